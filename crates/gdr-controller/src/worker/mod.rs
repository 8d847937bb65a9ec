//! Workers: one per backend, each consuming its own durable JetStream consumer
//! (DESIGN invariants 5, 6, 8, 9, 12).
//!
//! For every delivered assignment: decode and re-derive (poison or tampered → TERM); apply
//! the queue's trust rules (invariant 21: a plaintext envelope where a task key is
//! configured, or one fetched longer ago than a task may live → TERM); set aside one
//! sealed with a key this controller lacks (moved to the held subject, so it holds no
//! admission slot); skip if the backend shows it claimed already, or if it finished before
//! (invariant 20: a replay → TERM); take an admission slot, waiting in line while the pool
//! is full (the slot a finishing executor frees goes to the first waiter at once; beyond
//! `capacity` waiters the delivery is NAKed with a delay; nothing is created beyond
//! capacity either way); offer the task to the facade; reconcile the executor through the
//! backend (find → create → bind identity) and wait, extending the ack deadline, until the
//! runner claims it; then double-ack. A failing or full backend only delays its own
//! consumer.
//!
//! One assignment is handled by at most one delivery at a time in this process: a
//! redelivery that arrives while an earlier one still works (OpenSandbox's create blocks up
//! to a minute) is put back instead of starting a second create.
//!
//! A backend with a watch (the Pod backend) gives the worker a [`Wake`]: while it waits
//! for the identity target (the Pod's scheduling) or for the claim, every observed change
//! makes it look at the executor at once, so a Pod that failed, or was deleted, before its
//! runner claimed is reported without waiting for the next progress tick.

use std::collections::{BTreeMap, HashSet};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::{self, AckKind};
use futures::StreamExt;
use gdr_core::assignment::{
    Assignment, AssignmentId, DerivationPolicy, Envelope, EnvelopeRules, TaskKeyring, decode_with,
    envelope_id,
};
use gdr_core::backend::Backend;
use gdr_core::capability::Capability;
use gdr_core::capacity::Admission;
use gdr_core::executor::{Binding, ExecutorBackend, ExecutorError, ExecutorRecord, ExecutorSpec};
use gdr_core::metadata::MetadataCodec;

use crate::backoff::Backoff;
use crate::channel::ExecutorChannel;
use crate::dispatch::{ClaimState, Dispatch, Waited};
use crate::job_metrics::{FailureReason, JobMetrics};
use crate::metrics::BackendLabel;
use crate::shutdown::Shutdown;
use crate::wake::Wake;
use gdr_gitea::{GiteaClient, Reported};

mod decide;
use decide::{AfterCreateError, Observed, Settle, Start, Unopened};

/// Re-subscribing after a stream error: quick at first, never a spin.
const RESUBSCRIBE: Backoff = Backoff::new(Duration::from_millis(500), Duration::from_secs(30));
/// Reporting a failed executor: a few attempts within one delivery; if Gitea stays away the
/// delivery is put back and the next one reports again.
const REPORT_BACKOFF: Backoff = Backoff::new(Duration::from_millis(500), Duration::from_secs(5));
const REPORT_ATTEMPTS: u32 = 4;

/// Worker timings and executor wiring.
#[derive(Debug, Clone)]
pub struct WorkerSettings {
    /// Backend this worker serves.
    pub backend: Backend,
    /// NAK delay while the pool is full and as many deliveries wait in line as it has
    /// slots, or the backend itself is full without a retry hint.
    pub full_delay: Duration,
    /// NAK delay while the identity target does not exist yet.
    pub not_ready_delay: Duration,
    /// NAK delay after a backend error.
    pub error_delay: Duration,
    /// How often the ack deadline is extended and the executor looked at while waiting
    /// (must be below the consumer's ack wait).
    pub progress_interval: Duration,
    /// An executor whose runner has not claimed the task this long after the executor's
    /// creation has failed to start.
    pub start_deadline: Duration,
    /// What executors are told about the facade and their runner.
    pub channel: ExecutorChannel,
    /// The metadata codec of executor objects.
    pub codec: MetadataCodec,
    /// What the worker trusts of an envelope.
    pub envelopes: EnvelopeTrust,
    /// Where assignments sealed with an unknown task key are set aside
    /// (`queue::StreamSettings::held_subject`).
    pub held_subject: String,
}

impl WorkerSettings {
    /// The executor spec of `assignment`, its runner token `capability`.
    pub fn spec(&self, assignment: &Assignment, capability: Capability) -> ExecutorSpec {
        self.channel.spec(assignment, capability, &self.codec)
    }

    /// What a warm environment's executor (`vm_warm_pool`), started before any job, is
    /// given: the job-independent part of every executor's environment. The facade hands
    /// it the rest once a job claimed it.
    pub fn standby_environment(&self) -> BTreeMap<&'static str, String> {
        self.channel.standby_environment(self.backend)
    }
}

