//! The Gateway API Inference Extension's Model Server Protocol
//! (docs/proposals/003-model-server-protocol), under the names vLLM exports, so an endpoint
//! picker configured for vLLM (its defaults) reads quiver unchanged:
//!
//! - `vllm:num_requests_waiting`, `vllm:num_requests_running`: gauges;
//! - `vllm:kv_cache_usage_perc`: KV-cache use as a fraction (0..1, despite the name);
//! - `vllm:cache_config_info{block_size, num_gpu_blocks}`: value 1, the facts in labels;
//! - `vllm:lora_requests_info{max_lora, running_lora_adapters, waiting_lora_adapters}`: value
//!   the Unix time the lists last changed (the picker keeps the newest series). The lists are
//!   comma-separated with no spaces: the picker splits on "," and does not trim;
//! - `vllm:prefix_cache_queries_total`, `vllm:prefix_cache_hits_total`: counters of prompt
//!   tokens (as vLLM's, for dashboards and pickers that score cache affinity by hit rate).

use std::sync::atomic::Ordering;

use super::{text, Metrics};

/// KV blocks in use over usable blocks; 0 for an empty cache.
pub fn kv_usage(free: u64, total: u64) -> f64 {
    if total == 0 {
        return 0.0;
    }
    total.saturating_sub(free) as f64 / total as f64
}

pub fn render(out: &mut String, metrics: &Metrics) {
    let load = |gauge: &std::sync::atomic::AtomicU64| gauge.load(Ordering::Relaxed);
    let total = load(&metrics.kv_blocks_total);
    let usage = kv_usage(load(&metrics.kv_blocks_free), total);
    text::single(
        out,
        "quiver_kv_cache_usage_ratio",
        "gauge",
        "Fraction of the usable KV-cache blocks reserved by requests (0 to 1).",
        usage,
    );
    text::single(
        out,
        "vllm:num_requests_waiting",
        "gauge",
        "Requests waiting to be scheduled (GIE TotalQueuedRequests; as quiver_requests_waiting).",
        load(&metrics.requests_waiting),
    );
    text::single(
        out,
        "vllm:num_requests_running",
        "gauge",
        "Requests in the running batch (GIE TotalRunningRequests; as quiver_requests_running).",
        load(&metrics.requests_running),
    );
    text::single(
        out,
        "vllm:kv_cache_usage_perc",
        "gauge",
        "KV-cache usage as a fraction, 1 is full (GIE KVCacheUtilization).",
        usage,
    );
    text::single(
        out,
        "vllm:prefix_cache_queries_total",
        "counter",
        "Prompt tokens looked up in the prefix cache (as quiver_prefix_cache_queries_total).",
        load(&metrics.prefix_cache_queries_total),
    );
    text::single(
        out,
        "vllm:prefix_cache_hits_total",
        "counter",
        "Prompt tokens found in the prefix cache (as quiver_prefix_cache_hits_total).",
        load(&metrics.prefix_cache_hits_total),
    );
    let name = "vllm:cache_config_info";
    text::header(
        out,
        name,
        "gauge",
        "KV-cache configuration in labels: tokens per block and blocks in the cache.",
    );
    let block_size = load(&metrics.kv_block_size).to_string();
    let blocks = total.to_string();
    text::sample(
        out,
        name,
        &[("block_size", &block_size), ("num_gpu_blocks", &blocks)],
        1,
    );
    let name = "vllm:lora_requests_info";
    text::header(
        out,
        name,
        "gauge",
        "LoRA adapters on the device (running_lora_adapters) and with queued requests \
         (waiting_lora_adapters), comma-separated, with the device slots (max_lora); the value \
         is the Unix time the lists last changed.",
    );
    let lora = metrics.scheduler.lora();
    let max_lora = load(&metrics.adapter_slots).to_string();
    let running = lora.running.join(",");
    let waiting = lora.waiting.join(",");
    let labels = [
        ("max_lora", max_lora.as_str()),
        ("running_lora_adapters", running.as_str()),
        ("waiting_lora_adapters", waiting.as_str()),
    ];
    text::sample(out, name, &labels, lora.updated);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_usage_is_a_fraction() {
        assert_eq!(kv_usage(0, 0), 0.0);
        assert_eq!(kv_usage(10, 10), 0.0);
        assert_eq!(kv_usage(5, 20), 0.75);
        assert_eq!(kv_usage(0, 8), 1.0);
    }

    #[test]
    fn renders_the_protocol_gauges() {
        let metrics = Metrics::default();
        Metrics::set(&metrics.kv_blocks_total, 100);
        Metrics::set(&metrics.kv_blocks_free, 25);
        Metrics::set(&metrics.kv_block_size, 16);
        Metrics::set(&metrics.adapter_slots, 4);
        Metrics::set(&metrics.requests_waiting, 3);
        metrics
            .scheduler
            .publish_lora(vec!["b".into(), "a".into()], vec!["c".into()]);
        let mut out = String::new();
        render(&mut out, &metrics);
        assert!(out.contains("vllm:kv_cache_usage_perc 0.75\n"));
        assert!(out.contains("vllm:num_requests_waiting 3\n"));
        assert!(
            out.contains("vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"100\"} 1\n")
        );
        assert!(out.contains(
            "vllm:lora_requests_info{max_lora=\"4\",running_lora_adapters=\"a,b\",\
             waiting_lora_adapters=\"c\"} "
        ));
    }
}
