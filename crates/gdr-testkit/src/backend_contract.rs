//! The executor-backend contract (`gdr_core::executor`, DESIGN invariants 8–10, 12) as one
//! reusable suite, run against every backend: the in-memory one, the process backend, the
//! OpenSandbox backend against the real server.
//!
//! [`run`] gets a factory of backend *instances* over one shared store (a directory, a
//! server, a cluster): each call is a controller restart, so whatever an instance
//! records must be seen by the next one. The previous instance is dropped first, as a
//! restarted controller's predecessor is gone (two live process-backend instances over
//! one state directory are not a supported setup). The suite needs nothing else from the backend;
//! it only waits (with a deadline) where a backend is eventually consistent, e.g. a deleted
//! sandbox that reads `Stopping` before it is gone.

use std::sync::Arc;
use std::time::Duration;

use buffa_types::google::protobuf::Struct;
use gdr_core::assignment::{Assignment, AssignmentId, DerivationPolicy};
use gdr_core::backend::{Backend, BackendLabels};
use gdr_core::capability::CapabilityKey;
use gdr_core::executor::{Binding, ExecutorBackend, ExecutorError, ExecutorRecord, ExecutorSpec};
use gdr_core::identity::{IdentityScheme, TrustDomain};
use gdr_core::metadata::MetadataCodec;
use gdr_proto::runner::v1 as pb;

use crate::eventually;

/// What the suite needs to know about the backend under test.
#[derive(Debug, Clone)]
pub struct Contract {
    /// The backend kind the instances serve.
    pub backend: Backend,
    /// The codec the instances write metadata with.
    pub codec: MetadataCodec,
    /// The trust domain they validate against.
    pub trust_domain: TrustDomain,
    /// The suite uses task IDs `first_task_id ..= first_task_id + 9`; pick them so that
    /// nothing else on the shared store uses them.
    pub first_task_id: i64,
    /// Longest wait for an eventually consistent state.
    pub deadline: Duration,
}

impl Contract {
    /// A contract for `backend` with the default codec, `example.org` and a 30 s deadline.
    pub fn new(backend: Backend, first_task_id: i64) -> Self {
        Contract {
            backend,
            codec: MetadataCodec::default(),
            trust_domain: trust_domain(),
            first_task_id,
            deadline: Duration::from_secs(30),
        }
    }

    fn spec(&self, offset: i64, backend: Backend) -> ExecutorSpec {
        spec(
            &assignment(
                self.first_task_id + offset,
                "octo-org/hello-world",
                "build",
                backend,
                &self.trust_domain,
            ),
            &self.codec,
        )
    }
}

/// Trust domain of the suite's specs.
pub const TRUST_DOMAIN: &str = "example.org";
/// Facade SPIFFE ID the suite's specs name.
pub const FACADE_ID: &str = "spiffe://example.org/controller";

/// [`TRUST_DOMAIN`].
pub fn trust_domain() -> TrustDomain {
    match TrustDomain::new(TRUST_DOMAIN) {
        Ok(td) => td,
        Err(e) => panic!("example.org is a trust domain: {e}"),
    }
}

/// The assignment of a task as Gitea would hand it out: task `task_id` of `repository`,
/// one job `job_key` with `runs-on: [self-hosted, <backend>]`.
pub fn assignment(
    task_id: i64,
    repository: &str,
    job_key: &str,
    backend: Backend,
    trust_domain: &TrustDomain,
) -> Assignment {
    let mut context = Struct::new();
    context.insert("repository", repository);
    context.insert("ref", crate::tasks::REF);
    context.insert("event_name", "push");
    let workflow = format!(
        "on: push\njobs:\n  {job_key}:\n    runs-on: [self-hosted, {backend}]\n    steps: []\n"
    );
    let task = pb::Task {
        id: task_id,
        workflow_payload: Some(workflow.into_bytes()),
        context: buffa::MessageField::some(context),
        ..Default::default()
    };
    let policy = DerivationPolicy {
        trust_domain: trust_domain.clone(),
        scheme: IdentityScheme::Ref,
        labels: BackendLabels::default(),
    };
    Assignment::from_task(task, &policy).unwrap_or_else(|e| panic!("test task {task_id}: {e}"))
}

