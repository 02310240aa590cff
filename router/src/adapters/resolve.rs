//! From an adapter id to where its files are: a hub repository (`owner/name`, optionally
//! `@revision`), a directory inside `--adapter-root`, or an S3 prefix (`s3://bucket/prefix`) in a
//! bucket `--s3-adapter-buckets` allows.
//!
//! Local ids are a security boundary: a client must not make the server read any directory it
//! likes. An id is refused (400) when it is absolute, has a `..` component, or when its
//! canonical path (every symlink followed) is not inside the canonical root. What is sent to the
//! shard is that canonical path, so the shard reads exactly the directory that was checked.

use std::fmt;
use std::path::{Component, Path, PathBuf};

use super::s3_id::{is_s3_id, S3Buckets, S3Location};
use super::{check_name, check_path, AdapterError};

/// Where an adapter id is looked up; defined with the `--adapter-source` flag.
pub use quiver_flags::AdapterSource;

/// Where an adapter's files come from.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum AdapterLocation {
    Hub {
        /// `owner/name`.
        repo: String,
        /// Branch, tag or commit; `None` is the repository's default branch.
        revision: Option<String>,
    },
    /// The canonical directory, inside the canonical adapter root.
    Local { path: PathBuf },
    /// A prefix in an allowed bucket.
    S3(S3Location),
}

impl AdapterLocation {
    pub fn source(&self) -> AdapterSource {
        match self {
            Self::Hub { .. } => AdapterSource::Hub,
            Self::Local { .. } => AdapterSource::Local,
            Self::S3(_) => AdapterSource::S3,
        }
    }
}

impl fmt::Display for AdapterLocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Hub {
                repo,
                revision: Some(revision),
            } => write!(f, "hub:{repo}@{revision}"),
            Self::Hub {
                repo,
                revision: None,
            } => write!(f, "hub:{repo}"),
            Self::Local { .. } => f.write_str("a local directory"),
            Self::S3(location) => location.fmt(f),
        }
    }
}

/// A resolved adapter: the id clients use in `model`, and where its files are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdapterSpec {
    pub id: String,
    pub location: AdapterLocation,
}

/// Resolves adapter ids with the server's `--adapter-source` and `--adapter-root`.
#[derive(Debug, Clone, Default)]
pub struct Resolver {
    default_source: AdapterSource,
    /// Canonical `--adapter-root`.
    root: Option<PathBuf>,
    /// `--adapter-root` as given (made absolute), for absolute paths spelled through it.
    root_as_given: Option<PathBuf>,
    s3_buckets: S3Buckets,
}

impl Resolver {
    /// Canonicalizes `root` once, so later checks compare canonical paths; a root that does not
    /// exist is an error (a typo in a flag should stop start-up, not 404 every request).
    pub fn new(default_source: AdapterSource, root: Option<&Path>) -> Result<Self, String> {
        let root_as_given = root.and_then(|root| std::path::absolute(root).ok());
        let root = match root {
            Some(root) => {
                let canonical = root
                    .canonicalize()
                    .map_err(|error| format!("--adapter-root {}: {error}", root.display()))?;
                if !canonical.is_dir() {
                    return Err(format!(
                        "--adapter-root {} is not a directory",
                        root.display()
                    ));
                }
                Some(canonical)
            }
            None => None,
        };
        Ok(Self {
            default_source,
            root,
            root_as_given,
            s3_buckets: S3Buckets::default(),
        })
    }

    /// Allows S3 adapters from `buckets` (`--s3-adapter-buckets`); a malformed name is an error.
    pub fn with_s3_buckets(mut self, buckets: &[String]) -> Result<Self, String> {
        self.s3_buckets = S3Buckets::new(buckets)?;
        Ok(self)
    }

    /// The canonical `--adapter-root`, if the server has one.
    pub fn canonical_root(&self) -> Option<&Path> {
        self.root.as_deref()
    }

