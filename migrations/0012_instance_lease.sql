-- Each instance's lease, on the store's clock: until when it may pace alone should the store
-- stop hearing it, and so until when the others hold its share back (fleet::Report::lease).
-- Its heartbeat stamps it; a row whose lease ran out concerns nobody and is deleted by the
-- next heartbeat of any instance. A row an older binary writes has none: its lease is read
-- from last_seen and alone_ms as that binary reckons it.
ALTER TABLE pacegate_instances ADD COLUMN lease_until timestamptz;
CREATE INDEX pacegate_instances_lease ON pacegate_instances (lease_until);
