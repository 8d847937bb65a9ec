//! The `executor` subcommand (DESIGN invariant 16): runs inside a Pod, VM or local
//! process directory, serves the loopback proxy to the facade over SPIFFE mTLS, writes a
//! one-shot `.runner`, waits until the facade answers, then runs the unmodified official
//! runner as `daemon --once` and exits with its status.
//!
//! With `CI_RUNNER_START_DOCKER` it also starts the job's Docker daemon once it holds its
//! SVID, starts the runner only after the daemon answers (with `DOCKER_HOST` pointing at
//! it), and stops the daemon after the runner, however the runner ended ([`crate::docker`]).
//!
//! Restarts of the controller cost no job (DESIGN invariant 19): a runner that exits before
//! its task was claimed (its `Declare` failed while the facade was away) is started again,
//! with backoff, for as long as the outage tolerance; and the executor does not exit before
//! everything the runner reported reached the facade, or the tolerance ran out (then it
//! exits non-zero and says what was lost).
//!
//! The executor never sees the controller's Gitea credential: its runner token is the
//! assignment-scoped capability, useful only at the facade and only with this
//! workload's SVID.

use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::sync::Arc;
use std::time::Duration;

use gdr_core::assignment::AssignmentId;
use gdr_core::backend::Backend;
use gdr_core::backoff::Backoff;
use gdr_core::executor::env;
use rustix::process::{Pid, Signal};
use serde::Serialize;

use crate::docker::{DockerError, DockerSettings, Dockerd};
pub use crate::forward::Forward;
use crate::relay::{Claim, Relay, Settled};

/// `CI_RUNNER_CONFIG`: the official runner's configuration file, passed as `--config`.
pub const RUNNER_CONFIG: &str = "CI_RUNNER_CONFIG";

/// Default of `CI_EXECUTOR_REPORT_OUTAGE_TOLERANCE` (the controller's
/// `executor_report_outage_tolerance` default).
pub const DEFAULT_REPORT_OUTAGE_TOLERANCE: Duration = Duration::from_secs(30 * 60);
/// How long the runner may take to end a job Gitea cancelled (`CI_EXECUTOR_CANCEL_GRACE`).
pub const CANCEL_GRACE: &str = "CI_EXECUTOR_CANCEL_GRACE";
/// The default of [`CANCEL_GRACE`]: the runner ends a cancelled job within seconds unless a
/// step's own child process holds its output open (the official runner kills only the
/// step's shell on Linux, and waits for the output to close).
pub const DEFAULT_CANCEL_GRACE: Duration = Duration::from_secs(15);
/// Starting the runner again after it exited before its task was claimed.
const RUNNER_RESTART: Backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(30));

/// Everything the executor reads from its environment.
#[derive(Clone)]
pub struct ExecutorConfig {
    /// `CI_ASSIGNMENT_ID`.
    pub assignment_id: AssignmentId,
    /// `CI_RUNNER_CAPABILITY` (never logged).
    pub capability: String,
    /// `CI_RUNNER_BACKEND`.
    pub backend: Backend,
    /// Label the runner declares for the backend (`CI_RUNNER_LABEL`, default the backend name).
    pub backend_label: String,
    /// `CI_RUNNER_FACADE_URL`.
    pub facade_url: String,
    /// `CI_RUNNER_FACADE_SPIFFE_ID`.
    pub facade_spiffe_id: String,
    /// `SPIFFE_ENDPOINT_SOCKET`.
    pub workload_api: String,
    /// `GITEA_RUNNER_BINARY` (default `gitea-runner`).
    pub runner_binary: PathBuf,
    /// `CI_RUNNER_WORKDIR` (default: a new temporary directory, removed afterwards).
    pub work_dir: Option<PathBuf>,
    /// `CI_RUNNER_CONFIG`: the official runner's configuration file, passed to it as
    /// `--config <path>`; it must exist (default: none, the runner's built-in defaults).
    pub runner_config: Option<PathBuf>,
    /// The job's Docker daemon, started before the runner, which gets `DOCKER_HOST`
    /// pointing at it (`None`: no daemon). `CI_RUNNER_START_DOCKER` (`true`/`false`,
    /// `1`/`0`, `yes`/`no`; default false) switches it on; `CI_DOCKERD` is the program
    /// (default `dockerd` on `PATH`), `CI_DOCKER_SOCKET` its Unix socket (default
    /// `/var/run/docker.sock`), `CI_DOCKER_READY_TIMEOUT` how many seconds it may take to
    /// answer (default 60) before the executor fails.
    pub docker: Option<DockerSettings>,
    /// How long to wait for the SVID and the facade (`CI_EXECUTOR_READY_TIMEOUT` seconds, default 120).
    pub ready_timeout: Duration,
    /// How long the runner's reports are held while the facade is unreachable, and how
    /// long a runner that exits before its task was claimed is started again
    /// (`CI_EXECUTOR_REPORT_OUTAGE_TOLERANCE` seconds, default 30 minutes).
    pub report_outage_tolerance: Duration,
    /// How long the runner may take to end its job after Gitea answered that the job was
    /// cancelled, before the executor ends the job's processes itself
    /// (`CI_EXECUTOR_CANCEL_GRACE` seconds, default 15).
    pub cancel_grace: Duration,
}

