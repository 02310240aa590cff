//! The scheduler against `FakeShard`. Expected tokens come from the fake's documented rule,
//! written out again here (`reference_tokens`) rather than taken from the code under test; the
//! fake itself rejects block tables that are too short or shared, decodes past
//! `max_new_tokens`, and batches that disagree with what it holds, so every test also checks
//! the router's block and batch bookkeeping.

use std::sync::Arc;
use std::time::Duration;

use super::test_support::*;
use super::*;
use crate::shard::{FakeRpc, FakeShard};

/// The fake's documented token rule: t' = (31 t + 7) mod vocab, starting from the last prompt
/// token.
fn reference_tokens(prompt: &[u32], n: usize) -> Vec<u32> {
    let mut previous = *prompt.last().unwrap();
    (0..n)
        .map(|_| {
            previous = (previous * 31 + 7) % VOCAB;
            previous
        })
        .collect()
}

#[tokio::test]
async fn one_request_gets_the_fake_sequence_and_stops_at_length() {
    let shard = Arc::new(FakeShard::new(VOCAB));
    let scheduler = start(&shard, config(16, 64));
    let prompt = [5, 9, 200];
    let outcome = collect(scheduler.submit(request(&prompt, 7)).unwrap()).await;
    assert_eq!(
        outcome,
        Outcome {
            tokens: reference_tokens(&prompt, 7),
            finish: Ok(FinishReason::Length),
        }
    );
    assert_all_released(&shard, &scheduler).await;
    // The step counters behind /metrics agree with the calls the shard saw.
    let (stats, seen) = (scheduler.stats(), shard.stats());
    assert_eq!((stats.prefill_steps, stats.decode_steps), (1, 6));
    assert_eq!(seen.decode_calls, 6);
}

#[tokio::test]
async fn a_single_new_token_finishes_at_prefill() {
    let shard = Arc::new(FakeShard::new(VOCAB));
    let scheduler = start(&shard, config(16, 64));
    let outcome = collect(scheduler.submit(request(&[42], 1)).unwrap()).await;
    assert_eq!(outcome.tokens, reference_tokens(&[42], 1));
    assert_eq!(outcome.finish, Ok(FinishReason::Length));
    assert_all_released(&shard, &scheduler).await;
    assert_eq!(shard.stats().decode_calls, 0);
}

/// A prompt whose reference sequence has a token at index 2 not seen at 0 or 1: that token is
/// used as EOS.
fn eos_case() -> (Vec<u32>, u32) {
    let prompt = vec![3, 1, 4];
    let tokens = reference_tokens(&prompt, 12);
    let eos = tokens[2];
    assert!(!tokens[..2].contains(&eos) && !tokens[3..].contains(&eos));
    (prompt, eos)
}

#[tokio::test]
async fn eos_finishes_with_eos() {
    let shard = Arc::new(FakeShard::new(VOCAB));
    let scheduler = start(&shard, config(16, 64));
    let (prompt, eos) = eos_case();
    let mut req = request(&prompt, 12);
    req.eos_token_ids = vec![999, eos];
    let outcome = collect(scheduler.submit(req).unwrap()).await;
    assert_eq!(outcome.tokens, reference_tokens(&prompt, 3));
    assert_eq!(outcome.finish, Ok(FinishReason::Eos));
    assert_all_released(&shard, &scheduler).await;
}

