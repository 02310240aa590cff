//! quiver-router: the OpenAI-compatible HTTP front of quiver.
//!
//! A request flows: `http` (axum handlers) → `validation` (OpenAI body → `GenerationRequest`)
//! → `scheduler` (queues, KV blocks, continuous batching) → `shard` (gRPC client), and back as
//! token events → `detokenizer` → `stop` → SSE or JSON. `startup` builds the state they share.

pub mod adapters;
pub mod bounded_text;
pub mod config;
pub mod core;
pub mod detokenizer;
pub mod error;
pub mod files;
pub mod http;
pub mod metrics;
pub mod openai;
pub mod reasoning;
pub mod scheduler;
pub mod server;
pub mod shard;
pub mod startup;
pub mod stop;
pub mod telemetry;
pub mod template;
pub mod tenants;
pub mod token_pieces;
pub mod tokenizer;
pub mod tool_calls;
pub mod validation;

/// Code generated from `proto/quiver/v1/shard.proto` by build.rs.
pub mod pb {
    tonic::include_proto!("quiver.v1");
}
