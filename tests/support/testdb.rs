//! For tests: a fresh database per test, in the server `PACEGATE_TEST_DATABASE_URL`
//! names (scripts/test provides one). Shared by the library's unit tests (through `#[path]`)
//! and the integration tests.

use std::sync::atomic::{AtomicU32, Ordering};

/// Creates a new empty database and returns its URL. Panics, saying how to get a server,
/// when `PACEGATE_TEST_DATABASE_URL` is not set.
#[allow(dead_code, unreachable_pub)]
pub async fn fresh() -> String {
    let admin = std::env::var("PACEGATE_TEST_DATABASE_URL").unwrap_or_else(|_| {
        fail(
            "PACEGATE_TEST_DATABASE_URL is not set: run the tests through scripts/test, which starts a throwaway PostgreSQL, or point it at a server where the tests may create databases",
        )
    });
    static N: AtomicU32 = AtomicU32::new(0);
    // The process id alone repeats on a server that outlives many runs: the start time of the
    // process's first database makes the name unique.
    static STARTED: std::sync::OnceLock<u128> = std::sync::OnceLock::new();
    let started = *STARTED.get_or_init(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_micros())
    });
    let name = format!(
        "pacegate_unit_{}_{started}_{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    );
    let (client, conn) = tokio_postgres::connect(&admin, tokio_postgres::NoTls)
        .await
        .unwrap_or_else(|e| {
            fail(&format!(
                "cannot connect to PACEGATE_TEST_DATABASE_URL ({admin}): {e}; run the tests through scripts/test, which starts a throwaway PostgreSQL"
            ))
        });
    tokio::spawn(conn);
    static SWEPT: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if !SWEPT.swap(true, Ordering::Relaxed) {
        sweep(&client, started).await;
    }
    client
        .batch_execute(&format!("CREATE DATABASE {name}"))
        .await
        .unwrap();
    let s = Server::of(&admin);
    let password = s.password.map(|p| format!(":{p}")).unwrap_or_default();
    format!(
        "postgres://{}{password}@{}:{}/{name}",
        s.user, s.host, s.port
    )
}

/// Where the test server listens and who logs in, read from its URL.
#[allow(dead_code, unreachable_pub)]
pub struct Server {
    pub host: String,
    pub port: u16,
    pub user: String,
    pub password: Option<String>,
}

impl Server {
    /// Reads `url` (`PACEGATE_TEST_DATABASE_URL`), which must name a TCP host and port.
    #[allow(dead_code, unreachable_pub)]
    pub fn of(url: &str) -> Self {
        let config: tokio_postgres::Config = url.parse().unwrap();
        let (host, port) = match (config.get_hosts().first(), config.get_ports().first()) {
            (Some(tokio_postgres::config::Host::Tcp(h)), Some(p)) => (h.clone(), *p),
            _ => panic!("PACEGATE_TEST_DATABASE_URL must name a TCP host and port"),
        };
        Self {
            host,
            port,
            user: config.get_user().unwrap_or("postgres").to_owned(),
            password: config
                .get_password()
                .map(|p| String::from_utf8_lossy(p).into_owned()),
        }
    }
}

/// Fails the test with `why` as its one line of output: no panic message, no backtrace
/// (`resume_unwind` skips the panic hook), since what is missing is a setup, not a bug.
#[allow(dead_code, unreachable_pub)]
pub fn fail(why: &str) -> ! {
    println!("{why}");
    std::panic::resume_unwind(Box::new(why.to_owned()))
}

/// How old a test database must be before a later run drops it: older than any run.
const SWEEP_AFTER_MICROS: u128 = 3_600_000_000;

/// Drops the test databases of runs that started over an hour before `now` (micros since the
/// epoch, as in the names), so that a server that outlives many runs (a developer's own) does
/// not fill up. One still in use is left (a plain `DROP DATABASE` refuses it), as is any
/// name this code did not make.
async fn sweep(client: &tokio_postgres::Client, now: u128) {
    let Ok(rows) = client
        .query(
            "SELECT datname FROM pg_database WHERE datname LIKE 'pacegate\\_unit\\_%'",
            &[],
        )
        .await
    else {
        return;
    };
    for row in rows {
        let name: String = row.get(0);
        // pacegate_unit_{pid}_{started}_{n}
        let started = name.split('_').nth(3).and_then(|s| s.parse::<u128>().ok());
        if started.is_some_and(|s| s + SWEEP_AFTER_MICROS < now) {
            // Another test process may be sweeping too; whoever drops it first wins.
            let _ = client
                .batch_execute(&format!("DROP DATABASE IF EXISTS {name}"))
                .await;
        }
    }
}
