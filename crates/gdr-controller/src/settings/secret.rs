//! Secret files: every credential is a file path in the configuration, read here.
//!
//! A secret file others can read is refused, naming the file and its mode, as ssh refuses
//! such private keys (`secret_file_permissions` relaxes it where a platform decides the
//! mode, e.g. Kubernetes Secret volumes with `fsGroup`).

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

/// Which permission bits a secret file may have (`secret_file_permissions`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SecretPermissions {
    /// No access for group or others (`chmod 600` or `400`).
    #[default]
    OwnerOnly,
    /// Also readable (not writable) by the file's group; never by others.
    GroupReadable,
    /// Not checked.
    Unchecked,
}

impl SecretPermissions {
    /// The mode bits this policy refuses.
    fn refused_bits(self) -> u32 {
        match self {
            SecretPermissions::OwnerOnly => 0o077,
            SecretPermissions::GroupReadable => 0o037,
            SecretPermissions::Unchecked => 0,
        }
    }

    /// How the configuration spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            SecretPermissions::OwnerOnly => "owner-only",
            SecretPermissions::GroupReadable => "group-readable",
            SecretPermissions::Unchecked => "unchecked",
        }
    }
}

impl FromStr for SecretPermissions {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "owner-only" => Ok(SecretPermissions::OwnerOnly),
            "group-readable" => Ok(SecretPermissions::GroupReadable),
            "unchecked" => Ok(SecretPermissions::Unchecked),
            other => Err(format!(
                "{other:?} must be \"owner-only\", \"group-readable\" or \"unchecked\""
            )),
        }
    }
}

/// Refuses a secret file whose mode gives group or others more than `permissions`
/// allows (the mode of the file a symlink points to, as Kubernetes mounts Secrets).
pub fn check_secret_file_mode(
    key: &str,
    path: &Path,
    permissions: SecretPermissions,
) -> Result<(), SecretFileError> {
    let refused = permissions.refused_bits();
    if refused == 0 {
        return Ok(());
    }
    let metadata = std::fs::metadata(path).map_err(|source| SecretFileError::Read {
        key: key.to_string(),
        path: path.to_path_buf(),
        source,
    })?;
    let mode = metadata.mode() & 0o7777;
    if mode & refused != 0 {
        return Err(SecretFileError::TooOpen {
            key: key.to_string(),
            path: path.to_path_buf(),
            mode,
            permissions,
        });
    }
    Ok(())
}

/// Reads a secret file, trimming surrounding whitespace (as the Go version did), after
/// checking that only its owner can access it. The error names the key and the path,
/// never the content.
pub fn read_secret_file(key: &str, path: &Path) -> Result<String, SecretFileError> {
    read_secret_file_with(key, path, SecretPermissions::OwnerOnly)
}

/// [`read_secret_file`] with the configured `secret_file_permissions`.
pub fn read_secret_file_with(
    key: &str,
    path: &Path,
    permissions: SecretPermissions,
) -> Result<String, SecretFileError> {
    check_secret_file_mode(key, path, permissions)?;
    let raw = std::fs::read(path).map_err(|source| SecretFileError::Read {
        key: key.to_string(),
        path: path.to_path_buf(),
        source,
    })?;
    let text = String::from_utf8(raw).map_err(|_| SecretFileError::NotText {
        key: key.to_string(),
        path: path.to_path_buf(),
    })?;
    let trimmed = text.trim();
    if trimmed.is_empty() {
        return Err(SecretFileError::Empty {
            key: key.to_string(),
            path: path.to_path_buf(),
        });
    }
    Ok(trimmed.to_string())
}

/// A secret file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum SecretFileError {
    /// The file could not be read.
    #[error("{key} ({}): cannot read {}: {source}", key.to_ascii_uppercase(), path.display())]
    Read {
        /// Config key.
        key: String,
        /// Path.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The file is not UTF-8 text.
    #[error("{key} ({}): {} is not UTF-8 text", key.to_ascii_uppercase(), path.display())]
    NotText {
        /// Config key.
        key: String,
        /// Path.
        path: PathBuf,
    },
    /// The file is empty or only whitespace.
    #[error("{key} ({}): {} is empty", key.to_ascii_uppercase(), path.display())]
    Empty {
        /// Config key.
        key: String,
        /// Path.
        path: PathBuf,
    },
    /// Group or others may access the file.
    #[error(
        "{key} ({}): {} is accessible by {} (mode {mode:04o}); restrict it (`chmod 600 {}`) or set secret_file_permissions (now {:?})",
        key.to_ascii_uppercase(),
        path.display(),
        if mode & 0o007 != 0 { "others" } else { "its group" },
        path.display(),
        permissions.as_str()
    )]
    TooOpen {
        /// Config key.
        key: String,
        /// Path.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
        /// What is allowed.
        permissions: SecretPermissions,
    },
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    fn secret(dir: &Path, mode: u32) -> PathBuf {
        let path = dir.join(format!("secret-{mode:o}"));
        std::fs::write(&path, "s3cr3t\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        path
    }

    /// DESIGN invariant 17: a secret file group or others can read is refused with its
    /// name and mode, unless the operator relaxed the rule for their platform.
    #[test]
    fn a_secret_file_others_can_read_is_refused_naming_the_file_and_its_mode() {
        let dir = tempfile::tempdir().unwrap();
        for mode in [0o600, 0o400] {
            assert_eq!(
                read_secret_file("k_file", &secret(dir.path(), mode)).unwrap(),
                "s3cr3t"
            );
        }
        for mode in [0o644, 0o640, 0o604, 0o660] {
            let path = secret(dir.path(), mode);
            let err = read_secret_file("gitea_runner_token_file", &path).unwrap_err();
            let text = err.to_string();
            assert!(
                text.contains(&path.display().to_string())
                    && text.contains(&format!("mode {mode:04o}"))
                    && text.contains("GITEA_RUNNER_TOKEN_FILE")
                    && !text.contains("s3cr3t"),
                "{text}"
            );
        }
        let group = SecretPermissions::GroupReadable;
        assert!(read_secret_file_with("k", &secret(dir.path(), 0o440), group).is_ok());
        assert!(read_secret_file_with("k", &secret(dir.path(), 0o640), group).is_ok());
        assert!(read_secret_file_with("k", &secret(dir.path(), 0o660), group).is_err());
        assert!(read_secret_file_with("k", &secret(dir.path(), 0o644), group).is_err());
        let any = SecretPermissions::Unchecked;
        assert!(read_secret_file_with("k", &secret(dir.path(), 0o666), any).is_ok());
    }

    #[test]
    fn the_permission_policy_is_spelled_as_in_the_configuration() {
        for p in [
            SecretPermissions::OwnerOnly,
            SecretPermissions::GroupReadable,
            SecretPermissions::Unchecked,
        ] {
            assert_eq!(p.as_str().parse::<SecretPermissions>(), Ok(p));
        }
        assert!("0600".parse::<SecretPermissions>().is_err());
    }
}
