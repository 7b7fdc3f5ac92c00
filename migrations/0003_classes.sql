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
