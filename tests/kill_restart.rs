//! Kill-and-restart: the controller process is SIGKILLed at a named fail point, then
//! started again; each test asserts what became of the job: no task runs twice, nothing
//! is lost outside the documented fetch→publish window, no executor or slot leaks.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use gdr_testkit::controller::{ControllerFixture, listener};
use gdr_testkit::fake_kube::{FakeKube, ServiceAccount};
use gdr_testkit::local_controller::{
    LocalController, Stop, executor_logs, killed_at_its_fail_point, started_in_a_runner, stop,
};
use gdr_testkit::mock_gitea::{JobId, MockConfig, MockGitea, Status};
use gdr_testkit::nats_server::{AckDropper, NatsServer, servers_on};
use gdr_testkit::service::{ReadyService, is_ready};
use gdr_testkit::standin_runner::GAVE_UP;
use gdr_testkit::until;

const WAIT: Duration = Duration::from_secs(60);
const BIN: &str = env!("CARGO_BIN_EXE_gitea-dynamic-runner");
const STANDIN: &str = env!("CARGO_BIN_EXE_gitea-runner-standin");
/// What the executor logs when it starts holding its runner's reports.
const HOLDING: &str = "holding them and answering the runner";
/// What the executor logs when it sends a runner's call again instead of failing it.
const RESENDING: &str = "sending it again";
/// What the executor logs when it starts a runner again that exited before its claim.
const RESTARTING_RUNNER: &str = "the runner exited before its task was claimed; starting it again";

/// Which NATS the controller uses.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Nats {
    /// A server of the test's own (the controller connects with `nats_url`).
    External,
    /// The controller's embedded, supervised server (single-host mode).
    Embedded,
}

/// A controller on this host with the pod backend only; its incarnations keep reaching
/// the same facade address across restarts.
struct Setup {
    nats: Option<NatsServer>,
    local: LocalController,
}

impl std::ops::Deref for Setup {
    type Target = LocalController;

    fn deref(&self) -> &LocalController {
        &self.local
    }
}

impl std::ops::DerefMut for Setup {
    fn deref_mut(&mut self) -> &mut LocalController {
        &mut self.local
    }
}

impl Setup {
    async fn new() -> Self {
        Self::with(
            MockConfig::default().with_zombie_timeout(Duration::from_secs(3)),
            Nats::External,
            |f| f,
        )
        .await
    }

    async fn with(
        mock: MockConfig,
        nats: Nats,
        tweak: impl FnOnce(ControllerFixture) -> ControllerFixture,
    ) -> Self {
        let server = match nats {
            Nats::External => Some(NatsServer::start().await.expect("nats")),
            Nats::Embedded => None,
        };
        let url = server.as_ref().map(NatsServer::url);
        let local = LocalController::start(mock, BIN.as_ref(), STANDIN.as_ref(), |f| {
            let f = f
                .set("components", "scheduler,pod-worker")
                .set("pod_capacity", 2u32)
                .set("vm_capacity", 0u32)
                .set("heartbeat_interval", "1s")
                .set("nats_ack_wait", "3s");
            tweak(match url {
                Some(url) => f.set("nats_url", url),
                None => f.set("nats_server_binary", NatsServer::binary().as_path()),
            })
        })
        .await;
        Setup {
            nats: server,
            local,
        }
    }

    fn controller(&self, failpoint: Option<&str>) -> tokio::process::Child {
        let env: Vec<(&str, &str)> = failpoint
            .map(|p| vec![("GDR_FAILPOINT", p)])
            .unwrap_or_default();
        self.spawn(&env)
    }

    /// The message IDs (assignment IDs) of the assignments in the controller's stream,
    /// read from the test's own NATS server.
    async fn stored_message_ids(&self) -> Vec<String> {
        let nats = self.nats.as_ref().expect("an external NATS server");
        let client = async_nats::connect(nats.url()).await.expect("connect");
        let js = async_nats::jetstream::new(client);
        let mut stream = js.get_stream("CI_RUNNER").await.expect("the stream");
        let last = stream.info().await.expect("info").state.last_sequence;
        let mut ids = Vec::new();
        for sequence in 1..=last {
            if let Ok(message) = stream.get_raw_message(sequence).await {
                let id = message.headers.get("Nats-Msg-Id").expect("a message ID");
                ids.push(id.as_str().to_owned());
            }
        }
        ids
    }

