//! The shard's adapter device slots as the router tracks them: which adapter each slot holds,
//! how many requests use it, and which adapter is waiting for it.
//!
//! Rules (the batcher applies them between steps, so no slot changes under a running request):
//! - An adapter already in a slot runs there.
//! - Otherwise it takes a slot no request uses and whose capacity holds its rank (rank
//!   classes, `--lora-rank-classes`): one reserved for it or an empty one, else the one whose
//!   adapter was used least recently (LRU eviction, only ever of idle adapters); among each,
//!   the smallest capacity first, so that small adapters leave the large slots to the large
//!   ones.
//! - If every such slot is busy, the adapter waits; the batcher then reserves a busy slot that
//!   holds its rank for it (`reserve`: of the smallest class, least recently used within it):
//!   the slot's adapter gets no
//!   new requests, its running ones finish, and the slot goes to the waiting adapter. Without
//!   that, an adapter with a steady stream of requests would keep its slot busy forever and
//!   starve the others.
//!
//! - A slot being filled (`begin_activation` .. `activation_done`) takes no requests, is no
//!   eviction or reservation victim and cannot be unloaded: its copy runs beside the steps.
//!
//! Pure bookkeeping, no I/O: the batcher calls ActivateAdapter for the slots it begins to fill.

use std::collections::HashMap;

#[derive(Debug)]
struct Slot {
    /// The largest LoRA rank the slot holds.
    capacity: u32,
    /// The adapter the slot holds (or is being activated with in the batch being built).
    adapter: Option<String>,
    /// Requests using the slot: running, or admitted into the batch being built.
    users: usize,
    /// When the slot was last claimed or released (a logical clock).
    last_used: u64,
    /// An adapter waiting for this slot; the holder gets no new requests until it is idle.
    reserved_for: Option<String>,
    /// ActivateAdapter is copying `adapter` into the slot.
    activating: bool,
}

#[derive(Debug)]
pub(super) struct AdapterSlots {
    slots: Vec<Slot>,
    by_adapter: HashMap<String, usize>,
    clock: u64,
    /// The largest slot capacity.
    max_capacity: u32,
}

impl AdapterSlots {
    /// One slot per capacity (the largest LoRA rank it holds), in slot order.
    pub(super) fn new(capacities: &[u32]) -> Self {
        let slot = |&capacity| Slot {
            capacity,
            adapter: None,
            users: 0,
            last_used: 0,
            reserved_for: None,
            activating: false,
        };
        Self {
            slots: capacities.iter().map(slot).collect(),
            by_adapter: HashMap::new(),
            clock: 0,
            max_capacity: capacities.iter().copied().max().unwrap_or(0),
        }
    }

    /// Whether `slot` holds an adapter of `rank`. An unknown rank (0), or one above every slot
    /// (which the shards refuse to load), goes only to the largest slots: there it runs if
    /// anywhere, and the shard's own check answers otherwise rather than the request waiting
    /// for a slot that cannot come.
    fn fits(&self, slot: &Slot, rank: u32) -> bool {
        let needed = if rank == 0 {
            self.max_capacity
        } else {
            rank.min(self.max_capacity)
        };
        slot.capacity >= needed
    }

    /// Slots holding an adapter.
    pub(super) fn active_count(&self) -> usize {
        self.by_adapter.len()
    }

    /// The adapters holding a slot.
    pub(super) fn adapters(&self) -> Vec<String> {
        self.by_adapter.keys().cloned().collect()
    }

    /// Requests using `adapter`'s slot (0 if it holds none).
    pub(super) fn users_of(&self, adapter: &str) -> usize {
        self.by_adapter
            .get(adapter)
            .map_or(0, |&slot| self.slots[slot].users)
    }

    /// The slot `adapter` (of LoRA rank `rank`) can run in now, if any (see the module rules).
    /// Changes nothing.
    pub(super) fn find(&self, adapter: &str, rank: u32) -> Option<usize> {
        if let Some(&slot) = self.by_adapter.get(adapter) {
            let reserved = self.slots[slot].reserved_for.as_deref();
            // Draining for another adapter: no new requests here.
            return reserved.is_none_or(|r| r == adapter).then_some(slot);
        }
        let mut best: Option<(usize, (u8, u32, u64))> = None;
        for (index, slot) in self.slots.iter().enumerate() {
            if slot.users > 0 || slot.activating || !self.fits(slot, rank) {
                continue;
            }
            // A slot drained for it is as good as an empty one: of the two, the smaller goes
            // (a small adapter that had to reserve a large slot takes a small one that came
            // free, and its reservation goes with `assign`).
            let preference = match slot.reserved_for.as_deref() {
                Some(r) if r == adapter => 0,
                Some(_) => continue,
                None if slot.adapter.is_none() => 0,
                None => 1,
            };
            let key = (preference, slot.capacity, slot.last_used);
            if best.is_none_or(|(_, best_key)| key < best_key) {
                best = Some((index, key));
            }
        }
        best.map(|(index, _)| index)
    }

