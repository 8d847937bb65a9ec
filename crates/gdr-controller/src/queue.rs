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

use std::collections::BTreeMap;
use std::time::Duration;

use async_nats::jetstream::{self, consumer, kv, stream};
use futures::TryStreamExt;
use gdr_core::assignment::AssignmentId;
use gdr_core::backend::Backend;

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

/// Why a queue operation failed.
#[derive(Debug, thiserror::Error)]
pub enum QueueError {
    /// The stream could not be created or read.
    #[error("JetStream stream {stream}: {message}")]
    Stream {
        /// Stream name.
        stream: String,
        /// Cause.
        message: String,
    },
    /// The consumer could not be created or read.
    #[error("JetStream consumer {consumer}: {message}")]
    Consumer {
        /// Durable name.
        consumer: String,
        /// Cause.
        message: String,
    },
    /// JetStream did not acknowledge a publish.
    #[error("publishing {id} to {subject}: {message}")]
    Publish {
        /// Assignment ID.
        id: String,
        /// Subject.
        subject: String,
        /// Cause.
        message: String,
    },
    /// The finished-assignments bucket could not be created, read or written.
    #[error("JetStream key-value bucket {bucket}: {message}")]
    Finished {
        /// Bucket name.
        bucket: String,
        /// Cause.
        message: String,
    },
}

