//! The field table against OpenAI's field lists (`testdata/openai/request-fields.json`, taken from
//! OpenAI's OpenAPI description) and against the tables of `docs/api.md`.

use std::collections::BTreeSet;
use std::path::Path;

use serde_json::{json, Value};

use super::*;

fn repo_file(path: &str) -> String {
    let full = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(path);
    std::fs::read_to_string(&full).unwrap_or_else(|error| panic!("{}: {error}", full.display()))
}

fn endpoint_table(endpoint: &str) -> Vec<Field> {
    let own = match endpoint {
        "chat" => CHAT,
        "completions" => COMPLETIONS,
        // The Responses API shares none of the chat endpoints' fields table.
        "responses" => return crate::openai::responses_request::RESPONSES.to_vec(),
        "embeddings" => return crate::openai::embeddings::EMBEDDINGS.to_vec(),
        other => panic!("no endpoint {other}"),
    };
    own.iter().chain(SHARED).copied().collect()
}

#[test]
fn every_openai_request_field_is_classified() {
    let lists: Value = serde_json::from_str(&repo_file("testdata/openai/request-fields.json"))
        .expect("request-fields.json is JSON");
    for endpoint in ["chat", "completions", "responses", "embeddings"] {
        let table = endpoint_table(endpoint);
        let openai = lists[endpoint].as_array().expect("a list of names");
        assert!(openai.len() >= 5, "{endpoint}: too few fields, wrong file?");
        for name in openai {
            let name = name.as_str().expect("a name");
            assert!(
                table.iter().any(|field| field.name == name),
                "{endpoint}: OpenAI's `{name}` is not in router/src/openai/fields.rs"
            );
        }
    }
}

#[test]
fn each_field_is_listed_once_with_a_reason_unless_implemented() {
    for endpoint in ["chat", "completions", "responses", "embeddings"] {
        let table = endpoint_table(endpoint);
        let names: BTreeSet<_> = table.iter().map(|field| field.name).collect();
        assert_eq!(
            names.len(),
            table.len(),
            "{endpoint}: a field is listed twice"
        );
        for field in &table {
            let needs_reason = field.status != Status::Implemented;
            assert_eq!(!field.reason.is_empty(), needs_reason, "{}", field.name);
        }
    }
}

/// `(name, status)` of each row of the table under `heading` in `markdown`.
fn doc_rows(markdown: &str, heading: &str) -> Vec<(String, String)> {
    let mut lines = markdown.lines().skip_while(|line| line.trim() != heading);
    assert!(
        lines.next().is_some(),
        "docs/api.md has no heading {heading:?}"
    );
    lines
        .skip_while(|line| !line.starts_with('|'))
        .take_while(|line| line.starts_with('|'))
        .skip(2) // the header and the separator
        .map(|line| {
            let cells: Vec<&str> = line.split('|').map(str::trim).collect();
            (cells[1].trim_matches('`').to_owned(), cells[2].to_owned())
        })
        .collect()
}

#[test]
fn docs_have_one_row_per_field_with_its_status() {
    let markdown = repo_file("docs/api.md");
    for (endpoint, heading) in [
        ("chat", "### Chat completions: request fields"),
        ("completions", "### Completions: request fields"),
        ("responses", "### Responses: request fields"),
        ("embeddings", "### Embeddings: request fields"),
    ] {
        let rows = doc_rows(&markdown, heading);
        let table = endpoint_table(endpoint);
        for field in &table {
            let matching: Vec<_> = rows.iter().filter(|(name, _)| name == field.name).collect();
            assert_eq!(matching.len(), 1, "{heading}: `{}` rows", field.name);
            assert_eq!(
                matching[0].1,
                field.status.label(),
                "{heading}: `{}`",
                field.name
            );
        }
        for (name, _) in &rows {
            assert!(
                table.iter().any(|field| field.name == name),
                "{heading}: `{name}` is documented but not in the table"
            );
        }
    }
}

fn refusal(own: &[Field], body: Value) -> Option<(String, &'static str)> {
    let Value::Object(body) = body else {
        panic!("not an object")
    };
    check_fields(own, &body).err().map(|error| match error {
        ApiError::BadRequestBody { param, code, .. } => (param.unwrap_or_default(), code),
        other => panic!("unexpected {other:?}"),
    })
}

#[test]
fn refused_and_unknown_fields_are_named() {
    for (body, param) in [
        (
            json!({"audio": {"voice": "alloy", "format": "mp3"}}),
            "audio",
        ),
        (
            json!({"prediction": {"type": "content", "content": "x"}}),
            "prediction",
        ),
        (json!({"web_search_options": {}}), "web_search_options"),
        (json!({"reasoning_effort": "low"}), "reasoning_effort"),
        (json!({"grammar": {"type": "json"}}), "grammar"),
        (json!({"use_beam_search": true}), "use_beam_search"),
    ] {
        let (named, _) = refusal(CHAT, body.clone()).unwrap_or_else(|| panic!("{body}"));
        assert_eq!(named, param, "{body}");
    }
}

#[test]
fn unknown_fields_are_accepted_and_named() {
    let names = |own: &[Field], body: Value| {
        let Value::Object(body) = body else {
            panic!("not an object")
        };
        check_fields(own, &body).expect("accepted")
    };
    assert_eq!(
        names(
            CHAT,
            json!({"max_token": 5, "temperature": 0, "x_extra": {}})
        ),
        vec!["max_token".to_owned(), "x_extra".to_owned()]
    );
    // A chat-only field on completions is unknown there; a null one is absent.
    assert_eq!(
        names(COMPLETIONS, json!({"messages": [], "foo": null})),
        vec!["messages".to_owned()]
    );
    assert!(names(COMPLETIONS, json!({"prompt": "x", "echo": true})).is_empty());
}

#[test]
fn fields_taken_with_some_values_refuse_the_others() {
    assert_eq!(
        refusal(CHAT, json!({"modalities": ["text", "audio"]})),
        Some(("modalities".to_owned(), "unsupported_value"))
    );
    assert_eq!(
        refusal(COMPLETIONS, json!({"suffix": "tail"})),
        Some(("suffix".to_owned(), "unsupported_value"))
    );
}

#[test]
fn accepted_values_and_nulls_pass() {
    let chat = json!({
        "model": "m", "messages": [], "response_format": {"type": "text"},
        "tool_choice": "auto", "parallel_tool_calls": true, "modalities": ["text"],
        "user": "u", "metadata": {"k": "v"}, "store": false, "service_tier": "auto",
        "safety_identifier": "s", "prompt_cache_key": "k", "top_k": 5, "stop_token_ids": [1],
        "functions": null, "audio": null, "no_such_field": null
    });
    assert_eq!(refusal(CHAT, chat), None);
    assert_eq!(refusal(CHAT, json!({"tool_choice": "none"})), None);
    // Tool fields are checked with the tools they go with (`tool_calls::check_tool_request`).
    for body in [
        json!({"tool_choice": "required"}),
        json!({"functions": [], "function_call": "auto"}),
    ] {
        assert_eq!(refusal(CHAT, body), None);
    }
    let completions =
        json!({"prompt": "p", "suffix": "", "echo": false, "best_of": 1, "user": "u"});
    assert_eq!(refusal(COMPLETIONS, completions), None);
}
