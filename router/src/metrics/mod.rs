//! Prometheus metrics, rendered as text on `GET /metrics` (docs/observability.md lists them).
//!
//! Hand-written rather than a registry crate: everything on the decode path is an atomic or a
//! lock-free histogram (`histogram.rs`), per-adapter series are found once per request
//! (`labels.rs`), and the GIE gauges (`gie.rs`) need label sets that change with the load,
//! which registries model awkwardly.
//!
//! Families: the original load gauges and step counters (`quiver_*`, kept by name), HTTP
//! responses (`http.rs`), per-request latencies and lengths (`requests.rs`), what the
//! batching loop sees (`scheduler.rs`), adapter host-memory loads here, and the vLLM-named
//! gauges of the Gateway API Inference Extension's Model Server Protocol (`gie.rs`).

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

pub mod gie;
pub mod histogram;
pub mod http;
pub mod labels;
pub mod requests;
pub mod scheduler;
pub mod text;

use histogram::Histogram;
use labels::AdapterLabels;
use requests::RequestMetrics;
use scheduler::SchedulerMetrics;

#[derive(Debug)]
pub struct Metrics {
    pub kv_blocks_total: AtomicU64,
    pub kv_blocks_free: AtomicU64,
    pub requests_running: AtomicU64,
    pub requests_waiting: AtomicU64,
    pub requests_finished_total: AtomicU64,
    pub requests_failed_total: AtomicU64,
    pub prompt_tokens_total: AtomicU64,
    pub generated_tokens_total: AtomicU64,
    /// `/v1/embeddings` inputs embedded, and their tokens (also in `prompt_tokens_total`).
    pub embedding_inputs_total: AtomicU64,
    pub embedding_tokens_total: AtomicU64,
    pub prefill_steps_total: AtomicU64,
    pub decode_steps_total: AtomicU64,
    pub preemptions_total: AtomicU64,
    /// Prompt tokens looked up in the prefix cache, and those found there.
    pub prefix_cache_queries_total: AtomicU64,
    pub prefix_cache_hits_total: AtomicU64,
    pub adapters_active: AtomicU64,
    pub adapter_slots: AtomicU64,
    /// Steps with a grammar in the batch, and the shard's time computing and applying their
    /// token masks: rendered as the summary `quiver_grammar_mask_seconds` (sum and count).
    pub grammar_mask_steps: AtomicU64,
    pub grammar_mask_ns: AtomicU64,
    /// Tokens per KV block, for the GIE cache config gauge (set at scrape time).
    pub kv_block_size: AtomicU64,
    /// `LoadAdapter` on the shards: fetch (a hub download included) and load into host memory.
    pub adapter_load_seconds: Histogram,
    pub labels: Arc<AdapterLabels>,
    pub requests: RequestMetrics,
    pub http: http::HttpMetrics,
    /// Shared with the scheduler, which writes it.
    pub scheduler: Arc<SchedulerMetrics>,
    /// Bytes of model weights each rank holds, by rank (set once at start-up).
    shard_weight_bytes: std::sync::OnceLock<Vec<u64>>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new(Arc::new(SchedulerMetrics::default()))
    }
}

struct Series {
    name: &'static str,
    kind: &'static str,
    help: &'static str,
}

impl Metrics {
    /// Metrics whose adapter labels are the scheduler's, so both give an adapter one label.
    pub fn new(scheduler: Arc<SchedulerMetrics>) -> Self {
        let zero = || AtomicU64::new(0);
        Self {
            kv_blocks_total: zero(),
            kv_blocks_free: zero(),
            requests_running: zero(),
            requests_waiting: zero(),
            requests_finished_total: zero(),
            requests_failed_total: zero(),
            prompt_tokens_total: zero(),
            generated_tokens_total: zero(),
            embedding_inputs_total: zero(),
            embedding_tokens_total: zero(),
            prefill_steps_total: zero(),
            decode_steps_total: zero(),
            preemptions_total: zero(),
            prefix_cache_queries_total: zero(),
            prefix_cache_hits_total: zero(),
            adapters_active: zero(),
            adapter_slots: zero(),
            grammar_mask_steps: zero(),
            grammar_mask_ns: zero(),
            kv_block_size: zero(),
            adapter_load_seconds: Histogram::new(histogram::LATENCY_SECONDS),
            labels: scheduler.labels.clone(),
            requests: RequestMetrics::new(scheduler.labels.clone()),
            http: http::HttpMetrics::default(),
            scheduler,
            shard_weight_bytes: std::sync::OnceLock::new(),
        }
    }

