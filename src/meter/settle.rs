//! A request's cost read from its response as the bytes pass to the client, never holding
//! them back: a server-sent-event stream is read a line at a time (only the line being read
//! is kept), and a JSON body is kept whole up to [`WHOLE`], past which only its last [`TAIL`]
//! bytes are, where the vendors write what the request cost.
//!
//! A stream's usage is its last word: OpenAI's in the last chunk (or the Responses API's
//! `response.completed`), Anthropic's output in the last `message_delta`, which counts from
//! the start of the message (cumulative, never to be added up).

use serde_json::Value;

/// The most of a JSON body kept whole, to be read at its end.
const WHOLE: usize = 1 << 20;

/// How much of a JSON body larger than [`WHOLE`] is kept: its end.
const TAIL: usize = 64 << 10;

/// The longest server-sent-event line read; a longer one is passed over.
const LINE: usize = 1 << 20;

/// Which vendor's word on the cost is read (see [`super::Cost`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Read {
    OpenAi,
    AnthropicInput,
    AnthropicOutput,
    GithubGraphql,
    ShopifyGraphql,
}

/// Why a response settled nothing: its request keeps its estimate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unsettled {
    /// The body ended before its cost was said (an error, a client gone, a stream cut off).
    Cut,
    /// The whole body came, and said nothing of its cost.
    NoUsage,
}

impl Unsettled {
    /// The label of the unsettled requests' metric.
    pub fn as_str(self) -> &'static str {
        match self {
            Unsettled::Cut => "cut",
            Unsettled::NoUsage => "no_usage",
        }
    }
}

/// What a response said its request cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settled {
    /// The cost, in the meter's unit.
    Cost(u64),
    /// Nothing: the estimate stands.
    Unsettled(Unsettled),
}

/// What a vendor's leaky bucket of points said it holds after a request: Shopify's
/// `extensions.cost.throttleStatus`, read where the cost is.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bucket {
    /// Points left now (`currentlyAvailable`).
    pub available: f64,
    /// Points it refills a second (`restoreRate`).
    pub restore_rate: f64,
    /// Its size (`maximumAvailable`).
    pub maximum: f64,
}

/// Reads one response's cost as its body passes ([`Settle::feed`], then [`Settle::finish`]).
#[derive(Debug)]
pub struct Settle {
    read: Read,
    stream: bool,
    /// A stream: the line being read. JSON: the body so far, or its tail once past
    /// [`WHOLE`].
    kept: Vec<u8>,
    /// JSON: `kept` is the body's tail, not the whole of it. A stream: the line being read
    /// is longer than [`LINE`] and is passed over to its end.
    overflowed: bool,
    /// A stream's cost as its events said so far.
    cost: Option<u64>,
    /// The vendor's bucket, as the body said it (see [`Settle::bucket`]).
    bucket: Option<Bucket>,
}

impl Settle {
    pub(super) fn new(read: Read, stream: bool) -> Self {
        Self {
            read,
            stream,
            kept: Vec::new(),
            overflowed: false,
            cost: None,
            bucket: None,
        }
    }

    /// The next bytes of the body, as they go on to the client.
    pub fn feed(&mut self, mut chunk: &[u8]) {
        if !self.stream {
            self.kept.extend_from_slice(chunk);
            if self.kept.len() > WHOLE {
                let cut = self.kept.len() - TAIL;
                self.kept.drain(..cut);
                self.overflowed = true;
            }
            return;
        }
        while let Some(end) = chunk.iter().position(|b| *b == b'\n') {
            let (rest, next) = (&chunk[..end], &chunk[end + 1..]);
            if !self.overflowed {
                self.kept.extend_from_slice(rest);
                let line = std::mem::take(&mut self.kept);
                self.line(&line);
                self.kept = line;
                self.kept.clear();
            }
            self.overflowed = false;
            chunk = next;
        }
        if !self.overflowed {
            self.kept.extend_from_slice(chunk);
            if self.kept.len() > LINE {
                self.kept.clear();
                self.overflowed = true;
            }
        }
    }

    /// One line of a stream: an event's data is read for its cost.
    fn line(&mut self, line: &[u8]) {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let Some(data) = line.strip_prefix(b"data:") else {
            return;
        };
        let data = data.trim_ascii();
        if data.is_empty() || data == b"[DONE]" {
            return;
        }
        if let Ok(event) = serde_json::from_slice::<Value>(data) {
            if let Some(cost) = self.cost_of(&event) {
                self.cost = Some(cost);
            }
        }
    }

