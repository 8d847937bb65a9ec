//! Adapter: the JetStream handoff between the scheduler and the workers.
//!
//! Subjects `<base>.pod` / `<base>.vm`, one work-queue stream, one durable pull
//! consumer per backend (names `pod` / `vm`, as the Go version used). The message
//! ID is the assignment ID, so a retried publish of the same task is stored once.
//!
//! Two more things live beside them (DESIGN invariants 20, 21): `<base>.held.<backend>`
//! holds assignments sealed with a task key this controller lacks, so they take no
//! admission slot (see `crate::held`), and a key-value bucket records the assignments
//! that finished, so a replayed envelope never runs a job again.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use async_nats::jetstream::{self, consumer, kv, stream};
use futures::TryStreamExt;
use gdr_core::assignment::AssignmentId;
use gdr_core::backend::Backend;
use gdr_core::executor::{ExecutorError, WarmClaims};

/// Stream layout.
#[derive(Debug, Clone)]
pub struct StreamSettings {
    /// Stream name (default `CI_RUNNER`).
    pub stream: String,
    /// Subject base (default `ci.runner`).
    pub subject_base: String,
    /// Window in which a repeated message ID is dropped as a duplicate.
    pub duplicate_window: Duration,
}

impl StreamSettings {
    /// The subject of a backend's assignments.
    pub fn subject(&self, backend: Backend) -> String {
        format!("{}.{}", self.subject_base, backend.as_str())
    }

    /// The subject of a backend's held assignments (sealed with an unknown task key).
    pub fn held_subject(&self, backend: Backend) -> String {
        format!("{}.held.{}", self.subject_base, backend.as_str())
    }

    /// Every subject the stream must cover.
    pub fn subjects(&self) -> Vec<String> {
        [Backend::Pod, Backend::Vm]
            .into_iter()
            .flat_map(|b| [self.subject(b), self.held_subject(b)])
            .collect()
    }
}

pub use crate::ports::{QueueError, QueueErrorSource};

/// Creates the stream if missing, or makes an existing one cover every subject (a stream
/// of the Go version, or of an older release, lacks the held subjects).
pub async fn ensure_stream(
    js: &jetstream::Context,
    settings: &StreamSettings,
) -> Result<stream::Stream, QueueError> {
    let err = |e: QueueErrorSource| QueueError::Stream {
        stream: settings.stream.clone(),
        source: e,
    };
    let config = stream::Config {
        name: settings.stream.clone(),
        subjects: settings.subjects(),
        retention: stream::RetentionPolicy::WorkQueue,
        storage: stream::StorageType::File,
        duplicate_window: settings.duplicate_window,
        ..Default::default()
    };
    let mut stream = js
        .get_or_create_stream(config)
        .await
        .map_err(|e| err(e.into()))?;
    let existing = stream
        .info()
        .await
        .map_err(|e| err(e.into()))?
        .config
        .clone();
    let missing: Vec<String> = settings
        .subjects()
        .into_iter()
        .filter(|s| !existing.subjects.contains(s))
        .collect();
    if !missing.is_empty() {
        let mut config = existing;
        tracing::info!(stream = %settings.stream, subjects = ?missing, "adding subjects to the stream");
        config.subjects.extend(missing);
        js.update_stream(config).await.map_err(|e| err(e.into()))?;
        stream = js
            .get_stream(&settings.stream)
            .await
            .map_err(|e| err(e.into()))?;
    }
    Ok(stream)
}

/// Opens the stream an operator provisioned (least-privilege deployments).
pub async fn open_stream(
    js: &jetstream::Context,
    settings: &StreamSettings,
) -> Result<stream::Stream, QueueError> {
    js.get_stream(&settings.stream)
        .await
        .map_err(|e| QueueError::Stream {
            stream: settings.stream.clone(),
            source: e.into(),
        })
}

