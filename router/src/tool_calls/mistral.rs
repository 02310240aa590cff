//! Mistral and Mixtral (tokenizers before v11): `[TOOL_CALLS]` then a JSON array of
//! `{"name": …, "arguments": {…}}`; text before the marker is the reply's content. The v11
//! form, `[TOOL_CALLS]name[ARGS]{…}`, is not read (it stays text).

use serde_json::Value;

use super::{leading_json, non_blank, read_call, ParsedOutput};

const MARKER: &str = "[TOOL_CALLS]";

/// `None` when `text` has no marker, or what follows it is not a list of well-formed calls.
pub(super) fn parse(text: &str, declared: Option<&[String]>) -> Option<ParsedOutput> {
    let (before, after) = text.split_once(MARKER)?;
    let (value, trailing) = leading_json(after.trim_start())?;
    if non_blank(trailing).is_some() {
        return None;
    }
    let calls = match value {
        Value::Array(calls) => calls,
        // A lone object is one call.
        call @ Value::Object(_) => vec![call],
        _ => return None,
    };
    if calls.is_empty() {
        return None;
    }
    let tool_calls = calls
        .iter()
        .map(|call| read_call(call, &["arguments"], declared))
        .collect::<Option<Vec<_>>>()?;
    Some(ParsedOutput {
        content: non_blank(before).map(str::to_owned),
        tool_calls,
    })
}
