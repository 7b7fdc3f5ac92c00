//! Usage asked for on a client's behalf: an OpenAI chat stream settles only if it ends with
//! its usage, which a request must ask for (`stream_options.include_usage`). A streamed
//! request that did not is sent asking for it ([`ask`]), and what the answer then carries
//! that the client did not ask for is taken out as it passes ([`Strip`]): the last chunk,
//! which holds the usage and no choice, and the `"usage":null` every other chunk then has.
//! The client gets the chunks it would have had without pacegate.

use bytes::{Bytes, BytesMut};
use serde_json::Value;

/// The longest event held while it is incomplete; a longer one is passed on as it is.
const EVENT: usize = 1024 * 1024;

/// `body`, an OpenAI request, rewritten to ask for usage at the end of its stream: `None`
/// where it need not be (not a JSON object, not a stream, or usage asked for already).
pub fn ask(body: &[u8]) -> Option<Bytes> {
    let mut json: Value = serde_json::from_slice(body).ok()?;
    let object = json.as_object_mut()?;
    if object.get("stream") != Some(&Value::Bool(true)) {
        return None;
    }
    let options = object
        .entry("stream_options")
        .or_insert_with(|| Value::Object(serde_json::Map::new()));
    let options = options.as_object_mut()?;
    if options.get("include_usage") == Some(&Value::Bool(true)) {
        return None;
    }
    options.insert("include_usage".into(), Value::Bool(true));
    serde_json::to_vec(&json).ok().map(Bytes::from)
}

/// Takes out of a server-sent-event stream what asking for usage added, an event at a time:
/// complete events go on at once, and only the one still arriving is held.
#[derive(Debug, Default)]
pub struct Strip {
    /// The event being read.
    held: BytesMut,
    /// The event being read is too long to hold: passed on as it comes, to its end.
    passing: bool,
}

impl Strip {
    /// The next bytes of the stream; returns what goes on to the client now.
    pub fn feed(&mut self, chunk: &[u8]) -> Bytes {
        let mut out = BytesMut::new();
        let mut rest = chunk;
        while !rest.is_empty() {
            if self.passing {
                match end_of_event(&self.held, rest) {
                    Some(n) => {
                        out.extend_from_slice(&rest[..n]);
                        rest = &rest[n..];
                        self.passing = false;
                        self.held.clear();
                    }
                    None => {
                        out.extend_from_slice(rest);
                        // Kept to find an end that straddles two chunks.
                        self.held.clear();
                        self.held
                            .extend_from_slice(&rest[rest.len().saturating_sub(2)..]);
                        return out.freeze();
                    }
                }
                continue;
            }
            match end_of_event(&self.held, rest) {
                Some(n) => {
                    self.held.extend_from_slice(&rest[..n]);
                    rest = &rest[n..];
                    let event = std::mem::take(&mut self.held);
                    out.extend_from_slice(&unasked(&event));
                }
                None => {
                    self.held.extend_from_slice(rest);
                    if self.held.len() > EVENT {
                        out.extend_from_slice(&self.held);
                        self.passing = true;
                        // Its last bytes kept, to find an end that straddles two chunks.
                        let tail = self.held.split_off(self.held.len() - 2);
                        self.held = tail;
                    }
                    return out.freeze();
                }
            }
        }
        out.freeze()
    }

    /// The stream ended: what is still held goes on.
    pub fn finish(&mut self) -> Bytes {
        if self.passing {
            return Bytes::new();
        }
        let event = std::mem::take(&mut self.held);
        unasked(&event)
    }
}

/// Where in `next` the event that `held` began ends (after its blank line, `\n\n` or
/// `\r\n\r\n`, which may have begun in `held`), if it does.
fn end_of_event(held: &[u8], next: &[u8]) -> Option<usize> {
    // The byte `k` before `next[i]`, in `next` or at the end of `held`.
    let before = |i: usize, k: usize| -> Option<u8> {
        match i.checked_sub(k) {
            Some(j) => Some(next[j]),
            None => held.len().checked_sub(k - i).map(|j| held[j]),
        }
    };
    next.iter().enumerate().find_map(|(i, b)| {
        let blank = *b == b'\n'
            && (before(i, 1) == Some(b'\n')
                || (before(i, 1) == Some(b'\r') && before(i, 2) == Some(b'\n')));
        blank.then_some(i + 1)
    })
}

