//! The postgres store's statements, as named constants. The functions they call are in
//! `migrations/`.

/// The common case of a reservation, as one UPDATE: one request waits here and none anywhere
/// else (so it deserves the slot, and no share is owed), the destination has no quota
/// window, the row exists, is not locked (nor is its parent, for a key's budget), and the slot is within the limit. `t` is `$2 * backoff` seconds and the burst tolerance
/// `($3 - 1) * t`; the slot is returned from the new row as `GREATEST(now, next_at - t -
/// tolerance, paused_until)`, which equals the slot the SET computed from the old row.
/// When no row comes back (missing row, lockout, slot too late), `SQL_RESERVE` runs and says
/// which. `c.now` is read once, before any wait for the row lock, so a contended reservation
/// computes its slot from a slightly earlier "now": the slot can only be earlier on the beat,
/// never closer to another slot. The database time returned is read again after the update,
/// so that waiting for the lock does not make the local deadline late. `$5` is the lead
/// (`clock::DbClock::lead`): the slot is no earlier than `now + $5` seconds, when its answer
/// can have reached the caller.
pub(super) const SQL_RESERVE_FAST: &str = "UPDATE pacegate_budgets AS b
    SET next_at = GREATEST(b.next_at,
            GREATEST(c.now + make_interval(secs => $5), b.next_at - make_interval(secs => $2 * b.backoff * ($3 - 1)), b.paused_until))
        + make_interval(secs => $2 * b.backoff),
        last_slot = GREATEST(b.last_slot,
            GREATEST(c.now + make_interval(secs => $5), b.next_at - make_interval(secs => $2 * b.backoff * ($3 - 1)), b.paused_until))
    FROM (SELECT clock_timestamp() AS now) AS c
    WHERE b.destination = $1
      AND b.lock_status IS NULL
      AND b.credits = '{}'
      AND (b.vendor_reset IS NULL OR b.vendor_reset <= c.now)
      AND NOT EXISTS (SELECT 1 FROM pacegate_waiting AS w WHERE w.destination = $1)
      AND NOT EXISTS (SELECT 1 FROM pacegate_budgets AS p WHERE position('#' in $1) > 0
          AND p.destination = split_part($1, '#', 1) AND p.lock_status IS NOT NULL)
      AND ($4::float8 IS NULL OR
           GREATEST(c.now + make_interval(secs => $5), b.next_at - make_interval(secs => $2 * b.backoff * ($3 - 1)), b.paused_until)
               <= c.now + make_interval(secs => $4::float8))
    RETURNING GREATEST(c.now + make_interval(secs => $5), b.next_at - make_interval(secs => $2 * b.backoff * $3), b.paused_until),
        clock_timestamp(), b.generation";
/// The database clock alone: a round trip with nothing to commit (see `clock`).
pub(super) const SQL_NOW: &str = "SELECT clock_timestamp()";
/// A reservation on the wait list, granting a batch of up to `$17` slots over at most `$18`
/// seconds (see `budget::Ask::most`), none earlier than `$19` seconds after the database's
/// "now" (the lead, as in [`SQL_RESERVE_FAST`]). A row found missing where this instance
/// paced before was lost, and its schedule starts `$20` seconds from now (`LOST_ROW_HOLD`).
/// `$21`: whether a vendor's remaining requests are spread until its reset
/// (`VendorPace::Spread`). `$22`: the units a slot weighs in the quota windows (`Rule::cost`).
pub(super) const SQL_RESERVE_MANY: &str =
    "SELECT outcome, slot, db_now, generation, class, backoff, lock_since, lock_status, lock_request, lock_instance, more
    FROM pacegate_reserve_weighted($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19, $20, $21, $22)";
/// Slots handed out without the store (`budget::Store::continue_after`): each budget `$1[i]`
/// continues no earlier than `$2[i]` seconds from now, created if missing. One statement
/// whatever the number, and a round trip even with none.
pub(super) const SQL_CONTINUE_AFTER: &str =
    "INSERT INTO pacegate_budgets AS b (destination, next_at)
        SELECT m.destination, clock_timestamp() + make_interval(secs => m.ahead)
        FROM unnest($1::text[], $2::float8[]) AS m(destination, ahead)
    ON CONFLICT (destination) DO UPDATE SET next_at = GREATEST(b.next_at, EXCLUDED.next_at)";
