//! The log's writer, and the request line.
//!
//! Every line goes into a buffer in memory that a thread of its own writes to stderr every
//! `EVERY` (at once when it holds `SOON` bytes): a line costs a lock and a copy, not a system
//! call, and wakes no thread.
//!
//! The request line, one per request and so the most frequent by far, is not formatted on the
//! request path at all when the log is text without colours (as shipped): the request copies
//! its fields into the buffer as they are, numbers as numbers and texts as bytes, and the
//! writing thread formats them, without the formatting machinery, into the very text the
//! default format writes (`2026-12-01T17:56:07.374385Z  INFO pacegate::request:
//! destination="local" method=GET ...`). A request thus pays neither for a float's digits nor
//! for a formatter per field. In any other format (JSON; colours at a terminal) the request
//! line is a `tracing` event like every other line.

use std::fmt;
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use parking_lot::{Condvar, Mutex};

/// The request line's target: filters and JSON consumers select it by this name.
pub const REQUEST_LOG: &str = "pacegate::request";

/// How long a line may wait in the buffer.
const EVERY: Duration = Duration::from_millis(100);
/// A buffer this full is written without waiting for the next tick.
const SOON: usize = 64 * 1024;

/// The buffer holds frames, in the order they were written: a tag, then what it says.
/// `TEXT`: a length (u32) and the bytes of lines already formatted.
const TEXT: u8 = 0;
/// `REQUEST`: a request line's fields ([`RequestLine::encode`]).
const REQUEST: u8 = 1;

#[derive(Default)]
struct Shared {
    frames: Mutex<Vec<u8>>,
    full: Condvar,
    stopping: AtomicBool,
}

/// Where the subscriber writes: the buffer.
#[derive(Clone)]
pub struct Buffered(Arc<Shared>);

/// Writes what is left when dropped; hold it until the process ends.
pub struct Flushing {
    shared: Arc<Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// The buffer request lines go to unformatted, once the text log has been set up
/// ([`Buffered::take_request_lines`]), or none where its filter lets no request line
/// through; until then they are `tracing` events.
static REQUEST_LINES: OnceLock<Option<Buffered>> = OnceLock::new();

/// A buffered writer to `out`, and the guard of its writing thread.
pub fn buffered<W: Write + Send + 'static>(mut out: W) -> (Buffered, Flushing) {
    let shared = Arc::new(Shared::default());
    let mine = shared.clone();
    let thread = std::thread::Builder::new()
        .name("pacegate-log".into())
        .spawn(move || {
            // Two buffers that keep their capacity: the frames taken, the text made of them.
            let mut frames = Vec::new();
            let mut text = Vec::new();
            let mut second = Second::default();
            loop {
                let stopping = mine.stopping.load(Ordering::Acquire);
                {
                    let mut shared = mine.frames.lock();
                    if shared.len() < SOON && !stopping {
                        mine.full.wait_for(&mut shared, EVERY);
                    }
                    std::mem::swap(&mut *shared, &mut frames);
                }
                if !frames.is_empty() {
                    render(&frames, &mut text, &mut second);
                    // Nowhere to report a failing stderr: the lines are lost.
                    let _ = out.write_all(&text).and_then(|()| out.flush());
                    frames.clear();
                    text.clear();
                    // A burst may have grown them; do not keep its size for ever.
                    frames.shrink_to(4 * SOON);
                    text.shrink_to(8 * SOON);
                }
                if stopping {
                    return;
                }
            }
        })
        .ok();
    (Buffered(shared.clone()), Flushing { shared, thread })
}

impl Buffered {
    /// From now on request lines come to this buffer as fields, and its thread formats them
    /// as the default text format would (for the text log without colours). Called once the
    /// subscriber is set: its filter, which does not change while pacegate runs, is asked
    /// here once whether request lines pass, not on every request.
    pub fn take_request_lines(&self) {
        let passes = tracing::enabled!(target: REQUEST_LOG, tracing::Level::INFO);
        let _ = REQUEST_LINES.set(passes.then(|| self.clone()));
    }

    /// Appends one frame under the lock.
    fn frame(&self, write: impl FnOnce(&mut Vec<u8>)) {
        let mut frames = self.0.frames.lock();
        write(&mut frames);
        if frames.len() >= SOON {
            self.0.full.notify_one();
        }
    }
}

