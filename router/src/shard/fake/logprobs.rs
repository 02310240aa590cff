//! `FakeShard`'s logprobs, by its documented rule (see `fake.rs`): token `t` has logprob
//! `-t / vocab_size` at every step, so the most likely tokens are `0, 1, 2, ...` and the rank of
//! `t` is `t + 1`; and the seeded first token of `with_seeded_sampling`.

use crate::shard::{PromptPosition, TokenLogprob};

/// The fake's log-probability of `token`, at any step and for any adapter.
pub fn fake_logprob(token: u32, vocab_size: u32) -> f32 {
    -(token as f32) / vocab_size as f32
}

/// The fake's `k` most likely tokens: `0..k` (within the vocabulary).
pub(super) fn fake_top(k: u32, vocab_size: u32) -> Vec<TokenLogprob> {
    (0..k.min(vocab_size))
        .map(|token_id| TokenLogprob {
            token_id,
            logprob: fake_logprob(token_id, vocab_size),
        })
        .collect()
}

/// The first token of a request with `seed` under `with_seeded_sampling`, given the token the
/// unseeded rule would give.
pub fn fake_seeded_first_token(unseeded: u32, seed: u64, vocab_size: u32) -> u32 {
    ((u64::from(unseeded) + seed % u64::from(vocab_size)) % u64::from(vocab_size)) as u32
}

/// `prompt_logprobs` of a prefill: every prompt token after the first.
pub(super) fn prompt_positions(
    input_ids: &[u32],
    top: u32,
    vocab_size: u32,
) -> Vec<PromptPosition> {
    input_ids
        .iter()
        .skip(1)
        .map(|&token| PromptPosition {
            logprob: fake_logprob(token, vocab_size),
            top: fake_top(top, vocab_size),
            rank: token + 1,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lower_ids_are_more_likely() {
        let positions = prompt_positions(&[5, 3, 0], 2, 10);
        assert_eq!(positions.len(), 2);
        assert_eq!((positions[0].logprob, positions[0].rank), (-0.3, 4));
        assert_eq!((positions[1].logprob, positions[1].rank), (0.0, 1));
        let top: Vec<(u32, f32)> = positions[0]
            .top
            .iter()
            .map(|t| (t.token_id, t.logprob))
            .collect();
        assert_eq!(top, [(0, 0.0), (1, -0.1)]);
        assert_eq!(fake_top(30, 10).len(), 10);
        assert_eq!(fake_seeded_first_token(7, 15, 10), 2);
    }
}
