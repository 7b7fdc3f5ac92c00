//! A TCP relay between one pacegate instance and the database, that a scenario can cut: a
//! partition of that instance alone, while the others keep the store.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

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
                        let Ok(mut outbound) = TcpStream::connect(to).await else {
                            return;
                        };
                        let mut inbound = inbound;
                        tokio::select! {
                            _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
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
