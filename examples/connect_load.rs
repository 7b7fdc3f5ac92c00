//! A load generator for https through a forward proxy, which wrk cannot do: each of `-c`
//! connections sends `CONNECT` to the proxy, starts TLS inside the tunnel (trusting only
//! `--ca`, the proxy's CA when it intercepts), and then sends GETs one after another on that
//! keep-alive connection for `-d` seconds. Without `--proxy` it connects to the target
//! directly. Prints one line: requests, req/s, p50 and p99 latency, errors.
//!
//!     cargo run --release --example connect_load -- \
//!         --proxy 127.0.0.1:3128 --ca ca.pem --target localhost:8443 --path /1k -c 32 -d 5
//!
//! Used by `benches/peers.sh` (loopback only).

#![allow(
    clippy::disallowed_methods,
    clippy::disallowed_types,
    reason = "measures real time, across processes and threads of its own; clippy.toml's rules are the library's"
)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::Parser;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

#[derive(Parser)]
struct Args {
    /// The forward proxy, host:port; none connects to the target directly.
    #[arg(long)]
    proxy: Option<String>,
    /// PEM roots trusted for the target's certificate (as the proxy presents it).
    #[arg(long)]
    ca: std::path::PathBuf,
    /// The origin, host:port.
    #[arg(long)]
    target: String,
    /// The path requested.
    #[arg(long, default_value = "/")]
    path: String,
    /// Connections, each sending one request at a time.
    #[arg(short = 'c', default_value_t = 32)]
    connections: usize,
    /// Seconds of load.
    #[arg(short = 'd', default_value_t = 5)]
    seconds: u64,
    /// Runtime worker threads.
    #[arg(short = 't', default_value_t = 2)]
    threads: usize,
}

#[derive(Default)]
struct Tally {
    /// Latency of each request that succeeded, in µs.
    latencies: Vec<u32>,
    errors: u64,
}

fn main() {
    let args = Args::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.threads.max(1))
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(run(args));
}

async fn run(args: Args) {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(&args.ca).expect("--ca: a PEM file") {
        roots
            .add(cert.expect("--ca: a certificate"))
            .expect("--ca: a root");
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
    tls.alpn_protocols = vec![b"http/1.1".to_vec()];
    let connector = tokio_rustls::TlsConnector::from(Arc::new(tls));
    let args = Arc::new(args);
    let started = Instant::now();
    let until = started + Duration::from_secs(args.seconds);
    let workers: Vec<_> = (0..args.connections)
        .map(|_| tokio::spawn(worker(args.clone(), connector.clone(), until)))
        .collect();
    let mut all = Tally::default();
    for w in workers {
        let t = w.await.expect("a worker");
        all.latencies.extend(t.latencies);
        all.errors += t.errors;
    }
    let elapsed = started.elapsed().as_secs_f64();
    all.latencies.sort_unstable();
    let pct = |p: f64| {
        all.latencies
            .get(((all.latencies.len().saturating_sub(1)) as f64 * p).round() as usize)
            .map_or(f64::NAN, |us| f64::from(*us) / 1000.0)
    };
    println!(
        "requests {} req/s {:.0} p50 {:.3}ms p99 {:.3}ms errors {}",
        all.latencies.len(),
        all.latencies.len() as f64 / elapsed,
        pct(0.5),
        pct(0.99),
        all.errors
    );
}

/// One connection's requests until `until`; a failed connection is opened again.
async fn worker(args: Arc<Args>, connector: tokio_rustls::TlsConnector, until: Instant) -> Tally {
    let mut tally = Tally::default();
    while Instant::now() < until {
        match session(&args, &connector, until, &mut tally).await {
            Ok(()) => {}
            Err(e) => {
                tally.errors += 1;
                if tally.errors == 1 {
                    eprintln!("connect_load: {e}");
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
    tally
}

type Error = Box<dyn std::error::Error + Send + Sync>;

async fn session(
    args: &Args,
    connector: &tokio_rustls::TlsConnector,
    until: Instant,
    tally: &mut Tally,
) -> Result<(), Error> {
    let mut tcp = TcpStream::connect(args.proxy.as_deref().unwrap_or(&args.target)).await?;
    tcp.set_nodelay(true)?;
    if args.proxy.is_some() {
        let target = &args.target;
        tcp.write_all(format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n").as_bytes())
            .await?;
        // The proxy's answer ends with an empty line; nothing follows it until TLS starts.
        let mut head = Vec::new();
        while !head.ends_with(b"\r\n\r\n") {
            let mut byte = [0u8; 1];
            if tcp.read(&mut byte).await? == 0 {
                return Err("the proxy closed the connection during CONNECT".into());
            }
            head.push(byte[0]);
        }
        let head = String::from_utf8_lossy(&head);
        if !head.starts_with("HTTP/1.1 200") && !head.starts_with("HTTP/1.0 200") {
            return Err(format!("CONNECT refused: {}", head.lines().next().unwrap_or("")).into());
        }
    }
    let host = args
        .target
        .rsplit_once(':')
        .map_or(&*args.target, |(h, _)| h);
    let name = ServerName::try_from(host.to_owned())?;
    let stream = connector.connect(name, tcp).await?;
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake::<_, Empty<Bytes>>(TokioIo::new(stream)).await?;
    tokio::spawn(connection);
    while Instant::now() < until {
        let request = http::Request::get(&args.path)
            .header(http::header::HOST, &args.target)
            .body(Empty::new())?;
        let sent = Instant::now();
        sender.ready().await?;
        let response = sender.send_request(request).await?;
        let status = response.status();
        response.into_body().collect().await?;
        if !status.is_success() {
            tally.errors += 1;
            continue;
        }
        let us = u32::try_from(sent.elapsed().as_micros()).unwrap_or(u32::MAX);
        tally.latencies.push(us);
    }
    Ok(())
}
