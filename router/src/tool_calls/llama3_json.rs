//! Llama 3.1 to 3.3 with JSON tool calls: the whole reply, after an optional `<|python_tag|>`,
//! is `{"name": …, "parameters": {…}}` (`"arguments"` is accepted too), or several such objects
//! separated by `;`. A reply that does not start that way is text.

use super::format::ToolCallFormat;
use super::json_calls::{leading_json, read_call};
use super::lark::{json_call_rules, marker, SpecialId};
use super::parsed::ParsedOutput;
use super::partial::{read_list, Scan};
use super::request::FunctionSpec;

const PYTHON_TAG: &str = "<|python_tag|>";
/// The keys the arguments are under, Llama's first.
const ARGUMENTS: &[&str] = &["parameters", "arguments"];

pub(super) struct Llama3Json;

impl ToolCallFormat for Llama3Json {
    fn markers(&self) -> &'static [&'static str] {
        &[PYTHON_TAG]
    }

    fn taught_by(&self, template: &str) -> bool {
        template.contains(PYTHON_TAG)
            || (template.contains("<|start_header_id|>") && template.contains("\"parameters\""))
    }

    fn call_instruction(&self) -> &'static str {
        "{\"name\": <function name>, \"parameters\": <arguments as a JSON object>} (calls \
         separated by \"; \") and nothing else."
    }

    /// `{"name": …, "parameters": {…}}` objects separated by `; `; in `auto`, text that does
    /// not open with `{`, or calls, after `<|python_tag|>` or not.
    fn grammar(
        &self,
        forced: bool,
        several: bool,
        functions: &[&FunctionSpec],
        special_id: SpecialId,
    ) -> (String, Vec<String>) {
        let calls = match several {
            true => "calls: call (\"; \" call)*",
            false => "calls: call",
        };
        let mut rules = vec![calls.to_owned()];
        let start = if forced {
            "calls".to_owned()
        } else {
            // Text may not start with `{` (or whitespace before one): that is how a call starts.
            rules.push(r"PLAIN: /([^{\s](.|\n)*)?/".to_owned());
            let tag = marker(PYTHON_TAG, special_id);
            format!("PLAIN | calls | {tag} calls")
        };
        rules.extend(json_call_rules(ARGUMENTS[0], functions));
        (start, rules)
    }

    fn read(&self, text: &str, declared: Option<&[String]>) -> Option<ParsedOutput> {
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

    fn scan<'a>(&self, text: &'a str) -> Scan<'a> {
        let mut scan = Scan::default();
        let trimmed = text.trim_start();
        let body = match trimmed.strip_prefix(PYTHON_TAG) {
            Some(after) => after.trim_start(),
            // Nothing yet, or the start of the tag: it may still become a call.
            None if PYTHON_TAG.starts_with(trimmed) => return scan,
            None if !trimmed.starts_with('{') => {
                scan.content.push_str(text);
                return scan;
            }
            None => trimmed,
        };
        read_list(body, ARGUMENTS, ";", &mut scan.calls);
        scan
    }
}
