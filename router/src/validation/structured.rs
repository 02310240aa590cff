//! Structured output: `response_format` (OpenAI), `structured_outputs` (vLLM) and vLLM's older
//! `guided_*` aliases → the grammar the shards enforce. Only the shape is checked here; whether
//! a schema, regex or grammar compiles is the grammar engine's answer (`CompileGrammar`, before
//! admission), reported under the same `param`.

use serde_json::{Map, Value};

use super::ValidationError;
use crate::openai::common::GenerationParams;
use crate::scheduler::GrammarKind as Kind;

/// A request's output constraint, before it knows its tokenizer's EOS ids.
#[derive(Debug, Clone, PartialEq)]
pub struct OutputGrammar {
    pub kind: Kind,
    pub text: String,
    /// The request field it came from: compile errors are reported under it.
    pub param: &'static str,
}

impl OutputGrammar {
    fn new(kind: Kind, text: String, param: &'static str) -> Self {
        Self { kind, text, param }
    }

    /// The grammar of a chat request's tool calls (`crate::tool_calls`), in the Lark dialect.
    pub fn tool_calls(text: String) -> Self {
        Self::new(Kind::Lark, text, "tools")
    }

    /// JSON mode: any JSON object.
    fn any_object(param: &'static str) -> Self {
        Self::new(Kind::JsonSchema, r#"{"type":"object"}"#.to_owned(), param)
    }
}

/// The one grammar a request's fields ask for; `None` for free text. Two sources at once are
/// refused: which one should win is not obvious.
pub fn output_grammar(params: &GenerationParams) -> Result<Option<OutputGrammar>, ValidationError> {
    let mut found: Vec<OutputGrammar> = Vec::new();
    if let Some(value) = &params.response_format {
        found.extend(response_format(value)?);
    }
    if let Some(value) = &params.structured_outputs {
        found.push(structured_outputs(value)?);
    }
    let aliases = [
        ("guided_json", &params.guided_json),
        ("guided_regex", &params.guided_regex),
        ("guided_choice", &params.guided_choice),
        ("guided_grammar", &params.guided_grammar),
    ];
    for (name, value) in aliases {
        if let Some(value) = value {
            found.push(guided(name, value)?);
        }
    }
    match found.len() {
        0 | 1 => Ok(found.pop()),
        _ => Err(ValidationError::invalid(
            found[1].param,
            format!(
                "`{}` and `{}` both constrain the output; give one of them",
                found[0].param, found[1].param
            ),
        )),
    }
}

const RESPONSE_FORMAT: &str = "response_format";

/// OpenAI's `response_format`: `text`, `json_object` or `json_schema`.
fn response_format(value: &Value) -> Result<Option<OutputGrammar>, ValidationError> {
    let invalid = |message: String| ValidationError::invalid(RESPONSE_FORMAT, message);
    let object = value
        .as_object()
        .ok_or_else(|| invalid("`response_format` must be an object with a `type`".to_owned()))?;
    let kind = object.get("type").and_then(Value::as_str).ok_or_else(|| {
        invalid(
            "`response_format.type` must be one of \"text\", \"json_object\", \"json_schema\""
                .to_owned(),
        )
    })?;
    match kind {
        "text" => Ok(None),
        "json_object" => Ok(Some(OutputGrammar::any_object(RESPONSE_FORMAT))),
        "json_schema" => {
            let spec = object
                .get("json_schema")
                .and_then(Value::as_object)
                .ok_or_else(|| {
                    invalid(
                        "`response_format.json_schema` must be an object with `name` and `schema`"
                            .to_owned(),
                    )
                })?;
            check_schema_name(spec).map_err(invalid)?;
            let schema = spec.get("schema").ok_or_else(|| {
                invalid("`response_format.json_schema.schema` is required".to_owned())
            })?;
            if let Some(strict) = spec.get("strict") {
                if !(strict.is_boolean() || strict.is_null()) {
                    return Err(invalid(
                        "`response_format.json_schema.strict` must be a boolean".to_owned(),
                    ));
                }
            }
            json_schema(
                schema,
                RESPONSE_FORMAT,
                "response_format.json_schema.schema",
            )
            .map(Some)
        }
        other => Err(invalid(format!(
            "`response_format.type` {other:?} is not supported: use \"text\", \"json_object\" or \
             \"json_schema\""
        ))),
    }
}

/// OpenAI's rule for `json_schema.name`: a-z, A-Z, 0-9, `_` and `-`, at most 64 characters.
fn check_schema_name(spec: &Map<String, Value>) -> Result<(), String> {
    let name = spec
        .get("name")
        .and_then(Value::as_str)
        .ok_or("`response_format.json_schema.name` is required (a string)")?;
    let valid = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if valid {
        Ok(())
    } else {
        Err(format!(
            "`response_format.json_schema.name` {name:?} must be 1 to 64 characters of a-z, A-Z, \
             0-9, `_` and `-`"
        ))
    }
}

/// A JSON schema given as a JSON object (or a boolean schema); `what` names it in messages.
fn json_schema(
    schema: &Value,
    param: &'static str,
    what: &str,
) -> Result<OutputGrammar, ValidationError> {
    match schema {
        Value::Object(_) => Ok(OutputGrammar::new(
            Kind::JsonSchema,
            schema.to_string(),
            param,
        )),
        // The schema every JSON value satisfies, spelt as the object the engine takes.
        Value::Bool(true) => Ok(OutputGrammar::new(Kind::JsonSchema, "{}".to_owned(), param)),
        Value::Bool(false) => Err(ValidationError::invalid(
            param,
            format!("`{what}` is `false`, which no output satisfies"),
        )),
        _ => Err(ValidationError::invalid(
            param,
            format!("`{what}` must be a JSON schema (an object)"),
        )),
    }
}

const STRUCTURED_OUTPUTS: &str = "structured_outputs";

/// vLLM's `structured_outputs`: exactly one of `json`, `json_object`, `regex`, `choice`,
/// `grammar`. Its other keys (whitespace and structural-tag options) are refused by name.
fn structured_outputs(value: &Value) -> Result<OutputGrammar, ValidationError> {
    let invalid = |message: String| ValidationError::invalid(STRUCTURED_OUTPUTS, message);
    let object = value.as_object().ok_or_else(|| {
        invalid("`structured_outputs` must be an object with one of `json`, `regex`, `choice`, `grammar`, `json_object`".to_owned())
    })?;
    let mut set = object.iter().filter(|(_, v)| !v.is_null());
    let (key, inner) = set.next().ok_or_else(|| {
        invalid("`structured_outputs` is empty: give one of `json`, `regex`, `choice`, `grammar`, `json_object`".to_owned())
    })?;
    if let Some((second, _)) = set.next() {
        return Err(invalid(format!(
            "`structured_outputs` sets both `{key}` and `{second}`; give exactly one"
        )));
    }
    match key.as_str() {
        "json" => json_value(inner, STRUCTURED_OUTPUTS, "structured_outputs.json"),
        "regex" => regex(inner, STRUCTURED_OUTPUTS, "structured_outputs.regex"),
        "choice" => choice(inner, STRUCTURED_OUTPUTS, "structured_outputs.choice"),
        "grammar" => lark(inner, STRUCTURED_OUTPUTS, "structured_outputs.grammar"),
        "json_object" => match inner {
            Value::Bool(true) => Ok(OutputGrammar::any_object(STRUCTURED_OUTPUTS)),
            _ => Err(invalid(
                "`structured_outputs.json_object` must be `true`".to_owned(),
            )),
        },
        other => Err(invalid(format!(
            "`structured_outputs.{other}` is not supported: give one of `json`, `regex`, \
             `choice`, `grammar`, `json_object`"
        ))),
    }
}

/// vLLM's older top-level aliases of `structured_outputs`' keys.
fn guided(name: &'static str, value: &Value) -> Result<OutputGrammar, ValidationError> {
    match name {
        "guided_json" => json_value(value, name, name),
        "guided_regex" => regex(value, name, name),
        "guided_choice" => choice(value, name, name),
        _ => lark(value, name, name),
    }
}

/// A schema as an object, or as a string holding one (vLLM takes both).
fn json_value(
    value: &Value,
    param: &'static str,
    what: &str,
) -> Result<OutputGrammar, ValidationError> {
    match value {
        Value::String(text) => {
            let parsed: Value = serde_json::from_str(text).map_err(|error| {
                ValidationError::invalid(param, format!("`{what}` is not valid JSON: {error}"))
            })?;
            json_schema(&parsed, param, what)
        }
        other => json_schema(other, param, what),
    }
}

fn non_empty_string<'a>(
    value: &'a Value,
    param: &'static str,
    what: &str,
) -> Result<&'a str, ValidationError> {
    match value.as_str() {
        Some(text) if !text.is_empty() => Ok(text),
        _ => Err(ValidationError::invalid(
            param,
            format!("`{what}` must be a non-empty string"),
        )),
    }
}

