//! A fake upstream serving HTTP and HTTPS (HTTP/1.1 and, optionally, h2) on loopback, with a
//! test CA of its own. It answers by path and records every request with its arrival time.
//!
//! Paths: `/status/{code}?h=Name:Value&...` answers that status with those headers;
//! `/echo` streams the request body back; `/bytes/{n}` streams n bytes; `/gated/{n}` streams
//! its first 64 KiB, then the rest once [`FakeUpstream::release`] is called; `/sleep/{ms}`
//! answers after a delay; `/headers` lists the request headers; `/flaky/{n}/{key}` answers 429
//! (with the `h=` headers) to the first n requests for that key, then 200;
//! `/retry-date/{secs}` answers 429 with a `Date` and a `Retry-After` date secs after it;
//! anything else says hello. `/status` also takes `delay={ms}`, `body={text}` (`%20` for a
//! space) and `gzip=1` (the body gzip-encoded). `/window/{n}/{secs}` allows n requests per
//! fixed window of secs seconds (from the first request), counting down in the IETF
//! `RateLimit` fields, and answers 429 past n. `/etag/{tag}` is an entity fresh for a second
//! that answers 304 to its tag; `/cut/{n}/{tag}` declares n bytes of entity `tag` and cuts the
//! first request for it after half of them. `/bytes`, `/gated` and `/cut` take `h=` too.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode, Version};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
use rustls::ServerConfig;
use rustls_pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio::net::TcpListener;
use tokio::sync::Notify;

use super::stamped::{LastRead, Stamped};

type Body = BoxBody<Bytes, Box<dyn std::error::Error + Send + Sync>>;

/// The chunk size of streamed bodies.
pub const CHUNK: usize = 64 * 1024;

/// The byte at offset `i` of every streamed body, so both ends can check content.
pub fn pattern(i: u64) -> u8 {
    (i % 251) as u8
}

/// A CA for the fake upstream, and a leaf for localhost, 127.0.0.1 and ::1.
pub struct TestCa {
    pub dir: tempfile::TempDir,
    pub cert_path: PathBuf,
    /// The leaf (localhost, 127.0.0.1, ::1) and its key, as PEM, for servers other than the
    /// fake upstream (a TLS PostgreSQL).
    pub leaf_pem: String,
    pub key_pem: String,
    leaf: rustls_pki_types::CertificateDer<'static>,
    key_der: Vec<u8>,
}

impl TestCa {
    pub fn new() -> Self {
        let ca_key = KeyPair::generate().unwrap();
        let mut ca_params = CertificateParams::default();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "fake upstream test CA");
        let ca_cert = ca_params.self_signed(&ca_key).unwrap();
        let issuer = Issuer::new(ca_params, ca_key);
        let key = KeyPair::generate().unwrap();
        let mut params =
            CertificateParams::new(vec!["localhost".into(), "127.0.0.1".into(), "::1".into()])
                .unwrap();
        params.use_authority_key_identifier_extension = true;
        let leaf = params.signed_by(&key, &issuer).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let cert_path = dir.path().join("upstream-ca.pem");
        std::fs::write(&cert_path, ca_cert.pem()).unwrap();
        Self {
            dir,
            cert_path,
            leaf_pem: leaf.pem(),
            key_pem: key.serialize_pem(),
            leaf: leaf.der().clone(),
            key_der: key.serialize_der(),
        }
    }

    fn server_config(&self, h2: bool) -> ServerConfig {
        let mut cfg = ServerConfig::builder_with_provider(pacegate::tls::provider())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(
                vec![self.leaf.clone()],
                PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.key_der.clone())),
            )
            .unwrap();
        cfg.alpn_protocols = if h2 {
            vec![b"h2".to_vec(), b"http/1.1".to_vec()]
        } else {
            vec![b"http/1.1".to_vec()]
        };
        cfg
    }
}

/// One request as the upstream saw it.
#[derive(Debug, Clone)]
pub struct Recorded {
    pub method: String,
    pub path: String,
    /// The URI authority (h2) or Host header (HTTP/1.1).
    pub authority: String,
    pub version: Version,
    pub headers: HeaderMap,
    pub tls: bool,
    /// When its head reached the upstream's socket (see [`super::stamped`]).
    pub at: Instant,
}

