//! Where the rendered prompt leaves the reply. A template may open the thinking block itself
//! (DeepSeek-R1's ends the prompt with `<think>\n`), close it to switch thinking off (Qwen3 with
//! `enable_thinking: false` renders `<think>\n\n</think>\n\n`), or leave the choice to the model.
//! Only the prompt's end counts: markers earlier on belong to the history or the user's text.

use super::{THINK_END, THINK_START};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptState {
    /// The prompt ends inside an opened thinking block: the reply starts as reasoning.
    Opened,
    /// The prompt ends after a closed (empty) thinking block: the reply is all content.
    Closed,
    /// Neither: the reply may open a thinking block itself.
    Unopened,
}

impl PromptState {
    /// The state a rendered chat prompt leaves the reply in (trailing whitespace aside).
    pub fn of(prompt: &str) -> Self {
        let end = prompt.trim_end();
        if end.ends_with(THINK_START) {
            Self::Opened
        } else if end.ends_with(THINK_END) {
            Self::Closed
        } else {
            Self::Unopened
        }
    }
}
