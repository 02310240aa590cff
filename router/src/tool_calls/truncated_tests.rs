//! Replies cut by `max_tokens` inside their calls, in each family's format: the complete calls
//! whole, the cut one with its arguments so far, no markup as content; and what a cut reply
//! without calls keeps.

use super::truncated::parse_reply;
use super::{ParsedCall, ParsedOutput, ToolCallParser};

fn declared() -> Vec<String> {
    ["get_weather", "add"].map(String::from).to_vec()
}

fn cut(parser: ToolCallParser, text: &str) -> ParsedOutput {
    parse_reply(parser, text, &declared(), true)
}

fn call(name: &str, arguments: &str) -> ParsedCall {
    ParsedCall {
        name: name.to_owned(),
        arguments: arguments.to_owned(),
    }
}

const WEATHER: &str = r#"{"name": "get_weather", "arguments": {"city": "Oslo"}}"#;

#[test]
fn hermes_calls_cut_inside_the_second_one() {
    let text = format!(
        "<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{}",
        r#"{"name": "add", "arguments": {"a": 1, "b"#
    );
    let output = cut(ToolCallParser::Hermes, &text);
    assert_eq!(output.content, None);
    assert_eq!(
        output.tool_calls,
        vec![
            call("get_weather", r#"{"city": "Oslo"}"#),
            call("add", r#"{"a": 1, "b"#)
        ]
    );
}

#[test]
fn hermes_cut_before_a_name_is_complete_keeps_the_calls_before_and_the_text() {
    let text = format!("Checking.<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{{\"na");
    let output = cut(ToolCallParser::Hermes, &text);
    // Text between blocks is content, as in a reply that finished.
    assert_eq!(output.content.as_deref(), Some("Checking.\n"));
    assert_eq!(
        output.tool_calls,
        vec![call("get_weather", r#"{"city": "Oslo"}"#)]
    );

    let only_markup = cut(
        ToolCallParser::Hermes,
        "Sure. <tool_call>\n{\"name\": \"get_w",
    );
    assert_eq!(only_markup.content.as_deref(), Some("Sure. "));
    assert!(only_markup.tool_calls.is_empty());
}

#[test]
fn hermes_cut_right_after_the_arguments_name() {
    let output = cut(
        ToolCallParser::Hermes,
        "<tool_call>\n{\"name\": \"add\", \"arguments\": ",
    );
    assert_eq!(output.tool_calls, vec![call("add", "")]);
    assert_eq!(output.content, None);
}

#[test]
fn mistral_and_llama3_cut_calls() {
    let mistral = cut(
        ToolCallParser::Mistral,
        &format!(
            "[TOOL_CALLS] [{WEATHER}, {}",
            r#"{"name": "add", "arguments": {"a": 4"#
        ),
    );
    assert_eq!(mistral.content, None);
    assert_eq!(
        mistral.tool_calls,
        vec![
            call("get_weather", r#"{"city": "Oslo"}"#),
            call("add", r#"{"a": 4"#)
        ]
    );
    let llama = cut(
        ToolCallParser::Llama3Json,
        r#"<|python_tag|>{"name": "get_weather", "parameters": {"city": "Os"#,
    );
    assert_eq!(llama.content, None);
    assert_eq!(
        llama.tool_calls,
        vec![call("get_weather", r#"{"city": "Os"#)]
    );
}

#[test]
fn a_cut_inside_the_next_marker_leaves_it_out_of_the_content() {
    let text = format!("<tool_call>\n{WEATHER}\n</tool_call>\n\n<tool_c");
    let output = cut(ToolCallParser::Hermes, &text);
    assert_eq!(output.content, None);
    assert_eq!(
        output.tool_calls,
        vec![call("get_weather", r#"{"city": "Oslo"}"#)]
    );
}

#[test]
fn an_undeclared_name_ends_the_calls_read() {
    let text = format!(
        "<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{}",
        r#"{"name": "delete_all", "arguments": {"#
    );
    let output = cut(ToolCallParser::Hermes, &text);
    assert_eq!(
        output.tool_calls,
        vec![call("get_weather", r#"{"city": "Oslo"}"#)]
    );
    assert_eq!(output.content, None);
}

#[test]
fn a_cut_reply_without_calls_is_its_text() {
    for parser in [
        ToolCallParser::Hermes,
        ToolCallParser::Mistral,
        ToolCallParser::Llama3Json,
    ] {
        let output = cut(parser, "The weather in Oslo is");
        assert_eq!(output.content.as_deref(), Some("The weather in Oslo is"));
        assert!(output.tool_calls.is_empty());
    }
}

#[test]
fn a_reply_that_ended_on_its_own_is_parsed_as_before() {
    // Not cut: an unfinished call is malformed output, returned whole as content.
    let text = r#"<tool_call>\n{"name": "add", "arguments": {"a": 1"#;
    let output = parse_reply(ToolCallParser::Hermes, text, &declared(), false);
    assert_eq!(output.content.as_deref(), Some(text));
    assert!(output.tool_calls.is_empty());
}