fn regex(value: &Value, param: &'static str, what: &str) -> Result<OutputGrammar, ValidationError> {
    let text = non_empty_string(value, param, what)?;
    Ok(OutputGrammar::new(Kind::Regex, text.to_owned(), param))
}

fn lark(value: &Value, param: &'static str, what: &str) -> Result<OutputGrammar, ValidationError> {
    let text = non_empty_string(value, param, what)?;
    Ok(OutputGrammar::new(Kind::Lark, text.to_owned(), param))
}

/// One of the listed strings, exactly: a Lark alternation of string literals (JSON string
/// syntax is Lark's literal syntax too).
fn choice(
    value: &Value,
    param: &'static str,
    what: &str,
) -> Result<OutputGrammar, ValidationError> {
    let invalid = || {
        ValidationError::invalid(
            param,
            format!("`{what}` must be a non-empty list of non-empty strings"),
        )
    };
    let items = value
        .as_array()
        .filter(|items| !items.is_empty())
        .ok_or_else(invalid)?;
    let mut literals = Vec::with_capacity(items.len());
    for item in items {
        match item.as_str() {
            Some(text) if !text.is_empty() => literals.push(Value::from(text).to_string()),
            _ => return Err(invalid()),
        }
    }
    Ok(OutputGrammar::new(
        Kind::Lark,
        format!("start: {}", literals.join(" | ")),
        param,
    ))
}

#[cfg(test)]
#[path = "structured_tests.rs"]
mod tests;
