//! Unit tests of the template layer; the golden corpus lives in `tests/chat_template_golden.rs`.
//! Expected strings are what transformers 5.23 (`render_jinja_template`, jinja2 3.1.6) renders.

use serde_json::json;

use super::*;
use crate::tokenizer::test_support::TempDir;

fn messages() -> Json {
    json!([
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b", "reasoning": "think"}
    ])
}

fn render(source: &str, bos: Option<&str>, eos: Option<&str>) -> Result<String, TemplateError> {
    ChatTemplate::new(source.into(), bos.map(Into::into), eos.map(Into::into))?.render_with(
        &messages(),
        None,
        false,
        None,
    )
}

#[test]
fn context_variables_match_transformers() {
    let source = "{{ bos_token is defined }}|{{ eos_token }}|{{ tools is none }}|\
                  {{ documents is none }}|{{ add_generation_prompt }}";
    assert_eq!(
        render(source, None, Some("</s>")).unwrap(),
        "False|</s>|True|True|False"
    );
}

#[test]
fn python_printing_slicing_and_loop_controls() {
    let source = "{% for m in messages[::-1] %}{% if loop.index > 1 %}{% break %}{% endif %}\
                  {{ m.role }}{% endfor %}|{{ true }} {{ none }} {{ 1.5e20 }} {{ [1, 'x'] }}";
    assert_eq!(
        render(source, None, None).unwrap(),
        "assistant|True None 1.5e+20 [1, 'x']"
    );
    let source = "{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role == 'user' %}\
                  {% continue %}{% endif %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }} \
                  {{ dict(a=1, b='x') | tojson }} {{ 'a b'.split() }}";
    assert_eq!(
        render(source, None, None).unwrap(),
        r#"1 {"a": 1, "b": "x"} ['a', 'b']"#
    );
}

#[test]
fn reasoning_is_aliased_like_transformers() {
    assert_eq!(
        render("{{ messages[1] | tojson }}", None, None).unwrap(),
        r#"{"thinking": "think", "role": "assistant", "content": "b", "reasoning": "think", "reasoning_content": "think"}"#
    );
}

#[test]
fn whitespace_control_matches_jinja2() {
    let source = "  {% if true %}\n  x\n  {% endif %}\ny\n{{ 'z' }}\n";
    assert_eq!(render(source, None, None).unwrap(), "  x\ny\nz");
}

#[test]
fn errors_are_classified() {
    match render("{{ raise_exception('no system role') }}", None, None) {
        Err(TemplateError::Raised(message)) => assert_eq!(message, "no system role"),
        other => panic!("expected Raised, got {other:?}"),
    }
    assert!(matches!(
        render("{% for t in tools %}{{ t }}{% endfor %}", None, None),
        Err(TemplateError::Render(_))
    ));
    assert!(matches!(
        ChatTemplate::new("{% if %}".into(), None, None),
        Err(TemplateError::Syntax(_))
    ));
}

#[test]
fn strftime_now_uses_the_injected_clock() {
    let moment = chrono::NaiveDate::from_ymd_opt(2025, 3, 14)
        .and_then(|day| day.and_hms_opt(9, 26, 53))
        .unwrap();
    let source = "{{ strftime_now('%d %b %Y %B %H:%M:%S') }}";
    let fixed = ChatTemplate::with_clock(source.into(), None, None, Clock::Fixed(moment)).unwrap();
    assert_eq!(
        fixed.render_with(&messages(), None, false, None).unwrap(),
        "14 Mar 2025 March 09:26:53"
    );
    let year = chrono::Local::now().format("%Y").to_string();
    let local = ChatTemplate::new("{{ strftime_now('%Y') }}".into(), None, None).unwrap();
    assert_eq!(
        local.render_with(&messages(), None, false, None).unwrap(),
        year
    );
}

#[test]
fn from_dir_finds_the_template_where_transformers_does() {
    let dir = TempDir::new("template-dir");
    assert!(
        ChatTemplate::from_dir(&crate::files::ConfinedDir::model_dir(dir.path()).unwrap())
            .unwrap()
            .is_none()
    );

    let config = |template: Json| json!({"bos_token": {"content": "<s>"}, "eos_token": "</s>", "chat_template": template});
    let write = |name: &str, value: &Json| {
        std::fs::write(dir.path().join(name), value.to_string()).unwrap();
    };
    let source = "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}";
    write("tokenizer_config.json", &config(json!(source)));
    let template =
        ChatTemplate::from_dir(&crate::files::ConfinedDir::model_dir(dir.path()).unwrap())
            .unwrap()
            .unwrap();
    assert_eq!(
        template
            .render_with(&messages(), None, false, None)
            .unwrap(),
        "<s>a</s>"
    );

    let named = json!([
        {"name": "tool_use", "template": "tools"},
        {"name": "default", "template": "default {{ eos_token }}"}
    ]);
    write("tokenizer_config.json", &config(named));
    let template =
        ChatTemplate::from_dir(&crate::files::ConfinedDir::model_dir(dir.path()).unwrap())
            .unwrap()
            .unwrap();
    assert_eq!(
        template
            .render_with(&messages(), None, false, None)
            .unwrap(),
        "default </s>"
    );

    write(
        "tokenizer_config.json",
        &config(json!([{"name": "x", "template": "y"}])),
    );
    assert!(matches!(
        ChatTemplate::from_dir(&crate::files::ConfinedDir::model_dir(dir.path()).unwrap()),
        Err(TemplateError::Config { .. })
    ));

    std::fs::write(dir.path().join("chat_template.jinja"), "jinja file wins").unwrap();
    let template =
        ChatTemplate::from_dir(&crate::files::ConfinedDir::model_dir(dir.path()).unwrap())
            .unwrap()
            .unwrap();
    assert_eq!(
        template
            .render_with(&messages(), None, false, None)
            .unwrap(),
        "jinja file wins"
    );
    assert_eq!(template.eos_token(), Some("</s>"));
}

/// Null content is "" for a template that never tests content (transformers would print
/// "[None]"; with `content: ""` it prints "[]"), and stays `None` for one that tests it
/// (transformers prints "none"). Expected strings are `render_jinja_template`'s.
#[test]
fn null_content_is_empty_text_unless_the_template_tests_content() {
    let null = json!([{"role": "assistant", "content": null, "tool_calls": []}]);
    let render = |source: &str| {
        ChatTemplate::new(source.into(), None, None)
            .unwrap()
            .render_with(&null, None, false, None)
            .unwrap()
    };
    assert_eq!(
        render("{% for m in messages %}[{{ m.content }}]{% endfor %}"),
        "[]"
    );
    assert_eq!(
        render(
            "{% for m in messages %}{% if m.content is none %}none{% else %}[{{ m.content }}]\
             {% endif %}{% endfor %}"
        ),
        "none"
    );
}