impl std::fmt::Debug for ExecutorConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExecutorConfig")
            .field("assignment_id", &self.assignment_id.as_str())
            .field("backend", &self.backend)
            .field("facade_url", &self.facade_url)
            .field("facade_spiffe_id", &self.facade_spiffe_id)
            .field("runner_binary", &self.runner_binary)
            .field("runner_config", &self.runner_config)
            .field("docker", &self.docker)
            .field("report_outage_tolerance", &self.report_outage_tolerance)
            .field("cancel_grace", &self.cancel_grace)
            .finish_non_exhaustive()
    }
}

/// Why the executor could not run its job.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// A required variable is missing or invalid.
    #[error("{name}: {problem}")]
    Env {
        /// Variable.
        name: &'static str,
        /// What is wrong.
        problem: String,
    },
    /// The assignment ID variable is not an assignment ID.
    #[error("{name}: {source}")]
    AssignmentId {
        /// Variable.
        name: &'static str,
        /// Why it is not one.
        #[source]
        source: gdr_core::assignment_id::AssignmentIdError,
    },
    /// SPIFFE setup failed.
    #[error(transparent)]
    Spiffe(#[from] gdr_identity::svid_stream::SvidStreamError),
    /// The loopback proxy could not start.
    #[error(transparent)]
    Proxy(#[from] crate::proxy::ProxyError),
    /// Local I/O failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// Cause.
        source: std::io::Error,
    },
    /// `CI_RUNNER_CONFIG` names no readable file.
    #[error("{RUNNER_CONFIG}: the runner configuration {path} cannot be used: {source}")]
    RunnerConfig {
        /// The path.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// `GITEA_RUNNER_BINARY` cannot be executed by the uid the job runs as (a root
    /// executor runs it as `CI_RUNNER_UID`, which must reach it through every directory).
    #[error("GITEA_RUNNER_BINARY: the runner {path} cannot be executed by uid {uid}: {source}")]
    RunnerNotExecutable {
        /// The path.
        path: PathBuf,
        /// The uid that tried.
        uid: u32,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The job's Docker daemon could not be started.
    #[error(transparent)]
    Docker(#[from] DockerError),
    /// The facade never answered.
    #[error("the facade at {0} did not answer in time")]
    FacadeUnreachable(String),
    /// A SIGTERM or SIGINT came while the executor still waited for its SVID or its Docker
    /// daemon: there was no runner yet to pass it to, nor anything to report.
    #[error("stopped by {0:?} before the runner started")]
    Stopped(Forward),
    /// The facade stayed unreachable longer than the tolerance after the runner reported.
    #[error(
        "gave up delivering the runner's reports after the facade was unreachable for {waited:?} \
         (executor_report_outage_tolerance {tolerance:?}): {rows} log rows{} not delivered",
        if *.result { " and the job's result" } else { "" }
    )]
    ReportsUndelivered {
        /// How long the executor waited.
        waited: Duration,
        /// The tolerance.
        tolerance: Duration,
        /// Log rows lost.
        rows: usize,
        /// Whether the result was lost too.
        result: bool,
    },
    /// The facade refused some of the reports the executor held for the runner, for good
    /// (each refusal is logged with what it dropped); everything else was delivered.
    #[error(
        "the facade refused some of the runner's held reports for good: {rows} log rows{} not delivered",
        if *.result { " and the job's result" } else { "" }
    )]
    ReportsRefused {
        /// Log rows lost.
        rows: usize,
        /// Whether the result was lost too.
        result: bool,
    },
}

