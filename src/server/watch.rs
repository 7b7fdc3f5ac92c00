//! The deadlines of a served connection, but for HTTP/2's pings (hyper's): the wait for a
//! client's first byte, an HTTP/1 request head (`header_read_timeout`), idle time with no
//! request in flight, and a response write that the client does not read.
//!
//! Idle time counts from the end of the last request (or the first byte), not from the last
//! byte: an HTTP/2 client answers the server's pings and sends settings and window updates
//! while it has nothing to ask, and none of that is a reason to keep its connection. On
//! HTTP/1 the next head is due within `header_read_timeout` of the last request's end, so a
//! kept-alive HTTP/1 connection idles at most that long (or `idle_timeout`, if shorter).
//! The head's deadline is kept here and not by hyper, which arms a timer of its own (an
//! allocation and two visits to the timer wheel) for every request; the watch's one timer
//! serves the connection.
//!
//! [`Watched`] wraps the connection's stream and notes its first byte and its writes;
//! [`Watch::expired`]
//! resolves when a deadline has passed, and the connection is then dropped. Dropping it drops
//! the requests still attached to it, and with them their upstream connections and permits.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

use crate::config::Limits;
use crate::shutdown::quietly;

/// How an HTTP/2 client's first bytes read (RFC 9113, section 3.4).
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Why a connection was closed by its watch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expired {
    /// The client sent nothing within `header_read_timeout` of connecting.
    Silent,
    /// An HTTP/1 client began a request head and did not finish it within
    /// `header_read_timeout` (or `idle_timeout`, if shorter) of the last request's end.
    Head,
    /// No request in flight for `idle_timeout` (on HTTP/1, `header_read_timeout` if shorter).
    Idle,
}

impl Expired {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Silent => "silent",
            Self::Head => "head",
            Self::Idle => "idle",
        }
    }
}

impl std::fmt::Display for Expired {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Silent => "the client sent nothing within proxy.limits.header_read_timeout",
            Self::Head => {
                "the client did not finish a request head within proxy.limits.header_read_timeout"
            }
            Self::Idle => {
                "no request for proxy.limits.idle_timeout (on HTTP/1.1, header_read_timeout if shorter)"
            }
        })
    }
}

/// One connection's deadlines and what it has been doing; cheap to clone.
#[derive(Clone)]
pub struct Watch {
    inner: Arc<Activity>,
}

struct Activity {
    since: Instant,
    /// Milliseconds after `since` of the first byte, or of the last request's end.
    last_request: AtomicU64,
    first_byte: AtomicBool,
    /// The client spoke HTTP/2 (its first bytes were the preface): no head deadline.
    h2: AtomicBool,
    /// Bytes came with no request in flight since the last one began: a head under way (on
    /// HTTP/1).
    head_begun: AtomicBool,
    in_flight: AtomicUsize,
    header_read_timeout: Duration,
    idle_timeout: Duration,
    write_timeout: Duration,
}

impl Watch {
    /// A watch for a connection opened now.
    pub fn new(limits: &Limits) -> Self {
        Self {
            inner: Arc::new(Activity {
                since: Instant::now(),
                last_request: AtomicU64::new(0),
                first_byte: AtomicBool::new(false),
                h2: AtomicBool::new(false),
                head_begun: AtomicBool::new(false),
                in_flight: AtomicUsize::new(0),
                header_read_timeout: limits.header_read_timeout,
                idle_timeout: limits.idle_timeout,
                write_timeout: limits.write_timeout,
            }),
        }
    }

    /// The connection's stream, watched.
    pub fn io<I>(&self, io: I) -> Watched<I> {
        Watched {
            io,
            watch: self.clone(),
            write_deadline: None,
        }
    }

    /// Marks a request in flight until the returned guard drops (with the response body).
    pub fn request(&self) -> InFlight {
        self.inner.in_flight.fetch_add(1, Ordering::Relaxed);
        self.inner.head_begun.store(false, Ordering::Relaxed);
        // No clock read here: the idle time is looked at only with no request in flight, and
        // the request that ends last marks where it counts from (`InFlight`'s drop).
        InFlight {
            watch: self.clone(),
        }
    }

