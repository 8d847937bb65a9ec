//! `metadata.json`, the backend's record of one executor: its shape, how it is read and
//! re-validated, and how it is written (atomically; durably for the claimed and terminal
//! markers).

use std::collections::BTreeMap;
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::time::SystemTime;

use gdr_core::assignment::{AssignmentId, RecoveredAssignment};
use gdr_core::executor::{ExecutorError, IdentityTarget};
use gdr_core::metadata::ExecutorMetadata;
use serde::{Deserialize, Serialize};

use super::{Inner, METADATA_FILE, ProcessError, Untrusted, unavailable};

pub(super) const METADATA_VERSION: u32 = 1;
const METADATA_TEMP: &str = "metadata.json.tmp";

/// What `metadata.json` holds.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Metadata {
    pub(super) version: u32,
    pub(super) labels: BTreeMap<String, String>,
    pub(super) annotations: BTreeMap<String, String>,
    pub(super) claimed: bool,
    pub(super) terminal: bool,
    pub(super) identity_bound: bool,
    pub(super) created_at: SystemTime,
    pub(super) pid: Option<u32>,
    /// Field 22 of `/proc/<pid>/stat`: tells our executor from a process that reused its pid.
    pub(super) pid_start_time: Option<u64>,
    /// The exit code; `128 + signal` for a child killed by a signal; `None` while running
    /// or when it ended while no controller was watching.
    pub(super) exit_code: Option<i32>,
}

/// Metadata that re-validated.
pub(super) struct Loaded {
    pub(super) meta: Metadata,
    pub(super) assignment: RecoveredAssignment,
}

/// What an executor directory holds.
pub(super) enum Load {
    /// No directory.
    Absent,
    /// A directory without metadata: a creation that stopped before recording anything,
    /// so no process was spawned from it (spawning happens only after the metadata write).
    Incomplete,
    /// Valid metadata.
    Valid(Box<Loaded>),
}

impl Inner {
    /// Reads and re-validates the metadata of directory `name`. Errors name the directory.
    pub(super) async fn load(&self, name: &str) -> Result<Load, ExecutorError> {
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

    pub(super) async fn write(
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
            .map_err(io::Error::other)
            .and_then(|r| r)
            .map_err(|e| unavailable("write", &dir.join(METADATA_FILE), e))
    }

    /// Read-modify-write of a metadata file under its lock. `Ok(false)` when absent.
    pub(super) async fn update(
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
}

/// How far a metadata write must get before it counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Durability {
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

pub(super) fn process_target(meta: &Metadata) -> Option<IdentityTarget> {
    match (meta.pid, meta.pid_start_time) {
        (Some(pid), Some(start_time)) => Some(IdentityTarget::Process { pid, start_time }),
        _ => None,
    }
}
