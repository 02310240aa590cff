//! Which family's format a model writes calls in, when `--tool-call-parser` does not say: read
//! off the chat template, which prints the format it teaches the model.

use super::ToolCallParser;

/// The family a chat template's text shows, if any.
pub fn detect_parser(template: &str) -> Option<ToolCallParser> {
    if template.contains("<tool_call>") {
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

/// The flag, else the template's family, else hermes (the most common format, also Qwen's).
pub fn parser_for(flag: Option<ToolCallParser>, template: Option<&str>) -> ToolCallParser {
    flag.or_else(|| template.and_then(detect_parser))
        .unwrap_or(ToolCallParser::Hermes)
}
