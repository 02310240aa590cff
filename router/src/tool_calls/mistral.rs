//! Mistral and Mixtral: `[TOOL_CALLS]`, then the calls; text before the marker is the reply's
//! content. Tokenizers before v11 write a JSON array of `{"name", "arguments"}` after one marker
//! (`json_list`); from v11 on, each call is `[TOOL_CALLS]name[ARGS]{…}` (v13 puts
//! `[CALL_ID]id` between the name and `[ARGS]`), the arguments a bare JSON object.

use super::{argument_text, json_list, leading_json, non_blank, ParsedCall, ParsedOutput};

pub(super) const MARKER: &str = "[TOOL_CALLS]";
/// v11 on: what ends a call's name and opens its arguments.
pub(super) const ARGS: &str = "[ARGS]";
/// v13 on: the call id the model writes between the name and `[ARGS]`.
pub(super) const CALL_ID: &str = "[CALL_ID]";
pub(super) const ARGUMENTS: &[&str] = json_list::ARGUMENTS;

/// `None` when `text` has no marker, or what follows it is not well-formed calls in either
/// layout.
pub(super) fn parse(text: &str, declared: Option<&[String]>) -> Option<ParsedOutput> {
    let (before, after) = text.split_once(MARKER)?;
    if after.trim_start().starts_with(['[', '{']) {
        return json_list::parse(text, MARKER, declared);
    }
    let tool_calls = after
        .split(MARKER)
        .map(|call| read_v11_call(call, declared))
        .collect::<Option<Vec<_>>>()?;
    Some(ParsedOutput::with_calls(before, tool_calls))
}

/// `name[ARGS]{…}` (or `name[CALL_ID]id[ARGS]{…}`), nothing but whitespace after the object.
fn read_v11_call(call: &str, declared: Option<&[String]>) -> Option<ParsedCall> {
    let (name, arguments) = call.split_once(ARGS)?;
    let name = v11_name(name)?;
    if declared.is_some_and(|names| !names.iter().any(|declared| declared == name)) {
        return None;
    }
    let (value, trailing) = leading_json(arguments.trim_start())?;
    if non_blank(trailing).is_some() {
        return None;
    }
    Some(ParsedCall {
        name: name.to_owned(),
        arguments: argument_text(value)?,
    })
}

/// The name written before `[ARGS]`, without a v13 call id; `None` when empty.
pub(super) fn v11_name(written: &str) -> Option<&str> {
    let name = written
        .split_once(CALL_ID)
        .map_or(written, |(name, _)| name)
        .trim();
    non_blank(name)
}
