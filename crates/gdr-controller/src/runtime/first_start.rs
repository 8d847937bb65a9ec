//! What single-host mode does on its first start so that `controller --gitea-url URL
//! --registration-token-file FILE` is the whole set-up: register the runner, generate the
//! capability key, find the official runner on `PATH`. Everything it writes is created
//! once, atomically, mode 0600, and reused by every later start.

use std::io::Write as _;
use std::path::{Path, PathBuf};

use crate::register::{self, Registration};
use crate::settings::{GiteaSettings, KeyFile, RunnerSettings};

pub use crate::settings::RUNNER_NAMES;

/// Why a first-start step failed.
#[derive(Debug, thiserror::Error)]
pub enum FirstStartError {
    /// Neither runner name is on `PATH`.
    #[error(
        "runner_binary (RUNNER_BINARY) is not set and neither gitea-runner nor act_runner is on PATH ({path}): install the official Gitea runner (https://gitea.com/gitea/runner/releases, or your distribution's gitea-runner / act_runner package) or set runner_binary to its path"
    )]
    RunnerNotFound {
        /// The `PATH` searched.
        path: String,
    },
    /// Only one of the two credential files exists: a registration was cut short or a
    /// file was removed; registering again would orphan the runner of the other.
    #[error(
        "{} exists but {} does not: restore it, or remove both and start again to register a new runner",
        present.display(),
        missing.display()
    )]
    HalfRegistered {
        /// The file that exists.
        present: PathBuf,
        /// The file that does not.
        missing: PathBuf,
    },
    /// Registration failed.
    #[error("registering with gitea_runner_registration_token_file: {0}")]
    Register(#[source] register::RegisterError),
    /// A generated secret could not be read or written.
    #[error("{}: {source}", path.display())]
    Secret {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// Registers the runner when its credential files do not exist yet and a registration
/// token is configured; does nothing when both exist (later starts never register again).
/// Without a registration token, a missing file is reported by reading the credential.
pub async fn ensure_registered(
    gitea: &GiteaSettings,
    runner: &RunnerSettings,
    labels: Vec<String>,
) -> Result<(), FirstStartError> {
    let (uuid, token) = (&gitea.uuid_file, &gitea.token_file);
    match (uuid.exists(), token.exists()) {
        (true, true) => return Ok(()),
        (true, false) | (false, true) if gitea.registration_token_file.is_some() => {
            let (present, missing) = if uuid.exists() {
                (uuid, token)
            } else {
                (token, uuid)
            };
            return Err(FirstStartError::HalfRegistered {
                present: present.clone(),
                missing: missing.clone(),
            });
        }
        _ => {}
    }
    let Some(token_file) = &gitea.registration_token_file else {
        return Ok(());
    };
    for dir in [uuid, token].into_iter().filter_map(|p| p.parent()) {
        crate::runtime::private_dir(dir).map_err(|e| FirstStartError::Secret {
            path: dir.to_path_buf(),
            source: std::io::Error::other(e),
        })?;
    }
    let registration = Registration {
        client: register::client_options(gitea).map_err(FirstStartError::Register)?,
        registration_token: crate::settings::read_secret_file(
            "gitea_runner_registration_token_file",
            token_file,
        )
        .map_err(|e| FirstStartError::Register(e.into()))?,
        name: runner.name.clone(),
        labels,
        capabilities: runner.capabilities.clone(),
        uuid_file: uuid.clone(),
        token_file: token.clone(),
        force: false,
    };
    let registered = register::run(&registration)
        .await
        .map_err(FirstStartError::Register)?;
    tracing::info!(
        runner_id = registered.id,
        runner_uuid = %registered.uuid,
        labels = %registered.labels.join(","),
        uuid_file = %uuid.display(),
        token_file = %token.display(),
        "first start: registered the runner in Gitea; later starts reuse these files"
    );
    Ok(())
}

/// The capability key's text: read from a configured file, or from single-host mode's
/// generated one, created on first start (32 random bytes as 64 hex digits).
pub fn capability_key_text(
    file: &KeyFile,
    read_configured: impl FnOnce(&Path) -> Result<String, crate::settings::SecretFileError>,
) -> Result<String, crate::runtime::Source> {
    match file {
        KeyFile::Configured(path) => Ok(read_configured(path)?),
        KeyFile::Generated(path) => {
            let (text, created) = generated_secret(path, || {
                let key: [u8; 32] = rand::random();
                Ok(key.iter().map(|b| format!("{b:02x}")).collect::<String>() + "\n")
            })?;
            if created {
                tracing::info!(path = %path.display(), "generated the capability key of single-host mode (mode 0600)");
            }
            Ok(text.trim().to_owned())
        }
    }
}

/// The contents of `path` (and `false`), or of a new file created there from `generate`
/// (and `true`): written to a
/// private temporary file beside it, synced and linked into place, so a crash leaves
/// either no file or a whole one, and an existing file is never replaced (two starts
/// racing both read the one that won).
pub fn generated_secret(
    path: &Path,
    generate: impl FnOnce() -> std::io::Result<String>,
) -> Result<(String, bool), FirstStartError> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let fail = |source| FirstStartError::Secret {
        path: path.to_path_buf(),
        source,
    };
    match std::fs::read_to_string(path) {
        Ok(text) => return Ok((text, false)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(fail(e)),
    }
    if let Some(dir) = path.parent() {
        crate::runtime::private_dir(dir).map_err(|e| fail(std::io::Error::other(e)))?;
    }
    let text = generate().map_err(fail)?;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".{}.tmp", std::process::id()));
    let tmp = PathBuf::from(tmp);
    let _ = std::fs::remove_file(&tmp);
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .and_then(|mut file| {
            file.write_all(text.as_bytes())?;
            file.sync_all()
        })
        .and_then(|()| std::fs::hard_link(&tmp, path));
    let _ = std::fs::remove_file(&tmp);
    match written {
        Ok(()) => Ok((text, true)),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => std::fs::read_to_string(path)
            .map(|t| (t, false))
            .map_err(fail),
        Err(e) => Err(fail(e)),
    }
}

