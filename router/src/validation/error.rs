//! What validation refuses, with the request field it is about.

use crate::template::TemplateError;
use crate::tokenizer::TokenizerError;

#[derive(Debug, thiserror::Error)]
pub enum ValidationError {
    /// A field is missing, has the wrong shape or is out of range.
    #[error("{message}")]
    Invalid {
        param: String,
        code: &'static str,
        message: String,
    },
    /// The chat template called `raise_exception`: its message is meant for the user.
    #[error("{0}")]
    TemplateRaised(String),
    #[error("chat template error: {0}")]
    Template(TemplateError),
    #[error("this model has no chat template; use /v1/completions with a prompt instead")]
    NoChatTemplate,
    #[error("tokenizer error: {0}")]
    Tokenizer(#[from] TokenizerError),
}

impl ValidationError {
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self::Invalid {
            param: param.into(),
            code: "invalid_value",
            message: message.into(),
        }
    }

    pub(super) fn missing(param: &str) -> Self {
        Self::Invalid {
            param: param.to_owned(),
            code: "missing_required_parameter",
            message: format!("you must provide `{param}`"),
        }
    }

    /// The request field the error is about, for the error body's `param`.
    pub fn param(&self) -> Option<&str> {
        match self {
            Self::Invalid { param, .. } => Some(param),
            Self::TemplateRaised(_) | Self::Template(_) | Self::NoChatTemplate => Some("messages"),
            Self::Tokenizer(_) => None,
        }
    }

    /// Stable machine-readable code (also a metric label).
    pub fn code(&self) -> &'static str {
        match self {
            Self::Invalid { code, .. } => code,
            Self::TemplateRaised(_) | Self::Template(_) => "chat_template_error",
            Self::NoChatTemplate => "no_chat_template",
            Self::Tokenizer(_) => "tokenizer_error",
        }
    }

    /// Whether the client caused it (400) rather than the server (500).
    pub fn is_client_error(&self) -> bool {
        !matches!(self, Self::Tokenizer(_))
    }
}

impl From<TemplateError> for ValidationError {
    fn from(error: TemplateError) -> Self {
        match error {
            TemplateError::Raised(message) => Self::TemplateRaised(message),
            other => Self::Template(other),
        }
    }
}
