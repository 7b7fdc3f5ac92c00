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
