//! One chat request's reasoning handling, settled at validation: the model's parser, where the
//! rendered prompt leaves the reply, and how the markers are tokens of the request's tokenizer.

use super::grammar::{after_thinking, MarkerTokens, ThinkingStart};
use super::{Piece, PromptState, ReasoningParser, ReasoningSplitter, THINK_END, THINK_START};
use crate::tokenizer::TextTokenizer;
use crate::validation::OutputGrammar;

#[derive(Debug, Clone)]
pub struct ReasoningPlan {
    pub parser: ReasoningParser,
    pub prompt: PromptState,
    markers: MarkerTokens,
    /// A marker is a special token: the detokenizer must keep it for the split to see it.
    special_markers: bool,
}

/// A finished reply split: `None` on a side with no text, as vLLM answers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Split {
    pub reasoning: Option<String>,
    pub content: Option<String>,
}

impl ReasoningPlan {
    /// `prompt` is the rendered chat prompt the reply continues.
    pub fn new(parser: ReasoningParser, prompt: &str, tokenizer: &TextTokenizer) -> Self {
        let start = tokenizer.added_token(THINK_START);
        let end = tokenizer.added_token(THINK_END);
        Self {
            parser,
            prompt: PromptState::of(prompt),
            markers: MarkerTokens {
                start: start.map(|(id, _)| id),
                end: end.map(|(id, _)| id),
            },
            special_markers: [start, end]
                .iter()
                .any(|token| token.is_some_and(|(_, special)| special)),
        }
    }

    /// The splitter of one streamed choice.
    pub fn splitter(&self) -> ReasoningSplitter {
        ReasoningSplitter::new(self.parser, self.prompt)
    }

    /// A complete reply split into reasoning and content.
    pub fn split(&self, text: &str) -> Split {
        let mut splitter = self.splitter();
        let mut pieces = splitter.push(text);
        pieces.extend(splitter.finish());
        let mut split = Split::default();
        for piece in pieces {
            let (side, text) = match piece {
                Piece::Reasoning(text) => (&mut split.reasoning, text),
                Piece::Content(text) => (&mut split.content, text),
            };
            side.get_or_insert_with(String::new).push_str(&text);
        }
        split
    }

    /// Whether the detokenizer must keep special tokens for the split to see the markers.
    pub fn keeps_special_tokens(&self) -> bool {
        self.special_markers && self.prompt != PromptState::Closed
    }

    /// `grammar` applied after the thinking block (unchanged when the prompt closed it): the
    /// reply may think first (must, when the prompt opened the block, or the format always
    /// thinks), and the constraint holds from the end of its thinking.
    pub fn constrain_after_thinking(&self, grammar: OutputGrammar) -> OutputGrammar {
        let start = match (self.prompt, self.parser) {
            (PromptState::Closed, _) => return grammar,
            (PromptState::Opened, _) => ThinkingStart::Inside,
            (PromptState::Unopened, ReasoningParser::DeepseekR1) => ThinkingStart::Required,
            (PromptState::Unopened, ReasoningParser::Qwen3) => ThinkingStart::Optional,
        };
        after_thinking(grammar, start, self.markers)
    }
}
