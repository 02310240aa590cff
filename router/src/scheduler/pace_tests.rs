//! Prefill pacing against a fake shard whose Decode takes 32 ms and whose Prefill takes 1 ms
//! per computed prompt token, on tokio's paused clock: the step times the batcher measures are
//! exact, so the chunk sizes and the running streams' inter-token times are too.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::test_support::{assert_all_released, collect, config, next_token, request, start};
use super::{FinishReason, SchedulerConfig};
use crate::shard::FakeShard;

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
    SchedulerConfig {
        max_batch_prefill_tokens: 4096,
        prefill_pace: pace,
        ..config(16, 256)
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

#[tokio::test(start_paused = true)]
async fn a_burst_of_new_requests_is_not_held_back() {
    // One stream decodes; eight requests of 100 distinct tokens arrive at once: they
    // outnumber it, so they share one full-budget Prefill.
    let shard = shard();
    let scheduler = start(&shard, paced(1.0));
    let mut first = scheduler.submit(request(&[1, 2, 3, 4], 40)).unwrap();
    next_token(&mut first).await;
    next_token(&mut first).await;
    let before = shard.stats().prefill_tokens.len();
    let burst: Vec<_> = (0..8)
        .map(|n| {
            let prompt: Vec<u32> = (0..100).map(|i| 20 + n + i).collect();
            scheduler.submit(request(&prompt, 2)).unwrap()
        })
        .collect();
    for events in burst {
        assert_eq!(collect(events).await.finish, Ok(FinishReason::Length));
    }
    assert_eq!(collect(first).await.finish, Ok(FinishReason::Length));
    assert_eq!(shard.stats().prefill_tokens[before..], [800]);
    assert_all_released(&shard, &scheduler).await;
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
