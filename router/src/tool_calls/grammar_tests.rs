//! Grammars built for every format, choice and marker kind. Every grammar built here is also
//! written out (see `grammars_are_written_for_llguidance`) so that llguidance itself can
//! validate them (docs/tool-calling.md, "Checking the grammars").

use serde_json::{json, Value};

use super::request_fields_tests::{check, weather_tools};
use super::{tool_grammar, ToolCallParser, ToolPlan, ToolRequest};

const PARSERS: [ToolCallParser; 5] = [
    ToolCallParser::Hermes,
    ToolCallParser::Llama3Json,
    ToolCallParser::Mistral,
    ToolCallParser::Granite,
    ToolCallParser::Pythonic,
];

fn request(choice: Value, parallel: bool) -> ToolRequest {
    check(json!({"tools": weather_tools(), "tool_choice": choice, "parallel_tool_calls": parallel}))
        .unwrap()
        .unwrap()
}

fn no_special(_: &str) -> Option<u32> {
    None
}

/// Every (parser, choice, parallel, special markers) combination, labelled.
fn all_grammars() -> Vec<(String, String)> {
    let special = |text: &str| match text {
        "<tool_call>" => Some(151657),
        "</tool_call>" => Some(151658),
        "<|python_tag|>" => Some(128010),
        "[TOOL_CALLS]" => Some(5),
        "<|tool_call|>" => Some(49153),
        _ => None,
    };
    // A Mistral tokenizer from v11 on: `[ARGS]` is a token too.
    let v11 = |text: &str| match text {
        "[ARGS]" => Some(32),
        _ => special(text),
    };
    let mut grammars = Vec::new();
    for parser in PARSERS {
        for (choice_label, choice) in [
            ("auto", json!("auto")),
            ("required", json!("required")),
            (
                "named",
                json!({"type": "function", "function": {"name": "get_weather"}}),
            ),
        ] {
            for parallel in [true, false] {
                let mut lookups = vec![
                    ("text", &no_special as &dyn Fn(&str) -> Option<u32>),
                    ("special", &special),
                ];
                if parser == ToolCallParser::Mistral {
                    lookups.push(("v11", &v11));
                }
                for (marker_label, lookup) in lookups {
                    let request = request(choice.clone(), parallel);
                    let grammar = tool_grammar(parser, &request, lookup).expect("a grammar");
                    let label = format!(
                        "{}-{choice_label}-{}-{marker_label}",
                        parser.name(),
                        if parallel { "parallel" } else { "single" }
                    );
                    grammars.push((label, grammar));
                }
            }
        }
    }
    grammars
}

#[test]
fn no_grammar_for_tool_choice_none() {
    for parser in PARSERS {
        assert_eq!(
            tool_grammar(parser, &request(json!("none"), true), &no_special),
            None
        );
    }
}

