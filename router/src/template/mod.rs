//! Chat templates: a model's Jinja chat template rendered with minijinja exactly as
//! transformers' `apply_chat_template(..., tokenize=False)` renders it with Jinja2.
//!
//! Where the template comes from (first found wins, as in transformers):
//! `chat_template.jinja`, then `chat_template.json` (`{"chat_template": ...}`), then the
//! `chat_template` entry of `tokenizer_config.json` — a string, or a list of
//! `{"name", "template"}` of which the one named `default` is used.

mod environment;
mod null_content;
mod pyjson;
mod python;
mod source;

use minijinja::value::{Serde, Value};
use serde_json::Value as Json;

pub use environment::RaisedByTemplate;

use crate::files::{ConfinedDir, FileError};

/// What `strftime_now()` reads. Production uses the local wall clock; tests freeze it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Clock {
    Local,
    Fixed(chrono::NaiveDateTime),
}

#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    /// The template called `raise_exception(msg)`: the conversation is not one this model
    /// accepts (e.g. a system message for a model without one). The client's fault: HTTP 400.
    #[error("{0}")]
    Raised(String),
    /// The template does not parse.
    #[error("invalid chat template: {0}")]
    Syntax(String),
    /// Rendering failed inside the template (e.g. it iterated over `tools` when there are none).
    #[error("chat template failed to render: {0}")]
    Render(String),
    /// A file of the model's directory is unusable; names only the file.
    #[error("{0}")]
    File(#[from] FileError),
    /// A model file that should describe the template is malformed.
    #[error("invalid {file}: {message}")]
    Config { file: &'static str, message: String },
}

/// A compiled chat template plus the special tokens it may print. Cheap to share behind an
/// `Arc`; `render` takes `&self` and can run on many threads at once.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    source: String,
    bos_token: Option<String>,
    eos_token: Option<String>,
    /// The template never tests content, so null content reaches it as "" (`null_content`).
    null_content_as_empty: bool,
    env: minijinja::Environment<'static>,
}

impl ChatTemplate {
    /// Compiles `source`; `bos`/`eos` are visible to the template as `bos_token`/`eos_token`
    /// (left undefined when `None`, as transformers does). `strftime_now` uses the local clock.
    pub fn new(
        source: String,
        bos: Option<String>,
        eos: Option<String>,
    ) -> Result<Self, TemplateError> {
        Self::with_clock(source, bos, eos, Clock::Local)
    }

    /// As [`ChatTemplate::new`] with an explicit clock for `strftime_now`.
    pub fn with_clock(
        source: String,
        bos: Option<String>,
        eos: Option<String>,
        clock: Clock,
    ) -> Result<Self, TemplateError> {
        let env = environment::build(source::prepare(&source), clock)
            .map_err(|err| TemplateError::Syntax(err.to_string()))?;
        Ok(Self {
            null_content_as_empty: !null_content::tests_content(&source),
            source,
            bos_token: bos,
            eos_token: eos,
            env,
        })
    }

    /// Loads the template of a model or adapter directory, or `Ok(None)` when it has none.
    /// `bos_token`/`eos_token` come from `tokenizer_config.json` (or `special_tokens_map.json`).
    pub fn from_dir(dir: &ConfinedDir) -> Result<Option<Self>, TemplateError> {
        let Some(source) = load_source(dir)? else {
            return Ok(None);
        };
        let tokens = crate::tokenizer::SpecialTokens::from_dir(dir).map_err(|err| match err {
            crate::tokenizer::TokenizerError::Load(file) => TemplateError::File(file),
            other => TemplateError::Config {
                file: "tokenizer_config.json",
                message: other.to_string(),
            },
        })?;
        Self::new(source, tokens.bos, tokens.eos).map(Some)
    }

