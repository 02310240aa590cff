//! Structured output over HTTP against the fake shard: each way of asking for a constraint
//! reaches the shards as one compiled grammar carried by every choice (with the EOS ids that
//! end the request), a grammar the shard cannot compile is the client's 400 before anything is
//! prefilled, and malformed fields are 400s naming them.

mod http_common;

use http_common::openapi::assert_schema;
use http_common::*;
use quiver_router::shard::GrammarKind as Kind;
use serde_json::{json, Value};

const CHAT: &str = "/v1/chat/completions";
const COMPLETIONS: &str = "/v1/completions";

fn schema() -> Value {
    json!({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
}

#[tokio::test]
async fn each_source_reaches_the_shard_as_one_grammar_on_every_choice() {
    let app = TestApp::start().await;
    let cases = [
        (
            CHAT,
            chat_body(
                "Hi",
                json!({"response_format": {"type": "json_schema",
                "json_schema": {"name": "n", "schema": schema(), "strict": true}}}),
            ),
            Kind::JsonSchema,
        ),
        (
            CHAT,
            chat_body("Hi", json!({"response_format": {"type": "json_object"}})),
            Kind::JsonSchema,
        ),
        (
            COMPLETIONS,
            completion_body(
                json!("a"),
                json!({"response_format": {"type": "json_schema",
                "json_schema": {"name": "n", "schema": schema()}}}),
            ),
            Kind::JsonSchema,
        ),
        (
            COMPLETIONS,
            completion_body(
                json!("a"),
                json!({"structured_outputs": {"regex": "[0-9]+"}}),
            ),
            Kind::Regex,
        ),
        (
            CHAT,
            chat_body("Hi", json!({"guided_choice": ["yes", "no"]})),
            Kind::Lark,
        ),
    ];
    for (path, mut body, kind) in cases {
        body["n"] = json!(3);
        body["max_tokens"] = json!(2);
        let compiled_before = app.shard.compiled_grammars().len();
        let prefilled_before = app.shard.prefilled_grammars().len();
        let (status, response) = app.post(path, &body).await;
        assert_eq!(status, 200, "{body}: {response}");
        let compiled = app.shard.compiled_grammars();
        assert_eq!(
            compiled.len(),
            compiled_before + 1,
            "one compile per request: {body}"
        );
        let call = compiled.last().unwrap();
        assert_eq!(call.adapter_id, "");
        let grammar = call.grammar.clone();
        assert_eq!(grammar.kind, kind, "{body}");
        assert!(grammar.eos_token_ids.contains(&EOS), "{grammar:?}");
        let prefilled = &app.shard.prefilled_grammars()[prefilled_before..];
        assert_eq!(prefilled.len(), 3, "{body}");
        assert!(
            prefilled.iter().all(|g| g.as_ref() == Some(&grammar)),
            "{prefilled:?}"
        );
        // Pinned for the request's three choices, released once they are done.
        app.wait_idle().await;
    }
}

#[tokio::test]
async fn free_requests_compile_nothing() {
    let app = TestApp::start().await;
    for body in [
        chat_body("Hi", json!({"max_tokens": 2})),
        chat_body(
            "Hi",
            json!({"max_tokens": 2, "response_format": {"type": "text"}}),
        ),
    ] {
        let (status, _) = app.post(CHAT, &body).await;
        assert_eq!(status, 200);
    }
    assert!(app.shard.compiled_grammars().is_empty());
    assert!(app.shard.prefilled_grammars().iter().all(Option::is_none));
}

#[tokio::test]
async fn a_grammar_the_shard_refuses_is_a_400_before_any_prefill() {
    let app = TestApp::start().await;
    app.shard.refuse_grammars("invalid type: \"strin\"");
    for (path, body, param) in [
        (
            CHAT,
            chat_body(
                "Hi",
                json!({"response_format": {"type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "strin"}}}}),
            ),
            "response_format",
        ),
        (
            COMPLETIONS,
            completion_body(json!("a"), json!({"guided_regex": "a("})),
            "guided_regex",
        ),
    ] {
        let (status, response) = app.post(path, &body).await;
        assert_eq!(status, 400, "{response}");
        assert_schema(&response, "ErrorResponse");
        assert_eq!(response["error"]["param"], param);
        assert_eq!(response["error"]["type"], "invalid_request_error");
        let message = response["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("strin") && message.contains(param),
            "{message}"
        );
    }
    assert!(app.shard.prefilled_grammars().is_empty());
    // The server keeps serving.
    let (status, _) = app
        .post(CHAT, &chat_body("Hi", json!({"max_tokens": 1})))
        .await;
    assert_eq!(status, 200);
}

#[tokio::test]
async fn malformed_constraints_are_400s_naming_the_field() {
    let app = TestApp::start().await;
    for (extra, param) in [
        (
            json!({"response_format": {"type": "xml"}}),
            "response_format",
        ),
        (
            json!({"response_format": {"type": "json_schema"}}),
            "response_format",
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
            "response_format",
        ),
        (
            json!({"structured_outputs": {"regex": "a", "choice": ["a"]}}),
            "structured_outputs",
        ),
        (json!({"guided_choice": "yes"}), "guided_choice"),
        (
            json!({"response_format": {"type": "json_object"}, "guided_regex": "a"}),
            "guided_regex",
        ),
    ] {
        let (status, response) = app.post(CHAT, &chat_body("Hi", extra.clone())).await;
        assert_eq!(status, 400, "{extra}: {response}");
        assert_schema(&response, "ErrorResponse");
        assert_eq!(response["error"]["param"], param, "{extra}");
    }
    assert!(app.shard.compiled_grammars().is_empty());
}
