-- A waiting request keeps its place ahead of other instances' only while its instance keeps
-- asking: an instance asks again within a yield (at most 250 ms) or once its granted slot has
-- come, and each ask renews its requests' claim for 500 ms past that. An instance cut off
-- from the database while its heartbeat still counts (a link that flaps) no longer holds
-- every other instance's requests back: its claims lapse within half a second.
ALTER TABLE pacegate_waiting
    ADD COLUMN claimed_until timestamptz NOT NULL DEFAULT clock_timestamp() + interval '500 milliseconds';
