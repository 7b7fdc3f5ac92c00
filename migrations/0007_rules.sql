-- Each instance's rule for each destination, in a canonical form with its fingerprint, so
-- that instances whose configs differ find out, say so, and pace by the stricter rule.
CREATE TABLE pacegate_rules (
    destination text NOT NULL,
    instance    text NOT NULL,
    fingerprint text NOT NULL,
    rule        text NOT NULL,
    written_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (destination, instance)
);
