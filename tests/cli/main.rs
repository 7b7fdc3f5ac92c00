//! What an operator runs: the commands and their exit codes, the shipped configs and fixtures,
//! `pacegate demo`, real clients (curl, Python, Node, Go) through their usual proxy settings,
//! the status page in headless Chromium, and the shipped dashboard and alert rules.

#[path = "../support/mod.rs"]
mod support;

mod clients;
mod commands;
mod demo;
mod observability;
mod status_page;
