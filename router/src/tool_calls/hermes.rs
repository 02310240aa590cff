//! Hermes and Qwen2.5/Qwen3: each call is `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>`;
//! text before, between and after the blocks is the reply's content.

use super::format::ToolCallFormat;
use super::json_calls::{leading_json, read_call};
use super::lark::{json_call_rules, marker, opening_after_text, SpecialId, TEXT};
use super::parsed::{non_blank, ParsedCall, ParsedOutput};
use super::partial::{read, without_marker_start, Read, Scan};
use super::request::FunctionSpec;

pub(super) const START: &str = "<tool_call>";
pub(super) const END: &str = "</tool_call>";
/// The key the arguments are under.
const ARGUMENTS: &[&str] = &["arguments"];

pub(super) struct Hermes;

impl ToolCallFormat for Hermes {
    fn markers(&self) -> &'static [&'static str] {
        &[START, END]
    }

    fn taught_by(&self, template: &str) -> bool {
        template.contains(START)
    }

    fn call_instruction(&self) -> &'static str {
        "<tool_call>\n{\"name\": <function name>, \"arguments\": <arguments as a JSON \
         object>}\n</tool_call>\n(one such block per call)."
    }

    /// `<tool_call>\n{…}\n</tool_call>` blocks, separated by a newline when forced.
    fn grammar(
        &self,
        forced: bool,
        several: bool,
        functions: &[&FunctionSpec],
        special_id: SpecialId,
    ) -> (String, Vec<String>) {
        let open = marker(START, special_id);
        let close = marker(END, special_id);
        let mut rules = vec![format!("block_rest: \"\\n\" call \"\\n\" {close}")];
        let start = if forced {
            rules.push(format!("block: {open} block_rest"));
            match several {
                true => "block (\"\\n\" block)*".to_owned(),
                false => "block".to_owned(),
            }
        } else {
            rules.push(TEXT.to_owned());
            rules.push(opening_after_text(&open, START));
            match several {
                true => "(opening block_rest)* TEXT".to_owned(),
                false => "TEXT | opening block_rest".to_owned(),
            }
        };
        rules.extend(json_call_rules(ARGUMENTS[0], functions));
        (start, rules)
    }

    fn read(&self, text: &str, declared: Option<&[String]>) -> Option<ParsedOutput> {
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

    fn scan<'a>(&self, text: &'a str) -> Scan<'a> {
        let mut scan = Scan::default();
        let mut rest = text;
        loop {
            let Some(start) = rest.find(START) else {
                scan.content.push_str(without_marker_start(rest, START));
                return scan;
            };
            scan.content.push_str(&rest[..start]);
            let body = rest[start + START.len()..].trim_start();
            let Read::Call(call, end) = read(body, ARGUMENTS) else {
                return scan;
            };
            scan.calls.push(call);
            let Some(end) = end else { return scan };
            match body[end..].trim_start().strip_prefix(END) {
                Some(after) => rest = after,
                None => return scan,
            }
        }
    }
}

/// One block's body: a single JSON call and nothing else but whitespace.
fn read_block(body: &str, declared: Option<&[String]>) -> Option<ParsedCall> {
    let (value, after) = leading_json(body.trim_start())?;
    if non_blank(after).is_some() {
        return None;
    }
    read_call(value, ARGUMENTS, declared)
}
