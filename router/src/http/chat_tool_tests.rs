//! Chat's answer to a request with tools, from canned model text: the non-streamed message and
//! the streamed deltas, which must add up to it (ids aside: each response makes its own).

use serde_json::{json, Value};

use super::Chat;
use crate::core::{ChoiceOutput, GeneratedToken};
use crate::http::endpoint::{Endpoint, FinishedChoice, ResponseSetup};
use crate::http::sse::{ChoiceStep, ChunkFormat};
use crate::openai::common::{FinishReason, Usage};
use crate::reasoning::ReasoningPlan;
use crate::tokenizer::test_support::byte_level_bpe;
use crate::tokenizer::TextTokenizer;
use crate::tool_calls::{check_tool_request, ToolCallParser, ToolFields, ToolPlan};
use crate::validation::{LogprobOptions, ResponseOptions};

const CALL: &str =
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\":\"Paris\"}}\n</tool_call>";

fn setup(body: Value, logprobs: bool) -> ResponseSetup {
    setup_with(Some(body), None, logprobs)
}

/// The answer's setup for a request with the tools of `body` (if any), split by `reasoning`.
pub(super) fn setup_with(
    body: Option<Value>,
    reasoning: Option<ReasoningPlan>,
    logprobs: bool,
) -> ResponseSetup {
    let tokenizer = TextTokenizer::from_tokenizer(byte_level_bpe());
    let tools = body.map(|body| {
        let request = check_tool_request(ToolFields {
            tools: body.get("tools"),
            tool_choice: body.get("tool_choice"),
            functions: body.get("functions"),
            function_call: body.get("function_call"),
            parallel_tool_calls: None,
        })
        .unwrap()
        .unwrap();
        ToolPlan::new(request, ToolCallParser::Hermes, &tokenizer)
    });
    ResponseSetup {
        model: "m".into(),
        options: ResponseOptions {
            n: 1,
            logprobs: LogprobOptions {
                tokens: logprobs.then_some(0),
                ..LogprobOptions::default()
            },
            ..ResponseOptions::default()
        },
        tools,
        reasoning,
        tokenizer,
        prompts: Vec::new(),
    }
}