/// Per-backend consumer settings.
#[derive(Debug, Clone)]
pub struct ConsumerSettings {
    /// At most this many assignments are delivered and unacknowledged at once;
    /// bound to the backend capacity.
    pub max_ack_pending: i64,
    /// Redelivery after this long without an ack (or a progress signal).
    pub ack_wait: Duration,
    /// Deliveries before JetStream gives up on a message (-1: unlimited).
    pub max_deliver: i64,
}

/// Creates the durable pull consumer of one backend, or brings an existing one to
/// `consumer_settings` (JetStream keeps an existing consumer's configuration as it is, so
/// a capacity changed across a restart would otherwise never reach `max_ack_pending`).
pub async fn ensure_consumer(
    stream: &stream::Stream,
    settings: &StreamSettings,
    backend: Backend,
    consumer_settings: &ConsumerSettings,
) -> Result<consumer::PullConsumer, QueueError> {
    let name = backend.as_str().to_string();
    let err = |e: QueueErrorSource| QueueError::Consumer {
        consumer: name.clone(),
        source: e,
    };
    let wanted = consumer::pull::Config {
        durable_name: Some(name.clone()),
        filter_subject: settings.subject(backend),
        ack_policy: consumer::AckPolicy::Explicit,
        ack_wait: consumer_settings.ack_wait,
        max_deliver: consumer_settings.max_deliver,
        max_ack_pending: consumer_settings.max_ack_pending,
        ..Default::default()
    };
    let mut consumer: consumer::PullConsumer = stream
        .get_or_create_consumer(&name, wanted.clone())
        .await
        .map_err(|e| err(e.into()))?;
    let current = consumer
        .info()
        .await
        .map_err(|e| err(e.into()))?
        .config
        .clone();
    let differs = current.max_ack_pending != wanted.max_ack_pending
        || current.ack_wait != wanted.ack_wait
        || current.max_deliver != wanted.max_deliver
        || current.filter_subject != wanted.filter_subject
        || current.ack_policy != wanted.ack_policy;
    if differs {
        tracing::info!(
            consumer = %name,
            max_ack_pending = wanted.max_ack_pending,
            was = current.max_ack_pending,
            ack_wait = ?wanted.ack_wait,
            "updating the worker consumer to the configured settings"
        );
        consumer = stream
            .update_consumer(wanted)
            .await
            .map_err(|e| err(e.into()))?;
    }
    Ok(consumer)
}

/// Opens the durable consumer of one backend that an operator provisioned.
pub async fn open_consumer(
    stream: &stream::Stream,
    backend: Backend,
) -> Result<consumer::PullConsumer, QueueError> {
    let name = backend.as_str().to_owned();
    stream
        .get_consumer(&name)
        .await
        .map_err(|e| QueueError::Consumer {
            consumer: name,
            source: e,
        })
}

/// The outcome of a publish JetStream acknowledged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Published {
    /// Stream sequence of the stored message.
    pub sequence: u64,
    /// JetStream had this message ID already: nothing new was stored, which
    /// counts as success for a retried publish.
    pub duplicate: bool,
}

/// Publishes an assignment with its ID as the JetStream message ID and waits
/// for the stream's acknowledgement.
pub async fn publish(
    js: &jetstream::Context,
    settings: &StreamSettings,
    backend: Backend,
    assignment_id: &str,
    payload: bytes::Bytes,
) -> Result<Published, QueueError> {
    let subject = settings.subject(backend);
    let err = |e: QueueErrorSource| QueueError::Publish {
        id: assignment_id.to_string(),
        subject: subject.clone(),
        source: e,
    };
    let size = payload.len();
    let message = jetstream::message::PublishMessage::build()
        .payload(payload)
        .message_id(assignment_id);
    let ack = js
        .send_publish(subject.clone(), message)
        .await
        .map_err(|e| match e.kind() {
            jetstream::context::PublishErrorKind::MaxPayloadExceeded => QueueError::TooLarge {
                id: assignment_id.to_string(),
                subject: subject.clone(),
                size,
                source: e.into(),
            },
            _ => err(e.into()),
        })?;
    crate::failpoint::hit(crate::failpoint::points::PUBLISH_SENT);
    let ack = ack.await.map_err(|e| err(e.into()))?;
    Ok(Published {
        sequence: ack.sequence,
        duplicate: ack.duplicate,
    })
}

