//! pacegate: a forward HTTP proxy that paces requests to configured destinations.
//!
//! The modules, in the order a request meets them:
//!
//! - [`cli`]: the binary's commands, one function each (`main` only parses the arguments).
//! - [`app`]: wiring: config -> metrics, TLS, store, pacer, upstream client, proxy,
//!   listeners; run and stop.
//! - [`config`]: the typed [`config::Config`]; `config::file` is the TOML file model and
//!   `config::validate` turns it into the config, reporting every problem with its key path.
//! - [`server`]: accept loop on a bound listener, connection and request limits, one task per
//!   connection, every connection's deadlines (`server::watch`).
//! - [`proxy`]: per request: authenticate, route, then forward / intercept / tunnel / refuse;
//!   `proxy::respond` is the one place errors become responses (with `Proxy-Status`).
//! - [`destination`]: host patterns, the routing table, a destination's pacing keys and
//!   quota windows, and its groups (which of its requests take a budget of their own);
//!   `destination::host` normalises and checks a host as a request or a pattern writes it;
//!   `destination::path` reads a path as a vendor counts it, for picking its group.
//! - [`class`]: priority classes, and which one a request asks for (header or proxy user).
//! - [`collapse`]: one fetch for many: an identical GET or HEAD of a destination with
//!   `cache = true` waits for the one in flight and takes no slot; what can become of it is
//!   named (served, on its own, in the leader's place), and `Cache-Status` says which; a
//!   shared response kept whole answers from memory while it is fresh; `collapse::tape` is a
//!   shared response's body, recorded once and read by each of them from its start (or,
//!   past `max_object`, streamed by); `collapse::recording` the leader's fetch reading its
//!   body onto the tape (and asking again for one cut short); `collapse::kept` what an entry
//!   holds, keeping and purging them; `collapse::disk` the disk tier, a file per entry.
//! - [`signals`]: what a vendor's rate-limit headers say (remaining, limit, reset), every
//!   header family reduced to one signal, and the bucket it names; `signals::tokens` what
//!   one says of a budget in tokens or points, for a meter; `signals::walls` which bot
//!   wall's challenge a response is (Cloudflare, AWS WAF, DataDome, HUMAN, Akamai).
//! - [`meter`]: what a request costs in a meter's unit (tokens, points): estimated from the
//!   request before it is sent, settled from the response as its bytes pass
//!   (`meter::settle`); `meter::usage` asks a stream for the usage its client did not, and
//!   takes out what that adds; `meter::recall` keeps what a GraphQL query last cost.
//! - [`pacing`]: the pacer: routing yields a [`pacing::Route`] (a handle to the
//!   destination's lanes, one per budget: its own and each group's) that the request carries;
//!   `pacing::exchange` picks the request's group and carries it through that budget (its slot, the check that the slot is still good to send on, the
//!   verdict, the retry of a throttled request), so the proxy hands it a request and the
//!   upstream and gets a response or a refusal; `pacing::admit` gets a request its slot
//!   (waited for, or counted by a stand-in in shadow mode); `pacing::lane` queues waiting
//!   requests and hands slots out, `pacing::dispatch` asks the store for slots,
//!   `pacing::status` is what status and the gauges show (a scrape reads no store),
//!   `pacing::rate` counts the achieved rate, `pacing::verdict` reads a response,
//!   `pacing::sniff` the start of its body, and `pacing::observe` applies the verdict to the
//!   budget; `pacing::meters` takes a request's slots in its destination's meters (budgets in
//!   tokens or points), weighted by its estimated cost, and settles them from the response;
//!   `pacing::walls` counts a budget's bot-wall challenges against its responses (the share
//!   that widens the pace, the advice logged once a minute);
//!   `pacing::keys` splits a budget by key (a lane per
//!   host, credential or tenant, made on first use, bounded, forgotten when idle);
//!   `pacing::advertise` is what a response tells its client of the budget that paced it
//!   (the RateLimit fields).
//! - [`budget`]: the budget seam ([`budget::Store`]) and the arithmetic every store shares
//!   (`budget::schedule`), with the contract suite and the model test (`budget::model`) each
//!   store passes, and what this instance knows of each budget (`budget::known`), which the
//!   shared store feeds and both ways of losing it read; no I/O.
//! - [`fleet`]: this instance among the others sharing a store: its identity (made once,
//!   passed in), the membership seam, heartbeats and its share of each rate
//!   (`fleet::standing`), what happens while a shared store is lost (`fleet::failover`:
//!   divide or refuse, lockout write-back, the shared state read back each heartbeat),
//!   instances whose rules differ (`fleet::drift`).
//! - [`store`]: the stores: `store::memory`, the embedded one (what survives a restart in
//!   `memory::state_file`: a snapshot and a journal of what changed), and `store::postgres`, the
//!   shared one (`sql`, `migrations`, `rows` apart, `typed`, which sends statements prepared
//!   or, for a pooler in transaction mode, unnamed, `clock`, which places its slots on this
//!   instance's clock, `reassert`, which puts what this instance knew back into a server
//!   that a failover left with less, and `membership`).
//! - [`tls`]: the local CA, leaf certificates minted per CONNECT host and cached; the CA's files;
//!   upstream roots.
//! - [`upstream`]: the guarded connector (`upstream::connector`, under the address policy of
//!   `upstream::address`, directly or through a parent proxy), connections opened while a request
//!   waits for its slot (`upstream::warm`), and the pool of HTTP/1.1 and h2 connections
//!   requests are sent on (`upstream::pool`), both kept in one table per upstream
//!   (`upstream::table`); `upstream::stall` cuts a body, either way, that stops moving (`body_timeout`).
//! - [`headers`]: hop-by-hop hygiene at both boundaries, and the one pass over a request's
//!   names that finds which of those pacegate acts on are there; a leaf.
//! - [`log`]: the log's writer (a buffer that a thread of its own writes every 100 ms) and
//!   the request line, which a request copies unformatted and that thread formats; a leaf.
//! - [`metrics`]: every metric family in one struct; a budget's series, found once
//!   (`metrics::series`: `BudgetSeries`, its series by label value in slots set once).
//! - [`status`]: what status shows (types, and their rendering as tables); a leaf.
//! - [`reload`]: hot reload (SIGHUP, `POST /reload`): the config file read again, what can
//!   change in place applied, the rest kept and named.
//! - [`admin`]: the admin listener (the status page, `/metrics`, `/status`, `/history`,
//!   `/store`, `/healthz`, `/readyz`, `/config`, reload, unlock; a write needs intent) and the
//!   client the `status` and `unlock` commands use.
//! - [`shutdown`]: signal, drain, task tracking, grace deadline; `shutdown::quietly`, the
//!   wait a busy connection's task polls only when it may be done.
//! - [`demo`]: `pacegate demo`: a local vendor, three instances on one budget and a load past
//!   the ceiling, then the control; `demo::cluster` is the throwaway PostgreSQL it (and the
//!   tests) start.
//!
//! Each module imports only modules below it in this order: `status`, `class`, `headers`,
//! `log`, `signals`, `meter`, `shutdown`, `destination`, `config`, `tls`, `metrics`, `budget`, `fleet`,
//! `store`, `upstream`, `pacing`, `server`, `proxy`, `reload`, `admin`, `app`, `demo`, `cli`
//! (checked by `tests/in_process/layering.rs`).
//!
//! Words (see `docs/pacing-model.md`): *client* sends through pacegate;
//! *destination* is a configured group of hosts sharing one budget; *upstream* is the real
//! server; *slot* is the instant one request may be sent; *budget* is a destination's shared
//! pacing state; *store* is where budgets live; *verdict* is what a response tells the pacer
//! (clean, throttled, lockout, none); *class* is a request's priority.

pub mod admin;
pub mod app;
pub mod budget;
pub mod class;
pub mod cli;
pub mod collapse;
pub mod config;
pub mod demo;
pub mod destination;
pub mod fleet;
pub mod headers;
pub mod log;
pub mod meter;
pub mod metrics;
pub mod pacing;
pub mod proxy;
pub mod reload;
pub mod server;
pub mod shutdown;
pub mod signals;
pub mod status;
pub mod store;
pub mod tls;
pub mod upstream;
