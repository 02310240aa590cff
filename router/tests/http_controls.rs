//! The request-field policy over HTTP (every field implemented, accepted without effect, or
//! refused naming it; unknown fields accepted and named in a header) and the sampling controls' limits: stop strings,
//! `logit_bias`, penalties, `stop_token_ids`.

mod http_common;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_common::openapi::assert_schema;
use http_common::*;
use quiver_router::shard::fake_next_token;
use serde_json::{json, Value};
use tower::ServiceExt;

const CHAT: &str = "/v1/chat/completions";
const COMPLETIONS: &str = "/v1/completions";

/// A 400 in OpenAI's shape naming `param`, with `code`.
fn assert_refused(status: StatusCode, body: &Value, param: &str, code: &str) {
    assert_eq!(status, StatusCode::BAD_REQUEST, "{param}: {body}");
    assert_schema(body, "ErrorResponse");
    assert_eq!(body["error"]["param"], param, "{body}");
    assert_eq!(body["error"]["code"], code, "{body}");
    assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains(param), "{message}");
}

#[tokio::test]
async fn refused_fields_name_their_param() {
    let app = TestApp::start().await;
    let chat_cases = [
        // Tool fields are implemented: only a choice without the tools it needs is refused.
        (
            json!({"function_call": "auto"}),
            "function_call",
            "invalid_value",
        ),
        (
            json!({"audio": {"voice": "alloy", "format": "wav"}}),
            "audio",
            "unsupported_parameter",
        ),
        (
            json!({"prediction": {"type": "content", "content": "x"}}),
            "prediction",
            "unsupported_parameter",
        ),
        (
            json!({"web_search_options": {}}),
            "web_search_options",
            "unsupported_parameter",
        ),
        (
            json!({"grammar": {"type": "json", "value": {}}}),
            "grammar",
            "unsupported_parameter",
        ),
        (
            json!({"tool_choice": "required"}),
            "tool_choice",
            "invalid_value",
        ),
        (
            json!({"tool_choice": {"type": "function", "function": {"name": "f"}}}),
            "tool_choice",
            "invalid_value",
        ),
        (
            json!({"modalities": ["text", "audio"]}),
            "modalities",
            "unsupported_value",
        ),
    ];
    for (extra, param, code) in chat_cases {
        let (status, body) = app.post(CHAT, &chat_body("Hi", extra)).await;
        assert_refused(status, &body, param, code);
    }
    let (status, body) = app
        .post(
            COMPLETIONS,
            &completion_body(json!("a"), json!({"suffix": "z"})),
        )
        .await;
    assert_refused(status, &body, "suffix", "unsupported_value");
}

#[tokio::test]
async fn unknown_fields_are_accepted_and_named_in_a_header() {
    let app = TestApp::start().await;
    let ignored = |body: &Value, path: &str| {
        let request = Request::post(path)
            .header("content-type", "application/json")
            .body(Body::from(body.to_string()))
            .expect("request");
        let app = app.app.clone();
        async move {
            let response = app.oneshot(request).await.expect("the router answers");
            assert_eq!(response.status(), StatusCode::OK);
            response
                .headers()
                .get("quiver-ignored-fields")
                .map(|value| value.to_str().unwrap().to_owned())
        }
    };
    for (path, body) in [
        (
            CHAT,
            chat_body("Hi", json!({"max_tokens": 1, "max_token": 2})),
        ),
        (
            COMPLETIONS,
            completion_body(json!("a"), json!({"max_tokens": 1, "max_token": 2})),
        ),
    ] {
        assert_eq!(ignored(&body, path).await.as_deref(), Some("max_token"));
    }
    // A chat-only field is unknown to completions; streamed answers carry the header too.
    let body = completion_body(
        json!("a"),
        json!({"messages": [], "max_tokens": 1, "stream": true, "extra": 1}),
    );
    assert_eq!(
        ignored(&body, COMPLETIONS).await.as_deref(),
        Some("messages, extra")
    );
    // Known fields and null unknown ones: no header.
    let body = chat_body("Hi", json!({"max_tokens": 1, "vendor_field": null}));
    assert_eq!(ignored(&body, CHAT).await, None);
}