/// Settles a request of budget `$1` that cost `$2` seconds of its schedule (units times the
/// interval) more than it reserved, fewer where negative, at the budget's backoff: a charge
/// moves its next slot later, a refund earlier but never before now, nor, unless `$4` (the
/// budget counts its sends, whose latest keeps the slots in order), before the latest slot
/// granted (see `budget::schedule::Budget::settle`). `$3`: the units charged, for a budget
/// that counts its sends (else 0): counted as a send of them now, or at the latest slot if
/// that is later, so that the sends stay in time order. The next reservation forgets the
/// sends no window reaches.
pub(super) const SQL_SETTLE: &str = "WITH b AS (
        UPDATE pacegate_budgets
        SET next_at = CASE WHEN $2::float8 >= 0 THEN next_at + make_interval(secs => $2::float8 * backoff)
            ELSE GREATEST(next_at + make_interval(secs => $2::float8 * backoff),
                LEAST(next_at, CASE WHEN $4::boolean THEN clock_timestamp()
                    ELSE GREATEST(clock_timestamp(), last_slot) END)) END,
            sends = sends + GREATEST($3::bigint, 0)
        WHERE destination = $1
        RETURNING destination, sends, last_slot)
    INSERT INTO pacegate_sends (destination, seq, at)
        SELECT b.destination, b.sends, GREATEST(clock_timestamp(), b.last_slot) FROM b
        WHERE $3::bigint > 0
    ON CONFLICT (destination, seq) DO NOTHING";
/// Gives back `$5` units of a slot of budget `$1` reserved for `$4`: `$2` seconds of its
/// schedule refunded as [`SQL_SETTLE`] refunds them (`$6` as its `$4`), and its send (`$3`,
/// its slot) weighing
/// that many fewer in the windows where it has one (see `budget::schedule::Budget::unsend`).
pub(super) const SQL_GIVE_BACK: &str = "SELECT pacegate_give_back_part($1, $2, $3, $4, $5, $6)";
pub(super) const SQL_TELL: &str = "SELECT pacegate_tell($1, $2, clock_timestamp(), $3, $4, $5, $6)";
/// Renews the lease of instance `$1`'s wait lists for `$2` seconds, and drops the lists whose
/// lease ran out (an instance gone without a word): they no longer count, and would keep
/// reservations off the one-statement path. One statement, once a heartbeat. Only a list
/// past half its lease is renewed: an instance that keeps asking renews its own with every
/// reservation, and rewriting them here too would take their row locks while its
/// reservations want them (a stalled reservation places its slot late on the local clock).
pub(super) const SQL_KEEP_WAITING: &str = "WITH renewed AS (
        UPDATE pacegate_waiting SET live_until = clock_timestamp() + make_interval(secs => $2)
        WHERE instance = $1 AND live_until < clock_timestamp() + make_interval(secs => $2::float8 / 2)
        RETURNING 1)
    DELETE FROM pacegate_waiting WHERE live_until <= clock_timestamp() AND instance <> $1";
pub(super) const SQL_FORGET_WAITING: &str = "DELETE FROM pacegate_waiting WHERE instance = $1";
pub(super) const SQL_RECORD: &str = "SELECT backoff, generation, clean_streak, paused_for,
        lock_since, lock_status, lock_request, lock_instance, paused_by, block_streak,
        vendor_family, vendor_remaining, vendor_limit, vendor_reset_in
    FROM pacegate_record_said($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15,
        $16, $17, $18, $19, $20, $21, $22, $23, $24, $25, $26, $27)";
pub(super) const SQL_UNLOCK: &str = "WITH old AS (
        SELECT destination, lock_since, lock_status, lock_request, lock_instance
        FROM pacegate_budgets WHERE destination = $1 AND lock_status IS NOT NULL FOR UPDATE)
    UPDATE pacegate_budgets AS b
    SET lock_since = NULL, lock_status = NULL, lock_request = NULL, lock_instance = NULL
    FROM old WHERE b.destination = old.destination
    RETURNING old.lock_since, old.lock_status, old.lock_request, old.lock_instance";