    /// The body ended: `complete` if it came whole, else it was cut off.
    pub fn finish(&mut self, complete: bool) -> Settled {
        if self.stream {
            // A last line without its newline.
            if complete && !self.overflowed && !self.kept.is_empty() {
                let line = std::mem::take(&mut self.kept);
                self.line(&line);
            }
            return match self.cost {
                Some(cost) => Settled::Cost(cost),
                None if complete => Settled::Unsettled(Unsettled::NoUsage),
                None => Settled::Unsettled(Unsettled::Cut),
            };
        }
        if !complete {
            return Settled::Unsettled(Unsettled::Cut);
        }
        let body = if self.overflowed {
            self.read_tail()
        } else {
            serde_json::from_slice::<Value>(&self.kept).ok()
        };
        let Some(body) = body else {
            return Settled::Unsettled(Unsettled::NoUsage);
        };
        if self.read == Read::ShopifyGraphql {
            self.bucket = bucket_of(&body);
        }
        self.cost_of(&body)
            .map_or(Settled::Unsettled(Unsettled::NoUsage), Settled::Cost)
    }

    /// What the vendor's bucket held after the request, where the body said it (Shopify's);
    /// read by [`Settle::finish`].
    pub fn bucket(&self) -> Option<Bucket> {
        self.bucket
    }

    /// A body larger than [`WHOLE`] as its tail says what the request cost: the last
    /// occurrence of the field that holds it, read as the value that follows.
    fn read_tail(&self) -> Option<Value> {
        let field: &[u8] = match self.read {
            Read::OpenAi | Read::AnthropicInput | Read::AnthropicOutput => b"\"usage\"",
            Read::GithubGraphql => b"\"rateLimit\"",
            Read::ShopifyGraphql => b"\"extensions\"",
        };
        let at = self.kept.windows(field.len()).rposition(|w| w == field)?;
        let rest = self.kept[at + field.len()..].trim_ascii_start();
        let rest = rest.strip_prefix(b":")?;
        let value = serde_json::Deserializer::from_slice(rest)
            .into_iter::<Value>()
            .next()?
            .ok()?;
        Some(match self.read {
            Read::GithubGraphql => serde_json::json!({ "data": { "rateLimit": value } }),
            Read::ShopifyGraphql => serde_json::json!({ "extensions": value }),
            _ => serde_json::json!({ "usage": value }),
        })
    }

    /// What `v` (a JSON body, or a stream's event) says the request cost, if anything.
    fn cost_of(&self, v: &Value) -> Option<u64> {
        let n = |v: &Value| v.as_u64();
        match self.read {
            Read::OpenAi => {
                let usage = v
                    .get("usage")
                    .filter(|u| u.is_object())
                    .or_else(|| v.get("response")?.get("usage"))?;
                n(&usage["total_tokens"]).or_else(|| {
                    let input = n(&usage["input_tokens"]).or(n(&usage["prompt_tokens"]))?;
                    let output = n(&usage["output_tokens"]).or(n(&usage["completion_tokens"]))?;
                    Some(input + output)
                })
            }
            Read::AnthropicInput => {
                // A stream's `message_start` holds the message; a JSON body is the message.
                let usage = v.get("message").unwrap_or(v).get("usage")?;
                let input = n(&usage["input_tokens"])?;
                Some(
                    input
                        + n(&usage["cache_creation_input_tokens"]).unwrap_or(0)
                        + n(&usage["cache_read_input_tokens"]).unwrap_or(0),
                )
            }
            Read::AnthropicOutput => {
                let usage = v.get("message").unwrap_or(v).get("usage")?;
                n(&usage["output_tokens"])
            }
            Read::GithubGraphql => n(&v["data"]["rateLimit"]["cost"]),
            Read::ShopifyGraphql => {
                let cost = &v["extensions"]["cost"];
                // A query throttled is not run, and costs nothing: its requested cost is
                // said, its actual cost null.
                match n(&cost["actualQueryCost"]) {
                    Some(actual) => Some(actual),
                    None if cost["actualQueryCost"].is_null()
                        && n(&cost["requestedQueryCost"]).is_some() =>
                    {
                        Some(0)
                    }
                    None => None,
                }
            }
        }
    }
}

/// Shopify's `throttleStatus` in a response body.
fn bucket_of(body: &Value) -> Option<Bucket> {
    let status = &body["extensions"]["cost"]["throttleStatus"];
    let f = |name: &str| status[name].as_f64().filter(|v| v.is_finite() && *v >= 0.0);
    Some(Bucket {
        available: f("currentlyAvailable")?,
        restore_rate: f("restoreRate").filter(|r| *r > 0.0)?,
        maximum: f("maximumAvailable")?,
    })
}

