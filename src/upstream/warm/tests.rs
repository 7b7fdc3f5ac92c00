//! The stash of connections opened ahead, and the send check where it hands them out.

use super::*;

/// A connector that may reach loopback; stashed connections kept 4 s, opening bounded by 5 s.
pub(in crate::upstream) fn warm() -> Warm {
    warm_for(Duration::from_secs(4))
}

/// The pool's call for a connection to `uri`.
fn connection(
    w: &Warm,
    uri: &Uri,
    by: Option<tokio::time::Instant>,
) -> impl Future<Output = Result<Counted, BoxError>> {
    w.connection(key_of(uri).unwrap(), uri.clone(), by)
}

fn warm_for(ttl: Duration) -> Warm {
    warm_with(ttl, Duration::from_secs(5))
}

fn warm_with(ttl: Duration, open_timeout: Duration) -> Warm {
    warm_on(Table::new(ttl, 8), open_timeout)
}

/// A connector that may reach loopback, opening into `table` within `open_timeout`.
pub(in crate::upstream) fn warm_on(table: Arc<Table>, open_timeout: Duration) -> Warm {
    let tls = crate::tls::upstream_client_config(rustls::RootCertStore::empty()).unwrap();
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_all_versions()
        .wrap_connector(Connector::new(true, Duration::from_secs(5)));
    Warm::new(https, table, open_timeout)
}

fn counts(w: &Warm, uri: &Uri) -> Option<(usize, usize, usize, usize)> {
    let hosts = w.shared.table.lock();
    let h = hosts.get(&key_of(uri).unwrap())?;
    Some((
        h.alive,
        h.opening,
        h.requests.waiting.load(std::sync::atomic::Ordering::SeqCst),
        h.stash.len(),
    ))
}

/// A loopback upstream that accepts and keeps every connection; its URI, and the task
/// to abort.
async fn upstream() -> (Uri, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let accepted = tokio::spawn(async move {
        let mut kept = Vec::new();
        while let Ok((s, _)) = listener.accept().await {
            kept.push(s);
        }
    });
    let uri = format!("http://127.0.0.1:{port}/").parse().unwrap();
    (uri, accepted)
}

