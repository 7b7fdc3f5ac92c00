-- The latest slot granted on a budget: a meter's refund (the store's settle statement)
-- moves the next slot earlier, but never before it, so that slots stay in the order they
-- were granted.
ALTER TABLE pacegate_budgets ADD COLUMN last_slot timestamptz NOT NULL DEFAULT '-infinity';
