-- What each instance would take of every destination's rate if it lost the store: it paces
-- alone at 1 / divisor of the rate (at most) for at most alone_ms, beginning a few seconds
-- after its last heartbeat. The instances that keep the store read these from the heartbeat
-- rows and leave that share of the shared schedule unused while the heartbeat is stale, so
-- that a partial partition cannot carry the fleet past the ceiling.
ALTER TABLE pacegate_instances
    ADD COLUMN divisor  integer NOT NULL DEFAULT 1,
    ADD COLUMN alone_ms bigint  NOT NULL DEFAULT 0;
