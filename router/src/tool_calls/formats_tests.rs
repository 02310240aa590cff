//! The formats added after the first three, on canned model text: Mistral's v11 layout,
//! Granite's list, pythonic calls. Each is read whole, streamed in pieces of every size adding
//! up to the whole reading, and cut by `max_tokens` inside a call.

use serde_json::{json, Value};

use super::stream_tests::{assert_stream_adds_up, assert_streamed_text};
use super::truncated::parse_reply;
use super::{format_of, ParsedOutput, ToolCallParser};

fn declared() -> Vec<String> {
    vec!["get_weather".to_owned(), "get_time".to_owned()]
}

/// `(name, arguments as JSON)` of each call, and the content.
fn read(parser: ToolCallParser, text: &str) -> (Option<String>, Vec<(String, Value)>) {
    let ParsedOutput {
        content,
        tool_calls,
    } = format_of(parser).parse(text, Some(&declared()));
    let calls = tool_calls
        .into_iter()
        .map(|call| {
            (
                call.name,
                serde_json::from_str(&call.arguments).expect("JSON arguments"),
            )
        })
        .collect();
    (content, calls)
}

fn call(name: &str, arguments: Value) -> (String, Value) {
    (name.to_owned(), arguments)
}

#[test]
fn mistral_v11_calls_each_after_their_marker() {
    let text = r#"Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]get_time[ARGS]{}"#;
    assert_eq!(
        read(ToolCallParser::Mistral, text),
        (
            Some("Checking.".to_owned()),
            vec![
                call("get_weather", json!({"city": "Paris", "days": 3})),
                call("get_time", json!({}))
            ]
        )
    );
    // v13's call id between the name and `[ARGS]` is read past.
    let with_id = r#"[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{"zone": "UTC"}"#;
    assert_eq!(
        read(ToolCallParser::Mistral, with_id).1,
        vec![call("get_time", json!({"zone": "UTC"}))]
    );
    // The list layout of older tokenizers still reads.
    let list = r#"[TOOL_CALLS][{"name": "get_time", "arguments": {}}]"#;
    assert_eq!(
        read(ToolCallParser::Mistral, list).1,
        vec![call("get_time", json!({}))]
    );
    for text in [text, with_id, list] {
        assert_stream_adds_up(ToolCallParser::Mistral, text);
    }
}

#[test]
fn granite_calls_are_a_list_after_its_marker() {
    let text = r#"<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"arguments": {}, "name": "get_time"}]"#;
    assert_eq!(
        read(ToolCallParser::Granite, text),
        (
            None,
            vec![
                call("get_weather", json!({"city": "Oslo"})),
                call("get_time", json!({}))
            ]
        )
    );
    assert_stream_adds_up(ToolCallParser::Granite, text);
    assert_streamed_text(
        ToolCallParser::Granite,
        "No tool needed: it is <|tool sunny.",
    );
    assert_streamed_text(
        ToolCallParser::Granite,
        r#"<|tool_call|>[{"name": "launch", "arguments": {}}]"#,
    );
}

#[test]
fn pythonic_calls_become_json_arguments() {
    let text = r#"[get_weather(city='Paris', days=3, units="metric", hourly=True, note=None, spots=[1, 2.5, -3], extra={'a': (1, 2)}), get_time()]"#;
    let (content, calls) = read(ToolCallParser::Pythonic, text);
    assert_eq!(content, None);
    assert_eq!(
        calls,
        vec![
            call(
                "get_weather",
                json!({"city": "Paris", "days": 3, "units": "metric", "hourly": true,
                                       "note": null, "spots": [1, 2.5, -3], "extra": {"a": [1, 2]}})
            ),
            call("get_time", json!({})),
        ]
    );
    // Llama 4's tags, escapes, a trailing comma, whitespace anywhere.
    let tagged =
        "<|python_start|>[ get_weather( city = 'It\\'s \\u00e9t\\u00e9' , ) ]<|python_end|>";
    assert_eq!(
        read(ToolCallParser::Pythonic, tagged).1,
        vec![call("get_weather", json!({"city": "It's été"}))]
    );
    for text in [text, tagged] {
        assert_stream_adds_up(ToolCallParser::Pythonic, text);
    }
}

#[test]
fn pythonic_text_is_text() {
    for text in [
        "It is sunny in Paris.",
        "[1] is a citation, not a call.",
        "[get_weather(city='Paris')] and then some words",
        "[launch(code=1)]",
        "[get_weather(city=paris)]",
        "[get_weather('Paris')]",
        "[]",
    ] {
        assert_streamed_text(ToolCallParser::Pythonic, text);
    }
}

#[test]
fn calls_cut_by_max_tokens_come_back_as_calls() {
    let declared = declared();
    let cut = |parser: ToolCallParser, text: &str| {
        let parsed = parse_reply(parser, text, &declared, true);
        let calls: Vec<(String, String)> = parsed
            .tool_calls
            .into_iter()
            .map(|c| (c.name, c.arguments))
            .collect();
        (parsed.content, calls)
    };
    let pair = |name: &str, arguments: &str| (name.to_owned(), arguments.to_owned());
    assert_eq!(
        cut(
            ToolCallParser::Mistral,
            r#"[TOOL_CALLS]get_time[ARGS]{}[TOOL_CALLS]get_weather[ARGS]{"city": "Pa"#
        ),
        (
            None,
            vec![
                pair("get_time", "{}"),
                pair("get_weather", r#"{"city": "Pa"#)
            ]
        )
    );
    assert_eq!(
        cut(
            ToolCallParser::Granite,
            r#"Sure.<|tool_call|>[{"name": "get_weather", "arguments": {"ci"#
        ),
        (
            Some("Sure.".to_owned()),
            vec![pair("get_weather", r#"{"ci"#)]
        )
    );
    // A pythonic call's arguments are known once it is complete; the cut one has none yet.
    assert_eq!(
        cut(
            ToolCallParser::Pythonic,
            "[get_time(), get_weather(city='Pa"
        ),
        (None, vec![pair("get_time", "{}"), pair("get_weather", "")])
    );
    // Cut before any name: no call, and the markup is not content.
    assert_eq!(
        cut(ToolCallParser::Pythonic, "[get_wea"),
        (None, Vec::new())
    );
    assert_eq!(
        cut(ToolCallParser::Granite, "<|tool_call|>[{\"na"),
        (None, Vec::new())
    );
}
