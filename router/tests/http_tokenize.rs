//! `/tokenize` and `/detokenize`: vLLM's shapes, the base model's tokenizer and template, and
//! the errors, against this fixture's own character table (`http_common`).

mod http_common;

use axum::http::StatusCode;
use http_common::*;
use serde_json::json;

#[tokio::test]
async fn tokenize_a_prompt_with_and_without_special_tokens() {
    let app = TestApp::start().await;
    let (status, body) = app.post("/tokenize", &json!({"prompt": "Hi there"})).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let mut expected = vec![BOS];
    expected.extend(text_ids("Hi there"));
    assert_eq!(
        body,
        json!({"count": expected.len(), "max_model_len": 64, "tokens": expected})
    );
    let (_, body) = app
        .post(
            "/tokenize",
            &json!({"model": SERVED_NAME, "prompt": "Hi", "add_special_tokens": false,
                    "return_token_strs": true}),
        )
        .await;
    assert_eq!(body["tokens"], json!(text_ids("Hi")));
    assert_eq!(body["token_strs"], json!(["H", "i"]));
}

#[tokio::test]
async fn tokenize_messages_renders_the_chat_template() {
    let app = TestApp::start().await;
    let messages = json!([{"role": "user", "content": "yo"}]);
    let (status, body) = app.post("/tokenize", &json!({"messages": messages})).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["tokens"], json!(chat_prompt_ids("yo")));
    assert_eq!(body["count"], chat_prompt_ids("yo").len());
    let (_, body) = app
        .post(
            "/tokenize",
            &json!({"messages": messages, "add_generation_prompt": false}),
        )
        .await;
    let mut expected = vec![BOS];
    expected.extend(text_ids("<user>yo\n"));
    assert_eq!(body["tokens"], json!(expected));
}

#[tokio::test]
async fn detokenize_round_trips_and_keeps_special_tokens() {
    let app = TestApp::start().await;
    let mut ids = vec![BOS];
    ids.extend(text_ids("a b~"));
    ids.push(EOS);
    let (status, body) = app.post("/detokenize", &json!({"tokens": ids})).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body, json!({"prompt": "<|bos|>a b~<|eos|>"}));
    let (_, body) = app.post("/v1/detokenize", &json!({"tokens": []})).await;
    assert_eq!(body, json!({"prompt": ""}));
}

fn assert_error(status: StatusCode, body: &serde_json::Value, want: StatusCode, param: &str) {
    assert_eq!(status, want, "{body}");
    openapi::assert_schema(body, "ErrorResponse");
    assert_eq!(body["error"]["param"], param, "{body}");
}

#[tokio::test]
async fn bad_input_is_refused_naming_the_field() {
    let app = TestApp::start().await;
    for bad in [
        json!([VOCAB]),
        json!([5, -1]),
        json!([u64::from(u32::MAX) + 1]),
    ] {
        let (status, body) = app.post("/detokenize", &json!({"tokens": bad})).await;
        assert_error(status, &body, StatusCode::BAD_REQUEST, "tokens");
        assert_eq!(body["error"]["code"], "invalid_value");
    }
    let (status, body) = app.post("/detokenize", &json!({})).await;
    assert_error(status, &body, StatusCode::BAD_REQUEST, "tokens");
    let (status, body) = app.post("/detokenize", &json!({"tokens": "12"})).await;
    assert_error(status, &body, StatusCode::BAD_REQUEST, "tokens");
    let (status, body) = app.post("/tokenize", &json!({})).await;
    assert_error(status, &body, StatusCode::BAD_REQUEST, "prompt");
    let (status, body) = app.post("/tokenize", &json!({"prompt": 5})).await;
    assert_error(status, &body, StatusCode::BAD_REQUEST, "prompt");
    let both = json!({"prompt": "a", "messages": [{"role": "user", "content": "b"}]});
    let (status, body) = app.post("/tokenize", &both).await;
    assert_error(status, &body, StatusCode::BAD_REQUEST, "messages");
    let wizard = json!({"messages": [{"role": "wizard", "content": "b"}]});
    let (status, body) = app.post("/tokenize", &wizard).await;
    assert_error(status, &body, StatusCode::BAD_REQUEST, "messages[0].role");
    let (status, body) = app
        .post("/tokenize", &json!({"model": "gpt-4", "prompt": "a"}))
        .await;
    assert_error(status, &body, StatusCode::NOT_FOUND, "model");
    assert_eq!(body["error"]["code"], "model_not_found");
}

#[tokio::test]
async fn a_model_without_a_template_refuses_messages() {
    let app = TestApp::with_options(Options {
        with_template: false,
        ..Options::default()
    })
    .await;
    let messages = json!({"messages": [{"role": "user", "content": "b"}]});
    let (status, body) = app.post("/tokenize", &messages).await;
    assert_error(status, &body, StatusCode::BAD_REQUEST, "messages");
    assert_eq!(body["error"]["code"], "no_chat_template");
}

#[tokio::test]
async fn the_api_key_guards_both_endpoints() {
    let app = TestApp::with_options(Options {
        api_key: Some("sekret".into()),
        ..Options::default()
    })
    .await;
    for (path, body) in [
        ("/tokenize", json!({"prompt": "a"})),
        ("/detokenize", json!({"tokens": [5]})),
        ("/v1/tokenize", json!({"prompt": "a"})),
    ] {
        let (status, response) = app.post(path, &body).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{path}");
        assert_eq!(response["error"]["code"], "invalid_api_key");
    }
}

#[tokio::test]
async fn a_text_over_the_context_is_counted_but_one_that_cannot_fit_is_refused_unread() {
    let app = TestApp::start().await;
    // 100 tokens: over the fixture's 64-token context, still counted.
    let long = "a".repeat(100);
    let (status, body) = app
        .post(
            "/tokenize",
            &json!({"prompt": long, "add_special_tokens": false}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["count"], 100);
    // Far more bytes than 64 tokens of the longest vocabulary entry could cover.
    let huge = "a".repeat(64 * 1024);
    for (field, value) in [
        ("prompt", json!(huge)),
        ("messages", json!([{"role": "user", "content": huge}])),
    ] {
        let (status, body) = app.post("/tokenize", &json!({ field: value })).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
        assert_eq!(body["error"]["code"], "context_length_exceeded", "{body}");
        assert_eq!(body["error"]["param"], field, "{body}");
    }
}