/// The trust rules a worker applies to what it reads from the queue (DESIGN invariant 21).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EnvelopeTrust {
    /// Accept plaintext v1 envelopes although a task key is configured (a migration).
    pub accept_plaintext: bool,
    /// Refuse an envelope fetched longer ago than this (Gitea's endless-task timeout).
    pub max_age: Duration,
    /// Accept sealed envelopes without a fetch time (older releases wrote them): an upgrade.
    pub accept_undated: bool,
}

impl EnvelopeTrust {
    /// The rules as of `now`.
    pub fn rules(&self, now: SystemTime) -> EnvelopeRules {
        EnvelopeRules {
            accept_plaintext: self.accept_plaintext,
            max_age: self.max_age,
            accept_undated: self.accept_undated,
            now,
        }
    }
}

pub use crate::vocabulary::Outcome;

/// A backend worker.
pub struct Worker {
    dispatch: Arc<Dispatch>,
    backend: Arc<dyn ExecutorBackend>,
    gitea: GiteaClient,
    policy: DerivationPolicy,
    keyring: Option<TaskKeyring>,
    settings: WorkerSettings,
    outcomes: Option<tokio::sync::mpsc::UnboundedSender<(String, Outcome)>>,
    metrics: Option<Arc<JobMetrics>>,
    /// Assignments a delivery is being handled for right now.
    in_flight: Mutex<HashSet<AssignmentId>>,
    /// `Retry-After` hints of full backends, per assignment, for the NAK that follows.
    retry_hints: Mutex<std::collections::HashMap<String, Duration>>,
    /// The backend's change signal.
    wake: Wake,
    /// Notified when a settled delivery left the stream (the scheduler's backlog gate
    /// re-reads the stream at once).
    settled: Option<Arc<tokio::sync::Notify>>,
    /// The time the decisions are made at (the wall clock: the ages it measures are of
    /// executors and envelopes, which outlive this process).
    clock: fn() -> SystemTime,
}

/// Why a worker could not start.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// The dispatch has no adapter for this worker's backend.
    #[error("no {0} backend configured")]
    NoBackend(Backend),
}

/// Deletes a resumed assignment's message once its runner claimed it (see
/// [`Worker::resume_adopted`]); gives up when the assignment is forgotten unclaimed.
async fn remove_once_claimed(
    stream: jetstream::stream::Stream,
    sequence: u64,
    id: AssignmentId,
    mut claim: tokio::sync::watch::Receiver<ClaimState>,
) {
    let claimed = claim
        .wait_for(|s| matches!(s, ClaimState::Claimed | ClaimState::Terminal))
        .await
        .is_ok();
    if !claimed {
        return;
    }
    match stream.delete_message(sequence).await {
        Ok(_) => {
            tracing::debug!(assignment_id = %id, sequence, "removed the claimed assignment of a resumed executor from the stream");
        }
        // Acknowledged by a redelivery meanwhile: gone already.
        Err(e) => {
            tracing::debug!(assignment_id = %id, sequence, error = %e, "the claimed assignment of a resumed executor is no longer in the stream");
        }
    }
}

