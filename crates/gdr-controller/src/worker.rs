//! Workers: one per backend, each consuming its own durable JetStream consumer
//! (DESIGN invariants 5, 6, 8, 9).
//!
//! For every delivered assignment: decode and re-derive (poison or tampered → TERM);
//! skip if the backend shows it claimed already; take an admission slot or NAK with a
//! delay (the assignment stays pending, nothing is created beyond capacity); reconcile
//! the executor through the backend (find → create → bind identity); offer the task to
//! the facade and wait, extending the ack deadline, until the runner claims it; then
//! double-ack. A failing or full backend only delays its own consumer.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, AckKind, consumer::PullConsumer};
use futures::StreamExt;
use tokio::sync::watch;

use crate::dispatch::{ClaimState, Dispatch};
use crate::gitea::GiteaClient;
use gdr_core::assignment::{Assignment, DerivationPolicy, EnvelopeError, TaskKeyring, decode};
use gdr_core::backend::Backend;
use gdr_core::capacity::Admission;
use gdr_core::executor::{
    Binding, ExecutorBackend, ExecutorError, ExecutorRecord, ExecutorSpec, Phase,
};

/// Worker timings and executor wiring.
#[derive(Debug, Clone)]
pub struct WorkerSettings {
    /// Backend this worker serves.
    pub backend: Backend,
    /// NAK delay while the pool is full.
    pub full_delay: Duration,
    /// NAK delay while the identity target does not exist yet.
    pub not_ready_delay: Duration,
    /// NAK delay after a backend error.
    pub error_delay: Duration,
    /// How often the ack deadline is extended and the executor looked at while waiting
    /// for the claim (must be below the consumer's ack wait).
    pub progress_interval: Duration,
    /// An executor whose runner has not claimed the task by then has failed to start.
    pub start_deadline: Duration,
    /// Facade URL handed to executors.
    pub facade_url: String,
    /// Facade SPIFFE ID handed to executors.
    pub facade_spiffe_id: String,
    /// The runs-on label of this backend as the executor's runner declares it.
    pub runner_label: String,
    /// The metadata codec of executor objects.
    pub codec: gdr_core::metadata::MetadataCodec,
}

/// What became of one delivery; logged and counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The runner claimed the task; the message is acknowledged.
    Claimed,
    /// Already claimed before this delivery (redelivery after a restart); acknowledged.
    AlreadyClaimed,
    /// Pool full: NAK with delay.
    Full,
    /// Identity target not ready: NAK with delay.
    NotReady,
    /// Backend error: NAK with a longer delay.
    BackendError,
    /// Undecodable, tampered or misrouted: terminated, never retried.
    Poison,
    /// The executor ended or never started without claiming: reported as failed.
    ExecutorFailed,
    /// Shutting down: NAK so another controller takes it at once.
    Interrupted,
    /// Sealed with a task key this controller does not have: NAK with a long delay.
    MissingKey,
}

impl Outcome {
    /// Metric/log label.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Claimed => "claimed",
            Outcome::AlreadyClaimed => "already_claimed",
            Outcome::Full => "full",
            Outcome::NotReady => "not_ready",
            Outcome::BackendError => "backend_error",
            Outcome::Poison => "poison",
            Outcome::ExecutorFailed => "executor_failed",
            Outcome::Interrupted => "interrupted",
            Outcome::MissingKey => "missing_key",
        }
    }
}

/// A backend worker.
pub struct Worker {
    dispatch: Arc<Dispatch>,
    backend: Arc<dyn ExecutorBackend>,
    gitea: GiteaClient,
    policy: DerivationPolicy,
    keyring: Option<TaskKeyring>,
    settings: WorkerSettings,
    outcomes: Option<tokio::sync::mpsc::UnboundedSender<(String, Outcome)>>,
}

/// Why a worker stopped.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// The dispatch has no adapter for this worker's backend.
    #[error("no {0} backend configured")]
    NoBackend(Backend),
    /// Pulling from JetStream failed permanently.
    #[error("pulling {backend} assignments: {message}")]
    Pull {
        /// Backend.
        backend: Backend,
        /// Cause.
        message: String,
    },
}

impl Worker {
    /// A worker for `settings.backend`.
    pub fn new(
        dispatch: Arc<Dispatch>,
        gitea: GiteaClient,
        policy: DerivationPolicy,
        keyring: Option<TaskKeyring>,
        settings: WorkerSettings,
    ) -> Result<Self, WorkerError> {
        let backend = dispatch
            .backend(settings.backend)
            .ok_or(WorkerError::NoBackend(settings.backend))?;
        Ok(Worker {
            dispatch,
            backend,
            gitea,
            policy,
            keyring,
            settings,
            outcomes: None,
        })
    }

    /// Reports every delivery's outcome (tests and metrics).
    pub fn with_outcomes(
        mut self,
        tx: tokio::sync::mpsc::UnboundedSender<(String, Outcome)>,
    ) -> Self {
        self.outcomes = Some(tx);
        self
    }

