//! An output constraint (`response_format`, `structured_outputs`, a tool choice) held after
//! the thinking block, as vLLM applies its grammar only once reasoning has ended: the reply
//! thinks freely, then writes what the constraint allows. One Lark grammar (llguidance's
//! dialect) embeds the constraint as it was: a JSON schema with `%json`, a regex as a lexeme,
//! a Lark grammar (the client's, or the tool-call one) as a nested `%lark` grammar, whose rule
//! names stay its own.
//!
//! The thinking is any text up to `</think>`; then at most two line breaks (Qwen3 and R1 write
//! `</think>\n\n`, SmolLM3 `</think>\n`) before the constrained part. A marker that is an added
//! token of the tokenizer is written by id (llguidance matches an added token only as itself,
//! so free text cannot contain it); a textual `</think>` ends a lazy lexeme instead.

use serde_json::{json, Value};

use super::{THINK_END, THINK_START};
use crate::scheduler::GrammarKind as Kind;
use crate::validation::OutputGrammar;

/// The markers' ids where they are added tokens of the request's tokenizer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MarkerTokens {
    pub start: Option<u32>,
    pub end: Option<u32>,
}

/// Where the reply's thinking begins.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ThinkingStart {
    /// The prompt opened the block: the reply thinks from its first token.
    Inside,
    /// The reply thinks, `<think>` written or not (DeepSeek-R1).
    Required,
    /// The reply may open a thinking block, or answer at once (Qwen3).
    Optional,
}

/// `grammar` preceded by a thinking block.
pub fn after_thinking(
    grammar: OutputGrammar,
    start: ThinkingStart,
    markers: MarkerTokens,
) -> OutputGrammar {
    let open = marker(THINK_START, markers.start);
    let mut lines = vec!["%llguidance {}".to_owned()];
    lines.push(match start {
        ThinkingStart::Inside => "start: thinking body".to_owned(),
        ThinkingStart::Required => format!("start: ({open})? thinking body"),
        ThinkingStart::Optional => format!("start: ({open} thinking)? body"),
    });
    match markers.end {
        Some(id) => {
            lines.push(format!("thinking: THOUGHT <[{id}]> (BREAK)?"));
            lines.push(r"THOUGHT: /(.|\n)*/".to_owned());
        }
        None => {
            lines.push("thinking: thought (BREAK)?".to_owned());
            lines.push(format!(r"thought[lazy]: /(.|\n)*/ {}", string(THINK_END)));
        }
    }
    lines.push(r"BREAK: /\n{1,2}/".to_owned());
    lines.push(format!("body: {}", embedded(&grammar)));
    OutputGrammar {
        kind: Kind::Lark,
        text: lines.join("\n") + "\n",
        param: grammar.param,
    }
}

/// The constraint as one item of a Lark rule.
fn embedded(grammar: &OutputGrammar) -> String {
    match grammar.kind {
        Kind::JsonSchema => format!("%json {}", compact_schema(&grammar.text)),
        Kind::Regex => format!("/{}/", regex_literal(&grammar.text)),
        Kind::Lark => format!("%lark {{\n{}\n}}", grammar.text),
    }
}

/// The schema with llguidance's option for compact JSON, as the shard compiles a schema on its
/// own (no free whitespace between tokens).
fn compact_schema(text: &str) -> String {
    let Ok(mut schema) = serde_json::from_str::<Value>(text) else {
        // Validation passes objects only; the engine reports anything else.
        return text.to_owned();
    };
    if let Value::Object(object) = &mut schema {
        let options = object.entry("x-guidance").or_insert_with(|| json!({}));
        if let Value::Object(options) = options {
            options.insert("whitespace_flexible".to_owned(), Value::Bool(false));
        }
    }
    schema.to_string()
}

/// A regex between Lark's `/…/` delimiters: an unescaped `/` and line breaks escaped, escape
/// pairs copied as they are (as llguidance's own regex-to-Lark conversion writes it).
fn regex_literal(regex: &str) -> String {
    let mut out = String::with_capacity(regex.len() + 2);
    let mut chars = regex.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                out.push('\\');
                if let Some(next) = chars.next() {
                    match next {
                        '\n' => out.push('n'),
                        '\r' => out.push('r'),
                        other => out.push(other),
                    }
                }
            }
            '/' => out.push_str(r"\/"),
            '\n' => out.push_str(r"\n"),
            '\r' => out.push_str(r"\r"),
            other => out.push(other),
        }
    }
    out
}

/// A marker: its added token by id, else its text.
fn marker(text: &str, id: Option<u32>) -> String {
    match id {
        Some(id) => format!("<[{id}]>"),
        None => string(text),
    }
}

/// A Lark string literal (JSON's escapes are Lark's).
fn string(text: &str) -> String {
    Value::String(text.to_owned()).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grammar(kind: Kind, text: &str) -> OutputGrammar {
        OutputGrammar {
            kind,
            text: text.to_owned(),
            param: "response_format",
        }
    }

    #[test]
    fn each_kind_is_embedded_after_the_thinking() {
        let markers = MarkerTokens {
            start: Some(7),
            end: Some(8),
        };
        let json = after_thinking(
            grammar(Kind::JsonSchema, r#"{"type":"object"}"#),
            ThinkingStart::Inside,
            markers,
        );
        assert_eq!(json.kind, Kind::Lark);
        assert_eq!(json.param, "response_format");
        assert_eq!(
            json.text,
            "%llguidance {}\nstart: thinking body\nthinking: THOUGHT <[8]> (BREAK)?\n\
             THOUGHT: /(.|\\n)*/\nBREAK: /\\n{1,2}/\n\
             body: %json {\"type\":\"object\",\"x-guidance\":{\"whitespace_flexible\":false}}\n"
        );
        let lark = after_thinking(
            grammar(Kind::Lark, "start: \"a\""),
            ThinkingStart::Optional,
            markers,
        );
        assert!(lark.text.contains("start: (<[7]> thinking)? body\n"));
        assert!(lark.text.ends_with("body: %lark {\nstart: \"a\"\n}\n"));
        let regex = after_thinking(
            grammar(Kind::Regex, "a/b\\/c\n"),
            ThinkingStart::Required,
            MarkerTokens::default(),
        );
        assert!(regex.text.contains("start: (\"<think>\")? thinking body\n"));
        assert!(regex
            .text
            .contains("thought[lazy]: /(.|\\n)*/ \"</think>\"\n"));
        assert!(
            regex.text.ends_with("body: /a\\/b\\/c\\n/\n"),
            "{}",
            regex.text
        );
    }

    #[test]
    fn a_schema_keeps_its_own_guidance_options() {
        let schema = compact_schema(r#"{"x-guidance":{"lenient":true},"type":"string"}"#);
        let schema: Value = serde_json::from_str(&schema).unwrap();
        assert_eq!(
            schema["x-guidance"],
            json!({"lenient": true, "whitespace_flexible": false})
        );
        assert_eq!(compact_schema("true"), "true");
    }
}
