//! Scenarios on a pacegate started in-process (`support::TestProxy`, port 0): forwarding,
//! pacing measured at the upstream, classes, what the vendor says, refusals, hostile clients,
//! shutdown, plus the fuzz targets' short run and the module layering check.

#[path = "../support/mod.rs"]
mod support;

mod admin;
mod any_config;
mod classes;
mod deadlines;
mod forwarding;
mod fuzz;
mod groups;
mod layering;
mod pacing;
mod refusals;
mod robustness;
mod shutdown;
mod vendor;