    /// Each rank's weight bytes (`InfoResponse.weight_bytes`), by rank; the first call wins.
    pub fn set_shard_weight_bytes(&self, by_rank: Vec<u64>) {
        let _ = self.shard_weight_bytes.set(by_rank);
    }

    /// An adapter's `LoadAdapter` took `took`.
    pub fn adapter_loaded(&self, took: Duration) {
        self.adapter_load_seconds.observe(took.as_secs_f64());
    }

    pub fn set(gauge: &AtomicU64, value: u64) {
        gauge.store(value, Ordering::Relaxed);
    }

    pub fn add(counter: &AtomicU64, value: u64) {
        counter.fetch_add(value, Ordering::Relaxed);
    }

    fn series(&self) -> [(Series, &AtomicU64); 17] {
        let s = |name, kind, help| Series { name, kind, help };
        [
            (
                s(
                    "quiver_kv_blocks_total",
                    "gauge",
                    "KV-cache blocks the shard holds.",
                ),
                &self.kv_blocks_total,
            ),
            (
                s(
                    "quiver_kv_blocks_free",
                    "gauge",
                    "KV-cache blocks not reserved by any request.",
                ),
                &self.kv_blocks_free,
            ),
            (
                s(
                    "quiver_requests_running",
                    "gauge",
                    "Requests in the running batch.",
                ),
                &self.requests_running,
            ),
            (
                s(
                    "quiver_requests_waiting",
                    "gauge",
                    "Requests admitted but not yet prefilled.",
                ),
                &self.requests_waiting,
            ),
            (
                s(
                    "quiver_requests_finished_total",
                    "counter",
                    "Requests that ended normally.",
                ),
                &self.requests_finished_total,
            ),
            (
                s(
                    "quiver_requests_failed_total",
                    "counter",
                    "Requests that ended with a server-side error.",
                ),
                &self.requests_failed_total,
            ),
            (
                s(
                    "quiver_prompt_tokens_total",
                    "counter",
                    "Prompt tokens prefilled.",
                ),
                &self.prompt_tokens_total,
            ),
            (
                s(
                    "quiver_generated_tokens_total",
                    "counter",
                    "Tokens generated.",
                ),
                &self.generated_tokens_total,
            ),
            (
                s(
                    "quiver_embedding_inputs_total",
                    "counter",
                    "Inputs embedded by /v1/embeddings.",
                ),
                &self.embedding_inputs_total,
            ),
            (
                s(
                    "quiver_embedding_tokens_total",
                    "counter",
                    "Tokens of the inputs embedded by /v1/embeddings (counted in quiver_prompt_tokens_total too).",
                ),
                &self.embedding_tokens_total,
            ),
            (
                s(
                    "quiver_prefill_steps_total",
                    "counter",
                    "Steps with a prefill (a Prefill call, or a prefill carried in a Decode).",
                ),
                &self.prefill_steps_total,
            ),
            (
                s(
                    "quiver_decode_steps_total",
                    "counter",
                    "Decode calls to the shards (mixed steps included).",
                ),
                &self.decode_steps_total,
            ),
            (
                s(
                    "quiver_preemptions_total",
                    "counter",
                    "Running requests preempted to make room for a request that waited too long.",
                ),
                &self.preemptions_total,
            ),
            (
                s(
                    "quiver_prefix_cache_queries_total",
                    "counter",
                    "Prompt tokens looked up in the prefix cache (requests that ask for prompt logprobs are not).",
                ),
                &self.prefix_cache_queries_total,
            ),
            (
                s(
                    "quiver_prefix_cache_hits_total",
                    "counter",
                    "Prompt tokens whose KV the prefix cache supplied; hits over queries is the hit rate.",
                ),
                &self.prefix_cache_hits_total,
            ),
            (
                s(
                    "quiver_adapters_active",
                    "gauge",
                    "Adapter device slots holding an adapter.",
                ),
                &self.adapters_active,
            ),
            (
                s(
                    "quiver_adapter_slots",
                    "gauge",
                    "Adapter device slots in all (--max-active-adapters).",
                ),
                &self.adapter_slots,
            ),
        ]
    }

