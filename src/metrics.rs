//! Every metric family pacegate exports, in one struct registered on an injected registry.
//!
//! Label values come only from configured destination names (or `unmatched`) and fixed enums,
//! so a hostile client cannot grow the label space.

use std::time::{Duration, SystemTime};

use prometheus::core::Collector;
use prometheus::{
    Encoder, Gauge, GaugeVec, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

use crate::destination::{GROUP_MARK, KEY_MARK};
use crate::status::DestinationStatus;

mod series;
pub use series::{BudgetSeries, Found};

/// The destination label of requests that match no configured destination.
pub const UNMATCHED: &str = "unmatched";

/// pacegate's metric families.
pub struct Metrics {
    registry: Registry,
    /// Every family's name, exported or not yet (a labelled family shows once it has a
    /// series).
    families: Vec<String>,
    /// `pacegate_requests_total{destination,outcome}`: requests answered, by outcome.
    pub requests: IntCounterVec,
    /// `pacegate_upstream_responses_total{destination,status}`: upstream response statuses.
    pub upstream_responses: IntCounterVec,
    /// `pacegate_request_duration_seconds{destination}`: arrival to response head.
    pub request_duration: HistogramVec,
    /// `pacegate_connections_open`: client connections open now.
    pub connections_open: IntGauge,
    /// `pacegate_connections_total`: client connections accepted.
    pub connections_total: IntCounter,
    /// `pacegate_connections_rejected_total`: connections refused at `max_connections`.
    pub connections_rejected: IntCounter,
    /// `pacegate_clients_refused_total`: connections refused because their source is outside
    /// `[proxy] clients`.
    pub clients_refused: IntCounter,
    /// `pacegate_connections_expired_total{reason}`: connections (client connections and
    /// intercepted sessions) closed at a deadline: `silent` (no first byte), `head` (an
    /// HTTP/1 head begun, not finished), `idle` (no request), `write_timeout` (a client that
    /// did not read).
    pub connections_expired: IntCounterVec,
    /// `pacegate_bodies_cut_total{reason}`: bodies cut at `body_timeout`, by which side
    /// stalled: `upstream` (a response body), `client` (a request body).
    pub bodies_cut: IntCounterVec,
    /// `pacegate_tunnels_open{kind}`: CONNECT sessions open now (`intercept` or `blind`).
    pub tunnels_open: IntGaugeVec,
    /// `pacegate_tunnels_total{kind}`: CONNECT sessions started.
    pub tunnels_total: IntCounterVec,
    /// `pacegate_tls_handshake_failures_total`: client TLS handshakes that failed or timed out.
    pub tls_handshake_failures: IntCounter,
    /// `pacegate_cert_cache_total{result}`: leaf lookups, `hit` or `miss` (minted).
    pub cert_cache: IntCounterVec,
    /// `pacegate_cert_cache_entries`: leaf certificates cached.
    pub cert_cache_entries: IntGauge,
    /// `pacegate_verdicts_total{destination,verdict,reason}`: verdicts read from responses,
    /// and what decided each (`status`, or for a throttle in a lockout status `retry-after`,
    /// `exhausted`, `body`).
    pub verdicts: IntCounterVec,
    /// `pacegate_challenges_total{destination,vendor}`: bot walls' challenges, by the
    /// product that sent them (`cloudflare`, `aws-waf`, `datadome`, `perimeterx`, `akamai`,
    /// `other`).
    pub challenges: IntCounterVec,
    /// `pacegate_collapsed_total{destination,outcome}`: requests that found an identical one
    /// in flight, by what became of them: `served` (its response shared: a slot saved),
    /// `released` (a leader's response that could not be shared: its waiters went on their
    /// own), `vary` (shared, but not for this request's `Vary`'d headers), `lead_timeout` and
    /// `took_over` (a leader slow or failed, and a waiter going in its place).
    pub collapsed: IntCounterVec,
    /// `pacegate_cache_total{destination,result}`: lookups of kept responses (`hit`: answered
    /// from memory, no slot; `stale`: kept but asked for again; `miss`), responses kept
    /// (`stored`), and stale ones the vendor said had not changed (`revalidated`).
    pub cache: IntCounterVec,
    /// `pacegate_cache_bytes{tier}`: what the kept responses weigh in memory (against
    /// `[cache] memory`) and on disk (against `[cache] disk`), and the bodies being read
    /// (`flight`).
    pub cache_bytes: IntGaugeVec,
    /// `pacegate_cache_evictions_total{tier}`: kept responses let go of to make room.
    pub cache_evictions: IntCounterVec,
    /// `pacegate_slots_saved_total{destination}`: requests answered without a slot, from a
    /// kept response or an identical one's in flight.
    pub slots_saved: IntCounterVec,
    /// `pacegate_retries_total{destination}`: throttled requests retried in the proxy.
    pub retries: IntCounterVec,
    /// `pacegate_meter_units_total{destination}` (a meter's budget, `NAME~UNIT`): what its
    /// requests cost in its unit, as settled, or as estimated where no response said.
    pub meter_units: IntCounterVec,
    /// `pacegate_meter_unsettled_total{destination, reason}`: a meter's requests whose cost
    /// no response said (`cut`: the body ended early; `no_usage`: it said nothing), which
    /// keep their estimate.
    pub meter_unsettled: IntCounterVec,
    /// `pacegate_meter_retaken_total{destination}` (a meter's budget): its slots given back
    /// unused because another meter's (or the request's own) came too long after, and taken
    /// again. Meters that keep doing this to each other lose some of their rate.
    pub meter_retaken: IntCounterVec,
    /// `pacegate_slots_dropped_total{destination}`: slots not used because they came too late
    /// (a stalled process or store); each costs one slot of pace, never adds one.
    pub slots_dropped: IntCounterVec,
    /// `pacegate_keys{destination}`: the keys a budget split by key keeps here now.
    pub keys: GaugeVec,
    /// `pacegate_key_wait_max_seconds{destination}`: the oldest wait for a slot over the
    /// budget's keys here: what the most limited key costs.
    pub key_wait_max: GaugeVec,
    /// `pacegate_keys_refused_total{destination}`: requests refused for a new key past
    /// `max_keys`.
    pub keys_refused: IntCounterVec,
    /// `pacegate_keys_refused_client_total{destination,group}`: requests refused for a new
    /// key past its client's `max_keys_per_client`.
    pub keys_refused_client: IntCounterVec,
    /// `pacegate_wait_seconds{destination}`: time from arrival to slot.
    pub wait_seconds: HistogramVec,
    /// `pacegate_shadow_wait_seconds{destination}`: in shadow mode, how long each request
    /// would have waited for its slot.
    pub shadow_wait: HistogramVec,
    /// `pacegate_shadow_refusals_total{destination,reason}`: in shadow mode, requests that
    /// would have been refused (`locked`, `max_wait`, `store`, `max_keys`), and were forwarded.
    pub shadow_refusals: IntCounterVec,
    /// `pacegate_reservation_seconds{store}`: time one reservation takes in the store (one round
    /// trip, which may grant a batch of slots; `_count` is the round trips).
    pub reservation_seconds: HistogramVec,
    /// `pacegate_backoff_multiplier{destination}`.
    pub backoff: GaugeVec,
    /// `pacegate_effective_rate{destination}`: `rate / backoff`.
    pub effective_rate: GaugeVec,
    /// `pacegate_configured_rate{destination}`: the destination's `rate`.
    pub configured_rate: GaugeVec,
    /// `pacegate_max_wait_seconds{destination}`: the destination's `max_wait`.
    pub max_wait: GaugeVec,
    /// `pacegate_achieved_rate{destination}`: sends per second over the last 10 s.
    pub achieved_rate: GaugeVec,
    /// `pacegate_locked{destination}`: 1 when locked out.
    pub locked: GaugeVec,
    /// `pacegate_paused_until_seconds{destination}`: Unix time a pause ends (Retry-After, block,
    /// spent vendor budget; 0: none).
    pub paused_until: GaugeVec,
    /// `pacegate_vendor_remaining{destination}`: the vendor's requests left, while its view
    /// lasts (absent otherwise).
    pub vendor_remaining: GaugeVec,
    /// `pacegate_vendor_reset_seconds{destination}`: seconds until the vendor's window resets.
    pub vendor_reset: GaugeVec,
    /// `pacegate_block_streak{destination}`: throttles in a row that blocked the destination.
    pub block_streak: GaugeVec,
    /// `pacegate_pace_limited_by{destination,reason}`: 1 for the reason in force (see
    /// `status::PACE_LIMITS`), 0 for the others.
    pub pace_limited_by: GaugeVec,
    /// `pacegate_waiting{destination,class}`: requests waiting for a slot on this instance.
    pub waiting: GaugeVec,
    /// `pacegate_store_waiting{destination,class}`: requests waiting on every instance, as the
    /// store sees them.
    pub store_waiting: GaugeVec,
    /// `pacegate_oldest_wait_seconds{destination,class}`: the oldest wait on any instance.
    pub oldest_wait: GaugeVec,
    /// `pacegate_granted_total{destination,class}`: slots granted on this instance.
    pub granted: IntCounterVec,
    /// `pacegate_quota_used{destination,window}`: slots taken in the last quota window, over
    /// every instance.
    pub quota_used: GaugeVec,
    /// `pacegate_in_flight{destination}`: requests admitted and not finished.
    pub in_flight: GaugeVec,
    /// `pacegate_store_degraded`: 1 while the shared store is unreachable.
    pub store_degraded: IntGauge,
    /// `pacegate_store_instances`: live instances sharing the store (last heartbeat count).
    pub store_instances: IntGauge,
    /// `pacegate_store_share_held`: the share of a rate held back for instances that lost
    /// the store and may be pacing alone, until their leases run out (of a destination whose
    /// rate is above their count: a slower one holds nothing back, since they do not pace it
    /// alone).
    pub store_share_held: Gauge,
    /// `pacegate_store_share_alone`: the share of every rate this instance would pace alone
    /// at, were it to lose the store now.
    pub store_share_alone: Gauge,
    /// `pacegate_config_reloads_total{result}`: reloads, `ok` or `error`.
    pub config_reloads: IntCounterVec,
    /// `pacegate_config_last_reload_successful`: 0 while the last reload was refused.
    pub config_last_reload_successful: IntGauge,
    /// `pacegate_config_mismatch{destination}`: 1 while a live instance paces the
    /// destination by another rule (the stricter governs).
    pub config_mismatch: IntGaugeVec,
}

impl Metrics {
    /// Creates and registers every family on `registry`.
    pub fn new(registry: Registry) -> Result<Self, prometheus::Error> {
        let mut families = Vec::new();
        let mut register = |c: Box<dyn Collector>| {
            families.extend(c.desc().iter().map(|d| d.fq_name.clone()));
            registry.register(c)
        };
        let requests = IntCounterVec::new(
            Opts::new(
                "pacegate_requests_total",
                "Requests answered, by destination and outcome",
            ),
            &["destination", "group", "outcome"],
        )?;
        let upstream_responses = IntCounterVec::new(
            Opts::new(
                "pacegate_upstream_responses_total",
                "Upstream responses, by destination and status code",
            ),
            &["destination", "group", "status"],
        )?;
        let request_duration = HistogramVec::new(
            HistogramOpts::new(
                "pacegate_request_duration_seconds",
                "Time from a request's arrival to its response head, by destination",
            )
            .buckets(vec![
                0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
            ]),
            &["destination", "group"],
        )?;
        let connections_open =
            IntGauge::new("pacegate_connections_open", "Client connections open")?;
        let connections_total =
            IntCounter::new("pacegate_connections_total", "Client connections accepted")?;
        let connections_rejected = IntCounter::new(
            "pacegate_connections_rejected_total",
            "Client connections refused because max_connections were open",
        )?;
        let clients_refused = IntCounter::new(
            "pacegate_clients_refused_total",
            "Client connections refused because their source is outside [proxy] clients",
        )?;
        let connections_expired = IntCounterVec::new(
            Opts::new(
                "pacegate_connections_expired_total",
                "Connections closed at a deadline, by reason (silent, head, idle, write_timeout)",
            ),
            &["reason"],
        )?;
        for reason in ["silent", "head", "idle", "write_timeout"] {
            connections_expired.with_label_values(&[reason]);
        }
        let bodies_cut = IntCounterVec::new(
            Opts::new(
                "pacegate_bodies_cut_total",
                "Bodies cut after sending nothing for proxy.limits.body_timeout, by the side that stalled (upstream, client)",
            ),
            &["reason"],
        )?;
        for reason in ["upstream", "client"] {
            bodies_cut.with_label_values(&[reason]);
        }
        let tunnels_open = IntGaugeVec::new(
            Opts::new(
                "pacegate_tunnels_open",
                "CONNECT sessions open, by kind (intercept, blind)",
            ),
            &["kind"],
        )?;
        let tunnels_total = IntCounterVec::new(
            Opts::new(
                "pacegate_tunnels_total",
                "CONNECT sessions started, by kind (intercept, blind)",
            ),
            &["kind"],
        )?;
        let tls_handshake_failures = IntCounter::new(
            "pacegate_tls_handshake_failures_total",
            "Client TLS handshakes on intercepted sessions that failed or timed out",
        )?;
        let cert_cache = IntCounterVec::new(
            Opts::new(
                "pacegate_cert_cache_total",
                "Leaf certificate lookups, by result (hit, miss)",
            ),
            &["result"],
        )?;
        let cert_cache_entries =
            IntGauge::new("pacegate_cert_cache_entries", "Leaf certificates cached")?;
        let verdicts = IntCounterVec::new(
            Opts::new(
                "pacegate_verdicts_total",
                "Verdicts read from upstream responses, by destination, verdict and what decided it",
            ),
            &["destination", "group", "verdict", "reason"],
        )?;
        let challenges = IntCounterVec::new(
            Opts::new(
                "pacegate_challenges_total",
                "Bot walls' challenges in upstream responses, by destination and the product that sent them",
            ),
            &["destination", "vendor"],
        )?;
        let collapsed = IntCounterVec::new(
            Opts::new(
                "pacegate_collapsed_total",
                "Requests that found an identical one in flight, by destination and what became of them",
            ),
            &["destination", "outcome"],
        )?;
        let cache = IntCounterVec::new(
            Opts::new(
                "pacegate_cache_total",
                "Lookups of kept responses (hit, stale, miss) and responses kept (stored), by destination",
            ),
            &["destination", "result"],
        )?;
        let cache_bytes = IntGaugeVec::new(
            Opts::new(
                "pacegate_cache_bytes",
                "Bytes of the kept responses, by tier (memory, disk), and of the bodies being read (flight)",
            ),
            &["tier"],
        )?;
        let slots_saved = IntCounterVec::new(
            Opts::new(
                "pacegate_slots_saved_total",
                "Requests answered without a slot, from a kept response or an identical one's in flight, by destination",
            ),
            &["destination"],
        )?;
        let cache_evictions = IntCounterVec::new(
            Opts::new(
                "pacegate_cache_evictions_total",
                "Kept responses let go of to make room, by tier",
            ),
            &["tier"],
        )?;
        let slots_dropped = IntCounterVec::new(
            Opts::new(
                "pacegate_slots_dropped_total",
                "Slots not used because they came too late to send on, by destination",
            ),
            &["destination", "group"],
        )?;
        let keys_refused = IntCounterVec::new(
            Opts::new(
                "pacegate_keys_refused_total",
                "Requests refused because their key would pass max_keys, by destination",
            ),
            &["destination", "group"],
        )?;
        let keys_refused_client = IntCounterVec::new(
            Opts::new(
                "pacegate_keys_refused_client_total",
                "Requests refused because their client made max_keys_per_client keys of the budget already, by destination",
            ),
            &["destination", "group"],
        )?;
        let retries = IntCounterVec::new(
            Opts::new(
                "pacegate_retries_total",
                "Throttled requests retried by pacegate, by destination",
            ),
            &["destination", "group"],
        )?;
        let meter_units = IntCounterVec::new(
            Opts::new(
                "pacegate_meter_units_total",
                "What a meter's requests cost in its unit (tokens, points): as settled from the response, or as estimated where it said nothing; the destination label is the meter's budget, NAME~UNIT",
            ),
            &["destination", "group"],
        )?;
        let meter_unsettled = IntCounterVec::new(
            Opts::new(
                "pacegate_meter_unsettled_total",
                "A meter's requests whose response did not say what they cost, which keep their estimate, by meter budget and reason (cut, no_usage)",
            ),
            &["destination", "group", "reason"],
        )?;
        let meter_retaken = IntCounterVec::new(
            Opts::new(
                "pacegate_meter_retaken_total",
                "A meter's slots given back unused because another meter's, or the request's own, came too long after them, and taken again, by meter budget",
            ),
            &["destination", "group"],
        )?;
        let wait_buckets = vec![
            0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
        ];
        let shadow_wait = HistogramVec::new(
            HistogramOpts::new(
                "pacegate_shadow_wait_seconds",
                "In shadow mode, how long requests would have waited for their slot, by destination",
            )
            .buckets(wait_buckets.clone()),
            &["destination", "group"],
        )?;
        let shadow_refusals = IntCounterVec::new(
            Opts::new(
                "pacegate_shadow_refusals_total",
                "In shadow mode, requests that would have been refused, and were forwarded, by destination and reason",
            ),
            &["destination", "group", "reason"],
        )?;
        let wait_seconds = HistogramVec::new(
            HistogramOpts::new(
                "pacegate_wait_seconds",
                "Time requests waited for their slot, by destination",
            )
            .buckets(wait_buckets),
            &["destination", "group"],
        )?;
        let reservation_seconds = HistogramVec::new(
            HistogramOpts::new(
                "pacegate_reservation_seconds",
                "Time one reservation (one store round trip, for a slot or a batch of them) takes, by store",
            )
            .buckets(vec![
                0.00001, 0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.1, 0.5,
            ]),
            &["store"],
        )?;
        let gauge = |name: &str, help: &str| {
            GaugeVec::new(Opts::new(name, help), &["destination", "group"])
        };
        let backoff = gauge(
            "pacegate_backoff_multiplier",
            "Current interval multiplier (1 = configured rate)",
        )?;
        let effective_rate = gauge(
            "pacegate_effective_rate",
            "rate / backoff: the pace now, requests per second",
        )?;
        let configured_rate = gauge(
            "pacegate_configured_rate",
            "The destination's configured rate, requests per second over every instance",
        )?;
        let max_wait = gauge(
            "pacegate_max_wait_seconds",
            "The destination's max_wait: the longest a request waits for a slot before a 503",
        )?;
        let achieved_rate = gauge(
            "pacegate_achieved_rate",
            "Requests sent per second over the last 10 s, this instance",
        )?;
        let locked = gauge("pacegate_locked", "1 while the destination is locked out")?;
        let paused_until = gauge(
            "pacegate_paused_until_seconds",
            "Unix time at which a pause ends: Retry-After, block or spent vendor budget (0: none)",
        )?;
        let vendor_remaining = gauge(
            "pacegate_vendor_remaining",
            "Requests the vendor says are left in its window (absent without a current view)",
        )?;
        let vendor_reset = gauge(
            "pacegate_vendor_reset_seconds",
            "Seconds until the vendor's window resets (absent without a current view)",
        )?;
        let block_streak = gauge(
            "pacegate_block_streak",
            "Throttles in a row that blocked the destination; one success ends the streak",
        )?;
        let pace_limited_by = GaugeVec::new(
            Opts::new(
                "pacegate_pace_limited_by",
                "1 for what limits the destination's pace now, 0 for the other reasons",
            ),
            &["destination", "group", "reason"],
        )?;
        let by_class = |name: &str, help: &str| {
            GaugeVec::new(Opts::new(name, help), &["destination", "group", "class"])
        };
        let waiting = by_class(
            "pacegate_waiting",
            "Requests waiting for a slot on this instance",
        )?;
        let store_waiting = by_class(
            "pacegate_store_waiting",
            "Requests waiting for a slot on every instance, as the store sees them",
        )?;
        let oldest_wait = by_class(
            "pacegate_oldest_wait_seconds",
            "How long the oldest waiting request has waited, on any instance",
        )?;
        let granted = IntCounterVec::new(
            Opts::new(
                "pacegate_granted_total",
                "Slots granted to requests on this instance, by destination and class",
            ),
            &["destination", "group", "class"],
        )?;
        let quota_used = GaugeVec::new(
            Opts::new(
                "pacegate_quota_used",
                "Slots taken in the last quota window over every instance, in units for a meter (limit in the window label's destination config)",
            ),
            &["destination", "group", "window"],
        )?;
        let in_flight = gauge(
            "pacegate_in_flight",
            "Requests admitted and not yet answered",
        )?;
        let keys = gauge(
            "pacegate_keys",
            "Keys a budget split by key keeps on this instance now",
        )?;
        let key_wait_max = gauge(
            "pacegate_key_wait_max_seconds",
            "The oldest wait for a slot over a split budget's keys on this instance",
        )?;
        let store_degraded = IntGauge::new(
            "pacegate_store_degraded",
            "1 while the shared pacing store is unreachable and on_unavailable applies",
        )?;
        let store_instances = IntGauge::new(
            "pacegate_store_instances",
            "Live pacegate instances sharing the store, as last seen",
        )?;
        let store_share_held = Gauge::new(
            "pacegate_store_share_held",
            "Share of a destination's rate left unused on the shared schedule for instances whose heartbeat is stale and whose lease in the store still runs (a destination whose rate is at most their count holds nothing back: they do not pace it alone)",
        )?;
        register(Box::new(store_degraded.clone()))?;
        let store_share_alone = Gauge::new(
            "pacegate_store_share_alone",
            "Share of every destination's rate this instance would pace alone at if it lost the store now (divide), before the slack it gives up",
        )?;
        register(Box::new(store_share_held.clone()))?;
        register(Box::new(store_share_alone.clone()))?;
        let config_mismatch = IntGaugeVec::new(
            Opts::new(
                "pacegate_config_mismatch",
                "1 while another live instance paces the destination by another rule; the stricter of each key governs until the configs agree",
            ),
            &["destination"],
        )?;
        register(Box::new(config_mismatch.clone()))?;
        let config_reloads = IntCounterVec::new(
            Opts::new(
                "pacegate_config_reloads_total",
                "Config reloads (SIGHUP or POST /reload), by result: ok or error",
            ),
            &["result"],
        )?;
        register(Box::new(config_reloads.clone()))?;
        let config_last_reload_successful = IntGauge::new(
            "pacegate_config_last_reload_successful",
            "0 while the last reload was refused (the running config stays in force), else 1",
        )?;
        register(Box::new(config_last_reload_successful.clone()))?;
        register(Box::new(store_instances.clone()))?;
        register(Box::new(requests.clone()))?;
        register(Box::new(upstream_responses.clone()))?;
        register(Box::new(request_duration.clone()))?;
        register(Box::new(connections_open.clone()))?;
        register(Box::new(connections_total.clone()))?;
        register(Box::new(connections_rejected.clone()))?;
        register(Box::new(connections_expired.clone()))?;
        register(Box::new(bodies_cut.clone()))?;
        register(Box::new(clients_refused.clone()))?;
        register(Box::new(tunnels_open.clone()))?;
        register(Box::new(tunnels_total.clone()))?;
        register(Box::new(tls_handshake_failures.clone()))?;
        register(Box::new(cert_cache.clone()))?;
        register(Box::new(cert_cache_entries.clone()))?;
        register(Box::new(cache_bytes.clone()))?;
        for c in [
            &verdicts,
            &challenges,
            &collapsed,
            &cache,
            &cache_evictions,
            &slots_saved,
            &retries,
            &meter_units,
            &meter_unsettled,
            &meter_retaken,
            &slots_dropped,
            &keys_refused,
            &keys_refused_client,
            &granted,
            &shadow_refusals,
        ] {
            register(Box::new(c.clone()))?;
        }
        for h in [&wait_seconds, &shadow_wait, &reservation_seconds] {
            register(Box::new(h.clone()))?;
        }
        for g in [
            &backoff,
            &effective_rate,
            &configured_rate,
            &max_wait,
            &achieved_rate,
            &locked,
            &paused_until,
            &vendor_remaining,
            &vendor_reset,
            &block_streak,
            &pace_limited_by,
            &waiting,
            &store_waiting,
            &oldest_wait,
            &quota_used,
            &in_flight,
            &keys,
            &key_wait_max,
        ] {
            register(Box::new(g.clone()))?;
        }
        families.sort();
        Ok(Self {
            registry,
            families,
            requests,
            upstream_responses,
            request_duration,
            connections_open,
            connections_total,
            connections_rejected,
            connections_expired,
            bodies_cut,
            clients_refused,
            tunnels_open,
            tunnels_total,
            tls_handshake_failures,
            cert_cache,
            cert_cache_entries,
            verdicts,
            challenges,
            collapsed,
            cache,
            cache_bytes,
            cache_evictions,
            slots_saved,
            retries,
            meter_units,
            meter_unsettled,
            meter_retaken,
            slots_dropped,
            keys,
            key_wait_max,
            keys_refused,
            keys_refused_client,
            wait_seconds,
            shadow_wait,
            shadow_refusals,
            reservation_seconds,
            backoff,
            effective_rate,
            configured_rate,
            max_wait,
            achieved_rate,
            locked,
            paused_until,
            vendor_remaining,
            vendor_reset,
            block_streak,
            pace_limited_by,
            waiting,
            store_waiting,
            oldest_wait,
            granted,
            quota_used,
            in_flight,
            store_degraded,
            store_instances,
            store_share_held,
            store_share_alone,
            config_mismatch,
            config_reloads,
            config_last_reload_successful,
        })
    }

    /// Counts an upstream response to a request for `destination` (a configured name, or
    /// [`UNMATCHED`]).
    pub fn upstream_response(&self, destination: &str, status: http::StatusCode) {
        self.upstream_responses
            .with_label_values(&labels_and(destination, status.as_str()))
            .inc();
    }

    /// Sets every per-destination gauge from a status snapshot.
    pub fn set_destination(&self, s: &DestinationStatus, paused_for: Duration) {
        let d = labels(&s.destination);
        self.backoff.with_label_values(&d).set(s.backoff);
        self.effective_rate
            .with_label_values(&d)
            .set(s.effective_rate);
        self.configured_rate.with_label_values(&d).set(s.rate);
        self.max_wait.with_label_values(&d).set(s.max_wait_seconds);
        self.achieved_rate
            .with_label_values(&d)
            .set(s.achieved_rate_10s);
        self.locked
            .with_label_values(&d)
            .set(if s.lock.is_some() { 1.0 } else { 0.0 });
        let until = if paused_for.is_zero() {
            0.0
        } else {
            (SystemTime::now() + paused_for)
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64())
        };
        self.paused_until.with_label_values(&d).set(until);
        match &s.vendor {
            Some(v) => {
                self.vendor_remaining
                    .with_label_values(&d)
                    .set(v.remaining as f64);
                self.vendor_reset
                    .with_label_values(&d)
                    .set(v.reset_in_seconds);
            }
            None => {
                // No view: no series, rather than a made-up value.
                let _ = self.vendor_remaining.remove_label_values(&d);
                let _ = self.vendor_reset.remove_label_values(&d);
            }
        }
        self.block_streak
            .with_label_values(&d)
            .set(f64::from(s.block_streak));
        for reason in crate::status::PACE_LIMITS {
            let on = if s.pace_limited_by == reason {
                1.0
            } else {
                0.0
            };
            self.pace_limited_by
                .with_label_values(&labels_and(&s.destination, reason))
                .set(on);
        }
        for c in &s.classes {
            let dc = labels_and(&s.destination, c.class.as_str());
            self.waiting
                .with_label_values(&dc)
                .set(c.waiting_here as f64);
            self.store_waiting
                .with_label_values(&dc)
                .set(c.waiting as f64);
            self.oldest_wait
                .with_label_values(&dc)
                .set(c.oldest_wait_seconds);
        }
        for q in &s.quota {
            self.quota_used
                .with_label_values(&labels_and(&s.destination, q.window.as_str()))
                .set(f64::from(q.used));
        }
        self.in_flight.with_label_values(&d).set(s.in_flight as f64);
    }

    /// Pre-creates the per-destination series so that dashboards see zeros, not gaps.
    pub fn init_destinations<'a>(&self, names: impl Iterator<Item = &'a str>) {
        for name in names {
            self.request_duration.with_label_values(&labels(name));
            self.wait_seconds.with_label_values(&labels(name));
            self.retries.with_label_values(&labels(name));
        }
    }

    /// The name of every metric family pacegate exports, sorted.
    pub fn families(&self) -> &[String] {
        &self.families
    }

    /// Everything in the Prometheus text exposition format.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        // Encoding into a Vec cannot fail for the text format.
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        String::from_utf8(buf).unwrap_or_default()
    }
}

/// A budget's labels, `destination` and `group` (empty for a destination's own budget), from
/// its name (`DESTINATION`, `DESTINATION/GROUP`). A key's budget (`PARENT#KEY`) counts as its
/// parent's, so keys add no label values.
pub fn labels(budget: &str) -> [&str; 2] {
    let budget = budget
        .split_once(KEY_MARK)
        .map_or(budget, |(parent, _)| parent);
    budget
        .split_once(GROUP_MARK)
        .map_or([budget, ""], |(destination, group)| [destination, group])
}

/// [`labels`], and one label more.
pub fn labels_and<'a>(budget: &'a str, more: &'a str) -> [&'a str; 3] {
    let [destination, group] = labels(budget);
    [destination, group, more]
}
