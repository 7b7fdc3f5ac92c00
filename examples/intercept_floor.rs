//! The floor under pacegate's cost per intercepted request: a forward proxy that answers
//! `CONNECT`, terminates TLS inside the tunnel with a leaf for the CONNECT host (minted once
//! from a CA and cached, with pacegate's own `tls::Authority`: rcgen and rustls with ring),
//! serves the requests inside with the hyper server pacegate uses (HTTP/1.1 or h2 by ALPN), and
//! sends each upstream over TLS through the hyper-util pooled client with hyper-rustls, as
//! pacegate does. It does nothing else: no routing, address policy, pacing, verdicts, metrics
//! or request log. What pacegate spends above this over https is its own.
//!
//!     cargo run --release --example intercept_floor -- \
//!         127.0.0.1:3130 ca.pem ca-key.pem upstream-ca.pem
//!
//! Used by `benches/peers.sh` (loopback only). Not a proxy to use: it forwards to any host.

use std::convert::Infallible;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode, Uri};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use pacegate::tls::Authority;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::CertificateDer;

type Body = BoxBody<Bytes, hyper::Error>;
type Upstream = Client<hyper_rustls::HttpsConnector<HttpConnector>, Body>;

#[tokio::main]
async fn main() {
    let mut args = std::env::args().skip(1);
    let mut next = |what: &str| {
        args.next().unwrap_or_else(|| {
            panic!("usage: intercept_floor LISTEN CA_CERT CA_KEY UPSTREAM_CA ({what} missing)")
        })
    };
    let listen = next("LISTEN");
    let (ca_cert, ca_key, upstream_ca) = (
        PathBuf::from(next("CA_CERT")),
        PathBuf::from(next("CA_KEY")),
        PathBuf::from(next("UPSTREAM_CA")),
    );
    let authority = Arc::new(
        Authority::load(&ca_cert, &ca_key, Duration::from_secs(86_400))
            .expect("cannot load the CA"),
    );
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(&upstream_ca).expect("cannot read UPSTREAM_CA") {
        roots
            .add(cert.expect("not a PEM certificate"))
            .expect("not a usable root");
    }
    let tls = rustls::ClientConfig::builder_with_provider(pacegate::tls::provider())
        .with_safe_default_protocol_versions()
        .expect("protocol versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
    let mut http = HttpConnector::new();
    http.set_nodelay(true);
    http.enforce_http(false);
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_only()
        .enable_all_versions()
        .wrap_connector(http);
    // As pacegate keeps them: up to 256 idle upstream connections per host.
    let client: Upstream = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(256)
        .build(https);
    let listener = tokio::net::TcpListener::bind(&listen)
        .await
        .expect("cannot bind");
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        let (authority, client) = (authority.clone(), client.clone());
        tokio::spawn(async move {
            let service = service_fn(move |req: Request<Incoming>| {
                let (authority, client) = (authority.clone(), client.clone());
                async move { Ok::<_, Infallible>(connect(req, authority, client)) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .with_upgrades()
                .await;
        });
    }
}

fn empty(status: StatusCode) -> Response<Body> {
    let mut response = Response::new(Empty::new().map_err(|never| match never {}).boxed());
    *response.status_mut() = status;
    response
}

/// Answers a CONNECT with 200 and serves the tunnel once hyper hands it over.
fn connect(req: Request<Incoming>, authority: Arc<Authority>, client: Upstream) -> Response<Body> {
    let Some(target) = req
        .uri()
        .authority()
        .cloned()
        .filter(|_| req.method() == Method::CONNECT)
    else {
        return empty(StatusCode::METHOD_NOT_ALLOWED);
    };
    let Ok((config, _)) = authority.server_config(target.host()) else {
        return empty(StatusCode::BAD_GATEWAY);
    };
    tokio::spawn(async move {
        let Ok(upgraded) = hyper::upgrade::on(req).await else {
            return;
        };
        let acceptor = tokio_rustls::TlsAcceptor::from(config);
        let Ok(tls) = acceptor.accept(TokioIo::new(upgraded)).await else {
            return;
        };
        let service = service_fn(move |req: Request<Incoming>| {
            let (client, target) = (client.clone(), target.clone());
            async move { Ok::<_, Infallible>(forward(req, &target, &client).await) }
        });
        let _ = auto::Builder::new(TokioExecutor::new())
            .serve_connection(TokioIo::new(tls), service)
            .await;
    });
    empty(StatusCode::OK)
}

/// Sends one request from inside the tunnel to `target` over TLS.
async fn forward(
    req: Request<Incoming>,
    target: &http::uri::Authority,
    client: &Upstream,
) -> Response<Body> {
    let (mut parts, body) = req.into_parts();
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let Ok(uri) = format!("https://{target}{path}").parse::<Uri>() else {
        return empty(StatusCode::BAD_REQUEST);
    };
    parts.uri = uri;
    parts.version = http::Version::HTTP_11;
    match client
        .request(Request::from_parts(parts, body.boxed()))
        .await
    {
        Ok(response) => response.map(BodyExt::boxed),
        Err(_) => empty(StatusCode::BAD_GATEWAY),
    }
}
