//! The `pacegate` binary: flags, config, tracing, exit codes. Everything else is the library.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use pacegate::config::{Config, ConfigError, LogFormat};
use pacegate::tls;

/// Exit code for bad config or usage (EX_USAGE).
const EXIT_USAGE: u8 = 64;
/// Exit code for a runtime failure.
const EXIT_FAILURE: u8 = 1;

/// pacegate: a forward proxy that paces requests to configured destinations.
#[derive(Parser)]
#[command(version, about, long_about = None)]
struct Cli {
    /// Log format.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text, env = "PACEGATE_LOG_FORMAT")]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the proxy and its admin listener until SIGINT or SIGTERM.
    Serve {
        /// Config file (TOML).
        #[arg(long, env = "PACEGATE_CONFIG")]
        config: PathBuf,
    },
    /// Validate a config file and print it normalised, every default filled in.
    CheckConfig {
        /// Config file (TOML).
        #[arg(long, env = "PACEGATE_CONFIG")]
        config: PathBuf,
    },
    /// Manage the local certificate authority.
    Ca {
        #[command(subcommand)]
        command: CaCommand,
    },
    /// Clear the lockout of a destination, through the admin listener the config names.
    Unlock {
        /// The destination (`[destinations.NAME]`).
        name: String,
        /// Config file (gives the admin listener and its token variable).
        #[arg(long, env = "PACEGATE_CONFIG")]
        config: PathBuf,
        /// Admin listener to use instead of the config's, e.g. http://10.0.0.5:9464.
        #[arg(long)]
        admin: Option<String>,
    },
    /// Apply the postgres store's migrations (serve does it too, unless [store] migrate = false).
    Migrate {
        /// The store, e.g. postgres://pacegate@db:5432/pacegate.
        #[arg(long, env = "PACEGATE_STORE_URL")]
        store: String,
    },
    /// Show every destination's pace, backoff, pause, lockout and queue, and the live
    /// instances sharing the store.
    Status {
        /// Config file (gives the admin listener).
        #[arg(long, env = "PACEGATE_CONFIG", required_unless_present = "store")]
        config: Option<PathBuf>,
        /// Read the shared store directly instead of an admin listener.
        #[arg(long, conflicts_with_all = ["config", "admin"])]
        store: Option<String>,
        /// Admin listener to use instead of the config's.
        #[arg(long)]
        admin: Option<String>,
        /// Print the JSON of GET /status instead of a table.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum CaCommand {
    /// Create a new CA: DIR/ca.pem and DIR/ca-key.pem (mode 0600). Never overwrites.
    Init {
        /// Directory to write into (created if missing).
        #[arg(long)]
        dir: PathBuf,
    },
    /// Write the system roots plus the CA that a config names, as one PEM bundle, for clients
    /// whose SSL_CERT_FILE / REQUESTS_CA_BUNDLE / CURL_CA_BUNDLE replaces the system store.
    Bundle {
        /// Config file naming the CA.
        #[arg(long, env = "PACEGATE_CONFIG")]
        config: PathBuf,
        /// Bundle to write.
        #[arg(long)]
        out: PathBuf,
    },
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() {
                ExitCode::from(EXIT_USAGE)
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    init_tracing(cli.log_format);
    match cli.command {
        Command::Serve { config } => serve(&config),
        Command::CheckConfig { config } => match load(&config) {
            Ok(c) => {
                print!("{}", c.to_toml());
                ExitCode::SUCCESS
            }
            Err(code) => code,
        },
        Command::Ca {
            command: CaCommand::Init { dir },
        } => {
            let (cert, key) = (dir.join("ca.pem"), dir.join("ca-key.pem"));
            match tls::write_new_ca(&cert, &key) {
                Ok(()) => {
                    println!("wrote {} and {} (mode 0600)", cert.display(), key.display());
                    println!("clients trust it through `pacegate ca bundle --config FILE --out bundle.pem`");
                    ExitCode::SUCCESS
                }
                Err(e) => fail(&e),
            }
        }
        Command::Ca {
            command: CaCommand::Bundle { config, out },
        } => bundle(&config, &out),
        Command::Migrate { store } => migrate(&store),
        Command::Unlock {
            name,
            config,
            admin,
        } => unlock(&name, &config, admin),
        Command::Status {
            store: Some(store), ..
        } => status_from_store(&store),
        Command::Status {
            config,
            admin,
            json,
            ..
        } => status(&config.unwrap_or_default(), admin, json),
    }
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
        pacegate::budget::postgres::PostgresStore,
        tokio::runtime::Runtime,
    ),
    ExitCode,
> {
    let store = pacegate::budget::postgres::PostgresStore::new(url, 2).map_err(|e| {
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
    let base = admin.unwrap_or_else(|| pacegate::admin::url_for(config.admin.listen));
    let runtime = small_runtime()?;
    runtime
        .block_on(pacegate::admin::call(
            &base,
            method,
            path,
            config.admin.token.as_deref(),
        ))
        .map_err(|e| fail(&e))
}

fn migrate(url: &str) -> ExitCode {
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

fn unlock(name: &str, path: &Path, admin: Option<String>) -> ExitCode {
    let config = match load(path) {
        Ok(c) => c,
        Err(code) => return code,
    };
    if !config.destinations.iter().any(|d| d.name == name) {
        eprintln!(
            "error: {} has no destination named `{name}`",
            path.display()
        );
        return ExitCode::from(EXIT_USAGE);
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

fn status(path: &Path, admin: Option<String>, json: bool) -> ExitCode {
    let config = match load(path) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let body = match admin_call(&config, admin, http::Method::GET, "/status") {
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
    let rows: Vec<pacegate::pacing::DestinationStatus> = match serde_json::from_str(&body) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: unexpected /status answer: {e}");
            return ExitCode::from(EXIT_FAILURE);
        }
    };
    print!("{}", pacegate::pacing::status_table(&rows));
    if let Ok((s, body)) = admin_call(&config, None, http::Method::GET, "/instances") {
        let instances: Vec<pacegate::budget::InstanceStatus> =
            serde_json::from_str(&body).unwrap_or_default();
        if s.is_success() && !instances.is_empty() {
            println!();
            print!("{}", pacegate::pacing::instances_table(&instances));
        }
    }
    ExitCode::SUCCESS
}

fn status_from_store(url: &str) -> ExitCode {
    let (store, runtime) = match store_at(url) {
        Ok(opened) => opened,
        Err(code) => return code,
    };
    let result = runtime.block_on(async {
        let budgets = store.budgets().await?;
        let instances = store
            .live_instances(pacegate::budget::failover::LIVE_WITHIN)
            .await?;
        Ok::<_, pacegate::budget::StoreError>((budgets, instances))
    });
    match result {
        Ok((budgets, instances)) => {
            println!(
                "{:<24}  {:>8}  {:>6}  {:>8}  LOCKOUT",
                "DESTINATION", "BACKOFF", "STREAK", "PAUSED"
            );
            for (name, b) in budgets {
                let paused = if b.paused_for.is_zero() {
                    "-".to_owned()
                } else {
                    format!("{:.1}s", b.paused_for.as_secs_f64())
                };
                let lock = b.lock.map_or("-".to_owned(), |l| {
                    format!(
                        "LOCKED since {} by {} to {} (pacegate unlock {name})",
                        humantime::format_rfc3339_seconds(l.since),
                        l.status,
                        l.request
                    )
                });
                println!(
                    "{name:<24}  {:>8}  {:>6}  {paused:>8}  {lock}",
                    format!("x{}", b.backoff),
                    b.clean_streak
                );
            }
            println!();
            print!("{}", pacegate::pacing::instances_table(&instances));
            ExitCode::SUCCESS
        }
        Err(e) => fail(&e),
    }
}

fn serve(path: &Path) -> ExitCode {
    let config = match load(path) {
        Ok(c) => c,
        Err(code) => return code,
    };
    // Every rustls config pacegate builds names ring explicitly; installing it as the process
    // default too keeps any dependency that asks for the default on the same provider.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => return fail(&e),
    };
    match runtime.block_on(pacegate::app::run(config)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(&e),
    }
}

fn bundle(config: &Path, out: &Path) -> ExitCode {
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

fn fail(e: &dyn std::error::Error) -> ExitCode {
    let mut msg = format!("error: {e}");
    let mut source = e.source();
    while let Some(s) = source {
        msg.push_str(&format!(": {s}"));
        source = s.source();
    }
    eprintln!("{msg}");
    ExitCode::from(EXIT_FAILURE)
}

fn init_tracing(format: LogFormat) {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_env("PACEGATE_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
}
