//! The fake's outputs as functions of its inputs: the token rule, each adapter's shift of it,
//! and the embedding (see the module doc of `fake.rs`). Tests compute what to expect with them.

/// Width of the fake's embeddings.
pub const FAKE_EMBEDDING_DIM: u32 = 4;

/// The fake's embedding of `prompt` under `adapter_id` ("" is the base model).
pub fn fake_embedding(adapter_id: &str, prompt: &[u32], vocab_size: u32) -> Vec<f32> {
    let sum = prompt.iter().map(|&t| u64::from(t)).sum::<u64>() % u64::from(vocab_size.max(1));
    vec![
        prompt.len() as f32,
        prompt.last().copied().unwrap_or(0) as f32,
        fake_adapter_shift(adapter_id, vocab_size) as f32,
        sum as f32,
    ]
}

/// The fake's token rule for the base model: the token after `previous`.
pub fn fake_next_token(previous: u32, vocab_size: u32) -> u32 {
    next_token(previous, 0, vocab_size)
}

/// The fake's token rule for `adapter_id` ("" is the base model): the token after `previous`.
pub fn fake_next_token_for(previous: u32, adapter_id: &str, vocab_size: u32) -> u32 {
    next_token(
        previous,
        fake_adapter_shift(adapter_id, vocab_size),
        vocab_size,
    )
}

/// `k` of the token rule: 0 for the base model, else `1 + fnv1a64(id) % (vocab_size - 1)`
/// (FNV-1a, 64-bit: offset basis 0xcbf29ce484222325, prime 0x100000001b3), in 1..vocab_size.
pub fn fake_adapter_shift(adapter_id: &str, vocab_size: u32) -> u32 {
    if adapter_id.is_empty() || vocab_size < 2 {
        return 0;
    }
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for &byte in adapter_id.as_bytes() {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    1 + (hash % u64::from(vocab_size - 1)) as u32
}

pub(super) fn next_token(previous: u32, shift: u32, vocab_size: u32) -> u32 {
    ((u64::from(previous) * 31 + 7 + u64::from(shift)) % u64::from(vocab_size)) as u32
}
