//! What reading a reply gives: its text and its calls, and the id each call is answered with.

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
    pub(super) fn plain(text: &str) -> Self {
        Self {
            content: non_blank(text).map(|_| text.to_owned()),
            tool_calls: Vec::new(),
        }
    }

    /// Text and calls; the text kept whole unless it is blank.
    pub(super) fn with_calls(content: &str, tool_calls: Vec<ParsedCall>) -> Self {
        Self {
            content: non_blank(content).map(|_| content.to_owned()),
            tool_calls,
        }
    }
}

/// A fresh OpenAI-style tool call id: `call_` + 24 random alphanumerics.
pub fn call_id() -> String {
    random_id("call_")
}

/// `text` trimmed, or `None` when nothing but whitespace.
pub(super) fn non_blank(text: &str) -> Option<&str> {
    let trimmed = text.trim();
    (!trimmed.is_empty()).then_some(trimmed)
}
