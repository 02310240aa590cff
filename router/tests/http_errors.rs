//! Every bad input of issue 2 gets OpenAI's error object (checked against the schema) with the
//! status OpenAI uses and a message that says what was wrong, and the router goes on serving.

mod http_common;

use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use http_common::openapi::assert_schema;
use http_common::*;
use serde_json::{json, Value};
use tower::ServiceExt;

const CHAT: &str = "/v1/chat/completions";
const COMPLETIONS: &str = "/v1/completions";

/// Checks the error body's shape, status, `param` and `code`, and that the message mentions
/// every `needle`.
fn assert_error(
    status: StatusCode,
    body: &Value,
    expected: StatusCode,
    param: Option<&str>,
    needles: &[&str],
) {
    assert_eq!(status, expected, "{body}");
    assert_schema(body, "ErrorResponse");
    let error = &body["error"];
    assert_eq!(
        error.as_object().unwrap().len(),
        4,
        "exactly message, type, param, code: {body}"
    );
    assert_eq!(error["param"], json!(param), "{body}");
    assert!(error["code"].is_string(), "{body}");
    let message = error["message"].as_str().unwrap();
    for needle in needles {
        assert!(
            message.contains(needle),
            "{message:?} should mention {needle:?}"
        );
    }
}

/// The router still answers a good request, and holds nothing afterwards.
async fn assert_still_serving(app: &TestApp) {
    let (status, body) = app
        .post(CHAT, &chat_body("Hi", json!({"max_tokens": 2})))
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    app.wait_idle().await;
}

#[tokio::test]
async fn malformed_bodies_and_wrong_types() {
    let app = TestApp::start().await;
    let cases: &[(&str, &str, Option<&str>, &[&str])] = &[
        (
            CHAT,
            r#"{"model": "tiny", "messages": ["#,
            None,
            &["not valid JSON"],
        ),
        (CHAT, "", None, &["not valid JSON"]),
        (COMPLETIONS, "[1, 2]", None, &["JSON object"]),
        (
            CHAT,
            r#"{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}"#,
            Some("temperature"),
            &["temperature"],
        ),
        (
            CHAT,
            r#"{"messages": "hello"}"#,
            Some("messages"),
            &["messages"],
        ),
        (
            CHAT,
            r#"{"messages": [], "max_tokens": -5}"#,
            Some("max_tokens"),
            &["max_tokens"],
        ),
        (
            CHAT,
            r#"{"messages": [], "stream": "yes"}"#,
            Some("stream"),
            &["stream"],
        ),
        (
            COMPLETIONS,
            r#"{"prompt": "x", "stop": 3}"#,
            Some("stop"),
            &["stop"],
        ),
        (
            COMPLETIONS,
            r#"{"prompt": "x", "model": 12}"#,
            Some("model"),
            &["model"],
        ),
        (
            COMPLETIONS,
            r#"{"prompt": "x", "seed": 1.5}"#,
            Some("seed"),
            &["seed"],
        ),
    ];
    for (path, body, param, needles) in cases {
        let (status, response) = app.post_raw(path, body).await;
        assert_error(status, &response, StatusCode::BAD_REQUEST, *param, needles);
        assert_eq!(response["error"]["type"], "invalid_request_error");
    }
    assert_still_serving(&app).await;
}

#[tokio::test]
async fn missing_and_empty_inputs() {
    let app = TestApp::start().await;
    let cases: &[(&str, Value, &str, &[&str])] = &[
        (
            CHAT,
            json!({"model": SERVED_NAME}),
            "messages",
            &["messages"],
        ),
        (CHAT, json!({"messages": null}), "messages", &["messages"]),
        (CHAT, json!({"messages": []}), "messages", &["at least one"]),
        (
            COMPLETIONS,
            json!({"model": SERVED_NAME}),
            "prompt",
            &["prompt"],
        ),
        (COMPLETIONS, json!({"prompt": []}), "prompt", &["empty"]),
        (COMPLETIONS, json!({"prompt": [[]]}), "prompt", &["empty"]),
        (
            COMPLETIONS,
            json!({"prompt": {"text": "x"}}),
            "prompt",
            &["string"],
        ),
        (
            COMPLETIONS,
            json!({"prompt": ["a", 1]}),
            "prompt",
            &["list"],
        ),
        (
            COMPLETIONS,
            json!({"prompt": [1, VOCAB]}),
            "prompt",
            &["98", "out of range"],
        ),
        (
            COMPLETIONS,
            json!({"prompt": [[1], [-1]]}),
            "prompt[1]",
            &["-1"],
        ),
    ];
    for (path, body, param, needles) in cases {
        let (status, response) = app.post(path, body).await;
        assert_error(
            status,
            &response,
            StatusCode::BAD_REQUEST,
            Some(param),
            needles,
        );
    }
    assert_still_serving(&app).await;
}