#[test]
fn grammars_embed_each_schema_and_name_first_openings() {
    for (label, grammar) in all_grammars() {
        assert!(grammar.starts_with("%llguidance {}\nstart: "), "{label}");
        let named = label.contains("-named-");
        let format = label.split('-').next().unwrap();
        let v11 = label.ends_with("-v11");
        assert_eq!(grammar.contains("get_time"), !named, "{label}");
        let opening = match format {
            "pythonic" => r#"fn_0: "get_weather(""#.to_owned(),
            _ if v11 => r#"fn_0: "get_weather" <[32]> args_0"#.to_owned(),
            "llama3_json" => r#""{\"name\": \"get_weather\", \"parameters\": ""#.to_owned(),
            _ => r#""{\"name\": \"get_weather\", \"arguments\": ""#.to_owned(),
        };
        assert!(grammar.contains(&opening), "{label}: {grammar}");
        if format == "pythonic" {
            // Keywords from the parameters, each value of its type.
            assert!(
                grammar.contains(r#"kw_0_0: "city=" PY_STRING"#),
                "{label}: {grammar}"
            );
            assert!(
                grammar.contains(r#"kw_0_1: "days=" PY_INT"#),
                "{label}: {grammar}"
            );
            assert_eq!(
                grammar.contains("PLAIN"),
                label.contains("-auto-"),
                "{label}"
            );
            continue;
        }
        // The schema is embedded whole, with llguidance's compact-JSON option.
        let schema_line = grammar
            .lines()
            .find(|line| line.starts_with("args_0: %json "))
            .unwrap();
        let schema: Value = serde_json::from_str(&schema_line["args_0: %json ".len()..]).unwrap();
        assert_eq!(schema["x-guidance"], json!({"whitespace_flexible": false}));
        assert_eq!(schema["properties"]["days"]["maximum"], json!(7));
        // Special markers by id, plain ones as text.
        let special = label.ends_with("-special") || v11;
        let marker = match format {
            "hermes" => ("<[151657]>", "\"<tool_call>\""),
            "llama3_json" => ("<[128010]>", "\"<|python_tag|>\""),
            "granite" => ("<[49153]>", "\"<|tool_call|>\""),
            _ => ("<[5]>", "\"[TOOL_CALLS]\""),
        };
        let forced_llama = format == "llama3_json" && !label.contains("-auto-");
        if !forced_llama {
            let (by_id, by_text) = marker;
            assert_eq!(grammar.contains(by_id), special, "{label}: {grammar}");
            assert_eq!(grammar.contains(by_text), !special, "{label}: {grammar}");
        }
        // Free text only in `auto`, and a textual marker then ends it lazily.
        let auto = label.contains("-auto-");
        assert_eq!(
            grammar.contains("TEXT") || grammar.contains("PLAIN"),
            auto,
            "{label}"
        );
        if auto && !special && format != "llama3_json" {
            assert!(grammar.contains("opening[lazy]: TEXT"), "{label}");
        }
    }
}

/// With `QUIVER_TOOL_GRAMMAR_DIR` set, writes every grammar there as `<label>.lark`, for
/// llguidance's own check: `integration-tests/test_tool_grammars_llguidance.py` runs this test
/// and then validates each file with llguidance and runs canned replies through its matcher.
/// Without the variable there is nothing to write (the assertions above cover the text).
#[test]
fn grammars_are_written_for_llguidance() {
    let Some(dir) = std::env::var_os("QUIVER_TOOL_GRAMMAR_DIR") else {
        return;
    };
    let dir = std::path::PathBuf::from(dir);
    std::fs::create_dir_all(&dir).unwrap();
    for (label, grammar) in all_grammars() {
        std::fs::write(dir.join(format!("{label}.lark")), grammar).unwrap();
    }
}

// ---- markers as tokens ----

fn tokenizer_with(marker: &str, special: bool) -> crate::tokenizer::TextTokenizer {
    let mut tokenizer = crate::tokenizer::test_support::byte_level_bpe();
    tokenizer
        .add_tokens([tokenizers::AddedToken::from(marker, special)])
        .expect("the marker is added");
    crate::tokenizer::TextTokenizer::from_tokenizer(tokenizer)
}

#[test]
fn markers_that_are_tokens_are_written_by_id() {
    let request = request(json!("required"), true);
    // Qwen's `<tool_call>` is an added token that is not special: by id, and the detokenizer
    // keeps it anyway.
    let qwen = tokenizer_with("<tool_call>", false);
    let id = qwen.inner().token_to_id("<tool_call>").unwrap();
    let plan = ToolPlan::new(request.clone(), ToolCallParser::Hermes, &qwen);
    assert!(plan.grammar_text().unwrap().contains(&format!("<[{id}]>")));
    assert!(plan.grammar_text().unwrap().contains("\"</tool_call>\""));
    assert!(!plan.keeps_special_tokens());
    // Mistral's `[TOOL_CALLS]` is special: the detokenizer must keep it for the parser.
    let mistral = tokenizer_with("[TOOL_CALLS]", true);
    let id = mistral.inner().token_to_id("[TOOL_CALLS]").unwrap();
    let plan = ToolPlan::new(request, ToolCallParser::Mistral, &mistral);
    assert!(plan.grammar_text().unwrap().contains(&format!("<[{id}]>")));
    assert!(plan.keeps_special_tokens());
}