/// The spec of `assignment`'s executor, with a capability from a fixed test key.
pub fn spec(assignment: &Assignment, codec: &MetadataCodec) -> ExecutorSpec {
    let key = CapabilityKey::new(b"contract-suite-capability-key-32b")
        .unwrap_or_else(|e| panic!("test capability key: {e}"));
    ExecutorSpec::new(
        assignment,
        key.issue(assignment.id()),
        codec,
        "https://facade.invalid",
        FACADE_ID,
        assignment.backend().as_str(),
    )
}

/// The spec of task `task_id` of `owner/repo`, job `build` with `runs_on` (a YAML flow
/// list), whose executor dials the facade at `facade_url`.
pub fn task_spec(task_id: i64, runs_on: &str, facade_url: &str) -> ExecutorSpec {
    let mut context = Struct::new();
    context.insert("repository", "owner/repo");
    context.insert("ref", crate::tasks::REF);
    context.insert("event_name", "push");
    let task = pb::Task {
        id: task_id,
        context: buffa::MessageField::some(context),
        workflow_payload: Some(
            format!("jobs:\n  build:\n    runs-on: {runs_on}\n    steps: []\n").into_bytes(),
        ),
        ..Default::default()
    };
    let policy = DerivationPolicy {
        trust_domain: trust_domain(),
        scheme: IdentityScheme::Ref,
        labels: BackendLabels::default(),
    };
    let assignment =
        Assignment::from_task(task, &policy).unwrap_or_else(|e| panic!("test task {task_id}: {e}"));
    let key = CapabilityKey::new(b"contract-suite-capability-key-32b")
        .unwrap_or_else(|e| panic!("test capability key: {e}"));
    ExecutorSpec::new(
        &assignment,
        key.issue(assignment.id()),
        &MetadataCodec::default(),
        facade_url,
        FACADE_ID,
        assignment.backend().as_str(),
    )
}

fn ok<T>(result: Result<T, ExecutorError>, what: &str) -> T {
    result.unwrap_or_else(|e| panic!("{what}: {e}"))
}

async fn find(backend: &dyn ExecutorBackend, id: &AssignmentId) -> Option<ExecutorRecord> {
    ok(backend.find(id).await, "find")
}

async fn listed(backend: &dyn ExecutorBackend, id: &AssignmentId) -> Vec<ExecutorRecord> {
    ok(backend.list().await, "list")
        .into_iter()
        .filter(|r| r.assignment.id() == id)
        .collect()
}

