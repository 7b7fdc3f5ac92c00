//! Every metric family pacegate exports, in one struct registered on an injected registry.
//!
//! Label values come only from configured destination names (or `unmatched`) and fixed enums,
//! so a hostile client cannot grow the label space.

use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
};

/// The destination label of requests that match no configured destination.
pub const UNMATCHED: &str = "unmatched";

/// pacegate's metric families.
pub struct Metrics {
    registry: Registry,
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
}

impl Metrics {
    /// Creates and registers every family on `registry`.
    pub fn new(registry: Registry) -> Result<Self, prometheus::Error> {
        let requests = IntCounterVec::new(
            Opts::new(
                "pacegate_requests_total",
                "Requests answered, by destination and outcome",
            ),
            &["destination", "outcome"],
        )?;
        let upstream_responses = IntCounterVec::new(
            Opts::new(
                "pacegate_upstream_responses_total",
                "Upstream responses, by destination and status code",
            ),
            &["destination", "status"],
        )?;
        let request_duration = HistogramVec::new(
            HistogramOpts::new(
                "pacegate_request_duration_seconds",
                "Time from a request's arrival to its response head, by destination",
            )
            .buckets(vec![
                0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
            ]),
            &["destination"],
        )?;
        let connections_open =
            IntGauge::new("pacegate_connections_open", "Client connections open")?;
        let connections_total =
            IntCounter::new("pacegate_connections_total", "Client connections accepted")?;
        let connections_rejected = IntCounter::new(
            "pacegate_connections_rejected_total",
            "Client connections refused because max_connections were open",
        )?;
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
        registry.register(Box::new(requests.clone()))?;
        registry.register(Box::new(upstream_responses.clone()))?;
        registry.register(Box::new(request_duration.clone()))?;
        registry.register(Box::new(connections_open.clone()))?;
        registry.register(Box::new(connections_total.clone()))?;
        registry.register(Box::new(connections_rejected.clone()))?;
        registry.register(Box::new(tunnels_open.clone()))?;
        registry.register(Box::new(tunnels_total.clone()))?;
        registry.register(Box::new(tls_handshake_failures.clone()))?;
        registry.register(Box::new(cert_cache.clone()))?;
        registry.register(Box::new(cert_cache_entries.clone()))?;
        Ok(Self {
            registry,
            requests,
            upstream_responses,
            request_duration,
            connections_open,
            connections_total,
            connections_rejected,
            tunnels_open,
            tunnels_total,
            tls_handshake_failures,
            cert_cache,
            cert_cache_entries,
        })
    }

    /// Pre-creates the per-destination series so that dashboards see zeros, not gaps.
    pub fn init_destinations<'a>(&self, names: impl Iterator<Item = &'a str>) {
        for name in names {
            self.request_duration.with_label_values(&[name]);
        }
    }

    /// Everything in the Prometheus text exposition format.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        // Encoding into a Vec cannot fail for the text format.
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        String::from_utf8(buf).unwrap_or_default()
    }
}
