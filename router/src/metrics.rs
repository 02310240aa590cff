//! Prometheus metrics, rendered as text on `GET /metrics`.
//!
//! A handful of gauges and counters kept in atomics: cheap enough to touch on the decode path,
//! and no registry crate needed for this few series.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};

#[derive(Debug, Default)]
pub struct Metrics {
    pub kv_blocks_total: AtomicU64,
    pub kv_blocks_free: AtomicU64,
    pub requests_running: AtomicU64,
    pub requests_waiting: AtomicU64,
    pub requests_finished_total: AtomicU64,
    pub requests_failed_total: AtomicU64,
    pub prompt_tokens_total: AtomicU64,
    pub generated_tokens_total: AtomicU64,
    pub prefill_steps_total: AtomicU64,
    pub decode_steps_total: AtomicU64,
    pub preemptions_total: AtomicU64,
    pub adapters_active: AtomicU64,
    pub adapter_slots: AtomicU64,
    /// Steps with a grammar in the batch, and the shard's time computing and applying their
    /// token masks: rendered as the summary `quiver_grammar_mask_seconds` (sum and count).
    pub grammar_mask_steps: AtomicU64,
    pub grammar_mask_ns: AtomicU64,
}

struct Series {
    name: &'static str,
    kind: &'static str,
    help: &'static str,
}

impl Metrics {
    pub fn set(gauge: &AtomicU64, value: u64) {
        gauge.store(value, Ordering::Relaxed);
    }

    pub fn add(counter: &AtomicU64, value: u64) {
        counter.fetch_add(value, Ordering::Relaxed);
    }

    fn series(&self) -> [(Series, &AtomicU64); 13] {
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
                    "quiver_prefill_steps_total",
                    "counter",
                    "Prefill calls to the shards.",
                ),
                &self.prefill_steps_total,
            ),
            (
                s(
                    "quiver_decode_steps_total",
                    "counter",
                    "Decode calls to the shards.",
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
        out
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
    fn renders_every_series_with_help_and_type() {
        let m = Metrics::default();
        Metrics::set(&m.kv_blocks_free, 7);
        Metrics::add(&m.generated_tokens_total, 3);
        Metrics::add(&m.generated_tokens_total, 2);
        let text = m.render();
        assert!(text.contains("# TYPE quiver_kv_blocks_free gauge\nquiver_kv_blocks_free 7\n"));
        assert!(text.contains("quiver_generated_tokens_total 5\n"));
        assert_eq!(text.matches("# HELP ").count(), 14);
        assert_eq!(text.matches("# TYPE ").count(), 14);
    }
}
