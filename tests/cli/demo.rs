//! `pacegate demo`, run as a user runs it: what it prints holds (the shared run within the
//! ceiling + 1 in every second and every 1 s window, the control past it), what it writes
//! with `--out` is the arrivals and a chart of both runs, and nothing it started or wrote is
//! left behind, Ctrl-C included.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

/// The demo's rate, and the promise: at most this plus one in any 1 s window.
const CEILING: usize = 10;

/// A demo run in an empty working directory, with an empty temp dir of its own.
struct Sandbox {
    cwd: tempfile::TempDir,
    tmp: tempfile::TempDir,
}

impl Sandbox {
    fn new() -> Self {
        let tmp = tempfile::tempdir().unwrap();
        // As root the database runs as its own user, which must reach its directory in here.
        std::fs::set_permissions(
            tmp.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )
        .unwrap();
        Self {
            cwd: tempfile::tempdir().unwrap(),
            tmp,
        }
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_pacegate"));
        c.arg("demo")
            .args(args)
            .current_dir(self.cwd.path())
            .env("TMPDIR", self.tmp.path())
            .env_remove("PACEGATE_LOG");
        c
    }

    fn run(&self, args: &[&str]) -> (Output, String) {
        let out = self.command(args).output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        (out, stdout)
    }

    /// Nothing is left in the temp dir, and nothing but `keep` in the working directory.
    fn assert_left_nothing(&self, keep: &[&str]) {
        let names = |dir: &Path| -> Vec<String> {
            std::fs::read_dir(dir)
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect()
        };
        assert_eq!(
            names(self.tmp.path()),
            Vec::<String>::new(),
            "left in TMPDIR"
        );
        let mut left = names(self.cwd.path());
        left.sort();
        assert_eq!(left, keep, "left in the working directory");
    }
}

/// The number after `key` on the first line that contains it.
fn number_after(text: &str, line_has: &str, key: &str) -> usize {
    let line = text
        .lines()
        .find(|l| l.contains(line_has))
        .unwrap_or_else(|| panic!("no line with {line_has:?} in:\n{text}"));
    let rest = &line[line
        .find(key)
        .unwrap_or_else(|| panic!("{key:?} in {line}"))
        + key.len()..];
    rest.trim_start()
        .split(|c: char| !c.is_ascii_digit())
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("a number after {key:?} in {line}"))
}

/// Every live line of `run`: the arrivals of that second, over all instances.
fn per_second(text: &str, run: &str) -> Vec<usize> {
    text.lines()
        .filter(|l| l.starts_with(run) && l.contains(" s ") && l.contains('|'))
        .map(|l| number_after(l, run, "="))
        .collect()
}

/// The processes the demo says it stopped, and that every one of them is gone.
fn assert_stopped(text: &str, at_least: usize) {
    let line = text
        .lines()
        .find(|l| l.starts_with("cleaned up:"))
        .unwrap_or_else(|| panic!("no clean-up line in:\n{text}"));
    let inside = &line[line.find('[').unwrap() + 1..line.find(']').unwrap()];
    let pids: Vec<u32> = inside
        .split_whitespace()
        .map(|p| p.parse().unwrap())
        .collect();
    assert!(pids.len() >= at_least, "{line}");
    for pid in pids {
        // A pid taken again since would run something else: only ours count.
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline);
        assert!(
            !cmdline.contains("pacegate") && !cmdline.contains("postgres"),
            "process {pid} is still running: {cmdline}"
        );
    }
}

/// What every demo run prints: the shared run kept the promise in every second and every
/// 1 s window, the control broke it, and the vendor throttled only the control.
fn assert_promise_shown(stdout: &str) {
    let shared = per_second(stdout, "shared");
    let alone = per_second(stdout, "alone");
    assert_eq!(shared.len(), 3, "a line a second for --quick:\n{stdout}");
    assert_eq!(alone.len(), 3, "{stdout}");
    assert!(
        shared.iter().all(|n| *n <= CEILING + 1),
        "shared run past the ceiling in a second: {shared:?}\n{stdout}"
    );
    let shared_worst = number_after(stdout, "shared budget:", "worst 1 s window");
    let alone_worst = number_after(stdout, "pacing alone:", "worst 1 s window");
    assert!(shared_worst <= CEILING + 1, "{stdout}");
    assert!(
        shared_worst >= CEILING - 2,
        "the shared run should come close to the ceiling: {stdout}"
    );
    assert!(
        alone_worst > CEILING + 1,
        "the control must break it: {stdout}"
    );
    assert_eq!(
        number_after(stdout, "shared budget:", "throttles"),
        0,
        "{stdout}"
    );
    assert!(
        number_after(stdout, "pacing alone:", "throttles") > 0,
        "{stdout}"
    );
    assert!(
        stdout.contains("Reproduce: pacegate demo --quick"),
        "{stdout}"
    );
}

