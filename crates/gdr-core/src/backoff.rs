//! Capped exponential backoff with jitter, shared by the controller (retries towards Gitea,
//! JetStream and backends) and the executor (riding out facade outages).

use std::time::Duration;

use aws_lc_rs::rand::{SecureRandom, SystemRandom};

/// `base · 2^attempt`, capped at `max`, then jittered down to between half and all of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// Delay of the first retry (before jitter).
    pub base: Duration,
    /// Upper bound of every delay.
    pub max: Duration,
}

impl Backoff {
    /// A backoff from `base` to `max`.
    pub const fn new(base: Duration, max: Duration) -> Self {
        Backoff { base, max }
    }

    /// The capped delay of retry number `attempt` (0-based), without jitter.
    pub fn ceiling(&self, attempt: u32) -> Duration {
        let factor = 1u32.checked_shl(attempt.min(20)).unwrap_or(u32::MAX);
        self.base.saturating_mul(factor).min(self.max)
    }

    /// The jittered delay of retry number `attempt` (0-based): uniform in `[c/2, c]`.
    pub fn delay(&self, attempt: u32) -> Duration {
        let ceiling = self.ceiling(attempt);
        let half = ceiling / 2;
        let spread = (ceiling - half).as_nanos().min(u64::MAX as u128) as u64;
        if spread == 0 {
            return ceiling;
        }
        let mut bytes = [0u8; 8];
        // No randomness (never seen in practice) means no jitter, not no delay.
        if SystemRandom::new().fill(&mut bytes).is_err() {
            return ceiling;
        }
        half + Duration::from_nanos(u64::from_le_bytes(bytes) % spread.saturating_add(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_double_up_to_the_cap_and_stay_within_the_jitter_band() {
        let b = Backoff::new(Duration::from_millis(100), Duration::from_millis(700));
        assert_eq!(b.ceiling(0), Duration::from_millis(100));
        assert_eq!(b.ceiling(2), Duration::from_millis(400));
        assert_eq!(b.ceiling(3), Duration::from_millis(700));
        assert_eq!(b.ceiling(u32::MAX), Duration::from_millis(700));
        for attempt in 0..10 {
            let d = b.delay(attempt);
            assert!(
                d <= b.ceiling(attempt) && d >= b.ceiling(attempt) / 2,
                "{d:?}"
            );
        }
    }
}