/// Unclaimed assignments per backend: the messages on each backend's own subject (held
/// ones, and those of a backend not in this stream, are not counted).
pub async fn unclaimed_per_backend(
    stream: &stream::Stream,
    settings: &StreamSettings,
) -> Result<BTreeMap<Backend, u64>, QueueError> {
    counts_per_backend(
        stream,
        settings,
        format!("{}.*", settings.subject_base),
        StreamSettings::subject,
    )
    .await
}

/// Held assignments per backend (sealed with a task key this controller lacks).
pub async fn held_per_backend(
    stream: &stream::Stream,
    settings: &StreamSettings,
) -> Result<BTreeMap<Backend, u64>, QueueError> {
    counts_per_backend(
        stream,
        settings,
        format!("{}.held.*", settings.subject_base),
        StreamSettings::held_subject,
    )
    .await
}

async fn counts_per_backend(
    stream: &stream::Stream,
    settings: &StreamSettings,
    filter: String,
    subject_of: fn(&StreamSettings, Backend) -> String,
) -> Result<BTreeMap<Backend, u64>, QueueError> {
    let err = |e: QueueErrorSource| QueueError::Stream {
        stream: settings.stream.clone(),
        source: e,
    };
    let wanted: BTreeMap<String, Backend> = [Backend::Pod, Backend::Vm]
        .into_iter()
        .map(|b| (subject_of(settings, b), b))
        .collect();
    let mut counts = BTreeMap::new();
    let mut subjects = stream
        .info_with_subjects(filter)
        .await
        .map_err(|e| err(e.into()))?;
    while let Some((subject, count)) = subjects.try_next().await.map_err(|e| err(e.into()))? {
        if let Some(backend) = wanted.get(&subject) {
            counts.insert(*backend, u64::try_from(count).unwrap_or(u64::MAX));
        }
    }
    Ok(counts)
}

/// Messages in the stream: with work-queue retention this is the number of
/// assignments not yet acknowledged (i.e. not claimed by an executor).
pub async fn unclaimed(stream: &mut stream::Stream) -> Result<u64, QueueError> {
    let name = stream.cached_info().config.name.clone();
    stream
        .info()
        .await
        .map(|i| i.state.messages)
        .map_err(|e| QueueError::Stream {
            stream: name,
            source: e.into(),
        })
}

/// The queue depth of each backend, from its durable consumer's info.
pub struct ConsumerDepth {
    stream: stream::Stream,
}

impl ConsumerDepth {
    /// Reads the consumers of the stream `settings` names.
    pub async fn open(
        js: &jetstream::Context,
        settings: &StreamSettings,
    ) -> Result<Self, QueueError> {
        Ok(ConsumerDepth {
            stream: open_stream(js, settings).await?,
        })
    }
}

#[async_trait::async_trait]
impl crate::ports::QueueDepth for ConsumerDepth {
    async fn unclaimed(&self, backend: Backend) -> Result<u64, QueueError> {
        let name = backend.as_str();
        let info = self
            .stream
            .consumer_info(name)
            .await
            .map_err(|e| QueueError::Consumer {
                consumer: name.to_owned(),
                source: e.into(),
            })?;
        // Not yet delivered, plus delivered and not yet acknowledged (the worker holds it,
        // or it waits for redelivery after a NAK): every assignment not yet claimed.
        Ok(info
            .num_pending
            .saturating_add(u64::try_from(info.num_ack_pending).unwrap_or(u64::MAX)))
    }
}

/// One message waiting in the stream.
#[derive(Debug, Clone)]
pub struct Queued {
    /// Its stream sequence.
    pub sequence: u64,
    /// Its subject (`<base>.pod` / `<base>.vm`, or a held subject).
    pub subject: String,
    /// When JetStream stored it.
    pub published: SystemTime,
    /// The envelope.
    pub payload: bytes::Bytes,
}

