//! A controller process under test on this host: a mock Gitea, a controller configuration
//! for it (process backends, the stand-in runner, see [`ControllerFixture`]), the facade
//! and health listeners every incarnation of the controller gets, and what a test reads
//! back: Gitea's view of a job, the process backend's executors and their logs, `/readyz`
//! and `/metrics`.
//!
//! A test stops and starts controller processes of one [`LocalController`] as it likes
//! (a restart, a kill at a fail point); the listeners stay bound by the test, so every
//! incarnation serves the same addresses.

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::controller::{ControllerFixture, listener};
use crate::mock_gitea::{JobId, JobSnapshot, MockConfig, MockGitea, RunningMock, Status};
use crate::service::is_ready;

/// How long a job, a start or a clean-up may take before a wait fails: only a bound on a
/// hang (a job on the stand-in runner ends within seconds), never a speed assertion.
const DEADLINE: Duration = Duration::from_secs(60);

/// A mock Gitea, a controller configuration for it and the listeners of its processes.
pub struct LocalController {
    /// The Gitea the controller serves.
    pub mock: RunningMock,
    /// The configuration every controller process of this test starts with.
    pub fixture: ControllerFixture,
    binary: PathBuf,
    /// `None` while closed: the port then refuses connections, as a stopped controller's
    /// does.
    facade: Option<TcpListener>,
    facade_addr: SocketAddr,
    health: TcpListener,
}

impl LocalController {
    /// Starts a mock Gitea with `mock`, binds the facade and health listeners, and builds
    /// the fixture (controller `binary`, stand-in `runner`) with its facade URL pointing at
    /// the facade listener, then `configure` on top.
    pub async fn start(
        mock: MockConfig,
        binary: &Path,
        runner: &Path,
        configure: impl FnOnce(ControllerFixture) -> ControllerFixture,
    ) -> Self {
        let mock = MockGitea::start(mock)
            .await
            .unwrap_or_else(|e| panic!("cannot start the mock Gitea: {e}"));
        let facade = listener();
        let facade_addr = facade
            .local_addr()
            .unwrap_or_else(|e| panic!("the facade listener has no address: {e}"));
        let fixture = ControllerFixture::new(&mock, binary, runner).facade_at(facade_addr);
        LocalController {
            fixture: configure(fixture),
            mock,
            binary: binary.to_path_buf(),
            facade: Some(facade),
            facade_addr,
            health: listener(),
        }
    }

    /// A controller process with the fixture's configuration and `env`.
    pub fn spawn(&self, env: &[(&str, &str)]) -> tokio::process::Child {
        let facade = self
            .facade
            .as_ref()
            .unwrap_or_else(|| panic!("the facade port is closed"));
        self.fixture.spawn(&self.binary, facade, &self.health, env)
    }

    /// The address executors reach the facade at.
    pub fn facade_addr(&self) -> SocketAddr {
        self.facade_addr
    }

    /// The address of `/readyz` and `/metrics`.
    pub fn health_addr(&self) -> SocketAddr {
        self.health
            .local_addr()
            .unwrap_or_else(|e| panic!("the health listener has no address: {e}"))
    }

    /// The facade port refuses connections from now on.
    pub fn close_facade(&mut self) {
        self.facade = None;
    }

    /// The facade port accepts again (the same address, for the next controller).
    pub async fn reopen_facade(&mut self) {
        let addr = self.facade_addr;
        let reopened =
            crate::eventually(DEADLINE, "the facade port to bind again", || async move {
                TcpListener::bind(addr).ok()
            })
            .await;
        reopened
            .set_nonblocking(true)
            .unwrap_or_else(|e| panic!("cannot make a listener non-blocking: {e}"));
        self.facade = Some(reopened);
    }

    /// Waits until the running controller answers `/readyz` with 200.
    pub async fn ready(&self) {
        let health = self.health_addr();
        crate::until(DEADLINE, "the controller to be ready", || is_ready(health)).await;
    }

    /// Queues a one-job workflow on `[self-hosted, pod]` in `owner/repo` whose step is
    /// `step` (a stand-in runner script such as `standin:success`).
    pub fn queue(&self, step: &str) -> JobId {
        let yaml = format!(
            "on: push\njobs:\n  build:\n    runs-on: [self-hosted, pod]\n    steps:\n      - run: {step}\n"
        );
        self.mock
            .handle
            .queue_workflow("owner/repo", &yaml)
            .unwrap_or_else(|e| panic!("cannot queue a workflow: {e}"))[0]
    }

    /// Waits until `job` has `status` in Gitea.
    pub async fn status(&self, job: JobId, status: Status) {
        self.status_within(job, status, DEADLINE).await;
    }

