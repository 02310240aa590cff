//! Streamed replies read on canned model text: the deltas add up to the non-streamed reading.

use serde_json::{json, Value};

use super::{format_of, ToolCallParser, ToolCallStream, ToolDelta};

/// Streams `text` in pieces of `size` characters; returns the reassembled content and calls
/// (name, arguments) and the deltas.
pub(super) fn stream(
    parser: ToolCallParser,
    text: &str,
    size: usize,
) -> (Option<String>, Vec<(String, String)>, Vec<ToolDelta>) {
    let declared = vec!["get_weather".to_owned(), "get_time".to_owned()];
    let mut reader = ToolCallStream::new(parser, declared);
    let chars: Vec<char> = text.chars().collect();
    let mut deltas = Vec::new();
    for piece in chars.chunks(size) {
        deltas.extend(reader.push(&piece.iter().collect::<String>()));
    }
    let (last, _) = reader.finish(false);
    deltas.extend(last);
    let mut content: Option<String> = None;
    let mut calls: Vec<(String, String)> = Vec::new();
    for delta in &deltas {
        match delta {
            ToolDelta::Content(text) => content.get_or_insert_with(String::new).push_str(text),
            ToolDelta::CallStart { index, id, name } => {
                assert_eq!(*index, calls.len(), "calls start in order");
                assert!(id.starts_with("call_"));
                calls.push((name.clone(), String::new()));
            }
            ToolDelta::Arguments { index, text } => calls[*index].1.push_str(text),
        }
    }
    (content, calls, deltas)
}

/// The non-streamed reading of `text`, in the same shape.
fn whole(parser: ToolCallParser, text: &str) -> (Option<String>, Vec<(String, String)>) {
    let declared = vec!["get_weather".to_owned(), "get_time".to_owned()];
    let parsed = format_of(parser).parse(text, Some(&declared));
    let calls = parsed
        .tool_calls
        .into_iter()
        .map(|call| (call.name, call.arguments))
        .collect();
    (parsed.content, calls)
}

/// Streamed in pieces of every size from 1 to 7 characters, `text` adds up to its
/// non-streamed reading; returns that reading.
pub(super) fn assert_stream_adds_up(
    parser: ToolCallParser,
    text: &str,
) -> (Option<String>, Vec<(String, String)>) {
    let expected = whole(parser, text);
    for size in 1..=7 {
        let (content, calls, _) = stream(parser, text, size);
        assert_eq!(
            (content, calls),
            expected,
            "{parser:?}, pieces of {size}: {text:?}"
        );
    }
    expected
}

/// A reply that is text after all (a call cut short, or not a call of a declared function):
/// its content adds up to the whole text. Deltas of a call that looked well-formed while it
/// streamed were already sent and stand (docs/tool-calling.md).
pub(super) fn assert_streamed_text(parser: ToolCallParser, text: &str) {
    assert_eq!(whole(parser, text), (Some(text.to_owned()), Vec::new()));
    for size in 1..=7 {
        let (content, _, _) = stream(parser, text, size);
        assert_eq!(
            content.as_deref(),
            Some(text),
            "{parser:?}, pieces of {size}"
        );
    }
}

#[test]
fn streamed_hermes_replies_add_up() {
    let call = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\":\"Paris \\\"Nord\\\" → é\",\"days\":3}}\n</tool_call>";
    let time = "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>";
    let (content, calls) = assert_stream_adds_up(ToolCallParser::Hermes, call);
    assert_eq!(content, None);
    assert_eq!(calls[0].0, "get_weather");
    let arguments: Value = serde_json::from_str(&calls[0].1).unwrap();
    assert_eq!(arguments, json!({"city": "Paris \"Nord\" → é", "days": 3}));
    let (content, calls) = assert_stream_adds_up(
        ToolCallParser::Hermes,
        &format!("Checking <tools>.\n{call}\n{time}"),
    );
    assert_eq!(content.as_deref(), Some("Checking <tools>.\n\n"));
    assert_eq!(calls.len(), 2);
    // Text alone, a marker's start at the end, malformed calls: all text.
    for text in [
        "Sunny, 20°C.",
        "a < b and <tool_",
        "<tool_call>\n{\"name\": \"launch\", \"arguments\": {}}\n</tool_call>",
        "<tool_call>\n{\"arguments\": {}, \"name\": \"get_time\"",
    ] {
        let (content, calls) = assert_stream_adds_up(ToolCallParser::Hermes, text);
        assert_eq!((content.as_deref(), calls.len()), (Some(text), 0));
    }
    assert_streamed_text(
        ToolCallParser::Hermes,
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": }}\n</tool_call>",
    );
}

#[test]
fn streamed_arguments_come_in_pieces_after_the_name() {
    let text = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\":\"Paris\"}}\n</tool_call>";
    let (_, _, deltas) = stream(ToolCallParser::Hermes, text, 1);
    let ToolDelta::CallStart { name, .. } = &deltas[0] else {
        panic!("{deltas:?}")
    };
    assert_eq!(name, "get_weather");
    let pieces = deltas[1..]
        .iter()
        .filter(|delta| matches!(delta, ToolDelta::Arguments { .. }))
        .count();
    assert!(pieces > 5, "{deltas:?}");
    // The marker never shows as content.
    assert!(!deltas
        .iter()
        .any(|delta| matches!(delta, ToolDelta::Content(_))));
}

#[test]
fn streamed_llama3_replies_add_up() {
    let calls_text = "{\"name\": \"get_weather\", \"parameters\": {\"city\":\"Paris\"}}; {\"name\": \"get_time\", \"parameters\": {}}";
    let (content, calls) = assert_stream_adds_up(ToolCallParser::Llama3Json, calls_text);
    assert_eq!((content, calls.len()), (None, 2));
    let tagged = format!("<|python_tag|>{calls_text}");
    assert_eq!(
        assert_stream_adds_up(ToolCallParser::Llama3Json, &tagged)
            .1
            .len(),
        2
    );
    for text in ["It is sunny.", "<|pyth"] {
        let (content, calls) = assert_stream_adds_up(ToolCallParser::Llama3Json, text);
        assert_eq!((content.as_deref(), calls.len()), (Some(text), 0));
    }
    assert_streamed_text(
        ToolCallParser::Llama3Json,
        "{\"name\": \"get_weather\", \"parameters\": {",
    );
}

#[test]
fn streamed_mistral_replies_add_up() {
    let text = "I will check.[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\":\"Paris\"}}, {\"name\": \"get_time\", \"arguments\": {}}]";
    let (content, calls) = assert_stream_adds_up(ToolCallParser::Mistral, text);
    assert_eq!(content.as_deref(), Some("I will check."));
    assert_eq!(calls.len(), 2);
    let (content, calls) = assert_stream_adds_up(ToolCallParser::Mistral, "Sunny [TOOL");
    assert_eq!((content.as_deref(), calls.len()), (Some("Sunny [TOOL"), 0));
    assert_streamed_text(
        ToolCallParser::Mistral,
        "[TOOL_CALLS] [{\"name\": \"get_time\", \"arguments\": {}",
    );
}

#[test]
fn arguments_written_as_a_string_arrive_at_the_end() {
    let text =
        r#"<tool_call>{"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}</tool_call>"#;
    let (_, calls) = assert_stream_adds_up(ToolCallParser::Hermes, text);
    assert_eq!(
        calls,
        vec![("get_weather".into(), r#"{"city":"Paris"}"#.into())]
    );
}
