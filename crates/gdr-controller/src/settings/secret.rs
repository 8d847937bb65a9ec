//! Secret files: every credential is a file path in the configuration, read here.

use std::path::{Path, PathBuf};

/// Reads a secret file, trimming surrounding whitespace (as the Go version did).
/// The error names the key and the path, never the content.
pub fn read_secret_file(key: &str, path: &Path) -> Result<String, SecretFileError> {
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
}
