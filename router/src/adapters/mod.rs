//! LoRA adapters in the router: which adapter a request's `model` names (`resolve`), the
//! registry of loaded adapters with their own tokenizer and chat template (`registry`,
//! `assets`), and the seam to the shards and the scheduler that load and unload them
//! (`backend`).
//!
//! A request for an adapter flows: `resolve` turns the `model` string into an `AdapterSpec`
//! (hub repo and revision, a directory checked to lie inside `--adapter-root`, or an S3
//! prefix in an allowed bucket) → the
//! registry loads it once (`LoadAdapter` on the shards; concurrent requests await the same
//! load) and reads its assets → validation renders and tokenizes with those assets → the
//! scheduler gets `GenerationRequest.adapter_id` and owns the device slots from there.

mod assets;
mod backend;
mod error;
mod names;
mod registry;
mod resolve;
mod s3_id;

pub use assets::adapter_assets;
pub use backend::{AdapterBackend, ServingBackend};
pub use error::AdapterError;
pub use names::{check_name, check_path, MAX_ADAPTER_NAME_BYTES, MAX_ADAPTER_PATH_BYTES};
pub use registry::{AdapterEntry, AdapterRegistry};
pub use resolve::{AdapterLocation, AdapterSource, AdapterSpec, Resolver};
pub use s3_id::S3Location;