/// How much one [`QueuedReader`] reads: messages per page (one page is what a caller holds
/// at once) and in all. Anyone who can publish can fill the stream, so no reader loads it
/// whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadLimits {
    /// Messages per page (at least 1).
    pub page: usize,
    /// Messages per reader; the rest is left unread and counted.
    pub max: usize,
}

impl ReadLimits {
    /// 256 per page, 4096 per reader: far above the backlog limits, which bound what the
    /// controller itself queues.
    pub const DEFAULT: ReadLimits = ReadLimits {
        page: 256,
        max: 4096,
    };
}

/// Reads the messages on `subjects` (a subject or wildcard) that `stream` held when it was
/// opened (its cached info), page by page, without consuming them. With work-queue
/// retention these are the assignments not claimed yet (and those whose claim has not been
/// acknowledged), and held ones.
pub struct QueuedReader<'a> {
    stream: &'a stream::Stream,
    subjects: String,
    limits: ReadLimits,
    start: u64,
    next: u64,
    last: u64,
    messages: u64,
    read: usize,
    reached_end: bool,
    capped: bool,
    /// An error after part of a page was read: that part is returned first.
    error: Option<QueueError>,
}

impl<'a> QueuedReader<'a> {
    /// A reader from the first message of the snapshot.
    pub fn new(stream: &'a stream::Stream, subjects: &str, limits: ReadLimits) -> Self {
        let state = &stream.cached_info().state;
        QueuedReader {
            stream,
            subjects: subjects.to_owned(),
            limits: ReadLimits {
                page: limits.page.max(1),
                max: limits.max,
            },
            // Everything before the first sequence is gone as well.
            start: 0,
            next: state.first_sequence,
            last: state.last_sequence,
            messages: state.messages,
            read: 0,
            reached_end: state.messages == 0,
            capped: false,
            error: None,
        }
    }

    /// Starts at `sequence` instead (where an earlier reader stopped at its cap).
    #[must_use]
    pub fn starting_at(mut self, sequence: u64) -> Self {
        if sequence > self.next {
            self.next = sequence;
            self.start = sequence;
        }
        self
    }

    /// The next page; `None` once the snapshot's end or the cap is reached.
    pub async fn next_page(&mut self) -> Result<Option<Vec<Queued>>, QueueError> {
        use async_nats::jetstream::stream::LastRawMessageErrorKind;
        if let Some(e) = self.error.take() {
            return Err(e);
        }
        let mut page = Vec::new();
        while page.len() < self.limits.page && !self.reached_end && !self.capped {
            if self.read >= self.limits.max {
                self.capped = true;
                break;
            }
            if self.next > self.last {
                self.reached_end = true;
                break;
            }
            let message = match self
                .stream
                .get_first_raw_message_by_subject(&self.subjects, self.next)
                .await
            {
                Ok(m) => m,
                Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => {
                    self.reached_end = true;
                    break;
                }
                Err(e) => {
                    let e = QueueError::Stream {
                        stream: self.stream.cached_info().config.name.clone(),
                        source: e.into(),
                    };
                    if page.is_empty() {
                        return Err(e);
                    }
                    self.error = Some(e);
                    break;
                }
            };
            // Only messages present at the snapshot; later ones are the next reader's.
            if message.sequence > self.last {
                self.reached_end = true;
                break;
            }
            self.next = message.sequence + 1;
            self.read += 1;
            page.push(Queued {
                sequence: message.sequence,
                subject: message.subject.to_string(),
                published: SystemTime::UNIX_EPOCH
                    + Duration::from_nanos(
                        u64::try_from(message.time.unix_timestamp_nanos()).unwrap_or(0),
                    ),
                payload: message.payload,
            });
        }
        Ok((!page.is_empty()).then_some(page))
    }

    /// The first sequence not looked at yet.
    pub fn position(&self) -> u64 {
        self.next
    }

    /// The sequences looked at completely so far: a message of the snapshot in this range
    /// that no page returned is gone from the stream.
    pub fn covered(&self) -> std::ops::Range<u64> {
        let end = if self.reached_end {
            self.last.saturating_add(1).max(self.start)
        } else {
            self.next
        };
        self.start..end
    }

