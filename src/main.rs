//! The `pacegate` binary: parses the arguments and calls one function of `pacegate::cli` per
//! command. Everything else is the library.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use pacegate::cli;
use pacegate::config::LogFormat;

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
    cli::init_tracing(cli.log_format);
    match cli.command {
        Command::Serve { config } => cli::serve(&config),
        Command::CheckConfig { config } => cli::check_config(&config),
        Command::Ca {
            command: CaCommand::Init { dir, config, .. },
        } => cli::ca_init(&dir, config.as_deref()),
        Command::Ca {
            command: CaCommand::Bundle { config, out },
        } => cli::bundle(&config, &out),
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
    }
}
