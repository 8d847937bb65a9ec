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
//!
//! Code: `spawn` creates an executor, `store` reads and writes its `metadata.json`,
//! `reaper` watches and stops its processes, `identity` serves its SVID and `logs` reads
//! and keeps its log; this module holds the backend and its [`ExecutorBackend`] methods.

mod identity;
mod logs;
mod reaper;
mod spawn;
mod store;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use gdr_core::assignment::AssignmentId;
use gdr_core::backend::Backend;
use gdr_core::executor::{
    Binding, ExecutorBackend, ExecutorError, ExecutorRecord, ExecutorSpec, Phase,
};
use gdr_core::identity::TrustDomain;
use gdr_core::metadata::{MetadataCodec, MetadataError};
pub use identity::{IdentityProvider, Provisioned, RunAs};
pub use logs::LogRetention;
use logs::{keep_log, last_error_line};
use reaper::{process_alive, unrecorded_executor};
use store::{Durability, Load, Loaded, Metadata, process_target};
use tokio::sync::Mutex as AsyncMutex;
use tokio::task::JoinHandle;

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

    /// Whether `name`'s record is of a creation a controller stopped between writing the
    /// metadata and spawning: no pid, no process of ours or in its working directory, never
    /// claimed or ended. Its job never ran, so it is treated as a creation that never
    /// completed (the next `create` starts it) rather than as an executor that ended.
    fn never_started(&self, name: &str, meta: &Metadata) -> bool {
        if meta.pid.is_some() || meta.exit_code.is_some() || meta.claimed || meta.terminal {
            return false;
        }
        {
            let live = self.live();
            if live.spawning.contains(name) || live.children.contains_key(name) {
                return false;
            }
        }
        unrecorded_executor(&self.dir(name).join(WORK_DIR)).is_none()
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

#[async_trait]
impl ExecutorBackend for ProcessBackend {
    fn backend(&self) -> Backend {
        self.inner.settings.backend
    }

    async fn find(&self, id: &AssignmentId) -> Result<Option<ExecutorRecord>, ExecutorError> {
        let name = id.as_str();
        match self.inner.load(name).await? {
            Load::Absent | Load::Incomplete => Ok(None),
            Load::Valid(loaded) if self.inner.never_started(name, &loaded.meta) => Ok(None),
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
            Load::Valid(loaded) if self.inner.never_started(name, &loaded.meta) => {
                tracing::info!(assignment_id = %id, executor = name, "starting an executor whose start an earlier controller recorded but never made");
            }
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
                Ok(Load::Valid(loaded)) if self.inner.never_started(&name, &loaded.meta) => {
                    tracing::warn!(executor = %name, directory = %entry.path().display(), "skipping an executor that was recorded but never started (its job's redelivery starts it)");
                }
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
                .map_err(io::Error::other)
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
