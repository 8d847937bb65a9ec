//! The facade with real peers: executor (loopback proxy, SPIFFE mTLS from a fake Workload
//! API) → facade → mock Gitea, with the stand-in runner doing the runner's side.

use std::sync::Arc;
use std::time::Duration;

use connectrpc::client::{ClientConfig, HttpClient};
use gdr_controller::dispatch::{ClaimState, Dispatch};
use gdr_controller::facade::{BackendStandbys, ExecutorChannel};
use gdr_controller::settings::FacadeLimits;
use gdr_controller::shutdown::{ShutdownTrigger, shutdown_channel};
use gdr_core::assignment::{Assignment, DerivationPolicy};
use gdr_core::backend::{Backend, BackendLabels};
use gdr_core::capability::CapabilityKey;
use gdr_core::executor::{ExecutorBackend, ExecutorSpec};
use gdr_core::identity::{IdentityScheme, TrustDomain};
use gdr_core::metadata::MetadataCodec;
use gdr_executor::oneshot::{ExecutorConfig, Forward, TERMINATION_DELIVERY, run};
use gdr_facade::Facade;
use gdr_facade::proxy::{ReverseProxy, UpstreamTimeouts};
use gdr_facade::tls::FacadeStats;
use gdr_gitea::{ClientOptions, Credentials, GiteaClient};
use gdr_identity::tls;
use gdr_proto::runner::v1::{
    DeclareRequest, FetchTaskRequest, LogRow, RegisterRequest, RunnerServiceClient,
    UpdateLogRequest,
};
use gdr_testkit::log_capture::Capture;
use gdr_testkit::memory_backend::MemoryBackend;
use gdr_testkit::mock_gitea::{MockConfig, MockGitea, RunningMock, Status};
use gdr_testkit::spiffe::{
    FakeWorkloadApi, RunningWorkloadApi, TestCa, any_server_client_config, raw_tls_get, tls_over,
};
use gdr_testkit::standin_dockerd::{
    Readiness, RunnerStart, StandinDockerd, recording_runner, runner_start,
};

pub(super) const WAIT: Duration = Duration::from_secs(30);
/// No signal ever reaches these executors.
fn no_signals() -> tokio::sync::mpsc::Receiver<Forward> {
    tokio::sync::mpsc::channel(1).1
}

const KEY: &[u8] = b"0123456789abcdef0123456789abcdef";
pub(super) const FACADE_ID: &str = "spiffe://example.org/controller";
const STANDIN: &str = env!("CARGO_BIN_EXE_gitea-runner-standin");
const DOCKERD: &str = env!("CARGO_BIN_EXE_dockerd-standin");

/// How [`Env::with`] sets its facade up.
struct EnvOptions {
    limits: FacadeLimits,
    /// Slots of the pod backend.
    capacity: usize,
    /// Where the facade forwards to instead of the mock Gitea (the runner calls and the
    /// pass-through; tasks are still fetched from the mock).
    upstream: Option<String>,
    timeouts: UpstreamTimeouts,
    /// Request timeout of the client the facade forwards UpdateTask/UpdateLog with.
    forward_timeout: Duration,
    /// The Workload API the facade's SVID comes from instead of the fake one of the test
    /// CA (the real SPIRE agent of tests/real_spire.rs).
    facade_endpoint: Option<String>,
}

impl Default for EnvOptions {
    fn default() -> Self {
        EnvOptions {
            limits: FacadeLimits::default(),
            capacity: 4,
            upstream: None,
            timeouts: UpstreamTimeouts::default(),
            forward_timeout: ClientOptions::new("http://unused").request_timeout,
            facade_endpoint: None,
        }
    }
}

pub(super) struct Env {
    pub(super) mock: RunningMock,
    gitea: GiteaClient,
    pub(super) ca: TestCa,
    pub(super) dir: tempfile::TempDir,
    backend: Arc<MemoryBackend>,
    pub(super) dispatch: Arc<Dispatch>,
    facade_api: RunningWorkloadApi,
    pub(super) facade_addr: std::net::SocketAddr,
    /// The facade's connection counters.
    facade_stats: Arc<FacadeStats>,
    metrics: Arc<gdr_controller::job_metrics::JobMetrics>,
    stop: ShutdownTrigger,
}

impl Env {
    pub(super) async fn new() -> Self {
        Self::with_limits(FacadeLimits::default()).await
    }

    /// A facade whose SVID comes from the Workload API at `endpoint`.
    pub(super) async fn with_facade_identity(endpoint: String) -> Self {
        Self::with(EnvOptions {
            facade_endpoint: Some(endpoint),
            ..EnvOptions::default()
        })
        .await
    }

    async fn with_limits(limits: FacadeLimits) -> Self {
        Self::build(limits, 4).await
    }

    /// A facade with `limits` over a pod backend of `capacity` slots.
    async fn build(limits: FacadeLimits, capacity: usize) -> Self {
        Self::with(EnvOptions {
            limits,
            capacity,
            ..EnvOptions::default()
        })
        .await
    }

    async fn with(options: EnvOptions) -> Self {
        let EnvOptions {
            limits,
            capacity,
            upstream,
            timeouts,
            forward_timeout,
            facade_endpoint,
        } = options;
        let mock = MockGitea::start(MockConfig::default()).await.expect("mock");
        let (uuid, token) = mock
            .handle
            .create_runner("ctl", &["self-hosted", "pod"], false);
        let gitea = GiteaClient::new(
            ClientOptions::new(mock.url.clone()),
            Some(&Credentials::new(uuid, token)),
        )
        .expect("client");
        let ca = TestCa::new("example.org").expect("ca");
        let dir = tempfile::Builder::new().prefix("f").tempdir().expect("dir");
        let facade_api = FakeWorkloadApi::start(dir.path(), ca.clone(), FACADE_ID)
            .await
            .expect("workload api");
        let source = tls::x509_source(&facade_endpoint.unwrap_or_else(|| facade_api.endpoint()))
            .await
            .expect("facade svid");
        let tls = Arc::new(tls::facade_server_config(&source, "example.org").expect("tls"));
        let backend = Arc::new(MemoryBackend::new(Backend::Pod));
        let dispatch = Arc::new(Dispatch::new(
            [(backend.clone() as Arc<dyn ExecutorBackend>, capacity)],
            CapabilityKey::new(KEY).expect("key"),
        ));
        // What the facade forwards UpdateTask/UpdateLog with; Gitea itself unless a test
        // puts another upstream there.
        let forwarding = match &upstream {
            None => gitea.clone(),
            Some(url) => {
                let mut client = ClientOptions::new(url.clone());
                client.request_timeout = forward_timeout;
                GiteaClient::new(client, Some(&Credentials::new("ctl", "token"))).expect("client")
            }
        };
        let metrics = Arc::new(gdr_controller::job_metrics::JobMetrics::default());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let facade_addr = listener.local_addr().expect("addr");
        // The memory backend stands in for the VM backend's claim of a warm sandbox
        // (`MemoryBackend::claim_standby`); the controller's own port answers from it.
        let standbys = BackendStandbys::new(
            dispatch.clone(),
            std::collections::BTreeMap::from([(
                Backend::Pod,
                ExecutorChannel {
                    facade_url: format!("https://{facade_addr}"),
                    facade_spiffe_id: FACADE_ID.into(),
                    runner_label: "pod".into(),
                    report_outage_tolerance: Duration::from_secs(600),
                },
            )]),
        );
        let facade = Arc::new(
            Facade::new(
                dispatch.clone(),
                forwarding,
                Some("job-summary".into()),
                BackendLabels::default(),
            )
            .with_metrics(metrics.clone())
            .with_standbys(Arc::new(standbys)),
        );
        let proxy =
            ReverseProxy::with_timeouts(upstream.as_deref().unwrap_or(&mock.url), None, timeouts)
                .expect("proxy");
        let facade_stats = Arc::new(FacadeStats::default());
        let stats = facade_stats.clone();
        let (stop, stopped) = shutdown_channel();
        tokio::spawn(async move {
            // The source must live as long as the server: it rotates the facade's SVID.
            let _source = source;
            facade
                .serve_limited(listener, tls, proxy, limits, stats, stopped)
                .await
        });
        Env {
            mock,
            gitea,
            ca,
            dir,
            backend,
            dispatch,
            facade_api,
            facade_addr,
            facade_stats,
            metrics,
            stop,
        }
    }

    /// Queues a job, fetches it as the scheduler would and lets a worker offer it.
    pub(super) async fn assignment(&self, step: &str) -> Assignment {
        let assignment = self.executor_only(step).await;
        self.dispatch.admit(Backend::Pod, assignment.id());
        self.dispatch.offer(&assignment);
        assignment
    }

    /// Like [`Self::assignment`], but nothing is offered: the executor exists on the
    /// backend while its assignment waits for redelivery (a controller just restarted).
    async fn executor_only(&self, step: &str) -> Assignment {
        let yaml = format!(
            "on: push\njobs:\n  build:\n    runs-on: [self-hosted, pod]\n    steps:\n      - run: {step}\n"
        );
        self.mock
            .handle
            .queue_workflow("owner/repo", &yaml)
            .expect("queue");
        self.fetched_executor().await
    }

    /// Fetches the next task as the scheduler would and creates its executor on the
    /// backend (nothing offered yet).
    async fn fetched_executor(&self) -> Assignment {
        let task = self
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
        let assignment = Assignment::from_task(task, &policy).expect("assignment");
        self.backend
            .create(&ExecutorSpec::new(
                &assignment,
                self.dispatch.capability_key().issue(assignment.id()),
                &MetadataCodec::default(),
                self.facade_url(),
                FACADE_ID,
                "pod",
            ))
            .await
            .expect("executor");
        assignment
    }

    pub(super) fn facade_url(&self) -> String {
        format!("https://{}", self.facade_addr)
    }

    pub(super) async fn workload(&self, spiffe_id: &str) -> RunningWorkloadApi {
        FakeWorkloadApi::start(self.dir.path(), self.ca.clone(), spiffe_id)
            .await
            .expect("workload api")
    }

    fn executor_config(
        &self,
        assignment: &Assignment,
        workload: &RunningWorkloadApi,
    ) -> ExecutorConfig {
        self.executor_config_with(assignment, workload, &[])
    }

    /// [`Self::executor_config`] with `extra` variables set (or overridden; the first of a
    /// name wins).
    fn executor_config_with(
        &self,
        assignment: &Assignment,
        workload: &RunningWorkloadApi,
        extra: &[(&str, String)],
    ) -> ExecutorConfig {
        ExecutorConfig::from_env(|name| {
            if let Some((_, value)) = extra.iter().find(|(k, _)| *k == name) {
                return Some(value.clone());
            }
            self.executor_variable(assignment, workload, name)
        })
        .expect("executor config")
    }

    /// Gives an executor process `command` the variables its backend would set for
    /// `assignment` (its runner binary aside).
    fn pass_executor_variables(
        &self,
        command: &mut tokio::process::Command,
        assignment: &Assignment,
        workload: &RunningWorkloadApi,
    ) {
        for name in [
            "CI_ASSIGNMENT_ID",
            "CI_RUNNER_CAPABILITY",
            "CI_RUNNER_BACKEND",
            "CI_RUNNER_FACADE_URL",
            "CI_RUNNER_FACADE_SPIFFE_ID",
            "SPIFFE_ENDPOINT_SOCKET",
            "CI_EXECUTOR_READY_TIMEOUT",
        ] {
            if let Some(value) = self.executor_variable(assignment, workload, name) {
                command.env(name, value);
            }
        }
    }

    fn executor_variable(
        &self,
        assignment: &Assignment,
        workload: &RunningWorkloadApi,
        name: &str,
    ) -> Option<String> {
        match name {
            "CI_ASSIGNMENT_ID" => Some(assignment.id().as_str().to_string()),
            "CI_RUNNER_CAPABILITY" => Some(
                self.dispatch
                    .capability_key()
                    .issue(assignment.id())
                    .expose()
                    .to_string(),
            ),
            "CI_RUNNER_BACKEND" => Some("pod".into()),
            "CI_RUNNER_FACADE_URL" => Some(self.facade_url()),
            "CI_RUNNER_FACADE_SPIFFE_ID" => Some(FACADE_ID.into()),
            "SPIFFE_ENDPOINT_SOCKET" => Some(workload.endpoint()),
            "GITEA_RUNNER_BINARY" => Some(STANDIN.into()),
            "CI_EXECUTOR_READY_TIMEOUT" => Some("20".into()),
            _ => None,
        }
    }

    /// A Connect client that reaches the facade the way a runner in an executor does:
    /// through a loopback proxy holding `spiffe_id`'s SVID, presenting `uuid`/`token`.
    async fn runner_client(
        &self,
        workload: &RunningWorkloadApi,
        uuid: &str,
        token: &str,
    ) -> RunnerServiceClient<HttpClient> {
        let source = gdr_identity::svid_stream::svid_stream(&workload.endpoint(), WAIT)
            .await
            .expect("svid");
        let config = gdr_identity::svid_stream::executor_client_config(&source, FACADE_ID)
            .expect("client tls");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let local = listener.local_addr().expect("addr");
        let relay = gdr_executor::relay::Relay::new(
            uuid,
            &self.facade_url(),
            &config,
            std::time::Duration::from_secs(5),
        )
        .expect("relay");
        let credentials =
            gdr_executor::proxy::RunnerCredentials::new(uuid, token).expect("credentials");
        tokio::spawn(async move {
            let _source = source;
            gdr_executor::proxy::serve_loopback_proxy(
                listener,
                relay,
                credentials,
                gdr_controller::shutdown::Shutdown::never(),
            )
            .await
        });
        let config = ClientConfig::new(format!("http://{local}/api/actions").parse().expect("uri"))
            .with_default_header("x-runner-uuid", uuid)
            .with_default_header("x-runner-token", token);
        RunnerServiceClient::new(HttpClient::plaintext(), config)
    }

    /// The assignment's capability, as its executor presents it.
    fn capability(&self, assignment: &Assignment) -> String {
        self.dispatch
            .capability_key()
            .issue(assignment.id())
            .expose()
            .to_string()
    }

