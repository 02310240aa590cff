//! The shard's gRPC Health, answered by the test process on the socket the launcher handed a
//! fake shard, so the launcher's real readiness check runs unchanged.

use std::path::PathBuf;

mod pb {
    tonic::include_proto!("quiver.v1");
}

/// Serves Health on `socket` until the test's runtime ends.
pub async fn serve_fake_shard(socket: PathBuf) {
    let listener = tokio::net::UnixListener::bind(&socket).unwrap();
    tonic::transport::Server::builder()
        .add_service(pb::shard_server::ShardServer::new(HealthyShard))
        .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener))
        .await
        .unwrap();
}

/// Answers Health; nothing else is called before the router starts.
struct HealthyShard;

#[tonic::async_trait]
impl pb::shard_server::Shard for HealthyShard {
    async fn info(
        &self,
        _: tonic::Request<pb::InfoRequest>,
    ) -> Result<tonic::Response<pb::InfoResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("fake"))
    }
    async fn health(
        &self,
        _: tonic::Request<pb::HealthRequest>,
    ) -> Result<tonic::Response<pb::HealthResponse>, tonic::Status> {
        Ok(tonic::Response::new(pb::HealthResponse {}))
    }
    async fn warmup(
        &self,
        _: tonic::Request<pb::WarmupRequest>,
    ) -> Result<tonic::Response<pb::WarmupResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("fake"))
    }
    async fn prefill(
        &self,
        _: tonic::Request<pb::PrefillRequest>,
    ) -> Result<tonic::Response<pb::PrefillResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("fake"))
    }
    async fn decode(
        &self,
        _: tonic::Request<pb::DecodeRequest>,
    ) -> Result<tonic::Response<pb::DecodeResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("fake"))
    }
    async fn filter_batch(
        &self,
        _: tonic::Request<pb::FilterBatchRequest>,
    ) -> Result<tonic::Response<pb::FilterBatchResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("fake"))
    }
    async fn clear_cache(
        &self,
        _: tonic::Request<pb::ClearCacheRequest>,
    ) -> Result<tonic::Response<pb::ClearCacheResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("fake"))
    }
    async fn load_adapter(
        &self,
        _: tonic::Request<pb::LoadAdapterRequest>,
    ) -> Result<tonic::Response<pb::LoadAdapterResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("fake"))
    }
    async fn activate_adapter(
        &self,
        _: tonic::Request<pb::ActivateAdapterRequest>,
    ) -> Result<tonic::Response<pb::ActivateAdapterResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("fake"))
    }
    async fn prefetch_adapter(
        &self,
        _: tonic::Request<pb::PrefetchAdapterRequest>,
    ) -> Result<tonic::Response<pb::PrefetchAdapterResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("fake"))
    }
    async fn unload_adapter(
        &self,
        _: tonic::Request<pb::UnloadAdapterRequest>,
    ) -> Result<tonic::Response<pb::UnloadAdapterResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("fake"))
    }
    async fn compile_grammar(
        &self,
        _: tonic::Request<pb::CompileGrammarRequest>,
    ) -> Result<tonic::Response<pb::CompileGrammarResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("fake"))
    }

    async fn release_grammars(
        &self,
        _: tonic::Request<pb::ReleaseGrammarsRequest>,
    ) -> Result<tonic::Response<pb::ReleaseGrammarsResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("fake"))
    }
}
