//! Wiring: config -> metrics, TLS, upstream client, proxy, listeners; and the run sequence.
//! The only place that knows how the parts fit together.

use std::net::SocketAddr;
use std::sync::Arc;

use prometheus::Registry;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::admin::Admin;
use crate::budget::{Store, StoreError};
use crate::config::{Config, StoreConfig};
use crate::destination;
use crate::fleet::failover::{Failover, Gauges, Policy};
use crate::fleet::{Fleet, Instance, Solo};
use crate::metrics::Metrics;
use crate::pacing::Pacer;
use crate::proxy::{ClientPolicy, Proxy, ProxyParts};
use crate::reload::Reloader;
use crate::shutdown::{self, Shutdown};
use crate::store::memory::MemoryStore;
use crate::store::postgres::PostgresStore;
use crate::tls::{self, Authority, TlsError};
use crate::upstream::{AddressPolicy, Upstream};

/// Why pacegate could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// A listener could not be bound.
    #[error("cannot listen on {addr} ({what}): {source}")]
    Bind {
        /// Which listener.
        what: &'static str,
        /// The configured address.
        addr: SocketAddr,
        /// The socket error.
        source: std::io::Error,
    },
    /// The CA or upstream roots are unusable.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// Metrics could not be registered.
    #[error("metrics: {0}")]
    Metrics(#[from] prometheus::Error),
    /// The pacing store could not be opened.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A signal handler could not be installed.
    #[error("cannot install the SIGHUP handler: {source}")]
    Signal { source: std::io::Error },
    /// The cache's disk tier cannot be written (a config the host does not allow: exit 64).
    #[error(transparent)]
    CacheDir(#[from] crate::collapse::DiskError),
}

/// A started pacegate: its bound addresses, and the handles to stop it.
pub struct Running {
    /// The proxy listener's address (useful when the config said port 0).
    pub proxy_addr: SocketAddr,
    /// The admin listener's address.
    pub admin_addr: SocketAddr,
    /// The metrics, for in-process inspection.
    pub metrics: Arc<Metrics>,
    shutdown: Shutdown,
    pacer: Arc<Pacer>,
    supervisor: JoinHandle<()>,
    supervisor_stop: CancellationToken,
    grace: std::time::Duration,
    proxy_task: JoinHandle<()>,
    admin_stop: CancellationToken,
    admin_task: JoinHandle<()>,
    /// Present when the config was read from a file.
    reloader: Option<Arc<Reloader>>,
}

impl Running {
    /// Starts the drain without waiting for it.
    pub fn begin_shutdown(&self) {
        self.shutdown.start_drain();
    }

    /// Runs the shutdown sequence: stop accepting, drain, force what is left at the grace
    /// deadline, stop the admin listener. Returns how many tasks were forced.
    pub async fn stop(self) -> usize {
        self.shutdown.start_drain();
        // Requests still waiting for a slot are refused now rather than sent during the drain.
        self.pacer.stop();
        let _ = self.proxy_task.await;
        let forced = self.shutdown.finish(self.grace).await;
        if forced > 0 {
            tracing::warn!(
                forced,
                "shutdown deadline reached; closed connections and tunnels still open"
            );
        }
        self.admin_stop.cancel();
        let _ = self.admin_task.await;
        // Last: the store supervisor removes this instance from the live count, or writes
        // the quota windows a last time.
        self.supervisor_stop.cancel();
        let _ = self.supervisor.await;
        tracing::info!("pacegate stopped");
        forced
    }
}

/// Binds the listeners and starts serving. The CA is created first if the config asks for it.
pub async fn start(config: Config) -> Result<Running, StartError> {
    start_on(config, None).await
}

/// [`start`], on a handle of an embedded store that other pacers in this process share
/// (`MemoryStore::instance`), instead of the store the config names: `pacegate demo` plays a
/// fleet this way where there is no PostgreSQL.
pub async fn start_sharing(config: Config, store: MemoryStore) -> Result<Running, StartError> {
    start_on(config, Some(store)).await
}

async fn start_on(config: Config, shared: Option<MemoryStore>) -> Result<Running, StartError> {
    let metrics = Arc::new(Metrics::new(Registry::new())?);

    let (authority, created) = Authority::load_or_create(&config.tls)?;
    if created {
        tracing::warn!(
            ca_cert = %config.tls.ca_cert.display(),
            ca_key = %config.tls.ca_key.display(),
            "created a new local CA; clients must trust ca_cert: `pacegate ca bundle --config FILE --out bundle.pem`, then SSL_CERT_FILE / REQUESTS_CA_BUNDLE / CURL_CA_BUNDLE = bundle.pem, or NODE_EXTRA_CA_CERTS = ca_cert"
        );
    } else {
        tracing::info!(ca_cert = %config.tls.ca_cert.display(), "loaded local CA");
    }
    for host in authority.outside_constraints(&destination::ca_names(&config.destinations)) {
        tracing::warn!(
            host,
            ca_cert = %config.tls.ca_cert.display(),
            "a configured host is outside the CA's name constraints: clients will refuse the certificates minted for it; create a CA for this config with `pacegate ca init --name-constraints --config FILE`"
        );
    }
    // This instance, made once: lockout records, wait lists and heartbeats name it.
    let me = Instance::new();
    let supervisor_stop = CancellationToken::new();
    // The store's supervisor: the memory store's quota-window writer, or the postgres
    // store's heartbeats and failover.
    type Wired = (Arc<dyn Store>, Arc<dyn Fleet>, JoinHandle<()>);
    let (store, fleet, supervisor): Wired = match (shared, &config.store) {
        // A shared handle writes no state file: its supervisor has nothing to keep.
        (Some(store), _) => (Arc::new(store), Arc::new(Solo), tokio::spawn(async {})),
        (None, StoreConfig::Memory(memory)) => {
            let store = Arc::new(MemoryStore::open(&memory.state_file)?.with_instance(&me.id));
            let supervisor = tokio::spawn(store.clone().keep_state(supervisor_stop.clone()));
            (store, Arc::new(Solo), supervisor)
        }
        (None, StoreConfig::Postgres(postgres)) => {
            let url = &postgres.url;
            let roots = tls::upstream_roots(postgres.ca_file.as_slice())?;
            let store = PostgresStore::with_roots(url, postgres.connections - 1, roots.clone())?
                .with_instance(&me.id)
                .with_statements(postgres.statements)
                .with_reassert(postgres.reassert);
            if postgres.migrate {
                let applied = store.migrate().await?;
                if !applied.is_empty() {
                    tracing::info!(?applied, "applied store migrations");
                }
            } else {
                store.check_schema().await?;
            }
            // A reservation, a heartbeat's chores beside it, and one more: none waits for a
            // connection to open (see `PostgresStore::warm`). Best effort: the pool opens them
            // when asked anyway.
            if let Err(e) = store.warm(3).await {
                tracing::debug!("cannot open the store's connections ahead: {e}");
            }
            // One connection of the configured ones is kept for heartbeats (see Failover).
            let control = PostgresStore::with_roots(url, 1, roots)?
                .with_instance(&me.id)
                .with_statements(postgres.statements);
            let policy = Policy {
                on_unavailable: postgres.on_unavailable,
                instances_hint: postgres.instances_hint,
                divide_for: postgres.divide_for,
                timeout: postgres.timeout,
                // The multi-process tests' negative control (debug builds only).
                hold_back: std::env::var_os("PACEGATE_TEST_NO_HOLD_BACK").is_none(),
            };
            let gauges = Gauges {
                degraded: metrics.store_degraded.clone(),
                instances: metrics.store_instances.clone(),
                held: metrics.store_share_held.clone(),
                alone: metrics.store_share_alone.clone(),
                mismatch: metrics.config_mismatch.clone(),
            };
            let local = MemoryStore::ephemeral().with_instance(&me.id);
            let failover = Arc::new(Failover::new(
                store,
                control,
                local,
                me.clone(),
                policy,
                gauges,
            ));
            let supervisor = tokio::spawn(failover.clone().supervise(supervisor_stop.clone()));
            (failover.clone(), failover, supervisor)
        }
    };
    let pacer = Arc::new(
        Pacer::new(
            &config.destinations,
            config.classes.clone(),
            store,
            metrics.clone(),
            me.id.clone(),
        )
        .with_fleet(fleet.clone()),
    );
    pacer.start().await?;
    // It ends with the pacer's `stop`.
    tokio::spawn(pacer.clone().keep_up());
    let bind = |what: &'static str, addr: SocketAddr| async move {
        let bound = async {
            let listener = TcpListener::bind(addr).await?;
            let local = listener.local_addr()?;
            Ok::<_, std::io::Error>((listener, local))
        };
        bound
            .await
            .map_err(|source| StartError::Bind { what, addr, source })
    };
    let (proxy_listener, proxy_addr) = bind("proxy", config.proxy.listen).await?;
    let (admin_listener, admin_addr) = bind("admin", config.admin.listen).await?;
    let roots = tls::upstream_roots(&config.tls.extra_upstream_roots)?;
    let upstream = Upstream::new(
        &config.upstream,
        AddressPolicy::of(&config, vec![proxy_addr, admin_addr]),
        tls::upstream_client_config(roots)?,
    )
    .with_stall(crate::upstream::stall::Stall {
        after: config.proxy.limits.body_timeout,
        cut: metrics.bodies_cut.with_label_values(&["upstream"]),
        what: "upstream response",
    });

    let collapse = config
        .cache
        .clone()
        .map(|c| crate::collapse::Collapser::new(c, metrics.clone()))
        .transpose()?;
    let shutdown = Shutdown::new();
    let gate = crate::server::Gate::new(&config.proxy.limits);
    let proxy = Proxy::new(ProxyParts {
        policy: arc_swap::ArcSwap::from_pointee(ClientPolicy::of(&config)),
        limits: config.proxy.limits.clone(),
        authority: Arc::new(authority),
        upstream,
        pacer: pacer.clone(),
        metrics: metrics.clone(),
        shutdown: shutdown.clone(),
        gate: gate.clone(),
        collapse: collapse.clone(),
    });
    let proxy_task = tokio::spawn(crate::server::serve(
        proxy_listener,
        proxy.clone(),
        gate,
        config.proxy.limits.clone(),
        config.proxy.clients.clone().map(Arc::from),
        metrics.clone(),
        shutdown.clone(),
    ));
    let admin_stop = CancellationToken::new();
    let reloader = config.file.clone().map(|file| {
        Arc::new(Reloader::new(
            file,
            config.clone(),
            pacer.clone(),
            proxy.clone(),
            metrics.clone(),
        ))
    });
    let admin = Admin::new(
        metrics.clone(),
        pacer.clone(),
        fleet,
        shutdown.clone(),
        &config.admin,
        reloader.clone(),
        collapse,
    );
    let admin_task = tokio::spawn(admin.serve(admin_listener, admin_stop.clone()));
    tracing::info!(
        proxy = %proxy_addr,
        admin = %admin_addr,
        destinations = config.destinations.len(),
        unmatched = ?config.proxy.unmatched,
        "pacegate listening"
    );
    Ok(Running {
        proxy_addr,
        admin_addr,
        metrics,
        shutdown,
        pacer,
        supervisor,
        supervisor_stop,
        grace: config.proxy.shutdown_grace,
        proxy_task,
        admin_stop,
        admin_task,
        reloader,
    })
}

/// Starts pacegate and runs it until SIGINT or SIGTERM, then shuts down gracefully; SIGHUP
/// reloads the config file meanwhile.
pub async fn run(config: Config) -> Result<(), StartError> {
    // Before "listening" is logged: a SIGHUP that follows it must not meet the default
    // action, which ends the process.
    let mut hangups = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
        .map_err(|source| StartError::Signal { source })?;
    let running = start(config).await?;
    let stop = shutdown::signal();
    tokio::pin!(stop);
    loop {
        tokio::select! {
            () = &mut stop => break,
            _ = hangups.recv() => match &running.reloader {
                Some(reloader) => {
                    tracing::info!("SIGHUP: reloading the config file");
                    reloader.reload().await;
                }
                None => tracing::warn!("SIGHUP ignored: the config was not read from a file"),
            },
        }
    }
    tracing::info!("shutdown signal received; draining");
    running.stop().await;
    Ok(())
}
