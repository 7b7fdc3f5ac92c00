//! A throwaway PostgreSQL cluster: initialised in a temp dir, serving on a free loopback port,
//! stopped and removed when dropped. It is started from the local server binaries, found as
//! `scripts/test` finds them (on `PATH`, else the newest `/usr/lib/postgresql/*/bin`).

use std::path::{Path, PathBuf};
use std::process::Command;

/// Why a cluster could not be started or stopped.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// No `initdb` and `pg_ctl` on this machine.
    #[error("no PostgreSQL server binaries (initdb, pg_ctl) on PATH or under /usr/lib/postgresql/*/bin; install them (Debian/Ubuntu: apt-get install postgresql)")]
    NoServer,
    /// A file or process could not be made.
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    /// A server tool failed.
    #[error("{tool} failed: {output}")]
    Tool { tool: String, output: String },
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> ClusterError {
    let what = what.into();
    move |source| ClusterError::Io { what, source }
}

/// The directory of `initdb` and `pg_ctl`, if this machine has them: the server's own bin
/// directory, where the other tools (`pg_basebackup`) are too, even when the PATH holds
/// links to the two (as `/usr/local/bin` may).
pub fn server_binaries() -> Option<PathBuf> {
    let on_path = std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .find(|d| d.join("initdb").is_file() && d.join("pg_ctl").is_file())
    });
    if let Some(dir) = on_path {
        let real = std::fs::canonicalize(dir.join("initdb"))
            .ok()
            .and_then(|initdb| initdb.parent().map(Path::to_path_buf))
            .filter(|real| real.join("pg_ctl").is_file());
        return Some(real.unwrap_or(dir));
    }
    let mut dirs: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|d| {
            d.filter_map(Result::ok)
                .map(|e| e.path().join("bin"))
                .collect()
        })
        .unwrap_or_default();
    // Newest first: "15" sorts after "13", and every packaged major version has two digits.
    dirs.sort();
    dirs.into_iter()
        .rev()
        .find(|d| d.join("initdb").is_file() && d.join("pg_ctl").is_file())
}

/// A cluster of one's own, with a `pacegate` superuser and trust authentication.
pub struct Cluster {
    dir: tempfile::TempDir,
    bin: PathBuf,
    /// The server's own user when running as root (initdb refuses root).
    run_as: Option<String>,
    /// Its loopback port.
    pub port: u16,
}

impl Cluster {
    /// Creates and starts a cluster.
    pub fn start() -> Result<Self, ClusterError> {
        Self::start_with(None)
    }

    /// Like [`Cluster::start`], serving TLS with this certificate and key (PEM).
    pub fn start_tls(cert_pem: &str, key_pem: &str) -> Result<Self, ClusterError> {
        Self::start_with(Some((cert_pem, key_pem)))
    }

    fn start_with(tls: Option<(&str, &str)>) -> Result<Self, ClusterError> {
        let bin = server_binaries().ok_or(ClusterError::NoServer)?;
        let dir = tempfile::Builder::new()
            .prefix("pacegate-pg.")
            .tempdir()
            .map_err(io("cannot create a temp dir"))?;
        let run_as = is_root().then(server_user);
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(io("cannot find a free port"))?
            .port();
        let cluster = Self {
            dir,
            bin,
            run_as,
            port,
        };
        cluster.hand_over(cluster.dir.path())?;
        let data = cluster.data();
        cluster.run(
            "initdb",
            &["-D", &data, "-U", "pacegate", "--auth=trust", "-E", "UTF8"],
        )?;
        if let Some((cert, key)) = tls {
            cluster.serve_tls(cert, key)?;
        }
        cluster.up()?;
        Ok(cluster)
    }