impl ExecutorConfig {
    /// Reads the `CI_*` environment through `get` (the process environment in `main`).
    pub fn from_env(get: impl Fn(&str) -> Option<String>) -> Result<Self, RunError> {
        let required = |name: &'static str| {
            get(name)
                .filter(|v| !v.trim().is_empty())
                .ok_or(RunError::Env {
                    name,
                    problem: "is required".into(),
                })
        };
        let id_text = required(env::ASSIGNMENT_ID)?;
        let assignment_id =
            AssignmentId::parse(&id_text).map_err(|source| RunError::AssignmentId {
                name: env::ASSIGNMENT_ID,
                source,
            })?;
        let backend_text = required(env::BACKEND)?;
        let backend: Backend = backend_text.parse().map_err(|_| RunError::Env {
            name: env::BACKEND,
            problem: format!("{backend_text:?} is neither pod nor vm"),
        })?;
        let facade_url = required(env::FACADE_URL)?;
        if !facade_url.starts_with("https://") {
            return Err(RunError::Env {
                name: env::FACADE_URL,
                problem: "must be an https:// URL".into(),
            });
        }
        let seconds = |name: &'static str, default: Duration| match get(name) {
            Some(v) => v
                .trim()
                .parse()
                .map(Duration::from_secs)
                .map_err(|_| RunError::Env {
                    name,
                    problem: format!("{v:?} is not a number of seconds"),
                }),
            None => Ok(default),
        };
        let ready_timeout = seconds("CI_EXECUTOR_READY_TIMEOUT", Duration::from_secs(120))?;
        let report_outage_tolerance = seconds(
            env::REPORT_OUTAGE_TOLERANCE,
            DEFAULT_REPORT_OUTAGE_TOLERANCE,
        )?;
        let cancel_grace = seconds(CANCEL_GRACE, DEFAULT_CANCEL_GRACE)?;
        Ok(ExecutorConfig {
            assignment_id,
            capability: required(env::CAPABILITY)?,
            backend_label: get("CI_RUNNER_LABEL").unwrap_or_else(|| backend.as_str().to_string()),
            backend,
            facade_url,
            facade_spiffe_id: required(env::FACADE_SPIFFE_ID)?,
            workload_api: required(env::SPIFFE_ENDPOINT_SOCKET)?,
            runner_binary: get("GITEA_RUNNER_BINARY")
                .map_or_else(|| PathBuf::from("gitea-runner"), PathBuf::from),
            work_dir: get("CI_RUNNER_WORKDIR").map(PathBuf::from),
            runner_config: get(RUNNER_CONFIG)
                .filter(|v| !v.trim().is_empty())
                .map(PathBuf::from),
            docker: DockerSettings::from_env(&get)?,
            ready_timeout,
            report_outage_tolerance,
            cancel_grace,
        })
    }
}

/// The runner's registration file name; it holds the capability.
pub const RUNNER_FILE: &str = ".runner";

/// The official runner's registration file (v3.5.0 schema).
#[derive(Serialize)]
struct RunnerFile<'a> {
    #[serde(rename = "WARNING")]
    warning: &'a str,
    id: i64,
    uuid: &'a str,
    name: &'a str,
    token: &'a str,
    address: &'a str,
    labels: Vec<&'a str>,
    ephemeral: bool,
}

/// Writes `.runner` (mode 0600) for one pre-assigned task.
pub fn write_runner_file(
    dir: &Path,
    config: &ExecutorConfig,
    proxy_url: &str,
) -> Result<PathBuf, RunError> {
    let file = RunnerFile {
        warning: "Generated for one pre-assigned task by gitea-dynamic-runner; the token works only at its facade.",
        id: 0,
        uuid: config.assignment_id.as_str(),
        name: config.assignment_id.as_str(),
        token: &config.capability,
        address: proxy_url,
        labels: vec!["self-hosted", &config.backend_label],
        ephemeral: true,
    };
    let mut text = serde_json::to_string_pretty(&file).map_err(|e| RunError::Io {
        what: "encoding .runner".into(),
        source: std::io::Error::other(e),
    })?;
    text.push('\n');
    let path = dir.join(RUNNER_FILE);
    let io = |source| RunError::Io {
        what: format!("writing {}", path.display()),
        source,
    };
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    let mut handle = options.open(&path).map_err(io)?;
    std::io::Write::write_all(&mut handle, text.as_bytes()).map_err(io)?;
    Ok(path)
}

