//! The log writer: each line is appended to a buffer in memory, and a thread of its own
//! writes the buffer to stderr every `EVERY` (at once when it holds `SOON` bytes). A
//! request's log line thus costs a lock and a copy, not a system call, and no thread is
//! woken for it. `Text` writes the request log line itself, the one line per request, with
//! less formatting machinery than the default text format and the same text.

use std::fmt;
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use parking_lot::{Condvar, Mutex};
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::format::{Format, Full, Writer};
use tracing_subscriber::fmt::time::SystemTime as Clock;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields, MakeWriter};
use tracing_subscriber::registry::LookupSpan;

use crate::proxy::REQUEST_LOG;

/// How long a line may wait in the buffer.
const EVERY: Duration = Duration::from_millis(100);
/// A buffer this full is written without waiting for the next tick.
const SOON: usize = 64 * 1024;

#[derive(Default)]
struct Shared {
    lines: Mutex<Vec<u8>>,
    full: Condvar,
    stopping: AtomicBool,
}

/// Where the subscriber writes: the buffer.
#[derive(Clone)]
pub(super) struct Buffered(Arc<Shared>);

/// Writes what is left when dropped; hold it until the process ends.
pub struct Flushing {
    shared: Arc<Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// A buffered writer to `out`, and the guard of its writing thread.
pub(super) fn buffered<W: Write + Send + 'static>(mut out: W) -> (Buffered, Flushing) {
    let shared = Arc::new(Shared::default());
    let mine = shared.clone();
    let thread = std::thread::Builder::new()
        .name("pacegate-log".into())
        .spawn(move || loop {
            let stopping = mine.stopping.load(Ordering::Acquire);
            let lines = {
                let mut lines = mine.lines.lock();
                if lines.len() < SOON && !stopping {
                    mine.full.wait_for(&mut lines, EVERY);
                }
                std::mem::take(&mut *lines)
            };
            if !lines.is_empty() {
                // Nowhere to report a failing stderr: the lines are lost.
                let _ = out.write_all(&lines).and_then(|()| out.flush());
            }
            if stopping {
                return;
            }
        })
        .ok();
    (Buffered(shared.clone()), Flushing { shared, thread })
}

impl Write for Buffered {
    fn write(&mut self, line: &[u8]) -> std::io::Result<usize> {
        let mut lines = self.0.lines.lock();
        lines.extend_from_slice(line);
        if lines.len() >= SOON {
            self.0.full.notify_one();
        }
        Ok(line.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> MakeWriter<'a> for Buffered {
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

/// The text format: the default one (`2026-12-01T17:56:07.374385Z  INFO target: fields`),
/// except that the request log line, when not coloured, is written here. The default format
/// styles each field name, formats the time through a calendar type and writes every value
/// through `Debug`: about 6% of the CPU of a proxied request. Here the time is humantime's
/// fixed-width writer and a plain string is copied between quotes; the text is the same.
#[derive(Default)]
pub(super) struct Text(Format<Full, Clock>);

impl<S, N> FormatEvent<S, N> for Text
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let meta = event.metadata();
        if writer.has_ansi_escapes() || meta.target() != REQUEST_LOG {
            return self.0.format_event(ctx, writer, event);
        }
        let level = match *meta.level() {
            Level::ERROR => "ERROR",
            Level::WARN => " WARN",
            Level::INFO => " INFO",
            Level::DEBUG => "DEBUG",
            Level::TRACE => "TRACE",
        };
        write!(
            writer,
            "{} {level} {}: ",
            humantime::format_rfc3339_micros(SystemTime::now()),
            meta.target()
        )?;
        let mut fields = Fields {
            out: &mut writer,
            first: true,
            result: Ok(()),
        };
        event.record(&mut fields);
        fields.result?;
        writer.write_char('\n')
    }
}

/// Writes `name=value` pairs as the default format's visitor does, without colour.
struct Fields<'w, 'a> {
    out: &'w mut Writer<'a>,
    first: bool,
    result: fmt::Result,
}

impl Fields<'_, '_> {
    fn field(&mut self, field: &Field, value: impl FnOnce(&mut Writer<'_>) -> fmt::Result) {
        if self.result.is_err() {
            return;
        }
        let out = &mut *self.out;
        let lead = if std::mem::take(&mut self.first) {
            ""
        } else {
            " "
        };
        let name = field.name();
        self.result = if name == "message" {
            out.write_str(lead).and_then(|()| value(out))
        } else {
            let name = name.strip_prefix("r#").unwrap_or(name);
            write!(out, "{lead}{name}=").and_then(|()| value(out))
        };
    }
}

impl Visit for Fields<'_, '_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        let message = field.name() == "message";
        self.field(field, |out| {
            // What `Debug` would escape is rare in these values; only then is it asked to.
            let plain = value
                .bytes()
                .all(|b| (b' '..=b'~').contains(&b) && b != b'"' && b != b'\\');
            match (message, plain) {
                (true, _) => out.write_str(value),
                (false, true) => write!(out, "\"{value}\""),
                (false, false) => write!(out, "{value:?}"),
            }
        });
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.field(field, |out| write!(out, "{value}"));
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.field(field, |out| write!(out, "{value}"));
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.field(field, |out| write!(out, "{value:?}"));
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
        }
        drop(guard);
        let written = String::from_utf8(sink.0.lock().clone()).unwrap();
        assert_eq!(written.lines().count(), 1001, "nothing lost at the end");
        assert!(written.ends_with("999\n"));
    }

    /// One request log line through a subscriber with `format`, without its time.
    fn request_line<F>(format: F, host: &str, reason: &str) -> String
    where
        F: FormatEvent<
                tracing_subscriber::Registry,
                tracing_subscriber::fmt::format::DefaultFields,
            > + Send
            + Sync
            + 'static,
    {
        let sink = Sink::default();
        let out = sink.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_writer(move || out.clone())
            .event_format(format)
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            tracing::info!(
                target: REQUEST_LOG,
                destination = "local",
                method = %http::Method::GET,
                host = %host,
                status = 200u16,
                duration_ms = 0.585663,
                waited_ms = 0.0009710000000000001,
                retries = 0u32,
                signed = -3i64,
                ok = true,
                reason,
                "a {} line",
                "request"
            );
        });
        let line = String::from_utf8(sink.0.lock().clone()).unwrap();
        // The time is the first 27 characters: `2026-12-01T17:56:07.374385Z`.
        assert_eq!(line.as_bytes()[26], b'Z', "{line}");
        line[27..].to_owned()
    }

    #[test]
    fn the_request_line_reads_as_the_default_format_writes_it() {
        for (host, reason) in [
            ("localhost:18080", ""),
            ("[::1]:443", "say \"no\" \\ twice"),
            ("h\u{e9}te:80", "tab\there, caf\u{e9}, \u{1b}[31m"),
        ] {
            let fast = request_line(Text::default(), host, reason);
            let default = request_line(Format::<Full, Clock>::default(), host, reason);
            assert_eq!(fast, default);
            assert!(
                fast.starts_with(
                    "  INFO pacegate::request: a request line destination=\"local\" method=GET"
                ),
                "{fast}"
            );
        }
    }
}
