//! The local process backend: each executor is a child process in its own directory under
//! a state root (DESIGN invariants 7–12, single-host use and the full-chain tests).
//!
//! Layout: `<state_root>/executors/<assignment-id>/` holds
//! - `metadata.json`: the backend's authority on the executor, as Pod labels are for
//!   Kubernetes (assignment labels/annotations, claimed/terminal/identity markers, pid,
//!   pid start time, exit code). Written atomically (temp file, rename); writes of the
//!   claimed and terminal markers are also durable (fsync of file and directory before
//!   the rename counts), because they must survive a power loss (DESIGN invariants 9,
//!   10). The rest (creation, pid, identity bound, exit code) describes processes that
//!   a power loss ends anyway, so it costs no fsync on the way to a job's start.
//! - `work/`: the executor's working directory (`CI_RUNNER_WORKDIR`).
//! - `executor.log`: the child's stdout and stderr, appended. When the executor is deleted
//!   the log moves to `<state_root>/logs/<assignment-id>.log` and is kept as long as the
//!   [`LogRetention`] says, so the cause of a failure can still be read after clean-up.
//!
//! Executors outlive the controller: children are not killed on drop and run in their own
//! process group. A new backend instance re-adopts live executors (pid alive and same start
//! time, so a reused pid is not mistaken for one) and reports dead ones as finished.
//!
//! Metadata that does not parse or does not re-validate (assignment ID, task ID, backend,
//! SPIFFE ID re-derived from repository and job key, directory name) is never trusted:
//! [`ExecutorBackend::list`] skips it with a WARN naming the directory, and
//! [`ExecutorBackend::find`] / [`ExecutorBackend::create`] answer
//! [`ExecutorError::Permanent`] for it. `find` does not answer `None` there on purpose:
//! something exists that may be a live executor, and `None` would invite the worker to
//! create a second one. A directory *without* metadata is a creation that stopped before
//! anything was spawned (the metadata is written before the spawn): `find` answers `None`
//! and `create` completes it.
//!
//! Phase: a child of this instance is `Running` until reaped, then `Finished` with its
//! exact status; otherwise a recorded exit code decides; otherwise a live pid with the
//! recorded start time is `Running` and anything else is `Finished { success: false }`.
//!
//! Limitation: with the local CA the executor runs as the controller's user and can therefore rewrite its
//! own `metadata.json`. Re-validation refuses inconsistent metadata, but a consistent
//! rewrite (another repository, job key and matching SPIFFE ID) is not detected; an
//! authenticated (MAC'd) metadata file would close this. An identity provider that answers
//! a user to run as ([`Provisioned::run_as`], the SPIRE provider) closes it: the executor
//! then owns only `work/`.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use gdr_core::assignment::{AssignmentId, RecoveredAssignment};
use gdr_core::backend::Backend;
use gdr_core::executor::{
    Binding, ExecutorBackend, ExecutorError, ExecutorRecord, ExecutorSpec, IdentityTarget, Phase,
    env,
};
use gdr_core::identity::TrustDomain;
use gdr_core::metadata::{ExecutorMetadata, MetadataCodec, MetadataError};
use gdr_identity::workload_api::LocalIdentity;
use rustix::process::{Pid, Signal};
use serde::{Deserialize, Serialize};
use tokio::sync::Mutex as AsyncMutex;
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// Environment variable naming the executor's working directory.
pub const WORKDIR_ENV: &str = "CI_RUNNER_WORKDIR";
/// Name of the metadata file inside an executor directory.
pub const METADATA_FILE: &str = "metadata.json";
/// Name of the log file inside an executor directory.
pub const LOG_FILE: &str = "executor.log";
/// Name of the work directory inside an executor directory.
pub const WORK_DIR: &str = "work";
/// Directory under the state root that keeps the logs of deleted executors.
pub const LOGS_DIR: &str = "logs";
/// How much of the end of `executor.log` is searched for the executor's last error.
const ERROR_TAIL: u64 = 64 * 1024;
/// Longest error line quoted in a failure reason.
const MAX_ERROR_LINE: usize = 300;

const METADATA_VERSION: u32 = 1;
const METADATA_TEMP: &str = "metadata.json.tmp";
/// Controller environment passed through to executors. Everything else is cleared so
/// that nothing of the controller's configuration leaks into a job by accident.
const INHERITED_ENV: &[&str] = &["PATH", "HOME", "USER", "LANG", "LC_ALL", "TMPDIR", "TZ"];
/// `CI_EXECUTOR_SANDBOXED` makes an executor started as root prepare its environment as
/// root (device nodes, mounts, cgroups): only ever inside a Pod or VM, never on this host.
const ROOT_START_ENV: &str = "CI_EXECUTOR_SANDBOXED";
/// How often process state is polled while stopping a process group.
const STOP_POLL: Duration = Duration::from_millis(20);
/// How long to wait for a process group to vanish after SIGKILL.
const KILL_WAIT: Duration = Duration::from_secs(5);

/// Why a process-backend operation failed; wrapped in [`ExecutorError`] with the action it
/// calls for (retry for I/O, give up for untrustworthy metadata).
#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    /// A file system or process operation failed.
    #[error("cannot {what} {}: {source}", path.display())]
    Io {
        /// What was being done.
        what: &'static str,
        /// The file or directory involved.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// `metadata.json` does not parse or does not re-validate.
    #[error("executor directory {} has untrustworthy metadata: {why}", dir.display())]
    Untrusted {
        /// The executor directory.
        dir: PathBuf,
        /// What is wrong.
        why: Untrusted,
    },
    /// The assignment belongs to the other backend.
    #[error("assignment {id} is for backend {requested}, this backend is {this}")]
    WrongBackend {
        /// The assignment.
        id: AssignmentId,
        /// Its backend.
        requested: Backend,
        /// This backend.
        this: Backend,
    },
    /// The child exited before its pid could be recorded.
    #[error("the executor in {} exited before it could be recorded", dir.display())]
    ExitedAtStart {
        /// The executor directory.
        dir: PathBuf,
    },
    /// No executor directory exists for the assignment.
    #[error("no executor directory {}", dir.display())]
    NoExecutor {
        /// The directory looked for.
        dir: PathBuf,
    },
    /// The identity provider could not serve the executor's SVID.
    #[error("serving the identity of the executor in {}: {source}", dir.display())]
    Identity {
        /// The executor directory.
        dir: PathBuf,
        /// The cause.
        #[source]
        source: gdr_identity::workload_api::WorkloadApiError,
    },
}

