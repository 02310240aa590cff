//! KV-block accounting: which of the shard's cache blocks are free.
//!
//! The shard reports how many blocks its cache holds (Warmup); the router hands each admitted
//! request a block table and the shard writes that request's KV only there. Accounting must be
//! exact: a leaked block shrinks the cache for good, a block handed out twice corrupts two
//! requests' KV. So an allocation is a move-only `BlockAllocation` that only `free` consumes,
//! and the allocator also remembers which blocks are out, so that even a block table forged
//! elsewhere cannot be returned twice.
//!
//! Prefix caching (as vLLM's automatic prefix caching): a full block of prompt tokens is
//! named by a hash of its adapter, its tokens and every token before it. Once a block's
//! prefill is sent it is registered under that hash, and a later request whose prompt starts
//! the same way takes a reference on it instead of computing it again. A block is free for
//! reuse only when no allocation references it; a cached one then stays cached, and is
//! evicted (least recently released first) only when no plain free block is left.

use std::collections::{BTreeMap, HashMap};

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

/// Identity of a full block of prompt tokens: a digest of the adapter, the tokens before it
/// and its own tokens (see `prefix_hash.rs`). Equal hashes mean equal KV.
pub type BlockHash = u128;

#[derive(Debug)]
pub struct BlockAllocator {
    /// Free block ids that hold no cached prefix; allocation pops from the end, so the most
    /// recently freed blocks are reused first.
    free: Vec<u32>,
    /// References held on each block by live allocations (0 = not allocated). A prefix-cache
    /// hit shares a block between requests, so this is a count, not a flag.
    refs: Vec<u32>,
    /// Blocks whose KV is a known prefix: hash -> block, and each block's hash.
    cached: HashMap<BlockHash, u32>,
    hash_of: Vec<Option<BlockHash>>,
    /// Cached blocks no allocation holds, by the tick they were last released: the oldest is
    /// evicted first when `free` runs dry. `released_at[b]` is b's key here.
    evictable: BTreeMap<u64, u32>,
    released_at: Vec<u64>,
    tick: u64,
}

impl BlockAllocator {
    /// An allocator over blocks `0..num_blocks`, all free.
    pub fn new(num_blocks: u32) -> Self {
        let n = num_blocks as usize;
        Self {
            // Reversed so that a fresh allocator hands out 0, 1, 2, ...
            free: (0..num_blocks).rev().collect(),
            refs: vec![0; n],
            cached: HashMap::new(),
            hash_of: vec![None; n],
            evictable: BTreeMap::new(),
            released_at: vec![0; n],
            tick: 0,
        }
    }

    pub fn total(&self) -> u32 {
        self.refs.len() as u32
    }

    /// Blocks an allocation can take: the free ones and the cached ones nobody holds.
    pub fn free_count(&self) -> u32 {
        (self.free.len() + self.evictable.len()) as u32
    }

    /// Cached prefix blocks that no request holds (part of `free_count`).
    #[cfg(test)]
    pub fn evictable_count(&self) -> u32 {
        self.evictable.len() as u32
    }

    /// Takes `n` blocks, or none at all if fewer than `n` are free (tests; requests go through
    /// `allocate_with_prefix`).
    #[cfg(test)]
    pub fn allocate(&mut self, n: u32) -> Option<BlockAllocation> {
        self.allocate_with_prefix(&[], n)
            .map(|(allocation, _)| allocation)
    }

    /// Takes `n` blocks whose leading ones are the cached blocks of `prefix` (the hashes of
    /// the request's first full blocks, in order) as far as they are cached; returns the
    /// allocation and how many leading blocks were hits. None, taking nothing, when the
    /// blocks beyond the hits are not free.
    pub fn allocate_with_prefix(
        &mut self,
        prefix: &[BlockHash],
        n: u32,
    ) -> Option<(BlockAllocation, u32)> {
        let hits: Vec<u32> = prefix
            .iter()
            .take(n as usize)
            .map_while(|hash| self.cached.get(hash).copied())
            .collect();
        // Hits that sit in `evictable` must not also be counted as room for the fresh blocks.
        let idle_hits = hits.iter().filter(|&&b| self.refs[b as usize] == 0).count();
        let fresh = n as usize - hits.len();
        if fresh > self.free.len() + self.evictable.len() - idle_hits {
            return None;
        }
        let mut blocks = Vec::with_capacity(n as usize);
        for &block in &hits {
            self.take_ref(block);
            blocks.push(block);
        }
        for _ in 0..fresh {
            let block = match self.free.pop() {
                Some(block) => block,
                None => self.evict_oldest(),
            };
            self.take_ref(block);
            blocks.push(block);
        }
        Some((BlockAllocation { blocks }, hits.len() as u32))
    }