    /// `jobs_completed_total{backend="pod",result}`.
    fn completed(&self, result: &str) -> u64 {
        self.metrics
            .jobs_completed
            .get_or_create(&gdr_controller::job_metrics::ResultLabels {
                backend: "pod".into(),
                result: result.into(),
            })
            .get()
    }

    /// The runner credentials of `assignment` as HTTP/1.1 header lines.
    fn credential_lines(&self, assignment: &Assignment) -> String {
        format!(
            "x-runner-uuid: {}\r\nx-runner-token: {}\r\n",
            assignment.id().as_str(),
            self.dispatch
                .capability_key()
                .issue(assignment.id())
                .expose()
        )
    }

    /// The pass-through requests Gitea received for `path_and_query`, with their headers.
    fn seen_headers(&self, path_and_query: &str) -> Vec<Vec<(String, String)>> {
        self.mock
            .handle
            .seen_request_headers()
            .into_iter()
            .filter(|(p, _)| p == path_and_query)
            .map(|(_, headers)| headers)
            .collect()
    }

    pub(super) async fn job_status(&self, assignment: &Assignment, status: Status) {
        let task_id = assignment.id().task_id();
        self.mock
            .handle
            .wait_for(
                |m| {
                    m.jobs()
                        .iter()
                        .any(|j| j.task_id == Some(task_id) && j.status == status)
                },
                WAIT,
            )
            .await
            .unwrap_or_else(|_| panic!("task {task_id} never reached {status:?}"));
    }
}

/// DESIGN invariant 14: the `.runner` file holds the assignment's capability; it never
/// outlives the executor, early errors included (here: the facade never answers).
#[tokio::test(flavor = "multi_thread")]
async fn the_runner_file_with_the_capability_is_removed_when_the_executor_gives_up_early() {
    let env = Env::new().await;
    let a = env.assignment("standin:success").await;
    let workload = env.workload(a.identity().spiffe_id()).await;
    let work = tempfile::tempdir().expect("work dir");
    let unreachable = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind")
        .local_addr()
        .expect("addr");
    let base = env.executor_config(&a, &workload);
    let config = ExecutorConfig::from_env(|name| match name {
        "CI_RUNNER_FACADE_URL" => Some(format!("https://{unreachable}")),
        "CI_EXECUTOR_READY_TIMEOUT" => Some("1".into()),
        "CI_RUNNER_WORKDIR" => Some(work.path().display().to_string()),
        "CI_ASSIGNMENT_ID" => Some(base.assignment_id.to_string()),
        "CI_RUNNER_CAPABILITY" => Some(base.capability.clone()),
        "CI_RUNNER_BACKEND" => Some("pod".into()),
        "CI_RUNNER_FACADE_SPIFFE_ID" => Some(FACADE_ID.into()),
        "SPIFFE_ENDPOINT_SOCKET" => Some(workload.endpoint()),
        "GITEA_RUNNER_BINARY" => Some(STANDIN.into()),
        _ => None,
    })
    .expect("executor config");
    let result = run(config, no_signals()).await;
    assert!(result.is_err(), "the facade is unreachable: {result:?}");
    let left: Vec<_> = std::fs::read_dir(work.path())
        .expect("work dir")
        .map(|e| e.expect("entry").file_name())
        .collect();
    assert!(
        !left.iter().any(|n| n == ".runner"),
        "the capability was left behind: {left:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_job_runs_through_executor_facade_and_mock_gitea_with_its_logs_and_result() {
    let env = Env::new().await;
    let a = env.assignment("standin:success").await;
    let workload = env.workload(a.identity().spiffe_id()).await;
    let status = run(env.executor_config(&a, &workload), no_signals())
        .await
        .expect("executor runs");
    assert!(status.success(), "the runner exits 0");
    env.job_status(&a, Status::Success).await;
    let job = env
        .mock
        .handle
        .jobs()
        .into_iter()
        .find(|j| j.task_id == Some(a.id().task_id()))
        .expect("job");
    let task = job.task.expect("task");
    assert!(
        !task.log_rows.is_empty() && task.log_archived,
        "logs forwarded: {:?}",
        task.log_rows
    );
    let record = env.backend.records().into_iter().next().expect("executor");
    assert!(
        record.claimed && record.terminal,
        "claim and terminal marker are durable on the backend"
    );
    assert_eq!(
        env.dispatch.pool_usage(Backend::Pod),
        (0, 4),
        "the slot is released at the terminal update"
    );
    assert_eq!(env.dispatch.claim_state(a.id()), Some(ClaimState::Terminal));
}

/// Issue 39 item 2 (DESIGN invariant 16, rotation without a new connection): an executor
/// opens exactly one `FetchX509SVID` stream for a whole job: its first message is the SVID,
/// and rotations come on the same stream, not on a second one opened after the first fetch.
/// A rotation during the job shows the stream is still the one that carries them.
#[tokio::test(flavor = "multi_thread")]
async fn an_executor_opens_exactly_one_workload_api_stream_through_a_whole_job() {
    let env = Env::new().await;
    let a = env.assignment("standin:success").await;
    let workload = env.workload(a.identity().spiffe_id()).await;
    let executor = tokio::spawn(run(env.executor_config(&a, &workload), no_signals()));
    gdr_testkit::until(WAIT, "the executor to fetch its SVID", || async {
        workload.fetch_count() > 0
    })
    .await;
    workload.rotate().expect("rotate");
    let status = executor
        .await
        .expect("executor task")
        .expect("executor runs");
    assert!(status.success(), "the runner exits 0");
    env.job_status(&a, Status::Success).await;
    assert_eq!(
        workload.fetch_count(),
        1,
        "X.509-SVID streams the executor opened"
    );
}

/// DESIGN invariant 16 (an executor's Pod ends as a kubelet ends it): a SIGTERM that comes
/// while the executor still waits for its SVID (its identity entry not bound yet: the
/// Workload API accepts and says nothing) stops it at once, naming why, instead of leaving
/// it to the SIGKILL at the end of its Pod's grace period. Its ready timeout is far away.
#[tokio::test(flavor = "multi_thread")]
async fn a_sigterm_while_the_executor_waits_for_its_svid_stops_it_at_once() {
    let env = Env::new().await;
    let a = env.assignment("standin:success").await;
    let workload = env.workload(a.identity().spiffe_id()).await;
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("silent.sock");
    let silent = tokio::net::UnixListener::bind(&socket).unwrap();
    let (accepted_tx, mut accepted) = tokio::sync::mpsc::channel(1);
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = silent.accept().await {
            held.push(stream);
            let _ = accepted_tx.try_send(());
        }
    });
    let config = env.executor_config_with(
        &a,
        &workload,
        &[
            (
                "SPIFFE_ENDPOINT_SOCKET",
                format!("unix://{}", socket.display()),
            ),
            ("CI_EXECUTOR_READY_TIMEOUT", "600".to_owned()),
        ],
    );
    let (signal, signals) = tokio::sync::mpsc::channel(1);
    let executor = tokio::spawn(run(config, signals));
    tokio::time::timeout(WAIT, accepted.recv())
        .await
        .expect("the executor asks the Workload API for its SVID");
    signal.send(Forward::Terminate).await.unwrap();
    let ended = tokio::time::timeout(WAIT, executor)
        .await
        .expect("the executor stops on SIGTERM, not at its ready timeout")
        .expect("executor task");
    let error = ended.expect_err("no runner ran");
    assert!(
        error
            .to_string()
            .contains("stopped by Terminate before the runner started"),
        "{error}"
    );
}

/// The executor's own binary, which `cargo build --workspace` (the test command) puts next to
/// the controller's, where the process backend looks for it.
fn executor_binary() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_BIN_EXE_gitea-dynamic-runner"))
        .with_file_name(gdr_executor::cli::BINARY)
}

/// The executor's own binary in VM standby mode, as a warm sandbox starts it: its standby
/// ID, where the facade is and its Workload API, no assignment.
fn warm_executor(env: &Env, workload: &str) -> tokio::process::Command {
    let mut command = tokio::process::Command::new(executor_binary());
    command
        .arg("executor")
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("CI_EXECUTOR_STANDBY_ID", STANDBY_ID)
        .env("CI_RUNNER_FACADE_URL", env.facade_url())
        .env("CI_RUNNER_FACADE_SPIFFE_ID", FACADE_ID)
        // What a warm VM's environment says; the assignment's own values replace them.
        .env("CI_RUNNER_BACKEND", "vm")
        .env("CI_RUNNER_LABEL", "vm")
        .env("SPIFFE_ENDPOINT_SOCKET", workload)
        .env("CI_EXECUTOR_READY_TIMEOUT", "20")
        .env("GITEA_RUNNER_BINARY", STANDIN)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true);
    command
}

/// Issue 39 item 2: the executor's own binary (`gitea-dynamic-executor`, no controller code)
/// runs a job as the controller binary's `executor` subcommand does, from the same
/// environment and the same argument, with one Workload API stream.
#[tokio::test(flavor = "multi_thread")]
async fn the_executors_own_binary_runs_a_job_from_the_same_environment_as_the_executor_subcommand()
{
    let bin = executor_binary();
    assert!(
        bin.is_file(),
        "{} is built by the test command (cargo nextest run --workspace)",
        bin.display()
    );
    let env = Env::new().await;
    let a = env.assignment("standin:success").await;
    let workload = env.workload(a.identity().spiffe_id()).await;
    let mut command = tokio::process::Command::new(&bin);
    command
        .arg("executor")
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .kill_on_drop(true);
    env.pass_executor_variables(&mut command, &a, &workload);
    if let Some(runner) = env.executor_variable(&a, &workload, "GITEA_RUNNER_BINARY") {
        command.env("GITEA_RUNNER_BINARY", runner);
    }
    let output = tokio::time::timeout(WAIT, command.output())
        .await
        .expect("the executor ends")
        .expect("the executor runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{}\n{stderr}", output.status);
    env.job_status(&a, Status::Success).await;
    assert_eq!(workload.fetch_count(), 1, "{stderr}");
}

// === warm VM executors (issue 39 item 5) ===

/// The standby ID the tests' warm executors have.
const STANDBY_ID: &str = "warm-1";

/// A warm executor's standby request ([`gdr_core::executor::standby`]) presenting `svid`:
/// the status and the body of the facade's answer.
async fn standby_post(
    env: &Env,
    svid: &gdr_testkit::spiffe::Svid,
    standby_id: &str,
) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut tls = tls_to(env.facade_addr, svid, &[b"http/1.1"]).await;
    let request = format!(
        "POST {} HTTP/1.1\r\nhost: x\r\n{}: {standby_id}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
        gdr_core::executor::standby::PATH,
        gdr_core::executor::standby::ID_HEADER,
    );
    tls.write_all(request.as_bytes()).await.expect("write");
    let mut answer = Vec::new();
    tokio::time::timeout(WAIT, tls.read_to_end(&mut answer))
        .await
        .expect("the facade answers")
        .expect("read");
    let answer = String::from_utf8_lossy(&answer).into_owned();
    let status = answer
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no HTTP answer: {answer:?}"));
    let body = answer
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
        .unwrap_or_default();
    (status, body)
}

/// The SVID of `assignment`'s job, as SPIRE issues it to the sandbox its job claimed.
fn svid_of(env: &Env, assignment: &Assignment) -> gdr_testkit::spiffe::Svid {
    env.ca
        .issue(assignment.identity().spiffe_id(), Duration::from_secs(600))
        .expect("svid")
}

/// DESIGN invariants 14 and 15 (issue 39 item 5): a warm sandbox's assignment, capability
/// included, is handed only to the workload of the job that claimed it: nothing while no
/// job has (404), nothing to a peer with another SPIFFE ID (403), and to the claiming
/// job's workload the variables of a fresh executor of its assignment with a capability
/// that verifies under the facade's key (200).
#[tokio::test(flavor = "multi_thread")]
async fn a_warm_sandboxs_assignment_is_handed_only_to_the_workload_of_the_job_that_claimed_it() {
    let env = Env::new().await;
    let a = env.assignment("standin:success").await;
    let own = svid_of(&env, &a);
    let (status, _) = standby_post(&env, &own, STANDBY_ID).await;
    assert_eq!(status, 404, "no job has claimed the sandbox yet");

    env.backend.claim_standby(STANDBY_ID, a.id());
    let (status, body) = standby_post(&env, &job_svid(&env, "other"), STANDBY_ID).await;
    assert_eq!(status, 403, "another job's workload: {body}");
    assert!(!body.contains("CI_RUNNER_CAPABILITY"), "{body}");
    let (status, _) = standby_post(&env, &own, "warm-2").await;
    assert_eq!(status, 404, "another sandbox, not claimed");

    let (status, body) = standby_post(&env, &own, STANDBY_ID).await;
    assert_eq!(status, 200, "{body}");
    let vars: std::collections::BTreeMap<String, String> =
        serde_json::from_str(&body).expect("a JSON object of strings");
    assert_eq!(vars["CI_ASSIGNMENT_ID"], a.id().as_str());
    assert_eq!(vars["CI_SPIFFE_ID"], a.identity().spiffe_id());
    assert_eq!(vars["CI_RUNNER_FACADE_URL"], env.facade_url());
    assert_eq!(vars["CI_RUNNER_FACADE_SPIFFE_ID"], FACADE_ID);
    assert_eq!(vars["CI_RUNNER_BACKEND"], "pod");
    assert!(
        env.dispatch
            .capability_key()
            .verify(a.id().as_str(), &vars["CI_RUNNER_CAPABILITY"]),
        "the capability verifies under the facade's key"
    );
    let mut names: Vec<&str> = vars.keys().map(String::as_str).collect();
    names.retain(|n| {
        !gdr_core::executor::env::ASSIGNMENT.contains(n)
            && *n != gdr_core::executor::env::REPORT_OUTAGE_TOLERANCE
    });
    assert!(
        names.is_empty(),
        "only an assignment's variables: {names:?}"
    );

    env.backend
        .set_failing(Some(gdr_testkit::memory_backend::Failure::Unavailable));
    let (status, body) = standby_post(&env, &own, STANDBY_ID).await;
    assert_eq!(
        status, 503,
        "the backend cannot be read: ask again ({body})"
    );
}

