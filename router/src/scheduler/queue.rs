//! The waiting queue: admitted requests that have no KV blocks yet.
//!
//! The queue decides only the *order* in which waiting requests are offered to the batcher;
//! the batcher's `admit` callback decides whether each one fits (token budget, batch size,
//! free blocks). Today the order is arrival (FIFO). Per-adapter scheduling replaces the single
//! deque with one deque per adapter and a round-robin cursor over them inside `next_batch`;
//! the batcher, which sees only `push`/`retain`/`next_batch`, does not change.
//!
//! Generic over the entry type so it is tested here with plain values.

use std::collections::VecDeque;

#[derive(Debug)]
pub struct Queue<T> {
    entries: VecDeque<T>,
}

impl<T> Default for Queue<T> {
    fn default() -> Self {
        Self {
            entries: VecDeque::new(),
        }
    }
}

impl<T> Queue<T> {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn push(&mut self, entry: T) {
        self.entries.push_back(entry);
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Drops the entries for which `keep` is false (e.g. requests whose client left).
    pub fn retain(&mut self, keep: impl FnMut(&T) -> bool) {
        self.entries.retain(keep);
    }

    /// Removes and returns entries in service order while `admit` accepts them, each with what
    /// `admit` returned for it (e.g. its KV blocks).
    ///
    /// Stops at the first entry `admit` refuses: the entry at the head is never overtaken by
    /// smaller ones behind it, so a large request cannot starve.
    pub fn next_batch<A>(&mut self, mut admit: impl FnMut(&T) -> Option<A>) -> Vec<(T, A)> {
        let mut batch = Vec::new();
        while let Some(entry) = self.entries.front() {
            let Some(admitted) = admit(entry) else {
                break;
            };
            if let Some(entry) = self.entries.pop_front() {
                batch.push((entry, admitted));
            }
        }
        batch
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offers_entries_in_arrival_order() {
        let mut queue = Queue::new();
        for i in 0..5 {
            queue.push(i);
        }
        let batch = queue.next_batch(|&i| Some(i * 10));
        assert_eq!(batch, vec![(0, 0), (1, 10), (2, 20), (3, 30), (4, 40)]);
        assert!(queue.is_empty());
    }

    #[test]
    fn stops_at_first_refusal_without_skipping() {
        let mut queue = Queue::new();
        for size in [3, 4, 9, 1, 1] {
            queue.push(size);
        }
        // A budget of 10: 3 + 4 fit, 9 does not; the 1s behind it must wait their turn.
        let mut budget = 10;
        let batch = queue.next_batch(|&size| {
            (size <= budget).then(|| {
                budget -= size;
            })
        });
        assert_eq!(
            batch.iter().map(|(s, _)| *s).collect::<Vec<_>>(),
            vec![3, 4]
        );
        assert_eq!(queue.len(), 3);
        let rest = queue.next_batch(|_| Some(()));
        assert_eq!(
            rest.iter().map(|(s, _)| *s).collect::<Vec<_>>(),
            vec![9, 1, 1]
        );
    }

    #[test]
    fn refusing_everything_leaves_the_queue_intact() {
        let mut queue = Queue::new();
        queue.push("a");
        queue.push("b");
        assert!(queue.next_batch(|_| None::<()>).is_empty());
        assert_eq!(queue.len(), 2);
    }

    #[test]
    fn retain_drops_cancelled_entries_and_keeps_order() {
        let mut queue = Queue::new();
        for i in 0..6 {
            queue.push(i);
        }
        queue.retain(|i| i % 2 == 0);
        let batch = queue.next_batch(|_| Some(()));
        assert_eq!(
            batch.iter().map(|(i, _)| *i).collect::<Vec<_>>(),
            vec![0, 2, 4]
        );
    }
}
