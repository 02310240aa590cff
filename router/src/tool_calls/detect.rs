//! Which family's format a model writes calls in, when `--tool-call-parser` does not say: read
//! off the chat template, which prints the format it teaches the model.

use quiver_flags::ToolCallParser;

use super::registry::format_of;

/// The families in the order a template is tried against them, the first it shows winning:
/// the narrower signs first, Llama's JSON last (a pythonic template is a Llama template too, and
/// any template may print `"parameters"`).
const DETECTION_ORDER: [ToolCallParser; 5] = [
    ToolCallParser::Granite,
    ToolCallParser::Pythonic,
    ToolCallParser::Hermes,
    ToolCallParser::Mistral,
    ToolCallParser::Llama3Json,
];

/// The family a chat template's text shows, if any.
pub fn detect_parser(template: &str) -> Option<ToolCallParser> {
    DETECTION_ORDER
        .into_iter()
        .find(|parser| format_of(*parser).taught_by(template))
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
