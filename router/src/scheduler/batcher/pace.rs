//! Prefill pacing: how many prompt tokens a step may compute while other requests decode.
//!
//! A step's Prefill and its Decode are two shard calls, so every prompt token computed in a
//! step delays the next token of every decoding request. With a fixed budget, a 2,048-token
//! prompt arriving while 28 streams decode stalls them for as long as two thousand tokens
//! of prefill take, then they run at full pace again: their inter-token p99 is dozens of
//! times their p50. Pacing sizes the chunks from what the steps are measured to cost instead,
//! so that a step's prefill takes about `pace` times the last decode steps: the running
//! streams slow down by a bounded factor while the prompt goes in, on any CPU and model.
//!
//! Pacing holds back a few requests for the sake of many: it applies only while fewer than a
//! quarter as many requests wait for their first token as decode. Otherwise the full
//! `--max-batch-prefill-tokens` applies: a burst of new requests, the first steps after
//! start-up, or a wave of requests that finished together and come back. Holding those back
//! would cost them more time than it saves the running streams, and throughput too: the
//! decode steps run at a fraction of the batch meanwhile, for about the same cost a step.

use std::time::Duration;

/// Pacing applies while `waiting * WAITING_SHARE < decoding`.
const WAITING_SHARE: usize = 4;

/// Weight of the newest measurement in the running averages: recent enough to follow the
/// batch as it grows and shrinks, smooth enough that one slow step does not swing the chunks.
const NEWEST_WEIGHT: f64 = 0.25;

pub(super) struct PrefillPace {
    /// Prefill time per decode time; 0 turns pacing off.
    pace: f64,
    /// Running average of a Decode call's seconds.
    decode_secs: Option<f64>,
    /// Running average of a Prefill call's seconds per computed prompt token.
    prefill_secs_per_token: Option<f64>,
}

impl PrefillPace {
    pub(super) fn new(pace: f64) -> Self {
        Self {
            pace,
            decode_secs: None,
            prefill_secs_per_token: None,
        }
    }

    pub(super) fn record_decode(&mut self, elapsed: Duration) {
        average_in(&mut self.decode_secs, elapsed.as_secs_f64());
    }

    /// `computed`: prompt tokens the Prefill computed (prefix-cache hits excluded).
    pub(super) fn record_prefill(&mut self, elapsed: Duration, computed: u64) {
        if computed > 0 {
            average_in(
                &mut self.prefill_secs_per_token,
                elapsed.as_secs_f64() / computed as f64,
            );
        }
    }

    /// The prompt tokens the next step may compute: `cap` (`--max-batch-prefill-tokens`)
    /// unless requests decode and fewer than a quarter as many wait; then what takes about
    /// `pace` decode steps, at least `floor` so that prompts always go on.
    pub(super) fn budget(&self, cap: u32, floor: u32, decoding: usize, waiting: usize) -> u32 {
        if self.pace <= 0.0 || decoding == 0 || waiting * WAITING_SHARE >= decoding {
            return cap;
        }
        let (Some(decode), Some(per_token)) = (self.decode_secs, self.prefill_secs_per_token)
        else {
            return cap;
        };
        let tokens = self.pace * decode / per_token.max(f64::MIN_POSITIVE);
        // `as` saturates: a huge or infinite quotient becomes u32::MAX, then the cap.
        (tokens as u32).clamp(floor.min(cap), cap)
    }
}

fn average_in(average: &mut Option<f64>, sample: f64) {
    *average = Some(match *average {
        Some(old) => old + NEWEST_WEIGHT * (sample - old),
        None => sample,
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// A pace that measured one decode step of `decode` and one prefill of `tokens` in `prefill`.
    fn measured(pace: f64, decode: Duration, prefill: Duration, tokens: u64) -> PrefillPace {
        let mut measured = PrefillPace::new(pace);
        measured.record_decode(decode);
        measured.record_prefill(prefill, tokens);
        measured
    }

    #[test]
    fn full_budget_until_both_costs_are_known() {
        let mut pace = PrefillPace::new(1.0);
        assert_eq!(pace.budget(4096, 16, 28, 4), 4096);
        pace.record_decode(ms(50));
        assert_eq!(pace.budget(4096, 16, 28, 4), 4096);
        pace.record_prefill(ms(400), 1000);
        // 50 ms of decode at 0.4 ms a prompt token.
        assert_eq!(pace.budget(4096, 16, 28, 4), 125);
    }

    #[test]
    fn pace_scales_the_chunk() {
        let pace = measured(0.5, ms(50), ms(400), 1000);
        assert_eq!(pace.budget(4096, 16, 28, 4), 62);
    }

    #[test]
    fn full_budget_when_nothing_decodes_or_a_quarter_as_many_wait() {
        let pace = measured(1.0, ms(50), ms(400), 1000);
        assert_eq!(pace.budget(4096, 16, 0, 4), 4096);
        assert_eq!(pace.budget(4096, 16, 16, 4), 4096);
        assert_eq!(pace.budget(4096, 16, 17, 15), 4096);
        assert_eq!(pace.budget(4096, 16, 1, 31), 4096);
        assert_eq!(pace.budget(4096, 16, 17, 4), 125);
        assert_eq!(pace.budget(4096, 16, 28, 4), 125);
        assert_eq!(pace.budget(4096, 16, 2, 0), 125);
    }

    #[test]
    fn off_at_zero() {
        let pace = measured(0.0, ms(50), ms(400), 1000);
        assert_eq!(pace.budget(4096, 16, 28, 4), 4096);
    }

    #[test]
    fn bounded_by_floor_and_cap() {
        let pace = measured(1.0, ms(1), ms(1000), 100);
        assert_eq!(pace.budget(4096, 16, 28, 4), 16);
        // A floor above the cap gives the cap.
        assert_eq!(pace.budget(8, 16, 28, 4), 8);
        let fast = measured(1.0, ms(1000), Duration::from_nanos(1), 1);
        assert_eq!(fast.budget(4096, 16, 28, 4), 4096);
    }

    #[test]
    fn averages_follow_new_costs() {
        let mut pace = PrefillPace::new(1.0);
        pace.record_prefill(ms(400), 1000);
        pace.record_prefill(ms(0), 0);
        pace.record_decode(ms(50));
        pace.record_decode(ms(90));
        // decode: 50 + 0.25 × 40 = 60 ms; per token still 0.4 ms.
        assert_eq!(pace.budget(4096, 16, 28, 4), 150);
    }
}
