//! A marker, then a JSON array of `{"name": …, "arguments": {…}}` calls (a lone object is one
//! call); text before the marker is the reply's content. Mistral's tokenizers before v11
//! (`[TOOL_CALLS]`) and Granite 3 (`<|tool_call|>`) write calls so: the layout both formats
//! share, read whole, read in progress, and as grammar.

use serde_json::value::RawValue;

use super::json_calls::{leading_json, read_call};
use super::lark::{json_call_rules, marker, opening_after_text, SpecialId, TEXT};
use super::parsed::{non_blank, ParsedOutput};
use super::partial::{read_list, without_marker_start, Scan};
use super::request::FunctionSpec;

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

/// `marker` then a JSON array of calls (or one object), text before it the content.
pub(super) fn scan<'a>(text: &'a str, marker: &str) -> Scan<'a> {
    let mut scan = Scan::default();
    let Some(start) = text.find(marker) else {
        scan.content.push_str(without_marker_start(text, marker));
        return scan;
    };
    scan.content.push_str(&text[..start]);
    let after = text[start + marker.len()..].trim_start();
    match after.strip_prefix('[') {
        Some(list) => read_list(list, ARGUMENTS, ",", &mut scan.calls),
        None => read_list(after, ARGUMENTS, "", &mut scan.calls),
    }
    scan
}

/// `marker` then a JSON array of calls, after free text in `auto`.
pub(super) fn grammar(
    text_marker: &str,
    forced: bool,
    several: bool,
    functions: &[&FunctionSpec],
    special_id: SpecialId,
) -> (String, Vec<String>) {
    let open = marker(text_marker, special_id);
    let calls = match several {
        true => "calls: \"[\" call (\", \" call)* \"]\"",
        false => "calls: \"[\" call \"]\"",
    };
    let mut rules = vec![calls.to_owned()];
    let start = if forced {
        format!("{open} calls")
    } else {
        rules.push(TEXT.to_owned());
        rules.push(opening_after_text(&open, text_marker));
        "TEXT | opening calls".to_owned()
    };
    rules.extend(json_call_rules(ARGUMENTS[0], functions));
    (start, rules)
}
