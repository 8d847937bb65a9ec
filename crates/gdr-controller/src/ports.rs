//! The ports: the traits a component consumes from the JetStream adapter (`queue.rs`), and
//! their error type, in a module that imports no adapter and no component.
//!
//! The scheduler's heartbeats, the dispatch, the lifecycle reconciler and the status page
//! hold these traits; `queue.rs` implements them. So the adapter depends on the ports, the
//! components depend on the ports, and neither imports the other for them: the import
//! graph has no loop (`tests/architecture.rs`).

use std::collections::HashSet;

use async_trait::async_trait;
use gdr_core::assignment_id::AssignmentId;
use gdr_core::backend::Backend;

/// The cause of a [`QueueError`]: the NATS client's error, or what the adapter saw.
pub type QueueErrorSource = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Why a queue operation failed.
#[derive(Debug, thiserror::Error)]
pub enum QueueError {
    /// The stream could not be created or read.
    #[error("JetStream stream {stream}: {source}")]
    Stream {
        /// Stream name.
        stream: String,
        /// Cause, kept for the log's cause chain.
        #[source]
        source: QueueErrorSource,
    },
    /// The consumer could not be created or read.
    #[error("JetStream consumer {consumer}: {source}")]
    Consumer {
        /// Durable name.
        consumer: String,
        /// Cause, kept for the log's cause chain.
        #[source]
        source: QueueErrorSource,
    },
    /// JetStream did not acknowledge a publish.
    #[error("publishing {id} to {subject}: {source}")]
    Publish {
        /// Assignment ID.
        id: String,
        /// Subject.
        subject: String,
        /// Cause, kept for the log's cause chain.
        #[source]
        source: QueueErrorSource,
    },
    /// The envelope is larger than the NATS server takes (its `max_payload`): no retry
    /// can store it.
    #[error(
        "publishing {id} to {subject}: the envelope of {size} bytes is larger than the NATS server's max_payload allows ({source}); raise the server's max_payload to queue such tasks"
    )]
    TooLarge {
        /// Assignment ID.
        id: String,
        /// Subject.
        subject: String,
        /// The envelope's size in bytes.
        size: usize,
        /// Cause, kept for the log's cause chain.
        #[source]
        source: QueueErrorSource,
    },
    /// The finished-assignments bucket could not be created, read or written.
    #[error("JetStream key-value bucket {bucket}: {source}")]
    Finished {
        /// Bucket name.
        bucket: String,
        /// Cause, kept for the log's cause chain.
        #[source]
        source: QueueErrorSource,
    },
}

/// How many assignments of a backend wait in JetStream.
#[async_trait]
pub trait QueueDepth: Send + Sync {
    /// Assignments of `backend` stored and not yet acknowledged (i.e. not yet claimed by
    /// their runner: work-queue retention drops a message when it is acknowledged).
    async fn unclaimed(&self, backend: Backend) -> Result<u64, QueueError>;
}

/// Which assignments still wait in the queue, where a worker (or the held reconciler) sees
/// them again.
#[async_trait]
pub trait QueuedAssignments: Send + Sync {
    /// The members of `ids` that have a message in the queue now.
    async fn queued(
        &self,
        ids: &HashSet<AssignmentId>,
    ) -> Result<HashSet<AssignmentId>, QueueError>;
}

/// The record of assignments that finished (DESIGN invariant 20: an assignment runs at
/// most once, ever). An ID that could not be written yet is still counted as finished in
/// this process until a later call writes it.
#[async_trait]
pub trait FinishedLog: Send + Sync + std::fmt::Debug {
    /// Records that `id` finished (idempotent). On an error the ID is kept unsaved and the
    /// caller still learns that it is not durable yet.
    async fn record(&self, id: &AssignmentId) -> Result<(), QueueError>;

    /// Whether `id` finished (written, or unsaved in this process).
    async fn contains(&self, id: &AssignmentId) -> Result<bool, QueueError>;

    /// Counts `id` as finished in this process at once, and leaves the write to
    /// [`FinishedLog::save_unsaved`] (for callers that must not wait for NATS).
    fn remember(&self, id: &AssignmentId);

    /// Writes the unsaved IDs; returns how many are still unsaved.
    async fn save_unsaved(&self) -> usize;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 41 item 3: a queue error keeps the NATS client's error as its source, so a
    /// log line (which prints the error) and a caller walking the chain both see the cause.
    #[test]
    fn a_queue_error_keeps_its_cause_for_the_log_and_the_chain() {
        let cause = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "nats went away");
        let e = QueueError::Publish {
            id: "gitea-task-7".into(),
            subject: "ci.pod".into(),
            source: cause.into(),
        };
        assert_eq!(
            e.to_string(),
            "publishing gitea-task-7 to ci.pod: nats went away"
        );
        let source = std::error::Error::source(&e).expect("a source");
        let io = source
            .downcast_ref::<std::io::Error>()
            .expect("the original error, not its text");
        assert_eq!(io.kind(), std::io::ErrorKind::ConnectionReset);
    }
}
