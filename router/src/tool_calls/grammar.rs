//! The grammar (llguidance's Lark dialect) that holds a reply to `tool_choice`: `required` and a
//! named function allow calls alone; `auto` allows free text, but a call, once its family's
//! marker is written, must be a complete call of a declared function. Arguments are each
//! function's `parameters` schema, embedded with `%json` (compact JSON, as for
//! `response_format`). The format writes its rules (`ToolCallFormat::grammar`); here the
//! choice decides which calls, and how many.
//!
//! Every call is written name first (`{"name": "f", "arguments": {…}}`), the order the
//! families' chat templates print calls in, so that a call's name streams before its arguments.
//!
//! A marker that is an added token of the request's tokenizer (Llama's `<|python_tag|>`,
//! Mistral's `[TOOL_CALLS]`, Qwen's `<tool_call>`, special or not) is written by id
//! (`<[128010]>`): the token, not its spelling in ordinary text, is what the model emits, and
//! llguidance matches an added token only as itself. A marker that is plain text is a string; in
//! `auto` it is a lazy lexeme, which ends the free text as soon as the marker appears.

use quiver_flags::ToolCallParser;

use super::lark::SpecialId;
use super::registry::format_of;
use super::request::{FunctionSpec, ToolChoice, ToolRequest};

/// The Lark grammar for `request` in `parser`'s format; `None` for `tool_choice: "none"`.
/// `special_id` gives the id of a marker that is an added token of the tokenizer.
pub fn tool_grammar(
    parser: ToolCallParser,
    request: &ToolRequest,
    special_id: SpecialId,
) -> Option<String> {
    let forced = match &request.choice {
        ToolChoice::None => return None,
        ToolChoice::Auto => false,
        ToolChoice::Required | ToolChoice::Named(_) => true,
    };
    let functions: Vec<&FunctionSpec> = match &request.choice {
        ToolChoice::Named(name) => request
            .functions
            .iter()
            .filter(|function| function.name == *name)
            .collect(),
        _ => request.functions.iter().collect(),
    };
    // A named function is one call; `required` one or more unless parallel calls are off.
    let several = request.parallel && !matches!(request.choice, ToolChoice::Named(_));
    let (start, rules) = format_of(parser).grammar(forced, several, &functions, special_id);
    let mut lines = vec!["%llguidance {}".to_owned(), format!("start: {start}")];
    lines.extend(rules);
    Some(lines.join("\n") + "\n")
}