    /// A runner that waits at `<gate>/go` before it starts (so the test can stop the
    /// controller right before the runner's first `Declare`), then runs the stand-in
    /// with `env`. Returns the gate directory and the script.
    fn gated_runner(fixture: &ControllerFixture, env: &[(&str, &str)]) -> (PathBuf, PathBuf) {
        use std::os::unix::fs::PermissionsExt;
        let gate = fixture.path().join("gate");
        std::fs::create_dir_all(&gate).expect("gate");
        let exports: String = env
            .iter()
            .map(|(k, v)| format!("export {k}={v}\n"))
            .collect();
        let script = fixture.file(
            "gate/runner.sh",
            &format!(
                "#!/bin/sh\ntouch '{gate}/started'\nwhile [ ! -e '{gate}/go' ]; do sleep 0.05; done\n{exports}exec '{STANDIN}' \"$@\"\n",
                gate = gate.display()
            ),
        );
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o700)).expect("chmod");
        (gate, script)
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn killed_after_a_fetch_the_task_is_lost_in_the_documented_window_and_failed_by_gitea() {
    let s = Setup::new().await;
    let job = s.queue("standin:success");
    let mut first = s.controller(Some("after-fetch"));
    killed_at_its_fail_point(&mut first).await;
    let mut second = s.controller(None);
    // Gitea handed the task out and nobody stored it: its zombie clean-up fails it.
    s.status(job, Status::Failure).await;
    assert_eq!(s.runs_of(job), 0, "the lost task never ran");
    s.no_executor_left().await;
    let _ = second.start_kill();
}

/// DESIGN invariants 2 and 4: killed right after a publish is handed to the NATS client
/// (its acknowledgement outstanding, the bytes usually not yet on the wire), the controller
/// loses only what had not reached the stream: each task the stream holds runs exactly once
/// after the restart, a task fetched but not stored is the documented fetch→store window
/// (Gitea fails it at its zombie timeout, it never runs), and a job not yet fetched runs
/// once. The stored case is made certain by the next test.
#[tokio::test(flavor = "multi_thread")]
async fn killed_with_a_publish_ack_outstanding_every_stored_task_runs_once_and_only_unstored_ones_are_lost()
 {
    let s = Setup::new().await;
    let jobs = [s.queue("standin:success"), s.queue("standin:success")];
    let mut first = s.controller(Some("publish-sent"));
    killed_at_its_fail_point(&mut first).await;
    let stored = s.stored_message_ids().await;
    // Read before the restart, whose controller fetches what is still waiting.
    let fetched: Vec<Option<i64>> = jobs
        .iter()
        .map(|j| s.mock.handle.job(*j).expect("job").task_id)
        .collect();
    eprintln!("killed with an ack outstanding: tasks fetched {fetched:?}, stored {stored:?}");
    let mut second = s.controller(None);
    for (job, task_id) in jobs.into_iter().zip(fetched) {
        let lost = task_id.is_some_and(|t| !stored.contains(&format!("gitea-task-{t}")));
        if lost {
            s.status(job, Status::Failure).await;
            assert_eq!(s.runs_of(job), 0, "the unstored task never ran");
        } else {
            s.status(job, Status::Success).await;
            assert_eq!(s.runs_of(job), 1, "a stored or unfetched task runs once");
        }
    }
    s.no_executor_left().await;
    let _ = second.start_kill();
}

/// DESIGN invariants 2 and 4: killed while a stored assignment's acknowledgement is
/// outstanding (a proxy drops JetStream's publish acks on their way back, so the controller
/// never counted the task handed off and was about to publish it again), the job still runs
/// exactly once: what reached the stream is not lost with the controller.
#[tokio::test(flavor = "multi_thread")]
async fn killed_while_a_stored_assignments_ack_is_outstanding_the_job_still_runs_once() {
    let mut s = Setup::new().await;
    let direct = s.nats.as_ref().expect("an external NATS server").url();
    let proxy = AckDropper::start(&direct).await;
    proxy.drop_acks(true);
    s.fixture.replace("nats_url", proxy.url());
    let job = s.queue("standin:success");
    let mut first = s.controller(Some("publish-unacknowledged"));
    killed_at_its_fail_point(&mut first).await;
    assert!(
        proxy.dropped() >= 1,
        "the server stored the assignment and acknowledged it; the ack was lost"
    );

    s.fixture.replace("nats_url", direct);
    let mut second = s.controller(None);
    s.status(job, Status::Success).await;
    assert_eq!(s.runs_of(job), 1);
    s.no_executor_left().await;
    let _ = second.start_kill();
}

