//! Reading calls written as JSON objects (`{"name": …, "arguments": {…}}`), shared by the
//! formats that write them so: hermes, llama3_json, and the marked lists of mistral and granite.

use std::collections::HashMap;

use serde_json::value::RawValue;
use serde_json::Value;

use super::parsed::ParsedCall;

/// Reads one `{"name": …, <arguments key>: {…}}` object (raw JSON text), the first of
/// `argument_keys` present holding the arguments. `None` when it is not a well-formed call of a
/// declared function.
pub(super) fn read_call(
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
pub(super) fn argument_text(arguments: &RawValue) -> Option<String> {
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
pub(super) fn leading_json(text: &str) -> Option<(&RawValue, &str)> {
    let mut values = serde_json::Deserializer::from_str(text).into_iter::<&RawValue>();
    let value = values.next()?.ok()?;
    Some((value, &text[values.byte_offset()..]))
}