    /// Notes that the connection did something the idle time counts from.
    fn busy(&self) {
        let ms = u64::try_from(self.inner.since.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.inner.last_request.store(ms, Ordering::Relaxed);
    }

    /// When the connection must end unless something happens first, or `None` while a request
    /// is in flight (its response write has a deadline of its own, and HTTP/2 pings find a
    /// peer that is gone).
    fn deadline(&self) -> Option<(Instant, Expired)> {
        let a = &self.inner;
        if !a.first_byte.load(Ordering::Relaxed) {
            return Some((a.since + a.header_read_timeout, Expired::Silent));
        }
        if a.in_flight.load(Ordering::Relaxed) > 0 {
            return None;
        }
        let last = a.since + Duration::from_millis(a.last_request.load(Ordering::Relaxed));
        if a.h2.load(Ordering::Relaxed) {
            return Some((last + a.idle_timeout, Expired::Idle));
        }
        // HTTP/1: the next head is due, whether or not its first bytes have come.
        let why = if a.head_begun.load(Ordering::Relaxed) {
            Expired::Head
        } else {
            Expired::Idle
        };
        Some((last + a.header_read_timeout.min(a.idle_timeout), why))
    }

    /// Resolves when a deadline has passed with nothing to put it off.
    // Its sleep is polled only once it may have fired ([`quietly`]): the connection's task
    // polls this at every wake, several times a request.
    pub async fn expired(&self) -> Expired {
        loop {
            let sleep = match self.deadline() {
                Some((at, why)) if at <= Instant::now() => return why,
                Some((at, _)) => tokio::time::sleep_until(at),
                // Looked at again after an idle timeout's time: a request in flight then has
                // either ended (and the idle time counts from its end) or still runs.
                None => tokio::time::sleep(self.inner.idle_timeout),
            };
            quietly(sleep, Sleep::is_elapsed).await;
        }
    }
}

/// A request in flight on a watched connection; the connection is not idle while one lives.
pub struct InFlight {
    watch: Watch,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        // Marked before the count drops, so that a watch that sees no request in flight
        // also sees this one's end.
        self.watch.busy();
        self.watch.inner.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A stream whose reads and writes its [`Watch`] sees. A write the client does not take for
/// `write_timeout` fails with `TimedOut`, which ends the connection.
pub struct Watched<I> {
    io: I,
    watch: Watch,
    write_deadline: Option<Pin<Box<Sleep>>>,
}

impl<I> Watched<I> {
    /// Notes a write's outcome. One that cannot proceed has until the deadline set at its
    /// first such poll; one that proceeds clears it.
    fn wrote<T>(
        &mut self,
        result: Poll<io::Result<T>>,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<T>> {
        if result.is_ready() {
            self.write_deadline = None;
            return result;
        }
        let timeout = self.watch.inner.write_timeout;
        let deadline = self
            .write_deadline
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        match deadline.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "the client read nothing of the response for {} (proxy.limits.write_timeout)",
                    humantime::format_duration(timeout)
                ),
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<I: AsyncRead + Unpin> AsyncRead for Watched<I> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let result = Pin::new(&mut self.io).poll_read(cx, buf);
        if !matches!(result, Poll::Ready(Ok(()))) || buf.filled().len() == before {
            return result;
        }
        let a = &self.watch.inner;
        if !a.first_byte.load(Ordering::Relaxed) {
            // The first bytes say the protocol, as hyper's builder reads them: HTTP/2 begins
            // with its preface, which clients write at once. A first read too short to tell
            // is taken for HTTP/1, whose deadlines are the stricter.
            let first = &buf.filled()[before..];
            let h2 = first.len() >= 4 && H2_PREFACE.starts_with(&first[..first.len().min(24)]);
            a.h2.store(h2, Ordering::Relaxed);
            // The idle time, and an HTTP/1 head's, count from here until a request comes.
            self.watch.busy();
            a.first_byte.store(true, Ordering::Relaxed);
        }
        if a.in_flight.load(Ordering::Relaxed) == 0 && !a.head_begun.load(Ordering::Relaxed) {
            a.head_begun.store(true, Ordering::Relaxed);
        }
        result
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for Watched<I> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let result = Pin::new(&mut self.io).poll_write(cx, data);
        self.wrote(result, cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let result = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.wrote(result, cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let result = Pin::new(&mut self.io).poll_flush(cx);
        self.wrote(result, cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};

    fn limits() -> Limits {
        Limits {
            header_read_timeout: Duration::from_secs(2),
            idle_timeout: Duration::from_secs(10),
            write_timeout: Duration::from_secs(5),
            ..Limits::default()
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_client_expires_at_the_header_timeout() {
        let watch = Watch::new(&limits());
        let started = Instant::now();
        assert_eq!(watch.expired().await, Expired::Silent);
        assert_eq!(started.elapsed(), Duration::from_secs(2));
    }

    /// A connection's two ends, the client's and the watched server's.
    type Ends = (DuplexStream, Watched<DuplexStream>);

    fn connected(watch: &Watch) -> Ends {
        let (client, server) = tokio::io::duplex(64);
        (client, watch.io(server))
    }

    #[tokio::test(start_paused = true)]
    async fn bytes_that_are_no_request_do_not_put_the_idle_time_off() {
        let watch = Watch::new(&limits());
        let (mut client, mut server) = connected(&watch);
        let started = Instant::now();
        let chatter = tokio::spawn(async move {
            // An HTTP/2 client: its preface, then a ping's answer every 3 s, both ways, for
            // longer than the idle timeout.
            client.write_all(H2_PREFACE).await.unwrap();
            let mut buf = [0u8; 24];
            server.read_exact(&mut buf).await.unwrap();
            for _ in 0..10 {
                client.write_all(b"PING-ACK").await.unwrap();
                server.read_exact(&mut buf[..8]).await.unwrap();
                server.write_all(b"PING").await.unwrap();
                tokio::time::sleep(Duration::from_secs(3)).await;
            }
        });
        assert_eq!(watch.expired().await, Expired::Idle);
        assert_eq!(started.elapsed(), Duration::from_secs(10));
        chatter.abort();
    }

    /// One request of `secs` on a connection whose client said `first`: when it ended.
    async fn one_request(watch: &Watch, first: &[u8], secs: u64) -> (Instant, Ends) {
        let (mut client, mut server) = connected(watch);
        client.write_all(first).await.unwrap();
        let mut buf = vec![0u8; first.len()];
        server.read_exact(&mut buf).await.unwrap();
        let request = watch.request();
        // A request in flight: neither idle nor a head late.
        let early = tokio::time::timeout(Duration::from_secs(secs), watch.expired()).await;
        assert!(early.is_err(), "expired while a request was in flight");
        drop(request);
        (Instant::now(), (client, server))
    }

    #[tokio::test(start_paused = true)]
    async fn idle_time_counts_from_the_last_request_s_end_and_not_while_one_runs() {
        let watch = Watch::new(&limits());
        let started = Instant::now();
        let (ended, _ends) = one_request(&watch, H2_PREFACE, 60).await;
        assert_eq!(watch.expired().await, Expired::Idle);
        assert_eq!(ended.elapsed(), Duration::from_secs(10));
        assert!(started.elapsed() >= Duration::from_secs(70));
    }

    #[tokio::test(start_paused = true)]
    async fn a_kept_alive_http1_connection_idles_no_longer_than_the_header_timeout() {
        let watch = Watch::new(&limits());
        let (ended, _ends) = one_request(&watch, b"GET ", 60).await;
        assert_eq!(watch.expired().await, Expired::Idle);
        assert_eq!(ended.elapsed(), Duration::from_secs(2));
        // Where the idle timeout is the shorter, it is the one.
        let shorter = Limits {
            idle_timeout: Duration::from_secs(1),
            ..limits()
        };
        let watch = Watch::new(&shorter);
        let (ended, _ends) = one_request(&watch, b"GET ", 5).await;
        assert_eq!(watch.expired().await, Expired::Idle);
        assert_eq!(ended.elapsed(), Duration::from_secs(1));
    }

    #[tokio::test(start_paused = true)]
    async fn an_http1_head_begun_and_not_finished_is_late_at_the_header_timeout() {
        // The first request's head: counted from its first byte.
        let watch = Watch::new(&limits());
        let (mut client, mut server) = connected(&watch);
        tokio::time::sleep(Duration::from_secs(1)).await;
        client
            .write_all(b"GET http://a/ HTTP/1.1\r\nHo")
            .await
            .unwrap();
        let mut buf = [0u8; 8];
        let _ = server.read(&mut buf).await.unwrap();
        let first_byte = Instant::now();
        assert_eq!(watch.expired().await, Expired::Head);
        assert_eq!(first_byte.elapsed(), Duration::from_secs(2));

        // A later one: counted from the last request's end, however its bytes come.
        let watch = Watch::new(&limits());
        let (ended, (mut client, mut server)) = one_request(&watch, b"GET ", 5).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
        client.write_all(b"G").await.unwrap();
        let _ = server.read(&mut buf).await.unwrap();
        assert_eq!(watch.expired().await, Expired::Head);
        assert_eq!(ended.elapsed(), Duration::from_secs(2));
    }

    #[tokio::test(start_paused = true)]
    async fn a_write_the_client_does_not_take_fails_after_the_write_timeout() {
        let watch = Watch::new(&limits());
        let (_client, server) = tokio::io::duplex(16);
        let mut server = watch.io(server);
        let started = Instant::now();
        let err = server.write_all(&[0u8; 64]).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert_eq!(started.elapsed(), Duration::from_secs(5));
    }

    #[tokio::test(start_paused = true)]
    async fn a_write_that_progresses_keeps_its_deadline_fresh() {
        let watch = Watch::new(&limits());
        let (mut client, server) = tokio::io::duplex(16);
        let mut server = watch.io(server);
        let reader = tokio::spawn(async move {
            // Reads 16 bytes every 3 s: slower than the data comes, faster than the deadline.
            let mut total = 0;
            let mut buf = [0u8; 16];
            while total < 64 {
                tokio::time::sleep(Duration::from_secs(3)).await;
                total += client.read(&mut buf).await.unwrap();
            }
        });
        server.write_all(&[0u8; 64]).await.unwrap();
        reader.await.unwrap();
    }
}
