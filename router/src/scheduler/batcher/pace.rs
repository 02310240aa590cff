//! Prefill pacing: how many prompt tokens a step may compute while other requests decode.
//!
//! Every prompt token computed in a step delays the next token of every decoding request,
//! whether the step's prefill runs in the Decode's forward pass (a mixed step,
//! `batcher/mixed.rs`) or as a Prefill call before it. With a fixed budget, a 2,048-token
//! prompt arriving while 28 streams decode stalls them for as long as two thousand tokens
//! of prefill take, then they run at full pace again: their inter-token p99 is dozens of
//! times their p50. Pacing sizes each step's prefill from what steps are measured to cost
//! instead, so that it takes about `pace` times a decode step: the running streams slow down
//! by a bounded factor (about `1 + pace`) while the prompt goes in, on any CPU, GPU and model.
//!
//! Pacing holds back a few requests for the sake of many: it applies only while fewer than a
//! quarter as many requests wait for their first token (queued, or with their prefill under
//! way) as decode. Otherwise the full `--max-batch-prefill-tokens` applies: a burst of new
//! requests, the first steps after start-up, or a wave of requests that finished together and
//! come back. Holding those back costs them far more than it saves the running streams: with
//! pacing on whatever waits, a wave of 32 real prompts on a 2-core CPU took 28 s to its median
//! first token instead of a few, as it trickled in beside ever longer decode steps (and the
//! decode average, measured before the wave, no longer described them). The price is that
//! the streams started by a wave's first step wait while its later steps go in.
//!
//! The budget is `pace × decode step ÷ prefill seconds per token`, at least `floor` (a block,
//! so prompts always go on) and at most `cap`; until both costs are measured, `cap`. Both are
//! running averages:
//! - the decode step's time comes from pure Decode calls only (no prompt tokens in them);
//! - the per-token prefill cost from Prefill calls of their own (their time ÷ their tokens), and
//!   from mixed steps as `(step − decode average) ÷ tokens`: a mixed step costs about one
//!   decode step plus its prompt tokens, and it is the prompt tokens' share that the budget
//!   divides by. A mixed step no longer than the decode average holds no measurable prefill
//!   cost (its tokens rode along for free, or the batch shrank since the average was taken);
//!   it is then recorded as a decode sample instead, since the step bounds the decode cost
//!   from above, and the per-token estimate keeps its value rather than falling to zero.
//!
//! While every step is mixed (a long wave), the decode average is the one measured before;
//! when the wave's requests join the batch and make the decode dearer, the excess is counted as
//! prefill cost: the budget errs small, on the side of the running streams.

use std::time::Duration;

/// Pacing applies while `waiting * WAITING_SHARE < decoding`.
const WAITING_SHARE: usize = 4;

/// Weight of the newest measurement in the running averages: recent enough to follow the
/// batch as it grows and shrinks, smooth enough that one slow step does not swing the chunks.
const NEWEST_WEIGHT: f64 = 0.25;

pub(super) struct PrefillPace {
    /// Prefill time per decode time; 0 turns pacing off.
    pace: f64,
    /// Running average of a pure Decode call's seconds.
    decode_secs: Option<f64>,
    /// Running average of prefill seconds per computed prompt token.
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

    /// A Decode call that carried no prefill.
    pub(super) fn record_decode(&mut self, elapsed: Duration) {
        average_in(&mut self.decode_secs, elapsed.as_secs_f64());
    }

    /// A Prefill call of its own; `computed`: prompt tokens it computed (prefix-cache hits
    /// excluded).
    pub(super) fn record_prefill(&mut self, elapsed: Duration, computed: u64) {
        if computed > 0 {
            average_in(
                &mut self.prefill_secs_per_token,
                elapsed.as_secs_f64() / computed as f64,
            );
        }
    }

