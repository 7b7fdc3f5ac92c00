//! Scenarios on the real binary as OS processes: several `pacegate serve` instances on one
//! throwaway PostgreSQL keeping one ceiling (through faults, in batches), and single processes
//! for what only a process shows (reload by SIGHUP, the request log, shadow mode, a parent
//! proxy), and the store behind PgBouncer in transaction mode. The timing scenarios run one at a time (`support::fleet::one_at_a_time`).

#![allow(
    clippy::disallowed_methods,
    clippy::disallowed_types,
    reason = "measures real time, across processes and threads of its own; clippy.toml's rules are the library's"
)]

#[path = "../support/mod.rs"]
mod support;

mod batches;
mod ceiling;

mod distance;
mod failover;
mod faults;
mod groups;
mod keys;
mod lockouts;
mod logs;
mod meters;
mod parent;
mod pooler;
mod reload;
mod shadow;
mod sidecars;
mod standby;
mod state_file;
mod telling;
