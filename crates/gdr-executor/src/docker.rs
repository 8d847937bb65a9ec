//! A Docker daemon for the job, started by the executor when `CI_RUNNER_START_DOCKER` is
//! set (the executor image's Pods and VMs run Docker inside the environment so jobs can
//! build images). The job's runner starts only once the daemon answers `/_ping` on its
//! socket, so the first `docker` step never races the daemon's start-up; the runner gets
//! `DOCKER_HOST` pointing at that socket. The daemon is stopped after the runner, however
//! the runner ended (SIGTERM, so it stops its containers; SIGKILL after a grace).
//!
//! It replaces the Go image's job-started hook (wait for the job's SVID, start dockerd,
//! wait for `docker info`): the executor starts the daemon only once it holds its SVID.

use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::time::Duration;

use rustix::process::{Pid, Signal};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// `CI_RUNNER_START_DOCKER`: `true`/`false` (also `1`/`0`, `yes`/`no`).
pub const START_DOCKER: &str = "CI_RUNNER_START_DOCKER";
/// `CI_DOCKERD`: the daemon program (default `dockerd`, found on `PATH`).
pub const DOCKERD: &str = "CI_DOCKERD";
/// `CI_DOCKER_SOCKET`: the daemon's Unix socket (default `/var/run/docker.sock`).
pub const DOCKER_SOCKET: &str = "CI_DOCKER_SOCKET";
/// `CI_DOCKER_READY_TIMEOUT`: seconds to wait for the daemon (default 60).
pub const DOCKER_READY_TIMEOUT: &str = "CI_DOCKER_READY_TIMEOUT";
/// `CI_DOCKER_EXTERNAL`: `true` when the daemon on `CI_DOCKER_SOCKET` is another
/// container's (the Pod's `dockerd` sidecar): the executor waits for it to answer and
/// neither starts, prepares nor stops a daemon, so its processes keep their container's
/// cgroup (issue 37 item 3: SPIRE's `k8s` attestor reads the container ID from it).
pub const DOCKER_EXTERNAL: &str = "CI_DOCKER_EXTERNAL";

/// dockerd's own shutdown stops containers with a 10 s grace; a little more than that.
const STOP_GRACE: Duration = Duration::from_secs(15);
const POLL: Duration = Duration::from_millis(100);

/// How to start the daemon.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DockerSettings {
    /// The daemon program.
    pub program: PathBuf,
    /// Its socket.
    pub socket: PathBuf,
    /// How long it may take to answer.
    pub ready_timeout: Duration,
    /// The daemon is another container's (`CI_DOCKER_EXTERNAL`): wait for it only.
    pub external: bool,
}

/// Why the daemon could not be started.
#[derive(Debug, thiserror::Error)]
pub enum DockerError {
    /// A variable is invalid.
    #[error("{name}: {problem}")]
    Env {
        /// The variable.
        name: &'static str,
        /// What is wrong.
        problem: String,
    },
    /// The program could not be started.
    #[error("starting the Docker daemon {program}: {source}")]
    Spawn {
        /// The program.
        program: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The daemon exited before it answered.
    #[error(
        "the Docker daemon {program} ({DOCKERD}) exited before it answered on {socket}: {status}"
    )]
    Exited {
        /// The program.
        program: PathBuf,
        /// Its socket.
        socket: PathBuf,
        /// Its exit status.
        status: ExitStatus,
    },
    /// The daemon did not answer in time (it is stopped).
    #[error(
        "the Docker daemon {program} ({DOCKERD}) did not answer on {socket} within {timeout:?} \
         ({DOCKER_READY_TIMEOUT})"
    )]
    NotReady {
        /// The program.
        program: PathBuf,
        /// Its socket.
        socket: PathBuf,
        /// The deadline.
        timeout: Duration,
    },
    /// The Pod's daemon (`CI_DOCKER_EXTERNAL`) did not answer in time.
    #[error(
        "the Docker daemon of the Pod's dockerd container ({DOCKER_EXTERNAL}) did not answer \
         on {socket} within {timeout:?} ({DOCKER_READY_TIMEOUT})"
    )]
    ExternalNotReady {
        /// Its socket.
        socket: PathBuf,
        /// The deadline.
        timeout: Duration,
    },
    /// Waiting for the daemon failed.
    #[error("waiting for the Docker daemon: {0}")]
    Wait(#[source] std::io::Error),
}

impl DockerSettings {
    /// Reads the variables through `get`; `None` when no daemon is wanted (the default).
    pub fn from_env(get: impl Fn(&str) -> Option<String>) -> Result<Option<Self>, DockerError> {
        Self::from_env_or(get, false)
    }

