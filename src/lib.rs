//! pacegate: a forward HTTP proxy that paces requests to configured destinations.
//!
//! The modules, in the order a request meets them:
//!
//! - [`app`]: wiring: config -> metrics, TLS, upstream client, proxy, listeners; run and stop.
//! - [`config`]: the TOML file model -> validation -> typed [`config::Config`].
//! - [`server`]: accept loop on a bound listener, connection limit, one task per connection.
//! - [`proxy`]: per request: authenticate, route, then forward / intercept / tunnel / refuse;
//!   `proxy::respond` is the one place errors become responses (with `Proxy-Status`).
//! - [`destination`]: host patterns and routing of a target to a configured destination.
//! - [`tls`]: the local CA, leaf certificates minted per CONNECT host and cached, upstream roots.
//! - [`upstream`]: the guarded connector (address policy) and the pooled HTTP/1.1 + h2 client.
//! - [`metrics`]: every metric family in one struct.
//! - [`admin`]: the admin listener (`/metrics`, `/healthz`, `/readyz`).
//! - [`shutdown`]: signal, drain, task tracking, grace deadline.
//!
//! Words (see `pacing-model.md` in the design notes): *client* sends through pacegate;
//! *destination* is a configured group of hosts sharing one budget; *upstream* is the real
//! server; *slot*, *budget*, *store*, *class* and *verdict* belong to the pacing engine.

pub mod admin;
pub mod app;
pub mod budget;
pub mod config;
pub mod destination;
pub mod metrics;
pub mod pacing;
pub mod proxy;
pub mod server;
pub mod shutdown;
pub mod tls;
pub mod upstream;
