//! The lifecycle reconciler against the mock Gitea and an in-memory backend.

// A panic is how a test (or a benchmark harness) fails.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use gdr_controller::dispatch::Dispatch;
use gdr_controller::gitea::{ClientOptions, Credentials, GiteaClient};
use gdr_controller::lifecycle::{Lifecycle, Pass};
use gdr_core::assignment::{Assignment, DerivationPolicy};
use gdr_core::backend::{Backend, BackendLabels};
use gdr_core::capability::CapabilityKey;
use gdr_core::executor::{ExecutorBackend, ExecutorSpec};
use gdr_core::identity::TrustDomain;
use gdr_core::metadata::MetadataCodec;
use gdr_testkit::memory_backend::MemoryBackend;
use gdr_testkit::mock_gitea::{MockConfig, MockGitea, RunningMock, Status};

const KEY: &[u8] = b"0123456789abcdef0123456789abcdef";
/// Long enough that no test here sees an executor fall silent by accident.
const IDLE: Duration = Duration::from_secs(3600);

struct Setup {
    mock: RunningMock,
    gitea: GiteaClient,
    backend: Arc<MemoryBackend>,
    dispatch: Arc<Dispatch>,
}

async fn setup() -> Setup {
    let mock = MockGitea::start(MockConfig::default()).await.expect("mock");
    let (uuid, token) = mock
        .handle
        .create_runner("ctl", &["self-hosted", "pod"], false);
    let gitea = GiteaClient::new(
        ClientOptions::new(mock.url.clone()),
        Some(&Credentials::new(uuid, token)),
    )
    .expect("client");
    let backend = Arc::new(MemoryBackend::new(Backend::Pod));
    let dispatch = Arc::new(Dispatch::new(
        [(backend.clone() as Arc<dyn ExecutorBackend>, 2)],
        CapabilityKey::new(KEY).expect("key"),
    ));
    Setup {
        mock,
        gitea,
        backend,
        dispatch,
    }
}

async fn running_executor(s: &Setup, claimed: bool) -> Assignment {
    s.mock
        .handle
        .queue_workflow(
            "owner/repo",
            "on: push\njobs:\n  build:\n    runs-on: [self-hosted, pod]\n    steps: []\n",
        )
        .expect("queue");
    let task = s
        .gitea
        .fetch_task(0)
        .await
        .expect("fetch")
        .task
        .into_option()
        .expect("task");
    let policy = DerivationPolicy {
        trust_domain: TrustDomain::new("example.org").expect("td"),
        labels: BackendLabels::default(),
    };
    let assignment = Assignment::from_task(task, &policy).expect("assignment");
    let spec = ExecutorSpec::new(
        &assignment,
        s.dispatch.capability_key().issue(assignment.id()),
        &MetadataCodec::default(),
        "https://facade",
        "spiffe://example.org/controller",
        "pod",
    );
    s.backend.create(&spec).await.expect("create");
    s.backend.start(assignment.id());
    if claimed {
        s.backend
            .record_claimed(assignment.id())
            .await
            .expect("claim");
    }
    assignment
}

#[tokio::test]
async fn a_claimed_executor_that_ends_without_a_result_is_failed_in_gitea_released_and_deleted() {
    let s = setup().await;
    let a = running_executor(&s, true).await;
    s.dispatch.restore(&s.backend.records());
    assert_eq!(s.dispatch.pool_usage(Backend::Pod), (1, 2));
    let lifecycle = Lifecycle::new(s.dispatch.clone(), s.backend.clone(), s.gitea.clone(), IDLE);

    assert_eq!(
        lifecycle.reconcile_once().await.expect("pass"),
        Pass::default(),
        "a running executor is left alone"
    );
    s.backend.finish(a.id(), false);
    assert_eq!(
        lifecycle.reconcile_once().await.expect("pass"),
        Pass {
            deleted: 1,
            failed: 1,
            ..Pass::default()
        }
    );

    let job = s
        .mock
        .handle
        .jobs()
        .into_iter()
        .find(|j| j.task_id == Some(a.id().task_id()))
        .expect("job");
    assert_eq!(job.status, Status::Failure);
    assert!(
        job.task
            .expect("task")
            .log_rows
            .iter()
            .any(|r| r.contains("without reporting a result"))
    );
    assert_eq!(s.dispatch.pool_usage(Backend::Pod), (0, 2));
    assert!(s.backend.records().is_empty());
}

