//! Each parser on canned model output. Expected arguments are written here as JSON values and
//! compared with the parsed `arguments` text read back by serde_json.

use serde_json::{json, Value};

use super::{call_id, format_of, ParsedOutput, ToolCallParser};

fn declared() -> Vec<String> {
    ["get_weather", "search", "get_time"]
        .map(String::from)
        .to_vec()
}

fn parse(parser: ToolCallParser, text: &str) -> ParsedOutput {
    format_of(parser).parse(text, Some(&declared()))
}

/// The calls as `(name, arguments as a JSON value)`.
fn calls(output: &ParsedOutput) -> Vec<(&str, Value)> {
    output
        .tool_calls
        .iter()
        .map(|call| {
            let arguments: Value = serde_json::from_str(&call.arguments)
                .unwrap_or_else(|err| panic!("arguments {:?}: {err}", call.arguments));
            (call.name.as_str(), arguments)
        })
        .collect()
}

/// The output, unchanged, as content without calls.
fn assert_plain(parser: ToolCallParser, text: &str) {
    let output = parse(parser, text);
    assert_eq!(
        output,
        ParsedOutput {
            content: Some(text.to_owned()),
            tool_calls: Vec::new()
        },
        "{parser:?} on {text:?}"
    );
}

/// Arguments as a model writes them: strings needing escapes (a `\u` escape among them) and
/// non-ASCII text, nested in objects and arrays.
const NESTED_ARGUMENTS: &str = concat!(
    r#"{"query": "say \"h\u00e9llo\" → 世界 🌍", "#,
    r#""filters": {"lang": ["fr", "zh"], "range": {"from": 1, "to": 2.5}, "exact": true}, "#,
    r#""note": null, "path": "C:\\tmp\\x"}"#,
);

/// What `NESTED_ARGUMENTS` means.
fn nested_arguments() -> Value {
    json!({
        "query": "say \"héllo\" → 世界 🌍",
        "filters": {"lang": ["fr", "zh"], "range": {"from": 1, "to": 2.5}, "exact": true},
        "note": null,
        "path": "C:\\tmp\\x"
    })
}

// ---- hermes ----

#[test]
fn hermes_single_call() {
    let text = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
    let output = parse(ToolCallParser::Hermes, text);
    assert_eq!(output.content, None);
    assert_eq!(
        calls(&output),
        vec![("get_weather", json!({"city": "Paris"}))]
    );
}

#[test]
fn hermes_several_calls_after_text() {
    let text = "Let me look that up.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>";
    let output = parse(ToolCallParser::Hermes, text);
    assert_eq!(output.content.as_deref(), Some("Let me look that up.\n\n"));
    assert_eq!(
        calls(&output),
        vec![
            ("get_weather", json!({"city": "Paris"})),
            ("get_time", json!({}))
        ]
    );
}

#[test]
fn hermes_nested_arguments() {
    let text = format!(
        "<tool_call>\n{{\"name\": \"search\", \"arguments\": {NESTED_ARGUMENTS}}}\n</tool_call>"
    );
    let output = parse(ToolCallParser::Hermes, &text);
    assert_eq!(calls(&output), vec![("search", nested_arguments())]);
    // Exactly as written, so that streamed pieces of it add up to it.
    assert_eq!(output.tool_calls[0].arguments, NESTED_ARGUMENTS);
}

#[test]
fn hermes_arguments_as_a_json_string() {
    let text = r#"<tool_call>{"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": 3}"}</tool_call>"#;
    let output = parse(ToolCallParser::Hermes, text);
    assert_eq!(
        calls(&output),
        vec![("get_weather", json!({"city": "Paris", "days": 3}))]
    );
    assert_eq!(
        output.tool_calls[0].arguments,
        r#"{"city":"Paris","days":3}"#
    );
}

#[test]
fn hermes_last_block_without_end_tag() {
    let text = "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"tz\": \"UTC\"}}\n";
    let output = parse(ToolCallParser::Hermes, text);
    assert_eq!(calls(&output), vec![("get_time", json!({"tz": "UTC"}))]);
}

#[test]
fn hermes_plain_text() {
    assert_plain(ToolCallParser::Hermes, "The weather in Paris is sunny.");
    assert_eq!(parse(ToolCallParser::Hermes, " \n").content, None);
}