async fn settled(w: &Warm, uri: &Uri) -> Option<(usize, usize, usize, usize)> {
    for _ in 0..500 {
        if counts(w, uri).is_none_or(|c| c.1 == 0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    counts(w, uri)
}

#[tokio::test]
async fn waiting_requests_get_connections_ahead_and_the_host_is_forgotten_after() {
    let (uri, accepted) = upstream().await;
    let w = warm();
    // Two requests wait: two connections are opened ahead, no more.
    let a = w.expect(&uri);
    let b = w.expect(&uri);
    assert_eq!(settled(&w, &uri).await, Some((2, 0, 2, 2)));
    // The client asks the connector: a stashed one, and nothing new opened for `b`,
    // whose connection is already there.
    let first = connection(&w, &uri, None).await.unwrap();
    drop(a);
    assert_eq!(settled(&w, &uri).await, Some((2, 0, 1, 1)));
    // A request that waits alone beside an open connection opens nothing.
    drop(b);
    let second = connection(&w, &uri, None).await.unwrap();
    let c = w.expect(&uri);
    assert_eq!(settled(&w, &uri).await, Some((2, 0, 1, 0)));
    drop((c, first, second));
    assert_eq!(counts(&w, &uri), None, "an idle host is forgotten");
    assert_eq!(w.opened_ahead(), 2);
    accepted.abort();
}

#[tokio::test]
async fn a_request_counts_as_waiting_then_as_sent_and_the_last_one_answered_forgets_the_host() {
    use std::sync::atomic::Ordering::SeqCst;
    let (uri, accepted) = upstream().await;
    let w = warm();
    let requests = |w: &Warm| {
        w.shared.table.lock().get(&key_of(&uri).unwrap()).map(|h| {
            (
                h.requests.busy.load(SeqCst),
                h.requests.waiting.load(SeqCst),
            )
        })
    };
    let waiting = w.expect(&uri);
    assert_eq!(requests(&w), Some((0, 1)));
    let sent = waiting.sending();
    assert_eq!(requests(&w), Some((1, 0)), "sent: busy, no longer waiting");
    drop(sent);
    assert_eq!(
        requests(&w),
        Some((0, 0)),
        "the connection opened ahead keeps the host"
    );
    let w = warm();
    // Sent without a wait and without a connection of its own yet (the client opens it).
    let (a, b) = (w.sending(&uri), w.sending(&uri));
    assert_eq!(requests(&w), Some((2, 0)));
    drop(a);
    assert_eq!(requests(&w), Some((1, 0)));
    drop(b);
    assert_eq!(requests(&w), None, "nothing left of the host: forgotten");
    accepted.abort();
}

/// An https upstream that accepts and never answers: a TLS handshake with it does not
/// end. Its URI, and the task to abort.
async fn silent_tls() -> (Uri, tokio::task::JoinHandle<()>) {
    let (http, accepted) = upstream().await;
    let uri = format!("https://127.0.0.1:{}/", http.port_u16().unwrap())
        .parse()
        .unwrap();
    (uri, accepted)
}

/// The pool's call for a connection to `uri`, for a request that must be sent by `by`: its
/// error.
async fn refused_by(w: &Warm, uri: &Uri, by: tokio::time::Instant) -> BoxError {
    let call = connection(w, uri, Some(by));
    match tokio::time::timeout(Duration::from_secs(5), call).await {
        Ok(Err(e)) => e,
        Ok(Ok(_)) => panic!("a connection to an upstream that never answers"),
        Err(_) => panic!("still waiting for a connection 5 s on"),
    }
}

#[tokio::test]
async fn no_connection_by_the_send_time_sends_nothing_and_the_connection_goes_on_opening() {
    let (uri, accepted) = silent_tls().await;
    let w = warm();
    let by = tokio::time::Instant::now() + Duration::from_millis(30);
    let err = refused_by(&w, &uri, by).await;
    assert!(err.is::<NoConnectionInTime>(), "{err}");
    assert!(
        tokio::time::Instant::now() >= by,
        "given up before its time"
    );
    assert_eq!(counts(&w, &uri), Some((0, 1, 0, 0)), "still opening");
    // The next request waits for that one, up to its own time, and opens no other.
    let by = tokio::time::Instant::now() + Duration::from_millis(20);
    let err = refused_by(&w, &uri, by).await;
    assert!(err.is::<NoConnectionInTime>(), "{err}");
    assert_eq!(counts(&w, &uri), Some((0, 1, 0, 0)));
    accepted.abort();

    // Where the connection comes: `opened` returns once it is in the stash.
    let (uri, accepted) = upstream().await;
    let a = w.expect(&uri);
    tokio::time::timeout(Duration::from_secs(5), w.opened(&uri))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(counts(&w, &uri), Some((1, 0, 1, 1)));
    drop(a);
    accepted.abort();
}

#[tokio::test]
async fn a_handshake_the_upstream_never_answers_ends_at_the_connect_timeout() {
    let (uri, accepted) = silent_tls().await;
    let w = warm_with(Duration::from_secs(4), Duration::from_millis(50));
    // Opened ahead for a waiting request, and opened by the client itself.
    let a = w.expect(&uri);
    let err = tokio::time::timeout(Duration::from_secs(5), connection(&w, &uri, None))
        .await
        .expect("within the connect timeout")
        .err()
        .unwrap();
    assert!(
        matches!(err.downcast_ref(), Some(ConnectError::Timeout { .. })),
        "{err}"
    );
    assert_eq!(
        settled(&w, &uri).await,
        Some((0, 0, 1, 0)),
        "nothing left opening"
    );
    drop(a);
    accepted.abort();
}

#[tokio::test]
async fn a_stashed_connection_too_old_to_use_counts_for_nothing() {
    let (uri, accepted) = upstream().await;
    let w = warm_for(Duration::from_millis(20));
    let a = w.expect(&uri);
    assert_eq!(settled(&w, &uri).await, Some((1, 0, 1, 1)));
    drop(a);
    tokio::time::sleep(Duration::from_millis(30)).await;
    // The stashed one is too old for the next request: a fresh one is opened for it.
    let b = w.expect(&uri);
    assert_eq!(settled(&w, &uri).await, Some((1, 0, 1, 1)));
    assert_eq!(w.opened_ahead(), 2);
    drop(b);
    accepted.abort();
}