    /// How many leading blocks of `prefix` are cached now (what `allocate_with_prefix` would
    /// share), without taking anything.
    pub fn cached_prefix_len(&self, prefix: &[BlockHash]) -> u32 {
        prefix
            .iter()
            .take_while(|hash| self.cached.contains_key(hash))
            .count() as u32
    }

    /// Records that `block`, held by an allocation, holds the KV of the prefix `hash` (its
    /// prefill was sent), so later requests may share it. A hash that another block already
    /// holds keeps that block; this one stays private.
    pub fn register(&mut self, block: u32, hash: BlockHash) {
        let b = block as usize;
        if self.refs.get(b).copied().unwrap_or(0) == 0 || self.hash_of[b].is_some() {
            return;
        }
        if let std::collections::hash_map::Entry::Vacant(slot) = self.cached.entry(hash) {
            slot.insert(block);
            self.hash_of[b] = Some(hash);
        }
    }

    /// Forgets what `block` caches (its prefill failed, so its KV is not what the hash says).
    pub fn unregister(&mut self, block: u32) {
        if let Some(hash) = self.hash_of.get_mut(block as usize).and_then(Option::take) {
            self.cached.remove(&hash);
        }
    }

    /// Whether `block` is registered as a cached prefix block.
    pub fn is_cached(&self, block: u32) -> bool {
        self.hash_of
            .get(block as usize)
            .is_some_and(Option::is_some)
    }

    /// Returns an allocation's references. A block that is not currently allocated (from
    /// another allocator, or already returned) is skipped and logged rather than freed twice.
    /// A cached block nobody holds any more stays cached until its room is needed.
    pub fn free(&mut self, allocation: BlockAllocation) {
        for block in allocation.blocks {
            let b = block as usize;
            match self.refs.get_mut(b) {
                Some(refs) if *refs > 0 => {
                    *refs -= 1;
                    if *refs > 0 {
                        continue;
                    }
                    if self.hash_of[b].is_some() {
                        self.tick += 1;
                        self.released_at[b] = self.tick;
                        self.evictable.insert(self.tick, block);
                    } else {
                        self.free.push(block);
                    }
                }
                _ => tracing::error!(block, "KV block freed but not allocated; ignored"),
            }
        }
    }

    fn take_ref(&mut self, block: u32) {
        let b = block as usize;
        if self.refs[b] == 0 && self.hash_of[b].is_some() {
            self.evictable.remove(&self.released_at[b]);
        }
        self.refs[b] += 1;
    }

