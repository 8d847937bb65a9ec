//! Kill-and-restart: the controller process is SIGKILLed at a named fail point, then
//! started again; each test asserts what became of the job: no task runs twice, nothing
//! is lost outside the documented fetch→publish window, no executor or slot leaks.

// A panic is how a test (or a benchmark harness) fails.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use gdr_testkit::controller::{ControllerFixture, listener};
use gdr_testkit::mock_gitea::{JobId, MockConfig, MockGitea, RunningMock, Status};
use gdr_testkit::nats_server::NatsServer;

const WAIT: Duration = Duration::from_secs(60);
const BIN: &str = env!("CARGO_BIN_EXE_gitea-dynamic-runner");
const STANDIN: &str = env!("CARGO_BIN_EXE_gitea-runner-standin");

struct Setup {
    _nats: NatsServer,
    mock: RunningMock,
    fixture: ControllerFixture,
    /// Bound once by the test and handed to every controller incarnation, so executors
    /// keep reaching the same facade address across restarts.
    facade: std::net::TcpListener,
    health: std::net::TcpListener,
}

impl Setup {
    async fn new() -> Self {
        let nats = NatsServer::start().await.expect("nats");
        let mock =
            MockGitea::start(MockConfig::default().with_zombie_timeout(Duration::from_secs(3)))
                .await
                .expect("mock");
        let facade = listener();
        let health = listener();
        let fixture = ControllerFixture::new(&mock, BIN.as_ref(), STANDIN.as_ref())
            .facade_at(facade.local_addr().expect("addr"))
            .set("components", "scheduler,pod-worker")
            .set("pod_capacity", 2u32)
            .set("vm_capacity", 0u32)
            .set("nats_url", nats.url())
            .set("heartbeat_interval", "1s")
            .set("nats_ack_wait", "3s");
        Setup {
            _nats: nats,
            mock,
            fixture,
            facade,
            health,
        }
    }

    fn controller(&self, failpoint: Option<&str>) -> tokio::process::Child {
        let env: Vec<(&str, &str)> = failpoint
            .map(|p| vec![("GDR_FAILPOINT", p)])
            .unwrap_or_default();
        self.fixture
            .spawn(BIN.as_ref(), &self.facade, &self.health, &env)
    }

    fn queue(&self, step: &str) -> JobId {
        let yaml = format!(
            "on: push\njobs:\n  build:\n    runs-on: [self-hosted, pod]\n    steps:\n      - run: {step}\n"
        );
        self.mock
            .handle
            .queue_workflow("owner/repo", &yaml)
            .expect("queue")[0]
    }

    async fn killed_at_its_fail_point(&self, child: &mut tokio::process::Child) {
        use std::os::unix::process::ExitStatusExt;
        let status = tokio::time::timeout(WAIT, child.wait())
            .await
            .expect("the fail point fires")
            .expect("wait");
        assert_eq!(
            status.signal(),
            Some(9),
            "the controller died at its fail point: {status:?}"
        );
    }

    async fn status(&self, job: JobId, status: Status) {
        self.mock
            .handle
            .wait_for(|m| m.job(job).is_some_and(|j| j.status == status), WAIT)
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "job never reached {status:?}: {:?}",
                    self.mock
                        .handle
                        .job(job)
                        .map(|j| (j.status, j.task.map(|t| t.log_rows)))
                )
            });
    }

    fn executors(&self) -> usize {
        std::fs::read_dir(self.fixture.state_dir().join("pod/executors"))
            .map(|d| d.count())
            .unwrap_or(0)
    }

    /// No executor directory and no admission slot in use (read from `/metrics` of
    /// the restarted controller).
    async fn no_executor_left(&self) {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let slots = self.pod_slots_in_use().await;
            if self.executors() == 0 && slots == Some(0) {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "leaked: {} executors, slots {slots:?}",
                self.executors()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn pod_slots_in_use(&self) -> Option<u64> {
        let addr = self.health.local_addr().ok()?;
        let text = reqwest::get(format!("http://{addr}/metrics"))
            .await
            .ok()?
            .text()
            .await
            .ok()?;
        text.lines()
            .find_map(|l| l.strip_prefix("gitea_dynamic_runner_pool_in_use{backend=\"pod\"} "))
            .and_then(|v| v.trim().parse().ok())
    }

    fn runs_of(&self, job: JobId) -> usize {
        let rows = self
            .mock
            .handle
            .job(job)
            .and_then(|j| j.task)
            .map(|t| t.log_rows)
            .unwrap_or_default();
        rows.iter()
            .filter(|r| r.contains("stand-in runner: task"))
            .count()
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn killed_after_a_fetch_the_task_is_lost_in_the_documented_window_and_failed_by_gitea() {
    let s = Setup::new().await;
    let job = s.queue("standin:success");
    let mut first = s.controller(Some("after-fetch"));
    s.killed_at_its_fail_point(&mut first).await;
    let mut second = s.controller(None);
    // Gitea handed the task out and nobody stored it: its zombie clean-up fails it.
    s.status(job, Status::Failure).await;
    assert_eq!(s.runs_of(job), 0, "the lost task never ran");
    s.no_executor_left().await;
    let _ = second.start_kill();
}

#[tokio::test(flavor = "multi_thread")]
async fn killed_after_the_publish_the_restarted_controller_runs_the_job_once() {
    let s = Setup::new().await;
    let job = s.queue("standin:success");
    let mut first = s.controller(Some("after-publish"));
    s.killed_at_its_fail_point(&mut first).await;
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
    s.killed_at_its_fail_point(&mut first).await;
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
    s.killed_at_its_fail_point(&mut first).await;
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
    s.killed_at_its_fail_point(&mut first).await;
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
    s.killed_at_its_fail_point(&mut first).await;
    s.status(job, Status::Success).await;
    let mut second = s.controller(None);
    s.no_executor_left().await;
    assert_eq!(s.runs_of(job), 1);
    let _ = second.start_kill();
}
