//! What a vendor says of a budget in another unit than requests, for the meter that paces it:
//! tokens (OpenAI, Anthropic) and GraphQL points (GitHub). Each is read apart from the
//! request budget's families ([`super::Family`]): a request budget never reads them.
//!
//! A field that is missing, negative (`-1`, "unknown") or does not parse leaves the figure
//! unknown, never 0: a meter is paused only by a remaining that was said to be 0.

use std::time::{Duration, SystemTime};

use http::HeaderMap;

use super::{count, go_duration, text, x_ratelimit, Reset};

/// Which of a vendor's budgets a meter reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    /// OpenAI's tokens: `x-ratelimit-{limit,remaining,reset}-tokens`. The reset is a duration
    /// (`6m0s`, `1s`, `12ms`): the time until the bucket is full again, since it refills
    /// continuously, not the end of a fixed window.
    OpenAiTokens,
    /// Anthropic's input tokens: `anthropic-ratelimit-input-tokens-*`, reset an RFC 3339 time.
    AnthropicInput,
    /// Anthropic's output tokens: `anthropic-ratelimit-output-tokens-*`.
    AnthropicOutput,
    /// Anthropic's tokens, input and output together: `anthropic-ratelimit-tokens-*`.
    AnthropicTokens,
    /// GitHub's GraphQL points: `x-ratelimit-*` on a response whose
    /// `x-ratelimit-resource` is `graphql`.
    GithubPoints,
}

/// What one response says of a meter's budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Said {
    /// Left in the budget, in its unit.
    pub remaining: u64,
    /// The budget's size, where given.
    pub limit: Option<u64>,
    /// When it is whole again (OpenAI: refilled), where given.
    pub reset: Option<Reset>,
}

impl Said {
    /// Whether the budget is spent: a 429 with this says the meter, not the request budget,
    /// ran out.
    pub fn exhausted(&self) -> bool {
        self.remaining == 0
    }

    /// How long until the reset, read against `now`; `None` without one, or for one past.
    pub fn reset_in(&self, now: SystemTime) -> Option<Duration> {
        self.reset?.after(now)
    }
}

/// What `headers` say of `unit`'s budget, if they say its remaining.
pub fn read(headers: &HeaderMap, unit: Unit) -> Option<Said> {
    match unit {
        Unit::OpenAiTokens => Some(Said {
            remaining: count(text(headers, "x-ratelimit-remaining-tokens")?)?,
            limit: text(headers, "x-ratelimit-limit-tokens").and_then(count),
            reset: text(headers, "x-ratelimit-reset-tokens")
                .and_then(go_duration)
                .map(Reset::In),
        }),
        Unit::AnthropicInput => anthropic(
            headers,
            [
                "anthropic-ratelimit-input-tokens-remaining",
                "anthropic-ratelimit-input-tokens-limit",
                "anthropic-ratelimit-input-tokens-reset",
            ],
        ),
        Unit::AnthropicOutput => anthropic(
            headers,
            [
                "anthropic-ratelimit-output-tokens-remaining",
                "anthropic-ratelimit-output-tokens-limit",
                "anthropic-ratelimit-output-tokens-reset",
            ],
        ),
        Unit::AnthropicTokens => anthropic(
            headers,
            [
                "anthropic-ratelimit-tokens-remaining",
                "anthropic-ratelimit-tokens-limit",
                "anthropic-ratelimit-tokens-reset",
            ],
        ),
        Unit::GithubPoints => {
            if text(headers, "x-ratelimit-resource") != Some("graphql") {
                return None;
            }
            let s = x_ratelimit(headers)?;
            Some(Said {
                remaining: s.remaining,
                limit: s.limit,
                reset: s.reset,
            })
        }
    }
}

