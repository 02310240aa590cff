//! Tools for a chat template that does not read `tools`: described in a system message instead
//! (the "system-prompt injection" of docs/tool-calling.md), in the call format the reply is
//! held to, so the model sees what it may call and how. Templates that read `tools` render them
//! their own way and get nothing added.

use quiver_flags::ToolCallParser;
use serde_json::json;

use super::registry::format_of;
use super::request::{ToolChoice, ToolRequest};

/// Whether a template's source reads a variable named `tools` (as a whole identifier:
/// `tools_in_user_message` or `custom_tools` are other variables).
pub fn template_reads_tools(source: &str) -> bool {
    let identifier = |c: char| c.is_ascii_alphanumeric() || c == '_';
    source.match_indices("tools").any(|(at, _)| {
        let before = source[..at].chars().next_back();
        let after = source[at + "tools".len()..].chars().next();
        !before.is_some_and(identifier) && !after.is_some_and(identifier)
    })
}

/// The system text describing `request`'s tools, or `None` when none is needed: no template
/// (the request fails elsewhere), a template that reads `tools`, or `tool_choice: "none"`.
pub fn tool_system_prompt(
    parser: ToolCallParser,
    request: &ToolRequest,
    template_source: Option<&str>,
) -> Option<String> {
    let source = template_source?;
    if request.choice == ToolChoice::None || template_reads_tools(source) {
        return None;
    }
    let mut text = String::from(
        "You can call the following functions. Each is given as a JSON object with its name and \
         the JSON schema of its arguments:\n",
    );
    for function in &request.functions {
        let line = json!({"name": function.name, "parameters": function.parameters});
        text.push_str(&line.to_string());
        text.push('\n');
    }
    text.push_str("To call a function, reply with ");
    text.push_str(format_of(parser).call_instruction());
    Some(text)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::tool_calls::request::{check_tool_request, ToolFields};

    fn request(choice: serde_json::Value) -> ToolRequest {
        let tools = json!([{"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
        check_tool_request(ToolFields {
            tools: Some(&tools),
            tool_choice: Some(&choice),
            ..ToolFields::default()
        })
        .unwrap()
        .unwrap()
    }

    #[test]
    fn reads_tools_only_as_a_whole_identifier() {
        assert!(template_reads_tools(
            "{% if tools %}{{ tools | tojson }}{% endif %}"
        ));
        assert!(template_reads_tools("{%- for t in tools -%}"));
        assert!(!template_reads_tools(
            "{% if custom_tools %}{{ tools_in_user_message }}{% endif %}"
        ));
        assert!(!template_reads_tools(
            "{% for m in messages %}{{ m.content }}{% endfor %}"
        ));
    }

    #[test]
    fn a_template_without_tools_gets_them_in_the_call_format() {
        let template = "{% for m in messages %}{{ m.content }}{% endfor %}";
        for (parser, marker) in [
            (ToolCallParser::Hermes, "<tool_call>"),
            (ToolCallParser::Llama3Json, "\"parameters\""),
            (ToolCallParser::Mistral, "[TOOL_CALLS]"),
            (ToolCallParser::Granite, "<|tool_call|>"),
            (ToolCallParser::Pythonic, "[function_name(argument=value"),
        ] {
            let text = tool_system_prompt(parser, &request(json!("auto")), Some(template))
                .expect("a prompt");
            assert!(text.contains(r#""name":"get_weather""#), "{text}");
            assert!(text.contains(r#""city":{"type":"string"}"#), "{text}");
            assert!(text.contains(marker), "{parser:?}: {text}");
        }
    }

    #[test]
    fn nothing_is_added_where_it_is_not_needed() {
        let plain = "{% for m in messages %}{{ m.content }}{% endfor %}";
        let hermes = ToolCallParser::Hermes;
        assert_eq!(
            tool_system_prompt(hermes, &request(json!("none")), Some(plain)),
            None
        );
        let reads = "{{ tools | tojson }}{% for m in messages %}{{ m.content }}{% endfor %}";
        assert_eq!(
            tool_system_prompt(hermes, &request(json!("required")), Some(reads)),
            None
        );
        assert_eq!(
            tool_system_prompt(hermes, &request(json!("auto")), None),
            None
        );
    }
}
