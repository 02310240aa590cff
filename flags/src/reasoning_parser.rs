//! `--reasoning-parser`: how a thinking model's reply is split into its reasoning
//! (`reasoning_content`) and its answer (`content`). The names are vLLM's, so a command line
//! written for vLLM works here; `none` turns the split off for every model.

use clap::ValueEnum;

/// A reasoning format: both write the thinking between `<think>` and `</think>`. They differ
/// where the prompt does not show whether the reply starts inside the thinking block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReasoningParser {
    /// Qwen3, SmolLM3: a reply thinks only when it opens with `<think>` (a model or a request
    /// with thinking off answers at once).
    Qwen3,
    /// DeepSeek-R1 and its distills: a reply thinks from its first token (R1's template opens
    /// the block in the prompt; older ones let the model skip `<think>`) until `</think>`.
    DeepseekR1,
}

impl ReasoningParser {
    /// The flag's spelling, vLLM's.
    pub fn name(self) -> &'static str {
        match self {
            Self::Qwen3 => "qwen3",
            Self::DeepseekR1 => "deepseek_r1",
        }
    }
}

// Plain comments on the variants, as for `AdapterSource`: `--help` shows the short list.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, ValueEnum)]
pub enum ReasoningParserFlag {
    #[value(name = "qwen3")]
    Qwen3,
    #[value(name = "deepseek_r1")]
    DeepseekR1,
    // No reasoning split for any model: replies are all content.
    #[value(name = "none")]
    None,
}

impl ReasoningParserFlag {
    /// The parser the flag forces; `None` for `none`.
    pub fn parser(self) -> Option<ReasoningParser> {
        match self {
            Self::Qwen3 => Some(ReasoningParser::Qwen3),
            Self::DeepseekR1 => Some(ReasoningParser::DeepseekR1),
            Self::None => None,
        }
    }

    /// The flag's spelling.
    pub fn name(self) -> &'static str {
        self.parser().map_or("none", ReasoningParser::name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flag_spelling_is_the_parser_name() {
        for flag in ReasoningParserFlag::value_variants() {
            let value = flag.to_possible_value().unwrap();
            assert_eq!(value.get_name(), flag.name());
        }
    }
}
