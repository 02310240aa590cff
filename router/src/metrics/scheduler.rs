//! What the batching loop observes: queue wait, batch sizes, adapter slot activations and
//! evictions, and the adapters on the device and waiting (for the GIE LoRA info gauge).
//! Written by the loop between shard steps, read at scrape time.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::histogram::{self, Histogram};
use super::labels::{AdapterLabels, Family};
use super::text;

/// The adapters the endpoint picker sees: on the device, and with requests waiting.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LoraState {
    /// Adapters holding a device slot, sorted.
    pub running: Vec<String>,
    /// Adapters with queued requests, sorted.
    pub waiting: Vec<String>,
    /// Unix time (seconds) the lists last changed.
    pub updated: f64,
}

#[derive(Debug)]
pub struct SchedulerMetrics {
    pub labels: Arc<AdapterLabels>,
    queue_wait: Family<Histogram>,
    prefill_batch: Histogram,
    decode_batch: Histogram,
    activations: Family<AtomicU64>,
    evictions: Family<AtomicU64>,
    activation_seconds: Histogram,
    /// Activations whose weights the shard found in its host-memory cache, and those it read
    /// from disk again.
    host_cache_hits: AtomicU64,
    host_cache_misses: AtomicU64,
    /// PrefetchAdapter calls for adapters waiting for a slot, and those that read from disk.
    prefetches: AtomicU64,
    prefetch_reads: AtomicU64,
    lora: Mutex<LoraState>,
}

impl Default for SchedulerMetrics {
    fn default() -> Self {
        Self::new(Arc::new(AdapterLabels::default()))
    }
}

impl SchedulerMetrics {
    pub fn new(labels: Arc<AdapterLabels>) -> Self {
        Self {
            labels,
            queue_wait: Family::new(|| Histogram::new(histogram::LATENCY_SECONDS)),
            prefill_batch: Histogram::new(histogram::BATCH_SIZE),
            decode_batch: Histogram::new(histogram::BATCH_SIZE),
            activations: Family::new(|| AtomicU64::new(0)),
            evictions: Family::new(|| AtomicU64::new(0)),
            activation_seconds: Histogram::new(histogram::LATENCY_SECONDS),
            host_cache_hits: AtomicU64::new(0),
            host_cache_misses: AtomicU64::new(0),
            prefetches: AtomicU64::new(0),
            prefetch_reads: AtomicU64::new(0),
            lora: Mutex::new(LoraState::default()),
        }
    }

    /// A request left the queue for its first prefill (not a resumed one: one wait a request).
    pub fn queue_wait(&self, adapter_id: &str, waited: Duration) {
        let label = self.labels.label(adapter_id);
        self.queue_wait.get(&label).observe(waited.as_secs_f64());
    }

    pub fn prefill_batch(&self, requests: usize) {
        self.prefill_batch.observe(requests as f64);
    }

    pub fn decode_batch(&self, requests: usize) {
        self.decode_batch.observe(requests as f64);
    }

    /// An adapter was copied into a device slot, replacing `evicted` if the slot held one; the
    /// shard found its weights in host memory (`host_cache_hit`) or read them from disk.
    pub fn activated(
        &self,
        adapter_id: &str,
        evicted: Option<&str>,
        took: Duration,
        host_cache_hit: bool,
    ) {
        let host = if host_cache_hit {
            &self.host_cache_hits
        } else {
            &self.host_cache_misses
        };
        host.fetch_add(1, Ordering::Relaxed);
        let label = self.labels.label(adapter_id);
        self.activations.get(&label).fetch_add(1, Ordering::Relaxed);
        if let Some(evicted) = evicted {
            let label = self.labels.label(evicted);
            self.evictions.get(&label).fetch_add(1, Ordering::Relaxed);
        }
        self.activation_seconds.observe(took.as_secs_f64());
    }

