//! The fake's own checks: it must catch the router's bookkeeping mistakes (the scheduler tests
//! rely on that) with `InvalidArgument`, and a rejected call must change nothing.

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

fn assert_invalid(result: ShardResult<impl std::fmt::Debug>, needle: &str) {
    match result {
        Err(ShardError::InvalidArgument(message)) => {
            assert!(message.contains(needle), "{message:?} lacks {needle:?}")
        }
        other => panic!("expected InvalidArgument({needle:?}), got {other:?}"),
    }
}

#[tokio::test]
async fn rejects_bad_prefills_without_changing_state() {
    let shard = FakeShard::new(100).with_cache(4, 8);
    // 3 + 2 tokens need 2 blocks of 4.
    assert_invalid(
        shard
            .prefill(0, vec![req(1, vec![1, 2, 3], vec![0], 2)])
            .await,
        "block table",
    );
    assert_invalid(
        shard.prefill(0, vec![req(1, vec![100], vec![0], 1)]).await,
        "vocabulary",
    );
    assert_invalid(
        shard.prefill(0, vec![req(1, vec![], vec![0], 1)]).await,
        "empty prompt",
    );
    assert_invalid(
        shard.prefill(0, vec![req(1, vec![1], vec![0], 0)]).await,
        "no new tokens",
    );
    assert_invalid(
        shard.prefill(0, vec![req(1, vec![1], vec![8], 1)]).await,
        "outside the cache",
    );
    assert_invalid(
        shard
            .prefill(0, vec![req(1, vec![1; 5], vec![2, 2], 1)])
            .await,
        "twice",
    );
    assert_invalid(
        shard
            .prefill(
                0,
                vec![req(1, vec![1], vec![0], 1), req(2, vec![1], vec![0], 1)],
            )
            .await,
        "two new requests",
    );
    assert_invalid(shard.prefill(0, vec![]).await, "empty batch");
    assert_eq!((shard.live_requests(), shard.live_batches()), (0, 0));

    shard
        .prefill(0, vec![req(1, vec![1], vec![0], 3)])
        .await
        .unwrap();
    // A block or an id held by a live request, or a live batch id, cannot be reused.
    assert_invalid(
        shard.prefill(1, vec![req(2, vec![1], vec![0], 3)]).await,
        "in use",
    );
    assert_invalid(
        shard.prefill(1, vec![req(1, vec![1], vec![1], 3)]).await,
        "already live",
    );
    assert_invalid(
        shard.prefill(0, vec![req(2, vec![1], vec![1], 3)]).await,
        "already live",
    );
    assert_eq!((shard.live_requests(), shard.live_batches()), (1, 1));
}

#[tokio::test]
async fn decode_follows_the_token_rule_and_stops_at_max_new_tokens() {
    let shard = FakeShard::new(100).with_cache(4, 8);
    let first = shard
        .prefill(0, vec![req(1, vec![9, 4], vec![0, 1], 3)])
        .await
        .unwrap();
    // (4 * 31 + 7) mod 100 = 31, then (31 * 31 + 7) mod 100 = 68, (68 * 31 + 7) mod 100 = 15.
    assert_eq!(first.generations[0].token_id, 31);
    let batch = first.batch.unwrap();
    let second = shard.decode(vec![batch.clone()]).await.unwrap();
    assert_eq!(second.generations[0].token_id, 68);
    let third = shard.decode(vec![batch.clone()]).await.unwrap();
    assert_eq!(third.generations[0].token_id, 15);
    assert!((third.generations[0].logprob + 0.15).abs() < 1e-6);
    // The request has its 3 tokens: one more decode would write past its block table.
    assert_invalid(
        shard.decode(vec![batch]).await,
        "already has its 3 new tokens",
    );
}

#[tokio::test]
async fn decode_merges_into_the_first_batch_and_checks_membership() {
    let shard = FakeShard::new(100);
    let a = shard
        .prefill(5, vec![req(1, vec![1], vec![0], 9)])
        .await
        .unwrap();
    let b = shard
        .prefill(6, vec![req(2, vec![2], vec![1], 9)])
        .await
        .unwrap();
    let (a, b) = (a.batch.unwrap(), b.batch.unwrap());
    let stale = CachedBatch {
        id: 5,
        request_ids: vec![1, 2],
    };
    assert_invalid(shard.decode(vec![stale]).await, "holds requests");
    assert_invalid(
        shard.decode(vec![a.clone(), a.clone()]).await,
        "listed twice",
    );
    assert_invalid(shard.decode(vec![]).await, "no batches");
    let merged = shard.decode(vec![a, b]).await.unwrap().batch.unwrap();
    assert_eq!(
        merged,
        CachedBatch {
            id: 5,
            request_ids: vec![1, 2]
        }
    );
    assert_eq!(shard.live_batches(), 1);
    assert_eq!(shard.stats().max_decode_batch_size, 2);
}