struct State {
    recorded: Mutex<Vec<Recorded>>,
    flaky: Mutex<std::collections::HashMap<String, u32>>,
    /// `/window`: when the current window started, and the requests in it.
    window: Mutex<Option<(Instant, u64)>>,
    received_bytes: AtomicU64,
    /// Connections accepted, http and https.
    accepted: AtomicU64,
    gate: Notify,
    /// How long a new connection waits before it is served (its TLS handshake too): a slow
    /// upstream or a long way to it.
    slow_start_ms: AtomicU64,
}

impl State {
    async fn slow_start(&self) {
        let ms = self.slow_start_ms.load(Ordering::Relaxed);
        if ms > 0 {
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
    }
}

/// The fake upstream.
pub struct FakeUpstream {
    pub ca: TestCa,
    pub http: SocketAddr,
    pub https: SocketAddr,
    state: Arc<State>,
}

impl FakeUpstream {
    /// Starts with h2 offered over TLS.
    pub async fn start() -> Self {
        Self::start_with(true).await
    }

    /// Starts; `h2` decides whether TLS offers h2 besides HTTP/1.1.
    pub async fn start_with(h2: bool) -> Self {
        Self::start_on("127.0.0.1", h2).await
    }

    /// Starts on loopback address `ip` (any of 127.0.0.0/8): another host for a test that
    /// needs several.
    pub async fn start_on(ip: &str, h2: bool) -> Self {
        super::init();
        let ca = TestCa::new();
        let state = Arc::new(State {
            recorded: Mutex::new(Vec::new()),
            flaky: Mutex::new(std::collections::HashMap::new()),
            window: Mutex::new(None),
            received_bytes: AtomicU64::new(0),
            accepted: AtomicU64::new(0),
            gate: Notify::new(),
            slow_start_ms: AtomicU64::new(0),
        });
        let http_listener = TcpListener::bind((ip, 0)).await.unwrap();
        let https_listener = TcpListener::bind((ip, 0)).await.unwrap();
        super::stamped::keep_on();
        // Every accepted socket has them.
        super::stamped::enable(&http_listener);
        super::stamped::enable(&https_listener);
        let http = http_listener.local_addr().unwrap();
        let https = https_listener.local_addr().unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(ca.server_config(h2)));
        let s = state.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = http_listener.accept().await {
                s.accepted.fetch_add(1, Ordering::SeqCst);
                let _ = stream.set_nodelay(true);
                let s = s.clone();
                tokio::spawn(async move {
                    s.slow_start().await;
                    let (stream, last) = Stamped::new(stream);
                    serve(TokioIo::new(stream), s, false, last).await;
                });
            }
        });
        let s = state.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = https_listener.accept().await {
                s.accepted.fetch_add(1, Ordering::SeqCst);
                let _ = stream.set_nodelay(true);
                let s = s.clone();
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    s.slow_start().await;
                    let (stream, last) = Stamped::new(stream);
                    if let Ok(tls) = acceptor.accept(stream).await {
                        serve(TokioIo::new(tls), s, true, last).await;
                    }
                });
            }
        });
        Self {
            ca,
            http,
            https,
            state,
        }
    }

    /// Every new connection waits this long before it is served (TLS handshake included).
    pub fn slow_start(&self, delay: Duration) {
        self.state
            .slow_start_ms
            .store(delay.as_millis() as u64, Ordering::Relaxed);
    }

    /// `http://127.0.0.1:PORT`.
    pub fn http_url(&self, host: &str) -> String {
        format!("http://{host}:{}", self.http.port())
    }

    /// `https://HOST:PORT`.
    pub fn https_url(&self, host: &str) -> String {
        format!("https://{host}:{}", self.https.port())
    }

    /// Everything recorded so far.
    pub fn recorded(&self) -> Vec<Recorded> {
        self.state.recorded.lock().unwrap().clone()
    }

    /// When each request arrived, in order.
    pub fn arrivals(&self) -> Vec<Instant> {
        let mut at: Vec<Instant> = self.recorded().iter().map(|r| r.at).collect();
        at.sort();
        at
    }

    /// Forgets what was recorded.
    pub fn clear(&self) {
        self.state.recorded.lock().unwrap().clear();
        self.state.received_bytes.store(0, Ordering::SeqCst);
    }

    /// Request body bytes received so far, over all requests.
    pub fn received_bytes(&self) -> u64 {
        self.state.received_bytes.load(Ordering::SeqCst)
    }

    /// Connections accepted so far, http and https.
    pub fn connections(&self) -> u64 {
        self.state.accepted.load(Ordering::SeqCst)
    }

    /// Lets `/gated` responses send the rest of their body.
    pub fn release(&self) {
        self.state.gate.notify_waiters();
    }
}

