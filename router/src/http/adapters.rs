//! `POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter`: load an adapter under a
//! name of the operator's choosing, or unload one, at run time. Answers as vLLM does: 200 with
//! a one-line text, errors in OpenAI's shape.

use axum::extract::State;
use serde_json::Value;

use super::json::{typed, OpenAiJson, RequestBody};
use super::state::AppState;
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
    state
        .infer
        .models()
        .load_adapter(name.clone(), path, request.adapter_source.as_deref())
        .await?;
    Ok(format!(
        "Success: LoRA adapter '{name}' added successfully."
    ))
}

pub async fn unload_lora_adapter(
    State(state): State<AppState>,
    OpenAiJson(request): OpenAiJson<UnloadLoraAdapterRequest>,
) -> Result<String, ApiError> {
    let name = required(request.lora_name, "lora_name")?;
    state.infer.models().unload_adapter(&name).await?;
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
