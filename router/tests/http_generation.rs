//! Chat and completions through the whole router over the fake shard: outputs against the
//! fake's token rule and the test vocabulary, response and chunk shapes against OpenAI's
//! schema, streaming against non-streaming, stop strings, EOS, lengths, cancellation.

mod http_common;

use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use http_common::openapi::assert_schema;
use http_common::*;
use quiver_router::shard::FakeRpc;
use serde_json::{json, Value};
use tower::ServiceExt;

const CHAT: &str = "/v1/chat/completions";
const COMPLETIONS: &str = "/v1/completions";

/// The text of streamed chunks joined, from `delta.content` (chat) or `text` (completions).
fn joined_text(chunks: &[Value], index: u64) -> String {
    chunks
        .iter()
        .filter_map(|chunk| chunk.get("choices")?.as_array())
        .flatten()
        .filter(|choice| choice["index"] == index)
        .filter_map(|choice| {
            choice["delta"]["content"]
                .as_str()
                .or(choice["text"].as_str())
        })
        .collect()
}

fn joined_token_ids(chunks: &[Value]) -> Vec<u64> {
    chunks
        .iter()
        .filter_map(|chunk| chunk.get("choices")?.as_array())
        .flatten()
        .filter_map(|choice| choice["token_ids"].as_array())
        .flatten()
        .filter_map(Value::as_u64)
        .collect()
}

/// A streamed completions chunk has the response's shape, except that, as OpenAI's own stream
/// does, `finish_reason` is null before a choice's last chunk (the schema, written for the
/// whole response, types it as a string): null is checked here, the rest against the schema.
fn assert_completion_chunk(chunk: &Value) {
    let mut checked = chunk.clone();
    for choice in checked["choices"].as_array_mut().unwrap() {
        if choice["finish_reason"].is_null() {
            choice["finish_reason"] = json!("stop");
        }
    }
    assert_schema(&checked, "CreateCompletionResponse");
    assert_eq!(chunk["object"], "text_completion");
}

fn ids(values: &[u32]) -> Value {
    json!(values)
}