#[tokio::test]
async fn filter_and_clear_free_requests_and_blocks() {
    let shard = FakeShard::new(100).with_cache(4, 2);
    shard
        .prefill(
            0,
            vec![req(1, vec![1], vec![0], 2), req(2, vec![1], vec![1], 2)],
        )
        .await
        .unwrap();
    assert_invalid(shard.filter_batch(0, vec![3]).await, "not in batch");
    assert_invalid(shard.filter_batch(9, vec![]).await, "unknown batch");
    let kept = shard.filter_batch(0, vec![2]).await.unwrap();
    assert_eq!(kept.unwrap().request_ids, vec![2]);
    assert_eq!(shard.live_requests(), 1);
    // Request 1's block is free again.
    shard
        .prefill(1, vec![req(3, vec![1], vec![0], 2)])
        .await
        .unwrap();
    assert_invalid(shard.clear_cache(Some(7)).await, "unknown batch");
    shard.clear_cache(Some(1)).await.unwrap();
    assert_eq!(shard.live_requests(), 1);
    shard.clear_cache(None).await.unwrap();
    assert_eq!((shard.live_requests(), shard.live_batches()), (0, 0));
}

#[tokio::test]
async fn injected_failures_hit_one_call_of_one_rpc() {
    let shard = FakeShard::new(100);
    shard.fail_next(FakeRpc::Prefill);
    shard.info().await.unwrap();
    let error = shard
        .prefill(0, vec![req(1, vec![1], vec![0], 2)])
        .await
        .unwrap_err();
    assert_eq!(error.code(), tonic::Code::Internal);
    assert_eq!(shard.live_requests(), 0);
    shard
        .prefill(0, vec![req(1, vec![1], vec![0], 2)])
        .await
        .unwrap();
    assert_eq!(shard.live_requests(), 1);
}

#[tokio::test]
async fn warmup_reports_the_cache_capped_by_max_batch_total_tokens() {
    let shard = FakeShard::new(100).with_cache(16, 100);
    let uncapped = shard.warmup(WarmupLimits::default()).await.unwrap();
    assert_eq!((uncapped.block_size, uncapped.num_blocks), (16, 100));
    let capped = shard
        .warmup(WarmupLimits {
            max_batch_total_tokens: 320,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(capped.num_blocks, 20);
}

#[tokio::test]
async fn an_embed_request_computes_its_whole_prompt_and_nothing_else() {
    let shard = FakeShard::new(100).with_cache(4, 8);
    let embed = |max_new_tokens: u32, cached_tokens: u32, prefill_until: u32| PrefillEntry {
        sampling: SamplingParams::default(),
        draws_done: 0,
        cached_tokens,
        prefill_until,
        embed: true,
        ..req(1, vec![1, 2, 3, 4, 5], vec![0, 1], max_new_tokens)
    };
    for bad in [embed(1, 0, 0), embed(0, 4, 0), embed(0, 0, 3)] {
        assert_invalid(
            shard.prefill(0, vec![bad]).await,
            "computes its whole prompt",
        );
    }
    let answer = shard.prefill(0, vec![embed(0, 0, 0)]).await.unwrap();
    assert_eq!(answer.generations.len(), 1);
    assert_eq!(answer.generations[0].embedding, vec![5.0, 5.0, 0.0, 15.0]);
    // Nothing is kept: the shard holds no request and no batch for it.
    assert_eq!(answer.batch.map(|b| b.request_ids), Some(Vec::new()));
    assert_eq!((shard.live_requests(), shard.live_batches()), (0, 0));
}

#[tokio::test]
async fn a_prefill_names_only_a_pinned_grammar() {
    let shard = FakeShard::new(100).with_cache(4, 8);
    let grammar = Grammar {
        kind: GrammarKind::Regex,
        text: "a+".to_string(),
        eos_token_ids: vec![0],
    };
    let constrained = |id: u64, grammar_id: u64| PrefillEntry {
        grammar_id: Some(grammar_id),
        ..req(id, vec![1], vec![id as u32], 2)
    };
    assert_invalid(
        shard.prefill(0, vec![constrained(1, 5)]).await,
        "not pinned",
    );
    shard
        .compile_grammar(String::new(), grammar.clone(), 5)
        .await
        .unwrap();
    assert_eq!(shard.pinned_grammars(), 1);
    shard.prefill(0, vec![constrained(1, 5)]).await.unwrap();
    assert_eq!(shard.prefilled_grammars(), vec![Some(grammar.clone())]);
    shard.release_grammars(vec![5, 6]).await.unwrap();
    assert_eq!(shard.pinned_grammars(), 0);
    assert_invalid(
        shard.prefill(1, vec![constrained(2, 5)]).await,
        "not pinned",
    );

    // A refused grammar is not pinned.
    shard.refuse_grammars("too deep");
    let refused = shard
        .compile_grammar(String::new(), grammar, 7)
        .await
        .unwrap();
    assert_eq!(refused.error.as_deref(), Some("too deep"));
    assert_eq!(shard.pinned_grammars(), 0);
}
