//! `s3://bucket/prefix` adapter ids (LoRAX's spelling), and the buckets a server allows.
//!
//! The prefix becomes a folder of the shard's adapter cache, so anything that could walk out of
//! it (`..`, `.`, empty components, backslashes) is refused here, before any shard sees it.

use super::AdapterError;

/// What an S3 adapter id starts with.
pub const S3_SCHEME: &str = "s3://";

/// A bucket and the key prefix under which the adapter's files lie.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct S3Location {
    pub bucket: String,
    /// `a/b/c`, without leading or trailing `/`.
    pub prefix: String,
}

impl std::fmt::Display for S3Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{S3_SCHEME}{}/{}", self.bucket, self.prefix)
    }
}

/// The buckets `--s3-adapter-buckets` allows; empty: S3 adapters are off.
#[derive(Debug, Clone, Default)]
pub struct S3Buckets(Vec<String>);

impl S3Buckets {
    /// Checks every name (a typo in a flag should stop start-up, not 400 every request).
    pub fn new(buckets: &[String]) -> Result<Self, String> {
        for bucket in buckets {
            check_bucket(bucket).map_err(|reason| {
                format!("--s3-adapter-buckets: `{bucket}` is not a bucket name: {reason}")
            })?;
        }
        Ok(Self(buckets.to_vec()))
    }

    /// `id` as an S3 location in an allowed bucket.
    pub fn locate(&self, id: &str) -> Result<S3Location, AdapterError> {
        let location = parse_s3_id(id)?;
        if self.0.is_empty() {
            return Err(invalid(id, "S3 adapters are not enabled on this server"));
        }
        if !self.0.contains(&location.bucket) {
            return Err(invalid(
                id,
                &format!(
                    "bucket `{}` is not one this server loads adapters from",
                    location.bucket
                ),
            ));
        }
        Ok(location)
    }
}

/// Whether `id` is spelled as an S3 adapter id (whatever else is wrong with it).
pub fn is_s3_id(id: &str) -> bool {
    id.starts_with(S3_SCHEME)
}

/// `s3://bucket/prefix`: a bucket named by S3's rules and a prefix of plain components.
pub fn parse_s3_id(id: &str) -> Result<S3Location, AdapterError> {
    const SHAPE: &str = "S3 adapter ids are `s3://bucket/prefix`";
    let Some(rest) = id.strip_prefix(S3_SCHEME) else {
        // Like a name without `/` for the hub: a model this server does not serve.
        return Err(AdapterError::NotFound {
            id: id.to_owned(),
            detail: String::new(),
        });
    };
    let Some((bucket, prefix)) = rest.split_once('/') else {
        return Err(invalid(id, &format!("{SHAPE}; the prefix is missing")));
    };
    check_bucket(bucket).map_err(|reason| invalid(id, &format!("{SHAPE}; {reason}")))?;
    check_prefix(prefix).map_err(|reason| invalid(id, &format!("{SHAPE}; {reason}")))?;
    Ok(S3Location {
        bucket: bucket.to_owned(),
        prefix: prefix.to_owned(),
    })
}

/// S3's rules for general purpose buckets: 3 to 63 of `a-z 0-9 . -`, starting and ending with a
/// letter or digit, no `..`.
fn check_bucket(bucket: &str) -> Result<(), &'static str> {
    if !(3..=63).contains(&bucket.len()) {
        return Err("a bucket name has 3 to 63 characters");
    }
    if !bucket
        .chars()
        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '.' | '-'))
    {
        return Err("a bucket name has only lowercase letters, digits, `.` and `-`");
    }
    let alphanumeric = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric());
    if !alphanumeric(bucket.chars().next()) || !alphanumeric(bucket.chars().last()) {
        return Err("a bucket name starts and ends with a letter or digit");
    }
    if bucket.contains("..") {
        return Err("a bucket name has no `..`");
    }
    Ok(())
}

fn check_prefix(prefix: &str) -> Result<(), &'static str> {
    if prefix.is_empty() {
        return Err("the prefix is missing");
    }
    if prefix.contains('\\') {
        return Err("the prefix must not contain `\\`");
    }
    for component in prefix.split('/') {
        match component {
            "" => return Err("the prefix must not have empty components (`//` or a trailing `/`)"),
            "." | ".." => return Err("the prefix must not have `.` or `..` components"),
            _ => {}
        }
    }
    Ok(())
}

fn invalid(id: &str, reason: &str) -> AdapterError {
    AdapterError::InvalidId {
        id: id.to_owned(),
        reason: reason.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn buckets(names: &[&str]) -> S3Buckets {
        S3Buckets::new(
            &names
                .iter()
                .map(|name| (*name).to_owned())
                .collect::<Vec<_>>(),
        )
        .unwrap()
    }

    #[test]
    fn ids_name_a_bucket_and_a_prefix() {
        assert_eq!(
            parse_s3_id("s3://team-a.adapters/sql/v2").unwrap(),
            S3Location {
                bucket: "team-a.adapters".into(),
                prefix: "sql/v2".into()
            }
        );
        assert_eq!(parse_s3_id("s3://abc/x").unwrap().to_string(), "s3://abc/x");
    }

    #[test]
    fn malformed_ids_are_invalid_and_non_s3_names_are_unknown() {
        for bad in [
            "s3://",
            "s3://bucket",
            "s3://bucket/",
            "s3://bucket/a//b",
            "s3://bucket/a/",
            "s3://bucket/a/../b",
            "s3://bucket/./a",
            "s3://bucket/..",
            "s3://bucket/a\\b",
            "s3://Bucket/a",
            "s3://ab/a",
            "s3://-bucket/a",
            "s3://bucket-/a",
            "s3://buck..et/a",
            "s3://bu_cket/a",
        ] {
            let error = parse_s3_id(bad).unwrap_err();
            assert_eq!(error.code(), "invalid_adapter_id", "{bad}: {error}");
        }
        assert_eq!(parse_s3_id("gpt-4").unwrap_err().code(), "model_not_found");
    }

    #[test]
    fn only_allowed_buckets_are_served() {
        let allowed = buckets(&["team-a", "shared"]);
        assert!(allowed.locate("s3://team-a/sql").is_ok());
        let error = allowed.locate("s3://team-b/sql").unwrap_err();
        assert_eq!(error.code(), "invalid_adapter_id");
        assert!(error.to_string().contains("`team-b` is not one"), "{error}");
        let off = S3Buckets::default().locate("s3://team-a/sql").unwrap_err();
        assert!(off.to_string().contains("not enabled"), "{off}");
    }

    #[test]
    fn a_bad_bucket_flag_stops_start_up() {
        assert!(S3Buckets::new(&["Team_A".to_owned()]).is_err());
        assert!(S3Buckets::new(&["ok-bucket".to_owned()]).is_ok());
    }
}
