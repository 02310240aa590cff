//! The fake's adapter rules: its documented token rule per adapter (re-derived here from the
//! documentation, not from the code), and the checks the scheduler tests rely on to catch a
//! request on an inactive adapter, an activation under running requests, or an early unload.

use std::collections::HashSet;

use quiver_flags::AdapterSource;

use super::*;

const VOCAB: u32 = 256;

/// `k` as the fake's documentation states it: 0 for the base model, else
/// 1 + FNV-1a-64(id) mod (vocab - 1).
fn documented_shift(adapter_id: &str) -> u32 {
    if adapter_id.is_empty() {
        return 0;
    }
    let mut hash: u64 = 14695981039346656037;
    for byte in adapter_id.bytes() {
        hash = (hash ^ byte as u64).wrapping_mul(1099511628211);
    }
    1 + (hash % (VOCAB as u64 - 1)) as u32
}

fn req(id: u64, prompt: u32, block: u32, adapter_id: &str) -> PrefillEntry {
    PrefillEntry {
        id,
        input_ids: vec![prompt],
        blocks: vec![block],
        sampling: SamplingParams::default(),
        draws_done: 0,
        max_new_tokens: 4,
        adapter_id: adapter_id.to_string(),
        prompt_logprobs: None,
        grammar_id: None,
        cached_tokens: 0,
        prefill_until: 0,
        embed: false,
    }
}

fn load(adapter_id: &str) -> AdapterLoad {
    AdapterLoad {
        adapter_id: adapter_id.to_string(),
        source: AdapterSource::Local,
        path: format!("/adapters/{adapter_id}"),
        revision: String::new(),
    }
}

fn assert_invalid(result: ShardResult<impl std::fmt::Debug>, needle: &str) {
    match result {
        Err(ShardError::InvalidArgument(message)) => {
            assert!(message.contains(needle), "{message:?} lacks {needle:?}")
        }
        other => panic!("expected InvalidArgument({needle:?}), got {other:?}"),
    }
}

#[test]
fn the_shift_is_the_documented_hash_and_separates_adapters() {
    let ids = ["a0", "a1", "a2", "a3", "a4", "a5", "owner/name", "x"];
    for id in ids {
        assert_eq!(fake_adapter_shift(id, VOCAB), documented_shift(id), "{id}");
        assert_ne!(fake_adapter_shift(id, VOCAB), 0);
        assert_eq!(
            fake_next_token_for(10, id, VOCAB),
            (10 * 31 + 7 + documented_shift(id)) % VOCAB
        );
    }
    assert_eq!(fake_adapter_shift("", VOCAB), 0);
    assert_eq!(
        fake_next_token_for(10, "", VOCAB),
        fake_next_token(10, VOCAB)
    );
    let distinct: HashSet<u32> = ids.iter().map(|id| fake_adapter_shift(id, VOCAB)).collect();
    assert_eq!(
        distinct.len(),
        ids.len(),
        "the test adapters need distinct shifts"
    );
}

#[tokio::test]
async fn each_request_follows_its_own_adapters_rule_in_one_batch() {
    let shard = FakeShard::new(VOCAB).with_adapter_slots(2);
    for id in ["a", "b"] {
        shard.load_adapter(load(id)).await.unwrap();
    }
    shard.activate_adapter("a".into(), 0).await.unwrap();
    shard.activate_adapter("b".into(), 1).await.unwrap();
    let first = shard
        .prefill(
            0,
            vec![req(1, 9, 0, ""), req(2, 9, 1, "a"), req(3, 9, 2, "b")],
        )
        .await
        .unwrap();
    let expected: Vec<u32> = ["", "a", "b"]
        .iter()
        .map(|id| (9 * 31 + 7 + documented_shift(id)) % VOCAB)
        .collect();
    let tokens: Vec<u32> = first.generations.iter().map(|g| g.token_id).collect();
    assert_eq!(tokens, expected);
    let second = shard.decode(vec![first.batch.unwrap()]).await.unwrap();
    let tokens: Vec<u32> = second.generations.iter().map(|g| g.token_id).collect();
    let expected: Vec<u32> = ["", "a", "b"]
        .iter()
        .zip(&expected)
        .map(|(id, t)| (t * 31 + 7 + documented_shift(id)) % VOCAB)
        .collect();
    assert_eq!(tokens, expected);
    let stats = shard.stats();
    assert_eq!((stats.max_live_adapters, stats.max_decode_adapters), (2, 2));
}

#[tokio::test]
async fn a_request_needs_its_adapter_in_a_slot() {
    let shard = FakeShard::new(VOCAB).with_adapter_slots(1);
    assert_invalid(
        shard.prefill(0, vec![req(1, 9, 0, "a")]).await,
        "not active in any slot",
    );
    shard.load_adapter(load("a")).await.unwrap();
    // Loaded is not enough.
    assert_invalid(
        shard.prefill(0, vec![req(1, 9, 0, "a")]).await,
        "not active in any slot",
    );
    assert_eq!(shard.live_requests(), 0);
    shard.activate_adapter("a".into(), 0).await.unwrap();
    shard.prefill(0, vec![req(1, 9, 0, "a")]).await.unwrap();
}