/// DESIGN invariant 15 (issue 39 item 5): once the runner claimed its task, the standby
/// route hands the assignment out no more, not even to the claiming job's workload.
#[tokio::test(flavor = "multi_thread")]
async fn a_warm_sandboxs_assignment_is_refused_once_its_runner_claimed_the_task() {
    let env = Env::new().await;
    let a = env.assignment("standin:success").await;
    env.backend.claim_standby(STANDBY_ID, a.id());
    let own = svid_of(&env, &a);
    assert_eq!(standby_post(&env, &own, STANDBY_ID).await.0, 200);
    let workload = env.workload(a.identity().spiffe_id()).await;
    let runner = env
        .runner_client(&workload, a.id().as_str(), &env.capability(&a))
        .await;
    let fetched = runner
        .fetch_task(FetchTaskRequest::default())
        .await
        .expect("fetch")
        .into_owned();
    assert!(
        fetched.task.into_option().is_some(),
        "the runner claimed it"
    );
    let (status, body) = standby_post(&env, &own, STANDBY_ID).await;
    assert_eq!(status, 403, "{body}");
    assert!(!body.contains("CI_RUNNER_CAPABILITY"), "{body}");
}

/// DESIGN invariants 14 and 16 (issue 39 item 5): the executor's own binary in VM standby
/// mode (`CI_EXECUTOR_STANDBY_ID`, no assignment in its environment) dials nothing while
/// the Workload API has no SVID for it; once a job claimed its sandbox and its SVID is
/// issued, it gets its assignment from the facade and runs as a fresh executor of it: its
/// runner declares and fetches with the assignment's ID and capability, and the job ends.
#[tokio::test(flavor = "multi_thread")]
async fn a_warm_vm_executor_dials_nothing_before_its_svid_then_runs_the_job_that_claimed_it() {
    let env = Env::new().await;
    let a = env.assignment("standin:success").await;
    let workload = env.workload(a.identity().spiffe_id()).await;
    // A warm sandbox has no SPIRE entry before the claim.
    workload.clear_identity();
    let executor = warm_executor(&env, &workload.endpoint())
        .spawn()
        .expect("the executor starts");
    gdr_testkit::until(
        WAIT,
        "the warm executor to ask for its SVID a few times",
        || async { workload.fetch_count() >= 3 },
    )
    .await;
    assert_eq!(
        env.facade_stats
            .accepted
            .load(std::sync::atomic::Ordering::Relaxed),
        0,
        "a warm executor without an SVID dials nothing"
    );
    // The claim writes the assignment onto the sandbox; then SPIRE issues its SVID.
    env.backend.claim_standby(STANDBY_ID, a.id());
    workload
        .set_identity(a.identity().spiffe_id())
        .expect("identity");
    let output = tokio::time::timeout(WAIT, executor.wait_with_output())
        .await
        .expect("the executor ends")
        .expect("the executor runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{}\n{stderr}", output.status);
    env.job_status(&a, Status::Success).await;
    let record = env.backend.records().into_iter().next().expect("executor");
    assert!(
        record.claimed && record.terminal,
        "its runner claimed the task with the assignment's credentials and finished it"
    );
    assert!(
        !stderr.contains(&env.capability(&a)),
        "the capability is never logged"
    );
}

/// Issue 39 item 5: a warm VM executor that has its SVID before the facade knows of the
/// claim (the backend's view lags) is answered 404 and asks again, and runs its job once
/// the claim is seen.
#[tokio::test(flavor = "multi_thread")]
async fn a_warm_vm_executor_asks_again_until_the_facade_knows_of_the_claim() {
    let env = Env::new().await;
    let a = env.assignment("standin:success").await;
    let workload = env.workload(a.identity().spiffe_id()).await;
    let executor = warm_executor(&env, &workload.endpoint())
        .spawn()
        .expect("the executor starts");
    // One executor asks one request at a time: by its second ask, the first was answered
    // from a backend that knew of no claim.
    gdr_testkit::until(
        WAIT,
        "the warm executor to ask the facade twice",
        || async { env.backend.standby_calls() >= 2 },
    )
    .await;
    env.backend.claim_standby(STANDBY_ID, a.id());
    let output = tokio::time::timeout(WAIT, executor.wait_with_output())
        .await
        .expect("the executor ends")
        .expect("the executor runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{}\n{stderr}", output.status);
    env.job_status(&a, Status::Success).await;
}

/// A warm VM executor whose standby request the facade refuses for good (here: its SVID is
/// another job's than the one that claimed its sandbox) exits at once with the facade's
/// reason, instead of asking forever (DESIGN invariant 15).
#[tokio::test(flavor = "multi_thread")]
async fn a_warm_vm_executor_refused_by_the_facade_exits_with_the_reason() {
    let env = Env::new().await;
    let a = env.assignment("standin:success").await;
    env.backend.claim_standby(STANDBY_ID, a.id());
    let workload = env
        .workload("spiffe://example.org/ci/owner/repo/branch/main/other")
        .await;
    let output = tokio::time::timeout(WAIT, warm_executor(&env, &workload.endpoint()).output())
        .await
        .expect("the executor ends")
        .expect("the executor runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(
        stderr.contains("the facade refused to hand standby warm-1 its assignment")
            && stderr.contains("SPIFFE ID is not the claiming job's"),
        "{stderr}"
    );
    assert!(!env.backend.records()[0].claimed, "no runner ran");
}

