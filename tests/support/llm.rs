//! A fake OpenAI-compatible vendor on loopback: `POST /v1/chat/completions`, charged in
//! tokens against one token bucket (a rate, and a capacity it starts full at; or, started
//! with [`FakeLlm::quota`], a quota of fixed windows), answered 429 when a request costs
//! more than the bucket holds, as the vendor's own limiter does. What a
//! request costs is decided by the vendor, below what a client can know before it is sent:
//! the prompt's bytes / 5, plus half the `max_tokens` asked for.
//!
//! It answers as OpenAI does: a JSON body with `usage`, or (`"stream": true`) a
//! server-sent-event stream whose last chunk before `[DONE]` carries `usage` only where the
//! request asked for it (`stream_options.include_usage`).
//!
//! Started as Anthropic's ([`FakeLlm::anthropic`]), it serves `POST /v1/messages` with input
//! and output tokens limited apart, one bucket each, and answers as Anthropic does: `usage`
//! in a JSON body, or a stream whose `message_start` carries the input tokens and whose last
//! `message_delta` the output tokens.
//!
//! Started as Shopify's ([`FakeLlm::shopify`]), it serves GraphQL at `POST /graphql` from a
//! leaky bucket of points: a query costs the number its text asks for (`first: N`), and one
//! the bucket does not hold is throttled as Shopify throttles, a 200 whose `errors` say
//! `THROTTLED` and whose `extensions.cost` say what the bucket holds.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;

type Body = BoxBody<Bytes, Infallible>;

/// One request as the vendor counted it.
#[derive(Debug, Clone)]
pub struct Charge {
    /// When its head reached the vendor.
    pub at: Instant,
    /// What it cost, in tokens (0 for a request refused).
    pub tokens: u64,
    /// Of which input (the prompt) and output, as Anthropic counts them apart.
    pub input: u64,
    pub output: u64,
    /// What a client estimates it at before it is sent, as pacegate's `openai` cost does:
    /// the body's bytes / 4, plus `max_tokens`.
    pub estimate: u64,
    /// 200, or 429 where the bucket did not hold its cost.
    pub status: u16,
    /// Whether it was a stream, and whether it asked for usage in it.
    pub stream: bool,
    pub asked_usage: bool,
}

struct Bucket {
    rate: f64,
    capacity: f64,
    tokens: f64,
    at: Instant,
    /// A quota instead: `capacity` tokens in each fixed window of this length from the
    /// start, none carried over (`rate` is then 0).
    window: Option<(Duration, Instant)>,
}

impl Bucket {
    fn full(rate: f64, capacity: f64) -> Self {
        Self {
            rate,
            capacity,
            tokens: capacity,
            at: Instant::now(),
            window: None,
        }
    }

    /// A quota of `limit` tokens in each fixed window of `per`, the first starting now.
    fn quota(limit: f64, per: Duration) -> Self {
        Self {
            window: Some((per, Instant::now())),
            ..Self::full(0.0, limit)
        }
    }

    /// Refills the bucket to now (a quota: anew in each window); whether it holds `cost`.
    fn holds(&mut self, cost: f64) -> bool {
        let now = Instant::now();
        if let Some((per, start)) = self.window {
            let nth = |t: Instant| (t - start).as_nanos() / per.as_nanos();
            if nth(now) != nth(self.at) {
                self.tokens = self.capacity;
            }
            self.at = now;
            return self.tokens >= cost;
        }
        let refill = (now - self.at).as_secs_f64() * self.rate;
        self.tokens = (self.tokens + refill).min(self.capacity);
        self.at = now;
        self.tokens >= cost
    }
}

struct State {
    bucket: Mutex<Bucket>,
    /// Anthropic's: the output tokens' bucket (`bucket` is then the input's).
    output: Option<Mutex<Bucket>>,
    /// Shopify's GraphQL: `bucket` holds points.
    graphql: bool,
    charges: Mutex<Vec<Charge>>,
}

