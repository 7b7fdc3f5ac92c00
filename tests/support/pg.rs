//! A PostgreSQL cluster of a test's own, for scenarios that stop and start the database. It
//! is started from the local server binaries, as scripts/test does.

use std::path::{Path, PathBuf};
use std::process::Command;

/// A throwaway cluster on a loopback port; stopped and removed when dropped.
pub struct Cluster {
    dir: tempfile::TempDir,
    bin: PathBuf,
    run_as: Option<String>,
    pub port: u16,
}

fn find_bin() -> PathBuf {
    let on_path = Command::new("sh")
        .args(["-c", "command -v initdb"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()));
    if let Some(dir) = on_path.as_deref().and_then(Path::parent) {
        return dir.to_owned();
    }
    let mut dirs: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.path().join("bin"))
                .collect()
        })
        .unwrap_or_default();
    dirs.sort();
    dirs.into_iter()
        .rev()
        .find(|d| d.join("initdb").exists())
        .expect(
            "PostgreSQL server binaries (initdb, pg_ctl) are needed; scripts/test installs them",
        )
}

impl Cluster {
    /// Creates and starts a cluster with a `pacegate` superuser and trust authentication.
    pub fn start() -> Self {
        Self::start_with(None)
    }

    /// Like [`Cluster::start`], serving TLS with this certificate and key (PEM).
    pub fn start_tls(cert_pem: &str, key_pem: &str) -> Self {
        Self::start_with(Some((cert_pem, key_pem)))
    }

    fn start_with(tls: Option<(&str, &str)>) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let bin = find_bin();
        let root = Command::new("id")
            .arg("-u")
            .output()
            .map(|o| o.stdout == b"0\n")
            .unwrap_or(false);
        // initdb refuses to run as root: use the server's own user, or the one scripts/test
        // creates where there is none.
        let run_as = root.then(|| {
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
        });
        if let Some(user) = &run_as {
            assert!(Command::new("chown")
                .arg(user)
                .arg(dir.path())
                .status()
                .unwrap()
                .success());
        }
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let cluster = Self {
            dir,
            bin,
            run_as,
            port,
        };
        cluster.run(
            "initdb",
            &[
                "-D",
                &cluster.data(),
                "-U",
                "pacegate",
                "--auth=trust",
                "-E",
                "UTF8",
            ],
        );
        if let Some((cert, key)) = tls {
            let data = PathBuf::from(cluster.data());
            std::fs::write(data.join("server.crt"), cert).unwrap();
            std::fs::write(data.join("server.key"), key).unwrap();
            let mut conf = std::fs::OpenOptions::new()
                .append(true)
                .open(data.join("postgresql.conf"))
                .unwrap();
            std::io::Write::write_all(
                &mut conf,
                b"ssl = on\nssl_cert_file = 'server.crt'\nssl_key_file = 'server.key'\n",
            )
            .unwrap();
            for f in ["server.crt", "server.key"] {
                let path = data.join(f);
                if let Some(user) = &cluster.run_as {
                    assert!(Command::new("chown")
                        .arg(user)
                        .arg(&path)
                        .status()
                        .unwrap()
                        .success());
                }
                use std::os::unix::fs::PermissionsExt;
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
            }
        }
        cluster.up();
        cluster
    }

    fn data(&self) -> String {
        self.dir.path().join("data").display().to_string()
    }

    fn run(&self, tool: &str, args: &[&str]) {
        let program = self.bin.join(tool);
        let mut cmd = match &self.run_as {
            Some(user) => {
                let mut c = Command::new("runuser");
                c.args(["-u", user, "--"]).arg(&program);
                c
            }
            None => Command::new(&program),
        };
        let out = cmd.args(args).output().unwrap();
        assert!(
            out.status.success(),
            "{tool} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Starts the server (again), on the same port.
    pub fn up(&self) {
        let options = format!(
            "-c listen_addresses=127.0.0.1 -c port={} -c unix_socket_directories={}",
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
        );
    }

    /// Stops the server at once, as a crash or an outage would.
    pub fn down(&self) {
        self.run(
            "pg_ctl",
            &["-D", &self.data(), "-m", "immediate", "-w", "stop"],
        );
    }

    /// The URL of its `postgres` database.
    pub fn url(&self) -> String {
        format!("postgres://pacegate@127.0.0.1:{}/postgres", self.port)
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let data = self.data();
        let args = ["-D", data.as_str(), "-m", "immediate", "stop"];
        let _ = match &self.run_as {
            Some(user) => Command::new("runuser")
                .args(["-u", user, "--"])
                .arg(self.bin.join("pg_ctl"))
                .args(args)
                .output(),
            None => Command::new(self.bin.join("pg_ctl")).args(args).output(),
        };
    }
}