    /// The template text as given (before the rewrites of [`source::prepare`]).
    pub fn source(&self) -> &str {
        &self.source
    }

    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    /// Renders a conversation. `messages` is the OpenAI-style list of message objects (their
    /// keys reach the template in the order given); `tools` the list of tool schemas; `extra`
    /// more template variables (`chat_template_kwargs`, as transformers'
    /// `apply_chat_template(**kwargs)`): they may replace `bos_token` and `eos_token`, not the
    /// conversation's own variables (the caller refuses those names).
    pub fn render_with(
        &self,
        messages: &Json,
        tools: Option<&Json>,
        add_generation_prompt: bool,
        kwargs: Option<&serde_json::Map<String, Json>>,
    ) -> Result<String, TemplateError> {
        let messages = template_messages(messages, self.null_content_as_empty);
        let mut context = Vec::new();
        if let Some(bos) = &self.bos_token {
            context.push(("bos_token", Value::from(bos.as_str())));
        }
        if let Some(eos) = &self.eos_token {
            context.push(("eos_token", Value::from(eos.as_str())));
        }
        for (name, value) in kwargs.into_iter().flatten() {
            context.push((name.as_str(), Value::from(Serde(value))));
        }
        // `tools` and `documents` are always defined (none when absent) so that templates
        // testing `tools is not none` behave as under transformers.
        context.extend([
            ("messages", Value::from(Serde(&messages))),
            (
                "tools",
                tools.map_or(Value::from(()), |tools| Value::from(Serde(tools))),
            ),
            ("documents", Value::from(())),
            ("add_generation_prompt", Value::from(add_generation_prompt)),
        ]);
        let context = Value::from_pairs(context);
        let template = self
            .env
            .get_template(environment::TEMPLATE_NAME)
            .map_err(|err| TemplateError::Syntax(err.to_string()))?;
        template
            .render(context)
            .map_err(|err| match raised_message(&err) {
                Some(message) => TemplateError::Raised(message),
                None => TemplateError::Render(err.to_string()),
            })
    }
}

/// The messages as the template sees them. transformers copies a message's reasoning, given
/// under any of its names, to `reasoning_content` (the standard name templates read) and
/// `thinking` (gpt-oss templates): `{"thinking": r, **message, "reasoning_content": r}`. With
/// `null_content_as_empty`, a null `content` becomes "" (`null_content`).
fn template_messages(messages: &Json, null_content_as_empty: bool) -> Json {
    const REASONING_FIELDS: [&str; 3] = ["reasoning_content", "thinking", "reasoning"];
    let Some(list) = messages.as_array() else {
        return messages.clone();
    };
    let aliased = list
        .iter()
        .map(|message| {
            let Some(fields) = message.as_object() else {
                return message.clone();
            };
            let reasoning = REASONING_FIELDS
                .iter()
                .find_map(|key| fields.get(*key).filter(|value| !value.is_null()));
            let mut out = serde_json::Map::new();
            if let Some(reasoning) = reasoning {
                out.insert("thinking".into(), reasoning.clone());
            }
            for (key, value) in fields {
                let empty = null_content_as_empty && key == "content" && value.is_null();
                let value = if empty { Json::from("") } else { value.clone() };
                out.insert(key.clone(), value);
            }
            if let Some(reasoning) = reasoning {
                out.insert("reasoning_content".into(), reasoning.clone());
            }
            Json::Object(out)
        })
        .collect();
    Json::Array(aliased)
}

/// The message of a `raise_exception` anywhere in the error's source chain.
fn raised_message(err: &minijinja::Error) -> Option<String> {
    let mut current: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(error) = current {
        if let Some(raised) = error.downcast_ref::<RaisedByTemplate>() {
            return Some(raised.0.clone());
        }
        current = error.source();
    }
    None
}

fn load_source(dir: &ConfinedDir) -> Result<Option<String>, TemplateError> {
    if let Some(source) = dir.read_text("chat_template.jinja")? {
        return Ok(Some(source));
    }
    for file in ["chat_template.json", "tokenizer_config.json"] {
        let Some(config) = dir.read_json(file)? else {
            continue;
        };
        if let Some(entry) = config.get("chat_template").filter(|v| !v.is_null()) {
            return pick_template(entry)
                .map(Some)
                .map_err(|message| TemplateError::Config { file, message });
        }
    }
    Ok(None)
}

/// A `chat_template` entry: the template itself, or named templates of which `default` is used.
fn pick_template(entry: &Json) -> Result<String, String> {
    if let Some(source) = entry.as_str() {
        return Ok(source.to_owned());
    }
    let Some(named) = entry.as_array() else {
        return Err("`chat_template` must be a string or a list of {name, template}".into());
    };
    named
        .iter()
        .find(|item| item.get("name").and_then(Json::as_str) == Some("default"))
        .and_then(|item| item.get("template"))
        .and_then(Json::as_str)
        .map(str::to_owned)
        .ok_or_else(|| "several chat templates but none named `default`".into())
}

#[cfg(test)]
mod tests;
