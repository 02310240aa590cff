//! The scheduler with adapters, against `FakeShard`. Expected tokens follow the fake's
//! documented per-adapter rule, t' = (31 t + 7 + k(adapter)) mod vocab (k checked against its
//! documented hash in the fake's own tests). The fake refuses a prefill whose adapter is not in
//! a slot, an activation of a slot that running requests use, more slots than it has, and an
//! unload while requests still use the adapter, so every test also checks the slot bookkeeping.

use std::sync::Arc;
use std::time::Duration;

use quiver_flags::AdapterSource;

use super::test_support::*;
use super::*;
use crate::shard::{fake_adapter_shift, AdapterLoad, FakeShard};

/// The reference output of `prompt` on `adapter` ("" = base model).
fn reference(adapter: &str, prompt: &[u32], n: usize) -> Vec<u32> {
    let shift = fake_adapter_shift(adapter, VOCAB);
    let mut previous = *prompt.last().unwrap();
    (0..n)
        .map(|_| {
            previous = (previous * 31 + 7 + shift) % VOCAB;
            previous
        })
        .collect()
}

fn on(adapter: &str, prompt: &[u32], max_new_tokens: u32) -> GenerationRequest {
    GenerationRequest {
        adapter_id: adapter.to_string(),
        ..request(prompt, max_new_tokens)
    }
}

fn with_slots(slots: u32) -> SchedulerConfig {
    SchedulerConfig {
        max_active_adapters: slots,
        ..config(16, 1024)
    }
}

fn names(count: usize) -> Vec<String> {
    (0..count).map(|i| format!("team/adapter-{i}")).collect()
}

/// A fake with `slots` adapter slots and `adapters` loaded, as the registry would leave it.
async fn shard_with(slots: u32, adapters: &[String], step_delay: Duration) -> Arc<FakeShard> {
    let shard = FakeShard::new(VOCAB)
        .with_adapter_slots(slots)
        .with_step_delay(step_delay);
    for id in adapters {
        shard
            .load_adapter(AdapterLoad {
                adapter_id: id.clone(),
                source: AdapterSource::Local,
                path: format!("/adapters/{id}"),
                revision: String::new(),
            })
            .await
            .unwrap();
    }
    Arc::new(shard)
}

#[tokio::test]
async fn adapter_requests_are_refused_when_adapters_are_disabled() {
    let shard = shard_with(0, &[], Duration::ZERO).await;
    let scheduler = start(&shard, with_slots(0));
    assert_eq!(
        scheduler.submit(on("team/a", &[1], 3)).unwrap_err(),
        AdmissionError::AdaptersDisabled {
            adapter_id: "team/a".to_string()
        }
    );
    assert_eq!(scheduler.in_flight(), 0);
    let base = collect(scheduler.submit(on("", &[1], 3)).unwrap()).await;
    assert_eq!(base.tokens, reference("", &[1], 3));
}

#[tokio::test]
async fn a_mixed_burst_gives_every_request_its_adapters_output_as_alone() {
    let adapters = names(6);
    let shard = shard_with(8, &adapters, Duration::ZERO).await;
    let scheduler = start(&shard, with_slots(8));
    let mut cases = Vec::new();
    for round in 0..3u32 {
        for (i, adapter) in std::iter::once("")
            .chain(adapters.iter().map(String::as_str))
            .enumerate()
        {
            let i = i as u32;
            let prompt = vec![(round * 17 + i * 5) % VOCAB, (i * 3 + 1) % VOCAB];
            cases.push((adapter.to_string(), prompt, 3 + (round + i) % 6));
        }
    }
    let alone: Vec<Outcome> = {
        let mut outcomes = Vec::new();
        for (adapter, prompt, max_new) in &cases {
            outcomes.push(collect(scheduler.submit(on(adapter, prompt, *max_new)).unwrap()).await);
        }
        outcomes
    };
    assert_eq!(shard.stats().max_decode_batch_size, 1, "alone means alone");
    let burst: Vec<_> = cases
        .iter()
        .map(|(adapter, prompt, max_new)| scheduler.submit(on(adapter, prompt, *max_new)).unwrap())
        .collect();
    for ((case, alone), events) in cases.iter().zip(alone).zip(burst) {
        let (adapter, prompt, max_new) = case;
        let expected = reference(adapter, prompt, *max_new as usize);
        assert_eq!(alone.tokens, expected, "{adapter:?} alone");
        let together = collect(events).await;
        assert_eq!(together.tokens, expected, "{adapter:?} in the burst");
        assert_eq!(together.finish, Ok(FinishReason::Length));
    }
    let stats = shard.stats();
    assert!(stats.max_decode_batch_size >= 14, "{stats:?}");
    assert_eq!(
        stats.max_decode_adapters, 6,
        "one batch mixed all six adapters"
    );
    // Enough slots for all: each adapter was activated once and stayed.
    for adapter in &adapters {
        assert_eq!(shard.activation_count(adapter), 1, "{adapter}");
    }
    assert_eq!(scheduler.stats().active_adapters, 6);
    assert_eq!(scheduler.stats().adapter_slots, 8);
    assert_all_released(&shard, &scheduler).await;
}