#[cfg(test)]
mod tests {
    use super::super::Cost;
    use super::*;

    /// Feeds `body` to `cost`'s settler in pieces of `piece` bytes, and finishes it whole.
    fn settled(cost: &Cost, stream: bool, body: &[u8], piece: usize) -> Settled {
        let mut settle = cost.settle(stream).unwrap();
        for chunk in body.chunks(piece) {
            settle.feed(chunk);
        }
        settle.finish(true)
    }

    fn every_split(cost: &Cost, stream: bool, body: &str, want: Settled) {
        for piece in [1, 2, 3, 7, 64, body.len().max(1)] {
            assert_eq!(
                settled(cost, stream, body.as_bytes(), piece),
                want,
                "in pieces of {piece}"
            );
        }
    }

    const OPENAI_CHAT: &str = r#"{"id":"c","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"hi"}}],"usage":{"prompt_tokens":12,"completion_tokens":30,"total_tokens":42}}"#;

    #[test]
    fn an_openai_answer_says_its_tokens() {
        every_split(&Cost::OpenAi, false, OPENAI_CHAT, Settled::Cost(42));
        let responses = r#"{"id":"r","object":"response","output":[],"usage":{"input_tokens":20,"output_tokens":5,"total_tokens":25}}"#;
        every_split(&Cost::OpenAi, false, responses, Settled::Cost(25));
        let without_total = r#"{"usage":{"input_tokens":20,"output_tokens":5}}"#;
        every_split(&Cost::OpenAi, false, without_total, Settled::Cost(25));
        every_split(
            &Cost::OpenAi,
            false,
            r#"{"error":{"message":"bad"}}"#,
            Settled::Unsettled(Unsettled::NoUsage),
        );
    }

    #[test]
    fn an_openai_stream_says_its_tokens_in_its_last_chunk() {
        let stream = "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}],\"usage\":null}\n\n\
                      data: {\"choices\":[{\"delta\":{\"content\":\"b\"}}],\"usage\":null}\r\n\r\n\
                      data: {\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":2,\"total_tokens\":11}}\n\n\
                      data: [DONE]\n\n";
        every_split(&Cost::OpenAi, true, stream, Settled::Cost(11));
        let responses = "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"usage\":null}}\n\n\
                         event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"usage\":{\"input_tokens\":3,\"output_tokens\":4,\"total_tokens\":7}}}\n\n";
        every_split(&Cost::OpenAi, true, responses, Settled::Cost(7));
    }

    #[test]
    fn a_stream_cut_before_its_usage_keeps_the_estimate() {
        let head = b"data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}],\"usage\":null}\n\n";
        let mut settle = Cost::OpenAi.settle(true).unwrap();
        settle.feed(head);
        assert_eq!(settle.finish(false), Settled::Unsettled(Unsettled::Cut));
        // Whole, but without usage (the client did not ask for it).
        let mut settle = Cost::OpenAi.settle(true).unwrap();
        settle.feed(head);
        settle.feed(b"data: [DONE]\n\n");
        assert_eq!(settle.finish(true), Settled::Unsettled(Unsettled::NoUsage));
        // A JSON body cut off is cut, whatever it held.
        let mut settle = Cost::OpenAi.settle(false).unwrap();
        settle.feed(&OPENAI_CHAT.as_bytes()[..40]);
        assert_eq!(settle.finish(false), Settled::Unsettled(Unsettled::Cut));
    }

