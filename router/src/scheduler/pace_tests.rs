//! Prefill pacing against a fake shard whose Decode takes 32 ms and whose Prefill takes 1 ms
//! per computed prompt token (a mixed step: both), on tokio's paused clock: the step times the
//! batcher measures are exact, so the chunk sizes and the running streams' inter-token times
//! are too. A few prompts among many decoding streams are checked in both step shapes (mixed,
//! and a Prefill call then a Decode call), and a burst that outnumbers the streams.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::test_support::{assert_all_released, collect, config, next_token, request, start};
use super::{FinishReason, SchedulerConfig};
use crate::shard::{fake_next_token, FakeShard};

const DECODE: Duration = Duration::from_millis(32);
const PER_TOKEN: Duration = Duration::from_millis(1);

fn shard() -> Arc<FakeShard> {
    Arc::new(
        FakeShard::new(super::test_support::VOCAB)
            .with_cache(16, 256)
            .with_decode_delay(DECODE)
            .with_prefill_token_delay(PER_TOKEN),
    )
}

fn paced(pace: f64) -> SchedulerConfig {
    paced_with_cache(pace, 256)
}

fn paced_with_cache(pace: f64, num_blocks: u32) -> SchedulerConfig {
    SchedulerConfig {
        max_batch_prefill_tokens: 4096,
        prefill_pace: pace,
        ..config(16, num_blocks)
    }
}

/// Five streams decode; a 320-token prompt arrives. Returns the Prefill sizes after the
/// streams' own, and the longest gap between two tokens of a running stream meanwhile.
async fn long_prompt_among_decoding(pace: f64) -> (Vec<u32>, Duration) {
    let shard = shard();
    let scheduler = start(&shard, paced(pace));
    let short: Vec<u32> = (1..=8).collect();
    let mut running: Vec<_> = (0..5)
        .map(|_| scheduler.submit(request(&short, 60)).unwrap())
        .collect();
    for events in &mut running {
        next_token(events).await;
    }
    let before = shard.stats().prefill_tokens.len();
    let long: Vec<u32> = (0..320).map(|i| 10 + i % 200).collect();
    let long_run = tokio::spawn(collect(scheduler.submit(request(&long, 2)).unwrap()));
    let mut longest = Duration::ZERO;
    let mut last = Instant::now();
    while !long_run.is_finished() {
        next_token(&mut running[0]).await;
        longest = longest.max(last.elapsed());
        last = Instant::now();
    }
    let outcome = long_run.await.unwrap();
    assert_eq!(outcome.finish, Ok(FinishReason::Length));
    for events in running {
        assert_eq!(collect(events).await.finish, Ok(FinishReason::Length));
    }
    assert_all_released(&shard, &scheduler).await;
    let sizes = shard.stats().prefill_tokens[before..].to_vec();
    (sizes, longest)
}