    /// Whether the reader stopped at its cap with messages left.
    pub fn capped(&self) -> bool {
        self.capped && !self.reached_end
    }

    /// Messages read so far.
    pub fn read(&self) -> usize {
        self.read
    }

    /// At most this many messages of the snapshot were not read (the stream's count, which
    /// also holds the subjects outside this reader's filter, minus those read).
    pub fn unread(&self) -> u64 {
        self.messages
            .saturating_sub(u64::try_from(self.read).unwrap_or(u64::MAX))
    }
}

// === finished assignments ===

/// The JetStream key-value bucket of finished assignment IDs (DESIGN invariant 20). An
/// entry lives `ttl`: at least Gitea's endless-task timeout, after which an envelope of
/// the assignment is refused as too old anyway.
///
/// An ID whose entry could not be written (NATS away) is kept in memory, shared by every
/// clone, until a later [`FinishedAssignments::record`], [`FinishedAssignments::contains`]
/// or [`FinishedAssignments::save_unsaved`] writes it: meanwhile this process already
/// counts it as finished, so a delivery that arrives when NATS is back before the write
/// starts nothing.
#[derive(Clone)]
pub struct FinishedAssignments {
    store: kv::Store,
    bucket: String,
    unsaved: Arc<Mutex<BTreeSet<AssignmentId>>>,
}

impl std::fmt::Debug for FinishedAssignments {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FinishedAssignments")
            .field("bucket", &self.bucket)
            .finish_non_exhaustive()
    }
}

impl FinishedAssignments {
    /// Creates the bucket (or brings its TTL to `ttl`) when `create`, else opens the one
    /// an operator provisioned.
    pub async fn open(
        js: &jetstream::Context,
        bucket: &str,
        ttl: Duration,
        create: bool,
    ) -> Result<Self, QueueError> {
        let err = |e: QueueErrorSource| QueueError::Finished {
            bucket: bucket.to_owned(),
            source: e,
        };
        let store = if create {
            js.create_or_update_key_value(kv::Config {
                bucket: bucket.to_owned(),
                description: "assignments that finished: never run again".into(),
                history: 1,
                max_age: ttl,
                storage: stream::StorageType::File,
                ..Default::default()
            })
            .await
            .map_err(|e| err(e.into()))?
        } else {
            js.get_key_value(bucket).await.map_err(|e| err(e.into()))?
        };
        Ok(FinishedAssignments {
            store,
            bucket: bucket.to_owned(),
            unsaved: Arc::default(),
        })
    }

    fn unsaved(&self) -> std::sync::MutexGuard<'_, BTreeSet<AssignmentId>> {
        // Plain data, updated in single steps: a poisoned lock holds a consistent set.
        self.unsaved.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn err(&self, e: QueueErrorSource) -> QueueError {
        QueueError::Finished {
            bucket: self.bucket.clone(),
            source: e,
        }
    }

    /// Records that `id` finished (idempotent). On an error the ID is kept unsaved (see
    /// the type) and the caller still learns that it is not durable yet.
    pub async fn record(&self, id: &AssignmentId) -> Result<(), QueueError> {
        let now = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs();
        match self.store.put(id.as_str(), now.to_string().into()).await {
            Ok(_) => {
                self.unsaved().remove(id);
                Ok(())
            }
            Err(e) => {
                self.unsaved().insert(id.clone());
                Err(self.err(e.into()))
            }
        }
    }

    /// Whether `id` finished (within the bucket's TTL, or unsaved in this process).
    pub async fn contains(&self, id: &AssignmentId) -> Result<bool, QueueError> {
        let unsaved = self.unsaved().contains(id);
        if unsaved {
            // Written now if NATS is back; finished either way.
            let _ = self.record(id).await;
            return Ok(true);
        }
        self.store
            .get(id.as_str())
            .await
            .map(|v| v.is_some())
            .map_err(|e| self.err(e.into()))
    }

