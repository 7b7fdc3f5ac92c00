-- The secret that keys the hash of a credential taken as a key (`key = "header:..."` or
-- "proxy-user"): one row, made once, the same for every instance, so that they all name a
-- key's budget alike and none keeps the credential itself. 244 random bits from two v4 UUIDs
-- (gen_random_uuid draws from the server's strong random source).
CREATE TABLE pacegate_key_secret (
    one    boolean PRIMARY KEY DEFAULT true CHECK (one),
    secret bytea NOT NULL
);
INSERT INTO pacegate_key_secret (secret)
    VALUES (decode(replace(gen_random_uuid()::text || gen_random_uuid()::text, '-', ''), 'hex'));
