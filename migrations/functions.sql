-- The postgres store's functions, each defined once: `pacegate migrate` (and `serve`, unless
-- [store] migrate = false) applies this file after the numbered migrations, in the same
-- transaction under the same advisory lock, whenever its digest differs from the one the
-- database last applied (pacegate_schema_functions). The numbered files hold tables and data
-- only. Every function is the arithmetic of budget::schedule in SQL; budget::contract and
-- store::postgres::model hold the two to each other.
--
-- A function's signature is kept for the binary of the release before, which may still run
-- beside this one during a rolling upgrade: pacegate_record (pacegate_record_said without
-- the requests unanswered), pacegate_reserve_paced (pacegate_reserve_weighted with every
-- slot one unit), pacegate_reassert (pacegate_reassert_units with every send one unit),
-- pacegate_give_back (pacegate_give_back_part giving back whole slots only),
-- pacegate_reserve_for (one slot at a time),
-- pacegate_reserve_batch (pacegate_reserve_paced without p_spread: a vendor's budget is always
-- spread), pacegate_reserve_slots (without p_lost_hold either: a lost row starts at "now") and
-- pacegate_reserve_many (without p_lead either: every slot from the database's bare "now") are
-- such functions.

-- Functions of releases two or more back, which no running binary calls.
DROP FUNCTION IF EXISTS pacegate_reserve(text, double precision, integer, double precision);
DROP FUNCTION IF EXISTS pacegate_record(text, text, bigint, double precision, double precision,
    double precision, integer, double precision, integer, text, text);
DROP FUNCTION IF EXISTS pacegate_reserve_for(text, double precision, integer, double precision,
    text, double precision, double precision[], bigint[], double precision[], double precision,
    integer[], integer[], double precision[], double precision[], boolean);

-- A pause given as seconds from now or as an instant of the database clock: seconds from
-- now_ts, at most p_max; NULL when none, zero or past.
CREATE OR REPLACE FUNCTION pacegate_pause_secs(
    p_secs double precision,
    p_at timestamptz,
    now_ts timestamptz,
    p_max double precision
) RETURNS double precision LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN d > 0 THEN LEAST(d, p_max) END
    FROM (SELECT coalesce(p_secs, extract(epoch FROM p_at - now_ts)::double precision) AS d) AS x
$$;

-- Replaces an instance's waiting requests of a destination. Ages are seconds before p_now.
CREATE OR REPLACE FUNCTION pacegate_tell(
    p_destination text,
    p_instance text,
    p_now timestamptz,
    p_classes integer[],
    p_counts integer[],
    p_oldest double precision[],
    p_next double precision[]
) RETURNS void LANGUAGE sql AS $$
    DELETE FROM pacegate_waiting WHERE destination = p_destination AND instance = p_instance;
    INSERT INTO pacegate_waiting (destination, instance, class, count, since, next_since)
        SELECT p_destination, p_instance, u.c, u.n, p_now - make_interval(secs => u.o),
            p_now - make_interval(secs => u.x)
        FROM unnest(p_classes, p_counts, p_oldest, p_next) AS u(c, n, o, x)
        WHERE u.n > 0;
$$;

-- Applies what the vendor said (p_vendor_*, all NULL when nothing), then a verdict: p_kind is
-- 'clean', 'throttled', 'lockout' or 'none'. Returns the budget after them.
-- p_vendor_unanswered: the budget's requests sent and not yet answered when the vendor said
-- it, which its remaining may not count yet: they count as taken from it.
CREATE OR REPLACE FUNCTION pacegate_record_said(
    p_destination text,
    p_kind text,
    p_generation bigint,
    p_success boolean,
    p_retry_after_secs double precision,
    p_retry_after_at timestamptz,
    p_reset_secs double precision,
    p_reset_at timestamptz,
    p_spread double precision,
    p_backoff_factor double precision,
    p_backoff_max double precision,
    p_decay_after integer,
    p_retry_after_max double precision,
    p_reserve bigint,
    p_block_min_us bigint,
    p_block_max_us bigint,
    p_block_jitter double precision,
    p_lock_status integer,
    p_lock_request text,
    p_lock_instance text,
    p_vendor_family text,
    p_vendor_remaining bigint,
    p_vendor_limit bigint,
    p_vendor_reset_secs double precision,
    p_vendor_reset_at timestamptz,
    p_vendor_jitter_us bigint,
    p_vendor_unanswered bigint
) RETURNS TABLE (
    backoff double precision,
    generation bigint,
    clean_streak integer,
    paused_for double precision,
    lock_since timestamptz,
    lock_status integer,
    lock_request text,
    lock_instance text,
    paused_by text,
    block_streak integer,
    vendor_family text,
    vendor_remaining bigint,
    vendor_limit bigint,
    vendor_reset_in double precision
) LANGUAGE plpgsql AS $$
DECLARE
    b pacegate_budgets%ROWTYPE;
    now_ts timestamptz;
    left_secs double precision;
    new_reset timestamptz;
    keep boolean;
    current boolean;
    block_us bigint;
    until_ts timestamptz;
    cause text;
    unseen bigint := GREATEST(coalesce(p_vendor_unanswered, 0), 0);
BEGIN
    INSERT INTO pacegate_budgets (destination) VALUES (p_destination) ON CONFLICT DO NOTHING;
    SELECT * INTO b FROM pacegate_budgets AS x WHERE x.destination = p_destination FOR UPDATE;
    now_ts := clock_timestamp();
    -- Budget::observe: an older window never replaces a newer one; within one window (resets
    -- 2 s apart or less) the lower remaining, less the slots taken since, wins.
    IF p_vendor_remaining IS NOT NULL THEN
        left_secs := pacegate_pause_secs(p_vendor_reset_secs, p_vendor_reset_at, now_ts, p_retry_after_max);
        IF left_secs IS NOT NULL THEN
            new_reset := now_ts + make_interval(secs => left_secs);
            keep := false;
            IF b.vendor_reset IS NOT NULL AND b.vendor_reset > now_ts THEN
                IF new_reset + interval '2 seconds' < b.vendor_reset THEN
                    keep := true;
                ELSIF new_reset <= b.vendor_reset + interval '2 seconds' THEN
                    keep := GREATEST(p_vendor_remaining - unseen, 0)
                        > GREATEST(b.vendor_remaining - b.vendor_taken, 0);
                END IF;
            END IF;
            IF NOT keep THEN
                b.vendor_family := p_vendor_family;
                b.vendor_remaining := p_vendor_remaining;
                b.vendor_limit := p_vendor_limit;
                b.vendor_observed := now_ts;
                b.vendor_reset := new_reset;
                b.vendor_taken := unseen;
                IF p_vendor_remaining - unseen <= p_reserve THEN
                    until_ts := new_reset + make_interval(secs => p_vendor_jitter_us / 1000000.0);
                    IF until_ts > b.paused_until THEN
                        b.paused_until := until_ts;
                        b.paused_by := 'exhausted';
                    END IF;
                END IF;
            END IF;
        END IF;
    END IF;
    IF p_kind = 'clean' THEN
        IF p_success THEN
            b.block_streak := 0;
        END IF;
        -- Only a response reserved under the current generation counts towards decay.
        IF p_generation = b.generation THEN
            b.clean_streak := b.clean_streak + 1;
            IF b.clean_streak >= p_decay_after THEN
                b.clean_streak := 0;
                b.backoff := GREATEST(b.backoff / p_backoff_factor, 1);
            END IF;
        END IF;
    ELSIF p_kind = 'throttled' THEN
        b.clean_streak := 0;
        -- One widening, and one block, per generation.
        current := p_generation = b.generation;
        IF current THEN
            b.backoff := LEAST(b.backoff * p_backoff_factor, p_backoff_max);
            b.generation := b.generation + 1;
        END IF;
        until_ts := NULL;
        left_secs := pacegate_pause_secs(p_retry_after_secs, p_retry_after_at, now_ts, p_retry_after_max);
        IF left_secs IS NOT NULL THEN
            until_ts := now_ts + make_interval(secs => left_secs);
            cause := 'retry-after';
        ELSE
            left_secs := pacegate_pause_secs(p_reset_secs, p_reset_at, now_ts, p_retry_after_max);
            IF left_secs IS NOT NULL THEN
                until_ts := now_ts + make_interval(secs => left_secs);
                cause := 'exhausted';
            ELSIF p_block_min_us IS NOT NULL AND current THEN
                -- destination::Block::after: min × 2^streak, at most max, ± jitter.
                -- In numeric: doubled 40 times, an hour's block is past what a bigint holds.
                block_us := LEAST(p_block_min_us::numeric * (2::numeric ^ LEAST(b.block_streak, 40)),
                    p_block_max_us)::bigint;
                block_us := floor(block_us::double precision
                    * (1 + p_block_jitter * GREATEST(-1, LEAST(1, p_spread))))::bigint;
                b.block_streak := b.block_streak + 1;
                until_ts := now_ts + make_interval(secs => block_us / 1000000.0);
                cause := 'block';
            END IF;
        END IF;
        IF until_ts IS NOT NULL AND until_ts > b.paused_until THEN
            b.paused_until := until_ts;
            b.paused_by := cause;
        END IF;
    ELSIF p_kind = 'lockout' THEN
        IF b.lock_status IS NULL THEN
            b.lock_since := now_ts;
            b.lock_status := p_lock_status;
            b.lock_request := p_lock_request;
            b.lock_instance := p_lock_instance;
        END IF;
    ELSIF p_kind <> 'none' THEN
        RAISE EXCEPTION 'unknown verdict %', p_kind;
    END IF;
    UPDATE pacegate_budgets AS x SET
        backoff = b.backoff, generation = b.generation, clean_streak = b.clean_streak,
        paused_until = b.paused_until, paused_by = b.paused_by, block_streak = b.block_streak,
        lock_since = b.lock_since, lock_status = b.lock_status,
        lock_request = b.lock_request, lock_instance = b.lock_instance,
        vendor_family = b.vendor_family, vendor_remaining = b.vendor_remaining,
        vendor_limit = b.vendor_limit, vendor_observed = b.vendor_observed,
        vendor_reset = b.vendor_reset, vendor_taken = b.vendor_taken
        WHERE x.destination = p_destination;
    RETURN QUERY SELECT b.backoff, b.generation, b.clean_streak,
        CASE WHEN b.paused_until > now_ts
            THEN extract(epoch FROM b.paused_until - now_ts)::double precision ELSE 0 END,
        b.lock_since, b.lock_status, b.lock_request, b.lock_instance,
        CASE WHEN b.paused_until > now_ts THEN b.paused_by END,
        b.block_streak,
        CASE WHEN b.vendor_reset > now_ts THEN b.vendor_family END,
        CASE WHEN b.vendor_reset > now_ts THEN GREATEST(b.vendor_remaining - b.vendor_taken, 0) END,
        CASE WHEN b.vendor_reset > now_ts THEN b.vendor_limit END,
        CASE WHEN b.vendor_reset > now_ts
            THEN extract(epoch FROM b.vendor_reset - now_ts)::double precision END;
END
$$;

-- The release before does not say how many requests were unanswered: its views count none.
CREATE OR REPLACE FUNCTION pacegate_record(
    p_destination text,
    p_kind text,
    p_generation bigint,
    p_success boolean,
    p_retry_after_secs double precision,
    p_retry_after_at timestamptz,
    p_reset_secs double precision,
    p_reset_at timestamptz,
    p_spread double precision,
    p_backoff_factor double precision,
    p_backoff_max double precision,
    p_decay_after integer,
    p_retry_after_max double precision,
    p_reserve bigint,
    p_block_min_us bigint,
    p_block_max_us bigint,
    p_block_jitter double precision,
    p_lock_status integer,
    p_lock_request text,
    p_lock_instance text,
    p_vendor_family text,
    p_vendor_remaining bigint,
    p_vendor_limit bigint,
    p_vendor_reset_secs double precision,
    p_vendor_reset_at timestamptz,
    p_vendor_jitter_us bigint
) RETURNS TABLE (
    backoff double precision,
    generation bigint,
    clean_streak integer,
    paused_for double precision,
    lock_since timestamptz,
    lock_status integer,
    lock_request text,
    lock_instance text,
    paused_by text,
    block_streak integer,
    vendor_family text,
    vendor_remaining bigint,
    vendor_limit bigint,
    vendor_reset_in double precision
) LANGUAGE sql AS $$
    SELECT * FROM pacegate_record_said(p_destination, p_kind, p_generation, p_success,
        p_retry_after_secs, p_retry_after_at, p_reset_secs, p_reset_at, p_spread,
        p_backoff_factor, p_backoff_max, p_decay_after, p_retry_after_max, p_reserve,
        p_block_min_us, p_block_max_us, p_block_jitter, p_lock_status, p_lock_request,
        p_lock_instance, p_vendor_family, p_vendor_remaining, p_vendor_limit,
        p_vendor_reset_secs, p_vendor_reset_at, p_vendor_jitter_us, 0)
$$;

-- Batched grants: one reservation may grant the caller up to p_most slots for its requests of
-- the class that deserves the next slot, as budget::schedule::Budget::reserve_for does. The
-- first slot is 0006's; each later one is reserved exactly as a reservation of its own would
-- be (beat, pause, quota windows, the vendor's budget), while the caller has requests of the
-- class left, the class is still the one chosen (no other class owed a share), the slot is
-- within p_not_after and at most p_horizon seconds after the first. The budget row is written
-- once, the sends in one INSERT, so a batch costs the database one statement.
-- p_max_late is budget::Rule::quota_margin: the lateness a slot may still be sent with plus
-- its way to the upstream (the name stays: CREATE OR REPLACE cannot rename a parameter).
-- p_spread is budget::Rule::vendor_pace: the vendor's remaining requests spread until its reset
-- (true), or spent at the rate until the reserve (false).
-- p_cost is budget::Rule::cost: the units each slot stands for in the quota windows (a
-- meter's estimate; p_interval is already that many intervals). pacegate_budgets.sends is the
-- running total of units sent, and each pacegate_sends row's seq the total up to and
-- including its send (budget::schedule::Sent).
CREATE OR REPLACE FUNCTION pacegate_reserve_weighted(
    p_destination text,
    p_interval double precision,
    p_burst integer,
    p_not_after double precision,
    p_instance text,
    p_lease double precision,
    p_shares double precision[],
    p_quota_limits bigint[],
    p_quota_pers double precision[],
    p_max_late double precision,
    p_classes integer[],
    p_counts integer[],
    p_oldest double precision[],
    p_next double precision[],
    p_tell boolean,
    p_reserve bigint,
    p_most integer,
    p_horizon double precision,
    p_lead double precision,
    p_lost_hold double precision,
    p_spread boolean,
    p_cost bigint
) RETURNS TABLE (
    outcome text,
    slot timestamptz,
    db_now timestamptz,
    generation bigint,
    class integer,
    backoff double precision,
    lock_since timestamptz,
    lock_status integer,
    lock_request text,
    lock_instance text,
    more timestamptz[]
) LANGUAGE plpgsql AS $$
DECLARE
    b pacegate_budgets%ROWTYPE;
    parent pacegate_budgets%ROWTYPE;
    now_ts timestamptz;
    -- The earliest slot the caller can use: its answer reaches it p_lead after now_ts.
    earliest timestamptz;
    t interval;
    -- The slot by the beat, a pause and the vendor's view alone (see the beat's update below).
    s_beat timestamptz;
    -- The latest send, before which no slot goes, and the refund carried past it.
    s_order timestamptz;
    lag interval;
    idle interval;
    half interval;
    s timestamptz;
    n integer := coalesce(array_length(p_shares, 1), 0);
    nq integer := coalesce(array_length(p_quota_limits, 1), 0);
    waiting integer[];
    cr double precision[];
    new_credits double precision[];
    chosen integer;
    pick integer;
    first_instance text;
    i integer;
    keep bigint;
    at_ts timestamptz;
    usable bigint;
    k bigint;
    sends0 bigint;
    want bigint;
    mine integer;
    slots timestamptz[] := '{}';
    until_ts timestamptz;
    claim constant interval := interval '500 milliseconds';
BEGIN
    SELECT * INTO b FROM pacegate_budgets AS x WHERE x.destination = p_destination FOR UPDATE;
    IF NOT FOUND THEN
        -- Missing where the caller paced before (p_lost_hold > 0), the row was lost (a
        -- TRUNCATE, a restore): slots handed out from it, on any instance, may still be due,
        -- and nothing here says when. Its schedule starts p_lost_hold from now, past them
        -- (past the caller's own, and a while for the others').
        INSERT INTO pacegate_budgets (destination, next_at) VALUES (p_destination,
            CASE WHEN p_lost_hold > 0 THEN clock_timestamp()
                + make_interval(secs => p_lost_hold + p_interval * GREATEST(p_burst - 1, 0))
            ELSE '-infinity' END)
            ON CONFLICT DO NOTHING;
        SELECT * INTO b FROM pacegate_budgets AS x WHERE x.destination = p_destination FOR UPDATE;
    END IF;
    now_ts := clock_timestamp();
    earliest := now_ts + make_interval(secs => GREATEST(p_lead, 0));
    IF p_tell THEN
        PERFORM pacegate_tell(p_destination, p_instance, now_ts, p_classes, p_counts, p_oldest, p_next);
    END IF;
    IF b.lock_status IS NOT NULL THEN
        RETURN QUERY SELECT 'locked'::text, NULL::timestamptz, now_ts, b.generation, NULL::integer,
            b.backoff, b.lock_since, b.lock_status, b.lock_request, b.lock_instance, NULL::timestamptz[];
        RETURN;
    END IF;
    -- A key's budget (PARENT#KEY) is halted by its parent's lockout: a lockout is the IP's,
    -- kept on the parent alone, and halts every key however new.
    IF position('#' in p_destination) > 0 THEN
        SELECT * INTO parent FROM pacegate_budgets AS x
            WHERE x.destination = split_part(p_destination, '#', 1) AND x.lock_status IS NOT NULL;
        IF FOUND THEN
            RETURN QUERY SELECT 'locked'::text, NULL::timestamptz, now_ts, b.generation, NULL::integer,
                b.backoff, parent.lock_since, parent.lock_status, parent.lock_request,
                parent.lock_instance, NULL::timestamptz[];
            RETURN;
        END IF;
    END IF;
    -- The caller asks: its waiting requests claim their places again.
    UPDATE pacegate_waiting AS w SET claimed_until = now_ts + claim,
            live_until = now_ts + make_interval(secs => p_lease)
        WHERE w.destination = p_destination AND w.instance = p_instance;
    -- The classes with waiting requests on live instances that keep asking (the caller is
    -- live and asking).
    SELECT array_agg(DISTINCT w.class ORDER BY w.class) INTO waiting
        FROM pacegate_waiting AS w
        WHERE w.destination = p_destination
          AND (w.instance = p_instance OR (w.live_until > now_ts AND w.claimed_until > now_ts));
    cr := b.credits;
    chosen := NULL;
    -- Within a batch only the caller's list changes, and it keeps the chosen class: the
    -- classes waiting stay the same, and each slot's choice is budget::schedule::choose on
    -- the credits so far. The first slot's class must also be the caller's oldest request.
    t := make_interval(secs => p_interval * b.backoff);
    -- Half an interval, in whole microseconds as budget::schedule computes it.
    half := make_interval(secs => floor(extract(epoch FROM t) * 1000000 / 2) / 1000000.0);
    sends0 := b.sends;
    IF b.vendor_reset IS NOT NULL AND b.vendor_reset <= now_ts THEN
        b.vendor_reset := NULL;
        b.vendor_remaining := NULL;
        b.vendor_family := NULL;
        b.vendor_limit := NULL;
        b.vendor_observed := NULL;
        b.vendor_taken := 0;
    END IF;
    LOOP
        -- budget::schedule::choose: shares earn credit while their class waits; an owed class
        -- goes first, else the most urgent.
        new_credits := array_fill(0::double precision, ARRAY[n]);
        FOR i IN 1..n LOOP
            IF p_shares[i] > 0 AND (i - 1) = ANY (waiting) THEN
                new_credits[i] := coalesce(cr[i], 0) + p_shares[i];
            END IF;
        END LOOP;
        pick := NULL;
        FOR i IN 1..n LOOP
            IF new_credits[i] >= 1 - 1e-9 AND (i - 1) = ANY (waiting) THEN
                pick := i - 1;
                EXIT;
            END IF;
        END LOOP;
        IF pick IS NULL THEN
            pick := waiting[1];
        END IF;
        IF chosen IS NULL THEN
            IF pick IS NOT NULL THEN
                SELECT w.instance INTO first_instance
                    FROM pacegate_waiting AS w
                    WHERE w.destination = p_destination AND w.class = pick
                      AND (w.instance = p_instance OR (w.live_until > now_ts AND w.claimed_until > now_ts))
                    ORDER BY w.since, w.instance
                    LIMIT 1;
            END IF;
            -- A yield says when the next slot is free by the beat and a pause: the caller
            -- need not ask again before then (another instance may hold a batch until then).
            IF first_instance IS DISTINCT FROM p_instance THEN
                -- budget::schedule::Budget::free_at: a weighted slot's waiter asks again
                -- when the latest slot granted comes, else half-way to the free one.
                at_ts := b.next_at - t * (p_burst - 1);
                IF p_cost > 1 AND b.last_slot > now_ts THEN
                    at_ts := LEAST(at_ts, b.last_slot);
                ELSIF p_cost > 1 AND at_ts > now_ts THEN
                    at_ts := now_ts + (at_ts - now_ts) / 2;
                END IF;
                RETURN QUERY SELECT 'yield'::text, GREATEST(earliest, at_ts, b.paused_until),
                    now_ts, b.generation, NULL::integer,
                    b.backoff, NULL::timestamptz, NULL::integer, NULL::text, NULL::text, NULL::timestamptz[];
                RETURN;
            END IF;
            chosen := pick;
            SELECT w.count INTO mine FROM pacegate_waiting AS w
                WHERE w.destination = p_destination AND w.instance = p_instance AND w.class = chosen;
            mine := coalesce(mine, 1);
        ELSE
            EXIT WHEN cardinality(slots) >= LEAST(p_most, mine) OR pick IS DISTINCT FROM chosen;
        END IF;
        IF chosen + 1 <= n THEN
            new_credits[chosen + 1] := greatest(new_credits[chosen + 1] - 1, 0);
        END IF;
        -- budget::schedule::Budget::reserve: beat keeping, then quota windows
        -- (Budget::window_floor): the send holding unit sends + cost - limit must have left
        -- each window; slots of this batch are cost units each, after sends0.
        s := GREATEST(earliest, b.next_at - t * (p_burst - 1), b.paused_until);
        s_beat := s;
        FOR i IN 1..nq LOOP
            want := b.sends + LEAST(p_cost, p_quota_limits[i]) - p_quota_limits[i];
            IF want > 0 THEN
                IF want > sends0 THEN
                    at_ts := slots[(want - sends0 - 1) / p_cost + 1];
                ELSE
                    SELECT x.at INTO at_ts FROM pacegate_sends AS x
                        WHERE x.destination = p_destination AND x.seq >= want
                        ORDER BY x.seq LIMIT 1;
                    IF NOT FOUND THEN
                        at_ts := NULL;
                    END IF;
                END IF;
                IF at_ts IS NOT NULL THEN
                    s := GREATEST(s, at_ts + make_interval(secs => p_quota_pers[i] + p_max_late));
                END IF;
            END IF;
        END LOOP;
        s_order := NULL;
        IF nq > 0 THEN
            IF cardinality(slots) > 0 THEN
                s_order := slots[cardinality(slots)];
            ELSE
                SELECT x.at INTO s_order FROM pacegate_sends AS x
                    WHERE x.destination = p_destination AND x.seq = b.sends;
            END IF;
            -- Where the beat is within half an interval of the latest send (a refund took it
            -- back, or a window held that send), the slot keeps half an interval from it.
            IF s_order IS NOT NULL AND b.next_at < s_order + half THEN
                s := GREATEST(s, s_order + half);
            ELSE
                s := GREATEST(s, s_order);
            END IF;
        END IF;
        -- budget::schedule::Budget::reserve: the vendor's view, while its window lasts, holds
        -- every slot past its remaining requests less the reserve until the reset, and, with
        -- p_spread, spreads those evenly until the reset.
        IF b.vendor_reset IS NOT NULL THEN
            usable := GREATEST(b.vendor_remaining - p_reserve, 0);
            k := b.vendor_taken + 1;
            IF k > usable THEN
                s_beat := GREATEST(s_beat, b.vendor_reset);
            ELSIF p_spread THEN
                s_beat := GREATEST(s_beat, b.vendor_observed + make_interval(secs =>
                    ((extract(epoch FROM b.vendor_reset - b.vendor_observed) * 1000000)::bigint
                        * k / usable) / 1000000.0));
            END IF;
            s := GREATEST(s, s_beat);
        END IF;
        IF cardinality(slots) = 0 THEN
            IF p_not_after IS NOT NULL AND s > now_ts + make_interval(secs => p_not_after) THEN
                RETURN QUERY SELECT 'too_late'::text, s, now_ts, b.generation, NULL::integer,
                    b.backoff, NULL::timestamptz, NULL::integer, NULL::text, NULL::text, NULL::timestamptz[];
                RETURN;
            END IF;
            until_ts := s + make_interval(secs => p_horizon);
            IF p_not_after IS NOT NULL THEN
                until_ts := LEAST(until_ts, now_ts + make_interval(secs => p_not_after));
            END IF;
        ELSE
            EXIT WHEN s > until_ts;
        END IF;
        -- The slot is taken.
        cr := new_credits;
        slots := slots || s;
        -- budget::schedule::Budget::reserve: the beat goes on from where it stood; where it
        -- lags behind the latest send (a refund carried past it), the lag is spent by the
        -- slots after it and lost only as time passes unused beyond that send; a window's
        -- hold leaves it at most an interval behind the slot, or the lag it had.
        lag := interval '0';
        IF s_order IS NOT NULL AND isfinite(b.next_at) AND b.next_at < s_order THEN
            lag := s_order - b.next_at;
        END IF;
        idle := CASE WHEN s_order IS NULL OR s_beat <= s_order THEN interval '0'
            ELSE s_beat - s_order END;
        b.next_at := GREATEST(CASE WHEN lag > idle THEN b.next_at + idle
                ELSE GREATEST(b.next_at, s_beat) END + t, s - GREATEST(t, lag - idle));
        b.last_slot := GREATEST(b.last_slot, s);
        IF nq > 0 THEN
            b.sends := b.sends + p_cost;
        END IF;
        IF b.vendor_reset IS NOT NULL THEN
            b.vendor_taken := b.vendor_taken + 1;
        END IF;
    END LOOP;
    IF NOT EXISTS (SELECT 1 FROM unnest(cr) AS c WHERE c > 0) THEN
        cr := '{}';
    END IF;
    UPDATE pacegate_budgets AS x SET next_at = b.next_at, last_slot = b.last_slot, credits = cr,
        sends = b.sends,
        vendor_reset = b.vendor_reset, vendor_remaining = b.vendor_remaining,
        vendor_family = b.vendor_family, vendor_limit = b.vendor_limit,
        vendor_observed = b.vendor_observed,
        vendor_taken = CASE WHEN b.vendor_reset IS NULL THEN 0 ELSE b.vendor_taken END
        WHERE x.destination = p_destination;
    IF nq > 0 THEN
        SELECT max(q) INTO keep FROM unnest(p_quota_limits) AS q;
        INSERT INTO pacegate_sends (destination, seq, at)
            SELECT p_destination, sends0 + o.i * p_cost, o.at
            FROM unnest(slots) WITH ORDINALITY AS o(at, i)
            WHERE sends0 + o.i * p_cost > b.sends - keep;
        DELETE FROM pacegate_sends AS x
            WHERE x.destination = p_destination AND x.seq <= b.sends - keep;
    END IF;
    -- The requests served leave the list; the next oldest of the class is the oldest. The
    -- caller asks again once its last slot has come: its requests keep their places until then.
    UPDATE pacegate_waiting AS w
        SET count = w.count - cardinality(slots), since = coalesce(w.next_since, w.since), next_since = NULL
        WHERE w.destination = p_destination AND w.instance = p_instance AND w.class = chosen;
    UPDATE pacegate_waiting AS w SET claimed_until = GREATEST(slots[cardinality(slots)], now_ts) + claim,
            live_until = now_ts + make_interval(secs => p_lease)
        WHERE w.destination = p_destination AND w.instance = p_instance;
    DELETE FROM pacegate_waiting AS w
        WHERE w.destination = p_destination AND w.instance = p_instance AND w.count <= 0;
    RETURN QUERY SELECT 'granted'::text, slots[1], now_ts, b.generation, chosen, b.backoff,
        NULL::timestamptz, NULL::integer, NULL::text, NULL::text, slots[2:];
END
$$;

-- Units given back of a slot (budget::Store::give_back): p_units of a slot reserved for
-- p_reserved, all of them for a slot never used, or the part of its estimate a request did
-- not cost. p_secs (negative) of its schedule is refunded as a settlement's refund is (with
-- p_order, where the budget counts its sends, past now as far as the slot's own length
-- behind the latest slot, and past the latest slot: the sends keep the slots in order, and
-- the slots after it spend what is carried; budget::schedule::Budget::give_back), and,
-- where p_at names its send, that send weighs p_units fewer in the windows
-- (budget::schedule::Budget::unsend): the latest send at p_at of p_reserved units loses
-- them, or is removed where all are given back, and the ones after it count p_units fewer.
-- seq is the key, so the rows from it on move down through negative values, never onto a
-- row not yet moved.
CREATE OR REPLACE FUNCTION pacegate_give_back_part(
    p_destination text,
    p_secs double precision,
    p_at timestamptz,
    p_reserved bigint,
    p_units bigint,
    p_order boolean
) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    b pacegate_budgets%ROWTYPE;
    x bigint;
    units bigint := LEAST(p_units, p_reserved);
BEGIN
    SELECT * INTO b FROM pacegate_budgets AS y WHERE y.destination = p_destination FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    UPDATE pacegate_budgets AS y
        SET next_at = GREATEST(y.next_at + make_interval(secs => p_secs * y.backoff),
            LEAST(y.next_at, CASE WHEN p_order
                THEN LEAST(clock_timestamp(), y.last_slot + make_interval(secs =>
                    p_secs * y.backoff * p_reserved / GREATEST(p_units, 1)))
                ELSE GREATEST(clock_timestamp(), y.last_slot) END))
        WHERE y.destination = p_destination;
    IF p_at IS NULL OR units <= 0 THEN
        RETURN;
    END IF;
    -- Two sends may share an instant (a carried refund's slot goes at the latest send's):
    -- the latest at p_at of p_reserved units is the one.
    SELECT s.seq INTO x FROM pacegate_sends AS s
        WHERE s.destination = p_destination AND s.at = p_at
          AND s.seq - coalesce((SELECT max(q.seq) FROM pacegate_sends AS q
                  WHERE q.destination = p_destination AND q.seq < s.seq),
              s.seq - LEAST(p_reserved, s.seq)) = p_reserved
        ORDER BY s.seq DESC LIMIT 1;
    IF x IS NULL THEN
        RETURN;
    END IF;
    IF units = p_reserved THEN
        DELETE FROM pacegate_sends AS s WHERE s.destination = p_destination AND s.seq = x;
    END IF;
    UPDATE pacegate_sends AS s SET seq = -(s.seq - units)
        WHERE s.destination = p_destination AND s.seq >= x;
    UPDATE pacegate_sends AS s SET seq = -s.seq
        WHERE s.destination = p_destination AND s.seq < 0;
    UPDATE pacegate_budgets AS y SET sends = y.sends - units
        WHERE y.destination = p_destination;
END
$$;

-- The release before gives back whole slots only.
CREATE OR REPLACE FUNCTION pacegate_give_back(
    p_destination text,
    p_secs double precision,
    p_at timestamptz,
    p_units bigint
) RETURNS void LANGUAGE sql AS $$
    SELECT pacegate_give_back_part(p_destination, p_secs, p_at, p_units, p_units, false)
$$;

-- The release before weighs every slot one unit in the quota windows.
CREATE OR REPLACE FUNCTION pacegate_reserve_paced(
    p_destination text,
    p_interval double precision,
    p_burst integer,
    p_not_after double precision,
    p_instance text,
    p_lease double precision,
    p_shares double precision[],
    p_quota_limits bigint[],
    p_quota_pers double precision[],
    p_max_late double precision,
    p_classes integer[],
    p_counts integer[],
    p_oldest double precision[],
    p_next double precision[],
    p_tell boolean,
    p_reserve bigint,
    p_most integer,
    p_horizon double precision,
    p_lead double precision,
    p_lost_hold double precision,
    p_spread boolean
) RETURNS TABLE (
    outcome text,
    slot timestamptz,
    db_now timestamptz,
    generation bigint,
    class integer,
    backoff double precision,
    lock_since timestamptz,
    lock_status integer,
    lock_request text,
    lock_instance text,
    more timestamptz[]
) LANGUAGE sql AS $$
    SELECT * FROM pacegate_reserve_weighted(p_destination, p_interval, p_burst, p_not_after,
        p_instance, p_lease, p_shares, p_quota_limits, p_quota_pers, p_max_late, p_classes,
        p_counts, p_oldest, p_next, p_tell, p_reserve, p_most, p_horizon, p_lead, p_lost_hold,
        p_spread, 1)
$$;

-- The release before spreads a vendor's remaining requests until its reset, always.
CREATE OR REPLACE FUNCTION pacegate_reserve_batch(
    p_destination text,
    p_interval double precision,
    p_burst integer,
    p_not_after double precision,
    p_instance text,
    p_lease double precision,
    p_shares double precision[],
    p_quota_limits bigint[],
    p_quota_pers double precision[],
    p_max_late double precision,
    p_classes integer[],
    p_counts integer[],
    p_oldest double precision[],
    p_next double precision[],
    p_tell boolean,
    p_reserve bigint,
    p_most integer,
    p_horizon double precision,
    p_lead double precision,
    p_lost_hold double precision
) RETURNS TABLE (
    outcome text,
    slot timestamptz,
    db_now timestamptz,
    generation bigint,
    class integer,
    backoff double precision,
    lock_since timestamptz,
    lock_status integer,
    lock_request text,
    lock_instance text,
    more timestamptz[]
) LANGUAGE sql AS $$
    SELECT * FROM pacegate_reserve_paced(p_destination, p_interval, p_burst, p_not_after,
        p_instance, p_lease, p_shares, p_quota_limits, p_quota_pers, p_max_late, p_classes,
        p_counts, p_oldest, p_next, p_tell, p_reserve, p_most, p_horizon, p_lead, p_lost_hold,
        true)
$$;

-- The release before does not tell a lost row from a new one: it starts at "now".
CREATE OR REPLACE FUNCTION pacegate_reserve_slots(
    p_destination text,
    p_interval double precision,
    p_burst integer,
    p_not_after double precision,
    p_instance text,
    p_lease double precision,
    p_shares double precision[],
    p_quota_limits bigint[],
    p_quota_pers double precision[],
    p_max_late double precision,
    p_classes integer[],
    p_counts integer[],
    p_oldest double precision[],
    p_next double precision[],
    p_tell boolean,
    p_reserve bigint,
    p_most integer,
    p_horizon double precision,
    p_lead double precision
) RETURNS TABLE (
    outcome text,
    slot timestamptz,
    db_now timestamptz,
    generation bigint,
    class integer,
    backoff double precision,
    lock_since timestamptz,
    lock_status integer,
    lock_request text,
    lock_instance text,
    more timestamptz[]
) LANGUAGE sql AS $$
    SELECT * FROM pacegate_reserve_batch(p_destination, p_interval, p_burst, p_not_after,
        p_instance, p_lease, p_shares, p_quota_limits, p_quota_pers, p_max_late, p_classes,
        p_counts, p_oldest, p_next, p_tell, p_reserve, p_most, p_horizon, p_lead, 0)
$$;

-- The release before asks without a lead: its slots start from the database's bare "now".
CREATE OR REPLACE FUNCTION pacegate_reserve_many(
    p_destination text,
    p_interval double precision,
    p_burst integer,
    p_not_after double precision,
    p_instance text,
    p_lease double precision,
    p_shares double precision[],
    p_quota_limits bigint[],
    p_quota_pers double precision[],
    p_max_late double precision,
    p_classes integer[],
    p_counts integer[],
    p_oldest double precision[],
    p_next double precision[],
    p_tell boolean,
    p_reserve bigint,
    p_most integer,
    p_horizon double precision
) RETURNS TABLE (
    outcome text,
    slot timestamptz,
    db_now timestamptz,
    generation bigint,
    class integer,
    backoff double precision,
    lock_since timestamptz,
    lock_status integer,
    lock_request text,
    lock_instance text,
    more timestamptz[]
) LANGUAGE sql AS $$
    SELECT * FROM pacegate_reserve_batch(p_destination, p_interval, p_burst, p_not_after,
        p_instance, p_lease, p_shares, p_quota_limits, p_quota_pers, p_max_late, p_classes,
        p_counts, p_oldest, p_next, p_tell, p_reserve, p_most, p_horizon, 0, 0)
$$;

-- A binary that knows only the one-slot function keeps working beside one that batches: its
-- reservations are batches of one.
CREATE OR REPLACE FUNCTION pacegate_reserve_for(
    p_destination text,
    p_interval double precision,
    p_burst integer,
    p_not_after double precision,
    p_instance text,
    p_lease double precision,
    p_shares double precision[],
    p_quota_limits bigint[],
    p_quota_pers double precision[],
    p_max_late double precision,
    p_classes integer[],
    p_counts integer[],
    p_oldest double precision[],
    p_next double precision[],
    p_tell boolean,
    p_reserve bigint
) RETURNS TABLE (
    outcome text,
    slot timestamptz,
    db_now timestamptz,
    generation bigint,
    class integer,
    backoff double precision,
    lock_since timestamptz,
    lock_status integer,
    lock_request text,
    lock_instance text
) LANGUAGE sql AS $$
    SELECT r.outcome, r.slot, r.db_now, r.generation, r.class, r.backoff, r.lock_since,
        r.lock_status, r.lock_request, r.lock_instance
    FROM pacegate_reserve_batch(p_destination, p_interval, p_burst, p_not_after, p_instance,
        p_lease, p_shares, p_quota_limits, p_quota_pers, p_max_late, p_classes, p_counts,
        p_oldest, p_next, p_tell, p_reserve, 1, 0, 0, 0) AS r
$$;

-- What instances knew of budgets, put back into a server that may have lost it: a standby
-- promoted after the primary's last commits did not reach it (store::postgres::reassert).
-- One element per budget in each p_* array; times are seconds from now (an instance's own
-- clock, read as late as can be). The merge only ever tightens: a lockout or a pause never
-- disappears, the next slot never moves back, the backoff and the block streak never fall,
-- the vendor's budget never grows, and a quota window holds every send an instance knew of
-- after the latest one it still holds. p_send_in lists those sends, each budget's in time
-- order, p_sends[i] of them for budget i, and p_send_units the units each weighed (NULL:
-- one). Returns how many budgets it tightened.
CREATE OR REPLACE FUNCTION pacegate_reassert_units(
    p_budgets text[],
    p_next_in double precision[],
    p_paused_in double precision[],
    p_paused_by text[],
    p_backoff double precision[],
    p_generation bigint[],
    p_clean_streak integer[],
    p_block_streak integer[],
    p_lock_since timestamptz[],
    p_lock_status integer[],
    p_lock_request text[],
    p_lock_instance text[],
    p_vendor_family text[],
    p_vendor_remaining bigint[],
    p_vendor_limit bigint[],
    p_vendor_reset_in double precision[],
    p_sends integer[],
    p_send_in double precision[],
    p_send_units bigint[]
) RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    b pacegate_budgets%ROWTYPE;
    was pacegate_budgets%ROWTYPE;
    now_ts timestamptz := clock_timestamp();
    at_ts timestamptz;
    latest timestamptz;
    tightened integer := 0;
    i integer;
    s integer;
    first integer := 1;
BEGIN
    FOR i IN 1..coalesce(cardinality(p_budgets), 0) LOOP
        INSERT INTO pacegate_budgets (destination) VALUES (p_budgets[i]) ON CONFLICT DO NOTHING;
        SELECT * INTO b FROM pacegate_budgets AS x WHERE x.destination = p_budgets[i] FOR UPDATE;
        was := b;
        IF p_next_in[i] IS NOT NULL THEN
            b.next_at := GREATEST(b.next_at, now_ts + make_interval(secs => p_next_in[i]));
        END IF;
        IF p_paused_in[i] IS NOT NULL THEN
            at_ts := now_ts + make_interval(secs => p_paused_in[i]);
            IF at_ts > b.paused_until THEN
                b.paused_until := at_ts;
                b.paused_by := p_paused_by[i];
            END IF;
        END IF;
        IF p_backoff[i] IS NOT NULL AND p_backoff[i] > b.backoff THEN
            b.backoff := p_backoff[i];
            b.clean_streak := coalesce(p_clean_streak[i], 0);
        END IF;
        b.generation := GREATEST(b.generation, coalesce(p_generation[i], 0));
        b.block_streak := GREATEST(b.block_streak, coalesce(p_block_streak[i], 0));
        IF b.lock_status IS NULL AND p_lock_status[i] IS NOT NULL THEN
            b.lock_since := p_lock_since[i];
            b.lock_status := p_lock_status[i];
            b.lock_request := p_lock_request[i];
            b.lock_instance := p_lock_instance[i];
        END IF;
        IF p_vendor_reset_in[i] > 0 AND p_vendor_remaining[i] IS NOT NULL
            AND (b.vendor_reset IS NULL OR b.vendor_reset <= now_ts
                 OR GREATEST(b.vendor_remaining - b.vendor_taken, 0) > p_vendor_remaining[i]) THEN
            b.vendor_family := p_vendor_family[i];
            b.vendor_remaining := p_vendor_remaining[i];
            b.vendor_limit := p_vendor_limit[i];
            b.vendor_observed := now_ts;
            b.vendor_reset := GREATEST(coalesce(b.vendor_reset, '-infinity'),
                now_ts + make_interval(secs => p_vendor_reset_in[i]));
            b.vendor_taken := 0;
        END IF;
        SELECT max(x.at) INTO latest FROM pacegate_sends AS x WHERE x.destination = p_budgets[i];
        FOR s IN first..first + coalesce(p_sends[i], 0) - 1 LOOP
            at_ts := now_ts + make_interval(secs => p_send_in[s]);
            CONTINUE WHEN latest IS NOT NULL AND at_ts <= latest;
            b.sends := b.sends + coalesce(p_send_units[s], 1);
            INSERT INTO pacegate_sends (destination, seq, at) VALUES (p_budgets[i], b.sends, at_ts)
                ON CONFLICT (destination, seq) DO UPDATE SET at = EXCLUDED.at;
            latest := at_ts;
        END LOOP;
        first := first + coalesce(p_sends[i], 0);
        IF b IS DISTINCT FROM was THEN
            tightened := tightened + 1;
            UPDATE pacegate_budgets AS x SET next_at = b.next_at,
                paused_until = b.paused_until, paused_by = b.paused_by,
                backoff = b.backoff, generation = b.generation, clean_streak = b.clean_streak,
                block_streak = b.block_streak,
                lock_since = b.lock_since, lock_status = b.lock_status,
                lock_request = b.lock_request, lock_instance = b.lock_instance,
                vendor_family = b.vendor_family, vendor_remaining = b.vendor_remaining,
                vendor_limit = b.vendor_limit, vendor_observed = b.vendor_observed,
                vendor_reset = b.vendor_reset, vendor_taken = b.vendor_taken,
                sends = b.sends
                WHERE x.destination = p_budgets[i];
        END IF;
    END LOOP;
    RETURN tightened;
END
$$;

-- The release before weighs every send it puts back one unit.
CREATE OR REPLACE FUNCTION pacegate_reassert(
    p_budgets text[],
    p_next_in double precision[],
    p_paused_in double precision[],
    p_paused_by text[],
    p_backoff double precision[],
    p_generation bigint[],
    p_clean_streak integer[],
    p_block_streak integer[],
    p_lock_since timestamptz[],
    p_lock_status integer[],
    p_lock_request text[],
    p_lock_instance text[],
    p_vendor_family text[],
    p_vendor_remaining bigint[],
    p_vendor_limit bigint[],
    p_vendor_reset_in double precision[],
    p_sends integer[],
    p_send_in double precision[]
) RETURNS integer LANGUAGE sql AS $$
    SELECT pacegate_reassert_units(p_budgets, p_next_in, p_paused_in, p_paused_by, p_backoff,
        p_generation, p_clean_streak, p_block_streak, p_lock_since, p_lock_status,
        p_lock_request, p_lock_instance, p_vendor_family, p_vendor_remaining, p_vendor_limit,
        p_vendor_reset_in, p_sends, p_send_in, NULL)
$$;