/// What makes metadata untrustworthy.
#[derive(Debug, thiserror::Error)]
pub enum Untrusted {
    /// Not JSON of the expected shape (serde_json quotes positions and field names here,
    /// never values).
    #[error("not valid metadata JSON ({0})")]
    Json(#[source] serde_json::Error),
    /// A metadata version this build does not read.
    #[error("unsupported version {0}")]
    Version(u32),
    /// The labels and annotations do not re-validate.
    #[error("{0}")]
    Metadata(#[source] MetadataError),
    /// It records another assignment than its directory name.
    #[error("it records assignment {0}")]
    OtherAssignment(AssignmentId),
    /// It records the other backend.
    #[error("it records backend {found}, this backend is {this}")]
    OtherBackend {
        /// The recorded backend.
        found: Backend,
        /// This backend.
        this: Backend,
    },
}

fn unavailable(what: &'static str, path: &Path, source: io::Error) -> ExecutorError {
    ExecutorError::unavailable(ProcessError::Io {
        what,
        path: path.to_path_buf(),
        source,
    })
}

/// The user and group an executor runs as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunAs {
    /// Its uid.
    pub uid: u32,
    /// Its gid.
    pub gid: u32,
}

/// Where an executor gets its identity, and as whom it must run to get it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Provisioned {
    /// What the executor gets as `SPIFFE_ENDPOINT_SOCKET`.
    pub endpoint: String,
    /// The user it runs as; `None`: the controller's own.
    pub run_as: Option<RunAs>,
}

impl From<String> for Provisioned {
    /// An endpoint for an executor running as the controller's user.
    fn from(endpoint: String) -> Self {
        Provisioned {
            endpoint,
            run_as: None,
        }
    }
}

/// Serves the workload identity of process executors (a local CA and a per-executor
/// SPIFFE Workload API socket, or entries in an existing SPIRE server; a recorder in
/// tests).
#[async_trait]
pub trait IdentityProvider: Send + Sync + 'static {
    /// Starts serving `spiffe_id` for the executor in `dir`; returns the endpoint the
    /// executor gets as `SPIFFE_ENDPOINT_SOCKET` (e.g. `unix:<dir>/workload.sock`) and the
    /// user it must run as. Must be idempotent: it is called again after a controller
    /// restart, and must then answer the same user.
    async fn provision(&self, dir: &Path, spiffe_id: &str) -> Result<Provisioned, ExecutorError>;

    /// Stops serving the identity of the executor in `dir` (no-op when not served).
    async fn revoke(&self, dir: &Path);
}

/// Configuration of a [`ProcessBackend`].
#[derive(Debug, Clone)]
pub struct ProcessBackendSettings {
    /// Which backend kind these executors serve (`pod` or `vm` jobs).
    pub backend: Backend,
    /// Root of the state directory; executors live in `<state_root>/executors/<id>/`.
    pub state_root: PathBuf,
    /// The executor program (in production `gitea-dynamic-runner`).
    pub program: PathBuf,
    /// Its arguments (in production `["executor"]`).
    pub args: Vec<String>,
    /// Extra environment (e.g. `GITEA_RUNNER_BINARY`, `CI_RUNNER_LABEL`).
    pub extra_env: BTreeMap<String, String>,
    /// The metadata codec (its prefix, default `ci.ddupan.top/`).
    pub codec: MetadataCodec,
    /// Trust domain the recorded SPIFFE IDs must belong to.
    pub trust_domain: TrustDomain,
    /// How long `delete` waits after SIGTERM before SIGKILL.
    pub stop_grace: Duration,
    /// Which logs of deleted executors are kept.
    pub log_retention: LogRetention,
}

/// Which logs of deleted executors are kept: none older than `max_age`, at most
/// `max_count` (the newest).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogRetention {
    /// Age limit (zero: no log is kept).
    pub max_age: Duration,
    /// Count limit (zero: no log is kept).
    pub max_count: usize,
}

impl LogRetention {
    /// Keeps no log.
    pub const NONE: LogRetention = LogRetention {
        max_age: Duration::ZERO,
        max_count: 0,
    };

    fn keeps_any(&self) -> bool {
        !self.max_age.is_zero() && self.max_count > 0
    }
}

/// What `metadata.json` holds.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Metadata {
    version: u32,
    labels: BTreeMap<String, String>,
    annotations: BTreeMap<String, String>,
    claimed: bool,
    terminal: bool,
    identity_bound: bool,
    created_at: SystemTime,
    pid: Option<u32>,
    /// Field 22 of `/proc/<pid>/stat`: tells our executor from a process that reused its pid.
    pid_start_time: Option<u64>,
    /// The exit code; `128 + signal` for a child killed by a signal; `None` while running
    /// or when it ended while no controller was watching.
    exit_code: Option<i32>,
}

/// Metadata that re-validated.
struct Loaded {
    meta: Metadata,
    assignment: RecoveredAssignment,
}

/// What an executor directory holds.
enum Load {
    /// No directory.
    Absent,
    /// A directory without metadata: a creation that stopped before recording anything,
    /// so no process was spawned from it (spawning happens only after the metadata write).
    Incomplete,
    /// Valid metadata.
    Valid(Box<Loaded>),
}