#[tokio::test]
async fn two_slots_serve_a_burst_over_six_adapters() {
    let adapters = names(6);
    let shard = shard_with(2, &adapters, Duration::ZERO).await;
    let scheduler = start(&shard, with_slots(2));
    let cases: Vec<(String, Vec<u32>, u32)> = (0..36u32)
        .map(|i| {
            let adapter = adapters[i as usize % 6].clone();
            (adapter, vec![i % VOCAB, (i * 7) % VOCAB], 2 + i % 9)
        })
        .collect();
    let receivers: Vec<_> = cases
        .iter()
        .map(|(adapter, prompt, max_new)| scheduler.submit(on(adapter, prompt, *max_new)).unwrap())
        .collect();
    for ((adapter, prompt, max_new), events) in cases.iter().zip(receivers) {
        let outcome = collect(events).await;
        assert_eq!(
            outcome.tokens,
            reference(adapter, prompt, *max_new as usize)
        );
        assert_eq!(outcome.finish, Ok(FinishReason::Length));
    }
    let stats = shard.stats();
    assert!(stats.max_live_adapters <= 2, "{stats:?}");
    assert!(shard.activations().iter().all(|(_, slot)| *slot < 2));
    for adapter in &adapters {
        assert!(shard.activation_count(adapter) >= 1, "{adapter}");
    }
    assert_all_released(&shard, &scheduler).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_slots_serve_six_clients_rotating_over_six_adapters() {
    let adapters = names(6);
    let shard = shard_with(2, &adapters, Duration::from_millis(1)).await;
    let scheduler = start(&shard, with_slots(2));
    // Each client sends its requests one after another, each on the next adapter, so every
    // adapter keeps coming back while the others hold the slots.
    let clients: Vec<_> = (0..6usize)
        .map(|client| {
            let scheduler = scheduler.clone();
            let adapters = adapters.clone();
            tokio::spawn(async move {
                for turn in 0..5usize {
                    let adapter = &adapters[(client + turn) % 6];
                    let prompt = vec![(client * 11 + turn) as u32 % VOCAB];
                    let max_new = 2 + ((client + 2 * turn) % 7) as u32;
                    let outcome =
                        collect(scheduler.submit(on(adapter, &prompt, max_new)).unwrap()).await;
                    assert_eq!(
                        outcome.tokens,
                        reference(adapter, &prompt, max_new as usize)
                    );
                    assert_eq!(outcome.finish, Ok(FinishReason::Length));
                }
            })
        })
        .collect();
    for client in clients {
        tokio::time::timeout(DEADLINE, client)
            .await
            .expect("a client was stuck: deadlock")
            .unwrap();
    }
    let stats = shard.stats();
    assert!(stats.max_live_adapters <= 2, "{stats:?}");
    assert!(
        stats.activate_calls > 6,
        "the two slots were swapped around: {stats:?}"
    );
    assert_all_released(&shard, &scheduler).await;
}

/// Steps the shard had run when `events` got its first token.
async fn steps_until_first_token(shard: &FakeShard, events: &mut EventReceiver) -> (u64, u64) {
    next_token(events).await;
    let stats = shard.stats();
    (stats.prefill_calls, stats.decode_calls)
}

#[tokio::test]
async fn a_burst_on_one_adapter_does_not_delay_another() {
    let adapters = names(2);
    let (a, b) = (&adapters[0], &adapters[1]);
    // The step delay lets this task read the shard's counters as soon as b's token is out.
    let shard = shard_with(2, &adapters, Duration::from_millis(1)).await;
    // 4-token prompts under an 8-token prefill budget: two requests per prefill, so the burst
    // alone takes 25 prefills.
    let config = SchedulerConfig {
        max_batch_prefill_tokens: 8,
        ..with_slots(2)
    };
    let scheduler = start(&shard, config);
    let burst: Vec<_> = (0..50u32)
        .map(|i| scheduler.submit(on(a, &[i, i, i, i], 20)).unwrap())
        .collect();
    let mut single = scheduler.submit(on(b, &[9, 9, 9, 9], 5)).unwrap();
    let (prefills, decodes) = steps_until_first_token(&shard, &mut single).await;
    assert!(
        prefills <= 2 && decodes <= 1,
        "b waited {prefills} prefills, {decodes} decodes"
    );
    let rest = collect(single).await;
    assert_eq!(rest.finish, Ok(FinishReason::Length));
    for (i, events) in burst.into_iter().enumerate() {
        let i = i as u32;
        assert_eq!(collect(events).await.tokens, reference(a, &[i], 20));
    }
    assert_all_released(&shard, &scheduler).await;
}

#[tokio::test]
async fn a_busy_adapter_gives_its_only_slot_up_to_a_waiting_one() {
    let adapters = names(2);
    let (a, b) = (&adapters[0], &adapters[1]);
    let shard = shard_with(1, &adapters, Duration::from_millis(1)).await;
    let config = SchedulerConfig {
        max_batch_prefill_tokens: 8,
        ..with_slots(1)
    };
    let scheduler = start(&shard, config);
    let burst: Vec<_> = (0..20u32)
        .map(|i| scheduler.submit(on(a, &[i, i, i, i], 5)).unwrap())
        .collect();
    let mut single = scheduler.submit(on(b, &[9, 9, 9, 9], 5)).unwrap();
    // a's first prefill (two requests) runs to the end, then b gets the slot: b is in the
    // second prefill, not behind all ten of a's.
    let (prefills, _) = steps_until_first_token(&shard, &mut single).await;
    assert_eq!(prefills, 2);
    assert_eq!(collect(single).await.finish, Ok(FinishReason::Length));
    for (i, events) in burst.into_iter().enumerate() {
        let i = i as u32;
        assert_eq!(collect(events).await.tokens, reference(a, &[i], 5));
    }
    let activations: Vec<String> = shard.activations().into_iter().map(|(id, _)| id).collect();
    assert_eq!(activations, vec![a.clone(), b.clone(), a.clone()]);
    assert_all_released(&shard, &scheduler).await;
}

#[tokio::test]
async fn a_waiter_that_left_does_not_hold_the_slot() {
    let adapters = names(2);
    let (a, b) = (&adapters[0], &adapters[1]);
    let shard = shard_with(1, &adapters, Duration::from_millis(1)).await;
    let scheduler = start(&shard, with_slots(1));
    let mut long = scheduler.submit(on(a, &[1], 60)).unwrap();
    next_token(&mut long).await;
    // b waits for a's slot, then its client leaves. The batcher publishes `queued` after a
    // step, so b counted there means a prefill already passed b over and reserved a's slot.
    let gone = scheduler.submit(on(b, &[2], 5)).unwrap();
    eventually("b waits for a's slot", || scheduler.stats().queued == 1).await;
    drop(gone);
    // A new request on a joins a's slot at once rather than waiting for the long one to end.
    let mut next = scheduler.submit(on(a, &[3], 3)).unwrap();
    next_token(&mut next).await;
    assert!(
        shard.live_requests() == 2,
        "the long request is still running"
    );
    assert_eq!(collect(next).await.finish, Ok(FinishReason::Length));
    assert_eq!(collect(long).await.finish, Ok(FinishReason::Length));
    assert_eq!(shard.activation_count(b), 0);
    assert_all_released(&shard, &scheduler).await;
}

#[tokio::test]
async fn eviction_picks_the_least_recently_used_idle_adapter() {
    let adapters = names(3);
    let (x, y, z) = (&adapters[0], &adapters[1], &adapters[2]);
    let shard = shard_with(2, &adapters, Duration::ZERO).await;
    let scheduler = start(&shard, with_slots(2));
    for adapter in [x, y, x] {
        let outcome = collect(scheduler.submit(on(adapter, &[4], 3)).unwrap()).await;
        assert_eq!(outcome.tokens, reference(adapter, &[4], 3));
    }
    // Both slots are idle; y was used less recently than x, so z replaces y.
    let outcome = collect(scheduler.submit(on(z, &[4], 3)).unwrap()).await;
    assert_eq!(outcome.tokens, reference(z, &[4], 3));
    assert_eq!(
        shard.activations(),
        vec![(x.clone(), 0), (y.clone(), 1), (z.clone(), 1)]
    );
    assert_eq!(
        shard.active_adapters(),
        vec![Some(x.clone()), Some(z.clone())]
    );
    assert_all_released(&shard, &scheduler).await;
}

#[tokio::test]
async fn a_failed_activation_fails_only_that_adapters_requests() {
    let adapters = names(2);
    let (broken, fine) = (&adapters[0], &adapters[1]);
    let shard = shard_with(1, &adapters, Duration::ZERO).await;
    shard.fail_adapter_activation(broken.clone());
    let config = SchedulerConfig {
        max_batch_prefill_tokens: 2,
        ..with_slots(1)
    };
    let scheduler = start(&shard, config);
    // Two of broken's four requests fit the first prefill; the other two are still queued when
    // the activation fails, and fail with it.
    let failing: Vec<_> = (0..4u32)
        .map(|i| scheduler.submit(on(broken, &[i], 4)).unwrap())
        .collect();
    let ok = scheduler.submit(on(fine, &[7], 4)).unwrap();
    let base = scheduler.submit(on("", &[8], 4)).unwrap();
    for events in failing {
        let outcome = collect(events).await;
        assert!(outcome.tokens.is_empty());
        assert!(
            matches!(&outcome.finish, Err(GenerationError::Shard(m)) if m.contains("injected")),
            "{outcome:?}"
        );
    }
    assert_eq!(collect(ok).await.tokens, reference(fine, &[7], 4));
    assert_eq!(collect(base).await.tokens, reference("", &[8], 4));
    assert_eq!(shard.active_adapters(), vec![Some(fine.clone())]);
    assert_all_released(&shard, &scheduler).await;
}

#[tokio::test]
async fn unload_lets_running_and_queued_requests_finish_first() {
    let adapters = names(2);
    let (x, other) = (&adapters[0], &adapters[1]);
    let shard = shard_with(2, &adapters, Duration::from_millis(1)).await;
    let scheduler = start(&shard, with_slots(2));
    let mut running = scheduler.submit(on(x, &[5], 30)).unwrap();
    let mut tokens = vec![next_token(&mut running).await.token_id];
    let queued = scheduler.submit(on(x, &[6], 4)).unwrap();
    let unloaded = tokio::spawn(scheduler.unload_adapter(x.clone()));
    let elsewhere = collect(scheduler.submit(on(other, &[7], 4)).unwrap()).await;
    assert_eq!(elsewhere.tokens, reference(other, &[7], 4));
    assert!(shard.unloaded_adapters().is_empty(), "x still has requests");

    let rest = collect(running).await;
    tokens.extend(rest.tokens);
    assert_eq!(tokens, reference(x, &[5], 30));
    assert_eq!(collect(queued).await.tokens, reference(x, &[6], 4));
    tokio::time::timeout(DEADLINE, unloaded)
        .await
        .expect("unload finished")
        .unwrap()
        .unwrap();
    assert_eq!(shard.unloaded_adapters(), vec![x.clone()]);
    assert_eq!(shard.loaded_adapters(), vec![other.clone()]);
    assert!(!shard.active_adapters().contains(&Some(x.clone())));
    assert_eq!(scheduler.stats().active_adapters, 1);
    assert_all_released(&shard, &scheduler).await;
}

#[tokio::test]
async fn unload_of_an_idle_or_unused_adapter_goes_straight_to_the_shard() {
    let adapters = names(2);
    let shard = shard_with(1, &adapters, Duration::ZERO).await;
    let scheduler = start(&shard, with_slots(1));
    collect(scheduler.submit(on(&adapters[0], &[1], 2)).unwrap()).await;
    scheduler.unload_adapter(adapters[0].clone()).await.unwrap();
    // Never activated: still unloaded from the shards' host memory.
    scheduler.unload_adapter(adapters[1].clone()).await.unwrap();
    assert_eq!(shard.unloaded_adapters(), adapters);
    assert_eq!(shard.active_adapters(), vec![None]);
    assert_eq!(
        scheduler.unload_adapter(String::new()).await,
        Err(UnloadError::BaseModel)
    );
}

#[tokio::test(start_paused = true)]
async fn a_slot_filled_beside_the_steps_stalls_no_running_stream() {
    let adapters = names(1);
    let a = &adapters[0];
    let shard = FakeShard::new(VOCAB)
        .with_adapter_slots(1)
        .with_step_delay(Duration::from_millis(1))
        .with_adapter_activation_delay(Duration::from_millis(40));
    shard
        .load_adapter(AdapterLoad {
            adapter_id: a.clone(),
            source: AdapterSource::Local,
            path: format!("/adapters/{a}"),
            revision: String::new(),
        })
        .await
        .unwrap();
    let shard = Arc::new(shard);
    let scheduler = start(&shard, with_slots(1));
    let mut stream = scheduler.submit(on("", &[1], 200)).unwrap();
    next_token(&mut stream).await;
    let mut cold = scheduler.submit(on(a, &[5], 3)).unwrap();
    // Until the cold request's first token, the base stream keeps getting tokens: the copy
    // into the slot (40 ms against 1 ms steps) runs beside the steps, not between them.
    let mut streamed = 0;
    let first = loop {
        tokio::select! {
            biased;
            event = cold.recv() => break event.expect("a token").expect("no error"),
            event = stream.recv() => {
                event.expect("a token").expect("no error");
                streamed += 1;
            }
        }
    };
    assert!(
        streamed >= 10,
        "the base stream got {streamed} tokens while the slot was filled"
    );
    let rest = collect(cold).await;
    let mut tokens = vec![first.token_id];
    tokens.extend(rest.tokens);
    assert_eq!(tokens, reference(a, &[5], 3));
    assert_eq!(shard.activations(), vec![(a.clone(), 0)]);
    assert_eq!(collect(stream).await.finish, Ok(FinishReason::Length));
    assert_all_released(&shard, &scheduler).await;
}

#[tokio::test]
async fn an_adapter_waiting_for_a_slot_has_its_host_copy_warmed_once() {
    let adapters = names(2);
    let (a, b) = (&adapters[0], &adapters[1]);
    let shard = shard_with(1, &adapters, Duration::from_millis(1)).await;
    let scheduler = start(&shard, with_slots(1));
    let mut long = scheduler.submit(on(a, &[1], 40)).unwrap();
    next_token(&mut long).await;
    // b waits for a's slot through many steps, with two requests: one prefetch.
    let waiting: Vec<_> = (0..2u32)
        .map(|i| scheduler.submit(on(b, &[i + 2], 3)).unwrap())
        .collect();
    eventually("b's host copy is warmed", || !shard.prefetches().is_empty()).await;
    for (i, events) in waiting.into_iter().enumerate() {
        let outcome = collect(events).await;
        assert_eq!(outcome.tokens, reference(b, &[i as u32 + 2], 3));
    }
    assert_eq!(shard.prefetches(), vec![b.clone()]);
    assert_eq!(collect(long).await.finish, Ok(FinishReason::Length));
    // a, evicted now, waits for the slot again behind a long b: warmed again.
    let mut long = scheduler.submit(on(b, &[7], 40)).unwrap();
    next_token(&mut long).await;
    let again = scheduler.submit(on(a, &[8], 3)).unwrap();
    assert_eq!(collect(again).await.tokens, reference(a, &[8], 3));
    assert_eq!(shard.prefetches(), vec![b.clone(), a.clone()]);
    collect(long).await;
    assert_all_released(&shard, &scheduler).await;
}

/// A fake whose slots hold `slot_ranks` and whose adapters (id, rank) are loaded; the config
/// that matches it.
async fn classed(
    slot_ranks: &[u32],
    adapters: &[(&str, u32)],
) -> (Arc<FakeShard>, SchedulerConfig) {
    let mut shard = FakeShard::new(VOCAB)
        .with_adapter_slot_ranks(slot_ranks)
        .with_step_delay(Duration::from_millis(1));
    for &(id, rank) in adapters {
        shard = shard.with_adapter_rank(id, rank);
    }
    for &(id, rank) in adapters {
        let loaded = shard
            .load_adapter(AdapterLoad {
                adapter_id: id.to_string(),
                source: AdapterSource::Local,
                path: format!("/adapters/{id}"),
                revision: String::new(),
            })
            .await
            .unwrap();
        assert_eq!(loaded.rank, rank);
    }
    let config = SchedulerConfig {
        slot_ranks: slot_ranks.to_vec(),
        ..with_slots(slot_ranks.len() as u32)
    };
    (Arc::new(shard), config)
}

/// A request on `adapter`, which has LoRA rank `rank`.
fn ranked(adapter: &str, rank: u32, prompt: &[u32], max_new_tokens: u32) -> GenerationRequest {
    GenerationRequest {
        adapter_rank: rank,
        ..on(adapter, prompt, max_new_tokens)
    }
}

#[tokio::test(start_paused = true)]
async fn rank_classes_serve_every_adapter_in_a_slot_that_holds_its_rank() {
    let adapters = [
        ("small-0", 8),
        ("small-1", 8),
        ("small-2", 8),
        ("big-0", 64),
        ("big-1", 64),
    ];
    let slot_ranks = [8, 8, 64];
    let (shard, config) = classed(&slot_ranks, &adapters).await;
    let scheduler = start(&shard, config);
    let cases: Vec<(&str, u32, Vec<u32>, u32)> = (0..20u32)
        .map(|i| {
            let (adapter, rank) = adapters[i as usize % adapters.len()];
            (
                adapter,
                rank,
                vec![i % VOCAB, (i * 5 + 3) % VOCAB],
                2 + i % 7,
            )
        })
        .collect();
    let receivers: Vec<_> = cases
        .iter()
        .map(|(adapter, rank, prompt, max_new)| {
            scheduler
                .submit(ranked(adapter, *rank, prompt, *max_new))
                .unwrap()
        })
        .collect();
    for ((adapter, _, prompt, max_new), events) in cases.iter().zip(receivers) {
        let outcome = collect(events).await;
        assert_eq!(outcome.finish, Ok(FinishReason::Length), "{adapter}");
        assert_eq!(
            outcome.tokens,
            reference(adapter, prompt, *max_new as usize)
        );
    }
    // The fake refuses a too-small slot, which would have failed requests above; and the
    // large adapters never took the small slots even when those were empty.
    let activations = shard.activations();
    for (adapter, slot) in &activations {
        let rank = adapters.iter().find(|(id, _)| id == adapter).unwrap().1;
        assert!(
            rank <= slot_ranks[*slot as usize],
            "{adapter} in slot {slot}"
        );
    }
    for (adapter, rank) in adapters {
        assert!(shard.activation_count(adapter) >= 1, "{adapter} ({rank})");
    }
    // And the small ones went to the small slots (a rank lost on the way, 0, would not).
    for small in 0..2 {
        assert!(
            activations.iter().any(|(_, slot)| *slot == small),
            "slot {small} unused: {activations:?}"
        );
    }
    assert_all_released(&shard, &scheduler).await;
}

#[tokio::test(start_paused = true)]
async fn a_large_adapter_waits_for_the_large_slot_while_small_ones_stand_empty() {
    let (shard, config) = classed(&[8, 8, 64], &[("big-a", 64), ("big-b", 64)]).await;
    let scheduler = start(&shard, config);
    let mut long = scheduler.submit(ranked("big-a", 64, &[1], 40)).unwrap();
    let mut tokens = vec![next_token(&mut long).await.token_id];
    let waiting = scheduler.submit(ranked("big-b", 64, &[2], 3)).unwrap();
    // The batcher publishes `queued` after a step: big-b was passed over, small slots empty.
    eventually("big-b waits", || scheduler.stats().queued == 1).await;
    assert_eq!(
        shard.active_adapters(),
        vec![None, None, Some("big-a".into())]
    );
    let rest = collect(long).await;
    tokens.extend(rest.tokens);
    assert_eq!(tokens, reference("big-a", &[1], 40));
    assert_eq!(collect(waiting).await.tokens, reference("big-b", &[2], 3));
    assert_eq!(
        shard.activations(),
        vec![("big-a".to_string(), 2), ("big-b".to_string(), 2)]
    );
    assert_all_released(&shard, &scheduler).await;
}
