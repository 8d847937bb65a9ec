//! The whole system on one host: mock Gitea → scheduler → embedded nats-server →
//! worker → process backend → `gitea-dynamic-runner executor` → stand-in runner →
//! facade → mock Gitea.

use std::sync::Arc;
use std::time::Duration;

use gdr_controller::runtime::{self, Listeners};
use gdr_controller::settings::{NatsServer as NatsServerSettings, Settings, Sources};
use gdr_controller::shutdown::{ShutdownTrigger, shutdown_channel};
use gdr_testkit::controller::ControllerFixture;
use gdr_testkit::mock_gitea::{JobId, MockConfig, MockGitea, RunningMock, Status};
use gdr_testkit::nats_server::NatsServer;

const WAIT: Duration = Duration::from_secs(60);
const BIN: &str = env!("CARGO_BIN_EXE_gitea-dynamic-runner");
const STANDIN: &str = env!("CARGO_BIN_EXE_gitea-runner-standin");

pub struct Controller {
    pub mock: RunningMock,
    pub fixture: ControllerFixture,
    pub health: std::net::SocketAddr,
    stop: ShutdownTrigger,
    pub task: Option<tokio::task::JoinHandle<Result<(), runtime::RuntimeError>>>,
}

impl Controller {
    async fn start(pod_capacity: u32, vm_capacity: u32) -> Self {
        Self::start_with(pod_capacity, vm_capacity, None, &[]).await
    }

    async fn start_with(
        pod_capacity: u32,
        vm_capacity: u32,
        nats_url: Option<String>,
        extra: &[(&str, &str)],
    ) -> Self {
        Self::start_on(
            MockConfig::default(),
            pod_capacity,
            vm_capacity,
            nats_url,
            extra,
        )
        .await
    }

    /// [`Controller::start_with`] against a mock Gitea configured as `mock`.
    async fn start_on(
        mock: MockConfig,
        pod_capacity: u32,
        vm_capacity: u32,
        nats_url: Option<String>,
        extra: &[(&str, &str)],
    ) -> Self {
        let mock = MockGitea::start(mock).await.expect("mock");
        Self::start_against(mock, pod_capacity, vm_capacity, nats_url, extra).await
    }

    /// [`Controller::start_with`] against a mock Gitea the test started (and may have
    /// queued jobs in already).
    pub(crate) async fn start_against(
        mock: RunningMock,
        pod_capacity: u32,
        vm_capacity: u32,
        nats_url: Option<String>,
        extra: &[(&str, &str)],
    ) -> Self {
        let facade = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let health = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let health_addr = health.local_addr().expect("addr");
        let mut fixture = ControllerFixture::new(&mock, BIN.as_ref(), STANDIN.as_ref())
            .facade_at(facade.local_addr().expect("addr"))
            .set("pod_capacity", pod_capacity)
            .set("vm_capacity", vm_capacity)
            .set("nats_server_binary", NatsServer::binary().as_path())
            .set("heartbeat_interval", "2s");
        let task_key = fixture.file("secrets/task-key", &"ab".repeat(32));
        fixture = fixture.set("task_encryption_key_file", task_key.as_path());
        if let Some(url) = nats_url {
            fixture = fixture.set("nats_url", url);
        }
        for (k, v) in extra {
            fixture = fixture.set(k, *v);
        }
        let mut settings =
            Settings::load(&Sources::overrides(fixture.overrides()).expect("overrides"))
                .expect("valid configuration");
        // This process is the test binary: the real one starts the embedded server.
        if let NatsServerSettings::Embedded { binder, .. } = &mut settings.nats.server {
            *binder = Some(BIN.into());
        }
        let (stop, shutdown) = shutdown_channel();
        let task = tokio::spawn(runtime::run(
            settings,
            Listeners { facade, health },
            shutdown,
        ));
        Controller {
            mock,
            fixture,
            health: health_addr,
            stop,
            task: Some(task),
        }
    }

    pub(crate) fn queue(&self, name: &str, runs_on: &str, step: &str) -> JobId {
        let yaml = format!(
            "on: push\njobs:\n  {name}:\n    runs-on: {runs_on}\n    steps:\n      - run: {step}\n"
        );
        self.mock
            .handle
            .queue_workflow("owner/repo", &yaml)
            .expect("queue")[0]
    }