    pub fn default_source(&self) -> AdapterSource {
        self.default_source
    }

    /// `id` looked up in `source` (the request's `adapter_source`), else by its spelling
    /// (`s3://…` is S3), else in `--adapter-source`.
    pub fn resolve(
        &self,
        id: &str,
        source: Option<AdapterSource>,
    ) -> Result<AdapterSpec, AdapterError> {
        check_name(id)?;
        let location = self.locate(id, source.unwrap_or_else(|| self.implied_source(id)))?;
        Ok(AdapterSpec {
            id: id.to_owned(),
            location,
        })
    }

    /// Where `path` (a hub id or a local path) points, for an adapter that will be served under
    /// another name (`/v1/load_lora_adapter`). Without an explicit source an absolute path is
    /// local (what vLLM clients send); it must still lie inside the adapter root.
    pub fn locate_path(
        &self,
        path: &str,
        source: Option<AdapterSource>,
    ) -> Result<AdapterLocation, AdapterError> {
        check_path(path)?;
        match source {
            Some(source) => self.locate(path, source),
            None if Path::new(path).is_absolute() => self.local_absolute(path),
            None => self.locate(path, self.implied_source(path)),
        }
    }

    /// Why `name` must not be the name of the adapter at `location`, if it must not: as a local
    /// id (or an absolute path) it names another directory under the root, or it is a hub id
    /// of another adapter. Otherwise requests for that directory or hub adapter would silently
    /// get these weights.
    pub fn name_conflict(&self, name: &str, location: &AdapterLocation) -> Option<&'static str> {
        let as_local = if Path::new(name).is_absolute() {
            self.local_absolute(name)
        } else {
            self.locate(name, AdapterSource::Local)
        };
        if let Ok(local) = as_local {
            return (local != *location)
                .then_some("it names another adapter directory under the adapter root");
        }
        if is_s3_id(name) {
            return match self.s3_buckets.locate(name) {
                Ok(s3) if !matches!(location, AdapterLocation::S3(own) if *own == s3) => {
                    Some("it is the id of another (S3) adapter")
                }
                _ => None,
            };
        }
        match parse_hub_id(name) {
            Ok(hub) if hub != *location => Some("it is the id of another (hub) adapter"),
            _ => None,
        }
    }

    /// Where an id without an explicit source is looked up: an `s3://` id in S3 (no hub id or
    /// local path is spelled that way), anything else in `--adapter-source`.
    fn implied_source(&self, id: &str) -> AdapterSource {
        if is_s3_id(id) {
            AdapterSource::S3
        } else {
            self.default_source
        }
    }

    fn locate(&self, id: &str, source: AdapterSource) -> Result<AdapterLocation, AdapterError> {
        match source {
            AdapterSource::S3 => self.s3_buckets.locate(id).map(AdapterLocation::S3),
            AdapterSource::Hub => parse_hub_id(id),
            AdapterSource::Local => {
                let relative = checked_relative(id)?;
                self.inside_root(id, &relative)
            }
        }
    }

    /// An absolute path is accepted only when it (canonically) lies inside the root.
    fn local_absolute(&self, path: &str) -> Result<AdapterLocation, AdapterError> {
        let root = self.root(path)?;
        if Path::new(path)
            .components()
            .any(|component| component == Component::ParentDir)
        {
            return Err(invalid(path, "`..` is not allowed in adapter paths"));
        }
        // Refused before touching the file system, so the answer never tells whether some
        // path outside the root exists.
        let spelled_inside = [Some(root), self.root_as_given.as_deref()]
            .into_iter()
            .flatten()
            .any(|prefix| Path::new(path).starts_with(prefix));
        if !spelled_inside {
            return Err(invalid(path, "the path is outside the adapter root"));
        }
        self.checked_dir(path, root, Path::new(path))
    }

    fn root(&self, id: &str) -> Result<&Path, AdapterError> {
        self.root
            .as_deref()
            .ok_or_else(|| AdapterError::NoAdapterRoot { id: id.to_owned() })
    }

    /// Joins, follows every symlink, and checks the result is a directory inside the root.
    fn inside_root(&self, id: &str, relative: &Path) -> Result<AdapterLocation, AdapterError> {
        let root = self.root(id)?;
        self.checked_dir(id, root, &root.join(relative))
    }

    fn checked_dir(
        &self,
        id: &str,
        root: &Path,
        candidate: &Path,
    ) -> Result<AdapterLocation, AdapterError> {
        let not_found = || AdapterError::NotFound {
            id: id.to_owned(),
            detail: ": no such adapter directory under the adapter root".to_owned(),
        };
        let canonical = match candidate.canonicalize() {
            Ok(path) => path,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Err(not_found()),
            Err(error) => {
                return Err(invalid(
                    id,
                    &format!("the adapter directory cannot be read ({})", error.kind()),
                ))
            }
        };
        // Before the is_dir check, so a link out of the root never reveals what it points at.
        if !canonical.starts_with(root) {
            return Err(invalid(id, "the path leads outside the adapter root"));
        }
        if !canonical.is_dir() {
            return Err(not_found());
        }
        Ok(AdapterLocation::Local { path: canonical })
    }
}