#[test]
fn hermes_malformed_calls_are_text() {
    for text in [
        // Invalid JSON.
        "Sure.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": }\n</tool_call>",
        // Truncated by max_tokens.
        "<tool_call>\n{\"name\": \"get_weather\", \"argum",
        // No name, a non-string name.
        "<tool_call>{\"arguments\": {}}</tool_call>",
        "<tool_call>{\"name\": 7, \"arguments\": {}}</tool_call>",
        // Arguments missing, not an object, a string holding no object.
        "<tool_call>{\"name\": \"get_time\"}</tool_call>",
        "<tool_call>{\"name\": \"get_time\", \"arguments\": [1]}</tool_call>",
        "<tool_call>{\"name\": \"get_time\", \"arguments\": \"now\"}</tool_call>",
        // Two objects in one block; an empty block.
        "<tool_call>{\"name\": \"get_time\", \"arguments\": {}} {}</tool_call>",
        "<tool_call></tool_call>",
        // One good call and one bad one.
        "<tool_call>{\"name\": \"get_time\", \"arguments\": {}}</tool_call><tool_call>{</tool_call>",
    ] {
        assert_plain(ToolCallParser::Hermes, text);
    }
}

#[test]
fn hermes_unknown_function_is_text() {
    let text = "<tool_call>\n{\"name\": \"delete_everything\", \"arguments\": {}}\n</tool_call>";
    assert_plain(ToolCallParser::Hermes, text);
    // Without a declared list, any name is taken.
    let output = format_of(ToolCallParser::Hermes).parse(text, None);
    assert_eq!(calls(&output), vec![("delete_everything", json!({}))]);
}

// ---- llama3_json ----

#[test]
fn llama3_single_call() {
    let text = r#"{"name": "get_weather", "parameters": {"city": "Paris"}}"#;
    let output = parse(ToolCallParser::Llama3Json, text);
    assert_eq!(output.content, None);
    assert_eq!(
        calls(&output),
        vec![("get_weather", json!({"city": "Paris"}))]
    );
}

#[test]
fn llama3_python_tag_and_arguments_key() {
    let text = r#"<|python_tag|>{"name": "get_time", "arguments": {"tz": "UTC"}}"#;
    let output = parse(ToolCallParser::Llama3Json, text);
    assert_eq!(calls(&output), vec![("get_time", json!({"tz": "UTC"}))]);
}

#[test]
fn llama3_several_calls() {
    let text = r#"{"name": "get_weather", "parameters": {"city": "a;b"}}; {"name": "get_time", "parameters": {}}"#;
    let output = parse(ToolCallParser::Llama3Json, text);
    assert_eq!(output.content, None);
    assert_eq!(
        calls(&output),
        vec![
            ("get_weather", json!({"city": "a;b"})),
            ("get_time", json!({}))
        ]
    );
}

