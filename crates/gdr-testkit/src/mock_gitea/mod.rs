//! A mock Gitea that speaks the real runner protocol (Connect, `runner.v1.RunnerService` and
//! `ping.v1.PingService` under `/api/actions`) with Gitea's server semantics, held in memory.
//!
//! Tests drive it through [`MockGitea`]: queue workflows, cancel jobs, inject faults, and
//! wait on observable state. The same server runs standalone as `examples/mock-gitea.rs`,
//! with a small JSON admin API under `/_mock/`.

mod server;
mod state;
mod workflow;

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use gdr_proto::runner::v1 as pb;
use serde::Serialize;
use state::State;
pub use state::{GiteaError, GrpcCode, Trigger};
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;

/// Identifier of a queued job (Gitea's `ActionRunJob.ID`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(transparent)]
pub struct JobId(pub i64);

impl std::fmt::Display for JobId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// Errors of the test-driving API.
#[derive(Debug, thiserror::Error)]
pub enum MockError {
    #[error("invalid workflow: {0}")]
    InvalidWorkflow(String),
    #[error("not supported: {0}")]
    Unsupported(String),
    #[error("no such job: {0}")]
    NoSuchJob(JobId),
    #[error("condition not met within {0:?}")]
    Timeout(Duration),
}

/// Status of a job or task, as Gitea's `actions_model.Status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Waiting,
    Running,
    Cancelling,
    Success,
    Failure,
    Cancelled,
    Skipped,
}

impl Status {
    /// Gitea's `IsDone`.
    pub fn is_done(self) -> bool {
        matches!(
            self,
            Self::Success | Self::Failure | Self::Cancelled | Self::Skipped
        )
    }

    /// Gitea's `AsResult`: what `UpdateTaskResponse.state.result` says for this status.
    pub fn as_result(self) -> pb::TaskResult {
        match self {
            Self::Waiting | Self::Running => pb::TaskResult::RESULT_UNSPECIFIED,
            Self::Success => pb::TaskResult::RESULT_SUCCESS,
            Self::Failure => pb::TaskResult::RESULT_FAILURE,
            Self::Cancelling | Self::Cancelled => pb::TaskResult::RESULT_CANCELLED,
            Self::Skipped => pb::TaskResult::RESULT_SKIPPED,
        }
    }
}

/// A step as last reported through `UpdateTask`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StepSnapshot {
    pub id: i64,
    /// Wire value of `runner.v1.Result`.
    pub result: i32,
    pub log_index: i64,
    pub log_length: i64,
    pub started: Option<SystemTime>,
    pub stopped: Option<SystemTime>,
}

/// A task (one claim of a job by a runner).
#[derive(Debug, Clone, Serialize)]
pub struct TaskSnapshot {
    pub id: i64,
    pub job_id: JobId,
    pub runner_id: i64,
    pub status: Status,
    /// Wire value of `runner.v1.Result` that `UpdateTask` answers for this task.
    pub result: i32,
    pub started: SystemTime,
    pub stopped: Option<SystemTime>,
    /// Refreshed by heartbeats and log writes; the zombie sweeper reads it.
    pub updated: SystemTime,
    /// Number of `UpdateTask` calls without a result while the task was unfinished.
    pub heartbeats: u64,
    /// Number of `UpdateTask` calls carrying a result, whether or not the task had ended
    /// already (the first one ends it; Gitea ignores later ones, so only this count shows
    /// that a second final report arrived).
    pub results_reported: u64,
    /// Stored log rows (contents only), in order.
    pub log_rows: Vec<String>,
    /// When the first log row was stored (how long a job took to start, seen from Gitea).
    pub first_log: Option<SystemTime>,
    pub log_archived: bool,
    pub outputs: BTreeMap<String, String>,
    pub steps: Vec<StepSnapshot>,
    /// The task token (also `GITEA_TOKEN`); not printed by the example binary.
    #[serde(skip)]
    pub token: String,
}

