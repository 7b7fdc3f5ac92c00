//! The log writer: each line is appended to a buffer in memory, and a thread of its own
//! writes the buffer to stderr every [`EVERY`] (at once when it holds [`SOON`] bytes). A
//! request's log line thus costs a lock and a copy, not a system call, and no thread is
//! woken for it.

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};
use tracing_subscriber::fmt::MakeWriter;

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
}
