//! Test configs built rather than written: a destination with its keys, and a proxy's
//! sections, each key named once. What comes out is the TOML file pacegate reads, so a
//! scenario still goes through the config's parsing and validation.

use std::path::PathBuf;

use toml::Value;

use super::{process, FakeUpstream, TestProxy};

/// One `[destinations.NAME]` section.
#[derive(Debug, Clone)]
pub struct Dest {
    name: String,
    hosts: Vec<String>,
    keys: Vec<(String, String)>,
}

impl Dest {
    /// A destination for `hosts`, with no keys yet (`rate` is required: see [`Dest::rate`]).
    pub fn new(name: &str, hosts: &[&str]) -> Self {
        Self {
            name: name.to_owned(),
            hosts: hosts.iter().map(|h| (*h).to_owned()).collect(),
            keys: Vec::new(),
        }
    }

    /// `local` for `hosts` at a rate no test reaches, reading no verdicts: every status
    /// passes through untouched (forwarding scenarios).
    pub fn forwarding(hosts: &[&str]) -> Self {
        Self::new("local", hosts)
            .rate(100_000.0)
            .key("throttle_statuses", Vec::<i64>::new())
            .key("lockout_statuses", Vec::<i64>::new())
    }

    /// `rate`, requests per second.
    pub fn rate(self, rate: f64) -> Self {
        self.key("rate", rate)
    }

    /// Any other key: `"1s"`, `3`, `true`, `vec![429]`.
    pub fn key(mut self, key: &str, value: impl Into<Value>) -> Self {
        self.keys.push((key.to_owned(), value.into().to_string()));
        self
    }

    /// The section as TOML.
    pub fn toml(&self) -> String {
        let hosts: Vec<String> = self.hosts.iter().map(|h| format!("{h:?}")).collect();
        let mut out = format!(
            "[destinations.{}]\nhosts = [{}]\n",
            self.name,
            hosts.join(", ")
        );
        for (key, value) in &self.keys {
            out.push_str(&format!("{key} = {value}\n"));
        }
        out
    }
}

/// A [`TestProxy`]'s config, key by key: see [`TestProxy::with`].
pub struct Setup {
    upstream_ca: PathBuf,
    proxy: Vec<String>,
    limits: Vec<String>,
    admin: Vec<String>,
    rest: Vec<String>,
}

impl TestProxy {
    /// A proxy trusting `upstream`'s CA, on the test base config (see [`TestProxy::start`]),
    /// to which the builder adds.
    pub fn with(upstream: &FakeUpstream) -> Setup {
        Setup {
            upstream_ca: upstream.ca.cert_path.clone(),
            proxy: Vec::new(),
            limits: Vec::new(),
            admin: Vec::new(),
            rest: Vec::new(),
        }
    }
}

impl Setup {
    /// A key of `[proxy]`.
    pub fn proxy(mut self, key: &str, value: impl Into<Value>) -> Self {
        self.proxy.push(format!("{key} = {}", value.into()));
        self
    }

    /// A key of `[proxy.limits]`.
    pub fn limit(mut self, key: &str, value: impl Into<Value>) -> Self {
        self.limits.push(format!("{key} = {}", value.into()));
        self
    }

    /// A key of `[admin]`.
    pub fn admin(mut self, key: &str, value: impl Into<Value>) -> Self {
        self.admin.push(format!("{key} = {}", value.into()));
        self
    }

    /// A destination.
    pub fn destination(mut self, dest: Dest) -> Self {
        self.rest.push(dest.toml());
        self
    }

    /// Any other section, as TOML.
    pub fn section(mut self, toml: &str) -> Self {
        self.rest.push(toml.to_owned());
        self
    }

    /// The config file's text.
    pub fn toml(&self) -> String {
        let mut proxy = self.proxy.join("\n");
        if !self.limits.is_empty() {
            proxy.push_str("\n[proxy.limits]\n");
            proxy.push_str(&self.limits.join("\n"));
        }
        process::config_text(
            &proxy,
            &self.admin.join("\n"),
            Some(&self.upstream_ca),
            &self.rest.join("\n"),
        )
    }

    /// Starts the proxy on it.
    pub async fn start(self) -> TestProxy {
        super::init();
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(super::CONFIG_FILE), self.toml()).unwrap();
        TestProxy::start_in(dir).await
    }
}