    pub(crate) async fn wait_status(&self, job: JobId, status: Status) {
        self.mock
            .handle
            .wait_for(|m| m.job(job).is_some_and(|j| j.status == status), WAIT)
            .await
            .unwrap_or_else(|_| {
                let seen = self.mock.handle.job(job).map(|j| j.status);
                panic!("job {job:?} never reached {status:?} (is {seen:?})")
            });
    }

    async fn stop(&mut self) {
        self.stop.trigger();
        if let Some(task) = self.task.take() {
            let result = tokio::time::timeout(WAIT, task)
                .await
                .expect("controller stops")
                .expect("join");
            result.expect("controller ran without error");
        }
    }

    /// `(in use, capacity)` of a backend's admission pool, from `/metrics`.
    async fn pool_usage(&self, backend: gdr_core::backend::Backend) -> (usize, usize) {
        let Ok(text) = async {
            reqwest::get(format!("http://{}/metrics", self.health))
                .await?
                .text()
                .await
        }
        .await
        else {
            return (0, 0);
        };
        let gauge = |name: &str| {
            let prefix = format!("gitea_dynamic_runner_{name}{{backend=\"{backend}\"}} ");
            text.lines()
                .find_map(|l| l.strip_prefix(&prefix))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0)
        };
        (gauge("pool_in_use"), gauge("pool_capacity"))
    }

    /// Executors not yet terminal (the ones holding capacity), read from the backend's
    /// own metadata files.
    fn live_executors(&self) -> usize {
        ["pod", "vm"]
            .iter()
            .flat_map(|b| {
                std::fs::read_dir(self.fixture.state_dir().join(b).join("executors"))
                    .into_iter()
                    .flatten()
                    .filter_map(|e| e.ok())
                    .filter_map(|e| std::fs::read(e.path().join("metadata.json")).ok())
                    .filter_map(|m| serde_json::from_slice::<serde_json::Value>(&m).ok())
                    .filter(|m| {
                        m.get("terminal").and_then(serde_json::Value::as_bool) == Some(false)
                    })
            })
            .count()
    }

    /// The log rows Gitea stored for a job's task.
    pub(crate) fn log_rows(&self, job: JobId) -> Vec<String> {
        self.mock.handle.log_rows(job)
    }

    /// Waits until the job's runner is running it (its first log row reached Gitea) and
    /// returns the task ID. A heartbeat is no sign of it: the controller keeps a queued task
    /// alive with its own.
    async fn running(&self, job: JobId, what: &str) -> i64 {
        let task = self
            .mock
            .handle
            .wait_for_value(|m| m.job(job).and_then(|j| j.task).map(|t| t.id), WAIT)
            .await
            .unwrap_or_else(|_| panic!("{what}: never fetched"));
        gdr_testkit::until(WAIT, what, || async {
            self.mock.handle.runner_starts(job) > 0
        })
        .await;
        task
    }

    /// Waits until no executor directory and no admission slot is left.
    async fn nothing_left(&self) {
        gdr_testkit::until(WAIT, "no executor and no admission slot left", || async {
            self.executor_dirs() == 0
                && self.pool_usage(gdr_core::backend::Backend::Pod).await.0 == 0
        })
        .await;
    }

    fn executor_dirs(&self) -> usize {
        ["pod", "vm"]
            .iter()
            .map(|b| {
                std::fs::read_dir(self.fixture.state_dir().join(b).join("executors"))
                    .map(|d| d.count())
                    .unwrap_or(0)
            })
            .sum()
    }
}

