//! The executor-backend contract suite (DESIGN invariants 8–10): what every
//! [`ExecutorBackend`] must do, checked through the trait only, with a *new instance over
//! the same store* standing in for a controller restart.
//!
//! Checked: an absent executor is not found, deleting it is a no-op; `create` is
//! idempotent (one executor per assignment, the same one returned); a new instance finds
//! and lists it with its assignment re-validated; the claimed and terminal markers survive
//! new instances and are idempotent; claiming an absent executor is an error (the facade
//! must not hand out a task whose claim was not recorded); `delete` removes it for every
//! instance and is idempotent.

// The suite runs inside tests: a panic naming the broken rule is how it fails.
#![allow(clippy::expect_used)]

use std::sync::Arc;

use buffa_types::google::protobuf::{Struct, Value};
use gdr_core::assignment::{Assignment, AssignmentId, DerivationPolicy};
use gdr_core::backend::{Backend, BackendLabels};
use gdr_core::capability::CapabilityKey;
use gdr_core::executor::{ExecutorBackend, ExecutorRecord, ExecutorSpec};
use gdr_core::identity::TrustDomain;
use gdr_core::metadata::MetadataCodec;
use gdr_proto::runner::v1::Task;

/// Trust domain of the suite's specs.
pub const TRUST_DOMAIN: &str = "example.org";
/// Facade SPIFFE ID the suite's specs name.
pub const FACADE_ID: &str = "spiffe://example.org/controller";
const KEY: &[u8] = b"0123456789abcdef0123456789abcdef";

/// A spec for task `task_id` of `owner/repo`, job `build`, with `runs_on` (YAML flow list).
pub fn spec(task_id: i64, runs_on: &str, facade_url: &str) -> ExecutorSpec {
    let task = Task {
        id: task_id,
        context: Struct::from_fields([("repository", Value::from("owner/repo"))]).into(),
        workflow_payload: Some(
            format!("jobs:\n  build:\n    runs-on: {runs_on}\n    steps: []\n").into_bytes(),
        ),
        ..Default::default()
    };
    let policy = DerivationPolicy {
        trust_domain: TrustDomain::new(TRUST_DOMAIN).unwrap_or_else(|e| panic!("{e}")),
        labels: BackendLabels::default(),
    };
    let assignment = Assignment::from_task(task, &policy).unwrap_or_else(|e| panic!("{e}"));
    let key = CapabilityKey::new(KEY).unwrap_or_else(|e| panic!("{e}"));
    let label = assignment.backend().as_str().to_owned();
    ExecutorSpec::new(
        &assignment,
        key.issue(assignment.id()),
        &MetadataCodec::default(),
        facade_url,
        FACADE_ID,
        label,
    )
}

fn ids(records: &[ExecutorRecord]) -> Vec<String> {
    let mut ids: Vec<String> = records
        .iter()
        .map(|r| r.assignment.id().to_string())
        .collect();
    ids.sort();
    ids
}

async fn found(backend: &dyn ExecutorBackend, id: &AssignmentId, when: &str) -> ExecutorRecord {
    match backend.find(id).await {
        Ok(Some(r)) => r,
        other => panic!("{when}: expected the executor of {id}, got {other:?}"),
    }
}

/// Runs the suite. `make_backend` must return a new instance over the same store each
/// call (the previous instance is dropped first, as in a restart); `kind` is the backend it serves; `a` and `b` are two specs of that backend whose
/// executors do not exist yet (see [`spec`]).
pub async fn run(
    make_backend: impl Fn() -> Arc<dyn ExecutorBackend>,
    kind: Backend,
    a: ExecutorSpec,
    b: ExecutorSpec,
) {
    let (id_a, id_b) = (a.assignment.id().clone(), b.assignment.id().clone());
    let first = make_backend();
    assert_eq!(first.backend(), kind, "backend kind");
    assert!(
        first.find(&id_a).await.expect("find absent").is_none(),
        "absent executor found"
    );
    first
        .delete(&id_a)
        .await
        .expect("deleting an absent executor is a no-op");
    assert!(
        first.record_claimed(&id_a).await.is_err(),
        "claiming an absent executor must fail: the facade would hand out an unrecorded claim"
    );

    let created = first.create(&a).await.expect("create");
    assert_eq!(
        created.assignment, a.assignment,
        "the record carries the assignment"
    );
    assert!(
        !created.claimed && !created.terminal,
        "a new executor carries no marker"
    );
    let again = first.create(&a).await.expect("create again");
    assert_eq!(again.name, created.name, "create is idempotent");
    assert_eq!(
        ids(&first.list().await.expect("list")),
        [id_a.to_string()],
        "one executor per assignment"
    );

    // A restart: the old instance is gone, a new one opens the same store.
    drop(first);
    let second = make_backend();
    let record = found(second.as_ref(), &id_a, "after a restart").await;
    assert_eq!(record.name, created.name);
    assert_eq!(record.assignment, a.assignment, "re-validated assignment");
    assert!(
        record.identity_target.is_some(),
        "the identity target is reported"
    );
    assert_eq!(
        second.create(&a).await.expect("create after restart").name,
        created.name
    );

    second.record_claimed(&id_a).await.expect("claim");
    second
        .record_claimed(&id_a)
        .await
        .expect("claim is idempotent");
    drop(second);
    let third = make_backend();
    let record = found(third.as_ref(), &id_a, "after claiming").await;
    assert!(
        record.claimed && !record.terminal,
        "the claim survives a restart: {record:?}"
    );
    third.mark_terminal(&id_a).await.expect("terminal");
    third
        .mark_terminal(&id_a)
        .await
        .expect("terminal is idempotent");
    drop(third);
    let fourth = make_backend();
    let record = found(fourth.as_ref(), &id_a, "after the terminal marker").await;
    assert!(
        record.claimed && record.terminal,
        "both markers survive a restart: {record:?}"
    );

    fourth.create(&b).await.expect("create b");
    let listed = fourth.list().await.expect("list");
    assert_eq!(ids(&listed), [id_a.to_string(), id_b.to_string()]);
    let listed_a = listed
        .iter()
        .find(|r| r.assignment.id() == &id_a)
        .expect("a listed");
    assert!(
        listed_a.claimed && listed_a.terminal,
        "list carries the markers"
    );
    let listed_b = listed
        .iter()
        .find(|r| r.assignment.id() == &id_b)
        .expect("b listed");
    assert!(!listed_b.claimed && !listed_b.terminal);

    fourth.delete(&id_a).await.expect("delete");
    fourth.delete(&id_a).await.expect("delete is idempotent");
    drop(fourth);
    let fifth = make_backend();
    assert!(
        fifth.find(&id_a).await.expect("find").is_none(),
        "deleted for every instance"
    );
    assert_eq!(ids(&fifth.list().await.expect("list")), [id_b.to_string()]);
    fifth
        .mark_terminal(&id_a)
        .await
        .expect("marking a deleted executor terminal is a no-op");
    fifth.delete(&id_b).await.expect("delete b");
    assert!(fifth.list().await.expect("list").is_empty());
}