#[tokio::test(flavor = "multi_thread")]
async fn killed_after_the_publish_the_restarted_controller_runs_the_job_once() {
    let s = Setup::new().await;
    let job = s.queue("standin:success");
    let mut first = s.controller(Some("after-publish"));
    killed_at_its_fail_point(&mut first).await;
    let mut second = s.controller(None);
    s.status(job, Status::Success).await;
    assert_eq!(s.runs_of(job), 1);
    s.no_executor_left().await;
    let _ = second.start_kill();
}

#[tokio::test(flavor = "multi_thread")]
async fn killed_after_the_executor_was_created_the_restarted_controller_adopts_it_and_runs_the_job_once()
 {
    let s = Setup::new().await;
    let job = s.queue("standin:success");
    let mut first = s.controller(Some("after-create"));
    killed_at_its_fail_point(&mut first).await;
    assert_eq!(s.executors(), 1, "the executor outlives the controller");
    let mut second = s.controller(None);
    s.status(job, Status::Success).await;
    assert_eq!(s.runs_of(job), 1);
    s.no_executor_left().await;
    let _ = second.start_kill();
}

#[tokio::test(flavor = "multi_thread")]
async fn killed_after_the_claim_the_unanswered_runner_is_stopped_and_the_task_failed_not_left_hanging()
 {
    let s = Setup::new().await;
    let job = s.queue("standin:success");
    let mut first = s.controller(Some("after-claim"));
    killed_at_its_fail_point(&mut first).await;
    let mut second = s.controller(None);
    s.status(job, Status::Failure).await;
    assert_eq!(
        s.runs_of(job),
        0,
        "the task was handed out to nobody and never ran"
    );
    s.no_executor_left().await;
    let _ = second.start_kill();
}

#[tokio::test(flavor = "multi_thread")]
async fn killed_after_gitea_accepted_the_result_the_restarted_controller_marks_and_cleans_up() {
    let s = Setup::new().await;
    let job = s.queue("standin:success");
    let mut first = s.controller(Some("after-terminal-accepted"));
    killed_at_its_fail_point(&mut first).await;
    s.status(job, Status::Success).await;
    let mut second = s.controller(None);
    s.no_executor_left().await;
    assert_eq!(s.runs_of(job), 1);
    assert_eq!(
        s.mock.handle.job(job).map(|j| j.status),
        Some(Status::Success),
        "the result stands"
    );
    let _ = second.start_kill();
}

#[tokio::test(flavor = "multi_thread")]
async fn killed_after_the_terminal_marker_the_restarted_controller_deletes_the_executor() {
    let s = Setup::new().await;
    let job = s.queue("standin:success");
    let mut first = s.controller(Some("after-terminal-marker"));
    killed_at_its_fail_point(&mut first).await;
    s.status(job, Status::Success).await;
    let mut second = s.controller(None);
    s.no_executor_left().await;
    assert_eq!(s.runs_of(job), 1);
    let _ = second.start_kill();
}

// ----- issue 9: restarts, upgrades and failovers cost no job ---------------------------

