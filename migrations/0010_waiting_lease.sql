-- A wait list counts while its own lease runs, kept in the budgets' database: its instance
-- renews it with each reservation and once a heartbeat (`pacegate_keep_waiting`), so that
-- nothing about budgets reads pacegate_instances and budgets and membership may live apart.
-- The default is the lease (fleet::WAITER_LEASE) from the list's last write.
ALTER TABLE pacegate_waiting
    ADD COLUMN live_until timestamptz NOT NULL DEFAULT clock_timestamp() + interval '3 seconds';
