//! Prefix caching and chunked prefill against the fake shard, which checks that every cached
//! position a Prefill relies on holds the KV of that adapter and those exact tokens
//! (`shard/fake/kv_content.rs`): a wrong hit, a hit on an evicted or never-computed block, or
//! a chunk skipped fails the request.

use std::sync::Arc;

use quiver_flags::AdapterSource;

use super::test_support::{assert_all_released, config, request, start};
use super::{EventReceiver, FinishReason, GenerationRequest, Scheduler, SchedulerConfig};
use crate::shard::{fake_next_token, AdapterLoad, FakeRpc, FakeShard, ShardBackend};

const VOCAB: u32 = 1000;

/// A request's tokens, how it ended, and the cached prompt tokens its first event reported.
#[derive(Debug)]
struct Run {
    tokens: Vec<u32>,
    finish: FinishReason,
    cached_tokens: u32,
}

async fn run(mut events: EventReceiver) -> Run {
    let mut tokens = Vec::new();
    let mut cached_tokens = None;
    loop {
        let event = tokio::time::timeout(std::time::Duration::from_secs(20), events.recv())
            .await
            .expect("request did not finish")
            .expect("stream ended without a finish")
            .expect("request failed");
        cached_tokens.get_or_insert(event.cached_tokens);
        if !tokens.is_empty() {
            assert_eq!(event.cached_tokens, 0, "only the first event reports it");
        }
        tokens.push(event.token_id);
        if let Some(finish) = event.finish {
            return Run {
                tokens,
                finish,
                cached_tokens: cached_tokens.unwrap_or(0),
            };
        }
    }
}

fn expected(prompt: &[u32], n: usize) -> Vec<u32> {
    let mut previous = *prompt.last().unwrap();
    (0..n)
        .map(|_| {
            previous = fake_next_token(previous, VOCAB);
            previous
        })
        .collect()
}

/// `shared` tokens common to every prompt, then `own` tokens that differ by `seed`.
fn prompt(shared: u32, own: u32, seed: u32) -> Vec<u32> {
    (0..shared)
        .map(|i| i % VOCAB)
        .chain((0..own).map(|i| (500 + seed * 7 + i) % VOCAB))
        .collect()
}

async fn complete(scheduler: &Scheduler, request: GenerationRequest) -> Run {
    let n = request.max_new_tokens as usize;
    let prompt = request.input_ids.clone();
    let outcome = run(scheduler.submit(request).unwrap()).await;
    assert_eq!(outcome.tokens, expected(&prompt, n));
    assert_eq!(outcome.finish, FinishReason::Length);
    outcome
}

fn shard(block_size: u32, num_blocks: u32) -> Arc<FakeShard> {
    Arc::new(FakeShard::new(VOCAB).with_cache(block_size, num_blocks))
}

#[tokio::test]
async fn a_later_request_reuses_the_full_blocks_of_a_common_prefix() {
    let shard = shard(16, 64);
    let scheduler = start(&shard, config(16, 64));
    let first = complete(&scheduler, request(&prompt(40, 5, 1), 4)).await;
    assert_eq!(first.cached_tokens, 0);
    // 40 shared tokens: two full blocks (32 tokens) are names the second prompt shares.
    let second = complete(&scheduler, request(&prompt(40, 9, 2), 4)).await;
    assert_eq!(second.cached_tokens, 32);
    // The same prompt again: every full block but the one holding the last token.
    let again = complete(&scheduler, request(&prompt(40, 9, 2), 4)).await;
    assert_eq!(again.cached_tokens, 48);
    let stats = scheduler.stats();
    assert_eq!(stats.prefix_cache_queries, 45 + 49 + 49);
    assert_eq!(stats.prefix_cache_hits, 32 + 48);
    assert_all_released(&shard, &scheduler).await;
}

#[tokio::test]
async fn a_prompt_that_is_exactly_cached_still_computes_its_last_token() {
    let shard = shard(16, 64);
    let scheduler = start(&shard, config(16, 64));
    let whole = prompt(32, 0, 0);
    complete(&scheduler, request(&whole, 3)).await;
    let again = complete(&scheduler, request(&whole, 3)).await;
    assert_eq!(
        again.cached_tokens, 16,
        "the block of the last token is computed again"
    );
    assert_all_released(&shard, &scheduler).await;
}

#[tokio::test]
async fn simultaneous_requests_share_a_prefix_computed_in_the_same_prefill() {
    let shard = shard(16, 128);
    let scheduler = start(&shard, config(16, 128));
    let receivers: Vec<_> = (0..4)
        .map(|i| {
            let p = prompt(64, 3, i);
            (p.clone(), scheduler.submit(request(&p, 5)).unwrap())
        })
        .collect();
    let mut cached = Vec::new();
    for (p, events) in receivers {
        let outcome = run(events).await;
        assert_eq!(outcome.tokens, expected(&p, 5));
        cached.push(outcome.cached_tokens);
    }
    assert_eq!(cached, [0, 64, 64, 64]);
    assert_eq!(
        shard.stats().prefill_calls,
        1,
        "one Prefill computed them all"
    );
    assert_all_released(&shard, &scheduler).await;
}

