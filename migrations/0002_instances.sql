-- Live pacegate instances: each one heartbeats its row, so the live count is known (for
-- dividing the rate while the store is unreachable) and `pacegate status` can list them.
CREATE TABLE pacegate_instances (
    id          text PRIMARY KEY,
    host        text NOT NULL,
    pid         integer NOT NULL,
    version     text NOT NULL,
    started_at  timestamptz NOT NULL,
    last_seen   timestamptz NOT NULL
);
