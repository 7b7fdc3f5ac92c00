//! What a budget's bot-wall challenges add up to on this instance: how many of its responses
//! over the last five minutes were challenges (past `challenge_share`, the pace widens), when
//! the advice was last logged (once a minute), and how many each product sent since the
//! start, for status.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use crate::signals::walls::Wall;

/// The window a share of challenges is counted over, in one-minute buckets.
const MINUTES: usize = 5;
/// How often the advice is logged, at most, per budget.
const LOG_EVERY_MS: u64 = 60_000;
/// Responses a window must hold before a share of challenges widens the pace, so that the
/// first challenge never does.
const MIN_RESPONSES: u32 = 10;
/// Challenges a window must hold before their share widens the pace.
const MIN_CHALLENGES: u32 = 2;

/// A budget's challenges; every count is an atomic, as every response of the budget counts.
#[derive(Default)]
pub(super) struct Challenges {
    minutes: [Minute; MINUTES],
    /// When the advice was last logged, in ms from the lanes' epoch, plus one (0: never).
    logged: AtomicU64,
    /// Challenges since the start, by product (in [`Wall`] order).
    by_wall: [AtomicU64; 6],
}

/// One minute's responses and challenges.
#[derive(Default)]
struct Minute {
    /// The minute counted (ms / 60,000, plus one; 0: none yet).
    at: AtomicU64,
    responses: AtomicU32,
    challenges: AtomicU32,
}

/// What a challenge makes of the window it falls in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Share {
    /// Responses over the window, this one included.
    pub responses: u32,
    /// Challenges over the window, this one included.
    pub challenges: u32,
    /// Whether they are past the destination's share: the pace widens.
    pub widens: bool,
    /// Whether the advice is due in the log (none logged in the last minute).
    pub log: bool,
}

impl Challenges {
    /// Counts a response at `now_ms` (ms from the lanes' epoch).
    pub(super) fn answered(&self, now_ms: u64) {
        self.minute(now_ms)
            .responses
            .fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a challenge from `wall` at `now_ms`, a response too, and says what the window
    /// makes of it against `share` (the destination's `challenge_share`).
    pub(super) fn challenged(&self, wall: Wall, now_ms: u64, share: f64) -> Share {
        let minute = self.minute(now_ms);
        minute.responses.fetch_add(1, Ordering::Relaxed);
        minute.challenges.fetch_add(1, Ordering::Relaxed);
        self.by_wall[wall as usize].fetch_add(1, Ordering::Relaxed);
        let (responses, challenges) = self.window(now_ms);
        let widens = responses >= MIN_RESPONSES
            && challenges >= MIN_CHALLENGES
            && f64::from(challenges) > share * f64::from(responses);
        let last = self.logged.load(Ordering::Relaxed);
        let log = (last == 0 || now_ms + 1 >= last + LOG_EVERY_MS)
            && self
                .logged
                .compare_exchange(last, now_ms + 1, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok();
        Share {
            responses,
            challenges,
            widens,
            log,
        }
    }

    /// Responses and challenges over the window ending at `now_ms`.
    pub(super) fn window(&self, now_ms: u64) -> (u32, u32) {
        let now = now_ms / 60_000 + 1;
        self.minutes
            .iter()
            .filter(|m| {
                let at = m.at.load(Ordering::Relaxed);
                at != 0 && at + MINUTES as u64 > now
            })
            .fold((0, 0), |(r, c), m| {
                (
                    r + m.responses.load(Ordering::Relaxed),
                    c + m.challenges.load(Ordering::Relaxed),
                )
            })
    }

    /// Challenges since the start, by product, those with any.
    pub(super) fn by_wall(&self) -> Vec<(Wall, u64)> {
        Wall::KNOWN
            .into_iter()
            .chain([Wall::Other])
            .map(|w| (w, self.by_wall[w as usize].load(Ordering::Relaxed)))
            .filter(|(_, n)| *n > 0)
            .collect()
    }

    /// The bucket of `now_ms`'s minute, emptied first where it last counted another. Two
    /// responses racing at a minute's turn may lose a count: a share, not a ledger.
    fn minute(&self, now_ms: u64) -> &Minute {
        let at = now_ms / 60_000 + 1;
        let minute = &self.minutes[(at % MINUTES as u64) as usize];
        let was = minute.at.load(Ordering::Relaxed);
        if was != at
            && minute
                .at
                .compare_exchange(was, at, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            minute.responses.store(0, Ordering::Relaxed);
            minute.challenges.store(0, Ordering::Relaxed);
        }
        minute
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: u64 = 60_000;

    #[test]
    fn the_first_challenge_never_widens_and_a_share_past_the_limit_does() {
        let c = Challenges::default();
        let first = c.challenged(Wall::Cloudflare, 0, 0.2);
        assert!(!first.widens && first.log, "{first:?}");
        // Nine clean responses, then a second challenge: 2 of 11 is under a fifth.
        for _ in 0..9 {
            c.answered(1_000);
        }
        let second = c.challenged(Wall::Cloudflare, 2_000, 0.2);
        assert_eq!((second.responses, second.challenges), (11, 2));
        assert!(!second.widens, "{second:?}");
        assert!(!second.log, "logged once a minute");
        let third = c.challenged(Wall::Cloudflare, 3_000, 0.2);
        assert!(third.widens, "3 of 12 is past a fifth: {third:?}");
        // A minute on, the advice is due again.
        assert!(c.challenged(Wall::Akamai, MIN + 3_000, 0.2).log);
        assert_eq!(c.by_wall(), [(Wall::Cloudflare, 3), (Wall::Akamai, 1)]);
    }

    #[test]
    fn the_window_is_five_minutes_and_older_minutes_are_forgotten() {
        let c = Challenges::default();
        for _ in 0..20 {
            c.challenged(Wall::DataDome, 0, 0.2);
        }
        assert_eq!(c.window(4 * MIN + 59_000), (20, 20));
        assert_eq!(c.window(5 * MIN), (0, 0), "past five minutes");
        // A bucket reused five minutes on starts from nothing.
        c.answered(5 * MIN + 1);
        assert_eq!(c.window(5 * MIN + 2), (1, 0));
        let late = c.challenged(Wall::DataDome, 5 * MIN + 3, 0.2);
        assert!(!late.widens, "{late:?}");
    }
}