#[tokio::test]
async fn adapters_never_share_blocks_with_the_base_or_each_other() {
    let shard = Arc::new(
        FakeShard::new(VOCAB)
            .with_cache(16, 64)
            .with_adapter_slots(2),
    );
    shard
        .load_adapter(AdapterLoad {
            adapter_id: "a".into(),
            source: AdapterSource::Local,
            path: "/adapters/a".into(),
            revision: String::new(),
        })
        .await
        .unwrap();
    let mut config = config(16, 64);
    config.max_active_adapters = 2;
    let scheduler = start(&shard, config);
    let base = complete(&scheduler, request(&prompt(48, 2, 0), 2)).await;
    let mut on_adapter = request(&prompt(48, 2, 0), 2);
    on_adapter.adapter_id = "a".into();
    let prompt_a = on_adapter.input_ids.clone();
    let first_a = run(scheduler.submit(on_adapter.clone()).unwrap()).await;
    let again_a = run(scheduler.submit(on_adapter).unwrap()).await;
    assert_eq!(first_a.tokens, again_a.tokens);
    assert_eq!(first_a.tokens.len(), 2);
    assert_eq!(
        (
            base.cached_tokens,
            first_a.cached_tokens,
            again_a.cached_tokens
        ),
        (0, 0, 48)
    );
    assert_ne!(
        first_a.tokens,
        expected(&prompt_a, 2),
        "the adapter's own tokens"
    );
    assert_all_released(&shard, &scheduler).await;
}

#[tokio::test]
async fn evicted_blocks_are_recomputed_and_hot_ones_survive() {
    // 12 blocks of 4 tokens; each request holds 4 (12 prompt + 4 new tokens).
    let shard = shard(4, 12);
    let scheduler = start(&shard, config(4, 12));
    let hot = prompt(8, 4, 99);
    complete(&scheduler, request(&hot, 4)).await;
    for round in 0..6 {
        // Distinct prompts fill the cache and push out the least recently released blocks.
        let cold = complete(&scheduler, request(&prompt(0, 12, round * 3 + 1), 4)).await;
        assert_eq!(cold.cached_tokens, 0);
        let again = complete(&scheduler, request(&hot, 4)).await;
        assert_eq!(
            again.cached_tokens, 8,
            "round {round}: the hot prefix stays cached"
        );
    }
    assert_all_released(&shard, &scheduler).await;
}

#[tokio::test]
async fn blocks_of_a_failed_prefill_are_never_hits() {
    let shard = shard(16, 64);
    let scheduler = start(&shard, config(16, 64));
    let p = prompt(48, 4, 0);
    shard.fail_next(FakeRpc::Prefill);
    let failed = scheduler.submit(request(&p, 3)).unwrap();
    let mut failed = failed;
    let error = loop {
        match failed.recv().await.expect("an error event") {
            Ok(_) => continue,
            Err(error) => break error,
        }
    };
    assert!(error.to_string().contains("injected failure"));
    // Its blocks were registered when the Prefill was sent; the fake would reject a hit on
    // them, since their KV was never written.
    let after = complete(&scheduler, request(&p, 3)).await;
    assert_eq!(after.cached_tokens, 0);
    assert_all_released(&shard, &scheduler).await;
}

#[tokio::test]
async fn prompt_logprobs_requests_compute_the_whole_prompt_in_one_step() {
    let shard = shard(16, 64);
    let mut config = config(16, 64);
    config.max_batch_prefill_tokens = 16;
    let scheduler = start(&shard, config);
    let p = prompt(40, 8, 0);
    complete(&scheduler, request(&p, 2)).await;
    let prefills = shard.stats().prefill_calls;
    let mut with_logprobs = request(&p, 2);
    with_logprobs.prompt_logprobs = Some(1);
    let outcome = complete(&scheduler, with_logprobs).await;
    assert_eq!(outcome.cached_tokens, 0);
    assert_eq!(shard.stats().prefill_calls, prefills + 1);
    assert_all_released(&shard, &scheduler).await;
}

fn chunked(block_size: u32, num_blocks: u32, budget: u32, prefix_caching: bool) -> SchedulerConfig {
    SchedulerConfig {
        max_batch_prefill_tokens: budget,
        prefix_caching,
        ..config(block_size, num_blocks)
    }
}

#[tokio::test]
async fn a_long_prompt_is_prefilled_in_chunks_of_the_budget() {
    for prefix_caching in [false, true] {
        let shard = shard(16, 64);
        let scheduler = start(&shard, chunked(16, 64, 16, prefix_caching));
        let p = prompt(0, 50, 3);
        let outcome = complete(&scheduler, request(&p, 4)).await;
        assert_eq!(outcome.cached_tokens, 0);
        // 16 + 16 + 16 + 2 tokens.
        assert_eq!(shard.stats().prefill_calls, 4);
        assert_all_released(&shard, &scheduler).await;
    }
}