/// Removes the capability-bearing `.runner` (and a temporary work directory) however the
/// executor returns: early errors included.
struct Cleanup {
    runner_file: Option<PathBuf>,
    temp_dir: Option<PathBuf>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if let Some(file) = self.runner_file.take() {
            let _ = std::fs::remove_file(file);
        }
        if let Some(dir) = self.temp_dir.take() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// Runs the executor until the runner exits; returns the runner's exit status. `signals`
/// are passed on to the runner (the caller owns the signal handlers). Boxed so its state
/// machine is compiled once, in this crate, not again in the binary that polls it (release
/// builds share no generic instantiation across crates).
pub fn run(
    config: ExecutorConfig,
    signals: tokio::sync::mpsc::Receiver<Forward>,
) -> std::pin::Pin<Box<dyn Future<Output = Result<ExitStatus, RunError>> + Send>> {
    Box::pin(run_executor(config, signals))
}

async fn run_executor(
    mut config: ExecutorConfig,
    mut signals: tokio::sync::mpsc::Receiver<Forward>,
) -> Result<ExitStatus, RunError> {
    if let Some(path) = &config.runner_config {
        config.runner_config = Some(check_runner_config(path)?);
    }
    check_runner_binary(&config.runner_binary)?;
    // One Workload API stream for the executor's life: its first message is the SVID,
    // later ones its rotations (issue 39: no second stream in every executor's start).
    let svids = until_signalled(
        &mut signals,
        gdr_identity::svid_stream::svid_stream(&config.workload_api, config.ready_timeout),
    )
    .await??;
    let client_config = Arc::new(gdr_identity::svid_stream::executor_client_config(
        &svids,
        &config.facade_spiffe_id,
    )?);
    // Stops the proxy on every way out, the early error returns included.
    let proxy = LoopbackProxy::start(&config, &client_config).await?;
    let (work_dir, cleanup) = prepare_work_dir(&config, &proxy.url)?;
    // No probe of the facade first: the runner's first call proves the channel (the relay
    // holds it through a facade outage), and a facade that never answers ends the run at
    // the ready timeout below.
    let dockerd = until_signalled(&mut signals, start_dockerd(config.docker.as_ref())).await??;

    // A cancelled step's process outlives the shell the runner kills; adopted, it stays
    // where the cancel grace finds it.
    if let Err(e) = crate::descendants::adopt_orphans() {
        tracing::warn!(assignment_id = %config.assignment_id.as_str(), error = %e, "cannot adopt the job's orphaned processes; a cancelled job's stray process may outlive the grace");
    }
    let keep: Vec<Pid> = dockerd
        .as_ref()
        .and_then(Dockerd::pid)
        .into_iter()
        .collect();
    let docker_host = dockerd.as_ref().map(Dockerd::docker_host);
    let relay = &proxy.relay;
    let ran = tokio::select! {
        ran = run_runner(
            &config,
            &work_dir,
            &proxy.url,
            docker_host.as_deref(),
            &keep,
            relay,
            &mut signals,
        ) => ran,
        // Dropping the runner's future kills the runner (`kill_on_drop`).
        () = unanswered(relay, config.ready_timeout) => {
            Err(RunError::FacadeUnreachable(config.facade_url.clone()))
        }
    };
    // The job's daemon ends with its runner, however the runner ended (a forwarded signal
    // included), while the reports may still be on their way.
    let stopping = stop_dockerd(dockerd);
    let (status, terminating) = match ran {
        Ok(ran) => ran,
        Err(e) => {
            stopping.await;
            return Err(e);
        }
    };
    // Invariant 19: the runner may have been answered by the relay; nothing leaves
    // before the facade has it — unless the executor is being terminated.
    let (settled, ()) = tokio::join!(settle(relay, &mut signals, terminating), stopping);
    proxy.stop().await;
    drop(cleanup);
    outcome(settled, status, config.report_outage_tolerance)
}

/// The loopback proxy the runner talks to, relaying to the facade. Dropped (an early error
/// return), it is told to stop and left to finish on its own.
struct LoopbackProxy {
    /// `http://127.0.0.1:<port>`, the runner's Gitea address.
    url: String,
    relay: Arc<Relay>,
    stop: gdr_shutdown::ShutdownGuard,
    task: tokio::task::JoinHandle<Result<(), crate::proxy::ProxyError>>,
}

impl LoopbackProxy {
    /// Binds a loopback port and serves the proxy on it.
    async fn start(
        config: &ExecutorConfig,
        client_config: &rustls::ClientConfig,
    ) -> Result<Self, RunError> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|source| RunError::Io {
                what: "binding the loopback proxy".into(),
                source,
            })?;
        let local = listener.local_addr().map_err(|source| RunError::Io {
            what: "reading the proxy address".into(),
            source,
        })?;
        let relay = Relay::new(
            config.assignment_id.as_str(),
            &config.facade_url,
            client_config,
            config.report_outage_tolerance,
        )?;
        let credentials = crate::proxy::RunnerCredentials::new(
            config.assignment_id.as_str(),
            &config.capability,
        )?;
        let (stop, stopped) = gdr_shutdown::shutdown_channel();
        let stop = stop.into_guard();
        let task = tokio::spawn(crate::proxy::serve_loopback_proxy(
            listener,
            relay.clone(),
            credentials,
            stopped,
        ));
        Ok(LoopbackProxy {
            url: format!("http://{local}"),
            relay,
            stop,
            task,
        })
    }

    /// Stops the proxy and waits until it has.
    async fn stop(self) {
        drop(self.stop);
        let _ = self.task.await;
    }
}

