//! The commands of the `pacegate` binary, one function each: load what the command needs,
//! run it, print the result, and say how it ended as an exit code (0 ok, 64 bad config or
//! usage, 1 runtime failure). `main` only parses the arguments and calls one of them.

use std::path::Path;
use std::process::ExitCode;

use crate::config::{Config, ConfigError, LogFormat};
use crate::fleet::Membership;
use crate::status::{self, BudgetStatus};
use crate::tls;

/// Exit code for bad config or usage (EX_USAGE).
pub const EXIT_USAGE: u8 = 64;
/// Exit code for a runtime failure.
const EXIT_FAILURE: u8 = 1;

/// `pacegate check-config`: the normalised config, or every problem; with `admin`, what a
/// reload of the file would change in that running instance.
pub fn check_config(path: &Path, admin: Option<String>) -> ExitCode {
    let config = match load(path) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let Some(admin) = admin else {
        print!("{}", config.to_toml());
        return ExitCode::SUCCESS;
    };
    let running = match admin_call(&config, Some(admin.clone()), http::Method::GET, "/config") {
        Err(code) => return code,
        Ok((s, body)) if s.is_success() => body,
        Ok((s, body)) => {
            eprintln!("error: {admin} answered {s}: {}", body.trim());
            return ExitCode::from(EXIT_FAILURE);
        }
    };
    let running: toml::Value = match toml::from_str(&running) {
        Ok(v) => v,
        Err(e) => {
            eprintln!("error: {admin}/config is not a config: {e}");
            return ExitCode::from(EXIT_FAILURE);
        }
    };
    let changed = crate::reload::differences(&running, &crate::reload::redacted(&config));
    if config.proxy.auth.is_some() {
        // The running instance never shows a password, so a changed one cannot be seen here.
        println!("passwords are not compared: a running instance never shows them (a reload applies a changed one)");
    }
    if changed.is_empty() {
        println!(
            "{} is the config {admin} runs: a reload changes nothing",
            path.display()
        );
        return ExitCode::SUCCESS;
    }
    for key in &changed {
        if crate::reload::in_place(key) {
            println!("reload applies  {key}");
        } else {
            println!("needs restart   {key} (a reload keeps the running value)");
        }
    }
    ExitCode::SUCCESS
}

/// `pacegate ca init`: a new CA in `dir`; with `constrained_to`, a config, one constrained to
/// the hosts of its destinations that intercept.
pub fn ca_init(dir: &Path, constrained_to: Option<&Path>) -> ExitCode {
    let (cert, key) = (dir.join("ca.pem"), dir.join("ca-key.pem"));
    let before_ca = |path: &Path| {
        Config::load_before_ca(path).map_err(|e| {
            eprintln!("error: {e}");
            ExitCode::from(EXIT_USAGE)
        })
    };
    let config = match constrained_to.map(before_ca).transpose() {
        Ok(config) => config,
        Err(code) => return code,
    };
    let names = config
        .as_ref()
        .map(|c| crate::destination::ca_names(&c.destinations));
    if names.as_ref().is_some_and(Vec::is_empty) {
        eprintln!("error: the config has no destination that intercepts: a CA constrained to no host could sign for none");
        return ExitCode::from(EXIT_USAGE);
    }
    match tls::write_new_ca_for(&cert, &key, names.as_deref()) {
        Ok(()) => {
            println!("wrote {} and {} (mode 0600)", cert.display(), key.display());
            if let Some(names) = &names {
                println!(
                    "the CA may sign only for: {} (and the names below each)",
                    names.join(", ")
                );
            }
            println!(
                "clients trust it through `pacegate ca bundle --config FILE --out bundle.pem`"
            );
            ExitCode::SUCCESS
        }
        Err(e) => fail(&e),
    }
}

/// The multi-threaded runtime pacegate serves on, on `threads` worker threads (by default one
/// per core).
fn server_runtime(threads: Option<usize>) -> Result<tokio::runtime::Runtime, ExitCode> {
    // Every rustls config pacegate builds names ring explicitly; installing it as the process
    // default too keeps any dependency that asks for the default on the same provider.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = threads {
        builder.worker_threads(n);
    }
    builder.enable_all().build().map_err(|e| fail(&e))
}

