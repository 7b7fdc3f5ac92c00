-- Batched grants: one reservation may grant the caller up to p_most slots for its requests of
-- the class that deserves the next slot, as budget::schedule::Budget::reserve_for does. The
-- first slot is 0006's; each later one is reserved exactly as a reservation of its own would
-- be (beat, pause, quota windows, the vendor's budget), while the caller has requests of the
-- class left, the class is still the one chosen (no other class owed a share), the slot is
-- within p_not_after and at most p_horizon seconds after the first. The budget row is written
-- once, the sends in one INSERT, so a batch costs the database one statement.
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
) LANGUAGE plpgsql AS $$
DECLARE
    b pacegate_budgets%ROWTYPE;
    now_ts timestamptz;
    t interval;
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
        INSERT INTO pacegate_budgets (destination) VALUES (p_destination) ON CONFLICT DO NOTHING;
        SELECT * INTO b FROM pacegate_budgets AS x WHERE x.destination = p_destination FOR UPDATE;
    END IF;
    now_ts := clock_timestamp();
    IF p_tell THEN
        PERFORM pacegate_tell(p_destination, p_instance, now_ts, p_classes, p_counts, p_oldest, p_next);
    END IF;
    IF b.lock_status IS NOT NULL THEN
        RETURN QUERY SELECT 'locked'::text, NULL::timestamptz, now_ts, b.generation, NULL::integer,
            b.backoff, b.lock_since, b.lock_status, b.lock_request, b.lock_instance, NULL::timestamptz[];
        RETURN;
    END IF;
    -- The caller asks: its waiting requests claim their places again.
    UPDATE pacegate_waiting AS w SET claimed_until = now_ts + claim
        WHERE w.destination = p_destination AND w.instance = p_instance;
    -- The classes with waiting requests on live instances that keep asking (the caller is
    -- live and asking).
    SELECT array_agg(DISTINCT w.class ORDER BY w.class) INTO waiting
        FROM pacegate_waiting AS w LEFT JOIN pacegate_instances AS l ON l.id = w.instance
        WHERE w.destination = p_destination
          AND (w.instance = p_instance OR (l.last_seen > now_ts - make_interval(secs => p_lease)
               AND w.claimed_until > now_ts));
    cr := b.credits;
    chosen := NULL;
    -- Within a batch only the caller's list changes, and it keeps the chosen class: the
    -- classes waiting stay the same, and each slot's choice is budget::schedule::choose on
    -- the credits so far. The first slot's class must also be the caller's oldest request.
    t := make_interval(secs => p_interval * b.backoff);
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
                    FROM pacegate_waiting AS w LEFT JOIN pacegate_instances AS l ON l.id = w.instance
                    WHERE w.destination = p_destination AND w.class = pick
                      AND (w.instance = p_instance OR (l.last_seen > now_ts - make_interval(secs => p_lease)
                           AND w.claimed_until > now_ts))
                    ORDER BY w.since, w.instance
                    LIMIT 1;
            END IF;
            -- A yield says when the next slot is free by the beat and a pause: the caller
            -- need not ask again before then (another instance may hold a batch until then).
            IF first_instance IS DISTINCT FROM p_instance THEN
                RETURN QUERY SELECT 'yield'::text,
                    GREATEST(now_ts, b.next_at - t * (p_burst - 1), b.paused_until), now_ts, b.generation, NULL::integer,
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
        -- budget::schedule::Budget::reserve: beat keeping, then quota windows.
        s := GREATEST(now_ts, b.next_at - t * (p_burst - 1), b.paused_until);
        FOR i IN 1..nq LOOP
            IF b.sends >= p_quota_limits[i] THEN
                want := b.sends - p_quota_limits[i] + 1;
                IF want > sends0 THEN
                    at_ts := slots[want - sends0];
                ELSE
                    SELECT x.at INTO at_ts FROM pacegate_sends AS x
                        WHERE x.destination = p_destination AND x.seq = want;
                    IF NOT FOUND THEN
                        at_ts := NULL;
                    END IF;
                END IF;
                IF at_ts IS NOT NULL THEN
                    s := GREATEST(s, at_ts + make_interval(secs => p_quota_pers[i] + p_max_late));
                END IF;
            END IF;
        END LOOP;
        IF nq > 0 THEN
            IF b.sends > sends0 THEN
                s := GREATEST(s, slots[b.sends - sends0]);
            ELSE
                SELECT x.at INTO at_ts FROM pacegate_sends AS x
                    WHERE x.destination = p_destination AND x.seq = b.sends;
                IF FOUND THEN
                    s := GREATEST(s, at_ts);
                END IF;
            END IF;
        END IF;
        -- budget::schedule::Budget::reserve: the vendor's view, while its window lasts, spreads
        -- its remaining requests less the reserve evenly until the reset.
        IF b.vendor_reset IS NOT NULL THEN
            usable := GREATEST(b.vendor_remaining - p_reserve, 0);
            k := b.vendor_taken + 1;
            IF k > usable THEN
                s := GREATEST(s, b.vendor_reset);
            ELSE
                s := GREATEST(s, b.vendor_observed + make_interval(secs =>
                    ((extract(epoch FROM b.vendor_reset - b.vendor_observed) * 1000000)::bigint
                        * k / usable) / 1000000.0));
            END IF;
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
        b.next_at := GREATEST(b.next_at, s) + t;
        IF nq > 0 THEN
            b.sends := b.sends + 1;
        END IF;
        IF b.vendor_reset IS NOT NULL THEN
            b.vendor_taken := b.vendor_taken + 1;
        END IF;
    END LOOP;
    IF NOT EXISTS (SELECT 1 FROM unnest(cr) AS c WHERE c > 0) THEN
        cr := '{}';
    END IF;
    UPDATE pacegate_budgets AS x SET next_at = b.next_at, credits = cr,
        sends = b.sends,
        vendor_reset = b.vendor_reset, vendor_remaining = b.vendor_remaining,
        vendor_family = b.vendor_family, vendor_limit = b.vendor_limit,
        vendor_observed = b.vendor_observed,
        vendor_taken = CASE WHEN b.vendor_reset IS NULL THEN 0 ELSE b.vendor_taken END
        WHERE x.destination = p_destination;
    IF nq > 0 THEN
        SELECT max(q) INTO keep FROM unnest(p_quota_limits) AS q;
        INSERT INTO pacegate_sends (destination, seq, at)
            SELECT p_destination, sends0 + o.i, o.at FROM unnest(slots) WITH ORDINALITY AS o(at, i)
            WHERE sends0 + o.i > b.sends - keep;
        DELETE FROM pacegate_sends AS x
            WHERE x.destination = p_destination AND x.seq <= b.sends - keep;
    END IF;
    -- The requests served leave the list; the next oldest of the class is the oldest. The
    -- caller asks again once its last slot has come: its requests keep their places until then.
    UPDATE pacegate_waiting AS w
        SET count = w.count - cardinality(slots), since = coalesce(w.next_since, w.since), next_since = NULL
        WHERE w.destination = p_destination AND w.instance = p_instance AND w.class = chosen;
    UPDATE pacegate_waiting AS w SET claimed_until = GREATEST(slots[cardinality(slots)], now_ts) + claim
        WHERE w.destination = p_destination AND w.instance = p_instance;
    DELETE FROM pacegate_waiting AS w
        WHERE w.destination = p_destination AND w.instance = p_instance AND w.count <= 0;
    RETURN QUERY SELECT 'granted'::text, slots[1], now_ts, b.generation, chosen, b.backoff,
        NULL::timestamptz, NULL::integer, NULL::text, NULL::text, slots[2:];
END
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
    FROM pacegate_reserve_many(p_destination, p_interval, p_burst, p_not_after, p_instance,
        p_lease, p_shares, p_quota_limits, p_quota_pers, p_max_late, p_classes, p_counts,
        p_oldest, p_next, p_tell, p_reserve, 1, 0) AS r
$$;