/// The directory the runner works in (`CI_RUNNER_WORKDIR` or a new temporary one) with the
/// one-shot `.runner` written into it; the returned [`Cleanup`] removes what was created.
fn prepare_work_dir(
    config: &ExecutorConfig,
    proxy_url: &str,
) -> Result<(PathBuf, Cleanup), RunError> {
    let mut cleanup = Cleanup {
        runner_file: None,
        temp_dir: None,
    };
    let work_dir = match &config.work_dir {
        Some(dir) => dir.clone(),
        None => {
            let temp = tempdir()?;
            cleanup.temp_dir = Some(temp.clone());
            temp
        }
    };
    cleanup.runner_file = Some(work_dir.join(RUNNER_FILE));
    write_runner_file(&work_dir, config, proxy_url)?;
    Ok((work_dir, cleanup))
}

/// The executor's result once the reports are settled: the runner's status if the facade
/// has everything it reported.
fn outcome(
    settled: Settled,
    status: ExitStatus,
    tolerance: Duration,
) -> Result<ExitStatus, RunError> {
    match settled {
        Settled::Delivered => Ok(status),
        Settled::Refused { rows, result } => Err(RunError::ReportsRefused { rows, result }),
        Settled::GaveUp {
            waited,
            rows,
            result,
        } => Err(RunError::ReportsUndelivered {
            waited,
            tolerance,
            rows,
            result,
        }),
    }
}

/// How long a terminated executor still tries to deliver held reports: well inside a
/// Pod's default 30 s grace between SIGTERM and SIGKILL, and longer than the longest
/// pause between two delivery attempts (5 s), so one more attempt is made.
pub const TERMINATION_DELIVERY: Duration = Duration::from_secs(10);

/// Waits until the held reports are delivered, refused or given up after the outage
/// tolerance; once the executor is told to terminate (before or during the wait) it
/// makes one last attempt of at most [`TERMINATION_DELIVERY`] and gives up the rest:
/// a SIGTERM is never ignored for the sake of held reports (docs/executor.md).
async fn settle(
    relay: &Relay,
    signals: &mut tokio::sync::mpsc::Receiver<Forward>,
    terminating: bool,
) -> Settled {
    if !terminating {
        tokio::select! {
            settled = relay.settled() => return settled,
            Some(forward) = signals.recv() => {
                tracing::info!(signal = ?forward, bound = ?TERMINATION_DELIVERY, "terminating while reports are held: one last attempt to deliver them");
            }
        }
    }
    relay.settle_within(TERMINATION_DELIVERY).await
}