/// A current-thread runtime for one command's few calls.
fn small_runtime() -> Result<tokio::runtime::Runtime, ExitCode> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| fail(&e))
}

/// The postgres store at `url` (two connections), with a runtime to use it on.
fn store_at(
    url: &str,
) -> Result<
    (
        crate::store::postgres::PostgresStore,
        tokio::runtime::Runtime,
    ),
    ExitCode,
> {
    let store = crate::store::postgres::PostgresStore::new(url, 2).map_err(|e| {
        eprintln!("error: {e}");
        ExitCode::from(EXIT_USAGE)
    })?;
    Ok((store, small_runtime()?))
}

/// Runs one admin call on a small runtime.
fn admin_call(
    config: &Config,
    admin: Option<String>,
    method: http::Method,
    path: &str,
) -> Result<(http::StatusCode, String), ExitCode> {
    let base = admin.unwrap_or_else(|| crate::admin::url_for(config.admin.listen));
    // A read carries the read token where there is one; the write token serves for both.
    let token = match method {
        http::Method::GET => config
            .admin
            .read_token
            .as_deref()
            .or(config.admin.token.as_deref()),
        _ => config.admin.token.as_deref(),
    };
    let runtime = small_runtime()?;
    runtime
        .block_on(crate::admin::call(&base, method, path, token))
        .map_err(|e| fail(&e))
}

pub fn migrate(url: &str) -> ExitCode {
    let (store, runtime) = match store_at(url) {
        Ok(opened) => opened,
        Err(code) => return code,
    };
    match runtime.block_on(store.migrate()) {
        Ok(applied) if applied.is_empty() => {
            println!("the store's schema is up to date");
            ExitCode::SUCCESS
        }
        Ok(applied) => {
            println!("applied migrations {applied:?}");
            ExitCode::SUCCESS
        }
        Err(e) => fail(&e),
    }
}

