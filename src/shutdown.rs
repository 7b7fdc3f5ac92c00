//! Shutdown as one written sequence.
//!
//! 1. A signal (or the caller) starts the *drain*: listeners stop accepting, every hyper
//!    connection (client connections and intercepted sessions alike) is told to finish its
//!    current requests and close, `/readyz` turns 503.
//! 2. Everything spawned through [`Shutdown::spawn`] is tracked, blind tunnels included (they
//!    escape hyper's own drain). The caller waits for all of it up to the grace deadline.
//! 3. At the deadline the *force* token ends whatever is still open, and the caller logs how
//!    much that was.

use std::future::Future;
use std::time::Duration;

use hyper_util::server::graceful::GracefulConnection;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// Handle shared by every task that must take part in shutdown.
#[derive(Clone, Default)]
pub struct Shutdown {
    drain: CancellationToken,
    force: CancellationToken,
    tracker: TaskTracker,
}

impl Shutdown {
    /// A fresh handle, not draining.
    pub fn new() -> Self {
        Self::default()
    }

    /// Starts the drain (idempotent).
    pub fn start_drain(&self) {
        self.drain.cancel();
    }

    /// Whether the drain has started.
    pub fn is_draining(&self) -> bool {
        self.drain.is_cancelled()
    }

    /// Resolves when the drain starts.
    pub async fn draining(&self) {
        self.drain.cancelled().await;
    }

    /// Resolves when the grace deadline has passed and remaining work must stop.
    pub async fn forced(&self) {
        self.force.cancelled().await;
    }

    /// Spawns a tracked task.
    pub fn spawn<F>(&self, fut: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        self.tracker.spawn(fut);
    }

    /// Drives a hyper connection to completion, switching it to graceful shutdown when the
    /// drain starts and dropping it when the grace deadline passes.
    pub async fn drive<C>(&self, conn: C) -> Result<(), C::Error>
    where
        C: GracefulConnection,
    {
        tokio::pin!(conn);
        tokio::select! {
            res = conn.as_mut() => return res,
            () = self.draining() => conn.as_mut().graceful_shutdown(),
        }
        tokio::select! {
            res = conn.as_mut() => res,
            () = self.forced() => Ok(()),
        }
    }

    /// Waits for every tracked task, up to `grace` after the drain started; then forces the
    /// rest to stop. Returns how many tasks were still running at the deadline.
    pub async fn finish(&self, grace: Duration) -> usize {
        self.start_drain();
        self.tracker.close();
        if tokio::time::timeout(grace, self.tracker.wait())
            .await
            .is_ok()
        {
            return 0;
        }
        let remaining = self.tracker.len();
        self.force.cancel();
        // Forced tasks end at their next poll; give them a moment to run their cleanup.
        let _ = tokio::time::timeout(Duration::from_secs(2), self.tracker.wait()).await;
        remaining
    }
}

/// Resolves on SIGINT or SIGTERM.
pub async fn signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn finish_waits_for_tasks_then_forces_the_rest() {
        let shutdown = Shutdown::new();
        let s = shutdown.clone();
        // A well-behaved task ends when the drain starts.
        shutdown.spawn(async move { s.draining().await });
        let s = shutdown.clone();
        // A stubborn one (a tunnel, say) only ends when forced.
        shutdown.spawn(async move { s.forced().await });
        let remaining = shutdown.finish(Duration::from_secs(5)).await;
        assert_eq!(remaining, 1);
    }

    #[tokio::test(start_paused = true)]
    async fn finish_returns_at_once_when_nothing_runs() {
        let shutdown = Shutdown::new();
        let before = tokio::time::Instant::now();
        assert_eq!(shutdown.finish(Duration::from_secs(30)).await, 0);
        assert_eq!(before.elapsed(), Duration::ZERO);
    }
}
