//! The dashboard and the alert rules shipped in `docker/`: the rules fire as their unit tests
//! say (`promtool test rules`), every expression parses, and every metric they name is one
//! pacegate exports.

use std::path::{Path, PathBuf};
use std::process::Command;

use pacegate::metrics::Metrics;

fn docker() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("docker")
}

/// Runs promtool, failing loudly where it is missing.
fn promtool(args: &[&str], dir: &Path) -> String {
    let out = Command::new("promtool")
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| {
            panic!("promtool is needed ({e}): scripts/test installs it (Debian: apt-get install prometheus)")
        });
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "promtool {args:?}:\n{text}");
    text
}

/// Every PromQL expression of the dashboard.
fn dashboard_expressions() -> Vec<String> {
    let text = std::fs::read_to_string(docker().join("grafana/dashboards/pacegate.json")).unwrap();
    let dashboard: serde_json::Value = serde_json::from_str(&text).unwrap();
    let exprs: Vec<String> = dashboard["panels"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["targets"].as_array().unwrap().iter())
        .map(|t| t["expr"].as_str().unwrap().to_owned())
        .collect();
    assert!(
        exprs.len() >= 20,
        "the dashboard has {} expressions",
        exprs.len()
    );
    exprs
}

/// Every alert rule's expression.
fn rule_expressions() -> Vec<String> {
    let text = std::fs::read_to_string(docker().join("alerts.yml")).unwrap();
    let mut exprs = Vec::new();
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        let Some(rest) = line.trim_start().strip_prefix("expr:") else {
            continue;
        };
        let mut expr = rest.trim().trim_start_matches(">-").to_owned();
        // A folded expression continues on the lines indented below it.
        while lines
            .peek()
            .is_some_and(|l| l.starts_with("            ") && !l.trim().is_empty())
        {
            expr.push(' ');
            expr.push_str(lines.next().unwrap().trim());
        }
        exprs.push(expr);
    }
    assert_eq!(exprs.len(), 8, "{exprs:?}");
    exprs
}

/// The metric names in an expression.
fn metric_names(expr: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = expr;
    while let Some(at) = rest.find("pacegate_") {
        let name: String = rest[at..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        rest = &rest[at + name.len()..];
        names.push(name);
    }
    names
}

#[test]
fn the_alert_rules_fire_as_their_unit_tests_say() {
    promtool(&["check", "rules", "alerts.yml"], &docker());
    let tested = promtool(&["test", "rules", "alerts.test.yml"], &docker());
    assert!(tested.contains("SUCCESS"), "{tested}");
    // Each alert has a unit test.
    let tests = std::fs::read_to_string(docker().join("alerts.test.yml")).unwrap();
    let rules = std::fs::read_to_string(docker().join("alerts.yml")).unwrap();
    for alert in rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert: "))
    {
        assert!(
            tests.contains(&format!("alertname: {alert}")),
            "{alert} has no unit test"
        );
    }
}

#[test]
fn the_prometheus_config_and_every_dashboard_expression_parse() {
    let dir = tempfile::tempdir().unwrap();
    // The compose file mounts the rules at /etc/prometheus; here they are where they are.
    let config = std::fs::read_to_string(docker().join("prometheus.yml"))
        .unwrap()
        .replace(
            "/etc/prometheus/alerts.yml",
            docker().join("alerts.yml").to_str().unwrap(),
        );
    std::fs::write(dir.path().join("prometheus.yml"), config).unwrap();
    promtool(&["check", "config", "prometheus.yml"], dir.path());
    // Each expression as a recording rule: promtool parses it.
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (i, expr) in dashboard_expressions().iter().enumerate() {
        rules.push_str(&format!(
            "      - record: dashboard:panel_{i}\n        expr: {}\n",
            serde_json::to_string(expr).unwrap()
        ));
    }
    std::fs::write(dir.path().join("dashboard.yml"), rules).unwrap();
    promtool(&["check", "rules", "dashboard.yml"], dir.path());
}

#[test]
fn every_metric_the_dashboard_and_the_rules_name_is_exported() {
    let metrics = Metrics::new(prometheus::Registry::new()).unwrap();
    let exported = metrics.families();
    let known = |name: &str| {
        exported.iter().any(|f| f == name)
            || ["_bucket", "_sum", "_count"].iter().any(|suffix| {
                name.strip_suffix(suffix)
                    .is_some_and(|base| exported.iter().any(|f| f == base))
            })
    };
    let mut named: Vec<String> = dashboard_expressions()
        .iter()
        .chain(&rule_expressions())
        .flat_map(|e| metric_names(e))
        .collect();
    named.sort();
    named.dedup();
    assert!(named.len() >= 20, "{named:?}");
    let unknown: Vec<&String> = named.iter().filter(|n| !known(n)).collect();
    assert!(unknown.is_empty(), "named but not exported: {unknown:?}");
}
