//! Held assignments (DESIGN invariant 21): envelopes sealed with a task key this controller
//! does not have. A worker moves them to `<base>.held.<backend>` so they never occupy an
//! admission slot (a consumer's `max_ack_pending` is the backend's capacity: `capacity`
//! such messages NAKed forever would stop the backend for good).
//!
//! This reconciler looks at them every interval with its own durable consumer, one message
//! at a time:
//! - once the key is configured (the controller restarted with it), the envelope is
//!   published again to its backend's subject and runs normally;
//! - after `timeout`, if its `id_mac` verifies (our scheduler wrote that assignment ID;
//!   the task itself stays unreadable) and it is not older than a task may live, it is
//!   failed in Gitea with the reason, recorded as finished and dropped. One report attempt
//!   per message and look; a report Gitea did not take is tried again a minute later;
//! - after `timeout` without a valid `id_mac` (anyone able to publish can name any ID, also
//!   a task Gitea hands out later) it is dropped without touching Gitea or the finished
//!   record: if a real task had that ID, Gitea's own zombie and endless-task timeouts end
//!   it, and an envelope of a task Gitea has not handed out yet cannot silence it;
//! - meanwhile it stays in the stream, where the heartbeater keeps its task alive (only if
//!   its `id_mac` verifies).
//!
//! The number held per backend is exported as a metric and logged.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_nats::jetstream::consumer::{AckPolicy, PullConsumer, pull};
use async_nats::jetstream::{self, AckKind};
use futures::StreamExt;
use gdr_core::assignment::{
    Assignment, AssignmentId, DerivationPolicy, EnvelopeError, EnvelopeRules, TaskKeyring,
    authenticated_id, decode_with, envelope_id,
};
use gdr_core::backend::Backend;
use gdr_core::capability::EnvelopeIdKey;

use crate::backoff::Backoff;
use crate::dispatch::Dispatch;
use crate::queue::{self, QueueError, QueueErrorSource, StreamSettings};
use crate::shutdown::Shutdown;
use gdr_gitea::{GiteaClient, Reported};

/// Durable name of the held consumer.
pub const CONSUMER: &str = "held";
/// Messages looked at per round.
const BATCH: usize = 256;
/// A failure report: one attempt per message and look, so the cost is bounded by the
/// messages, never multiplied by retries; a report Gitea did not take is looked at again
/// after [`REPORT_RETRY`].
const REPORT_BACKOFF: Backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(2));
const REPORT_ATTEMPTS: u32 = 1;
/// When a failure report Gitea did not take is tried again (the heartbeat interval's default).
const REPORT_RETRY: Duration = Duration::from_secs(60);

/// What one round did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Round {
    /// Held per backend at the start of the round.
    pub held: BTreeMap<Backend, u64>,
    /// Published again to their backend (their key is known now).
    pub released: usize,
    /// Failed in Gitea after the timeout.
    pub failed: usize,
    /// Still waiting for their key.
    pub waiting: usize,
    /// Not envelopes at all (dropped).
    pub dropped: usize,
    /// Past the timeout without a valid `id_mac`: dropped, nothing told to Gitea.
    pub unauthenticated: usize,
    /// Past the timeout and older than a task may live: dropped, Gitea ended the task.
    pub expired: usize,
}

/// The held-assignments reconciler.
pub struct HeldAssignments {
    js: jetstream::Context,
    stream: StreamSettings,
    policy: DerivationPolicy,
    keyring: Option<TaskKeyring>,
    gitea: GiteaClient,
    dispatch: Arc<Dispatch>,
    timeout: Duration,
    id_key: Option<EnvelopeIdKey>,
    task_lifetime: Duration,
}

impl HeldAssignments {
    /// A reconciler failing held assignments in Gitea after `timeout`.
    pub fn new(
        js: jetstream::Context,
        stream: StreamSettings,
        policy: DerivationPolicy,
        keyring: Option<TaskKeyring>,
        gitea: GiteaClient,
        dispatch: Arc<Dispatch>,
        timeout: Duration,
    ) -> Self {
        HeldAssignments {
            js,
            stream,
            policy,
            keyring,
            gitea,
            dispatch,
            timeout,
            id_key: None,
            task_lifetime: Duration::MAX,
        }
    }

    /// Authenticates the assignment IDs of held envelopes with `key` (the scheduler's
    /// [`gdr_core::capability::CapabilityKey::envelope_id_key`]); without it no held
    /// envelope is ever failed in Gitea, only dropped after the timeout.
    #[must_use]
    pub fn with_envelope_id_key(mut self, key: EnvelopeIdKey) -> Self {
        self.id_key = Some(key);
        self
    }