impl TaskSnapshot {
    /// How many times a stand-in runner started this task (its first row, counted in the
    /// stored log).
    pub fn runner_starts(&self) -> usize {
        self.log_rows
            .iter()
            .filter(|r| r.starts_with(crate::standin_runner::TASK_STARTED))
            .count()
    }
}

/// A queued job, with its task once claimed.
#[derive(Debug, Clone, Serialize)]
pub struct JobSnapshot {
    pub id: JobId,
    pub run_id: i64,
    pub repo: String,
    /// Key under `jobs:`.
    pub key: String,
    pub name: String,
    pub runs_on: Vec<String>,
    pub status: Status,
    pub task_id: Option<i64>,
    /// The single-job YAML sent as `workflow_payload`.
    pub payload: String,
    pub task: Option<TaskSnapshot>,
}

/// A registered runner.
#[derive(Debug, Clone, Serialize)]
pub struct RunnerSnapshot {
    pub id: i64,
    pub uuid: String,
    pub name: String,
    pub version: String,
    pub labels: Vec<String>,
    pub ephemeral: bool,
    pub capabilities: Vec<String>,
    pub disabled: bool,
    pub last_online: SystemTime,
}

/// An RPC of the runner protocol, for fault injection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RpcMethod {
    Register,
    Declare,
    FetchTask,
    UpdateTask,
    UpdateLog,
    Ping,
}

impl RpcMethod {
    /// Maps a Connect procedure path (`/runner.v1.RunnerService/FetchTask`) to the method.
    pub fn from_procedure(path: &str) -> Option<Self> {
        Some(match path.trim_start_matches('/') {
            "runner.v1.RunnerService/Register" => Self::Register,
            "runner.v1.RunnerService/Declare" => Self::Declare,
            "runner.v1.RunnerService/FetchTask" => Self::FetchTask,
            "runner.v1.RunnerService/UpdateTask" => Self::UpdateTask,
            "runner.v1.RunnerService/UpdateLog" => Self::UpdateLog,
            "ping.v1.PingService/Ping" => Self::Ping,
            _ => return None,
        })
    }
}

/// A one-shot fault for the next call of a method.
#[derive(Debug, Clone)]
pub enum MockFault {
    /// What Gitea itself answers on failure: HTTP 500, code `unknown`,
    /// message `rpc error: code = <code> desc = <desc>`.
    Gitea { code: GrpcCode, desc: String },
    /// A genuine Connect error code, as a proxy or another server would send
    /// (e.g. `Unavailable` → 503, `Unauthenticated` → 401).
    Connect {
        code: connectrpc::ErrorCode,
        message: String,
    },
    /// A non-Connect HTTP answer (a proxy's error page): status and a `text/plain` body.
    Http { status: u16, body: String },
    /// Wait this long, then handle the call normally (for client timeout tests).
    Delay(Duration),
}

/// Settings of a mock instance.
#[derive(Debug, Clone)]
pub struct MockConfig {
    /// Running tasks not updated for this long are failed (`ZOMBIE_TASK_TIMEOUT`).
    pub zombie_timeout: Duration,
    /// How often the background sweeper runs; `None` = `zombie_timeout / 4`.
    pub sweep_interval: Option<Duration>,
    /// Extra latency added to every `FetchTask`.
    pub fetch_delay: Option<Duration>,
    /// Long polling (go-gitea/gitea#37482): a `FetchTask` that finds no task is held
    /// until the tasks version moves (then it picks again) or this long has passed (then
    /// it answers no task). The client's own deadline is not consulted, so a hold longer
    /// than it ends in the client's timeout.
    pub long_poll: Option<Duration>,
    /// Gitea's AppURL as put into task contexts; `None` = the listening address.
    pub public_url: Option<String>,
    /// Registration tokens accepted from the start.
    pub registration_tokens: Vec<String>,
    /// `gitea_default_actions_url` in task contexts.
    pub default_actions_url: String,
}

