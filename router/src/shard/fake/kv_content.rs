//! What the fake's KV cache holds: for every written slot, a digest of the adapter and every
//! token up to that position. The real KV of a position is a function of exactly that, so a
//! Prefill whose `cached_tokens` points at blocks holding anything else (another prompt's KV,
//! a block evicted and written over, a chunk never computed) is caught as a router bug.

use std::collections::HashMap;

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

fn mix(mut hash: u64, bytes: &[u8]) -> u64 {
    for &byte in bytes {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(FNV_PRIME);
    }
    hash
}

/// The digest before any token: the adapter alone ("" is the base model).
pub(super) fn start_digest(adapter_id: &str) -> u64 {
    mix(mix(FNV_OFFSET, adapter_id.as_bytes()), &[0xff])
}

/// The digest after one more token.
pub(super) fn next_digest(previous: u64, token: u32) -> u64 {
    mix(previous, &token.to_le_bytes())
}

/// Digest of every prefix of `tokens`: entry p covers tokens 0..=p.
pub(super) fn prefix_digests(adapter_id: &str, tokens: &[u32]) -> Vec<u64> {
    let mut digest = start_digest(adapter_id);
    tokens
        .iter()
        .map(|&token| {
            digest = next_digest(digest, token);
            digest
        })
        .collect()
}

#[derive(Debug, Default, Clone)]
pub(super) struct KvContent {
    /// Flat slot (block * block_size + offset) → digest of what was written there.
    slots: HashMap<u64, u64>,
}

impl KvContent {
    fn slot(blocks: &[u32], block_size: u32, position: usize) -> u64 {
        let block_size = block_size as usize;
        u64::from(blocks[position / block_size]) * block_size as u64
            + (position % block_size) as u64
    }

    /// Positions `from..until` of a sequence with block table `blocks` get `digests`' entries.
    pub(super) fn write(
        &mut self,
        blocks: &[u32],
        block_size: u32,
        digests: &[u64],
        from: usize,
        until: usize,
    ) {
        for (position, &digest) in digests.iter().enumerate().take(until).skip(from) {
            self.write_one(blocks, block_size, position, digest);
        }
    }

    /// Position `position` gets `digest` (a decode step's token).
    pub(super) fn write_one(
        &mut self,
        blocks: &[u32],
        block_size: u32,
        position: usize,
        digest: u64,
    ) {
        self.slots
            .insert(Self::slot(blocks, block_size, position), digest);
    }

    /// Whether positions `0..until` hold `digests`' entries; the error names the first that
    /// does not.
    pub(super) fn check(
        &self,
        blocks: &[u32],
        block_size: u32,
        digests: &[u64],
        until: usize,
    ) -> Result<(), String> {
        for (position, digest) in digests.iter().enumerate().take(until) {
            let slot = Self::slot(blocks, block_size, position);
            if self.slots.get(&slot) != Some(digest) {
                return Err(format!(
                    "cached position {position} (block {}) does not hold this prompt's KV",
                    blocks[position / block_size as usize]
                ));
            }
        }
        Ok(())
    }
}
