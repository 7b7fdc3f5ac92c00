//! The module tree has a direction: each module imports only modules below it, so there is no
//! import circle and the leaves (`status`, `class`, `destination`, `config`, `tls`, `metrics`,
//! ...) import nothing above them. This reads every source file and checks each `crate::`
//! path against that order.

use std::path::Path;

/// The library's top modules, lowest first. A module may use those before it in this list.
const LAYERS: &[&str] = &[
    "status",
    "class",
    "headers",
    "log",
    "signals",
    "meter",
    "shutdown",
    "destination",
    "config",
    "tls",
    "metrics",
    "budget",
    "fleet",
    "store",
    "upstream",
    "pacing",
    "collapse",
    "server",
    "proxy",
    "reload",
    "admin",
    "app",
    "demo",
    "cli",
];

/// `(file, module it belongs to, crate:: paths it names)` for every file under `src/`.
fn imports(dir: &Path, out: &mut Vec<(String, String, Vec<String>)>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            imports(&path, out);
            continue;
        }
        // Unit tests wire concrete pieces together, as `app` does (the failover's tests run
        // it over a memory store): they are not part of the module they test's layer.
        if path.file_name().is_some_and(|n| n == "tests.rs") {
            continue;
        }
        let relative = path
            .strip_prefix("src")
            .unwrap()
            .to_string_lossy()
            .to_string();
        let module = relative
            .split(['/', '.'])
            .next()
            .unwrap_or_default()
            .to_owned();
        let text = std::fs::read_to_string(&path).unwrap();
        let mut used = Vec::new();
        for (i, _) in text.match_indices("crate::") {
            let name: String = text[i + "crate::".len()..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            used.push(name);
        }
        out.push((relative, module, used));
    }
}

#[test]
fn no_module_imports_one_above_it() {
    let mut files = Vec::new();
    imports(Path::new("src"), &mut files);
    let rank = |m: &str| LAYERS.iter().position(|l| *l == m);
    let mut upward = Vec::new();
    for (file, module, used) in &files {
        if matches!(module.as_str(), "lib" | "main") {
            continue;
        }
        let own =
            rank(module).unwrap_or_else(|| panic!("{file}: module `{module}` is not in LAYERS"));
        for name in used {
            let Some(theirs) = rank(name) else { continue };
            if theirs > own {
                upward.push(format!("{file} ({module}) uses crate::{name}"));
            }
        }
    }
    upward.sort();
    upward.dedup();
    assert!(
        upward.is_empty(),
        "imports that go up:\n{}",
        upward.join("\n")
    );
}

#[test]
fn every_module_of_the_crate_root_has_a_layer() {
    let lib = std::fs::read_to_string("src/lib.rs").unwrap();
    for line in lib.lines() {
        if let Some(name) = line.strip_prefix("pub mod ") {
            let name = name.trim_end_matches(';');
            assert!(LAYERS.contains(&name), "`{name}` has no place in LAYERS");
        }
    }
}