#[tokio::test]
async fn ignore_eos_and_min_tokens_defer_eos() {
    let shard = Arc::new(FakeShard::new(VOCAB));
    let scheduler = start(&shard, config(16, 64));
    let (prompt, eos) = eos_case();
    let full = reference_tokens(&prompt, 12);

    let mut ignoring = request(&prompt, 12);
    ignoring.eos_token_ids = vec![eos];
    ignoring.ignore_eos = true;
    let outcome = collect(scheduler.submit(ignoring).unwrap()).await;
    assert_eq!(outcome.tokens, full);
    assert_eq!(outcome.finish, Ok(FinishReason::Length));

    // EOS is the 3rd token: with min_tokens 3 only two tokens precede it, so it is not honoured.
    let mut at_least_three = request(&prompt, 12);
    at_least_three.eos_token_ids = vec![eos];
    at_least_three.min_tokens = 3;
    let outcome = collect(scheduler.submit(at_least_three).unwrap()).await;
    assert_eq!(outcome.tokens, full);
    assert_eq!(outcome.finish, Ok(FinishReason::Length));

    // With min_tokens 2 exactly two precede it: honoured.
    let mut at_least_two = request(&prompt, 12);
    at_least_two.eos_token_ids = vec![eos];
    at_least_two.min_tokens = 2;
    let outcome = collect(scheduler.submit(at_least_two).unwrap()).await;
    assert_eq!(outcome.tokens, full[..3].to_vec());
    assert_eq!(outcome.finish, Ok(FinishReason::Eos));
    assert_all_released(&shard, &scheduler).await;
}

/// Under a grammar the shard allows EOS only once the output is complete, and then nothing
/// else: EOS ends the request whatever `ignore_eos` and `min_tokens` say.
#[tokio::test]
async fn eos_ends_a_constrained_request_despite_ignore_eos_and_min_tokens() {
    let shard = Arc::new(FakeShard::new(VOCAB));
    let scheduler = start(&shard, config(16, 64));
    let (prompt, eos) = eos_case();
    let mut constrained = request(&prompt, 12);
    constrained.eos_token_ids = vec![eos];
    constrained.ignore_eos = true;
    constrained.min_tokens = 5;
    let regex = Grammar {
        kind: GrammarKind::Regex,
        text: "[a-z]+".to_owned(),
        eos_token_ids: vec![eos],
    };
    constrained.grammar = Some(pinned(&scheduler, &shard, regex).await);
    let outcome = collect(scheduler.submit(constrained).unwrap()).await;
    assert_eq!(outcome.tokens, reference_tokens(&prompt, 3));
    assert_eq!(outcome.finish, Ok(FinishReason::Eos));
    assert_all_released(&shard, &scheduler).await;
}