#[tokio::test]
async fn a_terminal_executor_is_deleted_only_once_it_has_finished() {
    let s = setup().await;
    let a = running_executor(&s, true).await;
    s.backend.mark_terminal(a.id()).await.expect("terminal");
    let lifecycle = Lifecycle::new(s.dispatch.clone(), s.backend.clone(), s.gitea.clone(), IDLE);
    assert_eq!(
        lifecycle.reconcile_once().await.expect("pass").deleted,
        0,
        "still flushing: kept"
    );
    s.backend.finish(a.id(), true);
    assert_eq!(
        lifecycle.reconcile_once().await.expect("pass"),
        Pass {
            deleted: 1,
            ..Pass::default()
        }
    );
    let job = s
        .mock
        .handle
        .jobs()
        .into_iter()
        .find(|j| j.task_id == Some(a.id().task_id()))
        .expect("job");
    assert_eq!(
        job.status,
        Status::Running,
        "nothing reported for a task that already has its result"
    );
}

#[tokio::test]
async fn an_unclaimed_finished_executor_is_left_to_its_worker() {
    let s = setup().await;
    let a = running_executor(&s, false).await;
    s.backend.finish(a.id(), false);
    let lifecycle = Lifecycle::new(s.dispatch.clone(), s.backend.clone(), s.gitea.clone(), IDLE);
    assert_eq!(
        lifecycle.reconcile_once().await.expect("pass"),
        Pass::default()
    );
    assert_eq!(s.backend.records().len(), 1);
}

/// DESIGN invariants 10 and 12: one executor that cannot be handled now (its deletion
/// fails) is counted and retried next pass; it never blocks the clean-up of the others.
#[tokio::test]
async fn one_stuck_executor_does_not_block_the_cleanup_of_the_others() {
    let s = setup().await;
    let stuck = running_executor(&s, true).await;
    let other = running_executor(&s, true).await;
    for a in [&stuck, &other] {
        s.backend.mark_terminal(a.id()).await.expect("terminal");
        s.backend.finish(a.id(), true);
    }
    s.backend.fail_deletes_of(stuck.id());
    let lifecycle = Lifecycle::new(s.dispatch.clone(), s.backend.clone(), s.gitea.clone(), IDLE);
    assert_eq!(
        lifecycle.reconcile_once().await.expect("pass"),
        Pass {
            deleted: 1,
            errors: 1,
            ..Pass::default()
        }
    );
    let left: Vec<_> = s
        .backend
        .records()
        .iter()
        .map(|r| r.assignment.id().clone())
        .collect();
    assert_eq!(left, [stuck.id().clone()]);
    s.backend.heal_delete(stuck.id());
    assert_eq!(lifecycle.reconcile_once().await.expect("pass").deleted, 1);
    assert!(s.backend.records().is_empty());
}

/// DESIGN invariant 12: a claimed executor whose runner died while its environment stays up
/// (OpenSandbox keeps a sandbox Running after its process exits) is failed in Gitea once
/// the facade has not heard from it for the idle timeout, then cleaned up.
#[tokio::test]
async fn a_claimed_executor_whose_runner_falls_silent_is_failed_after_the_idle_timeout() {
    let s = setup().await;
    let a = running_executor(&s, true).await;
    s.dispatch.restore(&s.backend.records());
    let idle = Duration::from_millis(400);
    let lifecycle = Lifecycle::new(s.dispatch.clone(), s.backend.clone(), s.gitea.clone(), idle);
    assert_eq!(
        lifecycle.reconcile_once().await.expect("pass"),
        Pass::default(),
        "heard from at restart: not silent yet"
    );
    let pass = gdr_testkit::eventually(
        Duration::from_secs(20),
        "the silent executor to be failed",
        || async {
            let pass = lifecycle.reconcile_once().await.expect("pass");
            (pass.idle == 1).then_some(pass)
        },
    )
    .await;
    assert_eq!(pass.deleted, 1);
    let task = s.mock.handle.task(a.id().task_id()).expect("task");
    assert_eq!(
        task.result,
        gdr_proto::runner::v1::TaskResult::RESULT_FAILURE as i32
    );
    assert!(
        task.log_rows
            .iter()
            .any(|r| r.contains("stopped reporting")),
        "{:?}",
        task.log_rows
    );
    assert!(s.backend.records().is_empty());
    assert_eq!(s.dispatch.pool_usage(Backend::Pod), (0, 2));
}

/// DESIGN invariant 12: while the facade hears from a runner, it is never idle, however
/// long its job runs.
#[tokio::test]
async fn a_runner_that_keeps_reporting_is_never_failed_as_idle() {
    let s = setup().await;
    let a = running_executor(&s, true).await;
    s.dispatch.restore(&s.backend.records());
    let idle = Duration::from_millis(400);
    let lifecycle = Lifecycle::new(s.dispatch.clone(), s.backend.clone(), s.gitea.clone(), idle);
    for _ in 0..8 {
        s.dispatch.heard_from(a.id());
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(
            lifecycle.reconcile_once().await.expect("pass"),
            Pass::default()
        );
    }
    assert_eq!(s.backend.records().len(), 1);
}

