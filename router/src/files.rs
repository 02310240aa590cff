//! Reading the files of a model or adapter directory without leaving the tree the operator
//! chose for it.
//!
//! A client picks adapters by name, and an adapter directory may hold symlinks; a link that
//! leads out of the adapter root would let a client read (through the chat template, say) a
//! file the operator never meant to serve. So every file is opened first and then checked
//! where the opened file really is (`/proc/self/fd/N`), which no swap of a link between a check
//! and the open can fool. Errors name only the file within its directory: never a server path,
//! never a position inside a file (a line/column would tell the length of a file elsewhere).

use std::fs::File;
use std::io::Read;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use serde_json::Value as Json;

/// Why a file of a model or adapter directory cannot be used. Displays only the file's name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FileError {
    #[error("{file} leads outside the directory it belongs to")]
    Outside { file: String },
    #[error("{file} is not a regular file")]
    NotAFile { file: String },
    #[error("{file} cannot be read ({kind})")]
    Unreadable { file: String, kind: String },
    #[error("{file} is not valid UTF-8")]
    NotUtf8 { file: String },
    #[error("{file} is not valid JSON")]
    NotJson { file: String },
    /// The content is well-formed but not what the file should hold; `what` never quotes it.
    #[error("{file} is not a valid {what}")]
    Invalid { file: String, what: &'static str },
}

/// A directory whose files are read only when they resolve inside `root` (both canonical).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfinedDir {
    dir: PathBuf,
    root: PathBuf,
}

impl ConfinedDir {
    /// `dir`, whose files must stay inside `root` (which must hold `dir`).
    pub fn new(dir: &Path, root: &Path) -> std::io::Result<Self> {
        let dir = dir.canonicalize()?;
        let root = root.canonicalize()?;
        if !dir.starts_with(&root) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::PermissionDenied,
                "the directory is outside its root",
            ));
        }
        Ok(Self { dir, root })
    }

    /// A model directory as its own root, except a Hugging Face cache snapshot
    /// (`…/models--org--name/snapshots/<rev>`), whose files are links into the repository's
    /// `blobs/`: its root is the repository's cache folder.
    pub fn model_dir(dir: &Path) -> std::io::Result<Self> {
        let canonical = dir.canonicalize()?;
        let root = hub_cache_repo(&canonical)
            .unwrap_or(&canonical)
            .to_path_buf();
        Ok(Self {
            dir: canonical,
            root,
        })
    }

    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// Whether `name` exists in the directory (a link is not followed to find out).
    pub fn has(&self, name: &str) -> bool {
        self.dir.join(name).symlink_metadata().is_ok()
    }

    /// The bytes of `name`, `None` when there is no such file.
    pub fn read(&self, name: &str) -> Result<Option<Vec<u8>>, FileError> {
        let path = self.dir.join(name);
        let unreadable = |error: std::io::Error| {
            tracing::warn!(file = ?path, %error, "cannot read a model file");
            FileError::Unreadable {
                file: name.to_owned(),
                kind: error.kind().to_string(),
            }
        };
        // Non-blocking, so a FIFO put in place of a file cannot hang the reader at open.
        let mut file = match File::options()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&path)
        {
            Ok(file) => file,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(error) => return Err(unreadable(error)),
        };
        let opened = std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd()))
            .map_err(unreadable)?;
        if !opened.starts_with(&self.root) {
            tracing::warn!(file = ?path, target = ?opened, root = ?self.root,
                "refused a model file that leads outside its root");
            return Err(FileError::Outside {
                file: name.to_owned(),
            });
        }
        if !file.metadata().map_err(unreadable)?.is_file() {
            return Err(FileError::NotAFile {
                file: name.to_owned(),
            });
        }
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes).map_err(unreadable)?;
        Ok(Some(bytes))
    }

    /// `name` as text, `None` when there is no such file.
    pub fn read_text(&self, name: &str) -> Result<Option<String>, FileError> {
        self.read(name)?
            .map(|bytes| {
                String::from_utf8(bytes).map_err(|_| FileError::NotUtf8 {
                    file: name.to_owned(),
                })
            })
            .transpose()
    }

    /// `name` parsed as JSON, `None` when there is no such file.
    pub fn read_json(&self, name: &str) -> Result<Option<Json>, FileError> {
        self.read_text(name)?
            .map(|text| {
                serde_json::from_str(&text).map_err(|error| {
                    tracing::warn!(file = ?self.dir.join(name), %error, "malformed JSON file");
                    FileError::NotJson {
                        file: name.to_owned(),
                    }
                })
            })
            .transpose()
    }
}

