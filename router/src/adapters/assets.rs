//! An adapter's own tokenizer and chat template, when its directory has them; the base model's
//! otherwise. Fine-tunes often change the chat format (and sometimes the special tokens), and
//! serving them with the base model's template is a classic source of silently wrong output.

use std::path::Path;

use super::AdapterError;
use crate::files::ConfinedDir;
use crate::template::{ChatTemplate, TemplateError};
use crate::tokenizer::{SpecialTokens, TextTokenizer};
use crate::validation::ModelAssets;

/// Reads the assets of the adapter `id` from `dir` (blocking file reads: call it off the async
/// runtime). A directory this machine cannot see (a shard on another host) means the base
/// model's assets. Every file must resolve inside `root` (the adapter root of a local adapter;
/// `None` for a hub download, whose root is its cache folder).
///
/// * tokenizer: the adapter's `tokenizer.json` (with its special tokens and generation config),
///   else the base model's;
/// * chat template: the adapter's (`chat_template.jinja`, `chat_template.json` or
///   `tokenizer_config.json`), else the base model's; `bos_token`/`eos_token` in it come from
///   the adapter's config files, else from the base model's template.
pub fn adapter_assets(
    id: &str,
    dir: &Path,
    root: Option<&Path>,
    base: &ModelAssets,
) -> Result<ModelAssets, AdapterError> {
    if !dir.is_dir() {
        return Ok(base.clone());
    }
    let unusable = |what: &'static str, message: String| AdapterError::Assets {
        id: id.to_owned(),
        what,
        message,
    };
    let confined = match root {
        Some(root) => ConfinedDir::new(dir, root),
        None => ConfinedDir::model_dir(dir),
    };
    let dir = confined.map_err(|error| {
        tracing::warn!(adapter = ?id, dir = ?dir, %error, "adapter directory refused");
        unusable("directory", "it is outside the adapter root".to_owned())
    })?;
    let dir = &dir;
    let template_error = |error: TemplateError| {
        let message = match error {
            TemplateError::File(file) => file.to_string(),
            TemplateError::Config { .. } | TemplateError::Raised(_) => error.to_string(),
            // The compiler's message gives positions in the file: logged, not shown.
            TemplateError::Syntax(_) | TemplateError::Render(_) => {
                tracing::warn!(adapter = ?id, %error, "adapter chat template does not compile");
                "the template does not compile".to_owned()
            }
        };
        unusable("chat template", message)
    };
    let tokenizer = if dir.has("tokenizer.json") {
        TextTokenizer::from_dir(dir).map_err(|error| unusable("tokenizer", error.to_string()))?
    } else {
        base.tokenizer.clone()
    };
    let own_tokens = SpecialTokens::from_dir(dir)
        .map_err(|error| unusable("tokenizer config", error.to_string()))?;
    let own_template = ChatTemplate::from_dir(dir).map_err(template_error)?;
    let adapters_own_template = own_template.is_some();
    let base_template = base.template.as_ref();
    let template = match own_template {
        Some(template) => Some(template),
        // The base template, but spelled with the adapter's special tokens if it has its own.
        None if own_tokens != SpecialTokens::default() => base_template
            .map(|base| ChatTemplate::new(base.source().to_owned(), None, None))
            .transpose()
            .map_err(template_error)?,
        None => {
            return Ok(ModelAssets {
                tokenizer,
                template: base.template.clone(),
                adapters_own_template: false,
            })
        }
    };
    let template = template
        .map(|template| with_token_fallback(template, &own_tokens, base))
        .transpose()
        .map_err(template_error)?;
    Ok(ModelAssets {
        tokenizer,
        template,
        adapters_own_template,
    })
}

