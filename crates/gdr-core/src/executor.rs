//! The executor-backend contract: one trait implemented by the Pod, OpenSandbox and
//! local-process backends (DESIGN invariants 8–12).
//!
//! The backend is the authority on executor state (Pod labels and annotations, OpenSandbox
//! metadata, the process backend's state directory); the controller keeps no database.
//! Every operation is idempotent and keyed by assignment ID, so a worker can reconcile from
//! observed state after any crash: find → create if absent → bind identity → wait for the
//! claim. Errors say what the caller should do ([`ExecutorError`]): retry after a delay,
//! retry with backoff, or give up and fail the task.

use std::collections::BTreeMap;
use std::error::Error as StdError;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;

use crate::assignment::{Assignment, AssignmentId, RecoveredAssignment};
use crate::backend::Backend;
use crate::capability::Capability;
use crate::metadata::{ExecutorMetadata, MetadataCodec};

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
    /// The runs-on label the runner declares for the backend (`pod`, `vm` or the VM alias).
    pub const RUNNER_LABEL: &str = "CI_RUNNER_LABEL";
    /// The SPIFFE Workload API socket.
    pub const SPIFFE_ENDPOINT_SOCKET: &str = "SPIFFE_ENDPOINT_SOCKET";
    /// How long (seconds) the executor holds its runner's reports while the facade is
    /// unreachable (`executor_report_outage_tolerance`).
    pub const REPORT_OUTAGE_TOLERANCE: &str = "CI_EXECUTOR_REPORT_OUTAGE_TOLERANCE";
    /// The standby ID of a warm VM sandbox's executor (`vm_warm_pool`): a random name the
    /// controller gave the sandbox at its creation, before any job, also written to the
    /// sandbox's metadata (`<prefix>standby-id`). Once a job claimed the sandbox and its
    /// SVID is issued, the executor asks the facade for its assignment with it
    /// ([`super::standby`]). Not an assignment variable: a warm sandbox has no assignment.
    pub const STANDBY_ID: &str = "CI_EXECUTOR_STANDBY_ID";
    /// The variables [`ExecutorSpec::environment`](super::ExecutorSpec::environment) sets
    /// from the assignment; configuration may not set them.
    pub const ASSIGNMENT: [&str; 7] = [
        ASSIGNMENT_ID,
        CAPABILITY,
        FACADE_URL,
        FACADE_SPIFFE_ID,
        SPIFFE_ID,
        BACKEND,
        RUNNER_LABEL,
    ];
}

/// How a warm VM sandbox's executor learns its assignment from the facade (issue 39 item
/// 5; OpenSandbox has no downward API, so nothing on the sandbox can tell the executor
/// after its start). The executor calls `POST` [`PATH`](crate::executor::standby::PATH) over its mTLS
/// channel with its SVID, naming its standby ID in [`ID_HEADER`](crate::executor::standby::ID_HEADER) and
/// an empty body. The facade answers:
/// - `200` with a JSON object of strings: the [`crate::executor::env::ASSIGNMENT`] variables of the job
///   that claimed the sandbox, the capability included, and
///   [`crate::executor::env::REPORT_OUTAGE_TOLERANCE`] when configured — what a fresh sandbox's executor
///   gets in its environment;
/// - `404` while no job has claimed the sandbox (or it is unknown): ask again later;
/// - `403` when the peer's SPIFFE ID is not the claiming job's, or its runner has
///   claimed the task already (the assignment is handed out once);
/// - `503` when the backend cannot be read: ask again later.
pub mod standby {
    /// The facade's route.
    pub const PATH: &str = "/gdr.executor.v1.StandbyService/Assignment";
    /// The request header naming the standby ID ([`super::env::STANDBY_ID`]).
    pub const ID_HEADER: &str = "x-gdr-standby-id";
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
    /// The job's `runs-on` labels (backends pick per-label profiles from them).
    pub runs_on: Vec<String>,
    /// The label the executor's runner declares for its backend.
    pub runner_label: String,
    /// The metadata to place on the executor object, from the one codec
    /// ([`crate::metadata::MetadataCodec::encode`]), `runner=true` included.
    pub metadata: ExecutorMetadata,
    /// How long the executor holds its runner's reports while the facade is unreachable
    /// (`None`: the executor's default).
    pub report_outage_tolerance: Option<Duration>,
}

