//! Tool calling over HTTP against the fake shard: malformed tool fields are refused with the
//! field named before anything is generated; requests with tools are answered in OpenAI's shapes
//! (checked against OpenAI's schema); `/info` names the tool-call format in use. The fake does
//! not follow grammars, so call answers are tested on canned text in the router's unit tests.

mod http_common;

use axum::http::StatusCode;
use http_common::openapi::assert_schema;
use http_common::*;
use quiver_router::tool_calls::ToolCallParser;
use serde_json::{json, Value};

const CHAT: &str = "/v1/chat/completions";

fn tools() -> Value {
    json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
        "required": ["city"]}}}])
}

/// The test template does not read `tools`, so they are described in the prompt (several
/// hundred characters, one token each).
async fn long_prompts() -> TestApp {
    TestApp::with_options(Options {
        max_input_tokens: 600,
        max_total_tokens: 640,
        ..Options::default()
    })
    .await
}

#[tokio::test]
async fn malformed_tool_fields_are_refused_with_the_field_named() {
    let app = TestApp::start().await;
    let named = json!({"type": "function", "function": {"name": "nope"}});
    for (extra, param) in [
        (json!({"tools": "get_weather"}), "tools"),
        (
            json!({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}),
            "tools[0].function.name",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]}),
            "tools[0].function.parameters",
        ),
        (
            json!({"tools": tools(), "tool_choice": "sometimes"}),
            "tool_choice",
        ),
        (
            json!({"tools": tools(), "tool_choice": named}),
            "tool_choice",
        ),
        (json!({"tool_choice": "required"}), "tool_choice"),
        (
            json!({"tools": tools(), "parallel_tool_calls": 1}),
            "parallel_tool_calls",
        ),
        (
            json!({"functions": [{"name": "f"}], "tools": tools()}),
            "functions",
        ),
        (json!({"functions": [{}]}), "functions[0].name"),
    ] {
        let (status, body) = app.post(CHAT, &chat_body("Hi", extra.clone())).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{extra}: {body}");
        assert_schema(&body, "ErrorResponse");
        assert_eq!(body["error"]["param"], param, "{extra}: {body}");
    }
    // Nothing was generated for any of them.
    assert_eq!(app.shard.stats().prefill_calls, 0);
}

#[tokio::test]
async fn requests_with_tools_are_answered_in_openais_shapes() {
    let app = long_prompts().await;
    for choice in [json!("auto"), json!("none"), json!("required")] {
        let extra = json!({"tools": tools(), "tool_choice": choice, "max_tokens": 4});
        let (status, body) = app.post(CHAT, &chat_body("Hi", extra.clone())).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_schema(&body, "CreateChatCompletionResponse");
        // The fake writes no call: its text is the content.
        assert!(
            body["choices"][0]["message"]["content"].is_string(),
            "{body}"
        );
        let mut streamed = extra.clone();
        streamed["stream"] = json!(true);
        let (status, chunks) = app.stream(CHAT, &chat_body("Hi", streamed)).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(chunks.last(), Some(&json!("[DONE]")));
        for chunk in &chunks[..chunks.len() - 1] {
            assert_schema(chunk, "CreateChatCompletionStreamResponse");
        }
        let text: String = chunks
            .iter()
            .filter_map(|chunk| chunk["choices"][0]["delta"]["content"].as_str())
            .collect();
        assert_eq!(
            text,
            body["choices"][0]["message"]["content"].as_str().unwrap()
        );
    }
    let legacy = json!({"functions": [{"name": "get_weather"}], "function_call": "auto",
                        "max_tokens": 4});
    let (status, body) = app.post(CHAT, &chat_body("Hi", legacy)).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    app.wait_idle().await;
}

#[tokio::test]
async fn info_names_the_tool_call_format() {
    // The test template shows no family's format: hermes, the default.
    let app = TestApp::start().await;
    assert_eq!(app.get("/info").await.1["tool_call_parser"], "hermes");
    let app = TestApp::with_options(Options {
        tool_call_parser: Some(ToolCallParser::Mistral),
        ..Options::default()
    })
    .await;
    assert_eq!(app.get("/info").await.1["tool_call_parser"], "mistral");
}

/// The test template does not read `tools`: with a tool choice other than "none" they are
/// described after the client's system text, in the call format the reply is held to (hermes
/// here: the template names no format); with "none" the prompt is the plain rendering.
#[tokio::test]
async fn tools_are_described_in_the_system_message_for_a_template_without_them() {
    let app = long_prompts().await;
    let prompt = |choice: Value| {
        let mut body = chat_body(
            "Hi",
            json!({"tools": tools(), "tool_choice": choice,
            "max_tokens": 1, "return_token_ids": true}),
        );
        body["messages"] = json!([{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": "Hi"}]);
        let app = &app;
        async move {
            let (status, response) = app.post(CHAT, &body).await;
            assert_eq!(status, StatusCode::OK, "{response}");
            let ids = response["prompt_token_ids"]
                .as_array()
                .expect("prompt ids")
                .clone();
            ids.iter()
                .map(|id| token_text(id.as_u64().unwrap() as u32))
                .collect::<String>()
        }
    };
    let plain = "<system>Be brief.\n<user>Hi\n<assistant>";
    assert_eq!(prompt(json!("none")).await, plain);
    for choice in [json!("auto"), json!("required")] {
        let text = prompt(choice).await;
        assert!(
            text.starts_with("<system>Be brief.\n\nYou can call"),
            "{text}"
        );
        assert!(text.contains(r#""name":"get_weather""#), "{text}");
        assert!(text.contains(r#""required":["city"]"#), "{text}");
        assert!(text.contains("<tool_call>"), "{text}");
        assert!(text.ends_with("\n<user>Hi\n<assistant>"), "{text}");
    }
    app.wait_idle().await;
}
