//! Pieces of llguidance's Lark dialect that the formats' grammars share: string literals,
//! markers by token id or text, free text that a marker ends, and JSON calls named first with
//! each function's `parameters` schema embedded by `%json` (compact JSON, as for
//! `response_format`).

use serde_json::{json, Value};

use super::request::FunctionSpec;

/// Free text, any length (`.` is every character but a newline).
pub(super) const TEXT: &str = r"TEXT: /(.|\n)*/";

/// The id of a marker that is an added token of the request's tokenizer.
pub type SpecialId<'a> = &'a dyn Fn(&str) -> Option<u32>;

/// A Lark string literal (JSON's escapes are Lark's).
pub(super) fn string(text: &str) -> String {
    Value::String(text.to_owned()).to_string()
}

/// A marker: its added token by id, else its text.
pub(super) fn marker(text: &str, special_id: SpecialId) -> String {
    match special_id(text) {
        Some(id) => format!("<[{id}]>"),
        None => string(text),
    }
}

/// `opening`: free text, then the marker. A textual marker is a lazy lexeme, so the text ends
/// at the marker's first appearance; a special token cannot appear inside text at all.
pub(super) fn opening_after_text(open: &str, text_marker: &str) -> String {
    if open.starts_with("<[") {
        format!("opening: TEXT {open}")
    } else {
        format!("opening[lazy]: TEXT {}", string(text_marker))
    }
}

/// `call: fn_0 | fn_1 | …`, one alternative per function.
pub(super) fn call_choice(functions: &[&FunctionSpec]) -> String {
    let alternatives: Vec<String> = (0..functions.len()).map(|i| format!("fn_{i}")).collect();
    format!("call: {}", alternatives.join(" | "))
}

/// `call`: one call of any of `functions`, name first, then its arguments under `key`.
pub(super) fn json_call_rules(key: &str, functions: &[&FunctionSpec]) -> Vec<String> {
    let mut rules = vec![call_choice(functions)];
    for (i, function) in functions.iter().enumerate() {
        // The opening as the templates print it (Python's json.dumps separators).
        let opening = format!(
            "{{\"name\": {}, \"{key}\": ",
            Value::String(function.name.clone())
        );
        rules.push(format!("fn_{i}: {} args_{i} \"}}\"", string(&opening)));
        rules.push(arguments_rule(i, function));
    }
    rules
}

/// `args_<i>`: the function's arguments as its schema allows them.
pub(super) fn arguments_rule(i: usize, function: &FunctionSpec) -> String {
    format!("args_{i}: %json {}", compact_schema(&function.parameters))
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