    /// Counts `id` as finished in this process at once, and leaves the write to
    /// [`FinishedAssignments::save_unsaved`] (for callers that must not wait for NATS).
    pub fn remember(&self, id: &AssignmentId) {
        self.unsaved().insert(id.clone());
    }

    /// Writes the unsaved IDs; returns how many are still unsaved.
    pub async fn save_unsaved(&self) -> usize {
        let ids: Vec<AssignmentId> = self.unsaved().iter().cloned().collect();
        for id in ids {
            if self.record(&id).await.is_err() {
                break;
            }
        }
        self.unsaved().len()
    }
}

#[async_trait::async_trait]
impl crate::ports::FinishedLog for FinishedAssignments {
    async fn record(&self, id: &AssignmentId) -> Result<(), QueueError> {
        FinishedAssignments::record(self, id).await
    }

    async fn contains(&self, id: &AssignmentId) -> Result<bool, QueueError> {
        FinishedAssignments::contains(self, id).await
    }

    fn remember(&self, id: &AssignmentId) {
        FinishedAssignments::remember(self, id);
    }

    async fn save_unsaved(&self) -> usize {
        FinishedAssignments::save_unsaved(self).await
    }
}

/// Key prefix of the warm claims in the finished-assignments bucket: a sandbox ID after
/// it; an assignment ID (the finished records' keys) never starts with it.
pub const WARM_CLAIM_PREFIX: &str = "warm-claim.";

/// The VM warm pool's arbiter ([`WarmClaims`], issue 39 item 5): which assignment claimed
/// a warm sandbox, as one entry of the finished-assignments bucket per sandbox
/// (`warm-claim.<sandbox ID>` = the assignment ID), so no other bucket, setting or
/// permission is needed. The first writer creates it (`kv.create` fails for every later
/// one), whatever replica or worker it is: one sandbox never serves two jobs (DESIGN
/// invariant 8). Entries age out with the bucket's TTL, long after their sandbox is gone.
#[derive(Clone)]
pub struct KvWarmClaims {
    store: kv::Store,
    bucket: String,
}

impl std::fmt::Debug for KvWarmClaims {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvWarmClaims")
            .field("bucket", &self.bucket)
            .finish_non_exhaustive()
    }
}

impl KvWarmClaims {
    fn key(member: &str) -> String {
        format!("{WARM_CLAIM_PREFIX}{member}")
    }

    fn err(&self, e: QueueErrorSource) -> ExecutorError {
        // NATS unreachable or refusing: the claim is retried with the create.
        ExecutorError::unavailable(QueueError::Finished {
            bucket: self.bucket.clone(),
            source: e,
        })
    }
}

impl FinishedAssignments {
    /// The warm claims kept in this bucket.
    pub fn warm_claims(&self) -> KvWarmClaims {
        KvWarmClaims {
            store: self.store.clone(),
            bucket: self.bucket.clone(),
        }
    }
}

#[async_trait::async_trait]
impl WarmClaims for KvWarmClaims {
    async fn claim(&self, member: &str, by: &AssignmentId) -> Result<bool, ExecutorError> {
        let key = Self::key(member);
        match self.store.create(&key, by.as_str().to_owned().into()).await {
            Ok(_) => Ok(true),
            Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => {
                // Ours from an earlier attempt of this job, or another job's.
                let held = self.store.get(&key).await.map_err(|e| self.err(e.into()))?;
                Ok(held.is_some_and(|v| v.as_ref() == by.as_str().as_bytes()))
            }
            Err(e) => Err(self.err(e.into())),
        }
    }

    async fn held_since(&self, member: &str) -> Result<Option<SystemTime>, ExecutorError> {
        let entry = self
            .store
            .entry(Self::key(member))
            .await
            .map_err(|e| self.err(e.into()))?;
        Ok(entry
            .filter(|e| e.operation == kv::Operation::Put)
            .map(|e| SystemTime::from(e.created)))
    }
}

// === assignments still queued ===