impl Write for Buffered {
    fn write(&mut self, line: &[u8]) -> std::io::Result<usize> {
        // One frame holds at most 4 GiB; a longer write is taken in parts.
        let line = &line[..line.len().min(u32::MAX as usize)];
        self.frame(|frames| {
            frames.push(TEXT);
            frames.extend_from_slice(&(line.len() as u32).to_le_bytes());
            frames.extend_from_slice(line);
        });
        Ok(line.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Buffered {
    type Writer = Buffered;

    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

impl Drop for Flushing {
    fn drop(&mut self) {
        self.shared.stopping.store(true, Ordering::Release);
        self.shared.full.notify_one();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The canonical line of one request: its fields, borrowed from the request.
pub struct RequestLine<'a> {
    pub destination: &'a str,
    pub method: &'a str,
    /// `host:port` as the request named it or as it was routed.
    pub host: Aimed<'a>,
    pub outcome: &'a str,
    pub status: u16,
    pub duration: Duration,
    pub waited: Option<Duration>,
    pub verdict: &'a str,
    pub verdict_reason: &'a str,
    pub retries: u32,
    pub class: &'a str,
    /// What the cache made of it (`hit`, `collapsed`, `stored`, ..., as its `Cache-Status`
    /// says), for a destination with `cache = true`; else empty.
    pub cache: &'a str,
    pub reason: &'a str,
}

/// What a request line names as its target.
#[derive(Clone, Copy, Debug)]
pub enum Aimed<'a> {
    /// As the request named it (`host:port`), for a refusal before its target was known.
    Named(&'a str),
    /// A target as routed: its host (IPv6 without brackets) and port.
    Routed(&'a str, u16),
}

impl fmt::Display for Aimed<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Self::Named(text) => f.write_str(text),
            Self::Routed(host, port) if host.contains(':') => write!(f, "[{host}]:{port}"),
            Self::Routed(host, port) => write!(f, "{host}:{port}"),
        }
    }
}

impl RequestLine<'_> {
    /// Logs the line at info, if the filter lets `pacegate::request` through.
    pub fn log(&self) {
        match REQUEST_LINES.get() {
            Some(Some(buffer)) => buffer.frame(|frames| self.encode(frames, SystemTime::now())),
            Some(None) => {}
            None => {
                if tracing::enabled!(target: REQUEST_LOG, tracing::Level::INFO) {
                    self.event();
                }
            }
        }
    }

    /// The line as a `tracing` event, for every format but plain text.
    fn event(&self) {
        tracing::info!(
            target: REQUEST_LOG,
            destination = self.destination,
            method = %self.method,
            // Not `target`: that is every event's own key in JSON, and would hide this one.
            host = %self.host,
            outcome = %self.outcome,
            status = self.status,
            duration_ms = millis(self.duration),
            waited_ms = self.waited.map_or(0.0, millis),
            verdict = self.verdict,
            verdict_reason = self.verdict_reason,
            retries = self.retries,
            class = self.class,
            cache = self.cache,
            reason = self.reason,
        );
    }

    /// Appends the fields as a `REQUEST` frame: what [`render_request`] reads, in its order.
    fn encode(&self, out: &mut Vec<u8>, now: SystemTime) {
        let since = now.duration_since(UNIX_EPOCH).unwrap_or_default();
        out.push(REQUEST);
        out.extend_from_slice(&since.as_secs().to_le_bytes());
        out.extend_from_slice(&since.subsec_nanos().to_le_bytes());
        out.extend_from_slice(&micros(self.duration).to_le_bytes());
        out.extend_from_slice(&self.waited.map_or(0, micros).to_le_bytes());
        out.extend_from_slice(&u32::from(self.status).to_le_bytes());
        out.extend_from_slice(&self.retries.to_le_bytes());
        put_str(out, self.destination);
        put_str(out, self.method);
        put_aimed(out, self.host);
        for text in [
            self.outcome,
            self.verdict,
            self.verdict_reason,
            self.class,
            self.cache,
            self.reason,
        ] {
            put_str(out, text);
        }
    }
}

/// Milliseconds to the microsecond, for the log: `0.586`, not `0.5856630000000001`.
fn millis(d: Duration) -> f64 {
    micros(d) as f64 / 1e3
}

/// Whole microseconds, rounded as [`millis`] shows them.
fn micros(d: Duration) -> u64 {
    (d.as_secs_f64() * 1e6).round() as u64
}

fn put_str(out: &mut Vec<u8>, text: &str) {
    let text = &text.as_bytes()[..text.len().min(u32::MAX as usize)];
    out.extend_from_slice(&(text.len() as u32).to_le_bytes());
    out.extend_from_slice(text);
}

/// The target written in place behind its length, as its `Display` writes it (without the
/// formatting machinery: a few hundred instructions on every request).
fn put_aimed(out: &mut Vec<u8>, aimed: Aimed<'_>) {
    let (host, port) = match aimed {
        Aimed::Named(text) => return put_str(out, text),
        Aimed::Routed(host, port) => (host, port),
    };
    let at = out.len();
    out.extend_from_slice(&[0; 4]);
    if host.contains(':') {
        out.push(b'[');
        out.extend_from_slice(host.as_bytes());
        out.push(b']');
    } else {
        out.extend_from_slice(host.as_bytes());
    }
    out.push(b':');
    decimal(out, u64::from(port));
    let len = u32::try_from(out.len() - at - 4).unwrap_or(u32::MAX);
    out[at..at + 4].copy_from_slice(&len.to_le_bytes());
}

/// The text of every frame in `frames`, appended to `text`.
fn render(frames: &[u8], text: &mut Vec<u8>, second: &mut Second) {
    let mut read = Reader(frames);
    while let Some(tag) = read.u8() {
        let whole = match tag {
            TEXT => read.bytes().map(|line| text.extend_from_slice(line)),
            REQUEST => render_request(&mut read, text, second),
            _ => None,
        };
        // Only this module writes frames; a short one would be a bug, and ends the batch.
        if whole.is_none() {
            return;
        }
    }
}

/// One request line, as the default format writes its event (checked by the tests).
fn render_request(read: &mut Reader<'_>, out: &mut Vec<u8>, second: &mut Second) -> Option<()> {
    let (secs, nanos) = (read.u64()?, read.u32()?);
    let duration = read.u64()?;
    let waited = read.u64()?;
    let status = read.u32()?;
    let retries = read.u32()?;
    second.write(out, secs, nanos);
    out.extend_from_slice(b"  INFO ");
    out.extend_from_slice(REQUEST_LOG.as_bytes());
    out.extend_from_slice(b": destination=");
    quoted(out, read.bytes()?)?;
    out.extend_from_slice(b" method=");
    out.extend_from_slice(read.bytes()?);
    out.extend_from_slice(b" host=");
    out.extend_from_slice(read.bytes()?);
    out.extend_from_slice(b" outcome=");
    out.extend_from_slice(read.bytes()?);
    out.extend_from_slice(b" status=");
    decimal(out, u64::from(status));
    out.extend_from_slice(b" duration_ms=");
    milliseconds(out, duration);
    out.extend_from_slice(b" waited_ms=");
    milliseconds(out, waited);
    out.extend_from_slice(b" verdict=");
    quoted(out, read.bytes()?)?;
    out.extend_from_slice(b" verdict_reason=");
    quoted(out, read.bytes()?)?;
    out.extend_from_slice(b" retries=");
    decimal(out, u64::from(retries));
    out.extend_from_slice(b" class=");
    quoted(out, read.bytes()?)?;
    out.extend_from_slice(b" cache=");
    quoted(out, read.bytes()?)?;
    out.extend_from_slice(b" reason=");
    quoted(out, read.bytes()?)?;
    out.push(b'\n');
    Some(())
}

/// The time as the default format writes it (`2026-12-01T17:56:07.374385Z`), the date and
/// second formatted once for every line of that second.
#[derive(Default)]
struct Second {
    secs: Option<u64>,
    text: Vec<u8>,
}

impl Second {
    fn write(&mut self, out: &mut Vec<u8>, secs: u64, nanos: u32) {
        if self.secs != Some(secs) {
            self.text.clear();
            let whole = humantime::format_rfc3339_seconds(UNIX_EPOCH + Duration::from_secs(secs));
            let _ = write!(self.text, "{whole}");
            // `2026-12-01T17:56:07Z`: the second, without its `Z`.
            self.text.pop();
            self.secs = Some(secs);
        }
        out.extend_from_slice(&self.text);
        out.push(b'.');
        let micros = nanos / 1000;
        const PLACES: [u32; 6] = [100_000, 10_000, 1_000, 100, 10, 1];
        let digits: [u8; 6] = PLACES.map(|place| b'0' + (micros / place % 10) as u8);
        out.extend_from_slice(&digits);
        out.push(b'Z');
    }
}

/// A text field as the default format writes it: through `Debug`, so between quotes and
/// escaped. What `Debug` would escape is rare in these values; only then is it asked to.
fn quoted(out: &mut Vec<u8>, value: &[u8]) -> Option<()> {
    // Most values are plain and copied as they are; only the rest are read as text again.
    let plain = value
        .iter()
        .all(|&b| (b' '..=b'~').contains(&b) && b != b'"' && b != b'\\');
    if plain {
        out.push(b'"');
        out.extend_from_slice(value);
        out.push(b'"');
    } else {
        let _ = write!(out, "{:?}", std::str::from_utf8(value).ok()?);
    }
    Some(())
}

fn decimal(out: &mut Vec<u8>, mut n: u64) {
    let mut digits = [0u8; 20];
    let mut at = digits.len();
    loop {
        at -= 1;
        digits[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[at..]);
}

/// `micros` as `Debug` writes the float `micros / 1000`: `0.586`, `1.5`, `12.0`.
fn milliseconds(out: &mut Vec<u8>, micros: u64) {
    decimal(out, micros / 1000);
    out.push(b'.');
    let mut fraction = micros % 1000;
    let mut width = 3;
    while width > 1 && fraction % 10 == 0 {
        fraction /= 10;
        width -= 1;
    }
    let digits = [
        b'0' + (fraction / 100 % 10) as u8,
        b'0' + (fraction / 10 % 10) as u8,
        b'0' + (fraction % 10) as u8,
    ];
    out.extend_from_slice(&digits[3 - width..]);
}

/// Reads frames back in the order they were written.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }

    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }

    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }

    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }

    fn bytes(&mut self) -> Option<&'a [u8]> {
        let len = self.u32()? as usize;
        self.take(len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A writer the test reads back.
    #[derive(Clone, Default)]
    struct Sink(Arc<Mutex<Vec<u8>>>);

    impl Write for Sink {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    #[expect(
        clippy::disallowed_methods,
        reason = "the writer is a thread of its own: waited for on the real clock"
    )]
    fn lines_are_written_within_a_tick_and_all_of_them_at_the_end() {
        let sink = Sink::default();
        let (mut writer, guard) = buffered(sink.clone());
        writer.write_all(b"one\n").unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while sink.0.lock().is_empty() {
            assert!(
                std::time::Instant::now() < deadline,
                "not written within 5 s"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(&*sink.0.lock(), b"one\n");
        for i in 0..1000 {
            writer.write_all(format!("{i}\n").as_bytes()).unwrap();
            if i == 500 {
                line(Aimed::Named("localhost:80"), "").encode_into(&writer);
            }
        }
        drop(guard);
        let written = String::from_utf8(sink.0.lock().clone()).unwrap();
        let lines: Vec<&str> = written.lines().collect();
        assert_eq!(lines.len(), 1002, "nothing lost at the end");
        assert!(lines[501].ends_with("500"), "{}", lines[501]);
        assert!(
            lines[502].contains("INFO pacegate::request: destination=\"local\""),
            "the request line in its place: {}",
            lines[502]
        );
        assert!(written.ends_with("999\n"));
    }

    impl RequestLine<'_> {
        fn encode_into(&self, buffer: &Buffered) {
            buffer.frame(|frames| self.encode(frames, SystemTime::now()));
        }
    }

    fn line<'a>(host: Aimed<'a>, reason: &'a str) -> RequestLine<'a> {
        RequestLine {
            destination: "local",
            method: "GET",
            host,
            outcome: "forwarded",
            status: 200,
            duration: Duration::from_nanos(585_663_123),
            waited: Some(Duration::from_nanos(971)),
            verdict: "clean",
            verdict_reason: "status",
            retries: 0,
            class: "",
            cache: "hit",
            reason,
        }
    }

    /// `line` as the default text format writes its event, without the time.
    fn as_the_default_format_writes_it(line: &RequestLine<'_>) -> String {
        let sink = Sink::default();
        let out = sink.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_writer(move || out.clone())
            .finish();
        tracing::subscriber::with_default(subscriber, || line.event());
        let text = String::from_utf8(sink.0.lock().clone()).unwrap();
        // The time is the first 27 characters: `2026-12-01T17:56:07.374385Z`.
        assert_eq!(text.as_bytes()[26], b'Z', "{text}");
        text[27..].to_owned()
    }

    /// `line` as the writing thread formats it from its frame, without the time.
    fn as_rendered(line: &RequestLine<'_>, at: SystemTime) -> String {
        let mut frames = Vec::new();
        line.encode(&mut frames, at);
        let mut text = Vec::new();
        render(&frames, &mut text, &mut Second::default());
        let text = String::from_utf8(text).unwrap();
        text[27..].to_owned()
    }

    #[test]
    fn the_request_line_reads_as_the_default_format_writes_it() {
        let at = SystemTime::now();
        for (host, reason) in [
            (Aimed::Named("localhost:18080"), ""),
            (Aimed::Routed("localhost", 18080), ""),
            (Aimed::Routed("::1", 443), "say \"no\" \\ twice"),
            (Aimed::Named("[::1]:443"), "say \"no\" \\ twice"),
            (
                Aimed::Routed("h\u{e9}te", 80),
                "tab\there, caf\u{e9}, \u{1b}[31m",
            ),
            (Aimed::Routed("a", 0), ""),
            (Aimed::Routed("a", 65535), ""),
        ] {
            for (duration, waited) in [
                (
                    Duration::from_nanos(585_663_123),
                    Some(Duration::from_nanos(971)),
                ),
                (Duration::ZERO, None),
                (Duration::from_millis(1500), Some(Duration::from_secs(12))),
                (
                    Duration::from_micros(120_030),
                    Some(Duration::from_nanos(1_499)),
                ),
            ] {
                let line = RequestLine {
                    duration,
                    waited,
                    ..line(host, reason)
                };
                let rendered = as_rendered(&line, at);
                assert_eq!(rendered, as_the_default_format_writes_it(&line));
                assert!(
                    rendered.starts_with(
                        "  INFO pacegate::request: destination=\"local\" method=GET host="
                    ),
                    "{rendered}"
                );
            }
        }
    }

    #[test]
    fn the_time_is_written_as_the_default_format_writes_it() {
        let at = UNIX_EPOCH + Duration::new(1_796_342_400, 374_385_999);
        let mut frames = Vec::new();
        line(Aimed::Named("localhost:1"), "").encode(&mut frames, at);
        let mut text = Vec::new();
        let mut second = Second::default();
        render(&frames, &mut text, &mut second);
        // The next line in the same second reuses its text; one in the next second does not.
        for at in [
            at + Duration::from_micros(5),
            at + Duration::from_millis(700),
        ] {
            let mut frames = Vec::new();
            line(Aimed::Named("localhost:1"), "").encode(&mut frames, at);
            render(&frames, &mut text, &mut second);
        }
        let text = String::from_utf8(text).unwrap();
        let times: Vec<&str> = text.lines().map(|l| &l[..27]).collect();
        assert_eq!(
            times,
            [
                "2026-12-04T00:00:00.374385Z",
                "2026-12-04T00:00:00.374390Z",
                "2026-12-04T00:00:01.074385Z"
            ]
        );
        // Against the calendar's own writer, over seconds and microseconds of every size.
        let mut second = Second::default();
        for k in 0..5_000u64 {
            let at = UNIX_EPOCH
                + Duration::new(
                    k * 7_919_993 % 4_102_444_800,
                    (k * 104_729) as u32 % 1_000_000_000,
                );
            let mut out = Vec::new();
            let since = at.duration_since(UNIX_EPOCH).unwrap();
            second.write(&mut out, since.as_secs(), since.subsec_nanos());
            assert_eq!(
                String::from_utf8(out).unwrap(),
                humantime::format_rfc3339_micros(at).to_string()
            );
        }
        let text = text.into_bytes();
        assert!(
            text.starts_with(b"2026-12-04T00:00:00.374385Z  INFO"),
            "{}",
            String::from_utf8_lossy(&text)
        );
    }

    #[test]
    fn milliseconds_read_as_the_float_would() {
        let mut seed = 0x2545_f491_4f6c_dd1d_u64;
        let mut samples: Vec<u64> = (0..2_000).collect();
        for _ in 0..20_000 {
            // xorshift: many magnitudes, from microseconds to days.
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            samples.push(seed >> (seed % 40 + 24));
        }
        for micros in samples {
            let mut out = Vec::new();
            milliseconds(&mut out, micros);
            let float = millis(Duration::from_micros(micros));
            assert_eq!(String::from_utf8(out).unwrap(), format!("{float:?}"));
        }
    }
}
