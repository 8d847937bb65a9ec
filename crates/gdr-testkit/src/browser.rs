//! A real headless Chromium, for tests that render a page the controller serves.
//!
//! The binary comes from `CHROMIUM_BIN`, else the first of `chromium`, `chromium-browser`,
//! `google-chrome` on `PATH`; `.ci/run` installs Debian's `chromium`. A test that needs it
//! fails with an install hint when none is found: the page test must not pass by skipping.

use std::path::{Path, PathBuf};
use std::time::Duration;

/// How long one Chromium invocation may take (a cold start on a loaded machine is slow).
const RUN_TIMEOUT: Duration = Duration::from_secs(120);

/// Why rendering failed.
#[derive(Debug, thiserror::Error)]
pub enum BrowserError {
    /// No Chromium on this machine.
    #[error(
        "no Chromium found (set CHROMIUM_BIN or put chromium on PATH); install it with \
         `apt-get install chromium` (Debian) — .ci/run does"
    )]
    NotInstalled,
    /// It could not be started or waited for.
    #[error("running {binary}: {source}")]
    Spawn {
        /// The binary.
        binary: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// It did not finish in time.
    #[error("{binary} did not finish within {RUN_TIMEOUT:?}")]
    Timeout {
        /// The binary.
        binary: PathBuf,
    },
    /// It exited with an error.
    #[error("{binary} failed ({status}): {stderr}")]
    Failed {
        /// The binary.
        binary: PathBuf,
        /// Its exit status.
        status: std::process::ExitStatus,
        /// What it printed on stderr.
        stderr: String,
    },
}

/// A headless Chromium with its own throw-away profile.
pub struct Chromium {
    binary: PathBuf,
    profile: tempfile::TempDir,
}

fn on_path(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(name))
            .find(|p| p.is_file())
    })
}

impl Chromium {
    /// Finds Chromium, or says how to install it.
    pub fn find() -> Result<Self, BrowserError> {
        let binary = std::env::var_os("CHROMIUM_BIN")
            .map(PathBuf::from)
            .or_else(|| {
                ["chromium", "chromium-browser", "google-chrome"]
                    .iter()
                    .find_map(|n| on_path(n))
            })
            .ok_or(BrowserError::NotInstalled)?;
        let profile = tempfile::Builder::new()
            .prefix("gdr-chromium")
            .tempdir()
            .map_err(|source| BrowserError::Spawn {
                binary: binary.clone(),
                source,
            })?;
        Ok(Chromium { binary, profile })
    }

    async fn run(&self, args: &[String]) -> Result<Vec<u8>, BrowserError> {
        let mut command = tokio::process::Command::new(&self.binary);
        command
            .args([
                "--headless",
                // Tests run as root in a container, where Chromium's sandbox cannot start.
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--window-size=1280,900",
            ])
            .arg(format!("--user-data-dir={}", self.profile.path().display()))
            .args(args)
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true);
        let binary = self.binary.clone();
        let output = tokio::time::timeout(RUN_TIMEOUT, command.output())
            .await
            .map_err(|_| BrowserError::Timeout {
                binary: binary.clone(),
            })?
            .map_err(|source| BrowserError::Spawn {
                binary: binary.clone(),
                source,
            })?;
        if !output.status.success() {
            return Err(BrowserError::Failed {
                binary,
                status: output.status,
                stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
            });
        }
        Ok(output.stdout)
    }

    /// The DOM of `url` after it loaded (`--dump-dom`).
    pub async fn dump_dom(&self, url: &str) -> Result<String, BrowserError> {
        let out = self.run(&["--dump-dom".to_owned(), url.to_owned()]).await?;
        Ok(String::from_utf8_lossy(&out).into_owned())
    }

    /// Renders `url` into the PNG file `path` (`--screenshot`).
    pub async fn screenshot(&self, url: &str, path: &Path) -> Result<(), BrowserError> {
        self.run(&[format!("--screenshot={}", path.display()), url.to_owned()])
            .await
            .map(|_| ())
    }
}