#[test]
fn llama3_nested_arguments() {
    let text = format!(r#"{{"name": "search", "parameters": {NESTED_ARGUMENTS}}}"#);
    let output = parse(ToolCallParser::Llama3Json, &text);
    assert_eq!(calls(&output), vec![("search", nested_arguments())]);
}

#[test]
fn llama3_arguments_as_a_json_string() {
    let text = r#"{"name": "get_weather", "parameters": "{\"city\": \"Paris\"}"}"#;
    let output = parse(ToolCallParser::Llama3Json, text);
    assert_eq!(
        calls(&output),
        vec![("get_weather", json!({"city": "Paris"}))]
    );
}

#[test]
fn llama3_plain_text() {
    assert_plain(ToolCallParser::Llama3Json, "It is sunny in Paris.");
}

#[test]
fn llama3_text_around_a_call_is_text() {
    // The format has no place for text: a reply with both is not a call.
    assert_plain(
        ToolCallParser::Llama3Json,
        r#"Calling: {"name": "get_time", "parameters": {}}"#,
    );
    assert_plain(
        ToolCallParser::Llama3Json,
        r#"{"name": "get_time", "parameters": {}} and that is all"#,
    );
}

#[test]
fn llama3_malformed_calls_are_text() {
    for text in [
        r#"{"name": "get_time", "parameters": {"#,
        r#"{"parameters": {}}"#,
        r#"{"name": ["get_time"], "parameters": {}}"#,
        r#"{"name": "get_time", "parameters": 3}"#,
        r#"{"name": "get_time"}"#,
        r#"{"name": "get_time", "parameters": {}}; {"name": "get_time"}"#,
        r#"{"name": "get_time", "parameters": {}} {"name": "get_time", "parameters": {}}"#,
        r#"{"answer": 42}"#,
    ] {
        assert_plain(ToolCallParser::Llama3Json, text);
    }
}

#[test]
fn llama3_unknown_function_is_text() {
    assert_plain(
        ToolCallParser::Llama3Json,
        r#"{"name": "get_weather", "parameters": {}}; {"name": "launch", "parameters": {}}"#,
    );
}

// ---- mistral ----

#[test]
fn mistral_single_call() {
    let text = r#"[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]"#;
    let output = parse(ToolCallParser::Mistral, text);
    assert_eq!(output.content, None);
    assert_eq!(
        calls(&output),
        vec![("get_weather", json!({"city": "Paris"}))]
    );
}

#[test]
fn mistral_several_calls_after_text() {
    let text = concat!(
        "I will check both.\n",
        r#"[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1b2c3d4e"}, "#,
        r#"{"name": "get_time", "arguments": "{}"}]"#,
    );
    let output = parse(ToolCallParser::Mistral, text);
    assert_eq!(output.content.as_deref(), Some("I will check both.\n"));
    assert_eq!(
        calls(&output),
        vec![
            ("get_weather", json!({"city": "Paris"})),
            ("get_time", json!({}))
        ]
    );
}

#[test]
fn mistral_nested_arguments() {
    let text = format!(r#"[TOOL_CALLS] [{{"name": "search", "arguments": {NESTED_ARGUMENTS}}}]"#);
    let output = parse(ToolCallParser::Mistral, &text);
    assert_eq!(calls(&output), vec![("search", nested_arguments())]);
}

#[test]
fn mistral_plain_text() {
    assert_plain(ToolCallParser::Mistral, "It is sunny in Paris.");
}

#[test]
fn mistral_malformed_calls_are_text() {
    for text in [
        r#"[TOOL_CALLS] [{"name": "get_time", "arguments": {}"#,
        r#"[TOOL_CALLS] []"#,
        r#"[TOOL_CALLS] "get_time""#,
        r#"[TOOL_CALLS] [{"name": "get_time", "arguments": {}}, 5]"#,
        r#"[TOOL_CALLS] [{"name": null, "arguments": {}}]"#,
        r#"[TOOL_CALLS] [{"name": "get_time", "arguments": true}]"#,
        r#"[TOOL_CALLS] [{"name": "get_time", "arguments": {}}] trailing words"#,
        // The v11 layout, malformed: unfinished, no `[ARGS]`, no name, not an object,
        // an undeclared function, words after the object.
        r#"[TOOL_CALLS]get_time[ARGS]{"#,
        r#"[TOOL_CALLS]get_time{}"#,
        r#"[TOOL_CALLS][ARGS]{}"#,
        r#"[TOOL_CALLS]get_time[ARGS][1]"#,
        r#"[TOOL_CALLS]nope[ARGS]{}"#,
        r#"[TOOL_CALLS]get_time[ARGS]{} trailing"#,
    ] {
        assert_plain(ToolCallParser::Mistral, text);
    }
}

#[test]
fn mistral_unknown_function_is_text() {
    assert_plain(
        ToolCallParser::Mistral,
        r#"[TOOL_CALLS] [{"name": "get_weather", "arguments": {}}, {"name": "nope", "arguments": {}}]"#,
    );
}

// ---- names and ids ----

#[test]
fn tool_calls_parser_names_are_vllms() {
    use clap::ValueEnum;
    for (parser, name) in [
        (ToolCallParser::Hermes, "hermes"),
        (ToolCallParser::Llama3Json, "llama3_json"),
        (ToolCallParser::Mistral, "mistral"),
    ] {
        assert_eq!(parser.name(), name);
        assert_eq!(ToolCallParser::from_str(name, false), Ok(parser));
    }
    assert!(ToolCallParser::from_str("qwen", false).is_err());
}

#[test]
fn tool_calls_ids_look_like_openais() {
    let id = call_id();
    let suffix = id.strip_prefix("call_").expect("call_ prefix");
    assert_eq!(suffix.len(), 24);
    assert!(suffix.chars().all(|c| c.is_ascii_alphanumeric()));
    assert_ne!(call_id(), id);
}
