//! A streamed chat choice read as it comes, when its text is more than content: the reasoning
//! split of a thinking model first, then the tool-call reader on the content alone, so that
//! thinking never reaches the call parser. Tokens whose text is held back (a possible marker,
//! a possible call) wait here for the next chunk that goes out.

use crate::core::GeneratedToken;
use crate::reasoning::{Piece, ReasoningSplitter};
use crate::tool_calls::{ToolCallStream, ToolDelta};

/// One delta of a reply: reasoning text, or what the content makes (text, or call pieces).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplyDelta {
    Reasoning(String),
    Content(ToolDelta),
}

#[derive(Debug)]
pub struct ChoiceReader {
    reasoning: Option<ReasoningSplitter>,
    calls: Option<ToolCallStream>,
    /// Tokens of text that no delta carried yet.
    pub held: Vec<GeneratedToken>,
}

impl ChoiceReader {
    pub fn new(reasoning: Option<ReasoningSplitter>, calls: Option<ToolCallStream>) -> Self {
        Self {
            reasoning,
            calls,
            held: Vec::new(),
        }
    }

    /// The deltas the reply's next text makes known.
    pub fn push(&mut self, text: &str) -> Vec<ReplyDelta> {
        let pieces = match &mut self.reasoning {
            Some(splitter) => splitter.push(text),
            None => vec![Piece::Content(text.to_owned())],
        };
        self.deltas(pieces)
    }

    /// The last deltas once the reply is complete, and whether it holds calls; `cut`: it
    /// stopped at `max_tokens`.
    pub fn finish(&mut self, cut: bool) -> (Vec<ReplyDelta>, bool) {
        let pieces = match &mut self.reasoning {
            Some(splitter) => splitter.finish(),
            None => Vec::new(),
        };
        let mut deltas = self.deltas(pieces);
        let Some(calls) = &mut self.calls else {
            return (deltas, false);
        };
        let (last, has_calls) = calls.finish(cut);
        deltas.extend(last.into_iter().map(ReplyDelta::Content));
        (deltas, has_calls)
    }

    fn deltas(&mut self, pieces: Vec<Piece>) -> Vec<ReplyDelta> {
        let mut deltas = Vec::new();
        for piece in pieces {
            match piece {
                Piece::Reasoning(text) => deltas.push(ReplyDelta::Reasoning(text)),
                Piece::Content(text) => match &mut self.calls {
                    Some(calls) => {
                        deltas.extend(calls.push(&text).into_iter().map(ReplyDelta::Content))
                    }
                    None => deltas.push(ReplyDelta::Content(ToolDelta::Content(text))),
                },
            }
        }
        deltas
    }
}
