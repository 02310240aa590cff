//! What probes and scrapers read: whether every shard rank answers (`/health`), and the
//! Prometheus page with the scheduler's load figures read at scrape time (`/metrics`).

use super::infer::Infer;
use crate::error::ApiError;
use crate::metrics::Metrics;

impl Infer {
    /// Ok when every shard rank answers `Health`; 503 when one does not, or while the router is
    /// dialling a rank whose connection failed: requests are refused then, and a probe that
    /// said 200 would keep the pod in rotation while it refuses them.
    pub async fn health(&self) -> Result<(), ApiError> {
        if self.shard.is_unavailable() {
            return Err(ApiError::ShardUnavailable(
                "the router is reconnecting to it".to_owned(),
            ));
        }
        match self.shard.health().await {
            Ok(_) => Ok(()),
            Err(error) => {
                // The detail can name the shard's socket path: it goes to the log, not the
                // client.
                tracing::warn!(%error, "shard health check failed");
                Err(ApiError::ShardUnavailable(
                    "it did not answer its health check".to_owned(),
                ))
            }
        }
    }

    /// The router's counters (token and request counters are counted where a request's life
    /// ends, in `generation`), with the load gauges set from the scheduler now.
    pub fn metrics_page(&self) -> String {
        let stats = self.scheduler.stats();
        let metrics = &self.metrics;
        Metrics::set(&metrics.kv_blocks_total, u64::from(stats.total_blocks));
        let block_size = self.scheduler.config().block_size;
        Metrics::set(&metrics.kv_block_size, u64::from(block_size));
        Metrics::set(&metrics.kv_blocks_free, u64::from(stats.free_blocks));
        Metrics::set(&metrics.requests_running, stats.running as u64);
        Metrics::set(&metrics.requests_waiting, stats.queued as u64);
        Metrics::set(&metrics.adapters_active, stats.active_adapters as u64);
        Metrics::set(&metrics.adapter_slots, u64::from(stats.adapter_slots));
        Metrics::set(&metrics.prefill_steps_total, stats.prefill_steps);
        Metrics::set(&metrics.decode_steps_total, stats.decode_steps);
        Metrics::set(&metrics.preemptions_total, stats.preemptions);
        Metrics::set(
            &metrics.prefix_cache_queries_total,
            stats.prefix_cache_queries,
        );
        Metrics::set(&metrics.prefix_cache_hits_total, stats.prefix_cache_hits);
        Metrics::set(&metrics.grammar_mask_steps, stats.grammar_steps);
        Metrics::set(&metrics.grammar_mask_ns, stats.grammar_ns);
        metrics.render()
    }

    /// The HTTP response counters, which the HTTP layer counts for every route.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }
}
