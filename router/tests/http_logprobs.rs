//! Logprobs through the whole router over the fake shard: chat's `logprobs.content`,
//! completions' legacy `logprobs`, `echo`, `max_tokens: 0`, vLLM's `prompt_logprobs` and
//! `best_of`, against the fake's documented rule (token `t` has logprob `-t / VOCAB`, the most
//! likely tokens are `0, 1, 2, ...`, the rank of `t` is `t + 1`) and the test vocabulary.

mod http_common;

use axum::http::StatusCode;
use http_common::openapi::assert_schema;
use http_common::*;
use quiver_router::shard::{fake_next_token, fake_seeded_first_token};
use serde_json::{json, Value};

const CHAT: &str = "/v1/chat/completions";
const COMPLETIONS: &str = "/v1/completions";

/// The fake's logprob of token `id`.
fn logprob(id: u32) -> f64 {
    f64::from(-(id as f32) / VOCAB as f32)
}

/// A token's text decoded alone: the special tokens keep their names.
fn piece(id: u32) -> String {
    match id {
        BOS => "<|bos|>".to_owned(),
        EOS => "<|eos|>".to_owned(),
        id => token_text(id),
    }
}

fn assert_close(got: &Value, want: f64, what: &str) {
    let got = got
        .as_f64()
        .unwrap_or_else(|| panic!("{what}: {got} is not a number"));
    assert!((got - want).abs() < 1e-6, "{what}: {got} != {want}");
}

/// Checks chat `logprobs.content` entries against the token ids they stand for.
fn assert_chat_entries(content: &[Value], ids: &[u32], top: u32) {
    assert_eq!(content.len(), ids.len(), "{content:?}");
    for (entry, &id) in content.iter().zip(ids) {
        assert_eq!(entry["token"], piece(id));
        assert_close(&entry["logprob"], logprob(id), "logprob");
        assert_eq!(entry["bytes"], json!(piece(id).into_bytes()));
        let alternatives = entry["top_logprobs"].as_array().unwrap();
        assert_eq!(alternatives.len(), top as usize);
        for (alt, alt_id) in alternatives.iter().zip(0..) {
            assert_eq!(alt["token"], piece(alt_id));
            assert_close(&alt["logprob"], logprob(alt_id), "top logprob");
            assert_eq!(alt["bytes"], json!(piece(alt_id).into_bytes()));
        }
    }
}

/// Every streamed choice's `logprobs` joined: chat's `content` lists, or completions' lists.
fn joined_logprobs(chunks: &[Value], field: &str) -> Vec<Value> {
    chunks
        .iter()
        .filter_map(|chunk| chunk.get("choices")?.as_array())
        .flatten()
        .filter_map(|choice| choice["logprobs"][field].as_array())
        .flatten()
        .cloned()
        .collect()
}

fn joined_text(chunks: &[Value]) -> String {
    chunks
        .iter()
        .filter_map(|chunk| chunk.get("choices")?.as_array())
        .flatten()
        .filter_map(|choice| {
            choice["delta"]["content"]
                .as_str()
                .or(choice["text"].as_str())
        })
        .collect()
}

#[tokio::test]
async fn chat_logprobs_report_each_token_with_its_alternatives() {
    let app = TestApp::start().await;
    let body = chat_body(
        "Hi",
        json!({"max_tokens": 6, "logprobs": true, "top_logprobs": 3}),
    );
    let (status, response) = app.post(CHAT, &body).await;
    assert_eq!(status, StatusCode::OK, "{response}");
    assert_schema(&response, "CreateChatCompletionResponse");
    let last = *chat_prompt_ids("Hi").last().unwrap();
    let (ids, _) = expected_generation(last, 6, false);
    let logprobs = &response["choices"][0]["logprobs"];
    assert_eq!(logprobs["refusal"], Value::Null);
    assert_chat_entries(logprobs["content"].as_array().unwrap(), &ids, 3);

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (status, chunks) = app.stream(CHAT, &streamed).await;
    assert_eq!(status, StatusCode::OK);
    for chunk in chunks.iter().filter(|chunk| chunk.is_object()) {
        assert_schema(chunk, "CreateChatCompletionStreamResponse");
    }
    assert_eq!(
        joined_logprobs(&chunks, "content"),
        *logprobs["content"].as_array().unwrap()
    );
}

