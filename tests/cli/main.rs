//! What an operator runs: the commands and their exit codes, the shipped configs and fixtures,
//! `pacegate demo`, real clients (curl, Python, Node, Go) through their usual proxy settings,
//! the status page in headless Chromium, and the shipped dashboard and alert rules.

#![allow(
    clippy::disallowed_methods,
    clippy::disallowed_types,
    reason = "measures real time, across processes and threads of its own; clippy.toml's rules are the library's"
)]

#[path = "../support/mod.rs"]
mod support;

mod clients;
mod commands;
mod demo;
mod observability;
mod status_page;