    /// A Decode that carried a prefill of `computed` prompt tokens (see the module docs).
    pub(super) fn record_mixed(&mut self, elapsed: Duration, computed: u64) {
        let Some(decode) = self.decode_secs else {
            // No decode cost to take off: the step's share of prefill is unknown.
            return;
        };
        let extra = elapsed.as_secs_f64() - decode;
        if extra > 0.0 && computed > 0 {
            average_in(&mut self.prefill_secs_per_token, extra / computed as f64);
        } else {
            self.record_decode(elapsed);
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
        assert_eq!(pace.budget(4096, 16, 8, 0), 4096);
        pace.record_decode(ms(50));
        assert_eq!(pace.budget(4096, 16, 8, 0), 4096);
        pace.record_prefill(ms(400), 1000);
        // 50 ms of decode at 0.4 ms a prompt token.
        assert_eq!(pace.budget(4096, 16, 8, 0), 125);
    }

    #[test]
    fn pace_scales_the_chunk() {
        let pace = measured(0.5, ms(50), ms(400), 1000);
        assert_eq!(pace.budget(4096, 16, 8, 0), 62);
    }

    #[test]
    fn full_budget_when_nothing_decodes_or_a_quarter_as_many_wait() {
        let pace = measured(1.0, ms(50), ms(400), 1000);
        assert_eq!(pace.budget(4096, 16, 0, 0), 4096);
        assert_eq!(pace.budget(4096, 16, 8, 1), 125);
        assert_eq!(pace.budget(4096, 16, 8, 2), 4096);
        assert_eq!(pace.budget(4096, 16, 9, 2), 125);
    }

    #[test]
    fn off_at_zero() {
        let pace = measured(0.0, ms(50), ms(400), 1000);
        assert_eq!(pace.budget(4096, 16, 8, 0), 4096);
    }

    #[test]
    fn bounded_by_floor_and_cap() {
        let pace = measured(1.0, ms(1), ms(1000), 100);
        assert_eq!(pace.budget(4096, 16, 8, 0), 16);
        // A floor above the cap gives the cap.
        assert_eq!(pace.budget(8, 16, 8, 0), 8);
        let fast = measured(1.0, ms(1000), Duration::from_nanos(1), 1);
        assert_eq!(fast.budget(4096, 16, 8, 0), 4096);
    }

    #[test]
    fn averages_follow_new_costs() {
        let mut pace = PrefillPace::new(1.0);
        pace.record_prefill(ms(400), 1000);
        pace.record_prefill(ms(0), 0);
        pace.record_decode(ms(50));
        pace.record_decode(ms(90));
        // decode: 50 + 0.25 × 40 = 60 ms; per token still 0.4 ms.
        assert_eq!(pace.budget(4096, 16, 8, 0), 150);
    }

    #[test]
    fn a_mixed_step_counts_its_time_beyond_a_decode_step_as_prefill() {
        let mut pace = PrefillPace::new(1.0);
        pace.record_decode(ms(40));
        // 40 ms of decode and 100 tokens at 0.2 ms.
        pace.record_mixed(ms(60), 100);
        assert_eq!(pace.budget(4096, 16, 8, 0), 200);
        // The decode average is untouched by it.
        pace.record_mixed(ms(60), 100);
        assert_eq!(pace.budget(4096, 16, 8, 0), 200);
    }

    #[test]
    fn a_mixed_step_no_longer_than_a_decode_step_lowers_the_decode_cost_only() {
        let mut pace = measured(1.0, ms(40), ms(40), 100);
        pace.record_mixed(ms(20), 100);
        // decode: 40 − 0.25 × 20 = 35 ms; per token still 0.4 ms.
        assert_eq!(pace.budget(4096, 16, 8, 0), 87);
    }

    #[test]
    fn a_mixed_step_before_any_decode_is_not_measured() {
        let mut pace = PrefillPace::new(1.0);
        pace.record_mixed(ms(60), 100);
        pace.record_decode(ms(40));
        assert_eq!(pace.budget(4096, 16, 8, 0), 4096);
    }
}
