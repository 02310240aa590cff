//! The objects embed `ObjectHeader` with `#[serde(flatten)]`; these pin the JSON it writes to
//! the order of OpenAI's own examples: `id`, `object`, `created`, `model` first, then the
//! object's other fields, with no wrapper and nothing added.

use super::chat::{ChatCompletionChunk, ChatCompletionResponse};
use super::common::{ObjectHeader, Usage};
use super::completions::CompletionResponse;

fn header(object: &'static str) -> ObjectHeader {
    ObjectHeader {
        id: "x-1".to_owned(),
        object,
        created: 1_700_000_000,
        model: "m".to_owned(),
    }
}

#[test]
fn a_chat_response_opens_with_the_header_fields_in_order() {
    let response = ChatCompletionResponse {
        header: header("chat.completion"),
        choices: Vec::new(),
        usage: Usage::new(2, 3),
        prompt_token_ids: None,
    };
    assert_eq!(
        serde_json::to_string(&response).unwrap(),
        r#"{"id":"x-1","object":"chat.completion","created":1700000000,"model":"m","choices":[],"usage":{"prompt_tokens":2,"completion_tokens":3,"total_tokens":5}}"#
    );
}

#[test]
fn a_chat_chunk_opens_with_the_header_fields_in_order() {
    let chunk = ChatCompletionChunk {
        header: header("chat.completion.chunk"),
        choices: Vec::new(),
        usage: None,
        prompt_token_ids: Some(vec![7]),
    };
    assert_eq!(
        serde_json::to_string(&chunk).unwrap(),
        r#"{"id":"x-1","object":"chat.completion.chunk","created":1700000000,"model":"m","choices":[],"prompt_token_ids":[7]}"#
    );
}

#[test]
fn a_completion_opens_with_the_header_fields_in_order() {
    let response = CompletionResponse {
        header: header("text_completion"),
        choices: Vec::new(),
        usage: None,
    };
    assert_eq!(
        serde_json::to_string(&response).unwrap(),
        r#"{"id":"x-1","object":"text_completion","created":1700000000,"model":"m","choices":[]}"#
    );
}

#[test]
fn a_header_for_another_object_keeps_id_time_and_model() {
    let chunk_header = header("chat.completion").with_object("chat.completion.chunk");
    assert_eq!(chunk_header, header("chat.completion.chunk"));
}
