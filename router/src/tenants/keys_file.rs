//! `--api-keys-file`: the YAML that says who may call, with what, and how much.
//!
//! ```yaml
//! keys:
//!   - name: team-a                 # shown in logs and as the metrics' `key` label
//!     sha256: 5e884898da28...      # printf %s "$KEY" | sha256sum
//!     tenant: acme                 # default: the name; keys of one tenant share its turn
//!     prefix_cache_group: acme     # default: the tenant; cached prompt blocks stay inside it
//!     adapters: ["team-a/*", "shared-sql"]
//!     base_model: true
//!     admin: false
//!     limits: {max_concurrent_requests: 4, requests_per_minute: 60, tokens_per_minute: 20000}
//! ```
//!
//! Unknown fields are refused, so a misspelt `adimn` never silently grants less, or more.

use std::collections::HashSet;
use std::path::Path;

use serde::Deserialize;

use super::digest::KeyDigest;
use super::pattern::AdapterPattern;

/// What one key may do, as the file says it.
#[derive(Debug, Clone)]
pub struct KeyPolicy {
    pub name: String,
    pub digest: KeyDigest,
    /// Whose requests these are: tenants take turns in each adapter's queue.
    pub tenant: String,
    /// Requests reuse cached prompt blocks only of requests in the same group.
    pub prefix_cache_group: String,
    pub adapters: Vec<AdapterPattern>,
    pub base_model: bool,
    pub admin: bool,
    pub limits: KeyLimits,
}

/// Per-key limits; `None` is no limit of that kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeyLimits {
    pub max_concurrent_requests: Option<u32>,
    pub requests_per_minute: Option<u32>,
    pub tokens_per_minute: Option<u64>,
}

impl KeyPolicy {
    /// The one key of `--api-key`: everything, admin included, no limits.
    pub fn single_admin(key: &str) -> Self {
        Self {
            name: "api-key".to_owned(),
            digest: KeyDigest::of_key(key),
            tenant: "api-key".to_owned(),
            prefix_cache_group: "api-key".to_owned(),
            adapters: vec![AdapterPattern::new("*").expect("not empty")],
            base_model: true,
            admin: true,
            limits: KeyLimits::default(),
        }
    }

    pub fn may_use_adapter(&self, id: &str) -> bool {
        self.adapters.iter().any(|pattern| pattern.matches(id))
    }

    /// A lone `*` among the patterns: nothing is out of reach.
    pub fn may_use_all_adapters(&self) -> bool {
        self.adapters.iter().any(AdapterPattern::is_everything)
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct KeysFile {
    keys: Vec<KeyEntry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct KeyEntry {
    name: String,
    sha256: String,
    tenant: Option<String>,
    prefix_cache_group: Option<String>,
    #[serde(default)]
    adapters: Vec<String>,
    #[serde(default)]
    base_model: bool,
    #[serde(default)]
    admin: bool,
    #[serde(default)]
    limits: KeyLimits,
}

/// Reads and checks the file. Messages name the file and the entry, never a digest.
pub fn read_keys_file(path: &Path) -> Result<Vec<KeyPolicy>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|error| format!("cannot read {}: {error}", path.display()))?;
    parse_keys(&text).map_err(|error| format!("{}: {error}", path.display()))
}

pub fn parse_keys(text: &str) -> Result<Vec<KeyPolicy>, String> {
    let file: KeysFile = serde_norway::from_str(text).map_err(|error| error.to_string())?;
    let mut names = HashSet::new();
    let mut policies: Vec<KeyPolicy> = Vec::with_capacity(file.keys.len());
    for (index, entry) in file.keys.into_iter().enumerate() {
        let at = format!("keys[{index}]");
        let policy = entry_policy(entry).map_err(|error| format!("{at}: {error}"))?;
        if !names.insert(policy.name.clone()) {
            return Err(format!("{at}: the name `{}` is used twice", policy.name));
        }
        if let Some(other) = policies.iter().find(|p| p.digest.matches(&policy.digest)) {
            return Err(format!(
                "{at}: `{}` has the same sha256 as `{}`",
                policy.name, other.name
            ));
        }
        policies.push(policy);
    }
    Ok(policies)
}

fn entry_policy(entry: KeyEntry) -> Result<KeyPolicy, String> {
    if !valid_name(&entry.name) {
        return Err(format!(
            "name `{}` must be 1 to 64 letters, digits, `-`, `_` or `.` (it is a metric label)",
            entry.name
        ));
    }
    let at = |error: String| format!("`{}`: {error}", entry.name);
    let tenant = entry.tenant.unwrap_or_else(|| entry.name.clone());
    let prefix_cache_group = entry.prefix_cache_group.unwrap_or_else(|| tenant.clone());
    for (field, value) in [
        ("tenant", &tenant),
        ("prefix_cache_group", &prefix_cache_group),
    ] {
        if !valid_name(value) {
            return Err(at(format!(
                "{field} `{value}` must be 1 to 64 letters, digits, `-`, `_` or `.`"
            )));
        }
    }
    let digest = KeyDigest::from_hex(&entry.sha256).map_err(at)?;
    let adapters = entry
        .adapters
        .iter()
        .map(|pattern| AdapterPattern::new(pattern))
        .collect::<Result<_, _>>()
        .map_err(at)?;
    let limits = entry.limits;
    if limits.max_concurrent_requests == Some(0)
        || limits.requests_per_minute == Some(0)
        || limits.tokens_per_minute == Some(0)
    {
        return Err(at(
            "a limit of 0 would refuse every request; remove the key instead".to_owned(),
        ));
    }
    Ok(KeyPolicy {
        name: entry.name,
        digest,
        tenant,
        prefix_cache_group,
        adapters,
        base_model: entry.base_model,
        admin: entry.admin,
        limits,
    })
}

fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `printf %s a | sha256sum`, and the same for `b`.
    const SHA_A: &str = "ca978112ca1bbdcafac231b39a23dc4da786eff8147c4e72b9807785afee48bb";
    const SHA_B: &str = "3e23e8160039594a33894f6564e1b1348bbd7a0088d42c4acb73eeaed59c009d";