#[tokio::test]
async fn stop_token_ids_end_even_with_ignore_eos_but_wait_for_min_tokens() {
    let shard = Arc::new(FakeShard::new(VOCAB));
    let scheduler = start(&shard, config(16, 64));
    let (prompt, stop) = eos_case();
    let full = reference_tokens(&prompt, 12);

    let mut stopping = request(&prompt, 12);
    stopping.stop_token_ids = vec![stop];
    stopping.ignore_eos = true;
    let outcome = collect(scheduler.submit(stopping).unwrap()).await;
    assert_eq!(outcome.tokens, full[..3].to_vec());
    assert_eq!(outcome.finish, Ok(FinishReason::Eos));

    let mut deferred = request(&prompt, 12);
    deferred.stop_token_ids = vec![stop];
    deferred.min_tokens = 3;
    let outcome = collect(scheduler.submit(deferred).unwrap()).await;
    assert_eq!(outcome.tokens, full);
    assert_eq!(outcome.finish, Ok(FinishReason::Length));
    assert_all_released(&shard, &scheduler).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_get_the_same_output_as_alone() {
    let shard = Arc::new(FakeShard::new(VOCAB).with_step_delay(Duration::from_millis(1)));
    let scheduler = start(&shard, config(4, 512));
    let cases: Vec<(Vec<u32>, u32)> = (0..32u32)
        .map(|i| {
            let prompt: Vec<u32> = (0..1 + i % 5).map(|j| (i * 7 + j) % VOCAB).collect();
            (prompt, 1 + (i * 5) % 17)
        })
        .collect();
    let tasks: Vec<_> = cases
        .iter()
        .map(|(prompt, max_new)| {
            let events = scheduler.submit(request(prompt, *max_new)).unwrap();
            tokio::spawn(collect(events))
        })
        .collect();
    for ((prompt, max_new), task) in cases.iter().zip(tasks) {
        let outcome = task.await.unwrap();
        assert_eq!(outcome.tokens, reference_tokens(prompt, *max_new as usize));
        assert_eq!(outcome.finish, Ok(FinishReason::Length));
    }
    assert!(
        shard.stats().max_decode_batch_size > 1,
        "requests were never batched together"
    );
    assert_all_released(&shard, &scheduler).await;
}

#[tokio::test]
async fn new_requests_join_the_running_batch_between_steps() {
    let shard = Arc::new(FakeShard::new(VOCAB).with_step_delay(Duration::from_millis(2)));
    let scheduler = start(&shard, config(16, 64));
    let mut long = scheduler.submit(request(&[10], 40)).unwrap();
    let mut long_tokens = Vec::new();
    for _ in 0..5 {
        long_tokens.push(long.recv().await.unwrap().unwrap().token_id);
    }
    let short = collect(scheduler.submit(request(&[20], 3)).unwrap()).await;
    assert_eq!(short.tokens, reference_tokens(&[20], 3));
    let rest = collect(long).await;
    long_tokens.extend(rest.tokens);
    assert_eq!(long_tokens, reference_tokens(&[10], 40));
    assert_eq!(shard.stats().max_decode_batch_size, 2);
    assert_all_released(&shard, &scheduler).await;
}

#[tokio::test]
async fn dropping_the_receiver_frees_the_request() {
    let shard = Arc::new(FakeShard::new(VOCAB).with_step_delay(Duration::from_millis(1)));
    let scheduler = start(&shard, config(16, 128));
    let mut events = scheduler.submit(request(&[1, 2, 3], 1000)).unwrap();
    for _ in 0..3 {
        events.recv().await.unwrap().unwrap();
    }
    assert!(scheduler.stats().free_blocks < scheduler.stats().total_blocks);
    drop(events);
    assert_all_released(&shard, &scheduler).await;
}

#[tokio::test]
async fn a_client_gone_while_queued_never_reaches_the_shard() {
    let shard = Arc::new(FakeShard::new(VOCAB).with_step_delay(Duration::from_millis(1)));
    // Room for exactly one request at a time.
    let scheduler = start(&shard, config(4, 2));
    let first = scheduler.submit(request(&[1], 7)).unwrap();
    let queued = scheduler.submit(request(&[2], 7)).unwrap();
    drop(queued);
    let outcome = collect(first).await;
    assert_eq!(outcome.tokens, reference_tokens(&[1], 7));
    assert_all_released(&shard, &scheduler).await;
    assert_eq!(shard.stats().prefill_calls, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_requests_than_blocks_wait_and_all_complete() {
    let shard = Arc::new(FakeShard::new(VOCAB).with_cache(4, 8));
    // Each request needs ceil((3 + 5) / 4) = 2 blocks: at most 4 run at once.
    let scheduler = start(&shard, config(4, 8));
    let prompts: Vec<Vec<u32>> = (0..20u32).map(|i| vec![i, i + 1, i + 2]).collect();
    let tasks: Vec<_> = prompts
        .iter()
        .map(|prompt| tokio::spawn(collect(scheduler.submit(request(prompt, 5)).unwrap())))
        .collect();
    for (prompt, task) in prompts.iter().zip(tasks) {
        let outcome = task.await.unwrap();
        assert_eq!(outcome.tokens, reference_tokens(prompt, 5));
        assert_eq!(outcome.finish, Ok(FinishReason::Length));
    }
    assert!(shard.stats().max_decode_batch_size <= 4);
    assert_all_released(&shard, &scheduler).await;
}

#[tokio::test]
async fn batch_size_and_prefill_budget_are_respected() {
    let shard = Arc::new(FakeShard::new(VOCAB));
    let mut config = config(16, 256);
    config.max_batch_size = 3;
    config.max_batch_prefill_tokens = 8;
    // Whole prompts only: chunked prefill would split them across steps.
    config.chunked_prefill = false;
    let scheduler = start(&shard, config);
    let receivers: Vec<_> = (0..9u32)
        .map(|i| scheduler.submit(request(&[i, i, i, i, i], 4)).unwrap())
        .collect();
    for (i, events) in receivers.into_iter().enumerate() {
        let outcome = collect(events).await;
        assert_eq!(outcome.tokens, reference_tokens(&[i as u32], 4));
    }
    let stats = shard.stats();
    assert!(stats.max_decode_batch_size <= 3);
    // 5-token prompts under an 8-token budget: one request per prefill.
    assert_eq!(stats.prefill_calls, 9);
    assert_all_released(&shard, &scheduler).await;
}

#[tokio::test]
async fn overloaded_beyond_max_concurrent_requests() {
    let shard = Arc::new(FakeShard::new(VOCAB).with_step_delay(Duration::from_millis(1)));
    let mut config = config(16, 64);
    config.max_concurrent_requests = 2;
    let scheduler = start(&shard, config);
    let a = scheduler.submit(request(&[1], 500)).unwrap();
    let b = scheduler.submit(request(&[2], 500)).unwrap();
    assert_eq!(scheduler.in_flight(), 2);
    assert_eq!(
        scheduler.submit(request(&[3], 5)).unwrap_err(),
        AdmissionError::Overloaded
    );
    drop(a);
    eventually("a slot is free again", || scheduler.in_flight() == 1).await;
    let c = collect(scheduler.submit(request(&[3], 5)).unwrap()).await;
    assert_eq!(c.tokens, reference_tokens(&[3], 5));
    drop(b);
    assert_all_released(&shard, &scheduler).await;
}

#[tokio::test]
async fn too_large_for_the_whole_cache() {
    let shard = Arc::new(FakeShard::new(VOCAB).with_cache(4, 4));
    let scheduler = start(&shard, config(4, 4));
    // 10 + 10 tokens need 5 blocks of 4; the cache has 4.
    assert_eq!(
        scheduler.submit(request(&[1; 10], 10)).unwrap_err(),
        AdmissionError::TooLarge {
            needed: 5,
            total: 4
        }
    );
    // Exactly the whole cache is fine.
    let outcome = collect(scheduler.submit(request(&[1; 10], 6)).unwrap()).await;
    assert_eq!(outcome.tokens, reference_tokens(&[1], 6));

    // --max-batch-total-tokens caps the usable cache below what the shard holds.
    let mut capped = config(4, 4);
    capped.max_batch_total_tokens = 8;
    let scheduler = start(&shard, capped);
    assert_eq!(
        scheduler.submit(request(&[1; 5], 4)).unwrap_err(),
        AdmissionError::TooLarge {
            needed: 3,
            total: 2
        }
    );
    assert_eq!(scheduler.in_flight(), 0);
}

#[tokio::test]
async fn decode_failure_fails_the_batch_and_serving_continues() {
    let shard = Arc::new(FakeShard::new(VOCAB).with_step_delay(Duration::from_millis(1)));
    let scheduler = start(&shard, config(16, 64));
    let mut a = scheduler.submit(request(&[1], 100)).unwrap();
    let b = scheduler.submit(request(&[2], 100)).unwrap();
    a.recv().await.unwrap().unwrap();
    shard.fail_next(FakeRpc::Decode);
    for events in [a, b] {
        let outcome = collect(events).await;
        assert!(
            matches!(&outcome.finish, Err(GenerationError::Shard(m)) if m.contains("injected")),
            "{outcome:?}"
        );
    }
    assert_all_released(&shard, &scheduler).await;
    let later = collect(scheduler.submit(request(&[3], 6)).unwrap()).await;
    assert_eq!(later.tokens, reference_tokens(&[3], 6));
    assert_eq!(later.finish, Ok(FinishReason::Length));
    assert_all_released(&shard, &scheduler).await;
}

/// A shard taking a millisecond a step, and a 30-token stream of prompt [7] under way in either
/// step shape: (shard, scheduler, the stream, its first token).
async fn one_stream_running(
    mixed_prefill: bool,
) -> (Arc<FakeShard>, Scheduler, EventReceiver, Vec<u32>) {
    let shard = Arc::new(FakeShard::new(VOCAB).with_step_delay(Duration::from_millis(1)));
    let scheduler = start(
        &shard,
        SchedulerConfig {
            mixed_prefill,
            ..config(16, 64)
        },
    );
    let mut running = scheduler.submit(request(&[7], 30)).unwrap();
    let first = running.recv().await.unwrap().unwrap().token_id;
    (shard, scheduler, running, vec![first])
}

#[tokio::test]
async fn prefill_failure_fails_only_the_new_requests_unless_it_rode_in_the_decode() {
    for mixed_prefill in [false, true] {
        let (shard, scheduler, running, mut tokens) = one_stream_running(mixed_prefill).await;
        shard.fail_next(FakeRpc::Prefill);
        let failed = collect(scheduler.submit(request(&[8], 5)).unwrap()).await;
        assert!(matches!(failed.finish, Err(GenerationError::Shard(_))));
        assert!(failed.tokens.is_empty());
        let rest = collect(running).await;
        tokens.extend(rest.tokens);
        if mixed_prefill {
            // One call carried the running request's step too: it fails with it, as in a
            // failed Decode.
            assert!(matches!(rest.finish, Err(GenerationError::Shard(_))));
            assert_eq!(tokens, reference_tokens(&[7], tokens.len()));
        } else {
            assert_eq!(tokens, reference_tokens(&[7], 30));
            assert_eq!(rest.finish, Ok(FinishReason::Length));
        }
        assert_all_released(&shard, &scheduler).await;
        // Serving goes on.
        let later = collect(scheduler.submit(request(&[3], 6)).unwrap()).await;
        assert_eq!(later.tokens, reference_tokens(&[3], 6));
        assert_all_released(&shard, &scheduler).await;
    }
}

#[tokio::test]
async fn a_prompt_the_shard_refuses_fails_alone_in_either_mode() {
    // The shard checks a step's requests before it runs anything: a refused mixed step is taken
    // again as a Prefill, which fails only the bad request, and a Decode.
    for mixed_prefill in [false, true] {
        let (shard, scheduler, running, mut tokens) = one_stream_running(mixed_prefill).await;
        let bad = collect(scheduler.submit(request(&[VOCAB + 5], 5)).unwrap()).await;
        assert!(
            matches!(&bad.finish, Err(GenerationError::Shard(m)) if m.contains("outside the vocabulary")),
            "{bad:?}"
        );
        assert!(bad.tokens.is_empty());
        let rest = collect(running).await;
        tokens.extend(rest.tokens);
        assert_eq!(tokens, reference_tokens(&[7], 30));
        assert_eq!(rest.finish, Ok(FinishReason::Length));
        assert_all_released(&shard, &scheduler).await;
    }
}

#[tokio::test]
async fn filter_failure_fails_the_remaining_requests() {
    let shard = Arc::new(FakeShard::new(VOCAB));
    let scheduler = start(&shard, config(16, 64));
    shard.fail_next(FakeRpc::FilterBatch);
    // Both are prefilled together; the short one finishing triggers the failing FilterBatch.
    let long = scheduler.submit(request(&[1], 20)).unwrap();
    let short = scheduler.submit(request(&[2], 2)).unwrap();
    let short = collect(short).await;
    assert_eq!(short.tokens, reference_tokens(&[2], 2));
    let long = collect(long).await;
    assert!(matches!(long.finish, Err(GenerationError::Shard(_))));
    assert_all_released(&shard, &scheduler).await;
}

#[tokio::test]
async fn shutdown_stops_admission_but_finishes_in_flight() {
    let shard = Arc::new(FakeShard::new(VOCAB).with_step_delay(Duration::from_millis(1)));
    let scheduler = start(&shard, config(16, 64));
    let events = scheduler.submit(request(&[9], 10)).unwrap();
    scheduler.shutdown();
    assert_eq!(
        scheduler.submit(request(&[9], 10)).unwrap_err(),
        AdmissionError::ShuttingDown
    );
    let outcome = collect(events).await;
    assert_eq!(outcome.tokens, reference_tokens(&[9], 10));
    assert_all_released(&shard, &scheduler).await;
}