/// Creates the stream if missing, or makes an existing one cover every subject (a stream
/// of the Go version, or of an older release, lacks the held subjects).
pub async fn ensure_stream(
    js: &jetstream::Context,
    settings: &StreamSettings,
) -> Result<stream::Stream, QueueError> {
    let err = |e: &dyn std::fmt::Display| QueueError::Stream {
        stream: settings.stream.clone(),
        message: e.to_string(),
    };
    let config = stream::Config {
        name: settings.stream.clone(),
        subjects: settings.subjects(),
        retention: stream::RetentionPolicy::WorkQueue,
        storage: stream::StorageType::File,
        duplicate_window: settings.duplicate_window,
        ..Default::default()
    };
    let mut stream = js.get_or_create_stream(config).await.map_err(|e| err(&e))?;
    let existing = stream.info().await.map_err(|e| err(&e))?.config.clone();
    let missing: Vec<String> = settings
        .subjects()
        .into_iter()
        .filter(|s| !existing.subjects.contains(s))
        .collect();
    if !missing.is_empty() {
        let mut config = existing;
        tracing::info!(stream = %settings.stream, subjects = ?missing, "adding subjects to the stream");
        config.subjects.extend(missing);
        js.update_stream(config).await.map_err(|e| err(&e))?;
        stream = js.get_stream(&settings.stream).await.map_err(|e| err(&e))?;
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
            message: e.to_string(),
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
    let err = |e: &dyn std::fmt::Display| QueueError::Consumer {
        consumer: name.clone(),
        message: e.to_string(),
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
        .map_err(|e| err(&e))?;
    let current = consumer.info().await.map_err(|e| err(&e))?.config.clone();
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
        consumer = stream.update_consumer(wanted).await.map_err(|e| err(&e))?;
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
            message: e.to_string(),
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
    let err = |e: &dyn std::fmt::Display| QueueError::Publish {
        id: assignment_id.to_string(),
        subject: subject.clone(),
        message: e.to_string(),
    };
    let message = jetstream::message::PublishMessage::build()
        .payload(payload)
        .message_id(assignment_id);
    let ack = js
        .send_publish(subject.clone(), message)
        .await
        .map_err(|e| err(&e))?
        .await
        .map_err(|e| err(&e))?;
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
    let err = |e: &dyn std::fmt::Display| QueueError::Stream {
        stream: settings.stream.clone(),
        message: e.to_string(),
    };
    let wanted: BTreeMap<String, Backend> = [Backend::Pod, Backend::Vm]
        .into_iter()
        .map(|b| (subject_of(settings, b), b))
        .collect();
    let mut counts = BTreeMap::new();
    let mut subjects = stream
        .info_with_subjects(filter)
        .await
        .map_err(|e| err(&e))?;
    while let Some((subject, count)) = subjects.try_next().await.map_err(|e| err(&e))? {
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
            message: e.to_string(),
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
impl crate::status::QueueDepth for ConsumerDepth {
    async fn unclaimed(&self, backend: Backend) -> Result<u64, QueueError> {
        let name = backend.as_str();
        let info = self
            .stream
            .consumer_info(name)
            .await
            .map_err(|e| QueueError::Consumer {
                consumer: name.to_owned(),
                message: e.to_string(),
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
    /// Its subject (`<base>.pod` / `<base>.vm`).
    pub subject: String,
    /// The envelope.
    pub payload: bytes::Bytes,
}

/// The messages on `subjects` (a subject or wildcard) present in `stream` when it was
/// opened (its cached info), read one by one without consuming them. With work-queue
/// retention these are the assignments not claimed yet (and those whose claim has not
/// been acknowledged).
pub async fn queued(stream: &stream::Stream, subjects: &str) -> Result<Vec<Queued>, QueueError> {
    use async_nats::jetstream::stream::LastRawMessageErrorKind;
    let info = stream.cached_info();
    let state = info.state.clone();
    let mut out = Vec::new();
    if state.messages == 0 {
        return Ok(out);
    }
    let mut sequence = state.first_sequence;
    // Only messages present now; later ones are the next reader's.
    while sequence <= state.last_sequence {
        let message = match stream
            .get_first_raw_message_by_subject(subjects, sequence)
            .await
        {
            Ok(m) => m,
            Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => break,
            Err(e) => {
                return Err(QueueError::Stream {
                    stream: info.config.name.clone(),
                    message: e.to_string(),
                });
            }
        };
        sequence = message.sequence + 1;
        if message.sequence > state.last_sequence {
            break;
        }
        out.push(Queued {
            sequence: message.sequence,
            subject: message.subject.to_string(),
            payload: message.payload,
        });
    }
    Ok(out)
}

// === finished assignments ===

/// The JetStream key-value bucket of finished assignment IDs (DESIGN invariant 20). An
/// entry lives `ttl`: at least Gitea's endless-task timeout, after which an envelope of
/// the assignment is refused as too old anyway.
#[derive(Clone)]
pub struct FinishedAssignments {
    store: kv::Store,
    bucket: String,
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
        let err = |e: &dyn std::fmt::Display| QueueError::Finished {
            bucket: bucket.to_owned(),
            message: e.to_string(),
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
            .map_err(|e| err(&e))?
        } else {
            js.get_key_value(bucket).await.map_err(|e| err(&e))?
        };
        Ok(FinishedAssignments {
            store,
            bucket: bucket.to_owned(),
        })
    }

    fn err(&self, e: &dyn std::fmt::Display) -> QueueError {
        QueueError::Finished {
            bucket: self.bucket.clone(),
            message: e.to_string(),
        }
    }

    /// Records that `id` finished (idempotent).
    pub async fn record(&self, id: &AssignmentId) -> Result<(), QueueError> {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs();
        self.store
            .put(id.as_str(), now.to_string().into())
            .await
            .map(|_| ())
            .map_err(|e| self.err(&e))
    }

    /// Whether `id` finished (within the bucket's TTL).
    pub async fn contains(&self, id: &AssignmentId) -> Result<bool, QueueError> {
        self.store
            .get(id.as_str())
            .await
            .map(|v| v.is_some())
            .map_err(|e| self.err(&e))
    }
}

// === assignments still queued ===

/// The assignments of one backend that still have a message in the stream: on the
/// backend's subject (a worker delivers them) or on its held subject (the held reconciler
/// releases or fails them). The lifecycle reconciler asks before it fails an unclaimed
/// executor whose start deadline has passed: while its message is there, the worker
/// that delivers it fails it, and only one of the two may report.
pub struct StreamQueue {
    js: jetstream::Context,
    settings: StreamSettings,
    backend: Backend,
}

impl StreamQueue {
    /// Reads `backend`'s subjects of the stream `settings` names.
    pub fn new(js: jetstream::Context, settings: StreamSettings, backend: Backend) -> Self {
        StreamQueue {
            js,
            settings,
            backend,
        }
    }
}

#[async_trait::async_trait]
impl crate::lifecycle::QueuedAssignments for StreamQueue {
    async fn queued(
        &self,
        ids: &std::collections::HashSet<AssignmentId>,
    ) -> Result<std::collections::HashSet<AssignmentId>, QueueError> {
        use async_nats::jetstream::stream::LastRawMessageErrorKind;
        let err = |e: &dyn std::fmt::Display| QueueError::Stream {
            stream: self.settings.stream.clone(),
            message: e.to_string(),
        };
        let mut found = std::collections::HashSet::new();
        if ids.is_empty() {
            return Ok(found);
        }
        let mut stream = open_stream(&self.js, &self.settings).await?;
        let state = stream.info().await.map_err(|e| err(&e))?.state.clone();
        if state.messages == 0 {
            return Ok(found);
        }
        for subject in [
            self.settings.subject(self.backend),
            self.settings.held_subject(self.backend),
        ] {
            let mut sequence = state.first_sequence;
            // Messages present now; one published later is a later pass's to see. Read one
            // by one (the server filters by subject) and only until every ID is found.
            while found.len() < ids.len() && sequence <= state.last_sequence {
                let message = match stream
                    .get_first_raw_message_by_subject(&subject, sequence)
                    .await
                {
                    Ok(m) => m,
                    Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => break,
                    Err(e) => return Err(err(&e)),
                };
                sequence = message.sequence + 1;
                if let Some(id) = gdr_core::assignment::envelope_id(&message.payload)
                    .filter(|id| ids.contains(id))
                {
                    found.insert(id);
                }
            }
        }
        Ok(found)
    }
}