pub(super) fn tools_body() -> Value {
    json!({"tools": [{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]})
}

fn tokens(count: usize) -> Vec<GeneratedToken> {
    (0..count)
        .map(|i| GeneratedToken {
            id: i as u32,
            logprob: -0.5,
            top: Vec::new(),
        })
        .collect()
}

/// The non-streamed message and finish reason of `text`.
pub(super) fn answer(setup: ResponseSetup, text: &str) -> Value {
    let chat = Chat::new(setup, ());
    let output = ChoiceOutput {
        text: text.to_owned(),
        tokens: tokens(3),
        prompt: None,
        finish_reason: FinishReason::Stop,
        completion_tokens: 3,
        reasoning_tokens: 0,
        cached_tokens: 0,
    };
    let response = chat.response(vec![FinishedChoice { index: 0, output }], Usage::new(1, 3));
    serde_json::to_value(&response.choices[0]).unwrap()
}

/// The streamed chunks' choice objects of `text`, one character (one token) per step.
pub(super) fn stream(setup: ResponseSetup, text: &str) -> Vec<Value> {
    let mut chat = Chat::new(setup, ());
    let mut chunks = chat.choice(0, ChoiceStep::Opening);
    for (i, c) in text.chars().enumerate() {
        chunks.extend(chat.choice(
            0,
            ChoiceStep::Text {
                text: c.to_string(),
                tokens: vec![tokens(i + 1).pop().unwrap()],
            },
        ));
    }
    chunks.extend(chat.choice(
        0,
        ChoiceStep::Finish {
            reason: FinishReason::Stop,
            tokens: Vec::new(),
        },
    ));
    chunks
        .iter()
        .map(|chunk| serde_json::to_value(&chunk.choices[0]).unwrap())
        .collect()
}

/// The message the deltas add up to, ids taken out, and the finish reason.
pub(super) fn reassemble(choices: &[Value]) -> (Value, Value) {
    let mut content: Option<String> = None;
    let mut reasoning: Option<String> = None;
    let mut calls: Vec<Value> = Vec::new();
    let mut finish = Value::Null;
    for choice in choices {
        let delta = &choice["delta"];
        if let Some(text) = delta["content"].as_str().filter(|text| !text.is_empty()) {
            content.get_or_insert_with(String::new).push_str(text);
        }
        if let Some(text) = delta["reasoning_content"].as_str() {
            assert!(!text.is_empty(), "an empty reasoning delta: {choice}");
            reasoning.get_or_insert_with(String::new).push_str(text);
        }
        for call in delta["tool_calls"].as_array().into_iter().flatten() {
            let index = call["index"].as_u64().unwrap() as usize;
            if call.get("id").is_some() {
                assert_eq!(index, calls.len());
                assert_eq!(call["type"], "function");
                assert_eq!(call["function"]["arguments"], "", "the first delta: {call}");
                calls.push(json!({"type": "function", "function": {
                    "name": call["function"]["name"], "arguments": ""}}));
            } else {
                assert!(call["function"].get("name").is_none(), "{call}");
                let arguments = &mut calls[index]["function"]["arguments"];
                *arguments = json!(format!(
                    "{}{}",
                    arguments.as_str().unwrap(),
                    call["function"]["arguments"].as_str().unwrap()
                ));
            }
        }
        if !choice["finish_reason"].is_null() {
            finish = choice["finish_reason"].clone();
        }
    }
    let calls = (!calls.is_empty()).then_some(Value::Array(calls));
    let message = json!({"content": content, "reasoning_content": reasoning, "tool_calls": calls});
    (message, finish)
}

/// The message without its call ids (`reasoning_content` null when absent).
pub(super) fn without_ids(message: &Value) -> Value {
    let mut calls = message["tool_calls"].clone();
    for call in calls.as_array_mut().into_iter().flatten() {
        let id = call.as_object_mut().unwrap().remove("id").unwrap();
        assert!(id.as_str().unwrap().starts_with("call_"));
    }
    json!({"content": message["content"], "reasoning_content": message["reasoning_content"],
           "tool_calls": calls})
}

#[test]
fn a_call_is_answered_as_tool_calls() {
    let choice = answer(setup(tools_body(), false), CALL);
    assert_eq!(choice["finish_reason"], "tool_calls");
    let message = &choice["message"];
    assert_eq!(message["content"], Value::Null);
    assert_eq!(
        without_ids(message),
        json!({"content": null, "reasoning_content": null, "tool_calls": [{"type": "function", "function": {
            "name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]})
    );
}

#[test]
fn text_is_answered_as_content() {
    let choice = answer(setup(tools_body(), false), "It is sunny.");
    assert_eq!(choice["finish_reason"], "stop");
    assert_eq!(choice["message"]["content"], "It is sunny.");
    assert!(choice["message"].get("tool_calls").is_none());
}

#[test]
fn streamed_deltas_add_up_to_the_message() {
    for text in [
        CALL.to_owned(),
        format!("Let me see.\n{CALL}\n{CALL}"),
        "No call <tool but text.".to_owned(),
    ] {
        let message = answer(setup(tools_body(), false), &text);
        let (streamed, finish) = reassemble(&stream(setup(tools_body(), false), &text));
        assert_eq!(streamed, without_ids(&message["message"]), "{text:?}");
        assert_eq!(finish, message["finish_reason"], "{text:?}");
    }
}

#[test]
fn held_back_tokens_are_reported_once_each() {
    let choices = stream(setup(tools_body(), true), CALL);
    let reported: usize = choices
        .iter()
        .filter_map(|choice| choice["logprobs"]["content"].as_array())
        .map(Vec::len)
        .sum();
    assert_eq!(reported, CALL.chars().count());
}

#[test]
fn legacy_functions_are_answered_as_function_call() {
    let body = json!({"functions": [{"name": "get_weather"}], "function_call": "auto"});
    let choice = answer(setup(body.clone(), false), CALL);
    assert_eq!(choice["finish_reason"], "function_call");
    assert_eq!(
        choice["message"]["function_call"],
        json!({"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"})
    );
    assert!(choice["message"].get("tool_calls").is_none());
    let chunks = stream(setup(body, false), CALL);
    let first = chunks
        .iter()
        .find(|choice| choice["delta"].get("function_call").is_some())
        .unwrap();
    assert_eq!(
        first["delta"]["function_call"],
        json!({"name": "get_weather", "arguments": ""})
    );
    assert_eq!(chunks.last().unwrap()["finish_reason"], "function_call");
}