/// `event` as the client would have had it without usage asked for: gone if it is the usage
/// chunk (no choice, a usage), else without its `"usage":null`.
fn unasked(event: &[u8]) -> Bytes {
    let data: Vec<&[u8]> = event
        .split(|b| *b == b'\n')
        .filter_map(|line| line.strip_prefix(b"data:"))
        .map(<[u8]>::trim_ascii)
        .collect();
    if let [json] = data.as_slice() {
        if let Ok(Value::Object(chunk)) = serde_json::from_slice::<Value>(json) {
            let no_choice = chunk
                .get("choices")
                .and_then(Value::as_array)
                .is_some_and(Vec::is_empty);
            if no_choice && chunk.get("usage").is_some_and(Value::is_object) {
                return Bytes::new();
            }
        }
    }
    // Quotes inside a JSON string are escaped, so these can only be the key itself.
    let mut out = event.to_vec();
    for pattern in [&b",\"usage\":null"[..], &b"\"usage\":null,"[..]] {
        while let Some(at) = out.windows(pattern.len()).position(|w| w == pattern) {
            out.drain(at..at + pattern.len());
        }
    }
    Bytes::from(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_that_did_not_ask_asks_and_nothing_else_changes() {
        let asked =
            ask(br#"{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}"#)
                .unwrap();
        let json: Value = serde_json::from_slice(&asked).unwrap();
        assert_eq!(json["stream_options"]["include_usage"], true);
        assert_eq!(json["messages"][0]["content"], "hi");
        assert_eq!(json["model"], "m");
        // Other stream options are kept.
        let asked = ask(br#"{"stream":true,"stream_options":{"x":1}}"#).unwrap();
        let json: Value = serde_json::from_slice(&asked).unwrap();
        assert_eq!(json["stream_options"]["x"], 1);
        assert_eq!(json["stream_options"]["include_usage"], true);
        for untouched in [
            &br#"{"stream":true,"stream_options":{"include_usage":true}}"#[..],
            br#"{"stream":false}"#,
            br#"{"model":"m"}"#,
            b"not json",
            b"[1,2]",
        ] {
            assert_eq!(
                ask(untouched),
                None,
                "{}",
                String::from_utf8_lossy(untouched)
            );
        }
    }

    const ASKED: &str = concat!(
        "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"say \\\"usage\\\":null\"}}],\"usage\":null}\n\n",
        "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}],\"usage\":null}\n\n",
        "data: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":5,\"total_tokens\":8}}\n\n",
        "data: [DONE]\n\n",
    );

    const UNASKED: &str = concat!(
        "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"say \\\"usage\\\":null\"}}]}\n\n",
        "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n",
        "data: [DONE]\n\n",
    );

    #[test]
    fn what_asking_added_is_taken_out_however_the_stream_is_cut() {
        let bytes = ASKED.as_bytes();
        for size in [1, 2, 3, 7, 64, bytes.len()] {
            let mut strip = Strip::default();
            let mut out = Vec::new();
            for chunk in bytes.chunks(size) {
                out.extend_from_slice(&strip.feed(chunk));
            }
            out.extend_from_slice(&strip.finish());
            assert_eq!(
                String::from_utf8(out).unwrap(),
                UNASKED,
                "in chunks of {size}"
            );
        }
    }

    #[test]
    fn complete_events_go_on_at_once_and_only_the_one_arriving_is_held() {
        let mut strip = Strip::default();
        let first = "data: {\"choices\":[{\"delta\":{}}]}\n\n";
        let out = strip.feed(format!("{first}data: {{\"cho").as_bytes());
        assert_eq!(out, first.as_bytes());
        assert_eq!(strip.feed(b"ices\":[]}\n"), Bytes::new());
        assert_eq!(strip.feed(b"\n"), &b"data: {\"choices\":[]}\n\n"[..]);
    }

    #[test]
    fn an_event_too_long_to_hold_passes_as_it_comes() {
        let mut strip = Strip::default();
        let long = vec![b'x'; EVENT + 10];
        let mut out = strip.feed(b"data: ").to_vec();
        out.extend_from_slice(&strip.feed(&long));
        out.extend_from_slice(&strip.feed(b"\n"));
        out.extend_from_slice(&strip.feed(b"\ndata: {\"choices\":[],\"usage\":{}}\n\n"));
        out.extend_from_slice(&strip.finish());
        let mut want = b"data: ".to_vec();
        want.extend_from_slice(&long);
        want.extend_from_slice(b"\n\n");
        assert_eq!(out, want);
    }
}
