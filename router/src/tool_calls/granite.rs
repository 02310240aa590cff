//! IBM Granite 3: `<|tool_call|>` then a JSON array of `{"name", "arguments"}` (`json_list`).

use super::{json_list, ParsedOutput};

pub(super) const MARKER: &str = "<|tool_call|>";
pub(super) const ARGUMENTS: &[&str] = json_list::ARGUMENTS;

pub(super) fn parse(text: &str, declared: Option<&[String]>) -> Option<ParsedOutput> {
    json_list::parse(text, MARKER, declared)
}
