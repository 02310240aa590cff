use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::*;

fn messages_of(items: &[Value]) -> Result<Vec<Value>, ApiError> {
    let mut messages = ItemMessages::default();
    for (index, item) in items.iter().enumerate() {
        messages.add_item(item, index)?;
    }
    Ok(messages.into_messages())
}

fn call(call_id: &str, name: &str) -> Value {
    json!({"type": "function_call", "call_id": call_id, "name": name, "arguments": "{}"})
}

fn output(call_id: &str) -> Value {
    json!({"type": "function_call_output", "call_id": call_id, "output": "ok"})
}

#[test]
fn an_output_is_the_tool_message_of_its_call() {
    let items = [
        json!({"role": "user", "content": "weather and time?"}),
        call("c1", "get_weather"),
        call("c2", "local_time"),
        output("c2"),
        output("c1"),
    ];
    let messages = messages_of(&items).unwrap();
    assert_eq!(messages.len(), 4, "{messages:?}");
    assert_eq!(messages[1]["content"], Value::Null);
    assert_eq!(
        messages[1]["tool_calls"][1]["function"]["name"],
        "local_time"
    );
    assert_eq!(
        messages[2],
        json!({"role": "tool", "tool_call_id": "c2", "name": "local_time", "content": "ok"})
    );
    assert_eq!(messages[3]["name"], "get_weather");
}

/// OpenAI refuses an output whose call is not earlier in the input ("No tool call found for
/// function call output with call_id …", 400), naming the item.
#[test]
fn an_output_without_an_earlier_call_is_refused() {
    for items in [
        vec![json!({"role": "user", "content": "hi"}), output("nowhere")],
        vec![output("c1"), call("c1", "f")],
    ] {
        let error = messages_of(&items).unwrap_err();
        let index = items
            .iter()
            .position(|item| item["type"] == "function_call_output")
            .unwrap();
        assert_eq!(
            error.param().as_deref(),
            Some(format!("input[{index}]").as_str())
        );
        assert_eq!(error.status(), axum::http::StatusCode::BAD_REQUEST);
        assert!(
            error
                .message()
                .starts_with("No tool call found for function call output with call_id"),
            "{}",
            error.message()
        );
    }
    let long_id = format!("call_{}", "x".repeat(100_000));
    let message = messages_of(&[output(&long_id)]).unwrap_err().message();
    assert!(message.contains("call_xxx"), "{message}");
    assert!(message.len() < 200, "{} bytes", message.len());
}

/// `count` items: half of them one assistant turn's parallel calls, then their outputs in
/// order, so each output's call is as far from it as a body can put it.
fn parallel_round_trip(count: usize) -> Vec<Value> {
    let half = count / 2;
    let calls = (0..half).map(|i| call(&format!("call_{i}"), "f"));
    let outputs = (0..half).map(|i| output(&format!("call_{i}")));
    calls.chain(outputs).collect()
}

fn mapping_time(items: &[Value]) -> Duration {
    // The better of two runs: a scheduler hiccup only ever adds time.
    (0..2)
        .map(|_| {
            let start = Instant::now();
            let messages = messages_of(items).unwrap();
            let elapsed = start.elapsed();
            assert_eq!(messages.len(), 1 + items.len() / 2);
            elapsed
        })
        .min()
        .unwrap()
}

/// The complexity check: 60,000 items map in about ten times the time of 6,000 (a
/// search per output made it a hundred times). Ratios of two sizes timed in one test.
#[test]
fn mapping_is_linear_in_the_items() {
    let small = mapping_time(&parallel_round_trip(6_000));
    let large = mapping_time(&parallel_round_trip(60_000));
    assert!(
        large < small * 30,
        "6,000 items: {small:?}, 60,000 items: {large:?} (more than 30 times)"
    );
}