    #[test]
    fn reads_every_field() {
        let text = format!(
            "keys:\n\
             - name: team-a\n  sha256: {SHA_A}\n  adapters: [\"team-a/*\", shared]\n  \
               base_model: true\n  limits: {{max_concurrent_requests: 2, tokens_per_minute: 100}}\n\
             - name: ops\n  sha256: {SHA_B}\n  admin: true\n"
        );
        let keys = parse_keys(&text).unwrap();
        assert_eq!(keys.len(), 2);
        let a = &keys[0];
        assert_eq!(a.name, "team-a");
        assert!(a.digest.matches(&KeyDigest::of_key("a")));
        assert!(a.base_model && !a.admin);
        assert!(a.may_use_adapter("team-a/x") && a.may_use_adapter("shared"));
        assert!(!a.may_use_adapter("team-b/x"));
        assert_eq!(
            a.limits,
            KeyLimits {
                max_concurrent_requests: Some(2),
                requests_per_minute: None,
                tokens_per_minute: Some(100),
            }
        );
        let ops = &keys[1];
        assert!(ops.admin && !ops.base_model && ops.adapters.is_empty());
        // A key is its own tenant and cache group unless the file says otherwise.
        assert_eq!(
            (a.tenant.as_str(), a.prefix_cache_group.as_str()),
            ("team-a", "team-a")
        );
    }

    #[test]
    fn keys_share_a_tenant_and_tenants_a_cache_group_when_told() {
        let text = format!(
            "keys:\n\
             - {{name: a-ci, sha256: {SHA_A}, tenant: acme}}\n\
             - {{name: b, sha256: {SHA_B}, tenant: beta, prefix_cache_group: public}}\n"
        );
        let keys = parse_keys(&text).unwrap();
        assert_eq!(
            (keys[0].tenant.as_str(), keys[0].prefix_cache_group.as_str()),
            ("acme", "acme")
        );
        assert_eq!(
            (keys[1].tenant.as_str(), keys[1].prefix_cache_group.as_str()),
            ("beta", "public")
        );
        let bad = format!("keys:\n- {{name: a, sha256: {SHA_A}, tenant: 'a b'}}\n");
        assert!(parse_keys(&bad).unwrap_err().contains("tenant"));
    }

    #[test]
    fn refuses_what_would_be_misread() {
        let entry = |extra: &str| format!("keys:\n- name: a\n  sha256: {SHA_A}\n{extra}");
        for (text, says) in [
            (entry("  adimn: true\n"), "unknown field"),
            (entry("  limits: {rpm: 3}\n"), "unknown field"),
            (entry("  limits: {requests_per_minute: 0}\n"), "limit of 0"),
            (entry("  adapters: [\"\"]\n"), "empty"),
            ("keys:\n- name: a\n  sha256: abc\n".to_owned(), "64 hex"),
            (format!("keys:\n- name: 'a b'\n  sha256: {SHA_A}\n"), "name"),
            (
                format!("keys:\n- {{name: a, sha256: {SHA_A}}}\n- {{name: a, sha256: {SHA_B}}}\n"),
                "used twice",
            ),
            (
                format!("keys:\n- {{name: a, sha256: {SHA_A}}}\n- {{name: b, sha256: {SHA_A}}}\n"),
                "same sha256",
            ),
            ("keys: 3\n".to_owned(), "keys"),
        ] {
            let error = parse_keys(&text).unwrap_err();
            assert!(error.contains(says), "{text:?}: {error}");
            assert!(!error.contains(SHA_A), "{error}");
        }
    }

    #[test]
    fn the_single_key_may_do_everything() {
        let policy = KeyPolicy::single_admin("sekret");
        assert!(policy.admin && policy.base_model && policy.may_use_adapter("any/thing"));
        assert!(policy.digest.matches(&KeyDigest::of_key("sekret")));
    }
}