/// This instance's heartbeat, in one round trip: alive now, with its report and its lease
/// (`$7` seconds from now on the store's clock, `fleet::Report::lease`), answered with the
/// others. Rows whose lease ran out more than `$8` seconds ago are deleted with their rules:
/// nobody holds their share back any longer, and a sidecar in a crash loop leaves a row per
/// start. A row an older binary wrote has no lease; its own is read as
/// `last_seen + alone_ms + $9` seconds.
///
/// The others are the rows younger than `$10` seconds (the longest any lease runs), with what
/// is left of each lease. Those heard within `$11` seconds, the fleet at work, come back as one
/// row for each report they share (`fleet::Peer::instances` of them, the oldest's age, the
/// least lease); only the quiet ones come back one by one. So what an answer carries, and
/// what its instance does with it, does not grow with the fleet. (The statement reads the table
/// as it was before its own writes: its own row and the ones it deletes are left out by id.)
pub(super) const SQL_HEARTBEAT: &str = "WITH gone AS (
        DELETE FROM pacegate_instances
        WHERE id <> $1 AND coalesce(lease_until,
                last_seen + make_interval(secs => alone_ms / 1000.0 + $9::float8))
            < clock_timestamp() - make_interval(secs => $8::float8)
        RETURNING id),
    rules AS (DELETE FROM pacegate_rules WHERE instance IN (SELECT id FROM gone)),
    mine AS (INSERT INTO pacegate_instances
            (id, host, pid, version, started_at, last_seen, divisor, alone_ms, lease_until)
        VALUES ($1, $2, $3, $4, clock_timestamp(), clock_timestamp(), $5, $6,
            clock_timestamp() + make_interval(secs => $7::float8))
        ON CONFLICT (id) DO UPDATE SET last_seen = clock_timestamp(), divisor = $5, alone_ms = $6,
            lease_until = clock_timestamp() + make_interval(secs => $7::float8)),
    peers AS (SELECT id,
            greatest(extract(epoch FROM clock_timestamp() - last_seen), 0)::float8 AS age,
            divisor, alone_ms,
            greatest(extract(epoch FROM coalesce(lease_until,
                    last_seen + make_interval(secs => alone_ms / 1000.0 + $9::float8))
                - clock_timestamp()), 0)::float8 AS lease
        FROM pacegate_instances
        WHERE id <> $1 AND id NOT IN (SELECT id FROM gone)
            AND last_seen > clock_timestamp() - make_interval(secs => $10::float8))
    SELECT id, age, divisor, alone_ms, lease, 1::int8 FROM peers WHERE age >= $11::float8
    UNION ALL
    SELECT NULL, max(age), divisor, alone_ms, min(lease), count(*) FROM peers
        WHERE age < $11::float8 GROUP BY divisor, alone_ms";
pub(super) const SQL_LIVE: &str = "SELECT id, host, pid, version, started_at, last_seen,
        extract(epoch FROM clock_timestamp() - last_seen)::double precision
    FROM pacegate_instances
    WHERE last_seen > clock_timestamp() - make_interval(secs => $1)
    ORDER BY started_at";
pub(super) const SQL_FORGET: &str = "DELETE FROM pacegate_instances WHERE id = $1";
pub(super) const SQL_FORGET_RULES: &str = "DELETE FROM pacegate_rules WHERE instance = $1";
/// This instance's rules: one row per destination, and none for a destination it no longer has.
pub(super) const SQL_WRITE_RULES: &str = "WITH mine AS (
        SELECT * FROM unnest($2::text[], $3::text[], $4::text[]) AS m(destination, fingerprint, rule)),
    gone AS (DELETE FROM pacegate_rules AS r WHERE r.instance = $1
        AND r.destination NOT IN (SELECT destination FROM mine))
    INSERT INTO pacegate_rules (destination, instance, fingerprint, rule)
        SELECT destination, $1, fingerprint, rule FROM mine
    ON CONFLICT (destination, instance) DO UPDATE
        SET fingerprint = EXCLUDED.fingerprint, rule = EXCLUDED.rule, written_at = clock_timestamp()";
/// The rules of live instances that differ from this one's, destination by destination.
pub(super) const SQL_OTHER_RULES: &str = "SELECT r.destination, r.instance, r.fingerprint, r.rule
    FROM pacegate_rules AS r
    JOIN pacegate_instances AS l ON l.id = r.instance
    JOIN unnest($2::text[], $3::text[]) AS m(destination, fingerprint) ON m.destination = r.destination
    WHERE r.instance <> $1 AND r.fingerprint <> m.fingerprint
      AND l.last_seen > clock_timestamp() - make_interval(secs => $4)
    ORDER BY r.destination, r.instance";