/// The official runner executors run: `configured`, else the first of [`RUNNER_NAMES`]
/// found as an executable file in `path` (the `PATH` value).
pub fn runner_binary(
    configured: Option<&Path>,
    path: Option<&std::ffi::OsStr>,
) -> Result<PathBuf, FirstStartError> {
    use std::os::unix::fs::PermissionsExt as _;
    if let Some(configured) = configured {
        return Ok(configured.to_path_buf());
    }
    let dirs: Vec<PathBuf> = path
        .map(|p| std::env::split_paths(p).collect())
        .unwrap_or_default();
    RUNNER_NAMES
        .iter()
        .flat_map(|name| dirs.iter().map(move |dir| dir.join(name)))
        .find(|candidate| {
            std::fs::metadata(candidate)
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
        .ok_or_else(|| FirstStartError::RunnerNotFound {
            path: path
                .map(|p| p.to_string_lossy().into_owned())
                .unwrap_or_default(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn executable(dir: &Path, name: &str) -> PathBuf {
        use std::os::unix::fs::PermissionsExt as _;
        let path = dir.join(name);
        std::fs::write(&path, "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path
    }

    /// A configured runner_binary wins; unset, gitea-runner is preferred over act_runner
    /// in any PATH entry, and a non-executable file does not count.
    #[test]
    fn the_runner_is_found_on_path_gitea_runner_first() {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let act = executable(a.path(), "act_runner");
        std::fs::write(b.path().join("gitea-runner"), "not executable").unwrap();
        let path = std::env::join_paths([a.path(), b.path()]).unwrap();
        assert_eq!(runner_binary(None, Some(&path)).unwrap(), act);
        let gitea = executable(b.path(), "gitea-runner");
        assert_eq!(runner_binary(None, Some(&path)).unwrap(), gitea);
        let mine = Path::new("/opt/runner");
        assert_eq!(runner_binary(Some(mine), Some(&path)).unwrap(), mine);
    }

    /// Without a runner the error names both programs, what to install and the key.
    #[test]
    fn a_missing_runner_says_what_to_install_and_which_key_to_set() {
        let empty = tempfile::tempdir().unwrap();
        let err = runner_binary(None, Some(empty.path().as_os_str()))
            .unwrap_err()
            .to_string();
        for needle in [
            "gitea-runner",
            "act_runner",
            "install the official Gitea runner",
            "runner_binary (RUNNER_BINARY)",
            &empty.path().display().to_string(),
        ] {
            assert!(err.contains(needle), "{needle:?} missing from: {err}");
        }
    }

    /// A generated secret is 0600, written once and never replaced.
    #[test]
    fn a_generated_secret_is_private_and_never_overwritten() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state/key");
        let first = generated_secret(&path, || Ok("one\n".into())).unwrap();
        let second = generated_secret(&path, || Ok("two\n".into())).unwrap();
        assert_eq!(first, ("one\n".to_owned(), true));
        assert_eq!(second, ("one\n".to_owned(), false));
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let leftovers = std::fs::read_dir(path.parent().unwrap()).unwrap().count();
        assert_eq!(leftovers, 1, "no temporary file is left behind");
    }
}