    /// Like [`Self::from_env`], with `default` when `CI_RUNNER_START_DOCKER` is unset (the
    /// executor started as root in its Pod or VM starts the daemon by default).
    pub fn from_env_or(
        get: impl Fn(&str) -> Option<String>,
        default: bool,
    ) -> Result<Option<Self>, DockerError> {
        let wanted = match get(START_DOCKER).as_deref().map(str::trim) {
            None | Some("") => default,
            Some(v) => parse_bool(v).ok_or_else(|| DockerError::Env {
                name: START_DOCKER,
                problem: format!("{v:?} is neither true nor false"),
            })?,
        };
        if !wanted {
            return Ok(None);
        }
        let non_empty = |name| get(name).filter(|v| !v.trim().is_empty());
        let ready_timeout = match non_empty(DOCKER_READY_TIMEOUT) {
            None => Duration::from_secs(60),
            Some(v) => Duration::from_secs(v.trim().parse().map_err(|_| DockerError::Env {
                name: DOCKER_READY_TIMEOUT,
                problem: format!("{v:?} is not a number of seconds"),
            })?),
        };
        let external = match non_empty(DOCKER_EXTERNAL) {
            None => false,
            Some(v) => parse_bool(v.trim()).ok_or_else(|| DockerError::Env {
                name: DOCKER_EXTERNAL,
                problem: format!("{v:?} is neither true nor false"),
            })?,
        };
        Ok(Some(DockerSettings {
            external,
            program: non_empty(DOCKERD).map_or_else(|| PathBuf::from("dockerd"), PathBuf::from),
            socket: non_empty(DOCKER_SOCKET)
                .map_or_else(|| PathBuf::from("/var/run/docker.sock"), PathBuf::from),
            ready_timeout,
        }))
    }
}

fn parse_bool(v: &str) -> Option<bool> {
    match v.to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" => Some(true),
        "false" | "0" | "no" => Some(false),
        _ => None,
    }
}

/// A running daemon; killed (SIGKILL) if dropped without [`Dockerd::stop`]. An external
/// one (`CI_DOCKER_EXTERNAL`) has no child here: it is its container's, which ends it.
#[derive(Debug)]
pub struct Dockerd {
    child: Option<tokio::process::Child>,
    socket: PathBuf,
}

