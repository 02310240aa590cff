//! OpenAI's published schema (`testdata/openai-openapi/openapi.yaml`) as the reference for
//! response shapes: a small checker for the parts of OpenAPI the relevant schemas use
//! (`$ref`, `allOf`, `anyOf`/`oneOf`, `type`, `nullable`, `enum`, `required`, `properties`,
//! `items`).

use std::sync::OnceLock;

use serde_json::Value;

const SPEC: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../testdata/openai-openapi/openapi.yaml"
);
const REF_PREFIX: &str = "#/components/schemas/";

/// `components.schemas` of the spec, parsed once per test binary.
fn schemas() -> &'static Value {
    static SCHEMAS: OnceLock<Value> = OnceLock::new();
    SCHEMAS.get_or_init(|| {
        let text = std::fs::read_to_string(SPEC)
            .unwrap_or_else(|error| panic!("cannot read {SPEC}: {error}"));
        let text = widen_huge_integers(&text);
        let spec: serde_norway::Value =
            serde_norway::from_str(&text).expect("the OpenAPI spec parses");
        let schemas = &spec["components"]["schemas"];
        // Through JSON so that YAML's non-string keys elsewhere do not matter.
        serde_json::to_value(schemas).expect("the schemas convert to JSON")
    })
}

/// The spec writes the seed's bounds as integers beyond 64 bits (`-9223372036854776000`),
/// which the YAML parser refuses; such values become floats (only bounds, never checked here).
fn widen_huge_integers(text: &str) -> String {
    let mut widened = String::with_capacity(text.len());
    for line in text.lines() {
        widened.push_str(line);
        let value = line
            .rsplit_once(": ")
            .map_or("", |(_, value)| value.trim_start_matches('-'));
        if value.len() >= 19 && value.bytes().all(|byte| byte.is_ascii_digit()) {
            widened.push_str(".0");
        }
        widened.push('\n');
    }
    widened
}

/// Panics, listing every mismatch, unless `value` satisfies the named schema.
pub fn assert_schema(value: &Value, schema_name: &str) {
    let schema = schemas()
        .get(schema_name)
        .unwrap_or_else(|| panic!("no schema {schema_name} in the spec"));
    let mut errors = Vec::new();
    check(value, schema, "$", &mut errors);
    assert!(
        errors.is_empty(),
        "{value} does not match {schema_name}:\n{}",
        errors.join("\n")
    );
}

fn check(value: &Value, schema: &Value, path: &str, errors: &mut Vec<String>) {
    if value.is_null() && schema.get("nullable") == Some(&Value::Bool(true)) {
        return;
    }
    if let Some(reference) = schema.get("$ref").and_then(Value::as_str) {
        let name = reference.strip_prefix(REF_PREFIX).unwrap_or(reference);
        match schemas().get(name) {
            Some(target) => check(value, target, path, errors),
            None => errors.push(format!("{path}: unresolvable $ref {reference}")),
        }
    }
    for part in schema
        .get("allOf")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        check(value, part, path, errors);
    }
    for key in ["anyOf", "oneOf"] {
        if let Some(options) = schema.get(key).and_then(Value::as_array) {
            let fits = options.iter().any(|option| {
                let mut option_errors = Vec::new();
                check(value, option, path, &mut option_errors);
                option_errors.is_empty()
            });
            if !fits {
                errors.push(format!("{path}: {value} matches none of {key}"));
            }
        }
    }
    if let Some(kind) = schema.get("type") {
        let kinds: Vec<&str> = match kind {
            Value::Array(kinds) => kinds.iter().filter_map(Value::as_str).collect(),
            other => other.as_str().into_iter().collect(),
        };
        if !kinds.iter().any(|kind| has_type(value, kind)) {
            errors.push(format!("{path}: {value} is not of type {kinds:?}"));
            return;
        }
    }
    if let Some(allowed) = schema.get("enum").and_then(Value::as_array) {
        if !allowed.contains(value) {
            errors.push(format!("{path}: {value} is not one of {allowed:?}"));
        }
    }
    if let Value::Object(object) = value {
        for required in schema
            .get("required")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let key = required.as_str().unwrap_or_default();
            if !object.contains_key(key) {
                errors.push(format!("{path}: missing required `{key}`"));
            }
        }
        if let Some(properties) = schema.get("properties").and_then(Value::as_object) {
            for (key, property) in properties {
                if let Some(field) = object.get(key) {
                    check(field, property, &format!("{path}.{key}"), errors);
                }
            }
        }
    }
    if let (Value::Array(items), Some(item_schema)) = (value, schema.get("items")) {
        for (i, item) in items.iter().enumerate() {
            check(item, item_schema, &format!("{path}[{i}]"), errors);
        }
    }
}

fn has_type(value: &Value, kind: &str) -> bool {
    match kind {
        "string" => value.is_string(),
        "integer" => value.is_i64() || value.is_u64(),
        "number" => value.is_number(),
        "boolean" => value.is_boolean(),
        "array" => value.is_array(),
        "object" => value.is_object(),
        "null" => value.is_null(),
        _ => false,
    }
}
