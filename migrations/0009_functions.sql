-- The digest of the functions.sql this database last applied: a binary whose functions
-- differ re-applies them (`migrate`), or refuses to start (`[store] migrate = false`).
CREATE TABLE pacegate_schema_functions (
    digest     text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);