/// `pacegate cache purge`: removes the kept responses to `url`, or all of `destination`'s,
/// in the running instance the config (or `admin`) names.
pub fn cache_purge(
    url: Option<&str>,
    destination: Option<&str>,
    path: &Path,
    admin: Option<String>,
) -> ExitCode {
    let config = match load(path) {
        Ok(c) => c,
        Err(code) => return code,
    };
    if config.cache.is_none() {
        eprintln!(
            "error: {} has no [cache] section: nothing is kept to purge",
            path.display()
        );
        return ExitCode::from(EXIT_USAGE);
    }
    let query = match (url, destination) {
        (Some(url), None) => {
            if url
                .parse::<http::Uri>()
                .ok()
                .and_then(|u| u.host().map(str::len))
                .is_none()
            {
                eprintln!(
                    "error: `{url}` is not an absolute URL (e.g. https://images.example.com/a.png)"
                );
                return ExitCode::from(EXIT_USAGE);
            }
            format!(
                "url={}",
                percent_encoding::utf8_percent_encode(url, percent_encoding::NON_ALPHANUMERIC)
            )
        }
        (None, Some(name)) => {
            if let Err(code) = named(&config, path, name) {
                return code;
            }
            format!(
                "destination={}",
                percent_encoding::utf8_percent_encode(name, percent_encoding::NON_ALPHANUMERIC)
            )
        }
        _ => {
            eprintln!("error: name a URL or --destination NAME");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    match admin_call(
        &config,
        admin,
        http::Method::POST,
        &format!("/cache/purge?{query}"),
    ) {
        Err(code) => code,
        Ok((s, body)) if s.is_success() => {
            let purged = serde_json::from_str::<serde_json::Value>(&body)
                .ok()
                .and_then(|v| v["purged"].as_u64())
                .unwrap_or(0);
            println!("purged {purged} kept response(s)");
            ExitCode::SUCCESS
        }
        Ok((s, body)) => {
            eprintln!("error: the admin listener answered {s}: {}", body.trim());
            ExitCode::from(EXIT_FAILURE)
        }
    }
}

/// `Err` (exit 64, and why) where the config at `path` has no destination `name`.
fn named(config: &Config, path: &Path, name: &str) -> Result<(), ExitCode> {
    if config.destinations.iter().any(|d| d.name == name) {
        return Ok(());
    }
    eprintln!(
        "error: {} has no destination named `{name}`",
        path.display()
    );
    Err(ExitCode::from(EXIT_USAGE))
}

pub fn unlock(name: &str, path: &Path, admin: Option<String>) -> ExitCode {
    let config = match load(path) {
        Ok(c) => c,
        Err(code) => return code,
    };
    if let Err(code) = named(&config, path, name) {
        return code;
    }
    match admin_call(
        &config,
        admin,
        http::Method::POST,
        &format!("/destinations/{name}/unlock"),
    ) {
        Err(code) => code,
        Ok((status, body)) if status.is_success() => {
            let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
            if v["was_locked"] == true {
                println!(
                    "unlocked {name} (locked since {} after {} to {})",
                    v["lock"]["since"].as_str().unwrap_or("?"),
                    v["lock"]["status"],
                    v["lock"]["request"].as_str().unwrap_or("?")
                );
            } else {
                println!("{name} was not locked");
            }
            ExitCode::SUCCESS
        }
        Ok((status, body)) => {
            eprintln!(
                "error: the admin listener answered {status}: {}",
                body.trim()
            );
            ExitCode::from(EXIT_FAILURE)
        }
    }
}

pub fn status(path: &Path, admin: Option<String>, json: bool) -> ExitCode {
    let config = match load(path) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let body = match admin_call(&config, admin.clone(), http::Method::GET, "/status") {
        Err(code) => return code,
        Ok((s, body)) if s.is_success() => body,
        Ok((s, body)) => {
            eprintln!("error: the admin listener answered {s}: {}", body.trim());
            return ExitCode::from(EXIT_FAILURE);
        }
    };
    if json {
        println!("{body}");
        return ExitCode::SUCCESS;
    }
    let rows: Vec<status::DestinationStatus> = match serde_json::from_str(&body) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: unexpected /status answer: {e}");
            return ExitCode::from(EXIT_FAILURE);
        }
    };
    print!("{}", status::status_table(&rows));
    if let Ok((s, body)) = admin_call(&config, admin.clone(), http::Method::GET, "/reload") {
        let last: crate::reload::ReloadStatus = serde_json::from_str(&body).unwrap_or_default();
        if s.is_success() && last.result == "error" {
            println!();
            println!(
                "LAST RELOAD FAILED at {}: the running config stays in force",
                last.at
            );
            for p in &last.problems {
                println!("  - {p}");
            }
        }
    }
    if let Ok((s, body)) = admin_call(&config, admin, http::Method::GET, "/instances") {
        let instances: Vec<status::InstanceStatus> =
            serde_json::from_str(&body).unwrap_or_default();
        if s.is_success() && !instances.is_empty() {
            println!();
            print!("{}", status::instances_table(&instances));
        }
    }
    ExitCode::SUCCESS
}

pub fn status_from_store(url: &str) -> ExitCode {
    let (store, runtime) = match store_at(url) {
        Ok(opened) => opened,
        Err(code) => return code,
    };
    let result = runtime.block_on(async {
        let budgets = store.budgets().await?;
        let instances = store.live_instances(crate::fleet::LIVE_WITHIN).await?;
        Ok::<_, crate::budget::StoreError>((budgets, instances))
    });
    match result {
        Ok((budgets, instances)) => {
            let rows: Vec<BudgetStatus> = budgets
                .into_iter()
                .map(|(destination, b)| BudgetStatus {
                    destination,
                    backoff: b.backoff,
                    clean_streak: b.clean_streak,
                    paused_for_seconds: b.paused_for.as_secs_f64(),
                    lock: b.lock.as_ref().map(Into::into),
                })
                .collect();
            print!("{}", status::budgets_table(&rows));
            println!();
            print!("{}", status::instances_table(&instances));
            ExitCode::SUCCESS
        }
        Err(e) => fail(&e),
    }
}

