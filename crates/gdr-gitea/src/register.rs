//! One-time registration of the controller's own runner: the Register call and the UUID
//! and token files it writes. What to register comes from the controller's settings
//! (`gdr_controller`'s `register` module builds the [`Registration`]).

use std::io::Write;
use std::path::{Path, PathBuf};

use gdr_proto::runner::v1::RegisterRequest;

use crate::{ClientOptions, GiteaClient, GiteaError};

/// What to register and where to write the result.
#[derive(Debug, Clone)]
pub struct Registration {
    /// Gitea client options.
    pub client: ClientOptions,
    /// Registration token (from Gitea's runner settings).
    pub registration_token: String,
    /// Runner name.
    pub name: String,
    /// Labels (names only).
    pub labels: Vec<String>,
    /// Capabilities advertised to Gitea.
    pub capabilities: Vec<String>,
    /// Output: the runner UUID file.
    pub uuid_file: PathBuf,
    /// Output: the runner token file.
    pub token_file: PathBuf,
    /// Replace existing files.
    pub force: bool,
}

/// What registration produced.
#[derive(Debug, Clone)]
pub struct Registered {
    /// Runner id in Gitea.
    pub id: i64,
    /// Runner UUID.
    pub uuid: String,
    /// Runner name.
    pub name: String,
    /// Labels Gitea stored.
    pub labels: Vec<String>,
}

/// Why registering (or writing its result) failed.
#[derive(Debug, thiserror::Error)]
pub enum RegisterError {
    /// Output files exist already.
    #[error("{} already exists; refusing to overwrite a registration (use --force to register a new runner)", .0.display())]
    Exists(PathBuf),
    /// Gitea refused or could not be reached.
    #[error(transparent)]
    Gitea(#[from] GiteaError),
    /// Writing the output files failed.
    #[error("cannot write {}: {source}", path.display())]
    Write {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// Registers and writes the UUID and token files (mode 0600). Without `force` an existing
/// file is never replaced, even one that appears while Gitea answers.
pub async fn run(registration: &Registration) -> Result<Registered, RegisterError> {
    if !registration.force {
        for path in [&registration.uuid_file, &registration.token_file] {
            if path.exists() {
                return Err(RegisterError::Exists(path.clone()));
            }
        }
    }
    let client = GiteaClient::new(registration.client.clone(), None)?;
    let runner = client
        .register(RegisterRequest {
            name: registration.name.clone(),
            token: registration.registration_token.clone(),
            version: crate::VERSION.to_string(),
            labels: registration.labels.clone(),
            ephemeral: false,
            capabilities: registration.capabilities.clone(),
            ..Default::default()
        })
        .await?;
    // Both files are staged first so a failure never leaves a UUID without its token.
    let uuid_tmp = stage(&registration.uuid_file, &runner.uuid)?;
    let token_tmp = stage(&registration.token_file, &runner.token)?;
    publish(&token_tmp, &registration.token_file, registration.force)?;
    publish(&uuid_tmp, &registration.uuid_file, registration.force)?;
    tracing::info!(runner_id = runner.id, runner_uuid = %runner.uuid, name = %runner.name, "registered runner");
    Ok(Registered {
        id: runner.id,
        uuid: runner.uuid,
        name: runner.name,
        labels: runner.labels,
    })
}

fn stage(target: &Path, content: &str) -> Result<PathBuf, RegisterError> {
    let mut tmp = target.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let write = || -> std::io::Result<()> {
        let _ = std::fs::remove_file(&tmp);
        let mut options = std::fs::OpenOptions::new();
        options.write(true).create_new(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
        let mut file = options.open(&tmp)?;
        file.write_all(content.as_bytes())?;
        file.write_all(b"\n")?;
        file.sync_all()
    };
    write().map_err(|source| RegisterError::Write {
        path: target.to_path_buf(),
        source,
    })?;
    Ok(tmp)
}

/// Moves the staged file into place: a rename with `force`, else a link that fails when
/// `target` exists (so nothing is overwritten).
fn publish(tmp: &Path, target: &Path, force: bool) -> Result<(), RegisterError> {
    let moved = if force {
        std::fs::rename(tmp, target)
    } else {
        let linked = std::fs::hard_link(tmp, target);
        let _ = std::fs::remove_file(tmp);
        linked
    };
    moved.map_err(|source| match source.kind() {
        std::io::ErrorKind::AlreadyExists => RegisterError::Exists(target.to_path_buf()),
        _ => RegisterError::Write {
            path: target.to_path_buf(),
            source,
        },
    })
}