/// DESIGN invariant 19, row (a): the embedded nats-server dies with its controller. After
/// a SIGKILL no server is left on the store; a server left over there anyway (by a
/// controller whose parent-death signal was never armed) is stopped before the next
/// controller starts its own, so the store has exactly one; a second controller on the
/// same store is refused; a stopped controller leaves none.
#[tokio::test(flavor = "multi_thread")]
async fn the_embedded_nats_server_dies_with_its_controller_and_a_store_never_has_two() {
    let s = Setup::with(MockConfig::default(), Nats::Embedded, |f| f).await;
    let store = s.fixture.state_dir().join("nats");
    let one_server = |what: &'static str| {
        let store = store.clone();
        async move {
            until(WAIT, what, || {
                let n = servers_on(&store).len();
                async move { n == 1 }
            })
            .await;
            servers_on(&store)[0]
        }
    };

    let mut first = s.controller(None);
    s.ready().await;
    let first_server = one_server("the first controller's server").await;
    // Single-host mode seals envelopes with a key of its own (DESIGN invariant 5).
    let key = s.fixture.state_dir().join("task-encryption.key");
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(&key)
            .expect("the generated task key")
            .permissions(),
    );
    assert_eq!(mode & 0o777, 0o600);
    stop(&mut first, Stop::Kill).await;
    until(
        WAIT,
        "the killed controller's server to die with it",
        || {
            let left = servers_on(&store);
            async move { left.is_empty() }
        },
    )
    .await;

    let mut leftover = NatsServer::start_on(&store)
        .await
        .expect("a leftover server");
    assert_eq!(servers_on(&store), vec![leftover.pid().expect("pid")]);
    let mut second = s.controller(None);
    s.ready().await;
    let second_server = one_server("exactly one server on the store").await;
    assert_ne!(second_server, first_server);
    assert_ne!(
        Some(second_server),
        leftover.pid(),
        "the leftover was replaced"
    );
    assert!(leftover.exited(), "the leftover server was stopped");
    let job = s.queue("standin:success");
    s.status(job, Status::Success).await;

    // A second controller on the same store is refused and starts no server.
    let (facade, health) = (listener(), listener());
    let mut intruder = s.fixture.spawn(BIN.as_ref(), &facade, &health, &[]);
    let status = tokio::time::timeout(WAIT, intruder.wait())
        .await
        .expect("the second controller exits")
        .expect("wait");
    assert!(!status.success());
    assert!(
        s.fixture
            .log()
            .contains("in use by another running controller"),
        "{}",
        s.fixture.log()
    );
    assert_eq!(servers_on(&store), vec![second_server]);

    assert_eq!(
        s.fixture
            .log()
            .matches("generated the task encryption key")
            .count(),
        1,
        "the key is generated once and reused"
    );
    stop(&mut second, Stop::Term).await;
    assert!(
        servers_on(&store).is_empty(),
        "a stopped controller leaves no server: {:?}",
        servers_on(&store)
    );
}

/// DESIGN invariant 19, row (b): the controller goes away just before the runner's first
/// `Declare` and stays away for several seconds; the executor's proxy holds the `Declare`
/// instead of answering 502, and the job succeeds once the controller is back.
async fn outage_before_the_first_declare(how: Stop, runner_env: &[(&str, &str)], held: &str) {
    let mut gate = PathBuf::new();
    let mut s = Setup::with(MockConfig::default(), Nats::External, |f| {
        let (dir, script) = Setup::gated_runner(&f, runner_env);
        gate = dir;
        f.set("runner_binary", script.as_path())
    })
    .await;
    let mut first = s.controller(None);
    let job = s.queue("standin:success");
    let started = gate.join("started");
    until(WAIT, "the runner to start", || {
        let exists = started.exists();
        async move { exists }
    })
    .await;
    stop(&mut first, how).await;
    s.close_facade();
    std::fs::write(gate.join("go"), b"").expect("open the gate");
    s.executors_logged(held, 1).await;
    // The outage itself (a scenario parameter, not a wait for state): several seconds
    // more with the runner's call held.
    tokio::time::sleep(OUTAGE).await;
    s.reopen_facade().await;
    let mut second = s.controller(None);
    s.status(job, Status::Success).await;
    assert_eq!(s.runs_of(job), 1);
    s.no_executor_left().await;
    let _ = second.start_kill();
}

/// How long row (b) keeps the controller away after the runner's call is held.
const OUTAGE: Duration = Duration::from_secs(5);

/// DESIGN invariant 19, row (b), SIGKILL.
#[tokio::test(flavor = "multi_thread")]
async fn a_controller_killed_just_before_the_runners_first_declare_costs_no_job() {
    outage_before_the_first_declare(Stop::Kill, &[], RESENDING).await;
}

/// DESIGN invariant 19, row (b), SIGTERM (a graceful stop, e.g. an upgrade).
#[tokio::test(flavor = "multi_thread")]
async fn a_controller_stopped_just_before_the_runners_first_declare_costs_no_job() {
    outage_before_the_first_declare(Stop::Term, &[], RESENDING).await;
}

/// DESIGN invariant 19, row (b), outage longer than the runner's own request timeout: the
/// runner's `Declare` fails and it exits before its task was claimed, so the executor
/// starts it again (with backoff) until the controller is back.
#[tokio::test(flavor = "multi_thread")]
async fn a_runner_whose_declare_times_out_during_an_outage_is_started_again_and_the_job_succeeds() {
    outage_before_the_first_declare(
        Stop::Kill,
        &[("STANDIN_REQUEST_TIMEOUT_MS", "1500")],
        RESTARTING_RUNNER,
    )
    .await;
}