    /// Waits up to `wait` until `job` has `status` in Gitea; the failure shows the job,
    /// the executors' logs and the controller's.
    pub async fn status_within(&self, job: JobId, status: Status, wait: Duration) {
        self.mock
            .handle
            .wait_for(|m| m.job(job).is_some_and(|j| j.status == status), wait)
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "job never reached {status:?}: {:?}\nexecutor logs:\n{}\ncontroller log:\n{}",
                    self.mock
                        .handle
                        .job(job)
                        .map(|j| (j.status, j.task.map(|t| t.log_rows))),
                    self.executor_logs(),
                    self.fixture.log(),
                )
            });
    }

    /// Waits until the job's runner reported its first row (Gitea counts a job as running
    /// from the controller's fetch; this is the executor's runner at work).
    pub async fn runner_started(&self, job: JobId) {
        self.mock
            .handle
            .wait_for(|m| started_in_a_runner(m.job(job)), DEADLINE)
            .await
            .unwrap_or_else(|_| panic!("no runner started job {job:?}:\n{}", self.fixture.log()));
    }

    /// Live pod executors (directories of the process backend).
    pub fn executors(&self) -> usize {
        std::fs::read_dir(self.fixture.state_dir().join("pod/executors"))
            .map(|d| d.count())
            .unwrap_or(0)
    }

    /// Every pod executor's log, live or kept after its deletion.
    pub fn executor_logs(&self) -> String {
        executor_logs(&self.fixture.state_dir())
    }

    /// Waits until the executors' logs hold `line` at least `times` times.
    pub async fn executors_logged(&self, line: &str, times: usize) {
        let deadline = tokio::time::Instant::now() + DEADLINE;
        while self.executor_logs().matches(line).count() < times {
            assert!(
                tokio::time::Instant::now() < deadline,
                "executors never logged {line:?} {times} times ({} executors):\n{}\ncontroller log:\n{}",
                self.executors(),
                self.executor_logs(),
                self.fixture.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until no executor directory is left and no pod admission slot is in use
    /// (read from the running controller's `/metrics`).
    pub async fn no_executor_left(&self) {
        let deadline = tokio::time::Instant::now() + DEADLINE;
        loop {
            let slots = self
                .metric("gitea_dynamic_runner_pool_in_use{backend=\"pod\"}")
                .await;
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

    /// The value of the series `series` (name and labels as `/metrics` prints them, e.g.
    /// `gitea_dynamic_runner_pool_in_use{backend="pod"}`) of the running controller;
    /// `None` while `/metrics` cannot be read or does not show it.
    pub async fn metric(&self, series: &str) -> Option<u64> {
        metric(self.health_addr(), series).await
    }

    /// The log rows Gitea stored for `job`.
    pub fn rows(&self, job: JobId) -> Vec<String> {
        self.mock.handle.log_rows(job)
    }

    /// How many times a runner started `job` (its first row, counted in Gitea's log).
    pub fn runs_of(&self, job: JobId) -> usize {
        self.mock.handle.runner_starts(job)
    }
}

/// The value of `series` in the `/metrics` of the health server at `health`.
pub async fn metric(health: SocketAddr, series: &str) -> Option<u64> {
    let text = reqwest::get(format!("http://{health}/metrics"))
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    let prefix = format!("{series} ");
    text.lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .and_then(|v| v.trim().parse().ok())
}

/// Every pod executor's log under `state_dir`, live or kept after its deletion.
pub fn executor_logs(state_dir: &Path) -> String {
    let pod = state_dir.join("pod");
    let live = std::fs::read_dir(pod.join("executors"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join("executor.log"));
    let kept = std::fs::read_dir(pod.join("logs"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path());
    live.chain(kept)
        .filter_map(|p| std::fs::read_to_string(p).ok())
        .collect::<Vec<_>>()
        .join("\n")
}

/// Whether a runner started `job`: its first row reached Gitea.
pub fn started_in_a_runner(job: Option<JobSnapshot>) -> bool {
    job.and_then(|j| j.task)
        .is_some_and(|t| t.runner_starts() > 0)
}

/// How a controller goes away.
#[derive(Clone, Copy, Debug)]
pub enum Stop {
    /// SIGKILL: a crash.
    Kill,
    /// SIGTERM: a graceful stop (an upgrade).
    Term,
}

/// Stops `child` as `how` says and waits until it exited.
pub async fn stop(child: &mut tokio::process::Child, how: Stop) {
    match how {
        Stop::Kill => {
            let _ = child.start_kill();
        }
        Stop::Term => crate::controller::terminate(child),
    }
    tokio::time::timeout(DEADLINE, child.wait())
        .await
        .unwrap_or_else(|_| panic!("the controller did not stop within {DEADLINE:?}"))
        .unwrap_or_else(|e| panic!("cannot wait for the controller: {e}"));
}

/// Waits until `child` (started with `GDR_FAILPOINT`) killed itself at its fail point.
pub async fn killed_at_its_fail_point(child: &mut tokio::process::Child) {
    use std::os::unix::process::ExitStatusExt;
    let status = tokio::time::timeout(DEADLINE, child.wait())
        .await
        .unwrap_or_else(|_| panic!("the fail point did not fire within {DEADLINE:?}"))
        .unwrap_or_else(|e| panic!("cannot wait for the controller: {e}"));
    assert_eq!(
        status.signal(),
        Some(9),
        "the controller died at its fail point: {status:?}"
    );
}