impl State {
    fn new(bucket: Bucket, output: Option<Bucket>, graphql: bool) -> Self {
        Self {
            bucket: Mutex::new(bucket),
            output: output.map(Mutex::new),
            graphql,
            charges: Mutex::new(Vec::new()),
        }
    }
}

/// The fake vendor.
pub struct FakeLlm {
    pub addr: SocketAddr,
    state: Arc<State>,
}

impl FakeLlm {
    /// A vendor allowing `rate` tokens a second, with a bucket of `capacity` tokens.
    pub async fn start(rate: f64, capacity: f64) -> Self {
        Self::serve(State::new(Bucket::full(rate, capacity), None, false)).await
    }

    /// A vendor allowing `limit` tokens in each fixed window of `per` (a daily quota, made
    /// short), from when it starts.
    pub async fn quota(limit: f64, per: Duration) -> Self {
        Self::serve(State::new(Bucket::quota(limit, per), None, false)).await
    }

    /// Anthropic's: `input` and `output` tokens a second, each with a bucket of a second's.
    pub async fn anthropic(input: f64, output: f64) -> Self {
        let output = Some(Bucket::full(output, output));
        Self::serve(State::new(Bucket::full(input, input), output, false)).await
    }

    /// Shopify's GraphQL: a bucket of `maximum` points, restored at `restore` a second.
    pub async fn shopify(restore: f64, maximum: f64) -> Self {
        Self::serve(State::new(Bucket::full(restore, maximum), None, true)).await
    }

