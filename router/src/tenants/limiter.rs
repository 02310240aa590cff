//! Per-key limits: requests running at once, requests per minute, tokens per minute.
//!
//! Both rates are token buckets holding a minute's worth and refilling continuously, so a key
//! may burst its whole minute and then runs at the steady rate. Requests are taken from their
//! bucket at admission. Tokens (prompt + generated) are only known once a request ends, so they
//! are charged then and may drive the bucket below zero; a key is admitted while its token
//! bucket holds at least one token. `Retry-After` is when the refused bucket has that again.
//!
//! Time comes in as an argument, so the tests step it by hand.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use super::keys_file::KeyLimits;

/// Why a key was refused, and when to come back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimitExceeded {
    pub limit: LimitKind,
    pub retry_after_secs: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitKind {
    ConcurrentRequests,
    RequestsPerMinute,
    TokensPerMinute,
}

impl LimitKind {
    /// The limit's name in the keys file, in messages and as a metric label.
    pub fn name(self) -> &'static str {
        match self {
            Self::ConcurrentRequests => "max_concurrent_requests",
            Self::RequestsPerMinute => "requests_per_minute",
            Self::TokensPerMinute => "tokens_per_minute",
        }
    }
}

/// One key's use, kept by name across reloads of the keys file (a reload changes the limits,
/// not what was used).
#[derive(Debug, Default)]
pub struct KeyUsage {
    state: Mutex<UsageState>,
    pub counters: KeyCounters,
}

/// What `/metrics` reports per key.
#[derive(Debug, Default)]
pub struct KeyCounters {
    pub requests: AtomicU64,
    pub refused_concurrent: AtomicU64,
    pub refused_requests_per_minute: AtomicU64,
    pub refused_tokens_per_minute: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
}

impl KeyCounters {
    pub fn refused(&self, limit: LimitKind) -> &AtomicU64 {
        match limit {
            LimitKind::ConcurrentRequests => &self.refused_concurrent,
            LimitKind::RequestsPerMinute => &self.refused_requests_per_minute,
            LimitKind::TokensPerMinute => &self.refused_tokens_per_minute,
        }
    }
}

#[derive(Debug, Default)]
struct UsageState {
    in_flight: u32,
    requests: Option<Bucket>,
    tokens: Option<Bucket>,
}

/// A minute's worth of something, refilled at that rate.
#[derive(Debug, Clone, Copy)]
struct Bucket {
    per_minute: f64,
    level: f64,
    updated: Instant,
}

impl Bucket {
    /// A bucket for `per_minute` (none without a limit), keeping what `old` had used when the
    /// limit changed.
    fn with_limit(old: Option<Bucket>, per_minute: Option<u64>, now: Instant) -> Option<Bucket> {
        let per_minute = per_minute? as f64;
        let level = match old {
            Some(mut old) => {
                old.refill(now);
                old.level.min(per_minute)
            }
            None => per_minute,
        };
        Some(Bucket {
            per_minute,
            level,
            updated: now,
        })
    }

    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.updated).as_secs_f64();
        self.level = (self.level + elapsed * self.per_minute / 60.0).min(self.per_minute);
        self.updated = now;
    }

    /// Whole seconds until the bucket holds one unit again (at least 1).
    fn seconds_until_one(&self) -> u64 {
        let missing = 1.0 - self.level;
        ((missing * 60.0 / self.per_minute).ceil() as u64).max(1)
    }
}

impl KeyUsage {
    fn state(&self) -> MutexGuard<'_, UsageState> {
        // The state is a few numbers, consistent after every statement; a panic elsewhere
        // while it was held leaves nothing half-done.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Admits one request under `limits`, or says which limit refused it. The request counts
    /// as running until the returned guard is dropped.
    pub fn admit(
        self: &Arc<Self>,
        limits: &KeyLimits,
        now: Instant,
    ) -> Result<InFlight, LimitExceeded> {
        let mut state = self.state();
        state.requests = Bucket::with_limit(
            state.requests,
            limits.requests_per_minute.map(u64::from),
            now,
        );
        state.tokens = Bucket::with_limit(state.tokens, limits.tokens_per_minute, now);
        let refused = if limits
            .max_concurrent_requests
            .is_some_and(|max| state.in_flight >= max)
        {
            Some(LimitExceeded {
                limit: LimitKind::ConcurrentRequests,
                // Nothing says when a running request ends; a second is a polite guess.
                retry_after_secs: 1,
            })
        } else if let Some(tokens) = state.tokens.filter(|bucket| bucket.level < 1.0) {
            Some(LimitExceeded {
                limit: LimitKind::TokensPerMinute,
                retry_after_secs: tokens.seconds_until_one(),
            })
        } else {
            state
                .requests
                .filter(|bucket| bucket.level < 1.0)
                .map(|requests| LimitExceeded {
                    limit: LimitKind::RequestsPerMinute,
                    retry_after_secs: requests.seconds_until_one(),
                })
        };
        if let Some(refused) = refused {
            self.counters
                .refused(refused.limit)
                .fetch_add(1, Ordering::Relaxed);
            return Err(refused);
        }
        if let Some(requests) = state.requests.as_mut() {
            requests.level -= 1.0;
        }
        state.in_flight += 1;
        self.counters.requests.fetch_add(1, Ordering::Relaxed);
        Ok(InFlight {
            usage: Arc::clone(self),
        })
    }

