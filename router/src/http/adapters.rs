//! `POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter`: load an adapter under a
//! name of the operator's choosing, or unload one, at run time. Answers as vLLM does: 200 with
//! a one-line text, errors in OpenAI's shape.

use axum::extract::State;
use serde_json::Value;

use super::json::{typed, OpenAiJson, RequestBody};
use super::state::AppState;
use crate::adapters::{check_name, AdapterError, AdapterLocation, AdapterSource, AdapterSpec};
use crate::error::ApiError;
use crate::openai::adapters::{LoadLoraAdapterRequest, UnloadLoraAdapterRequest};

impl RequestBody for LoadLoraAdapterRequest {
    fn from_json(value: Value) -> Result<Self, ApiError> {
        typed(value)
    }
}

impl RequestBody for UnloadLoraAdapterRequest {
    fn from_json(value: Value) -> Result<Self, ApiError> {
        typed(value)
    }
}

pub async fn load_lora_adapter(
    State(state): State<AppState>,
    OpenAiJson(request): OpenAiJson<LoadLoraAdapterRequest>,
) -> Result<String, ApiError> {
    let name = required(request.lora_name, "lora_name")?;
    let path = required(request.lora_path, "lora_path")?;
    check_name(&name).map_err(|error| ApiError::adapter(error, "lora_name"))?;
    if state.models.is_base(&name) {
        return Err(ApiError::BadRequestBody {
            message: format!("`{name}` is the base model's name; choose another `lora_name`"),
            param: Some("lora_name".to_owned()),
            code: "invalid_value",
        });
    }
    let source = request
        .adapter_source
        .as_deref()
        .map(AdapterSource::parse)
        .transpose()
        .map_err(|error| ApiError::adapter(error, "adapter_source"))?;
    let location = state
        .resolver
        .locate_path(&path, source)
        .map_err(|error| ApiError::adapter(error, "lora_path"))?;
    if let AdapterLocation::Hub { .. } | AdapterLocation::S3(_) = location {
        // The shard downloads a hub or S3 adapter by its id (LoadAdapterRequest has no separate
        // repository field), so such an adapter can only be served under its own id.
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
    if let Some(reason) = state.resolver.name_conflict(&name, &location) {
        let error = AdapterError::Conflict {
            id: name,
            reason: reason.to_owned(),
        };
        return Err(ApiError::adapter(error, "lora_name"));
    }
    state
        .adapters
        .load(AdapterSpec {
            id: name.clone(),
            location,
        })
        .await
        .map_err(|error| {
            let param = match error {
                AdapterError::AlreadyLoaded { .. } | AdapterError::Conflict { .. } => "lora_name",
                _ => "lora_path",
            };
            ApiError::adapter(error, param)
        })?;
    Ok(format!(
        "Success: LoRA adapter '{name}' added successfully."
    ))
}

pub async fn unload_lora_adapter(
    State(state): State<AppState>,
    OpenAiJson(request): OpenAiJson<UnloadLoraAdapterRequest>,
) -> Result<String, ApiError> {
    let name = required(request.lora_name, "lora_name")?;
    check_name(&name).map_err(|error| ApiError::adapter(error, "lora_name"))?;
    state
        .adapters
        .unload(&name)
        .await
        .map_err(|error| ApiError::adapter(error, "lora_name"))?;
    Ok(format!(
        "Success: LoRA adapter '{name}' removed successfully."
    ))
}

fn required(value: Option<String>, param: &str) -> Result<String, ApiError> {
    value
        .filter(|value| !value.is_empty())
        .ok_or_else(|| ApiError::BadRequestBody {
            message: format!("you must provide `{param}`"),
            param: Some(param.to_owned()),
            code: "missing_required_parameter",
        })
}
