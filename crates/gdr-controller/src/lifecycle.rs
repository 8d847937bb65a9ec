//! The lifecycle reconciler (DESIGN invariants 10 and 12): from what a backend reports,
//! delete executors whose result Gitea has, and fail in Gitea the tasks whose claimed
//! executor ended — or fell silent — without a terminal report. It keeps no state of its
//! own (the facade's last-heard times are rebuildable: after a restart silence counts from
//! the restart), so a restart between the terminal marker and deletion still cleans up.
//!
//! Each pass looks at every executor; one that cannot be handled now (Gitea or the backend
//! unavailable) is logged, counted and retried next pass, and never blocks the others.
//!
//! A claimed executor the backend does not have at all any more (a Pod or sandbox deleted
//! by someone else, an expired sandbox) is failed as well: nothing else would ever report
//! it, and its slot would stay taken.
//!
//! Executors that end before their runner claimed the task are the worker's to fail: the
//! worker still holds their assignment.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use gdr_core::assignment::AssignmentId;
use gdr_core::executor::{ExecutorBackend, ExecutorError, ExecutorRecord};

use crate::backoff::Backoff;
use crate::dispatch::Dispatch;
use crate::gitea::{GiteaClient, Reported};
use crate::shutdown::Shutdown;

/// One report per executor per pass; the next pass is the retry.
const REPORT_BACKOFF: Backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(1));
const REPORT_ATTEMPTS: u32 = 2;

/// What one pass did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Pass {
    /// Executors deleted (their result is in Gitea).
    pub deleted: usize,
    /// Claimed executors that ended without a result, failed in Gitea.
    pub failed: usize,
    /// Claimed executors whose runner fell silent, failed in Gitea.
    pub idle: usize,
    /// Executors that could not be handled this pass (retried next pass).
    pub errors: usize,
}