impl Drop for Controller {
    fn drop(&mut self) {
        self.stop.trigger();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn success_failure_and_cancellation_reach_gitea_through_the_whole_chain() {
    let mut c = Controller::start(3, 1).await;
    let ok = c.queue("ok", "[self-hosted, pod]", "standin:success");
    let bad = c.queue("bad", "[self-hosted, pod]", "standin:failure");
    let hang = c.queue("hang", "[self-hosted, pod]", "standin:hang");
    c.wait_status(ok, Status::Success).await;
    c.wait_status(bad, Status::Failure).await;
    let hang_task = c.running(hang, "the hanging job runs").await;
    c.mock.handle.cancel_job(hang).expect("cancel");
    c.wait_status(hang, Status::Cancelled).await;
    let rows = c.mock.handle.task(hang_task).expect("task").log_rows;
    assert!(!rows.is_empty());
    // Everything is cleaned up: executors deleted, slots released.
    c.nothing_left().await;
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn twenty_jobs_with_capacity_three_all_succeed_and_never_exceed_capacity() {
    let mut c = Controller::start(3, 1).await;
    let jobs: Vec<JobId> = (0..20)
        .map(|i| {
            c.queue(
                &format!("job{i}"),
                "[self-hosted, pod]",
                "standin:sleep 200",
            )
        })
        .collect();
    let max_seen = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let done = c.mock.handle.clone();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(180);
    loop {
        let live = c
            .live_executors()
            .max(c.pool_usage(gdr_core::backend::Backend::Pod).await.0);
        max_seen.fetch_max(live, std::sync::atomic::Ordering::SeqCst);
        let finished = jobs
            .iter()
            .filter(|j| done.job(**j).is_some_and(|s| s.status == Status::Success))
            .count();
        if finished == jobs.len() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "only {finished} of 20 jobs succeeded"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        max_seen.load(std::sync::atomic::Ordering::SeqCst) <= 3,
        "more than 3 executors at once"
    );
    // The fetch→publish loss window, as the controller measures and exports it.
    let url = format!("http://{}/metrics", c.health);
    let deadline = tokio::time::Instant::now() + WAIT;
    let window = loop {
        let text = reqwest::get(&url)
            .await
            .expect("metrics")
            .text()
            .await
            .expect("text");
        let value = text
            .lines()
            .find_map(|l| l.strip_prefix("gitea_dynamic_runner_handoff_window_max_micros "))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(0);
        if value > 0 {
            break value;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the handoff window is not exported"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    eprintln!("measured fetch→publish window (max over 20 jobs): {window} µs");
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn pod_and_vm_labels_run_in_their_own_pools() {
    let mut c = Controller::start(1, 1).await;
    let pod = c.queue("p", "[self-hosted, pod]", "standin:sleep 500");
    let vm = c.queue("v", "[self-hosted, vm]", "standin:sleep 500");
    c.wait_status(pod, Status::Success).await;
    c.wait_status(vm, Status::Success).await;
    let state = c.fixture.state_dir();
    assert!(
        state.join("pod/executors").exists() && state.join("vm/executors").exists(),
        "each backend has its own executors"
    );
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn an_executor_killed_mid_job_is_reported_as_failed_and_cleaned_up() {
    let mut c = Controller::start(1, 1).await;
    let job = c.queue("victim", "[self-hosted, pod]", "standin:hang");
    c.running(job, "the job runs").await;
    let executors = c.fixture.state_dir().join("pod/executors");
    let dir = std::fs::read_dir(&executors)
        .expect("dir")
        .next()
        .expect("one executor")
        .expect("entry")
        .path();
    let meta: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("metadata.json")).expect("metadata"))
            .expect("json");
    let pid = meta
        .get("pid")
        .and_then(serde_json::Value::as_i64)
        .expect("pid") as i32;
    let group = rustix::process::Pid::from_raw(pid).expect("pid");
    rustix::process::kill_process_group(group, rustix::process::Signal::KILL).expect("kill");
    c.wait_status(job, Status::Failure).await;
    let rows = c.log_rows(job);
    assert!(
        rows.iter()
            .any(|r| r.contains("without reporting a result")),
        "{rows:?}"
    );
    c.nothing_left().await;
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_nats_restart_mid_job_loses_no_job() {
    let mut nats = NatsServer::start().await.expect("nats");
    let mut c = Controller::start_with(2, 1, Some(nats.url()), &[]).await;
    let running = c.queue("running", "[self-hosted, pod]", "standin:sleep 3000");
    c.running(running, "the first job runs").await;
    nats.restart().await.expect("restart nats");
    let after = c.queue("after", "[self-hosted, pod]", "standin:success");
    c.wait_status(running, Status::Success).await;
    c.wait_status(after, Status::Success).await;
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn an_executor_whose_runner_never_claims_within_the_deadline_is_failed_and_removed() {
    let scripts = tempfile::tempdir().expect("dir");
    let stuck = scripts.path().join("stuck-runner");
    std::fs::write(&stuck, "#!/bin/sh\nexec sleep 600\n").expect("script");
    let mut permissions = std::fs::metadata(&stuck).expect("meta").permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut permissions, 0o755);
    std::fs::set_permissions(&stuck, permissions).expect("chmod");
    let runner = stuck.display().to_string();
    let mut c = Controller::start_with(
        1,
        1,
        None,
        &[
            ("runner_binary", runner.as_str()),
            ("executor_start_deadline", "3s"),
            ("nats_ack_wait", "5s"),
        ],
    )
    .await;
    let job = c.queue("stuck", "[self-hosted, pod]", "standin:success");
    c.wait_status(job, Status::Failure).await;
    let rows = c.log_rows(job);
    assert!(
        rows.iter()
            .any(|r| r.contains("did not start the job within")),
        "{rows:?}"
    );
    c.nothing_left().await;
    c.stop().await;
}

/// DESIGN invariants 1 and 22 (defect, issue 8): a disabled backend is neither declared nor
/// fetched. With `components = "scheduler,vm-worker"` Gitea knows the runner by `vm` only,
/// so it never hands out pod jobs that nothing here would run (and that would fill the
/// backlog and stop VM jobs too).
#[tokio::test(flavor = "multi_thread")]
async fn a_disabled_backend_is_neither_declared_nor_fetched() {
    let mut c = Controller::start_with(2, 1, None, &[("components", "scheduler,vm-worker")]).await;
    let pod = c.queue("pod_job", "[self-hosted, pod]", "standin:success");
    let vm = c.queue("vm_job", "[self-hosted, vm]", "standin:success");
    c.wait_status(vm, Status::Success).await;
    let uuid = std::fs::read_to_string(c.fixture.path().join("secrets/uuid")).expect("uuid");
    let runner = c
        .mock
        .handle
        .runner(uuid.trim())
        .expect("the controller's runner");
    assert_eq!(
        runner.labels,
        ["self-hosted", "vm"],
        "labels of the one Declare"
    );
    assert_eq!(
        c.mock.handle.job(pod).map(|j| j.status),
        Some(Status::Waiting),
        "a pod job was handed to a controller without a pod worker"
    );
    c.stop().await;
}

/// DESIGN invariant 1: the pollers are as many as the enabled capacity, bounded by
/// `fetch_pollers_max` (Gitea serialises task picks; more concurrent pollers only cost).
/// A burst against a slow Gitea shows every poller at work and never more.
#[tokio::test(flavor = "multi_thread")]
async fn fetch_pollers_max_bounds_the_concurrent_fetch_task_calls() {
    use gdr_testkit::mock_gitea::RpcMethod;
    let slow = MockConfig::default().with_fetch_delay(Duration::from_millis(200));
    let mut c = Controller::start_on(
        slow,
        4,
        0,
        None,
        &[("fetch_pollers_max", "2"), ("backlog_limit", "20")],
    )
    .await;
    let jobs: Vec<JobId> = (0..8)
        .map(|i| c.queue(&format!("job{i}"), "[self-hosted, pod]", "standin:success"))
        .collect();
    for job in &jobs {
        c.wait_status(*job, Status::Success).await;
    }
    assert_eq!(
        c.mock.handle.in_flight_peak(RpcMethod::FetchTask),
        2,
        "as many concurrent FetchTask calls as fetch_pollers_max allows"
    );
    c.stop().await;
}

/// DESIGN invariant 5b, issue 39: every free slot is refilled as soon as it frees, never
/// at the idle poller's pace. With both backends enabled (the default), a full pod
/// backlog re-declares the vm labels alone, so the pollers' FetchTask finds nothing and
/// they park; when the backlog drains, the pod labels are declared again and that wakes
/// them. With the idle interval an hour long, 10 pod jobs queued before the start at
/// `pod_capacity = 2` all run only if nothing waits for the idle poller (the wait is a
/// bound on a hang, not a speed assertion).
#[tokio::test(flavor = "multi_thread")]
async fn ten_queued_jobs_at_capacity_two_all_run_without_waiting_for_the_idle_poller() {
    let mock = MockGitea::start(MockConfig::default()).await.expect("mock");
    let yaml = "on: push\njobs:\n  build:\n    runs-on: [self-hosted, pod]\n    steps:\n      - run: standin:success\n";
    let jobs: Vec<JobId> = (0..10)
        .map(|_| {
            mock.handle
                .queue_workflow("owner/repo", yaml)
                .expect("queue")[0]
        })
        .collect();
    let mut c = Controller::start_against(mock, 2, 1, None, &[("fetch_interval", "1h")]).await;
    for job in &jobs {
        c.wait_status(*job, Status::Success).await;
    }
    c.stop().await;
}
