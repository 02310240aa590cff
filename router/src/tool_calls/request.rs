//! The request's tools, checked: `tools`, `tool_choice`, `parallel_tool_calls`, and the legacy
//! `functions`/`function_call`, which map onto the same (and are answered in the legacy shape).
//! Every mistake is a 400 naming the field (`tools[0].function.name`), before any generation.

use std::collections::HashSet;

use serde_json::{json, Map, Value};

use crate::validation::ValidationError;

/// One declared function.
#[derive(Debug, Clone, PartialEq)]
pub struct FunctionSpec {
    pub name: String,
    /// The JSON schema of its arguments, an object schema (`{"type": "object", "properties":
    /// {}, "additionalProperties": false}` when the tool gave none: no arguments).
    pub parameters: Value,
}

/// `tool_choice` (or legacy `function_call`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// The model answers in text; tools still reach the template (as vLLM does) and the reply
    /// is not read for calls.
    None,
    /// Text, calls, or both: the model chooses.
    Auto,
    /// One or more calls, nothing else.
    Required,
    /// Exactly one call of this function.
    Named(String),
}

/// The tools of one chat request.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolRequest {
    pub functions: Vec<FunctionSpec>,
    pub choice: ToolChoice,
    /// `parallel_tool_calls` (default true): false allows at most one call.
    pub parallel: bool,
    /// Sent as `functions`/`function_call`: answered with `message.function_call`.
    pub legacy: bool,
    /// The tools as the chat template receives them (`functions` rewritten as `tools`).
    pub template_tools: Value,
}

/// The raw tool fields of a chat body.
#[derive(Debug, Clone, Copy, Default)]
pub struct ToolFields<'a> {
    pub tools: Option<&'a Value>,
    pub tool_choice: Option<&'a Value>,
    pub parallel_tool_calls: Option<&'a Value>,
    pub functions: Option<&'a Value>,
    pub function_call: Option<&'a Value>,
}

/// OpenAI's limit on a function name: `^[a-zA-Z0-9_-]{1,64}$`.
const MAX_NAME_LENGTH: usize = 64;

/// Checks the tool fields. `None` when the request declares no tools (and asks for no call).
pub fn check_tool_request(fields: ToolFields) -> Result<Option<ToolRequest>, ValidationError> {
    let parallel = match fields.parallel_tool_calls {
        None | Some(Value::Null) => true,
        Some(Value::Bool(parallel)) => *parallel,
        Some(_) => return Err(invalid("parallel_tool_calls", "must be a boolean")),
    };
    let tools = present(fields.tools);
    let functions = present(fields.functions);
    let legacy = match (tools, functions) {
        (Some(_), Some(_)) => {
            return Err(invalid(
                "functions",
                "cannot be sent with `tools`; `functions` is the legacy form of `tools`",
            ))
        }
        (None, Some(_)) => true,
        _ => false,
    };
    if !legacy && present(fields.function_call).is_some() {
        return Err(invalid(
            "function_call",
            "goes with the legacy `functions`; use `tool_choice` with `tools`",
        ));
    }
    if legacy && present(fields.tool_choice).is_some() {
        return Err(invalid(
            "tool_choice",
            "goes with `tools`; use `function_call` with the legacy `functions`",
        ));
    }
    let (specs, template_tools) = match (tools, functions) {
        (Some(tools), _) => (check_tools(tools)?, tools.clone()),
        (None, Some(functions)) => {
            let specs = check_functions(functions)?;
            // The template reads OpenAI's current shape: each function wrapped as a tool.
            let wrapped = functions
                .as_array()
                .map(|list| {
                    list.iter()
                        .map(|function| json!({"type": "function", "function": function}))
                        .collect()
                })
                .unwrap_or_default();
            (specs, Value::Array(wrapped))
        }
        (None, None) => (Vec::new(), Value::Null),
    };
    let (choice_param, choice) = match legacy {
        true => ("function_call", present(fields.function_call)),
        false => ("tool_choice", present(fields.tool_choice)),
    };
    let choice = match choice {
        None => ToolChoice::Auto,
        Some(value) => read_choice(choice_param, value, legacy)?,
    };
    if let ToolChoice::Named(name) = &choice {
        if !specs.iter().any(|spec| spec.name == *name) {
            return Err(invalid(
                choice_param,
                &format!("names the function `{name}`, which the request does not declare"),
            ));
        }
    }
    if specs.is_empty() {
        return match choice {
            ToolChoice::Required | ToolChoice::Named(_) => Err(invalid(
                choice_param,
                "asks for a tool call, but the request declares no tools",
            )),
            ToolChoice::None | ToolChoice::Auto => Ok(None),
        };
    }
    Ok(Some(ToolRequest {
        functions: specs,
        choice,
        parallel: parallel && !legacy,
        legacy,
        template_tools,
    }))
}

