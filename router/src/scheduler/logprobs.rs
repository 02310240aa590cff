//! The logprob data a shard reports with a token, as the scheduler hands it to the HTTP layer.
//! Empty unless the request asked for it (`top_logprobs`, `prompt_logprobs`).

use crate::pb;

/// A token and its log-probability under the model's raw distribution.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TokenLogprob {
    pub token_id: u32,
    pub logprob: f32,
}

/// One prompt position after the first: the prompt token's logprob and rank, and the most
/// likely alternatives there.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptPosition {
    pub logprob: f32,
    pub rank: u32,
    pub top: Vec<TokenLogprob>,
}

impl From<&pb::TokenLogprob> for TokenLogprob {
    fn from(entry: &pb::TokenLogprob) -> Self {
        Self {
            token_id: entry.token_id,
            logprob: entry.logprob,
        }
    }
}

impl From<&pb::PromptPosition> for PromptPosition {
    fn from(position: &pb::PromptPosition) -> Self {
        Self {
            logprob: position.logprob,
            rank: position.rank,
            top: position.top.iter().map(TokenLogprob::from).collect(),
        }
    }
}