#[tokio::test(start_paused = true)]
async fn chunks_take_about_one_decode_step_while_streams_decode() {
    let (sizes, longest) = long_prompt_among_decoding(1.0).await;
    // 32 ms of decode at 1 ms a token: 32-token chunks.
    assert_eq!(sizes, vec![32; 10]);
    // A running stream waits for one chunk and one decode step at most.
    assert!(
        longest <= DECODE * 2 + Duration::from_millis(1),
        "{longest:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn pace_scales_the_chunks() {
    let (sizes, _) = long_prompt_among_decoding(0.5).await;
    assert_eq!(sizes, vec![16; 20]);
}

#[tokio::test(start_paused = true)]
async fn without_pacing_the_prompt_takes_the_whole_budget() {
    let (sizes, longest) = long_prompt_among_decoding(0.0).await;
    assert_eq!(sizes, vec![320]);
    assert!(longest >= PER_TOKEN * 320, "{longest:?}");
}

/// The wave's shard: each call takes `STEP`, a Decode `WAVE_DECODE` more, and each computed
/// prompt token `PER_TOKEN` more (a mixed step: `STEP + WAVE_DECODE + tokens × PER_TOKEN`).
const STEP: Duration = Duration::from_millis(2);
const WAVE_DECODE: Duration = Duration::from_millis(30);
const BLOCK: u32 = 16;

/// The longest a running stream may wait for its next token while prompts go in: one step
/// whose prefill is one paced budget. The budget is `pace` × the decode step's time
/// (`STEP + WAVE_DECODE`) at `PER_TOKEN` a token, at least a block; a Prefill call of its own
/// measures its `STEP` as prefill cost too, which only makes its budget smaller. A mixed step
/// then takes `STEP + WAVE_DECODE + budget × PER_TOKEN`; two calls one `STEP` more.
fn paced_gap_bound(pace: f64, calls_per_step: u32) -> Duration {
    let decode = STEP + WAVE_DECODE;
    let budget = (pace * decode.as_secs_f64() / PER_TOKEN.as_secs_f64()).ceil() as u32;
    STEP * calls_per_step + WAVE_DECODE + PER_TOKEN * budget.max(BLOCK)
}

/// The fake's base-model tokens after `prompt`.
fn reference(prompt: &[u32], n: usize) -> Vec<u32> {
    let mut previous = *prompt.last().unwrap();
    (0..n)
        .map(|_| {
            previous = fake_next_token(previous, super::test_support::VOCAB);
            previous
        })
        .collect()
}

/// What the shard saw while a wave went in among decoding streams.
struct Wave {
    /// Longest wait of a running stream for its next token meanwhile.
    longest_gap: Duration,
    /// Prefill calls (on their own or carried) and mixed steps meanwhile.
    prefills: u64,
    mixed: u64,
    /// Decode calls and decode steps the router counted meanwhile.
    decode_calls: u64,
    decode_steps: u64,
}

/// `streams` streams decode; `arrivals` prompts of 100 distinct tokens arrive at once. Every
/// one of them must get its first token and finish, with the fake's tokens, while the streams
/// decode.
async fn wave_among_decoding(mixed_prefill: bool, streams: u32, arrivals: u32) -> Wave {
    let shard = Arc::new(
        FakeShard::new(super::test_support::VOCAB)
            .with_cache(BLOCK, 512)
            .with_step_delay(STEP)
            .with_decode_delay(WAVE_DECODE)
            .with_prefill_token_delay(PER_TOKEN),
    );
    let scheduler = start(
        &shard,
        SchedulerConfig {
            mixed_prefill,
            ..paced_with_cache(1.0, 512)
        },
    );
    let mut streams: Vec<_> = (0..streams)
        .map(|n| scheduler.submit(request(&[1, 2, 3, n + 4], 200)).unwrap())
        .collect();
    for events in &mut streams {
        next_token(events).await;
    }
    let (shard_before, router_before) = (shard.stats(), scheduler.stats());
    let prompts: Vec<Vec<u32>> = (0..arrivals)
        .map(|n| (0..100).map(|i| 10 + (n * 7 + i) % 240).collect())
        .collect();
    let wave: Vec<_> = prompts
        .iter()
        .map(|prompt| {
            let events = scheduler.submit(request(prompt, 4)).unwrap();
            tokio::spawn(collect(events))
        })
        .collect();
    let mut longest_gap = Duration::ZERO;
    let mut last = Instant::now();
    while !wave.iter().all(|request| request.is_finished()) {
        let event = next_token(&mut streams[0]).await;
        assert_eq!(
            event.finish, None,
            "the stream ended before the wave went in"
        );
        longest_gap = longest_gap.max(last.elapsed());
        last = Instant::now();
    }
    let (shard_after, router_after) = (shard.stats(), scheduler.stats());
    for (prompt, request) in prompts.iter().zip(wave) {
        let outcome = request.await.unwrap();
        assert_eq!(outcome.tokens, reference(prompt, 4));
        assert_eq!(outcome.finish, Ok(FinishReason::Length));
    }
    for events in streams {
        assert_eq!(collect(events).await.finish, Ok(FinishReason::Length));
    }
    assert_all_released(&shard, &scheduler).await;
    Wave {
        longest_gap,
        prefills: shard_after.prefill_calls - shard_before.prefill_calls,
        mixed: shard_after.mixed_calls - shard_before.mixed_calls,
        decode_calls: shard_after.decode_calls - shard_before.decode_calls,
        decode_steps: router_after.decode_steps - router_before.decode_steps,
    }
}

#[tokio::test(start_paused = true)]
async fn a_few_prompts_go_in_mixed_steps_of_one_paced_budget() {
    // Four arrivals among twenty streams: fewer than a quarter as many wait as decode.
    let wave = wave_among_decoding(true, 20, 4).await;
    let bound = paced_gap_bound(1.0, 1);
    assert!(
        wave.longest_gap <= bound,
        "{:?} > {bound:?}",
        wave.longest_gap
    );
    // More than one step: the wave was paced, not let in whole.
    assert!(wave.prefills > 1);
    // One shard call a step: every prefill rode in the step's Decode.
    assert_eq!(wave.mixed, wave.prefills);
    assert!(wave.decode_calls.abs_diff(wave.decode_steps) <= 1);
}

#[tokio::test(start_paused = true)]
async fn without_mixed_steps_a_few_prompts_are_paced_over_two_calls_a_step() {
    let wave = wave_among_decoding(false, 20, 4).await;
    let bound = paced_gap_bound(1.0, 2);
    assert!(
        wave.longest_gap <= bound,
        "{:?} > {bound:?}",
        wave.longest_gap
    );
    assert!(wave.prefills > 1);
    // A Prefill call, then a Decode call.
    assert_eq!(wave.mixed, 0);
    assert!(wave.decode_calls.abs_diff(wave.decode_steps) <= 1);
}

#[tokio::test(start_paused = true)]
async fn a_burst_of_new_requests_gets_the_whole_budget_in_one_mixed_step() {
    // 32 arrivals among four streams: at least a quarter as many wait as decode, so the burst
    // is not held back (module docs of batcher/pace.rs); it rides in one Decode.
    let wave = wave_among_decoding(true, 4, 32).await;
    assert_eq!((wave.prefills, wave.mixed), (1, 1));
    assert!(
        wave.longest_gap >= PER_TOKEN * 3200,
        "{:?}",
        wave.longest_gap
    );
}

#[tokio::test(start_paused = true)]
async fn unpaced_a_wave_stalls_the_streams_for_its_whole_prefill() {
    // The control: with `--prefill-pace 0` the wave's 3,200 tokens go in as one step.
    for mixed_prefill in [true, false] {
        let shard = shard();
        let scheduler = start(
            &shard,
            SchedulerConfig {
                mixed_prefill,
                ..paced(0.0)
            },
        );
        let mut stream = scheduler.submit(request(&[1, 2, 3, 4], 40)).unwrap();
        next_token(&mut stream).await;
        let wave: Vec<_> = (0..32u32)
            .map(|n| {
                let prompt: Vec<u32> = (0..100).map(|i| 10 + (n * 7 + i) % 240).collect();
                scheduler.submit(request(&prompt, 2)).unwrap()
            })
            .collect();
        // The step in flight when the wave came ends first; the next one takes the wave whole.
        next_token(&mut stream).await;
        let before = Instant::now();
        next_token(&mut stream).await;
        assert!(
            before.elapsed() >= PER_TOKEN * 3200,
            "{:?}",
            before.elapsed()
        );
        for events in wave {
            assert_eq!(collect(events).await.finish, Ok(FinishReason::Length));
        }
        assert_eq!(collect(stream).await.finish, Ok(FinishReason::Length));
        assert_all_released(&shard, &scheduler).await;
    }
}

#[tokio::test(start_paused = true)]
async fn a_flood_of_embeddings_is_paced_while_streams_decode() {
    // One stream decodes; sixteen 32-token embeddings arrive at once. They outnumber it, but no
    // stream waits on them: each step computes about one decode step's worth (one input of 32
    // tokens), and the stream's tokens keep coming between them.
    let shard = shard();
    let scheduler = start(&shard, paced(1.0));
    let mut stream = scheduler.submit(request(&[1, 2, 3, 4], 200)).unwrap();
    next_token(&mut stream).await;
    next_token(&mut stream).await;
    let before = shard.stats().prefill_tokens.len();
    let inputs: Vec<_> = (0..16)
        .map(|n| super::GenerationRequest::embedding((0..32).map(|i| 20 + n + i).collect(), "", 0))
        .collect();
    let embeddings = tokio::spawn(async move {
        for events in scheduler.submit_all(inputs).unwrap() {
            assert_eq!(collect(events).await.finish, Ok(FinishReason::Embedded));
        }
        scheduler
    });
    let mut longest = Duration::ZERO;
    let mut last = Instant::now();
    while !embeddings.is_finished() {
        next_token(&mut stream).await;
        longest = longest.max(last.elapsed());
        last = Instant::now();
    }
    let scheduler = embeddings.await.unwrap();
    assert_eq!(shard.stats().prefill_tokens[before..], [32; 16]);
    assert!(
        longest <= DECODE * 2 + Duration::from_millis(1),
        "{longest:?}"
    );
    assert_eq!(collect(stream).await.finish, Ok(FinishReason::Length));
    assert_all_released(&shard, &scheduler).await;
}