    async fn serve(state: State) -> Self {
        let state = Arc::new(state);
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        // Requests are dated when their heads reached the socket, not when a busy machine
        // got round to them.
        super::stamped::keep_on();
        super::stamped::enable(&listener);
        let addr = listener.local_addr().unwrap();
        let s = state.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let _ = stream.set_nodelay(true);
                let s = s.clone();
                tokio::spawn(async move {
                    let (stream, last) = super::stamped::Stamped::new(stream);
                    let service = service_fn(move |req| {
                        let s = s.clone();
                        let at = last.at_or(Instant::now());
                        async move { Ok::<_, Infallible>(respond(req, &s, at).await) }
                    });
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Self { addr, state }
    }

    /// `http://localhost:PORT/v1/chat/completions`, or Anthropic's `/v1/messages`.
    pub fn url(&self) -> String {
        let path = match (&self.state.output, self.state.graphql) {
            (_, true) => "/graphql",
            (Some(_), _) => "/v1/messages",
            (None, _) => "/v1/chat/completions",
        };
        format!("http://localhost:{}{path}", self.addr.port())
    }

    /// Every request counted so far, in order of arrival.
    pub fn charges(&self) -> Vec<Charge> {
        let mut c = self.state.charges.lock().unwrap().clone();
        c.sort_by_key(|c| c.at);
        c
    }
}

async fn respond(req: Request<Incoming>, state: &State, at: Instant) -> Response<Body> {
    let body = req.into_body().collect().await.unwrap().to_bytes();
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    if state.graphql {
        return shopify(&json, state, at);
    }
    let max_tokens = json["max_tokens"].as_u64().unwrap_or(16);
    let stream = json["stream"].as_bool().unwrap_or(false);
    let asked_usage = json["stream_options"]["include_usage"]
        .as_bool()
        .unwrap_or(false);
    let prompt = body.len() as u64 / 5;
    let completion = max_tokens / 2;
    let cost = prompt + completion;
    let granted = {
        let mut bucket = state.bucket.lock().unwrap();
        match &state.output {
            // Anthropic's: input and output apart, both or neither.
            Some(output) => {
                let mut output = output.lock().unwrap();
                let both = bucket.holds(prompt as f64) && output.holds(completion as f64);
                if both {
                    bucket.tokens -= prompt as f64;
                    output.tokens -= completion as f64;
                }
                both
            }
            None => {
                let held = bucket.holds(cost as f64);
                if held {
                    bucket.tokens -= cost as f64;
                }
                held
            }
        }
    };
    state.charges.lock().unwrap().push(Charge {
        at,
        tokens: if granted { cost } else { 0 },
        input: if granted { prompt } else { 0 },
        output: if granted { completion } else { 0 },
        estimate: body.len() as u64 / 4 + max_tokens,
        status: if granted { 200 } else { 429 },
        stream,
        asked_usage,
    });
    if !granted {
        let mut r = full(
            StatusCode::TOO_MANY_REQUESTS,
            r#"{"error":{"message":"Rate limit reached for tokens per min","type":"tokens","code":"rate_limit_exceeded"}}"#,
        );
        r.headers_mut().insert(
            "x-ratelimit-remaining-tokens",
            HeaderValue::from_static("0"),
        );
        return r;
    }
    if state.output.is_some() {
        return anthropic(stream, prompt, completion);
    }
    let usage = format!(
        r#"{{"prompt_tokens":{prompt},"completion_tokens":{completion},"total_tokens":{cost}}}"#
    );
    if !stream {
        return full(
            StatusCode::OK,
            format!(
                r#"{{"id":"chatcmpl-1","object":"chat.completion","choices":[{{"index":0,"message":{{"role":"assistant","content":"hello"}},"finish_reason":"stop"}}],"usage":{usage}}}"#
            ),
        );
    }
    // Asked for usage, every chunk carries `"usage":null` but the last, which carries the
    // usage and no choice.
    let null = if asked_usage { r#","usage":null"# } else { "" };
    // A long answer for benchmarks: `chunks` chunks of `chunk_bytes` of content each.
    let chunks = json["chunks"].as_u64().unwrap_or(3);
    let content = "x".repeat(json["chunk_bytes"].as_u64().unwrap_or(0) as usize);
    let pause = Duration::from_millis(if chunks > 3 { 0 } else { 5 });
    // Made as they are sent: a long answer is never held whole here.
    let last = asked_usage.then(|| {
        format!(
            r#"data: {{"id":"chatcmpl-1","object":"chat.completion.chunk","choices":[],"usage":{usage}}}"#
        ) + "\n\n"
    });
    let events = (0..chunks)
        .map(move |i| {
            format!(
                r#"data: {{"id":"chatcmpl-1","object":"chat.completion.chunk","choices":[{{"index":0,"delta":{{"content":"part {i}{content}"}},"finish_reason":null}}]{null}}}"#
            ) + "\n\n"
        })
        .chain(last)
        .chain(std::iter::once("data: [DONE]\n\n".to_owned()));
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, Infallible>>(1);
    tokio::spawn(async move {
        for event in events {
            if !pause.is_zero() {
                tokio::time::sleep(pause).await;
            }
            if tx.send(Ok(Frame::data(Bytes::from(event)))).await.is_err() {
                return;
            }
        }
    });
    let mut rx = rx;
    let body = StreamBody::new(futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx))).boxed();
    let mut r = Response::new(body);
    r.headers_mut().insert(
        "content-type",
        HeaderValue::from_static("text/event-stream"),
    );
    r
}

/// Anthropic's answer: `usage` in a JSON body, or a stream whose `message_start` says the
/// input tokens and whose `message_delta`s say the output tokens so far (the last, all).
fn anthropic(stream: bool, input: u64, output: u64) -> Response<Body> {
    if !stream {
        return full(
            StatusCode::OK,
            format!(
                r#"{{"id":"msg_1","type":"message","role":"assistant","content":[{{"type":"text","text":"hello"}}],"usage":{{"input_tokens":{input},"output_tokens":{output},"cache_creation_input_tokens":0,"cache_read_input_tokens":0}}}}"#
            ),
        );
    }
    let events = [
        format!(
            r#"{{"type":"message_start","message":{{"id":"msg_1","type":"message","role":"assistant","content":[],"usage":{{"input_tokens":{input},"output_tokens":1,"cache_creation_input_tokens":0,"cache_read_input_tokens":0}}}}}}"#
        ),
        r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"hello"}}"#
            .to_owned(),
        format!(
            r#"{{"type":"message_delta","delta":{{"stop_reason":null}},"usage":{{"output_tokens":{}}}}}"#,
            output / 2
        ),
        format!(
            r#"{{"type":"message_delta","delta":{{"stop_reason":"end_turn"}},"usage":{{"output_tokens":{output}}}}}"#
        ),
        r#"{"type":"message_stop"}"#.to_owned(),
    ];
    let text: String = events
        .iter()
        .map(|data| {
            let kind: serde_json::Value = serde_json::from_str(data).unwrap();
            format!(
                "event: {}\ndata: {data}\n\n",
                kind["type"].as_str().unwrap()
            )
        })
        .collect();
    let mut r = full(StatusCode::OK, text);
    r.headers_mut().insert(
        "content-type",
        HeaderValue::from_static("text/event-stream"),
    );
    r
}