/// The runner must be executable by this process's uid (the job's, when a root executor
/// started it): otherwise every start of the runner fails, and the executor would start
/// it again until the outage tolerance, silent, long after the controller's start
/// deadline. A bare name is looked up on `PATH` when the runner starts; its failure there
/// names the uid too.
fn check_runner_binary(path: &Path) -> Result<(), RunError> {
    if path.components().count() < 2 {
        return Ok(());
    }
    rustix::fs::accessat(
        rustix::fs::CWD,
        path,
        rustix::fs::Access::EXEC_OK,
        rustix::fs::AtFlags::EACCESS,
    )
    .map_err(|errno| RunError::RunnerNotExecutable {
        path: path.to_path_buf(),
        uid: rustix::process::geteuid().as_raw(),
        source: errno.into(),
    })
}

/// The runner configuration must be a readable file: the runner would otherwise fail
/// only after the executor waited for its SVID, the facade and the Docker daemon.
/// Returns it absolute (the runner runs in the work directory).
fn check_runner_config(path: &Path) -> Result<PathBuf, RunError> {
    let error = |source| RunError::RunnerConfig {
        path: path.to_path_buf(),
        source,
    };
    let metadata = std::fs::metadata(path).map_err(error)?;
    if !metadata.is_file() {
        return Err(error(std::io::Error::other("not a regular file")));
    }
    std::fs::File::open(path).map_err(error)?;
    std::path::absolute(path).map_err(error)
}

/// `step`, unless a SIGTERM or SIGINT comes first. Before the runner runs there is nothing
/// to pass the signal on to, so the executor stops: a Pod deleted while its executor waits
/// for its SVID (an entry never bound) or its Docker daemon goes at once, not when its
/// grace period ends in a SIGKILL.
async fn until_signalled<T>(
    signals: &mut tokio::sync::mpsc::Receiver<Forward>,
    step: impl std::future::Future<Output = T>,
) -> Result<T, RunError> {
    tokio::select! {
        biased;
        Some(forward) = signals.recv() => Err(RunError::Stopped(forward)),
        value = step => Ok(value),
    }
}

async fn start_dockerd(settings: Option<&DockerSettings>) -> Result<Option<Dockerd>, RunError> {
    match settings {
        Some(settings) => Ok(Some(Dockerd::start(settings).await?)),
        None => Ok(None),
    }
}

async fn stop_dockerd(dockerd: Option<Dockerd>) {
    if let Some(dockerd) = dockerd {
        dockerd.stop().await;
    }
}

/// Runs the runner until it has claimed its task (or cannot), starting it again when it
/// exits before the claim — a restart of the controller during its `Declare` must not
/// cost the job — with backoff, for as long as the outage tolerance. Returns the last
/// runner's exit status and whether the executor was told to terminate. `docker_host` is
/// the job's Docker daemon, for `DOCKER_HOST`.
async fn run_runner(
    config: &ExecutorConfig,
    work_dir: &Path,
    proxy_url: &str,
    docker_host: Option<&str>,
    keep: &[Pid],
    relay: &Relay,
    signals: &mut tokio::sync::mpsc::Receiver<Forward>,
) -> Result<(ExitStatus, bool), RunError> {
    let id = config.assignment_id.as_str();
    let mut restarts = 0u32;
    let mut first_early_exit: Option<tokio::time::Instant> = None;
    loop {
        tracing::info!(assignment_id = %id, proxy = %proxy_url, runner = %config.runner_binary.display(), restarts, "starting the one-shot runner");
        let mut command = tokio::process::Command::new(&config.runner_binary);
        if let Some(path) = &config.runner_config {
            // A persistent flag of the runner's root command.
            command.arg("--config").arg(path);
        }
        if let Some(host) = docker_host {
            command.env("DOCKER_HOST", host);
        }
        let mut child = command
            .args(["daemon", "--once"])
            .current_dir(work_dir)
            // The runner gets no CI_RUNNER_CAPABILITY: it reads its token from .runner.
            .env_remove(env::CAPABILITY)
            .env_remove(crate::jobenv::RUN_AS)
            .kill_on_drop(true)
            .spawn()
            .map_err(|source| RunError::RunnerNotExecutable {
                path: config.runner_binary.clone(),
                uid: rustix::process::geteuid().as_raw(),
                source,
            })?;
        let (status, signalled) =
            wait_forwarding_signals(&mut child, id, signals, relay, (config.cancel_grace, keep))
                .await?;
        tracing::info!(assignment_id = %id, status = %status, "the one-shot runner exited");
        let claim = relay.claim();
        if signalled || claim != Claim::Unclaimed {
            return Ok((status, signalled));
        }
        let since = *first_early_exit.get_or_insert_with(tokio::time::Instant::now);
        if since.elapsed() >= config.report_outage_tolerance {
            tracing::error!(assignment_id = %id, %status, restarts, "the runner keeps exiting before its task was claimed; giving up");
            return Ok((status, false));
        }
        let delay = RUNNER_RESTART.delay(restarts);
        tracing::warn!(assignment_id = %id, %status, restarts, retry_in = ?delay, "the runner exited before its task was claimed; starting it again");
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            Some(forward) = signals.recv() => {
                tracing::info!(assignment_id = %id, signal = ?forward, "stopping instead of starting the runner again");
                return Ok((status, true));
            }
        }
        restarts += 1;
    }
}