/// A child spawned by this instance.
struct OwnChild {
    pid: u32,
    /// Recorded at spawn: once reaped, the pid may be reused by a stranger.
    start_time: Option<u64>,
    /// `None` while running; `Some(code)` once reaped (`code` is `None` if unknown).
    exit: tokio::sync::watch::Receiver<Option<Option<i32>>>,
    reaper: JoinHandle<()>,
}

#[derive(Default)]
struct LiveState {
    children: HashMap<String, OwnChild>,
    /// Executors whose identity this instance serves.
    provisioned: HashSet<String>,
    /// Executors between their first metadata write and the pid write.
    spawning: HashSet<String>,
}

struct Inner {
    settings: ProcessBackendSettings,
    identity: Arc<dyn IdentityProvider>,
    /// One lock per executor directory serialises read-modify-write of its metadata
    /// (facade claim, reaper exit code, delete) without blocking other executors.
    locks: Mutex<HashMap<String, Arc<AsyncMutex<()>>>>,
    live: Mutex<LiveState>,
}

/// Executors as local child processes. Not `Clone`: dropping it stops watching children
/// (they keep running, as they would after a controller crash); share it in an `Arc`.
pub struct ProcessBackend {
    inner: Arc<Inner>,
}

impl ProcessBackend {
    /// A backend over `settings.state_root`, creating `<state_root>/executors` if needed.
    /// Call [`ProcessBackend::restore`] (or `list`) afterwards to serve the identities of
    /// executors that survived a restart.
    pub fn new(
        settings: ProcessBackendSettings,
        identity: Arc<dyn IdentityProvider>,
    ) -> Result<Self, ExecutorError> {
        let root = settings.state_root.join("executors");
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&root)
            .map_err(|e| unavailable("create the executor state directory", &root, e))?;
        Ok(ProcessBackend {
            inner: Arc::new(Inner {
                settings,
                identity,
                locks: Mutex::new(HashMap::new()),
                live: Mutex::new(LiveState::default()),
            }),
        })
    }

    /// Re-adopts the executors found on disk after a restart: every live one gets its
    /// identity served again. Idempotent; the same as [`ExecutorBackend::list`].
    pub async fn restore(&self) -> Result<Vec<ExecutorRecord>, ExecutorError> {
        self.list().await
    }
}

impl Drop for ProcessBackend {
    fn drop(&mut self) {
        // The reapers hold the children; aborting them leaves the processes running
        // (no kill_on_drop) and lets tokio reap them, as a controller crash would.
        for child in self.inner.live().children.values() {
            child.reaper.abort();
        }
    }
}

impl Inner {
    fn root(&self) -> PathBuf {
        self.settings.state_root.join("executors")
    }

    fn dir(&self, name: &str) -> PathBuf {
        self.root().join(name)
    }

    fn live(&self) -> MutexGuard<'_, LiveState> {
        self.live.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn lock_for(&self, name: &str) -> Arc<AsyncMutex<()>> {
        self.locks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(name.to_owned())
            .or_default()
            .clone()
    }