#[tokio::test]
async fn chat_logprobs_without_alternatives_and_off_by_default() {
    let app = TestApp::start().await;
    let (_, response) = app
        .post(
            CHAT,
            &chat_body("Hi", json!({"max_tokens": 3, "logprobs": true})),
        )
        .await;
    let content = response["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap();
    assert_eq!(content.len(), 3);
    assert!(content.iter().all(|e| e["top_logprobs"] == json!([])));
    let (_, plain) = app
        .post(CHAT, &chat_body("Hi", json!({"max_tokens": 3})))
        .await;
    assert_eq!(plain["choices"][0]["logprobs"], Value::Null);
    assert!(plain["choices"][0].get("prompt_logprobs").is_none());
}

/// Tokens held back by a possible stop string are reported with their text; generation ends at
/// the token that completes the stop string, which is reported and nothing after it.
#[tokio::test]
async fn logprobs_stay_aligned_with_stop_strings() {
    let app = TestApp::start().await;
    let last = *chat_prompt_ids("Hi").last().unwrap();
    let (ids, _) = expected_generation(last, 20, true);
    let text = decode(&ids);
    let stop: String = text.chars().skip(3).take(2).collect();
    let at = text.find(&stop).unwrap();
    // One character per token in the test vocabulary (no special token before `at`).
    let reported = &ids[..at + 2];
    let body = chat_body(
        "Hi",
        json!({"max_tokens": 20, "ignore_eos": true, "stop": [stop], "logprobs": true}),
    );
    let (_, response) = app.post(CHAT, &body).await;
    assert_eq!(response["choices"][0]["message"]["content"], text[..at]);
    let content = response["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap();
    assert_chat_entries(content, reported, 0);

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (_, chunks) = app.stream(CHAT, &streamed).await;
    assert_eq!(joined_logprobs(&chunks, "content"), *content);
    // Each text chunk reports exactly the tokens whose text it carries.
    for chunk in chunks.iter().filter(|chunk| chunk.is_object()) {
        let choice = &chunk["choices"][0];
        let (Some(delta), Some(entries)) = (
            choice["delta"]["content"].as_str(),
            choice["logprobs"]["content"].as_array(),
        ) else {
            continue;
        };
        let tokens: String = entries
            .iter()
            .map(|e| e["token"].as_str().unwrap())
            .collect();
        assert_eq!(tokens, delta, "{chunk}");
    }
}

#[tokio::test]
async fn completion_logprobs_have_the_legacy_shape_and_stream_the_same() {
    let app = TestApp::start().await;
    let body = completion_body(json!("abc"), json!({"max_tokens": 8, "logprobs": 2}));
    let (status, response) = app.post(COMPLETIONS, &body).await;
    assert_eq!(status, StatusCode::OK, "{response}");
    assert_schema(&response, "CreateCompletionResponse");
    let (ids, _) = expected_generation(text_ids("c")[0], 8, false);
    let logprobs = &response["choices"][0]["logprobs"];
    let tokens: Vec<String> = ids.iter().map(|&id| piece(id)).collect();
    assert_eq!(logprobs["tokens"], json!(tokens));
    let mut offset = 0;
    for (i, &id) in ids.iter().enumerate() {
        assert_close(&logprobs["token_logprobs"][i], logprob(id), "token logprob");
        // The two alternatives plus the chosen token itself (OpenAI's "logprobs+1").
        let top = logprobs["top_logprobs"][i].as_object().unwrap();
        assert_eq!(top.len(), 3);
        assert_close(&top[&piece(id)], logprob(id), "chosen in top");
        assert_close(&top["<|bos|>"], logprob(BOS), "top");
        assert_close(&top["<|eos|>"], logprob(EOS), "top");
        assert_eq!(logprobs["text_offset"][i], offset);
        offset += token_text(id).chars().count();
    }

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (_, chunks) = app.stream(COMPLETIONS, &streamed).await;
    for field in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
        assert_eq!(
            json!(joined_logprobs(&chunks, field)),
            logprobs[field],
            "{field}"
        );
    }
}

#[tokio::test]
async fn echo_returns_the_prompt_and_its_logprobs() {
    let app = TestApp::start().await;
    let body = completion_body(
        json!("abc"),
        json!({"max_tokens": 3, "echo": true, "logprobs": 1}),
    );
    let (status, response) = app.post(COMPLETIONS, &body).await;
    assert_eq!(status, StatusCode::OK, "{response}");
    let (ids, _) = expected_generation(text_ids("c")[0], 3, false);
    let choice = &response["choices"][0];
    assert_eq!(choice["text"], format!("abc{}", decode(&ids)));
    let prompt = [vec![BOS], text_ids("abc")].concat();
    let all: Vec<u32> = prompt.iter().chain(&ids).copied().collect();
    let logprobs = &choice["logprobs"];
    let tokens: Vec<String> = all.iter().map(|&id| piece(id)).collect();
    assert_eq!(logprobs["tokens"], json!(tokens));
    // Nothing precedes the first prompt token.
    assert_eq!(logprobs["token_logprobs"][0], Value::Null);
    assert_eq!(logprobs["top_logprobs"][0], Value::Null);
    for (i, &id) in all.iter().enumerate().skip(1) {
        assert_close(&logprobs["token_logprobs"][i], logprob(id), "token logprob");
        assert_close(&logprobs["top_logprobs"][i]["<|bos|>"], 0.0, "top");
    }
    // BOS is not in the text: the prompt's characters start at 0.
    assert_eq!(logprobs["text_offset"], json!([0, 0, 1, 2, 3, 4, 5]));
    assert_eq!(response["usage"]["prompt_tokens"], 4);
    assert_eq!(response["usage"]["completion_tokens"], 3);

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (_, chunks) = app.stream(COMPLETIONS, &streamed).await;
    assert_eq!(joined_text(&chunks), choice["text"]);
    for field in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
        assert_eq!(json!(joined_logprobs(&chunks, field)), logprobs[field]);
    }
}

