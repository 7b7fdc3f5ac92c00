-- One row per destination: the whole budget, shared by every pacegate instance.
-- Times are the database clock; no instance stores a reading of its own clock here.
CREATE TABLE pacegate_budgets (
    destination   text PRIMARY KEY,
    -- The earliest instant the next request may go (beat keeping).
    next_at       timestamptz NOT NULL DEFAULT '-infinity',
    -- Nothing is sent before this (Retry-After).
    paused_until  timestamptz NOT NULL DEFAULT '-infinity',
    backoff       double precision NOT NULL DEFAULT 1 CHECK (backoff >= 1),
    generation    bigint NOT NULL DEFAULT 0,
    clean_streak  integer NOT NULL DEFAULT 0,
    -- A lockout: set by a lockout verdict, cleared only by an operator.
    lock_since    timestamptz,
    lock_status   integer,
    lock_request  text,
    lock_instance text
);

-- Reserves the next slot of a destination: the arithmetic of budget::schedule, atomically.
-- The clock is read after the row lock is taken, so a reservation that waited for the lock
-- is computed from the time it actually ran. A missing row is created at once.
-- p_not_after: seconds from now past which no slot is taken (NULL: no limit).
CREATE FUNCTION pacegate_reserve(
    p_destination text,
    p_interval double precision,
    p_burst integer,
    p_not_after double precision
) RETURNS TABLE (
    granted boolean,
    slot timestamptz,
    db_now timestamptz,
    generation bigint,
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
BEGIN
    SELECT * INTO b FROM pacegate_budgets AS x WHERE x.destination = p_destination FOR UPDATE;
    IF NOT FOUND THEN
        INSERT INTO pacegate_budgets (destination) VALUES (p_destination) ON CONFLICT DO NOTHING;
        SELECT * INTO b FROM pacegate_budgets AS x WHERE x.destination = p_destination FOR UPDATE;
    END IF;
    now_ts := clock_timestamp();
    IF b.lock_status IS NOT NULL THEN
        RETURN QUERY SELECT false, NULL::timestamptz, now_ts, b.generation,
            b.lock_since, b.lock_status, b.lock_request, b.lock_instance;
        RETURN;
    END IF;
    t := make_interval(secs => p_interval * b.backoff);
    s := GREATEST(now_ts, b.next_at - t * (p_burst - 1), b.paused_until);
    IF p_not_after IS NOT NULL AND s > now_ts + make_interval(secs => p_not_after) THEN
        RETURN QUERY SELECT false, s, now_ts, b.generation,
            NULL::timestamptz, NULL::integer, NULL::text, NULL::text;
        RETURN;
    END IF;
    UPDATE pacegate_budgets AS x SET next_at = GREATEST(b.next_at, s) + t
        WHERE x.destination = p_destination;
    RETURN QUERY SELECT true, s, now_ts, b.generation,
        NULL::timestamptz, NULL::integer, NULL::text, NULL::text;
END
$$;

-- Applies a verdict: p_kind is 'clean', 'throttled' or 'lockout'. Mirrors
-- budget::schedule::Budget::apply; returns the budget after it.
CREATE FUNCTION pacegate_record(
    p_destination text,
    p_kind text,
    p_generation bigint,
    p_retry_after double precision,
    p_backoff_factor double precision,
    p_backoff_max double precision,
    p_decay_after integer,
    p_retry_after_max double precision,
    p_lock_status integer,
    p_lock_request text,
    p_lock_instance text
) RETURNS TABLE (
    backoff double precision,
    generation bigint,
    clean_streak integer,
    paused_for double precision,
    lock_since timestamptz,
    lock_status integer,
    lock_request text,
    lock_instance text
) LANGUAGE plpgsql AS $$
DECLARE
    b pacegate_budgets%ROWTYPE;
    now_ts timestamptz;
BEGIN
    INSERT INTO pacegate_budgets (destination) VALUES (p_destination) ON CONFLICT DO NOTHING;
    SELECT * INTO b FROM pacegate_budgets AS x WHERE x.destination = p_destination FOR UPDATE;
    now_ts := clock_timestamp();
    IF p_kind = 'clean' THEN
        b.clean_streak := b.clean_streak + 1;
        IF b.clean_streak >= p_decay_after THEN
            b.clean_streak := 0;
            b.backoff := GREATEST(b.backoff / p_backoff_factor, 1);
        END IF;
    ELSIF p_kind = 'throttled' THEN
        b.clean_streak := 0;
        -- One widening per generation.
        IF p_generation = b.generation THEN
            b.backoff := LEAST(b.backoff * p_backoff_factor, p_backoff_max);
            b.generation := b.generation + 1;
        END IF;
        IF p_retry_after IS NOT NULL THEN
            b.paused_until := GREATEST(b.paused_until,
                now_ts + make_interval(secs => LEAST(p_retry_after, p_retry_after_max)));
        END IF;
    ELSIF p_kind = 'lockout' THEN
        IF b.lock_status IS NULL THEN
            b.lock_since := now_ts;
            b.lock_status := p_lock_status;
            b.lock_request := p_lock_request;
            b.lock_instance := p_lock_instance;
        END IF;
    ELSE
        RAISE EXCEPTION 'unknown verdict %', p_kind;
    END IF;
    UPDATE pacegate_budgets AS x SET
        backoff = b.backoff, generation = b.generation, clean_streak = b.clean_streak,
        paused_until = b.paused_until, lock_since = b.lock_since, lock_status = b.lock_status,
        lock_request = b.lock_request, lock_instance = b.lock_instance
        WHERE x.destination = p_destination;
    RETURN QUERY SELECT b.backoff, b.generation, b.clean_streak,
        CASE WHEN b.paused_until > now_ts
            THEN extract(epoch FROM b.paused_until - now_ts)::double precision ELSE 0 END,
        b.lock_since, b.lock_status, b.lock_request, b.lock_instance;
END
$$;
