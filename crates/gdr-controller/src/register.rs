//! `register`: one-time registration of the controller's own runner. The Register call and
//! the files it writes are the Gitea client's ([`gdr_gitea::register`]); this module builds
//! the [`Registration`] from the settings and the flags.

use std::path::{Path, PathBuf};

use gdr_gitea::ClientOptions;
pub use gdr_gitea::register::{Registered, Registration};

use crate::settings::{GiteaSettings, RegisterSettings, read_secret_file};

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
    /// Gitea refused, could not be reached, or the files could not be written.
    #[error(transparent)]
    Register(#[from] gdr_gitea::register::RegisterError),
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

/// Registers and writes the UUID and token files ([`gdr_gitea::register::run`]).
pub async fn run(registration: &Registration) -> Result<Registered, RegisterError> {
    Ok(gdr_gitea::register::run(registration).await?)
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
