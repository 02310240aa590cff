//! Why an adapter cannot serve a request. Clone, because one failed load is the answer of every
//! request that waited on it. Messages never show server paths: `--adapter-root` is the
//! operator's business, not the client's.

use quiver_flags::UnknownAdapterSource;

use crate::shard::ShardError;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AdapterError {
    /// Not a hub id (`owner/name[@revision]`), or a local id that is absolute, has a `..`
    /// component, or leads (through a symlink) out of `--adapter-root`.
    #[error("`{id}` is not a valid adapter id: {reason}")]
    InvalidId { id: String, reason: String },
    /// A local id, but the server was started without `--adapter-root`.
    #[error(
        "`{id}` names a local adapter, but this server has no adapter root (--adapter-root): \
         only hub adapters can be served"
    )]
    NoAdapterRoot { id: String },
    /// `adapter_source` is not `hub`, `local` or `s3`.
    #[error("`adapter_source` must be `hub`, `local` or `s3`, got `{0}`")]
    InvalidSource(String),
    /// No such local directory, no such hub repository, or not loaded (`/v1/models/{id}`,
    /// unload).
    #[error("The model `{id}` does not exist{detail}.")]
    NotFound { id: String, detail: String },
    /// Being unloaded: its running requests finish, new ones are refused until it is gone.
    #[error("The adapter `{0}` is being unloaded.")]
    Unloading(String),
    /// `/v1/load_lora_adapter` for a name already loaded from somewhere else.
    #[error("The adapter `{id}` is already loaded from {loaded}; unload it first.")]
    AlreadyLoaded { id: String, loaded: String },
    /// The name would make one adapter answer for another: it is another adapter's id or
    /// directory, a hub id naming something else, or the adapter is loaded under another name.
    #[error("`{id}` cannot be used as an adapter name: {reason}")]
    Conflict { id: String, reason: String },
    /// The shard refused it: it does not fit the base model (architecture, shapes, target
    /// modules, rank over --max-lora-rank) or its files are malformed. The shard's message
    /// says what differs.
    #[error("adapter `{id}` cannot be served with this model: {message}")]
    Rejected { id: String, message: String },
    /// The adapter's own tokenizer or chat template cannot be read.
    #[error("adapter `{id}` has an unusable {what}: {message}")]
    Assets {
        id: String,
        what: &'static str,
        message: String,
    },
    /// The shard failed for a reason of its own (download error, a crash).
    #[error("loading adapter `{id}` failed: {message}")]
    LoadFailed { id: String, message: String },
}

impl From<UnknownAdapterSource> for AdapterError {
    fn from(error: UnknownAdapterSource) -> Self {
        Self::InvalidSource(error.0)
    }
}

impl AdapterError {
    /// Classifies a failed `LoadAdapter`: the shard's `InvalidArgument` is the adapter's fault
    /// (400), `NotFound` an unknown repository or directory (404), the rest a server error.
    pub fn from_load(id: &str, error: ShardError) -> Self {
        let id = id.to_owned();
        match error.code() {
            tonic::Code::InvalidArgument => Self::Rejected {
                id,
                message: error.message().to_owned(),
            },
            tonic::Code::NotFound => Self::NotFound {
                id,
                detail: format!(": {}", error.message()),
            },
            _ => Self::LoadFailed {
                id,
                message: error.to_string(),
            },
        }
    }

    /// Whether the client caused it (4xx) rather than the server (5xx).
    pub fn is_client_error(&self) -> bool {
        !matches!(self, Self::LoadFailed { .. })
    }

    /// Whether the answer is 409.
    pub fn is_conflict(&self) -> bool {
        matches!(self, Self::Conflict { .. })
    }

    /// Whether the answer is 404.
    pub fn is_not_found(&self) -> bool {
        matches!(self, Self::NotFound { .. } | Self::Unloading(_))
    }

    /// Stable machine-readable code (also a metric label).
    pub fn code(&self) -> &'static str {
        match self {
            Self::InvalidId { .. } => "invalid_adapter_id",
            Self::NoAdapterRoot { .. } => "adapter_root_not_set",
            Self::InvalidSource(_) => "invalid_value",
            Self::NotFound { .. } | Self::Unloading(_) => "model_not_found",
            Self::AlreadyLoaded { .. } => "adapter_already_loaded",
            Self::Conflict { .. } => "adapter_name_conflict",
            Self::Rejected { .. } | Self::Assets { .. } => "invalid_adapter",
            Self::LoadFailed { .. } => "adapter_load_failed",
        }
    }
}
