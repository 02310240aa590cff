//! The waiting queue: admitted requests that are not prefilled yet, one queue per adapter (the
//! base model is the adapter ""), and inside it one FIFO per tenant.
//!
//! The queue decides only the *order* in which waiting requests are offered to the batcher;
//! the batcher's `admit` callback decides whether each one goes in now (token budget, batch
//! size, free blocks, an adapter slot). Order: round robin over the adapters that have waiting
//! requests, one request per turn, so a burst on one adapter is interleaved with every other
//! adapter's requests instead of running ahead of them. An adapter that was just served goes
//! to the back of the ring; an adapter that had to wait keeps its place and is offered first
//! next time. Inside an adapter's turn the tenants with waiting requests take turns the same
//! way, so one tenant's burst cannot hold back another tenant's requests on the same adapter.
//!
//! Generic over the entry type so it is tested here with plain values.

use std::collections::{HashMap, VecDeque};

/// What a queued entry must tell the queue: the adapter it runs on, its tenant, and whether it
/// will decode once prefilled (an embedding does not: prefill pacing does not hold back for
/// it).
pub trait Keyed {
    fn key(&self) -> &str;

    /// Whose turn it takes inside its adapter's queue ("" without API keys).
    fn tenant(&self) -> &str {
        ""
    }

    fn decodes(&self) -> bool {
        true
    }
}

/// The batcher's answer about the entry at the head of one adapter's queue.
#[derive(Debug, PartialEq, Eq)]
pub enum Admit<A> {
    /// Take it, with this (e.g. its KV blocks).
    Take(A),
    /// Its adapter cannot run now (no device slot): leave its queue alone, go on with the
    /// other adapters.
    Skip,
    /// Nothing more fits in this batch (blocks, batch size, token budget). Stopping rather than
    /// passing over the head keeps a large request from being overtaken forever.
    Stop,
}

/// One adapter's waiting entries: a FIFO per tenant, the tenants taking turns.
#[derive(Debug)]
struct TenantQueues<T> {
    fifos: HashMap<String, VecDeque<T>>,
    /// Tenants with waiting entries, in service order (front = offered first).
    ring: VecDeque<String>,
}

impl<T: Keyed> TenantQueues<T> {
    fn new() -> Self {
        Self {
            fifos: HashMap::new(),
            ring: VecDeque::new(),
        }
    }

    fn push(&mut self, entry: T) {
        if let Some(fifo) = self.fifos.get_mut(entry.tenant()) {
            fifo.push_back(entry);
        } else {
            let tenant = entry.tenant().to_owned();
            self.ring.push_back(tenant.clone());
            self.fifos.insert(tenant, VecDeque::from([entry]));
        }
    }

    fn is_empty(&self) -> bool {
        self.ring.is_empty()
    }

    /// The entry offered next: the oldest of the tenant whose turn it is.
    fn head(&self) -> Option<&T> {
        self.fifos.get(self.ring.front()?)?.front()
    }

    /// Removes the head; its tenant goes to the back of the ring if it has more waiting.
    fn pop_head(&mut self) -> Option<T> {
        let tenant = self.ring.pop_front()?;
        let fifo = self.fifos.get_mut(&tenant)?;
        let entry = fifo.pop_front();
        if fifo.is_empty() {
            self.fifos.remove(&tenant);
        } else {
            self.ring.push_back(tenant);
        }
        entry
    }

    fn entries(&self) -> impl Iterator<Item = &T> {
        self.fifos.values().flatten()
    }

    fn retain(&mut self, keep: &mut impl FnMut(&T) -> bool) {
        for fifo in self.fifos.values_mut() {
            fifo.retain(&mut *keep);
        }
        self.fifos.retain(|_, fifo| !fifo.is_empty());
        let fifos = &self.fifos;
        self.ring.retain(|tenant| fifos.contains_key(tenant));
    }

    /// Every entry, in the order they would have been offered.
    fn drain(mut self) -> Vec<T> {
        let mut entries = Vec::new();
        while let Some(entry) = self.pop_head() {
            entries.push(entry);
        }
        entries
    }
}

#[derive(Debug)]
pub struct Queue<T> {
    queues: HashMap<String, TenantQueues<T>>,
    /// Adapters with waiting entries, in service order (front = offered first).
    ring: VecDeque<String>,
    len: usize,
    /// Entries that will decode (`Keyed::decodes`).
    decoding_len: usize,
}

