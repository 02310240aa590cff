//! Tool requests checked on whole chat bodies: `tool_choice` and its legacy form read, and each
//! malformed field named.

use serde_json::{json, Value};

use super::{check_tool_request, ToolChoice, ToolFields, ToolRequest};
use crate::validation::ValidationError;

pub(super) fn weather_tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Weather",
         "parameters": {"type": "object", "properties": {"city": {"type": "string"},
          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
          "required": ["city"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "get_time"}}
    ])
}

pub(super) fn check(body: Value) -> Result<Option<ToolRequest>, ValidationError> {
    check_tool_request(ToolFields {
        tools: body.get("tools"),
        tool_choice: body.get("tool_choice"),
        parallel_tool_calls: body.get("parallel_tool_calls"),
        functions: body.get("functions"),
        function_call: body.get("function_call"),
    })
}

fn refused_param(body: Value) -> String {
    match check(body.clone()) {
        Err(ValidationError::Invalid { param, .. }) => param,
        other => panic!("{body} was not refused: {other:?}"),
    }
}

#[test]
fn tool_requests_read_choices() {
    let request = check(json!({"tools": weather_tools()})).unwrap().unwrap();
    assert_eq!(request.choice, ToolChoice::Auto);
    assert!(request.parallel && !request.legacy);
    assert_eq!(request.functions.len(), 2);
    // No parameters: no arguments.
    assert_eq!(
        request.functions[1].parameters,
        json!({"type": "object", "properties": {}, "additionalProperties": false})
    );
    for (choice, expected) in [
        (json!("none"), ToolChoice::None),
        (json!("auto"), ToolChoice::Auto),
        (json!("required"), ToolChoice::Required),
        (
            json!({"type": "function", "function": {"name": "get_time"}}),
            ToolChoice::Named("get_time".into()),
        ),
    ] {
        let request = check(json!({"tools": weather_tools(), "tool_choice": choice}))
            .unwrap()
            .unwrap();
        assert_eq!(request.choice, expected);
    }
    let single = check(json!({"tools": weather_tools(), "parallel_tool_calls": false}));
    assert!(!single.unwrap().unwrap().parallel);
}

#[test]
fn tool_requests_without_tools() {
    assert_eq!(check(json!({})).unwrap(), None);
    assert_eq!(
        check(json!({"tools": [], "tool_choice": "auto"})).unwrap(),
        None
    );
    assert_eq!(check(json!({"tool_choice": "none"})).unwrap(), None);
    assert_eq!(
        refused_param(json!({"tool_choice": "required"})),
        "tool_choice"
    );
}

#[test]
fn tool_requests_map_legacy_functions() {
    let functions = json!([{"name": "get_time", "parameters": {"type": "object"}}]);
    let request = check(json!({"functions": functions, "function_call": {"name": "get_time"}}))
        .unwrap()
        .unwrap();
    assert!(request.legacy && !request.parallel);
    assert_eq!(request.choice, ToolChoice::Named("get_time".into()));
    assert_eq!(
        request.template_tools,
        json!([{"type": "function", "function": functions[0]}])
    );
}

#[test]
fn malformed_tool_requests_name_the_field() {
    let tools = weather_tools;
    for (body, param) in [
        (json!({"tools": {}}), "tools"),
        (json!({"tools": [3]}), "tools[0]"),
        (
            json!({"tools": [{"function": {"name": "f"}}]}),
            "tools[0].type",
        ),
        (
            json!({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}),
            "tools[0].type",
        ),
        (
            json!({"tools": [{"type": "function"}]}),
            "tools[0].function",
        ),
        (
            json!({"tools": [{"type": "function", "function": {}}]}),
            "tools[0].function.name",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "has space"}}]}),
            "tools[0].function.name",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "x".repeat(65)}}]}),
            "tools[0].function.name",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}),
            "tools[0].function.parameters",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f",
                   "parameters": {"type": "string"}}}]}),
            "tools[0].function.parameters.type",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f", "description": 1}}]}),
            "tools[0].function.description",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]}),
            "tools[0].function.strict",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f"}},
                             {"type": "function", "function": {"name": "f"}}]}),
            "tools[1].function.name",
        ),
        (
            json!({"tools": tools(), "tool_choice": "always"}),
            "tool_choice",
        ),
        (json!({"tools": tools(), "tool_choice": 1}), "tool_choice"),
        (
            json!({"tools": tools(), "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
            "tool_choice",
        ),
        (
            json!({"tools": tools(), "tool_choice": {"type": "function"}}),
            "tool_choice",
        ),
        (
            json!({"tools": tools(), "parallel_tool_calls": "yes"}),
            "parallel_tool_calls",
        ),
        (json!({"tools": tools(), "functions": []}), "functions"),
        (
            json!({"tools": tools(), "function_call": "auto"}),
            "function_call",
        ),
        (json!({"functions": [{"name": 5}]}), "functions[0].name"),
        (
            json!({"functions": [{"name": "f"}], "function_call": "required"}),
            "function_call",
        ),
        (
            json!({"functions": [{"name": "f"}], "tool_choice": "auto"}),
            "tool_choice",
        ),
    ] {
        assert_eq!(refused_param(body.clone()), param, "{body}");
    }
}