#[tokio::test]
async fn fields_without_effect_are_accepted() {
    let app = TestApp::start().await;
    let chat = json!({
        "max_tokens": 2, "user": "u", "metadata": {"k": "v"}, "store": false,
        "service_tier": "auto", "safety_identifier": "s", "prompt_cache_key": "k",
        "prompt_cache_retention": "in_memory", "parallel_tool_calls": false,
        "tool_choice": "auto", "response_format": {"type": "text"}, "modalities": ["text"]
    });
    let (status, response) = app.post(CHAT, &chat_body("Hi", chat)).await;
    assert_eq!(status, StatusCode::OK, "{response}");
    let completions = json!({"max_tokens": 2, "user": "u", "suffix": ""});
    let (status, response) = app
        .post(COMPLETIONS, &completion_body(json!("a"), completions))
        .await;
    assert_eq!(status, StatusCode::OK, "{response}");
}

#[tokio::test]
async fn up_to_sixteen_stop_strings() {
    let app = TestApp::start().await;
    let sixteen: Vec<String> = (0..16).map(|i| format!("stop{i}")).collect();
    let seventeen: Vec<String> = (0..17).map(|i| format!("stop{i}")).collect();
    for path in [CHAT, COMPLETIONS] {
        let body = |stop: &[String]| {
            let extra = json!({"max_tokens": 2, "stop": stop});
            match path {
                CHAT => chat_body("Hi", extra),
                _ => completion_body(json!("a"), extra),
            }
        };
        let (status, response) = app.post(path, &body(&sixteen)).await;
        assert_eq!(status, StatusCode::OK, "{response}");
        let (status, response) = app.post(path, &body(&seventeen)).await;
        assert_refused(status, &response, "stop", "invalid_value");
        assert!(response["error"]["message"]
            .as_str()
            .unwrap()
            .contains("16"));
    }
    let long = "x".repeat(1025);
    let (status, response) = app
        .post(CHAT, &chat_body("Hi", json!({"stop": [long]})))
        .await;
    assert_refused(status, &response, "stop", "invalid_value");
}

#[tokio::test]
async fn control_values_out_of_range_are_named() {
    let app = TestApp::start().await;
    for (extra, param) in [
        (json!({"presence_penalty": 2.5}), "presence_penalty"),
        (json!({"frequency_penalty": -2.01}), "frequency_penalty"),
        (json!({"logit_bias": {"5": 101}}), "logit_bias"),
        (json!({"logit_bias": {"5": -100.5}}), "logit_bias"),
        (json!({"stop_token_ids": [98]}), "stop_token_ids"),
    ] {
        for (path, body) in [
            (CHAT, chat_body("Hi", extra.clone())),
            (COMPLETIONS, completion_body(json!("a"), extra.clone())),
        ] {
            let (status, response) = app.post(path, &body).await;
            assert_refused(status, &response, param, "invalid_value");
        }
    }
    let bounds = json!({"max_tokens": 1, "presence_penalty": -2, "frequency_penalty": 2,
                        "logit_bias": {"5": -100, "6": 100}, "stop_token_ids": [97]});
    let (status, response) = app.post(CHAT, &chat_body("Hi", bounds)).await;
    assert_eq!(status, StatusCode::OK, "{response}");
}

#[tokio::test]
async fn logit_bias_keys_are_vocabulary_ids() {
    let app = TestApp::start().await;
    for key in ["98", "-1", "x", "1.5"] {
        let body = chat_body("Hi", json!({"logit_bias": { key: 1 }}));
        let (status, response) = app.post(CHAT, &body).await;
        assert_refused(status, &response, "logit_bias", "invalid_value");
        let message = response["error"]["message"].as_str().unwrap();
        assert!(message.contains(&format!("\"{key}\"")), "{message}");
    }
    let body = chat_body(
        "Hi",
        json!({"max_tokens": 1, "logit_bias": {"97": 100, "0": -100}}),
    );
    let (status, response) = app.post(CHAT, &body).await;
    assert_eq!(status, StatusCode::OK, "{response}");
}

#[tokio::test]
async fn stop_token_ids_end_with_stop_even_with_ignore_eos() {
    let app = TestApp::start().await;
    let last = text_ids("a")[0];
    let (expected, _) = expected_generation(last, 6, true);
    // The third generated token, where it first appears, ends the choice; it is not shown.
    let stop = expected[2];
    let first = expected.iter().position(|&t| t == stop).unwrap();
    let body = completion_body(
        json!("a"),
        json!({"max_tokens": 6, "ignore_eos": true, "stop_token_ids": [stop],
               "return_token_ids": true}),
    );
    let (status, response) = app.post(COMPLETIONS, &body).await;
    assert_eq!(status, StatusCode::OK, "{response}");
    let choice = &response["choices"][0];
    assert_eq!(choice["finish_reason"], "stop");
    assert_eq!(choice["text"], decode(&expected[..first]));
    assert_eq!(choice["token_ids"], json!(expected[..=first]));
    assert_eq!(fake_next_token(last, VOCAB), expected[0]);
}
