use serde_json::{json, Value};

use super::*;

fn params(body: Value) -> GenerationParams {
    serde_json::from_value(body).expect("generation params")
}

fn grammar(body: Value) -> Option<OutputGrammar> {
    output_grammar(&params(body)).expect("accepted")
}

fn refused(body: Value) -> (String, String) {
    match output_grammar(&params(body.clone())) {
        Err(ValidationError::Invalid { param, message, .. }) => (param, message),
        other => panic!("{body} was not refused: {other:?}"),
    }
}

#[test]
fn text_and_absent_fields_are_free() {
    assert_eq!(grammar(json!({})), None);
    assert_eq!(grammar(json!({"response_format": {"type": "text"}})), None);
    assert_eq!(grammar(json!({"response_format": null})), None);
}

#[test]
fn json_object_is_any_object() {
    for body in [
        json!({"response_format": {"type": "json_object"}}),
        json!({"structured_outputs": {"json_object": true}}),
    ] {
        let g = grammar(body).unwrap();
        assert_eq!(g.kind, Kind::JsonSchema);
        let schema: Value = serde_json::from_str(&g.text).unwrap();
        assert_eq!(schema, json!({"type": "object"}));
    }
}

#[test]
fn a_json_schema_is_passed_on_as_json() {
    let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
    let g = grammar(json!({"response_format": {"type": "json_schema",
        "json_schema": {"name": "thing_1", "schema": schema, "strict": true}}}))
    .unwrap();
    assert_eq!((g.kind, g.param), (Kind::JsonSchema, "response_format"));
    assert_eq!(serde_json::from_str::<Value>(&g.text).unwrap(), schema);
    // vLLM takes a schema as an object or as a string holding one.
    for body in [
        json!({"structured_outputs": {"json": schema}}),
        json!({"guided_json": schema.to_string()}),
    ] {
        let g = grammar(body).unwrap();
        assert_eq!(serde_json::from_str::<Value>(&g.text).unwrap(), schema);
    }
}

#[test]
fn regex_choice_and_grammar_map_to_their_kinds() {
    let g = grammar(json!({"structured_outputs": {"regex": "[a-z]{3}"}})).unwrap();
    assert_eq!(
        (g.kind, g.text.as_str(), g.param),
        (Kind::Regex, "[a-z]{3}", "structured_outputs")
    );
    let g = grammar(json!({"guided_regex": "\\d+"})).unwrap();
    assert_eq!((g.kind, g.param), (Kind::Regex, "guided_regex"));
    let g = grammar(json!({"guided_grammar": "start: \"a\"+"})).unwrap();
    assert_eq!((g.kind, g.param), (Kind::Lark, "guided_grammar"));
    // Choices become Lark literals, quotes and backslashes escaped as JSON strings are.
    let g =
        grammar(json!({"structured_outputs": {"choice": ["yes", "no \"way\"", "a\\b"]}})).unwrap();
    assert_eq!(g.kind, Kind::Lark);
    assert_eq!(g.text, r#"start: "yes" | "no \"way\"" | "a\\b""#);
}

#[test]
fn malformed_response_formats_name_the_field() {
    for body in [
        json!({"response_format": "json"}),
        json!({"response_format": {}}),
        json!({"response_format": {"type": "xml"}}),
        json!({"response_format": {"type": "json_schema"}}),
        json!({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}),
        json!({"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}}),
        json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
        json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}}),
        json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": false}}}),
        json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}}}),
    ] {
        assert_eq!(refused(body).0, "response_format");
    }
}

#[test]
fn malformed_structured_outputs_name_the_field() {
    for (body, param) in [
        (json!({"structured_outputs": []}), "structured_outputs"),
        (json!({"structured_outputs": {}}), "structured_outputs"),
        (
            json!({"structured_outputs": {"regex": "a", "choice": ["a"]}}),
            "structured_outputs",
        ),
        (
            json!({"structured_outputs": {"structural_tag": "x"}}),
            "structured_outputs",
        ),
        (
            json!({"structured_outputs": {"regex": ""}}),
            "structured_outputs",
        ),
        (
            json!({"structured_outputs": {"json_object": false}}),
            "structured_outputs",
        ),
        (json!({"guided_choice": []}), "guided_choice"),
        (json!({"guided_choice": ["a", 3]}), "guided_choice"),
        (json!({"guided_json": "{not json"}), "guided_json"),
        (json!({"guided_regex": 5}), "guided_regex"),
    ] {
        assert_eq!(refused(body.clone()).0, param, "{body}");
    }
}

#[test]
fn tool_call_grammars_are_lark_reported_under_tools() {
    let g = OutputGrammar::tool_calls("start: \"x\"".to_owned());
    assert_eq!(
        (g.kind, g.text.as_str(), g.param),
        (Kind::Lark, "start: \"x\"", "tools")
    );
}

#[test]
fn two_constraints_at_once_are_refused() {
    let (param, message) = refused(json!({
        "response_format": {"type": "json_object"},
        "guided_regex": "a+",
    }));
    assert_eq!(param, "guided_regex");
    assert!(message.contains("response_format"), "{message}");
    // `text` constrains nothing, so it combines with anything.
    assert!(grammar(json!({"response_format": {"type": "text"}, "guided_regex": "a+"})).is_some());
}
