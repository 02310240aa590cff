//! Shard logprobs → the response shapes (`openai::logprobs`), with each token spelled by the
//! request's own tokenizer (an adapter's tokenizer when it has one). Also `best_of`'s choice.

use std::collections::BTreeMap;

use crate::core::{ChoiceOutput, GeneratedToken};
use crate::openai::logprobs::{
    ChatLogprobs, ChatTokenLogprob, ChatTopLogprob, CompletionLogprobs, PromptLogprobEntry,
    PromptLogprobs,
};
use crate::scheduler::{PromptPosition, TokenLogprob};
use crate::token_pieces::{token_piece, TokenPiece};
use crate::tokenizer::TextTokenizer;

/// JSON has no infinity: a logprob that underflowed is reported as vLLM does.
fn finite(logprob: f32) -> f32 {
    if logprob.is_finite() {
        logprob
    } else {
        -9999.0
    }
}

/// Chat's entries for `tokens`, each with at most `top` alternatives.
pub fn chat_logprobs(
    tokenizer: &TextTokenizer,
    tokens: &[GeneratedToken],
    top: u32,
) -> ChatLogprobs {
    let entry = |id: u32, logprob: f32| {
        let TokenPiece { text, bytes, .. } = token_piece(tokenizer, id);
        (text, finite(logprob), bytes)
    };
    let content = tokens
        .iter()
        .map(|token| {
            let (token_text, logprob, bytes) = entry(token.id, token.logprob);
            ChatTokenLogprob {
                token: token_text,
                logprob,
                bytes,
                top_logprobs: token
                    .top
                    .iter()
                    .take(top as usize)
                    .map(|alt| {
                        let (token, logprob, bytes) = entry(alt.token_id, alt.logprob);
                        ChatTopLogprob {
                            token,
                            logprob,
                            bytes,
                        }
                    })
                    .collect(),
            }
        })
        .collect();
    ChatLogprobs {
        content,
        refusal: None,
    }
}

/// Completions' `{token: logprob}` map: the `k` alternatives plus the chosen token itself, as
/// OpenAI documents ("up to logprobs+1 elements") and vLLM does, for prompt tokens too.
fn top_map(
    tokenizer: &TextTokenizer,
    chosen: (u32, f32),
    top: &[TokenLogprob],
    k: u32,
) -> BTreeMap<String, f32> {
    let alternatives = top
        .iter()
        .take(k as usize)
        .map(|alt| (alt.token_id, alt.logprob));
    // The chosen token last: where two tokens decode to the same text, its logprob is kept.
    alternatives
        .chain(std::iter::once(chosen))
        .map(|(id, logprob)| (token_piece(tokenizer, id).text, finite(logprob)))
        .collect()
}

/// Builds one choice's completions logprobs, chunk after chunk: `text_offset` continues from
/// where the previous chunk's tokens ended.
#[derive(Debug, Clone, Default)]
pub struct CompletionOffsets {
    /// Characters of the choice's text before the next token.
    next: usize,
}

impl CompletionOffsets {
    /// Entries for generated `tokens` with at most `k` alternatives each.
    pub fn generated(
        &mut self,
        tokenizer: &TextTokenizer,
        tokens: &[GeneratedToken],
        k: u32,
    ) -> CompletionLogprobs {
        let mut out = CompletionLogprobs::default();
        for token in tokens {
            let top = top_map(tokenizer, (token.id, token.logprob), &token.top, k);
            self.push(
                &mut out,
                token_piece(tokenizer, token.id),
                Some(token.logprob),
                Some(top),
            );
        }
        out
    }

    /// Entries for the echoed prompt: the first token has no logprob (nothing precedes it),
    /// each later one the shard's `positions` entry, with at most `k` alternatives.
    pub fn prompt(
        &mut self,
        tokenizer: &TextTokenizer,
        prompt_ids: &[u32],
        positions: &[PromptPosition],
        k: u32,
    ) -> CompletionLogprobs {
        let mut out = CompletionLogprobs::default();
        for (i, &id) in prompt_ids.iter().enumerate() {
            let position = i.checked_sub(1).and_then(|p| positions.get(p));
            let logprob = position.map(|p| p.logprob);
            let top = position.map(|p| top_map(tokenizer, (id, p.logprob), &p.top, k));
            self.push(&mut out, token_piece(tokenizer, id), logprob, top);
        }
        out
    }