/// How long row (c) keeps the controller down: far longer than the official runner's
/// `report_close_timeout` (10 s), which the stand-in keeps.
const LONG_OUTAGE: Duration = Duration::from_secs(60);

/// DESIGN invariant 19, row (c): the controller is down for 60 s while jobs end. The
/// runners' final reports are answered by their executors (the runner itself would give
/// up after 10 s), and once the controller is back every job's real result and every log
/// row reach Gitea, in order, each once.
#[tokio::test(flavor = "multi_thread")]
async fn a_controller_down_longer_than_the_runners_close_timeout_loses_no_result_and_no_row() {
    let mut s = Setup::with(MockConfig::default(), Nats::External, |f| f).await;
    let mut first = s.controller(None);
    let jobs = [s.queue("standin:sleep 3000"), s.queue("standin:sleep 5000")];
    for job in jobs {
        s.runner_started(job).await;
    }
    let down = tokio::time::Instant::now();
    stop(&mut first, Stop::Kill).await;
    s.close_facade();
    // Both jobs end (their runners exit) while the controller is down.
    s.executors_logged("the one-shot runner exited", 2).await;
    tokio::time::sleep(LONG_OUTAGE.saturating_sub(down.elapsed())).await;
    s.reopen_facade().await;
    let mut second = s.controller(None);
    for (job, ms) in jobs.iter().zip([3000, 5000]) {
        s.status(*job, Status::Success).await;
        let task = s.mock.handle.job(*job).and_then(|j| j.task).expect("task");
        let expected = vec![
            format!(
                "{} {} script Sleep({:?})",
                gdr_testkit::standin_runner::TASK_STARTED,
                task.id,
                Duration::from_millis(ms)
            ),
            format!("slept {:?}", Duration::from_millis(ms)),
        ];
        assert_eq!(task.log_rows, expected, "every row, in order, once");
        assert!(task.log_archived, "the held no_more reached Gitea");
    }
    assert_eq!(
        s.executor_logs().matches(HOLDING).count(),
        2,
        "each executor answered its runner's final report itself"
    );
    assert!(
        !s.executor_logs().contains(GAVE_UP),
        "no runner gave its final report up"
    );
    s.no_executor_left().await;
    let _ = second.start_kill();
}