#[tokio::test(start_paused = true)]
async fn running_requests_decode_between_the_chunks_of_a_long_prompt() {
    for mixed_prefill in [true, false] {
        // Steps take time, so the long prompt arrives while the short request decodes.
        let shard = Arc::new(
            FakeShard::new(VOCAB)
                .with_cache(16, 256)
                .with_step_delay(std::time::Duration::from_millis(1)),
        );
        let config = SchedulerConfig {
            mixed_prefill,
            ..chunked(16, 256, 32, true)
        };
        let scheduler = start(&shard, config);
        let short = prompt(0, 4, 1);
        let mut running = scheduler.submit(request(&short, 40)).unwrap();
        let first = running.recv().await.unwrap().unwrap();
        assert_eq!(first.token_id, expected(&short, 1)[0]);
        let long = prompt(0, 320, 2);
        let long_events = scheduler.submit(request(&long, 2)).unwrap();
        let long_run = tokio::spawn(run(long_events));
        // The long prompt takes 10 steps of 32 tokens; the running request gets a token in
        // each.
        let mut tokens = vec![first.token_id];
        while tokens.len() < 40 {
            let event = running.recv().await.unwrap().unwrap();
            tokens.push(event.token_id);
        }
        assert_eq!(tokens, expected(&short, 40));
        let outcome = long_run.await.unwrap();
        assert_eq!(outcome.tokens, expected(&long, 2));
        let stats = shard.stats();
        assert_eq!(stats.prefill_calls, 11, "{stats:?}");
        assert_eq!(stats.max_decode_batch_size, 2, "{stats:?}");
        // Every chunk of the long prompt rode in a Decode of the running request.
        let carried = if mixed_prefill { 10 } else { 0 };
        assert_eq!(stats.mixed_calls, carried, "{stats:?}");
        assert_all_released(&shard, &scheduler).await;
    }
}

#[tokio::test(start_paused = true)]
async fn blocks_of_a_failed_step_beside_a_decode_are_never_hits() {
    for mixed_prefill in [true, false] {
        let shard = Arc::new(
            FakeShard::new(VOCAB)
                .with_cache(16, 64)
                .with_step_delay(std::time::Duration::from_millis(1)),
        );
        let config = SchedulerConfig {
            mixed_prefill,
            ..config(16, 64)
        };
        let scheduler = start(&shard, config);
        let mut stream = scheduler.submit(request(&prompt(0, 4, 9), 30)).unwrap();
        stream.recv().await.unwrap().unwrap();
        let p = prompt(48, 4, 0);
        shard.fail_next(FakeRpc::Prefill);
        let mut failed = scheduler.submit(request(&p, 3)).unwrap();
        let error = loop {
            match failed.recv().await.expect("an error event") {
                Ok(_) => continue,
                Err(error) => break error,
            }
        };
        assert!(error.to_string().contains("injected failure"));
        // A failed mixed step failed the stream's step too; a failed Prefill only its own.
        let stream_failed = loop {
            match stream.recv().await.expect("a last event") {
                Ok(event) if event.finish.is_some() => break false,
                Ok(_) => continue,
                Err(_) => break true,
            }
        };
        assert_eq!(stream_failed, mixed_prefill);
        // The blocks were registered when the step was planned; the fake would reject a hit
        // on them, since their KV was never written.
        let after = complete(&scheduler, request(&p, 3)).await;
        assert_eq!(after.cached_tokens, 0);
        assert_all_released(&shard, &scheduler).await;
    }
}

#[tokio::test]
async fn a_client_that_leaves_mid_prefill_frees_its_blocks() {
    let shard = Arc::new(
        FakeShard::new(VOCAB)
            .with_cache(16, 64)
            .with_step_delay(std::time::Duration::from_millis(2)),
    );
    let scheduler = start(&shard, chunked(16, 64, 16, true));
    let events = scheduler.submit(request(&prompt(0, 300, 5), 2)).unwrap();
    super::test_support::eventually("a chunk was prefilled", || shard.stats().prefill_calls >= 2)
        .await;
    drop(events);
    assert_all_released(&shard, &scheduler).await;
    // The cache still works for others.
    complete(&scheduler, request(&prompt(0, 40, 6), 2)).await;
    assert_all_released(&shard, &scheduler).await;
}

#[tokio::test]
async fn a_next_turn_reuses_the_blocks_of_the_previous_answer() {
    let shard = shard(16, 64);
    let scheduler = start(&shard, config(16, 64));
    let question = prompt(0, 10, 4);
    let answer = complete(&scheduler, request(&question, 40)).await;
    // The answer's first 39 tokens were fed back through the model: with the question, 49
    // tokens of KV, three full blocks. The next turn repeats them and goes on.
    let mut next_turn = question.clone();
    next_turn.extend_from_slice(&answer.tokens);
    next_turn.extend_from_slice(&[7, 8, 9]);
    let next = complete(&scheduler, request(&next_turn, 4)).await;
    assert_eq!(next.cached_tokens, 48);
    assert_all_released(&shard, &scheduler).await;
}
