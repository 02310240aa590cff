//! Tool requests checked, grammars built, and streamed replies read, on canned model text.
//! Every grammar built here is also written out (see `grammars_are_written_for_llguidance`) so
//! that llguidance itself can validate them (docs/tool-calling.md, "Checking the grammars").

use serde_json::{json, Value};

use super::request::ToolFields;
use super::{
    check_tool_request, detect_parser, parser_for, tool_grammar, ToolCallFormat, ToolCallParser,
    ToolCallStream, ToolChoice, ToolDelta, ToolRequest,
};
use crate::validation::ValidationError;

const PARSERS: [ToolCallParser; 5] = [
    ToolCallParser::Hermes,
    ToolCallParser::Llama3Json,
    ToolCallParser::Mistral,
    ToolCallParser::Granite,
    ToolCallParser::Pythonic,
];

fn weather_tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Weather",
         "parameters": {"type": "object", "properties": {"city": {"type": "string"},
          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
          "required": ["city"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "get_time"}}
    ])
}

fn check(body: Value) -> Result<Option<ToolRequest>, ValidationError> {
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

// ---- request checks ----

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

// ---- detection ----

#[test]
fn parsers_are_detected_from_templates() {
    let qwen = "{%- if tools %}<tools>{{ tool | tojson }}</tools> ... <tool_call>\n{\"name\": ...";
    let llama = "<|start_header_id|>ipython<|end_header_id|> {\"name\": function name, \"parameters\": dictionary}";
    let llama_tag = "{{- '<|python_tag|>' + tool_call.name }}";
    let mistral = "{{- '[TOOL_CALLS] [' }}";
    assert_eq!(detect_parser(qwen), Some(ToolCallParser::Hermes));
    assert_eq!(detect_parser(llama), Some(ToolCallParser::Llama3Json));
    assert_eq!(detect_parser(llama_tag), Some(ToolCallParser::Llama3Json));
    assert_eq!(detect_parser(mistral), Some(ToolCallParser::Mistral));
    let mistral_v11 = "{{- '[TOOL_CALLS]' + tool.function.name + '[ARGS]' + arguments }}";
    assert_eq!(detect_parser(mistral_v11), Some(ToolCallParser::Mistral));
    // Llama 4's own instruction for its pythonic calls.
    let llama4 = "you MUST put it in the format of [func_name1(params_name1=params_value1, \
                  params_name2=params_value2...), func_name2(params)]";
    assert_eq!(detect_parser(llama4), Some(ToolCallParser::Pythonic));
    assert_eq!(detect_parser("{{ messages }}"), None);
    assert_eq!(
        parser_for(None, Some("{{ messages }}"), false),
        ToolCallParser::Hermes
    );
    assert_eq!(parser_for(None, None, false), ToolCallParser::Hermes);
    assert_eq!(
        parser_for(Some(ToolCallParser::Mistral), Some(qwen), false),
        ToolCallParser::Mistral
    );
    // An adapter's own template: its family before the flag, the flag where it shows none.
    let flag = Some(ToolCallParser::Granite);
    assert_eq!(parser_for(flag, Some(qwen), true), ToolCallParser::Hermes);
    assert_eq!(
        parser_for(flag, Some("{{ messages }}"), true),
        ToolCallParser::Granite
    );
}

/// The published templates in testdata/chat-templates (copied from the models' repositories)
/// are detected as their models' families.
#[test]
fn published_templates_are_detected_as_their_family() {
    let template = |name: &str| -> String {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../testdata/chat-templates")
            .join(format!("{name}.json"));
        let file: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        file["chat_template"].as_str().unwrap().to_owned()
    };
    for (name, parser) in [
        ("granite-3.2-instruct", ToolCallParser::Granite),
        ("hermes-2-pro-tool-use", ToolCallParser::Hermes),
        ("qwen2.5-instruct", ToolCallParser::Hermes),
        ("llama-3.1-instruct", ToolCallParser::Llama3Json),
        ("llama-3.2-instruct", ToolCallParser::Llama3Json),
        ("mistral-7b-instruct-v0.3", ToolCallParser::Mistral),
        ("mistral-nemo-instruct-2407", ToolCallParser::Mistral),
    ] {
        assert_eq!(detect_parser(&template(name)), Some(parser), "{name}");
    }
}

// ---- grammars ----

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

// ---- streaming ----

/// Streams `text` in pieces of `size` characters; returns the reassembled content and calls
/// (name, arguments) and the deltas.
pub(super) fn stream(
    parser: ToolCallParser,
    text: &str,
    size: usize,
) -> (Option<String>, Vec<(String, String)>, Vec<ToolDelta>) {
    let declared = vec!["get_weather".to_owned(), "get_time".to_owned()];
    let mut reader = ToolCallStream::new(parser, declared);
    let chars: Vec<char> = text.chars().collect();
    let mut deltas = Vec::new();
    for piece in chars.chunks(size) {
        deltas.extend(reader.push(&piece.iter().collect::<String>()));
    }
    let (last, _) = reader.finish(false);
    deltas.extend(last);
    let mut content: Option<String> = None;
    let mut calls: Vec<(String, String)> = Vec::new();
    for delta in &deltas {
        match delta {
            ToolDelta::Content(text) => content.get_or_insert_with(String::new).push_str(text),
            ToolDelta::CallStart { index, id, name } => {
                assert_eq!(*index, calls.len(), "calls start in order");
                assert!(id.starts_with("call_"));
                calls.push((name.clone(), String::new()));
            }
            ToolDelta::Arguments { index, text } => calls[*index].1.push_str(text),
        }
    }
    (content, calls, deltas)
}

/// The non-streamed reading of `text`, in the same shape.
fn whole(parser: ToolCallParser, text: &str) -> (Option<String>, Vec<(String, String)>) {
    let declared = vec!["get_weather".to_owned(), "get_time".to_owned()];
    let parsed = parser.parse(text, Some(&declared));
    let calls = parsed
        .tool_calls
        .into_iter()
        .map(|call| (call.name, call.arguments))
        .collect();
    (parsed.content, calls)
}

/// Streamed in pieces of every size from 1 to 7 characters, `text` adds up to its
/// non-streamed reading; returns that reading.
pub(super) fn assert_stream_adds_up(
    parser: ToolCallParser,
    text: &str,
) -> (Option<String>, Vec<(String, String)>) {
    let expected = whole(parser, text);
    for size in 1..=7 {
        let (content, calls, _) = stream(parser, text, size);
        assert_eq!(
            (content, calls),
            expected,
            "{parser:?}, pieces of {size}: {text:?}"
        );
    }
    expected
}

/// A reply that is text after all (a call cut short, or not a call of a declared function):
/// its content adds up to the whole text. Deltas of a call that looked well-formed while it
/// streamed were already sent and stand (docs/tool-calling.md).
pub(super) fn assert_streamed_text(parser: ToolCallParser, text: &str) {
    assert_eq!(whole(parser, text), (Some(text.to_owned()), Vec::new()));
    for size in 1..=7 {
        let (content, _, _) = stream(parser, text, size);
        assert_eq!(
            content.as_deref(),
            Some(text),
            "{parser:?}, pieces of {size}"
        );
    }
}

#[test]
fn streamed_hermes_replies_add_up() {
    let call = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\":\"Paris \\\"Nord\\\" → é\",\"days\":3}}\n</tool_call>";
    let time = "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>";
    let (content, calls) = assert_stream_adds_up(ToolCallParser::Hermes, call);
    assert_eq!(content, None);
    assert_eq!(calls[0].0, "get_weather");
    let arguments: Value = serde_json::from_str(&calls[0].1).unwrap();
    assert_eq!(arguments, json!({"city": "Paris \"Nord\" → é", "days": 3}));
    let (content, calls) = assert_stream_adds_up(
        ToolCallParser::Hermes,
        &format!("Checking <tools>.\n{call}\n{time}"),
    );
    assert_eq!(content.as_deref(), Some("Checking <tools>.\n\n"));
    assert_eq!(calls.len(), 2);
    // Text alone, a marker's start at the end, malformed calls: all text.
    for text in [
        "Sunny, 20°C.",
        "a < b and <tool_",
        "<tool_call>\n{\"name\": \"launch\", \"arguments\": {}}\n</tool_call>",
        "<tool_call>\n{\"arguments\": {}, \"name\": \"get_time\"",
    ] {
        let (content, calls) = assert_stream_adds_up(ToolCallParser::Hermes, text);
        assert_eq!((content.as_deref(), calls.len()), (Some(text), 0));
    }
    assert_streamed_text(
        ToolCallParser::Hermes,
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": }}\n</tool_call>",
    );
}

#[test]
fn streamed_arguments_come_in_pieces_after_the_name() {
    let text = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\":\"Paris\"}}\n</tool_call>";
    let (_, _, deltas) = stream(ToolCallParser::Hermes, text, 1);
    let ToolDelta::CallStart { name, .. } = &deltas[0] else {
        panic!("{deltas:?}")
    };
    assert_eq!(name, "get_weather");
    let pieces = deltas[1..]
        .iter()
        .filter(|delta| matches!(delta, ToolDelta::Arguments { .. }))
        .count();
    assert!(pieces > 5, "{deltas:?}");
    // The marker never shows as content.
    assert!(!deltas
        .iter()
        .any(|delta| matches!(delta, ToolDelta::Content(_))));
}

#[test]
fn streamed_llama3_replies_add_up() {
    let calls_text = "{\"name\": \"get_weather\", \"parameters\": {\"city\":\"Paris\"}}; {\"name\": \"get_time\", \"parameters\": {}}";
    let (content, calls) = assert_stream_adds_up(ToolCallParser::Llama3Json, calls_text);
    assert_eq!((content, calls.len()), (None, 2));
    let tagged = format!("<|python_tag|>{calls_text}");
    assert_eq!(
        assert_stream_adds_up(ToolCallParser::Llama3Json, &tagged)
            .1
            .len(),
        2
    );
    for text in ["It is sunny.", "<|pyth"] {
        let (content, calls) = assert_stream_adds_up(ToolCallParser::Llama3Json, text);
        assert_eq!((content.as_deref(), calls.len()), (Some(text), 0));
    }
    assert_streamed_text(
        ToolCallParser::Llama3Json,
        "{\"name\": \"get_weather\", \"parameters\": {",
    );
}

#[test]
fn streamed_mistral_replies_add_up() {
    let text = "I will check.[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\":\"Paris\"}}, {\"name\": \"get_time\", \"arguments\": {}}]";
    let (content, calls) = assert_stream_adds_up(ToolCallParser::Mistral, text);
    assert_eq!(content.as_deref(), Some("I will check."));
    assert_eq!(calls.len(), 2);
    let (content, calls) = assert_stream_adds_up(ToolCallParser::Mistral, "Sunny [TOOL");
    assert_eq!((content.as_deref(), calls.len()), (Some("Sunny [TOOL"), 0));
    assert_streamed_text(
        ToolCallParser::Mistral,
        "[TOOL_CALLS] [{\"name\": \"get_time\", \"arguments\": {}",
    );
}

#[test]
fn arguments_written_as_a_string_arrive_at_the_end() {
    let text =
        r#"<tool_call>{"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}</tool_call>"#;
    let (_, calls) = assert_stream_adds_up(ToolCallParser::Hermes, text);
    assert_eq!(
        calls,
        vec![("get_weather".into(), r#"{"city":"Paris"}"#.into())]
    );
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
    let plan = super::ToolPlan::new(request.clone(), ToolCallParser::Hermes, &qwen);
    assert!(plan.grammar_text().unwrap().contains(&format!("<[{id}]>")));
    assert!(plan.grammar_text().unwrap().contains("\"</tool_call>\""));
    assert!(!plan.keeps_special_tokens());
    // Mistral's `[TOOL_CALLS]` is special: the detokenizer must keep it for the parser.
    let mistral = tokenizer_with("[TOOL_CALLS]", true);
    let id = mistral.inner().token_to_id("[TOOL_CALLS]").unwrap();
    let plan = super::ToolPlan::new(request, ToolCallParser::Mistral, &mistral);
    assert!(plan.grammar_text().unwrap().contains(&format!("<[{id}]>")));
    assert!(plan.keeps_special_tokens());
}
