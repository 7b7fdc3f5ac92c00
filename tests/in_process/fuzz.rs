//! The fuzz targets' short run: each parser that reads what clients and vendors send, and the
//! config loader, on the committed corpus and on random and mutated inputs, without a panic.
//! The long runs are libFuzzer's (`docs/fuzzing.md`): `cargo +nightly fuzz run TARGET`.

#[path = "../../fuzz/harness.rs"]
mod harness;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

/// Random inputs per target in the suite; the long runs are libFuzzer's.
const CASES: u32 = 4_000;

/// The corpus committed for `target` (seeds and what libFuzzer kept), then `CASES` inputs
/// drawn from random bytes and from the corpus with bytes flipped, inserted and cut.
fn short_run(target: &str, run: fn(&[u8])) {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target);
    let corpus: Vec<Vec<u8>> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| std::fs::read(e.unwrap().path()).unwrap())
        .collect();
    assert!(!corpus.is_empty(), "no corpus for {target}");
    for input in &corpus {
        run(input);
    }
    let mutated = (prop::sample::select(corpus), any::<Vec<(u16, u8, u8)>>()).prop_map(
        |(mut seed, edits)| {
            for (at, byte, how) in edits {
                let at = usize::from(at) % (seed.len() + 1);
                match how % 3 {
                    0 if at < seed.len() => seed[at] = byte,
                    1 => seed.insert(at, byte),
                    _ => {
                        seed.truncate(at);
                    }
                }
            }
            seed
        },
    );
    let inputs = prop_oneof![prop::collection::vec(any::<u8>(), 0..512), mutated];
    TestRunner::new(Config::with_cases(CASES))
        .run(&inputs, |input| {
            run(&input);
            Ok(())
        })
        .unwrap();
}

#[test]
fn request_target() {
    short_run("request_target", harness::request_target);
}

#[test]
fn retry_after() {
    short_run("retry_after", harness::retry_after);
}

#[test]
fn rate_limit_headers() {
    short_run("rate_limit_headers", harness::rate_limit_headers);
}

#[test]
fn proxy_authorization() {
    short_run("proxy_authorization", harness::proxy_authorization);
}

#[test]
fn config() {
    short_run("config", harness::config);
}
