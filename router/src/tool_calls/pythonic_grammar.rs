//! The grammar of pythonic calls (`pythonic`): a Python list of `name(key=value, …)` calls of
//! the declared functions, each keyword one of the function's parameters, each value a Python
//! literal of the parameter's JSON-schema type: a string (only the `enum`'s, when it has one),
//! an integer, a number, `True`/`False`, `None`, a list or a dict; any literal where the schema
//! gives no single type. Ranges, patterns and which keywords are required are not held, unlike
//! the JSON formats' `%json` schemas: the values are Python's syntax, not JSON's.

use serde_json::Value;

use super::grammar::string;
use super::FunctionSpec;

/// Python literals, written as the grammar lets the model write them.
const LITERALS: &[&str] = &[
    r#"py_value: PY_STRING | PY_NUMBER | "True" | "False" | "None" | py_list | py_dict"#,
    r#"py_list: "[" (py_value (", " py_value)*)? "]""#,
    r#"py_dict: "{" (PY_STRING ": " py_value (", " PY_STRING ": " py_value)*)? "}""#,
    r#"PY_STRING: /'([^'\\\n]|\\.)*'/ | /"([^"\\\n]|\\.)*"/"#,
    r#"PY_INT: /-?[0-9]+/"#,
    r#"PY_NUMBER: /-?[0-9]+(\.[0-9]+)?([eE][+-]?[0-9]+)?/"#,
];

/// The start rule and the list's rules; in `auto`, text that does not open with `[` instead.
pub(super) fn rules(forced: bool, several: bool) -> (String, Vec<String>) {
    let calls = match several {
        true => r#"calls: "[" call (", " call)* "]""#,
        false => r#"calls: "[" call "]""#,
    };
    let mut rules = vec![calls.to_owned()];
    rules.extend(LITERALS.iter().map(|rule| (*rule).to_owned()));
    let start = if forced {
        "calls".to_owned()
    } else {
        rules.push(r"PLAIN: /([^\[\s](.|\n)*)?/".to_owned());
        "PLAIN | calls".to_owned()
    };
    (start, rules)
}

/// `call`: one call of any of `functions`, keywords from its parameters.
pub(super) fn call_rules(functions: &[&FunctionSpec]) -> Vec<String> {
    let alternatives: Vec<String> = (0..functions.len()).map(|i| format!("fn_{i}")).collect();
    let mut rules = vec![format!("call: {}", alternatives.join(" | "))];
    for (i, function) in functions.iter().enumerate() {
        let opening = string(&format!("{}(", function.name));
        let properties = function.parameters["properties"]
            .as_object()
            .filter(|properties| !properties.is_empty());
        let Some(properties) = properties else {
            rules.push(format!("fn_{i}: {opening} \")\""));
            continue;
        };
        rules.push(format!(
            "fn_{i}: {opening} (kwarg_{i} (\", \" kwarg_{i})*)? \")\""
        ));
        let keywords: Vec<String> = (0..properties.len())
            .map(|j| format!("kw_{i}_{j}"))
            .collect();
        rules.push(format!("kwarg_{i}: {}", keywords.join(" | ")));
        for (j, (key, schema)) in properties.iter().enumerate() {
            rules.push(format!(
                "kw_{i}_{j}: {} {}",
                string(&format!("{key}=")),
                value_rule(schema)
            ));
        }
    }
    rules
}

/// The literal a parameter's schema asks for.
fn value_rule(schema: &Value) -> String {
    if let Some(values) = schema["enum"].as_array() {
        let choices: Vec<String> = values.iter().filter_map(enum_literal).collect();
        if choices.len() == values.len() && !choices.is_empty() {
            return format!("({})", choices.join(" | "));
        }
    }
    match schema["type"].as_str() {
        Some("string") => "PY_STRING",
        Some("integer") => "PY_INT",
        Some("number") => "PY_NUMBER",
        Some("boolean") => r#"("True" | "False")"#,
        Some("null") => r#""None""#,
        Some("array") => "py_list",
        Some("object") => "py_dict",
        _ => "py_value",
    }
    .to_owned()
}

/// An enum value as a Python literal (strings in single quotes, as Python's `repr`).
fn enum_literal(value: &Value) -> Option<String> {
    let literal = match value {
        Value::String(text) if !text.contains(['\'', '\\', '\n']) => format!("'{text}'"),
        Value::Number(number) => number.to_string(),
        Value::Bool(true) => "True".to_owned(),
        Value::Bool(false) => "False".to_owned(),
        Value::Null => "None".to_owned(),
        _ => return None,
    };
    Some(string(&literal))
}
