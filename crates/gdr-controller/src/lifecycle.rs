//! The lifecycle reconciler (DESIGN invariants 10 and 12): from what a backend reports,
//! delete executors that are terminal-marked *and* finished, and fail in Gitea the
//! tasks whose claimed executor ended without a terminal report. It keeps no state of
//! its own, so a restart between the terminal marker and deletion still cleans up.
//!
//! Executors that end before their runner claimed the task are the worker's to fail:
//! the worker still holds their assignment.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::dispatch::Dispatch;
use crate::gitea::GiteaClient;
use gdr_core::executor::{ExecutorBackend, ExecutorError, Phase};

/// What one pass did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Pass {
    /// Terminal and finished executors deleted.
    pub deleted: usize,
    /// Claimed executors that ended without a result, failed in Gitea.
    pub failed: usize,
}

/// Reconciles one backend's executors.
pub struct Lifecycle {
    dispatch: Arc<Dispatch>,
    backend: Arc<dyn ExecutorBackend>,
    gitea: GiteaClient,
}

impl Lifecycle {
    /// A reconciler for one backend.
    pub fn new(
        dispatch: Arc<Dispatch>,
        backend: Arc<dyn ExecutorBackend>,
        gitea: GiteaClient,
    ) -> Self {
        Lifecycle {
            dispatch,
            backend,
            gitea,
        }
    }

    /// One pass over the backend's executors.
    pub async fn reconcile_once(&self) -> Result<Pass, ExecutorError> {
        let mut pass = Pass::default();
        let kind = self.backend.backend();
        for record in self.backend.list().await? {
            let id = record.assignment.id();
            let finished = matches!(record.phase, Phase::Finished { .. });
            if !finished {
                continue;
            }
            if !record.terminal {
                if !record.claimed {
                    continue;
                }
                let reason = "the executor ended without reporting a result for this job";
                tracing::error!(backend = %kind, assignment_id = %id, executor = %record.name, "claimed executor ended without a terminal report; failing the task");
                // Invariant 12: report first; if Gitea is unreachable, retry next pass
                // rather than hide the failure behind a deleted executor.
                if let Err(e) = self
                    .gitea
                    .fail_task(record.assignment.task_id(), reason)
                    .await
                {
                    tracing::warn!(backend = %kind, assignment_id = %id, error = %e, "reporting the failed task to Gitea failed; will retry");
                    continue;
                }
                self.backend.mark_terminal(id).await?;
                pass.failed += 1;
            }
            self.backend.delete(id).await?;
            self.dispatch.forget(kind, id);
            pass.deleted += 1;
            tracing::info!(backend = %kind, assignment_id = %id, executor = %record.name, "executor deleted");
        }
        Ok(pass)
    }

    /// Runs passes every `interval` until `shutdown` turns true.
    pub async fn run(self, interval: Duration, mut shutdown: watch::Receiver<bool>) {
        loop {
            if let Err(e) = self.reconcile_once().await {
                tracing::warn!(backend = %self.backend.backend(), error = %e, "lifecycle pass failed; retrying");
            }
            tokio::select! {
                _ = tokio::time::sleep(interval) => {}
                _ = shutdown.changed() => return,
            }
        }
    }
}