impl ExecutorSpec {
    /// The spec of `assignment`'s executor: its metadata from `codec`, its runs-on labels
    /// from the job, and where and how it reaches the facade.
    pub fn new(
        assignment: &Assignment,
        capability: Capability,
        codec: &MetadataCodec,
        facade_url: impl Into<String>,
        facade_spiffe_id: impl Into<String>,
        runner_label: impl Into<String>,
    ) -> Self {
        let recovered = RecoveredAssignment::from_assignment(assignment);
        ExecutorSpec {
            metadata: codec.encode(&recovered),
            assignment: recovered,
            capability,
            facade_url: facade_url.into(),
            facade_spiffe_id: facade_spiffe_id.into(),
            runs_on: assignment.runs_on().to_vec(),
            runner_label: runner_label.into(),
            report_outage_tolerance: None,
        }
    }

    /// The same spec with the executor's report outage tolerance set.
    #[must_use]
    pub fn with_report_outage_tolerance(mut self, tolerance: Duration) -> Self {
        self.report_outage_tolerance = Some(tolerance);
        self
    }

    /// The executor's `CI_*` environment (the capability included: it is what the
    /// executor authenticates with; it is never logged).
    pub fn environment(&self) -> BTreeMap<&'static str, String> {
        // In the order of `env::ASSIGNMENT`, which configuration may therefore not set.
        let values = [
            self.assignment.id().as_str().to_owned(),
            self.capability.expose().to_owned(),
            self.facade_url.clone(),
            self.facade_spiffe_id.clone(),
            self.assignment.identity().spiffe_id().to_owned(),
            self.assignment.backend().as_str().to_owned(),
            self.runner_label.clone(),
        ];
        let mut env: BTreeMap<&'static str, String> =
            env::ASSIGNMENT.into_iter().zip(values).collect();
        if let Some(tolerance) = self.report_outage_tolerance {
            env.insert(
                env::REPORT_OUTAGE_TOLERANCE,
                tolerance.as_secs().to_string(),
            );
        }
        env
    }
}

/// Decides which job gets a warm member when two may claim it at once (DESIGN invariant
/// 8: one environment never serves two jobs). A backend whose store has no conditional
/// write (OpenSandbox's metadata patch is a plain read-modify-write) asks this before it
/// writes a job's assignment onto a warm member. The controller's is a NATS KV `create`,
/// which exactly one writer wins, shared by every replica.
#[async_trait]
pub trait WarmClaims: Send + Sync + 'static {
    /// Records that `by` claims `member` (a backend object name), unless another
    /// assignment did first. `true` when `by` holds it, now or from an earlier call (so a
    /// worker retrying its create after a crash gets its member back); `false` when
    /// another assignment holds it.
    async fn claim(&self, member: &str, by: &AssignmentId) -> Result<bool, ExecutorError>;

    /// Since when an assignment holds `member`, if one does (`None`: free, or the
    /// arbiter cannot say, the default). A backend's pass uses it to find a member whose
    /// claimant won here but died before writing the job onto it: no other job can claim
    /// it, so it is discarded once held long enough for any live claim to have finished.
    async fn held_since(&self, member: &str) -> Result<Option<SystemTime>, ExecutorError> {
        let _ = member;
        Ok(None)
    }
}

/// [`WarmClaims`] within one process, for a single controller and for tests.
#[derive(Debug, Default)]
pub struct LocalWarmClaims {
    held: std::sync::Mutex<BTreeMap<String, (AssignmentId, SystemTime)>>,
}