    /// Charges a finished request's tokens.
    pub fn charge(&self, prompt_tokens: u64, generated_tokens: u64, now: Instant) {
        self.counters
            .prompt_tokens
            .fetch_add(prompt_tokens, Ordering::Relaxed);
        self.counters
            .generated_tokens
            .fetch_add(generated_tokens, Ordering::Relaxed);
        let mut state = self.state();
        if let Some(tokens) = state.tokens.as_mut() {
            tokens.refill(now);
            tokens.level -= (prompt_tokens + generated_tokens) as f64;
        }
    }

    pub fn in_flight(&self) -> u32 {
        self.state().in_flight
    }
}

/// A request of this key running; dropped when its response has been sent (or abandoned).
#[derive(Debug)]
pub struct InFlight {
    usage: Arc<KeyUsage>,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut state = self.usage.state();
        state.in_flight = state.in_flight.saturating_sub(1);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn limits(concurrent: Option<u32>, rpm: Option<u32>, tpm: Option<u64>) -> KeyLimits {
        KeyLimits {
            max_concurrent_requests: concurrent,
            requests_per_minute: rpm,
            tokens_per_minute: tpm,
        }
    }

    #[test]
    fn concurrency_counts_running_requests() {
        let usage = Arc::new(KeyUsage::default());
        let limits = limits(Some(2), None, None);
        let now = Instant::now();
        let first = usage.admit(&limits, now).unwrap();
        let _second = usage.admit(&limits, now).unwrap();
        let refused = usage.admit(&limits, now).unwrap_err();
        assert_eq!(refused.limit, LimitKind::ConcurrentRequests);
        assert_eq!(refused.retry_after_secs, 1);
        drop(first);
        assert_eq!(usage.in_flight(), 1);
        assert!(usage.admit(&limits, now).is_ok());
    }

    #[test]
    fn requests_per_minute_burst_then_refill() {
        let usage = Arc::new(KeyUsage::default());
        let limits = limits(None, Some(3), None);
        let start = Instant::now();
        for _ in 0..3 {
            drop(usage.admit(&limits, start).unwrap());
        }
        let refused = usage.admit(&limits, start).unwrap_err();
        assert_eq!(refused.limit, LimitKind::RequestsPerMinute);
        // One request refills every 20 s.
        assert_eq!(refused.retry_after_secs, 20);
        let later = start + Duration::from_secs(15);
        assert_eq!(usage.admit(&limits, later).unwrap_err().retry_after_secs, 5);
        assert!(usage
            .admit(&limits, start + Duration::from_secs(20))
            .is_ok());
        assert_eq!(usage.counters.requests.load(Ordering::Relaxed), 4);
        assert_eq!(
            usage
                .counters
                .refused_requests_per_minute
                .load(Ordering::Relaxed),
            2
        );
    }

    #[test]
    fn tokens_are_charged_at_the_end_and_may_overdraw() {
        let usage = Arc::new(KeyUsage::default());
        let limits = limits(None, None, Some(600));
        let start = Instant::now();
        let request = usage.admit(&limits, start).unwrap();
        // Still admitted while the first runs: nothing is charged yet.
        drop(usage.admit(&limits, start).unwrap());
        usage.charge(500, 400, start);
        drop(request);
        let refused = usage.admit(&limits, start).unwrap_err();
        assert_eq!(refused.limit, LimitKind::TokensPerMinute);
        // 300 tokens overdrawn + 1, at 10 tokens a second.
        assert_eq!(refused.retry_after_secs, 31);
        assert!(usage
            .admit(&limits, start + Duration::from_secs(31))
            .is_ok());
        assert_eq!(usage.counters.prompt_tokens.load(Ordering::Relaxed), 500);
        assert_eq!(usage.counters.generated_tokens.load(Ordering::Relaxed), 400);
    }

    #[test]
    fn a_new_limit_keeps_what_was_used() {
        let usage = Arc::new(KeyUsage::default());
        let start = Instant::now();
        for _ in 0..10 {
            drop(usage.admit(&limits(None, Some(10), None), start).unwrap());
        }
        // Raised: the empty bucket stays empty, and fills at the new rate.
        let raised = limits(None, Some(60), None);
        assert!(usage.admit(&raised, start).is_err());
        assert!(usage.admit(&raised, start + Duration::from_secs(1)).is_ok());
        // Removed: no limit at all.
        assert!(usage.admit(&limits(None, None, None), start).is_ok());
    }

    #[test]
    fn no_limits_admit_everything() {
        let usage = Arc::new(KeyUsage::default());
        let now = Instant::now();
        let held: Vec<_> = (0..1000)
            .map(|_| usage.admit(&KeyLimits::default(), now).unwrap())
            .collect();
        assert_eq!(usage.in_flight(), 1000);
        drop(held);
        assert_eq!(usage.in_flight(), 0);
    }
}
