//! The pool against a loopback HTTP/1.1 upstream that shows what reached it: the connections
//! it accepted and saw closed, and each request's head.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use http_body_util::BodyExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::*;
use crate::upstream::key::key_of;
use crate::upstream::warm::tests::warm_on;

/// A pool and the connections opened ahead for it, on one table: connections unused for
/// `idle` are closed, and at most `max_idle` idle ones are kept per upstream.
fn pool(idle: Duration, max_idle: usize) -> (Pool, Warm) {
    let table = Table::new(idle, max_idle);
    (
        Pool::new(table.clone()),
        warm_on(table, Duration::from_secs(5)),
    )
}

/// What the upstream saw.
#[derive(Default)]
struct Seen {
    accepted: AtomicUsize,
    /// Connections the pool closed (an end of stream read).
    closed: AtomicUsize,
    heads: parking_lot::Mutex<Vec<String>>,
}

/// How the upstream answers.
#[derive(Clone, Copy)]
struct Upstream {
    /// Closes each connection 50 ms after its first answer (once the pool has it back),
    /// without saying so in the answer.
    close_after_one: bool,
    /// Holds each answer until this many requests have arrived.
    hold_for: usize,
}

/// A loopback HTTP/1.1 upstream answering `200 ok` to every request; its URI (`path`
/// appended) and what it saw.
async fn upstream(how: Upstream, path: &str) -> (Uri, Arc<Seen>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let uri = format!("http://{}{path}", listener.local_addr().unwrap())
        .parse()
        .unwrap();
    let seen = Arc::new(Seen::default());
    let s = seen.clone();
    // Met by every `hold_for` requests in turn.
    let all_there = Arc::new(tokio::sync::Barrier::new(how.hold_for));
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            s.accepted.fetch_add(1, Ordering::SeqCst);
            let (s, all_there) = (s.clone(), all_there.clone());
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                loop {
                    match stream.read(&mut byte).await {
                        Ok(1) => head.push(byte[0]),
                        _ => {
                            s.closed.fetch_add(1, Ordering::SeqCst);
                            return;
                        }
                    }
                    if !head.ends_with(b"\r\n\r\n") {
                        continue;
                    }
                    s.heads
                        .lock()
                        .push(String::from_utf8_lossy(&head).into_owned());
                    head.clear();
                    all_there.wait().await;
                    let answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                    if stream.write_all(answer).await.is_err() {
                        return;
                    }
                    if how.close_after_one {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        return;
                    }
                }
            });
        }
    });
    (uri, seen)
}

const KEEPS: Upstream = Upstream {
    close_after_one: false,
    hold_for: 1,
};

/// Answers two requests at once, or none.
const PAIRS: Upstream = Upstream {
    close_after_one: false,
    hold_for: 2,
};

const CLOSES: Upstream = Upstream {
    close_after_one: true,
    hold_for: 1,
};

fn get(uri: &Uri) -> Request<ProxyBody> {
    let body = http_body_util::Empty::new()
        .map_err(|never| match never {})
        .boxed();
    let mut req = Request::new(body);
    *req.uri_mut() = uri.clone();
    req
}

/// Sends `req` and reads the answer to its end.
async fn exchange(pool: &Pool, warm: &Warm, req: Request<ProxyBody>) -> String {
    let response = tokio::time::timeout(
        Duration::from_secs(5),
        pool.send(warm, key_of(req.uri()), req, None),
    )
    .await
    .expect("an answer within 5 s")
    .expect("an answer");
    let body = response.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8_lossy(&body).into_owned()
}

/// Waits, up to 5 s, for `count` to reach `want`.
async fn eventually(count: &AtomicUsize, want: usize, what: &str) {
    for _ in 0..500 {
        if count.load(Ordering::SeqCst) == want {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!(
        "{what}: {} after 5 s, not {want}",
        count.load(Ordering::SeqCst)
    );
}

#[tokio::test]
async fn an_http1_connection_serves_one_request_after_another_in_origin_form_with_a_host() {
    let (uri, seen) = upstream(KEEPS, "/a/b?c=d").await;
    let (pool, warm) = pool(Duration::from_secs(4), 8);
    for _ in 0..3 {
        assert_eq!(exchange(&pool, &warm, get(&uri)).await, "ok");
    }
    let mut named = get(&uri);
    named
        .headers_mut()
        .insert(HOST, HeaderValue::from_static("example.test"));
    assert_eq!(exchange(&pool, &warm, named).await, "ok");
    assert_eq!(seen.accepted.load(Ordering::SeqCst), 1, "one connection");
    let heads = seen.heads.lock().clone();
    let authority = uri.authority().unwrap().as_str();
    for head in &heads[..3] {
        assert!(head.starts_with("GET /a/b?c=d HTTP/1.1\r\n"), "{head}");
        assert!(head.contains(&format!("host: {authority}\r\n")), "{head}");
    }
    assert!(heads[3].contains("host: example.test\r\n"), "{}", heads[3]);
    assert!(!heads[3].contains(authority), "one Host only: {}", heads[3]);
}

#[tokio::test]
async fn requests_at_once_take_a_connection_each_and_the_idle_ones_kept_are_bounded() {
    let (uri, seen) = upstream(PAIRS, "/").await;
    let (pool, warm) = pool(Duration::from_secs(4), 1);
    let (a, b) = tokio::join!(
        exchange(&pool, &warm, get(&uri)),
        exchange(&pool, &warm, get(&uri))
    );
    assert_eq!((a.as_str(), b.as_str()), ("ok", "ok"));
    assert_eq!(seen.accepted.load(Ordering::SeqCst), 2);
    // One upstream keeps one idle connection: the other is closed.
    eventually(&seen.closed, 1, "connections closed").await;
}

#[tokio::test]
async fn an_idle_connection_is_closed_once_it_has_been_idle_for_the_idle_timeout() {
    let (uri, seen) = upstream(KEEPS, "/").await;
    let (pool, warm) = pool(Duration::from_millis(100), 8);
    assert_eq!(exchange(&pool, &warm, get(&uri)).await, "ok");
    eventually(&seen.closed, 1, "connections closed").await;
    assert_eq!(exchange(&pool, &warm, get(&uri)).await, "ok");
    assert_eq!(
        seen.accepted.load(Ordering::SeqCst),
        2,
        "a new one for the next"
    );
    assert!(pool.table.lock().len() <= 1);
}

#[tokio::test]
async fn a_connection_the_upstream_closed_while_idle_is_not_handed_out() {
    let (uri, seen) = upstream(CLOSES, "/").await;
    let (pool, warm) = pool(Duration::from_secs(4), 8);
    for n in 1..=5 {
        assert_eq!(exchange(&pool, &warm, get(&uri)).await, "ok");
        // Back in the pool, then closed by the upstream: once the pool's side has seen the
        // close, the connection is no use.
        let key = key_of(&uri).unwrap();
        let idle_and_closed = || {
            pool.table
                .lock()
                .get(&key)
                .is_some_and(|host| host.idle.len() == 1 && host.idle[0].1.is_closed())
        };
        for _ in 0..500 {
            if idle_and_closed() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(idle_and_closed(), "kept, then closed by the upstream");
        assert_eq!(seen.accepted.load(Ordering::SeqCst), n);
    }
}
