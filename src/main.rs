//! The `pacegate` binary: parses the arguments and calls one function of `pacegate::cli` per
//! command. Everything else is the library.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use pacegate::config::LogFormat;
use pacegate::{cli, demo};

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
    /// Validate a config file and print it normalised, every default filled in; with
    /// --admin, say what reloading it into that running instance would change.
    CheckConfig {
        /// Config file (TOML).
        #[arg(long, env = "PACEGATE_CONFIG")]
        config: PathBuf,
        /// A running instance's admin listener, e.g. http://127.0.0.1:9464.
        #[arg(long)]
        admin: Option<String>,
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
    /// Manage the responses kept by `[cache]`.
    Cache {
        #[command(subcommand)]
        command: CacheCommand,
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
    /// Show the promise offline in about thirty seconds: a local vendor, three instances on
    /// one budget and a load of three times the ceiling, then the same load with each
    /// instance pacing alone.
    Demo {
        /// A few seconds instead of thirty.
        #[arg(long, conflicts_with = "seconds")]
        quick: bool,
        /// Seconds of load in each run.
        #[arg(long, default_value_t = 12, value_parser = clap::value_parser!(u64).range(1..=600))]
        seconds: u64,
        /// Also write the arrivals (arrivals.csv) and a chart of them (arrivals.svg) here.
        #[arg(long)]
        out: Option<PathBuf>,
        /// Where the instances share their budget: a throwaway PostgreSQL when its server
        /// binaries are here (auto), or three pacers in this process on the embedded store.
        #[arg(long, value_enum, default_value_t = DemoStore::Auto)]
        store: DemoStore,
    },
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum DemoStore {
    Auto,
    Postgres,
    Memory,
}

#[derive(Subcommand)]
enum CacheCommand {
    /// Remove the kept responses to URL (every method and variant), or all of a
    /// destination's, from memory and disk, through the admin listener the config names.
    Purge {
        /// The URL as clients ask for it, e.g. https://images.example.com/a.png.
        #[arg(required_unless_present = "destination")]
        url: Option<String>,
        /// Every response kept for this destination (`[destinations.NAME]`).
        #[arg(long, conflicts_with = "url")]
        destination: Option<String>,
        /// Config file (gives the admin listener and its token variable).
        #[arg(long, env = "PACEGATE_CONFIG")]
        config: PathBuf,
        /// Admin listener to use instead of the config's, e.g. http://10.0.0.5:9464.
        #[arg(long)]
        admin: Option<String>,
    },
}

#[derive(Subcommand)]
enum CaCommand {
    /// Create a new CA: DIR/ca.pem and DIR/ca-key.pem (mode 0600). Never overwrites.
    Init {
        /// Directory to write into (created if missing).
        #[arg(long)]
        dir: PathBuf,
        /// Constrain the CA (X.509 name constraints) to sign only for the hosts of the
        /// destinations in --config that intercept: a stolen key cannot impersonate any other
        /// site.
        #[arg(long, requires = "config")]
        name_constraints: bool,
        /// Config file whose destinations the constraints permit.
        #[arg(long, env = "PACEGATE_CONFIG", requires = "name_constraints")]
        config: Option<PathBuf>,
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
                ExitCode::from(cli::EXIT_USAGE)
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    // The demo prints its own view; its in-process pacers log only what went wrong.
    let level = if matches!(cli.command, Command::Demo { .. }) {
        "error"
    } else {
        "info"
    };
    // Dropped when main returns, after the command: the last lines are written then.
    let _log = cli::init_tracing(cli.log_format, level);
    match cli.command {
        Command::Serve { config } => cli::serve(&config),
        Command::CheckConfig { config, admin } => cli::check_config(&config, admin),
        Command::Ca {
            command: CaCommand::Init { dir, config, .. },
        } => cli::ca_init(&dir, config.as_deref()),
        Command::Ca {
            command: CaCommand::Bundle { config, out },
        } => cli::bundle(&config, &out),
        Command::Cache {
            command:
                CacheCommand::Purge {
                    url,
                    destination,
                    config,
                    admin,
                },
        } => cli::cache_purge(url.as_deref(), destination.as_deref(), &config, admin),
        Command::Migrate { store } => cli::migrate(&store),
        Command::Unlock {
            name,
            config,
            admin,
        } => cli::unlock(&name, &config, admin),
        Command::Status {
            store: Some(store), ..
        } => cli::status_from_store(&store),
        Command::Status {
            config,
            admin,
            json,
            ..
        } => cli::status(&config.unwrap_or_default(), admin, json),
        Command::Demo {
            quick,
            seconds,
            out,
            store,
        } => cli::demo(demo_options(quick, seconds, out, store)),
    }
}

fn demo_options(
    quick: bool,
    seconds: u64,
    out: Option<PathBuf>,
    store: DemoStore,
) -> demo::Options {
    let mut command = String::from("pacegate demo");
    if quick {
        command.push_str(" --quick");
    } else if seconds != 12 {
        command.push_str(&format!(" --seconds {seconds}"));
    }
    let store = match store {
        DemoStore::Auto => demo::StoreChoice::Auto,
        DemoStore::Postgres => {
            command.push_str(" --store postgres");
            demo::StoreChoice::Postgres
        }
        DemoStore::Memory => {
            command.push_str(" --store memory");
            demo::StoreChoice::Memory
        }
    };
    if let Some(out) = &out {
        command.push_str(&format!(" --out {}", out.display()));
    }
    demo::Options {
        seconds: if quick { 3 } else { seconds },
        out,
        store,
        command,
    }
}