async fn serve<I>(io: TokioIo<I>, state: Arc<State>, tls: bool, last: LastRead)
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let service = service_fn(move |req| {
        let state = state.clone();
        // Dated when its head reached the socket, not when this task got to it.
        let at = last.at_or(Instant::now());
        async move { Ok::<_, Infallible>(respond(req, state, tls, at).await) }
    });
    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
        .serve_connection(io, service)
        .await;
}

/// `text`, gzip-compressed.
pub fn gzip(text: &[u8]) -> Vec<u8> {
    use std::io::Write;
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(text).unwrap();
    e.finish().unwrap()
}

fn full(status: StatusCode, body: impl Into<Bytes>) -> Response<Body> {
    let mut r = Response::new(
        Full::new(body.into())
            .map_err(|never| match never {})
            .boxed(),
    );
    *r.status_mut() = status;
    r
}

/// A body of `n` pattern bytes, in chunks; after the first chunk it waits for `gate` if given.
fn stream_body(n: u64, gate: Option<Arc<State>>) -> Body {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, Infallible>>(4);
    tokio::spawn(async move {
        let mut sent = 0u64;
        let mut first = true;
        while sent < n {
            let len = CHUNK.min((n - sent) as usize);
            let chunk: Vec<u8> = (sent..sent + len as u64).map(pattern).collect();
            if tx.send(Ok(Frame::data(Bytes::from(chunk)))).await.is_err() {
                return;
            }
            sent += len as u64;
            if first {
                first = false;
                if let Some(state) = &gate {
                    state.gate.notified().await;
                }
            }
        }
    });
    StreamBody::new(tokio_stream_from(rx))
        .map_err(|never| match never {})
        .boxed()
}

fn tokio_stream_from<T: Send + 'static>(
    mut rx: tokio::sync::mpsc::Receiver<T>,
) -> impl futures_util::Stream<Item = T> + Send + 'static {
    futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

