//! A thinking model's chat replies over HTTP, on the fake shard: the parser named on `/info`
//! (detected from the template, or the flag), `reasoning_content` where the template leaves the
//! reply inside its thinking block, `chat_template_kwargs` reaching the template (and refused
//! for the names the request sets). The reference is the fake's token rule and this fixture's
//! character table (`http_common`), and OpenAI's schema.

mod http_common;

use axum::http::StatusCode;
use http_common::openapi::assert_schema;
use http_common::*;
use quiver_router::reasoning::ReasoningParserFlag;
use serde_json::{json, Value};

/// The fixture's template with a thinking switch as Qwen3's: the generation prompt opens a
/// thinking block, or, with `enable_thinking: false`, renders it closed and empty.
const THINKING: &str = "{{ bos_token }}{% for message in messages %}\
<{{ message.role }}>{{ message.content }}\n{% endfor %}\
{% if add_generation_prompt %}<assistant>\
{% if enable_thinking is defined and enable_thinking is false %}<think></think>\
{% else %}<think>{% endif %}{% endif %}";

const CHAT: &str = "/v1/chat/completions";

async fn thinking_app(reasoning_parser: Option<ReasoningParserFlag>) -> TestApp {
    TestApp::with_options(Options {
        template: THINKING,
        reasoning_parser,
        max_total_tokens: 64,
        ..Options::default()
    })
    .await
}

/// What the fake writes after the thinking prompt ("…<think>" or "…</think>"): its last
/// character is `>` either way.
fn generated(max_tokens: u32) -> String {
    let (ids, _) = expected_generation(text_ids(">")[0], max_tokens, false);
    decode(&ids)
}

#[tokio::test]
async fn info_names_the_reasoning_parser() {
    let plain = TestApp::start().await;
    assert_eq!(plain.get("/info").await.1["reasoning_parser"], Value::Null);
    assert_eq!(
        thinking_app(None).await.get("/info").await.1["reasoning_parser"],
        "qwen3"
    );
    let off = thinking_app(Some(ReasoningParserFlag::None)).await;
    assert_eq!(off.get("/info").await.1["reasoning_parser"], Value::Null);
    let r1 = thinking_app(Some(ReasoningParserFlag::DeepseekR1)).await;
    assert_eq!(r1.get("/info").await.1["reasoning_parser"], "deepseek_r1");
}

#[tokio::test]
async fn a_reply_inside_an_opened_block_is_reasoning() {
    let app = thinking_app(None).await;
    let body = chat_body("Hi", json!({"max_tokens": 6}));
    let (status, response) = app.post(CHAT, &body).await;
    assert_eq!(status, StatusCode::OK, "{response}");
    assert_schema(&response, "CreateChatCompletionResponse");
    let message = &response["choices"][0]["message"];
    assert_eq!(message["reasoning_content"], generated(6));
    assert_eq!(message["content"], Value::Null);

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (status, chunks) = app.stream(CHAT, &streamed).await;
    assert_eq!(status, StatusCode::OK);
    let mut reasoning = String::new();
    for chunk in &chunks[..chunks.len() - 1] {
        assert_schema(chunk, "CreateChatCompletionStreamResponse");
        let delta = &chunk["choices"][0]["delta"];
        reasoning.push_str(delta["reasoning_content"].as_str().unwrap_or_default());
        assert!(
            delta["content"].as_str().unwrap_or_default().is_empty(),
            "{chunk}"
        );
    }
    assert_eq!(reasoning, generated(6));
    app.wait_idle().await;
}

#[tokio::test]
async fn enable_thinking_false_reaches_the_template_and_the_reply_is_content() {
    let app = thinking_app(None).await;
    let kwargs = json!({"chat_template_kwargs": {"enable_thinking": false}, "max_tokens": 6});
    let (status, response) = app.post_text(CHAT, &chat_body("Hi", kwargs.clone())).await;
    assert_eq!(status, StatusCode::OK, "{response}");
    let response: Value = serde_json::from_str(&response).unwrap();
    let message = &response["choices"][0]["message"];
    assert_eq!(message["content"], generated(6));
    // The model has a parser: the field is there, null.
    assert_eq!(message.get("reasoning_content"), Some(&Value::Null));
    // The prompt is the one the template renders with the variable set.
    let (_, tokenized) = app
        .post(
            "/tokenize",
            &json!({"messages": [{"role": "user", "content": "Hi"}],
                                   "chat_template_kwargs": {"enable_thinking": false}}),
        )
        .await;
    let mut expected = vec![BOS];
    expected.extend(text_ids("<user>Hi\n<assistant><think></think>"));
    assert_eq!(tokenized["tokens"], json!(expected));
    assert_eq!(response["usage"]["prompt_tokens"], expected.len());
    app.wait_idle().await;
}

#[tokio::test]
async fn no_reasoning_field_without_a_parser() {
    let app = thinking_app(Some(ReasoningParserFlag::None)).await;
    let (_, response) = app
        .post(CHAT, &chat_body("Hi", json!({"max_tokens": 6})))
        .await;
    let message = response["choices"][0]["message"].as_object().unwrap();
    assert_eq!(message["content"], generated(6));
    assert!(!message.contains_key("reasoning_content"), "{response}");
    app.wait_idle().await;
}

#[tokio::test]
async fn chat_template_kwargs_that_set_the_requests_own_variables_are_refused() {
    let app = thinking_app(None).await;
    for (kwargs, param) in [
        (json!(["enable_thinking"]), "chat_template_kwargs"),
        (json!({"messages": []}), "chat_template_kwargs.messages"),
        (json!({"tools": []}), "chat_template_kwargs.tools"),
        (
            json!({"add_generation_prompt": false}),
            "chat_template_kwargs.add_generation_prompt",
        ),
        (
            json!({"chat_template": "x"}),
            "chat_template_kwargs.chat_template",
        ),
    ] {
        let body = chat_body("Hi", json!({"chat_template_kwargs": kwargs}));
        let (status, response) = app.post(CHAT, &body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{kwargs}: {response}");
        assert_schema(&response, "ErrorResponse");
        assert_eq!(response["error"]["param"], param, "{response}");
    }
    assert_eq!(app.shard.stats().prefill_calls, 0);
}