/// Shopify's answer to a GraphQL query: its cost is the `first: N` its text asks for (1
/// without one), taken from the bucket where it holds it (Shopify's requested cost, here
/// the actual one too), else throttled.
fn shopify(json: &serde_json::Value, state: &State, at: Instant) -> Response<Body> {
    let query = json["query"].as_str().unwrap_or_default();
    let cost: u64 = query
        .split_once("first: ")
        .and_then(|(_, rest)| {
            let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
            digits.parse().ok()
        })
        .unwrap_or(1);
    let (granted, available, restore, maximum) = {
        let mut bucket = state.bucket.lock().unwrap();
        let granted = bucket.holds(cost as f64);
        if granted {
            bucket.tokens -= cost as f64;
        }
        (granted, bucket.tokens, bucket.rate, bucket.capacity)
    };
    state.charges.lock().unwrap().push(Charge {
        at,
        tokens: if granted { cost } else { 0 },
        input: 0,
        output: 0,
        estimate: cost,
        // Shopify answers a throttled query 200: counted here as the refusal it is.
        status: if granted { 200 } else { 429 },
        stream: false,
        asked_usage: false,
    });
    let throttle = format!(
        r#"{{"maximumAvailable":{maximum:.1},"currentlyAvailable":{},"restoreRate":{restore:.1}}}"#,
        available.floor()
    );
    let body = if granted {
        format!(
            r#"{{"data":{{"products":{{"edges":[]}}}},"extensions":{{"cost":{{"requestedQueryCost":{cost},"actualQueryCost":{cost},"throttleStatus":{throttle}}}}}}}"#
        )
    } else {
        format!(
            r#"{{"errors":[{{"message":"Throttled","extensions":{{"code":"THROTTLED"}}}}],"extensions":{{"cost":{{"requestedQueryCost":{cost},"actualQueryCost":null,"throttleStatus":{throttle}}}}}}}"#
        )
    };
    full(StatusCode::OK, body)
}

fn full(status: StatusCode, body: impl Into<Bytes>) -> Response<Body> {
    let mut r = Response::new(Full::new(body.into()).boxed());
    *r.status_mut() = status;
    r.headers_mut()
        .insert("content-type", HeaderValue::from_static("application/json"));
    r
}

/// The most tokens any window of `length` holds, by the charges' arrivals.
pub fn busiest_tokens(charges: &[Charge], length: Duration) -> u64 {
    busiest_by(charges, length, |c| c.tokens)
}

/// The most of `count` (tokens, input or output) any window of `length` holds.
pub fn busiest_by(charges: &[Charge], length: Duration, count: impl Fn(&Charge) -> u64) -> u64 {
    let mut most = 0;
    for (i, first) in charges.iter().enumerate() {
        let sum: u64 = charges[i..]
            .iter()
            .take_while(|c| c.at - first.at < length)
            .map(&count)
            .sum();
        most = most.max(sum);
    }
    most
}

/// Posts `body`, as JSON, to `url` through `via` (a client of the proxy): a worker's request.
pub async fn post_json(
    via: &reqwest::Client,
    url: &str,
    body: &serde_json::Value,
) -> reqwest::Response {
    via.post(url)
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .unwrap()
}
