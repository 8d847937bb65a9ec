//! The lifecycle reconciler against the mock Gitea and an in-memory backend.

use std::sync::Arc;
use std::time::Duration;

use gdr_controller::dispatch::Dispatch;
use gdr_controller::lifecycle::{Lifecycle, Pass};
use gdr_controller::queue::{self, StreamQueue};
use gdr_core::assignment::{Assignment, DerivationPolicy, encode_v1};
use gdr_core::backend::{Backend, BackendLabels};
use gdr_core::capability::CapabilityKey;
use gdr_core::executor::{ExecutorBackend, ExecutorSpec};
use gdr_core::identity::{IdentityScheme, TrustDomain};
use gdr_core::metadata::MetadataCodec;
use gdr_gitea::{ClientOptions, Credentials, GiteaClient};
use gdr_testkit::memory_backend::MemoryBackend;
use gdr_testkit::mock_gitea::{MockConfig, MockGitea, RunningMock, Status};
use gdr_testkit::nats_server::NatsServer;

use crate::queue_common::stream_settings;

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

/// Queues a one-job workflow in Gitea and fetches its task as the scheduler would.
async fn fetched(s: &Setup) -> Assignment {
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
        scheme: IdentityScheme::Ref,
        labels: BackendLabels::default(),
    };
    Assignment::from_task(task, &policy).expect("assignment")
}

fn spec_of(s: &Setup, assignment: &Assignment) -> ExecutorSpec {
    ExecutorSpec::new(
        assignment,
        s.dispatch.capability_key().issue(assignment.id()),
        &MetadataCodec::default(),
        "https://facade",
        "spiffe://example.org/controller",
        "pod",
    )
}

async fn running_executor(s: &Setup, claimed: bool) -> Assignment {
    let assignment = fetched(s).await;
    s.backend
        .create(&spec_of(s, &assignment))
        .await
        .expect("create");
    s.backend.start(assignment.id());
    if claimed {
        s.backend
            .record_claimed(assignment.id())
            .await
            .expect("claim");
    }
    assignment
}

/// DESIGN invariant 12: a claimed executor that ends without a result is failed in Gitea with
/// the reason, then its slot is released and it is deleted; a running one is left alone.
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

/// DESIGN invariant 10: a terminal-marked executor is deleted only once it has finished (it may
/// still be flushing), and nothing is reported for a task whose result Gitea has.
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

/// DESIGN invariants 9, 12: an executor that ended before its runner claimed the task is left
/// to its worker, which still holds the unacknowledged assignment and fails it; the reconciler
/// neither reports nor deletes it, so it is reported once.
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

/// DESIGN invariants 10, 12: one executor that cannot be handled now (its deletion fails) is
/// counted and retried next pass; it never blocks the clean-up of the others.
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
/// (OpenSandbox keeps a sandbox Running after its process exits) is failed in Gitea once the
/// facade has not heard from it for the idle timeout, then cleaned up.
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

/// DESIGN invariant 12: while the facade hears from a runner, it is never idle, however long
/// its job runs.
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

/// DESIGN invariant 12: report first. While Gitea refuses the failure report, the executor is
/// kept (and counted as an error); the next pass reports and cleans up.
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

/// Creates, starts and claims an executor of `assignment` (its task need not be ours).
async fn claimed_executor_of(s: &Setup, assignment: &Assignment) {
    let spec = ExecutorSpec::new(
        assignment,
        s.dispatch.capability_key().issue(assignment.id()),
        &MetadataCodec::default(),
        "https://facade",
        "spiffe://example.org/controller",
        "pod",
    );
    s.backend.create(&spec).await.expect("create");
    s.backend.start(assignment.id());
    s.backend
        .record_claimed(assignment.id())
        .await
        .expect("claim");
}