#[tokio::test]
async fn echo_decodes_token_id_prompts_and_lists_of_prompts() {
    let app = TestApp::start().await;
    let first = text_ids("xy");
    let second = text_ids("pq");
    let body = completion_body(
        json!([first, second]),
        json!({"max_tokens": 2, "echo": true}),
    );
    let (status, response) = app.post(COMPLETIONS, &body).await;
    assert_eq!(status, StatusCode::OK, "{response}");
    for (i, prompt) in ["xy", "pq"].iter().enumerate() {
        let last = text_ids(prompt)[1];
        let (ids, _) = expected_generation(last, 2, false);
        assert_eq!(
            response["choices"][i]["text"],
            format!("{prompt}{}", decode(&ids))
        );
        assert_eq!(response["choices"][i]["logprobs"], Value::Null);
    }
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (_, chunks) = app.stream(COMPLETIONS, &streamed).await;
    let texts: Vec<String> = (0..2)
        .map(|index| {
            chunks
                .iter()
                .filter_map(|chunk| chunk.get("choices")?.as_array())
                .flatten()
                .filter(|choice| choice["index"] == index)
                .filter_map(|choice| choice["text"].as_str())
                .collect()
        })
        .collect();
    assert_eq!(texts[0], response["choices"][0]["text"]);
    assert_eq!(texts[1], response["choices"][1]["text"]);
}