    /// Whether `adapter` holds a slot (filled, or being filled).
    pub(super) fn holds(&self, adapter: &str) -> bool {
        self.by_adapter.contains_key(adapter)
    }

    /// Whether `adapter`'s slot is still being filled (its requests wait for it).
    pub(super) fn is_activating(&self, adapter: &str) -> bool {
        self.by_adapter
            .get(adapter)
            .is_some_and(|&slot| self.slots[slot].activating)
    }

    /// Slots being filled.
    pub(super) fn activating_count(&self) -> usize {
        self.slots.iter().filter(|s| s.activating).count()
    }

    /// Starts filling `slot` (from `find`, for an adapter it does not hold) with `adapter`;
    /// returns what the slot held before. Until `activation_done` the adapter takes no requests.
    pub(super) fn begin_activation(&mut self, slot: usize, adapter: &str) -> Option<String> {
        self.clock += 1;
        let state = &mut self.slots[slot];
        debug_assert!(state.users == 0 && !state.activating);
        state.last_used = self.clock;
        state.activating = true;
        state.reserved_for = None;
        self.assign(slot, adapter)
    }

    /// ActivateAdapter filled `slot`: its adapter takes requests from now on.
    pub(super) fn activation_done(&mut self, slot: usize) {
        self.slots[slot].activating = false;
    }

    /// Puts one more request of `adapter` in `slot` (from `find`). Returns the adapter the slot
    /// held before if it must be activated: `Some(None)` for an empty slot, `Some(Some(old))`
    /// when `old` is evicted, `None` when `adapter` is already there.
    pub(super) fn claim(&mut self, slot: usize, adapter: &str) -> Option<Option<String>> {
        self.clock += 1;
        let clock = self.clock;
        let state = &mut self.slots[slot];
        state.users += 1;
        state.last_used = clock;
        if state.adapter.as_deref() == Some(adapter) {
            return None;
        }
        Some(self.assign(slot, adapter))
    }

    /// Makes `slot` hold `adapter`; returns what it held. Whatever was reserved for `adapter`
    /// is no longer needed.
    fn assign(&mut self, slot: usize, adapter: &str) -> Option<String> {
        let evicted = self.slots[slot].adapter.replace(adapter.to_owned());
        if let Some(old) = &evicted {
            self.by_adapter.remove(old);
        }
        self.by_adapter.insert(adapter.to_owned(), slot);
        for other in &mut self.slots {
            if other.reserved_for.as_deref() == Some(adapter) {
                other.reserved_for = None;
            }
        }
        evicted
    }

    /// A request of `slot` finished or failed.
    pub(super) fn release(&mut self, slot: usize) {
        self.clock += 1;
        if let Some(state) = self.slots.get_mut(slot) {
            state.users = state.users.saturating_sub(1);
            state.last_used = self.clock;
        }
    }

    /// ActivateAdapter failed: the slot's content is unknown, so it is empty from now on. Its
    /// users were only the requests admitted with that activation, which the batcher fails.
    pub(super) fn activation_failed(&mut self, slot: usize) {
        let state = &mut self.slots[slot];
        state.users = 0;
        state.activating = false;
        if let Some(adapter) = state.adapter.take() {
            self.by_adapter.remove(&adapter);
        }
    }

    /// For each adapter in `waiting` (adapter and LoRA rank, in service order) that holds no
    /// slot and has no reservation, reserves an unreserved slot that holds its rank, if there is
    /// one: of the smallest such class, least recently used within it.
    pub(super) fn reserve(&mut self, waiting: &[(String, u32)]) {
        for (adapter, rank) in waiting {
            let reserved = self
                .slots
                .iter()
                .any(|s| s.reserved_for.as_deref() == Some(adapter.as_str()));
            if reserved || self.by_adapter.contains_key(adapter) {
                continue;
            }
            let victim = (0..self.slots.len())
                .filter(|&i| {
                    let slot = &self.slots[i];
                    slot.reserved_for.is_none() && !slot.activating && self.fits(slot, *rank)
                })
                // The smallest class first: a large slot stays for the large adapters.
                .min_by_key(|&i| (self.slots[i].capacity, self.slots[i].last_used));
            // Slots of a larger class may still be left for the adapters after it.
            let Some(victim) = victim.map(|i| &mut self.slots[i]) else {
                continue;
            };
            tracing::debug!(
                adapter = ?adapter,
                holder = ?victim.adapter,
                "adapter waits for a slot; its holder drains"
            );
            victim.reserved_for = Some(adapter.clone());
        }
    }

