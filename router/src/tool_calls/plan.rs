//! One request's tool calling, settled: its checked tools, the family format its replies are
//! constrained to and read in, and how the family's markers are tokens of the request's
//! tokenizer: an added token is written by id in the grammar (llguidance matches every added
//! token, special or not, only as that token), and a special one must be kept by the
//! detokenizer, or the parser would never see it.

use quiver_flags::ToolCallParser;

use super::grammar::tool_grammar;
use super::parsed::ParsedOutput;
use super::registry::format_of;
use super::request::{ToolChoice, ToolRequest};
use super::stream::ToolCallStream;
use super::truncated::parse_reply;
use crate::tokenizer::TextTokenizer;

#[derive(Debug, Clone)]
pub struct ToolPlan {
    pub request: ToolRequest,
    pub parser: ToolCallParser,
    /// The Lark grammar; `None` with `tool_choice: "none"`.
    grammar: Option<String>,
    /// A marker of the family is a special token of the tokenizer.
    special_markers: bool,
}

impl ToolPlan {
    pub fn new(request: ToolRequest, parser: ToolCallParser, tokenizer: &TextTokenizer) -> Self {
        let token_id = |text: &str| tokenizer.added_token(text).map(|(id, _)| id);
        let grammar = tool_grammar(parser, &request, &token_id);
        let special_markers = format_of(parser)
            .markers()
            .iter()
            .any(|m| tokenizer.added_token(m).is_some_and(|(_, special)| special));
        Self {
            request,
            parser,
            grammar,
            special_markers,
        }
    }

    /// The Lark grammar every choice of the request is held to (`None` for `tool_choice:
    /// "none"`); validation makes it the request's output grammar.
    pub fn grammar_text(&self) -> Option<&str> {
        self.grammar.as_deref()
    }

    /// Whether replies are read for calls (every choice but `"none"`).
    pub fn reads_calls(&self) -> bool {
        self.request.choice != ToolChoice::None
    }

    /// Whether the detokenizer must keep special tokens for the parser to see the markers.
    pub fn keeps_special_tokens(&self) -> bool {
        self.reads_calls() && self.special_markers
    }

    pub fn declared(&self) -> Vec<String> {
        self.request
            .functions
            .iter()
            .map(|function| function.name.clone())
            .collect()
    }

    /// A finished reply split into content and calls; `cut`: it stopped at `max_tokens`, maybe
    /// inside a call (`truncated`).
    pub fn parse(&self, text: &str, cut: bool) -> ParsedOutput {
        parse_reply(self.parser, text, &self.declared(), cut)
    }

    /// The reader of one streamed choice.
    pub fn stream(&self) -> ToolCallStream {
        ToolCallStream::new(self.parser, self.declared())
    }
}