/// The template with `bos_token`/`eos_token` filled from the adapter's own config files first,
/// then the base model's template, then the base tokenizer.
fn with_token_fallback(
    template: ChatTemplate,
    own: &SpecialTokens,
    base: &ModelAssets,
) -> Result<ChatTemplate, crate::template::TemplateError> {
    let base_template = base.template.as_ref();
    let pick = |own: Option<&str>,
                from_template: Option<&str>,
                from_base_template: Option<&str>,
                from_base_tokenizer: Option<&str>| {
        own.or(from_template)
            .or(from_base_template)
            .or(from_base_tokenizer)
            .map(str::to_owned)
    };
    let bos = pick(
        own.bos.as_deref(),
        template.bos_token(),
        base_template.and_then(ChatTemplate::bos_token),
        base.tokenizer.bos_token(),
    );
    let eos = pick(
        own.eos.as_deref(),
        template.eos_token(),
        base_template.and_then(ChatTemplate::eos_token),
        base.tokenizer.eos_token(),
    );
    if bos.as_deref() == template.bos_token() && eos.as_deref() == template.eos_token() {
        return Ok(template);
    }
    ChatTemplate::new(template.source().to_owned(), bos, eos)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn base() -> ModelAssets {
        ModelAssets {
            tokenizer: TextTokenizer::from_tokenizer(
                crate::tokenizer::test_support::byte_level_bpe(),
            ),
            template: Some(
                ChatTemplate::new(
                    "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                        .into(),
                    Some("<s>".into()),
                    Some("</s>".into()),
                )
                .unwrap(),
            ),
            adapters_own_template: false,
        }
    }

    fn render(assets: &ModelAssets) -> String {
        assets
            .template
            .as_ref()
            .unwrap()
            .render_with(
                &json!([{"role": "user", "content": "hi"}]),
                None,
                true,
                None,
            )
            .unwrap()
    }

    #[test]
    fn an_adapter_without_files_uses_the_base_assets() {
        let dir = tempfile::tempdir().unwrap();
        let base = base();
        let assets = adapter_assets("a", dir.path(), None, &base).unwrap();
        assert_eq!(render(&assets), "<s><user>hi");
        let missing = adapter_assets("a", &dir.path().join("elsewhere"), None, &base).unwrap();
        assert_eq!(render(&missing), "<s><user>hi");
        assert!(!assets.adapters_own_template && !missing.adapters_own_template);
    }

    #[test]
    fn an_adapter_template_wins_and_borrows_the_base_special_tokens() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("chat_template.jinja"),
            "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}{{ eos_token }}",
        )
        .unwrap();
        let assets = adapter_assets("a", dir.path(), None, &base()).unwrap();
        assert_eq!(render(&assets), "<s>[user] hi</s>");
        assert!(assets.adapters_own_template);
    }

    #[test]
    fn adapter_special_tokens_reach_the_base_template() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            r#"{"bos_token": "<|start|>"}"#,
        )
        .unwrap();
        let assets = adapter_assets("a", dir.path(), None, &base()).unwrap();
        assert_eq!(render(&assets), "<|start|><user>hi");
        // The base template spelled with the adapter's tokens is still the base model's.
        assert!(!assets.adapters_own_template);
    }

    #[test]
    fn a_broken_template_is_the_adapter_s_fault() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("chat_template.jinja"), "{% for %}").unwrap();
        let error = adapter_assets("a", dir.path(), None, &base()).unwrap_err();
        assert_eq!(error.code(), "invalid_adapter");
        assert!(error.to_string().contains("chat template"), "{error}");
    }

    #[test]
    fn files_linked_out_of_the_root_are_refused_without_saying_where() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("root");
        std::fs::create_dir_all(root.join("a")).unwrap();
        std::fs::write(tmp.path().join("secret.txt"), "SECRET {{ bos_token }}").unwrap();
        std::os::unix::fs::symlink(
            tmp.path().join("secret.txt"),
            root.join("a/chat_template.jinja"),
        )
        .unwrap();
        let error = adapter_assets("a", &root.join("a"), Some(&root), &base()).unwrap_err();
        assert_eq!(error.code(), "invalid_adapter");
        let message = error.to_string();
        assert!(message.contains("chat_template.jinja"), "{message}");
        assert!(!message.contains(tmp.path().to_str().unwrap()), "{message}");
        assert!(!message.contains("SECRET"), "{message}");
    }
}
