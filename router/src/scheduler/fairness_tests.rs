//! Fairness inside one adapter's queue, against the fake shard: a short request is not held
//! back by long prompts under way (the step's prefill budget is shared, `prefill_share.rs`),
//! and one tenant's burst does not hold back another tenant's request (`queue.rs`).
//!
//! Every assertion is about order — which request got its first token while which others had
//! none yet — never about time. Each step takes a millisecond of tokio's paused clock, so the
//! test's submissions land between steps as they would in a real server.

use std::sync::Arc;
use std::time::Duration;

use super::test_support::{
    assert_all_released, collect, config, eventually, request, start, VOCAB,
};
use super::{GenerationRequest, RequestScope, SchedulerConfig};
use crate::shard::FakeShard;

fn budget(block_size: u32, num_blocks: u32, prefill_tokens: u32) -> SchedulerConfig {
    SchedulerConfig {
        max_batch_prefill_tokens: prefill_tokens,
        prefix_caching: false,
        ..config(block_size, num_blocks)
    }
}

fn shard() -> Arc<FakeShard> {
    Arc::new(
        FakeShard::new(VOCAB)
            .with_cache(16, 256)
            .with_step_delay(Duration::from_millis(1)),
    )
}

fn prompt(len: u32, seed: u32) -> Vec<u32> {
    (0..len).map(|i| (seed * 31 + i) % VOCAB).collect()
}

fn of(tenant: &str, request: GenerationRequest) -> GenerationRequest {
    GenerationRequest {
        scope: RequestScope {
            tenant: tenant.to_owned(),
            cache_scope: String::new(),
        },
        ..request
    }
}

#[tokio::test(start_paused = true)]
async fn a_short_request_starts_while_long_prompts_are_under_way() {
    let shard = shard();
    let scheduler = start(&shard, budget(16, 256, 32));
    // 640 tokens each at 32 a step: 40 steps of prefill between them.
    let mut long = [
        scheduler.submit(request(&prompt(640, 1), 2)).unwrap(),
        scheduler.submit(request(&prompt(640, 2), 2)).unwrap(),
    ];
    eventually("the long prompts are under way", || {
        shard.stats().prefill_calls >= 2
    })
    .await;
    let mut short = scheduler.submit(request(&prompt(4, 3), 2)).unwrap();
    short.recv().await.unwrap().unwrap();
    let calls = shard.stats().prefill_calls;
    // It was prefilled in one of the next two steps (the step under way when it arrived, then
    // its own), and neither long prompt is done.
    assert!(
        calls <= 6,
        "{calls} prefill steps before the short request's first token"
    );
    for events in &mut long {
        assert!(events.try_recv().is_err(), "a long prompt finished first");
    }
    collect(short).await;
    for events in long {
        assert_eq!(collect(events).await.tokens.len(), 2);
    }
    // The budget was shared, never exceeded.
    assert!(shard
        .stats()
        .prefill_tokens
        .iter()
        .all(|&tokens| tokens <= 32));
    assert_all_released(&shard, &scheduler).await;
}

#[tokio::test(start_paused = true)]
async fn one_tenants_burst_does_not_hold_back_another_tenants_request() {
    let shard = shard();
    // One 32-token prompt fits a step: requests start one per step, in queue order.
    let mut config = budget(16, 256, 32);
    config.chunked_prefill = false;
    let scheduler = start(&shard, config);
    let burst: Vec<_> = (0..8)
        .map(|i| {
            scheduler
                .submit(of("big", request(&prompt(32, 10 + i), 2)))
                .unwrap()
        })
        .collect();
    let mut small = scheduler
        .submit(of("small", request(&prompt(32, 99), 2)))
        .unwrap();
    small.recv().await.unwrap().unwrap();
    // Tenants alternate: at most the request already started and the one offered before the
    // small tenant's turn ran ahead of it.
    let started = shard.stats().prefill_calls;
    assert!(
        started <= 3,
        "{started} prefill steps before the other tenant's request"
    );
    for events in burst {
        assert_eq!(collect(events).await.tokens.len(), 2);
    }
    collect(small).await;
    assert_all_released(&shard, &scheduler).await;
}
