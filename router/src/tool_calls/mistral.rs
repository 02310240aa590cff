//! Mistral and Mixtral: `[TOOL_CALLS]`, then the calls; text before the marker is the reply's
//! content. Tokenizers before v11 write a JSON array of `{"name", "arguments"}` after one marker
//! (`json_list`); from v11 on, each call is `[TOOL_CALLS]name[ARGS]{…}` (v13 puts
//! `[CALL_ID]id` between the name and `[ARGS]`), the arguments a bare JSON object.

use std::borrow::Cow;

use super::format::ToolCallFormat;
use super::json_calls::{argument_text, leading_json};
use super::json_list;
use super::lark::{
    arguments_rule, call_choice, marker, opening_after_text, string, SpecialId, TEXT,
};
use super::parsed::{non_blank, ParsedCall, ParsedOutput};
use super::partial::{value_end, PartialCall, Scan};
use super::request::FunctionSpec;

const MARKER: &str = "[TOOL_CALLS]";
/// v11 on: what ends a call's name and opens its arguments.
const ARGS: &str = "[ARGS]";
/// v13 on: the call id the model writes between the name and `[ARGS]`.
const CALL_ID: &str = "[CALL_ID]";

pub(super) struct Mistral;

impl ToolCallFormat for Mistral {
    fn markers(&self) -> &'static [&'static str] {
        &[MARKER, ARGS, CALL_ID]
    }

    fn taught_by(&self, template: &str) -> bool {
        template.contains(MARKER)
    }

    fn call_instruction(&self) -> &'static str {
        "[TOOL_CALLS][{\"name\": <function name>, \"arguments\": <arguments as a JSON \
         object>}] (one list entry per call)."
    }

    /// Mistral's tokenizers from v11 on have `[ARGS]` as a token: calls are
    /// `[TOOL_CALLS]name[ARGS]{…}`; before, the JSON list.
    fn grammar(
        &self,
        forced: bool,
        several: bool,
        functions: &[&FunctionSpec],
        special_id: SpecialId,
    ) -> (String, Vec<String>) {
        if special_id(ARGS).is_none() {
            return json_list::grammar(MARKER, forced, several, functions, special_id);
        }
        let (start, mut rules) = v11_rules(forced, several, special_id);
        rules.extend(v11_call_rules(functions, special_id));
        (start, rules)
    }

    /// `None` when `text` has no marker, or what follows it is not well-formed calls in either
    /// layout.
    fn read(&self, text: &str, declared: Option<&[String]>) -> Option<ParsedOutput> {
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

    fn scan<'a>(&self, text: &'a str) -> Scan<'a> {
        let Some(start) = text.find(MARKER) else {
            return json_list::scan(text, MARKER);
        };
        let after = &text[start + MARKER.len()..];
        if after.trim_start().is_empty() || after.trim_start().starts_with(['[', '{']) {
            return json_list::scan(text, MARKER);
        }
        // v11 on: `name[ARGS]{…}` after each marker.
        let mut scan = Scan::default();
        scan.content.push_str(&text[..start]);
        for call in after.split(MARKER) {
            let Some((name, arguments)) = call.split_once(ARGS) else {
                return scan;
            };
            let Some(name) = v11_name(name) else {
                return scan;
            };
            let arguments = arguments.trim_start();
            let arguments = match value_end(arguments) {
                Some(end) => &arguments[..end],
                None if arguments.starts_with('{') => arguments,
                None => "",
            };
            scan.calls.push(PartialCall {
                name: name.to_owned(),
                arguments: Cow::Borrowed(arguments),
            });
        }
        scan
    }
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
fn v11_name(written: &str) -> Option<&str> {
    let name = written
        .split_once(CALL_ID)
        .map_or(written, |(name, _)| name)
        .trim();
    non_blank(name)
}

/// From v11: `[TOOL_CALLS]name[ARGS]{…}` per call, after free text in `auto`.
fn v11_rules(forced: bool, several: bool, special_id: SpecialId) -> (String, Vec<String>) {
    let open = marker(MARKER, special_id);
    let calls = match several {
        true => format!("calls: call ({open} call)*"),
        false => "calls: call".to_owned(),
    };
    let mut rules = vec![calls];
    let start = if forced {
        format!("{open} calls")
    } else {
        rules.push(TEXT.to_owned());
        rules.push(opening_after_text(&open, MARKER));
        "TEXT | opening calls".to_owned()
    };
    (start, rules)
}

/// `call` in the v11 layout: the name, `[ARGS]`, the arguments object.
fn v11_call_rules(functions: &[&FunctionSpec], special_id: SpecialId) -> Vec<String> {
    let args = marker(ARGS, special_id);
    let mut rules = vec![call_choice(functions)];
    for (i, function) in functions.iter().enumerate() {
        rules.push(format!(
            "fn_{i}: {} {args} args_{i}",
            string(&function.name)
        ));
        rules.push(arguments_rule(i, function));
    }
    rules
}
