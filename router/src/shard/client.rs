//! gRPC client of the shard processes, one unix socket per tensor-parallel rank.
//!
//! Every rank must see every call (they run the forward pass together and would wait on each
//! other in their collectives), so each call goes to all ranks concurrently. The ranks compute
//! the same answer; rank 0's is returned. If any rank fails, the call fails with that rank's
//! error without waiting for the others: a rank that is stuck because a peer died would
//! otherwise hold the router forever.
//!
//! The one exception is loading a hub adapter: only rank 0 downloads it, so rank 0 is asked
//! first and the other ranks then load rank 0's local copy (`load_adapter`).

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use futures::future::{try_join_all, BoxFuture};
use futures::{FutureExt, TryFutureExt};
use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tokio::sync::watch;
use tonic::transport::{Channel, Endpoint, Uri};

use super::wire;
use super::{
    AdapterLoad, CachedBatch, Grammar, GrammarCompiled, KvLayout, LoadedAdapter, MixedStep,
    PrefillEntry, ShardBackend, ShardError, ShardInfo, ShardResult, Step, WarmupLimits,
};
use crate::bounded_text::bounded;
use crate::pb;
use crate::pb::shard_client::ShardClient as RankClient;
use crate::telemetry;

/// The shard applies the same limit: both read it from the proto, where it is explained.
const MAX_MESSAGE_BYTES: usize = pb::ChannelLimit::MaxMessageBytes as usize;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// First wait before a rank that failed at the transport is asked `Health` again; doubled
/// after every failed try, up to `RECONNECT_MAX_DELAY`.
const RECONNECT_FIRST_DELAY: Duration = Duration::from_millis(50);
const RECONNECT_MAX_DELAY: Duration = Duration::from_secs(2);

/// Client of all ranks of one model; cheap to clone (channels are shared).
#[derive(Debug, Clone)]
pub struct ShardClient {
    ranks: Vec<RankClient<Channel>>,
    /// False from a call that fails at the transport (see `is_transport_failure`) until the
    /// reconnect probe finds every rank answering again.
    reachable: Arc<watch::Sender<bool>>,
}

impl ShardClient {
    /// Connects to every rank's socket, rank 0 first.
    pub async fn connect(paths: &[PathBuf]) -> Result<Self, ShardError> {
        if paths.is_empty() {
            return Err(ShardError::Connect {
                path: PathBuf::new(),
                message: "no shard socket given".to_string(),
            });
        }
        let ranks = try_join_all(paths.iter().map(|path| connect_rank(path))).await?;
        Ok(Self {
            ranks,
            reachable: Arc::new(watch::Sender::new(true)),
        })
    }

