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
//! Executors that end, or do not start, before their runner claimed the task are the
//! worker's to fail while their assignment is queued: the worker delivering it fails it at
//! the start deadline. One whose assignment left the queue (expired and terminated, removed
//! by a stream limit, failed by the held reconciler) has no worker any more; past its start
//! deadline it is failed here, unless it was reported already, and deleted, so it does not
//! hold its slot forever. A claimed executor that is gone from the backend (a Pod deleted
//! by someone else) is failed here: nothing else would ever report it.
//!
//! Passes run on a timer and whenever the backend's [`Wake`] fires (the Pod watch), so a
//! Pod that ended is cleaned up or reported at once; a burst of changes gives one pass.
//! The backend's [`Housekeeping`] (the Pod backend's sweep of identity entries and
//! capability Secrets whose Pod is gone) runs at most once per timer interval.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use gdr_core::assignment::AssignmentId;
use gdr_core::executor::{ExecutorBackend, ExecutorError, ExecutorRecord};
use tokio::time::Instant;

use crate::backoff::Backoff;
use crate::dispatch::Dispatch;
use crate::job_metrics::FailureReason;
pub use crate::ports::QueuedAssignments;
use crate::shutdown::Shutdown;
use crate::status::Observations;
use crate::wake::Wake;
use gdr_gitea::{GiteaClient, Reported};

/// One report per executor per pass; the next pass is the retry.
const REPORT_BACKOFF: Backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(1));
const REPORT_ATTEMPTS: u32 = 2;
/// After a wake, how long further changes are gathered into the same pass (a Pod's phase,
/// markers and deletion arrive as separate events within milliseconds).
const WAKE_COALESCE: Duration = Duration::from_millis(200);

/// Clean-up a backend needs beyond its executors, run by the lifecycle pass.
#[async_trait]
pub trait Housekeeping: Send + Sync {
    /// Removes what is left over (identity entries, Secrets of gone Pods); returns how
    /// many objects were removed.
    async fn sweep(&self) -> Result<usize, ExecutorError>;

    /// What the backend keeps up on every pass, not only every interval (the Pod
    /// backend's warm pool, refilled as soon as a job claimed a member).
    async fn every_pass(&self) -> Result<Upkeep, ExecutorError> {
        Ok(Upkeep::default())
    }

    /// The `CI_*` variables every executor of the backend gets whatever its job (the
    /// facade's URL and SPIFFE ID, the backend, the runner label, the report outage
    /// tolerance), known once the worker is: what a warm environment's executor, started
    /// before any job, is given (the VM backend's `vm_warm_pool`). Ignored by default.
    fn standby_environment(&self, environment: BTreeMap<&'static str, String>) {
        let _ = environment;
    }
}

/// What a backend's per-pass upkeep did, and the warm environments it left.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Upkeep {
    /// Objects created or removed.
    pub changed: usize,
    /// Unclaimed warm environments, by profile (empty: none) and state (`ready`,
    /// `starting`); `None`: the backend keeps no warm pool.
    pub warm: Option<BTreeMap<(String, &'static str), usize>>,
    /// Warm environments this pass discarded, by reason (`ended`, `outdated`, `stalled`,
    /// `surplus`).
    pub discarded: BTreeMap<&'static str, usize>,
    /// Jobs' claims of warm environments since the previous pass, by outcome (`claimed`:
    /// a ready one served the job; `missed`: none was ready, one was created for it).
    pub claims: BTreeMap<&'static str, usize>,
}

/// Failing unclaimed executors whose assignment left the queue.
struct Unstarted {
    start_deadline: Duration,
    queue: Arc<dyn QueuedAssignments>,
    /// How long one pass waits for the queue's answer (invariant 21: a flooded or slow
    /// stream must not stall the pass, which also deletes finished executors).
    read_timeout: Duration,
}

/// Default of [`Unstarted::read_timeout`].
const QUEUE_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// What one pass did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Pass {
    /// Executors deleted (their result is in Gitea).
    pub deleted: usize,
    /// Claimed executors that ended without a result, failed in Gitea.
    pub failed: usize,
    /// Claimed executors whose runner fell silent, failed in Gitea.
    pub idle: usize,
    /// Claimed assignments whose executor is gone from the backend, failed in Gitea.
    pub gone: usize,
    /// Unclaimed executors past their start deadline whose assignment left the queue,
    /// failed in Gitea (unless reported before) and deleted.
    pub unstarted: usize,
    /// Executors that could not be handled this pass (retried next pass).
    pub errors: usize,
}