    /// Reads and re-validates the metadata of directory `name`. Errors name the directory.
    async fn load(&self, name: &str) -> Result<Load, ExecutorError> {
        let dir = self.dir(name);
        let bytes = match tokio::fs::read(dir.join(METADATA_FILE)).await {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Ok(match tokio::fs::metadata(&dir).await {
                    Ok(_) => Load::Incomplete,
                    Err(e) if e.kind() == io::ErrorKind::NotFound => Load::Absent,
                    Err(e) => return Err(unavailable("inspect executor directory", &dir, e)),
                });
            }
            Err(e) => return Err(unavailable("read", &dir.join(METADATA_FILE), e)),
        };
        let corrupt = |why: Untrusted| {
            ExecutorError::permanent(ProcessError::Untrusted {
                dir: dir.clone(),
                why,
            })
        };
        let meta: Metadata =
            serde_json::from_slice(&bytes).map_err(|e| corrupt(Untrusted::Json(e)))?;
        if meta.version != METADATA_VERSION {
            return Err(corrupt(Untrusted::Version(meta.version)));
        }
        let assignment = self
            .settings
            .codec
            .decode(
                &ExecutorMetadata {
                    labels: meta.labels.clone(),
                    annotations: meta.annotations.clone(),
                },
                &self.settings.trust_domain,
            )
            .map_err(|e| corrupt(Untrusted::Metadata(e)))?;
        if assignment.id().as_str() != name {
            return Err(corrupt(Untrusted::OtherAssignment(assignment.id().clone())));
        }
        if assignment.backend() != self.settings.backend {
            return Err(corrupt(Untrusted::OtherBackend {
                found: assignment.backend(),
                this: self.settings.backend,
            }));
        }
        Ok(Load::Valid(Box::new(Loaded { meta, assignment })))
    }

    async fn write(
        &self,
        name: &str,
        meta: &Metadata,
        durability: Durability,
    ) -> Result<(), ExecutorError> {
        let dir = self.dir(name);
        let meta = meta.clone();
        let target = dir.clone();
        tokio::task::spawn_blocking(move || write_metadata_sync(&target, &meta, durability))
            .await
            .map_err(|e| io::Error::other(e.to_string()))
            .and_then(|r| r)
            .map_err(|e| unavailable("write", &dir.join(METADATA_FILE), e))
    }

    fn phase(&self, name: &str, meta: &Metadata) -> Phase {
        // A child of ours is authoritative: it is running until reaped, then its exit
        // status is known exactly (even before the metadata write lands).
        let exit = self
            .live()
            .children
            .get(name)
            .map(|child| *child.exit.borrow());
        match exit {
            Some(None) => return Phase::Running,
            Some(Some(code)) => return finished(code, last_error_line(&self.dir(name))),
            None => {}
        }
        if let Some(code) = meta.exit_code {
            return finished(Some(code), last_error_line(&self.dir(name)));
        }
        match (meta.pid, meta.pid_start_time) {
            (Some(pid), Some(start)) if process_alive(pid, start) => Phase::Running,
            (None, _) if self.live().spawning.contains(name) => Phase::Starting { reason: None },
            // Died while no controller watched (exit code unknown), or never confirmed
            // started: either way it did not end cleanly as far as we can tell.
            (Some(_), _) => Phase::Finished {
                success: false,
                reason: Some(match last_error_line(&self.dir(name)) {
                    Some(line) => format!(
                        "the executor process ended while no controller watched it; its last error: {line}"
                    ),
                    None => "the executor process ended while no controller watched it".into(),
                }),
            },
            // A controller that died between spawning and recording the pid left it running.
            (None, _) if unrecorded_executor(&self.dir(name).join(WORK_DIR)).is_some() => {
                Phase::Running
            }
            (None, _) => Phase::Finished {
                success: false,
                reason: Some("the executor process was never recorded as started".into()),
            },
        }
    }

    fn record(&self, name: &str, loaded: Loaded) -> ExecutorRecord {
        let phase = self.phase(name, &loaded.meta);
        ExecutorRecord {
            name: name.to_owned(),
            assignment: loaded.assignment,
            phase,
            claimed: loaded.meta.claimed,
            terminal: loaded.meta.terminal,
            identity_bound: loaded.meta.identity_bound,
            identity_target: process_target(&loaded.meta),
            created_at: loaded.meta.created_at,
        }
    }

    /// Serves the identity of a live executor this instance does not serve yet (after a
    /// restart). Idempotent.
    async fn ensure_provisioned(&self, record: &ExecutorRecord) -> Result<(), ExecutorError> {
        if matches!(record.phase, Phase::Finished { .. })
            || self.live().provisioned.contains(&record.name)
        {
            return Ok(());
        }
        let lock = self.lock_for(&record.name);
        let _guard = lock.lock().await;
        if self.live().provisioned.contains(&record.name) {
            return Ok(());
        }
        let dir = self.dir(&record.name);
        let spiffe_id = record.assignment.identity().spiffe_id();
        self.identity.provision(&dir, spiffe_id).await?;
        self.live().provisioned.insert(record.name.clone());
        tracing::info!(assignment_id = %record.assignment.id(), executor = %record.name, spiffe_id, "identity served again for a re-adopted executor");
        Ok(())
    }

    /// Read-modify-write of a metadata file under its lock. `Ok(false)` when absent.
    async fn update(
        &self,
        id: &AssignmentId,
        durability: Durability,
        change: impl FnOnce(&mut Metadata) -> bool,
    ) -> Result<bool, ExecutorError> {
        let name = id.as_str();
        let lock = self.lock_for(name);
        let _guard = lock.lock().await;
        match self.load(name).await? {
            Load::Absent | Load::Incomplete => Ok(false),
            Load::Valid(mut loaded) => {
                if change(&mut loaded.meta) {
                    self.write(name, &loaded.meta, durability).await?;
                }
                Ok(true)
            }
        }
    }

    /// Stops the process group led by `pid` (if it is still ours): SIGTERM, up to
    /// `stop_grace`, then SIGKILL.
    async fn stop_group(&self, name: &str, pid: u32, start_time: Option<u64>) {
        let Some(pgid) = signal_target(pid) else {
            tracing::warn!(
                executor = name,
                pid,
                "refusing to signal an implausible pid"
            );
            return;
        };
        // The group ID stays reserved while any member lives, so the group is ours when
        // its leader is gone or is still our leader; a different live leader means the
        // pid was reused and the group belongs to someone else.
        match proc_stat(pid) {
            Some(stat) if Some(stat.start_time) != start_time => {
                tracing::info!(
                    executor = name,
                    pid,
                    "pid reused by another process; not signalling"
                );
                return;
            }
            _ => {}
        }
        if !group_alive(pgid) {
            return;
        }
        signal_group(pgid, Signal::TERM);
        let deadline = Instant::now() + self.settings.stop_grace;
        while group_alive(pgid) && Instant::now() < deadline {
            tokio::time::sleep(STOP_POLL).await;
        }
        if group_alive(pgid) {
            tracing::warn!(executor = name, pid, grace = ?self.settings.stop_grace, "executor ignored SIGTERM; sending SIGKILL");
            signal_group(pgid, Signal::KILL);
            let deadline = Instant::now() + KILL_WAIT;
            while group_alive(pgid) && Instant::now() < deadline {
                tokio::time::sleep(STOP_POLL).await;
            }
            if group_alive(pgid) {
                tracing::error!(
                    executor = name,
                    pid,
                    "executor process group survived SIGKILL"
                );
            }
        }
    }

    /// Creates the directory, serves the identity, records metadata, then spawns.
    async fn spawn_executor(
        self: &Arc<Self>,
        spec: &ExecutorSpec,
    ) -> Result<ExecutorRecord, ExecutorError> {
        let id = spec.assignment.id();
        let name = id.as_str().to_owned();
        let dir = self.dir(&name);
        for d in [dir.clone(), dir.join(WORK_DIR)] {
            match std::fs::DirBuilder::new().mode(0o700).create(&d) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(unavailable("create the executor directory", &d, e)),
            }
        }
        // The child needs its Workload API socket from its first instant.
        let spiffe_id = spec.assignment.identity().spiffe_id();
        let provisioned = self.identity.provision(&dir, spiffe_id).await?;
        self.live().provisioned.insert(name.clone());
        if let Some(run_as) = provisioned.run_as
            && let Err(e) = hand_over(&dir, run_as)
        {
            self.discard(&name).await;
            return Err(unavailable("hand the work directory over in", &dir, e));
        }
        let mut meta = Metadata {
            version: METADATA_VERSION,
            labels: spec.metadata.labels.clone(),
            annotations: spec.metadata.annotations.clone(),
            claimed: false,
            terminal: false,
            identity_bound: false,
            created_at: SystemTime::now(),
            pid: None,
            pid_start_time: None,
            exit_code: None,
        };
        // Recorded before the spawn: a redelivery after a crash finds the directory and
        // never starts a second executor.
        self.write(&name, &meta, Durability::CrashConsistent)
            .await?;
        self.live().spawning.insert(name.clone());
        let spawned = self.spawn_child(spec, &dir, &provisioned);
        let (mut child, log_path) = match spawned {
            Ok(c) => c,
            Err(e) => {
                self.live().spawning.remove(&name);
                self.discard(&name).await;
                return Err(unavailable("start the executor program in", &dir, e));
            }
        };
        let Some(pid) = child.id() else {
            self.live().spawning.remove(&name);
            self.discard(&name).await;
            return Err(ExecutorError::unavailable(ProcessError::ExitedAtStart {
                dir,
            }));
        };
        meta.pid = Some(pid);
        meta.pid_start_time = proc_stat(pid).map(|s| s.start_time);
        if let Err(e) = self.write(&name, &meta, Durability::CrashConsistent).await {
            // Without a durable pid a later delete could not stop it; nothing may run
            // that the backend does not record.
            if let Some(pgid) = signal_target(pid) {
                signal_group(pgid, Signal::KILL);
            }
            let _ = child.wait().await;
            self.live().spawning.remove(&name);
            self.discard(&name).await;
            return Err(e);
        }
        let (tx, rx) = tokio::sync::watch::channel(None);
        let reaper = {
            let inner = ReaperCtx {
                name: name.clone(),
                assignment_id: id.clone(),
                pid,
            };
            // Aborted when the backend is dropped, which releases this reference.
            let backend = Arc::clone(self);
            tokio::spawn(async move {
                let status = child.wait().await;
                let code = match status {
                    Ok(s) => s.code().or_else(|| s.signal().map(|sig| 128 + sig)),
                    Err(e) => {
                        tracing::warn!(assignment_id = %inner.assignment_id, executor = %inner.name, pid = inner.pid, error = %e, "waiting for the executor failed; exit status unknown");
                        None
                    }
                };
                tx.send_replace(Some(code));
                tracing::info!(assignment_id = %inner.assignment_id, executor = %inner.name, pid = inner.pid, exit_code = ?code, "executor exited");
                backend.record_exit(&inner, code).await;
            })
        };
        {
            let mut live = self.live();
            live.spawning.remove(&name);
            live.children.insert(
                name.clone(),
                OwnChild {
                    pid,
                    start_time: meta.pid_start_time,
                    exit: rx,
                    reaper,
                },
            );
        }
        tracing::info!(assignment_id = %id, executor = %name, pid, log = %log_path.display(), "executor started");
        let phase = self.phase(&name, &meta);
        Ok(ExecutorRecord {
            name,
            assignment: spec.assignment.clone(),
            phase,
            claimed: false,
            terminal: false,
            identity_bound: false,
            identity_target: process_target(&meta),
            created_at: meta.created_at,
        })
    }

    fn spawn_child(
        &self,
        spec: &ExecutorSpec,
        dir: &Path,
        provisioned: &Provisioned,
    ) -> io::Result<(tokio::process::Child, PathBuf)> {
        let log_path = dir.join(LOG_FILE);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(&log_path)?;
        let work = dir.join(WORK_DIR);
        let mut command = tokio::process::Command::new(&self.settings.program);
        command
            .args(&self.settings.args)
            .env_clear()
            .current_dir(&work)
            .stdin(Stdio::null())
            .stdout(Stdio::from(log.try_clone()?))
            .stderr(Stdio::from(log))
            // Executors must survive a controller crash, and signals aimed at the
            // controller's terminal must not reach them.
            .kill_on_drop(false)
            .process_group(0);
        for name in INHERITED_ENV {
            if let Some(value) = std::env::var_os(name) {
                command.env(name, value);
            }
        }
        command
            .envs(&self.settings.extra_env)
            .envs(spec.environment())
            .env(env::SPIFFE_ENDPOINT_SOCKET, &provisioned.endpoint)
            .env(WORKDIR_ENV, &work)
            .env_remove(ROOT_START_ENV);
        if let Some(run_as) = provisioned.run_as {
            // The controller's home is not the executor's to write in; without a group list
            // the standard library drops the controller's supplementary groups.
            command.uid(run_as.uid).gid(run_as.gid).env("HOME", &work);
        }
        Ok((command.spawn()?, log_path))
    }

    /// Undoes a creation that did not produce a running executor.
    async fn discard(&self, name: &str) {
        let dir = self.dir(name);
        self.identity.revoke(&dir).await;
        self.live().provisioned.remove(name);
        if let Err(e) = tokio::fs::remove_dir_all(&dir).await
            && e.kind() != io::ErrorKind::NotFound
        {
            tracing::warn!(executor = name, error = %e, "cannot remove the executor directory {}", dir.display());
        }
    }

    async fn record_exit(&self, ctx: &ReaperCtx, code: Option<i32>) {
        let result = self
            .update(&ctx.assignment_id, Durability::CrashConsistent, |meta| {
                if meta.pid != Some(ctx.pid) || meta.exit_code.is_some() {
                    return false;
                }
                meta.exit_code = code;
                code.is_some()
            })
            .await;
        if let Err(e) = result {
            tracing::warn!(assignment_id = %ctx.assignment_id, executor = %ctx.name, pid = ctx.pid, error = %e, "cannot record the executor's exit status");
        }
    }
}