/// DESIGN invariant 12: when Gitea no longer has a task for this runner — it never
/// existed or was removed (`update task: … resource does not exist`), or another runner
/// holds it (`update task: invalid runner for task`) — there is nothing left to report:
/// the executor is deleted and its slot released at once, not retried every pass forever.
#[tokio::test]
async fn an_executor_whose_task_gitea_no_longer_has_is_released_and_deleted_not_retried_forever() {
    let s = setup().await;
    // A task Gitea never handed out.
    let unknown = gdr_testkit::tasks::assignment(4242, "[self-hosted, pod]");
    claimed_executor_of(&s, &unknown).await;
    // A task another runner holds (e.g. the controller was registered anew).
    let (uuid, token) = s
        .mock
        .handle
        .create_runner("other", &["self-hosted", "pod"], false);
    let other = GiteaClient::new(
        ClientOptions::new(s.mock.url.clone()),
        Some(&Credentials::new(uuid, token)),
    )
    .expect("client");
    s.mock
        .handle
        .queue_workflow(
            "owner/repo",
            "on: push\njobs:\n  build:\n    runs-on: [self-hosted, pod]\n    steps: []\n",
        )
        .expect("queue");
    let task = other
        .fetch_task(0)
        .await
        .expect("fetch")
        .task
        .into_option()
        .expect("task");
    let foreign = Assignment::from_task(task, &gdr_testkit::tasks::policy()).expect("assignment");
    claimed_executor_of(&s, &foreign).await;
    s.dispatch.restore(&s.backend.records());
    assert_eq!(s.dispatch.pool_usage(Backend::Pod), (2, 2));
    s.backend.finish(unknown.id(), false);
    s.backend.finish(foreign.id(), false);

    let lifecycle = Lifecycle::new(s.dispatch.clone(), s.backend.clone(), s.gitea.clone(), IDLE);
    assert_eq!(
        lifecycle.reconcile_once().await.expect("pass"),
        Pass {
            deleted: 2,
            failed: 2,
            ..Pass::default()
        }
    );
    assert!(s.backend.records().is_empty(), "both executors deleted");
    assert_eq!(
        s.dispatch.pool_usage(Backend::Pod),
        (0, 2),
        "slots released"
    );
    assert_eq!(
        s.mock.handle.task(foreign.id().task_id()).map(|t| t.status),
        Some(Status::Running),
        "another runner's task is left to that runner"
    );
}

/// DESIGN invariant 12: a claimed executor that is gone from the backend (a Pod deleted by
/// someone else) is failed in Gitea, what is left of it deleted, and its slot released;
/// nothing else would ever report it.
#[tokio::test]
async fn a_claimed_executor_gone_from_the_backend_is_failed_in_gitea_and_its_slot_released() {
    let s = setup().await;
    let gone = running_executor(&s, true).await;
    let kept = running_executor(&s, true).await;
    s.dispatch.restore(&s.backend.records());
    assert_eq!(s.dispatch.pool_usage(Backend::Pod), (2, 2));
    let lifecycle = Lifecycle::new(s.dispatch.clone(), s.backend.clone(), s.gitea.clone(), IDLE);
    // Someone else deletes it.
    s.backend.delete(gone.id()).await.expect("delete");
    assert_eq!(
        lifecycle.reconcile_once().await.expect("pass"),
        Pass {
            gone: 1,
            ..Pass::default()
        }
    );
    let task = s.mock.handle.task(gone.id().task_id()).expect("task");
    assert_eq!(
        task.result,
        gdr_proto::runner::v1::TaskResult::RESULT_FAILURE as i32
    );
    assert!(
        task.log_rows
            .iter()
            .any(|r| r.contains("is gone from the pod backend")),
        "{:?}",
        task.log_rows
    );
    assert_eq!(s.dispatch.pool_usage(Backend::Pod), (1, 2));
    assert_eq!(
        s.mock.handle.task(kept.id().task_id()).map(|t| t.status),
        Some(Status::Running),
        "the executor that is still there is left alone"
    );
    assert_eq!(
        lifecycle.reconcile_once().await.expect("pass"),
        Pass::default(),
        "reported once"
    );
}