pub fn serve(path: &Path) -> ExitCode {
    let config = match load(path) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let runtime = match server_runtime(Some(config.proxy.threads)) {
        Ok(rt) => rt,
        Err(code) => return code,
    };
    match runtime.block_on(crate::app::run(config)) {
        Ok(()) => ExitCode::SUCCESS,
        // A directory the config names that this host does not let pacegate write: the
        // config's to change, as with any other bad value.
        Err(e @ crate::app::StartError::CacheDir(_)) => {
            eprintln!("error: {e}");
            ExitCode::from(EXIT_USAGE)
        }
        Err(e) => fail(&e),
    }
}

/// `pacegate demo`: 0 when the shared run held the ceiling, 1 when it did not or the demo
/// failed, 130 when interrupted (after cleaning up).
pub fn demo(options: crate::demo::Options) -> ExitCode {
    let runtime = match server_runtime(None) {
        Ok(rt) => rt,
        Err(code) => return code,
    };
    match runtime.block_on(crate::demo::run(options)) {
        Ok(outcome) if outcome.held() => ExitCode::SUCCESS,
        Ok(_) => ExitCode::from(EXIT_FAILURE),
        Err(crate::demo::DemoError::Interrupted) => {
            eprintln!("interrupted");
            ExitCode::from(130)
        }
        Err(e) => fail(&e),
    }
}

pub fn bundle(config: &Path, out: &Path) -> ExitCode {
    let config = match load(config) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let ca = match std::fs::read_to_string(&config.tls.ca_cert) {
        Ok(pem) => pem,
        Err(e) => {
            eprintln!(
                "error: cannot read the CA certificate {}: {e} (start pacegate once with tls.generate_ca = true, or run `pacegate ca init`)",
                config.tls.ca_cert.display()
            );
            return ExitCode::from(EXIT_FAILURE);
        }
    };
    let (pem, system) = tls::bundle_with_system_roots(&ca);
    if let Err(e) = std::fs::write(out, pem) {
        eprintln!("error: cannot write {}: {e}", out.display());
        return ExitCode::from(EXIT_FAILURE);
    }
    if system == 0 {
        eprintln!("warning: no system roots found; the bundle holds only pacegate's CA");
    }
    println!(
        "wrote {} ({system} system roots + pacegate's CA)",
        out.display()
    );
    ExitCode::SUCCESS
}

fn load(path: &Path) -> Result<Config, ExitCode> {
    Config::load(path).map_err(|e| {
        eprintln!("error: {e}");
        match e {
            ConfigError::Invalid { .. } | ConfigError::Read { .. } => ExitCode::from(EXIT_USAGE),
        }
    })
}

pub fn fail(e: &dyn std::error::Error) -> ExitCode {
    let mut msg = format!("error: {e}");
    let mut source = e.source();
    while let Some(s) = source {
        msg.push_str(&format!(": {s}"));
        source = s.source();
    }
    eprintln!("{msg}");
    ExitCode::from(EXIT_FAILURE)
}

/// Logs to stderr in `format`, filtered by `PACEGATE_LOG`, else at `level` and above, through
/// a buffer written every 100 ms ([`crate::log`]). Hold the guard until the process ends:
/// dropping it writes what is left.
pub fn init_tracing(format: LogFormat, level: &str) -> crate::log::Flushing {
    use std::io::IsTerminal;
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_env("PACEGATE_LOG").unwrap_or_else(|_| EnvFilter::new(level));
    let (writer, guard) = crate::log::buffered(std::io::stderr());
    // Colour codes only for a person at a terminal: in a log file they are noise.
    let colours = std::io::stderr().is_terminal();
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(colours)
        .with_writer(writer.clone());
    match format {
        LogFormat::Text => {
            builder.init();
            // After `init`: the filter it set is asked once whether request lines pass.
            if !colours {
                writer.take_request_lines();
            }
        }
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
    guard
}
