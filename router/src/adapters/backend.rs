//! What the registry needs from the rest of the router, as a small trait: load an adapter into
//! the shards, and unload it once the scheduler has drained its requests. `ServingBackend` is the
//! real one (shard client + scheduler); registry tests use their own.

use std::sync::Arc;

use futures::future::BoxFuture;
use futures::FutureExt;

use crate::pb;
use crate::scheduler::Scheduler;
use crate::shard::{ShardBackend, ShardError, ShardResult};

pub trait AdapterBackend: Send + Sync {
    /// `LoadAdapter` on every rank (the shard client sends a hub load to rank 0 first).
    fn load(
        &self,
        request: pb::LoadAdapterRequest,
    ) -> BoxFuture<'_, ShardResult<pb::LoadAdapterResponse>>;

    /// Hands the adapter to the scheduler for unloading: its running and queued requests
    /// finish, then its slot is freed and the shards forget it. Resolves once that is done.
    fn unload(&self, adapter_id: String) -> BoxFuture<'static, ()>;
}

/// The shards load adapters; the scheduler, which owns the device slots, unloads them.
pub struct ServingBackend {
    pub shard: Arc<dyn ShardBackend>,
    pub scheduler: Scheduler,
}

impl AdapterBackend for ServingBackend {
    fn load(
        &self,
        _request: pb::LoadAdapterRequest,
    ) -> BoxFuture<'_, ShardResult<pb::LoadAdapterResponse>> {
        // Until the shard client's load_adapter lands.
        async {
            Err(ShardError::Status {
                rank: 0,
                code: tonic::Code::Unimplemented,
                message: "adapters are not wired to the shards yet".to_owned(),
            })
        }
        .boxed()
    }

    fn unload(&self, _adapter_id: String) -> BoxFuture<'static, ()> {
        async {}.boxed()
    }
}