/// DESIGN invariant 12: an executor that disappears after Gitea accepted its runner's result
/// (a Pod deleted with its grace period: the runner reported the cancellation first) has
/// what it left removed at the next pass, not at the backend's next sweep, and its
/// assignment is forgotten: a later pass does nothing more.
#[tokio::test]
async fn an_executor_gone_after_its_result_has_its_leftovers_removed_at_the_next_pass() {
    let s = setup().await;
    let a = running_executor(&s, true).await;
    s.dispatch.restore(&s.backend.records());
    let auth = s
        .dispatch
        .authorize(
            a.id().as_str(),
            s.dispatch.capability_key().issue(a.id()).expose(),
            a.identity().spiffe_id(),
        )
        .expect("authorized");
    s.dispatch.finish(&auth).await.expect("finished");
    s.backend.vanish(a.id());
    let lifecycle = Lifecycle::new(s.dispatch.clone(), s.backend.clone(), s.gitea.clone(), IDLE);
    let before = s.backend.delete_calls();
    assert_eq!(
        lifecycle.reconcile_once().await.expect("pass"),
        Pass {
            deleted: 1,
            ..Pass::default()
        }
    );
    assert_eq!(
        s.backend.delete_calls() - before,
        1,
        "its leftovers are deleted"
    );
    assert_eq!(
        lifecycle.reconcile_once().await.expect("pass"),
        Pass::default(),
        "forgotten"
    );
    assert_eq!(s.backend.delete_calls() - before, 1);
}

