-- Priority classes, shares and quota windows, held across every instance.

-- Each class's credit towards its share, by rank (index 1 is rank 0); '{}' when all are zero.
-- `sends` numbers the slots of a destination with quota windows.
ALTER TABLE pacegate_budgets
    ADD COLUMN credits double precision[] NOT NULL DEFAULT '{}',
    ADD COLUMN sends bigint NOT NULL DEFAULT 0;

-- Each instance's waiting requests per destination and class: how many, and since when the
-- oldest and second oldest wait (database clock). An instance rewrites its rows with each
-- reservation and whenever its queue changes; its rows count only while its heartbeat in
-- pacegate_instances is recent (the lease), so a dead instance's waiters stop counting.
CREATE TABLE pacegate_waiting (
    destination text NOT NULL,
    instance    text NOT NULL,
    class       integer NOT NULL,
    count       integer NOT NULL,
    since       timestamptz NOT NULL,
    next_since  timestamptz,
    PRIMARY KEY (destination, instance, class)
);

-- The latest slots of destinations with quota windows, as many as the largest limit.
CREATE TABLE pacegate_sends (
    destination text NOT NULL,
    seq         bigint NOT NULL,
    at          timestamptz NOT NULL,
    PRIMARY KEY (destination, seq)
);

-- Replaces an instance's waiting requests of a destination. Ages are seconds before p_now.
CREATE FUNCTION pacegate_tell(
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

-- Records the caller's waiting requests (unless p_tell is false: unchanged since it last
-- said; the function itself takes a granted request off the list), then reserves the next slot for the request that
-- deserves it over every live instance: budget::schedule::Budget::reserve_for, atomically.
-- `outcome` is 'granted' (with `slot` and `class`), 'yield' (another instance's request goes
-- first; nothing taken), 'too_late' (with `slot`) or 'locked'.
CREATE FUNCTION pacegate_reserve_for(
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
    p_tell boolean
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
) LANGUAGE plpgsql AS $$
DECLARE
    b pacegate_budgets%ROWTYPE;
    now_ts timestamptz;
    t interval;
    s timestamptz;
    n integer := coalesce(array_length(p_shares, 1), 0);
    nq integer := coalesce(array_length(p_quota_limits, 1), 0);
    waiting integer[];
    new_credits double precision[];
    chosen integer;
    first_instance text;
    i integer;
    keep bigint;
    at_ts timestamptz;
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
            b.backoff, b.lock_since, b.lock_status, b.lock_request, b.lock_instance;
        RETURN;
    END IF;
    -- The classes with waiting requests on live instances (the caller is live).
    SELECT array_agg(DISTINCT w.class ORDER BY w.class) INTO waiting
        FROM pacegate_waiting AS w LEFT JOIN pacegate_instances AS l ON l.id = w.instance
        WHERE w.destination = p_destination
          AND (w.instance = p_instance OR l.last_seen > now_ts - make_interval(secs => p_lease));
    -- budget::schedule::choose: shares earn credit while their class waits; an owed class
    -- goes first, else the most urgent.
    new_credits := array_fill(0::double precision, ARRAY[n]);
    FOR i IN 1..n LOOP
        IF p_shares[i] > 0 AND (i - 1) = ANY (waiting) THEN
            new_credits[i] := coalesce(b.credits[i], 0) + p_shares[i];
        END IF;
    END LOOP;
    chosen := NULL;
    FOR i IN 1..n LOOP
        IF new_credits[i] >= 1 - 1e-9 AND (i - 1) = ANY (waiting) THEN
            chosen := i - 1;
            EXIT;
        END IF;
    END LOOP;
    IF chosen IS NULL THEN
        chosen := waiting[1];
    END IF;
    IF chosen IS NOT NULL THEN
        SELECT w.instance INTO first_instance
            FROM pacegate_waiting AS w LEFT JOIN pacegate_instances AS l ON l.id = w.instance
            WHERE w.destination = p_destination AND w.class = chosen
              AND (w.instance = p_instance OR l.last_seen > now_ts - make_interval(secs => p_lease))
            ORDER BY w.since, w.instance
            LIMIT 1;
    END IF;
    IF first_instance IS DISTINCT FROM p_instance THEN
        RETURN QUERY SELECT 'yield'::text, NULL::timestamptz, now_ts, b.generation, NULL::integer,
            b.backoff, NULL::timestamptz, NULL::integer, NULL::text, NULL::text;
        RETURN;
    END IF;
    IF chosen + 1 <= n THEN
        new_credits[chosen + 1] := greatest(new_credits[chosen + 1] - 1, 0);
    END IF;
    -- budget::schedule::Budget::reserve: beat keeping, then quota windows.
    t := make_interval(secs => p_interval * b.backoff);
    s := GREATEST(now_ts, b.next_at - t * (p_burst - 1), b.paused_until);
    FOR i IN 1..nq LOOP
        IF b.sends >= p_quota_limits[i] THEN
            SELECT x.at INTO at_ts FROM pacegate_sends AS x
                WHERE x.destination = p_destination AND x.seq = b.sends - p_quota_limits[i] + 1;
            IF FOUND THEN
                s := GREATEST(s, at_ts + make_interval(secs => p_quota_pers[i] + p_max_late));
            END IF;
        END IF;
    END LOOP;
    IF nq > 0 THEN
        SELECT x.at INTO at_ts FROM pacegate_sends AS x
            WHERE x.destination = p_destination AND x.seq = b.sends;
        IF FOUND THEN
            s := GREATEST(s, at_ts);
        END IF;
    END IF;
    IF p_not_after IS NOT NULL AND s > now_ts + make_interval(secs => p_not_after) THEN
        RETURN QUERY SELECT 'too_late'::text, s, now_ts, b.generation, NULL::integer,
            b.backoff, NULL::timestamptz, NULL::integer, NULL::text, NULL::text;
        RETURN;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM unnest(new_credits) AS c WHERE c > 0) THEN
        new_credits := '{}';
    END IF;
    UPDATE pacegate_budgets AS x SET next_at = GREATEST(b.next_at, s) + t, credits = new_credits,
        sends = b.sends + CASE WHEN nq > 0 THEN 1 ELSE 0 END
        WHERE x.destination = p_destination;
    IF nq > 0 THEN
        SELECT max(q) INTO keep FROM unnest(p_quota_limits) AS q;
        INSERT INTO pacegate_sends (destination, seq, at) VALUES (p_destination, b.sends + 1, s);
        DELETE FROM pacegate_sends AS x
            WHERE x.destination = p_destination AND x.seq <= b.sends + 1 - keep;
    END IF;
    -- The request served leaves the list; the next oldest of its class is the oldest.
    UPDATE pacegate_waiting AS w
        SET count = w.count - 1, since = coalesce(w.next_since, w.since), next_since = NULL
        WHERE w.destination = p_destination AND w.instance = p_instance AND w.class = chosen;
    DELETE FROM pacegate_waiting AS w
        WHERE w.destination = p_destination AND w.instance = p_instance AND w.count <= 0;
    RETURN QUERY SELECT 'granted'::text, s, now_ts, b.generation, chosen, b.backoff,
        NULL::timestamptz, NULL::integer, NULL::text, NULL::text;
END
$$;