/// The most arrivals of `run` in any 1 s window, from the CSV.
fn worst_in_csv(csv: &str, run: &str) -> usize {
    let mut at: Vec<f64> = csv
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split(',').collect();
            (f[0] == run).then(|| f[1].parse().unwrap())
        })
        .collect();
    at.sort_by(f64::total_cmp);
    (0..at.len())
        .map(|i| at[i..].iter().take_while(|t| **t < at[i] + 1.0).count())
        .max()
        .unwrap_or(0)
}

#[test]
fn three_processes_on_one_postgres_hold_the_ceiling_and_the_control_does_not() {
    let sandbox = Sandbox::new();
    let (out, stdout) = sandbox.run(&["--quick", "--out", "out"]);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("3 pacegate processes share one budget in a throwaway PostgreSQL"),
        "{stdout}"
    );
    assert_promise_shown(&stdout);
    // The database (its postmaster and at least one child), three instances for each run.
    assert_stopped(&stdout, 8);
    sandbox.assert_left_nothing(&["out"]);

    // The CSV holds every arrival: the worst windows it gives are the ones printed.
    let out_dir = sandbox.cwd.path().join("out");
    let csv = std::fs::read_to_string(out_dir.join("arrivals.csv")).unwrap();
    assert_eq!(
        worst_in_csv(&csv, "shared"),
        number_after(&stdout, "shared budget:", "worst 1 s window")
    );
    assert_eq!(
        worst_in_csv(&csv, "alone"),
        number_after(&stdout, "pacing alone:", "worst 1 s window")
    );

    // The chart is SVG with both runs as lines, and the ceiling.
    let svg = std::fs::read_to_string(out_dir.join("arrivals.svg")).unwrap();
    let doc = roxmltree::Document::parse(&svg).expect("the chart is well-formed XML");
    assert_eq!(doc.root_element().tag_name().name(), "svg");
    let line_of = |colour: &str| {
        doc.descendants()
            .filter(|n| n.has_tag_name("polyline") && n.attribute("stroke") == Some(colour))
            .map(|n| {
                n.attribute("points")
                    .unwrap_or("")
                    .split_whitespace()
                    .count()
            })
            .max()
            .unwrap_or(0)
    };
    // A step per second: two points per second of each run.
    assert!(line_of("#0000FF") >= 6, "no shared series in the chart");
    assert!(line_of("#FF0000") >= 6, "no control series in the chart");
    let texts: Vec<&str> = doc
        .descendants()
        .filter_map(|n| n.text())
        .map(str::trim)
        .collect();
    for legend in [
        "one shared budget",
        "each instance pacing alone",
        "the ceiling (rate)",
    ] {
        assert!(texts.contains(&legend), "no legend {legend:?}");
    }
}

#[test]
fn without_postgres_three_pacers_in_one_process_share_the_embedded_store() {
    let sandbox = Sandbox::new();
    let (out, stdout) = sandbox.run(&["--quick", "--store", "memory"]);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("3 pacers in this process share one embedded store"),
        "{stdout}"
    );
    assert_promise_shown(&stdout);
    assert!(
        stdout.contains("cleaned up: stopped 0 processes"),
        "{stdout}"
    );
    sandbox.assert_left_nothing(&[]);
}

#[test]
fn ctrl_c_stops_everything_the_demo_started_and_removes_its_files() {
    let sandbox = Sandbox::new();
    let mut child = sandbox
        .command(&["--out", "out"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut stdout = String::new();
    // The shared run under way: the database and the instances are up.
    for line in lines.by_ref() {
        let line = line.unwrap();
        stdout.push_str(&line);
        stdout.push('\n');
        if line.starts_with("shared") && line.contains(" s ") {
            break;
        }
    }
    assert!(Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap()
        .success());
    for line in lines {
        stdout.push_str(&line.unwrap());
        stdout.push('\n');
    }
    // Bounded: the clean-up waits for nothing longer than a server stop.
    let status = {
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the demo did not stop"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    assert_eq!(status.code(), Some(130), "{stdout}");
    assert!(!stdout.contains("Summary"), "{stdout}");
    // The database (its postmaster and at least one child) and the shared run's three
    // instances.
    assert_stopped(&stdout, 5);
    // Interrupted before its end, it writes no --out.
    sandbox.assert_left_nothing(&[]);
}