/// A backend's change signal (the Pod watch) runs a pass at once: an executor that ended
/// is reported without waiting for the timer.
#[tokio::test]
async fn a_wake_runs_a_pass_at_once_instead_of_at_the_next_interval() {
    use gdr_controller::shutdown::shutdown_channel;
    use gdr_controller::wake::Wake;
    let s = setup().await;
    let done = running_executor(&s, true).await;
    let ending = running_executor(&s, true).await;
    s.backend.mark_terminal(done.id()).await.expect("terminal");
    s.backend.finish(done.id(), true);
    s.dispatch.restore(&s.backend.records());
    let (tx, rx) = tokio::sync::watch::channel(0u64);
    let lifecycle = Lifecycle::new(s.dispatch.clone(), s.backend.clone(), s.gitea.clone(), IDLE)
        .with_wake(Wake::from(rx));
    let (stop, shutdown) = shutdown_channel();
    // The timer alone would run the next pass in an hour.
    let run = tokio::spawn(lifecycle.run(Duration::from_secs(3600), shutdown));
    gdr_testkit::until(Duration::from_secs(20), "the first pass", || async {
        s.backend.deleted() == 1
    })
    .await;
    s.backend.finish(ending.id(), false);
    tx.send_modify(|n| *n += 1);
    s.mock
        .handle
        .wait_for(
            |m| {
                m.task(ending.id().task_id())
                    .is_some_and(|t| t.status == Status::Failure)
            },
            Duration::from_secs(20),
        )
        .await
        .expect("the woken pass reports the ended executor");
    stop.trigger();
    run.await.expect("stops");
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

/// A real JetStream stream, as the workers and the held reconciler read it.
async fn stream() -> (NatsServer, async_nats::jetstream::Context) {
    let nats = NatsServer::start().await.expect("nats-server");
    let js = async_nats::jetstream::new(async_nats::connect(nats.url()).await.expect("connect"));
    queue::ensure_stream(&js, &stream_settings())
        .await
        .expect("stream");
    (nats, js)
}

/// An executor of a task this controller fetched, created `age` ago (by an earlier
/// controller) and never claimed.
async fn unclaimed_executor_created(s: &Setup, age: Duration) -> Assignment {
    let assignment = fetched(s).await;
    s.backend
        .insert(&spec_of(s, &assignment), std::time::SystemTime::now() - age);
    s.backend.start(assignment.id());
    assignment
}

fn stream_queue(js: &async_nats::jetstream::Context) -> Arc<StreamQueue> {
    Arc::new(StreamQueue::new(
        js.clone(),
        stream_settings(),
        Backend::Pod,
    ))
}

const START_DEADLINE: Duration = Duration::from_secs(60);
/// Longer ago than [`START_DEADLINE`].
const LONG_AGO: Duration = Duration::from_secs(120);

/// DESIGN invariant 12: an unclaimed executor past its start deadline whose assignment left the
/// queue (terminated as expired after a long outage, dropped by a stream limit) has no worker
/// that could fail it: it is failed in Gitea with the reason, deleted and its slot released,
/// once. One whose assignment is still queued, on its subject or held, is left to the worker
/// (or the held reconciler) that fails it, and one within its deadline is left to start.
#[tokio::test]
async fn an_unclaimed_executor_past_its_start_deadline_whose_assignment_left_the_queue_is_failed_and_deleted()
 {
    let s = setup().await;
    let (_nats, js) = stream().await;
    let orphan = unclaimed_executor_created(&s, LONG_AGO).await;
    let young = unclaimed_executor_created(&s, Duration::ZERO).await;
    let queued = unclaimed_executor_created(&s, LONG_AGO).await;
    let held = unclaimed_executor_created(&s, LONG_AGO).await;
    queue::publish(
        &js,
        &stream_settings(),
        Backend::Pod,
        queued.id().as_str(),
        encode_v1(&queued).expect("encode").into(),
    )
    .await
    .expect("publish");
    js.publish(
        stream_settings().held_subject(Backend::Pod),
        encode_v1(&held).expect("encode").into(),
    )
    .await
    .expect("send")
    .await
    .expect("stored");
    s.dispatch.restore(&s.backend.records());
    assert_eq!(s.dispatch.pool_usage(Backend::Pod), (4, 2));
    let lifecycle = Lifecycle::new(s.dispatch.clone(), s.backend.clone(), s.gitea.clone(), IDLE)
        .with_unstarted(START_DEADLINE, stream_queue(&js));

    assert_eq!(
        lifecycle.reconcile_once().await.expect("pass"),
        Pass {
            unstarted: 1,
            deleted: 1,
            ..Pass::default()
        }
    );
    let task = s.mock.handle.task(orphan.id().task_id()).expect("task");
    assert_eq!(
        task.result,
        gdr_proto::runner::v1::TaskResult::RESULT_FAILURE as i32
    );
    assert!(
        task.log_rows
            .iter()
            .any(|r| r.contains("did not start the job within 1m")
                && r.contains("queued assignment is gone")),
        "{:?}",
        task.log_rows
    );
    for kept in [&young, &queued, &held] {
        assert_eq!(
            s.mock.handle.task(kept.id().task_id()).map(|t| t.status),
            Some(Status::Running),
            "{} is not this reconciler's to fail",
            kept.id()
        );
    }
    let left: Vec<_> = s
        .backend
        .records()
        .iter()
        .map(|r| r.assignment.id().clone())
        .collect();
    assert!(
        !left.contains(orphan.id()),
        "the orphan is deleted: {left:?}"
    );
    assert_eq!(left.len(), 3);
    assert_eq!(
        s.dispatch.pool_usage(Backend::Pod),
        (3, 2),
        "its slot is released"
    );
    assert_eq!(
        lifecycle.reconcile_once().await.expect("pass"),
        Pass::default(),
        "reported once"
    );
}

/// DESIGN invariants 12, 20: an unclaimed executor whose assignment left the queue after its
/// job was failed in Gitea already (the held reconciler fails an assignment held too long and
/// records it finished) is deleted without a second report.
#[tokio::test]
async fn an_unstarted_executor_whose_job_was_failed_before_is_deleted_without_a_second_report() {
    let s = setup().await;
    let (_nats, js) = stream().await;
    let finished =
        queue::FinishedAssignments::open(&js, "TEST_FINISHED", Duration::from_secs(3600), true)
            .await
            .expect("bucket");
    let dispatch = Arc::new(
        Dispatch::new(
            [(s.backend.clone() as Arc<dyn ExecutorBackend>, 2)],
            CapabilityKey::new(KEY).expect("key"),
        )
        .with_finished(finished),
    );
    let a = unclaimed_executor_created(&s, LONG_AGO).await;
    dispatch.record_finished(a.id()).await.expect("recorded");
    dispatch.restore(&s.backend.records());
    let lifecycle = Lifecycle::new(dispatch.clone(), s.backend.clone(), s.gitea.clone(), IDLE)
        .with_unstarted(START_DEADLINE, stream_queue(&js));
    assert_eq!(
        lifecycle.reconcile_once().await.expect("pass"),
        Pass {
            unstarted: 1,
            deleted: 1,
            ..Pass::default()
        }
    );
    assert_eq!(
        s.mock.handle.task(a.id().task_id()).map(|t| t.status),
        Some(Status::Running),
        "reported a second time"
    );
    assert!(s.backend.records().is_empty());
    assert_eq!(dispatch.pool_usage(Backend::Pod), (0, 2));
}

/// DESIGN invariant 12: while the queue cannot be read, nobody can tell whether a worker still
/// holds an overdue executor's assignment: it is kept (counted as an error) and failed once
/// the queue answers.
#[tokio::test]
async fn an_unstarted_executor_is_kept_while_the_queue_cannot_tell_whether_its_assignment_waits() {
    let s = setup().await;
    let (mut nats, js) = stream().await;
    let a = unclaimed_executor_created(&s, LONG_AGO).await;
    s.dispatch.restore(&s.backend.records());
    let lifecycle = Lifecycle::new(s.dispatch.clone(), s.backend.clone(), s.gitea.clone(), IDLE)
        .with_unstarted(START_DEADLINE, stream_queue(&js));
    nats.kill().await.expect("kill");
    assert_eq!(
        lifecycle.reconcile_once().await.expect("pass"),
        Pass {
            errors: 1,
            ..Pass::default()
        }
    );
    assert_eq!(s.backend.records().len(), 1, "kept");
    assert_eq!(
        s.mock.handle.task(a.id().task_id()).map(|t| t.status),
        Some(Status::Running)
    );
    nats.restart().await.expect("restart");
    let pass = gdr_testkit::eventually(
        Duration::from_secs(20),
        "the executor failed once the queue answers",
        || async {
            let pass = lifecycle.reconcile_once().await.expect("pass");
            (pass.unstarted == 1).then_some(pass)
        },
    )
    .await;
    assert_eq!(pass.deleted, 1);
    assert!(s.backend.records().is_empty());
}

/// A queue that never answers: a stream so flooded or slow that reading it takes forever.
struct Stalled;

#[async_trait::async_trait]
impl gdr_controller::ports::QueuedAssignments for Stalled {
    async fn queued(
        &self,
        _ids: &std::collections::HashSet<gdr_core::assignment::AssignmentId>,
    ) -> Result<std::collections::HashSet<gdr_core::assignment::AssignmentId>, queue::QueueError>
    {
        std::future::pending().await
    }
}

/// DESIGN invariants 12, 21 (issue 37): an envelope anyone could publish, naming an overdue
/// executor's assignment without an ID that authenticates, does not keep that executor:
/// it is failed and deleted; one whose queued envelope authenticates is left to its worker.
#[tokio::test]
async fn only_an_authenticated_envelope_keeps_an_overdue_executor_as_queued() {
    use gdr_core::assignment::{TaskKey, TaskKeyring, encode_v2_with_id_mac};
    let s = setup().await;
    let (_nats, js) = stream().await;
    let forged = unclaimed_executor_created(&s, LONG_AGO).await;
    let genuine = unclaimed_executor_created(&s, LONG_AGO).await;
    let id_key = CapabilityKey::new(KEY).expect("key").envelope_id_key();
    let keyring = TaskKeyring::new(
        TaskKey::from_file_contents(
            b"1111111111111111111111111111111111111111111111111111111111111111",
        )
        .expect("task key"),
        Vec::new(),
    );
    for (a, payload) in [
        (&forged, encode_v1(&forged).expect("encode")),
        (
            &genuine,
            encode_v2_with_id_mac(&genuine, &keyring, &id_key).expect("encode"),
        ),
    ] {
        queue::publish(
            &js,
            &stream_settings(),
            Backend::Pod,
            a.id().as_str(),
            payload.into(),
        )
        .await
        .expect("publish");
    }
    s.dispatch.restore(&s.backend.records());
    let queue = StreamQueue::new(js.clone(), stream_settings(), Backend::Pod)
        .authenticated_by(id_key, false);
    let lifecycle = Lifecycle::new(s.dispatch.clone(), s.backend.clone(), s.gitea.clone(), IDLE)
        .with_unstarted(START_DEADLINE, Arc::new(queue));
    assert_eq!(
        lifecycle.reconcile_once().await.expect("pass"),
        Pass {
            unstarted: 1,
            deleted: 1,
            ..Pass::default()
        }
    );
    let left: Vec<_> = s
        .backend
        .records()
        .iter()
        .map(|r| r.assignment.id().clone())
        .collect();
    assert_eq!(left, vec![genuine.id().clone()], "the forged one is failed");
}

/// DESIGN invariants 12, 21 (issue 37): the queue read behind overdue executors stops at
/// its cap; with messages left unread nobody can tell their assignment is gone, so they
/// are kept (an error of the pass), not failed.
#[tokio::test]
async fn a_queue_too_long_to_read_whole_keeps_overdue_executors_and_counts_an_error() {
    let s = setup().await;
    let (_nats, js) = stream().await;
    let overdue = unclaimed_executor_created(&s, LONG_AGO).await;
    for n in 0..12 {
        js.publish(
            stream_settings().subject(Backend::Pod),
            format!("{{\"junk\":{n}}}").into(),
        )
        .await
        .expect("send")
        .await
        .expect("stored");
    }
    s.dispatch.restore(&s.backend.records());
    let queue = StreamQueue::new(js.clone(), stream_settings(), Backend::Pod)
        .with_limits(queue::ReadLimits { page: 4, max: 10 });
    let lifecycle = Lifecycle::new(s.dispatch.clone(), s.backend.clone(), s.gitea.clone(), IDLE)
        .with_unstarted(START_DEADLINE, Arc::new(queue));
    assert_eq!(
        lifecycle.reconcile_once().await.expect("pass"),
        Pass {
            errors: 1,
            ..Pass::default()
        }
    );
    assert_eq!(
        s.mock.handle.task(overdue.id().task_id()).map(|t| t.status),
        Some(Status::Running),
        "kept"
    );
}

/// DESIGN invariant 12 (issue 37): a queue that does not answer does not stall the
/// lifecycle pass: after the read timeout the overdue executor is kept for the next pass
/// and the pass ends with an error counted.
#[tokio::test]
async fn a_queue_that_never_answers_does_not_stall_the_lifecycle_pass() {
    let s = setup().await;
    let _overdue = unclaimed_executor_created(&s, LONG_AGO).await;
    s.dispatch.restore(&s.backend.records());
    let lifecycle = Lifecycle::new(s.dispatch.clone(), s.backend.clone(), s.gitea.clone(), IDLE)
        .with_unstarted(START_DEADLINE, Arc::new(Stalled))
        .with_queue_read_timeout(Duration::from_millis(300));
    let pass = tokio::time::timeout(Duration::from_secs(5), lifecycle.reconcile_once())
        .await
        .expect("the pass ends")
        .expect("pass");
    assert_eq!(
        pass,
        Pass {
            errors: 1,
            ..Pass::default()
        }
    );
    assert_eq!(s.backend.records().len(), 1, "kept");
}
