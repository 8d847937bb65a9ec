//! `register`: one-time registration of the controller's own runner.

use std::io::Write;
use std::path::{Path, PathBuf};

use gdr_proto::runner::v1::RegisterRequest;

use crate::gitea::{ClientOptions, GiteaClient, GiteaError};
use crate::settings::{GiteaSettings, RegisterSettings, read_secret_file};

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

/// Why registration failed.
#[derive(Debug, thiserror::Error)]
pub enum RegisterError {
    /// A secret file could not be read.
    #[error(transparent)]
    Secret(#[from] crate::settings::SecretFileError),
    /// The CA bundle for an https Gitea could not be read.
    #[error("gitea_ca_file (GITEA_CA_FILE): cannot read {}: {source}", path.display())]
    ReadCa {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
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

/// Builds a [`Registration`] from the settings and flags.
pub fn prepare(
    settings: RegisterSettings,
    registration_token_file: &Path,
    name: Option<String>,
    labels: Option<Vec<String>>,
    force: bool,
) -> Result<Registration, RegisterError> {
    let RegisterSettings {
        gitea,
        runner,
        labels: default_labels,
    } = settings;
    let registration_token = read_secret_file("registration_token_file", registration_token_file)?;
    Ok(Registration {
        client: client_options(&gitea)?,
        registration_token,
        name: name.unwrap_or(runner.name),
        labels: labels.unwrap_or(default_labels),
        capabilities: runner.capabilities,
        uuid_file: gitea.uuid_file,
        token_file: gitea.token_file,
        force,
    })
}

/// The options of the (credential-less) client that registers.
pub fn client_options(gitea: &GiteaSettings) -> Result<ClientOptions, RegisterError> {
    let mut client = ClientOptions::new(gitea.url.as_str().trim_end_matches('/'));
    client.request_timeout = gitea.request_timeout;
    if let Some(ca) = &gitea.ca_file {
        client.extra_ca_pem = Some(std::fs::read(ca).map_err(|source| RegisterError::ReadCa {
            path: ca.clone(),
            source,
        })?);
    }
    Ok(client)
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

/// What the operator must do next, printed after a successful registration.
pub fn next_steps(registration: &Registration, registered: &Registered) -> String {
    format!(
        "Registered runner {name:?} (id {id}, uuid {uuid}) at {url} with labels [{labels}].\n\
         Wrote {uuid_file} and {token_file} (mode 0600; keep the token file secret).\n\
         Next:\n  \
         1. Point the controller at these files: gitea_runner_uuid_file / GITEA_RUNNER_UUID_FILE and\n     \
            gitea_runner_token_file / GITEA_RUNNER_TOKEN_FILE (already so if they came from your config).\n  \
         2. Check the rest of the configuration: gitea-dynamic-runner check-config --config <file>\n  \
         3. Start it: gitea-dynamic-runner controller --config <file>\n  \
         4. Workflows choose a backend with runs-on: [self-hosted, pod] or [self-hosted, <vm label>].\n",
        name = registered.name,
        id = registered.id,
        uuid = registered.uuid,
        url = registration.client.base_url,
        labels = registered.labels.join(", "),
        uuid_file = registration.uuid_file.display(),
        token_file = registration.token_file.display(),
    )
}
