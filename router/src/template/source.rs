//! Rewrites of the template text where Jinja2 and minijinja differ in a way no hook can fix.
//!
//! * `{% generation %}…{% endgeneration %}` (transformers' AssistantTracker extension) renders
//!   its body inside a caller macro, i.e. in its own scope. minijinja has no custom tags, so the
//!   tags become `{% with %}…{% endwith %}`: same scope rule, and the same delimiters and
//!   whitespace-control markers, so trim/lstrip behave exactly as around the original tag.
//! * `{% for x in EXPR %}`: Jinja2 raises when EXPR is None ("'NoneType' object is not
//!   iterable" — e.g. a tool template looping over `tools` when the request has none), but
//!   minijinja iterates none as empty. The loop becomes `{% for x in (EXPR) | FILTER %}` with a
//!   filter that rejects none and passes everything else through unchanged.
//!
//! The scan understands just enough Jinja syntax to find block tags: comments, `{{ … }}`
//! expressions, string literals (which may contain `%}`), and `{% raw %}` sections.

/// The filter the `for` rewrite inserts (see [`super::environment`]).
pub const ITERABLE_FILTER: &str = "quiver_python_iterable";

pub fn prepare(source: &str) -> String {
    let mut out = String::with_capacity(source.len() + 64);
    let mut rest = source;
    while let Some(start) = rest.find('{') {
        out.push_str(&rest[..start]);
        rest = &rest[start..];
        let (consumed, replacement) = if rest.starts_with("{#") {
            let end = rest.find("#}").map_or(rest.len(), |end| end + 2);
            (end, None)
        } else if rest.starts_with("{{") {
            (expression_end(rest, 2, "}}"), None)
        } else if rest.starts_with("{%") {
            let end = expression_end(rest, 2, "%}");
            let tag = &rest[..end];
            if tag_body(tag).map(|body| body.trim()) == Some("raw") {
                (raw_block_end(rest, end), None)
            } else {
                (end, rewrite_tag(tag))
            }
        } else {
            (1, None)
        };
        out.push_str(replacement.as_deref().unwrap_or(&rest[..consumed]));
        rest = &rest[consumed..];
    }
    out.push_str(rest);
    out
}

/// Byte offset just past `close`, scanning from `from` and skipping string literals.
fn expression_end(text: &str, from: usize, close: &str) -> usize {
    let bytes = text.as_bytes();
    let mut idx = from;
    while idx < bytes.len() {
        match bytes[idx] {
            quote @ (b'\'' | b'"') => idx = string_end(bytes, idx, quote),
            _ if text[idx..].starts_with(close) => return idx + close.len(),
            _ => idx += 1,
        }
    }
    text.len()
}

/// Offset just past the string literal opening at `start` (backslash escapes honoured).
fn string_end(bytes: &[u8], start: usize, quote: u8) -> usize {
    let mut idx = start + 1;
    while idx < bytes.len() {
        match bytes[idx] {
            b'\\' => idx += 2,
            b if b == quote => return idx + 1,
            _ => idx += 1,
        }
    }
    bytes.len()
}

/// Offset just past the `{% endraw %}` closing a raw section whose opening tag ends at `from`.
fn raw_block_end(text: &str, from: usize) -> usize {
    let mut search = from;
    while let Some(offset) = text[search..].find("{%") {
        let start = search + offset;
        let end = text[start..]
            .find("%}")
            .map_or(text.len(), |end| start + end + 2);
        if tag_body(&text[start..end]).map(|body| body.trim()) == Some("endraw") {
            return end;
        }
        search = start + 2;
    }
    text.len()
}

/// The inside of `{%- … -%}` without delimiters and whitespace markers.
fn tag_body(tag: &str) -> Option<&str> {
    let inner = tag.strip_prefix("{%")?.strip_suffix("%}")?;
    let inner = inner.strip_prefix(['-', '+']).unwrap_or(inner);
    Some(inner.strip_suffix(['-', '+']).unwrap_or(inner))
}

