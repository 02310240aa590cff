//! The fake's mixed step (a Decode carrying a Prefill): both parts' effects, the prefill's
//! finished requests joined after the decoded batch's own, no batch of the prefill's id kept,
//! its checks (a rejected call changes nothing), its injected failures and its time. Expected
//! tokens follow the fake's rule, `next(t) = (31 t + 7) mod 100`, written out by hand.

use std::time::Duration;

use super::*;

fn req(id: u64, prompt: Vec<u32>, blocks: Vec<u32>, max_new_tokens: u32) -> PrefillEntry {
    PrefillEntry {
        id,
        input_ids: prompt,
        blocks,
        sampling: SamplingParams::default(),
        draws_done: 0,
        max_new_tokens,
        adapter_id: String::new(),
        prompt_logprobs: None,
        grammar_id: None,
        cached_tokens: 0,
        prefill_until: 0,
        embed: false,
    }
}

fn tokens(step: &Step) -> Vec<(u64, u32)> {
    step.generations
        .iter()
        .map(|g| (g.request_id, g.token_id))
        .collect()
}

fn batch(id: u64, request_ids: Vec<u64>) -> CachedBatch {
    CachedBatch { id, request_ids }
}

/// A shard with 8 blocks of 4 tokens running request 1 (prompt [5], first token 62) in batch 0.
async fn running_one() -> FakeShard {
    let shard = FakeShard::new(100).with_cache(4, 8);
    let first = shard
        .prefill(0, vec![req(1, vec![5], vec![0, 6], 4)])
        .await
        .unwrap();
    assert_eq!(tokens(&first), vec![(1, 62)]);
    shard
}

#[tokio::test]
async fn the_prompts_finished_by_the_prefill_join_the_decoded_batch() {
    let shard = running_one().await;
    let chunk = PrefillEntry {
        prefill_until: 4,
        ..req(3, (1..=8).collect(), vec![2, 3, 4], 2)
    };
    let mixed = shard
        .decode_with_prefill(
            vec![batch(0, vec![1])],
            1,
            vec![req(2, vec![6, 2], vec![1, 5], 4), chunk.clone()],
        )
        .await
        .unwrap();
    // Request 1 decodes (next(62) = 29); request 2 gets its first token (next(2) = 69); the
    // chunk of request 3 only writes its KV.
    assert_eq!(tokens(&mixed.decode), vec![(1, 29)]);
    assert_eq!(tokens(&mixed.prefill), vec![(2, 69)]);
    assert_eq!(mixed.prefill.batch, Some(batch(1, vec![2])));
    assert_eq!(mixed.decode.batch, Some(batch(0, vec![1, 2])));
    assert_eq!((shard.live_batches(), shard.live_requests()), (1, 2));
    let stats = shard.stats();
    assert_eq!(
        (stats.prefill_calls, stats.decode_calls, stats.mixed_calls),
        (2, 1, 1)
    );
    assert_eq!(stats.prefill_tokens, vec![1, 6]);

    // The joined batch decodes as one.
    let next = shard.decode(vec![batch(0, vec![1, 2])]).await.unwrap();
    assert_eq!(tokens(&next), vec![(1, 6), (2, 46)]);
    // The chunked prompt's last chunk in the next mixed step, reading the KV of the first.
    let rest = PrefillEntry {
        cached_tokens: 4,
        prefill_until: 0,
        ..chunk
    };
    let mixed = shard
        .decode_with_prefill(vec![batch(0, vec![1, 2])], 2, vec![rest])
        .await
        .unwrap();
    assert_eq!(tokens(&mixed.decode), vec![(1, 93), (2, 33)]);
    assert_eq!(tokens(&mixed.prefill), vec![(3, 55)]);
    assert_eq!(mixed.decode.batch, Some(batch(0, vec![1, 2, 3])));
    assert_eq!(shard.live_batches(), 1);
}

#[tokio::test]
async fn a_rejected_mixed_step_changes_nothing() {
    let shard = running_one().await;
    // The prefill part is wrong: block 0 is request 1's.
    assert_invalid(
        shard
            .decode_with_prefill(
                vec![batch(0, vec![1])],
                1,
                vec![req(2, vec![6], vec![0], 2)],
            )
            .await,
        "in use",
    );
    // The decode part is wrong: no batch 9.
    assert_invalid(
        shard
            .decode_with_prefill(
                vec![batch(9, vec![1])],
                1,
                vec![req(2, vec![6], vec![1], 2)],
            )
            .await,
        "unknown batch",
    );
    // The prefill's batch id is the decoded batch's.
    assert_invalid(
        shard
            .decode_with_prefill(
                vec![batch(0, vec![1])],
                0,
                vec![req(2, vec![6], vec![1], 2)],
            )
            .await,
        "already live",
    );
    assert_eq!((shard.live_batches(), shard.live_requests()), (1, 1));
    // Request 1 was never stepped: its next token is still the first decode's.
    let next = shard.decode(vec![batch(0, vec![1])]).await.unwrap();
    assert_eq!(tokens(&next), vec![(1, 29)]);
}

#[tokio::test]
async fn a_failure_injected_for_prefill_or_decode_breaks_a_mixed_step() {
    let shard = running_one().await;
    for rpc in [FakeRpc::Prefill, FakeRpc::Decode] {
        shard.fail_next(rpc);
        let error = shard
            .decode_with_prefill(
                vec![batch(0, vec![1])],
                1,
                vec![req(2, vec![6], vec![1], 2)],
            )
            .await
            .unwrap_err();
        assert_eq!(error.code(), tonic::Code::Internal);
        assert_eq!(shard.live_requests(), 1);
    }
    let mixed = shard
        .decode_with_prefill(
            vec![batch(0, vec![1])],
            1,
            vec![req(2, vec![6], vec![1], 2)],
        )
        .await
        .unwrap();
    assert_eq!(mixed.decode.batch, Some(batch(0, vec![1, 2])));
}

#[tokio::test(start_paused = true)]
async fn a_mixed_step_takes_a_decode_step_plus_its_prompt_tokens() {
    let step = Duration::from_millis(2);
    let decode = Duration::from_millis(30);
    let per_token = Duration::from_millis(1);
    let shard = FakeShard::new(100)
        .with_step_delay(step)
        .with_decode_delay(decode)
        .with_prefill_token_delay(per_token);
    shard
        .prefill(0, vec![req(1, vec![5], vec![0], 4)])
        .await
        .unwrap();
    let started = tokio::time::Instant::now();
    shard
        .decode_with_prefill(
            vec![batch(0, vec![1])],
            1,
            vec![req(2, vec![6, 7, 8], vec![1], 2)],
        )
        .await
        .unwrap();
    assert_eq!(started.elapsed(), step + decode + per_token * 3);
}

fn assert_invalid(result: ShardResult<impl std::fmt::Debug>, needle: &str) {
    match result {
        Err(ShardError::InvalidArgument(message)) => {
            assert!(message.contains(needle), "{message:?} lacks {needle:?}")
        }
        other => panic!("expected InvalidArgument({needle:?}), got {other:?}"),
    }
}