    /// A streaming standby of `primary` (`pg_basebackup -R`), started on a port of its own:
    /// it answers reads, refuses writes, and replays what the primary commits until it is
    /// promoted ([`Cluster::promote`]).
    pub fn standby_of(primary: &Cluster) -> Result<Self, ClusterError> {
        let dir = tempfile::Builder::new()
            .prefix("pacegate-pg-standby.")
            .tempdir()
            .map_err(io("cannot create a temp dir"))?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(io("cannot find a free port"))?
            .port();
        let standby = Self {
            dir,
            bin: primary.bin.clone(),
            run_as: primary.run_as.clone(),
            port,
        };
        standby.hand_over(standby.dir.path())?;
        let from = primary.port.to_string();
        standby.run(
            "pg_basebackup",
            &[
                "-D",
                &standby.data(),
                "-R",
                "-X",
                "stream",
                "-h",
                "127.0.0.1",
                "-p",
                &from,
                "-U",
                "pacegate",
            ],
        )?;
        standby.up()?;
        Ok(standby)
    }

    /// Promotes a standby: it takes writes from now on.
    pub fn promote(&self) -> Result<(), ClusterError> {
        self.run("pg_ctl", &["-D", &self.data(), "-w", "promote"])
    }

    /// Cuts a standby off from `primary`'s WAL once it has replayed all of it so far: from
    /// now on it learns nothing of what the primary commits, as a standby that lags when its
    /// primary fails. (The tests of failover play that loss with it.)
    pub fn cut_off(&self, primary: &Cluster) -> Result<(), ClusterError> {
        let lsn = primary.psql("SELECT pg_current_wal_lsn()")?;
        self.wait_for(&format!(
            "SELECT pg_last_wal_replay_lsn() >= '{lsn}'::pg_lsn"
        ))?;
        self.psql("ALTER SYSTEM SET primary_conninfo = ''")?;
        self.psql("SELECT pg_reload_conf()")?;
        self.wait_for("SELECT count(*) = 0 FROM pg_stat_wal_receiver")
    }