async fn respond(
    req: Request<Incoming>,
    state: Arc<State>,
    tls: bool,
    at: Instant,
) -> Response<Body> {
    let path = req
        .uri()
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_owned();
    state.recorded.lock().unwrap().push(Recorded {
        method: req.method().to_string(),
        path: path.clone(),
        authority: req
            .uri()
            .authority()
            .map(ToString::to_string)
            .or_else(|| {
                req.headers()
                    .get("host")
                    .map(|h| h.to_str().unwrap().to_owned())
            })
            .unwrap_or_default(),
        version: req.version(),
        headers: req.headers().clone(),
        tls,
        at,
    });
    let (route, query) = path.split_once('?').unwrap_or((&path, ""));
    let segments: Vec<&str> = route.trim_start_matches('/').split('/').collect();
    if segments[0] == "echo" {
        let counter = state.clone();
        let body = req
            .into_body()
            .map_frame(move |f| {
                if let Some(d) = f.data_ref() {
                    counter
                        .received_bytes
                        .fetch_add(d.len() as u64, Ordering::SeqCst);
                }
                f
            })
            .map_err(Into::into)
            .boxed();
        return Response::new(body);
    }
    let if_none_match = req.headers().get("if-none-match").cloned();
    // Every other route reads the whole request body first.
    let mut body = req.into_body();
    while let Some(Ok(frame)) = body.frame().await {
        if let Some(d) = frame.data_ref() {
            state
                .received_bytes
                .fetch_add(d.len() as u64, Ordering::SeqCst);
        }
    }
    let with_headers = |mut resp: Response<Body>| {
        for pair in query.split('&').filter_map(|kv| kv.strip_prefix("h=")) {
            let (k, v) = pair.split_once(':').unwrap();
            let v = decoded(v);
            resp.headers_mut().append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(&v).unwrap(),
            );
        }
        resp
    };
    match segments.as_slice() {
        ["status", code] => {
            if let Some(ms) = query.split('&').find_map(|kv| kv.strip_prefix("delay=")) {
                tokio::time::sleep(Duration::from_millis(ms.parse().unwrap())).await;
            }
            let status = StatusCode::from_u16(code.parse().unwrap()).unwrap();
            let text = query
                .split('&')
                .find_map(|kv| kv.strip_prefix("body="))
                .map_or_else(|| format!("status {code}\n"), decoded);
            if query.split('&').any(|kv| kv == "gzip=1") {
                let mut resp = full(status, gzip(text.as_bytes()));
                resp.headers_mut()
                    .insert("content-encoding", HeaderValue::from_static("gzip"));
                return with_headers(resp);
            }
            with_headers(full(status, text))
        }
        ["flaky", n, key] => {
            let seen = {
                let mut flaky = state.flaky.lock().unwrap();
                let count = flaky.entry((*key).to_owned()).or_insert(0);
                *count += 1;
                *count
            };
            if seen <= n.parse().unwrap() {
                with_headers(full(StatusCode::TOO_MANY_REQUESTS, "slow down\n"))
            } else {
                full(StatusCode::OK, "finally\n")
            }
        }
        ["retry-date", secs] => {
            let now = std::time::SystemTime::now();
            let later = now + Duration::from_secs(secs.parse().unwrap());
            let mut resp = full(StatusCode::TOO_MANY_REQUESTS, "come back later\n");
            let h = resp.headers_mut();
            h.insert(
                "date",
                HeaderValue::from_str(&httpdate::fmt_http_date(now)).unwrap(),
            );
            h.insert(
                "retry-after",
                HeaderValue::from_str(&httpdate::fmt_http_date(later)).unwrap(),
            );
            resp
        }
        ["window", n, secs] => {
            // A vendor allowing n requests per fixed window of secs, from the first request,
            // saying so in the IETF fields; past n, a 429.
            let (n, secs): (u64, u64) = (n.parse().unwrap(), secs.parse().unwrap());
            let length = Duration::from_secs(secs);
            let (used, left) = {
                let mut w = state.window.lock().unwrap();
                let now = Instant::now();
                let (start, used) = match *w {
                    Some((start, used)) if now - start < length => (start, used + 1),
                    _ => (now, 1),
                };
                *w = Some((start, used));
                (used, length - (now - start))
            };
            let status = if used > n {
                StatusCode::TOO_MANY_REQUESTS
            } else {
                StatusCode::OK
            };
            // Counted on arrival, answered `delay` ms later: a vendor a round trip away.
            if let Some(ms) = query.split('&').find_map(|kv| kv.strip_prefix("delay=")) {
                tokio::time::sleep(Duration::from_millis(ms.parse().unwrap())).await;
            }
            let mut resp = full(status, format!("{used} of {n}\n"));
            let h = resp.headers_mut();
            h.insert(
                "ratelimit-policy",
                HeaderValue::from_str(&format!("\"default\";q={n};w={secs}")).unwrap(),
            );
            h.insert(
                "ratelimit",
                HeaderValue::from_str(&format!(
                    "\"default\";r={};t={}",
                    n.saturating_sub(used),
                    left.as_secs_f64().ceil() as u64
                ))
                .unwrap(),
            );
            resp
        }
        // What an LLM API answers: the request's cost in tokens, in a JSON body's `usage`,
        // or (`usage-stream`) in the last event of a server-sent-event stream; `cut-stream`
        // ends with an error before it says.
        ["usage", n] => {
            let json = format!(
                "{{\"id\":\"c\",\"choices\":[{{\"message\":{{\"content\":\"hi\"}}}}],\"usage\":{{\"prompt_tokens\":1,\"completion_tokens\":{m},\"total_tokens\":{n}}}}}",
                m = n.parse::<u64>().unwrap().saturating_sub(1)
            );
            let mut r = full(StatusCode::OK, json);
            r.headers_mut()
                .insert("content-type", HeaderValue::from_static("application/json"));
            r
        }
        [kind @ ("usage-stream" | "cut-stream"), n] => {
            let mut events: Vec<Result<Frame<Bytes>, Box<dyn std::error::Error + Send + Sync>>> =
                (0..3)
                    .map(|i| {
                        Ok(Frame::data(Bytes::from(format!(
                            "data: {{\"choices\":[{{\"delta\":{{\"content\":\"part {i}\"}}}}]}}\n\n"
                        ))))
                    })
                    .collect();
            if *kind == "usage-stream" {
                events.push(Ok(Frame::data(Bytes::from(format!(
                    "data: {{\"choices\":[],\"usage\":{{\"total_tokens\":{n}}}}}\n\ndata: [DONE]\n\n"
                )))));
            } else {
                events.push(Err("the vendor went away mid-stream".into()));
            }
            // Each event written on its own, so that a cut comes after the head and the
            // first events have gone.
            let (tx, rx) = tokio::sync::mpsc::channel(1);
            tokio::spawn(async move {
                for event in events {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    if tx.send(event).await.is_err() {
                        return;
                    }
                }
            });
            let body = StreamBody::new(tokio_stream_from(rx)).boxed();
            let mut r = Response::new(body);
            r.headers_mut().insert(
                "content-type",
                HeaderValue::from_static("text/event-stream"),
            );
            r
        }
        // An entity tagged `tag`, fresh for a second: a request that names the tag gets a 304.
        ["etag", tag] => {
            let etag = format!("\"{tag}\"");
            let resp = if if_none_match.is_some_and(|v| v.as_bytes() == etag.as_bytes()) {
                full(StatusCode::NOT_MODIFIED, "")
            } else {
                full(StatusCode::OK, format!("entity {tag}\n"))
            };
            let mut resp = with_headers(resp);
            let h = resp.headers_mut();
            h.insert("etag", HeaderValue::from_str(&etag).unwrap());
            h.insert("cache-control", HeaderValue::from_static("max-age=1"));
            resp
        }
        ["bytes", n] => with_headers(Response::new(stream_body(n.parse().unwrap(), None))),
        ["gated", n] => with_headers(Response::new(stream_body(
            n.parse().unwrap(),
            Some(state.clone()),
        ))),
        // n bytes of entity `tag` (a strong `ETag` unless `etag=0`), declared: the first
        // request for the tag is cut after half of them, those after it get them whole.
        ["cut", n, tag] => {
            let n: u64 = n.parse().unwrap();
            let first = {
                let mut seen = state.flaky.lock().unwrap();
                let count = seen.entry(format!("cut/{tag}")).or_insert(0);
                *count += 1;
                *count == 1
            };
            let body = if first {
                let half: Vec<u8> = (0..n / 2).map(pattern).collect();
                let frames: Vec<Result<Frame<Bytes>, Box<dyn std::error::Error + Send + Sync>>> = vec![
                    Ok(Frame::data(Bytes::from(half))),
                    Err("the vendor went away mid-body".into()),
                ];
                let (tx, rx) = tokio::sync::mpsc::channel(1);
                tokio::spawn(async move {
                    for frame in frames {
                        // The half is on its way before the cut.
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        if tx.send(frame).await.is_err() {
                            return;
                        }
                    }
                });
                StreamBody::new(tokio_stream_from(rx)).boxed()
            } else {
                stream_body(n, None)
            };
            let mut resp = with_headers(Response::new(body));
            let h = resp.headers_mut();
            h.insert("content-length", HeaderValue::from(n));
            if !query.split('&').any(|kv| kv == "etag=0") {
                h.insert(
                    "etag",
                    HeaderValue::from_str(&format!("\"{tag}\"")).unwrap(),
                );
            }
            resp
        }
        ["sleep", ms] => {
            tokio::time::sleep(Duration::from_millis(ms.parse().unwrap())).await;
            full(StatusCode::OK, "slept\n")
        }
        ["headers"] => {
            let recorded = state
                .recorded
                .lock()
                .unwrap()
                .last()
                .unwrap()
                .headers
                .clone();
            let mut lines: Vec<String> = recorded
                .iter()
                .map(|(k, v)| format!("{k}: {}", String::from_utf8_lossy(v.as_bytes())))
                .collect();
            lines.sort();
            full(StatusCode::OK, lines.join("\n"))
        }
        _ => {
            let mut r = full(StatusCode::OK, "hello from upstream\n");
            r.headers_mut()
                .insert("content-type", HeaderValue::from_static("text/plain"));
            r
        }
    }
}

/// A query value percent-decoded (`%20`, `%22`, `%23`, ...); a `%` not followed by two hex
/// digits stays as it is.
fn decoded(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(b)) => {
                out.push(b);
                i += 3;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}
