//! Per-executor identity: where an executor gets its SVID ([`IdentityProvider`]: a local
//! CA's Workload API socket in its directory, or an entry in an existing SPIRE server) and
//! the user it runs as to get it.

use std::io;
use std::path::Path;

use async_trait::async_trait;
use gdr_core::executor::{ExecutorError, ExecutorRecord, Phase};
use gdr_identity::workload_api::LocalIdentity;

use super::{Inner, ProcessError, WORK_DIR};

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
pub(super) fn hand_over(dir: &Path, run_as: RunAs) -> io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::os::unix::fs::chown(dir.join(WORK_DIR), Some(run_as.uid), Some(run_as.gid))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o711))
}

impl Inner {
    /// Serves the identity of a live executor this instance does not serve yet (after a
    /// restart). Idempotent.
    pub(super) async fn ensure_provisioned(
        &self,
        record: &ExecutorRecord,
    ) -> Result<(), ExecutorError> {
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
}
