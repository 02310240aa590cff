//! The router's chat rendering against transformers' `apply_chat_template`, byte for byte, on
//! the golden corpus in `testdata/chat-templates/` (`golden.json`, made with transformers 5.23
//! and jinja2 3.1.6; its README gives provenance and licence) and on the demo model's own
//! template (`demo-golden.json`, from `generate_demo_golden.py`), and on tool turns with null
//! content (`null-content-golden.json`). Every case must match, or fail where transformers
//! failed.

use std::path::PathBuf;

use quiver_router::template::{ChatTemplate, Clock};
use serde_json::Value;

/// The corpus ships in the repository, so a bare clone runs this test.
fn corpus_dir() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../testdata/chat-templates");
    assert!(
        dir.join("golden.json").is_file(),
        "chat-template corpus not found: {} has no golden.json",
        dir.display()
    );
    dir
}

fn read_json(path: PathBuf) -> Value {
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|err| panic!("cannot read {}: {err}", path.display()));
    serde_json::from_str(&text)
        .unwrap_or_else(|err| panic!("bad JSON in {}: {err}", path.display()))
}

/// The goldens were rendered with `strftime_now` frozen at this moment.
fn frozen_clock() -> Clock {
    let moment = chrono::NaiveDate::from_ymd_opt(2025, 3, 14)
        .and_then(|date| date.and_hms_opt(9, 26, 53))
        .expect("valid date");
    Clock::Fixed(moment)
}

fn load_template(dir: &std::path::Path, file: &str) -> ChatTemplate {
    let spec = read_json(dir.join(file));
    let text = |key: &str| spec.get(key).and_then(Value::as_str).map(str::to_owned);
    let source = text("chat_template").unwrap_or_else(|| panic!("{file} has no chat_template"));
    ChatTemplate::with_clock(source, text("bos_token"), text("eos_token"), frozen_clock())
        .unwrap_or_else(|err| panic!("{file} does not compile: {err}"))
}

#[test]
fn renders_every_golden_case_like_transformers() {
    check_golden_file("golden.json");
}

/// The demo model's ChatML-with-tools template: tool declarations, tool calls with null or
/// absent content and string or object arguments, grouped tool results.
#[test]
fn renders_the_demo_template_like_transformers() {
    check_golden_file("demo-golden.json");
}

/// Tool turns with `content: null`: templates that never test content get "" (expected: what
/// transformers renders with `content: ""`), templates that test it keep `None`
/// (`null-content-golden.json`, from `generate_null_content_golden.py`).
#[test]
fn renders_null_content_as_transformers_renders_the_content_quiver_gives() {
    check_golden_file("null-content-golden.json");
}

fn check_golden_file(golden: &str) {
    let dir = corpus_dir();
    let cases = read_json(dir.join(golden));
    let cases = cases.as_array().expect("a golden file is a list of cases");
    assert!(!cases.is_empty(), "{golden} holds no cases");

    let mut templates = std::collections::HashMap::new();
    let mut failures = Vec::new();
    for case in cases {
        let file = case["template"].as_str().expect("case names its template");
        let name = format!(
            "{file} / {} / add_generation_prompt={}",
            case["case"], case["add_generation_prompt"]
        );
        let template = templates
            .entry(file.to_owned())
            .or_insert_with(|| load_template(&dir, file));
        let tools = case.get("tools").filter(|tools| !tools.is_null());
        let add_generation_prompt = case["add_generation_prompt"].as_bool().expect("bool");
        let rendered = template.render_with(&case["messages"], tools, add_generation_prompt, None);
        let expect_error = case["error"].as_bool().expect("error flag");
        match (rendered, expect_error) {
            (Ok(text), false) if Some(text.as_str()) == case["expected"].as_str() => {}
            (Ok(text), false) => failures.push(format!(
                "{name}: rendering differs\n--- expected\n{}\n--- got\n{text}",
                case["expected"].as_str().unwrap_or("<no expected text>")
            )),
            (Err(_), true) => {}
            (Ok(text), true) => {
                failures.push(format!("{name}: transformers raised, we rendered\n{text}"))
            }
            (Err(err), false) => failures.push(format!("{name}: unexpected error: {err}")),
        }
    }
    let passed = cases.len() - failures.len();
    println!("{golden}: {passed}/{} cases pass", cases.len());
    assert!(
        failures.is_empty(),
        "{golden}: {passed}/{} cases pass; failures:\n\n{}",
        cases.len(),
        failures.join("\n\n")
    );
}
