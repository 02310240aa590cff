//! Where each endpoint's prompts come from: chat renders its messages with the chat template,
//! completions tokenize (or take as ids) each `prompt`.

use std::future::Future;

use serde_json::{json, Value};

use super::bounds::{check_text_length, PromptLimits};
use super::logprobs::LogprobFields;
use super::messages::render_chat;
use super::prompt::{parse_prompt, PromptInput};
use super::{ModelAssets, ValidationError};
use crate::openai::chat::ChatFields;
use crate::openai::completions::CompletionFields;
use crate::tool_calls::{check_tool_request, ToolFields, ToolRequest};

/// An endpoint's own request fields, which decide how its prompts are built.
pub trait PromptSource: Send {
    /// The request field the prompts come from, named in errors about them.
    const PARAM: &'static str;

    /// Whether replies of a thinking model are split into reasoning and content (chat).
    const SPLITS_REASONING: bool = false;

    /// The logprob fields this endpoint reads (read before `prompt_ids` consumes the fields).
    fn logprob_fields(&self) -> LogprobFields;

    /// The request's tools, checked (chat only); legacy `functions` become the template's
    /// `tools`. Runs before `prompt_ids`.
    fn tool_request(&mut self) -> Result<Option<ToolRequest>, ValidationError> {
        Ok(None)
    }

    /// Adds `text` (the tools described for a template that does not read `tools`) to the
    /// system message, before `prompt_ids`. Chat only.
    fn add_tool_prompt(&mut self, _text: String) {}

    /// The token ids of each prompt, with its text when it was sent as text, after the checks
    /// that only these fields need. Prompts beyond `limits` are refused before they are
    /// tokenized.
    fn prompt_ids(
        self,
        assets: &ModelAssets,
        limits: &PromptLimits,
    ) -> impl Future<Output = Result<Vec<SourcedPrompt>, ValidationError>> + Send;
}

/// A prompt's ids, and its text when the client sent text.
pub type SourcedPrompt = (Vec<u32>, Option<String>);

impl PromptSource for ChatFields {
    const PARAM: &'static str = "messages";
    const SPLITS_REASONING: bool = true;

    fn logprob_fields(&self) -> LogprobFields {
        LogprobFields::Chat {
            logprobs: self.logprobs,
            top_logprobs: self.top_logprobs,
        }
    }

    fn tool_request(&mut self) -> Result<Option<ToolRequest>, ValidationError> {
        let request = check_tool_request(ToolFields {
            tools: self.tools.as_ref(),
            tool_choice: self.tool_choice.as_ref(),
            parallel_tool_calls: self.parallel_tool_calls.as_ref(),
            functions: self.functions.as_ref(),
            function_call: self.function_call.as_ref(),
        })?;
        if let Some(request) = request.as_ref().filter(|request| request.legacy) {
            self.tools = Some(request.template_tools.clone());
        }
        Ok(request)
    }

    /// After the client's own system text, or as a system message of its own in front.
    fn add_tool_prompt(&mut self, text: String) {
        let messages = self.messages.get_or_insert_with(Vec::new);
        let first_system = messages
            .first_mut()
            .filter(|message| message.get("role").and_then(Value::as_str) == Some("system"));
        if let Some(content) = first_system.and_then(|message| message.get_mut("content")) {
            match content {
                Value::String(own) => {
                    *own = format!("{own}\n\n{text}");
                    return;
                }
                Value::Array(parts) => {
                    parts.push(json!({"type": "text", "text": text}));
                    return;
                }
                _ => {}
            }
        }
        messages.insert(0, json!({"role": "system", "content": text}));
    }

    /// Normalize messages → render the template with the generation prompt → tokenize without
    /// special tokens (the template already wrote them).
    async fn prompt_ids(
        self,
        assets: &ModelAssets,
        limits: &PromptLimits,
    ) -> Result<Vec<SourcedPrompt>, ValidationError> {
        limits.request.check_choices(1, limits.n, Self::PARAM)?;
        let prompt = render_chat(
            assets,
            self.messages,
            self.tools.as_ref(),
            true,
            self.chat_template_kwargs.as_ref(),
        )?;
        check_text_length(
            &assets.tokenizer,
            &prompt,
            limits.max_input_tokens,
            Self::PARAM,
        )?;
        // The text goes along for the reasoning split (where the prompt leaves the reply); a
        // chat prompt is never echoed.
        let ids = assets.tokenizer.encode(prompt.clone(), false).await?;
        Ok(vec![(ids, Some(prompt))])
    }
}

impl PromptSource for CompletionFields {
    const PARAM: &'static str = "prompt";

    fn logprob_fields(&self) -> LogprobFields {
        LogprobFields::Completions {
            logprobs: self.logprobs,
            echo: self.echo,
            best_of: self.best_of,
        }
    }

    /// Each prompt is tokenized with special tokens (BOS), or taken as ids.
    async fn prompt_ids(
        self,
        assets: &ModelAssets,
        limits: &PromptLimits,
    ) -> Result<Vec<SourcedPrompt>, ValidationError> {
        let prompts = parse_prompt(
            self.prompt
                .ok_or_else(|| ValidationError::missing("prompt"))?,
            limits,
            Self::PARAM,
        )?;
        // Every text first: a long one late in the list is refused before any is tokenized.
        for prompt in &prompts {
            if let PromptInput::Text(text) = prompt {
                check_text_length(
                    &assets.tokenizer,
                    text,
                    limits.max_input_tokens,
                    Self::PARAM,
                )?;
            }
        }
        let mut prompt_ids = Vec::with_capacity(prompts.len());
        for prompt in prompts {
            prompt_ids.push(match prompt {
                PromptInput::Text(text) => (
                    assets.tokenizer.encode(text.clone(), true).await?,
                    Some(text),
                ),
                PromptInput::Ids(ids) => (ids, None),
            });
        }
        Ok(prompt_ids)
    }
}
