//! What a request costs in a meter's unit (tokens, points): estimated from the request before
//! it is sent, and settled from the response as its bytes pass ([`settle`]). A meter is a
//! budget in another unit than requests (`[destinations.NAME.meters.UNIT]`); how a request's
//! cost is read is its `cost` setting ([`Cost`]). Pure: nothing here holds a slot, reads a
//! socket or knows a budget.
//!
//! An estimate is never 0 (a request that costs nothing would never wait), and never more
//! than the meter holds (a request that costs more than the meter's whole size could never be
//! granted).

pub mod recall;
pub mod settle;
pub mod usage;

use std::fmt;
use std::str::FromStr;

use http::{HeaderMap, HeaderName};
use serde::Deserialize;

pub use recall::{Query, Recall};
pub use settle::{Bucket, Settle, Settled, Unsettled};

/// How a meter's cost of a request is estimated before it is sent, and settled after.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cost {
    /// OpenAI's tokens, input and output together: the body's bytes / 4 plus the output it
    /// asks for at most (`max_completion_tokens`, `max_tokens` or `max_output_tokens`);
    /// settled from `usage` (Chat Completions and the Responses API, JSON or a stream).
    OpenAi,
    /// Anthropic's input tokens: the body's bytes / 4; settled from `message_start`'s usage,
    /// cache reads and writes included.
    AnthropicInput,
    /// Anthropic's output tokens: `max_tokens`; settled from the last `message_delta`'s
    /// usage, which is cumulative.
    AnthropicOutput,
    /// GitHub GraphQL's points: the default; settled from `data.rateLimit.cost` where the
    /// query asks for it.
    GithubGraphql,
    /// Shopify GraphQL's points: the default; settled from
    /// `extensions.cost.actualQueryCost`.
    ShopifyGraphql,
    /// The client states the cost in this header, which is removed before forwarding; not
    /// settled.
    Header(HeaderName),
    /// Every request costs this much; not settled.
    Fixed(u64),
}

/// The settings `cost` takes, for an error that names them.
const CHOICES: &str = "\"openai\", \"anthropic-input\", \"anthropic-output\", \"github-graphql\", \"shopify-graphql\", \"header:NAME\" or a whole number above 0";

/// A `cost` setting that is none of [`Cost`]'s.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown cost `{given}`: use {CHOICES}")]
pub struct UnknownCost {
    given: String,
}

impl FromStr for Cost {
    type Err = UnknownCost;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let unknown = || UnknownCost {
            given: s.to_owned(),
        };
        Ok(match s {
            "openai" => Cost::OpenAi,
            "anthropic-input" => Cost::AnthropicInput,
            "anthropic-output" => Cost::AnthropicOutput,
            "github-graphql" => Cost::GithubGraphql,
            "shopify-graphql" => Cost::ShopifyGraphql,
            _ => match s.strip_prefix("header:") {
                Some(name) => Cost::Header(HeaderName::from_str(name).map_err(|_| unknown())?),
                None => match s.parse::<u64>() {
                    Ok(n) if n > 0 => Cost::Fixed(n),
                    _ => return Err(unknown()),
                },
            },
        })
    }
}

impl fmt::Display for Cost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Cost::OpenAi => f.write_str("openai"),
            Cost::AnthropicInput => f.write_str("anthropic-input"),
            Cost::AnthropicOutput => f.write_str("anthropic-output"),
            Cost::GithubGraphql => f.write_str("github-graphql"),
            Cost::ShopifyGraphql => f.write_str("shopify-graphql"),
            Cost::Header(name) => write!(f, "header:{name}"),
            Cost::Fixed(n) => write!(f, "{n}"),
        }
    }
}

/// The fields of a JSON request body an estimate reads; every other field is skipped
/// without being kept.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct Asked {
    max_completion_tokens: Option<u64>,
    max_tokens: Option<u64>,
    max_output_tokens: Option<u64>,
}

impl Asked {
    /// The body's fields, or none where it is not a JSON object.
    fn of(body: &[u8]) -> Self {
        serde_json::from_slice(body).unwrap_or_default()
    }
}

/// Tokens a text of `bytes` bytes is taken to hold before the vendor says: about four bytes
/// a token, as the vendors' own rules of thumb have it.
fn tokens_in(bytes: usize) -> u64 {
    u64::try_from(bytes / 4).unwrap_or(u64::MAX)
}

