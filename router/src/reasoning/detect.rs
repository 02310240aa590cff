//! Which reasoning format a model writes, when `--reasoning-parser` does not say: read off the
//! chat template, which prints the thinking markers of the models trained to think (to strip
//! past reasoning from the history, or to switch thinking off in the generation prompt).

use super::{ReasoningParser, ReasoningParserFlag, THINK_END, THINK_START};

/// DeepSeek's role marker: its thinking templates (R1 and the R1 distills) open the thinking
/// block in the generation prompt.
const DEEPSEEK_ASSISTANT: &str = "<｜Assistant｜>";

/// The format a chat template's text shows, if any.
pub fn detect_reasoning_parser(template: &str) -> Option<ReasoningParser> {
    if !(template.contains(THINK_START) || template.contains(THINK_END)) {
        return None;
    }
    if template.contains(DEEPSEEK_ASSISTANT) {
        Some(ReasoningParser::DeepseekR1)
    } else {
        // Qwen3, SmolLM3 and the other `<think>` templates that let a reply choose to think.
        Some(ReasoningParser::Qwen3)
    }
}

/// The flag (`none`: no parser for any model), else the template's format, else none. As for
/// tool calls, a parser the flag names is the base model's: an adapter that ships its own
/// template (`adapters_own`) is read as that template shows, when it shows a thinking format.
pub fn reasoning_parser_for(
    flag: Option<ReasoningParserFlag>,
    template: Option<&str>,
    adapters_own: bool,
) -> Option<ReasoningParser> {
    let detected = || template.and_then(detect_reasoning_parser);
    match flag {
        Some(ReasoningParserFlag::None) => None,
        Some(flag) if adapters_own => detected().or(flag.parser()),
        Some(flag) => flag.parser(),
        None => detected(),
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use serde_json::{json, Value};

    use super::*;
    use crate::reasoning::PromptState;
    use crate::template::ChatTemplate;

    /// The chat-template corpus kept in the repository (testdata/chat-templates/README.md).
    fn corpus() -> Vec<(String, Value)> {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/chat-templates");
        let mut templates = Vec::new();
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_none_or(|ext| ext != "json") {
                continue;
            }
            let file: Value =
                serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
            if file.get("chat_template").is_some() {
                templates.push((
                    path.file_name().unwrap().to_string_lossy().into_owned(),
                    file,
                ));
            }
        }
        templates
    }

    fn template(file: &Value) -> ChatTemplate {
        let token = |key: &str| file[key].as_str().map(str::to_owned);
        let source = file["chat_template"].as_str().unwrap().to_owned();
        ChatTemplate::new(source, token("bos_token"), token("eos_token")).unwrap()
    }

    #[test]
    fn the_thinking_templates_of_the_corpus_are_detected_and_no_other() {
        let expected = [
            ("qwen3.json", ReasoningParser::Qwen3),
            ("smollm3.json", ReasoningParser::Qwen3),
            ("deepseek-r1.json", ReasoningParser::DeepseekR1),
        ];
        let templates = corpus();
        assert!(templates.len() > 20, "the corpus is missing");
        for (name, file) in &templates {
            let want = expected.iter().find(|(n, _)| n == name).map(|(_, p)| *p);
            let source = file["chat_template"].as_str().unwrap();
            assert_eq!(detect_reasoning_parser(source), want, "{name}");
        }
    }

    #[test]
    fn the_flag_wins_and_none_turns_the_split_off() {
        let qwen3 = Some("{{ '<think>' }}");
        assert_eq!(
            reasoning_parser_for(None, qwen3, false),
            Some(ReasoningParser::Qwen3)
        );
        assert_eq!(
            reasoning_parser_for(Some(ReasoningParserFlag::None), qwen3, true),
            None
        );
        assert_eq!(
            reasoning_parser_for(Some(ReasoningParserFlag::DeepseekR1), Some("plain"), false),
            Some(ReasoningParser::DeepseekR1)
        );
        assert_eq!(reasoning_parser_for(None, None, false), None);
    }

    #[test]
    fn an_adapters_own_template_comes_before_the_flag() {
        let deepseek = Some("{{ '<｜Assistant｜><think>\n' }}");
        let flag = Some(ReasoningParserFlag::Qwen3);
        // The base model (or an adapter with its template) follows the flag...
        assert_eq!(
            reasoning_parser_for(flag, deepseek, false),
            Some(ReasoningParser::Qwen3)
        );
        // ...an adapter's own template its own format, and the flag where it shows none.
        assert_eq!(
            reasoning_parser_for(flag, deepseek, true),
            Some(ReasoningParser::DeepseekR1)
        );
        assert_eq!(
            reasoning_parser_for(flag, Some("plain"), true),
            Some(ReasoningParser::Qwen3)
        );
    }

    /// Where each thinking template's generation prompt leaves the reply, with thinking on (the
    /// templates' default) and off (`enable_thinking: false`, read by Qwen3's and SmolLM3's).
    #[test]
    fn the_thinking_templates_leave_the_reply_where_their_source_says() {
        let messages = json!([{"role": "user", "content": "Hi <think>"}]);
        let off = json!({"enable_thinking": false});
        let states = |name: &str| {
            let (_, file) = corpus().into_iter().find(|(n, _)| n == name).unwrap();
            let template = template(&file);
            let on = template.render_with(&messages, None, true, None).unwrap();
            let off = template
                .render_with(&messages, None, true, off.as_object())
                .unwrap();
            (PromptState::of(&on), PromptState::of(&off))
        };
        assert_eq!(
            states("qwen3.json"),
            (PromptState::Unopened, PromptState::Closed)
        );
        assert_eq!(
            states("smollm3.json"),
            (PromptState::Unopened, PromptState::Closed)
        );
        // R1's template always opens the block and has no switch.
        assert_eq!(
            states("deepseek-r1.json"),
            (PromptState::Opened, PromptState::Opened)
        );
    }
}
