//! Tool calling on `/v1/chat/completions`: the request's tools checked (`request`), the grammar
//! that constrains a reply to calls of them (`grammar`), and the reply read back into calls, one
//! format per model family, named as vLLM's `--tool-call-parser` names them: whole (`parse`) or
//! as it streams (`stream`). See docs/tool-calling.md.
//!
//! Each family's format is one file implementing `ToolCallFormat` whole (`hermes`,
//! `llama3_json`, `mistral`, `granite`, `pythonic`; `json_list` is the marked-list layout
//! mistral and granite share); `registry::format_of` picks it, and the generic machinery
//! (`detect`, `grammar`, `prompt`, `plan`, `stream`, `truncated`) only asks it. This file only
//! names the modules and what the rest of the router uses.
//!
//! A parser never fails: output holding a malformed call (invalid JSON, a missing or
//! non-string `name`, `arguments` that are not an object, a function that was not declared)
//! is returned whole as plain content, as if the model had written no call at all.

mod detect;
mod format;
mod grammar;
mod granite;
mod hermes;
mod json_calls;
mod json_list;
mod lark;
mod llama3_json;
mod mistral;
mod parsed;
mod partial;
mod plan;
mod prompt;
mod pythonic;
mod registry;
mod request;
mod stream;
mod truncated;

#[cfg(test)]
mod detect_tests;
#[cfg(test)]
mod formats_tests;
#[cfg(test)]
mod grammar_tests;
#[cfg(test)]
mod request_fields_tests;
#[cfg(test)]
mod stream_tests;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod truncated_tests;

pub use detect::{detect_parser, parser_for};
pub use format::ToolCallFormat;
pub use grammar::tool_grammar;
pub use parsed::{call_id, ParsedCall, ParsedOutput};
pub use plan::ToolPlan;
pub use prompt::{template_reads_tools, tool_system_prompt};
pub use quiver_flags::ToolCallParser;
pub use registry::format_of;
pub use request::{check_tool_request, FunctionSpec, ToolChoice, ToolFields, ToolRequest};
pub use stream::{ToolCallStream, ToolDelta};