/// DESIGN invariant 12: report first. While Gitea refuses the failure report, the executor
/// is kept (and counted as an error); the next pass reports and cleans up.
#[tokio::test]
async fn a_failure_report_gitea_refuses_keeps_the_executor_for_the_next_pass() {
    use gdr_testkit::mock_gitea::{MockFault, RpcMethod};
    let s = setup().await;
    let a = running_executor(&s, true).await;
    s.backend.finish(a.id(), false);
    for _ in 0..2 {
        s.mock.handle.fail_next(
            RpcMethod::UpdateTask,
            MockFault::Connect {
                code: connectrpc::ErrorCode::Unavailable,
                message: "Gitea restarting".into(),
            },
        );
    }
    let lifecycle = Lifecycle::new(s.dispatch.clone(), s.backend.clone(), s.gitea.clone(), IDLE);
    assert_eq!(
        lifecycle.reconcile_once().await.expect("pass"),
        Pass {
            errors: 1,
            ..Pass::default()
        }
    );
    assert_eq!(
        s.backend.records().len(),
        1,
        "kept until Gitea has the failure"
    );
    assert_eq!(
        lifecycle.reconcile_once().await.expect("pass"),
        Pass {
            deleted: 1,
            failed: 1,
            ..Pass::default()
        }
    );
}

/// DESIGN invariant 12: a claimed executor that vanished from the backend (its Pod or
/// sandbox deleted by someone else mid-job) is failed in Gitea with a reason saying so, and
/// its slot is released; an unclaimed one that vanished is left to its worker, which still
/// holds its assignment.
#[tokio::test]
async fn a_claimed_executor_deleted_by_someone_else_is_failed_in_gitea_and_its_slot_released() {
    let s = setup().await;
    let claimed = running_executor(&s, true).await;
    let unclaimed = running_executor(&s, false).await;
    s.dispatch.restore(&s.backend.records());
    s.dispatch.offer(&unclaimed);
    assert_eq!(s.dispatch.pool_usage(Backend::Pod), (2, 2));
    let lifecycle = Lifecycle::new(s.dispatch.clone(), s.backend.clone(), s.gitea.clone(), IDLE);
    assert_eq!(
        lifecycle.reconcile_once().await.expect("pass"),
        Pass::default()
    );
    // Someone else deletes both environments.
    for a in [&claimed, &unclaimed] {
        s.backend.delete(a.id()).await.expect("delete");
    }
    assert_eq!(
        lifecycle.reconcile_once().await.expect("pass"),
        Pass {
            failed: 1,
            ..Pass::default()
        }
    );
    let task = s.mock.handle.task(claimed.id().task_id()).expect("task");
    assert_eq!(
        task.result,
        gdr_proto::runner::v1::TaskResult::RESULT_FAILURE as i32
    );
    assert!(
        task.log_rows
            .iter()
            .any(|r| r.contains("environment is gone")),
        "{:?}",
        task.log_rows
    );
    assert_eq!(
        s.dispatch.pool_usage(Backend::Pod),
        (1, 2),
        "the claimed executor's slot is released, the unclaimed one's is its worker's"
    );
    let other = s.mock.handle.task(unclaimed.id().task_id()).expect("task");
    assert_eq!(other.result, 0, "the unclaimed task is not reported");
    assert_eq!(
        lifecycle.reconcile_once().await.expect("pass"),
        Pass::default(),
        "reported once"
    );
}

/// DESIGN invariant 10 for a backend that cannot see its executor exit (OpenSandbox keeps a
/// sandbox Running after its process ended): a terminal executor that still runs is
/// deleted once the terminal grace has passed, never before; without a grace it waits
/// for the exit.
#[tokio::test]
async fn a_terminal_executor_that_keeps_running_is_deleted_after_the_terminal_grace() {
    let s = setup().await;
    let a = running_executor(&s, true).await;
    s.backend.mark_terminal(a.id()).await.expect("terminal");
    let waiting = Lifecycle::new(s.dispatch.clone(), s.backend.clone(), s.gitea.clone(), IDLE);
    let grace = Duration::from_millis(300);
    let lifecycle = Lifecycle::new(s.dispatch.clone(), s.backend.clone(), s.gitea.clone(), IDLE)
        .with_terminal_grace(grace);
    let started = std::time::Instant::now();
    assert_eq!(
        lifecycle.reconcile_once().await.expect("pass").deleted,
        0,
        "kept within the grace"
    );
    let pass = gdr_testkit::eventually(
        Duration::from_secs(20),
        "the terminal executor to be deleted",
        || async {
            assert_eq!(waiting.reconcile_once().await.expect("pass").deleted, 0);
            let pass = lifecycle.reconcile_once().await.expect("pass");
            (pass.deleted == 1).then_some(pass)
        },
    )
    .await;
    assert!(started.elapsed() >= grace, "not before the grace");
    assert_eq!(pass.failed, 0, "nothing reported: Gitea has the result");
    assert!(s.backend.records().is_empty());
}
