//! The label vocabularies the metrics export: the values a component reports (a delivery's
//! outcome, an executor's phase, a kind of Gitea error), in a module of their own so that
//! the metrics registry imports no component while the components import the registry.

use gdr_core::executor::ExecutorRecord;
use serde::{Deserialize, Serialize};

use gdr_gitea::ErrorKind;

/// Every error kind, in a stable order (for metrics export).
pub const ERROR_KINDS: [ErrorKind; 6] = [
    ErrorKind::Unauthenticated,
    ErrorKind::NotFound,
    ErrorKind::Invalid,
    ErrorKind::Unavailable,
    ErrorKind::Other,
    ErrorKind::TooLarge,
];

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
    /// The executor ended or never started without claiming, or the backend refused it
    /// for good: reported as failed in Gitea, cleaned up, acknowledged.
    ExecutorFailed,
    /// The executor failed but Gitea did not take the report: NAK, the next delivery
    /// reports again (nothing is cleaned up before Gitea has the result).
    ReportPending,
    /// Another delivery of this assignment is still being handled here: NAK.
    InFlight,
    /// Shutting down: NAK so another controller takes it at once.
    Interrupted,
    /// Sealed with a task key this controller does not have, and setting it aside failed:
    /// NAK with a long delay.
    MissingKey,
    /// Sealed with a task key this controller does not have: moved to the held subject
    /// (it holds no admission slot there), acknowledged here.
    Held,
    /// A plaintext envelope where a task key is configured: terminated.
    Plaintext,
    /// Fetched longer ago than a task may live (or in the future), or sealed without a
    /// fetch time by an older release: terminated.
    Expired,
    /// The assignment finished before: a replay, terminated.
    Replayed,
}

impl Outcome {
    /// Every outcome (the metrics reference lists them).
    pub const ALL: [Outcome; 15] = [
        Outcome::Claimed,
        Outcome::AlreadyClaimed,
        Outcome::Full,
        Outcome::NotReady,
        Outcome::BackendError,
        Outcome::Poison,
        Outcome::ExecutorFailed,
        Outcome::ReportPending,
        Outcome::InFlight,
        Outcome::Interrupted,
        Outcome::MissingKey,
        Outcome::Held,
        Outcome::Plaintext,
        Outcome::Expired,
        Outcome::Replayed,
    ];

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
            Outcome::ReportPending => "report_pending",
            Outcome::InFlight => "in_flight",
            Outcome::Interrupted => "interrupted",
            Outcome::MissingKey => "missing_key",
            Outcome::Held => "held",
            Outcome::Plaintext => "plaintext_refused",
            Outcome::Expired => "expired",
            Outcome::Replayed => "replayed",
        }
    }
}

/// Where an executor stands, as the backend reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Created; its runner has not fetched the task yet.
    Starting,
    /// Its runner claimed the task and runs it.
    Running,
    /// It ended without a result in Gitea; the controller fails the job and cleans up.
    Ended,
    /// Gitea has the job's result; the executor is being cleaned up.
    Reported,
}

impl Phase {
    /// Every phase, in the order of a job's life.
    pub const ALL: [Phase; 4] = [
        Phase::Starting,
        Phase::Running,
        Phase::Ended,
        Phase::Reported,
    ];

    /// The label value and JSON spelling.
    pub const fn as_str(self) -> &'static str {
        match self {
            Phase::Starting => "starting",
            Phase::Running => "running",
            Phase::Ended => "ended",
            Phase::Reported => "reported",
        }
    }

    /// The phase of an executor record.
    pub fn of(record: &ExecutorRecord) -> Self {
        if record.terminal {
            Phase::Reported
        } else if record.phase.is_finished() {
            Phase::Ended
        } else if record.claimed {
            Phase::Running
        } else {
            Phase::Starting
        }
    }
}
