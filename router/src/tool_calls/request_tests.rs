use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::*;

fn tools(count: usize) -> Value {
    let tool = |i| json!({"type": "function", "function": {"name": format!("f{i}")}});
    Value::Array((0..count).map(tool).collect())
}

fn check(tools: &Value) -> Result<Option<ToolRequest>, ValidationError> {
    check_tool_request(ToolFields {
        tools: Some(tools),
        tool_choice: None,
        parallel_tool_calls: None,
        functions: None,
        function_call: None,
    })
}

fn checking_time(tools: &Value) -> Duration {
    // The better of two runs: a scheduler hiccup only ever adds time.
    (0..2)
        .map(|_| {
            let start = Instant::now();
            assert!(check(tools).unwrap().is_some());
            start.elapsed()
        })
        .min()
        .unwrap()
}

/// Each name is checked against the names before it through a set: ten times the tools take
/// about ten times as long (a list searched per tool took a hundred). Ratios of two sizes timed
/// in one test.
#[test]
fn checking_tools_is_linear_in_their_number() {
    let small = checking_time(&tools(2_000));
    let large = checking_time(&tools(20_000));
    assert!(
        large < small * 30,
        "2,000 tools: {small:?}, 20,000 tools: {large:?} (more than 30 times)"
    );
}

#[test]
fn a_name_declared_twice_is_refused_at_its_second_place() {
    let mut list = tools(5);
    list[4] = list[1].clone();
    let error = check(&list).unwrap_err();
    assert_eq!(error.param(), Some("tools[4].function.name"));
    assert!(
        error.to_string().contains("`f1` is declared twice"),
        "{error}"
    );
}
