//! Llama 3.1 to 3.3 with JSON tool calls: the whole reply, after an optional `<|python_tag|>`,
//! is `{"name": …, "parameters": {…}}` (`"arguments"` is accepted too), or several such objects
//! separated by `;`. A reply that does not start that way is text.

use super::{leading_json, read_call, ParsedOutput};

pub(super) const PYTHON_TAG: &str = "<|python_tag|>";
/// The keys the arguments are under, Llama's first.
pub(super) const ARGUMENTS: &[&str] = &["parameters", "arguments"];

/// `None` when `text` is not made of calls alone, or one of them is malformed.
pub(super) fn parse(text: &str, declared: Option<&[String]>) -> Option<ParsedOutput> {
    let trimmed = text.trim_start();
    let mut rest = trimmed
        .strip_prefix(PYTHON_TAG)
        .unwrap_or(trimmed)
        .trim_start();
    if !rest.starts_with('{') {
        return None;
    }
    let mut tool_calls = Vec::new();
    loop {
        let (value, after) = leading_json(rest)?;
        tool_calls.push(read_call(value, ARGUMENTS, declared)?);
        let after = after.trim_start();
        if after.is_empty() {
            break;
        }
        rest = after.strip_prefix(';')?.trim_start();
        // A `;` after the last object is tolerated.
        if rest.is_empty() {
            break;
        }
    }
    Some(ParsedOutput {
        content: None,
        tool_calls,
    })
}
