//! A body that stops moving is cut: `[proxy.limits] body_timeout` bounds the time a body
//! may keep its reader waiting for the next bytes, in either direction (an upstream's
//! response, a client's request). Past it the body ends in an error, so that hyper cuts the
//! stream (an HTTP/1.1 response closed without its end, an h2 stream reset), and whatever
//! the body held (a concurrency permit, an upstream connection) is let go with it.
//!
//! The time counts only while the reader waits: a body that the far side does not read (a
//! client that takes its time) is the write timeout's business, not this one's.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use prometheus::IntCounter;
use tokio::time::{Instant, Sleep};

use super::{BoxError, ProxyBody};

/// How long a body may keep its reader waiting, and the counter of those cut.
#[derive(Clone, Debug)]
pub struct Stall {
    /// `[proxy.limits] body_timeout`.
    pub after: Duration,
    /// `pacegate_bodies_cut_total{reason}`, for this direction.
    pub cut: IntCounter,
    /// Which body, for the error: `upstream response` or `client request`.
    pub what: &'static str,
}

/// The error a stalled body ends with.
#[derive(Debug, thiserror::Error)]
#[error("the {what} body sent nothing for {} (proxy.limits.body_timeout)", humantime::format_duration(*.after))]
pub struct BodyStalled {
    what: &'static str,
    after: Duration,
}

impl Stall {
    /// `body`, cut once it keeps its reader waiting longer than [`Stall::after`].
    pub fn bound<B>(&self, body: B) -> ProxyBody
    where
        B: Body<Data = Bytes> + Unpin + Send + Sync + 'static,
        B::Error: Into<BoxError>,
    {
        Bounded {
            body,
            stall: self.clone(),
            waiting: None,
        }
        .boxed()
    }
}

struct Bounded<B> {
    body: B,
    stall: Stall,
    /// Armed when the reader first finds no frame, disarmed by the next frame.
    waiting: Option<Pin<Box<Sleep>>>,
}

impl<B> Body for Bounded<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        match Pin::new(&mut this.body).poll_frame(cx) {
            Poll::Ready(frame) => {
                this.waiting = None;
                Poll::Ready(frame.map(|f| f.map_err(Into::into)))
            }
            Poll::Pending => {
                let after = this.stall.after;
                let timer = this.waiting.get_or_insert_with(|| {
                    Box::pin(tokio::time::sleep_until(Instant::now() + after))
                });
                match timer.as_mut().poll(cx) {
                    Poll::Pending => Poll::Pending,
                    Poll::Ready(()) => {
                        this.stall.cut.inc();
                        this.waiting = None;
                        Poll::Ready(Some(Err(Box::new(BodyStalled {
                            what: this.stall.what,
                            after,
                        }))))
                    }
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::mpsc;

    /// A body whose frames come from a channel.
    struct Channel(mpsc::Receiver<Bytes>);

    impl Body for Channel {
        type Data = Bytes;
        type Error = BoxError;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
            self.0.poll_recv(cx).map(|b| b.map(|b| Ok(Frame::data(b))))
        }
    }

    fn stall() -> Stall {
        Stall {
            after: Duration::from_secs(30),
            cut: IntCounter::new("cut", "cut").unwrap(),
            what: "upstream response",
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_that_sends_nothing_for_the_timeout_is_cut_and_counted_and_one_that_trickles_is_not(
    ) {
        let stall = stall();
        // A byte every 29 s goes on; then nothing for 30 s ends it.
        let (tx, rx) = mpsc::channel(1);
        let mut body = stall.bound(Channel(rx));
        let started = Instant::now();
        let sender = tokio::spawn(async move {
            for _ in 0..3 {
                tokio::time::sleep(Duration::from_secs(29)).await;
                tx.send(Bytes::from_static(b"x")).await.unwrap();
            }
            tokio::time::sleep(Duration::from_secs(3600)).await;
            drop(tx);
        });
        for _ in 0..3 {
            let frame = body.frame().await.unwrap().unwrap();
            assert_eq!(frame.into_data().unwrap(), Bytes::from_static(b"x"));
        }
        let err = body.frame().await.unwrap().unwrap_err();
        assert!(err.to_string().contains("body_timeout"), "{err}");
        assert_eq!(started.elapsed(), Duration::from_secs(3 * 29 + 30));
        assert_eq!(stall.cut.get(), 1);
        sender.abort();
    }
}
