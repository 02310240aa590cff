//! A marker, then a JSON array of `{"name": …, "arguments": {…}}` calls (a lone object is one
//! call); text before the marker is the reply's content. Mistral's tokenizers before v11
//! (`[TOOL_CALLS]`) and Granite 3 (`<|tool_call|>`) write calls so.

use serde_json::value::RawValue;

use super::{leading_json, non_blank, read_call, ParsedOutput};

/// The key the arguments are under.
pub(super) const ARGUMENTS: &[&str] = &["arguments"];

/// `None` when `text` has no `marker`, or what follows it is not a list of well-formed calls.
pub(super) fn parse(text: &str, marker: &str, declared: Option<&[String]>) -> Option<ParsedOutput> {
    let (before, after) = text.split_once(marker)?;
    let (value, trailing) = leading_json(after.trim_start())?;
    if non_blank(trailing).is_some() {
        return None;
    }
    let raw = value.get();
    let calls: Vec<&RawValue> = if raw.starts_with('[') {
        serde_json::from_str(raw).ok()?
    } else if raw.starts_with('{') {
        vec![value]
    } else {
        return None;
    };
    if calls.is_empty() {
        return None;
    }
    let tool_calls = calls
        .into_iter()
        .map(|call| read_call(call, ARGUMENTS, declared))
        .collect::<Option<Vec<_>>>()?;
    Some(ParsedOutput::with_calls(before, tool_calls))
}
