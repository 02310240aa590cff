//! Helpers shared by the scheduler tests: configs, requests, and reading a request's events
//! to the end with a deadline.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::timeout;

use super::*;
use crate::shard::{FakeShard, ShardBackend};

pub(super) const VOCAB: u32 = 256;
pub(super) const DEADLINE: Duration = Duration::from_secs(20);

pub(super) fn config(block_size: u32, num_blocks: u32) -> SchedulerConfig {
    SchedulerConfig {
        block_size,
        num_blocks,
        max_batch_prefill_tokens: 4096,
        max_batch_total_tokens: 0,
        max_batch_size: 64,
        max_concurrent_requests: 128,
        max_total_tokens: 4096,
        max_active_adapters: 0,
        slot_ranks: Vec::new(),
        preemption_wait: Duration::from_secs(3600),
        max_queue_wait: None,
        prefix_caching: true,
        chunked_prefill: true,
        // Chunk sizes that depend on measured step times would make step counts vary.
        prefill_pace: 0.0,
        mixed_prefill: true,
    }
}

pub(super) fn request(prompt: &[u32], max_new_tokens: u32) -> GenerationRequest {
    GenerationRequest {
        input_ids: prompt.to_vec(),
        max_new_tokens,
        sampling: SamplingParams::default(),
        eos_token_ids: Vec::new(),
        ignore_eos: false,
        stop_token_ids: Vec::new(),
        min_tokens: 0,
        adapter_id: String::new(),
        adapter_rank: 0,
        prompt_logprobs: None,
        grammar: None,
        embed: false,
        scope: Default::default(),
    }
}

pub(super) fn start(shard: &Arc<FakeShard>, config: SchedulerConfig) -> Scheduler {
    Scheduler::start_observed(shard.clone(), config, Arc::default())
}

/// A request's whole output: its tokens and how it ended.
#[derive(Debug, PartialEq)]
pub(super) struct Outcome {
    pub(super) tokens: Vec<u32>,
    pub(super) finish: Result<FinishReason, GenerationError>,
}

/// Reads events until the last one; checks that only the last carries a finish reason.
pub(super) async fn collect(mut events: EventReceiver) -> Outcome {
    let read = async {
        let mut tokens = Vec::new();
        while let Some(event) = events.recv().await {
            match event {
                Ok(event) => {
                    tokens.push(event.token_id);
                    if let Some(reason) = event.finish {
                        assert!(events.recv().await.is_none(), "event after the finish");
                        return Outcome {
                            tokens,
                            finish: Ok(reason),
                        };
                    }
                }
                Err(error) => {
                    return Outcome {
                        tokens,
                        finish: Err(error),
                    }
                }
            }
        }
        panic!("stream ended without a finish reason after {tokens:?}");
    };
    timeout(DEADLINE, read)
        .await
        .expect("request did not finish")
}

/// Waits (bounded) until `condition` holds.
pub(super) async fn eventually(what: &str, condition: impl Fn() -> bool) {
    let wait = async {
        while !condition() {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    };
    timeout(DEADLINE, wait)
        .await
        .unwrap_or_else(|_| panic!("timed out waiting for: {what}"));
}

/// Everything given back: shard state, blocks, admission slots.
pub(super) async fn assert_all_released(shard: &FakeShard, scheduler: &Scheduler) {
    eventually("shard holds no request", || shard.live_requests() == 0).await;
    eventually("shard holds no batch", || shard.live_batches() == 0).await;
    eventually("shard pins no grammar", || shard.pinned_grammars() == 0).await;
    eventually("all blocks free and nothing in flight", || {
        let stats = scheduler.stats();
        stats.free_blocks == stats.total_blocks && stats.in_flight == 0 && stats.running == 0
    })
    .await;
}

/// The next token event of a request that must not end yet (bounded wait).
pub(super) async fn next_token(events: &mut EventReceiver) -> TokenEvent {
    timeout(DEADLINE, events.recv())
        .await
        .expect("no token in time")
        .expect("the stream ended")
        .expect("the request failed")
}

/// `grammar` pinned by `scheduler` and compiled on `shard` under that pin, as `Infer` does.
pub(super) async fn pinned(
    scheduler: &Scheduler,
    shard: &FakeShard,
    grammar: Grammar,
) -> Arc<PinnedGrammar> {
    let pin = scheduler.pin_grammar(grammar);
    let compiled = shard
        .compile_grammar(String::new(), pin.grammar().clone(), pin.id())
        .await
        .unwrap();
    assert_eq!(compiled.error, None);
    pin
}
