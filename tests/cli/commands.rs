//! The command line: shipped configs, bad-config fixtures, CA commands, exit codes.

use crate::support;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn pacegate(args: &[&str]) -> Output {
    pacegate_env(args, &[])
}

fn pacegate_env(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_pacegate"));
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A temp dir holding a CA under the default names (`ca.pem`, `ca-key.pem`).
fn dir_with_ca() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let out = pacegate(&["ca", "init", "--dir", dir.path().to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    dir
}

fn files(dir: &str) -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join(dir);
    let mut out: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .collect();
    out.sort();
    assert!(!out.is_empty(), "no configs in {}", root.display());
    out
}

/// What shipped configs take from the environment.
const SHIPPED_ENV: &[(&str, &str)] = &[
    (
        "PACEGATE_STORE_URL",
        "postgres://pacegate@127.0.0.1:5432/pacegate",
    ),
    ("PACEGATE_PROXY_PASSWORD", "test"),
    ("PACEGATE_ADMIN_TOKEN", "test"),
];

#[test]
fn every_shipped_config_passes_check_config() {
    for config in files("config") {
        let dir = dir_with_ca();
        // shared.toml keeps its CA in ca/ (a volume shared by the replicas).
        let out = pacegate(&[
            "ca",
            "init",
            "--dir",
            dir.path().join("ca").to_str().unwrap(),
        ]);
        assert!(out.status.success());
        let copy = dir.path().join(config.file_name().unwrap());
        std::fs::copy(&config, &copy).unwrap();
        let out = pacegate_env(
            &["check-config", "--config", copy.to_str().unwrap()],
            SHIPPED_ENV,
        );
        assert_eq!(
            out.status.code(),
            Some(0),
            "{}: {}",
            config.display(),
            text(&out.stderr)
        );
        // The normalised output is itself a valid config that normalises to the same text.
        let normalised = dir.path().join("normalised.toml");
        std::fs::write(&normalised, &out.stdout).unwrap();
        let again = pacegate_env(
            &["check-config", "--config", normalised.to_str().unwrap()],
            SHIPPED_ENV,
        );
        assert_eq!(again.status.code(), Some(0), "{}", text(&again.stderr));
        assert_eq!(text(&again.stdout), text(&out.stdout));
    }
}

#[test]
fn each_bad_config_fixture_is_reported_with_its_key_path() {
    for fixture in files("tests/fixtures/bad-config") {
        let content = std::fs::read_to_string(&fixture).unwrap();
        let expected = content
            .lines()
            .next()
            .and_then(|l| l.strip_prefix("# expect: "))
            .unwrap_or_else(|| panic!("{} lacks an `# expect:` line", fixture.display()));
        let dir = dir_with_ca();
        let copy = dir.path().join("config.toml");
        std::fs::write(&copy, &content).unwrap();
        let out = pacegate(&["check-config", "--config", copy.to_str().unwrap()]);
        let stderr = text(&out.stderr);
        assert_eq!(
            out.status.code(),
            Some(64),
            "{}: {stderr}",
            fixture.display()
        );
        assert!(
            stderr.contains(expected),
            "{}: expected `{expected}` in:\n{stderr}",
            fixture.display()
        );
        assert!(
            stderr.contains("has 1 problem(s)"),
            "{}: one mistake, one problem:\n{stderr}",
            fixture.display()
        );
    }
}

#[test]
fn all_problems_are_reported_at_once() {
    let dir = dir_with_ca();
    let config = dir.path().join("config.toml");
    std::fs::write(
        &config,
        "[proxy]\nlisten = \"x\"\ncolour = 1\n[upstream]\nconnect_timeout = 5\n[destinations.a]\nhosts = []\nrate = 0\n[extra]\n",
    )
    .unwrap();
    let out = pacegate(&["check-config", "--config", config.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(64));
    let stderr = text(&out.stderr);
    for path in [
        "proxy.listen:",
        "proxy.colour:",
        "upstream.connect_timeout:",
        "destinations.a.hosts:",
        "destinations.a.rate:",
        "extra:",
    ] {
        assert!(stderr.contains(path), "{path} missing from:\n{stderr}");
    }
}

#[test]
fn ca_init_writes_a_private_key_and_never_overwrites() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("ca");
    let out = pacegate(&["ca", "init", "--dir", target.to_str().unwrap()]);
    assert!(out.status.success());
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(target.join("ca-key.pem"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
    }
    let key = std::fs::read(target.join("ca-key.pem")).unwrap();
    assert!(
        !text(&out.stdout).contains("PRIVATE KEY"),
        "the key is never printed"
    );
    let again = pacegate(&["ca", "init", "--dir", target.to_str().unwrap()]);
    assert_eq!(again.status.code(), Some(1));
    assert!(text(&again.stderr).contains("refusing to overwrite"));
    assert_eq!(std::fs::read(target.join("ca-key.pem")).unwrap(), key);
}

#[test]
fn a_ca_constrained_to_a_config_s_hosts_and_serve_s_warning_outside_them() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("pacegate.toml");
    let write = |hosts: &str| {
        std::fs::write(
            &config,
            format!(
                "[proxy]\nlisten = \"127.0.0.1:0\"\n[admin]\nlisten = \"127.0.0.1:0\"\n[tls]\nca_cert = \"ca/ca.pem\"\nca_key = \"ca/ca-key.pem\"\n[destinations.api]\nhosts = [{hosts}]\nrate = 5\n[destinations.tunnel]\nhosts = [\"blind.example\"]\nrate = 5\nintercept = false\n"
            ),
        )
        .unwrap();
    };
    write("\"api.example.com\", \"*.example.net\"");
    let ca = dir.path().join("ca");
    let args = [
        "ca",
        "init",
        "--dir",
        ca.to_str().unwrap(),
        "--name-constraints",
        "--config",
    ];
    let out = pacegate(&[&args[..], &[config.to_str().unwrap()]].concat());
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("may sign only for: api.example.com, example.net"),
        "{}",
        text(&out.stdout)
    );
    // --name-constraints needs a config.
    let alone = pacegate(&["ca", "init", "--dir", "x", "--name-constraints"]);
    assert_eq!(alone.status.code(), Some(64), "{}", text(&alone.stderr));
    // Serving a host outside the constraints warns at start.
    write("\"api.example.com\", \"other.org\"");
    let serving = support::process::spawn_binary(&config);
    let warned = serving.logs.json().into_iter().find(|l| {
        l["level"] == "WARN"
            && l["message"]
                .as_str()
                .unwrap_or("")
                .contains("outside the CA's name constraints")
    });
    let warned = warned.expect("no warning about the host outside the constraints");
    assert_eq!(warned["host"], "other.org");
}

