//! Hermes and Qwen2.5/Qwen3: each call is `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>`;
//! text before, between and after the blocks is the reply's content.

use super::{leading_json, non_blank, read_call, ParsedCall, ParsedOutput};

pub(super) const START: &str = "<tool_call>";
pub(super) const END: &str = "</tool_call>";
/// The key the arguments are under.
pub(super) const ARGUMENTS: &[&str] = &["arguments"];

/// `None` when `text` holds no call or a malformed one.
pub(super) fn parse(text: &str, declared: Option<&[String]>) -> Option<ParsedOutput> {
    let mut content = String::new();
    let mut tool_calls = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find(START) {
        content.push_str(&rest[..start]);
        let after_start = &rest[start + START.len()..];
        // The last block may lack its end tag when generation stopped right after the JSON.
        let (body, after_end) = match after_start.find(END) {
            Some(end) => (&after_start[..end], &after_start[end + END.len()..]),
            None => (after_start, ""),
        };
        tool_calls.push(read_block(body, declared)?);
        rest = after_end;
    }
    if tool_calls.is_empty() {
        return None;
    }
    content.push_str(rest);
    Some(ParsedOutput::with_calls(&content, tool_calls))
}

/// One block's body: a single JSON call and nothing else but whitespace.
fn read_block(body: &str, declared: Option<&[String]>) -> Option<ParsedCall> {
    let (value, after) = leading_json(body.trim_start())?;
    if non_blank(after).is_some() {
        return None;
    }
    read_call(value, ARGUMENTS, declared)
}