/// Why an executor could not be handled in this pass.
#[derive(Debug, thiserror::Error)]
enum StepError {
    #[error("reporting the failure to Gitea: {0}")]
    Report(#[source] gdr_gitea::GiteaError),
    #[error("{0}")]
    Backend(#[source] ExecutorError),
    #[error("recording the finished assignment: {0}")]
    Record(#[source] crate::ports::QueueError),
    #[error("reading whether the assignment finished: {0}")]
    Finished(#[source] crate::ports::QueueError),
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
    metrics: Option<Arc<crate::job_metrics::JobMetrics>>,
    observations: Option<Arc<Observations>>,
    wake: Wake,
    housekeeping: Option<Arc<dyn Housekeeping>>,
    unstarted: Option<Unstarted>,
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
            observations: None,
            wake: Wake::none(),
            housekeeping: None,
            unstarted: None,
            terminal_grace: None,
            terminal_since: Mutex::new(HashMap::new()),
        }
    }

    /// Runs a pass whenever `wake` fires, besides the timer.
    #[must_use]
    pub fn with_wake(mut self, wake: Wake) -> Self {
        self.wake = wake;
        self
    }

    /// Runs the backend's clean-up from the passes.
    #[must_use]
    pub fn with_housekeeping(mut self, housekeeping: Arc<dyn Housekeeping>) -> Self {
        self.housekeeping = Some(housekeeping);
        self
    }

    /// Fails unclaimed executors created longer than `start_deadline` ago whose assignment
    /// `queue` no longer has (invariant 12): no worker will ever deliver it, so nothing
    /// else would fail them or free their slots. While the assignment is queued, the worker
    /// that delivers it fails the executor at the same deadline, and this reconciler leaves
    /// it alone.
    #[must_use]
    pub fn with_unstarted(
        mut self,
        start_deadline: Duration,
        queue: Arc<dyn QueuedAssignments>,
    ) -> Self {
        self.unstarted = Some(Unstarted {
            start_deadline,
            queue,
            read_timeout: QUEUE_READ_TIMEOUT,
        });
        self
    }

    /// How long a pass waits for the queue's answer about unstarted executors (default
    /// 10 s); without an answer they are looked at again next pass.
    #[must_use]
    pub fn with_queue_read_timeout(mut self, timeout: Duration) -> Self {
        if let Some(u) = self.unstarted.as_mut() {
            u.read_timeout = timeout;
        }
        self
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
    pub fn with_metrics(mut self, metrics: Arc<crate::job_metrics::JobMetrics>) -> Self {
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
        for record in &records {
            if let Err(e) = self.reconcile(record, &mut pass).await {
                pass.errors += 1;
                self.count(|m| &m.lifecycle_errors);
                tracing::warn!(backend = %self.backend.backend(), assignment_id = %record.assignment.id(), executor = %record.name, error = %e, "lifecycle step failed; retrying next pass (the executor and its slot are kept until it succeeds)");
            }
        }
        if let Some(unstarted) = &self.unstarted {
            self.reconcile_unstarted(unstarted, &records, &mut pass)
                .await;
        }
        let listed: HashSet<&AssignmentId> = records.iter().map(|r| r.assignment.id()).collect();
        lock(&self.terminal_since).retain(|id, _| listed.contains(id));
        for id in self.dispatch.claimed(self.backend.backend()) {
            if listed.contains(&id) {
                continue;
            }
            if let Err(e) = self.fail_gone(&id, &mut pass).await {
                pass.errors += 1;
                self.count(|m| &m.lifecycle_errors);
                tracing::warn!(backend = %self.backend.backend(), assignment_id = %id, error = %e, "lifecycle step failed; retrying next pass");
            }
        }
        for id in self.dispatch.terminal(self.backend.backend()) {
            if listed.contains(&id) {
                continue;
            }
            if let Err(e) = self.clean_gone_terminal(&id, &mut pass).await {
                pass.errors += 1;
                self.count(|m| &m.lifecycle_errors);
                tracing::warn!(backend = %self.backend.backend(), assignment_id = %id, error = %e, "lifecycle step failed; retrying next pass");
            }
        }
        Ok(pass)
    }

    /// A terminal assignment missing from the list: its executor went after Gitea accepted
    /// its result (a Pod deleted with its grace period, whose runner reported the
    /// cancellation first). Once the backend confirms it is gone, what it left (its
    /// identity entry) is removed now rather than at the next sweep, and it is forgotten.
    async fn clean_gone_terminal(
        &self,
        id: &AssignmentId,
        pass: &mut Pass,
    ) -> Result<(), StepError> {
        if self
            .backend
            .find(id)
            .await
            .map_err(StepError::Backend)?
            .is_some()
        {
            return Ok(());
        }
        self.dispatch
            .record_finished(id)
            .await
            .map_err(StepError::Record)?;
        self.backend.delete(id).await.map_err(StepError::Backend)?;
        lock(&self.terminal_since).remove(id);
        self.dispatch.forget(self.backend.backend(), id);
        tracing::info!(backend = %self.backend.backend(), assignment_id = %id, event = "cleaned", "executor gone after its result; what it left is removed");
        pass.deleted += 1;
        Ok(())
    }

    /// Fails the unclaimed executors past their start deadline whose assignment is no
    /// longer queued. One queue read per pass, and only when there are such executors.
    async fn reconcile_unstarted(
        &self,
        unstarted: &Unstarted,
        records: &[ExecutorRecord],
        pass: &mut Pass,
    ) {
        let now = SystemTime::now();
        let overdue: Vec<&ExecutorRecord> = records
            .iter()
            .filter(|r| !r.claimed && !r.terminal)
            .filter(|r| {
                now.duration_since(r.created_at)
                    .is_ok_and(|age| age > unstarted.start_deadline)
            })
            .collect();
        if overdue.is_empty() {
            return;
        }
        let ids: HashSet<AssignmentId> =
            overdue.iter().map(|r| r.assignment.id().clone()).collect();
        let read = tokio::time::timeout(unstarted.read_timeout, unstarted.queue.queued(&ids));
        let queued = match read.await {
            Ok(Ok(q)) => q,
            Err(_) => {
                pass.errors += 1;
                self.count(|m| &m.lifecycle_errors);
                tracing::warn!(backend = %self.backend.backend(), overdue = overdue.len(), timeout = ?unstarted.read_timeout, "the queue did not say in time whether executors past their start deadline still have their assignment; looking again next pass");
                return;
            }
            Ok(Err(e)) => {
                pass.errors += 1;
                self.count(|m| &m.lifecycle_errors);
                tracing::warn!(backend = %self.backend.backend(), overdue = overdue.len(), error = %e, "cannot read the queue to tell whether executors past their start deadline still have their assignment; looking again next pass");
                return;
            }
        };
        for record in overdue
            .into_iter()
            .filter(|r| !queued.contains(r.assignment.id()))
        {
            if let Err(e) = self
                .fail_unstarted(record, unstarted.start_deadline, pass)
                .await
            {
                pass.errors += 1;
                self.count(|m| &m.lifecycle_errors);
                tracing::warn!(backend = %self.backend.backend(), assignment_id = %record.assignment.id(), executor = %record.name, error = %e, "lifecycle step failed; retrying next pass (the executor and its slot are kept until it succeeds)");
            }
        }
    }

    /// Invariant 12 for an executor that never started and whose assignment left the
    /// queue: report the failure (unless its end was recorded, i.e. reported, before),
    /// then mark it terminal and delete it, which frees its slot.
    async fn fail_unstarted(
        &self,
        record: &ExecutorRecord,
        start_deadline: Duration,
        pass: &mut Pass,
    ) -> Result<(), StepError> {
        let kind = self.backend.backend();
        let id = record.assignment.id();
        // From here on its runner cannot claim the task in this process; one that is
        // claiming right now keeps it.
        if !self.dispatch.expire(id) {
            return Ok(());
        }
        // The listing may predate a claim whose assignment was acknowledged since (that is
        // why its message is gone): the claim is on the backend before the ack.
        if self
            .backend
            .find(id)
            .await
            .map_err(StepError::Backend)?
            .is_some_and(|r| r.claimed || r.terminal)
        {
            return Ok(());
        }
        let reported = self
            .dispatch
            .has_finished(id)
            .await
            .map_err(StepError::Finished)?;
        if reported {
            tracing::info!(backend = %kind, assignment_id = %id, executor = %record.name, "an unclaimed executor's job was failed in Gitea before (its assignment was held too long); deleting it");
        } else {
            let reason = format!(
                "the executor {} did not start the job within {}, and the job's queued assignment is gone (it expired or was removed from the queue), so nothing can hand the job to it any more",
                record.name,
                humantime_serde::re::humantime::format_duration(start_deadline)
            );
            let why = FailureReason::StartDeadline;
            tracing::error!(backend = %kind, assignment_id = %id, event = "failing", failure = why.as_str(), executor = %record.name, %reason, "failing the task in Gitea, then cleaning up");
            match self
                .gitea
                .report_failure(id.task_id(), &reason, &REPORT_BACKOFF, REPORT_ATTEMPTS)
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
        }
        self.backend
            .mark_terminal(id)
            .await
            .map_err(StepError::Backend)?;
        self.delete(record).await?;
        pass.unstarted += 1;
        pass.deleted += 1;
        Ok(())
    }

    /// A claimed assignment missing from the list: if the backend confirms its executor is
    /// gone (a direct read, not the list, which may predate a just-created executor), fail
    /// the task in Gitea, delete what is left of the executor, and forget it.
    async fn fail_gone(&self, id: &AssignmentId, pass: &mut Pass) -> Result<(), StepError> {
        if self
            .backend
            .find(id)
            .await
            .map_err(StepError::Backend)?
            .is_some()
        {
            return Ok(());
        }
        let kind = self.backend.backend();
        let reason = format!(
            "the job's executor {id} is gone from the {kind} backend (deleted by someone else, or its node was lost) before the job reported a result"
        );
        tracing::error!(backend = %kind, assignment_id = %id, %reason, "failing the task in Gitea");
        match self
            .gitea
            .report_failure(id.task_id(), &reason, &REPORT_BACKOFF, REPORT_ATTEMPTS)
            .await
        {
            Ok(Reported::Accepted | Reported::TaskGone) => {}
            Err(e) => return Err(StepError::Report(e)),
        }
        // What the executor left (its identity entry) goes now, not at the next sweep.
        self.backend.delete(id).await.map_err(StepError::Backend)?;
        self.dispatch.forget(kind, id);
        pass.gone += 1;
        Ok(())
    }

    fn count(
        &self,
        family: impl Fn(
            &crate::job_metrics::JobMetrics,
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
        // Unclaimed: its worker fails it, or `reconcile_unstarted` once it has none.
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
        // Invariant 20: once the executor is gone, only this record stops a replayed
        // envelope from running the job again.
        self.dispatch
            .record_finished(id)
            .await
            .map_err(StepError::Record)?;
        self.backend.delete(id).await.map_err(StepError::Backend)?;
        lock(&self.terminal_since).remove(id);
        self.dispatch.forget(self.backend.backend(), id);
        tracing::info!(backend = %self.backend.backend(), assignment_id = %id, event = "cleaned", executor = %record.name, "executor deleted; its slot is free");
        Ok(())
    }

    /// Runs the backend's housekeeping, logging what it removed or why it could not.
    async fn housekeep(&self, housekeeping: &dyn Housekeeping) {
        match housekeeping.sweep().await {
            Ok(0) => {}
            Ok(removed) => {
                tracing::info!(backend = %self.backend.backend(), removed, "removed objects left over by gone executors");
            }
            Err(e) => {
                self.count(|m| &m.lifecycle_errors);
                tracing::warn!(backend = %self.backend.backend(), error = %e, "clean-up of left-over objects failed; retrying next interval");
            }
        }
    }

    /// Runs the backend's per-pass upkeep, logging why it could not.
    async fn upkeep(&self, housekeeping: &dyn Housekeeping) {
        match housekeeping.every_pass().await {
            Ok(upkeep) => {
                if let Some(o) = &self.observations {
                    o.warm_left(self.backend.backend(), upkeep.warm.as_ref());
                }
                if let Some(m) = &self.metrics {
                    m.record_warm(
                        self.backend.backend(),
                        upkeep.warm.as_ref(),
                        &upkeep.discarded,
                        &upkeep.claims,
                    );
                }
            }
            Err(e) => {
                self.count(|m| &m.lifecycle_errors);
                tracing::warn!(backend = %self.backend.backend(), error = %e, "keeping up the backend (its warm pool) failed; retrying next pass");
            }
        }
    }

    /// Runs passes every `interval`, and after every wake, until `shutdown`.
    pub async fn run(self, interval: Duration, shutdown: Shutdown) {
        let mut wake = self.wake.fresh();
        let mut last_housekeeping: Option<Instant> = None;
        loop {
            if let Err(e) = self.reconcile_once().await {
                self.count(|m| &m.lifecycle_errors);
                tracing::warn!(backend = %self.backend.backend(), error = %e, "listing executors failed; nothing is cleaned up or failed until the next pass lists them");
            }
            if let Some(h) = &self.housekeeping {
                self.upkeep(h.as_ref()).await;
            }
            if let Some(h) = &self.housekeeping
                && last_housekeeping.is_none_or(|t| t.elapsed() >= interval)
            {
                last_housekeeping = Some(Instant::now());
                self.housekeep(h.as_ref()).await;
            }
            tokio::select! {
                _ = shutdown.wait() => return,
                _ = tokio::time::sleep(interval) => {}
                _ = wake.changed() => {
                    if !shutdown.sleep(WAKE_COALESCE).await {
                        return;
                    }
                    // Changes during the pause are covered by the pass that follows.
                    wake = wake.fresh();
                }
            }
        }
    }
}
