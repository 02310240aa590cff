//! Chat's answer for a thinking model, from canned model text: reasoning in
//! `reasoning_content`, kept out of `content` and out of call parsing; the streamed deltas add
//! up to the non-streamed message, and every token is reported once, in order, across chunks.

use serde_json::{json, Value};

use super::tool_tests::{answer, reassemble, setup_with, stream, tools_body, without_ids};
use crate::reasoning::{ReasoningParser, ReasoningPlan};
use crate::tokenizer::test_support::byte_level_bpe;
use crate::tokenizer::TextTokenizer;

const CALL: &str =
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\":\"Paris\"}}\n</tool_call>";

/// Qwen3's plan for a prompt that ends as `prompt` does.
fn qwen3(prompt: &str) -> Option<ReasoningPlan> {
    let tokenizer = TextTokenizer::from_tokenizer(byte_level_bpe());
    Some(ReasoningPlan::new(
        ReasoningParser::Qwen3,
        prompt,
        &tokenizer,
    ))
}

/// The non-streamed message (ids out) and the one its streamed deltas add up to.
fn both(tools: Option<Value>, prompt: &str, text: &str) -> (Value, Value) {
    let message = answer(setup_with(tools.clone(), qwen3(prompt), false), text);
    let (streamed, finish) = reassemble(&stream(setup_with(tools, qwen3(prompt), false), text));
    assert_eq!(finish, message["finish_reason"], "{text:?}");
    (without_ids(&message["message"]), streamed)
}

#[test]
fn thinking_is_reasoning_content_and_the_rest_content() {
    let text = "<think>\nIt is in France.\n</think>\n\nParis.";
    let (message, streamed) = both(None, "<|im_start|>assistant\n", text);
    let expected = json!({"content": "\n\nParis.", "reasoning_content": "\nIt is in France.\n",
                          "tool_calls": null});
    assert_eq!(message, expected);
    assert_eq!(streamed, expected);
}

#[test]
fn a_prompt_that_closed_the_block_leaves_all_content_and_a_null_reasoning() {
    let text = "Paris.";
    let choice = answer(
        setup_with(None, qwen3("<think>\n\n</think>\n\n"), false),
        text,
    );
    let message = choice["message"].as_object().unwrap();
    assert_eq!(message["content"], "Paris.");
    // Present and null: the model has a parser, this reply no reasoning.
    assert_eq!(message.get("reasoning_content"), Some(&Value::Null));
    // Without a parser the field is absent.
    let plain = answer(setup_with(None, None, false), text);
    assert!(
        plain["message"].get("reasoning_content").is_none(),
        "{plain}"
    );
}

#[test]
fn unclosed_thinking_is_all_reasoning_with_null_content() {
    let (message, streamed) = both(None, "", "<think>Hmm, Paris or Ly");
    let expected =
        json!({"content": null, "reasoning_content": "Hmm, Paris or Ly", "tool_calls": null});
    assert_eq!(message, expected);
    assert_eq!(streamed, expected);
}

#[test]
fn calls_are_read_after_the_thinking_only() {
    // The thinking quotes a call of an undeclared function: it must not be parsed.
    let thinking =
        "I could write <tool_call>\n{\"name\": \"launch\", \"arguments\": {}}\n</tool_call>";
    let text = format!("<think>{thinking}</think>\n\n{CALL}");
    let (message, streamed) = both(Some(tools_body()), "", &text);
    let expected = json!({"content": null, "reasoning_content": thinking, "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]});
    assert_eq!(message, expected);
    assert_eq!(streamed, expected);
}

#[test]
fn every_token_is_reported_once_in_order() {
    let text = "<think>ab</think>cd";
    // The logprob entries in chunk order: a reader holds tokens back, but must report each
    // once and in the order of a plain stream, which reports each token with its own text.
    let entries = |choices: Vec<Value>| -> Vec<Value> {
        choices
            .iter()
            .filter_map(|choice| choice["logprobs"]["content"].as_array())
            .flatten()
            .cloned()
            .collect()
    };
    let plain = entries(stream(setup_with(None, None, true), text));
    assert_eq!(plain.len(), text.chars().count());
    for tools in [None, Some(tools_body())] {
        assert_eq!(
            entries(stream(setup_with(tools, qwen3(""), true), text)),
            plain
        );
    }
}
