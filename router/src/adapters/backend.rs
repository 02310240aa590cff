//! What the registry needs from the rest of the router, as a small trait: load an adapter into
//! the shards, and unload it once the scheduler has drained its requests. `ServingBackend` is the
//! real one (shard client + scheduler); registry tests use their own.

use std::sync::Arc;
use std::time::Instant;

use futures::future::BoxFuture;
use futures::FutureExt;
use tracing::Instrument;

use crate::metrics::Metrics;
use crate::scheduler::Scheduler;
use crate::shard::{AdapterLoad, LoadedAdapter, ShardBackend, ShardResult};
use crate::telemetry;

pub trait AdapterBackend: Send + Sync {
    /// `LoadAdapter` on every rank (the shard client sends a hub load to rank 0 first).
    fn load(&self, load: AdapterLoad) -> BoxFuture<'_, ShardResult<LoadedAdapter>>;

    /// Hands the adapter to the scheduler for unloading: its running and queued requests
    /// finish, then its slot is freed and the shards forget it. Resolves once that is done.
    fn unload(&self, adapter_id: String) -> BoxFuture<'static, ()>;
}

/// The shards load adapters; the scheduler, which owns the device slots, unloads them.
pub struct ServingBackend {
    pub shard: Arc<dyn ShardBackend>,
    pub scheduler: Scheduler,
    /// Where load times go.
    pub metrics: Arc<Metrics>,
}

impl AdapterBackend for ServingBackend {
    fn load(&self, load: AdapterLoad) -> BoxFuture<'_, ShardResult<LoadedAdapter>> {
        let load = self
            .shard
            .load_adapter(load)
            .instrument(telemetry::span("adapter.load"));
        let metrics = self.metrics.clone();
        async move {
            let started = Instant::now();
            let loaded = load.await;
            if loaded.is_ok() {
                metrics.adapter_loaded(started.elapsed());
            }
            loaded
        }
        .boxed()
    }

    fn unload(&self, adapter_id: String) -> BoxFuture<'static, ()> {
        // Asked now, so requests the scheduler already has are served first.
        let unload = self.scheduler.unload_adapter(adapter_id.clone());
        async move {
            if let Err(error) = unload.await {
                tracing::warn!(adapter = %adapter_id, %error, "unloading the adapter failed");
            }
        }
        .boxed()
    }
}
