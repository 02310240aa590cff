//! Loading an adapter under a name of the operator's choosing, and unloading one, at run time
//! (vLLM's `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`). Each refusal names the
//! request field it is about.

use super::models::Models;
use crate::adapters::{check_name, AdapterError, AdapterLocation, AdapterSource, AdapterSpec};
use crate::error::ApiError;

impl Models {
    /// Loads the adapter at `path` (of `adapter_source`, else `--adapter-source`) as `name`.
    pub async fn load_adapter(
        &self,
        name: String,
        path: String,
        adapter_source: Option<&str>,
    ) -> Result<(), ApiError> {
        check_name(&name).map_err(|error| ApiError::adapter(error, "lora_name"))?;
        if self.served.is_base(&name) {
            return Err(ApiError::BadRequestBody {
                message: format!("`{name}` is the base model's name; choose another `lora_name`"),
                param: Some("lora_name".to_owned()),
                code: "invalid_value",
            });
        }
        let source = adapter_source
            .map(AdapterSource::parse)
            .transpose()
            .map_err(|error| ApiError::adapter(error, "adapter_source"))?;
        let location = self
            .resolver
            .locate_path(&path, source)
            .map_err(|error| ApiError::adapter(error, "lora_path"))?;
        if let AdapterLocation::Hub { .. } | AdapterLocation::S3(_) = location {
            // The shard downloads a hub or S3 adapter by its id (LoadAdapterRequest has no
            // separate repository field), so such an adapter can only be served under its own id.
            if name != path {
                let kind = location.source();
                return Err(ApiError::BadRequestBody {
                    message: format!(
                        "{kind} adapters are served under their {kind} id: set `lora_name` to \
                         `{path}`"
                    ),
                    param: Some("lora_name".to_owned()),
                    code: "invalid_value",
                });
            }
        }
        if let Some(reason) = self.resolver.name_conflict(&name, &location) {
            let error = AdapterError::Conflict {
                id: name,
                reason: reason.to_owned(),
            };
            return Err(ApiError::adapter(error, "lora_name"));
        }
        self.adapters
            .load(AdapterSpec { id: name, location })
            .await
            .map_err(|error| {
                let param = match error {
                    AdapterError::AlreadyLoaded { .. } | AdapterError::Conflict { .. } => {
                        "lora_name"
                    }
                    _ => "lora_path",
                };
                ApiError::adapter(error, param)
            })?;
        Ok(())
    }

    /// Unloads `name`, once the requests running on it are done.
    pub async fn unload_adapter(&self, name: &str) -> Result<(), ApiError> {
        check_name(name).map_err(|error| ApiError::adapter(error, "lora_name"))?;
        self.adapters
            .unload(name)
            .await
            .map_err(|error| ApiError::adapter(error, "lora_name"))?;
        Ok(())
    }
}