impl Dockerd {
    /// Starts the daemon and waits until it answers `/_ping`, for at most
    /// `settings.ready_timeout`; a daemon that did not answer by then is stopped. An
    /// external daemon is only waited for.
    pub async fn start(settings: &DockerSettings) -> Result<Self, DockerError> {
        if settings.external {
            return Self::wait_external(settings).await;
        }
        let mut child = tokio::process::Command::new(&settings.program)
            .arg("--host")
            .arg(format!("unix://{}", settings.socket.display()))
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .map_err(|source| DockerError::Spawn {
                program: settings.program.clone(),
                source,
            })?;
        tracing::info!(program = %settings.program.display(), socket = %settings.socket.display(), "starting the Docker daemon");
        let deadline = tokio::time::Instant::now() + settings.ready_timeout;
        loop {
            if let Some(status) = child.try_wait().map_err(DockerError::Wait)? {
                return Err(DockerError::Exited {
                    program: settings.program.clone(),
                    socket: settings.socket.clone(),
                    status,
                });
            }
            let answered = tokio::time::timeout_at(deadline, pings(&settings.socket))
                .await
                .unwrap_or(false);
            if answered {
                tracing::info!(socket = %settings.socket.display(), "the Docker daemon answers");
                return Ok(Dockerd {
                    child: Some(child),
                    socket: settings.socket.clone(),
                });
            }
            if tokio::time::Instant::now() >= deadline {
                // It may have started containerd already: an orderly stop, not a SIGKILL.
                Dockerd {
                    child: Some(child),
                    socket: settings.socket.clone(),
                }
                .stop()
                .await;
                return Err(DockerError::NotReady {
                    program: settings.program.clone(),
                    socket: settings.socket.clone(),
                    timeout: settings.ready_timeout,
                });
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Waits until the external daemon answers, for at most `settings.ready_timeout`.
    async fn wait_external(settings: &DockerSettings) -> Result<Self, DockerError> {
        let deadline = tokio::time::Instant::now() + settings.ready_timeout;
        loop {
            let answered = tokio::time::timeout_at(deadline, pings(&settings.socket))
                .await
                .unwrap_or(false);
            if answered {
                tracing::info!(socket = %settings.socket.display(), "the Pod's Docker daemon answers");
                return Ok(Dockerd {
                    child: None,
                    socket: settings.socket.clone(),
                });
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(DockerError::ExternalNotReady {
                    socket: settings.socket.clone(),
                    timeout: settings.ready_timeout,
                });
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// The daemon's pid, when this process started it.
    pub fn pid(&self) -> Option<rustix::process::Pid> {
        self.child
            .as_ref()?
            .id()
            .and_then(|p| i32::try_from(p).ok())
            .and_then(rustix::process::Pid::from_raw)
    }

    /// `DOCKER_HOST` for the runner and the job.
    pub fn docker_host(&self) -> String {
        format!("unix://{}", self.socket.display())
    }

    /// Waits until the daemon this process started exits (never, for an external one).
    pub async fn exited(&mut self) -> Result<ExitStatus, DockerError> {
        match self.child.as_mut() {
            Some(child) => child.wait().await.map_err(DockerError::Wait),
            None => std::future::pending().await,
        }
    }

    /// Stops the daemon: SIGTERM (it stops its containers), SIGKILL after a grace. An
    /// external daemon is left to its container.
    pub async fn stop(self) {
        let Some(mut child) = self.child else {
            return;
        };
        if let Some(pid) = child
            .id()
            .and_then(|p| i32::try_from(p).ok())
            .and_then(Pid::from_raw)
        {
            let _ = rustix::process::kill_process(pid, Signal::TERM);
        }
        match tokio::time::timeout(STOP_GRACE, child.wait()).await {
            Ok(_) => {
                tracing::info!(socket = %self.socket.display(), "the Docker daemon stopped");
            }
            Err(_) => {
                tracing::warn!(socket = %self.socket.display(), "the Docker daemon ignored SIGTERM; killing it");
                let _ = child.kill().await;
            }
        }
    }
}

/// True when the daemon on `socket` answers `GET /_ping` with 200.
async fn pings(socket: &Path) -> bool {
    let Ok(Ok(mut stream)) = tokio::time::timeout(
        Duration::from_secs(2),
        tokio::net::UnixStream::connect(socket),
    )
    .await
    else {
        return false;
    };
    let request = b"GET /_ping HTTP/1.0\r\nHost: docker\r\n\r\n";
    if stream.write_all(request).await.is_err() {
        return false;
    }
    let mut head = [0u8; 32];
    let mut filled = 0;
    while filled < 12 {
        match tokio::time::timeout(Duration::from_secs(2), stream.read(&mut head[filled..])).await {
            Ok(Ok(0)) | Ok(Err(_)) | Err(_) => break,
            Ok(Ok(n)) => filled += n,
        }
    }
    let head = &head[..filled];
    head.starts_with(b"HTTP/1.") && head.get(8..12) == Some(b" 200".as_slice())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(env: &[(&str, &str)]) -> Result<Option<DockerSettings>, DockerError> {
        DockerSettings::from_env(|name| {
            env.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| (*v).to_owned())
        })
    }

    #[test]
    fn no_daemon_is_started_unless_asked_for() {
        assert_eq!(settings(&[]).unwrap(), None);
        assert_eq!(settings(&[(START_DOCKER, "false")]).unwrap(), None);
        let s = settings(&[(START_DOCKER, "true")]).unwrap().unwrap();
        assert_eq!(s.program, PathBuf::from("dockerd"));
        assert_eq!(s.socket, PathBuf::from("/var/run/docker.sock"));
    }

    #[test]
    fn a_malformed_switch_names_the_variable() {
        let e = settings(&[(START_DOCKER, "maybe")]).unwrap_err();
        assert!(e.to_string().starts_with("CI_RUNNER_START_DOCKER:"), "{e}");
        let e = settings(&[(START_DOCKER, "1"), (DOCKER_READY_TIMEOUT, "soon")]).unwrap_err();
        assert!(e.to_string().starts_with("CI_DOCKER_READY_TIMEOUT:"), "{e}");
    }

    // The daemon's start, readiness and stop are tested with a stand-in dockerd from the
    // test kit, through the executor, in the root package's tests/facade.rs.

    #[tokio::test]
    async fn a_missing_program_is_named() {
        let settings = DockerSettings {
            program: PathBuf::from("/nonexistent/dockerd"),
            socket: PathBuf::from("/nonexistent.sock"),
            ready_timeout: Duration::from_secs(1),
            external: false,
        };
        let e = Dockerd::start(&settings).await.unwrap_err();
        assert!(e.to_string().contains("/nonexistent/dockerd"), "{e}");
    }

    /// DESIGN invariant 16: an external daemon (the Pod's `dockerd` container) is waited
    /// for, never started: a socket nobody answers on fails within the timeout, naming
    /// the variable, however absent the program is.
    #[tokio::test]
    async fn an_external_daemon_is_only_waited_for_and_its_silence_is_named() {
        let s = settings(&[(START_DOCKER, "true"), (DOCKER_EXTERNAL, "true")])
            .unwrap()
            .unwrap();
        assert!(s.external);
        let settings = DockerSettings {
            program: PathBuf::from("/nonexistent/dockerd"),
            socket: PathBuf::from("/nonexistent.sock"),
            ready_timeout: Duration::from_millis(300),
            external: true,
        };
        let e = Dockerd::start(&settings).await.unwrap_err();
        assert!(matches!(e, DockerError::ExternalNotReady { .. }), "{e}");
        assert!(e.to_string().contains("CI_DOCKER_EXTERNAL"), "{e}");
    }
}
