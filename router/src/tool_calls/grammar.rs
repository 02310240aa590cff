//! The grammar (llguidance's Lark dialect) that holds a reply to `tool_choice`: `required` and a
//! named function allow calls alone; `auto` allows free text, but a call, once its family's
//! marker is written, must be a complete call of a declared function. Arguments are each
//! function's `parameters` schema, embedded with `%json` (compact JSON, as for
//! `response_format`).
//!
//! Every call is written name first (`{"name": "f", "arguments": {…}}`), the order the
//! families' chat templates print calls in, so that a call's name streams before its arguments.
//!
//! A marker that is an added token of the request's tokenizer (Llama's `<|python_tag|>`,
//! Mistral's `[TOOL_CALLS]`, Qwen's `<tool_call>`, special or not) is written by id
//! (`<[128010]>`): the token, not its spelling in ordinary text, is what the model emits, and
//! llguidance matches an added token only as itself. A marker that is plain text is a string; in
//! `auto` it is a lazy lexeme, which ends the free text as soon as the marker appears.

use serde_json::{json, Value};

use super::{
    granite, hermes, llama3_json, mistral, pythonic_grammar, FunctionSpec, ToolCallParser,
    ToolChoice, ToolRequest,
};

/// Free text, any length (`.` is every character but a newline).
const TEXT: &str = r"TEXT: /(.|\n)*/";

/// The Lark grammar for `request` in `parser`'s format; `None` for `tool_choice: "none"`.
/// `special_id` gives the id of a marker that is an added token of the tokenizer.
pub fn tool_grammar(
    parser: ToolCallParser,
    request: &ToolRequest,
    special_id: &dyn Fn(&str) -> Option<u32>,
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
    let mut lines = vec!["%llguidance {}".to_owned()];
    // Mistral's tokenizers from v11 on have `[ARGS]` as a token: calls are `[TOOL_CALLS]name[ARGS]{…}`.
    let mistral_v11 = parser == ToolCallParser::Mistral && special_id(mistral::ARGS).is_some();
    let (start, rules) = match parser {
        ToolCallParser::Hermes => hermes_rules(forced, several, special_id),
        ToolCallParser::Llama3Json => llama_rules(forced, several, special_id),
        ToolCallParser::Mistral if mistral_v11 => mistral_v11_rules(forced, several, special_id),
        ToolCallParser::Mistral => list_rules(mistral::MARKER, forced, several, special_id),
        ToolCallParser::Granite => list_rules(granite::MARKER, forced, several, special_id),
        ToolCallParser::Pythonic => pythonic_grammar::rules(forced, several),
    };
    lines.push(format!("start: {start}"));
    lines.extend(rules);
    lines.extend(match parser {
        ToolCallParser::Pythonic => pythonic_grammar::call_rules(&functions),
        _ if mistral_v11 => v11_call_rules(&functions, special_id),
        _ => call_rules(parser, &functions),
    });
    Some(lines.join("\n") + "\n")
}

/// `call`: one call of any of `functions`, name first, then its arguments.
fn call_rules(parser: ToolCallParser, functions: &[&FunctionSpec]) -> Vec<String> {
    let key = match parser {
        ToolCallParser::Hermes => hermes::ARGUMENTS[0],
        ToolCallParser::Llama3Json => llama3_json::ARGUMENTS[0],
        ToolCallParser::Mistral => mistral::ARGUMENTS[0],
        ToolCallParser::Granite => granite::ARGUMENTS[0],
        ToolCallParser::Pythonic => unreachable!("pythonic calls have rules of their own"),
    };
    let alternatives: Vec<String> = (0..functions.len()).map(|i| format!("fn_{i}")).collect();
    let mut rules = vec![format!("call: {}", alternatives.join(" | "))];
    for (i, function) in functions.iter().enumerate() {
        // The opening as the templates print it (Python's json.dumps separators).
        let opening = format!(
            "{{\"name\": {}, \"{key}\": ",
            Value::String(function.name.clone())
        );
        rules.push(format!("fn_{i}: {} args_{i} \"}}\"", string(&opening)));
        rules.push(format!(
            "args_{i}: %json {}",
            compact_schema(&function.parameters)
        ));
    }
    rules
}

/// The schema with llguidance's option for compact JSON (no free whitespace).
fn compact_schema(schema: &Value) -> String {
    let mut schema = schema.clone();
    if let Value::Object(object) = &mut schema {
        object.insert(
            "x-guidance".to_owned(),
            json!({"whitespace_flexible": false}),
        );
    }
    schema.to_string()
}