#[test]
fn ca_bundle_holds_the_system_roots_and_the_ca() {
    let dir = dir_with_ca();
    let config = dir.path().join("pacegate.toml");
    std::fs::write(&config, "").unwrap();
    // Pin the "system" store to one known root, so the bundle's content is exact.
    let system = dir_with_ca();
    let system_root = system.path().join("ca.pem");
    let out_path = dir.path().join("bundle.pem");
    let out = pacegate_env(
        &[
            "ca",
            "bundle",
            "--config",
            config.to_str().unwrap(),
            "--out",
            out_path.to_str().unwrap(),
        ],
        &[
            ("SSL_CERT_FILE", system_root.to_str().unwrap()),
            ("SSL_CERT_DIR", ""),
        ],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let bundle = std::fs::read_to_string(&out_path).unwrap();
    let ca = std::fs::read_to_string(dir.path().join("ca.pem")).unwrap();
    let root = std::fs::read_to_string(&system_root).unwrap();
    assert_eq!(bundle.matches("BEGIN CERTIFICATE").count(), 2);
    assert!(bundle.starts_with(root.trim()));
    assert!(bundle.trim_end().ends_with(ca.trim()));
}

#[test]
fn help_and_exit_codes() {
    for args in [
        &["--help"][..],
        &["serve", "--help"],
        &["check-config", "--help"],
        &["ca", "--help"],
        &["ca", "init", "--help"],
        &["ca", "bundle", "--help"],
    ] {
        let out = pacegate(args);
        assert_eq!(out.status.code(), Some(0), "{args:?}");
        assert!(text(&out.stdout).contains("Usage"), "{args:?}");
    }
    assert_eq!(pacegate(&["bogus"]).status.code(), Some(64));
    assert_eq!(
        pacegate(&["serve"]).status.code(),
        Some(64),
        "missing --config"
    );
    assert_eq!(
        pacegate(&["serve", "--config", "/nonexistent.toml"])
            .status
            .code(),
        Some(64)
    );
    // A runtime failure (the port is taken) is exit 1.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dir = dir_with_ca();
    let config = dir.path().join("pacegate.toml");
    std::fs::write(
        &config,
        format!("[proxy]\nlisten = \"{}\"\n", taken.local_addr().unwrap()),
    )
    .unwrap();
    let out = pacegate(&["serve", "--config", config.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("cannot listen"));
}

#[test]
fn every_config_the_compose_file_mounts_is_shipped_and_checked() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let compose = std::fs::read_to_string(root.join("docker/compose.yaml")).unwrap();
    let mounted: Vec<&str> = compose
        .split_whitespace()
        .filter_map(|w| w.trim_start_matches("- ").split(':').next())
        .filter(|p| p.starts_with("../config/"))
        .collect();
    assert!(!mounted.is_empty(), "compose mounts no config");
    for m in mounted {
        let config = root.join("docker").join(m);
        assert!(config.is_file(), "{m} is mounted but missing");
        let dir = dir_with_ca();
        let out = pacegate(&[
            "ca",
            "init",
            "--dir",
            dir.path().join("ca").to_str().unwrap(),
        ]);
        assert!(out.status.success());
        let copy = dir.path().join("mounted.toml");
        std::fs::copy(&config, &copy).unwrap();
        let out = pacegate_env(
            &["check-config", "--config", copy.to_str().unwrap()],
            SHIPPED_ENV,
        );
        assert_eq!(out.status.code(), Some(0), "{m}: {}", text(&out.stderr));
    }
}

/// `[proxy] threads` sets how many threads serve requests.
#[cfg(target_os = "linux")]
#[test]
fn serve_runs_on_as_many_threads_as_configured() {
    let workers = |pid: u32| {
        std::fs::read_dir(format!("/proc/{pid}/task"))
            .unwrap()
            .filter(|t| {
                let comm = t.as_ref().unwrap().path().join("comm");
                std::fs::read_to_string(comm).is_ok_and(|c| c.trim() == "tokio-rt-worker")
            })
            .count()
    };
    for threads in [1, 3] {
        let served = support::process::Served::start(&format!("threads = {threads}"), None, "");
        assert_eq!(workers(served.instance.child.id()), threads);
    }
}

/// A cache directory pacegate cannot write stops `serve` with exit 64 and its path; `cache
/// purge` names what it removes through the admin listener, and refuses what it cannot name.
#[test]
fn the_cache_directory_is_checked_at_start_and_a_purge_goes_through_the_admin_listener() {
    let dir = tempfile::tempdir().unwrap();
    let blocker = dir.path().join("not-a-directory");
    std::fs::write(&blocker, b"a file").unwrap();
    let cache = |path: &Path| {
        format!(
            "[cache]\nmemory = \"16MiB\"\ndir = \"{}\"\n[destinations.images]\nhosts = [\"localhost\"]\nrate = 5\ncache = true\n",
            path.display()
        )
    };
    let config = dir.path().join("pacegate.toml");
    let unwritable = blocker.join("cache");
    std::fs::write(
        &config,
        support::process::config_text("", "", None, &cache(&unwritable)),
    )
    .unwrap();
    let out = pacegate(&["serve", "--config", config.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(64), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains(&unwritable.display().to_string()),
        "{}",
        text(&out.stderr)
    );

    let cache_dir = dir.path().join("cache");
    let served = support::process::Served::start("", None, &cache(&cache_dir));
    assert!(
        cache_dir.join("tmp").is_dir(),
        "the disk tier is made at start"
    );
    let config = served.dir.path().join("pacegate.toml");
    let admin = format!("http://{}", served.instance.admin);
    let purge = |args: &[&str]| {
        let mut all = vec!["cache", "purge"];
        all.extend_from_slice(args);
        all.extend_from_slice(&["--config", config.to_str().unwrap(), "--admin", &admin]);
        pacegate(&all)
    };
    let out = purge(&["--destination", "images"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout).trim(), "purged 0 kept response(s)");
    let out = purge(&["https://localhost/a.png"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let out = purge(&["--destination", "nowhere"]);
    assert_eq!(out.status.code(), Some(64));
    assert!(text(&out.stderr).contains("no destination named `nowhere`"));
    let out = purge(&["/a.png"]);
    assert_eq!(out.status.code(), Some(64));
    assert!(text(&out.stderr).contains("not an absolute URL"));
}