fn invalid(id: &str, reason: &str) -> AdapterError {
    AdapterError::InvalidId {
        id: id.to_owned(),
        reason: reason.to_owned(),
    }
}

/// A local id as a relative path of plain names: no root, no drive prefix, no `..`.
fn checked_relative(id: &str) -> Result<PathBuf, AdapterError> {
    if id.is_empty() {
        return Err(invalid(id, "the id is empty"));
    }
    if id.contains('\0') {
        return Err(invalid(id, "the id contains a NUL character"));
    }
    let path = Path::new(id);
    let mut relative = PathBuf::new();
    for component in path.components() {
        match component {
            Component::Normal(name) => relative.push(name),
            Component::CurDir => {}
            Component::ParentDir => {
                return Err(invalid(id, "`..` is not allowed in local adapter ids"))
            }
            Component::RootDir | Component::Prefix(_) => {
                return Err(invalid(
                    id,
                    "local adapter ids are relative to the adapter root; absolute paths are not \
                     allowed",
                ))
            }
        }
    }
    if relative.as_os_str().is_empty() {
        return Err(invalid(id, "the id names the adapter root itself"));
    }
    Ok(relative)
}

/// `owner/name` or `owner/name@revision`, with the Hub's rules for names: letters, digits,
/// `-`, `_`, `.`, at most 96 characters, not starting or ending with `-` or `.`, no `--` or
/// `..`.
fn parse_hub_id(id: &str) -> Result<AdapterLocation, AdapterError> {
    const SHAPE: &str = "hub adapter ids are `owner/name` or `owner/name@revision`";
    let (repo, revision) = match id.split_once('@') {
        Some((repo, revision)) => (repo, Some(revision)),
        None => (id, None),
    };
    let Some((owner, name)) = repo.split_once('/') else {
        // Not even trying to be a hub id: most likely a model name this server does not
        // serve, which OpenAI answers with 404 model_not_found.
        return Err(AdapterError::NotFound {
            id: id.to_owned(),
            detail: String::new(),
        });
    };
    for part in [owner, name] {
        if let Err(reason) = check_hub_name(part) {
            return Err(invalid(id, &format!("{SHAPE}; `{part}` {reason}")));
        }
    }
    if let Some(revision) = revision {
        check_revision(revision).map_err(|reason| invalid(id, &reason))?;
    }
    Ok(AdapterLocation::Hub {
        repo: repo.to_owned(),
        revision: revision.map(str::to_owned),
    })
}

