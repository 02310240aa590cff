//! `content: null` on a message (an assistant turn that only calls tools, as the OpenAI SDKs,
//! the Agents SDK and LangChain send it) reaches most templates as Python's `None`, and a
//! template written for string content breaks on it: `'…' + message['content']` raises, and
//! `{{ message['content'] }}` prints "None" (vLLM's "literal None" bug). mlx-vlm and vLLM give
//! such templates an empty string instead, and so does quiver.
//!
//! A template that tests the content itself (`message.content is none`, `… is not none`,
//! `… is defined`, `… is string`, `… == none`) can tell null from "" and may print them
//! differently (DeepSeek-R1's tool-call branch, Llama 3.1's tool results), so it keeps `None`
//! and renders exactly as transformers does. The rule, on the template's source:
//!
//! > the template tests content when the word `content` (a name, an attribute `.content`, or a
//! > key `['content']` / `.get('content')`, but not `reasoning_content` or `contents`) is
//! > followed — after any closing quotes, brackets and parentheses and whitespace — by the
//! > test keyword `is`, or by `==` / `!=` and `none` / `None`.
//!
//! Only the word `content` is looked at: a template that copies the content to a variable of
//! another name and tests that variable is not recognised (none in the corpus does).

/// Whether `source` tests a message's content (the rule above).
pub(super) fn tests_content(source: &str) -> bool {
    source.match_indices("content").any(|(at, word)| {
        let starts_word = !source[..at].ends_with(is_name_char);
        let rest = &source[at + word.len()..];
        starts_word && !rest.starts_with(is_name_char) && is_test(rest)
    })
}

/// Whether `rest` (what follows a mention of content) applies a test or a comparison with none.
fn is_test(rest: &str) -> bool {
    let rest = rest.trim_start_matches(['\'', '"', ']', ')']).trim_start();
    if let Some(after) = rest.strip_prefix("is") {
        return after.starts_with(char::is_whitespace);
    }
    let Some(after) = rest.strip_prefix("==").or_else(|| rest.strip_prefix("!=")) else {
        return false;
    };
    let after = after.trim_start();
    (after.starts_with("none") || after.starts_with("None"))
        && !after[4..].starts_with(is_name_char)
}

fn is_name_char(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

#[cfg(test)]
mod tests {
    use super::tests_content;

    #[test]
    fn tests_of_the_content_are_found() {
        for source in [
            "{% if message['content'] is none %}",
            "{% if message.content is not none %}",
            "{%- if message.content is defined -%}",
            "{% set c = message.content if message.content is string else '' %}",
            "{% if message.get(\"content\") is none %}",
            "{% if content == none %}",
            "{% if (message.content) != None %}",
        ] {
            assert!(tests_content(source), "{source}");
        }
    }

    #[test]
    fn uses_without_a_test_are_not() {
        for source in [
            "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' }}",
            "{% if message.content %}{{ message.content | trim }}{% endif %}",
            "{{ message.content or '' }}{% if tools is not none %}{% endif %}",
            "{% if message.reasoning_content is string %}{% endif %}",
            "{% if message.contents is none %}{% endif %}",
            "{% if content == nonesuch %}{% endif %}",
            "{{ message.content ~ 'island' }}",
        ] {
            assert!(!tests_content(source), "{source}");
        }
    }
}
