//! A constraint on a request's output, as validation builds it and the scheduler carries it;
//! the shard's `Grammar` message is made from it only when a Prefill or a compile is sent.

use crate::pb;

/// The language `Grammar::text` is written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GrammarKind {
    /// A JSON schema (a JSON document); `{"type": "object"}` is JSON mode.
    JsonSchema,
    /// A regular expression the whole output must match.
    Regex,
    /// A grammar in llguidance's Lark dialect.
    Lark,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Grammar {
    pub kind: GrammarKind,
    pub text: String,
    /// The tokens that end the request once the output is complete (its tokenizer's EOS ids).
    pub eos_token_ids: Vec<u32>,
}

impl From<&Grammar> for pb::Grammar {
    fn from(grammar: &Grammar) -> Self {
        let kind = match grammar.kind {
            GrammarKind::JsonSchema => pb::grammar::Kind::JsonSchema,
            GrammarKind::Regex => pb::grammar::Kind::Regex,
            GrammarKind::Lark => pb::grammar::Kind::Lark,
        };
        Self {
            kind: kind as i32,
            text: grammar.text.clone(),
            eos_token_ids: grammar.eos_token_ids.clone(),
        }
    }
}
