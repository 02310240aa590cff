//! Families detected from chat templates, canned and published.

use serde_json::Value;

use super::{detect_parser, parser_for, ToolCallParser};

#[test]
fn parsers_are_detected_from_templates() {
    let qwen = "{%- if tools %}<tools>{{ tool | tojson }}</tools> ... <tool_call>\n{\"name\": ...";
    let llama = "<|start_header_id|>ipython<|end_header_id|> {\"name\": function name, \"parameters\": dictionary}";
    let llama_tag = "{{- '<|python_tag|>' + tool_call.name }}";
    let mistral = "{{- '[TOOL_CALLS] [' }}";
    assert_eq!(detect_parser(qwen), Some(ToolCallParser::Hermes));
    assert_eq!(detect_parser(llama), Some(ToolCallParser::Llama3Json));
    assert_eq!(detect_parser(llama_tag), Some(ToolCallParser::Llama3Json));
    assert_eq!(detect_parser(mistral), Some(ToolCallParser::Mistral));
    let mistral_v11 = "{{- '[TOOL_CALLS]' + tool.function.name + '[ARGS]' + arguments }}";
    assert_eq!(detect_parser(mistral_v11), Some(ToolCallParser::Mistral));
    // Llama 4's own instruction for its pythonic calls.
    let llama4 = "you MUST put it in the format of [func_name1(params_name1=params_value1, \
                  params_name2=params_value2...), func_name2(params)]";
    assert_eq!(detect_parser(llama4), Some(ToolCallParser::Pythonic));
    assert_eq!(detect_parser("{{ messages }}"), None);
    assert_eq!(
        parser_for(None, Some("{{ messages }}"), false),
        ToolCallParser::Hermes
    );
    assert_eq!(parser_for(None, None, false), ToolCallParser::Hermes);
    assert_eq!(
        parser_for(Some(ToolCallParser::Mistral), Some(qwen), false),
        ToolCallParser::Mistral
    );
    // An adapter's own template: its family before the flag, the flag where it shows none.
    let flag = Some(ToolCallParser::Granite);
    assert_eq!(parser_for(flag, Some(qwen), true), ToolCallParser::Hermes);
    assert_eq!(
        parser_for(flag, Some("{{ messages }}"), true),
        ToolCallParser::Granite
    );
}

/// The published templates in testdata/chat-templates (copied from the models' repositories)
/// are detected as their models' families.
#[test]
fn published_templates_are_detected_as_their_family() {
    let template = |name: &str| -> String {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../testdata/chat-templates")
            .join(format!("{name}.json"));
        let file: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        file["chat_template"].as_str().unwrap().to_owned()
    };
    for (name, parser) in [
        ("granite-3.2-instruct", ToolCallParser::Granite),
        ("hermes-2-pro-tool-use", ToolCallParser::Hermes),
        ("qwen2.5-instruct", ToolCallParser::Hermes),
        ("llama-3.1-instruct", ToolCallParser::Llama3Json),
        ("llama-3.2-instruct", ToolCallParser::Llama3Json),
        ("mistral-7b-instruct-v0.3", ToolCallParser::Mistral),
        ("mistral-nemo-instruct-2407", ToolCallParser::Mistral),
    ] {
        assert_eq!(detect_parser(&template(name)), Some(parser), "{name}");
    }
}
