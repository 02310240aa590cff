//! The tokens a reply spends thinking, as OpenAI's `reasoning_tokens` counts them: the split is
//! fed the reply token by token, and a token is thinking when its text belongs to the thinking
//! block, its markers included (the token that closes the block is the last one counted).
//! Tokens before the reply's first visible text count once the reply turns out to think, and
//! not when it answers at once.

use super::{Piece, ReasoningSplitter};

#[derive(Debug, Clone)]
pub struct ReasoningCounter {
    /// `None` once the reply is in its content: nothing after that is thinking.
    splitter: Option<ReasoningSplitter>,
    /// Tokens seen while it was not settled whether the reply thinks.
    unsettled: u32,
    counted: u32,
}

impl ReasoningCounter {
    pub fn new(splitter: ReasoningSplitter) -> Self {
        Self {
            splitter: Some(splitter),
            unsettled: 0,
            counted: 0,
        }
    }

    /// One generated token and the text it made (empty when the detokenizer holds it back).
    pub fn token(&mut self, text: &str) {
        let Some(splitter) = &mut self.splitter else {
            return;
        };
        let before = splitter.thinking();
        let pieces = splitter.push(text);
        let after = splitter.thinking();
        let wrote_thinking = pieces.iter().any(|p| matches!(p, Piece::Reasoning(_)));
        if before == Some(true) || after == Some(true) || wrote_thinking {
            self.counted += self.unsettled + 1;
            self.unsettled = 0;
        } else if after.is_none() {
            self.unsettled += 1;
        }
        if after == Some(false) {
            self.splitter = None;
        }
    }

    /// The thinking tokens so far (a reply that ends unsettled did not think).
    pub fn count(&self) -> u32 {
        self.counted
    }
}