impl Default for MockConfig {
    fn default() -> Self {
        Self {
            zombie_timeout: Duration::from_secs(600),
            sweep_interval: None,
            fetch_delay: None,
            long_poll: None,
            public_url: None,
            registration_tokens: Vec::new(),
            default_actions_url: "https://github.com".to_owned(),
        }
    }
}

impl MockConfig {
    #[must_use]
    pub fn with_zombie_timeout(mut self, timeout: Duration) -> Self {
        self.zombie_timeout = timeout;
        self
    }

    #[must_use]
    pub fn with_registration_token(mut self, token: impl Into<String>) -> Self {
        self.registration_tokens.push(token.into());
        self
    }

    #[must_use]
    pub fn with_fetch_delay(mut self, delay: Duration) -> Self {
        self.fetch_delay = Some(delay);
        self
    }

    #[must_use]
    pub fn with_long_poll(mut self, hold: Duration) -> Self {
        self.long_poll = Some(hold);
        self
    }

    fn effective_sweep_interval(&self) -> Duration {
        self.sweep_interval
            .unwrap_or(self.zombie_timeout / 4)
            .max(Duration::from_millis(10))
    }
}

struct Inner {
    state: Mutex<State>,
    /// Bumped after every state change so waiters wake without polling blindly.
    changed: watch::Sender<u64>,
    config: MockConfig,
}

/// Cloneable handle on one mock Gitea: the server and the test-driving API share it.
#[derive(Clone)]
pub struct MockGitea {
    inner: Arc<Inner>,
}

impl MockGitea {
    pub fn new(config: MockConfig) -> Self {
        let state = State::new(
            config
                .public_url
                .clone()
                .map(with_trailing_slash)
                .unwrap_or_default(),
            config.default_actions_url.clone(),
            &config.registration_tokens,
        );
        Self {
            inner: Arc::new(Inner {
                state: Mutex::new(state),
                changed: watch::Sender::new(0),
                config,
            }),
        }
    }

    pub fn config(&self) -> &MockConfig {
        &self.inner.config
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while locked leaves the data usable for a test double; keep serving.
        self.inner.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `f` on the locked state and wakes every waiter afterwards.
    fn mutate<R>(&self, f: impl FnOnce(&mut State) -> R) -> R {
        let r = {
            let mut s = self.lock();
            f(&mut s)
        };
        self.inner.changed.send_modify(|v| *v = v.wrapping_add(1));
        r
    }

    fn read<R>(&self, f: impl FnOnce(&State) -> R) -> R {
        f(&self.lock())
    }

    /// A receiver whose value changes after every state change.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.inner.changed.subscribe()
    }