/// A field, `null` counting as absent.
fn present(value: Option<&Value>) -> Option<&Value> {
    value.filter(|value| !value.is_null())
}

/// `[{"type": "function", "function": {...}}]`.
fn check_tools(tools: &Value) -> Result<Vec<FunctionSpec>, ValidationError> {
    let list = tools
        .as_array()
        .ok_or_else(|| invalid("tools", "must be a list of tools"))?;
    let mut specs: Vec<FunctionSpec> = Vec::with_capacity(list.len());
    let mut names = HashSet::with_capacity(list.len());
    for (i, tool) in list.iter().enumerate() {
        let param = format!("tools[{i}]");
        let tool = tool
            .as_object()
            .ok_or_else(|| invalid(&param, "must be an object"))?;
        match tool.get("type") {
            Some(Value::String(kind)) if kind == "function" => {}
            Some(Value::String(kind)) => {
                return Err(invalid(
                    &format!("{param}.type"),
                    &format!("`{kind}` is not supported: only \"function\" tools are"),
                ))
            }
            _ => return Err(invalid(&format!("{param}.type"), "must be \"function\"")),
        }
        let function = tool
            .get("function")
            .ok_or_else(|| missing(&format!("{param}.function")))?;
        let spec = check_function(&format!("{param}.function"), function)?;
        check_unique(&mut names, &spec, &format!("{param}.function.name"))?;
        specs.push(spec);
    }
    Ok(specs)
}

/// Legacy `[{"name", "description", "parameters"}]`.
fn check_functions(functions: &Value) -> Result<Vec<FunctionSpec>, ValidationError> {
    let list = functions
        .as_array()
        .ok_or_else(|| invalid("functions", "must be a list of functions"))?;
    let mut specs: Vec<FunctionSpec> = Vec::with_capacity(list.len());
    let mut names = HashSet::with_capacity(list.len());
    for (i, function) in list.iter().enumerate() {
        let param = format!("functions[{i}]");
        let spec = check_function(&param, function)?;
        check_unique(&mut names, &spec, &format!("{param}.name"))?;
        specs.push(spec);
    }
    Ok(specs)
}

/// `spec`'s name, not among the `names` declared before it (a set: a list searched per tool made
/// a request of many tools quadratic).
fn check_unique(
    names: &mut HashSet<String>,
    spec: &FunctionSpec,
    param: &str,
) -> Result<(), ValidationError> {
    if !names.insert(spec.name.clone()) {
        return Err(invalid(
            param,
            &format!(
                "`{}` is declared twice; function names must be unique",
                spec.name
            ),
        ));
    }
    Ok(())
}