/// The columns `view_of` reads, in its order.
macro_rules! view_columns {
    () => {
        "backoff, generation, clean_streak,
        CASE WHEN paused_until > clock_timestamp()
            THEN extract(epoch FROM paused_until - clock_timestamp())::double precision ELSE 0 END,
        lock_since, lock_status, lock_request, lock_instance,
        CASE WHEN paused_until > clock_timestamp() THEN paused_by END,
        block_streak,
        CASE WHEN vendor_reset > clock_timestamp() THEN vendor_family END,
        CASE WHEN vendor_reset > clock_timestamp()
            THEN GREATEST(vendor_remaining - vendor_taken, 0) END,
        CASE WHEN vendor_reset > clock_timestamp() THEN vendor_limit END,
        CASE WHEN vendor_reset > clock_timestamp()
            THEN extract(epoch FROM vendor_reset - clock_timestamp())::double precision END"
    };
}
pub(super) const SQL_BUDGETS: &str = concat!(
    "SELECT ",
    view_columns!(),
    ", destination FROM pacegate_budgets ORDER BY destination"
);
pub(super) const SQL_VIEW: &str = concat!(
    "SELECT ",
    view_columns!(),
    " FROM pacegate_budgets WHERE destination = $1"
);
/// What status shows of many destinations, in one statement: each budget (the view's columns,
/// then whether the row exists, as `known`), every live instance's waiting requests by class
/// (three arrays, by class), and each quota window's units (those after the latest send
/// before the window, as `budget::schedule::Budget::sent_within` counts). `$1`: the destinations; `$2`,
/// `$3`: every quota window as (its destination, its length in seconds), in the rules' order;
/// `$4`: this instance, whose lists count whatever their lease (the others' while it runs).
pub(super) const SQL_SNAPSHOT: &str = concat!(
    "SELECT ",
    view_columns!(),
    ", b.destination IS NOT NULL, w.classes, w.counts, w.oldest, q.used
    FROM unnest($1::text[]) WITH ORDINALITY AS d(destination, n)
    LEFT JOIN pacegate_budgets AS b ON b.destination = d.destination
    LEFT JOIN LATERAL (
        SELECT array_agg(g.class ORDER BY g.class) AS classes,
            array_agg(g.count ORDER BY g.class) AS counts,
            array_agg(g.oldest ORDER BY g.class) AS oldest
        FROM (SELECT wl.class, sum(wl.count)::bigint AS count,
                extract(epoch FROM clock_timestamp() - min(wl.since))::double precision AS oldest
            FROM pacegate_waiting AS wl
            WHERE wl.destination = d.destination
              AND (wl.instance = $4 OR wl.live_until > clock_timestamp())
            GROUP BY wl.class) AS g) AS w ON true
    LEFT JOIN LATERAL (
        SELECT array_agg((SELECT coalesce(max(s.seq), 0) - coalesce(max(s.seq) FILTER (
                    WHERE s.at <= clock_timestamp() - make_interval(secs => qw.per)), 0)
                FROM pacegate_sends AS s WHERE s.destination = qw.destination)
            ORDER BY qw.n) AS used
        FROM unnest($2::text[], $3::float8[]) WITH ORDINALITY AS qw(destination, per, n)
        WHERE qw.destination = d.destination) AS q ON true
    ORDER BY d.n"
);
/// The secret that keys credentials' hashes (made once by migration 0011).
pub(super) const SQL_KEY_SECRET: &str = "SELECT secret FROM pacegate_key_secret";
/// Deletes the budgets of `$1`'s keys idle for `$2` seconds (see `Store::forget_keys`), with
/// their quota windows' sends and any wait list left, and counts them. A reservation that
/// holds a row keeps it: the delete waits for the row, then sees its new slot.
pub(super) const SQL_FORGET_KEYS: &str = "WITH gone AS (
        DELETE FROM pacegate_budgets AS b
        WHERE starts_with(b.destination, $1 || '#')
          AND b.lock_status IS NULL
          AND greatest(b.next_at, b.paused_until) < clock_timestamp() - make_interval(secs => $2)
          AND NOT EXISTS (SELECT 1 FROM pacegate_sends AS s WHERE s.destination = b.destination
              AND s.at > clock_timestamp() - make_interval(secs => $2))
          AND NOT EXISTS (SELECT 1 FROM pacegate_waiting AS w WHERE w.destination = b.destination
              AND w.live_until > clock_timestamp())
        RETURNING b.destination),
    sends AS (DELETE FROM pacegate_sends AS s USING gone WHERE s.destination = gone.destination),
    waiting AS (DELETE FROM pacegate_waiting AS w USING gone WHERE w.destination = gone.destination)
    SELECT count(*) FROM gone";