    /// Drops reservations for adapters that no longer wait (their requests left the queue).
    pub(super) fn drop_reservations_unless(&mut self, still_waiting: impl Fn(&str) -> bool) {
        for slot in &mut self.slots {
            if slot
                .reserved_for
                .as_deref()
                .is_some_and(|a| !still_waiting(a))
            {
                slot.reserved_for = None;
            }
        }
    }

    /// Empties `adapter`'s slot (for unloading). Returns false, changing nothing, while requests
    /// use it or it is being filled.
    pub(super) fn evict(&mut self, adapter: &str) -> bool {
        if self.users_of(adapter) > 0 || self.is_activating(adapter) {
            return false;
        }
        if let Some(slot) = self.by_adapter.remove(adapter) {
            self.slots[slot].adapter = None;
        }
        self.drop_reservations_unless(|a| a != adapter);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Claims a slot for one request of `adapter` (rank 8), as the batcher does.
    fn admit(slots: &mut AdapterSlots, adapter: &str) -> usize {
        admit_ranked(slots, adapter, 8)
    }

    fn admit_ranked(slots: &mut AdapterSlots, adapter: &str, rank: u32) -> usize {
        let slot = slots.find(adapter, rank).expect("a slot");
        slots.claim(slot, adapter);
        slot
    }

    /// Adapters of rank 8 waiting for a slot, in service order.
    fn waiting(adapters: &[&str]) -> Vec<(String, u32)> {
        adapters.iter().map(|a| (a.to_string(), 8)).collect()
    }

    #[test]
    fn empty_slots_first_then_the_same_slot_for_the_same_adapter() {
        let mut slots = AdapterSlots::new(&[64; 2]);
        assert_eq!(slots.find("a", 8), Some(0));
        assert_eq!(slots.claim(0, "a"), Some(None));
        assert_eq!(slots.find("a", 8), Some(0));
        assert_eq!(slots.claim(0, "a"), None);
        assert_eq!(slots.find("b", 8), Some(1));
        assert_eq!(slots.claim(1, "b"), Some(None));
        assert_eq!(slots.users_of("a"), 2);
        assert_eq!(slots.active_count(), 2);
        // Both busy: c must wait.
        assert_eq!(slots.find("c", 8), None);
    }

    #[test]
    fn eviction_takes_the_least_recently_used_idle_adapter() {
        let mut slots = AdapterSlots::new(&[64; 3]);
        let a = admit(&mut slots, "a");
        let b = admit(&mut slots, "b");
        let c = admit(&mut slots, "c");
        slots.release(a);
        slots.release(b);
        // a was used again after b finished: b is the least recently used idle one.
        let again = admit(&mut slots, "a");
        slots.release(again);
        assert_eq!(slots.find("d", 8), Some(b));
        assert_eq!(slots.claim(b, "d"), Some(Some("b".to_string())));
        assert_eq!(slots.users_of("b"), 0);
        // c is busy and never evicted; a is the only idle one now.
        assert_eq!(slots.find("e", 8), Some(a));
        slots.release(c);
        assert_eq!(slots.find("e", 8), Some(a), "a went idle before c");
    }

    #[test]
    fn a_reserved_slot_drains_and_goes_to_its_waiter() {
        let mut slots = AdapterSlots::new(&[64; 2]);
        let a = admit(&mut slots, "a");
        let b = admit(&mut slots, "b");
        assert_eq!(slots.find("c", 8), None);
        slots.reserve(&waiting(&["c", "d", "e"]));
        // a is the older holder: reserved for c; b for d; e finds nothing left to reserve.
        assert_eq!(slots.find("a", 8), None, "a drains for c");
        assert_eq!(slots.find("b", 8), None, "b drains for d");
        slots.release(b);
        // b's slot is idle but reserved for d: neither c nor e may take it.
        assert_eq!(slots.find("c", 8), None);
        assert_eq!(slots.find("e", 8), None);
        assert_eq!(slots.find("d", 8), Some(b));
        slots.release(a);
        assert_eq!(slots.find("c", 8), Some(a));
        assert_eq!(slots.claim(a, "c"), Some(Some("a".to_string())));
        assert_eq!(slots.claim(b, "d"), Some(Some("b".to_string())));
        // Reservations are fulfilled: c and d keep admitting.
        assert_eq!((slots.find("c", 8), slots.find("d", 8)), (Some(a), Some(b)));
    }

    #[test]
    fn reservations_of_adapters_that_left_are_dropped() {
        let mut slots = AdapterSlots::new(&[64; 1]);
        admit(&mut slots, "a");
        slots.reserve(&waiting(&["b"]));
        assert_eq!(slots.find("a", 8), None);
        // A holder does not reserve a second slot for itself, nor does a waiter reserve twice.
        slots.reserve(&waiting(&["a", "b"]));
        slots.drop_reservations_unless(|adapter| adapter != "b");
        assert_eq!(slots.find("a", 8), Some(0));
    }

    #[test]
    fn a_failed_activation_empties_the_slot() {
        let mut slots = AdapterSlots::new(&[64; 1]);
        let slot = admit(&mut slots, "a");
        admit(&mut slots, "a");
        slots.activation_failed(slot);
        assert_eq!((slots.active_count(), slots.users_of("a")), (0, 0));
        assert_eq!(slots.find("b", 8), Some(slot));
        assert_eq!(slots.claim(slot, "b"), Some(None));
    }

    #[test]
    fn a_slot_being_filled_takes_no_requests_and_is_nobodys_victim() {
        let mut slots = AdapterSlots::new(&[64; 2]);
        assert_eq!(slots.find("a", 8), Some(0));
        assert_eq!(slots.begin_activation(0, "a"), None);
        assert!(slots.is_activating("a"));
        assert_eq!(slots.activating_count(), 1);
        // b gets the other slot, c none: a's slot is neither free nor evictable yet.
        assert_eq!(slots.find("b", 8), Some(1));
        assert_eq!(slots.begin_activation(1, "b"), None);
        assert_eq!(slots.find("c", 8), None);
        slots.reserve(&waiting(&["c"]));
        assert!(!slots.evict("a"), "no unload while a's weights are copied");
        slots.activation_done(0);
        assert!(!slots.is_activating("a"));
        assert_eq!(slots.claim(0, "a"), None, "a is in its slot already");
        slots.release(0);
        // Nothing was reserved for c while both slots were being filled; now the least
        // recently used idle adapter, b (filled before a was used), makes room for it.
        slots.activation_done(1);
        assert_eq!(slots.find("c", 8), Some(1));
        assert_eq!(slots.begin_activation(1, "c"), Some("b".to_string()));
        slots.activation_failed(1);
        assert_eq!((slots.active_count(), slots.activating_count()), (1, 0));
        assert_eq!(slots.find("c", 8), Some(1));
    }

    #[test]
    fn evict_waits_for_the_last_user() {
        let mut slots = AdapterSlots::new(&[64; 2]);
        let slot = admit(&mut slots, "a");
        slots.reserve(&waiting(&["x"]));
        assert!(!slots.evict("a"));
        slots.release(slot);
        assert!(slots.evict("a"));
        assert_eq!(slots.active_count(), 0);
        assert!(slots.evict("never-seen"));
    }

    #[test]
    fn an_adapter_takes_the_smallest_slot_its_rank_fits() {
        let slots = AdapterSlots::new(&[8, 16, 64]);
        for (rank, slot) in [(4, 0), (8, 0), (12, 1), (16, 1), (32, 2), (64, 2)] {
            assert_eq!(slots.find("a", rank), Some(slot), "rank {rank}");
        }
        // Above every slot (the shards refuse to load it): the largest, whose shard says no.
        assert_eq!(slots.find("a", 128), Some(2));
    }

    #[test]
    fn a_large_adapter_waits_rather_than_take_a_small_empty_slot() {
        let mut slots = AdapterSlots::new(&[16, 16, 64]);
        let big = admit_ranked(&mut slots, "big", 64);
        assert_eq!(big, 2);
        assert_eq!(
            slots.find("other-big", 64),
            None,
            "slots 0 and 1 are too small"
        );
        slots.reserve(&[("other-big".to_string(), 64)]);
        assert_eq!(slots.find("big", 64), None, "big drains for other-big");
        assert_eq!(slots.find("small", 16), Some(0));
        slots.release(big);
        assert_eq!(slots.find("other-big", 64), Some(2));
        assert_eq!(slots.claim(2, "other-big"), Some(Some("big".to_string())));
    }

    #[test]
    fn an_unknown_rank_goes_only_to_the_largest_slots() {
        let mut slots = AdapterSlots::new(&[8, 64, 64]);
        assert_eq!(admit_ranked(&mut slots, "u", 0), 1);
        assert_eq!(admit_ranked(&mut slots, "v", 0), 2);
        assert_eq!(
            slots.find("w", 0),
            None,
            "slot 0 is empty but may be too small"
        );
        assert_eq!(slots.find("w", 8), Some(0));
    }

    #[test]
    fn reserve_drains_only_a_slot_that_holds_the_waiters_rank() {
        let mut slots = AdapterSlots::new(&[16, 64]);
        let small = admit(&mut slots, "a");
        let large = admit_ranked(&mut slots, "c", 64);
        // a's slot is the least recently used, but too small for big1; big2 finds no slot
        // left that fits, and tiny, after it, still reserves a's.
        slots.reserve(&[
            ("big1".to_string(), 64),
            ("big2".to_string(), 64),
            ("tiny".to_string(), 8),
        ]);
        assert_eq!(slots.find("c", 64), None, "c drains for big1");
        assert_eq!(slots.find("a", 8), None, "a drains for tiny");
        slots.release(small);
        slots.release(large);
        assert_eq!(slots.find("big2", 64), None);
        assert_eq!(slots.find("big1", 64), Some(large));
        assert_eq!(slots.find("tiny", 8), Some(small));
    }

    #[test]
    fn a_small_adapter_that_reserved_a_large_slot_takes_a_small_one_that_came_free() {
        let mut slots = AdapterSlots::new(&[16, 64]);
        let small = admit(&mut slots, "a");
        let large = admit_ranked(&mut slots, "big", 64);
        // tiny reserves the small slot, then tiny2 (also small) can only reserve the large one.
        slots.reserve(&[("tiny".to_string(), 8), ("tiny2".to_string(), 8)]);
        assert_eq!(slots.find("big", 64), None, "big drains for tiny2");
        slots.release(large);
        slots.release(small);
        slots.claim(slots.find("tiny", 8).expect("its reserved slot"), "tiny");
        let tiny = slots.find("tiny", 8).unwrap();
        assert_eq!(tiny, small);
        slots.release(tiny);
        // Both the drained large slot and the now idle small one hold tiny2; evicting tiny is
        // not preferred over the slot drained for tiny2...
        assert_eq!(slots.find("tiny2", 8), Some(large));
        // ...but an empty small slot is: the large one then stays for the large adapters.
        assert!(slots.evict("tiny"));
        assert_eq!(slots.find("tiny2", 8), Some(small));
        slots.claim(small, "tiny2");
        assert_eq!(
            slots.find("big", 64),
            Some(large),
            "the large slot's reservation is gone"
        );
    }

    #[test]
    fn a_small_waiter_drains_a_small_slot_before_the_large_one() {
        let mut slots = AdapterSlots::new(&[64, 16]);
        let large = admit_ranked(&mut slots, "big", 64);
        let small = admit(&mut slots, "a");
        // big's large slot is the least recently used; tiny still drains a's small one, and the
        // large slot stays free of reservations for big2.
        slots.reserve(&[("tiny".to_string(), 8), ("big2".to_string(), 64)]);
        assert_eq!(slots.find("a", 8), None, "a drains for tiny");
        assert_eq!(slots.find("big", 64), None, "big drains for big2");
        slots.release(small);
        slots.release(large);
        assert_eq!(slots.find("tiny", 8), Some(small));
        assert_eq!(slots.find("big2", 64), Some(large));
    }

    #[test]
    fn an_empty_slot_comes_before_an_eviction_and_a_small_slot_before_a_recent_use() {
        let mut slots = AdapterSlots::new(&[8, 64]);
        let a = admit(&mut slots, "a");
        slots.release(a);
        // a idles in the rank-8 slot: b takes the empty rank-64 slot rather than evict it.
        assert_eq!(slots.find("b", 8), Some(1));
        let b = admit(&mut slots, "b");
        slots.release(b);
        // Both idle, b used last: c evicts a from the smaller slot, which also is the LRU.
        assert_eq!(slots.find("c", 8), Some(a));
        let again = admit(&mut slots, "a");
        slots.release(again);
        // Now b is the least recently used, yet the smaller slot (a's) goes first.
        assert_eq!(slots.find("c", 8), Some(a));
        assert_eq!(slots.find("d", 64), Some(b));
    }
}