fn check_hub_name(part: &str) -> Result<(), &'static str> {
    if part.is_empty() || part.len() > 96 {
        return Err("must be 1 to 96 characters");
    }
    if !part
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    {
        return Err("may only contain letters, digits, `-`, `_` and `.`");
    }
    if part.starts_with(['-', '.']) || part.ends_with(['-', '.']) {
        return Err("must not start or end with `-` or `.`");
    }
    if part.contains("--") || part.contains("..") {
        return Err("must not contain `--` or `..`");
    }
    Ok(())
}

/// Branch, tag or commit: git ref characters, so nothing odd reaches the hub client.
fn check_revision(revision: &str) -> Result<(), String> {
    if revision.is_empty() || revision.len() > 256 {
        return Err("the revision after `@` must be 1 to 256 characters".to_owned());
    }
    if !revision
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'))
    {
        return Err(
            "the revision may only contain letters, digits, `-`, `_`, `.` and `/`".to_owned(),
        );
    }
    if revision.contains("..") || revision.starts_with('/') || revision.ends_with('/') {
        return Err(format!("`{revision}` is not a valid revision"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::adapters::S3Location;

    fn hub(repo: &str, revision: Option<&str>) -> AdapterLocation {
        AdapterLocation::Hub {
            repo: repo.into(),
            revision: revision.map(Into::into),
        }
    }

    #[test]
    fn hub_ids_are_owner_name_with_an_optional_revision() {
        let resolver = Resolver::default();
        assert_eq!(
            resolver.resolve("org/sql-lora", None).unwrap().location,
            hub("org/sql-lora", None)
        );
        assert_eq!(
            resolver
                .resolve("org/sql_lora.v2@refs/pr/1", None)
                .unwrap()
                .location,
            hub("org/sql_lora.v2", Some("refs/pr/1"))
        );
        // No slash at all: an unknown model name, not a malformed hub id.
        for unknown in ["gpt-4", "sql-lora@v1"] {
            let error = resolver.resolve(unknown, None).unwrap_err();
            assert_eq!(error.code(), "model_not_found", "{unknown}");
            assert_eq!(
                error.to_string(),
                format!("The model `{unknown}` does not exist.")
            );
        }
        for bad in [
            "org/",
            "/name",
            "a/b/c",
            "org/na me",
            "org/-x",
            "org/x.",
            "org/a--b",
            "org/a..b",
            "org/x@",
            "org/x@a..b",
            "org/x@rev with space",
            "org/x@a@b",
        ] {
            let error = resolver.resolve(bad, None).unwrap_err();
            assert_eq!(error.code(), "invalid_adapter_id", "{bad}: {error}");
        }
        let long = format!("org/{}", "x".repeat(97));
        assert!(resolver.resolve(&long, None).is_err());
    }

    #[test]
    fn local_ids_need_an_adapter_root() {
        let error = Resolver::default()
            .resolve("sql", Some(AdapterSource::Local))
            .unwrap_err();
        assert_eq!(error.code(), "adapter_root_not_set");
    }

    #[test]
    fn local_ids_resolve_to_canonical_directories_inside_the_root() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("adapters");
        std::fs::create_dir_all(root.join("team/sql")).unwrap();
        std::fs::create_dir_all(dir.path().join("secret")).unwrap();
        std::fs::write(root.join("file"), "x").unwrap();
        std::os::unix::fs::symlink(dir.path().join("secret"), root.join("escape")).unwrap();
        std::os::unix::fs::symlink(root.join("team/sql"), root.join("alias")).unwrap();
        let resolver = Resolver::new(AdapterSource::Local, Some(&root)).unwrap();
        let canonical_root = root.canonicalize().unwrap();

        let spec = resolver.resolve("team/sql", None).unwrap();
        assert_eq!(
            spec.location,
            AdapterLocation::Local {
                path: canonical_root.join("team/sql")
            }
        );
        // A link that stays inside the root is fine and resolves to its target.
        assert_eq!(
            resolver.resolve("./alias", None).unwrap().location,
            AdapterLocation::Local {
                path: canonical_root.join("team/sql")
            }
        );
        let code = |id: &str| resolver.resolve(id, None).unwrap_err().code();
        assert_eq!(code("escape"), "invalid_adapter_id");
        assert_eq!(code("../secret"), "invalid_adapter_id");
        assert_eq!(code("team/../../secret"), "invalid_adapter_id");
        assert_eq!(
            code(&dir.path().join("secret").display().to_string()),
            "invalid_adapter_id"
        );
        assert_eq!(code("/etc"), "invalid_adapter_id");
        assert_eq!(code("."), "invalid_adapter_id");
        assert_eq!(code("missing"), "model_not_found");
        assert_eq!(code("file"), "model_not_found");
    }

    #[test]
    fn load_paths_may_be_absolute_inside_the_root_only() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("adapters");
        std::fs::create_dir_all(root.join("sql")).unwrap();
        std::fs::create_dir_all(dir.path().join("secret")).unwrap();
        let resolver = Resolver::new(AdapterSource::Hub, Some(&root)).unwrap();
        let canonical = root.canonicalize().unwrap();
        let inside = canonical.join("sql").display().to_string();
        assert_eq!(
            resolver.locate_path(&inside, None).unwrap(),
            AdapterLocation::Local {
                path: canonical.join("sql")
            }
        );
        let outside = dir.path().join("secret").canonicalize().unwrap();
        let error = resolver
            .locate_path(&outside.display().to_string(), None)
            .unwrap_err();
        assert_eq!(error.code(), "invalid_adapter_id");
        let sneaky = format!("{}/../secret", canonical.display());
        assert_eq!(
            resolver.locate_path(&sneaky, None).unwrap_err().code(),
            "invalid_adapter_id"
        );
        // Relative paths follow the default source (here: hub).
        assert_eq!(
            resolver.locate_path("org/x", None).unwrap(),
            hub("org/x", None)
        );
        assert_eq!(
            resolver
                .locate_path("sql", Some(AdapterSource::Local))
                .unwrap(),
            AdapterLocation::Local {
                path: canonical.join("sql")
            }
        );
    }

    #[test]
    fn s3_ids_are_s3_by_their_spelling_and_only_in_allowed_buckets() {
        let resolver = Resolver::default()
            .with_s3_buckets(&["team-a".to_owned()])
            .unwrap();
        let s3 = AdapterLocation::S3(S3Location {
            bucket: "team-a".into(),
            prefix: "sql/v2".into(),
        });
        assert_eq!(
            resolver
                .resolve("s3://team-a/sql/v2", None)
                .unwrap()
                .location,
            s3
        );
        assert_eq!(
            resolver
                .resolve("s3://team-a/sql/v2", Some(AdapterSource::S3))
                .unwrap()
                .location,
            s3
        );
        assert_eq!(
            resolver.locate_path("s3://team-a/sql/v2", None).unwrap(),
            s3
        );
        let code = |id: &str, source| resolver.resolve(id, source).unwrap_err().code();
        assert_eq!(code("s3://team-b/sql", None), "invalid_adapter_id");
        assert_eq!(code("s3://team-a/../x", None), "invalid_adapter_id");
        // An explicit source keeps its own rules: an S3 URL is no hub id.
        assert_eq!(
            code("s3://team-a/sql", Some(AdapterSource::Hub)),
            "invalid_adapter_id"
        );
        assert_eq!(code("gpt-4", Some(AdapterSource::S3)), "model_not_found");
        // Another S3 adapter's id cannot name this one.
        assert!(resolver.name_conflict("s3://team-a/other", &s3).is_some());
        assert!(resolver.name_conflict("s3://team-a/sql/v2", &s3).is_none());
        assert!(resolver.name_conflict("sql", &s3).is_none());
    }

    #[test]
    fn a_missing_root_stops_start_up() {
        let dir = tempfile::tempdir().unwrap();
        assert!(Resolver::new(AdapterSource::Local, Some(&dir.path().join("nope"))).is_err());
    }
}