struct ReaperCtx {
    name: String,
    assignment_id: AssignmentId,
    pid: u32,
}

#[async_trait]
impl ExecutorBackend for ProcessBackend {
    fn backend(&self) -> Backend {
        self.inner.settings.backend
    }

    async fn find(&self, id: &AssignmentId) -> Result<Option<ExecutorRecord>, ExecutorError> {
        let name = id.as_str();
        match self.inner.load(name).await? {
            Load::Absent | Load::Incomplete => Ok(None),
            Load::Valid(loaded) => {
                let record = self.inner.record(name, *loaded);
                if let Err(e) = self.inner.ensure_provisioned(&record).await {
                    tracing::warn!(assignment_id = %id, executor = name, error = %e, "cannot serve the identity of a re-adopted executor");
                }
                Ok(Some(record))
            }
        }
    }

    async fn create(&self, spec: &ExecutorSpec) -> Result<ExecutorRecord, ExecutorError> {
        let id = spec.assignment.id();
        if spec.assignment.backend() != self.inner.settings.backend {
            return Err(ExecutorError::permanent(ProcessError::WrongBackend {
                id: id.clone(),
                requested: spec.assignment.backend(),
                this: self.inner.settings.backend,
            }));
        }
        let name = id.as_str();
        let lock = self.inner.lock_for(name);
        let _guard = lock.lock().await;
        match self.inner.load(name).await? {
            Load::Valid(loaded) => return Ok(self.inner.record(name, *loaded)),
            Load::Incomplete => {
                tracing::info!(assignment_id = %id, executor = name, "completing an executor directory left without metadata");
            }
            Load::Absent => {}
        }
        self.inner.spawn_executor(spec).await
    }