#[tokio::test]
async fn activation_is_refused_under_running_requests_and_for_bad_slots() {
    let shard = FakeShard::new(VOCAB);
    shard
        .warmup(WarmupLimits {
            max_active_adapters: 2,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(shard.active_adapters(), vec![None, None]);
    assert_invalid(shard.activate_adapter("a".into(), 0).await, "not loaded");
    for id in ["a", "b"] {
        shard.load_adapter(load(id)).await.unwrap();
    }
    assert_invalid(
        shard.activate_adapter("a".into(), 2).await,
        "outside the 2 adapter slots",
    );
    shard.activate_adapter("a".into(), 0).await.unwrap();
    assert_invalid(
        shard.activate_adapter("a".into(), 1).await,
        "already active in slot 0",
    );
    shard
        .prefill(0, vec![req(1, 9, 0, "a"), req(2, 9, 1, "")])
        .await
        .unwrap();
    // Neither another adapter nor the same one again may overwrite a slot in use.
    assert_invalid(
        shard.activate_adapter("b".into(), 0).await,
        "running requests [1]",
    );
    assert_invalid(
        shard.activate_adapter("a".into(), 0).await,
        "running requests [1]",
    );
    assert_invalid(
        shard.unload_adapter("a".into()).await,
        "running requests [1]",
    );
    // Once request 1 left the batch, slot 0 is free to take.
    shard.filter_batch(0, vec![2]).await.unwrap();
    shard.activate_adapter("b".into(), 0).await.unwrap();
    assert_eq!(shard.active_adapters(), vec![Some("b".to_string()), None]);
    assert_eq!(
        shard.activations(),
        vec![("a".to_string(), 0), ("b".to_string(), 0)]
    );
    assert_eq!(shard.activation_count("a"), 1);
    assert_eq!(shard.stats().activate_calls, 2);
}

#[tokio::test]
async fn a_failed_activation_leaves_the_slot_empty() {
    let shard = FakeShard::new(VOCAB).with_adapter_slots(1);
    for id in ["a", "b"] {
        shard.load_adapter(load(id)).await.unwrap();
    }
    shard.activate_adapter("a".into(), 0).await.unwrap();
    shard.fail_adapter_activation("b");
    let error = shard.activate_adapter("b".into(), 0).await.unwrap_err();
    assert_eq!(error.code(), tonic::Code::Internal);
    assert_eq!(shard.active_adapters(), vec![None]);
    assert_eq!(shard.activations(), vec![("a".to_string(), 0)]);
}

#[tokio::test]
async fn loads_answer_paths_and_injected_failures() {
    let shard = FakeShard::new(VOCAB).with_adapter_path("owner/own-template", "/tmp/assets");
    let hub = |id: &str| AdapterLoad {
        adapter_id: id.to_string(),
        source: AdapterSource::Hub,
        ..Default::default()
    };
    assert_eq!(
        shard.load_adapter(hub("owner/plain")).await.unwrap().path,
        "fake-hub/owner/plain"
    );
    assert_eq!(
        shard
            .load_adapter(hub("owner/own-template"))
            .await
            .unwrap()
            .path,
        "/tmp/assets"
    );
    assert_eq!(
        shard.load_adapter(load("team/x")).await.unwrap().path,
        "/adapters/team/x"
    );
    let no_path = AdapterLoad {
        path: String::new(),
        ..load("team/y")
    };
    assert_invalid(shard.load_adapter(no_path).await, "without a path");
    shard.fail_adapter_load("team/bad", "rank 128 exceeds --max-lora-rank 64");
    assert_invalid(shard.load_adapter(load("team/bad")).await, "max-lora-rank");
    assert_eq!(
        shard.loaded_adapters(),
        vec!["owner/own-template", "owner/plain", "team/x"]
    );
    assert_eq!(shard.adapter_load_requests().len(), 5);

    let other_rank = FakeShard::new(VOCAB).with_rank(1, 2);
    assert_invalid(
        other_rank.load_adapter(hub("owner/plain")).await,
        "only rank 0 downloads",
    );

    shard.unload_adapter("team/x".into()).await.unwrap();
    shard.unload_adapter("never-loaded".into()).await.unwrap();
    assert_eq!(shard.unloaded_adapters(), vec!["team/x", "never-loaded"]);
    assert_eq!(
        shard.loaded_adapters(),
        vec!["owner/own-template", "owner/plain"]
    );
}

#[tokio::test]
async fn an_adapter_goes_only_into_a_slot_that_holds_its_rank() {
    let shard = FakeShard::new(VOCAB).with_adapter_rank("big", 64);
    assert_invalid(
        shard
            .warmup(WarmupLimits {
                max_active_adapters: 3,
                slot_ranks: vec![8, 64],
                ..Default::default()
            })
            .await,
        "2 slot ranks for 3 adapter slots",
    );
    shard
        .warmup(WarmupLimits {
            max_active_adapters: 2,
            slot_ranks: vec![16, 64],
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(shard.adapter_slot_ranks(), vec![16, 64]);
    assert_eq!(shard.load_adapter(load("big")).await.unwrap().rank, 64);
    assert_eq!(shard.load_adapter(load("small")).await.unwrap().rank, 8);
    assert_invalid(
        shard.activate_adapter("big".into(), 0).await,
        "rank 64, but slot 0 holds ranks up to 16",
    );
    assert_eq!(shard.active_adapters(), vec![None, None]);
    shard.activate_adapter("small".into(), 0).await.unwrap();
    shard.activate_adapter("big".into(), 1).await.unwrap();
    assert_eq!(
        shard.activations(),
        vec![("small".to_string(), 0), ("big".to_string(), 1)]
    );
}
