//! Who may call, and with what: `--api-key` (one key that may do everything) or
//! `--api-keys-file` (named keys, each with the adapters it may use, whether it may use the base
//! model, whether it may load and unload adapters, and limits of its own).
//!
//! The HTTP layer asks [`Tenants::authenticate`] for the [`Caller`] behind a request's bearer
//! token and consults it wherever a model is named; `reload` swaps the file's keys in place
//! (SIGHUP), while requests already admitted keep the grant they started with.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

mod digest;
mod keys_file;
mod limiter;
mod metrics;
mod pattern;
mod reload;

pub use digest::KeyDigest;
pub use keys_file::{parse_keys, KeyLimits, KeyPolicy};
pub use limiter::{InFlight, KeyUsage, LimitExceeded, LimitKind};
pub use reload::{catch_sighup, reload_on_sighup};

/// Where the keys come from.
#[derive(Debug)]
enum KeySource {
    /// No authentication: every caller may do everything.
    Open,
    /// `--api-key`.
    Single,
    /// `--api-keys-file`, read again on reload.
    File(PathBuf),
}

#[derive(Debug)]
pub struct Tenants {
    source: KeySource,
    keys: RwLock<Arc<Vec<Arc<KeyPolicy>>>>,
    /// By key name, kept across reloads so limits and counters carry on.
    usage: Mutex<HashMap<String, Arc<KeyUsage>>>,
}

/// The caller of one request, as its key grants.
#[derive(Debug, Clone)]
pub enum Caller {
    /// No keys are configured.
    Anyone,
    Key {
        policy: Arc<KeyPolicy>,
        usage: Arc<KeyUsage>,
    },
}

impl Tenants {
    /// Open, one key, or a keys file; both at once is refused (the flags conflict too), since
    /// neither reading, the single key as one more admin or the file alone, is obviously meant.
    pub fn new(api_key: Option<&str>, keys_file: Option<PathBuf>) -> Result<Self, String> {
        let (source, keys) = match (api_key, keys_file) {
            (Some(_), Some(_)) => {
                return Err(
                    "--api-key and --api-keys-file cannot be used together; put the \
                            admin key in the file"
                        .to_owned(),
                )
            }
            (Some(key), None) => (KeySource::Single, vec![KeyPolicy::single_admin(key)]),
            (None, Some(path)) => {
                let keys = keys_file::read_keys_file(&path)?;
                (KeySource::File(path), keys)
            }
            (None, None) => (KeySource::Open, Vec::new()),
        };
        Ok(Self {
            source,
            keys: RwLock::new(Arc::new(keys.into_iter().map(Arc::new).collect())),
            usage: Mutex::default(),
        })
    }

    /// Reads the keys file again and serves its keys from now on; on an error the keys in use
    /// stay. Returns how many keys the file holds.
    pub fn reload(&self) -> Result<usize, String> {
        let KeySource::File(path) = &self.source else {
            return Err("no --api-keys-file to reload".to_owned());
        };
        let keys = keys_file::read_keys_file(path)?;
        let count = keys.len();
        *self.keys.write().unwrap_or_else(|p| p.into_inner()) =
            Arc::new(keys.into_iter().map(Arc::new).collect());
        Ok(count)
    }

    pub fn reloadable(&self) -> bool {
        matches!(self.source, KeySource::File(_))
    }

    /// The caller behind `Authorization`'s value; `None` for a missing or unknown key. Every
    /// configured digest is compared, in constant time each, whichever matches.
    pub fn authenticate(&self, authorization: Option<&str>) -> Option<Caller> {
        if let KeySource::Open = self.source {
            return Some(Caller::Anyone);
        }
        let presented = authorization?.strip_prefix("Bearer ")?.trim();
        let digest = KeyDigest::of_key(presented);
        let keys = Arc::clone(&self.keys.read().unwrap_or_else(|p| p.into_inner()));
        let mut found = None;
        for policy in keys.iter() {
            if policy.digest.matches(&digest) {
                found = Some(Arc::clone(policy));
            }
        }
        let policy = found?;
        let usage = self.usage_of(&policy.name);
        Some(Caller::Key { policy, usage })
    }

    fn usage_of(&self, name: &str) -> Arc<KeyUsage> {
        let mut usage = self.usage.lock().unwrap_or_else(|p| p.into_inner());
        Arc::clone(usage.entry(name.to_owned()).or_default())
    }

    /// Every key that has called so far, by name.
    pub fn usage_by_key(&self) -> BTreeMap<String, Arc<KeyUsage>> {
        let usage = self.usage.lock().unwrap_or_else(|p| p.into_inner());
        usage
            .iter()
            .map(|(name, usage)| (name.clone(), Arc::clone(usage)))
            .collect()
    }

    /// Appends the per-key series to a `/metrics` page.
    pub fn render_metrics(&self, out: &mut String) {
        metrics::render(&self.usage_by_key(), out);
    }
}

impl Caller {
    pub fn may_use_base_model(&self) -> bool {
        match self {
            Self::Anyone => true,
            Self::Key { policy, .. } => policy.base_model,
        }
    }

    pub fn may_use_adapter(&self, id: &str) -> bool {
        match self {
            Self::Anyone => true,
            Self::Key { policy, .. } => policy.may_use_adapter(id),
        }
    }

