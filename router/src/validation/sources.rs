//! Where each endpoint's prompts come from: chat renders its messages with the chat template,
//! completions tokenize (or take as ids) each `prompt`.

use std::future::Future;

use super::bounds::{check_text_length, PromptLimits};
use super::messages::render_chat;
use super::prompt::{parse_prompt, PromptInput};
use super::{ModelAssets, ValidationError};
use crate::openai::chat::ChatFields;
use crate::openai::completions::CompletionFields;

/// An endpoint's own request fields, which decide how its prompts are built.
pub trait PromptSource: Send {
    /// The request field the prompts come from, named in errors about them.
    const PARAM: &'static str;

    /// The token ids of each prompt, after the checks that only these fields need. Prompts
    /// beyond `limits` are refused before they are tokenized.
    fn prompt_ids(
        self,
        assets: &ModelAssets,
        limits: &PromptLimits,
    ) -> impl Future<Output = Result<Vec<Vec<u32>>, ValidationError>> + Send;
}

impl PromptSource for ChatFields {
    const PARAM: &'static str = "messages";

    /// Normalize messages → render the template with the generation prompt → tokenize without
    /// special tokens (the template already wrote them).
    async fn prompt_ids(
        self,
        assets: &ModelAssets,
        limits: &PromptLimits,
    ) -> Result<Vec<Vec<u32>>, ValidationError> {
        limits.request.check_choices(1, limits.n, Self::PARAM)?;
        let prompt = render_chat(assets, self.messages, self.tools.as_ref(), true)?;
        check_text_length(
            &assets.tokenizer,
            &prompt,
            limits.max_input_tokens,
            Self::PARAM,
        )?;
        Ok(vec![assets.tokenizer.encode(prompt, false).await?])
    }
}

impl PromptSource for CompletionFields {
    const PARAM: &'static str = "prompt";

    /// Each prompt is tokenized with special tokens (BOS), or taken as ids.
    async fn prompt_ids(
        self,
        assets: &ModelAssets,
        limits: &PromptLimits,
    ) -> Result<Vec<Vec<u32>>, ValidationError> {
        if self.echo == Some(true) {
            return Err(ValidationError::invalid("echo", "`echo` is not supported"));
        }
        let prompts = parse_prompt(
            self.prompt
                .ok_or_else(|| ValidationError::missing("prompt"))?,
            limits,
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
                PromptInput::Text(text) => assets.tokenizer.encode(text, true).await?,
                PromptInput::Ids(ids) => ids,
            });
        }
        Ok(prompt_ids)
    }
}
