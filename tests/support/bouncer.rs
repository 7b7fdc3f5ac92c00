//! For tests: PgBouncer in transaction mode in front of the test server, as operators run it.
//! Its pool holds fewer server connections than its clients open, so consecutive statements of
//! one client connection may run on different server connections: a statement prepared under
//! a name on one is unknown on the next.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::testdb;

/// A running PgBouncer, stopped on drop.
pub struct Bouncer {
    child: Child,
    port: u16,
    dir: tempfile::TempDir,
}

/// Where Debian's package puts the binary, or `pgbouncer` on the PATH.
fn binary() -> PathBuf {
    ["/usr/sbin/pgbouncer", "/usr/bin/pgbouncer"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
        .unwrap_or_else(|| PathBuf::from("pgbouncer"))
}

impl Bouncer {
    /// Starts PgBouncer in transaction mode before the server `PACEGATE_TEST_DATABASE_URL`
    /// names, with `server_connections` server connections per database. Fails the test,
    /// saying how to get it, when PgBouncer is not installed.
    pub async fn start(server_connections: u32) -> Self {
        let admin = std::env::var("PACEGATE_TEST_DATABASE_URL").unwrap_or_else(|_| {
            testdb::fail(
                "PACEGATE_TEST_DATABASE_URL is not set: run the tests through scripts/test",
            )
        });
        let testdb::Server {
            host,
            port,
            user,
            password,
        } = testdb::Server::of(&admin);
        let password = password
            .map(|p| format!(" password={p}"))
            .unwrap_or_default();
        let listen = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let bouncer_port = listen.local_addr().unwrap().port();
        drop(listen);
        let dir = tempfile::tempdir().unwrap();
        // PgBouncer refuses to run as root: as root it runs as `nobody`, which must be able
        // to write its log beside its config.
        let as_root = nix::unistd::Uid::effective().is_root();
        if as_root {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        }
        let d = dir.path().display();
        // `auth_type = any`: clients are let in whatever user they name, and every server
        // connection logs in as the test server's user.
        let ini = format!(
            "[databases]\n* = host={host} port={port} user={user}{password}\n\
             [pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {bouncer_port}\n\
             unix_socket_dir =\nauth_type = any\npool_mode = transaction\n\
             default_pool_size = {server_connections}\nmin_pool_size = 0\nreserve_pool_size = 0\n\
             max_client_conn = 500\nignore_startup_parameters = extra_float_digits,options\n\
             logfile = {d}/pgbouncer.log\npidfile = {d}/pgbouncer.pid\n"
        );
        let config = dir.path().join("pgbouncer.ini");
        std::fs::write(&config, ini).unwrap();
        let mut command = if as_root {
            let mut c = Command::new("runuser");
            c.args(["-u", "nobody", "--"]).arg(binary());
            c
        } else {
            Command::new(binary())
        };
        let child = command
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| {
                testdb::fail(&format!(
                    "cannot start pgbouncer ({e}): install it (Debian: apt-get install pgbouncer) or run the tests through scripts/test, which does"
                ))
            });
        let bouncer = Self {
            child,
            port: bouncer_port,
            dir,
        };
        super::eventually(Duration::from_secs(10), "pgbouncer listening", || async {
            tokio::net::TcpStream::connect(("127.0.0.1", bouncer_port))
                .await
                .ok()
                .map(drop)
        })
        .await;
        bouncer
    }

    /// A URL through PgBouncer to a fresh database of the test server.
    pub async fn fresh(&self) -> String {
        let direct: tokio_postgres::Config = testdb::fresh().await.parse().unwrap();
        let name = direct.get_dbname().unwrap();
        format!("postgres://pacegate@127.0.0.1:{}/{name}", self.port)
    }

    /// What PgBouncer logged, to explain a failure.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("pgbouncer.log")).unwrap_or_default()
    }
}

impl Drop for Bouncer {
    fn drop(&mut self) {
        // runuser passes SIGTERM on to pgbouncer.
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let _ = self.child.wait();
    }
}