#[tokio::test]
async fn bad_messages_and_a_raising_template() {
    let app = TestApp::start().await;
    let user = json!({"role": "user", "content": "x"});
    let cases: &[(Value, &str, &[&str])] = &[
        (
            json!([{"role": "wizard", "content": "x"}]),
            "messages[0].role",
            &["wizard"],
        ),
        (
            json!([user, {"role": 5, "content": "x"}]),
            "messages[1].role",
            &["role"],
        ),
        (json!([{"content": "x"}]), "messages[0].role", &["role"]),
        (json!(["just a string"]), "messages[0]", &["object"]),
        (
            json!([{"role": "user", "content": 5}]),
            "messages[0].content",
            &["content"],
        ),
        (
            json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]),
            "messages[0].content[0].type",
            &["image_url"],
        ),
        (
            json!([user, {"role": "system", "content": "late"}]),
            "messages",
            &["System message must be at the beginning."],
        ),
        (
            json!([user, {"role": "assistant", "content": null, "tool_calls": [{"id": "c1"}]}]),
            "messages[1].tool_calls[0].function",
            &["function"],
        ),
        (
            json!([user, {"role": "assistant", "content": null,
                          "tool_calls": [{"function": {"name": "f", "arguments": 3}}]}]),
            "messages[1].tool_calls[0].function.arguments",
            &["arguments"],
        ),
        (
            json!([user, {"role": "tool", "tool_call_id": 7, "content": "r"}]),
            "messages[1].tool_call_id",
            &["tool_call_id"],
        ),
    ];
    for (messages, param, needles) in cases {
        let (status, response) = app.post(CHAT, &json!({"messages": messages})).await;
        assert_error(
            status,
            &response,
            StatusCode::BAD_REQUEST,
            Some(param),
            needles,
        );
    }
    // Every role OpenAI defines is accepted.
    for role in ["system", "user", "assistant", "tool", "developer"] {
        let body = json!({"max_tokens": 1, "messages": [{"role": role, "content": "x"}]});
        let (status, response) = app.post(CHAT, &body).await;
        assert_eq!(status, StatusCode::OK, "{role}: {response}");
    }
    // OpenAI's tool-call history: a call with `content: null`, then its result.
    let history = json!([user,
        {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"}]);
    let body = json!({"max_tokens": 1, "messages": history});
    let (status, response) = app.post(CHAT, &body).await;
    assert_eq!(status, StatusCode::OK, "tool-call history: {response}");
    assert_still_serving(&app).await;
}

#[tokio::test]
async fn lengths_over_the_limits_name_both_numbers() {
    let app = TestApp::start().await;
    // 48 input tokens at most, 64 in total.
    let long = "a".repeat(60);
    let (status, response) = app
        .post(COMPLETIONS, &completion_body(json!(long), json!({})))
        .await;
    assert_error(
        status,
        &response,
        StatusCode::BAD_REQUEST,
        Some("prompt"),
        &["61", "48"],
    );
    let (status, response) = app.post(CHAT, &chat_body(&long, json!({}))).await;
    let prompt = chat_prompt_ids(&long).len().to_string();
    assert_error(
        status,
        &response,
        StatusCode::BAD_REQUEST,
        Some("messages"),
        &[&prompt, "48"],
    );

    // 11 prompt tokens leave 53.
    let prompt = "a".repeat(10);
    for field in ["max_tokens", "max_completion_tokens"] {
        let (status, response) = app
            .post(
                COMPLETIONS,
                &completion_body(json!(prompt), json!({field: 54})),
            )
            .await;
        assert_error(
            status,
            &response,
            StatusCode::BAD_REQUEST,
            Some(field),
            &["54", "11", "53", "64"],
        );
        let (status, _) = app
            .post(
                COMPLETIONS,
                &completion_body(json!(prompt), json!({field: 53})),
            )
            .await;
        assert_eq!(status, StatusCode::OK);
    }
    assert_still_serving(&app).await;
}

#[tokio::test]
async fn out_of_range_parameters_are_named() {
    let app = TestApp::start().await;
    let cases = [
        (json!({"temperature": 2.01}), "temperature"),
        (json!({"temperature": -0.5}), "temperature"),
        (json!({"top_p": 0}), "top_p"),
        (json!({"top_p": 1.5}), "top_p"),
        (json!({"top_k": -3}), "top_k"),
        (json!({"min_p": 2}), "min_p"),
        (json!({"repetition_penalty": 0}), "repetition_penalty"),
        (json!({"n": 0}), "n"),
        (json!({"max_tokens": 0}), "max_tokens"),
        (json!({"min_tokens": 10, "max_tokens": 5}), "min_tokens"),
        (json!({"stop": vec!["s"; 17]}), "stop"),
    ];
    for (extra, param) in cases {
        let (status, response) = app.post(CHAT, &chat_body("Hi", extra.clone())).await;
        assert_error(
            status,
            &response,
            StatusCode::BAD_REQUEST,
            Some(param),
            &[param],
        );
    }
    for extra in [
        json!({"temperature": 0}),
        json!({"temperature": 2}),
        json!({"top_p": 1}),
        json!({"top_p": 0.01}),
    ] {
        let mut extra = extra;
        extra["max_tokens"] = json!(1);
        let (status, response) = app.post(CHAT, &chat_body("Hi", extra)).await;
        assert_eq!(status, StatusCode::OK, "{response}");
    }
    assert_still_serving(&app).await;
}

#[tokio::test]
async fn unknown_models_are_404_in_openai_shape() {
    let app = TestApp::start().await;
    let expected = json!({"error": {
        "message": "The model `gpt-9` does not exist.",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found"
    }});
    let (status, response) = app
        .post(CHAT, &chat_body("Hi", json!({"model": "gpt-9"})))
        .await;
    assert_eq!((status, &response), (StatusCode::NOT_FOUND, &expected));
    let (status, response) = app
        .post(
            COMPLETIONS,
            &completion_body(json!("x"), json!({"model": "gpt-9"})),
        )
        .await;
    assert_eq!((status, &response), (StatusCode::NOT_FOUND, &expected));
    let (status, response) = app.get("/v1/models/gpt-9").await;
    assert_eq!((status, &response), (StatusCode::NOT_FOUND, &expected));
    assert_schema(&response, "ErrorResponse");
    assert_still_serving(&app).await;
}

#[tokio::test]
async fn chat_without_a_template_is_a_400() {
    let app = TestApp::with_options(Options {
        with_template: false,
        ..Options::default()
    })
    .await;
    let (status, response) = app.post(CHAT, &chat_body("Hi", json!({}))).await;
    assert_error(
        status,
        &response,
        StatusCode::BAD_REQUEST,
        Some("messages"),
        &["chat template"],
    );
    let (status, _) = app
        .post(
            COMPLETIONS,
            &completion_body(json!("x"), json!({"max_tokens": 1})),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test]
async fn too_many_concurrent_requests_are_429() {
    let app = TestApp::with_options(Options {
        max_concurrent_requests: 1,
        step_delay: Duration::from_millis(5),
        ..Options::default()
    })
    .await;
    let body = completion_body(
        json!("ab"),
        json!({"max_tokens": 40, "ignore_eos": true, "stream": true}),
    );
    let response = app
        .app
        .clone()
        .oneshot(
            Request::post(COMPLETIONS)
                .body(Body::from(body.to_string()))
                .unwrap(),
        )
        .await
        .unwrap();
    let mut stream = response.into_body();
    stream.frame().await.unwrap().unwrap();
    let (status, response) = app
        .post(
            COMPLETIONS,
            &completion_body(json!("x"), json!({"max_tokens": 1})),
        )
        .await;
    assert_error(
        status,
        &response,
        StatusCode::TOO_MANY_REQUESTS,
        None,
        &["overloaded"],
    );
    drop(stream);
    app.wait_idle().await;
    // A request counts once whatever its `n`: two choices share the one slot.
    let (status, response) = app
        .post(CHAT, &chat_body("Hi", json!({"n": 2, "max_tokens": 1})))
        .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(response["choices"].as_array().map(Vec::len), Some(2));
    app.wait_idle().await;
    assert_still_serving(&app).await;
}

#[tokio::test]
async fn api_key_guards_v1_only() {
    let app = TestApp::with_options(Options {
        api_key: Some("sekret".into()),
        ..Options::default()
    })
    .await;
    let body = chat_body("Hi", json!({"max_tokens": 1})).to_string();
    let request = |auth: Option<&str>| {
        let mut builder = Request::post(CHAT).header("content-type", "application/json");
        if let Some(auth) = auth {
            builder = builder.header("authorization", auth);
        }
        builder.body(Body::from(body.clone())).unwrap()
    };
    for auth in [
        None,
        Some("Bearer wrong"),
        Some("sekret"),
        Some("Bearer sekret2"),
    ] {
        let (status, text) = app.send(request(auth)).await;
        let response: Value = serde_json::from_str(&text).unwrap();
        assert_error(
            status,
            &response,
            StatusCode::UNAUTHORIZED,
            None,
            &["API key"],
        );
        assert_eq!(response["error"]["code"], "invalid_api_key");
    }
    let (status, text) = app.send(request(Some("Bearer sekret"))).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let (status, _) = app
        .send(Request::get("/v1/models").body(Body::empty()).unwrap())
        .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    // Probes stay open.
    assert_eq!(app.get("/health").await.0, StatusCode::OK);
    assert_eq!(app.get("/info").await.0, StatusCode::OK);
}

#[tokio::test]
async fn unknown_routes_and_methods_answer_in_openai_shape() {
    let app = TestApp::start().await;
    let (status, response) = app.get("/v1/nope").await;
    assert_error(
        status,
        &response,
        StatusCode::NOT_FOUND,
        None,
        &["/v1/nope"],
    );
    let (status, response) = app.get(CHAT).await;
    assert_error(
        status,
        &response,
        StatusCode::METHOD_NOT_ALLOWED,
        None,
        &["GET"],
    );
    // A body with no content type (curl -d sends form-urlencoded) is still read as JSON.
    let request = Request::post(COMPLETIONS)
        .header("content-type", "application/x-www-form-urlencoded")
        .body(Body::from(
            completion_body(json!("x"), json!({"max_tokens": 1})).to_string(),
        ))
        .unwrap();
    let response = app.app.clone().oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let _ = response.into_body().collect().await;
    assert_still_serving(&app).await;
}