    /// Drops, without failing it in Gitea, a held envelope fetched longer ago than
    /// `lifetime` (Gitea's endless-task timeout: Gitea has ended its task).
    #[must_use]
    pub fn with_task_lifetime(mut self, lifetime: Duration) -> Self {
        self.task_lifetime = lifetime;
        self
    }

    /// The durable consumer of the held subjects, created (or brought to its settings) when
    /// `create`, else the one an operator provisioned.
    pub async fn consumer(
        &self,
        create: bool,
        ack_wait: Duration,
    ) -> Result<PullConsumer, QueueError> {
        let stream = queue::open_stream(&self.js, &self.stream).await?;
        let err = |e: QueueErrorSource| QueueError::Consumer {
            consumer: CONSUMER.into(),
            source: e,
        };
        if !create {
            return stream.get_consumer(CONSUMER).await.map_err(err);
        }
        let config = pull::Config {
            durable_name: Some(CONSUMER.into()),
            filter_subject: format!("{}.held.>", self.stream.subject_base),
            ack_policy: AckPolicy::Explicit,
            ack_wait,
            max_deliver: -1,
            ..Default::default()
        };
        stream
            .get_or_create_consumer(CONSUMER, config)
            .await
            .map_err(|e| err(e.into()))
    }

    /// Rounds every `interval` until `shutdown`.
    pub async fn run(
        self,
        consumer: PullConsumer,
        interval: Duration,
        shutdown: Shutdown,
        metrics: Option<Arc<crate::job_metrics::JobMetrics>>,
    ) {
        loop {
            match self.round(&consumer, interval).await {
                Ok(round) => {
                    if let Some(m) = &metrics {
                        for backend in [Backend::Pod, Backend::Vm] {
                            let n = round.held.get(&backend).copied().unwrap_or(0);
                            m.held_assignments
                                .get_or_create(&crate::metrics::BackendLabel {
                                    backend: backend.as_str().into(),
                                })
                                .set(i64::try_from(n).unwrap_or(i64::MAX));
                        }
                    }
                    if round.held.values().any(|n| *n > 0) {
                        tracing::warn!(
                            held = ?round.held,
                            released = round.released,
                            failed = round.failed,
                            unauthenticated = round.unauthenticated,
                            expired = round.expired,
                            "assignments sealed with a task key this controller does not have are held"
                        );
                    }
                }
                Err(e) => tracing::warn!(error = %e, "cannot look at held assignments; retrying"),
            }
            if !shutdown.sleep(interval).await {
                return;
            }
        }
    }

    /// One round over the held messages now.
    pub async fn round(
        &self,
        consumer: &PullConsumer,
        interval: Duration,
    ) -> Result<Round, QueueError> {
        let stream = queue::open_stream(&self.js, &self.stream).await?;
        let mut round = Round {
            held: queue::held_per_backend(&stream, &self.stream).await?,
            ..Round::default()
        };
        if round.held.values().all(|n| *n == 0) {
            return Ok(round);
        }
        let consumer_err = |e: QueueErrorSource| QueueError::Consumer {
            consumer: CONSUMER.into(),
            source: e,
        };
        let mut batch = consumer
            .fetch()
            .max_messages(BATCH)
            .expires(Duration::from_secs(1))
            .messages()
            .await
            .map_err(|e| consumer_err(e.into()))?;
        while let Some(message) = batch.next().await {
            let message = message.map_err(consumer_err)?;
            let settle = self.settle(&message, interval, &mut round).await;
            if let Err(e) = message.ack_with(settle).await {
                tracing::warn!(error = %e, "settling a held assignment failed; it comes back");
            }
        }
        Ok(round)
    }

    async fn settle(
        &self,
        message: &jetstream::Message,
        interval: Duration,
        round: &mut Round,
    ) -> AckKind {
        // The worker applies the real rules once the assignment is back on its subject.
        let rules = EnvelopeRules::permissive();
        let id = envelope_id(&message.payload);
        match decode_with(
            &message.payload,
            &self.policy,
            self.keyring.as_ref(),
            &rules,
        ) {
            Ok(assignment) => self.release(message, &assignment, interval, round).await,
            Err(e @ (EnvelopeError::UnknownKey(_) | EnvelopeError::NoKeyring)) => {
                let Some(id) = id else {
                    round.dropped += 1;
                    return AckKind::Term;
                };
                self.still_held(message, &id, &e, interval, round).await
            }
            // Not something a worker could ever run: drop it (the worker would too).
            Err(e) => {
                tracing::error!(assignment_id = ?id.map(|i| i.to_string()), error = %e, "dropping an undecodable held message");
                round.dropped += 1;
                AckKind::Term
            }
        }
    }