#[tokio::test]
async fn chat_answers_with_the_reference_tokens_and_text() {
    let app = TestApp::start().await;
    let body = chat_body(
        "Hi",
        json!({"max_tokens": 8, "temperature": 0, "return_token_ids": true}),
    );
    let (status, response) = app.post(CHAT, &body).await;
    assert_eq!(status, StatusCode::OK, "{response}");
    assert_schema(&response, "CreateChatCompletionResponse");

    let prompt = chat_prompt_ids("Hi");
    let (expected, finish) = expected_generation(*prompt.last().unwrap(), 8, false);
    assert_eq!(response["object"], "chat.completion");
    assert!(response["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(response["model"], SERVED_NAME);
    assert_eq!(response["prompt_token_ids"], ids(&prompt));
    let choice = &response["choices"][0];
    assert_eq!(choice["index"], 0);
    assert_eq!(choice["message"]["role"], "assistant");
    assert_eq!(choice["message"]["content"], decode(&expected));
    assert_eq!(choice["finish_reason"], finish);
    assert_eq!(choice["token_ids"], ids(&expected));
    assert_eq!(
        response["usage"],
        json!({"prompt_tokens": prompt.len(), "completion_tokens": expected.len(),
               "total_tokens": prompt.len() + expected.len(),
               "prompt_tokens_details": {"cached_tokens": 0}})
    );
    app.wait_idle().await;
}

#[tokio::test]
async fn chat_stream_sends_role_deltas_finish_usage_done() {
    let app = TestApp::start().await;
    let extra = json!({"max_tokens": 10, "return_token_ids": true});
    let (_, whole) = app.post(CHAT, &chat_body("Hey there", extra.clone())).await;

    let mut streamed = extra;
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let (status, chunks) = app.stream(CHAT, &chat_body("Hey there", streamed)).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(chunks.last().unwrap(), "[DONE]");
    let chunks = &chunks[..chunks.len() - 1];
    for chunk in chunks {
        assert_schema(chunk, "CreateChatCompletionStreamResponse");
        assert_eq!(chunk["object"], "chat.completion.chunk");
        assert_eq!(chunk["id"], chunks[0]["id"]);
        assert_eq!(chunk["created"], chunks[0]["created"]);
        assert_eq!(chunk["model"], SERVED_NAME);
    }
    assert!(chunks[0]["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(
        chunks[0]["choices"][0]["delta"],
        json!({"role": "assistant", "content": ""})
    );
    assert_eq!(chunks[0]["choices"][0]["finish_reason"], Value::Null);

    let (finish, usage) = (&chunks[chunks.len() - 2], &chunks[chunks.len() - 1]);
    assert_eq!(finish["choices"][0]["delta"], json!({}));
    assert_eq!(
        finish["choices"][0]["finish_reason"],
        whole["choices"][0]["finish_reason"]
    );
    assert_eq!(usage["choices"], json!([]));
    for count in ["prompt_tokens", "completion_tokens", "total_tokens"] {
        assert_eq!(usage["usage"][count], whole["usage"][count]);
    }
    // The same prompt again: every full block (4 tokens in the test app) but the one of its
    // last token is a prefix-cache hit.
    let prompt = chat_prompt_ids("Hey there");
    assert_eq!(whole["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(
        usage["usage"]["prompt_tokens_details"]["cached_tokens"],
        (prompt.len() - 1) / 4 * 4
    );
    for delta in &chunks[1..chunks.len() - 2] {
        assert_eq!(delta["choices"][0]["finish_reason"], Value::Null);
        assert!(delta["choices"][0]["delta"].get("role").is_none());
    }

    assert_eq!(
        joined_text(chunks, 0),
        whole["choices"][0]["message"]["content"]
    );
    assert_eq!(
        json!(joined_token_ids(chunks)),
        whole["choices"][0]["token_ids"]
    );
    assert_eq!(chunks[0]["prompt_token_ids"], whole["prompt_token_ids"]);
}

#[tokio::test]
async fn usage_chunk_only_when_asked() {
    let app = TestApp::start().await;
    let (_, chunks) = app
        .stream(
            CHAT,
            &chat_body("Hi", json!({"max_tokens": 3, "stream": true})),
        )
        .await;
    assert!(chunks.iter().all(|chunk| chunk.get("usage").is_none()));
    assert_eq!(chunks.last().unwrap(), "[DONE]");
    // The last chunk before [DONE] is the finish chunk.
    assert!(chunks[chunks.len() - 2]["choices"][0]["finish_reason"].is_string());
}

#[tokio::test]
async fn completions_tokenize_with_bos_and_stream_the_same_text() {
    let app = TestApp::start().await;
    let body = completion_body(
        json!("abc"),
        json!({"max_tokens": 12, "return_token_ids": true}),
    );
    let (status, response) = app.post(COMPLETIONS, &body).await;
    assert_eq!(status, StatusCode::OK, "{response}");
    assert_schema(&response, "CreateCompletionResponse");
    let mut prompt = vec![BOS];
    prompt.extend(text_ids("abc"));
    let (expected, finish) = expected_generation(*prompt.last().unwrap(), 12, false);
    assert_eq!(response["object"], "text_completion");
    assert!(response["id"].as_str().unwrap().starts_with("cmpl-"));
    let choice = &response["choices"][0];
    assert_eq!(choice["text"], decode(&expected));
    assert_eq!(choice["finish_reason"], finish);
    assert_eq!(choice["prompt_token_ids"], ids(&prompt));
    assert_eq!(choice["token_ids"], ids(&expected));
    assert_eq!(response["usage"]["prompt_tokens"], prompt.len());
    assert_eq!(response["usage"]["completion_tokens"], expected.len());

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let (status, chunks) = app.stream(COMPLETIONS, &streamed).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(chunks.last().unwrap(), "[DONE]");
    let chunks = &chunks[..chunks.len() - 1];
    for chunk in chunks {
        assert_completion_chunk(chunk);
    }
    assert_eq!(joined_text(chunks, 0), choice["text"]);
    assert_eq!(json!(joined_token_ids(chunks)), choice["token_ids"]);
    let finishes: Vec<&Value> = chunks
        .iter()
        .filter(|chunk| {
            chunk["choices"]
                .get(0)
                .is_some_and(|c| !c["finish_reason"].is_null())
        })
        .collect();
    assert_eq!(finishes.len(), 1);
    assert_eq!(finishes[0]["choices"][0]["finish_reason"], finish);
    assert_eq!(chunks.last().unwrap()["usage"], response["usage"]);
}

#[tokio::test]
async fn every_prompt_shape_gives_one_choice_per_prompt() {
    let app = TestApp::start().await;
    let with_bos = |text: &str| [vec![BOS], text_ids(text)].concat();
    let cases = [
        (json!(["ab", "xyz"]), vec![with_bos("ab"), with_bos("xyz")]),
        (json!(text_ids("ab")), vec![text_ids("ab")]),
        (
            json!([text_ids("ab"), text_ids("q")]),
            vec![text_ids("ab"), text_ids("q")],
        ),
    ];
    for (prompt, prompts) in cases {
        let body = completion_body(
            prompt.clone(),
            json!({"max_tokens": 5, "return_token_ids": true}),
        );
        let (status, response) = app.post(COMPLETIONS, &body).await;
        assert_eq!(status, StatusCode::OK, "{prompt}: {response}");
        assert_schema(&response, "CreateCompletionResponse");
        let choices = response["choices"].as_array().unwrap();
        assert_eq!(choices.len(), prompts.len(), "{prompt}");
        let mut prompt_tokens = 0;
        let mut completion_tokens = 0;
        for (i, (choice, ids)) in choices.iter().zip(&prompts).enumerate() {
            let (expected, finish) = expected_generation(*ids.last().unwrap(), 5, false);
            assert_eq!(choice["index"], i);
            assert_eq!(choice["prompt_token_ids"], json!(ids));
            assert_eq!(choice["text"], decode(&expected), "{prompt} choice {i}");
            assert_eq!(choice["finish_reason"], finish);
            prompt_tokens += ids.len();
            completion_tokens += expected.len();
        }
        assert_eq!(response["usage"]["prompt_tokens"], prompt_tokens);
        assert_eq!(response["usage"]["completion_tokens"], completion_tokens);
    }
}

#[tokio::test]
async fn n_choices_are_indexed_and_streamed_with_one_finish_each() {
    let app = TestApp::start().await;
    let body = chat_body("Hi", json!({"max_tokens": 4, "n": 3, "seed": 7}));
    let (status, response) = app.post(CHAT, &body).await;
    assert_eq!(status, StatusCode::OK, "{response}");
    let choices = response["choices"].as_array().unwrap();
    assert_eq!(
        choices
            .iter()
            .map(|c| c["index"].clone())
            .collect::<Vec<_>>(),
        [0, 1, 2]
    );
    // The fake ignores sampling, so every choice is the reference.
    let (expected, _) = expected_generation(*chat_prompt_ids("Hi").last().unwrap(), 4, false);
    assert!(choices
        .iter()
        .all(|c| c["message"]["content"] == decode(&expected)));
    assert_eq!(
        response["usage"]["prompt_tokens"],
        chat_prompt_ids("Hi").len()
    );
    assert_eq!(response["usage"]["completion_tokens"], 3 * expected.len());

    let mut streamed = body;
    streamed["stream"] = json!(true);
    let (_, chunks) = app.stream(CHAT, &streamed).await;
    for index in 0..3u64 {
        assert_eq!(
            joined_text(&chunks[..chunks.len() - 1], index),
            decode(&expected)
        );
        let finishes = chunks
            .iter()
            .filter_map(|chunk| chunk.get("choices")?.as_array())
            .flatten()
            .filter(|c| c["index"] == index && !c["finish_reason"].is_null())
            .count();
        assert_eq!(finishes, 1, "choice {index}");
    }
}

/// A completions prompt whose reference continuation is 20 tokens of at least `len` characters.
fn prompt_with_text(len: usize) -> (String, String) {
    ('a'..='z')
        .map(|c| format!("x{c}"))
        .find_map(|prompt| {
            continuation(*text_ids(&prompt).last().unwrap(), len).map(|text| (prompt, text))
        })
        .expect("some prompt continues long enough")
}

/// The same for chat: every rendered prompt ends with `<assistant>`, so any message continues
/// the same way; this one checks that the continuation is long enough.
fn chat_with_text(len: usize) -> (String, String) {
    let content = "Hi".to_owned();
    let text =
        continuation(*chat_prompt_ids(&content).last().unwrap(), len).expect("a long continuation");
    (content, text)
}

fn continuation(last: u32, len: usize) -> Option<String> {
    let (expected, _) = expected_generation(last, 20, false);
    let text = decode(&expected);
    (expected.len() == 20 && text.len() >= len).then_some(text)
}

#[tokio::test]
async fn stop_strings_end_the_output_and_are_never_emitted() {
    let app = TestApp::start().await;
    let (prompt, full) = prompt_with_text(12);
    // A stop string from the middle of the reference continuation, and one that never occurs.
    let stop = full[5..8].to_owned();
    let before_stop = &full[..full.find(&stop).unwrap()];
    let body = completion_body(
        json!(prompt),
        json!({"max_tokens": 20, "stop": [stop, "\u{7f}never"]}),
    );
    let (status, response) = app.post(COMPLETIONS, &body).await;
    assert_eq!(status, StatusCode::OK, "{response}");
    assert_eq!(response["choices"][0]["text"], before_stop);
    assert_eq!(response["choices"][0]["finish_reason"], "stop");
    app.wait_idle().await;

    let mut streamed = body;
    streamed["stream"] = json!(true);
    let (_, chunks) = app.stream(COMPLETIONS, &streamed).await;
    assert_eq!(joined_text(&chunks[..chunks.len() - 1], 0), before_stop);
    assert_eq!(chunks.last().unwrap(), "[DONE]");

    // Chat too, with a single string.
    let (content, text) = chat_with_text(6);
    let stop = &text[2..4];
    let body = chat_body(&content, json!({"max_tokens": 20, "stop": stop}));
    let (_, stopped) = app.post(CHAT, &body).await;
    assert_eq!(
        stopped["choices"][0]["message"]["content"],
        &text[..text.find(stop).unwrap()]
    );
    assert_eq!(stopped["choices"][0]["finish_reason"], "stop");
    app.wait_idle().await;
}

#[tokio::test]
async fn eos_stops_with_reason_stop_unless_ignored() {
    let app = TestApp::start().await;
    // A prompt whose next token is EOS under the fake's rule.
    let last = (3..VOCAB)
        .find(|&t| quiver_router::shard::fake_next_token(t, VOCAB) == EOS)
        .unwrap();
    let prompt = decode(&[last]);
    let (status, response) = app
        .post(
            COMPLETIONS,
            &completion_body(
                json!(prompt),
                json!({"max_tokens": 5, "return_token_ids": true}),
            ),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{response}");
    assert_eq!(response["choices"][0]["text"], "");
    assert_eq!(response["choices"][0]["finish_reason"], "stop");
    assert_eq!(response["choices"][0]["token_ids"], json!([EOS]));
    assert_eq!(response["usage"]["completion_tokens"], 1);

    let body = completion_body(json!(prompt), json!({"max_tokens": 5, "ignore_eos": true}));
    let (_, ignored) = app.post(COMPLETIONS, &body).await;
    let (expected, finish) = expected_generation(last, 5, true);
    assert_eq!(finish, "length");
    assert_eq!(ignored["choices"][0]["finish_reason"], "length");
    assert_eq!(ignored["choices"][0]["text"], decode(&expected));
    assert_eq!(ignored["usage"]["completion_tokens"], 5);
}

#[tokio::test]
async fn max_tokens_defaults_to_what_the_context_leaves() {
    let app = TestApp::start().await;
    let body = completion_body(json!("ab"), json!({"ignore_eos": true}));
    let (status, response) = app.post(COMPLETIONS, &body).await;
    assert_eq!(status, StatusCode::OK, "{response}");
    // 64 total tokens minus BOS + 2 prompt tokens.
    assert_eq!(response["usage"]["completion_tokens"], 64 - 3);
    assert_eq!(response["choices"][0]["finish_reason"], "length");
}

#[tokio::test]
async fn model_names_and_fields_accepted_without_effect() {
    let app = TestApp::start().await;
    for model in [json!(""), json!(MODEL_ID), json!(SERVED_NAME), Value::Null] {
        let mut body = chat_body("Hi", json!({"max_tokens": 2}));
        body["model"] = model.clone();
        let (status, response) = app.post(CHAT, &body).await;
        assert_eq!(status, StatusCode::OK, "{model}: {response}");
        let reported = model
            .as_str()
            .filter(|m| !m.is_empty())
            .unwrap_or(SERVED_NAME);
        assert_eq!(response["model"], reported);
    }
    let extras = json!({
        "max_tokens": 2, "user": "u", "logit_bias": {"5": 1},
        "presence_penalty": 0.5, "tool_choice": "none", "stream_options": null, "stop": null
    });
    let (status, response) = app.post(CHAT, &chat_body("Hi", extras)).await;
    assert_eq!(status, StatusCode::OK, "{response}");
    // Text parts are joined.
    let parts = json!({"model": SERVED_NAME, "max_tokens": 2, "messages": [{"role": "user",
        "content": [{"type": "text", "text": "H"}, {"type": "text", "text": "i"}]}]});
    let (status, response) = app.post(CHAT, &parts).await;
    assert_eq!(status, StatusCode::OK, "{response}");
    assert_eq!(
        response["usage"]["prompt_tokens"],
        chat_prompt_ids("H\ni").len()
    );
}

#[tokio::test]
async fn concurrent_requests_get_the_same_outputs_as_alone() {
    let app = TestApp::with_options(Options {
        step_delay: Duration::from_millis(2),
        ..Options::default()
    })
    .await;
    let prompts: Vec<String> = (0..12).map(|i| format!("p{i}")).collect();
    let body = |prompt: &str| completion_body(json!(prompt), json!({"max_tokens": 6}));
    let mut alone = Vec::new();
    for prompt in &prompts {
        alone.push(app.post(COMPLETIONS, &body(prompt)).await.1["choices"][0]["text"].clone());
    }
    let together = futures::future::join_all(prompts.iter().map(|prompt| {
        let body = body(prompt);
        let app = &app;
        async move { app.post(COMPLETIONS, &body).await.1["choices"][0]["text"].clone() }
    }))
    .await;
    assert_eq!(together, alone);
    assert!(
        app.shard.stats().max_decode_batch_size > 1,
        "requests were not batched together"
    );
}

#[tokio::test]
async fn a_client_leaving_mid_stream_frees_its_request() {
    let app = TestApp::with_options(Options {
        step_delay: Duration::from_millis(5),
        ..Options::default()
    })
    .await;
    let body = completion_body(
        json!("ab"),
        json!({"max_tokens": 50, "ignore_eos": true, "stream": true}),
    );
    let request = Request::post(COMPLETIONS)
        .body(Body::from(body.to_string()))
        .unwrap();
    let response = app.app.clone().oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let mut body = response.into_body();
    let first = body
        .frame()
        .await
        .expect("a first event")
        .expect("no error");
    assert!(first.data_ref().is_some());
    assert_eq!(app.shard.live_requests(), 1);
    drop(body);
    app.wait_idle().await;
    // The slot is free for the next client.
    let (status, _) = app
        .post(
            COMPLETIONS,
            &completion_body(json!("ab"), json!({"max_tokens": 2})),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test]
async fn a_shard_failure_mid_stream_ends_with_an_error_event_then_done() {
    let app = TestApp::with_options(Options {
        step_delay: Duration::from_millis(5),
        ..Options::default()
    })
    .await;
    let body = chat_body(
        "Hi",
        json!({"max_tokens": 40, "ignore_eos": true, "stream": true}),
    );
    let request = Request::post(CHAT)
        .body(Body::from(body.to_string()))
        .unwrap();
    let response = app.app.clone().oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let mut body = response.into_body();
    let mut text = String::new();
    // Wait for generated text, then break the next decode step.
    while !text.contains("\"content\":\"") || text.matches("data:").count() < 3 {
        let frame = body.frame().await.unwrap().unwrap();
        text.push_str(std::str::from_utf8(frame.data_ref().unwrap()).unwrap());
    }
    app.shard.fail_next(FakeRpc::Decode);
    let rest = body.collect().await.unwrap().to_bytes();
    text.push_str(std::str::from_utf8(&rest).unwrap());
    let events = sse_data(&text);
    assert_eq!(events.last().unwrap(), "[DONE]");
    let error = &events[events.len() - 2];
    assert_schema(error, "ErrorResponse");
    assert_eq!(error["error"]["type"], "server_error");
    assert!(events.iter().all(|e| e
        .get("choices")
        .is_none_or(|c| c[0]["finish_reason"].is_null())));
    app.wait_idle().await;
    let (status, _) = app
        .post(CHAT, &chat_body("Hi", json!({"max_tokens": 2})))
        .await;
    assert_eq!(status, StatusCode::OK);
}