/// The rewritten tag, or `None` to keep it as it is.
fn rewrite_tag(tag: &str) -> Option<String> {
    let body = tag_body(tag)?;
    let body_start = body.as_ptr() as usize - tag.as_ptr() as usize;
    let (head, tail) = (&tag[..body_start], &tag[body_start + body.len()..]);
    let keyword = body.trim();
    let new_body = match keyword {
        "generation" => " with ".to_owned(),
        "endgeneration" => " endwith ".to_owned(),
        _ => rewrite_for(body)?,
    };
    Some(format!("{head}{new_body}{tail}"))
}

/// `for TARGET in EXPR [if COND] [recursive]` → `for TARGET in (EXPR) | FILTER …`.
fn rewrite_for(body: &str) -> Option<String> {
    let words = top_level_words(body);
    let (first, first_start, _) = *words.first()?;
    if first != "for" || first_start != body.len() - body.trim_start().len() {
        return None;
    }
    let &(_, _, iter_start) = words.iter().find(|(word, _, _)| *word == "in")?;
    let iter_end = words
        .iter()
        .find(|(word, start, _)| *start > iter_start && matches!(*word, "if" | "recursive"))
        .map_or(body.trim_end().len(), |&(_, start, _)| start);
    let iterable = body[iter_start..iter_end].trim();
    Some(format!(
        "{} ({iterable}) | {ITERABLE_FILTER} {}",
        &body[..iter_start],
        body[iter_end..].trim_start()
    ))
}

/// Identifiers outside strings and brackets, with their start and end offsets.
fn top_level_words(body: &str) -> Vec<(&str, usize, usize)> {
    let bytes = body.as_bytes();
    let mut words = Vec::new();
    let mut depth = 0usize;
    let mut idx = 0;
    while idx < bytes.len() {
        let byte = bytes[idx];
        match byte {
            b'\'' | b'"' => idx = string_end(bytes, idx, byte),
            b'(' | b'[' | b'{' => {
                depth += 1;
                idx += 1;
            }
            b')' | b']' | b'}' => {
                depth = depth.saturating_sub(1);
                idx += 1;
            }
            b if b.is_ascii_alphabetic() || b == b'_' => {
                let start = idx;
                while idx < bytes.len()
                    && (bytes[idx].is_ascii_alphanumeric() || bytes[idx] == b'_')
                {
                    idx += 1;
                }
                // `x.in` is an attribute, not the keyword.
                let is_attribute = start > 0 && bytes[start - 1] == b'.';
                if depth == 0 && !is_attribute {
                    words.push((&body[start..idx], start, idx));
                }
            }
            b if b.is_ascii_digit() => {
                while idx < bytes.len()
                    && (bytes[idx].is_ascii_alphanumeric() || bytes[idx] == b'.')
                {
                    idx += 1;
                }
            }
            _ => idx += 1,
        }
    }
    words
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generation_tags_become_scoped_blocks() {
        assert_eq!(
            prepare("a{% generation %}b{%- endgeneration -%}c{%+generation+%}"),
            "a{% with %}b{%- endwith -%}c{%+ with +%}"
        );
    }

    #[test]
    fn for_loops_get_the_none_check() {
        let f = ITERABLE_FILTER;
        assert_eq!(
            prepare("{%- for m in messages %}x{% endfor %}"),
            format!("{{%- for m in (messages) | {f} %}}x{{% endfor %}}")
        );
        assert_eq!(
            prepare("{% for k, v in d.items() if v.in recursive -%}"),
            format!("{{% for k, v in (d.items()) | {f} if v.in recursive -%}}")
        );
        assert_eq!(
            prepare("{% for x in ['if', \"%}\", (a if b else c)] if x %}"),
            format!("{{% for x in (['if', \"%}}\", (a if b else c)]) | {f} if x %}}")
        );
    }

    #[test]
    fn strings_comments_and_raw_blocks_are_left_alone() {
        let text = "{{ '{% for x in y %}' }}{# {% for a in b %} #}\
                    {% raw %}{% for q in r %}{% endraw %}{% set s = \"%}\" %}";
        assert_eq!(prepare(text), text);
    }
}