impl<T> Default for Queue<T> {
    fn default() -> Self {
        Self {
            queues: HashMap::new(),
            ring: VecDeque::new(),
            len: 0,
            decoding_len: 0,
        }
    }
}

impl<T: Keyed> Queue<T> {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn push(&mut self, entry: T) {
        self.decoding_len += usize::from(entry.decodes());
        if let Some(queue) = self.queues.get_mut(entry.key()) {
            queue.push(entry);
        } else {
            let key = entry.key().to_owned();
            self.ring.push_back(key.clone());
            let mut queue = TenantQueues::new();
            queue.push(entry);
            self.queues.insert(key, queue);
        }
        self.len += 1;
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Waiting entries that will decode once prefilled.
    pub fn decoding_len(&self) -> usize {
        self.decoding_len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The keys with waiting entries.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.queues.keys().map(String::as_str)
    }

    /// Whether `key` has waiting entries.
    pub fn has_waiting(&self, key: &str) -> bool {
        self.queues.contains_key(key)
    }

    /// The waiting entries of `key` (in no particular order).
    pub fn waiting(&self, key: &str) -> impl Iterator<Item = &T> {
        self.queues
            .get(key)
            .into_iter()
            .flat_map(TenantQueues::entries)
    }

    /// Drops the entries for which `keep` is false (e.g. requests whose client left).
    pub fn retain(&mut self, mut keep: impl FnMut(&T) -> bool) {
        for queue in self.queues.values_mut() {
            queue.retain(&mut keep);
        }
        self.queues.retain(|_, queue| !queue.is_empty());
        let queues = &self.queues;
        self.ring.retain(|key| queues.contains_key(key));
        let entries = || self.queues.values().flat_map(TenantQueues::entries);
        self.len = entries().count();
        self.decoding_len = entries().filter(|e| e.decodes()).count();
    }

    /// Removes and returns every entry of `key`, in the order they would have been offered.
    pub fn take_all(&mut self, key: &str) -> Vec<T> {
        let Some(queue) = self.queues.remove(key) else {
            return Vec::new();
        };
        self.ring.retain(|k| k != key);
        let entries = queue.drain();
        self.len -= entries.len();
        self.decoding_len -= entries.iter().filter(|e| e.decodes()).count();
        entries
    }

