//! Scenarios on a pacegate started in-process (`support::TestProxy`, port 0): forwarding,
//! pacing measured at the upstream, classes, what the vendor says, refusals, hostile clients,
//! shutdown, plus the fuzz targets' short run and the module layering check.

#![allow(
    clippy::disallowed_methods,
    clippy::disallowed_types,
    reason = "measures real time, across processes and threads of its own; clippy.toml's rules are the library's"
)]

#[path = "../support/mod.rs"]
mod support;

mod admin;
mod any_config;
mod classes;
mod collapse;
mod deadlines;
mod forwarding;
mod fuzz;
mod groups;
mod layering;
mod meters;
mod pacing;
mod refusals;
mod robustness;
mod shutdown;
mod vendor;
mod walls;
