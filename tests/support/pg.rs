//! A PostgreSQL cluster of a test's own, for scenarios that stop and start the database: the
//! throwaway cluster `pacegate demo` uses, failing the test loudly where it cannot start.

use super::testdb::fail;

/// A throwaway cluster on a loopback port; stopped and removed when dropped.
pub struct Cluster(pacegate::demo::cluster::Cluster);

impl Cluster {
    /// Creates and starts a cluster with a `pacegate` superuser and trust authentication.
    pub fn start() -> Self {
        Self(pacegate::demo::cluster::Cluster::start().unwrap_or_else(|e| fail(&e.to_string())))
    }

    /// Like [`Cluster::start`], serving TLS with this certificate and key (PEM).
    pub fn start_tls(cert_pem: &str, key_pem: &str) -> Self {
        Self(
            pacegate::demo::cluster::Cluster::start_tls(cert_pem, key_pem)
                .unwrap_or_else(|e| fail(&e.to_string())),
        )
    }

    /// A streaming standby of `primary`, on a port of its own (see
    /// `pacegate::demo::cluster::Cluster::standby_of`).
    pub fn standby_of(primary: &Cluster) -> Self {
        Self(
            pacegate::demo::cluster::Cluster::standby_of(&primary.0)
                .unwrap_or_else(|e| panic!("{e}")),
        )
    }

    /// Cuts a standby off from `primary`'s WAL once it has replayed it so far (see
    /// `pacegate::demo::cluster::Cluster::cut_off`).
    pub fn cut_off(&self, primary: &Cluster) {
        self.0.cut_off(&primary.0).unwrap_or_else(|e| panic!("{e}"));
    }

    /// Promotes a standby.
    pub fn promote(&self) {
        self.0.promote().unwrap_or_else(|e| panic!("{e}"));
    }

    /// Its loopback port.
    pub fn port(&self) -> u16 {
        self.0.port
    }

    /// Starts the server (again), on the same port.
    pub fn up(&self) {
        self.0.up().unwrap_or_else(|e| panic!("{e}"));
    }

    /// Stops the server at once, as a crash or an outage would.
    pub fn down(&self) {
        self.0.down().unwrap_or_else(|e| panic!("{e}"));
    }

    /// The URL of its `postgres` database.
    pub fn url(&self) -> String {
        self.0.url()
    }
}