    /// Serves the mock on `listener` until `shutdown` resolves.
    pub async fn serve(
        self,
        listener: tokio::net::TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        let addr = listener.local_addr()?;
        self.mutate(|s| {
            if s.server_url.is_empty() {
                s.server_url = format!("http://{addr}/");
            }
        });
        let sweeper = {
            let mock = self.clone();
            let interval = self.inner.config.effective_sweep_interval();
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(interval);
                loop {
                    tick.tick().await;
                    mock.sweep_zombies_now();
                }
            })
        };
        let app = server::router(self);
        let served = axum::serve(listener, app)
            .with_graceful_shutdown(shutdown)
            .await;
        sweeper.abort();
        served
    }

    /// Binds `127.0.0.1:0` and serves in a background task.
    pub async fn start(config: MockConfig) -> std::io::Result<RunningMock> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let handle = Self::new(config);
        let (tx, rx) = oneshot::channel::<()>();
        let join = tokio::spawn(handle.clone().serve(listener, async {
            // A dropped sender also means "stop".
            let _ = rx.await;
        }));
        Ok(RunningMock {
            url: format!("http://{addr}"),
            addr,
            handle,
            join,
            stop: Some(tx),
        })
    }

    // ----- test-driving API --------------------------------------------------------------

    pub fn add_registration_token(&self, token: &str) {
        self.mutate(|s| s.add_registration_token(token));
    }

    pub fn invalidate_registration_token(&self, token: &str) {
        self.mutate(|s| s.invalidate_registration_token(token));
    }

    /// Registers a runner without the Register RPC; returns `(uuid, token)`.
    pub fn create_runner(&self, name: &str, labels: &[&str], ephemeral: bool) -> (String, String) {
        self.mutate(|s| s.create_runner(name, labels, ephemeral))
    }

    /// Disables or enables a runner (bumps the tasks version); false if unknown.
    pub fn set_runner_disabled(&self, uuid: &str, disabled: bool) -> bool {
        self.mutate(|s| s.set_runner_disabled(uuid, disabled))
    }

    /// A repository secret, sent in `Task.secrets` of that repo's jobs.
    pub fn set_secret(&self, repo: &str, name: &str, value: &str) {
        self.mutate(|s| s.set_secret(repo, name, value));
    }

    /// A repository variable, sent in `Task.vars`.
    pub fn set_variable(&self, repo: &str, name: &str, value: &str) {
        self.mutate(|s| s.set_variable(repo, name, value));
    }

    /// Queues one run of `yaml` in `repo` (`owner/name`), pushed to `main`: one waiting job
    /// per `jobs:` key.
    pub fn queue_workflow(&self, repo: &str, yaml: &str) -> Result<Vec<JobId>, MockError> {
        self.queue_workflow_for(repo, &Trigger::default(), yaml)
    }

    /// [`MockGitea::queue_workflow`] for a run `trigger` started: its tasks' context
    /// (`event_name`, `ref`, `base_ref`, `head_ref`, `event`) says so as Gitea's does.
    pub fn queue_workflow_for(
        &self,
        repo: &str,
        trigger: &Trigger,
        yaml: &str,
    ) -> Result<Vec<JobId>, MockError> {
        if repo.split('/').filter(|p| !p.is_empty()).count() != 2 {
            return Err(MockError::InvalidWorkflow(format!(
                "repository must be owner/name, got {repo:?}"
            )));
        }
        let wf = workflow::parse_workflow(yaml)?;
        Ok(self.mutate(|s| s.queue_workflow(repo, trigger, wf)))
    }

    /// A user cancel: waiting → cancelled; running → cancelling (runner with the
    /// `cancelling` capability) or cancelled.
    pub fn cancel_job(&self, job: JobId) -> Result<(), MockError> {
        self.mutate(|s| s.cancel_job(job))
    }

    pub fn job(&self, id: JobId) -> Option<JobSnapshot> {
        self.read(|s| s.job(id))
    }

    pub fn jobs(&self) -> Vec<JobSnapshot> {
        self.read(State::jobs)
    }

    pub fn task(&self, task_id: i64) -> Option<TaskSnapshot> {
        self.read(|s| s.task(task_id))
    }

    /// The log rows stored for `job`'s task (none before it is claimed).
    pub fn log_rows(&self, job: JobId) -> Vec<String> {
        self.job(job)
            .and_then(|j| j.task)
            .map(|t| t.log_rows)
            .unwrap_or_default()
    }

    /// How many times a stand-in runner started `job`'s task (0 before it is claimed).
    pub fn runner_starts(&self, job: JobId) -> usize {
        self.job(job)
            .and_then(|j| j.task)
            .map_or(0, |t| t.runner_starts())
    }

    pub fn runner(&self, uuid: &str) -> Option<RunnerSnapshot> {
        self.read(|s| s.runner(uuid))
    }

    /// The latest tasks version (at least 1, as Gitea reports it).
    pub fn tasks_version(&self) -> i64 {
        self.read(State::tasks_version)
    }

    /// Makes the next call of `method` fail (or stall) as `fault` says; faults queue up.
    pub fn fail_next(&self, method: RpcMethod, fault: MockFault) {
        self.mutate(|s| s.faults.entry(method).or_default().push_back(fault));
    }

    /// How many calls of `method` arrived (including faulted ones).
    pub fn calls(&self, method: RpcMethod) -> u64 {
        self.read(|s| s.calls.get(&method).copied().unwrap_or(0))
    }

    /// The most calls of `method` that were being answered at once since the start (or
    /// the last [`MockGitea::reset_in_flight_peaks`]).
    pub fn in_flight_peak(&self, method: RpcMethod) -> u64 {
        self.read(|s| s.in_flight_peak.get(&method).copied().unwrap_or(0))
    }

    /// Starts counting [`MockGitea::in_flight_peak`] afresh from the calls in flight now.
    pub fn reset_in_flight_peaks(&self) {
        let mut s = self.lock();
        s.in_flight_peak = s.in_flight.clone();
    }

    /// Paths (with query) of every request outside `/api/actions`, in arrival order.
    pub fn seen_requests(&self) -> Vec<String> {
        self.read(|s| s.seen_requests.clone())
    }

    /// Every request outside the runner API with its headers (names in lower case), in
    /// order: what a proxy in front of Gitea forwarded.
    pub fn seen_request_headers(&self) -> Vec<(String, Vec<(String, String)>)> {
        self.read(|s| s.seen_request_headers.clone())
    }

    /// Fails zombie tasks now; returns how many were stopped.
    pub fn sweep_zombies_now(&self) -> usize {
        let timeout = self.inner.config.zombie_timeout;
        let n = self.read(|s| s.count_zombies(timeout));
        if n == 0 {
            // Nothing to do: do not wake waiters for a no-op.
            return 0;
        }
        self.mutate(|s| s.sweep_zombies(timeout))
    }

    /// Waits until `pred` holds, re-checking after every state change (and every 50 ms,
    /// for time-based conditions).
    pub async fn wait_for(
        &self,
        mut pred: impl FnMut(&MockGitea) -> bool,
        timeout: Duration,
    ) -> Result<(), MockError> {
        self.wait_for_value(|m| pred(m).then_some(()), timeout)
            .await
    }

    /// Waits until `f` returns `Some`, and returns that value.
    pub async fn wait_for_value<T>(
        &self,
        mut f: impl FnMut(&MockGitea) -> Option<T>,
        timeout: Duration,
    ) -> Result<T, MockError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut rx = self.subscribe();
        loop {
            rx.mark_unchanged();
            if let Some(v) = f(self) {
                return Ok(v);
            }
            let now = tokio::time::Instant::now();
            if now >= deadline {
                return Err(MockError::Timeout(timeout));
            }
            let nap = (deadline - now).min(Duration::from_millis(50));
            // Either a change or the nap ends the wait; both lead to a re-check.
            let _ = tokio::time::timeout(nap, rx.changed()).await;
        }
    }
}

fn with_trailing_slash(mut url: String) -> String {
    if !url.ends_with('/') {
        url.push('/');
    }
    url
}

/// A mock serving in the background; dropping it stops the server.
pub struct RunningMock {
    /// `http://127.0.0.1:<port>` (no trailing slash).
    pub url: String,
    pub addr: std::net::SocketAddr,
    pub handle: MockGitea,
    pub join: JoinHandle<std::io::Result<()>>,
    stop: Option<oneshot::Sender<()>>,
}

impl RunningMock {
    /// Base URI for Connect clients: `<url>/api/actions`.
    pub fn api_url(&self) -> String {
        format!("{}/api/actions", self.url)
    }

    /// Stops the server and waits for it to finish.
    pub async fn shutdown(mut self) -> std::io::Result<()> {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        match (&mut self.join).await {
            Ok(r) => r,
            Err(e) => Err(std::io::Error::other(e)),
        }
    }
}

impl Drop for RunningMock {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
    }
}