#[tokio::test]
async fn max_tokens_zero_with_echo_scores_the_prompt_only() {
    let app = TestApp::start().await;
    let body = completion_body(
        json!("hello"),
        json!({"max_tokens": 0, "echo": true, "logprobs": 0}),
    );
    let (status, response) = app.post(COMPLETIONS, &body).await;
    assert_eq!(status, StatusCode::OK, "{response}");
    let choice = &response["choices"][0];
    assert_eq!(choice["text"], "hello");
    assert_eq!(choice["finish_reason"], "length");
    assert_eq!(response["usage"]["completion_tokens"], 0);
    assert_eq!(response["usage"]["prompt_tokens"], 6);
    let tokens = choice["logprobs"]["tokens"].as_array().unwrap();
    assert_eq!(tokens.len(), 6);
    // With `logprobs: 0`, only the prompt token itself.
    let top = choice["logprobs"]["top_logprobs"][1].as_object().unwrap();
    assert_eq!(top.len(), 1);
    assert_eq!(
        top.values().next(),
        Some(&choice["logprobs"]["token_logprobs"][1])
    );

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let (_, chunks) = app.stream(COMPLETIONS, &streamed).await;
    assert_eq!(joined_text(&chunks), "hello");
    assert_eq!(json!(joined_logprobs(&chunks, "tokens")), json!(tokens));
    let usage = chunks
        .iter()
        .rev()
        .find(|c| c.get("usage").is_some())
        .unwrap();
    assert_eq!(usage["usage"]["completion_tokens"], 0);
    app.wait_idle().await;

    let (status, error) = app
        .post(
            COMPLETIONS,
            &completion_body(json!("hello"), json!({"max_tokens": 0})),
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(error["error"]["param"], "max_tokens");
}

/// vLLM's shape: `null`, then per prompt token a map from token id to
/// `{logprob, rank, decoded_token}` holding the prompt token and the alternatives.
fn assert_prompt_logprobs(got: &Value, prompt: &[u32], k: u32) {
    let positions = got.as_array().unwrap();
    assert_eq!(positions.len(), prompt.len());
    assert_eq!(positions[0], Value::Null);
    for (position, &id) in positions.iter().zip(prompt).skip(1) {
        let map = position.as_object().unwrap();
        let mut expected: Vec<u32> = (0..k).collect();
        if !expected.contains(&id) {
            expected.push(id);
        }
        let mut keys: Vec<u32> = map.keys().map(|key| key.parse().unwrap()).collect();
        keys.sort_unstable();
        expected.sort_unstable();
        assert_eq!(keys, expected);
        for (key, entry) in map {
            let token: u32 = key.parse().unwrap();
            assert_close(&entry["logprob"], logprob(token), "prompt logprob");
            assert_eq!(entry["rank"], token + 1);
            assert_eq!(entry["decoded_token"], piece(token));
        }
    }
}

#[tokio::test]
async fn prompt_logprobs_follow_vllms_shape_on_both_endpoints() {
    let app = TestApp::start().await;
    let (status, response) = app
        .post(
            COMPLETIONS,
            &completion_body(json!("ab"), json!({"max_tokens": 2, "prompt_logprobs": 2})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{response}");
    let prompt = [vec![BOS], text_ids("ab")].concat();
    assert_prompt_logprobs(&response["choices"][0]["prompt_logprobs"], &prompt, 2);
    assert_eq!(response["choices"][0]["logprobs"], Value::Null);

    let body = chat_body("Hi", json!({"max_tokens": 2, "prompt_logprobs": 1}));
    let (_, response) = app.post(CHAT, &body).await;
    let prompt = chat_prompt_ids("Hi");
    let got = &response["choices"][0]["prompt_logprobs"];
    assert_prompt_logprobs(got, &prompt, 1);
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (_, chunks) = app.stream(CHAT, &streamed).await;
    let sent: Vec<&Value> = chunks
        .iter()
        .filter_map(|chunk| chunk.get("choices")?.get(0)?.get("prompt_logprobs"))
        .collect();
    assert_eq!(sent, vec![got]);
}

/// Under seeded sampling each seed picks the first token; the rest follows the token rule.
fn seeded_generation(seed: u64, last: u32, max_tokens: u32) -> Vec<u32> {
    let mut ids = vec![fake_seeded_first_token(
        fake_next_token(last, VOCAB),
        seed,
        VOCAB,
    )];
    while ids.len() < max_tokens as usize && *ids.last().unwrap() != EOS {
        ids.push(fake_next_token(*ids.last().unwrap(), VOCAB));
    }
    ids
}

#[tokio::test]
async fn best_of_returns_the_choices_with_the_highest_cumulative_logprob() {
    let app = TestApp::with_options(Options {
        seeded_sampling: true,
        ..Options::default()
    })
    .await;
    let (best_of, n, seed, max_tokens) = (5u64, 2usize, 40u64, 4u32);
    let prompts = ["ab", "xyz"];
    let body = completion_body(
        json!(prompts),
        json!({"max_tokens": max_tokens, "best_of": best_of, "n": n, "seed": seed,
               "temperature": 1.0, "logprobs": 0}),
    );
    let (status, response) = app.post(COMPLETIONS, &body).await;
    assert_eq!(status, StatusCode::OK, "{response}");
    let mut billed = 0;
    let mut reordered = false;
    for (p, prompt) in prompts.iter().enumerate() {
        let last = *text_ids(prompt).last().unwrap();
        // Choice `c` of a prompt is seeded `seed + c`.
        let mut candidates: Vec<(f64, u64, Vec<u32>)> = (0..best_of)
            .map(|c| {
                let ids = seeded_generation(seed + c, last, max_tokens);
                (ids.iter().map(|&id| logprob(id)).sum(), c, ids)
            })
            .collect();
        billed += candidates
            .iter()
            .map(|(_, _, ids)| ids.len())
            .sum::<usize>();
        candidates.sort_by(|a, b| b.0.total_cmp(&a.0));
        // The test means something only if the best are not simply the first choices.
        let picked: Vec<u64> = candidates.iter().take(n).map(|(_, c, _)| *c).collect();
        reordered |= picked != (0..n as u64).collect::<Vec<_>>();
        for (rank, (_, _, ids)) in candidates.iter().take(n).enumerate() {
            let index = p * n + rank;
            let choice = &response["choices"][index];
            assert_eq!(choice["index"], index);
            assert_eq!(choice["text"], decode(ids), "prompt {prompt}, rank {rank}");
        }
    }
    assert_eq!(
        response["choices"].as_array().unwrap().len(),
        prompts.len() * n
    );
    assert_eq!(response["usage"]["completion_tokens"], billed);
    assert!(
        reordered,
        "pick a seed whose best choices are not the first ones"
    );
}

#[tokio::test]
async fn refusals_name_their_param() {
    let app = TestApp::start().await;
    for (path, body, param) in [
        (
            CHAT,
            chat_body("x", json!({"top_logprobs": 2})),
            "top_logprobs",
        ),
        (
            CHAT,
            chat_body("x", json!({"logprobs": true, "top_logprobs": 21})),
            "top_logprobs",
        ),
        (
            COMPLETIONS,
            completion_body(json!("x"), json!({"logprobs": 6})),
            "logprobs",
        ),
        (
            COMPLETIONS,
            completion_body(json!("x"), json!({"best_of": 1, "n": 2})),
            "best_of",
        ),
        (
            COMPLETIONS,
            completion_body(json!("x"), json!({"best_of": 2, "stream": true})),
            "best_of",
        ),
        (
            COMPLETIONS,
            completion_body(json!("x"), json!({"prompt_logprobs": 21})),
            "prompt_logprobs",
        ),
        (
            COMPLETIONS,
            completion_body(json!("x"), json!({"best_of": 100000})),
            "best_of",
        ),
    ] {
        let (status, error) = app.post(path, &body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {error}");
        assert_eq!(error["error"]["param"], param, "{body}: {error}");
    }
    // `best_of` counts against the request's KV share like `n`: 128 × 16 blocks is over it.
    let (status, error) = app
        .post(
            COMPLETIONS,
            &completion_body(json!("x"), json!({"best_of": 128, "max_tokens": 60})),
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{error}");
    assert_eq!(error["error"]["code"], "kv_share_exceeded", "{error}");
}

/// `--max-logprob-entries` bounds what one response's logprobs hold, for chat `top_logprobs`
/// and completions `echo` alike: a request at the limit is served, one entry over it is 400
/// naming the product, before anything is scheduled.
#[tokio::test]
async fn logprob_entries_over_the_limit_are_refused_up_front() {
    // Chat: n 2 × max_tokens 10 × (top_logprobs 3 + 1) = 80 entries.
    // Completions: n 2 × ("abcd" = 4 prompt + 6 max_tokens) × (logprobs 3 + 1) = 80 entries.
    let requests = [
        (
            CHAT,
            chat_body(
                "Hi",
                json!({"n": 2, "max_tokens": 10, "logprobs": true, "top_logprobs": 3}),
            ),
            "(20 max_tokens over 2 choices) × (3 alternatives + 1)",
        ),
        (
            COMPLETIONS,
            completion_body(
                json!(text_ids("abcd")),
                json!({"n": 2, "max_tokens": 6, "echo": true, "logprobs": 3}),
            ),
            "(8 prompt tokens + 12 max_tokens, over 2 choices) × (3 alternatives + 1)",
        ),
    ];
    let at_limit = TestApp::with_options(Options {
        max_logprob_entries: Some(80),
        ..Options::default()
    })
    .await;
    let under = TestApp::with_options(Options {
        max_logprob_entries: Some(79),
        ..Options::default()
    })
    .await;
    for (path, body, product) in requests {
        let (status, answer) = at_limit.post(path, &body).await;
        assert_eq!(status, StatusCode::OK, "{path}: {answer}");
        let (status, error) = under.post(path, &body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{path}: {error}");
        assert_schema(&error, "ErrorResponse");
        assert_eq!(error["error"]["code"], "logprob_entries_exceeded");
        assert_eq!(error["error"]["param"], "logprobs");
        let message = error["error"]["message"].as_str().unwrap();
        assert!(
            message.contains(&format!("80 logprob entries ({product})")),
            "{message}"
        );
        assert!(message.contains("at most 79"), "{message}");
    }
    assert_eq!(under.shard.live_requests(), 0);
    under.wait_idle().await;
}