    /// Its task key is known now: publishes it again to its backend's subject.
    async fn release(
        &self,
        message: &jetstream::Message,
        assignment: &Assignment,
        interval: Duration,
        round: &mut Round,
    ) -> AckKind {
        let sequence = message
            .info()
            .map(|i| i.stream_sequence)
            .unwrap_or_default();
        let publish = jetstream::message::PublishMessage::build()
            .payload(message.payload.clone())
            // Not the assignment ID: within the duplicate window of the original
            // publish JetStream would drop it. Unique per held copy, so a retried
            // release is stored once.
            .message_id(format!("released-{}-{sequence}", assignment.id()));
        let subject = self.stream.subject(assignment.backend());
        match async { self.js.send_publish(subject, publish).await?.await }.await {
            Ok(_) => {
                round.released += 1;
                tracing::info!(assignment_id = %assignment.id(), "a held assignment's task key is configured now; released to its backend");
                AckKind::Ack
            }
            Err(e) => {
                tracing::warn!(assignment_id = %assignment.id(), error = %e, "releasing a held assignment failed; retrying");
                AckKind::Nak(Some(interval))
            }
        }
    }

    /// Its task key is still unknown (`error`): it waits until the timeout, then is dropped
    /// or failed in Gitea.
    async fn still_held(
        &self,
        message: &jetstream::Message,
        id: &AssignmentId,
        error: &EnvelopeError,
        interval: Duration,
        round: &mut Round,
    ) -> AckKind {
        let held_for = held_for(message);
        if held_for < self.timeout {
            round.waiting += 1;
            return AckKind::Nak(Some(interval));
        }
        // Only an ID our own scheduler wrote may be failed or recorded: otherwise a
        // publisher could pre-forge the IDs Gitea hands out next.
        let Some(authenticated) = self
            .id_key
            .as_ref()
            .and_then(|k| authenticated_id(&message.payload, k))
            .filter(|a| a.id() == id)
        else {
            tracing::warn!(assignment_id = %id, "dropping a held assignment whose ID is not authenticated (no valid id_mac: a forgery, or written by an older release); nothing is failed in Gitea or recorded, and Gitea's own timeouts end its task if it exists");
            round.unauthenticated += 1;
            return AckKind::Term;
        };
        let lifetime = EnvelopeRules {
            accept_plaintext: true,
            max_age: self.task_lifetime,
            accept_undated: false,
            now: SystemTime::now(),
        };
        if let Err(e) = authenticated.check_age(&lifetime) {
            tracing::warn!(assignment_id = %id, error = %e, "dropping a held assignment outside its task's lifetime; Gitea has ended that task");
            round.expired += 1;
            return AckKind::Term;
        }
        let reason = format!(
            "the job's queued assignment cannot be opened: {error}; it was held for {} waiting for that key (configure it in task_encryption_previous_key_files)",
            humantime_serde::re::humantime::format_duration(Duration::from_secs(
                held_for.as_secs()
            ))
        );
        tracing::error!(assignment_id = %id, %reason, "failing a held assignment in Gitea");
        self.fail(id, &reason, interval, round).await
    }

    /// Fails its task in Gitea (one attempt) and records it as finished.
    async fn fail(
        &self,
        id: &AssignmentId,
        reason: &str,
        interval: Duration,
        round: &mut Round,
    ) -> AckKind {
        match self
            .gitea
            .report_failure(id.task_id(), reason, &REPORT_BACKOFF, REPORT_ATTEMPTS)
            .await
        {
            Ok(Reported::Accepted | Reported::TaskGone) => {
                if let Err(e) = self.dispatch.record_finished(id).await {
                    tracing::warn!(assignment_id = %id, error = %e, "recording the failed held assignment failed; retrying");
                    return AckKind::Nak(Some(interval));
                }
                round.failed += 1;
                AckKind::Term
            }
            Err(e) => {
                tracing::warn!(assignment_id = %id, error = %e, retry_in = ?REPORT_RETRY, "Gitea did not take the failure of a held assignment; retrying");
                AckKind::Nak(Some(REPORT_RETRY.max(interval)))
            }
        }
    }
}

/// How long ago the message was published (zero if its metadata says nothing usable).
fn held_for(message: &jetstream::Message) -> Duration {
    message
        .info()
        .ok()
        .and_then(|i| {
            let published = SystemTime::UNIX_EPOCH
                + Duration::from_nanos(
                    u64::try_from(i.published.unix_timestamp_nanos()).unwrap_or(0),
                );
            SystemTime::now().duration_since(published).ok()
        })
        .unwrap_or_default()
}
