//! The executor-backend capability: one trait implemented by the Pod, OpenSandbox and
//! local-process backends (DESIGN invariants 8–12).
//!
//! The backend is the authority on executor state (Pod labels/annotations, OpenSandbox
//! metadata, the process backend's state directory); the controller keeps no database.
//! Every operation is idempotent and keyed by assignment ID, so a worker can reconcile
//! from observed state after any crash: find → create if absent → bind identity → wait
//! for the claim.

use std::collections::BTreeMap;
use std::time::SystemTime;

use async_trait::async_trait;

use crate::domain::assignment::{AssignmentId, RecoveredAssignment};
use crate::domain::backend::Backend;
use crate::domain::capability::Capability;

pub mod process;

/// Environment variable names handed to an executor (compatible with the Go version).
pub mod env {
    /// The assignment ID (also the runner UUID the executor presents).
    pub const ASSIGNMENT_ID: &str = "CI_ASSIGNMENT_ID";
    /// The assignment-scoped capability (the runner token the executor presents).
    pub const CAPABILITY: &str = "CI_RUNNER_CAPABILITY";
    /// URL of the controller's RunnerService facade.
    pub const FACADE_URL: &str = "CI_RUNNER_FACADE_URL";
    /// The facade's exact SPIFFE ID, verified by the executor.
    pub const FACADE_SPIFFE_ID: &str = "CI_RUNNER_FACADE_SPIFFE_ID";
    /// The job's SPIFFE ID.
    pub const SPIFFE_ID: &str = "CI_SPIFFE_ID";
    /// `pod` or `vm`.
    pub const BACKEND: &str = "CI_RUNNER_BACKEND";
    /// The SPIFFE Workload API socket.
    pub const SPIFFE_ENDPOINT_SOCKET: &str = "SPIFFE_ENDPOINT_SOCKET";
}

/// Everything a backend needs to start one executor.
#[derive(Debug, Clone)]
pub struct ExecutorSpec {
    /// The assignment as backend metadata records it.
    pub assignment: RecoveredAssignment,
    /// The runner token of this assignment.
    pub capability: Capability,
    /// Facade URL the executor dials.
    pub facade_url: String,
    /// Facade SPIFFE ID the executor verifies.
    pub facade_spiffe_id: String,
}

impl ExecutorSpec {
    /// The executor's `CI_*` environment (the capability included: it is what the
    /// executor authenticates with; it is never logged).
    pub fn environment(&self) -> BTreeMap<&'static str, String> {
        BTreeMap::from([
            (
                env::ASSIGNMENT_ID,
                self.assignment.id().as_str().to_string(),
            ),
            (env::CAPABILITY, self.capability.expose().to_string()),
            (env::FACADE_URL, self.facade_url.clone()),
            (env::FACADE_SPIFFE_ID, self.facade_spiffe_id.clone()),
            (
                env::SPIFFE_ID,
                self.assignment.identity().spiffe_id().to_string(),
            ),
            (env::BACKEND, self.assignment.backend().as_str().to_string()),
        ])
    }
}

/// Lifecycle of an executor as the backend observes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Created, not yet running (image pull, VM boot, process start).
    Starting,
    /// Running.
    Running,
    /// Ended; `success` is the executor's own exit status, not the job result.
    Finished {
        /// Whether the executor exited cleanly.
        success: bool,
    },
}

/// One executor as recorded on the backend.
#[derive(Debug, Clone)]
pub struct ExecutorRecord {
    /// Backend object name (Pod name, sandbox ID, state directory name).
    pub name: String,
    /// The assignment, re-validated from backend metadata.
    pub assignment: RecoveredAssignment,
    /// Observed phase.
    pub phase: Phase,
    /// The runner claimed the task through the facade (durable marker, invariant 9).
    pub claimed: bool,
    /// Gitea accepted a terminal result (or the executor was failed) (invariant 10).
    pub terminal: bool,
    /// The workload identity is bound (SPIRE entry, local SVID issued).
    pub identity_bound: bool,
    /// When the executor was created.
    pub created_at: SystemTime,
}

/// The outcome of binding an executor's workload identity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Binding {
    /// The identity is bound; the executor can obtain its SVID.
    Bound,
    /// The identity target (Pod UID, sandbox) does not exist yet; try again later.
    NotReady(String),
}

/// Why a backend operation failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ExecutorError {
    /// The backend refused for lack of room (e.g. OpenSandbox 429); retry later.
    #[error("backend full: {0}")]
    Full(String),
    /// A transient failure (API unavailable, conflict); retry later.
    #[error("backend unavailable: {0}")]
    Unavailable(String),
    /// The request can never succeed (invalid spec, corrupt metadata).
    #[error("backend refused: {0}")]
    Permanent(String),
}

/// One executor backend. Every method is idempotent.
#[async_trait]
pub trait ExecutorBackend: Send + Sync + 'static {
    /// Which backend this is.
    fn backend(&self) -> Backend;

    /// The executor of an assignment, if one exists.
    async fn find(&self, id: &AssignmentId) -> Result<Option<ExecutorRecord>, ExecutorError>;

    /// Creates the executor, or returns the existing one.
    async fn create(&self, spec: &ExecutorSpec) -> Result<ExecutorRecord, ExecutorError>;

    /// Binds the workload identity once its target exists.
    async fn bind_identity(&self, record: &ExecutorRecord) -> Result<Binding, ExecutorError>;

    /// Durably records that the runner claimed the task; must complete before the facade
    /// hands the task out.
    async fn record_claimed(&self, id: &AssignmentId) -> Result<(), ExecutorError>;

    /// Durably records that the task reached a terminal state in Gitea.
    async fn mark_terminal(&self, id: &AssignmentId) -> Result<(), ExecutorError>;

    /// Every executor that still exists (for restoring pools, claims and reconcilers).
    async fn list(&self) -> Result<Vec<ExecutorRecord>, ExecutorError>;

    /// Deletes the executor and its identity binding (no-op when absent).
    async fn delete(&self, id: &AssignmentId) -> Result<(), ExecutorError>;
}
