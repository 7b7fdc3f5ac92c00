-- What the vendor says, shared by every instance: the latest view of its budget, the
-- escalating block's streak, and why a pause is in force. The functions that apply it are in
-- functions.sql.
ALTER TABLE pacegate_budgets
    ADD COLUMN paused_by text,
    ADD COLUMN block_streak integer NOT NULL DEFAULT 0,
    ADD COLUMN vendor_family text,
    ADD COLUMN vendor_remaining bigint,
    ADD COLUMN vendor_limit bigint,
    ADD COLUMN vendor_observed timestamptz,
    ADD COLUMN vendor_reset timestamptz,
    ADD COLUMN vendor_taken bigint NOT NULL DEFAULT 0;
