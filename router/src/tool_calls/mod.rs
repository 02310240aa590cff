//! Tool calling on `/v1/chat/completions`: the request's tools checked (`request`), the grammar
//! that constrains a reply to calls of them (`grammar`), and the reply read back into calls, one
//! parser per model family, named as vLLM's `--tool-call-parser` names them: whole (`parse`) or
//! as it streams (`stream`). See docs/tool-calling.md.
//!
//! A parser never fails: output holding a malformed call (invalid JSON, a missing or
//! non-string `name`, `arguments` that are not an object, a function that was not declared)
//! is returned whole as plain content, as if the model had written no call at all.

mod detect;
#[cfg(test)]
mod formats_tests;
mod grammar;
mod granite;
mod hermes;
mod json_list;
mod llama3_json;
mod mistral;
mod partial;
mod plan;
#[cfg(test)]
mod plan_tests;
mod prompt;
mod pythonic;
mod pythonic_grammar;
mod request;
mod stream;
#[cfg(test)]
mod tests;
mod truncated;
#[cfg(test)]
mod truncated_tests;

use std::collections::HashMap;

use serde_json::value::RawValue;
use serde_json::Value;

pub use detect::{detect_parser, parser_for};
pub use grammar::tool_grammar;
pub use plan::ToolPlan;
pub use prompt::{template_reads_tools, tool_system_prompt};
pub use quiver_flags::ToolCallParser;
pub use request::{check_tool_request, FunctionSpec, ToolChoice, ToolFields, ToolRequest};
pub use stream::{ToolCallStream, ToolDelta};

use crate::openai::common::random_id;

/// One call read from the output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParsedCall {
    pub name: String,
    /// OpenAI's `function.arguments`: the object exactly as the model wrote it (so that streamed
    /// pieces add up to it), or, when the model wrote it as a JSON string, the object inside.
    pub arguments: String,
}

/// A reply split into its text and its calls.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParsedOutput {
    /// The text outside the calls, as written; `None` when there is none but whitespace.
    pub content: Option<String>,
    pub tool_calls: Vec<ParsedCall>,
}

impl ParsedOutput {
    /// The output as it was, without calls.
    fn plain(text: &str) -> Self {
        Self {
            content: non_blank(text).map(|_| text.to_owned()),
            tool_calls: Vec::new(),
        }
    }

    /// Text and calls; the text kept whole unless it is blank.
    fn with_calls(content: &str, tool_calls: Vec<ParsedCall>) -> Self {
        Self {
            content: non_blank(content).map(|_| content.to_owned()),
            tool_calls,
        }
    }
}

/// Reading a reply in a family's format.
pub trait ToolCallFormat {
    /// Splits `text`, a model's complete output, into content and calls. With `declared`, a call
    /// must name one of those functions.
    fn parse(self, text: &str, declared: Option<&[String]>) -> ParsedOutput;
}

impl ToolCallFormat for ToolCallParser {
    fn parse(self, text: &str, declared: Option<&[String]>) -> ParsedOutput {
        let parsed = match self {
            Self::Hermes => hermes::parse(text, declared),
            Self::Llama3Json => llama3_json::parse(text, declared),
            Self::Mistral => mistral::parse(text, declared),
            Self::Granite => granite::parse(text, declared),
            Self::Pythonic => pythonic::parse(text, declared),
        };
        parsed.unwrap_or_else(|| ParsedOutput::plain(text))
    }
}

/// A fresh OpenAI-style tool call id: `call_` + 24 random alphanumerics.
pub fn call_id() -> String {
    random_id("call_")
}

/// Reads one `{"name": …, <arguments key>: {…}}` object (raw JSON text), the first of
/// `argument_keys` present holding the arguments. `None` when it is not a well-formed call of a
/// declared function.
fn read_call(
    raw: &RawValue,
    argument_keys: &[&str],
    declared: Option<&[String]>,
) -> Option<ParsedCall> {
    let fields: HashMap<String, &RawValue> = serde_json::from_str(raw.get()).ok()?;
    let name: String = serde_json::from_str(fields.get("name")?.get()).ok()?;
    if declared.is_some_and(|names| !names.contains(&name)) {
        return None;
    }
    let arguments = argument_keys.iter().find_map(|key| fields.get(*key))?;
    Some(ParsedCall {
        name,
        arguments: argument_text(arguments)?,
    })
}

/// An object as written, or a JSON string holding one (some models write OpenAI's string form).
fn argument_text(arguments: &RawValue) -> Option<String> {
    match serde_json::from_str::<Value>(arguments.get()).ok()? {
        Value::Object(_) => Some(arguments.get().to_owned()),
        Value::String(text) => match serde_json::from_str(&text).ok()? {
            Value::Object(object) => Some(Value::Object(object).to_string()),
            _ => None,
        },
        _ => None,
    }
}

/// Reads the JSON value at the start of `text`, returning it raw and the text after it.
fn leading_json(text: &str) -> Option<(&RawValue, &str)> {
    let mut values = serde_json::Deserializer::from_str(text).into_iter::<&RawValue>();
    let value = values.next()?.ok()?;
    Some((value, &text[values.byte_offset()..]))
}

/// `text` trimmed, or `None` when nothing but whitespace.
fn non_blank(text: &str) -> Option<&str> {
    let trimmed = text.trim();
    (!trimmed.is_empty()).then_some(trimmed)
}