    async fn bind_identity(&self, record: &ExecutorRecord) -> Result<Binding, ExecutorError> {
        let id = record.assignment.id();
        let current = self.find(id).await?.ok_or_else(|| {
            ExecutorError::unavailable(ProcessError::NoExecutor {
                dir: self.inner.dir(id.as_str()),
            })
        })?;
        // `find` served the identity again if this instance did not yet.
        if !current.identity_bound {
            self.inner
                .update(id, Durability::CrashConsistent, |meta| {
                    let changed = !meta.identity_bound;
                    meta.identity_bound = true;
                    changed
                })
                .await?;
        }
        Ok(Binding::Bound)
    }

    async fn record_claimed(&self, id: &AssignmentId) -> Result<(), ExecutorError> {
        let found = self
            .inner
            .update(id, Durability::Durable, |meta| {
                let changed = !meta.claimed;
                meta.claimed = true;
                changed
            })
            .await?;
        if found {
            Ok(())
        } else {
            Err(ExecutorError::unavailable(ProcessError::NoExecutor {
                dir: self.inner.dir(id.as_str()),
            }))
        }
    }

    async fn mark_terminal(&self, id: &AssignmentId) -> Result<(), ExecutorError> {
        self.inner
            .update(id, Durability::Durable, |meta| {
                let changed = !meta.terminal;
                meta.terminal = true;
                changed
            })
            .await?;
        Ok(())
    }

    async fn list(&self) -> Result<Vec<ExecutorRecord>, ExecutorError> {
        let root = self.inner.root();
        let mut entries = match tokio::fs::read_dir(&root).await {
            Ok(e) => e,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(unavailable("list", &root, e)),
        };
        let mut records = Vec::new();
        loop {
            let entry = match entries.next_entry().await {
                Ok(Some(entry)) => entry,
                Ok(None) => break,
                Err(e) => return Err(unavailable("list", &root, e)),
            };
            let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
                tracing::warn!(directory = %entry.path().display(), "skipping a non-UTF-8 entry in the executor state directory");
                continue;
            };
            if AssignmentId::parse(&name).is_err() {
                tracing::warn!(executor = %name, directory = %entry.path().display(), "skipping an entry that is not an executor directory");
                continue;
            }
            match self.inner.load(&name).await {
                Ok(Load::Valid(loaded)) => {
                    let record = self.inner.record(&name, *loaded);
                    if let Err(e) = self.inner.ensure_provisioned(&record).await {
                        tracing::warn!(assignment_id = %name, executor = %name, error = %e, "cannot serve the identity of a re-adopted executor; retrying on the next pass");
                    }
                    records.push(record);
                }
                Ok(Load::Absent) => {}
                Ok(Load::Incomplete) => {
                    tracing::warn!(executor = %name, directory = %entry.path().display(), "skipping an executor directory without metadata (a creation that never completed)");
                }
                Err(e) => {
                    tracing::warn!(executor = %name, directory = %entry.path().display(), error = %e, "skipping an executor with corrupt or tampered metadata");
                }
            }
        }
        records.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(records)
    }

    async fn delete(&self, id: &AssignmentId) -> Result<(), ExecutorError> {
        let name = id.as_str();
        let dir = self.inner.dir(name);
        let lock = self.inner.lock_for(name);
        {
            let _guard = lock.lock().await;
            // Our own child is known exactly; otherwise only validated metadata may name
            // a process to signal (tampered metadata could name any pid).
            let own = self
                .inner
                .live()
                .children
                .get(name)
                .map(|c| (c.pid, c.start_time));
            let target = match own {
                Some(target) => Some(target),
                None => match self.inner.load(name).await {
                    Ok(Load::Valid(loaded)) => match loaded.meta.pid {
                        Some(p) => Some((p, loaded.meta.pid_start_time)),
                        None => unrecorded_executor(&dir.join(WORK_DIR))
                            .map(|(pid, start)| (pid, Some(start))),
                    },
                    Ok(_) => None,
                    Err(e) => {
                        tracing::warn!(assignment_id = %id, executor = name, error = %e, "deleting an executor whose metadata cannot be trusted; no process is signalled");
                        None
                    }
                },
            };
            if let Some((pid, start_time)) = target {
                tracing::info!(assignment_id = %id, executor = name, pid, "stopping executor");
                self.inner.stop_group(name, pid, start_time).await;
            }
            self.inner.identity.revoke(&dir).await;
            {
                let mut live = self.inner.live();
                live.provisioned.remove(name);
                live.children.remove(name);
            }
            let retention = self.inner.settings.log_retention;
            if retention.keeps_any() {
                let root = self.inner.settings.state_root.clone();
                let (log_name, log_dir) = (name.to_owned(), dir.clone());
                let kept = tokio::task::spawn_blocking(move || {
                    keep_log(&root, &log_name, &log_dir, retention)
                })
                .await
                .map_err(|e| io::Error::other(e.to_string()))
                .and_then(|r| r);
                // The executor goes anyway: a log that cannot be kept must not leak it.
                if let Err(e) = kept {
                    tracing::warn!(assignment_id = %id, executor = name, error = %e, "cannot keep the executor's log");
                }
            }
            match tokio::fs::remove_dir_all(&dir).await {
                Ok(()) => {
                    tracing::info!(assignment_id = %id, executor = name, "executor deleted");
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(unavailable("remove executor directory", &dir, e)),
            }
        }
        self.inner
            .locks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(name);
        Ok(())
    }
}

