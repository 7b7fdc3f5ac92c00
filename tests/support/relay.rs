//! A TCP relay between pacegate instances and the database, that a scenario can cut (a
//! partition of the instances behind it, while the others keep the store) or make far (each
//! chunk delayed by a one-way time, in order, as across a network hop).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

/// Relays every connection to `to` until cut; while cut, open connections are closed and new
/// ones are closed as soon as they are accepted (the client sees its connection reset or
/// closed, as across a failed link).
pub struct Relay {
    addr: SocketAddr,
    cut: Arc<AtomicBool>,
    /// Bumped at every cut: each relayed pair watches it and closes.
    cuts: watch::Sender<u64>,
    task: tokio::task::JoinHandle<()>,
}

impl Relay {
    /// Listens on a loopback port and relays to `to`.
    pub async fn start(to: SocketAddr) -> Self {
        Self::far(to, Duration::ZERO).await
    }

    /// Listens on a loopback port and relays to `to`, each chunk `one_way` after it was read,
    /// in order, in both directions: a round trip through it takes `2 * one_way` longer.
    pub async fn far(to: SocketAddr, one_way: Duration) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let cut = Arc::new(AtomicBool::new(false));
        let (cuts, _) = watch::channel(0u64);
        let task = {
            let cut = cut.clone();
            let cuts = cuts.clone();
            tokio::spawn(async move {
                loop {
                    let Ok((inbound, _)) = listener.accept().await else {
                        continue;
                    };
                    if cut.load(Ordering::SeqCst) {
                        drop(inbound);
                        continue;
                    }
                    let mut closed = cuts.subscribe();
                    tokio::spawn(async move {
                        let Ok(outbound) = TcpStream::connect(to).await else {
                            return;
                        };
                        let _ = inbound.set_nodelay(true);
                        let _ = outbound.set_nodelay(true);
                        let (in_read, in_write) = inbound.into_split();
                        let (out_read, out_write) = outbound.into_split();
                        tokio::select! {
                            () = pipe(in_read, out_write, one_way) => {}
                            () = pipe(out_read, in_write, one_way) => {}
                            _ = closed.changed() => {}
                        }
                    });
                }
            })
        };
        Self {
            addr,
            cut,
            cuts,
            task,
        }
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Closes every relayed connection and refuses new ones.
    pub fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
        self.cuts.send_modify(|n| *n += 1);
    }

    /// Relays new connections again.
    pub fn restore(&self) {
        self.cut.store(false, Ordering::SeqCst);
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
        self.cut();
    }
}

/// Copies `from` to `to`, each chunk written `delay` after it was read, in order; returns
/// when either side closes.
async fn pipe(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, delay: Duration) {
    let (chunks, mut due) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let reader = async move {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match from.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if chunks
                        .send((Instant::now() + delay, buf[..n].to_vec()))
                        .is_err()
                    {
                        return;
                    }
                }
            }
        }
    };
    let writer = async move {
        while let Some((at, chunk)) = due.recv().await {
            tokio::time::sleep_until(at).await;
            if to.write_all(&chunk).await.is_err() {
                return;
            }
        }
        let _ = to.shutdown().await;
    };
    // The writer delivers what was read before the reader saw the end.
    let writer = tokio::spawn(writer);
    reader.await;
    let _ = writer.await;
}
