//! Reasoning output of thinking models on `/v1/chat/completions`: the thinking a reply writes
//! between `<think>` and `</think>` is returned as `reasoning_content` (message and stream
//! deltas) and kept out of `content`, out of tool-call parsing and out of JSON parsing, as vLLM's
//! and SGLang's `--reasoning-parser` do. See docs/reasoning.md.
//!
//! - `detect`: which parser a model gets (the flag, else its chat template);
//! - `prompt`: where the rendered prompt leaves the reply (inside an opened thinking block,
//!   after a closed one, or before any);
//! - `splitter`: the split itself, as the text streams (also used whole);
//! - `counter`: how many of a reply's tokens are thinking (`reasoning_tokens` in usage);
//! - `grammar`: an output constraint that applies after the thinking block;
//! - `plan`: one request's settled reasoning handling.

mod counter;
#[cfg(test)]
mod counter_tests;
mod detect;
mod grammar;
mod plan;
mod prompt;
mod splitter;
#[cfg(test)]
mod splitter_tests;

pub use counter::ReasoningCounter;
pub use detect::{detect_reasoning_parser, reasoning_parser_for};
pub use plan::{ReasoningPlan, Split};
pub use prompt::PromptState;
pub use quiver_flags::{ReasoningParser, ReasoningParserFlag};
pub use splitter::{Piece, ReasoningSplitter};

/// The marker that opens a thinking block, in every format implemented.
pub const THINK_START: &str = "<think>";
/// The marker that closes it.
pub const THINK_END: &str = "</think>";
