//! IBM Granite 3: `<|tool_call|>` then a JSON array of `{"name", "arguments"}` (`json_list`).

use super::format::ToolCallFormat;
use super::json_list;
use super::lark::SpecialId;
use super::parsed::ParsedOutput;
use super::partial::Scan;
use super::request::FunctionSpec;

const MARKER: &str = "<|tool_call|>";

pub(super) struct Granite;

impl ToolCallFormat for Granite {
    fn markers(&self) -> &'static [&'static str] {
        &[MARKER]
    }

    fn taught_by(&self, template: &str) -> bool {
        template.contains(MARKER)
    }

    fn call_instruction(&self) -> &'static str {
        "<|tool_call|>[{\"name\": <function name>, \"arguments\": <arguments as a JSON \
         object>}] (one list entry per call)."
    }

    fn grammar(
        &self,
        forced: bool,
        several: bool,
        functions: &[&FunctionSpec],
        special_id: SpecialId,
    ) -> (String, Vec<String>) {
        json_list::grammar(MARKER, forced, several, functions, special_id)
    }

    fn read(&self, text: &str, declared: Option<&[String]>) -> Option<ParsedOutput> {
        json_list::parse(text, MARKER, declared)
    }

    fn scan<'a>(&self, text: &'a str) -> Scan<'a> {
        json_list::scan(text, MARKER)
    }
}
