//! The names of full prompt blocks for prefix caching (`blocks.rs`).
//!
//! Block i of a prompt is named by a digest of the previous block's name and its own tokens,
//! and block 0's "previous name" is a digest of the request's cache scope (its tenant's
//! prefix-cache group and `cache_salt`) and of the adapter (with how many times an adapter of
//! that id was unloaded, so an adapter reloaded under the same id never reuses the KV of the
//! old weights). Equal names thus mean the same scope, the same adapter and the same tokens
//! from position 0 to the end of the block: the same KV, which no other scope can hit. SHA-256 cut to 128 bits makes an accidental collision,
//! which would hand a request another prompt's KV, as unlikely as a hardware fault.

use sha2::{Digest, Sha256};

use super::blocks::BlockHash;

/// Names of the full blocks of `tokens` (a trailing partial block has none).
pub fn block_hashes(
    cache_scope: &str,
    adapter_id: &str,
    adapter_epoch: u64,
    tokens: &[u32],
    block_size: u32,
) -> Vec<BlockHash> {
    let block_size = block_size.max(1) as usize;
    let mut seed = Sha256::new();
    seed.update(b"quiver-prefix-v2");
    // Length-prefixed, so no scope and adapter pair spells another.
    seed.update((cache_scope.len() as u64).to_le_bytes());
    seed.update(cache_scope.as_bytes());
    seed.update(adapter_epoch.to_le_bytes());
    seed.update((adapter_id.len() as u64).to_le_bytes());
    seed.update(adapter_id.as_bytes());
    let mut previous = truncate(seed.finalize().into());
    tokens
        .chunks_exact(block_size)
        .map(|block| {
            let mut digest = Sha256::new();
            digest.update(previous.to_le_bytes());
            for token in block {
                digest.update(token.to_le_bytes());
            }
            previous = truncate(digest.finalize().into());
            previous
        })
        .collect()
}

fn truncate(digest: [u8; 32]) -> BlockHash {
    let mut head = [0u8; 16];
    head.copy_from_slice(&digest[..16]);
    BlockHash::from_le_bytes(head)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_name_depends_on_everything_before_it() {
        let tokens: Vec<u32> = (0..40).collect();
        let base = block_hashes("", "", 0, &tokens, 16);
        assert_eq!(base.len(), 2, "the trailing 8 tokens make no full block");
        // Same prefix, different later tokens: the shared full blocks keep their names.
        let mut other = tokens.clone();
        other[20] = 999;
        let parted = block_hashes("", "", 0, &other, 16);
        assert_eq!(parted[0], base[0]);
        assert_ne!(parted[1], base[1]);
        // A change in block 0 renames every later block too.
        other[20] = 20;
        other[3] = 999;
        let early = block_hashes("", "", 0, &other, 16);
        assert!(early.iter().zip(&base).all(|(a, b)| a != b));
    }

    #[test]
    fn adapters_and_their_reloads_never_share_blocks() {
        let tokens: Vec<u32> = (0..32).collect();
        let names = [
            block_hashes("", "", 0, &tokens, 16),
            block_hashes("", "a", 0, &tokens, 16),
            block_hashes("", "b", 0, &tokens, 16),
            block_hashes("", "a", 1, &tokens, 16),
        ];
        for (i, x) in names.iter().enumerate() {
            for y in &names[i + 1..] {
                assert!(x.iter().zip(y).all(|(a, b)| a != b));
            }
        }
        assert_eq!(names[1], block_hashes("", "a", 0, &tokens, 16));
    }

    #[test]
    fn cache_scopes_never_share_blocks() {
        let tokens: Vec<u32> = (0..32).collect();
        let names = [
            block_hashes("", "a", 0, &tokens, 16),
            block_hashes("team-a", "a", 0, &tokens, 16),
            block_hashes("team-b", "a", 0, &tokens, 16),
            // The length prefix keeps scope and adapter apart: "ab" + "" is not "a" + "b".
            block_hashes("ab", "", 0, &tokens, 16),
            block_hashes("a", "b", 0, &tokens, 16),
        ];
        for (i, x) in names.iter().enumerate() {
            for y in &names[i + 1..] {
                assert!(x.iter().zip(y).all(|(a, b)| a != b));
            }
        }
        assert_eq!(names[1], block_hashes("team-a", "a", 0, &tokens, 16));
    }
}