    /// Sends `request` to every rank with `call` and returns rank 0's response.
    async fn fan_out<Req, Resp, F, Fut>(&self, request: Req, call: F) -> ShardResult<Resp>
    where
        Req: Clone,
        F: Fn(RankClient<Channel>, tonic::Request<Req>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<Resp>, tonic::Status>>,
    {
        let Some((last, others)) = self.ranks.split_last() else {
            return Err(ShardError::Connect {
                path: PathBuf::new(),
                message: "no shard connected".to_string(),
            });
        };
        let mut calls = Vec::with_capacity(self.ranks.len());
        for (rank, client) in others.iter().enumerate() {
            calls.push(self.on_rank(rank, call(client.clone(), traced(request.clone()))));
        }
        // The last rank takes the original request; the others got copies.
        calls.push(self.on_rank(others.len(), call(last.clone(), traced(request))));
        let mut responses = try_join_all(calls).await?;
        Ok(responses.swap_remove(0))
    }

    /// A hub adapter named without a local path: rank 0 downloads it, then the other ranks get
    /// the same request with rank 0's `path` (they must not download it a second time, and they
    /// need the very same files). Anything else goes to all ranks at once.
    ///
    /// Unlike the other calls this waits for every rank (loading involves no collective, so no
    /// rank can hang on a dead peer), and a load that fails on any rank is undone on those where
    /// it succeeded: no rank keeps an adapter the router counts as not loaded.
    async fn load_adapter_on_ranks(
        &self,
        request: pb::LoadAdapterRequest,
    ) -> ShardResult<pb::LoadAdapterResponse> {
        let downloads = wire::is_remote(&request) && request.path.is_empty();
        let all = 0..self.ranks.len();
        if !downloads || self.ranks.len() == 1 {
            return self.load_on(all, request).await;
        }
        let adapter_id = request.adapter_id.clone();
        let response = self.load_on(0..1, request.clone()).await?;
        let local = pb::LoadAdapterRequest {
            path: response.path.clone(),
            ..request
        };
        match self.load_on(1..all.end, local).await {
            Ok(_) => Ok(response),
            Err(error) => {
                self.unload_quietly(&adapter_id, 0..1).await;
                Err(error)
            }
        }
    }

    /// Loads on `ranks`, all at once; the first one's answer, or the lowest failing rank's error
    /// once the adapter is unloaded again from the ranks that loaded it.
    async fn load_on(
        &self,
        ranks: std::ops::Range<usize>,
        request: pb::LoadAdapterRequest,
    ) -> ShardResult<pb::LoadAdapterResponse> {
        let adapter_id = request.adapter_id.clone();
        let calls = ranks.clone().map(|rank| {
            let mut client = self.ranks[rank].clone();
            let request = traced(request.clone());
            self.on_rank(rank, async move { client.load_adapter(request).await })
        });
        let mut answers = futures::future::join_all(calls).await;
        let Some(failed) = answers.iter().position(Result::is_err) else {
            return answers.swap_remove(0);
        };
        for (rank, answer) in ranks.zip(&answers) {
            if answer.is_ok() {
                self.unload_quietly(&adapter_id, rank..rank + 1).await;
            }
        }
        answers.swap_remove(failed)
    }

    /// Undoes a load on `ranks`; a rank that cannot unload it (gone, or never had it) is logged.
    async fn unload_quietly(&self, adapter_id: &str, ranks: std::ops::Range<usize>) {
        for rank in ranks {
            let request = pb::UnloadAdapterRequest {
                adapter_id: adapter_id.to_string(),
            };
            let mut client = self.ranks[rank].clone();
            let call = async move { client.unload_adapter(traced(request)).await };
            if let Err(error) = self.on_rank(rank, call).await {
                tracing::warn!(rank, %error, "could not undo an adapter load that failed on another rank");
            }
        }
    }

    /// Awaits one rank's answer, naming the rank in its error.
    async fn on_rank<Resp>(
        &self,
        rank: usize,
        call: impl Future<Output = Result<tonic::Response<Resp>, tonic::Status>>,
    ) -> ShardResult<Resp> {
        match call.await {
            Ok(response) => Ok(response.into_inner()),
            Err(status) => {
                if is_transport_failure(&status) && self.reachable.send_replace(false) {
                    tracing::error!(rank, status = %bounded(&status.to_string()),
                        "shard unreachable; refusing new requests with 503 until it answers again");
                    self.probe_until_reachable();
                }
                Err(ShardError::from_status(rank, &status))
            }
        }
    }

    /// Asks every rank `Health`, with growing pauses, until all answer, then lets requests in
    /// again. A broken connection is dialled anew by the channel on its next call, so a shard
    /// whose process lives on (the connection alone failed) comes back within one probe; one
    /// whose process died keeps failing until the launcher tears the stack down.
    fn probe_until_reachable(&self) {
        let ranks = self.ranks.clone();
        let reachable = self.reachable.clone();
        tokio::spawn(async move {
            let mut delay = RECONNECT_FIRST_DELAY;
            loop {
                tokio::time::sleep(delay).await;
                let probes = ranks.iter().map(|rank| {
                    let mut rank = rank.clone();
                    async move { rank.health(pb::HealthRequest {}).await }
                });
                if try_join_all(probes).await.is_ok() {
                    reachable.send_replace(true);
                    tracing::warn!("shard reachable again; accepting requests");
                    return;
                }
                delay = (delay * 2).min(RECONNECT_MAX_DELAY);
            }
        });
    }

    /// Returns once every rank is reachable (at once if none failed).
    pub async fn reachable(&self) {
        let mut watched = self.reachable.subscribe();
        // The sender lives in `self`, so the wait cannot end with an error.
        let _ = watched.wait_for(|reachable| *reachable).await;
    }
}

/// `message` as a call that carries the current span's `traceparent` (when tracing is on), so
/// the shard's spans join the request's trace.
fn traced<Req>(message: Req) -> tonic::Request<Req> {
    let mut request = tonic::Request::new(message);
    telemetry::inject_current(request.metadata_mut());
    request
}

/// A status the shard did not send: tonic made it from a broken connection, so it carries the
/// transport error as its source (a status the shard sent has none), or says `Unavailable`.
fn is_transport_failure(status: &tonic::Status) -> bool {
    status.code() == tonic::Code::Unavailable || std::error::Error::source(status).is_some()
}

async fn connect_rank(path: &Path) -> Result<RankClient<Channel>, ShardError> {
    let socket = path.to_path_buf();
    // The URI is required by the builder but never dialled: the connector opens the socket.
    let channel = Endpoint::from_static("http://shard.local")
        .connect_timeout(CONNECT_TIMEOUT)
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let socket = socket.clone();
            async move { UnixStream::connect(socket).await.map(TokioIo::new) }
        }))
        .await
        .map_err(|error| ShardError::Connect {
            path: path.to_path_buf(),
            message: error_chain(&error),
        })?;
    Ok(RankClient::new(channel)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES))
}