/// How far a metadata write must get before it counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Durability {
    /// On disk: survives a power loss (claimed and terminal markers).
    Durable,
    /// Atomic for every reader and across a controller crash (the page cache keeps it),
    /// not across a power loss.
    CrashConsistent,
}

fn write_metadata_sync(dir: &Path, meta: &Metadata, durability: Durability) -> io::Result<()> {
    let bytes = serde_json::to_vec_pretty(meta).map_err(io::Error::other)?;
    let temp = dir.join(METADATA_TEMP);
    {
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&temp)?;
        file.write_all(&bytes)?;
        if durability == Durability::Durable {
            file.sync_all()?;
        }
    }
    std::fs::rename(&temp, dir.join(METADATA_FILE))?;
    if durability == Durability::Durable {
        // The rename is durable only once the directory entry is.
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}

/// The parts of `/proc/<pid>/stat` we need.
struct ProcStat {
    state: char,
    pgrp: i32,
    start_time: u64,
}

fn proc_stat(pid: u32) -> Option<ProcStat> {
    parse_stat(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

fn parse_stat(text: &str) -> Option<ProcStat> {
    // The command name (field 2) may contain spaces and parentheses; it ends at the
    // last ')'. Fields after it start with field 3 (state).
    let rest = &text[text.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    Some(ProcStat {
        state: fields.first()?.chars().next()?,
        pgrp: fields.get(2)?.parse().ok()?,
        start_time: fields.get(19)?.parse().ok()?,
    })
}

/// The executor a controller spawned but died before recording (killed between the
/// metadata write and the pid write): the process-group leader whose working directory is
/// the executor's `work/` (only this user's processes can be there). Its pid and start time.
fn unrecorded_executor(work: &Path) -> Option<(u32, u64)> {
    let work = std::fs::canonicalize(work).ok()?;
    std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .find_map(|entry| {
            let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
            let stat = proc_stat(pid)?;
            let leader = i32::try_from(pid).ok()? == stat.pgrp;
            let here = std::fs::read_link(entry.path().join("cwd")).ok()? == work;
            (leader && here && !exited(stat.state)).then_some((pid, stat.start_time))
        })
}

fn exited(state: char) -> bool {
    matches!(state, 'Z' | 'X' | 'x')
}

/// The pid is alive (`kill(pid, 0)`), not a zombie, and started when ours did.
fn process_alive(pid: u32, start_time: u64) -> bool {
    let Some(target) = signal_target(pid).and_then(Pid::from_raw) else {
        return false;
    };
    if rustix::process::test_kill_process(target).is_err() {
        return false;
    }
    proc_stat(pid).is_some_and(|s| !exited(s.state) && s.start_time == start_time)
}

/// A pid that may be signalled: never 0 or 1 or negative, whose group forms would mean
/// "every process".
fn signal_target(pid: u32) -> Option<i32> {
    i32::try_from(pid).ok().filter(|p| *p > 1)
}

fn signal_group(pgid: i32, signal: Signal) {
    // `pgid > 1` (see `signal_target`), so this names exactly that group.
    if let Some(group) = Pid::from_raw(pgid) {
        let _ = rustix::process::kill_process_group(group, signal);
    }
}

fn finished(code: Option<i32>, last_error: Option<String>) -> Phase {
    let status = match code {
        Some(code) if code > 128 => format!("the executor was killed by signal {}", code - 128),
        Some(code) => format!("the executor exited with status {code}"),
        None => "the executor ended with an unknown status".to_owned(),
    };
    Phase::Finished {
        success: code == Some(0),
        reason: Some(match last_error {
            Some(line) => format!("{status}; its last error: {line}"),
            None => status,
        }),
    }
}

/// The executor's own last error in `<dir>/executor.log`: the `error: …` line it prints
/// when it stops, or its last ERROR event. Lines of the runner (which shares the file) are
/// not quoted: only the executor's own messages, which never carry secrets (invariant 17).
fn last_error_line(dir: &Path) -> Option<String> {
    use std::io::{Read, Seek, SeekFrom};
    let mut file = std::fs::File::open(dir.join(LOG_FILE)).ok()?;
    let len = file.metadata().ok()?.len();
    file.seek(SeekFrom::Start(len.saturating_sub(ERROR_TAIL)))
        .ok()?;
    let mut tail = Vec::new();
    file.take(ERROR_TAIL).read_to_end(&mut tail).ok()?;
    let text = String::from_utf8_lossy(&tail);
    let line = text.lines().rev().find_map(executor_error)?;
    Some(if line.chars().count() > MAX_ERROR_LINE {
        let cut: String = line.chars().take(MAX_ERROR_LINE).collect();
        format!("{cut}…")
    } else {
        line
    })
}

/// The message of one executor error line, if it is one.
fn executor_error(line: &str) -> Option<String> {
    if let Some(rest) = line.strip_prefix("error: ") {
        return Some(rest.trim().to_owned());
    }
    let event: serde_json::Value = serde_json::from_str(line).ok()?;
    let ours = event
        .get("target")
        .and_then(|t| t.as_str())
        .is_some_and(|t| t.starts_with("gdr_executor"));
    if !ours || event.get("level").and_then(|l| l.as_str()) != Some("ERROR") {
        return None;
    }
    let message = event.get("message")?.as_str()?;
    Some(match event.get("error").and_then(|e| e.as_str()) {
        Some(error) => format!("{message}: {error}"),
        None => message.to_owned(),
    })
}

/// Moves a deleted executor's log to `logs/`, then drops kept logs beyond the retention.
fn keep_log(root: &Path, name: &str, dir: &Path, retention: LogRetention) -> io::Result<()> {
    let logs = root.join(LOGS_DIR);
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&logs)?;
    match std::fs::rename(dir.join(LOG_FILE), logs.join(format!("{name}.log"))) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    prune_logs(&logs, retention, SystemTime::now())
}

/// Removes kept logs older than the retention, then the oldest beyond its count.
fn prune_logs(logs: &Path, retention: LogRetention, now: SystemTime) -> io::Result<()> {
    let mut kept: Vec<(SystemTime, PathBuf)> = Vec::new();
    for entry in std::fs::read_dir(logs)? {
        let entry = entry?;
        let path = entry.path();
        if path.extension().is_none_or(|e| e != "log") {
            continue;
        }
        let modified = entry.metadata()?.modified()?;
        let age = now.duration_since(modified).unwrap_or_default();
        if age > retention.max_age {
            std::fs::remove_file(&path)?;
        } else {
            kept.push((modified, path));
        }
    }
    kept.sort_by_key(|k| std::cmp::Reverse(k.0));
    for (_, path) in kept.into_iter().skip(retention.max_count) {
        std::fs::remove_file(path)?;
    }
    Ok(())
}

fn process_target(meta: &Metadata) -> Option<IdentityTarget> {
    match (meta.pid, meta.pid_start_time) {
        (Some(pid), Some(start_time)) => Some(IdentityTarget::Process { pid, start_time }),
        _ => None,
    }
}

/// Executors get `workload.sock` in their directory.
const EXECUTOR_SOCKET: &str = "workload.sock";

#[async_trait]
impl IdentityProvider for LocalIdentity {
    async fn provision(&self, dir: &Path, spiffe_id: &str) -> Result<Provisioned, ExecutorError> {
        self.serve(dir.join(EXECUTOR_SOCKET), spiffe_id)
            .await
            .map(Provisioned::from)
            .map_err(|source| {
                ExecutorError::unavailable(ProcessError::Identity {
                    dir: dir.to_path_buf(),
                    source,
                })
            })
    }

    async fn revoke(&self, dir: &Path) {
        self.stop(&dir.join(EXECUTOR_SOCKET)).await;
    }
}

/// Makes `work/` the executor's own and its directory traversable (not readable) by it, so
/// that an executor running as another user can work there while `metadata.json` and the
/// log stay the controller's (it can no longer rewrite its own metadata either).
fn hand_over(dir: &Path, run_as: RunAs) -> io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::os::unix::fs::chown(dir.join(WORK_DIR), Some(run_as.uid), Some(run_as.gid))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o711))
}