/// DESIGN invariants 18 and 19, row (d): two replicas with leader election; the leader is
/// SIGKILLed while jobs end. Nothing answers for about a lease duration (15 s, longer than
/// the runner's 10 s close timeout); the executors hold the results, and every job keeps
/// its real result once the standby leads.
#[tokio::test(flavor = "multi_thread")]
async fn a_leader_killed_while_jobs_end_loses_no_result_after_failover() {
    let nats = NatsServer::start().await.expect("nats");
    let mock = MockGitea::start(MockConfig::default()).await.expect("mock");
    let kube = FakeKube::start().await.expect("fake kube");
    kube.handle.enforce_shipped_rbac(&[]);
    let svc = ReadyService::start().await.expect("service");
    let fixture = ControllerFixture::new(&mock, BIN.as_ref(), STANDIN.as_ref())
        .facade_at(svc.addr())
        .set("components", "scheduler,pod-worker")
        .set("pod_capacity", 2u32)
        .set("vm_capacity", 0u32)
        .set("nats_url", nats.url())
        .set("heartbeat_interval", "2s")
        .set("leader_election", true)
        .set("lease_duration", "15s")
        .set("nats_ack_wait", "5s");
    let kubeconfig = fixture.file(
        "kubeconfig",
        &kube.kubeconfig_as("gitea-actions", &ServiceAccount::controller()),
    );
    let kubeconfig = kubeconfig.display().to_string();
    let mut replicas = Vec::new();
    for name in ["replica-a", "replica-b"] {
        let (facade, health) = (listener(), listener());
        let addrs = (
            facade.local_addr().expect("addr"),
            health.local_addr().expect("addr"),
        );
        let child = fixture.spawn(
            BIN.as_ref(),
            &facade,
            &health,
            &[("KUBECONFIG", &kubeconfig), ("LEADER_IDENTITY", name)],
        );
        svc.add(addrs.0, addrs.1).await;
        replicas.push((child, addrs.1, Some((facade, health))));
    }
    let leader = gdr_testkit::eventually(WAIT, "a leader", || {
        let healths: Vec<SocketAddr> = replicas.iter().map(|r| r.1).collect();
        async move {
            for (i, h) in healths.iter().enumerate() {
                if is_ready(*h).await {
                    return Some(i);
                }
            }
            None
        }
    })
    .await;
    let standby = 1 - leader;
    let jobs: Vec<JobId> = [2000, 4000]
        .iter()
        .map(|ms| {
            let yaml = format!(
                "on: push\njobs:\n  j{ms}:\n    runs-on: [self-hosted, pod]\n    steps:\n      - run: standin:sleep {ms}\n"
            );
            mock.handle.queue_workflow("owner/repo", &yaml).expect("queue")[0]
        })
        .collect();
    mock.handle
        .wait_for(
            |m| jobs.iter().all(|j| started_in_a_runner(m.job(*j))),
            WAIT,
        )
        .await
        .expect("the leader's executors started both jobs");
    let _ = replicas[leader].0.start_kill();
    let _ = replicas[leader].0.wait().await;
    replicas[leader].2 = None;
    let standby_health = replicas[standby].1;
    until(Duration::from_secs(120), "the standby to take over", || {
        is_ready(standby_health)
    })
    .await;
    for (job, ms) in jobs.iter().zip([2000u64, 4000]) {
        mock.handle
            .wait_for(
                |m| m.job(*job).is_some_and(|s| s.status == Status::Success),
                WAIT,
            )
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "job lost its result: {:?}\ncontroller log:\n{}",
                    mock.handle
                        .job(*job)
                        .map(|j| (j.status, j.task.map(|t| t.log_rows))),
                    fixture.log()
                )
            });
        let rows = mock
            .handle
            .job(*job)
            .and_then(|j| j.task)
            .expect("task")
            .log_rows;
        assert_eq!(rows.len(), 2, "every row once: {rows:?}");
        assert_eq!(rows[1], format!("slept {:?}", Duration::from_millis(ms)));
    }
    assert!(
        executor_logs(&fixture.state_dir()).contains(HOLDING),
        "a job ended during the failover, its result held by its executor"
    );
    let _ = replicas[standby].0.start_kill();
}

/// DESIGN invariants 9 and 19, row (e): a restarted controller resumes an adopted,
/// unclaimed executor at once: with `nats_ack_wait` at 10 minutes, far beyond the wait
/// here, the job still succeeds, because the worker reads the assignment from the stream
/// at start instead of waiting for its redelivery; the claimed message is then removed,
/// so no redelivery can run the job again.
#[tokio::test(flavor = "multi_thread")]
async fn a_restarted_controller_resumes_an_adopted_unclaimed_executor_without_waiting_for_the_ack_wait()
 {
    let s = Setup::with(
        MockConfig::default().with_zombie_timeout(Duration::from_secs(3)),
        Nats::External,
        |f| f.set("nats_ack_wait", "10m"),
    )
    .await;
    let job = s.queue("standin:success");
    let mut first = s.controller(Some("after-create"));
    killed_at_its_fail_point(&mut first).await;
    assert_eq!(s.executors(), 1, "the executor outlives the controller");
    let mut second = s.controller(None);
    s.status(job, Status::Success).await;
    assert_eq!(s.runs_of(job), 1);
    s.no_executor_left().await;
    assert!(
        s.fixture
            .log()
            .contains("offered the assignment of an adopted executor"),
        "{}",
        s.fixture.log()
    );
    let warnings: Vec<String> = s
        .fixture
        .log()
        .lines()
        .filter(|l| l.contains("\"level\":\"WARN\"") && l.contains("facade call"))
        .map(str::to_owned)
        .collect();
    assert!(
        warnings.is_empty(),
        "the accepted fallback polls are not warnings: {warnings:#?}"
    );
    let nats = async_nats::connect(s.nats.as_ref().expect("external nats").url())
        .await
        .expect("connect");
    let js = async_nats::jetstream::new(nats);
    until(WAIT, "the claimed assignment to leave the stream", || {
        let js = js.clone();
        async move {
            match js.get_stream("CI_RUNNER").await {
                Ok(mut stream) => stream.info().await.is_ok_and(|i| i.state.messages == 0),
                Err(_) => false,
            }
        }
    })
    .await;
    let _ = second.start_kill();
}