/// Anthropic's three fields of one budget: `[remaining, limit, reset]`.
fn anthropic(headers: &HeaderMap, [remaining, limit, reset]: [&'static str; 3]) -> Option<Said> {
    Some(Said {
        remaining: count(text(headers, remaining)?)?,
        limit: text(headers, limit).and_then(count),
        reset: text(headers, reset)
            .and_then(|t| humantime::parse_rfc3339_weak(t).ok())
            .map(Reset::At),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (name, value) in pairs {
            h.insert(*name, value.parse().unwrap());
        }
        h
    }

    #[test]
    fn openai_tokens_refill_within_a_duration() {
        let h = headers(&[
            ("x-ratelimit-limit-tokens", "90000"),
            ("x-ratelimit-remaining-tokens", "0"),
            ("x-ratelimit-reset-tokens", "6m0s"),
            // The request budget's own, which a meter does not read.
            ("x-ratelimit-remaining-requests", "4999"),
        ]);
        let said = read(&h, Unit::OpenAiTokens).unwrap();
        assert!(said.exhausted());
        assert_eq!(said.limit, Some(90_000));
        assert_eq!(
            said.reset_in(SystemTime::now()),
            Some(Duration::from_secs(360))
        );
        for (reset, want) in [("1s", 1_000), ("12ms", 12), ("1m30.5s", 90_500)] {
            let h = headers(&[
                ("x-ratelimit-remaining-tokens", "10"),
                ("x-ratelimit-reset-tokens", reset),
            ]);
            assert_eq!(
                read(&h, Unit::OpenAiTokens).unwrap().reset,
                Some(Reset::In(Duration::from_millis(want))),
                "{reset}"
            );
        }
    }

    #[test]
    fn unknown_is_never_zero() {
        for remaining in ["-1", "", "lots"] {
            let h = headers(&[("x-ratelimit-remaining-tokens", remaining)]);
            assert_eq!(read(&h, Unit::OpenAiTokens), None, "{remaining:?}");
        }
        assert_eq!(read(&HeaderMap::new(), Unit::AnthropicInput), None);
    }

    #[test]
    fn anthropic_says_each_budget_apart_with_a_reset_in_time() {
        let h = headers(&[
            ("anthropic-ratelimit-input-tokens-limit", "40000"),
            ("anthropic-ratelimit-input-tokens-remaining", "39000"),
            (
                "anthropic-ratelimit-input-tokens-reset",
                "2026-12-06T17:00:30Z",
            ),
            ("anthropic-ratelimit-output-tokens-limit", "8000"),
            ("anthropic-ratelimit-output-tokens-remaining", "0"),
            (
                "anthropic-ratelimit-output-tokens-reset",
                "2026-12-06T17:00:02Z",
            ),
        ]);
        let at = |t: &str| humantime::parse_rfc3339(t).unwrap();
        let input = read(&h, Unit::AnthropicInput).unwrap();
        assert_eq!(
            (input.remaining, input.limit, input.reset),
            (
                39_000,
                Some(40_000),
                Some(Reset::At(at("2026-12-06T17:00:30Z")))
            )
        );
        let output = read(&h, Unit::AnthropicOutput).unwrap();
        assert!(output.exhausted());
        assert_eq!(
            output.reset_in(at("2026-12-06T17:00:00Z")),
            Some(Duration::from_secs(2))
        );
        assert_eq!(read(&h, Unit::AnthropicTokens), None, "not said");
    }

    #[test]
    fn github_points_are_the_graphql_resource_alone() {
        let mut h = headers(&[
            ("x-ratelimit-limit", "5000"),
            ("x-ratelimit-remaining", "4990"),
            ("x-ratelimit-resource", "core"),
        ]);
        assert_eq!(read(&h, Unit::GithubPoints), None, "the REST budget");
        h.insert("x-ratelimit-resource", "graphql".parse().unwrap());
        let said = read(&h, Unit::GithubPoints).unwrap();
        assert_eq!((said.remaining, said.limit), (4_990, Some(5_000)));
    }
}