/// Whether any non-exited process is in group `pgid`.
fn group_alive(pgid: i32) -> bool {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return false;
    };
    entries.flatten().any(|entry| {
        entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
            .and_then(proc_stat)
            .is_some_and(|s| s.pgrp == pgid && !exited(s.state))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_parsing_survives_parentheses_in_the_command_name() {
        let line =
            "1234 (a) b (c)) S 1 1234 1234 0 -1 4194560 100 0 0 0 0 0 0 0 20 0 1 0 987654 1000 10";
        let stat = parse_stat(line).expect("parses");
        assert_eq!(stat.state, 'S');
        assert_eq!(stat.pgrp, 1234);
        assert_eq!(stat.start_time, 987654);
    }

    /// The failure reason quotes the executor's own last error, never a runner line.
    #[test]
    fn the_last_error_line_is_the_executors_own() {
        let dir = tempfile::tempdir().expect("dir");
        let log = [
            r#"{"timestamp":"t","level":"ERROR","message":"first","target":"gdr_executor::relay"}"#,
            r#"{"timestamp":"t","level":"ERROR","message":"runner says: token=xyz","target":"runner"}"#,
            r#"{"timestamp":"t","level":"ERROR","message":"the facade stayed away","waited":"1s","error":"refused","target":"gdr_executor::relay"}"#,
            "some runner output",
        ]
        .join("\n");
        std::fs::write(dir.path().join(LOG_FILE), log).expect("write");
        assert_eq!(
            last_error_line(dir.path()).as_deref(),
            Some("the facade stayed away: refused")
        );
        std::fs::write(
            dir.path().join(LOG_FILE),
            "noise\nerror: gave up delivering the runner's reports\nmore runner output\n",
        )
        .expect("write");
        assert_eq!(
            last_error_line(dir.path()).as_deref(),
            Some("gave up delivering the runner's reports")
        );
        assert_eq!(
            finished(Some(1), Some("boom".into())),
            Phase::Finished {
                success: false,
                reason: Some("the executor exited with status 1; its last error: boom".into())
            }
        );
    }

    /// Kept logs never exceed the retention's age or count; the newest stay.
    #[test]
    fn kept_logs_are_pruned_by_age_and_count() {
        let dir = tempfile::tempdir().expect("dir");
        let now = SystemTime::now();
        for (i, age) in [10u64, 20, 30, 4000].iter().enumerate() {
            let path = dir.path().join(format!("gitea-task-{i}.log"));
            std::fs::write(&path, "x").expect("write");
            let file = std::fs::File::options()
                .write(true)
                .open(&path)
                .expect("open");
            file.set_modified(now - Duration::from_secs(*age))
                .expect("mtime");
        }
        let retention = LogRetention {
            max_age: Duration::from_secs(3600),
            max_count: 2,
        };
        prune_logs(dir.path(), retention, now).expect("prune");
        let mut left: Vec<String> = std::fs::read_dir(dir.path())
            .expect("list")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, ["gitea-task-0.log", "gitea-task-1.log"]);
    }

    #[test]
    fn pids_zero_and_one_are_never_signalled() {
        assert_eq!(signal_target(0), None);
        assert_eq!(signal_target(1), None);
        assert_eq!(signal_target(u32::MAX), None);
        assert_eq!(signal_target(42), Some(42));
    }
}
