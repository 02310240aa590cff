//! Tool turns as OpenAI shapes them: an assistant's `tool_calls` and a tool result's
//! `tool_call_id`. They pass to the chat template unchanged, as transformers receives them
//! (`arguments` stays the JSON string OpenAI sends; templates print strings as they are), so
//! only a shape no template could read is refused, before it becomes a template error.

use serde_json::Value;

use super::ValidationError;

/// Checks `messages[i]`'s tool fields, when present.
pub(super) fn check_tool_fields(
    i: usize,
    message: &serde_json::Map<String, Value>,
) -> Result<(), ValidationError> {
    match message.get("tool_call_id") {
        None | Some(Value::Null) | Some(Value::String(_)) => {}
        Some(_) => {
            return Err(ValidationError::invalid(
                format!("messages[{i}].tool_call_id"),
                format!("messages[{i}].tool_call_id must be a string"),
            ))
        }
    }
    let calls = match message.get("tool_calls") {
        None | Some(Value::Null) => return Ok(()),
        Some(Value::Array(calls)) => calls,
        Some(_) => {
            return Err(ValidationError::invalid(
                format!("messages[{i}].tool_calls"),
                format!("messages[{i}].tool_calls must be a list of tool calls"),
            ))
        }
    };
    for (j, call) in calls.iter().enumerate() {
        check_call(&format!("messages[{i}].tool_calls[{j}]"), call)?;
    }
    Ok(())
}

/// `{"id", "type": "function", "function": {"name": string, "arguments": string}}`; an object
/// for `arguments` is accepted too, since chat templates print it as JSON.
fn check_call(param: &str, call: &Value) -> Result<(), ValidationError> {
    let function = call
        .as_object()
        .ok_or_else(|| ValidationError::invalid(param, format!("{param} must be an object")))?
        .get("function")
        .ok_or_else(|| ValidationError::missing(&format!("{param}.function")))?
        .as_object()
        .ok_or_else(|| {
            ValidationError::invalid(
                format!("{param}.function"),
                format!("{param}.function must be an object"),
            )
        })?;
    match function.get("name") {
        Some(Value::String(_)) => {}
        Some(_) => {
            return Err(ValidationError::invalid(
                format!("{param}.function.name"),
                format!("{param}.function.name must be a string"),
            ))
        }
        None => return Err(ValidationError::missing(&format!("{param}.function.name"))),
    }
    match function.get("arguments") {
        Some(Value::String(_)) | Some(Value::Object(_)) => Ok(()),
        Some(_) => Err(ValidationError::invalid(
            format!("{param}.function.arguments"),
            format!("{param}.function.arguments must be a JSON string"),
        )),
        None => Err(ValidationError::missing(&format!(
            "{param}.function.arguments"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn check(message: Value) -> Result<(), ValidationError> {
        check_tool_fields(2, message.as_object().expect("object"))
    }

    #[test]
    fn openai_tool_turns_pass() {
        let call = json!({"id": "c1", "type": "function",
                          "function": {"name": "f", "arguments": "{\"x\": 1}"}});
        let object_args = json!({"function": {"name": "f", "arguments": {"x": 1}}});
        assert!(check(json!({"role": "assistant", "content": null,
                             "tool_calls": [call, object_args]}))
        .is_ok());
        assert!(check(json!({"role": "tool", "tool_call_id": "c1", "content": "ok"})).is_ok());
        assert!(check(json!({"role": "user", "content": "no tool fields"})).is_ok());
    }

    #[test]
    fn malformed_tool_fields_name_the_parameter() {
        let cases = [
            (json!({"tool_calls": "f()"}), "messages[2].tool_calls"),
            (json!({"tool_calls": [1]}), "messages[2].tool_calls[0]"),
            (
                json!({"tool_calls": [{"id": "c"}]}),
                "messages[2].tool_calls[0].function",
            ),
            (
                json!({"tool_calls": [{"function": {"arguments": "{}"}}]}),
                "messages[2].tool_calls[0].function.name",
            ),
            (
                json!({"tool_calls": [{"function": {"name": 7, "arguments": "{}"}}]}),
                "messages[2].tool_calls[0].function.name",
            ),
            (
                json!({"tool_calls": [{"function": {"name": "f"}}]}),
                "messages[2].tool_calls[0].function.arguments",
            ),
            (
                json!({"tool_calls": [{"function": {"name": "f", "arguments": [1]}}]}),
                "messages[2].tool_calls[0].function.arguments",
            ),
            (json!({"tool_call_id": 5}), "messages[2].tool_call_id"),
        ];
        for (message, param) in cases {
            let error = check(message.clone()).expect_err(&message.to_string());
            assert_eq!(error.param(), Some(param), "{message}");
        }
    }
}