    /// May load and unload adapters, and read `/metrics`.
    pub fn is_admin(&self) -> bool {
        match self {
            Self::Anyone => true,
            Self::Key { policy, .. } => policy.admin,
        }
    }

    /// Whether some adapter id is out of reach, so answers must not tell a forbidden adapter
    /// from a missing one.
    pub fn is_restricted(&self) -> bool {
        match self {
            Self::Anyone => false,
            Self::Key { policy, .. } => !policy.may_use_all_adapters(),
        }
    }

    /// The tenant whose turn the request takes in its adapter's queue; "" without keys.
    pub fn tenant(&self) -> &str {
        match self {
            Self::Anyone => "",
            Self::Key { policy, .. } => &policy.tenant,
        }
    }

    /// Whose cached prompt blocks the request may reuse: its key's prefix-cache group; ""
    /// (everyone's) without keys. No client can leave it out or choose another.
    pub fn prefix_cache_group(&self) -> &str {
        match self {
            Self::Anyone => "",
            Self::Key { policy, .. } => &policy.prefix_cache_group,
        }
    }

    /// The key's name; `None` without keys.
    pub fn name(&self) -> Option<&str> {
        match self {
            Self::Anyone => None,
            Self::Key { policy, .. } => Some(&policy.name),
        }
    }

    /// Admits one request under the key's limits; the guard holds its place until dropped.
    pub fn admit(&self, now: Instant) -> Result<Option<InFlight>, LimitExceeded> {
        match self {
            Self::Anyone => Ok(None),
            Self::Key { policy, usage } => usage.admit(&policy.limits, now).map(Some),
        }
    }

    /// Charges a finished request's tokens to the key.
    pub fn charge(&self, prompt_tokens: u64, generated_tokens: u64) {
        if let Self::Key { usage, .. } = self {
            usage.charge(prompt_tokens, generated_tokens, Instant::now());
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    fn keys_file(text: &str) -> tempfile::NamedTempFile {
        let mut file = tempfile::NamedTempFile::new().unwrap();
        file.write_all(text.as_bytes()).unwrap();
        file
    }

    fn sha(key: &str) -> String {
        use sha2::{Digest, Sha256};
        Sha256::digest(key.as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    #[test]
    fn open_servers_let_anyone_in() {
        let tenants = Tenants::new(None, None).unwrap();
        let caller = tenants.authenticate(None).unwrap();
        assert!(caller.is_admin() && caller.may_use_base_model() && !caller.is_restricted());
    }

    #[test]
    fn one_key_is_an_unrestricted_admin() {
        let tenants = Tenants::new(Some("sekret"), None).unwrap();
        assert!(tenants.authenticate(None).is_none());
        assert!(tenants.authenticate(Some("Bearer wrong")).is_none());
        assert!(tenants.authenticate(Some("sekret")).is_none());
        let caller = tenants.authenticate(Some("Bearer sekret")).unwrap();
        assert!(caller.is_admin() && caller.may_use_adapter("x/y") && !caller.is_restricted());
    }

    #[test]
    fn both_flags_are_refused() {
        let file = keys_file("keys: []\n");
        let error = Tenants::new(Some("k"), Some(file.path().into())).unwrap_err();
        assert!(error.contains("together"), "{error}");
    }

    #[test]
    fn a_reload_swaps_keys_and_a_bad_file_keeps_them() {
        let file = keys_file(&format!(
            "keys: [{{name: a, sha256: {}, adapters: [x]}}]\n",
            sha("key-a")
        ));
        let tenants = Tenants::new(None, Some(file.path().into())).unwrap();
        let a = tenants.authenticate(Some("Bearer key-a")).unwrap();
        assert_eq!(a.name(), Some("a"));
        assert!(a.may_use_adapter("x") && !a.may_use_adapter("y") && a.is_restricted());
        assert!(!a.is_admin() && !a.may_use_base_model());
        assert!(tenants.authenticate(Some("Bearer key-b")).is_none());

        std::fs::write(
            file.path(),
            format!(
                "keys: [{{name: b, sha256: {}, adapters: ['*'], admin: true}}]\n",
                sha("key-b")
            ),
        )
        .unwrap();
        assert_eq!(tenants.reload(), Ok(1));
        assert!(tenants.authenticate(Some("Bearer key-a")).is_none());
        let b = tenants.authenticate(Some("Bearer key-b")).unwrap();
        assert!(b.is_admin() && !b.is_restricted());

        std::fs::write(file.path(), "keys: [{name: c}]\n").unwrap();
        let error = tenants.reload().unwrap_err();
        assert!(error.contains("sha256"), "{error}");
        assert!(tenants.authenticate(Some("Bearer key-b")).is_some());
    }

    #[test]
    fn usage_outlives_a_reload() {
        let text = format!(
            "keys: [{{name: a, sha256: {}, limits: {{max_concurrent_requests: 1}}}}]\n",
            sha("key-a")
        );
        let file = keys_file(&text);
        let tenants = Tenants::new(None, Some(file.path().into())).unwrap();
        let caller = tenants.authenticate(Some("Bearer key-a")).unwrap();
        let running = caller.admit(Instant::now()).unwrap();
        assert!(running.is_some());
        tenants.reload().unwrap();
        let again = tenants.authenticate(Some("Bearer key-a")).unwrap();
        assert!(again.admit(Instant::now()).is_err());
        drop(running);
        assert!(again.admit(Instant::now()).is_ok());
    }
}
