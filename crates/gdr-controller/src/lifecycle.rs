//! The lifecycle reconciler (DESIGN invariants 10 and 12): from what a backend reports,
//! delete executors whose result Gitea has, and fail in Gitea the tasks whose claimed
//! executor ended — or fell silent — without a terminal report. It keeps no state of its
//! own (the facade's last-heard times are rebuildable: after a restart silence counts from
//! the restart), so a restart between the terminal marker and deletion still cleans up.
//!
//! Each pass looks at every executor; one that cannot be handled now (Gitea or the backend
//! unavailable) is logged, counted and retried next pass, and never blocks the others.
//!
//! Executors that end before their runner claimed the task are the worker's to fail: the
//! worker still holds their assignment.

use std::sync::Arc;
use std::time::Duration;

use gdr_core::executor::{ExecutorBackend, ExecutorError, ExecutorRecord};

use crate::backoff::Backoff;
use crate::dispatch::Dispatch;
use crate::gitea::{GiteaClient, Reported};
use crate::metrics::FailureReason;
use crate::shutdown::Shutdown;
use crate::status::Observations;

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
    #[error("recording the finished assignment: {0}")]
    Record(#[source] crate::queue::QueueError),
}

/// Reconciles one backend's executors.
pub struct Lifecycle {
    dispatch: Arc<Dispatch>,
    backend: Arc<dyn ExecutorBackend>,
    gitea: GiteaClient,
    idle_timeout: Duration,
    metrics: Option<Arc<crate::metrics::Metrics>>,
    observations: Option<Arc<Observations>>,
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
            observations: None,
        }
    }

    /// Counts errors and idle failures into `metrics`.
    #[must_use]
    pub fn with_metrics(mut self, metrics: Arc<crate::metrics::Metrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// Hands every pass's listing to `observations` (the status endpoint reads it).
    #[must_use]
    pub fn with_observations(mut self, observations: Arc<Observations>) -> Self {
        self.observations = Some(observations);
        self
    }

    /// One pass over the backend's executors. `Err` only when the backend cannot even be
    /// listed.
    pub async fn reconcile_once(&self) -> Result<Pass, ExecutorError> {
        let mut pass = Pass::default();
        let records = match self.backend.list().await {
            Ok(r) => r,
            Err(e) => {
                if let Some(o) = &self.observations {
                    o.list_failed(self.backend.backend(), &e);
                }
                return Err(e);
            }
        };
        if let Some(o) = &self.observations {
            o.listed(self.backend.backend(), &records);
        }
        for record in records {
            if let Err(e) = self.reconcile(&record, &mut pass).await {
                pass.errors += 1;
                self.count(|m| &m.lifecycle_errors);
                tracing::warn!(backend = %self.backend.backend(), assignment_id = %record.assignment.id(), executor = %record.name, error = %e, "lifecycle step failed; retrying next pass (the executor and its slot are kept until it succeeds)");
            }
        }
        Ok(pass)
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
            if finished || !record.claimed {
                self.delete(record).await?;
                pass.deleted += 1;
            }
            return Ok(());
        }
        if !record.claimed {
            return Ok(());
        }
        let (why, reason) = if finished {
            let detail = match &record.phase {
                gdr_core::executor::Phase::Finished {
                    reason: Some(r), ..
                } => format!(" ({r})"),
                _ => String::new(),
            };
            (
                FailureReason::EndedWithoutResult,
                format!("the executor ended without reporting a result for this job{detail}"),
            )
        } else {
            match self.dispatch.silence(id) {
                Some(silent) if silent > self.idle_timeout => (
                    FailureReason::RunnerSilent,
                    format!(
                        "the job's runner stopped reporting: nothing was heard from it for {} while its environment stayed up",
                        humantime_serde::re::humantime::format_duration(Duration::from_secs(
                            silent.as_secs()
                        ))
                    ),
                ),
                // Never heard of (restored before this process saw it): start counting.
                None => {
                    self.dispatch.heard_from(id);
                    return Ok(());
                }
                Some(_) => return Ok(()),
            }
        };
        tracing::error!(backend = %kind, assignment_id = %id, event = "failing", failure = why.as_str(), executor = %record.name, %reason, "failing the task in Gitea, then cleaning up");
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
            Ok(Reported::Accepted) => {
                if let Some(m) = &self.metrics {
                    m.job_failed(kind, why);
                }
                tracing::info!(backend = %kind, assignment_id = %id, event = "terminal", result = "failure", failure = why.as_str(), "Gitea accepted the failure report");
            }
            Ok(Reported::TaskGone) => {
                tracing::warn!(backend = %kind, assignment_id = %id, event = "terminal", "Gitea no longer has the task (cancelled or timed out there); cleaning up");
            }
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

    async fn delete(&self, record: &ExecutorRecord) -> Result<(), StepError> {
        let id = record.assignment.id();
        // Invariant 20: once the executor is gone, only this record stops a replayed
        // envelope from running the job again.
        self.dispatch
            .record_finished(id)
            .await
            .map_err(StepError::Record)?;
        self.backend.delete(id).await.map_err(StepError::Backend)?;
        self.dispatch.forget(self.backend.backend(), id);
        tracing::info!(backend = %self.backend.backend(), assignment_id = %id, event = "cleaned", executor = %record.name, "executor deleted; its slot is free");
        Ok(())
    }

    /// Runs passes every `interval` until `shutdown`.
    pub async fn run(self, interval: Duration, shutdown: Shutdown) {
        loop {
            if let Err(e) = self.reconcile_once().await {
                self.count(|m| &m.lifecycle_errors);
                tracing::warn!(backend = %self.backend.backend(), error = %e, "listing executors failed; nothing is cleaned up or failed until the next pass lists them");
            }
            if !shutdown.sleep(interval).await {
                return;
            }
        }
    }
}