/// Removes an assignment from the in-flight set when its handler ends, however it ends.
struct InFlight<'a> {
    set: &'a Mutex<HashSet<AssignmentId>>,
    id: AssignmentId,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.set
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.id);
    }
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
            metrics: None,
            in_flight: Mutex::new(HashSet::new()),
            retry_hints: Mutex::new(std::collections::HashMap::new()),
            wake: Wake::none(),
            settled: None,
            clock: SystemTime::now,
        })
    }

    /// Looks at a waiting executor whenever `wake` fires. With a live signal, an identity
    /// target that is not ready yet is waited for within the delivery instead of putting
    /// the delivery back.
    #[must_use]
    pub fn with_wake(mut self, wake: Wake) -> Self {
        self.wake = wake;
        self
    }

    /// Notifies `signal` whenever an acknowledged or terminated delivery leaves the stream.
    pub fn with_backlog_signal(mut self, signal: Arc<tokio::sync::Notify>) -> Self {
        self.settled = Some(signal);
        self
    }

    /// Reports every delivery's outcome (tests and metrics).
    pub fn with_outcomes(
        mut self,
        tx: tokio::sync::mpsc::UnboundedSender<(String, Outcome)>,
    ) -> Self {
        self.outcomes = Some(tx);
        self
    }

    /// Observes queue wait, start latency and the jobs it fails into `metrics`.
    #[must_use]
    pub fn with_metrics(mut self, metrics: Arc<JobMetrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// Offers their assignments to the adopted executors whose runner has not claimed yet,
    /// read straight from `stream` (messages on `subject`); returns how many.
    ///
    /// After a controller restart JetStream keeps the messages the dead controller held
    /// pending until `nats_ack_wait` passes; their runners meanwhile poll the facade for a
    /// task it cannot give them. Reading the messages now lets those runners claim in
    /// seconds. Once one is claimed its message is deleted from the stream, as the ack
    /// after a claim would have removed it (the dead controller's delivery cannot be
    /// acknowledged from here), so a later redelivery cannot create its executor again.
    /// A redelivery that comes before the claim is handled as any delivery.
    pub async fn resume_adopted(&self, stream: &jetstream::stream::Stream, subject: &str) -> usize {
        let backend = self.settings.backend;
        let candidates: Vec<AssignmentId> = match self.backend.list().await {
            Ok(records) => records
                .into_iter()
                .filter(|r| !r.claimed && !r.terminal && !r.phase.is_finished())
                .map(|r| r.assignment.id().clone())
                .collect(),
            Err(e) => {
                tracing::warn!(%backend, error = %e, "cannot list executors to resume; their redelivery resumes them");
                return 0;
            }
        };
        let waiting = self.not_finished(candidates).await;
        if waiting.is_empty() {
            return 0;
        }
        let mut reader =
            crate::queue::QueuedReader::new(stream, subject, crate::queue::ReadLimits::DEFAULT);
        let mut resumed = 0;
        loop {
            let page = match reader.next_page().await {
                Ok(Some(page)) => page,
                Ok(None) => break,
                Err(e) => {
                    tracing::warn!(%backend, error = %e, "cannot read the stream to resume adopted executors; their redelivery resumes them");
                    break;
                }
            };
            resumed += self.resume_page(stream, page, &waiting);
        }
        if reader.capped() {
            tracing::warn!(%backend, read = reader.read(), unread = reader.unread(), "more assignments queued than one start reads; the rest of the adopted executors are resumed by their redelivery");
        }
        resumed
    }

    /// The members of `ids` not recorded as finished. A job failed before the restart
    /// (the record is written before the report) is never offered again; neither is one
    /// whose record cannot be read now: its redelivery decides.
    async fn not_finished(&self, ids: Vec<AssignmentId>) -> HashSet<AssignmentId> {
        let mut open = HashSet::new();
        for id in ids {
            match self.dispatch.has_finished(&id).await {
                Ok(false) => {
                    open.insert(id);
                }
                Ok(true) => {}
                Err(e) => {
                    tracing::warn!(backend = %self.settings.backend, assignment_id = %id, error = %e, "cannot tell whether an adopted executor's job finished; its redelivery decides");
                }
            }
        }
        open
    }

    /// [`Worker::resume_adopted`] for one page of the stream.
    fn resume_page(
        &self,
        stream: &jetstream::stream::Stream,
        messages: Vec<crate::queue::Queued>,
        waiting: &HashSet<AssignmentId>,
    ) -> usize {
        let backend = self.settings.backend;
        let mut resumed = 0;
        for message in messages {
            let Some(id) = envelope_id(&message.payload).filter(|id| waiting.contains(id)) else {
                continue;
            };
            let rules = self.settings.envelopes.rules((self.clock)());
            match decode_with(
                &message.payload,
                &self.policy,
                self.keyring.as_ref(),
                &rules,
            ) {
                Ok(assignment) if assignment.backend() == backend && assignment.id() == &id => {
                    // Admitted already: the pool was restored from the same executors.
                    if self.dispatch.admit(backend, &id) == Admission::Full {
                        continue;
                    }
                    let claim = self.dispatch.offer(&assignment);
                    tokio::spawn(remove_once_claimed(
                        stream.clone(),
                        message.sequence,
                        id.clone(),
                        claim,
                    ));
                    resumed += 1;
                    tracing::info!(%backend, assignment_id = %id, "offered the assignment of an adopted executor without waiting for its redelivery");
                }
                // Its redelivery decides (and terminates a bad one).
                Ok(_) | Err(_) => {}
            }
        }
        resumed
    }

    /// Consumes until `shutdown`. In-flight deliveries are NAKed on shutdown.
    pub async fn run(self, consumer: PullConsumer, shutdown: Shutdown) {
        let this = Arc::new(self);
        let backend = this.settings.backend;
        let mut tasks = tokio::task::JoinSet::new();
        let mut resubscribes = decide::Resubscribes::default();
        'outer: while !shutdown.is_triggered() {
            let mut messages = match consumer.messages().await {
                Ok(m) => m,
                Err(e) => {
                    let delay = RESUBSCRIBE.delay(resubscribes.failed());
                    tracing::warn!(%backend, error = %e, retry_in = ?delay, "cannot pull assignments; retrying");
                    if !shutdown.sleep(delay).await {
                        break;
                    }
                    continue;
                }
            };
            loop {
                tokio::select! {
                    _ = shutdown.wait() => break 'outer,
                    next = messages.next() => match next {
                        Some(Ok(message)) => {
                            resubscribes.delivered();
                            let worker = Arc::clone(&this);
                            let stop = shutdown.clone();
                            tasks.spawn(async move { worker.handle(message, stop).await });
                        }
                        Some(Err(e)) => {
                            let delay = RESUBSCRIBE.delay(resubscribes.failed());
                            tracing::warn!(%backend, error = %e, retry_in = ?delay, "assignment pull interrupted; re-subscribing");
                            if !shutdown.sleep(delay).await {
                                break 'outer;
                            }
                            continue 'outer;
                        }
                        None => {
                            // A stream that keeps ending must not make the loop spin.
                            let delay = RESUBSCRIBE.delay(resubscribes.failed());
                            tracing::warn!(%backend, retry_in = ?delay, "assignment stream ended; re-subscribing");
                            if !shutdown.sleep(delay).await {
                                break 'outer;
                            }
                            continue 'outer;
                        }
                    },
                    Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
                }
            }
        }
        // Handlers see the shutdown too and NAK what they hold.
        while tasks.join_next().await.is_some() {}
    }

    async fn handle(&self, message: jetstream::Message, shutdown: Shutdown) {
        let (label, outcome) = self.process(&message, shutdown).await;
        let backend = self.settings.backend;
        let hint = self
            .retry_hints
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&label);
        let s = &self.settings;
        let delays = decide::Delays {
            full: s.full_delay,
            not_ready: s.not_ready_delay,
            error: s.error_delay,
            progress: s.progress_interval,
        };
        let settlement = decide::settlement(outcome, hint, &delays);
        let leaves = matches!(settlement, Settle::Ack | Settle::Term);
        let settle = match settlement {
            Settle::Ack => message.double_ack().await,
            Settle::Term => message.double_ack_with(AckKind::Term).await,
            Settle::Nak(delay) => message.ack_with(AckKind::Nak(delay)).await,
        };
        if leaves
            && settle.is_ok()
            && let Some(signal) = &self.settled
        {
            signal.notify_one();
        }
        if let Err(e) = settle {
            // JetStream redelivers after the ack wait; every step is idempotent.
            tracing::warn!(%backend, assignment_id = %label, outcome = outcome.as_str(), error = %e, "settling the delivery failed; JetStream redelivers it after the ack wait (every step is idempotent)");
        }
        tracing::info!(%backend, assignment_id = %label, outcome = outcome.as_str(), "assignment delivery settled");
        if let Some(tx) = &self.outcomes {
            let _ = tx.send((label, outcome));
        }
    }

    async fn process(&self, message: &jetstream::Message, shutdown: Shutdown) -> (String, Outcome) {
        let backend = self.settings.backend;
        // Parsed once: the log's ID, the held copy's and the opening read the same parse.
        let envelope = Envelope::parse(&message.payload);
        let label = || {
            envelope.id().map_or_else(
                || {
                    let sequence = message
                        .info()
                        .map(|i| i.stream_sequence)
                        .unwrap_or_default();
                    format!("stream-sequence-{sequence}")
                },
                ToString::to_string,
            )
        };
        let rules = self.settings.envelopes.rules((self.clock)());
        let decoded = envelope.open(&self.policy, self.keyring.as_ref(), &rules);
        let assignment = match decoded {
            Ok(a) => a,
            Err(e) => {
                let label = label();
                return match decide::unopened(&e) {
                    // The heartbeater keeps a held assignment alive in Gitea meanwhile (it
                    // reads only the ID); the held reconciler releases it once the key is
                    // configured, or fails it.
                    Unopened::Hold => {
                        tracing::error!(%backend, assignment_id = %label, error = %e, "cannot decrypt an assignment: setting it aside until its task key is configured");
                        (label, self.hold(message, envelope.id()).await)
                    }
                    Unopened::Terminate { outcome, why } => {
                        tracing::error!(%backend, assignment_id = %label, error = %e, "{why}");
                        (label, outcome)
                    }
                };
            }
        };
        let label = assignment.id().as_str().to_owned();
        if assignment.backend() != backend {
            tracing::error!(%backend, assignment_id = %label, derived = %assignment.backend(), "terminating an assignment published to the wrong backend subject: it is never retried, and Gitea fails its task at its zombie timeout");
            return (label, Outcome::Poison);
        }
        let Some(_guard) = self.enter(assignment.id()) else {
            tracing::info!(%backend, assignment_id = %label, "an earlier delivery of this assignment is still being handled; putting this one back");
            return (label, Outcome::InFlight);
        };
        (label, self.reconcile(assignment, message, shutdown).await)
    }

    /// Moves an undecryptable delivery (naming `id`) to the held subject, then lets the
    /// caller ack it.
    async fn hold(&self, message: &jetstream::Message, id: Option<&AssignmentId>) -> Outcome {
        let backend = self.settings.backend;
        let mut publish =
            jetstream::message::PublishMessage::build().payload(message.payload.clone());
        // A redelivery of a message held already is dropped by JetStream as a duplicate.
        // Keyed by the stream sequence too: the ID is unauthenticated, and a forged message
        // naming it must not make the real one a duplicate.
        if let (Some(id), Ok(info)) = (id, message.info()) {
            publish = publish.message_id(format!("held-{id}-{}", info.stream_sequence));
        }
        let stored = async {
            message
                .context
                .send_publish(self.settings.held_subject.clone(), publish)
                .await?
                .await
        }
        .await;
        match stored {
            Ok(_) => Outcome::Held,
            Err(e) => {
                tracing::warn!(%backend, subject = %self.settings.held_subject, error = %e, "setting an assignment aside failed; retrying later");
                Outcome::MissingKey
            }
        }
    }

    fn enter(&self, id: &AssignmentId) -> Option<InFlight<'_>> {
        let fresh = self
            .in_flight
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id.clone());
        fresh.then(|| InFlight {
            set: &self.in_flight,
            id: id.clone(),
        })
    }

    /// Runs `work` while extending the delivery's ack deadline, so a slow backend call
    /// (a blocking VM create) never lets JetStream redeliver the message meanwhile.
    async fn keeping_alive<T>(
        &self,
        message: &jetstream::Message,
        id: &AssignmentId,
        work: impl Future<Output = T>,
    ) -> T {
        let mut work = std::pin::pin!(work);
        loop {
            tokio::select! {
                done = &mut work => return done,
                _ = tokio::time::sleep(self.settings.progress_interval) => {
                    if let Err(e) = message.ack_with(AckKind::Progress).await {
                        tracing::warn!(backend = %self.settings.backend, assignment_id = %id, error = %e, "extending the ack deadline failed; a redelivery meanwhile is put back while this one works");
                    }
                }
            }
        }
    }

    async fn reconcile(
        &self,
        assignment: Assignment,
        message: &jetstream::Message,
        shutdown: Shutdown,
    ) -> Outcome {
        let backend = self.settings.backend;
        let id = assignment.id().clone();
        let existing = match self.backend.find(&id).await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(%backend, assignment_id = %id, error = %e, retry_in = ?self.settings.error_delay, "looking up the executor failed; the job stays queued and is looked at again");
                return Outcome::BackendError;
            }
        };
        let observed = existing.as_ref().map(Observed::from);
        if observed.as_ref().is_some_and(|o| o.settled) {
            return Outcome::AlreadyClaimed;
        }
        // Invariant 12: the finished record is written before an unclaimed job's failure
        // is reported, so an executor still there is never offered its task again.
        match self
            .dispatch
            .has_finished(&id)
            .await
            .map(|finished| decide::start(observed.as_ref(), finished))
        {
            Ok(Start::Admit) => {}
            Ok(Start::Replayed) => {
                tracing::warn!(%backend, assignment_id = %id, "terminating an assignment that finished before (a replayed envelope)");
                return Outcome::Replayed;
            }
            // Reported again (Gitea keeps the first result) in case the first report never
            // reached it; counted as what stopped it from starting.
            Ok(Start::FailAgain(reason)) => {
                return self
                    .fail(&assignment, FailureReason::StartDeadline, &reason)
                    .await;
            }
            Err(e) => {
                tracing::warn!(%backend, assignment_id = %id, error = %e, "cannot tell whether the assignment finished before; retrying later");
                return Outcome::BackendError;
            }
        }
        if let Err(outcome) = self
            .take_slot(&id, existing.is_none(), message, &shutdown)
            .await
        {
            return outcome;
        }
        // Offered before the executor exists, so its runner's first FetchTask finds the task
        // however fast the executor starts (an empty answer would cost the runner its 2 s
        // poll interval). Only the workload with the assignment's SVID can fetch it.
        let mut claim = self.dispatch.offer(&assignment);
        let record = match existing {
            Some(r) => r,
            None => match self.create(&assignment, message).await {
                Ok(r) => r,
                Err(outcome) => return outcome,
            },
        };
        let mut wake = self.wake.fresh();
        if !record.identity_bound
            && let Err(outcome) = self
                .bind(&assignment, &record, &mut wake, message, &shutdown)
                .await
        {
            return outcome;
        }
        self.await_claim(
            &assignment,
            &record,
            &mut claim,
            &mut wake,
            message,
            &shutdown,
        )
        .await
    }

    /// Takes an admission slot for `id`, waiting in line while the pool is full; `Err` is
    /// the delivery's outcome when it cannot (the line is full, or shutdown).
    async fn take_slot(
        &self,
        id: &AssignmentId,
        new: bool,
        message: &jetstream::Message,
        shutdown: &Shutdown,
    ) -> Result<(), Outcome> {
        let backend = self.settings.backend;
        match self.dispatch.admit(backend, id) {
            Admission::Full => {
                let (in_use, capacity) = self.dispatch.pool_usage(backend);
                tracing::info!(%backend, assignment_id = %id, event = "queued", in_use, capacity, "pool full: the job waits in line for a slot");
                let waited = self.dispatch.admit_when_free(backend, id, shutdown);
                match self.keeping_alive(message, id, waited).await {
                    Waited::Admitted => {
                        // The wait can be long: Gitea may have ended the task meanwhile
                        // (the heartbeater records that), and it must get no executor.
                        if new && self.dispatch.has_finished(id).await.unwrap_or(false) {
                            self.dispatch.forget(backend, id);
                            tracing::warn!(%backend, assignment_id = %id, "terminating an assignment that finished before (ended in Gitea while it waited for a slot)");
                            return Err(Outcome::Replayed);
                        }
                        self.admitted(message, id);
                    }
                    Waited::LineFull => {
                        tracing::info!(%backend, assignment_id = %id, event = "queued", retry_in = ?self.settings.full_delay, "pool and its line full: the job stays queued in JetStream and is offered again later");
                        return Err(Outcome::Full);
                    }
                    Waited::Stopped => return Err(Outcome::Interrupted),
                }
            }
            Admission::Admitted => self.admitted(message, id),
            Admission::AlreadyAdmitted => {}
        }
        Ok(())
    }

    /// Creates the job's executor, extending the ack deadline while the backend works.
    async fn create(
        &self,
        assignment: &Assignment,
        message: &jetstream::Message,
    ) -> Result<ExecutorRecord, Outcome> {
        let backend = self.settings.backend;
        let id = assignment.id();
        let spec = self.spec(assignment);
        match self
            .keeping_alive(message, id, self.backend.create(&spec))
            .await
        {
            Ok(r) => {
                crate::failpoint::hit(crate::failpoint::points::AFTER_CREATE);
                tracing::info!(%backend, assignment_id = %id, event = "executor_created", executor = %r.name, "executor created");
                Ok(r)
            }
            Err(e) => self.after_create_error(assignment, e).await,
        }
    }

    /// Binds the executor's workload identity, waiting (for the backend's change signal or
    /// the not-ready delay) while its target does not exist yet; `Err` is the delivery's
    /// outcome when it cannot be bound now or at all.
    async fn bind(
        &self,
        assignment: &Assignment,
        record: &ExecutorRecord,
        wake: &mut Wake,
        message: &jetstream::Message,
        shutdown: &Shutdown,
    ) -> Result<(), Outcome> {
        let backend = self.settings.backend;
        let id = assignment.id();
        loop {
            let why = match self.backend.bind_identity(record).await {
                Ok(Binding::Bound) => {
                    tracing::info!(%backend, assignment_id = %id, event = "identity_bound", executor = %record.name, spiffe_id = %assignment.identity().spiffe_id(), "workload identity bound");
                    return Ok(());
                }
                Ok(Binding::NotReady(why)) => why,
                Err(ExecutorError::Permanent(cause)) => {
                    let reason = format!("the job's identity cannot be bound: {cause}");
                    return Err(self
                        .fail(assignment, FailureReason::IdentityRefused, &reason)
                        .await);
                }
                Err(e) => {
                    tracing::warn!(%backend, assignment_id = %id, error = %e, retry_in = ?self.settings.error_delay, "binding the identity failed; retrying with the next delivery");
                    return Err(Outcome::BackendError);
                }
            };
            tracing::info!(%backend, assignment_id = %id, reason = %why, retry_in = ?self.settings.not_ready_delay, "identity target not ready; binding again later");
            // A claim in flight or done wins over the deadline (see `await_claim`).
            let overdue = decide::start_overdue(
                &Observed::from(record),
                Some(&why),
                (self.clock)(),
                self.settings.start_deadline,
            );
            if let Some(failure) = overdue
                && self.dispatch.expire(id)
            {
                return Err(self
                    .fail(assignment, FailureReason::StartDeadline, &failure)
                    .await);
            }
            if !wake.is_live() {
                return Err(Outcome::NotReady);
            }
            // The watch tells when the Pod is scheduled; the delay bounds a wait for a
            // change that never comes.
            let waited = self.keeping_alive(message, id, async {
                tokio::select! {
                    _ = wake.changed() => true,
                    _ = tokio::time::sleep(self.settings.not_ready_delay) => true,
                    _ = shutdown.wait() => false,
                }
            });
            if !waited.await {
                return Err(Outcome::Interrupted);
            }
        }
    }

    /// Waits, extending the ack deadline, until the runner claims the task, looking at the
    /// executor at every progress tick and backend change; fails the job when its executor
    /// ended, disappeared or is past its start deadline first.
    async fn await_claim(
        &self,
        assignment: &Assignment,
        record: &ExecutorRecord,
        claim: &mut tokio::sync::watch::Receiver<ClaimState>,
        wake: &mut Wake,
        message: &jetstream::Message,
        shutdown: &Shutdown,
    ) -> Outcome {
        let backend = self.settings.backend;
        let id = assignment.id();
        let interval = self.settings.progress_interval;
        // A deadline, not a sleep per turn: wakes must not postpone the progress acks.
        let mut progress_due = tokio::time::Instant::now() + interval;
        loop {
            if matches!(*claim.borrow(), ClaimState::Claimed | ClaimState::Terminal) {
                self.observe(|m| &m.start_latency, self.elapsed_since(record.created_at));
                return Outcome::Claimed;
            }
            // Biased: a claim that lands together with a wake (the runner fetched, then its
            // Pod was deleted) is the runner's job now, reported by the lifecycle reconciler;
            // judged as a start failure it would be failed with the wrong reason.
            tokio::select! {
                biased;
                _ = claim.changed() => continue,
                _ = shutdown.wait() => return Outcome::Interrupted,
                _ = wake.changed() => {}
                _ = tokio::time::sleep_until(progress_due) => {
                    progress_due = tokio::time::Instant::now() + interval;
                    // Keeps JetStream from redelivering while the executor starts.
                    if let Err(e) = message.ack_with(AckKind::Progress).await {
                        tracing::warn!(%backend, assignment_id = %id, error = %e, "extending the ack deadline failed; a redelivery meanwhile is put back while this one works");
                    }
                }
            }
            if let Some((why, failure)) = self.executor_failure(id, record).await {
                // The failure and the claim exclude each other: a claim being recorded (or
                // recorded while the backend was read) wins, and this loop sees it land or
                // be rolled back; once expired, no runner can claim the task, so it is
                // never handed out while it is failed in Gitea and its executor deleted.
                if !self.dispatch.expire(id) {
                    continue;
                }
                return self.fail(assignment, why, &failure).await;
            }
        }
    }

    /// Looks at the executor while waiting for the claim: whether it has failed to start
    /// ([`decide::executor_failure`]); `None` while it may still claim, or when the
    /// backend cannot tell now.
    async fn executor_failure(
        &self,
        id: &AssignmentId,
        record: &ExecutorRecord,
    ) -> Option<(FailureReason, String)> {
        match self.backend.find(id).await {
            Ok(current) => decide::executor_failure(
                &Observed::from(record),
                current.as_ref().map(Observed::from).as_ref(),
                (self.clock)(),
                self.settings.start_deadline,
            ),
            Err(e) => {
                tracing::warn!(backend = %self.settings.backend, assignment_id = %id, error = %e, "looking at the executor failed; looking again later");
                None
            }
        }
    }

    /// Invariant 12: expire the offer (a claim in flight wins) and record the job as
    /// finished, so no redelivery or restarted controller offers it again; then report the
    /// failure; only once Gitea has it, mark terminal, release the slot and clean up. If
    /// Gitea does not take it, keep everything and put the delivery back, so the next one
    /// reports again.
    async fn fail(&self, assignment: &Assignment, why: FailureReason, reason: &str) -> Outcome {
        let backend = self.settings.backend;
        let id = assignment.id();
        // A claim being recorded, or recorded, wins: the runner has the job (invariant 12).
        if !self.dispatch.expire(id) {
            tracing::info!(%backend, assignment_id = %id, "the runner claimed the job before it could be failed; the next delivery hands it over");
            return Outcome::BackendError;
        }
        // The exclusion must outlive this process and this delivery before Gitea hears of
        // the failure: a redelivery or a restarted controller reads this record and never
        // offers the task again, whatever becomes of the clean-up below.
        if let Err(e) = self.dispatch.record_finished(id).await {
            tracing::warn!(%backend, assignment_id = %id, error = %e, "cannot record the failed assignment as finished; failing it with the next delivery");
            return Outcome::ReportPending;
        }
        tracing::error!(%backend, assignment_id = %id, event = "failing", failure = why.as_str(), reason, "the job failed before its runner claimed it; failing it in Gitea, then cleaning up");
        match self
            .gitea
            .report_failure(id.task_id(), reason, &REPORT_BACKOFF, REPORT_ATTEMPTS)
            .await
        {
            Ok(Reported::Accepted) => {
                if let Some(m) = &self.metrics {
                    m.job_failed(backend, why);
                }
                tracing::info!(%backend, assignment_id = %id, event = "terminal", result = "failure", failure = why.as_str(), "Gitea accepted the failure report");
            }
            Ok(Reported::TaskGone) => {
                tracing::warn!(%backend, assignment_id = %id, event = "terminal", "Gitea no longer has the task (cancelled or timed out there); cleaning up");
            }
            Err(e) => {
                tracing::error!(%backend, assignment_id = %id, error = %e, "Gitea did not take the failure report; keeping the executor and retrying with the next delivery");
                return Outcome::ReportPending;
            }
        }
        let marked = self.backend.mark_terminal(id).await;
        self.dispatch.forget(backend, id);
        match (self.backend.delete(id).await, marked) {
            (Ok(()), _) => {
                tracing::info!(%backend, assignment_id = %id, event = "cleaned", "failed executor deleted; its slot is free");
                Outcome::ExecutorFailed
            }
            // Terminal and never claimed: the lifecycle reconciler deletes it.
            (Err(e), Ok(())) => {
                tracing::warn!(%backend, assignment_id = %id, error = %e, "deleting the failed executor failed; the lifecycle reconciler retries");
                Outcome::ExecutorFailed
            }
            // Neither marked nor deleted: a redelivery finds the finished record and cleans
            // up (reporting again is harmless: Gitea keeps the first result).
            (Err(e), Err(mark)) => {
                tracing::warn!(%backend, assignment_id = %id, error = %e, mark_error = %mark, "cleaning up the failed executor failed; retrying with the next delivery");
                Outcome::BackendError
            }
        }
    }

    /// Time since `then` by the worker's clock (zero if the clock went backwards).
    fn elapsed_since(&self, then: SystemTime) -> Duration {
        (self.clock)().duration_since(then).unwrap_or_default()
    }

    /// Logs (and observes) that `id` took a slot.
    fn admitted(&self, message: &jetstream::Message, id: &AssignmentId) {
        let backend = self.settings.backend;
        let waited = self.queue_wait(message);
        tracing::info!(%backend, assignment_id = %id, event = "admitted", queue_wait = waited.map(tracing::field::debug), "admitted into the pool");
    }

    /// Fetched → admitted: from the moment JetStream stored the assignment (the fetch is
    /// milliseconds earlier, see the handoff window), read from the message itself so a
    /// restart does not reset it.
    fn queue_wait(&self, message: &jetstream::Message) -> Option<Duration> {
        let stored: SystemTime = message.info().ok()?.published.into();
        let waited = self.elapsed_since(stored);
        self.observe(|m| &m.queue_wait, waited);
        Some(waited)
    }

    fn observe(
        &self,
        family: impl Fn(
            &JobMetrics,
        ) -> &prometheus_client::metrics::family::Family<
            BackendLabel,
            prometheus_client::metrics::histogram::Histogram,
            fn() -> prometheus_client::metrics::histogram::Histogram,
        >,
        value: Duration,
    ) {
        if let Some(m) = &self.metrics {
            family(m)
                .get_or_create(&BackendLabel::of(self.settings.backend))
                .observe(value.as_secs_f64());
        }
    }

    fn spec(&self, assignment: &Assignment) -> ExecutorSpec {
        self.settings.spec(
            assignment,
            self.dispatch.capability_key().issue(assignment.id()),
        )
    }

    /// A create that answered with an error may still have stored the executor (the call
    /// timed out after the API server wrote the Pod, a step after the write failed): the
    /// backend is asked again, and the slot goes back only when it confirms that no
    /// executor exists (invariant 6: nothing runs beyond capacity). `Ok` is the executor
    /// the backend has after all, to go on with; `Err` the delivery's outcome.
    async fn after_create_error(
        &self,
        assignment: &Assignment,
        error: ExecutorError,
    ) -> Result<ExecutorRecord, Outcome> {
        let backend = self.settings.backend;
        let id = assignment.id();
        let permanent = matches!(error, ExecutorError::Permanent(_));
        let found = self.backend.find(id).await;
        let seen = found.as_ref().ok().map(Option::is_some);
        if let Err(find) = &found {
            tracing::warn!(%backend, assignment_id = %id, error = %error, find_error = %find, "creating the executor failed and the backend cannot tell whether it was stored; its slot is kept until a later look tells");
        }
        match (decide::after_create_error(permanent, seen), found) {
            (AfterCreateError::GoOn, Ok(Some(record))) => {
                tracing::warn!(%backend, assignment_id = %id, error = %error, event = "executor_created", executor = %record.name, "creating the executor answered with an error, but the backend has it: it keeps its slot and the job goes on with it");
                return Ok(record);
            }
            // Nothing was created, so the slot and the offer go back.
            (AfterCreateError::Release, _) => self.dispatch.forget(backend, id),
            (AfterCreateError::KeepAndRetry, _) => return Err(Outcome::BackendError),
            // Refused for good: failed below with the backend's reason; `fail` deletes the
            // executor and frees the slot once Gitea has the failure.
            (AfterCreateError::Keep | AfterCreateError::GoOn, _) => {}
        }
        Err(match error {
            ExecutorError::Full {
                retry_after,
                source,
            } => {
                tracing::info!(%backend, assignment_id = %id, event = "queued", reason = %source, ?retry_after, "the backend is full: the job stays queued in JetStream and is offered again later");
                if let Some(after) = retry_after {
                    self.retry_hints
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert(id.to_string(), after);
                }
                Outcome::Full
            }
            ExecutorError::Unavailable(cause) => {
                tracing::warn!(%backend, assignment_id = %id, error = %cause, retry_in = ?self.settings.error_delay, "creating the executor failed; the job stays queued and creation is retried");
                Outcome::BackendError
            }
            ExecutorError::Permanent(cause) => {
                let reason = format!(
                    "the {backend} backend refused to create the job's environment: {cause}"
                );
                self.fail(assignment, FailureReason::BackendRefused, &reason)
                    .await
            }
        })
    }
}
