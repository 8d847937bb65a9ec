//! What the facade needs of the controller, one trait per capability, in the facade's own
//! words: who may call ([`Admission`]), the claim of a task and its end ([`Claims`]),
//! which job claimed a warm sandbox ([`Standbys`]), and where a job's outcome is counted
//! ([`Outcomes`]). The controller's dispatch and job
//! metrics implement them; this crate never sees the controller, its queue or its backends.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use gdr_core::assignment::AssignmentId;
use gdr_core::backend::Backend;
use gdr_core::capability::CapabilityKey;
use gdr_core::executor::ExecutorError;
use gdr_proto::runner::v1::Task;

/// An assignment the facade has authenticated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Authorized {
    /// Assignment ID.
    pub id: AssignmentId,
    /// The Gitea task ID; updates must name it.
    pub task_id: i64,
    /// Backend of the executor.
    pub backend: Backend,
}

/// Why the facade refuses a caller.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    /// The assignment ID is malformed or unknown to this controller.
    #[error("unknown assignment")]
    UnknownAssignment,
    /// The capability does not belong to the assignment.
    #[error("invalid capability for the assignment")]
    BadCapability,
    /// The peer's SPIFFE ID is not the assignment's.
    #[error("peer identity does not match the assignment")]
    WrongIdentity,
    /// The backend could not be asked (after a restart, before the assignment's
    /// redelivery): the caller may well be legitimate, so it should retry, not give up.
    #[error("the backend cannot be read: {0}")]
    Unavailable(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The assignment has ended (Gitea has its result, or it was failed): its
    /// credentials open nothing any more, after a restart as before one.
    #[error("the assignment has finished")]
    Finished,
}

/// Whether an offered assignment's executor may still use the pass-through to Gitea.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Liveness {
    /// Waiting for its runner's claim, or claimed and running.
    Live,
    /// Gitea accepted a terminal result.
    Finished,
    /// Its start deadline passed before its runner claimed it.
    Expired,
}

/// What a FetchTask gets ([`Claims::take_task`]).
#[derive(Debug, Clone, PartialEq)]
pub enum Fetched {
    /// The task, the claim durable: handed out for the first time, or again to a runner
    /// that has not reported on it yet.
    Task(Box<Task>),
    /// Nothing to hand out: not offered here (yet), or the job is being failed.
    Nothing,
    /// The runner has reported on its task already, or its claim was recorded before a
    /// restart (the task is not in memory): it is never handed out again.
    HandedOut,
}

/// What one [`Claims::finish`] call did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Finished {
    /// This call ended the assignment (no earlier one had): count its result once.
    pub first: bool,
    /// How long the task ran since this process handed it out, when it did (first call).
    pub ran: Option<Duration>,
}

/// Why handing out a task (or finishing it) failed.
#[derive(Debug, thiserror::Error)]
pub enum ClaimError {
    /// The backend could not record the claim (or the terminal marker); the runner
    /// should retry. Shared: every FetchTask that waited for one claim write gets it.
    #[error("the backend failed: {0}")]
    Backend(#[source] Arc<ExecutorError>),
    /// The claim write ended without an outcome (the controller is stopping); the runner
    /// should retry.
    #[error("recording the claim was interrupted")]
    Interrupted,
    /// The backend for the assignment is not configured here.
    #[error("no {0} backend in this controller")]
    NoBackend(Backend),
}

impl From<ExecutorError> for ClaimError {
    fn from(e: ExecutorError) -> Self {
        ClaimError::Backend(Arc::new(e))
    }
}

/// Who may call: an assignment's credentials and its executor's SPIFFE ID, checked against
/// the assignments offered in this process or, after a restart, against the backends.
#[async_trait::async_trait]
pub trait Admission: Send + Sync {
    /// The key the capabilities (runner tokens) verify under.
    fn capability_key(&self) -> &CapabilityKey;

    /// Checks a caller against the assignments offered here: assignment ID (runner UUID),
    /// capability (runner token) and peer SPIFFE ID must all belong to one of them.
    fn authorize(
        &self,
        assignment_id: &str,
        capability: &str,
        peer_spiffe_id: &str,
    ) -> Result<Authorized, AuthError>;

    /// Checks a caller whose assignment is not offered here (yet) against the backends'
    /// metadata (after a restart, before its redelivery).
    async fn authorize_from_backend(
        &self,
        assignment_id: &str,
        capability: &str,
        peer_spiffe_id: &str,
    ) -> Result<Authorized, AuthError>;

    /// Whether a connection may still be bound to `assignment_id` (invariant 21).
    fn may_bind(&self, assignment_id: &str) -> bool;

    /// How far an offered assignment has come; `None` when it is not offered here.
    fn liveness(&self, id: &AssignmentId) -> Option<Liveness>;

    /// The facade heard from `id`'s runner just now (invariant 12: it is alive).
    fn heard_from(&self, id: &AssignmentId);
}

/// The claim of a pre-assigned task, and the end of its assignment.
#[async_trait::async_trait]
pub trait Claims: Send + Sync {
    /// Hands the task to its runner once the claim is durable on the backend; the claim
    /// completes or is rolled back whatever becomes of the caller.
    async fn take_task(self: Arc<Self>, auth: &Authorized) -> Result<Fetched, ClaimError>;

    /// The runner reported on its task (an UpdateTask or UpdateLog naming it).
    fn received(&self, id: &AssignmentId);

    /// Gitea accepted a terminal result: marks it on the backend and releases the slot,
    /// before the runner hears back (invariant 10).
    async fn finish(&self, auth: &Authorized) -> Result<Finished, ClaimError>;
}

/// Where the outcome of a job is counted.
pub trait Outcomes: Send + Sync {
    /// A job of `backend` ended with `result` (a label of [`crate::result_label`]), having
    /// run for `ran` since this process handed its task out, when it did.
    fn completed(&self, backend: Backend, result: &str, ran: Option<Duration>);
}

/// The job that claimed a warm sandbox, as its executor's standby request is answered
/// ([`gdr_core::executor::standby`]).
#[derive(Clone, PartialEq, Eq)]
pub struct ClaimedStandby {
    /// The assignment of the job.
    pub assignment_id: AssignmentId,
    /// The job's SPIFFE ID: the only peer the assignment is handed to.
    pub spiffe_id: String,
    /// Its runner has claimed the task already: the assignment was handed out.
    pub claimed: bool,
    /// The assignment has ended.
    pub terminal: bool,
    /// The variables a fresh executor of the assignment gets in its environment, the
    /// capability excepted (the facade adds it, from its own key).
    pub variables: BTreeMap<String, String>,
}

impl std::fmt::Debug for ClaimedStandby {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClaimedStandby")
            .field("assignment_id", &self.assignment_id.as_str())
            .field("spiffe_id", &self.spiffe_id)
            .field("claimed", &self.claimed)
            .field("terminal", &self.terminal)
            .field("variables", &self.variables.keys().collect::<Vec<_>>())
            .finish()
    }
}

/// Which job claimed a warm sandbox, by the standby ID its executor was started with.
#[async_trait::async_trait]
pub trait Standbys: Send + Sync {
    /// The job that claimed the warm sandbox with `standby_id`; `None` while none has, or
    /// when no sandbox has that ID. [`AuthError::Unavailable`] when the backend cannot be
    /// read (the executor asks again).
    async fn claimed(&self, standby_id: &str) -> Result<Option<ClaimedStandby>, AuthError>;
}
