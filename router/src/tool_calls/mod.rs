//! Tool calls parsed out of a model's finished output, one parser per model family, named as
//! vLLM's `--tool-call-parser` names them. Pure text → calls: nothing here is wired into the
//! HTTP path yet (that comes with constrained decoding, which makes the calls well-formed).
//!
//! A parser never fails: output holding a malformed call (invalid JSON, a missing or
//! non-string `name`, `arguments` that are not an object, a function that was not declared)
//! is returned whole as plain content, as if the model had written no call at all.

mod hermes;
mod llama3_json;
mod mistral;
#[cfg(test)]
mod tests;

use serde_json::{Map, Value};

use crate::openai::common::random_id;

/// The model family whose tool-call format a reply is read in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ToolCallParser {
    /// `<tool_call>{"name", "arguments"}</tool_call>` blocks (Hermes, Qwen2.5, Qwen3).
    #[value(name = "hermes")]
    Hermes,
    /// The whole reply is `{"name", "parameters"}` objects separated by `;`, after an optional
    /// `<|python_tag|>` (Llama 3.1 to 3.3).
    #[value(name = "llama3_json")]
    Llama3Json,
    /// `[TOOL_CALLS]` then a JSON array of `{"name", "arguments"}` (Mistral, Mixtral).
    #[value(name = "mistral")]
    Mistral,
}

/// One call read from the output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParsedCall {
    pub name: String,
    /// The arguments as compact JSON object text, OpenAI's `function.arguments`.
    pub arguments: String,
}

/// A reply split into its text and its calls.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParsedOutput {
    /// The text outside the calls; `None` when there is none but whitespace.
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
}

impl ToolCallParser {
    /// The flag's spelling, vLLM's.
    pub fn name(self) -> &'static str {
        match self {
            Self::Hermes => "hermes",
            Self::Llama3Json => "llama3_json",
            Self::Mistral => "mistral",
        }
    }

    /// Splits `text`, a model's complete output, into content and calls. With `declared`, a call
    /// must name one of those functions.
    pub fn parse(self, text: &str, declared: Option<&[String]>) -> ParsedOutput {
        let parsed = match self {
            Self::Hermes => hermes::parse(text, declared),
            Self::Llama3Json => llama3_json::parse(text, declared),
            Self::Mistral => mistral::parse(text, declared),
        };
        parsed.unwrap_or_else(|| ParsedOutput::plain(text))
    }
}

/// A fresh OpenAI-style tool call id: `call_` + 24 random alphanumerics.
pub fn call_id() -> String {
    random_id("call_")
}

/// Reads one `{"name": …, <arguments key>: {…}}` object, the first of `argument_keys` present
/// holding the arguments. `None` when it is not a well-formed call of a declared function.
fn read_call(
    value: &Value,
    argument_keys: &[&str],
    declared: Option<&[String]>,
) -> Option<ParsedCall> {
    let object = value.as_object()?;
    let name = object.get("name")?.as_str()?;
    if declared.is_some_and(|names| !names.iter().any(|declared| declared == name)) {
        return None;
    }
    let arguments = argument_keys.iter().find_map(|key| object.get(*key))?;
    let arguments = argument_object(arguments)?;
    Some(ParsedCall {
        name: name.to_owned(),
        arguments: Value::Object(arguments).to_string(),
    })
}

/// An object, or a JSON string holding one (some models write OpenAI's string form).
fn argument_object(arguments: &Value) -> Option<Map<String, Value>> {
    match arguments {
        Value::Object(object) => Some(object.clone()),
        Value::String(text) => match serde_json::from_str(text).ok()? {
            Value::Object(object) => Some(object),
            _ => None,
        },
        _ => None,
    }
}

/// Reads the JSON value at the start of `text`, returning it and the text after it.
fn leading_json(text: &str) -> Option<(Value, &str)> {
    let mut values = serde_json::Deserializer::from_str(text).into_iter::<Value>();
    let value = values.next()?.ok()?;
    Some((value, &text[values.byte_offset()..]))
}

/// `text` trimmed, or `None` when nothing but whitespace.
fn non_blank(text: &str) -> Option<&str> {
    let trimmed = text.trim();
    (!trimmed.is_empty()).then_some(trimmed)
}