    /// Runs one statement with `psql`; its output, unaligned.
    pub fn psql(&self, sql: &str) -> Result<String, ClusterError> {
        let port = self.port.to_string();
        let out = self
            .command("psql")
            .args([
                "-h",
                "127.0.0.1",
                "-p",
                &port,
                "-U",
                "pacegate",
                "-d",
                "postgres",
            ])
            .args(["-X", "-At", "-c", sql])
            .output()
            .map_err(io("cannot run psql"))?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
        } else {
            Err(ClusterError::Tool {
                tool: format!("psql -c {sql:?}"),
                output: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
            })
        }
    }

    /// Waits up to 30 s for `sql` to answer true.
    #[expect(
        clippy::disallowed_methods,
        reason = "a blocking thread's wait for a child process, off every runtime"
    )]
    fn wait_for(&self, sql: &str) -> Result<(), ClusterError> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            let answer = self.psql(sql)?;
            if answer == "t" {
                return Ok(());
            }
            if std::time::Instant::now() > deadline {
                return Err(ClusterError::Tool {
                    tool: format!("psql -c {sql:?}"),
                    output: format!("still `{answer}` after 30 s"),
                });
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }

    fn serve_tls(&self, cert: &str, key: &str) -> Result<(), ClusterError> {
        use std::io::Write;
        use std::os::unix::fs::PermissionsExt;
        let data = PathBuf::from(self.data());
        for (file, pem) in [("server.crt", cert), ("server.key", key)] {
            let path = data.join(file);
            std::fs::write(&path, pem).map_err(io(format!("cannot write {file}")))?;
            self.hand_over(&path)?;
            // The server refuses a key that others may read.
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
                .map_err(io(format!("cannot protect {file}")))?;
        }
        std::fs::OpenOptions::new()
            .append(true)
            .open(data.join("postgresql.conf"))
            .and_then(|mut conf| {
                conf.write_all(
                    b"ssl = on\nssl_cert_file = 'server.crt'\nssl_key_file = 'server.key'\n",
                )
            })
            .map_err(io("cannot write postgresql.conf"))
    }

    /// Gives `path` to the server's user, when there is one to give it to.
    fn hand_over(&self, path: &Path) -> Result<(), ClusterError> {
        let Some(user) = &self.run_as else {
            return Ok(());
        };
        let out = Command::new("chown")
            .arg(user)
            .arg(path)
            .output()
            .map_err(io("cannot run chown"))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(ClusterError::Tool {
                tool: "chown".into(),
                output: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
            })
        }
    }

    fn data(&self) -> String {
        self.dir.path().join("data").display().to_string()
    }

    /// The directory that holds the cluster (removed when it is dropped).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    fn command(&self, tool: &str) -> Command {
        let program = self.bin.join(tool);
        let mut cmd = match &self.run_as {
            Some(user) => {
                let mut c = Command::new("runuser");
                c.args(["-u", user, "--"]).arg(&program);
                c
            }
            None => Command::new(&program),
        };
        // A process group of its own: Ctrl-C at a terminal reaches whoever started the
        // cluster, which stops it, and not the server behind its back.
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        cmd
    }

    fn run(&self, tool: &str, args: &[&str]) -> Result<(), ClusterError> {
        let out = self
            .command(tool)
            .args(args)
            .output()
            .map_err(io(format!("cannot run {tool}")))?;
        if out.status.success() {
            return Ok(());
        }
        let mut output = String::from_utf8_lossy(&out.stderr).trim().to_owned();
        if let Ok(log) = std::fs::read_to_string(self.dir.path().join("server.log")) {
            output.push_str("\nserver log:\n");
            output.push_str(log.trim());
        }
        Err(ClusterError::Tool {
            tool: tool.into(),
            output,
        })
    }

    /// Starts the server (again), on the same port.
    pub fn up(&self) -> Result<(), ClusterError> {
        let options = format!(
            "-c listen_addresses=127.0.0.1 -c port={} -c unix_socket_directories={} -c max_connections=300",
            self.port,
            self.dir.path().display()
        );
        let log = self.dir.path().join("server.log").display().to_string();
        self.run(
            "pg_ctl",
            &[
                "-D",
                &self.data(),
                "-l",
                &log,
                "-o",
                &options,
                "-w",
                "-t",
                "60",
                "start",
            ],
        )
    }

    /// Stops the server at once, as a crash or an outage would.
    pub fn down(&self) -> Result<(), ClusterError> {
        self.run(
            "pg_ctl",
            &["-D", &self.data(), "-m", "immediate", "-w", "stop"],
        )
    }

    /// Every process of the server, its postmaster's children included: each works in the
    /// data directory. Read from `/proc`; where that cannot be read, the postmaster alone.
    pub fn pids(&self) -> Vec<u32> {
        let data = std::fs::canonicalize(self.data()).unwrap_or_else(|_| self.data().into());
        let mut pids: Vec<u32> = std::fs::read_dir("/proc")
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
            .filter(|pid| {
                std::fs::read_link(format!("/proc/{pid}/cwd")).is_ok_and(|cwd| cwd == data)
            })
            .collect();
        if pids.is_empty() {
            pids.extend(self.pid());
        }
        pids
    }

    /// The server's process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        let pidfile = std::fs::read_to_string(self.dir.path().join("data/postmaster.pid")).ok()?;
        pidfile.lines().next()?.trim().parse().ok()
    }

    /// The URL of its `postgres` database.
    pub fn url(&self) -> String {
        format!("postgres://pacegate@127.0.0.1:{}/postgres", self.port)
    }
}

impl Drop for Cluster {
    #[expect(
        clippy::disallowed_methods,
        reason = "dropped on a blocking thread (see `demo`), waiting for child processes"
    )]
    fn drop(&mut self) {
        let running = self.pids();
        let _ = self.down();
        // pg_ctl returns once the postmaster is gone; its children may take a moment longer.
        // The temp dir goes with the rest of `self`, once none of them writes to it.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while running
            .iter()
            .any(|pid| std::path::Path::new(&format!("/proc/{pid}")).exists())
            && std::time::Instant::now() < deadline
        {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout == b"0\n")
}

/// The server's own user, or the one `scripts/test` creates where there is none.
fn server_user() -> String {
    let exists = |u: &str| {
        Command::new("id")
            .args(["-u", u])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if exists("postgres") {
        "postgres"
    } else {
        "pacegate-test"
    }
    .to_owned()
}
