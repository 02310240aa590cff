//! Bounded waits with `FakeShard`, on tokio's paused clock (time moves only when every task
//! waits, so step counts and durations are exact): a starved queue head gets room by
//! preemption, the victims resume and finish with exactly the tokens an undisturbed run gives,
//! the queue deadline fails only requests that never started, and one request's choices share
//! one admission permit. The fake checks every block table against what it holds, so the
//! preempt/resume bookkeeping is checked on every step too.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::test_support::*;
use super::*;
use crate::shard::FakeShard;

const STEP: Duration = Duration::from_millis(10);

/// The fake's documented rule again: t' = (31 t + 7) mod vocab from the last prompt token.
fn reference_tokens(prompt: &[u32], n: usize) -> Vec<u32> {
    let mut previous = *prompt.last().unwrap();
    (0..n)
        .map(|_| {
            previous = (previous * 31 + 7) % VOCAB;
            previous
        })
        .collect()
}

/// 32 blocks of 4 tokens; each long request (1 + 63 tokens) takes 16 of them.
fn full_cache_config(preemption_wait: Duration) -> SchedulerConfig {
    SchedulerConfig {
        preemption_wait,
        ..config(4, 32)
    }
}

/// Starts two long requests that hold the whole cache and waits for their first tokens.
async fn two_long_requests(scheduler: &Scheduler) -> Vec<(Vec<u32>, EventReceiver)> {
    let mut longs = Vec::new();
    for prompt in [[1u32], [2]] {
        let mut events = scheduler.submit(request(&prompt, 63)).unwrap();
        let first = next_token(&mut events).await;
        assert_eq!(first.token_id, reference_tokens(&prompt, 1)[0]);
        longs.push((prompt.to_vec(), events));
    }
    eventually("the long requests hold every block", || {
        scheduler.stats().free_blocks == 0
    })
    .await;
    longs
}

#[tokio::test(start_paused = true)]
async fn a_starved_request_preempts_and_the_victims_resume_with_identical_tokens() {
    for mixed_prefill in [true, false] {
        starved_request_preempts(mixed_prefill).await;
    }
}

/// The victims' resumption and the short request's prefill run beside the other long
/// request's decode: in mixed steps, or as Prefill calls of their own.
async fn starved_request_preempts(mixed_prefill: bool) {
    let shard = Arc::new(FakeShard::new(VOCAB).with_step_delay(STEP));
    let wait = Duration::from_millis(50);
    let config = SchedulerConfig {
        mixed_prefill,
        ..full_cache_config(wait)
    };
    let scheduler = start(&shard, config);
    let longs = two_long_requests(&scheduler).await;

    let started = Instant::now();
    let short = collect(scheduler.submit(request(&[9], 3)).unwrap()).await;
    let waited = started.elapsed();
    assert_eq!(short.tokens, reference_tokens(&[9], 3));
    assert_eq!(short.finish, Ok(FinishReason::Length));
    // Without preemption it would wait for ~62 decode steps (620 ms). With it: the wait, the
    // step in flight, then its own prefill and two decodes.
    assert!(
        waited <= wait + 6 * STEP,
        "the short request took {waited:?}"
    );
    assert!(scheduler.stats().preemptions >= 1);

    for (prompt, events) in longs {
        let outcome = collect(events).await;
        // The first token was read above; the rest continue the same sequence.
        assert_eq!(outcome.tokens, reference_tokens(&prompt, 63)[1..]);
        assert_eq!(outcome.finish, Ok(FinishReason::Length));
    }
    assert_all_released(&shard, &scheduler).await;
    assert_eq!(shard.stats().mixed_calls > 0, mixed_prefill);
}

#[tokio::test(start_paused = true)]
async fn without_preemption_the_short_request_waits_for_the_long_ones() {
    // The control for the test above: the same load with preemption out of reach.
    let shard = Arc::new(FakeShard::new(VOCAB).with_step_delay(STEP));
    let scheduler = start(&shard, full_cache_config(Duration::from_secs(3600)));
    let longs = two_long_requests(&scheduler).await;
    let started = Instant::now();
    let short = collect(scheduler.submit(request(&[9], 3)).unwrap()).await;
    assert_eq!(short.tokens, reference_tokens(&[9], 3));
    assert!(started.elapsed() >= 60 * STEP);
    assert_eq!(scheduler.stats().preemptions, 0);
    for (_, events) in longs {
        collect(events).await;
    }
    assert_all_released(&shard, &scheduler).await;
}