    /// Consumes until `shutdown` turns true. In-flight deliveries are NAKed on shutdown.
    pub async fn run(
        self,
        consumer: PullConsumer,
        mut shutdown: watch::Receiver<bool>,
    ) -> Result<(), WorkerError> {
        let this = Arc::new(self);
        let backend = this.settings.backend;
        let mut tasks = tokio::task::JoinSet::new();
        'outer: loop {
            if *shutdown.borrow() {
                break;
            }
            let mut messages = match consumer.messages().await {
                Ok(m) => m,
                Err(e) => {
                    tracing::warn!(%backend, error = %e, "cannot pull assignments; retrying");
                    tokio::select! {
                        _ = tokio::time::sleep(Duration::from_secs(1)) => continue,
                        _ = shutdown.changed() => break,
                    }
                }
            };
            loop {
                tokio::select! {
                    _ = shutdown.changed() => break 'outer,
                    next = messages.next() => match next {
                        Some(Ok(message)) => {
                            let worker = Arc::clone(&this);
                            let stop = shutdown.clone();
                            tasks.spawn(async move { worker.handle(message, stop).await });
                        }
                        Some(Err(e)) => {
                            tracing::warn!(%backend, error = %e, "assignment pull interrupted; re-subscribing");
                            continue 'outer;
                        }
                        None => continue 'outer,
                    },
                    Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
                }
            }
        }
        // Handlers see the shutdown too and NAK what they hold.
        while tasks.join_next().await.is_some() {}
        Ok(())
    }

    async fn handle(&self, message: jetstream::Message, shutdown: watch::Receiver<bool>) {
        let (label, outcome) = self.process(&message, shutdown).await;
        let backend = self.settings.backend;
        let settle = match outcome {
            Outcome::Claimed | Outcome::AlreadyClaimed | Outcome::ExecutorFailed => {
                message.double_ack().await
            }
            Outcome::Poison => message.double_ack_with(AckKind::Term).await,
            Outcome::Full => {
                message
                    .ack_with(AckKind::Nak(Some(self.settings.full_delay)))
                    .await
            }
            Outcome::NotReady => {
                message
                    .ack_with(AckKind::Nak(Some(self.settings.not_ready_delay)))
                    .await
            }
            Outcome::BackendError | Outcome::MissingKey => {
                message
                    .ack_with(AckKind::Nak(Some(self.settings.error_delay)))
                    .await
            }
            Outcome::Interrupted => message.ack_with(AckKind::Nak(None)).await,
        };
        if let Err(e) = settle {
            // JetStream redelivers after the ack wait; every step is idempotent.
            tracing::warn!(%backend, assignment_id = %label, outcome = outcome.as_str(), error = %e, "settling the delivery failed");
        }
        tracing::info!(%backend, assignment_id = %label, outcome = outcome.as_str(), "assignment delivery settled");
        if let Some(tx) = &self.outcomes {
            let _ = tx.send((label, outcome));
        }
    }

    async fn process(
        &self,
        message: &jetstream::Message,
        shutdown: watch::Receiver<bool>,
    ) -> (String, Outcome) {
        let backend = self.settings.backend;
        let assignment = match decode(&message.payload, &self.policy, self.keyring.as_ref()) {
            Ok(a) => a,
            Err(e @ (EnvelopeError::UnknownKey(_) | EnvelopeError::NoKeyring)) => {
                // A key this process lacks is a configuration fault (e.g. a rotation
                // rolled out in the wrong order), not a bad message: keep the job. The
                // heartbeater keeps it alive in Gitea meanwhile (it reads only the ID).
                let sequence = message
                    .info()
                    .map(|i| i.stream_sequence)
                    .unwrap_or_default();
                tracing::error!(%backend, stream_sequence = sequence, error = %e, "cannot decrypt an assignment: configure its task key; retrying later");
                return (format!("stream-sequence-{sequence}"), Outcome::MissingKey);
            }
            Err(e) => {
                let sequence = message
                    .info()
                    .map(|i| i.stream_sequence)
                    .unwrap_or_default();
                tracing::error!(%backend, stream_sequence = sequence, error = %e, "terminating an undecodable or tampered assignment");
                return (format!("stream-sequence-{sequence}"), Outcome::Poison);
            }
        };
        let label = assignment.id().as_str().to_string();
        if assignment.backend() != backend {
            tracing::error!(%backend, assignment_id = %label, derived = %assignment.backend(), "terminating an assignment published to the wrong backend subject");
            return (label, Outcome::Poison);
        }
        (label, self.reconcile(assignment, message, shutdown).await)
    }

    async fn reconcile(
        &self,
        assignment: Assignment,
        message: &jetstream::Message,
        mut shutdown: watch::Receiver<bool>,
    ) -> Outcome {
        let backend = self.settings.backend;
        let id = assignment.id().clone();
        let existing = match self.backend.find(&id).await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(%backend, assignment_id = %id, error = %e, "looking up the executor failed");
                return Outcome::BackendError;
            }
        };
        if existing.as_ref().is_some_and(|r| r.claimed || r.terminal) {
            return Outcome::AlreadyClaimed;
        }
        match self.dispatch.admit(backend, &id) {
            Admission::Full => return Outcome::Full,
            Admission::Admitted | Admission::AlreadyAdmitted => {}
        }
        let record = match existing {
            Some(r) => r,
            None => {
                let spec = self.spec(&assignment);
                match self.backend.create(&spec).await {
                    Ok(r) => {
                        crate::failpoint::hit(crate::failpoint::points::AFTER_CREATE);
                        tracing::info!(%backend, assignment_id = %id, executor = %r.name, "executor created");
                        r
                    }
                    Err(e) => {
                        // Nothing was created, so the slot goes back.
                        self.dispatch.release(backend, &id);
                        tracing::warn!(%backend, assignment_id = %id, error = %e, "creating the executor failed");
                        return match e {
                            ExecutorError::Full { .. } => Outcome::Full,
                            ExecutorError::Unavailable(_) | ExecutorError::Permanent(_) => {
                                Outcome::BackendError
                            }
                        };
                    }
                }
            }
        };
        if !record.identity_bound {
            match self.backend.bind_identity(&record).await {
                Ok(Binding::Bound) => {}
                Ok(Binding::NotReady(why)) => {
                    tracing::info!(%backend, assignment_id = %id, reason = %why, "identity target not ready");
                    return Outcome::NotReady;
                }
                Err(e) => {
                    tracing::warn!(%backend, assignment_id = %id, error = %e, "binding the identity failed");
                    return Outcome::BackendError;
                }
            }
        }
        let mut claim = self.dispatch.offer(&assignment);
        let started = Instant::now();
        loop {
            if matches!(*claim.borrow(), ClaimState::Claimed | ClaimState::Terminal) {
                return Outcome::Claimed;
            }
            tokio::select! {
                _ = claim.changed() => continue,
                _ = shutdown.changed() => return Outcome::Interrupted,
                _ = tokio::time::sleep(self.settings.progress_interval) => {
                    // Keeps JetStream from redelivering while the executor starts.
                    if let Err(e) = message.ack_with(AckKind::Progress).await {
                        tracing::warn!(%backend, assignment_id = %id, error = %e, "extending the ack deadline failed");
                    }
                }
            }
            if let Some(failure) = self.executor_failure(&id, &record, started).await {
                self.fail(&assignment, &failure).await;
                return Outcome::ExecutorFailed;
            }
        }
    }

    /// Checks, while waiting for the claim, whether the executor has died or is too
    /// late; `None` while it may still claim (or when the backend cannot tell now).
    async fn executor_failure(
        &self,
        id: &gdr_core::assignment::AssignmentId,
        record: &ExecutorRecord,
        started: Instant,
    ) -> Option<String> {
        match self.backend.find(id).await {
            Ok(Some(current)) if current.claimed || current.terminal => None,
            Ok(Some(current)) => match current.phase {
                Phase::Finished { success, reason } => Some(format!(
                    "the executor {} ended ({}) before its runner fetched the task",
                    current.name,
                    reason.unwrap_or_else(|| if success {
                        "exit 0".into()
                    } else {
                        "failed".into()
                    })
                )),
                _ if started.elapsed() > self.settings.start_deadline => Some(format!(
                    "the executor {} did not start the job within {:?}",
                    record.name, self.settings.start_deadline
                )),
                _ => None,
            },
            Ok(None) => Some(format!(
                "the executor {} disappeared before its runner fetched the task",
                record.name
            )),
            Err(_) => None,
        }
    }

    /// Invariant 12: report the failure, mark terminal, release the slot, clean up.
    async fn fail(&self, assignment: &Assignment, reason: &str) {
        let backend = self.settings.backend;
        let id = assignment.id();
        tracing::error!(%backend, assignment_id = %id, reason, "executor failed before claiming its task");
        if let Err(e) = self.gitea.fail_task(id.task_id(), reason).await {
            tracing::error!(%backend, assignment_id = %id, error = %e, "reporting the failure to Gitea failed");
        }
        if let Err(e) = self.backend.mark_terminal(id).await {
            tracing::warn!(%backend, assignment_id = %id, error = %e, "marking the failed executor terminal failed");
        }
        self.dispatch.forget(backend, id);
        if let Err(e) = self.backend.delete(id).await {
            tracing::warn!(%backend, assignment_id = %id, error = %e, "deleting the failed executor failed; the lifecycle reconciler retries");
        }
    }

    fn spec(&self, assignment: &Assignment) -> ExecutorSpec {
        ExecutorSpec::new(
            assignment,
            self.dispatch.capability_key().issue(assignment.id()),
            &self.settings.codec,
            &self.settings.facade_url,
            &self.settings.facade_spiffe_id,
            &self.settings.runner_label,
        )
    }
}
