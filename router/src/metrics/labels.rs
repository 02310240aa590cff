//! Per-adapter label values with bounded cardinality: the base model is labelled with its own
//! name, the first `--metrics-max-adapter-labels` adapters seen with their ids, and every later
//! one as `other`, so a server that cycles through thousands of adapters keeps a fixed number of
//! series. An adapter keeps its label once given (even after unloading), so a series never
//! changes meaning.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// The label of adapters past the limit.
pub const OTHER: &str = "other";

#[derive(Debug)]
pub struct AdapterLabels {
    base: Arc<str>,
    other: Arc<str>,
    max: usize,
    given: Mutex<HashMap<String, Arc<str>>>,
}

impl Default for AdapterLabels {
    /// For schedulers built without a server around them (tests): the base is `base`.
    fn default() -> Self {
        Self::new("base", 0)
    }
}

impl AdapterLabels {
    pub fn new(base_model: &str, max_adapter_labels: usize) -> Self {
        Self {
            base: Arc::from(base_model),
            other: Arc::from(OTHER),
            max: max_adapter_labels,
            given: Mutex::new(HashMap::new()),
        }
    }

    /// The label for `adapter_id` ("" is the base model). Called once per request, not per token.
    pub fn label(&self, adapter_id: &str) -> Arc<str> {
        if adapter_id.is_empty() {
            return self.base.clone();
        }
        let mut given = self.given.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(label) = given.get(adapter_id) {
            return label.clone();
        }
        if given.len() >= self.max {
            return self.other.clone();
        }
        let label: Arc<str> = Arc::from(adapter_id);
        given.insert(adapter_id.to_owned(), label.clone());
        label
    }
}

/// One child series per label value (a histogram or counter), found under a short lock once
/// per request; the child itself is then updated without locking.
#[derive(Debug)]
pub struct Family<T> {
    children: Mutex<Vec<(Arc<str>, Arc<T>)>>,
    make: fn() -> T,
}

impl<T> Family<T> {
    pub fn new(make: fn() -> T) -> Self {
        Self {
            children: Mutex::new(Vec::new()),
            make,
        }
    }

    pub fn get(&self, label: &Arc<str>) -> Arc<T> {
        let mut children = self.children.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, child)) = children.iter().find(|(l, _)| l == label) {
            return child.clone();
        }
        let child = Arc::new((self.make)());
        children.push((label.clone(), child.clone()));
        child
    }

    /// Every child with its label, sorted by label (a stable exposition order).
    pub fn snapshot(&self) -> Vec<(Arc<str>, Arc<T>)> {
        let mut children = self
            .children
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        children.sort_by(|a, b| a.0.cmp(&b.0));
        children
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adapters_past_the_limit_share_the_other_label() {
        let labels = AdapterLabels::new("base-model", 2);
        assert_eq!(&*labels.label(""), "base-model");
        assert_eq!(&*labels.label("a"), "a");
        assert_eq!(&*labels.label("b"), "b");
        assert_eq!(&*labels.label("c"), OTHER);
        // Labels given stay given; the base model never takes a place.
        assert_eq!(&*labels.label("a"), "a");
        assert_eq!(&*labels.label(""), "base-model");
    }

    #[test]
    fn a_zero_limit_labels_every_adapter_other() {
        let labels = AdapterLabels::new("m", 0);
        assert_eq!(&*labels.label("a"), OTHER);
    }

    #[test]
    fn a_family_hands_out_one_child_per_label() {
        let family = Family::new(|| std::sync::atomic::AtomicU64::new(0));
        let a: Arc<str> = Arc::from("a");
        family
            .get(&a)
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        family
            .get(&a)
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        family.get(&Arc::from("b"));
        let snapshot = family.snapshot();
        assert_eq!(snapshot.len(), 2);
        assert_eq!(snapshot[0].1.load(std::sync::atomic::Ordering::Relaxed), 2);
    }
}
