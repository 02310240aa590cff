//! The shard's adapter device slots as the router tracks them: which adapter each slot holds,
//! how many requests use it, and which adapter is waiting for it.
//!
//! Rules (the batcher applies them between steps, so no slot changes under a running request):
//! - An adapter already in a slot runs there.
//! - Otherwise it takes a slot no request uses: one reserved for it, else an empty one, else the
//!   one whose adapter was used least recently (LRU eviction, only ever of idle adapters).
//! - If every slot is busy, the adapter waits; the batcher then reserves a busy slot for it
//!   (`reserve`, least recently used first): the slot's adapter gets no new requests, its
//!   running ones finish, and the slot goes to the waiting adapter. Without that, an adapter
//!   with a steady stream of requests would keep its slot busy forever and starve the others.
//!
//! - A slot being filled (`begin_activation` .. `activation_done`) takes no requests, is no
//!   eviction or reservation victim and cannot be unloaded: its copy runs beside the steps.
//!
//! Pure bookkeeping, no I/O: the batcher calls ActivateAdapter for the slots it begins to fill.

use std::collections::HashMap;

#[derive(Debug, Default)]
struct Slot {
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
}

impl AdapterSlots {
    pub(super) fn new(count: u32) -> Self {
        Self {
            slots: (0..count).map(|_| Slot::default()).collect(),
            by_adapter: HashMap::new(),
            clock: 0,
        }
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

    /// The slot `adapter` can run in now, if any (see the module rules). Changes nothing.
    pub(super) fn find(&self, adapter: &str) -> Option<usize> {
        if let Some(&slot) = self.by_adapter.get(adapter) {
            let reserved = self.slots[slot].reserved_for.as_deref();
            // Draining for another adapter: no new requests here.
            return reserved.is_none_or(|r| r == adapter).then_some(slot);
        }
        let mut best: Option<(usize, (u8, u64))> = None;
        for (index, slot) in self.slots.iter().enumerate() {
            if slot.users > 0 || slot.activating {
                continue;
            }
            let preference = match slot.reserved_for.as_deref() {
                Some(r) if r == adapter => 0,
                Some(_) => continue,
                None if slot.adapter.is_none() => 1,
                None => 2,
            };
            let rank = (preference, slot.last_used);
            if best.is_none_or(|(_, best_rank)| rank < best_rank) {
                best = Some((index, rank));
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

    /// For each adapter in `waiting` (in service order) that holds no slot and has no
    /// reservation, reserves the least recently used unreserved slot, while there is one.
    pub(super) fn reserve(&mut self, waiting: &[String]) {
        for adapter in waiting {
            let reserved = self
                .slots
                .iter()
                .any(|s| s.reserved_for.as_deref() == Some(adapter.as_str()));
            if reserved || self.by_adapter.contains_key(adapter) {
                continue;
            }
            let victim = self
                .slots
                .iter_mut()
                .filter(|s| s.reserved_for.is_none() && !s.activating)
                .min_by_key(|s| s.last_used);
            let Some(victim) = victim else {
                return;
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

    /// Claims a slot for one request of `adapter`, as the batcher does.
    fn admit(slots: &mut AdapterSlots, adapter: &str) -> usize {
        let slot = slots.find(adapter).expect("a slot");
        slots.claim(slot, adapter);
        slot
    }

    #[test]
    fn empty_slots_first_then_the_same_slot_for_the_same_adapter() {
        let mut slots = AdapterSlots::new(2);
        assert_eq!(slots.find("a"), Some(0));
        assert_eq!(slots.claim(0, "a"), Some(None));
        assert_eq!(slots.find("a"), Some(0));
        assert_eq!(slots.claim(0, "a"), None);
        assert_eq!(slots.find("b"), Some(1));
        assert_eq!(slots.claim(1, "b"), Some(None));
        assert_eq!(slots.users_of("a"), 2);
        assert_eq!(slots.active_count(), 2);
        // Both busy: c must wait.
        assert_eq!(slots.find("c"), None);
    }

    #[test]
    fn eviction_takes_the_least_recently_used_idle_adapter() {
        let mut slots = AdapterSlots::new(3);
        let a = admit(&mut slots, "a");
        let b = admit(&mut slots, "b");
        let c = admit(&mut slots, "c");
        slots.release(a);
        slots.release(b);
        // a was used again after b finished: b is the least recently used idle one.
        let again = admit(&mut slots, "a");
        slots.release(again);
        assert_eq!(slots.find("d"), Some(b));
        assert_eq!(slots.claim(b, "d"), Some(Some("b".to_string())));
        assert_eq!(slots.users_of("b"), 0);
        // c is busy and never evicted; a is the only idle one now.
        assert_eq!(slots.find("e"), Some(a));
        slots.release(c);
        assert_eq!(slots.find("e"), Some(a), "a went idle before c");
    }

    #[test]
    fn a_reserved_slot_drains_and_goes_to_its_waiter() {
        let mut slots = AdapterSlots::new(2);
        let a = admit(&mut slots, "a");
        let b = admit(&mut slots, "b");
        assert_eq!(slots.find("c"), None);
        slots.reserve(&["c".to_string(), "d".to_string(), "e".to_string()]);
        // a is the older holder: reserved for c; b for d; e finds nothing left to reserve.
        assert_eq!(slots.find("a"), None, "a drains for c");
        assert_eq!(slots.find("b"), None, "b drains for d");
        slots.release(b);
        // b's slot is idle but reserved for d: neither c nor e may take it.
        assert_eq!(slots.find("c"), None);
        assert_eq!(slots.find("e"), None);
        assert_eq!(slots.find("d"), Some(b));
        slots.release(a);
        assert_eq!(slots.find("c"), Some(a));
        assert_eq!(slots.claim(a, "c"), Some(Some("a".to_string())));
        assert_eq!(slots.claim(b, "d"), Some(Some("b".to_string())));
        // Reservations are fulfilled: c and d keep admitting.
        assert_eq!((slots.find("c"), slots.find("d")), (Some(a), Some(b)));
    }

    #[test]
    fn reservations_of_adapters_that_left_are_dropped() {
        let mut slots = AdapterSlots::new(1);
        admit(&mut slots, "a");
        slots.reserve(&["b".to_string()]);
        assert_eq!(slots.find("a"), None);
        // A holder does not reserve a second slot for itself, nor does a waiter reserve twice.
        slots.reserve(&["a".to_string(), "b".to_string()]);
        slots.drop_reservations_unless(|adapter| adapter != "b");
        assert_eq!(slots.find("a"), Some(0));
    }

    #[test]
    fn a_failed_activation_empties_the_slot() {
        let mut slots = AdapterSlots::new(1);
        let slot = admit(&mut slots, "a");
        admit(&mut slots, "a");
        slots.activation_failed(slot);
        assert_eq!((slots.active_count(), slots.users_of("a")), (0, 0));
        assert_eq!(slots.find("b"), Some(slot));
        assert_eq!(slots.claim(slot, "b"), Some(None));
    }

    #[test]
    fn a_slot_being_filled_takes_no_requests_and_is_nobodys_victim() {
        let mut slots = AdapterSlots::new(2);
        assert_eq!(slots.find("a"), Some(0));
        assert_eq!(slots.begin_activation(0, "a"), None);
        assert!(slots.is_activating("a"));
        assert_eq!(slots.activating_count(), 1);
        // b gets the other slot, c none: a's slot is neither free nor evictable yet.
        assert_eq!(slots.find("b"), Some(1));
        assert_eq!(slots.begin_activation(1, "b"), None);
        assert_eq!(slots.find("c"), None);
        slots.reserve(&["c".to_string()]);
        assert!(!slots.evict("a"), "no unload while a's weights are copied");
        slots.activation_done(0);
        assert!(!slots.is_activating("a"));
        assert_eq!(slots.claim(0, "a"), None, "a is in its slot already");
        slots.release(0);
        // Nothing was reserved for c while both slots were being filled; now the least
        // recently used idle adapter, b (filled before a was used), makes room for it.
        slots.activation_done(1);
        assert_eq!(slots.find("c"), Some(1));
        assert_eq!(slots.begin_activation(1, "c"), Some("b".to_string()));
        slots.activation_failed(1);
        assert_eq!((slots.active_count(), slots.activating_count()), (1, 0));
        assert_eq!(slots.find("c"), Some(1));
    }

    #[test]
    fn evict_waits_for_the_last_user() {
        let mut slots = AdapterSlots::new(2);
        let slot = admit(&mut slots, "a");
        slots.reserve(&["x".to_string()]);
        assert!(!slots.evict("a"));
        slots.release(slot);
        assert!(slots.evict("a"));
        assert_eq!(slots.active_count(), 0);
        assert!(slots.evict("never-seen"));
    }
}