impl Cost {
    /// The cost to reserve for a request with `body` and `headers`, before it is sent:
    /// `default` stands for what the request does not say (the output it may take, a
    /// query's points, a header missing); at least 1, at most `size` (the meter's).
    pub fn estimate(&self, body: &[u8], headers: &HeaderMap, default: u64, size: u64) -> u64 {
        let estimate = match self {
            Cost::OpenAi => {
                let asked = Asked::of(body);
                let output = asked
                    .max_completion_tokens
                    .or(asked.max_tokens)
                    .or(asked.max_output_tokens)
                    .unwrap_or(default);
                tokens_in(body.len()).saturating_add(output)
            }
            Cost::AnthropicInput => tokens_in(body.len()),
            Cost::AnthropicOutput => Asked::of(body).max_tokens.unwrap_or(default),
            Cost::GithubGraphql | Cost::ShopifyGraphql => default,
            Cost::Header(name) => headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.trim().parse::<u64>().ok())
                .unwrap_or(default),
            Cost::Fixed(n) => *n,
        };
        estimate.clamp(1, size.max(1))
    }

    /// Whether a request's cost is its query's (GraphQL): the last settled cost of the same
    /// query text is the next one's estimate (see [`recall`]).
    pub fn by_query(&self) -> bool {
        matches!(self, Cost::GithubGraphql | Cost::ShopifyGraphql)
    }

    /// Which of the vendor's budgets its headers name for this meter, where they do (see
    /// [`crate::signals::tokens`]).
    pub fn unit(&self) -> Option<crate::signals::tokens::Unit> {
        use crate::signals::tokens::Unit;
        match self {
            Cost::OpenAi => Some(Unit::OpenAiTokens),
            Cost::AnthropicInput => Some(Unit::AnthropicInput),
            Cost::AnthropicOutput => Some(Unit::AnthropicOutput),
            Cost::GithubGraphql => Some(Unit::GithubPoints),
            Cost::ShopifyGraphql | Cost::Header(_) | Cost::Fixed(_) => None,
        }
    }

    /// How the response settles the cost, where it does; `stream` where it is a
    /// server-sent-event stream (`text/event-stream`).
    pub fn settle(&self, stream: bool) -> Option<Settle> {
        let read = match self {
            Cost::OpenAi => settle::Read::OpenAi,
            Cost::AnthropicInput => settle::Read::AnthropicInput,
            Cost::AnthropicOutput => settle::Read::AnthropicOutput,
            Cost::GithubGraphql => settle::Read::GithubGraphql,
            Cost::ShopifyGraphql => settle::Read::ShopifyGraphql,
            Cost::Header(_) | Cost::Fixed(_) => return None,
        };
        Some(Settle::new(read, stream))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_setting_reads_back_as_it_was_written() {
        for s in [
            "openai",
            "anthropic-input",
            "anthropic-output",
            "github-graphql",
            "shopify-graphql",
            "header:x-cost",
            "12",
        ] {
            assert_eq!(s.parse::<Cost>().unwrap().to_string(), s);
        }
        for bad in [
            "",
            "0",
            "-3",
            "openai ",
            "header:",
            "header:bad name",
            "tokens",
        ] {
            let e = bad.parse::<Cost>().unwrap_err().to_string();
            assert!(e.contains("header:NAME"), "{bad}: {e}");
        }
    }

    #[test]
    fn an_openai_estimate_is_the_prompt_and_the_output_asked_for() {
        let none = HeaderMap::new();
        let body = br#"{"model":"m","messages":[{"role":"user","content":"0123456789abcdef"}],"max_tokens":100}"#;
        let prompt = tokens_in(body.len());
        assert_eq!(
            Cost::OpenAi.estimate(body, &none, 500, 90_000),
            prompt + 100
        );
        // The newer names win over the older one.
        let newer = br#"{"max_tokens":100,"max_completion_tokens":7}"#;
        assert_eq!(
            Cost::OpenAi.estimate(newer, &none, 500, 90_000),
            tokens_in(newer.len()) + 7
        );
        let responses = br#"{"input":"hi","max_output_tokens":9}"#;
        assert_eq!(
            Cost::OpenAi.estimate(responses, &none, 500, 90_000),
            tokens_in(responses.len()) + 9
        );
        // Without any, the default; never past the meter's size.
        let bare = br#"{"model":"m"}"#;
        assert_eq!(
            Cost::OpenAi.estimate(bare, &none, 500, 90_000),
            tokens_in(bare.len()) + 500
        );
        assert_eq!(Cost::OpenAi.estimate(bare, &none, 500, 300), 300);
        // A body that is not JSON is still its bytes.
        assert_eq!(Cost::OpenAi.estimate(&[b'x'; 400], &none, 0, 90_000), 100);
    }

    #[test]
    fn anthropic_splits_input_from_output() {
        let none = HeaderMap::new();
        let body = br#"{"model":"m","max_tokens":1024,"messages":[]}"#;
        assert_eq!(
            Cost::AnthropicInput.estimate(body, &none, 1, 40_000),
            tokens_in(body.len())
        );
        assert_eq!(Cost::AnthropicOutput.estimate(body, &none, 1, 8_000), 1024);
        assert_eq!(
            Cost::AnthropicOutput.estimate(b"{}", &none, 256, 8_000),
            256
        );
    }

    #[test]
    fn no_estimate_is_zero() {
        let none = HeaderMap::new();
        assert_eq!(Cost::AnthropicInput.estimate(b"{}", &none, 0, 100), 1);
        assert_eq!(Cost::GithubGraphql.estimate(b"{}", &none, 0, 100), 1);
        assert_eq!(Cost::Fixed(5).estimate(b"", &none, 0, 0), 1);
    }

    #[test]
    fn a_client_may_state_the_cost() {
        let cost: Cost = "header:x-cost".parse().unwrap();
        let mut headers = HeaderMap::new();
        assert_eq!(
            cost.estimate(b"", &headers, 3, 100),
            3,
            "absent: the default"
        );
        headers.insert("x-cost", " 42 ".parse().unwrap());
        assert_eq!(cost.estimate(b"", &headers, 3, 100), 42);
        headers.insert("x-cost", "lots".parse().unwrap());
        assert_eq!(
            cost.estimate(b"", &headers, 3, 100),
            3,
            "unreadable: the default"
        );
        assert!(cost.settle(false).is_none());
    }
}