/// Runs the whole contract; panics (failing the calling test) at the first violation.
pub async fn run(make_backend: impl Fn() -> Arc<dyn ExecutorBackend>, contract: &Contract) {
    let first = make_backend();
    assert_eq!(
        first.backend(),
        contract.backend,
        "the backend reports its kind"
    );

    // Absent executors: nothing to find, and the idempotent calls are no-ops.
    let absent = contract.spec(0, contract.backend);
    let absent_id = absent.assignment.id();
    assert!(
        find(&*first, absent_id).await.is_none(),
        "find of a never-created assignment is None"
    );
    ok(
        first.delete(absent_id).await,
        "delete of an absent executor is a no-op",
    );
    ok(
        first.mark_terminal(absent_id).await,
        "mark_terminal of an absent executor is a no-op",
    );
    assert!(
        first.record_claimed(absent_id).await.is_err(),
        "invariant 9: a claim cannot be recorded without an executor (the facade must not hand out the task)"
    );
    assert!(
        listed(&*first, absent_id).await.is_empty(),
        "the absent executor is not listed"
    );

    // An assignment of the other backend is refused for good.
    let other = match contract.backend {
        Backend::Pod => Backend::Vm,
        Backend::Vm => Backend::Pod,
    };
    let wrong = contract.spec(1, other);
    match first.create(&wrong).await {
        Err(ExecutorError::Permanent(_)) => {}
        Err(e) => panic!("creating an executor of the other backend must be Permanent, got {e}"),
        Ok(r) => panic!("created {} for an assignment of the other backend", r.name),
    }
    assert!(
        find(&*first, wrong.assignment.id()).await.is_none(),
        "nothing was created for it"
    );

    // Create is idempotent, across instances too (invariant 8).
    let spec = contract.spec(2, contract.backend);
    let id = spec.assignment.id();
    let created = ok(first.create(&spec).await, "create");
    assert_eq!(
        created.assignment, spec.assignment,
        "the record carries the assignment"
    );
    assert!(
        !created.name.is_empty(),
        "the record names the backend object"
    );
    assert!(
        !created.claimed && !created.terminal,
        "a new executor carries no marker"
    );
    let again = ok(first.create(&spec).await, "create again");
    assert_eq!(
        again.name, created.name,
        "a second create returns the existing executor"
    );
    drop(first);
    let restarted = make_backend();
    let again = ok(restarted.create(&spec).await, "create after restart");
    assert_eq!(
        again.name, created.name,
        "a restarted controller's create returns the existing executor"
    );
    let found = find(&*restarted, id)
        .await
        .unwrap_or_else(|| panic!("find after restart"));
    assert_eq!(
        found.name, created.name,
        "find after restart returns the executor"
    );
    assert_eq!(
        found.assignment, spec.assignment,
        "the assignment re-validates from backend metadata"
    );
    assert_eq!(
        listed(&*restarted, id).await.len(),
        1,
        "exactly one executor per assignment is listed"
    );

    // The identity binds once its target exists.
    let record = found;
    eventually(contract.deadline, "bind_identity answers Bound", || {
        let backend = Arc::clone(&restarted);
        let record = record.clone();
        async move {
            match ok(backend.bind_identity(&record).await, "bind_identity") {
                Binding::Bound => Some(()),
                Binding::NotReady(_) => None,
            }
        }
    })
    .await;
    let found = find(&*restarted, id)
        .await
        .unwrap_or_else(|| panic!("find after bind"));
    assert!(
        found.identity_target.is_some(),
        "a bound executor reports its identity target"
    );

    // Markers are durable: each instance sees what an earlier one recorded (9, 10).
    ok(restarted.record_claimed(id).await, "record_claimed");
    ok(restarted.record_claimed(id).await, "record_claimed again");
    drop(restarted);
    let second = make_backend();
    let found = find(&*second, id)
        .await
        .unwrap_or_else(|| panic!("find after claim"));
    assert!(
        found.claimed && !found.terminal,
        "invariant 9: the claim survives a restart, alone"
    );
    ok(second.mark_terminal(id).await, "mark_terminal");
    ok(second.mark_terminal(id).await, "mark_terminal again");
    drop(second);
    let third = make_backend();
    let found = find(&*third, id)
        .await
        .unwrap_or_else(|| panic!("find after terminal"));
    assert!(
        found.claimed && found.terminal,
        "invariant 10: both markers survive a restart"
    );
    let listed_now = listed(&*third, id).await;
    assert!(
        listed_now.len() == 1 && listed_now[0].claimed && listed_now[0].terminal,
        "invariant 7: list restores the markers"
    );

    // A second executor is independent of the first.
    let spec2 = contract.spec(3, contract.backend);
    let id2 = spec2.assignment.id();
    let created2 = ok(third.create(&spec2).await, "create a second executor");
    assert_ne!(
        created2.name, created.name,
        "two assignments get two executors"
    );
    let found2 = find(&*third, id2)
        .await
        .unwrap_or_else(|| panic!("find the second"));
    assert!(
        !found2.claimed && !found2.terminal,
        "markers of one executor do not leak to another"
    );

    // Delete is idempotent and touches only its assignment (12).
    ok(third.delete(id).await, "delete");
    ok(third.delete(id).await, "delete again");
    eventually(contract.deadline, "the deleted executor is gone", || {
        let backend = Arc::clone(&third);
        let id = id.clone();
        async move { find(&*backend, &id).await.is_none().then_some(()) }
    })
    .await;
    assert!(
        listed(&*third, id).await.is_empty(),
        "the deleted executor is not listed"
    );
    drop(third);
    let third = make_backend();
    ok(
        third.delete(id).await,
        "delete of a gone executor after restart",
    );
    assert!(
        find(&*third, id2).await.is_some(),
        "deleting one assignment's executor leaves the other's"
    );
    ok(third.delete(id2).await, "delete the second");
    eventually(contract.deadline, "the second executor is gone", || {
        let backend = Arc::clone(&third);
        let id2 = id2.clone();
        async move { find(&*backend, &id2).await.is_none().then_some(()) }
    })
    .await;
}