    /// Offers the heads of the adapters' queues in round-robin order and removes those `admit`
    /// takes, each with what `admit` returned for it. An adapter `admit` skips is not offered
    /// again in this call; `Stop` ends the call.
    pub fn next_batch<A>(&mut self, mut admit: impl FnMut(&T) -> Admit<A>) -> Vec<(T, A)> {
        let mut batch = Vec::new();
        // Ring positions before `position` hold adapters skipped in this call.
        let mut position = 0;
        while position < self.ring.len() {
            let key = &self.ring[position];
            let Some(queue) = self.queues.get_mut(key) else {
                // Unreachable: the ring lists only adapters with a queue.
                self.ring.remove(position);
                continue;
            };
            let Some(head) = queue.head() else {
                self.ring.remove(position);
                continue;
            };
            match admit(head) {
                Admit::Take(admitted) => {
                    if let Some(entry) = queue.pop_head() {
                        self.len -= 1;
                        self.decoding_len -= usize::from(entry.decodes());
                        batch.push((entry, admitted));
                    }
                    let served = self.ring.remove(position);
                    if let Some(served) = served {
                        if self.queues.get(&served).is_some_and(|q| !q.is_empty()) {
                            self.ring.push_back(served);
                        } else {
                            self.queues.remove(&served);
                        }
                    }
                }
                Admit::Skip => position += 1,
                Admit::Stop => break,
            }
        }
        batch
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (adapter, value)
    type Item = (&'static str, u32);

    impl Keyed for Item {
        fn key(&self) -> &str {
            self.0
        }
    }

    fn values(batch: &[(Item, ())]) -> Vec<Item> {
        batch.iter().map(|(item, _)| *item).collect()
    }

    fn take_all(queue: &mut Queue<Item>) -> Vec<Item> {
        values(&queue.next_batch(|_| Admit::Take(())))
    }

    #[test]
    fn one_adapter_is_served_in_arrival_order() {
        let mut queue = Queue::new();
        for i in 0..5 {
            queue.push(("", i));
        }
        let batch = queue.next_batch(|&(_, i)| Admit::Take(i * 10));
        let got: Vec<(u32, u32)> = batch.iter().map(|((_, i), a)| (*i, *a)).collect();
        assert_eq!(got, vec![(0, 0), (1, 10), (2, 20), (3, 30), (4, 40)]);
        assert!(queue.is_empty());
    }

    #[test]
    fn adapters_take_turns_one_request_each() {
        let mut queue = Queue::new();
        for i in 0..4 {
            queue.push(("a", i));
        }
        queue.push(("b", 0));
        queue.push(("", 0));
        queue.push(("b", 1));
        assert_eq!(queue.len(), 7);
        assert_eq!(
            take_all(&mut queue),
            vec![
                ("a", 0),
                ("b", 0),
                ("", 0),
                ("a", 1),
                ("b", 1),
                ("a", 2),
                ("a", 3)
            ]
        );
        assert!(queue.is_empty() && !queue.has_waiting("a"));
    }

    #[test]
    fn a_burst_does_not_hold_back_a_later_adapter_across_batches() {
        let mut queue = Queue::new();
        for i in 0..50 {
            queue.push(("a", i));
        }
        queue.push(("b", 0));
        // Two requests per batch: b goes in the first one.
        let mut budget = 2;
        let first = queue.next_batch(|_| {
            if budget == 0 {
                return Admit::Stop;
            }
            budget -= 1;
            Admit::Take(())
        });
        assert_eq!(values(&first), vec![("a", 0), ("b", 0)]);
        assert_eq!(queue.len(), 49);
    }

    #[test]
    fn the_served_adapter_goes_last_in_the_next_batch() {
        let mut queue = Queue::new();
        for i in 0..3 {
            queue.push(("a", i));
            queue.push(("b", i));
        }
        let one = |queue: &mut Queue<Item>| {
            let mut taken = false;
            values(&queue.next_batch(|_| {
                if taken {
                    return Admit::Stop;
                }
                taken = true;
                Admit::Take(())
            }))
        };
        assert_eq!(one(&mut queue), vec![("a", 0)]);
        assert_eq!(one(&mut queue), vec![("b", 0)]);
        assert_eq!(one(&mut queue), vec![("a", 1)]);
        queue.push(("c", 0));
        assert_eq!(
            take_all(&mut queue),
            vec![("b", 1), ("a", 2), ("c", 0), ("b", 2)]
        );
    }

    #[test]
    fn a_skipped_adapter_waits_while_others_go_and_keeps_its_turn() {
        let mut queue = Queue::new();
        queue.push(("x", 0));
        queue.push(("x", 1));
        queue.push(("y", 0));
        queue.push(("y", 1));
        let batch = queue.next_batch(|&(key, _)| {
            if key == "x" {
                Admit::Skip
            } else {
                Admit::Take(())
            }
        });
        assert_eq!(values(&batch), vec![("y", 0), ("y", 1)]);
        queue.push(("y", 2));
        // x waited, so it comes before y now.
        assert_eq!(take_all(&mut queue), vec![("x", 0), ("y", 2), ("x", 1)]);
    }

    #[test]
    fn stop_leaves_the_head_in_place_without_skipping_it() {
        let mut queue = Queue::new();
        for size in [3, 4, 9, 1, 1] {
            queue.push(("", size));
        }
        // A budget of 10: 3 + 4 fit, 9 does not; the 1s behind it must wait their turn.
        let mut budget = 10;
        let batch = queue.next_batch(|&(_, size)| {
            if size > budget {
                return Admit::Stop;
            }
            budget -= size;
            Admit::Take(())
        });
        assert_eq!(values(&batch), vec![("", 3), ("", 4)]);
        assert_eq!(queue.len(), 3);
        assert_eq!(take_all(&mut queue), vec![("", 9), ("", 1), ("", 1)]);
    }

    #[test]
    fn refusing_everything_leaves_the_queue_intact() {
        let mut queue = Queue::new();
        queue.push(("a", 0));
        queue.push(("b", 0));
        assert!(queue.next_batch(|_| Admit::<()>::Skip).is_empty());
        assert!(queue.next_batch(|_| Admit::<()>::Stop).is_empty());
        assert_eq!(queue.len(), 2);
        assert_eq!(take_all(&mut queue), vec![("a", 0), ("b", 0)]);
    }

    #[test]
    fn retain_and_take_all_keep_counts_and_order() {
        let mut queue = Queue::new();
        for i in 0..6 {
            queue.push(("a", i));
            queue.push(("b", i));
        }
        queue.push(("c", 0));
        queue.retain(|&(key, i)| key != "c" && i % 2 == 0);
        assert_eq!(queue.len(), 6);
        assert!(!queue.has_waiting("c"));
        assert_eq!(queue.take_all("b"), vec![("b", 0), ("b", 2), ("b", 4)]);
        assert_eq!(queue.len(), 3);
        assert!(queue.take_all("b").is_empty());
        assert_eq!(take_all(&mut queue), vec![("a", 0), ("a", 2), ("a", 4)]);
    }

    /// (adapter, tenant, value)
    type Owned = (&'static str, &'static str, u32);

    impl Keyed for Owned {
        fn key(&self) -> &str {
            self.0
        }

        fn tenant(&self) -> &str {
            self.1
        }
    }

    #[test]
    fn tenants_take_turns_inside_an_adapters_queue() {
        let mut queue = Queue::new();
        for i in 0..4 {
            queue.push(("", "big", i));
        }
        queue.push(("", "small", 0));
        queue.push(("a", "big", 0));
        queue.push(("", "small", 1));
        let order: Vec<Owned> = queue
            .next_batch(|_| Admit::Take(()))
            .into_iter()
            .map(|(entry, ())| entry)
            .collect();
        // Adapters alternate ("" then "a"); inside "", big and small alternate.
        assert_eq!(
            order,
            vec![
                ("", "big", 0),
                ("a", "big", 0),
                ("", "small", 0),
                ("", "big", 1),
                ("", "small", 1),
                ("", "big", 2),
                ("", "big", 3),
            ]
        );
    }

    #[test]
    fn a_tenant_whose_head_did_not_fit_keeps_its_turn() {
        let mut queue = Queue::new();
        queue.push(("", "big", 100));
        queue.push(("", "small", 1));
        queue.push(("", "big", 100));
        // Nothing of 100 fits: the call stops at big's head and small waits behind it, as a
        // head that does not fit is never overtaken.
        assert!(queue
            .next_batch(|&(_, _, size)| if size > 10 {
                Admit::<()>::Stop
            } else {
                Admit::Take(())
            })
            .is_empty());
        let one = queue.next_batch(|_| Admit::Take(()));
        let order: Vec<u32> = one.iter().map(|((_, _, size), ())| *size).collect();
        assert_eq!(order, vec![100, 1, 100]);
        // Dropped entries leave their tenant's turn with them.
        queue.push(("", "big", 1));
        queue.push(("", "small", 2));
        queue.push(("", "big", 3));
        queue.retain(|&(_, tenant, _)| tenant != "big");
        assert_eq!(
            (queue.len(), queue.take_all("")),
            (1, vec![("", "small", 2)])
        );
    }

    /// (adapter, decodes)
    struct Job(&'static str, bool);

    impl Keyed for Job {
        fn key(&self) -> &str {
            self.0
        }

        fn decodes(&self) -> bool {
            self.1
        }
    }

    #[test]
    fn entries_that_decode_are_counted_through_every_change() {
        let mut queue = Queue::new();
        for job in [
            Job("a", true),
            Job("a", false),
            Job("b", false),
            Job("b", true),
            Job("c", true),
        ] {
            queue.push(job);
        }
        assert_eq!((queue.len(), queue.decoding_len()), (5, 3));
        // Round robin: a's head (decodes), then b's head (does not).
        let taken = queue.next_batch(|job| {
            if job.0 == "c" {
                Admit::Stop
            } else {
                Admit::Take(())
            }
        });
        assert_eq!(taken.len(), 2);
        assert_eq!((queue.len(), queue.decoding_len()), (3, 2));
        queue.retain(|job| job.0 != "c");
        assert_eq!((queue.len(), queue.decoding_len()), (2, 1));
        assert_eq!(queue.take_all("b").len(), 1);
        assert_eq!((queue.len(), queue.decoding_len()), (1, 0));
    }
}
