//! Arrival times as the kernel saw them. The fake upstream shares two cores with the proxies
//! it measures: a request read when its task next runs may have arrived tens of ms earlier on
//! a loaded machine, and timing recorded then would bunch arrivals that were on the beat. A
//! [`Stamped`] connection asks the kernel for the time each segment it reads was received
//! (`SO_TIMESTAMPNS`), so an arrival is dated when it reached the upstream's socket.

use std::io;
use std::os::fd::AsRawFd;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant, SystemTime};

use nix::sys::socket::{recvmsg, setsockopt, sockopt, ControlMessageOwned, MsgFlags};
use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};
use tokio::net::TcpStream;

/// When the bytes a connection read last were received. An HTTP/1.1 request's head is the
/// last thing read when it is handled (its body is read after), so this dates the request.
#[derive(Clone, Default)]
pub struct LastRead(Arc<Mutex<Option<Instant>>>);

impl LastRead {
    /// When the last read's bytes arrived, never after `now`; `now` if the kernel gave no time.
    pub fn at_or(&self, now: Instant) -> Instant {
        self.0.lock().unwrap().map_or(now, |at| at.min(now))
    }
}

/// A TCP stream that records when what it reads was received.
pub struct Stamped {
    stream: TcpStream,
    last: LastRead,
    control: Vec<u8>,
}

/// Asks the kernel for receive times on `socket` (a listener passes it on to the sockets it
/// accepts). Without them every read is dated when it is handled.
pub fn enable(socket: &impl std::os::fd::AsFd) {
    let _ = setsockopt(socket, sockopt::ReceiveTimestampns, &true);
}

/// Keeps the kernel timestamping TCP segments for the life of this process, and waits (up to
/// 2 s) until it does. The kernel turns timestamping on a moment after the first socket asks
/// and off when the last one closes; a segment received meanwhile carries no time.
pub fn keep_on() {
    static ON: std::sync::OnceLock<(std::net::TcpStream, std::net::TcpStream)> =
        std::sync::OnceLock::new();
    ON.get_or_init(|| {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut from = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (to, _) = listener.accept().unwrap();
        enable(&to);
        let until = Instant::now() + Duration::from_secs(2);
        let mut control = nix::cmsg_space!(nix::sys::time::TimeSpec);
        while Instant::now() < until {
            std::io::Write::write_all(&mut from, b".").unwrap();
            let mut byte = [0u8; 1];
            let mut iov = [io::IoSliceMut::new(&mut byte)];
            let msg = recvmsg::<()>(
                to.as_raw_fd(),
                &mut iov,
                Some(&mut control),
                MsgFlags::empty(),
            )
            .unwrap();
            let stamped = msg
                .cmsgs()
                .is_ok_and(|mut m| m.any(|c| matches!(c, ControlMessageOwned::ScmTimestampns(_))));
            if stamped {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        (from, to)
    });
}

impl Stamped {
    pub fn new(stream: TcpStream) -> (Self, LastRead) {
        enable(&stream);
        let last = LastRead::default();
        let control = nix::cmsg_space!(nix::sys::time::TimeSpec);
        (
            Self {
                stream,
                last: last.clone(),
                control,
            },
            last,
        )
    }
}

/// The kernel's receive time (the realtime clock) on the monotonic clock: as long ago as it
/// was by the realtime clock now.
fn on_monotonic(received: SystemTime) -> Instant {
    let ago = SystemTime::now()
        .duration_since(received)
        .unwrap_or(Duration::ZERO);
    let now = Instant::now();
    now.checked_sub(ago).unwrap_or(now)
}

impl AsyncRead for Stamped {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            ready!(this.stream.poll_read_ready(cx))?;
            let fd = this.stream.as_raw_fd();
            let unfilled = buf.initialize_unfilled();
            let control = &mut this.control;
            let read = this.stream.try_io(Interest::READABLE, || {
                let mut iov = [io::IoSliceMut::new(unfilled)];
                let msg = recvmsg::<()>(fd, &mut iov, Some(control), MsgFlags::empty())
                    .map_err(io::Error::from)?;
                let mut received = None;
                if let Ok(messages) = msg.cmsgs() {
                    for m in messages {
                        if let ControlMessageOwned::ScmTimestampns(t) = m {
                            received = Some(
                                SystemTime::UNIX_EPOCH
                                    + Duration::new(t.tv_sec() as u64, t.tv_nsec() as u32),
                            );
                        }
                    }
                }
                Ok((msg.bytes, received))
            });
            match read {
                Ok((n, received)) => {
                    if n > 0 {
                        *this.last.0.lock().unwrap() = received.map(on_monotonic);
                    }
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                // Readiness was stale; `try_io` cleared it.
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

impl AsyncWrite for Stamped {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}
