//! A destination's groups: which of its requests take a budget of their own, and that
//! budget's keys (its own, else the destination's).

use super::super::file::RawDestination;
use super::{is_plain_name, Validator};
use crate::destination::{Group, Pace};

impl Validator<'_> {
    /// A destination's groups: each a budget of its own, with the destination's keys where it
    /// sets none. What only a destination can say (its hosts, ports, interception) is refused.
    pub(super) fn groups(&mut self, path: &str, d: &RawDestination, pace: &Pace) -> Vec<Group> {
        let raw = d.groups.clone().unwrap_or_default();
        if raw.len() > MAX_GROUPS {
            self.push(
                &format!("{path}.groups"),
                format!("at most {MAX_GROUPS} groups per destination"),
            );
        }
        let mut groups = Vec::new();
        for (name, g) in raw {
            let gpath = format!("{path}.groups.{name}");
            if !is_plain_name(&name) {
                self.push(
                    &gpath,
                    "group names may hold only letters, digits, `_` and `-`",
                );
            }
            for (key, set) in [
                ("hosts", g.hosts.is_some()),
                ("ports", g.ports.is_some()),
                (
                    "allow_private_upstreams",
                    g.allow_private_upstreams.is_some(),
                ),
                ("intercept", g.intercept.is_some()),
                ("groups", g.groups.is_some()),
                ("max_body", g.max_body.is_some()),
            ] {
                if set {
                    self.push(
                        &format!("{gpath}.{key}"),
                        format!("belongs to the destination, not a group: set it in [{path}]"),
                    );
                }
            }
            let paths = g.paths.clone().unwrap_or_default();
            for (i, p) in paths.iter().enumerate() {
                if !p.starts_with('/') || p.len() > 1024 || p.chars().any(char::is_whitespace) {
                    self.push(
                        &format!("{gpath}.paths[{i}]"),
                        format!(
                            "`{p}` is not a path prefix: it starts with `/`, e.g. \"/search/\""
                        ),
                    );
                }
            }
            let methods: Vec<String> = g.methods.clone().unwrap_or_default();
            for (i, m) in methods.iter().enumerate() {
                if http::Method::from_bytes(m.as_bytes()).is_err() || m.is_empty() {
                    self.push(
                        &format!("{gpath}.methods[{i}]"),
                        format!("`{m}` is not an HTTP method"),
                    );
                }
            }
            if paths.is_empty() && methods.is_empty() {
                self.push(
                    &gpath,
                    "needs `paths` or `methods`: which of the destination's requests it takes",
                );
            }
            if let Some(r) = &g.resource {
                if r.is_empty() || r.len() > 128 {
                    self.push(
                        &format!("{gpath}.resource"),
                        "must be the vendor's name for the bucket, 1 to 128 characters",
                    );
                }
            }
            let mut own = self.pace(&gpath, &g.inherit(d));
            own.intercept = pace.intercept;
            let meters = self.meters(&gpath, &g, &own);
            groups.push(Group {
                name,
                // Written as requests are read (`destination::path`).
                paths: paths
                    .iter()
                    .map(|p| crate::destination::path::normalise(p).into_owned())
                    .collect(),
                methods: methods.iter().map(|m| m.to_ascii_uppercase()).collect(),
                resource: g.resource.clone(),
                pace: own,
                meters,
            });
        }
        groups
    }
}

/// The most groups one destination may have.
const MAX_GROUPS: usize = 64;