fn tempdir() -> Result<PathBuf, RunError> {
    let base = std::env::temp_dir();
    for attempt in 0..100u32 {
        let candidate = base.join(format!(
            "gitea-task-runner-{}-{attempt}",
            std::process::id()
        ));
        match std::fs::create_dir(&candidate) {
            Ok(()) => return Ok(candidate),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(source) => {
                return Err(RunError::Io {
                    what: "creating the work directory".into(),
                    source,
                });
            }
        }
    }
    Err(RunError::Io {
        what: "creating the work directory".into(),
        source: std::io::Error::other("no free name"),
    })
}

/// The runner cancels its job on SIGTERM/SIGINT and still reports a cancelled result,
/// so the executor passes those signals on and keeps waiting for the runner to exit.
/// Once Gitea answered that the job was cancelled, the runner gets `cancel_grace` to end
/// it; then the executor kills the job's processes (never the runner, which still reports
/// the cancelled result). Returns the runner's status and whether a signal was passed on.
async fn wait_forwarding_signals(
    child: &mut tokio::process::Child,
    id: &str,
    signals: &mut tokio::sync::mpsc::Receiver<Forward>,
    relay: &Relay,
    (cancel_grace, keep): (Duration, &[Pid]),
) -> Result<(ExitStatus, bool), RunError> {
    let mut signalled = false;
    let runner = child
        .id()
        .and_then(|p| i32::try_from(p).ok())
        .and_then(Pid::from_raw);
    let overdue = async {
        relay.cancelled().await;
        tracing::info!(assignment_id = %id, grace = ?cancel_grace, "Gitea cancelled the job; the runner has the grace to end it");
        tokio::time::sleep(cancel_grace).await;
    };
    tokio::pin!(overdue);
    let mut killed = false;
    loop {
        let forwarded = tokio::select! {
            status = child.wait() => {
                return status
                    .map(|s| (s, signalled))
                    .map_err(|source| RunError::Io { what: "waiting for the runner".into(), source });
            }
            () = &mut overdue, if !killed => {
                killed = true;
                if let Some(pid) = runner {
                    let ended = crate::descendants::kill_job_processes(pid, keep);
                    tracing::warn!(assignment_id = %id, grace = ?cancel_grace, processes = ended, "the runner did not end the cancelled job within the grace ({CANCEL_GRACE}); killed the job's processes");
                }
                continue;
            }
            Some(forward) = signals.recv() => forward,
        };
        signalled = true;
        let signal = match forwarded {
            Forward::Terminate => Signal::TERM,
            Forward::Interrupt => Signal::INT,
        };
        if let Some(pid) = runner {
            tracing::info!(assignment_id = %id, signal = ?forwarded, "forwarding a signal to the runner");
            let _ = rustix::process::kill_process(pid, signal);
        }
    }
}

/// Resolves only when the facade has answered no request within `bound` of now (the
/// executor's start): the facade is unreachable, or not the one the executor trusts.
async fn unanswered(relay: &Relay, bound: Duration) {
    if relay.facade().answered_within(bound).await {
        std::future::pending::<()>().await;
    }
}