    fn push(
        &mut self,
        out: &mut CompletionLogprobs,
        piece: TokenPiece,
        logprob: Option<f32>,
        top: Option<BTreeMap<String, f32>>,
    ) {
        out.text_offset.push(self.next);
        self.next += piece.text_chars();
        out.tokens.push(piece.text);
        out.token_logprobs.push(logprob.map(finite));
        out.top_logprobs.push(top);
    }
}

/// vLLM's `prompt_logprobs` of one prompt: `null`, then per later prompt token its own entry
/// and at most `k` alternatives (ranked 1..=k), keyed by token id.
pub fn prompt_logprobs(
    tokenizer: &TextTokenizer,
    prompt_ids: &[u32],
    positions: &[PromptPosition],
    k: u32,
) -> PromptLogprobs {
    let decoded = |id: u32| token_piece(tokenizer, id).text;
    let mut out: PromptLogprobs = vec![None];
    for (&id, position) in prompt_ids.iter().skip(1).zip(positions) {
        let mut entries = BTreeMap::new();
        for (rank, alt) in (1..).zip(position.top.iter().take(k as usize)) {
            let entry = PromptLogprobEntry {
                logprob: finite(alt.logprob),
                rank,
                decoded_token: decoded(alt.token_id),
            };
            entries.insert(alt.token_id.to_string(), entry);
        }
        let own = PromptLogprobEntry {
            logprob: finite(position.logprob),
            rank: position.rank,
            decoded_token: decoded(id),
        };
        entries.insert(id.to_string(), own);
        out.push(Some(entries));
    }
    out
}

/// `best_of`: of each prompt's `best_of` consecutive outputs, the `n` with the highest
/// cumulative logprob, best first (ties: the earlier choice). Returns them prompt by prompt.
pub fn select_best(outputs: Vec<ChoiceOutput>, best_of: u32, n: u32) -> Vec<ChoiceOutput> {
    if best_of == n {
        return outputs;
    }
    let mut selected = Vec::with_capacity(outputs.len() / best_of as usize * n as usize);
    let mut outputs = outputs.into_iter().peekable();
    while outputs.peek().is_some() {
        let mut group: Vec<ChoiceOutput> = outputs.by_ref().take(best_of as usize).collect();
        let mut order: Vec<usize> = (0..group.len()).collect();
        // A stable sort keeps the earlier choice first among equals.
        order.sort_by(|&a, &b| {
            group[b]
                .cumulative_logprob()
                .total_cmp(&group[a].cumulative_logprob())
        });
        let mut taken: Vec<Option<ChoiceOutput>> = group.drain(..).map(Some).collect();
        selected.extend(
            order
                .into_iter()
                .take(n as usize)
                .filter_map(|i| taken[i].take()),
        );
    }
    selected
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::openai::common::FinishReason;

    fn output(logprobs: &[f32]) -> ChoiceOutput {
        ChoiceOutput {
            text: String::new(),
            tokens: logprobs
                .iter()
                .map(|&logprob| GeneratedToken {
                    id: 0,
                    logprob,
                    top: Vec::new(),
                })
                .collect(),
            prompt: None,
            finish_reason: FinishReason::Length,
            completion_tokens: logprobs.len() as u32,
            reasoning_tokens: 0,
            cached_tokens: 0,
        }
    }

    #[test]
    fn best_of_keeps_the_most_likely_per_prompt() {
        let outputs = vec![
            output(&[-1.0, -1.0]),
            output(&[-0.5]),
            output(&[-3.0]),
            output(&[-0.1]),
            output(&[-0.1]),
            output(&[-0.2, -0.3]),
        ];
        let best = select_best(outputs, 3, 2);
        let sums: Vec<f64> = best.iter().map(ChoiceOutput::cumulative_logprob).collect();
        let expected = [-0.5, -2.0, -0.1, -0.1];
        assert_eq!(sums.len(), expected.len());
        for (got, want) in sums.iter().zip(expected) {
            assert!((got - want).abs() < 1e-6, "{sums:?}");
        }
    }
}