/// tonic's transport error says only "transport error"; the cause (e.g. "No such file or
/// directory") is in its sources.
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut message = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        message.push_str(": ");
        message.push_str(&cause.to_string());
        source = cause.source();
    }
    message
}

impl ShardBackend for ShardClient {
    fn is_unavailable(&self) -> bool {
        !*self.reachable.borrow()
    }

    fn info(&self) -> BoxFuture<'_, ShardResult<ShardInfo>> {
        self.fan_out(
            pb::InfoRequest {},
            |mut c, r| async move { c.info(r).await },
        )
        .map_ok(ShardInfo::from)
        .boxed()
    }

    fn rank_infos(&self) -> BoxFuture<'_, ShardResult<Vec<ShardInfo>>> {
        let calls = self.ranks.iter().enumerate().map(|(rank, client)| {
            let mut client = client.clone();
            self.on_rank(rank, async move {
                client.info(traced(pb::InfoRequest {})).await
            })
            .map_ok(ShardInfo::from)
        });
        try_join_all(calls).boxed()
    }

    fn health(&self) -> BoxFuture<'_, ShardResult<()>> {
        self.fan_out(
            pb::HealthRequest {},
            |mut c, r| async move { c.health(r).await },
        )
        .map_ok(drop)
        .boxed()
    }

    fn warmup(&self, limits: WarmupLimits) -> BoxFuture<'_, ShardResult<KvLayout>> {
        self.fan_out(pb::WarmupRequest::from(limits), |mut c, r| async move {
            c.warmup(r).await
        })
        .map_ok(KvLayout::from)
        .boxed()
    }

    fn prefill(
        &self,
        batch_id: u64,
        requests: Vec<PrefillEntry>,
    ) -> BoxFuture<'_, ShardResult<Step>> {
        let request = pb::PrefillRequest {
            batch_id,
            requests: requests.into_iter().map(pb::Request::from).collect(),
        };
        self.fan_out(request, |mut c, r| async move { c.prefill(r).await })
            .map_ok(|r| wire::step(r.generations, r.batch, r.forward_ns, r.grammar_ns))
            .boxed()
    }

    fn decode(&self, batches: Vec<CachedBatch>) -> BoxFuture<'_, ShardResult<Step>> {
        let request = pb::DecodeRequest {
            batches: batches.into_iter().map(pb::CachedBatch::from).collect(),
            prefill: None,
        };
        self.fan_out(request, |mut c, r| async move { c.decode(r).await })
            .map_ok(|r| wire::step(r.generations, r.batch, r.forward_ns, r.grammar_ns))
            .boxed()
    }

    fn decode_with_prefill(
        &self,
        batches: Vec<CachedBatch>,
        batch_id: u64,
        requests: Vec<PrefillEntry>,
    ) -> BoxFuture<'_, ShardResult<MixedStep>> {
        let request = pb::DecodeRequest {
            batches: batches.into_iter().map(pb::CachedBatch::from).collect(),
            prefill: Some(pb::PrefillRequest {
                batch_id,
                requests: requests.into_iter().map(pb::Request::from).collect(),
            }),
        };
        self.fan_out(request, |mut c, r| async move { c.decode(r).await })
            .map(|answer| answer.and_then(wire::mixed_step))
            .boxed()
    }

    fn filter_batch(
        &self,
        batch_id: u64,
        keep: Vec<u64>,
    ) -> BoxFuture<'_, ShardResult<Option<CachedBatch>>> {
        let request = pb::FilterBatchRequest {
            batch_id,
            request_ids: keep,
        };
        self.fan_out(request, |mut c, r| async move { c.filter_batch(r).await })
            .map_ok(|r| r.batch.map(CachedBatch::from))
            .boxed()
    }

    fn clear_cache(&self, batch_id: Option<u64>) -> BoxFuture<'_, ShardResult<()>> {
        self.fan_out(pb::ClearCacheRequest { batch_id }, |mut c, r| async move {
            c.clear_cache(r).await
        })
        .map_ok(drop)
        .boxed()
    }

    fn load_adapter(&self, load: AdapterLoad) -> BoxFuture<'_, ShardResult<LoadedAdapter>> {
        self.load_adapter_on_ranks(load.into())
            .map_ok(LoadedAdapter::from)
            .boxed()
    }

    fn activate_adapter(&self, adapter_id: String, slot: u32) -> BoxFuture<'_, ShardResult<bool>> {
        let request = pb::ActivateAdapterRequest { adapter_id, slot };
        self.fan_out(
            request,
            |mut c, r| async move { c.activate_adapter(r).await },
        )
        .map_ok(|r| r.host_cache_hit)
        .boxed()
    }

    fn prefetch_adapter(&self, adapter_id: String) -> BoxFuture<'_, ShardResult<bool>> {
        let request = pb::PrefetchAdapterRequest { adapter_id };
        self.fan_out(
            request,
            |mut c, r| async move { c.prefetch_adapter(r).await },
        )
        .map_ok(|r| r.host_cache_hit)
        .boxed()
    }

    fn unload_adapter(&self, adapter_id: String) -> BoxFuture<'_, ShardResult<()>> {
        let request = pb::UnloadAdapterRequest { adapter_id };
        self.fan_out(request, |mut c, r| async move { c.unload_adapter(r).await })
            .map_ok(drop)
            .boxed()
    }

    fn compile_grammar(
        &self,
        adapter_id: String,
        grammar: Grammar,
        grammar_id: u64,
    ) -> BoxFuture<'_, ShardResult<GrammarCompiled>> {
        let request = pb::CompileGrammarRequest {
            adapter_id,
            grammar: Some(grammar.into()),
            grammar_id,
        };
        self.fan_out(
            request,
            |mut c, r| async move { c.compile_grammar(r).await },
        )
        .map_ok(GrammarCompiled::from)
        .boxed()
    }

    fn release_grammars(&self, grammar_ids: Vec<u64>) -> BoxFuture<'_, ShardResult<()>> {
        let request = pb::ReleaseGrammarsRequest { grammar_ids };
        self.fan_out(
            request,
            |mut c, r| async move { c.release_grammars(r).await },
        )
        .map_ok(drop)
        .boxed()
    }
}