/// Issue 39 item 2: no probe of the facade precedes the runner. The runner starts while
/// the facade does not answer yet (a door in front of it holds every connection
/// unanswered); its first call, held by the relay, proves the channel once the door
/// opens, and the job runs.
#[tokio::test(flavor = "multi_thread")]
async fn the_runner_starts_before_the_facade_answers_and_its_first_call_proves_the_channel() {
    let env = Env::new().await;
    let a = env.assignment("standin:success").await;
    let workload = env.workload(a.identity().spiffe_id()).await;
    let records = tempfile::tempdir().expect("dir");
    let door = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let mut config = env.executor_config(&a, &workload);
    config.facade_url = format!("https://{}", door.local_addr().expect("addr"));
    config.runner_binary =
        recording_runner(records.path(), STANDIN.as_ref()).expect("recording runner");
    let executor = tokio::spawn(run(config, no_signals()));
    gdr_testkit::until(
        WAIT,
        "the runner to start while the facade does not answer",
        || async { runner_start(records.path()).is_some() },
    )
    .await;
    let facade = env.facade_addr;
    tokio::spawn(async move {
        while let Ok((mut inbound, _)) = door.accept().await {
            tokio::spawn(async move {
                if let Ok(mut outbound) = tokio::net::TcpStream::connect(facade).await {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                }
            });
        }
    });
    let status = tokio::time::timeout(WAIT, executor)
        .await
        .expect("the executor ends")
        .expect("join")
        .expect("executor runs");
    assert!(status.success(), "the runner exits 0");
    env.job_status(&a, Status::Success).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_cancel_in_gitea_reaches_the_runner_which_reports_cancelled() {
    let env = Env::new().await;
    let a = env.assignment("standin:hang").await;
    let workload = env.workload(a.identity().spiffe_id()).await;
    let executor = tokio::spawn(run(env.executor_config(&a, &workload), no_signals()));
    let task_id = a.id().task_id();
    env.mock
        .handle
        .wait_for(|m| m.task(task_id).is_some_and(|t| t.heartbeats > 0), WAIT)
        .await
        .expect("the runner is heartbeating");
    let job = env
        .mock
        .handle
        .jobs()
        .into_iter()
        .find(|j| j.task_id == Some(task_id))
        .expect("job");
    env.mock.handle.cancel_job(job.id).expect("cancel");
    env.job_status(&a, Status::Cancelled).await;
    let status = tokio::time::timeout(WAIT, executor)
        .await
        .expect("executor ends")
        .expect("join")
        .expect("ran");
    assert!(status.success());
}

#[tokio::test(flavor = "multi_thread")]
async fn an_svid_rotation_during_a_job_does_not_interrupt_it() {
    let env = Env::new().await;
    let a = env.assignment("standin:sleep 3000").await;
    let workload = env.workload(a.identity().spiffe_id()).await;
    let executor = tokio::spawn(run(env.executor_config(&a, &workload), no_signals()));
    let task_id = a.id().task_id();
    env.mock
        .handle
        .wait_for(|m| m.task(task_id).is_some_and(|t| t.heartbeats > 0), WAIT)
        .await
        .expect("running");
    workload.rotate().expect("rotate the executor's SVID");
    env.facade_api.rotate().expect("rotate the facade's SVID");
    env.job_status(&a, Status::Success).await;
    let status = tokio::time::timeout(WAIT, executor)
        .await
        .expect("ends")
        .expect("join")
        .expect("ran");
    assert!(status.success());
}

fn code(e: connectrpc::ConnectError) -> connectrpc::ErrorCode {
    e.code
}

#[tokio::test(flavor = "multi_thread")]
async fn each_wrong_credential_is_refused_with_its_own_code() {
    let env = Env::new().await;
    let a = env.assignment("standin:success").await;
    let b = env.assignment("standin:success").await;
    let cap_a = env
        .dispatch
        .capability_key()
        .issue(a.id())
        .expose()
        .to_string();
    let cap_b = env
        .dispatch
        .capability_key()
        .issue(b.id())
        .expose()
        .to_string();
    let workload_a = env.workload(a.identity().spiffe_id()).await;
    let stranger = env
        .workload("spiffe://example.org/ci/owner/other/build")
        .await;

    // Wrong SPIFFE ID: a valid capability presented by another workload of the domain.
    let c = env.runner_client(&stranger, a.id().as_str(), &cap_a).await;
    let e = c
        .declare(DeclareRequest::default())
        .await
        .expect_err("refused");
    assert_eq!(code(e), connectrpc::ErrorCode::PermissionDenied);

    // Wrong capability.
    let c = env
        .runner_client(&workload_a, a.id().as_str(), "not-the-capability")
        .await;
    let e = c
        .fetch_task(FetchTaskRequest::default())
        .await
        .expect_err("refused");
    assert_eq!(code(e), connectrpc::ErrorCode::Unauthenticated);

    // Another assignment's capability.
    let c = env
        .runner_client(&workload_a, a.id().as_str(), &cap_b)
        .await;
    let e = c
        .fetch_task(FetchTaskRequest::default())
        .await
        .expect_err("refused");
    assert_eq!(code(e), connectrpc::ErrorCode::Unauthenticated);

    // The right credentials: the task, then refusal of a fetch after the runner reported.
    let c = env
        .runner_client(&workload_a, a.id().as_str(), &cap_a)
        .await;
    let declared = c.declare(DeclareRequest::default()).await.expect("declare");
    assert_eq!(
        declared
            .headers()
            .get("x-gitea-actions-capabilities")
            .and_then(|v| v.to_str().ok()),
        Some("job-summary")
    );
    let declared = declared.into_owned();
    let runner = declared.runner.into_option().expect("runner");
    assert!(runner.ephemeral && runner.uuid == a.id().as_str());
    let first = c
        .fetch_task(FetchTaskRequest::default())
        .await
        .expect("fetch")
        .into_owned();
    assert_eq!(
        first.task.into_option().expect("the pre-assigned task").id,
        a.id().task_id()
    );
    // Before the runner reported on it, a second fetch gets the same task (the answer to
    // the first may have been lost); after its first report, the task is never handed
    // out again.
    let again = c
        .fetch_task(FetchTaskRequest::default())
        .await
        .expect("fetch again")
        .into_owned();
    assert_eq!(
        again.task.into_option().map(|t| t.id),
        Some(a.id().task_id())
    );
    c.update_log(UpdateLogRequest {
        task_id: a.id().task_id(),
        ..Default::default()
    })
    .await
    .expect("the runner's first report");
    let e = c
        .fetch_task(FetchTaskRequest::default())
        .await
        .expect_err("a fetch after the first report refused");
    assert!(
        e.message
            .as_deref()
            .is_some_and(|m| m.ends_with("unregistered runner")),
        "{e:?}"
    );
    assert_eq!(
        code(e),
        connectrpc::ErrorCode::Unauthenticated,
        "the runner must stop polling"
    );

    // A refused request closes its connection (invariant 21): each refusal below is asked
    // on a connection of its own, as the runner's next call after one would be.
    // A log update naming another task.
    let c = env
        .runner_client(&workload_a, a.id().as_str(), &cap_a)
        .await;
    let e = c
        .update_log(UpdateLogRequest {
            task_id: b.id().task_id(),
            rows: vec![LogRow {
                content: "x".into(),
                ..Default::default()
            }],
            ..Default::default()
        })
        .await
        .expect_err("refused");
    assert_eq!(code(e), connectrpc::ErrorCode::PermissionDenied);
    let b_rows = env
        .mock
        .handle
        .task(b.id().task_id())
        .expect("task b")
        .log_rows;
    assert!(
        b_rows.is_empty(),
        "nothing reached Gitea for the other task"
    );

    // Register is never available through the facade.
    let c = env
        .runner_client(&workload_a, a.id().as_str(), &cap_a)
        .await;
    let e = c
        .register(RegisterRequest::default())
        .await
        .expect_err("refused");
    assert_eq!(code(e), connectrpc::ErrorCode::PermissionDenied);
}

/// DESIGN invariant 9 (issue 23): a runner whose FetchTask gives up while the claim is
/// being written (its Connect deadline, which the facade enforces, passes first) costs
/// nothing: the claim completes without it, the runner's next FetchTask gets the same task,
/// and the job runs to its result instead of hanging or being failed as never started.
#[tokio::test(flavor = "multi_thread")]
async fn a_runner_that_gives_up_while_its_claim_is_written_gets_the_same_task_on_its_next_fetch() {
    let env = Env::new().await;
    let a = env.assignment("standin:success").await;
    let workload = env.workload(a.identity().spiffe_id()).await;
    let c = env
        .runner_client(&workload, a.id().as_str(), &env.capability(&a))
        .await;
    env.backend.hold_claims();
    let impatient = c
        .fetch_task_with_options(
            FetchTaskRequest::default(),
            connectrpc::client::CallOptions::default().with_timeout(Duration::from_secs(2)),
        )
        .await;
    assert!(
        impatient.is_err(),
        "the claim write is held: the poll cannot be answered in time"
    );
    gdr_testkit::until_sync(WAIT, "the claim write to go on without its caller", || {
        env.backend.claims_waiting() == 1
    })
    .await;
    env.backend.release_claims();
    let retry = c
        .fetch_task(FetchTaskRequest::default())
        .await
        .expect("the retry is answered")
        .into_owned();
    assert_eq!(
        retry.task.into_option().map(|t| t.id),
        Some(a.id().task_id()),
        "the retry gets the task its first FetchTask claimed"
    );
    assert_eq!(env.backend.claim_calls(), 1, "the claim was written once");
    // The runner that runs the job fetches once more, still before any report.
    let status = run(env.executor_config(&a, &workload), no_signals())
        .await
        .expect("executor runs");
    assert!(status.success(), "the runner exits 0");
    env.job_status(&a, Status::Success).await;
}

/// DESIGN invariant 24 (issue 23): `jobs_completed` counts the result Gitea kept (here
/// the job was cancelled in Gitea while its runner reported success), once per assignment
/// however often the final report is repeated.
#[tokio::test(flavor = "multi_thread")]
async fn jobs_completed_counts_the_result_gitea_kept_once_per_assignment() {
    let env = Env::new().await;
    let a = env.assignment("standin:success").await;
    let workload = env.workload(a.identity().spiffe_id()).await;
    let c = env
        .runner_client(&workload, a.id().as_str(), &env.capability(&a))
        .await;
    let task_id = c
        .fetch_task(FetchTaskRequest::default())
        .await
        .expect("fetch")
        .into_owned()
        .task
        .into_option()
        .expect("the task")
        .id;
    let job = env
        .mock
        .handle
        .jobs()
        .into_iter()
        .find(|j| j.task_id == Some(task_id))
        .expect("job");
    env.mock.handle.cancel_job(job.id).expect("cancel");
    let success = gdr_proto::runner::v1::UpdateTaskRequest {
        state: gdr_proto::runner::v1::TaskState {
            id: task_id,
            result: gdr_proto::runner::v1::TaskResult::RESULT_SUCCESS.into(),
            ..Default::default()
        }
        .into(),
        ..Default::default()
    };
    for _ in 0..2 {
        let answer = c
            .update_task(success.clone())
            .await
            .expect("the final report is answered")
            .into_owned();
        assert_eq!(
            answer.state.into_option().map(|s| s.result),
            Some(gdr_proto::runner::v1::TaskResult::RESULT_CANCELLED.into()),
            "Gitea keeps the cancel"
        );
    }
    assert_eq!(
        env.completed("success"),
        0,
        "the runner's result was counted"
    );
    assert_eq!(
        env.completed("cancelled"),
        1,
        "Gitea's result, counted once"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn peers_outside_the_trust_domain_and_clients_without_a_certificate_are_refused_at_the_handshake()
 {
    let env = Env::new().await;
    let foreign = TestCa::new("evil.org")
        .expect("ca")
        .issue("spiffe://evil.org/ci/x/y/z", Duration::from_secs(600))
        .expect("svid");
    let result = raw_tls_get(
        any_server_client_config(Some(&foreign)).expect("tls"),
        env.facade_addr,
        "/api/v1/version",
    )
    .await;
    assert!(
        result.is_err(),
        "a foreign trust domain got an answer: {result:?}"
    );
    let result = raw_tls_get(
        any_server_client_config(None).expect("tls"),
        env.facade_addr,
        "/api/v1/version",
    )
    .await;
    assert!(
        result.is_err(),
        "a client without a certificate got an answer: {result:?}"
    );
    // Control: a peer of the trust domain gets past the handshake to an HTTP answer (the
    // pass-through's refusal: it presented no assignment's credentials).
    let own = env
        .ca
        .issue(
            "spiffe://example.org/ci/owner/repo/build",
            Duration::from_secs(600),
        )
        .expect("svid");
    let answer = raw_tls_get(
        any_server_client_config(Some(&own)).expect("tls"),
        env.facade_addr,
        "/_mock/blob/5",
    )
    .await;
    assert!(answer.expect("answer").starts_with("HTTP/1.1 401"));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_50_mib_checkout_is_reverse_proxied_from_gitea_through_executor_and_facade() {
    let env = Env::new().await;
    let a = env.assignment("standin:checkout 52428800").await;
    let workload = env.workload(a.identity().spiffe_id()).await;
    let status = run(env.executor_config(&a, &workload), no_signals())
        .await
        .expect("runs");
    assert!(status.success());
    env.job_status(&a, Status::Success).await;
    let rows = env
        .mock
        .handle
        .task(a.id().task_id())
        .expect("task")
        .log_rows;
    assert!(
        rows.iter().any(|r| r.contains("received 52428800 bytes")),
        "{rows:?}"
    );
    assert!(
        env.mock
            .handle
            .seen_requests()
            .iter()
            .any(|p| p.starts_with("/_mock/blob/52428800"))
    );
}

/// A multi-thread runtime whose threads (and the calling one) log into `dispatch`. A
/// process-wide default would be shared by every test of this binary under `cargo test`
/// (one process), so only the first test to set it would see its events.
pub(super) fn runtime_logging_into(
    dispatch: tracing::Dispatch,
) -> (tokio::runtime::Runtime, tracing::dispatcher::DefaultGuard) {
    let for_threads = dispatch.clone();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .on_thread_start(move || {
            // Lives as long as the runtime's thread does.
            std::mem::forget(tracing::dispatcher::set_default(&for_threads));
        })
        .build()
        .expect("runtime");
    (runtime, tracing::dispatcher::set_default(&dispatch))
}

#[test]
fn no_log_line_of_a_whole_job_contains_a_capability_token_or_task_secret() {
    let capture = Capture::default();
    let subscriber = gdr_controller::logging::subscriber(
        tracing_subscriber::EnvFilter::new("debug"),
        capture.clone(),
    );
    let (runtime, _guard) = runtime_logging_into(tracing::Dispatch::new(subscriber));
    let secrets = runtime.block_on(async {
        let env = Env::new().await;
        env.mock
            .handle
            .set_secret("owner/repo", "DEPLOY_KEY", "super-secret-deploy-key");
        let a = env.assignment("standin:success").await;
        let workload = env.workload(a.identity().spiffe_id()).await;
        run(env.executor_config(&a, &workload), no_signals())
            .await
            .expect("runs");
        env.job_status(&a, Status::Success).await;
        let task_token = env.mock.handle.task(a.id().task_id()).expect("task").token;
        vec![
            env.dispatch
                .capability_key()
                .issue(a.id())
                .expose()
                .to_string(),
            task_token,
            "super-secret-deploy-key".to_string(),
        ]
    });
    let logs = capture.text();
    assert!(
        logs.contains("task claimed by its executor"),
        "the capture must see the facade's events"
    );
    for secret in secrets {
        assert!(!logs.contains(&secret), "a log line contains a secret");
    }
}

/// DESIGN invariant 9 (issue 9): after a restart a runner whose assignment waits for its
/// redelivery is accepted through the backend's metadata; its Declare and polls are
/// routine, logged at debug, never as a refused call.
#[test]
fn the_polls_of_a_runner_whose_assignment_waits_for_redelivery_are_not_warnings() {
    let capture = Capture::default();
    let subscriber = gdr_controller::logging::subscriber(
        tracing_subscriber::EnvFilter::new("debug"),
        capture.clone(),
    );
    let (runtime, _guard) = runtime_logging_into(tracing::Dispatch::new(subscriber));
    runtime.block_on(async {
        let env = Env::new().await;
        let a = env.executor_only("standin:success").await;
        let capability = env
            .dispatch
            .capability_key()
            .issue(a.id())
            .expose()
            .to_string();
        let workload = env.workload(a.identity().spiffe_id()).await;
        let c = env
            .runner_client(&workload, a.id().as_str(), &capability)
            .await;
        c.declare(DeclareRequest::default()).await.expect("declare");
        for _ in 0..3 {
            let polled = c
                .fetch_task(FetchTaskRequest::default())
                .await
                .expect("a poll is answered")
                .into_owned();
            assert!(polled.task.is_unset(), "nothing to hand out yet");
        }
    });
    let logs = capture.text();
    assert!(
        logs.contains("authorised from backend metadata"),
        "the fallback was used:\n{logs}"
    );
    let warnings: Vec<&str> = logs
        .lines()
        .filter(|l| l.contains("\"level\":\"WARN\"") && l.contains("facade"))
        .collect();
    assert!(warnings.is_empty(), "{warnings:#?}");
}

/// DESIGN invariant 19: the executor holds its runner's reports only as long as
/// `executor_report_outage_tolerance`; a facade that stays away longer makes it give up,
/// exit with an error that says what was lost, and the result never reaches Gitea.
#[tokio::test(flavor = "multi_thread")]
async fn an_executor_whose_facade_stays_away_past_the_tolerance_gives_up_and_says_what_was_lost() {
    let env = Env::new().await;
    let a = env.assignment("standin:sleep 1500").await;
    let workload = env.workload(a.identity().spiffe_id()).await;
    let mut config = env.executor_config(&a, &workload);
    config.report_outage_tolerance = std::time::Duration::from_secs(2);
    let executor = tokio::spawn(run(config, no_signals()));
    let task_id = a.id().task_id();
    env.mock
        .handle
        .wait_for(
            |m| m.task(task_id).is_some_and(|t| t.runner_starts() > 0),
            WAIT,
        )
        .await
        .expect("the runner runs the job");
    // The facade goes away for good while the job runs.
    env.stop.trigger();
    let outcome = tokio::time::timeout(WAIT, executor)
        .await
        .expect("the executor ends")
        .expect("join");
    let error = outcome.expect_err("the executor gives up").to_string();
    assert!(
        error.contains("gave up delivering the runner's reports")
            && error.contains("the job's result"),
        "{error}"
    );
    assert_eq!(
        env.mock.handle.task(task_id).map(|t| t.status),
        Some(Status::Running),
        "the result never reached Gitea"
    );
}

/// An executor holding its runner's reports for a facade that went away (with the
/// default half-hour tolerance) is sent SIGTERM `after` the facade left; returns its
/// error and how long it took to exit after the signal.
async fn terminate_while_holding(after: Duration) -> (String, Duration) {
    let env = Env::new().await;
    let a = env.assignment("standin:sleep 1500").await;
    let workload = env.workload(a.identity().spiffe_id()).await;
    let mut config = env.executor_config(&a, &workload);
    config.report_outage_tolerance = Duration::from_secs(1800);
    let (signal, signals) = tokio::sync::mpsc::channel(1);
    let executor = tokio::spawn(run(config, signals));
    let task_id = a.id().task_id();
    env.mock
        .handle
        .wait_for(
            |m| m.task(task_id).is_some_and(|t| t.runner_starts() > 0),
            WAIT,
        )
        .await
        .expect("the runner runs the job");
    env.stop.trigger();
    tokio::time::sleep(after).await;
    signal.send(Forward::Terminate).await.expect("send");
    let signalled = std::time::Instant::now();
    let outcome = tokio::time::timeout(Duration::from_secs(30), executor)
        .await
        .expect("a terminated executor exits within a Pod's grace period, not after its tolerance")
        .expect("join");
    let error = outcome
        .expect_err("the reports were not delivered")
        .to_string();
    assert_eq!(
        env.mock.handle.task(task_id).map(|t| t.status),
        Some(Status::Running),
        "the result never reached Gitea"
    );
    (error, signalled.elapsed())
}

/// DESIGN invariant 19 and docs/executor.md ("Termination"): an executor holding its
/// runner's reports does not ignore SIGTERM (a Pod's deletion sends it, SIGKILL follows
/// after the grace period): it makes one last attempt of at most
/// `TERMINATION_DELIVERY`, then exits saying what was lost.
#[tokio::test(flavor = "multi_thread")]
async fn an_executor_holding_reports_exits_after_one_bounded_attempt_when_terminated() {
    // The runner finished (its result is held) before the signal came.
    let (error, took) = terminate_while_holding(Duration::from_secs(4)).await;
    assert!(
        error.contains("gave up delivering the runner's reports")
            && error.contains("the job's result"),
        "{error}"
    );
    assert!(
        took >= Duration::from_secs(9) && took < TERMINATION_DELIVERY + Duration::from_secs(5),
        "one attempt of at most {TERMINATION_DELIVERY:?}, took {took:?}"
    );
}

/// As above, the signal arriving while the runner still runs: it is passed on to the
/// runner, whose cancelled result is then held, and the wait for it is just as bounded.
#[tokio::test(flavor = "multi_thread")]
async fn an_executor_terminated_while_its_runner_runs_holds_its_reports_only_for_the_last_attempt()
{
    let (error, took) = terminate_while_holding(Duration::ZERO).await;
    assert!(
        error.contains("gave up delivering the runner's reports"),
        "{error}"
    );
    assert!(
        took < TERMINATION_DELIVERY + Duration::from_secs(5),
        "took {took:?}"
    );
}

// === hostile peers (DESIGN invariant 21) ===

/// An SVID of the trust domain, as any job's executor holds one.
fn job_svid(env: &Env, job: &str) -> gdr_testkit::spiffe::Svid {
    env.ca
        .issue(
            &format!("spiffe://example.org/ci/owner/repo/branch/main/{job}"),
            Duration::from_secs(600),
        )
        .expect("svid")
}

/// A TLS connection to the facade presenting `svid`, offering `alpn`.
async fn tls_to(
    addr: std::net::SocketAddr,
    svid: &gdr_testkit::spiffe::Svid,
    alpn: &[&[u8]],
) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    tls_over(tcp, svid, alpn).await.expect("handshake")
}

/// Reads until the peer closes (or `WAIT` passes: then `false`).
async fn closed_by_peer(stream: &mut (impl tokio::io::AsyncRead + Unpin)) -> bool {
    let mut buf = [0u8; 4096];
    let read = async {
        loop {
            match tokio::io::AsyncReadExt::read(stream, &mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    };
    tokio::time::timeout(WAIT, read).await.is_ok()
}

/// Reads the status line of one HTTP/1.1 answer (or `None` if none came within `WAIT`).
async fn status_line(stream: &mut (impl tokio::io::AsyncRead + Unpin)) -> Option<String> {
    let mut answer = Vec::new();
    let mut buf = [0u8; 1024];
    let read = async {
        while !answer.windows(2).any(|w| w == b"\r\n") {
            match tokio::io::AsyncReadExt::read(stream, &mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => answer.extend_from_slice(&buf[..n]),
            }
        }
    };
    tokio::time::timeout(WAIT, read).await.ok()?;
    let text = String::from_utf8_lossy(&answer).into_owned();
    text.lines().next().map(str::to_owned)
}

/// DESIGN invariant 21: a RunnerService call is authenticated from its headers and the
/// peer's SPIFFE ID before its body is read. A peer of the trust domain without the
/// assignment's credential announcing a 10 MB body gets its refusal at once, without the
/// facade waiting for (or buffering) the body.
#[tokio::test(flavor = "multi_thread")]
async fn a_runner_api_call_with_a_wrong_credential_is_refused_before_its_body_is_read() {
    let env = Env::new().await;
    let a = env.assignment("echo hi").await;
    let svid = job_svid(&env, "build");
    for (uuid, token) in [
        (a.id().as_str(), "not-the-capability"),
        ("gitea-task-999999", "x"),
        ("", ""),
    ] {
        let mut tls = tls_to(env.facade_addr, &svid, &[b"http/1.1"]).await;
        let head = format!(
            "POST /api/actions/runner.v1.RunnerService/UpdateLog HTTP/1.1\r\nhost: facade\r\ncontent-type: application/proto\r\ncontent-length: 10000000\r\nx-runner-uuid: {uuid}\r\nx-runner-token: {token}\r\n\r\n"
        );
        tokio::io::AsyncWriteExt::write_all(&mut tls, head.as_bytes())
            .await
            .expect("write head");
        let status = status_line(&mut tls).await;
        assert_eq!(
            status.as_deref(),
            Some("HTTP/1.1 401 Unauthorized"),
            "uuid {uuid:?}: refused from the headers, the body never sent"
        );
    }
    // Register is refused without reading its body too.
    let mut tls = tls_to(env.facade_addr, &svid, &[b"http/1.1"]).await;
    tokio::io::AsyncWriteExt::write_all(
        &mut tls,
        b"POST /api/actions/runner.v1.RunnerService/Register HTTP/1.1\r\nhost: facade\r\ncontent-type: application/proto\r\ncontent-length: 10000000\r\n\r\n",
    )
    .await
    .expect("write head");
    assert_eq!(
        status_line(&mut tls).await.as_deref(),
        Some("HTTP/1.1 403 Forbidden")
    );
}

/// The reverse proxy drops forwarding headers a client sends (Gitea would believe them)
/// and sets the real ones: the peer's address and https.
#[tokio::test(flavor = "multi_thread")]
async fn client_sent_forwarding_headers_are_replaced_by_the_real_peer() {
    let env = Env::new().await;
    let a = env.assignment("standin:success").await;
    let svid = job_svid(&env, "build");
    let mut tls = tls_to(env.facade_addr, &svid, &[b"http/1.1"]).await;
    let head = format!(
        "GET /_mock/blob/3 HTTP/1.1\r\nhost: facade\r\n{}x-forwarded-for: 6.6.6.6\r\nx-forwarded-host: evil.example\r\nx-forwarded-proto: http\r\nforwarded: for=6.6.6.6;host=evil.example\r\nx-real-ip: 6.6.6.6\r\nconnection: close\r\n\r\n",
        env.credential_lines(&a)
    );
    tokio::io::AsyncWriteExt::write_all(&mut tls, head.as_bytes())
        .await
        .expect("write");
    assert_eq!(
        status_line(&mut tls).await.as_deref(),
        Some("HTTP/1.1 200 OK")
    );
    let (path, headers) = env
        .mock
        .handle
        .seen_request_headers()
        .into_iter()
        .find(|(p, _)| p == "/_mock/blob/3")
        .expect("the request reached Gitea");
    let values = |name: &str| -> Vec<String> {
        headers
            .iter()
            .filter(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
            .collect()
    };
    assert_eq!(
        values("x-forwarded-for"),
        ["127.0.0.1"],
        "{path}: {headers:?}"
    );
    assert_eq!(values("x-forwarded-proto"), ["https"], "{headers:?}");
    for dropped in ["x-forwarded-host", "forwarded", "x-real-ip"] {
        assert!(values(dropped).is_empty(), "{dropped} passed: {headers:?}");
    }
}

/// DESIGN invariant 21: nothing a peer opens and leaves idle is held for long — a TCP
/// connection that never starts TLS, a TLS connection that never sends a request, an
/// HTTP/1.1 request head sent slowly, an HTTP/2 session with no request in flight — and
/// one SPIFFE ID holds only its share of connections.
#[tokio::test(flavor = "multi_thread")]
async fn idle_connections_are_closed_and_one_identity_holds_only_its_share() {
    let limits = FacadeLimits {
        max_connections_per_identity: 2,
        tls_handshake_timeout: Duration::from_secs(1),
        header_read_timeout: Duration::from_secs(1),
        idle_timeout: Duration::from_secs(2),
        ..FacadeLimits::default()
    };
    let env = Env::with_limits(limits).await;
    let svid = job_svid(&env, "build");

    let mut silent_tcp = tokio::net::TcpStream::connect(env.facade_addr)
        .await
        .expect("connect");
    assert!(
        closed_by_peer(&mut silent_tcp).await,
        "a connection that never starts TLS is closed"
    );

    let mut silent_tls = tls_to(env.facade_addr, &svid, &[b"http/1.1"]).await;
    assert!(
        closed_by_peer(&mut silent_tls).await,
        "a TLS connection that never sends a request is closed"
    );

    let mut slow = tls_to(env.facade_addr, &svid, &[b"http/1.1"]).await;
    tokio::io::AsyncWriteExt::write_all(&mut slow, b"GET /_mock/blob/1 HTTP/1.1\r\nhost: f")
        .await
        .expect("write");
    assert!(
        closed_by_peer(&mut slow).await,
        "a request head that never completes is not waited for"
    );

    // An HTTP/2 session that made a request and then idles.
    let a = env.assignment("standin:success").await;
    let h2 = tls_to(env.facade_addr, &svid, &[b"h2"]).await;
    let (mut sender, connection) =
        hyper::client::conn::http2::handshake::<_, _, http_body_util::Empty<bytes::Bytes>>(
            hyper_util::rt::TokioExecutor::new(),
            hyper_util::rt::TokioIo::new(h2),
        )
        .await
        .expect("h2 handshake");
    let session = tokio::spawn(connection);
    let answer = sender
        .send_request(
            http::Request::get("https://facade/_mock/blob/1")
                .header("x-runner-uuid", a.id().as_str())
                .header(
                    "x-runner-token",
                    env.dispatch.capability_key().issue(a.id()).expose(),
                )
                .body(http_body_util::Empty::new())
                .expect("request"),
        )
        .await
        .expect("answer");
    assert_eq!(answer.status(), 200);
    drop(answer);
    let ended = tokio::time::timeout(WAIT, session).await;
    assert!(ended.is_ok(), "an idle HTTP/2 session is closed");

    // Per identity, of connections no assignment's credentials bound: two are held (their
    // requests are answered, here refused), a third of the same SPIFFE ID is closed.
    let mut first = tls_to(env.facade_addr, &svid, &[b"http/1.1"]).await;
    let mut second = tls_to(env.facade_addr, &svid, &[b"http/1.1"]).await;
    let request = b"GET /_mock/blob/1 HTTP/1.1\r\nhost: facade\r\n\r\n";
    for held in [&mut first, &mut second] {
        tokio::io::AsyncWriteExt::write_all(held, request)
            .await
            .expect("write");
        assert_eq!(
            status_line(held).await.as_deref(),
            Some("HTTP/1.1 401 Unauthorized")
        );
    }
    let mut third = tls_to(env.facade_addr, &svid, &[b"http/1.1"]).await;
    let _ = tokio::io::AsyncWriteExt::write_all(&mut third, request).await;
    assert_eq!(
        status_line(&mut third).await,
        None,
        "a third unbound connection of one SPIFFE ID is closed without an answer"
    );
    // The assignment's executor is not held back by them: its first request binds its
    // connection to the assignment.
    let mut bound = tls_to(env.facade_addr, &svid, &[b"http/1.1"]).await;
    let credentialed = format!(
        "GET /_mock/blob/1 HTTP/1.1\r\nhost: facade\r\n{}\r\n",
        env.credential_lines(&a)
    );
    tokio::io::AsyncWriteExt::write_all(&mut bound, credentialed.as_bytes())
        .await
        .expect("write");
    assert_eq!(
        status_line(&mut bound).await.as_deref(),
        Some("HTTP/1.1 200 OK")
    );
    // Another job's identity is not held back by it.
    let mut other = tls_to(env.facade_addr, &job_svid(&env, "other"), &[b"http/1.1"]).await;
    tokio::io::AsyncWriteExt::write_all(&mut other, request)
        .await
        .expect("write");
    assert_eq!(
        status_line(&mut other).await.as_deref(),
        Some("HTTP/1.1 401 Unauthorized")
    );
}

/// DESIGN invariant 21 (issue 37): an HTTP/2 peer that stops answering pings (it vanished
/// without closing: half-open TCP, a frozen process) is dropped within
/// `runner_facade_h2_ping_interval` + `runner_facade_h2_ping_timeout`, long before any
/// other bound would close its connection.
#[tokio::test(flavor = "multi_thread")]
async fn an_http2_peer_that_stops_answering_pings_is_closed_within_the_ping_bound() {
    let limits = FacadeLimits {
        header_read_timeout: Duration::from_secs(120),
        idle_timeout: Duration::from_secs(120),
        h2_ping_interval: Duration::from_secs(1),
        h2_ping_timeout: Duration::from_secs(1),
        ..FacadeLimits::default()
    };
    let env = Env::with_limits(limits).await;
    let svid = job_svid(&env, "build");
    let mut h2 = tls_to(env.facade_addr, &svid, &[b"h2"]).await;
    // The client preface and an empty SETTINGS frame; then nothing, not even a PING ack.
    let mut preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    preface.extend_from_slice(&[0, 0, 0, 0x4, 0, 0, 0, 0, 0]);
    tokio::io::AsyncWriteExt::write_all(&mut h2, &preface)
        .await
        .expect("preface");
    let started = std::time::Instant::now();
    let closed = tokio::time::timeout(Duration::from_secs(8), closed_by_peer(&mut h2)).await;
    assert_eq!(closed, Ok(true), "still open after {:?}", started.elapsed());
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "closed only after {:?}",
        started.elapsed()
    );
}

/// DESIGN invariant 21: the facade bounds connections per assignment, not per SPIFFE ID.
/// Twenty runs of one job at once — a matrix of one repository and job key, so all share
/// one SPIFFE ID, more of them than one identity's bound on connections not yet bound to
/// an assignment — each connect, hold their connection while all of them run, and finish
/// with their result in Gitea.
#[tokio::test(flavor = "multi_thread")]
async fn twenty_concurrent_jobs_of_one_repository_and_job_key_each_connect_and_finish() {
    const JOBS: usize = 20;
    let limits = FacadeLimits::default();
    assert!(JOBS > limits.max_connections_per_identity);
    let env = Env::build(limits, JOBS).await;
    let release = env.dir.path().join("release");
    let values: Vec<String> = (1..=JOBS).map(|i| i.to_string()).collect();
    let yaml = format!(
        "on: push\njobs:\n  build:\n    runs-on: [self-hosted, pod]\n    strategy:\n      matrix:\n        n: [{}]\n    steps:\n      - run: standin:wait-for {}\n",
        values.join(", "),
        release.display()
    );
    env.mock
        .handle
        .queue_workflow("owner/repo", &yaml)
        .expect("queue");
    let mut assignments = Vec::new();
    for _ in 0..JOBS {
        let a = env.fetched_executor().await;
        env.dispatch.admit(Backend::Pod, a.id());
        env.dispatch.offer(&a);
        assignments.push(a);
    }
    let spiffe_id = assignments[0].identity().spiffe_id().to_owned();
    assert!(
        assignments
            .iter()
            .all(|a| a.identity().spiffe_id() == spiffe_id),
        "one SPIFFE ID for every run of the job"
    );
    let workload = env.workload(&spiffe_id).await;
    let executors: Vec<_> = assignments
        .iter()
        .map(|a| tokio::spawn(run(env.executor_config(a, &workload), no_signals())))
        .collect();
    let task_ids: Vec<i64> = assignments.iter().map(|a| a.id().task_id()).collect();
    let running = env
        .mock
        .handle
        .wait_for(
            |m| {
                task_ids
                    .iter()
                    .all(|id| m.task(*id).is_some_and(|t| t.heartbeats > 0))
            },
            Duration::from_secs(90),
        )
        .await;
    if running.is_err() {
        let heartbeating = task_ids
            .iter()
            .filter(|id| env.mock.handle.task(**id).is_some_and(|t| t.heartbeats > 0))
            .count();
        panic!("only {heartbeating} of {JOBS} runs of one job got to run at once");
    }
    std::fs::write(&release, b"go").expect("release the jobs");
    for executor in executors {
        let status = tokio::time::timeout(Duration::from_secs(60), executor)
            .await
            .expect("the executor ends")
            .expect("join")
            .expect("ran");
        assert!(status.success());
    }
    for a in &assignments {
        env.job_status(a, Status::Success).await;
    }
}

// === the pass-through to Gitea ===

/// Reads from `stream` into `buf` until `done` holds for what was read, the peer closes,
/// or `WAIT` passes.
async fn read_until(
    stream: &mut (impl tokio::io::AsyncRead + Unpin),
    buf: &mut Vec<u8>,
    done: impl Fn(&str) -> bool,
) {
    let mut chunk = [0u8; 4096];
    let read = async {
        while !done(&String::from_utf8_lossy(buf)) {
            match tokio::io::AsyncReadExt::read(stream, &mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
    };
    let _ = tokio::time::timeout(WAIT, read).await;
}

/// Writes one HTTP/1.1 request head (and `body`) on a new TLS connection presenting `svid`;
/// returns the connection and what was read of the answer: its head at least, unless the
/// connection closed first.
async fn exchange(
    env: &Env,
    svid: &gdr_testkit::spiffe::Svid,
    head: &str,
    body: &[u8],
) -> (
    tokio_rustls::client::TlsStream<tokio::net::TcpStream>,
    Answer,
) {
    let mut tls = tls_to(env.facade_addr, svid, &[b"http/1.1"]).await;
    tokio::io::AsyncWriteExt::write_all(&mut tls, head.as_bytes())
        .await
        .expect("write head");
    tokio::io::AsyncWriteExt::write_all(&mut tls, body)
        .await
        .expect("write body");
    let mut answer = Answer(Vec::new());
    read_until(&mut tls, &mut answer.0, |t| t.contains("\r\n\r\n")).await;
    (tls, answer)
}

/// Bytes of an HTTP/1.1 answer read so far.
struct Answer(Vec<u8>);

impl Answer {
    fn status(&self) -> Option<String> {
        let text = self.text();
        text.contains("\r\n")
            .then(|| text.lines().next().unwrap_or_default().to_owned())
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0).into_owned()
    }

    /// Reads on until `done` holds for the whole answer (or the peer closes).
    async fn read_on(
        &mut self,
        stream: &mut (impl tokio::io::AsyncRead + Unpin),
        done: impl Fn(&str) -> bool,
    ) -> String {
        read_until(stream, &mut self.0, done).await;
        self.text()
    }
}

/// The value Gitea received for header `name` (names arrive lowercase).
fn value<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
}

/// DESIGN invariant 15: a job cannot log into Gitea as anyone through the facade. Gitea's
/// reverse-proxy login headers (`X-WEBAUTH-USER`, `-EMAIL`, `-FULLNAME` by default) sent
/// by an executor on the pass-through never reach Gitea, which trusts them from a proxy in
/// its `REVERSE_PROXY_TRUSTED_PROXIES` (the facade's address is one where it runs beside
/// Gitea).
#[tokio::test(flavor = "multi_thread")]
async fn a_forged_reverse_proxy_login_never_reaches_gitea() {
    let env = Env::new().await;
    let a = env.assignment("standin:success").await;
    let svid = job_svid(&env, "build");
    let head = format!(
        "GET /_mock/blob/4?login HTTP/1.1\r\nhost: facade\r\n{}X-WEBAUTH-USER: gitea-admin\r\nX-WEBAUTH-EMAIL: admin@example.org\r\nX-WEBAUTH-FULLNAME: Gitea Admin\r\nconnection: close\r\n\r\n",
        env.credential_lines(&a)
    );
    let (_, answer) = exchange(&env, &svid, &head, b"").await;
    assert_eq!(answer.status().as_deref(), Some("HTTP/1.1 200 OK"));
    let seen = env.seen_headers("/_mock/blob/4?login");
    assert_eq!(seen.len(), 1, "the request reached Gitea once");
    for name in ["x-webauth-user", "x-webauth-email", "x-webauth-fullname"] {
        assert_eq!(
            value(&seen[0], name),
            None,
            "{name} reached Gitea: {seen:?}"
        );
    }
}

/// DESIGN invariant 15: the pass-through forwards an allow-list of request headers: what a
/// checkout (git smart HTTP with the job token in `Authorization`) and the artifact
/// uploads need arrive unchanged; a session cookie, `Sudo`, an unknown header and the
/// facade's own runner credentials do not.
#[tokio::test(flavor = "multi_thread")]
async fn only_allow_listed_headers_reach_gitea_and_a_checkouts_own_arrive() {
    let env = Env::new().await;
    let a = env.assignment("standin:success").await;
    let svid = job_svid(&env, "build");
    let checkout = [
        ("authorization", "Basic eC1hY2Nlc3MtdG9rZW46am9iLXRva2Vu"),
        ("content-type", "application/x-git-upload-pack-request"),
        ("content-encoding", "gzip"),
        ("git-protocol", "version=2"),
        ("accept", "application/x-git-upload-pack-result"),
        ("accept-encoding", "deflate, gzip"),
        ("user-agent", "git/2.43.0"),
        ("content-length", "4"),
    ];
    let artifact = [
        ("authorization", "Bearer runtime-token"),
        ("content-type", "application/octet-stream"),
        ("content-range", "bytes 0-3/4"),
        ("x-tfs-filelength", "4"),
        ("x-actions-results-md5", "CY9rzUYh03PK3k6DJie09g=="),
        ("content-length", "4"),
    ];
    let unwanted = [
        ("cookie", "i_like_gitea=admin-session"),
        ("sudo", "gitea-admin"),
        ("x-gitea-otp", "123456"),
        ("x-custom-header", "anything"),
    ];
    for (path, method, wanted) in [
        ("/owner/repo.git/git-upload-pack", "POST", &checkout[..]),
        (
            "/api/actions_pipeline/_apis/pipelines/workflows/1/artifacts/x/upload?itemPath=a%2Fb",
            "PUT",
            &artifact[..],
        ),
    ] {
        let lines: String = wanted
            .iter()
            .chain(&unwanted)
            .map(|(k, v)| format!("{k}: {v}\r\n"))
            .collect();
        let head = format!(
            "{method} {path} HTTP/1.1\r\nhost: facade\r\n{lines}{}connection: close\r\n\r\n",
            env.credential_lines(&a)
        );
        let (_, answer) = exchange(&env, &svid, &head, b"0000").await;
        // The mock has no git or artifact routes; the answer is its 404, from behind.
        assert_eq!(
            answer.status().as_deref(),
            Some("HTTP/1.1 404 Not Found"),
            "{path}"
        );
        let seen = env.seen_headers(path);
        assert_eq!(seen.len(), 1, "{path} reached Gitea once");
        let headers = &seen[0];
        for (name, sent) in wanted {
            assert_eq!(value(headers, name), Some(*sent), "{name}: {headers:?}");
        }
        for (name, _) in unwanted {
            assert_eq!(value(headers, name), None, "{name} passed: {headers:?}");
        }
        for name in ["x-runner-uuid", "x-runner-token"] {
            assert_eq!(value(headers, name), None, "{name} passed: {headers:?}");
        }
    }
}

/// DESIGN invariants 15, 21: the pass-through is only for the executor of a live
/// assignment, checked like a RunnerService call before the body is read: a peer of the
/// trust domain without credentials, with a forged capability, with an assignment's
/// credentials under another SPIFFE ID, or with a valid capability of an assignment this
/// controller does not run, is refused with 401/403 and a text saying why — also while it
/// announces a large body it never sends — and nothing reaches Gitea; once the assignment
/// has finished, its own executor is refused too.
#[tokio::test(flavor = "multi_thread")]
async fn a_trust_domain_peer_without_a_live_assignment_is_refused_by_the_pass_through() {
    let env = Env::new().await;
    let a = env.assignment("standin:success").await;
    let own = job_svid(&env, "build");
    let stranger = job_svid(&env, "other");
    let unknown = gdr_core::assignment::AssignmentId::parse("gitea-task-999999").expect("id");
    let unknown_token = env.dispatch.capability_key().issue(&unknown);
    let cases = [
        ("no credentials", &own, String::new(), "401 Unauthorized"),
        (
            "a forged capability",
            &own,
            format!(
                "x-runner-uuid: {}\r\nx-runner-token: forged\r\n",
                a.id().as_str()
            ),
            "401 Unauthorized",
        ),
        (
            "another SPIFFE ID",
            &stranger,
            env.credential_lines(&a),
            "403 Forbidden",
        ),
        (
            "an assignment this controller does not run",
            &own,
            format!(
                "x-runner-uuid: {}\r\nx-runner-token: {}\r\n",
                unknown.as_str(),
                unknown_token.expose()
            ),
            "401 Unauthorized",
        ),
    ];
    for (i, (case, svid, credentials, expected)) in cases.iter().enumerate() {
        let head = format!(
            "PUT /_mock/blob/{i}?refused HTTP/1.1\r\nhost: facade\r\n{credentials}content-length: 10000000\r\n\r\n"
        );
        let (mut tls, mut answer) = exchange(&env, svid, &head, b"").await;
        assert_eq!(
            answer.status().as_deref(),
            Some(format!("HTTP/1.1 {expected}").as_str()),
            "{case}: refused from the headers, the body never sent"
        );
        let text = answer
            .read_on(&mut tls, |t| t.contains("live assignment"))
            .await;
        assert!(text.contains("live assignment"), "{case}: {text}");
    }
    // Control: the assignment's own executor gets through.
    let head = format!(
        "GET /_mock/blob/5?own HTTP/1.1\r\nhost: facade\r\n{}connection: close\r\n\r\n",
        env.credential_lines(&a)
    );
    let (_, answer) = exchange(&env, &own, &head, b"").await;
    assert_eq!(answer.status().as_deref(), Some("HTTP/1.1 200 OK"));
    // Finished: Gitea has its result, and the pass-through is closed to it.
    let auth = env
        .dispatch
        .authorize(
            a.id().as_str(),
            env.dispatch.capability_key().issue(a.id()).expose(),
            a.identity().spiffe_id(),
        )
        .expect("authorized");
    env.dispatch.finish(&auth).await.expect("finished");
    let head = format!(
        "GET /_mock/blob/6?finished HTTP/1.1\r\nhost: facade\r\n{}connection: close\r\n\r\n",
        env.credential_lines(&a)
    );
    let (_, answer) = exchange(&env, &own, &head, b"").await;
    assert_eq!(answer.status().as_deref(), Some("HTTP/1.1 403 Forbidden"));
    let reached: Vec<String> = env
        .mock
        .handle
        .seen_requests()
        .into_iter()
        .filter(|p| p.contains("?refused") || p.contains("?finished"))
        .collect();
    assert!(
        reached.is_empty(),
        "refused requests reached Gitea: {reached:?}"
    );
}

/// DESIGN invariant 10: a controller that restarted after an assignment finished was never
/// offered it, and finds its executor on the backend with the terminal marker set; that
/// executor's credentials still open nothing — the pass-through answers 403 and nothing
/// reaches Gitea, and its runner calls are refused.
#[tokio::test(flavor = "multi_thread")]
async fn a_restarted_controller_refuses_the_executor_of_a_finished_assignment() {
    let env = Env::new().await;
    let a = env.executor_only("standin:success").await;
    env.backend.record_claimed(a.id()).await.expect("claimed");
    env.backend.mark_terminal(a.id()).await.expect("terminal");
    let own = job_svid(&env, "build");
    let head = format!(
        "GET /_mock/blob/7?after-restart HTTP/1.1\r\nhost: facade\r\n{}connection: close\r\n\r\n",
        env.credential_lines(&a)
    );
    let (_, answer) = exchange(&env, &own, &head, b"").await;
    assert_eq!(answer.status().as_deref(), Some("HTTP/1.1 403 Forbidden"));
    let capability = env
        .dispatch
        .capability_key()
        .issue(a.id())
        .expose()
        .to_string();
    let workload = env.workload(a.identity().spiffe_id()).await;
    let c = env
        .runner_client(&workload, a.id().as_str(), &capability)
        .await;
    let refused = c
        .declare(DeclareRequest::default())
        .await
        .expect_err("a finished assignment's runner is refused");
    assert!(
        refused.to_string().contains("has finished"),
        "the refusal says why: {refused}"
    );
    let reached: Vec<String> = env
        .mock
        .handle
        .seen_requests()
        .into_iter()
        .filter(|p| p.contains("?after-restart"))
        .collect();
    assert!(
        reached.is_empty(),
        "a refused request reached Gitea: {reached:?}"
    );
}

/// DESIGN invariant 21: a connection belongs to the assignment whose credentials its first
/// request presented; a request for another assignment on it is refused (the runs of one
/// job share a SPIFFE ID, so only the binding tells them apart).
#[tokio::test(flavor = "multi_thread")]
async fn a_connection_bound_to_one_assignment_refuses_requests_for_another() {
    let env = Env::new().await;
    let a = env.assignment("standin:success").await;
    let b = env.assignment("standin:success").await;
    assert_eq!(a.identity().spiffe_id(), b.identity().spiffe_id());
    let svid = job_svid(&env, "build");
    let first = format!(
        "GET /_mock/blob/1?a HTTP/1.1\r\nhost: facade\r\n{}\r\n",
        env.credential_lines(&a)
    );
    let (mut tls, mut answer) = exchange(&env, &svid, &first, b"").await;
    assert_eq!(answer.status().as_deref(), Some("HTTP/1.1 200 OK"));
    let second = format!(
        "GET /_mock/blob/1?b HTTP/1.1\r\nhost: facade\r\n{}connection: close\r\n\r\n",
        env.credential_lines(&b)
    );
    tokio::io::AsyncWriteExt::write_all(&mut tls, second.as_bytes())
        .await
        .expect("write");
    let text = answer
        .read_on(&mut tls, |t| t.contains("another assignment"))
        .await;
    assert!(
        text.contains("HTTP/1.1 403 Forbidden") && text.contains("another assignment"),
        "{text}"
    );
    assert!(
        !env.mock
            .handle
            .seen_requests()
            .iter()
            .any(|p| p == "/_mock/blob/1?b"),
        "the other assignment's request reached Gitea"
    );
}

/// DESIGN invariant 21 (issue 37): a connection whose request the facade refuses is
/// closed, so it holds no binding and no place: here a connection bound to an assignment
/// that has since finished.
#[tokio::test(flavor = "multi_thread")]
async fn a_connection_whose_request_is_refused_is_closed_and_unbound() {
    let env = Env::new().await;
    let a = env.assignment("standin:success").await;
    let svid = job_svid(&env, "build");
    let first = format!(
        "GET /_mock/blob/1?live HTTP/1.1\r\nhost: facade\r\n{}\r\n",
        env.credential_lines(&a)
    );
    let (mut tls, mut answer) = exchange(&env, &svid, &first, b"").await;
    assert_eq!(answer.status().as_deref(), Some("HTTP/1.1 200 OK"));
    let auth = env
        .dispatch
        .authorize(
            a.id().as_str(),
            env.dispatch.capability_key().issue(a.id()).expose(),
            a.identity().spiffe_id(),
        )
        .expect("authorized");
    env.dispatch.finish(&auth).await.expect("finished");
    // Kept alive (no `connection: close`): only the refusal may close it.
    let second = format!(
        "GET /_mock/blob/1?finished HTTP/1.1\r\nhost: facade\r\n{}\r\n",
        env.credential_lines(&a)
    );
    tokio::io::AsyncWriteExt::write_all(&mut tls, second.as_bytes())
        .await
        .expect("write");
    let text = answer
        .read_on(&mut tls, |t| t.contains("403 Forbidden"))
        .await;
    assert!(text.contains("HTTP/1.1 403 Forbidden"), "{text}");
    // Well before the idle timeout would close it.
    let closed = tokio::time::timeout(Duration::from_secs(3), closed_by_peer(&mut tls)).await;
    assert_eq!(closed, Ok(true), "the refused connection stays open");
}

/// DESIGN invariant 21 (issue 37): the backend look-up behind a request of an assignment
/// this controller was not offered is not repeated for every request: a peer presenting a
/// finished assignment's credentials again and again costs one look-up per interval.
#[tokio::test(flavor = "multi_thread")]
async fn repeated_requests_of_a_finished_assignment_cost_one_backend_look_up() {
    let env = Env::new().await;
    let a = env.executor_only("standin:success").await;
    env.backend.record_claimed(a.id()).await.expect("claimed");
    env.backend.mark_terminal(a.id()).await.expect("terminal");
    let own = job_svid(&env, "build");
    let before = env.backend.find_calls();
    for n in 0..5 {
        let head = format!(
            "GET /_mock/blob/7?again-{n} HTTP/1.1\r\nhost: facade\r\n{}connection: close\r\n\r\n",
            env.credential_lines(&a)
        );
        let (_, answer) = exchange(&env, &own, &head, b"").await;
        assert_eq!(answer.status().as_deref(), Some("HTTP/1.1 403 Forbidden"));
    }
    assert_eq!(
        env.backend.find_calls() - before,
        1,
        "one look-up, then the remembered answer"
    );
}

/// A TCP server that accepts every connection and never answers nor closes it: a Gitea
/// that hangs. Returns its URL; the task keeps the connections.
async fn silent_upstream() -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = listener.accept().await {
            held.push(stream);
        }
    });
    url
}

/// DESIGN invariant 21: every upstream call of the facade is bounded. A Gitea that accepts
/// the connection and never answers gets the executor a 504 from the pass-through once the
/// response bound passes (short here), and an UpdateLog forwarded to it fails within the
/// forwarding client's request timeout instead of holding the runner's call.
#[tokio::test(flavor = "multi_thread")]
async fn an_upstream_that_accepts_but_never_answers_makes_the_facade_answer_within_its_bounds() {
    let env = Env::with(EnvOptions {
        upstream: Some(silent_upstream().await),
        timeouts: UpstreamTimeouts {
            response: Duration::from_millis(500),
            ..UpstreamTimeouts::default()
        },
        forward_timeout: Duration::from_millis(500),
        ..EnvOptions::default()
    })
    .await;
    let a = env.assignment("standin:success").await;
    let svid = job_svid(&env, "build");
    let head = format!(
        "GET /owner/repo.git/info/refs?service=git-upload-pack HTTP/1.1\r\nhost: facade\r\n{}connection: close\r\n\r\n",
        env.credential_lines(&a)
    );
    let (_, answer) = exchange(&env, &svid, &head, b"").await;
    assert_eq!(
        answer.status().as_deref(),
        Some("HTTP/1.1 504 Gateway Timeout")
    );

    let update = buffa::Message::encode_to_vec(&UpdateLogRequest {
        task_id: a.id().task_id(),
        ..Default::default()
    });
    let head = format!(
        "POST /api/actions/runner.v1.RunnerService/UpdateLog HTTP/1.1\r\nhost: facade\r\ncontent-type: application/proto\r\ncontent-length: {}\r\n{}connection: close\r\n\r\n",
        update.len(),
        env.credential_lines(&a)
    );
    let (_, answer) = exchange(&env, &svid, &head, &update).await;
    assert_eq!(
        answer.status().as_deref(),
        Some("HTTP/1.1 503 Service Unavailable"),
        "the runner is told to retry"
    );
}

/// An upstream whose download trickles and whose upload is read as it trickles in.
async fn slow_upstream(chunks: usize, pause: Duration) -> String {
    let app = axum::Router::new().route(
        "/slow",
        axum::routing::get(move || async move {
            let stream = futures::stream::unfold(0, move |i| async move {
                if i == chunks {
                    return None;
                }
                tokio::time::sleep(pause).await;
                Some((
                    Ok::<_, std::io::Error>(bytes::Bytes::from_static(b"x")),
                    i + 1,
                ))
            });
            axum::body::Body::from_stream(stream)
        })
        .put(|body: axum::body::Body| async move {
            let bytes = axum::body::to_bytes(body, usize::MAX)
                .await
                .expect("upload");
            format!("{} bytes", bytes.len())
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(async move { axum::serve(listener, app).await });
    url
}

/// DESIGN invariant 21: the pass-through's bounds are on idleness, never on a whole
/// transfer. A download that trickles and an upload that trickles in, each lasting several
/// times the response and idle bounds, arrive whole as long as something moves within them.
#[tokio::test(flavor = "multi_thread")]
async fn a_transfer_that_keeps_moving_outlasts_the_pass_throughs_bounds() {
    const CHUNKS: usize = 30;
    let pause = Duration::from_millis(100);
    let bound = Duration::from_secs(1);
    let env = Env::with(EnvOptions {
        upstream: Some(slow_upstream(CHUNKS, pause).await),
        timeouts: UpstreamTimeouts {
            response: bound,
            idle: bound,
            ..UpstreamTimeouts::default()
        },
        ..EnvOptions::default()
    })
    .await;
    assert!(pause * CHUNKS as u32 > bound * 2);
    let a = env.assignment("standin:success").await;
    let svid = job_svid(&env, "build");

    let head = format!(
        "GET /slow HTTP/1.1\r\nhost: facade\r\n{}connection: close\r\n\r\n",
        env.credential_lines(&a)
    );
    let (mut tls, mut answer) = exchange(&env, &svid, &head, b"").await;
    assert_eq!(answer.status().as_deref(), Some("HTTP/1.1 200 OK"));
    // Chunked: each one-byte chunk is "1\r\nx\r\n", the end "0\r\n\r\n".
    let text = answer
        .read_on(&mut tls, |t| t.ends_with("\r\n0\r\n\r\n"))
        .await;
    assert_eq!(text.matches("\r\nx\r\n").count(), CHUNKS, "{text}");

    let mut tls = tls_to(env.facade_addr, &svid, &[b"http/1.1"]).await;
    let head = format!(
        "PUT /slow HTTP/1.1\r\nhost: facade\r\n{}content-length: {CHUNKS}\r\nconnection: close\r\n\r\n",
        env.credential_lines(&a)
    );
    tokio::io::AsyncWriteExt::write_all(&mut tls, head.as_bytes())
        .await
        .expect("write head");
    for _ in 0..CHUNKS {
        tokio::time::sleep(pause).await;
        tokio::io::AsyncWriteExt::write_all(&mut tls, b"y")
            .await
            .expect("write");
    }
    let mut answer = Answer(Vec::new());
    let text = answer
        .read_on(&mut tls, |t| t.ends_with(&format!("{CHUNKS} bytes")))
        .await;
    assert!(
        text.starts_with("HTTP/1.1 200 OK") && text.ends_with(&format!("{CHUNKS} bytes")),
        "{text}"
    );
}

// === the job's Docker daemon and the runner configuration ===

/// A stand-in dockerd and a recording runner in one directory, and the variables that
/// make the executor start that daemon.
struct DockerJob {
    dir: tempfile::TempDir,
    dockerd: StandinDockerd,
    runner: std::path::PathBuf,
}

impl DockerJob {
    fn new(readiness: Readiness) -> Self {
        let dir = tempfile::Builder::new().prefix("d").tempdir().expect("dir");
        let dockerd = StandinDockerd::install(dir.path(), std::path::Path::new(DOCKERD), readiness)
            .expect("stand-in dockerd");
        let runner = recording_runner(dir.path(), std::path::Path::new(STANDIN)).expect("runner");
        DockerJob {
            dir,
            dockerd,
            runner,
        }
    }

    fn socket(&self) -> std::path::PathBuf {
        self.dir.path().join("docker.sock")
    }

    fn variables(&self, ready_timeout_secs: u64) -> Vec<(&'static str, String)> {
        vec![
            ("CI_RUNNER_START_DOCKER", "true".into()),
            ("CI_DOCKERD", self.dockerd.program().display().to_string()),
            ("CI_DOCKER_SOCKET", self.socket().display().to_string()),
            ("CI_DOCKER_READY_TIMEOUT", ready_timeout_secs.to_string()),
            ("GITEA_RUNNER_BINARY", self.runner.display().to_string()),
        ]
    }

    fn runner_start(&self) -> Option<RunnerStart> {
        runner_start(self.dir.path())
    }

    /// The daemon got SIGTERM and its process is gone (waited for, not a zombie).
    fn assert_stopped(&self) {
        assert!(self.dockerd.pid().is_some(), "the daemon was started");
        assert!(self.dockerd.terminated(), "the daemon got SIGTERM");
        assert!(!self.dockerd.running(), "the daemon's process is gone");
    }
}

/// DESIGN invariant 16: with `CI_RUNNER_START_DOCKER` the executor starts the job's Docker
/// daemon after it holds its SVID, starts the runner only once the daemon answers on its
/// socket, with `DOCKER_HOST` pointing at it, and stops the daemon after the job.
#[tokio::test(flavor = "multi_thread")]
async fn the_runner_starts_once_the_jobs_docker_daemon_answers_with_docker_host_pointing_at_it_and_the_daemon_stops_after_the_job()
 {
    let env = Env::new().await;
    let a = env.assignment("standin:success").await;
    let workload = env.workload(a.identity().spiffe_id()).await;
    // The daemon binds its socket only after a while: the runner must not race it.
    let docker = DockerJob::new(Readiness::After(Duration::from_millis(700)));
    let config = env.executor_config_with(&a, &workload, &docker.variables(30));
    let status = run(config, no_signals()).await.expect("executor runs");
    assert!(status.success(), "the runner exits 0");
    env.job_status(&a, Status::Success).await;

    let host = format!("unix://{}", docker.socket().display());
    let start = docker.runner_start().expect("the runner started");
    assert_eq!(start.docker_host, host, "the runner's DOCKER_HOST");
    assert!(
        start.socket_existed,
        "the daemon listened before the runner started"
    );
    assert_eq!(
        docker.dockerd.args(),
        Some(vec!["--host".to_string(), host.clone()]),
        "the daemon serves the configured socket"
    );
    docker.assert_stopped();
}

/// DESIGN invariant 16: a daemon that does not answer within `CI_DOCKER_READY_TIMEOUT`
/// fails the executor with an error naming the variable and the program; no runner
/// starts (no job runs without the Docker it was promised) and the daemon is stopped.
#[tokio::test(flavor = "multi_thread")]
async fn a_docker_daemon_that_never_answers_fails_the_executor_naming_ci_docker_ready_timeout_and_no_runner_starts()
 {
    let env = Env::new().await;
    let a = env.assignment("standin:success").await;
    let workload = env.workload(a.identity().spiffe_id()).await;
    let docker = DockerJob::new(Readiness::Never);
    // Long enough for the stand-in (a Python process) to be up and handle SIGTERM on a
    // loaded machine; the error must come from the deadline, not from a dead daemon.
    let config = env.executor_config_with(&a, &workload, &docker.variables(5));
    let error = run(config, no_signals())
        .await
        .expect_err("the daemon never answers")
        .to_string();
    assert!(
        error.contains("CI_DOCKER_READY_TIMEOUT")
            && error.contains(&docker.dockerd.program().display().to_string()),
        "{error}"
    );
    assert_eq!(docker.runner_start(), None, "no runner started");
    docker.assert_stopped();
}

/// DESIGN invariant 16: a daemon that exits during its start-up fails the executor with
/// its status, naming `CI_DOCKERD`.
#[tokio::test(flavor = "multi_thread")]
async fn a_docker_daemon_that_exits_during_start_up_fails_the_executor_with_its_status() {
    let env = Env::new().await;
    let a = env.assignment("standin:success").await;
    let workload = env.workload(a.identity().spiffe_id()).await;
    let docker = DockerJob::new(Readiness::Exits(3));
    let config = env.executor_config_with(&a, &workload, &docker.variables(30));
    let error = run(config, no_signals())
        .await
        .expect_err("the daemon exits")
        .to_string();
    assert!(
        error.contains("CI_DOCKERD") && error.contains("exit status: 3"),
        "{error}"
    );
    assert_eq!(docker.runner_start(), None, "no runner started");
}

/// DESIGN invariant 16: a signal passed on to the runner ends the job; the daemon is
/// stopped after the runner exits, as after a finished job.
#[tokio::test(flavor = "multi_thread")]
async fn the_jobs_docker_daemon_is_stopped_after_a_runner_cancelled_by_a_signal() {
    let env = Env::new().await;
    let a = env.assignment("standin:hang").await;
    let workload = env.workload(a.identity().spiffe_id()).await;
    let docker = DockerJob::new(Readiness::After(Duration::ZERO));
    let config = env.executor_config_with(&a, &workload, &docker.variables(30));
    let (signal, signals) = tokio::sync::mpsc::channel(1);
    let executor = tokio::spawn(run(config, signals));
    let task_id = a.id().task_id();
    env.mock
        .handle
        .wait_for(|m| m.task(task_id).is_some_and(|t| t.heartbeats > 0), WAIT)
        .await
        .expect("the runner is heartbeating");
    assert!(
        docker.dockerd.running() && !docker.dockerd.terminated(),
        "the daemon runs with the job"
    );
    signal.send(Forward::Terminate).await.expect("send");
    tokio::time::timeout(WAIT, executor)
        .await
        .expect("executor ends")
        .expect("join")
        .expect("ran");
    env.job_status(&a, Status::Cancelled).await;
    docker.assert_stopped();
}

/// DESIGN invariant 16: a runner that cannot even start is an executor error; the daemon
/// started for it is stopped all the same.
#[tokio::test(flavor = "multi_thread")]
async fn the_jobs_docker_daemon_is_stopped_when_the_runner_cannot_start() {
    let env = Env::new().await;
    let a = env.assignment("standin:success").await;
    let workload = env.workload(a.identity().spiffe_id()).await;
    let docker = DockerJob::new(Readiness::After(Duration::ZERO));
    // The first of a name wins. A bare name is looked up on PATH only when the runner
    // starts (a path is checked before anything starts).
    let mut variables = vec![("GITEA_RUNNER_BINARY", "gdr-no-such-gitea-runner".into())];
    variables.extend(docker.variables(30));
    let config = env.executor_config_with(&a, &workload, &variables);
    let error = run(config, no_signals())
        .await
        .expect_err("no runner")
        .to_string();
    assert!(error.contains("gdr-no-such-gitea-runner"), "{error}");
    docker.assert_stopped();
}

/// DESIGN invariant 16: `CI_RUNNER_CONFIG` reaches the official runner as its
/// `--config` flag (a persistent flag of its root command), as an absolute path.
#[tokio::test(flavor = "multi_thread")]
async fn the_runner_configuration_reaches_the_runner_as_its_config_flag() {
    let env = Env::new().await;
    let a = env.assignment("standin:success").await;
    let workload = env.workload(a.identity().spiffe_id()).await;
    let docker = DockerJob::new(Readiness::Never);
    let config_file = docker.dir.path().join("config.yaml");
    std::fs::write(&config_file, "log:\n  level: info\n").expect("config");
    let config = env.executor_config_with(
        &a,
        &workload,
        &[
            ("GITEA_RUNNER_BINARY", docker.runner.display().to_string()),
            ("CI_RUNNER_CONFIG", config_file.display().to_string()),
        ],
    );
    let status = run(config, no_signals()).await.expect("executor runs");
    assert!(status.success());
    env.job_status(&a, Status::Success).await;
    let start = docker.runner_start().expect("the runner started");
    assert_eq!(
        start.args,
        vec![
            "--config".to_string(),
            config_file.display().to_string(),
            "daemon".to_string(),
            "--once".to_string()
        ]
    );
    assert_eq!(start.docker_host, "", "no daemon was asked for");
    assert_eq!(docker.dockerd.pid(), None, "no daemon was started");
}

/// DESIGN invariant 16: a `CI_RUNNER_CONFIG` naming no file fails the executor at once,
/// naming the variable and the path, before any runner starts.
#[tokio::test(flavor = "multi_thread")]
async fn a_missing_runner_configuration_fails_the_executor_naming_ci_runner_config() {
    let env = Env::new().await;
    let a = env.assignment("standin:success").await;
    let workload = env.workload(a.identity().spiffe_id()).await;
    let docker = DockerJob::new(Readiness::Never);
    let missing = docker.dir.path().join("missing.yaml");
    let config = env.executor_config_with(
        &a,
        &workload,
        &[
            ("GITEA_RUNNER_BINARY", docker.runner.display().to_string()),
            ("CI_RUNNER_CONFIG", missing.display().to_string()),
        ],
    );
    let error = run(config, no_signals())
        .await
        .expect_err("no configuration")
        .to_string();
    assert!(
        error.starts_with("CI_RUNNER_CONFIG:") && error.contains(&missing.display().to_string()),
        "{error}"
    );
    assert_eq!(docker.runner_start(), None, "no runner started");
}

/// DESIGN invariants 16 and 13: an executor started as root with `CI_EXECUTOR_SANDBOXED`
/// (as the executor image starts it in its Pod or VM) starts the job's Docker daemon by default,
/// runs the runner as uid/gid 2000 with the `docker` group and without root, links the
/// SPIRE agent's socket where jobs look for it, so a job's
/// `fetch jwt -socketPath /run/spire/agent-sockets/spire-agent.sock` gets a JWT-SVID of
/// its own SPIFFE ID, and stops the daemon after the job.
///
/// The executor runs in a mount namespace of its own (as in a container): `/run`,
/// `/var/lib` and `/sys/fs/cgroup` are fresh tmpfs there, and `/etc/group` names the
/// docker group, so nothing of the host's is touched.
#[tokio::test(flavor = "multi_thread")]
async fn an_executor_started_as_root_runs_the_job_as_uid_2000_with_the_docker_group_and_its_own_jwt_at_the_agent_path()
 {
    use std::os::unix::fs::PermissionsExt;
    if !rustix::process::geteuid().is_root() {
        eprintln!("SKIPPED: needs root (a mount namespace and a change of uid)");
        return;
    }
    // The executor image's entrypoint: the executor's own binary, which starts itself again
    // as uid 2000 with the argument `executor`.
    let bin = executor_binary();
    let env = Env::new().await;
    let a = env
        .assignment("standin:fetch-jwt ci-smoke socket=/run/spire/agent-sockets/spire-agent.sock")
        .await;
    // Everything the runner's user reaches: the agent's socket, its records, the runner.
    let shared = tempfile::Builder::new().prefix("r").tempdir().expect("dir");
    std::fs::set_permissions(shared.path(), std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let workload = FakeWorkloadApi::start(shared.path(), env.ca.clone(), a.identity().spiffe_id())
        .await
        .expect("workload api");
    std::fs::set_permissions(
        &workload.socket_path,
        std::fs::Permissions::from_mode(0o777),
    )
    .expect("chmod socket");
    let dockerd = StandinDockerd::install(
        shared.path(),
        std::path::Path::new(DOCKERD),
        Readiness::After(Duration::ZERO),
    )
    .expect("dockerd");
    // A copy in the shared directory: the checkout (and its target/) may live where uid
    // 2000 cannot go, such as a 0700 home directory.
    let standin = shared.path().join("standin-runner");
    std::fs::copy(STANDIN, &standin).expect("copy the stand-in runner");
    let runner = recording_runner(shared.path(), &standin).expect("runner");
    let group = shared.path().join("group");
    std::fs::write(&group, "root:x:0:\nrunner:x:2000:\ndocker:x:2001:runner\n").expect("group");
    let socket = shared.path().join("docker.sock");

    let mut command = tokio::process::Command::new("unshare");
    command
        .args(["--mount", "--propagation", "private", "sh", "-c"])
        .arg(
            "set -e; mount -t tmpfs gdr-run /run; mount -t tmpfs gdr-lib /var/lib; \
             mount -t tmpfs gdr-cgroup /sys/fs/cgroup; mount --bind \"$GROUP_FILE\" /etc/group; \
             exec \"$@\"",
        )
        .args(["sh".as_ref(), bin.as_os_str(), "executor".as_ref()])
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("GROUP_FILE", &group)
        .env("CI_EXECUTOR_SANDBOXED", "true")
        .env("CI_RUNNER_UID", "2000")
        .env("CI_DOCKERD", dockerd.program())
        .env("CI_DOCKER_SOCKET", &socket)
        .env("CI_DOCKER_READY_TIMEOUT", "30")
        .env("GITEA_RUNNER_BINARY", &runner)
        // Not the checkout, which uid 2000 may not be able to enter.
        .current_dir(shared.path())
        .kill_on_drop(true)
        .stderr(std::process::Stdio::piped());
    env.pass_executor_variables(&mut command, &a, &workload);
    let output = tokio::time::timeout(WAIT, command.output())
        .await
        .expect("the executor ends")
        .expect("unshare runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{}\n{stderr}", output.status);
    env.job_status(&a, Status::Success).await;

    let start = runner_start(shared.path()).expect("the runner started");
    assert_eq!(
        (start.uid.as_str(), start.gid.as_str()),
        ("2000", "2000"),
        "{stderr}"
    );
    assert!(
        start.groups.contains(&"2001".to_string()) && !start.groups.contains(&"0".to_string()),
        "the runner has the docker group and not root's: {:?}",
        start.groups
    );
    assert_eq!(start.docker_host, format!("unix://{}", socket.display()));
    assert!(
        start.socket_existed,
        "the daemon answered before the runner started"
    );
    let rows = env
        .mock
        .handle
        .task(a.id().task_id())
        .map(|t| t.log_rows)
        .unwrap_or_default();
    let expected = format!("jwt-svid: sub={} aud=ci-smoke", a.identity().spiffe_id());
    assert!(rows.contains(&expected), "{rows:?}\n{stderr}");
    assert!(dockerd.terminated(), "the daemon got SIGTERM");
    assert!(!dockerd.running(), "the daemon's process is gone");
}

/// DESIGN invariant 16 (issue 37): a runner binary the job's uid cannot execute (here in
/// a directory only root may enter, as a checkout under a 0700 home is for uid 2000)
/// fails the executor at once — before it waits for its SVID, the facade or a daemon —
/// with the path and the uid in the error, instead of leaving it silent until the
/// controller's deadline.
#[tokio::test(flavor = "multi_thread")]
async fn a_runner_the_jobs_uid_cannot_execute_fails_the_executor_at_once_naming_path_and_uid() {
    use std::os::unix::fs::PermissionsExt;
    if !rustix::process::geteuid().is_root() {
        eprintln!("SKIPPED: needs root (a change of uid)");
        return;
    }
    const BIN: &str = env!("CARGO_BIN_EXE_gitea-dynamic-runner");
    let env = Env::new().await;
    let a = env.assignment("standin:success").await;
    let shared = tempfile::Builder::new().prefix("r").tempdir().expect("dir");
    std::fs::set_permissions(shared.path(), std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let workload = FakeWorkloadApi::start(shared.path(), env.ca.clone(), a.identity().spiffe_id())
        .await
        .expect("workload api");
    std::fs::set_permissions(
        &workload.socket_path,
        std::fs::Permissions::from_mode(0o777),
    )
    .expect("chmod socket");
    let private = shared.path().join("home");
    std::fs::create_dir(&private).expect("private dir");
    std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    let runner = private.join("gitea-runner");
    std::fs::copy(STANDIN, &runner).expect("copy the runner");

    let mut command = tokio::process::Command::new(BIN);
    command
        .arg("executor")
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        // As the root executor starts it: the job's uid from its first instruction.
        .env("CI_EXECUTOR_RUN_AS", "2000:2000:")
        .env("GITEA_RUNNER_BINARY", &runner)
        .current_dir(shared.path())
        .kill_on_drop(true)
        .stderr(std::process::Stdio::piped());
    env.pass_executor_variables(&mut command, &a, &workload);
    let started = std::time::Instant::now();
    let output = tokio::time::timeout(WAIT, command.output())
        .await
        .expect("the executor ends")
        .expect("the executor runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "failed only after {:?}\n{stderr}",
        started.elapsed()
    );
    assert!(
        stderr.contains(&runner.display().to_string()) && stderr.contains("uid 2000"),
        "the error names the runner's path and the uid\n{stderr}"
    );
    assert_eq!(
        workload.fetch_count(),
        0,
        "nothing waited for the SVID first\n{stderr}"
    );
}

/// DESIGN invariants 12 and 15 (issue 37): the pass-through serves only the executor of a
/// live assignment: once the job's start deadline expired it (the job is being failed in
/// Gitea) its credentials open nothing; and only the runner's own calls count as it being
/// heard from, so an executor that keeps fetching artifacts but reports nothing still
/// falls silent for the idle timeout.
#[tokio::test(flavor = "multi_thread")]
async fn the_pass_through_refuses_an_expired_assignment_and_does_not_count_as_the_runner_being_heard()
 {
    let env = Env::new().await;
    let own = job_svid(&env, "build");
    // A claimed assignment: its silence counts from the claim.
    let live = env.assignment("standin:success").await;
    let auth = env
        .dispatch
        .authorize(
            live.id().as_str(),
            env.dispatch.capability_key().issue(live.id()).expose(),
            live.identity().spiffe_id(),
        )
        .expect("authorized");
    assert!(matches!(
        env.dispatch.take_task(&auth).await.expect("claimed"),
        gdr_controller::dispatch::Fetched::Task(_)
    ));
    tokio::time::sleep(Duration::from_millis(500)).await;
    let head = format!(
        "GET /_mock/blob/8?live HTTP/1.1\r\nhost: facade\r\n{}connection: close\r\n\r\n",
        env.credential_lines(&live)
    );
    let (_, answer) = exchange(&env, &own, &head, b"").await;
    assert_eq!(answer.status().as_deref(), Some("HTTP/1.1 200 OK"));
    let silence = env.dispatch.silence(live.id()).expect("heard at the claim");
    assert!(
        silence >= Duration::from_millis(500),
        "a pass-through request reset the runner's silence to {silence:?}"
    );

    // An assignment whose start deadline expired it.
    let expired = env.assignment("standin:success").await;
    assert!(env.dispatch.expire(expired.id()));
    let head = format!(
        "GET /_mock/blob/9?expired HTTP/1.1\r\nhost: facade\r\n{}connection: close\r\n\r\n",
        env.credential_lines(&expired)
    );
    let (_, answer) = exchange(&env, &own, &head, b"").await;
    assert_eq!(answer.status().as_deref(), Some("HTTP/1.1 403 Forbidden"));
    let reached: Vec<String> = env
        .mock
        .handle
        .seen_requests()
        .into_iter()
        .filter(|p| p.contains("?expired"))
        .collect();
    assert!(
        reached.is_empty(),
        "a refused request reached Gitea: {reached:?}"
    );
}