/// `{"name", "description"?, "parameters"?, "strict"?}` at `param`.
fn check_function(param: &str, function: &Value) -> Result<FunctionSpec, ValidationError> {
    let function = function
        .as_object()
        .ok_or_else(|| invalid(param, "must be an object"))?;
    let name_param = format!("{param}.name");
    let name = match function.get("name") {
        None | Some(Value::Null) => return Err(missing(&name_param)),
        Some(Value::String(name)) => name,
        Some(_) => return Err(invalid(&name_param, "must be a string")),
    };
    if !valid_name(name) {
        return Err(invalid(
            &name_param,
            "must be 1 to 64 characters of a-z, A-Z, 0-9, underscores and dashes",
        ));
    }
    if !matches!(
        function.get("description"),
        None | Some(Value::Null | Value::String(_))
    ) {
        return Err(invalid(&format!("{param}.description"), "must be a string"));
    }
    if !matches!(
        function.get("strict"),
        None | Some(Value::Null | Value::Bool(_))
    ) {
        return Err(invalid(&format!("{param}.strict"), "must be a boolean"));
    }
    let parameters = match function.get("parameters") {
        None | Some(Value::Null) => no_arguments(),
        Some(Value::Object(schema)) => object_schema(&format!("{param}.parameters"), schema)?,
        Some(_) => {
            return Err(invalid(
                &format!("{param}.parameters"),
                "must be a JSON schema object",
            ))
        }
    };
    Ok(FunctionSpec {
        name: name.clone(),
        parameters,
    })
}

fn valid_name(name: &str) -> bool {
    (1..=MAX_NAME_LENGTH).contains(&name.len())
        && name
            .bytes()
            .all(|byte| byte.is_ascii_alphanumeric() || byte == b'_' || byte == b'-')
}

/// OpenAI's meaning of a function without `parameters`: it takes none.
fn no_arguments() -> Value {
    json!({"type": "object", "properties": {}, "additionalProperties": false})
}

/// Arguments are an object: a schema of another type is refused, one without a type gets
/// `"type": "object"`.
fn object_schema(param: &str, schema: &Map<String, Value>) -> Result<Value, ValidationError> {
    let mut schema = schema.clone();
    match schema.get("type") {
        None => {
            schema.insert("type".to_owned(), json!("object"));
        }
        Some(Value::String(kind)) if kind == "object" => {}
        Some(_) => {
            return Err(invalid(
                &format!("{param}.type"),
                "must be \"object\": a function's arguments are a JSON object",
            ))
        }
    }
    Ok(Value::Object(schema))
}

/// `"none"` | `"auto"` | `"required"` | `{"type": "function", "function": {"name"}}`; legacy
/// `function_call`: `"none"` | `"auto"` | `{"name"}`.
fn read_choice(param: &str, value: &Value, legacy: bool) -> Result<ToolChoice, ValidationError> {
    let choices = if legacy {
        "\"none\", \"auto\" or {\"name\": ...}"
    } else {
        "\"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}"
    };
    let wrong = || invalid(param, &format!("must be {choices}"));
    match value {
        Value::String(text) => match text.as_str() {
            "none" => Ok(ToolChoice::None),
            "auto" => Ok(ToolChoice::Auto),
            "required" if !legacy => Ok(ToolChoice::Required),
            _ => Err(wrong()),
        },
        Value::Object(object) => {
            let function = if legacy {
                object
            } else {
                if object.get("type").and_then(Value::as_str) != Some("function") {
                    return Err(wrong());
                }
                object
                    .get("function")
                    .and_then(Value::as_object)
                    .ok_or_else(wrong)?
            };
            match function.get("name") {
                Some(Value::String(name)) => Ok(ToolChoice::Named(name.clone())),
                _ => Err(wrong()),
            }
        }
        _ => Err(wrong()),
    }
}

fn invalid(param: &str, message: &str) -> ValidationError {
    ValidationError::Invalid {
        param: param.to_owned(),
        code: "invalid_value",
        message: format!("`{param}`: {message}"),
    }
}

fn missing(param: &str) -> ValidationError {
    ValidationError::Invalid {
        param: param.to_owned(),
        code: "missing_required_parameter",
        message: format!("you must provide `{param}`"),
    }
}

#[cfg(test)]
#[path = "request_tests.rs"]
mod tests;
