//! The split of a reply into reasoning and content, fed the text as it streams. Text that may
//! be the beginning of a marker is held back until the next piece tells, so no part of a marker
//! ever reaches either side, however the detokenizer cuts the text.
//!
//! Whitespace is kept as the model wrote it on both sides (`"\n\nThe answer"` after
//! `</think>\n\n`), as vLLM's qwen3 and deepseek_r1 parsers do; only whitespace before an
//! opening `<think>` is dropped with it.

use super::{PromptState, ReasoningParser, THINK_END, THINK_START};

/// A run of text on one side of the split.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    Reasoning(String),
    Content(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Before the reply's first visible text: `<think>` here opens (or, when the prompt opened
    /// the block, repeats) the thinking. `implicit`: the reply is reasoning even without it.
    Start {
        implicit: bool,
    },
    Reasoning,
    Content,
}

#[derive(Debug, Clone)]
pub struct ReasoningSplitter {
    phase: Phase,
    /// Text not given out yet: a possible marker, or leading whitespace before the start.
    pending: String,
}

impl ReasoningSplitter {
    pub fn new(parser: ReasoningParser, prompt: PromptState) -> Self {
        let phase = match prompt {
            PromptState::Opened => Phase::Start { implicit: true },
            PromptState::Closed => Phase::Content,
            PromptState::Unopened => Phase::Start {
                implicit: parser == ReasoningParser::DeepseekR1,
            },
        };
        Self {
            phase,
            pending: String::new(),
        }
    }

    /// Whether the reply is thinking now: `None` while that is not settled (before its first
    /// visible text), `Some(false)` once it is in its content.
    pub fn thinking(&self) -> Option<bool> {
        match self.phase {
            Phase::Start { .. } => None,
            Phase::Reasoning => Some(true),
            Phase::Content => Some(false),
        }
    }

    /// The pieces `text`, the reply's next text, makes certain.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.pending.push_str(text);
        let mut pieces = Vec::new();
        loop {
            match self.phase {
                Phase::Start { implicit } => {
                    let visible = self.pending.trim_start();
                    if let Some(rest) = visible.strip_prefix(THINK_START) {
                        self.pending = rest.to_owned();
                        self.phase = Phase::Reasoning;
                    } else if THINK_START.starts_with(visible) {
                        // Whitespace only, or a beginning of `<think>`: not known yet.
                        return pieces;
                    } else {
                        self.phase = match implicit {
                            true => Phase::Reasoning,
                            false => Phase::Content,
                        };
                    }
                }
                Phase::Reasoning => match self.pending.find(THINK_END) {
                    Some(at) => {
                        let rest = self.pending.split_off(at + THINK_END.len());
                        self.pending.truncate(at);
                        push_piece(
                            &mut pieces,
                            Piece::Reasoning(std::mem::take(&mut self.pending)),
                        );
                        self.pending = rest;
                        self.phase = Phase::Content;
                    }
                    None => {
                        let held = marker_prefix_len(&self.pending, THINK_END);
                        let rest = self.pending.split_off(self.pending.len() - held);
                        push_piece(
                            &mut pieces,
                            Piece::Reasoning(std::mem::take(&mut self.pending)),
                        );
                        self.pending = rest;
                        return pieces;
                    }
                },
                Phase::Content => {
                    push_piece(
                        &mut pieces,
                        Piece::Content(std::mem::take(&mut self.pending)),
                    );
                    return pieces;
                }
            }
        }
    }

    /// What is still held once the reply is complete: a marker that never completed is text of
    /// the side it was written on.
    pub fn finish(&mut self) -> Vec<Piece> {
        let text = std::mem::take(&mut self.pending);
        let piece = match self.phase {
            Phase::Start { implicit: false } | Phase::Content => Piece::Content(text),
            Phase::Start { implicit: true } | Phase::Reasoning => Piece::Reasoning(text),
        };
        let mut pieces = Vec::new();
        push_piece(&mut pieces, piece);
        pieces
    }
}

/// Adds `piece` unless it is empty; a piece on the same side as the last one joins it.
fn push_piece(pieces: &mut Vec<Piece>, piece: Piece) {
    match (pieces.last_mut(), piece) {
        (_, Piece::Reasoning(text) | Piece::Content(text)) if text.is_empty() => {}
        (Some(Piece::Reasoning(last)), Piece::Reasoning(text))
        | (Some(Piece::Content(last)), Piece::Content(text)) => last.push_str(&text),
        (_, piece) => pieces.push(piece),
    }
}

/// The length of the longest end of `text` that begins `marker` (and is shorter than it).
/// The marker is ASCII, so such an end starts on a character boundary.
fn marker_prefix_len(text: &str, marker: &str) -> usize {
    (1..marker.len())
        .rev()
        .find(|&len| text.ends_with(&marker[..len]))
        .unwrap_or(0)
}
