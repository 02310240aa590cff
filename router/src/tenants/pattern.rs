//! The adapter patterns of a keys file: an exact id, or a glob where `*` stands for any run of
//! characters (`/` and `@` included, so `acme/*` covers every revision of every acme adapter)
//! and `?` for exactly one. Nothing else is special: ids never contain brackets.

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdapterPattern(String);

impl AdapterPattern {
    pub fn new(text: &str) -> Result<Self, String> {
        if text.is_empty() {
            return Err("an adapter pattern is empty".to_owned());
        }
        Ok(Self(text.to_owned()))
    }

    /// Only stars: matches every id.
    pub fn is_everything(&self) -> bool {
        self.0.bytes().all(|b| b == b'*')
    }

    pub fn matches(&self, id: &str) -> bool {
        glob_matches(self.0.as_bytes(), id.as_bytes())
    }
}

/// Iterative wildcard matching with one backtrack point (the last `*`): linear in practice,
/// never exponential, whatever a pattern holds.
fn glob_matches(pattern: &[u8], text: &[u8]) -> bool {
    let (mut p, mut t) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while t < text.len() {
        match pattern.get(p) {
            Some(b'*') => {
                star = Some((p, t));
                p += 1;
            }
            Some(&c) if c == b'?' || c == text[t] => {
                // `?` stands for one character, not one byte.
                if c == b'?' {
                    t += utf8_width(text[t]);
                } else {
                    t += 1;
                }
                p += 1;
            }
            _ => match star {
                Some((star_p, star_t)) => {
                    p = star_p + 1;
                    t = star_t + utf8_width(text[star_t]);
                    star = Some((star_p, t));
                }
                None => return false,
            },
        }
    }
    pattern[p..].iter().all(|&c| c == b'*')
}

fn utf8_width(first: u8) -> usize {
    match first {
        0xF0.. => 4,
        0xE0.. => 3,
        0xC0.. => 2,
        _ => 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matches(pattern: &str, id: &str) -> bool {
        AdapterPattern::new(pattern).unwrap().matches(id)
    }

    #[test]
    fn exact_ids_match_only_themselves() {
        assert!(matches("acme/sql", "acme/sql"));
        assert!(!matches("acme/sql", "acme/sql2"));
        assert!(!matches("acme/sql", "acme/sq"));
        assert!(!matches("acme/sql", "ACME/sql"));
    }

    #[test]
    fn stars_cover_any_run_slashes_included() {
        assert!(matches("acme/*", "acme/sql"));
        assert!(matches("acme/*", "acme/sql@v2"));
        assert!(matches("acme/*", "acme/"));
        assert!(!matches("acme/*", "acme"));
        assert!(!matches("acme/*", "other/sql"));
        assert!(matches("*", "anything/at@all"));
        assert!(matches("*-sql", "team-a/orders-sql"));
        assert!(matches("a*b*c", "aXXbYYbZc"));
        assert!(!matches("a*b*c", "aXXbYYbZ"));
        assert!(matches("**", ""));
    }

    #[test]
    fn question_marks_take_one_character() {
        assert!(matches("v?", "v1"));
        assert!(!matches("v?", "v10"));
        assert!(matches("v?", "vé"));
        assert!(matches("*?é", "xyé"));
    }

    #[test]
    fn hostile_patterns_stay_fast() {
        let pattern = "*a".repeat(50);
        let text = "a".repeat(10_000) + "b";
        assert!(!matches(&pattern, &text));
    }

    #[test]
    fn empty_patterns_are_refused() {
        assert!(AdapterPattern::new("").is_err());
    }
}