    /// The shards warmed the host copy of an adapter waiting for a slot; they read it from
    /// disk unless it was in host memory already (`host_cache_hit`).
    pub fn prefetched(&self, host_cache_hit: bool) {
        self.prefetches.fetch_add(1, Ordering::Relaxed);
        if !host_cache_hit {
            self.prefetch_reads.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The adapters on the device and waiting now; the timestamp moves only when they change.
    pub fn publish_lora(&self, mut running: Vec<String>, mut waiting: Vec<String>) {
        running.sort_unstable();
        waiting.sort_unstable();
        let mut lora = self.lora.lock().unwrap_or_else(|e| e.into_inner());
        if lora.updated > 0.0 && lora.running == running && lora.waiting == waiting {
            return;
        }
        *lora = LoraState {
            running,
            waiting,
            updated: unix_seconds(),
        };
    }

    pub fn lora(&self) -> LoraState {
        let lora = self.lora.lock().unwrap_or_else(|e| e.into_inner());
        if lora.updated > 0.0 {
            return lora.clone();
        }
        // Nothing published yet (no step ran): empty lists, as of now.
        LoraState {
            updated: unix_seconds(),
            ..LoraState::default()
        }
    }

    pub fn render(&self, out: &mut String) {
        let name = "quiver_request_queue_seconds";
        text::header(
            out,
            name,
            "histogram",
            "Time a request waited in the queue before its first prefill.",
        );
        for (label, histogram) in self.queue_wait.snapshot() {
            histogram.render(out, name, &[("adapter", &label)]);
        }
        let name = "quiver_batch_size";
        text::header(
            out,
            name,
            "histogram",
            "Requests in one shard step, by step kind (prefill of new requests, decode of the \
             running batch).",
        );
        self.prefill_batch.render(out, name, &[("step", "prefill")]);
        self.decode_batch.render(out, name, &[("step", "decode")]);
        let counters = [
            (
                "quiver_adapter_activations_total",
                "Adapters copied into a device slot (a slot miss), by adapter.",
                &self.activations,
            ),
            (
                "quiver_adapter_evictions_total",
                "Adapters replaced in their device slot by another, by the adapter evicted.",
                &self.evictions,
            ),
        ];
        for (name, help, family) in counters {
            text::header(out, name, "counter", help);
            for (label, count) in family.snapshot() {
                text::sample(
                    out,
                    name,
                    &[("adapter", &label)],
                    count.load(Ordering::Relaxed),
                );
            }
        }
        let name = "quiver_adapter_activation_seconds";
        text::header(
            out,
            name,
            "histogram",
            "Time to copy an adapter into a device slot, from the router's ActivateAdapter to the \
             shard's answer (the copy runs beside the steps).",
        );
        self.activation_seconds.render(out, name, &[]);
        text::single(
            out,
            "quiver_adapter_host_cache_hits_total",
            "counter",
            "Adapter activations whose weights were in the shard's host-memory cache.",
            self.host_cache_hits.load(Ordering::Relaxed),
        );
        text::single(
            out,
            "quiver_adapter_host_cache_misses_total",
            "counter",
            "Adapter activations that read the weights from disk again (evicted from host \
             memory by --max-cpu-adapters).",
            self.host_cache_misses.load(Ordering::Relaxed),
        );
        text::single(
            out,
            "quiver_adapter_prefetches_total",
            "counter",
            "Host copies of adapters waiting for a device slot that the shards were asked to warm.",
            self.prefetches.load(Ordering::Relaxed),
        );
        text::single(
            out,
            "quiver_adapter_prefetch_reads_total",
            "counter",
            "Prefetches that read the adapter from disk (it was not in host memory).",
            self.prefetch_reads.load(Ordering::Relaxed),
        );
    }
}

pub fn unix_seconds() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |elapsed| elapsed.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lora_timestamp_moves_only_when_the_adapters_change() {
        let metrics = SchedulerMetrics::default();
        metrics.publish_lora(vec!["b".into(), "a".into()], vec![]);
        let first = metrics.lora();
        assert_eq!(first.running, ["a", "b"]);
        metrics.publish_lora(vec!["a".into(), "b".into()], vec![]);
        assert_eq!(metrics.lora().updated, first.updated);
        metrics.publish_lora(vec!["a".into()], vec!["c".into()]);
        let changed = metrics.lora();
        assert_eq!(changed.waiting, ["c"]);
        assert!(changed.updated >= first.updated);
    }

    #[test]
    fn an_eviction_is_counted_against_the_adapter_evicted() {
        let metrics = SchedulerMetrics::new(Arc::new(AdapterLabels::new("m", 4)));
        metrics.activated("a", None, Duration::from_millis(2), true);
        metrics.activated("b", Some("a"), Duration::from_millis(2), false);
        let mut out = String::new();
        metrics.render(&mut out);
        assert!(out.contains("quiver_adapter_activations_total{adapter=\"a\"} 1\n"));
        assert!(out.contains("quiver_adapter_activations_total{adapter=\"b\"} 1\n"));
        assert!(out.contains("quiver_adapter_evictions_total{adapter=\"a\"} 1\n"));
        assert!(out.contains("quiver_adapter_activation_seconds_count 2\n"));
        assert!(out.contains("quiver_adapter_host_cache_hits_total 1\n"));
        assert!(out.contains("quiver_adapter_host_cache_misses_total 1\n"));
        metrics.prefetched(true);
        metrics.prefetched(false);
        let mut out = String::new();
        metrics.render(&mut out);
        assert!(out.contains("quiver_adapter_prefetches_total 2\n"));
        assert!(out.contains("quiver_adapter_prefetch_reads_total 1\n"));
    }
}