    /// Empties the least recently released cached block for reuse.
    fn evict_oldest(&mut self) -> u32 {
        let (_, block) = self
            .evictable
            .pop_first()
            .expect("the caller checked that enough blocks are free or evictable");
        self.unregister(block);
        block
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

    fn hashes(range: std::ops::Range<u128>) -> Vec<BlockHash> {
        range.collect()
    }

    #[test]
    fn a_registered_prefix_is_shared_and_counted_once() {
        let mut allocator = BlockAllocator::new(10);
        let (a, hits) = allocator.allocate_with_prefix(&hashes(1..4), 5).unwrap();
        assert_eq!(hits, 0);
        for (&block, hash) in a.ids().iter().zip(1..4) {
            allocator.register(block, hash);
        }
        let (b, hits) = allocator.allocate_with_prefix(&hashes(1..4), 5).unwrap();
        assert_eq!(hits, 3);
        assert_eq!(&b.ids()[..3], &a.ids()[..3]);
        assert!(b.ids()[3..].iter().all(|id| !a.ids().contains(id)));
        // 5 + 2 blocks are held; the shared ones count once.
        assert_eq!(allocator.free_count(), 3);
        // A prompt that parts after the first block shares only that one.
        let (c, hits) = allocator.allocate_with_prefix(&[1, 7, 8], 3).unwrap();
        assert_eq!((hits, c.ids()[0]), (1, a.ids()[0]));
        allocator.free(a);
        allocator.free(c);
        // b still holds the cached blocks, and the released cached ones are not plain free.
        assert_eq!(allocator.free_count(), 10 - 5);
        allocator.free(b);
        assert_eq!(allocator.free_count(), 10);
        assert_eq!(allocator.evictable_count(), 3);
    }

    #[test]
    fn released_cached_blocks_are_hits_until_their_room_is_needed() {
        let mut allocator = BlockAllocator::new(6);
        let (a, _) = allocator.allocate_with_prefix(&hashes(1..3), 2).unwrap();
        let (b, _) = allocator.allocate_with_prefix(&hashes(11..13), 2).unwrap();
        let (a_ids, b_ids) = (a.ids().to_vec(), b.ids().to_vec());
        for (&block, hash) in a_ids.iter().zip(1..3).chain(b_ids.iter().zip(11..13)) {
            allocator.register(block, hash);
        }
        allocator.free(a); // released first: evicted first
        allocator.free(b);
        // Two plain free blocks, then the oldest cached ones.
        let filler = allocator.allocate(3).unwrap();
        assert!(!allocator.is_cached(a_ids[0]));
        assert!(allocator.is_cached(a_ids[1]) && allocator.is_cached(b_ids[0]));
        // a's first block is gone, so a's prefix misses from the start; b's still hits.
        let (again_a, hits) = allocator.allocate_with_prefix(&hashes(1..3), 1).unwrap();
        assert_eq!(hits, 0);
        assert_ne!(again_a.ids()[0], a_ids[0]);
        let (again_b, hits) = allocator.allocate_with_prefix(&hashes(11..13), 2).unwrap();
        assert_eq!((hits, again_b.ids()), (2, &b_ids[..]));
        for allocation in [filler, again_a, again_b] {
            allocator.free(allocation);
        }
        assert_eq!(allocator.free_count(), 6);
    }

    #[test]
    fn an_idle_hit_is_not_also_room_for_fresh_blocks() {
        let mut allocator = BlockAllocator::new(3);
        let (a, _) = allocator.allocate_with_prefix(&hashes(1..2), 1).unwrap();
        allocator.register(a.ids()[0], 1);
        allocator.free(a);
        let held = allocator.allocate(2).unwrap();
        // One block would be the hit and the other two fresh: only one is left besides it.
        assert!(allocator.allocate_with_prefix(&hashes(1..2), 3).is_none());
        assert_eq!(allocator.free_count(), 1);
        assert_eq!(allocator.evictable_count(), 1);
        let (one, hits) = allocator.allocate_with_prefix(&hashes(1..2), 1).unwrap();
        assert_eq!(hits, 1);
        allocator.free(one);
        allocator.free(held);
        assert_eq!(allocator.free_count(), 3);
    }

    #[test]
    fn an_unregistered_block_is_no_hit_and_a_duplicate_hash_stays_private() {
        let mut allocator = BlockAllocator::new(4);
        let a = allocator.allocate(1).unwrap();
        let b = allocator.allocate(1).unwrap();
        allocator.register(a.ids()[0], 5);
        allocator.register(b.ids()[0], 5);
        assert!(allocator.is_cached(a.ids()[0]) && !allocator.is_cached(b.ids()[0]));
        allocator.unregister(a.ids()[0]);
        let (c, hits) = allocator.allocate_with_prefix(&[5], 1).unwrap();
        assert_eq!(hits, 0);
        for allocation in [a, b, c] {
            allocator.free(allocation);
        }
        assert_eq!(
            (allocator.free_count(), allocator.evictable_count()),
            (4, 0)
        );
    }

    #[test]
    fn random_churn_with_shared_prefixes_keeps_exact_accounting() {
        // Requests draw prompts from a few prefix families, register their blocks, and are freed
        // in random order; checked against a model of references per block.
        let mut allocator = BlockAllocator::new(48);
        let mut held: Vec<BlockAllocation> = Vec::new();
        let mut model: HashMap<u32, u32> = HashMap::new();
        let mut x: u64 = 99;
        for _ in 0..3000 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let r = (x >> 33) as u32;
            if !r.is_multiple_of(3) || held.is_empty() {
                let family = u128::from(r % 4) * 100;
                let prefix: Vec<BlockHash> = (family..family + u128::from(r % 5)).collect();
                let n = prefix.len() as u32 + r % 4;
                if let Some((a, hits)) = allocator.allocate_with_prefix(&prefix, n) {
                    for (i, &b) in a.ids().iter().enumerate() {
                        let refs = model.entry(b).or_default();
                        // Only hits may be shared.
                        assert!(
                            *refs == 0 || (i as u32) < hits,
                            "block {b} handed out twice"
                        );
                        *refs += 1;
                    }
                    for (&b, &hash) in a.ids().iter().zip(&prefix) {
                        allocator.register(b, hash);
                    }
                    held.push(a);
                }
            } else {
                let a = held.swap_remove(r as usize % held.len());
                for b in a.ids() {
                    *model.get_mut(b).unwrap() -= 1;
                }
                allocator.free(a);
            }
            let in_use = model.values().filter(|&&refs| refs > 0).count();
            assert_eq!(allocator.free_count() as usize, 48 - in_use);
        }
    }
}
