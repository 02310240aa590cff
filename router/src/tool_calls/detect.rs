//! Which family's format a model writes calls in, when `--tool-call-parser` does not say: read
//! off the chat template, which prints the format it teaches the model.

use super::ToolCallParser;

/// The family a chat template's text shows, if any.
pub fn detect_parser(template: &str) -> Option<ToolCallParser> {
    if template.contains("<|tool_call|>") {
        Some(ToolCallParser::Granite)
    } else if template.contains("[func_name1(") {
        // The pythonic templates' instruction (vLLM's Llama 3.2 one, Llama 4's own).
        Some(ToolCallParser::Pythonic)
    } else if template.contains("<tool_call>") {
        Some(ToolCallParser::Hermes)
    } else if template.contains("[TOOL_CALLS]") {
        Some(ToolCallParser::Mistral)
    } else if template.contains("<|python_tag|>")
        || (template.contains("<|start_header_id|>") && template.contains("\"parameters\""))
    {
        Some(ToolCallParser::Llama3Json)
    } else {
        None
    }
}

/// The family a model's replies are read in. The flag names the base model's format, and
/// applies to every model whose template is the base model's; an adapter that ships its own
/// template (`adapters_own`) was tuned to write what that template teaches, so its family, when
/// the template shows one, comes first. Else the template's family; else hermes (the most
/// common format, also Qwen's).
pub fn parser_for(
    flag: Option<ToolCallParser>,
    template: Option<&str>,
    adapters_own: bool,
) -> ToolCallParser {
    let detected = template.and_then(detect_parser);
    let first = if adapters_own {
        detected.or(flag)
    } else {
        flag.or(detected)
    };
    first.unwrap_or(ToolCallParser::Hermes)
}