    /// The Prometheus text exposition format (version 0.0.4).
    pub fn render(&self) -> String {
        let mut out = String::new();
        for (series, value) in self.series() {
            let _ = writeln!(out, "# HELP {} {}", series.name, series.help);
            let _ = writeln!(out, "# TYPE {} {}", series.name, series.kind);
            let _ = writeln!(out, "{} {}", series.name, value.load(Ordering::Relaxed));
        }
        let name = "quiver_grammar_mask_seconds";
        let _ = writeln!(
            out,
            "# HELP {name} Shard time per step spent on grammar token masks outside the forward \
             pass (steps with a constrained request only)."
        );
        let _ = writeln!(out, "# TYPE {name} summary");
        let seconds = self.grammar_mask_ns.load(Ordering::Relaxed) as f64 / 1e9;
        let _ = writeln!(out, "{name}_sum {seconds}");
        let steps = self.grammar_mask_steps.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_count {steps}");
        self.render_adapters(&mut out);
        self.render_shards(&mut out);
        self.http.render(&mut out);
        self.requests.render(&mut out);
        self.scheduler.render(&mut out);
        gie::render(&mut out, self);
        out
    }

    fn render_shards(&self, out: &mut String) {
        let name = "quiver_shard_weight_bytes";
        text::header(
            out,
            name,
            "gauge",
            "Bytes of model weights each shard rank holds (its share of a split model).",
        );
        for (rank, bytes) in self
            .shard_weight_bytes
            .get()
            .into_iter()
            .flatten()
            .enumerate()
        {
            let _ = writeln!(out, "{name}{{rank=\"{rank}\"}} {bytes}");
        }
    }

    fn render_adapters(&self, out: &mut String) {
        let name = "quiver_adapter_load_seconds";
        text::header(
            out,
            name,
            "histogram",
            "Time to load an adapter into the shards' host memory (a hub download included).",
        );
        self.adapter_load_seconds.render(out, name, &[]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_the_grammar_mask_summary_in_seconds() {
        let m = Metrics::default();
        Metrics::set(&m.grammar_mask_steps, 4);
        Metrics::set(&m.grammar_mask_ns, 2_500_000);
        let text = m.render();
        assert!(text.contains("# TYPE quiver_grammar_mask_seconds summary\n"));
        assert!(text.contains("quiver_grammar_mask_seconds_sum 0.0025\n"));
        assert!(text.contains("quiver_grammar_mask_seconds_count 4\n"));
    }

    #[test]
    fn names_each_rank_in_the_weight_bytes_gauge() {
        let m = Metrics::default();
        m.set_shard_weight_bytes(vec![1000, 998]);
        let text = m.render();
        assert!(text.contains("# TYPE quiver_shard_weight_bytes gauge\n"));
        assert!(text.contains("quiver_shard_weight_bytes{rank=\"0\"} 1000\n"));
        assert!(text.contains("quiver_shard_weight_bytes{rank=\"1\"} 998\n"));
    }

    #[test]
    fn renders_every_series_with_help_and_type() {
        let m = Metrics::default();
        Metrics::set(&m.kv_blocks_free, 7);
        Metrics::add(&m.generated_tokens_total, 3);
        Metrics::add(&m.generated_tokens_total, 2);
        let text = m.render();
        assert!(text.contains("# TYPE quiver_kv_blocks_free gauge\nquiver_kv_blocks_free 7\n"));
        assert!(text.contains("quiver_generated_tokens_total 5\n"));
        // Every family has one HELP and one TYPE line, and no name is declared twice.
        let helps: Vec<&str> = text.lines().filter(|l| l.starts_with("# HELP ")).collect();
        let types = text.lines().filter(|l| l.starts_with("# TYPE ")).count();
        assert_eq!(helps.len(), types);
        let mut names: Vec<&str> = helps.iter().map(|l| l.split(' ').nth(2).unwrap()).collect();
        let declared = names.len();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), declared);
        assert!(declared > 14);
    }
}
