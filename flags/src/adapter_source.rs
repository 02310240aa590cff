//! Where an adapter id is looked up. The flag, the request extension (`adapter_source`) and the
//! shard protocol all spell it `hub` | `local` | `s3`.

use std::fmt;

use clap::ValueEnum;

// Variants carry plain comments, not doc comments: clap would turn doc comments into a
// per-value help list, and `--help` has always shown the short `[possible values: hub, local, s3]`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, ValueEnum)]
pub enum AdapterSource {
    // A Hugging Face Hub repository, downloaded by shard rank 0.
    #[default]
    Hub,
    // A directory inside `--adapter-root`.
    Local,
    // An S3 (or S3-compatible) prefix, `s3://bucket/prefix`, downloaded by shard rank 0.
    S3,
}

impl AdapterSource {
    /// A request's `adapter_source` extension; unlike the flag, it is matched exactly.
    pub fn parse(value: &str) -> Result<Self, UnknownAdapterSource> {
        match value {
            "hub" => Ok(Self::Hub),
            "local" => Ok(Self::Local),
            "s3" => Ok(Self::S3),
            other => Err(UnknownAdapterSource(other.to_owned())),
        }
    }

    /// The spelling of the flag, the request field and the proto.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Hub => "hub",
            Self::Local => "local",
            Self::S3 => "s3",
        }
    }

    /// Whether shard rank 0 fetches the files (the other ranks read its copy).
    pub fn is_remote(self) -> bool {
        matches!(self, Self::Hub | Self::S3)
    }
}

impl fmt::Display for AdapterSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An `adapter_source` that is not `hub`, `local` or `s3` (the value as sent).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownAdapterSource(pub String);

impl fmt::Display for UnknownAdapterSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "`adapter_source` must be `hub`, `local` or `s3`, got `{}`",
            self.0
        )
    }
}

impl std::error::Error for UnknownAdapterSource {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_spelling_matches_the_flag_spelling() {
        for source in AdapterSource::value_variants() {
            let flag = source.to_possible_value().unwrap();
            assert_eq!(flag.get_name(), source.as_str());
            assert_eq!(AdapterSource::parse(source.as_str()), Ok(*source));
        }
        assert_eq!(
            AdapterSource::parse("Hub"),
            Err(UnknownAdapterSource("Hub".into()))
        );
    }
}