/// Why an executor could not be handled in this pass.
#[derive(Debug, thiserror::Error)]
enum StepError {
    #[error("reporting the failure to Gitea: {0}")]
    Report(#[source] crate::gitea::GiteaError),
    #[error("{0}")]
    Backend(#[source] ExecutorError),
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Plain data updated in single steps: a poisoned lock is still consistent.
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Reconciles one backend's executors.
pub struct Lifecycle {
    dispatch: Arc<Dispatch>,
    backend: Arc<dyn ExecutorBackend>,
    gitea: GiteaClient,
    idle_timeout: Duration,
    metrics: Option<Arc<crate::metrics::Metrics>>,
    terminal_grace: Option<Duration>,
    /// When each terminal, still running executor was first seen (for `terminal_grace`).
    terminal_since: Mutex<HashMap<AssignmentId, Instant>>,
}

impl Lifecycle {
    /// A reconciler for one backend; a claimed executor the facade has not heard from for
    /// `idle_timeout` is failed.
    pub fn new(
        dispatch: Arc<Dispatch>,
        backend: Arc<dyn ExecutorBackend>,
        gitea: GiteaClient,
        idle_timeout: Duration,
    ) -> Self {
        Lifecycle {
            dispatch,
            backend,
            gitea,
            idle_timeout,
            metrics: None,
            terminal_grace: None,
            terminal_since: Mutex::new(HashMap::new()),
        }
    }

    /// For a backend that cannot see its executor exit (OpenSandbox keeps a sandbox
    /// `Running` after its process ended): a terminal executor still running `grace` after
    /// this reconciler first saw it terminal is deleted anyway. Its runner had its answer
    /// before the marker was written (invariant 10), so this only bounds how long the
    /// environment outlives its job.
    #[must_use]
    pub fn with_terminal_grace(mut self, grace: Duration) -> Self {
        self.terminal_grace = Some(grace);
        self
    }

    /// Counts errors and idle failures into `metrics`.
    #[must_use]
    pub fn with_metrics(mut self, metrics: Arc<crate::metrics::Metrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// One pass over the backend's executors. `Err` only when the backend cannot even be
    /// listed.
    pub async fn reconcile_once(&self) -> Result<Pass, ExecutorError> {
        let mut pass = Pass::default();
        let records = self.backend.list().await?;
        for record in &records {
            if let Err(e) = self.reconcile(record, &mut pass).await {
                pass.errors += 1;
                self.count(|m| &m.lifecycle_errors);
                tracing::warn!(backend = %self.backend.backend(), assignment_id = %record.assignment.id(), executor = %record.name, error = %e, "lifecycle step failed; retrying next pass");
            }
        }
        let listed: HashSet<&AssignmentId> = records.iter().map(|r| r.assignment.id()).collect();
        lock(&self.terminal_since).retain(|id, _| listed.contains(id));
        for (id, task_id) in self.dispatch.claimed(self.backend.backend()) {
            if listed.contains(&id) {
                continue;
            }
            if let Err(e) = self.vanished(&id, task_id, &mut pass).await {
                pass.errors += 1;
                self.count(|m| &m.lifecycle_errors);
                tracing::warn!(backend = %self.backend.backend(), assignment_id = %id, error = %e, "lifecycle step failed; retrying next pass");
            }
        }
        Ok(pass)
    }

    /// A claimed executor the backend no longer lists was deleted by someone else (a Pod
    /// or sandbox removed by an operator, an expired sandbox) and will never report: fail
    /// its task in Gitea (invariant 12), then forget it, releasing its slot.
    async fn vanished(
        &self,
        id: &AssignmentId,
        task_id: i64,
        pass: &mut Pass,
    ) -> Result<(), StepError> {
        // A direct lookup confirms what the list said (a listing may lag a create).
        if self
            .backend
            .find(id)
            .await
            .map_err(StepError::Backend)?
            .is_some()
        {
            return Ok(());
        }
        let reason =
            "the job's environment is gone: it was deleted before the job reported a result";
        tracing::error!(backend = %self.backend.backend(), assignment_id = %id, reason, "failing the task in Gitea");
        match self
            .gitea
            .report_failure(task_id, reason, &REPORT_BACKOFF, REPORT_ATTEMPTS)
            .await
        {
            Ok(Reported::Accepted | Reported::TaskGone) => {}
            Err(e) => return Err(StepError::Report(e)),
        }
        self.dispatch.forget(self.backend.backend(), id);
        pass.failed += 1;
        Ok(())
    }

    fn count(
        &self,
        family: impl Fn(
            &crate::metrics::Metrics,
        ) -> &prometheus_client::metrics::family::Family<
            crate::metrics::BackendLabel,
            prometheus_client::metrics::counter::Counter,
        >,
    ) {
        if let Some(m) = &self.metrics {
            family(m)
                .get_or_create(&crate::metrics::BackendLabel {
                    backend: self.backend.backend().as_str().into(),
                })
                .inc();
        }
    }

    async fn reconcile(&self, record: &ExecutorRecord, pass: &mut Pass) -> Result<(), StepError> {
        let kind = self.backend.backend();
        let id = record.assignment.id();
        let finished = record.phase.is_finished();
        if record.terminal {
            // Invariant 10: the result is in Gitea; delete once the runner has its answer
            // (it has finished) — or at once if it never claimed (failed by the worker).
            if finished || !record.claimed || self.grace_over(id) {
                self.delete(record).await?;
                pass.deleted += 1;
            }
            return Ok(());
        }
        if !record.claimed {
            return Ok(());
        }
        let reason = if finished {
            let detail = match &record.phase {
                gdr_core::executor::Phase::Finished {
                    reason: Some(r), ..
                } => format!(" ({r})"),
                _ => String::new(),
            };
            format!("the executor ended without reporting a result for this job{detail}")
        } else {
            match self.dispatch.silence(id) {
                Some(silent) if silent > self.idle_timeout => format!(
                    "the job's runner stopped reporting: nothing was heard from it for {} while its environment stayed up",
                    humantime_serde::re::humantime::format_duration(Duration::from_secs(
                        silent.as_secs()
                    ))
                ),
                // Never heard of (restored before this process saw it): start counting.
                None => {
                    self.dispatch.heard_from(id);
                    return Ok(());
                }
                Some(_) => return Ok(()),
            }
        };
        tracing::error!(backend = %kind, assignment_id = %id, executor = %record.name, %reason, "failing the task in Gitea");
        // Invariant 12: report first; if Gitea is unreachable, retry next pass rather
        // than hide the failure behind a deleted executor.
        match self
            .gitea
            .report_failure(
                record.assignment.task_id(),
                &reason,
                &REPORT_BACKOFF,
                REPORT_ATTEMPTS,
            )
            .await
        {
            Ok(Reported::Accepted | Reported::TaskGone) => {}
            Err(e) => return Err(StepError::Report(e)),
        }
        self.backend
            .mark_terminal(id)
            .await
            .map_err(StepError::Backend)?;
        if finished {
            pass.failed += 1;
        } else {
            pass.idle += 1;
            self.count(|m| &m.idle_executors_failed);
        }
        self.delete(record).await?;
        pass.deleted += 1;
        Ok(())
    }

    /// Whether the terminal executor `id` has outlived the terminal grace.
    fn grace_over(&self, id: &AssignmentId) -> bool {
        let Some(grace) = self.terminal_grace else {
            return false;
        };
        let over = lock(&self.terminal_since)
            .entry(id.clone())
            .or_insert_with(Instant::now)
            .elapsed()
            >= grace;
        if over {
            tracing::info!(backend = %self.backend.backend(), assignment_id = %id, ?grace, "the job's result is in Gitea and its environment is still up after the terminal grace; deleting it");
        }
        over
    }

    async fn delete(&self, record: &ExecutorRecord) -> Result<(), StepError> {
        let id = record.assignment.id();
        self.backend.delete(id).await.map_err(StepError::Backend)?;
        lock(&self.terminal_since).remove(id);
        self.dispatch.forget(self.backend.backend(), id);
        tracing::info!(backend = %self.backend.backend(), assignment_id = %id, executor = %record.name, "executor deleted");
        Ok(())
    }

    /// Runs passes every `interval` until `shutdown`.
    pub async fn run(self, interval: Duration, shutdown: Shutdown) {
        loop {
            if let Err(e) = self.reconcile_once().await {
                self.count(|m| &m.lifecycle_errors);
                tracing::warn!(backend = %self.backend.backend(), error = %e, "listing executors failed; retrying");
            }
            if !shutdown.sleep(interval).await {
                return;
            }
        }
    }
}