impl LocalWarmClaims {
    fn held(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, (AssignmentId, SystemTime)>> {
        // Plain data, updated in single steps: a poisoned lock holds a consistent map.
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[async_trait]
impl WarmClaims for LocalWarmClaims {
    async fn claim(&self, member: &str, by: &AssignmentId) -> Result<bool, ExecutorError> {
        let mut held = self.held();
        let (holder, _) = held
            .entry(member.to_owned())
            .or_insert_with(|| (by.clone(), SystemTime::now()));
        Ok(holder == by)
    }

    async fn held_since(&self, member: &str) -> Result<Option<SystemTime>, ExecutorError> {
        Ok(self.held().get(member).map(|(_, since)| *since))
    }
}

/// Lifecycle of an executor as the backend observes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Phase {
    /// Created, not yet running.
    Starting {
        /// Why it is not running yet, when the backend says (`ImagePullBackOff: …`,
        /// `Unschedulable: …`, VM boot); reported if the start deadline passes.
        reason: Option<String>,
    },
    /// Running.
    Running,
    /// Ended; `success` is the executor's own exit status, not the job result.
    Finished {
        /// Whether the executor exited cleanly.
        success: bool,
        /// What the backend knows about the end (exit code, `OOMKilled`, node lost).
        reason: Option<String>,
    },
}

impl Phase {
    /// Whether the executor has ended.
    pub fn is_finished(&self) -> bool {
        matches!(self, Phase::Finished { .. })
    }
}

/// What the controller binds a job's identity to, as the backend reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IdentityTarget {
    /// A Pod's UID (SPIRE selector `k8s:pod-uid:<uid>`).
    PodUid(String),
    /// An OpenSandbox sandbox ID (its Pods are bound by `sandbox-identity`).
    SandboxId(String),
    /// A local process: its pid and start time (`/proc/<pid>/stat` field 22), which tell it
    /// from a process that later reuses the pid.
    Process {
        /// Process ID.
        pid: u32,
        /// Start time in clock ticks since boot.
        start_time: u64,
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
    /// The workload identity is bound (SPIRE entry, local SVID served).
    pub identity_bound: bool,
    /// What the identity binds to, once it exists (`None`: not yet, e.g. Pod not created).
    pub identity_target: Option<IdentityTarget>,
    /// When the executor was created (the start deadline counts from here).
    pub created_at: SystemTime,
}

/// The outcome of binding an executor's workload identity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Binding {
    /// The identity is bound; the executor can obtain its SVID.
    Bound,
    /// The identity target (Pod UID, node) does not exist yet; try again later.
    NotReady(String),
}

/// The cause of a backend failure, kept for logs and reports.
pub type Source = Box<dyn StdError + Send + Sync + 'static>;

/// Why a backend operation failed, by what the caller should do about it.
#[derive(Debug, thiserror::Error)]
pub enum ExecutorError {
    /// The backend refused for lack of room (OpenSandbox 429): leave the assignment queued
    /// and retry after `retry_after` (the backend's hint) or a default delay.
    #[error("backend full: {source}")]
    Full {
        /// The backend's `Retry-After`, when it gave one.
        retry_after: Option<Duration>,
        /// What the backend said.
        #[source]
        source: Source,
    },
    /// A transient failure (API unreachable, conflict, timeout): retry with backoff.
    #[error("backend unavailable: {0}")]
    Unavailable(#[source] Source),
    /// The request can never succeed (invalid spec, corrupt metadata, missing
    /// permission): fail the task with the reason instead of retrying.
    #[error("backend refused: {0}")]
    Permanent(#[source] Source),
}

impl ExecutorError {
    /// A transient failure with `source` as its cause.
    pub fn unavailable(source: impl Into<Source>) -> Self {
        ExecutorError::Unavailable(source.into())
    }

    /// A permanent failure with `source` as its cause.
    pub fn permanent(source: impl Into<Source>) -> Self {
        ExecutorError::Permanent(source.into())
    }
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

    /// The executor a job made of the warm member with standby ID `standby_id`
    /// ([`env::STANDBY_ID`]) by claiming it; `None` while it is unclaimed or unknown, and
    /// on every backend without such members (the default).
    async fn claimed_standby(
        &self,
        standby_id: &str,
    ) -> Result<Option<ExecutorRecord>, ExecutorError> {
        let _ = standby_id;
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs a future that never waits (the local claims take no I/O).
    fn ready<F: std::future::Future>(f: F) -> F::Output {
        let mut f = std::pin::pin!(f);
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        match f.as_mut().poll(&mut cx) {
            std::task::Poll::Ready(v) => v,
            std::task::Poll::Pending => panic!("the local claims waited"),
        }
    }

    #[test]
    fn a_warm_member_is_held_by_the_first_assignment_that_claims_it_and_by_no_other_invariant_8() {
        let claims = LocalWarmClaims::default();
        let (a, b) = (
            AssignmentId::from_task_id(1).unwrap(),
            AssignmentId::from_task_id(2).unwrap(),
        );
        assert!(ready(claims.claim("sandbox-1", &a)).unwrap());
        assert!(!ready(claims.claim("sandbox-1", &b)).unwrap(), "taken");
        assert!(
            ready(claims.claim("sandbox-1", &a)).unwrap(),
            "a retry keeps it"
        );
        assert!(ready(claims.claim("sandbox-2", &b)).unwrap());
        assert!(ready(claims.held_since("sandbox-1")).unwrap().is_some());
        assert!(ready(claims.held_since("sandbox-3")).unwrap().is_none());
    }
}