#[tokio::test(start_paused = true)]
async fn a_full_batch_is_also_preempted_for_and_min_tokens_carry_over() {
    let shard = Arc::new(FakeShard::new(VOCAB).with_step_delay(STEP));
    let mut config = config(4, 256);
    config.max_batch_size = 1;
    config.preemption_wait = Duration::from_millis(30);
    let scheduler = start(&shard, config);
    // EOS is the long request's 3rd token, which min_tokens hides until after token 40: the
    // resumed run must still count the tokens of the first one.
    let prompt = [3u32];
    let expected = reference_tokens(&prompt, 48);
    let mut long = request(&prompt, 48);
    long.min_tokens = 40;
    long.eos_token_ids = vec![expected[2]];
    let eos_after_min = expected[40..]
        .iter()
        .position(|&t| t == expected[2])
        .map(|i| i + 41);
    let mut long_events = scheduler.submit(long).unwrap();
    let mut tokens = vec![next_token(&mut long_events).await.token_id];
    let short = collect(scheduler.submit(request(&[9], 2)).unwrap()).await;
    assert_eq!(short.tokens, reference_tokens(&[9], 2));
    assert!(scheduler.stats().preemptions >= 1);
    let rest = collect(long_events).await;
    tokens.extend(rest.tokens);
    match eos_after_min {
        Some(length) => {
            assert_eq!(tokens, expected[..length]);
            assert_eq!(rest.finish, Ok(FinishReason::Eos));
        }
        None => {
            assert_eq!(tokens, expected);
            assert_eq!(rest.finish, Ok(FinishReason::Length));
        }
    }
    assert_all_released(&shard, &scheduler).await;
}

#[tokio::test(start_paused = true)]
async fn queued_requests_past_the_deadline_fail_with_queue_timeout() {
    let shard = Arc::new(FakeShard::new(VOCAB).with_step_delay(STEP));
    let mut config = full_cache_config(Duration::from_secs(3600));
    config.max_queue_wait = Some(Duration::from_millis(100));
    let scheduler = start(&shard, config);
    let longs = two_long_requests(&scheduler).await;
    let started = Instant::now();
    let late = collect(scheduler.submit(request(&[9], 3)).unwrap()).await;
    assert!(late.tokens.is_empty());
    assert!(
        matches!(
            late.finish,
            Err(GenerationError::QueueTimeout { limit_secs: 0, .. })
        ),
        "{late:?}"
    );
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(100) && waited <= Duration::from_millis(100) + 2 * STEP
    );
    // The running requests are not affected.
    for (prompt, events) in longs {
        assert_eq!(
            collect(events).await.tokens,
            reference_tokens(&prompt, 63)[1..]
        );
    }
    assert_all_released(&shard, &scheduler).await;
}

#[tokio::test]
async fn a_requests_choices_share_one_admission_permit() {
    let shard = Arc::new(FakeShard::new(VOCAB).with_step_delay(Duration::from_millis(1)));
    let mut config = config(16, 64);
    config.max_concurrent_requests = 1;
    let scheduler = start(&shard, config);
    // The last choice runs longest.
    let choices = (0..3).map(|i| request(&[i + 1], 20 + 100 * i)).collect();
    let mut receivers = scheduler.submit_all(choices).unwrap();
    assert_eq!(scheduler.in_flight(), 1);
    assert_eq!(
        scheduler.submit(request(&[7], 5)).unwrap_err(),
        AdmissionError::Overloaded
    );
    // The permit stays until the last choice ends.
    let last = receivers.pop().unwrap();
    for (i, events) in receivers.into_iter().enumerate() {
        let length = 20 + 100 * i;
        assert_eq!(
            collect(events).await.tokens,
            reference_tokens(&[i as u32 + 1], length)
        );
    }
    assert_eq!(scheduler.in_flight(), 1);
    assert_eq!(collect(last).await.tokens, reference_tokens(&[3], 220));
    assert_all_released(&shard, &scheduler).await;
}

/// A constrained request that is preempted resumes under the grammar pinned for it: its second
/// Prefill names the same pin (the fake refuses a pin that was released), nothing is compiled
/// again, and the pins are released once the requests are done.
#[tokio::test(start_paused = true)]
async fn a_preempted_request_resumes_under_its_pinned_grammar() {
    let shard = Arc::new(FakeShard::new(VOCAB).with_step_delay(STEP));
    let scheduler = start(&shard, full_cache_config(Duration::from_millis(50)));
    let mut longs = Vec::new();
    for (prompt, pattern) in [([1u32], "[a-z]+"), ([2], "[0-9]+")] {
        let grammar = Grammar {
            kind: GrammarKind::Regex,
            text: pattern.to_owned(),
            eos_token_ids: vec![VOCAB - 1],
        };
        let mut constrained = request(&prompt, 63);
        constrained.grammar = Some(pinned(&scheduler, &shard, grammar).await);
        let mut events = scheduler.submit(constrained).unwrap();
        next_token(&mut events).await;
        longs.push((prompt, events));
    }
    let short = collect(scheduler.submit(request(&[9], 3)).unwrap()).await;
    assert_eq!(short.finish, Ok(FinishReason::Length));
    assert!(scheduler.stats().preemptions >= 1);
    for (prompt, events) in longs {
        let outcome = collect(events).await;
        assert_eq!(outcome.tokens, reference_tokens(&prompt, 63)[1..]);
        assert_eq!(outcome.finish, Ok(FinishReason::Length));
    }
    assert_eq!(shard.compiled_grammars().len(), 2);
    let prefilled: Vec<String> = shard
        .prefilled_grammars()
        .into_iter()
        .flatten()
        .map(|grammar| grammar.text)
        .collect();
    // Each long request's first Prefill, then at least one resumed one, under its own grammar.
    assert!(prefilled.len() > 2, "{prefilled:?}");
    assert!(prefilled.iter().any(|text| text == "[a-z]+"));
    assert!(prefilled.iter().any(|text| text == "[0-9]+"));
    assert_all_released(&shard, &scheduler).await;
}
