//! `POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter`, with vLLM's field names so
//! its clients and scripts work unchanged.

use serde::Deserialize;
use utoipa::ToSchema;

#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct LoadLoraAdapterRequest {
    /// The id clients will send in `model`.
    #[schema(value_type = String, required = true)]
    pub lora_name: Option<String>,
    /// A hub id (`owner/name[@revision]`) or a directory inside `--adapter-root` (relative to
    /// it, or absolute).
    #[schema(value_type = String, required = true)]
    pub lora_path: Option<String>,
    /// Extension: `hub`, `local` or `s3`; default: an absolute `lora_path` is local, anything else
    /// follows `--adapter-source`.
    pub adapter_source: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct UnloadLoraAdapterRequest {
    #[schema(value_type = String, required = true)]
    pub lora_name: Option<String>,
}
