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
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Poll, Waker};
use std::time::Duration;

use hyper_util::server::graceful::GracefulConnection;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// Handle shared by every task that must take part in shutdown.
#[derive(Clone, Default)]
pub struct Shutdown {
    drain: CancellationToken,
    /// Set before `drain` is cancelled: what a connection looks at on each of its polls.
    draining: Arc<AtomicBool>,
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
        self.draining.store(true, Ordering::Release);
        self.drain.cancel();
    }

    /// Whether the drain has started.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
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
    // The connection comes boxed and is not moved again: pinned inside this future it would
    // be kept twice (1.5 KiB each) in what every connection's task holds, once as it came and
    // once where it was pinned.
    pub async fn drive<C>(&self, mut conn: Pin<Box<C>>) -> Result<(), C::Error>
    where
        C: GracefulConnection,
    {
        // In order, the connection first: a random order costs a draw at every wake, several
        // a request, and both branches are polled whenever the first is not ready.
        tokio::select! {
            biased;
            res = conn.as_mut() => return res,
            () = self.drain_started() => conn.as_mut().graceful_shutdown(),
        }
        tokio::select! {
            res = conn.as_mut() => res,
            () = self.forced() => Ok(()),
        }
    }

    /// Resolves when the drain starts, like [`Self::draining`], for a connection's task, which
    /// polls it at every wake, several times a request: polling the token's own future takes
    /// two locks, the token's and its waiters', that every connection shares.
    async fn drain_started(&self) {
        quietly(self.drain.cancelled(), |_| self.is_draining()).await;
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

/// Waits for `wait` in a task that is woken many times for other work (a connection's, for
/// its drain and its deadlines): once `wait` has registered the task's waker, a wake leaves it
/// unpolled unless `may_be_done` says it may be ready, or the task's waker has changed.
/// `may_be_done` must turn true before whatever makes `wait` ready wakes the task.
pub async fn quietly<F: Future>(wait: F, may_be_done: impl Fn(&F) -> bool) -> F::Output {
    tokio::pin!(wait);
    let mut registered: Option<Waker> = None;
    std::future::poll_fn(|cx| {
        if registered.as_ref().is_some_and(|w| w.will_wake(cx.waker())) && !may_be_done(&wait) {
            return Poll::Pending;
        }
        // A tokio timer polled when the task has spent its budget registers nothing (it asks
        // for another poll instead): only a poll with budget left counts as registered.
        let had_budget = tokio::task::coop::has_budget_remaining();
        let polled = wait.as_mut().poll(cx);
        if polled.is_pending() && had_budget {
            registered = Some(cx.waker().clone());
        }
        polled
    })
    .await
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

    /// A future that counts its polls and is ready once told.
    struct Counted<'a> {
        polls: &'a std::cell::Cell<u32>,
        ready: &'a std::cell::Cell<bool>,
    }

    impl Future for Counted<'_> {
        type Output = ();
        fn poll(self: std::pin::Pin<&mut Self>, _: &mut std::task::Context<'_>) -> Poll<()> {
            self.polls.set(self.polls.get() + 1);
            if self.ready.get() {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        }
    }

    struct Other;

    impl std::task::Wake for Other {
        fn wake(self: Arc<Self>) {}
    }

    #[test]
    fn a_quiet_wait_is_polled_again_only_when_it_may_be_done_or_the_waker_changed() {
        use std::task::Context;
        let (polls, ready) = (std::cell::Cell::new(0), std::cell::Cell::new(false));
        let wait = quietly(
            Counted {
                polls: &polls,
                ready: &ready,
            },
            |c| c.ready.get(),
        );
        let mut wait = std::pin::pin!(wait);
        let registered = Waker::from(Arc::new(Other));
        let mut same = Context::from_waker(&registered);
        for _ in 0..5 {
            assert!(wait.as_mut().poll(&mut same).is_pending());
        }
        assert_eq!(polls.get(), 1, "polled again with the waker it registered");
        let other = Waker::from(Arc::new(Other));
        let mut other = Context::from_waker(&other);
        assert!(wait.as_mut().poll(&mut other).is_pending());
        assert!(wait.as_mut().poll(&mut other).is_pending());
        assert_eq!(polls.get(), 2, "a new waker is registered, once");
        ready.set(true);
        assert!(wait.as_mut().poll(&mut other).is_ready());
        assert_eq!(polls.get(), 3);
    }

    #[tokio::test(start_paused = true)]
    async fn a_quiet_sleep_first_polled_with_the_task_s_budget_spent_still_fires() {
        let sleep = quietly(
            tokio::time::sleep(Duration::from_secs(1)),
            tokio::time::Sleep::is_elapsed,
        );
        let mut sleep = std::pin::pin!(sleep);
        std::future::poll_fn(|cx| {
            // A connection's task may spend its budget on its socket before its deadline.
            while let Poll::Ready(spent) = tokio::task::coop::poll_proceed(cx) {
                spent.made_progress();
            }
            assert!(sleep.as_mut().poll(cx).is_pending());
            Poll::Ready(())
        })
        .await;
        tokio::time::timeout(Duration::from_secs(5), sleep)
            .await
            .expect("the sleep never fired");
    }

    #[tokio::test]
    async fn the_drain_reaches_a_connection_woken_many_times_before_it() {
        let shutdown = Shutdown::new();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<()>();
        let s = shutdown.clone();
        // A connection's task: woken for its work many times, its drain wait among the rest.
        let task = tokio::spawn(async move {
            let drained = s.drain_started();
            tokio::pin!(drained);
            let mut wakes = 0;
            loop {
                tokio::select! {
                    () = &mut drained => return wakes,
                    Some(()) = rx.recv() => wakes += 1,
                }
            }
        });
        for _ in 0..100 {
            tx.send(()).unwrap();
            tokio::task::yield_now().await;
        }
        shutdown.start_drain();
        let wakes = tokio::time::timeout(Duration::from_secs(10), task)
            .await
            .expect("the drain did not reach the task")
            .unwrap();
        assert!(wakes > 0);
    }

    #[tokio::test(start_paused = true)]
    async fn finish_returns_at_once_when_nothing_runs() {
        let shutdown = Shutdown::new();
        let before = tokio::time::Instant::now();
        assert_eq!(shutdown.finish(Duration::from_secs(30)).await, 0);
        assert_eq!(before.elapsed(), Duration::ZERO);
    }
}