    const ANTHROPIC_STREAM: &str = "event: message_start\n\
        data: {\"type\":\"message_start\",\"message\":{\"id\":\"m\",\"usage\":{\"input_tokens\":25,\"cache_creation_input_tokens\":5,\"cache_read_input_tokens\":100,\"output_tokens\":1}}}\n\n\
        event: content_block_delta\n\
        data: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hi\"}}\n\n\
        event: message_delta\n\
        data: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":null},\"usage\":{\"output_tokens\":10}}\n\n\
        event: message_delta\n\
        data: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":15}}\n\n\
        event: message_stop\n\
        data: {\"type\":\"message_stop\"}\n\n";

    #[test]
    fn an_anthropic_stream_says_its_input_at_the_start_and_its_output_last() {
        // Input: the prompt and the cache's reads and writes.
        every_split(
            &Cost::AnthropicInput,
            true,
            ANTHROPIC_STREAM,
            Settled::Cost(130),
        );
        // Output: the last message_delta's count, which is cumulative (not 1 + 10 + 15).
        every_split(
            &Cost::AnthropicOutput,
            true,
            ANTHROPIC_STREAM,
            Settled::Cost(15),
        );
        let json = r#"{"id":"m","type":"message","content":[],"usage":{"input_tokens":7,"output_tokens":3}}"#;
        every_split(&Cost::AnthropicInput, false, json, Settled::Cost(7));
        every_split(&Cost::AnthropicOutput, false, json, Settled::Cost(3));
    }

    #[test]
    fn graphql_points_are_read_where_each_vendor_writes_them() {
        let github = r#"{"data":{"rateLimit":{"cost":3,"remaining":4990},"viewer":{"login":"x"}}}"#;
        every_split(&Cost::GithubGraphql, false, github, Settled::Cost(3));
        let shopify = r#"{"data":{"shop":{"name":"s"}},"extensions":{"cost":{"requestedQueryCost":10,"actualQueryCost":6,"throttleStatus":{"maximumAvailable":1000.0,"currentlyAvailable":994,"restoreRate":50.0}}}}"#;
        every_split(&Cost::ShopifyGraphql, false, shopify, Settled::Cost(6));
        every_split(
            &Cost::GithubGraphql,
            false,
            r#"{"data":{"viewer":{"login":"x"}}}"#,
            Settled::Unsettled(Unsettled::NoUsage),
        );
    }

    #[test]
    fn a_shopify_throttle_costs_nothing_and_says_what_its_bucket_holds() {
        let throttled = r#"{"errors":[{"message":"Throttled","extensions":{"code":"THROTTLED"}}],"extensions":{"cost":{"requestedQueryCost":120,"actualQueryCost":null,"throttleStatus":{"maximumAvailable":1000.0,"currentlyAvailable":40,"restoreRate":50.0}}}}"#;
        every_split(&Cost::ShopifyGraphql, false, throttled, Settled::Cost(0));
        let mut settle = Cost::ShopifyGraphql.settle(false).unwrap();
        settle.feed(throttled.as_bytes());
        settle.finish(true);
        assert_eq!(
            settle.bucket(),
            Some(Bucket {
                available: 40.0,
                restore_rate: 50.0,
                maximum: 1000.0
            })
        );
        // Said of nothing, or with a rate that would never refill: no bucket.
        for body in [
            r#"{"extensions":{"cost":{"actualQueryCost":3}}}"#,
            r#"{"extensions":{"cost":{"actualQueryCost":3,"throttleStatus":{"maximumAvailable":1000.0,"currentlyAvailable":40,"restoreRate":0}}}}"#,
        ] {
            let mut settle = Cost::ShopifyGraphql.settle(false).unwrap();
            settle.feed(body.as_bytes());
            assert_eq!(settle.finish(true), Settled::Cost(3));
            assert_eq!(settle.bucket(), None, "{body}");
        }
        // A body with neither cost is unsettled, not free.
        every_split(
            &Cost::ShopifyGraphql,
            false,
            r#"{"data":{"shop":{"name":"s"}}}"#,
            Settled::Unsettled(Unsettled::NoUsage),
        );
    }

    #[test]
    fn a_body_larger_than_is_kept_is_read_from_its_end() {
        let filler = "x".repeat(3 << 20);
        let body = format!(
            r#"{{"choices":[{{"message":{{"content":"{filler}"}}}}],"usage":{{"prompt_tokens":1,"completion_tokens":2,"total_tokens":3}}}}"#
        );
        let mut settle = Cost::OpenAi.settle(false).unwrap();
        for chunk in body.as_bytes().chunks(16 << 10) {
            settle.feed(chunk);
            assert!(
                settle.kept.len() <= WHOLE + (16 << 10),
                "kept {}",
                settle.kept.len()
            );
        }
        assert_eq!(settle.finish(true), Settled::Cost(3));
        let shopify = format!(
            r#"{{"data":{{"s":"{filler}"}},"extensions":{{"cost":{{"actualQueryCost":6}}}}}}"#
        );
        assert_eq!(
            settled(&Cost::ShopifyGraphql, false, shopify.as_bytes(), 1 << 16),
            Settled::Cost(6)
        );
    }

    #[test]
    fn a_stream_keeps_one_line_at_most() {
        let mut settle = Cost::OpenAi.settle(true).unwrap();
        // A line longer than is read is passed over to its end, and the next read.
        settle.feed(b"data: ");
        for _ in 0..(LINE / 4096 + 2) {
            settle.feed(&[b'x'; 4096]);
            assert!(settle.kept.len() <= LINE + 4096);
        }
        settle.feed(b"\n\ndata: {\"usage\":{\"total_tokens\":5}}\n\n");
        assert_eq!(settle.finish(true), Settled::Cost(5));
    }
}
