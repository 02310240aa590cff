//! Embedding requests against `FakeShard`: one Prefill each, whole, no decode; no batch slot;
//! their adapter's output; nothing left held or cached. The fake's embedding rule (prompt
//! length, last token, adapter shift, token sum mod vocab) is written out again here.

use std::sync::Arc;
use std::time::Duration;

use quiver_flags::AdapterSource;

use super::test_support::*;
use super::*;
use crate::shard::{fake_adapter_shift, AdapterLoad, FakeShard, ShardBackend};

fn expected(prompt: &[u32], adapter: &str) -> Vec<f32> {
    let sum: u32 = prompt.iter().sum::<u32>() % VOCAB;
    vec![
        prompt.len() as f32,
        *prompt.last().unwrap() as f32,
        fake_adapter_shift(adapter, VOCAB) as f32,
        sum as f32,
    ]
}

/// The one event of an embedding request.
async fn embedding_of(mut events: EventReceiver) -> TokenEvent {
    let event = next_token(&mut events).await;
    assert_eq!(event.finish, Some(FinishReason::Embedded));
    assert!(events.recv().await.is_none(), "event after the embedding");
    event
}

#[tokio::test]
async fn an_embedding_is_one_whole_prefill_and_leaves_nothing_held() {
    let shard = Arc::new(FakeShard::new(VOCAB));
    // Prompts longer than a step's prefill budget are still computed whole, never chunked.
    let scheduler = start(
        &shard,
        SchedulerConfig {
            max_batch_prefill_tokens: 16,
            ..config(16, 64)
        },
    );
    let prompt: Vec<u32> = (1..=40).collect();
    let event = embedding_of(
        scheduler
            .submit(GenerationRequest::embedding(prompt.clone(), "", 0))
            .unwrap(),
    )
    .await;
    assert_eq!(event.embedding, expected(&prompt, ""));
    assert_all_released(&shard, &scheduler).await;
    let seen = shard.stats();
    assert_eq!((seen.prefill_calls, seen.decode_calls), (1, 0));
    assert_eq!(seen.prefill_tokens, vec![40]);
}

#[tokio::test(start_paused = true)]
async fn embeddings_take_no_batch_slot_from_a_decoding_request() {
    let shard = Arc::new(FakeShard::new(VOCAB).with_decode_delay(Duration::from_millis(10)));
    let scheduler = start(
        &shard,
        SchedulerConfig {
            max_batch_size: 1,
            ..config(16, 256)
        },
    );
    let mut chat = scheduler.submit(request(&[3, 4], 500)).unwrap();
    next_token(&mut chat).await;
    let prompts: Vec<Vec<u32>> = (0..3).map(|i| vec![10 + i, 20 + i, 30 + i]).collect();
    let receivers = scheduler
        .submit_all(
            prompts
                .iter()
                .map(|p| GenerationRequest::embedding(p.clone(), "", 0))
                .collect(),
        )
        .unwrap();
    for (prompt, receiver) in prompts.iter().zip(receivers) {
        assert_eq!(embedding_of(receiver).await.embedding, expected(prompt, ""));
    }
    // The one batch slot is still the chat's, which goes on decoding.
    assert_eq!(scheduler.stats().running, 1);
    let rest = collect(chat).await;
    assert_eq!(rest.tokens.len(), 499);
    assert_all_released(&shard, &scheduler).await;
}

#[tokio::test]
async fn embeddings_run_under_their_adapter_and_never_touch_the_prefix_cache() {
    let adapter = "team/embedder";
    let shard = FakeShard::new(VOCAB).with_adapter_slots(1);
    shard
        .load_adapter(AdapterLoad {
            adapter_id: adapter.to_string(),
            source: AdapterSource::Local,
            path: "/adapters/embedder".to_string(),
            revision: String::new(),
        })
        .await
        .unwrap();
    let shard = Arc::new(shard);
    let scheduler = start(
        &shard,
        SchedulerConfig {
            max_active_adapters: 1,
            ..config(16, 64)
        },
    );
    let prompt: Vec<u32> = (50..90).collect();
    for _ in 0..2 {
        let event = embedding_of(
            scheduler
                .submit(GenerationRequest::embedding(prompt.clone(), adapter, 0))
                .unwrap(),
        )
        .await;
        assert_eq!(event.embedding, expected(&prompt, adapter));
        assert_eq!(event.cached_tokens, 0);
    }
    // Neither looked the prompt up, and neither left its blocks cached for a generation.
    assert_eq!(scheduler.stats().prefix_cache_queries, 0);
    let mut chat = scheduler
        .submit(GenerationRequest {
            adapter_id: adapter.to_string(),
            ..request(&prompt, 2)
        })
        .unwrap();
    assert_eq!(next_token(&mut chat).await.cached_tokens, 0);
    collect(chat).await;
    assert_all_released(&shard, &scheduler).await;
}
