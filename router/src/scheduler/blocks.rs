//! KV-block accounting: which of the shard's cache blocks are free.
//!
//! The shard reports how many blocks its cache holds (Warmup); the router hands each admitted
//! request a block table and the shard writes that request's KV only there. Accounting must be
//! exact: a leaked block shrinks the cache for good, a block handed out twice corrupts two
//! requests' KV. So an allocation is a move-only `BlockAllocation` that only `free` consumes,
//! and the allocator also remembers which blocks are out, so that even a block table forged
//! elsewhere cannot be returned twice.

/// Blocks held by one request, in block-table order. Not `Clone`: it can be freed only once.
#[derive(Debug, PartialEq, Eq)]
pub struct BlockAllocation {
    blocks: Vec<u32>,
}

impl BlockAllocation {
    pub fn ids(&self) -> &[u32] {
        &self.blocks
    }

    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }
}

/// Blocks needed to hold `tokens` tokens.
pub fn blocks_for_tokens(tokens: u64, block_size: u32) -> u64 {
    tokens.div_ceil(u64::from(block_size.max(1)))
}

#[derive(Debug)]
pub struct BlockAllocator {
    /// Free block ids; allocation pops from the end, so the most recently freed blocks are
    /// reused first.
    free: Vec<u32>,
    /// `in_use[b]` is true while block `b` is allocated.
    in_use: Vec<bool>,
}

impl BlockAllocator {
    /// An allocator over blocks `0..num_blocks`, all free.
    pub fn new(num_blocks: u32) -> Self {
        Self {
            // Reversed so that a fresh allocator hands out 0, 1, 2, ...
            free: (0..num_blocks).rev().collect(),
            in_use: vec![false; num_blocks as usize],
        }
    }

    pub fn total(&self) -> u32 {
        self.in_use.len() as u32
    }

    pub fn free_count(&self) -> u32 {
        self.free.len() as u32
    }

    /// Takes `n` blocks, or none at all if fewer than `n` are free.
    pub fn allocate(&mut self, n: u32) -> Option<BlockAllocation> {
        let n = n as usize;
        if n > self.free.len() {
            return None;
        }
        let blocks = self.free.split_off(self.free.len() - n);
        for &block in &blocks {
            self.in_use[block as usize] = true;
        }
        Some(BlockAllocation { blocks })
    }

    /// Returns an allocation's blocks. A block that is not currently allocated (from another
    /// allocator, or already returned) is skipped and logged rather than freed twice.
    pub fn free(&mut self, allocation: BlockAllocation) {
        for block in allocation.blocks {
            match self.in_use.get_mut(block as usize) {
                Some(in_use) if *in_use => {
                    *in_use = false;
                    self.free.push(block);
                }
                _ => tracing::error!(block, "KV block freed but not allocated; ignored"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn blocks_for_tokens_rounds_up() {
        assert_eq!(blocks_for_tokens(0, 16), 0);
        assert_eq!(blocks_for_tokens(1, 16), 1);
        assert_eq!(blocks_for_tokens(16, 16), 1);
        assert_eq!(blocks_for_tokens(17, 16), 2);
        assert_eq!(
            blocks_for_tokens(u64::from(u32::MAX) + 5, 1),
            u64::from(u32::MAX) + 5
        );
    }

    #[test]
    fn allocates_distinct_blocks_until_empty() {
        let mut allocator = BlockAllocator::new(10);
        let a = allocator.allocate(4).unwrap();
        let b = allocator.allocate(6).unwrap();
        assert_eq!(allocator.free_count(), 0);
        let all: HashSet<u32> = a.ids().iter().chain(b.ids()).copied().collect();
        assert_eq!(all, (0..10).collect());
        assert!(allocator.allocate(1).is_none());
        assert_eq!(allocator.allocate(0).map(|a| a.len()), Some(0));
    }

    #[test]
    fn too_large_allocation_takes_nothing() {
        let mut allocator = BlockAllocator::new(5);
        let held = allocator.allocate(3).unwrap();
        assert!(allocator.allocate(3).is_none());
        assert_eq!(allocator.free_count(), 2);
        allocator.free(held);
        assert_eq!(allocator.free_count(), 5);
    }

    #[test]
    fn freed_blocks_are_reused_and_counted_once() {
        let mut allocator = BlockAllocator::new(8);
        let a = allocator.allocate(3).unwrap();
        let a_ids: Vec<u32> = a.ids().to_vec();
        let b = allocator.allocate(2).unwrap();
        allocator.free(a);
        assert_eq!(allocator.free_count(), 6);
        let c = allocator.allocate(6).unwrap();
        assert!(a_ids.iter().all(|id| c.ids().contains(id)));
        assert!(b.ids().iter().all(|id| !c.ids().contains(id)));
        allocator.free(b);
        allocator.free(c);
        assert_eq!(allocator.free_count(), 8);
    }

    #[test]
    fn double_free_and_foreign_blocks_are_ignored() {
        let mut allocator = BlockAllocator::new(4);
        let a = allocator.allocate(2).unwrap();
        // A forged allocation of the same ids: freeing both must not grow the free list past
        // the cache.
        let forged = BlockAllocation {
            blocks: a.ids().to_vec(),
        };
        allocator.free(a);
        allocator.free(forged);
        allocator.free(BlockAllocation { blocks: vec![99] });
        assert_eq!(allocator.free_count(), 4);
        let all = allocator.allocate(4).unwrap();
        let distinct: HashSet<u32> = all.ids().iter().copied().collect();
        assert_eq!(distinct.len(), 4);
    }

    #[test]
    fn random_churn_keeps_exact_accounting() {
        // A deterministic pseudo-random sequence of allocations and frees, checked against a
        // plain set model of the blocks in use.
        let mut allocator = BlockAllocator::new(64);
        let mut held: Vec<BlockAllocation> = Vec::new();
        let mut model: HashSet<u32> = HashSet::new();
        let mut x: u64 = 12345;
        for _ in 0..2000 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let r = (x >> 33) as u32;
            if !r.is_multiple_of(3) || held.is_empty() {
                let n = r % 9;
                let fits = n as usize <= 64 - model.len();
                match allocator.allocate(n) {
                    Some(a) => {
                        assert!(fits);
                        for &b in a.ids() {
                            assert!(model.insert(b), "block {b} handed out twice");
                        }
                        held.push(a);
                    }
                    None => assert!(!fits),
                }
            } else {
                let a = held.swap_remove(r as usize % held.len());
                for b in a.ids() {
                    model.remove(b);
                }
                allocator.free(a);
            }
            assert_eq!(allocator.free_count() as usize, 64 - model.len());
        }
    }
}