/// `…/models--org--name` for a path `…/models--org--name/snapshots/<rev>`.
fn hub_cache_repo(dir: &Path) -> Option<&Path> {
    let snapshots = dir.parent()?;
    let repo = snapshots.parent()?;
    let is_repo = repo
        .file_name()
        .and_then(|name| name.to_str())
        .is_some_and(|name| name.starts_with("models--"));
    (snapshots.file_name()? == "snapshots" && is_repo).then_some(repo)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    #[test]
    fn files_linked_out_of_the_root_are_refused_and_inside_links_are_read() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("root");
        std::fs::create_dir_all(root.join("a")).unwrap();
        std::fs::write(tmp.path().join("secret"), "outside").unwrap();
        std::fs::write(root.join("shared.json"), "{\"x\": 1}").unwrap();
        symlink(tmp.path().join("secret"), root.join("a/out")).unwrap();
        symlink(root.join("shared.json"), root.join("a/in.json")).unwrap();
        std::fs::write(root.join("a/bad.json"), "{\n\n  nope").unwrap();
        std::fs::write(root.join("a/latin1"), [0xe9u8, 0x41]).unwrap();
        let dir = ConfinedDir::new(&root.join("a"), &root).unwrap();

        let error = dir.read("out").unwrap_err();
        assert_eq!(error, FileError::Outside { file: "out".into() });
        assert!(!error.to_string().contains(tmp.path().to_str().unwrap()));
        assert_eq!(
            dir.read_json("in.json").unwrap(),
            Some(serde_json::json!({"x": 1}))
        );
        assert_eq!(dir.read("missing").unwrap(), None);
        let bad = dir.read_json("bad.json").unwrap_err().to_string();
        assert_eq!(bad, "bad.json is not valid JSON");
        assert_eq!(
            dir.read_text("latin1").unwrap_err().to_string(),
            "latin1 is not valid UTF-8"
        );
        // A directory confined to itself refuses a link to its parent's files.
        let itself = ConfinedDir::model_dir(&root.join("a")).unwrap();
        assert!(matches!(
            itself.read("in.json"),
            Err(FileError::Outside { .. })
        ));
    }

    #[test]
    fn a_hub_snapshot_may_link_into_its_blobs_only() {
        let tmp = tempfile::tempdir().unwrap();
        let repo = tmp.path().join("models--org--name");
        let snapshot = repo.join("snapshots/abc");
        std::fs::create_dir_all(&snapshot).unwrap();
        std::fs::create_dir_all(repo.join("blobs")).unwrap();
        std::fs::write(repo.join("blobs/123"), "{}").unwrap();
        std::fs::write(tmp.path().join("secret"), "{}").unwrap();
        symlink("../../blobs/123", snapshot.join("config.json")).unwrap();
        symlink(tmp.path().join("secret"), snapshot.join("other.json")).unwrap();
        let dir = ConfinedDir::model_dir(&snapshot).unwrap();
        assert_eq!(dir.read_text("config.json").unwrap().as_deref(), Some("{}"));
        assert!(matches!(
            dir.read("other.json"),
            Err(FileError::Outside { .. })
        ));
    }

    #[test]
    fn a_fifo_is_not_a_file_and_does_not_block() {
        let tmp = tempfile::tempdir().unwrap();
        let fifo = tmp.path().join("chat_template.jinja");
        let status = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap();
        assert!(status.success());
        let dir = ConfinedDir::model_dir(tmp.path()).unwrap();
        assert!(matches!(
            dir.read("chat_template.jinja"),
            Err(FileError::NotAFile { .. })
        ));
    }
}