/// The assignments of one backend that still have a message in the stream: on the
/// backend's subject (a worker delivers them) or on its held subject (the held reconciler
/// releases or fails them). The lifecycle reconciler asks before it fails an unclaimed
/// executor whose start deadline has passed: while its message is there, the worker
/// that delivers it fails it, and only one of the two may report.
///
/// Anyone who can publish can fill the stream (invariant 21), so it reads page by page
/// and at most [`ReadLimits::max`] messages per subject (beyond, it cannot tell, and says
/// so), and counts a message only under an ID it can trust: one whose `id_mac` verifies
/// under the envelope-ID key, or any readable ID where envelopes carry none (no task key,
/// or plaintext accepted).
pub struct StreamQueue {
    js: jetstream::Context,
    settings: StreamSettings,
    backend: Backend,
    limits: ReadLimits,
    id_key: Option<gdr_core::capability::EnvelopeIdKey>,
    trust_unauthenticated: bool,
}

impl StreamQueue {
    /// Reads `backend`'s subjects of the stream `settings` names, trusting every readable
    /// ID until [`Self::authenticated_by`] says otherwise.
    pub fn new(js: jetstream::Context, settings: StreamSettings, backend: Backend) -> Self {
        StreamQueue {
            js,
            settings,
            backend,
            limits: ReadLimits::DEFAULT,
            id_key: None,
            trust_unauthenticated: true,
        }
    }

    /// Reads at most `limits` per subject.
    #[must_use]
    pub fn with_limits(mut self, limits: ReadLimits) -> Self {
        self.limits = limits;
        self
    }

    /// Counts IDs whose `id_mac` verifies under `key`, and unauthenticated ones only when
    /// `trust_unauthenticated` (the workers run such envelopes too).
    #[must_use]
    pub fn authenticated_by(
        mut self,
        key: gdr_core::capability::EnvelopeIdKey,
        trust_unauthenticated: bool,
    ) -> Self {
        self.id_key = Some(key);
        self.trust_unauthenticated = trust_unauthenticated;
        self
    }
}

/// The assignment a queued message counts for: its authenticated ID, else (where
/// unauthenticated envelopes are trusted) its readable one.
fn trusted_id(
    payload: &[u8],
    key: Option<&gdr_core::capability::EnvelopeIdKey>,
    trust_unauthenticated: bool,
) -> Option<AssignmentId> {
    if let Some(a) = key.and_then(|k| gdr_core::assignment::authenticated_id(payload, k)) {
        return Some(a.id().clone());
    }
    trust_unauthenticated
        .then(|| gdr_core::assignment::envelope_id(payload))
        .flatten()
}

#[async_trait::async_trait]
impl crate::ports::QueuedAssignments for StreamQueue {
    async fn queued(
        &self,
        ids: &std::collections::HashSet<AssignmentId>,
    ) -> Result<std::collections::HashSet<AssignmentId>, QueueError> {
        let mut found = std::collections::HashSet::new();
        if ids.is_empty() {
            return Ok(found);
        }
        let mut stream = open_stream(&self.js, &self.settings).await?;
        stream.info().await.map_err(|e| QueueError::Stream {
            stream: self.settings.stream.clone(),
            source: e.into(),
        })?;
        for subject in [
            self.settings.subject(self.backend),
            self.settings.held_subject(self.backend),
        ] {
            // Messages present now; one published later is a later pass's to see.
            let mut reader = QueuedReader::new(&stream, &subject, self.limits);
            while found.len() < ids.len() {
                let Some(page) = reader.next_page().await? else {
                    break;
                };
                found.extend(page.iter().filter_map(|m| {
                    trusted_id(&m.payload, self.id_key.as_ref(), self.trust_unauthenticated)
                        .filter(|id| ids.contains(id))
                }));
            }
            // Unread messages may hold the rest: nobody may conclude they are gone.
            if found.len() < ids.len() && reader.capped() {
                return Err(QueueError::Stream {
                    stream: self.settings.stream.clone(),
                    source: format!(
                        "more than {} messages on {subject}; cannot tell which assignments are still queued",
                        self.limits.max
                    )
                    .into(),
                });
            }
        }
        Ok(found)
    }
}