/// A Lark string literal (JSON's escapes are Lark's).
pub(super) fn string(text: &str) -> String {
    Value::String(text.to_owned()).to_string()
}

/// A marker: its added token by id, else its text.
fn marker(text: &str, special_id: &dyn Fn(&str) -> Option<u32>) -> String {
    match special_id(text) {
        Some(id) => format!("<[{id}]>"),
        None => string(text),
    }
}

/// `<tool_call>\n{…}\n</tool_call>` blocks, separated by a newline when forced.
fn hermes_rules(
    forced: bool,
    several: bool,
    special_id: &dyn Fn(&str) -> Option<u32>,
) -> (String, Vec<String>) {
    let open = marker(hermes::START, special_id);
    let close = marker(hermes::END, special_id);
    let mut rules = vec![format!("block_rest: \"\\n\" call \"\\n\" {close}")];
    let start = if forced {
        rules.push(format!("block: {open} block_rest"));
        match several {
            true => "block (\"\\n\" block)*".to_owned(),
            false => "block".to_owned(),
        }
    } else {
        rules.push(TEXT.to_owned());
        rules.push(opening_after_text(&open, hermes::START));
        match several {
            true => "(opening block_rest)* TEXT".to_owned(),
            false => "TEXT | opening block_rest".to_owned(),
        }
    };
    (start, rules)
}

/// `opening`: free text, then the marker. A textual marker is a lazy lexeme, so the text ends
/// at the marker's first appearance; a special token cannot appear inside text at all.
fn opening_after_text(open: &str, text_marker: &str) -> String {
    if open.starts_with("<[") {
        format!("opening: TEXT {open}")
    } else {
        format!("opening[lazy]: TEXT {}", string(text_marker))
    }
}

/// `{"name": …, "parameters": {…}}` objects separated by `; `; in `auto`, text that does not
/// open with `{`, or calls, after `<|python_tag|>` or not.
fn llama_rules(
    forced: bool,
    several: bool,
    special_id: &dyn Fn(&str) -> Option<u32>,
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
        let tag = marker(llama3_json::PYTHON_TAG, special_id);
        format!("PLAIN | calls | {tag} calls")
    };
    (start, rules)
}

/// `marker` then a JSON array of calls, after free text in `auto` (Mistral before v11,
/// Granite).
fn list_rules(
    text_marker: &str,
    forced: bool,
    several: bool,
    special_id: &dyn Fn(&str) -> Option<u32>,
) -> (String, Vec<String>) {
    let open = marker(text_marker, special_id);
    let calls = match several {
        true => "calls: \"[\" call (\", \" call)* \"]\"",
        false => "calls: \"[\" call \"]\"",
    };
    let mut rules = vec![calls.to_owned()];
    let start = if forced {
        format!("{open} calls")
    } else {
        rules.push(TEXT.to_owned());
        rules.push(opening_after_text(&open, text_marker));
        "TEXT | opening calls".to_owned()
    };
    (start, rules)
}

/// Mistral from v11: `[TOOL_CALLS]name[ARGS]{…}` per call, after free text in `auto`.
fn mistral_v11_rules(
    forced: bool,
    several: bool,
    special_id: &dyn Fn(&str) -> Option<u32>,
) -> (String, Vec<String>) {
    let open = marker(mistral::MARKER, special_id);
    let calls = match several {
        true => format!("calls: call ({open} call)*"),
        false => "calls: call".to_owned(),
    };
    let mut rules = vec![calls];
    let start = if forced {
        format!("{open} calls")
    } else {
        rules.push(TEXT.to_owned());
        rules.push(opening_after_text(&open, mistral::MARKER));
        "TEXT | opening calls".to_owned()
    };
    (start, rules)
}

/// `call` in Mistral's v11 layout: the name, `[ARGS]`, the arguments object.
fn v11_call_rules(
    functions: &[&FunctionSpec],
    special_id: &dyn Fn(&str) -> Option<u32>,
) -> Vec<String> {
    let args = marker(mistral::ARGS, special_id);
    let alternatives: Vec<String> = (0..functions.len()).map(|i| format!("fn_{i}")).collect();
    let mut rules = vec![format!("call: {}", alternatives.join(" | "))];
    for (i, function) in functions.iter().enumerate() {
        rules.push(format!(
            "fn_{i}: {} {args} args_{i}",
            string(&function.name)
        ));
        rules.push(format!(
            "args_{i}: %json {}",
            compact_schema(&function.parameters)
        ));
    }
    rules
}
