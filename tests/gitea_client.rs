//! The Gitea client against the mock Gitea over real HTTP.

use std::time::Duration;

use gdr_gitea::{ClientOptions, Credentials, ErrorKind, GiteaClient};
use gdr_proto::runner::v1::{
    LogRow, RegisterRequest, TaskResult, TaskState, UpdateLogRequest, UpdateTaskRequest,
};
use gdr_testkit::log_capture::Capture;
use gdr_testkit::mock_gitea::{
    GrpcCode, MockConfig, MockFault, MockGitea, RpcMethod, RunningMock, Status,
};

const POD_JOB: &str = "on: push\njobs:\n  build:\n    runs-on: [self-hosted, pod]\n    steps:\n      - run: echo hi\n";

async fn mock() -> RunningMock {
    MockGitea::start(MockConfig::default().with_registration_token("reg-token"))
        .await
        .expect("mock starts")
}

fn client(mock: &RunningMock, creds: Option<&Credentials>) -> GiteaClient {
    GiteaClient::new(ClientOptions::new(mock.url.clone()), creds).expect("client builds")
}

fn runner(mock: &RunningMock, labels: &[&str]) -> (Credentials, GiteaClient) {
    let (uuid, token) = mock.handle.create_runner("ctl", labels, false);
    let creds = Credentials::new(uuid, token);
    let c = client(mock, Some(&creds));
    (creds, c)
}

/// DESIGN invariants 1, 10: the client speaks the runner protocol the controller is built on:
/// one Register, Declare with labels and capabilities, FetchTask with a tasks version,
/// UpdateLog up to its ack index, heartbeats, and a final UpdateTask whose result and outputs
/// Gitea accepts.
#[tokio::test]
async fn register_declare_fetch_update_and_log_work_end_to_end() {
    let mock = mock().await;
    let registered = client(&mock, None)
        .register(RegisterRequest {
            name: "ctl".into(),
            token: "reg-token".into(),
            labels: vec!["self-hosted".into(), "pod".into()],
            capabilities: vec!["cancelling".into()],
            version: "test".into(),
            ..Default::default()
        })
        .await
        .expect("register");
    assert!(!registered.uuid.is_empty() && !registered.token.is_empty());
    let creds = Credentials::new(registered.uuid.clone(), registered.token.clone());
    let c = client(&mock, Some(&creds));

    let declared = c
        .declare(
            vec!["self-hosted".into(), "pod".into()],
            vec!["cancelling".into()],
        )
        .await
        .expect("declare");
    assert_eq!(declared.runner.uuid, registered.uuid);
    assert_eq!(declared.server_capabilities.as_deref(), Some("job-summary"));
    let seen = mock.handle.runner(&registered.uuid).expect("runner known");
    assert_eq!(seen.capabilities, vec!["cancelling".to_string()]);

    let job = mock
        .handle
        .queue_workflow("owner/repo", POD_JOB)
        .expect("queue")[0];
    let fetched = c.fetch_task(0).await.expect("fetch");
    let task = fetched.task.into_option().expect("a task is handed out");
    assert!(task.id > 0);
    assert!(fetched.tasks_version > 0);

    let ack = c
        .update_log(UpdateLogRequest {
            task_id: task.id,
            index: 0,
            rows: vec![
                LogRow {
                    content: "line one".into(),
                    ..Default::default()
                },
                LogRow {
                    content: "line two".into(),
                    ..Default::default()
                },
            ],
            ..Default::default()
        })
        .await
        .expect("log");
    assert_eq!(ack.ack_index, 2);

    let heartbeat = c
        .update_task(UpdateTaskRequest {
            state: TaskState {
                id: task.id,
                ..Default::default()
            }
            .into(),
            ..Default::default()
        })
        .await
        .expect("heartbeat");
    assert_eq!(
        heartbeat.state.as_option().map(|s| s.result),
        Some(TaskResult::RESULT_UNSPECIFIED.into())
    );

    let done = c
        .update_task(UpdateTaskRequest {
            state: TaskState {
                id: task.id,
                result: TaskResult::RESULT_SUCCESS.into(),
                ..Default::default()
            }
            .into(),
            outputs: [("artifact".to_string(), "ok".to_string())]
                .into_iter()
                .collect(),
            ..Default::default()
        })
        .await
        .expect("final state");
    assert_eq!(done.sent_outputs, vec!["artifact".to_string()]);

    let snapshot = mock.handle.job(job).expect("job");
    assert_eq!(snapshot.status, Status::Success);
    let task_snapshot = snapshot.task.expect("task");
    assert_eq!(
        task_snapshot.log_rows,
        vec!["line one".to_string(), "line two".to_string()]
    );
    assert_eq!(
        task_snapshot.outputs.get("artifact").map(String::as_str),
        Some("ok")
    );
}

/// No DESIGN invariant (Gitea protocol): the client's Ping reaches Gitea's PingService.
#[tokio::test]
async fn ping_answers_hello() {
    let mock = mock().await;
    assert_eq!(
        client(&mock, None).ping("ctl").await.expect("ping"),
        "Hello, ctl!"
    );
}

/// DESIGN invariants 12, 19: a refused controller credential is a typed, final
/// `Unauthenticated` carrying Gitea's own text, never retried like an outage.
#[tokio::test]
async fn an_unregistered_runner_gets_an_unauthenticated_error_with_giteas_text() {
    let mock = mock().await;
    let c = client(&mock, Some(&Credentials::new("nope", "wrong")));
    let err = c.fetch_task(0).await.expect_err("refused");
    assert_eq!(err.kind(), ErrorKind::Unauthenticated);
    assert_eq!(err.message(), "unregistered runner");
    assert!(!err.is_retryable());
    assert!(
        err.to_string()
            .starts_with("FetchTask: Gitea refused the credentials"),
        "{err}"
    );
}

/// No DESIGN invariant (operator interface): a registration with an invalidated token fails
/// with Gitea's message.
#[tokio::test]
async fn an_invalidated_registration_token_is_refused_with_giteas_message() {
    let mock = mock().await;
    mock.handle.invalidate_registration_token("reg-token");
    let err = client(&mock, None)
        .register(RegisterRequest {
            name: "x".into(),
            token: "reg-token".into(),
            ..Default::default()
        })
        .await
        .expect_err("refused");
    assert!(err.message().contains("invalidated"), "{err}");
}

/// DESIGN invariants 12, 19: Gitea's errors map to typed kinds keeping Gitea's message, so
/// callers tell an outage (`Unavailable`: failure reports and forwarded runner calls are
/// retried) from a refusal.
#[tokio::test]
async fn gitea_style_errors_map_to_typed_kinds() {
    let mock = mock().await;
    let (_, c) = runner(&mock, &["self-hosted", "pod"]);
    for (code, kind) in [
        (GrpcCode::NotFound, ErrorKind::NotFound),
        (GrpcCode::InvalidArgument, ErrorKind::Invalid),
        (GrpcCode::Unauthenticated, ErrorKind::Unauthenticated),
        (GrpcCode::Unavailable, ErrorKind::Unavailable),
        (GrpcCode::Internal, ErrorKind::Other),
    ] {
        mock.handle.fail_next(
            RpcMethod::FetchTask,
            MockFault::Gitea {
                code,
                desc: "injected".into(),
            },
        );
        let err = c.fetch_task(0).await.expect_err("fault");
        assert_eq!(err.kind(), kind, "{code:?}: {err}");
        assert_eq!(err.message(), "injected");
    }
}

/// DESIGN invariants 12, 19: errors of a proxy between the controller and Gitea (Connect
/// errors, an HTTP 502 page) map to typed kinds; a proxy's outage is a retryable `Unavailable`.
#[tokio::test]
async fn real_connect_and_http_errors_from_a_proxy_map_to_typed_kinds() {
    let mock = mock().await;
    let (_, c) = runner(&mock, &["self-hosted", "pod"]);
    mock.handle.fail_next(
        RpcMethod::Declare,
        MockFault::Connect {
            code: connectrpc::ErrorCode::Unavailable,
            message: "upstream down".into(),
        },
    );
    let err = c.declare(vec![], vec![]).await.expect_err("fault");
    assert_eq!(err.kind(), ErrorKind::Unavailable);
    assert!(err.is_retryable());

    mock.handle.fail_next(
        RpcMethod::Declare,
        MockFault::Connect {
            code: connectrpc::ErrorCode::Unauthenticated,
            message: "proxy says no".into(),
        },
    );
    assert_eq!(
        c.declare(vec![], vec![]).await.expect_err("fault").kind(),
        ErrorKind::Unauthenticated
    );

    mock.handle.fail_next(
        RpcMethod::Declare,
        MockFault::Http {
            status: 502,
            body: "bad gateway".into(),
        },
    );
    assert_eq!(
        c.declare(vec![], vec![]).await.expect_err("fault").kind(),
        ErrorKind::Unavailable
    );
}

/// DESIGN invariant 4: a fetch slower than the fetch timeout fails as `Unavailable`, so an
/// in-flight fetch is bounded and a hung Gitea holds neither a poller nor the shutdown.
#[tokio::test]
async fn a_fetch_slower_than_the_fetch_timeout_fails_as_unavailable() {
    let mock = mock().await;
    let (uuid, token) = mock.handle.create_runner("ctl", &["self-hosted"], false);
    let mut options = ClientOptions::new(mock.url.clone());
    options.fetch_timeout = Duration::from_millis(200);
    let c = GiteaClient::new(options, Some(&Credentials::new(uuid, token))).expect("client");
    mock.handle.fail_next(
        RpcMethod::FetchTask,
        MockFault::Delay(Duration::from_secs(3)),
    );
    let err = c.fetch_task(0).await.expect_err("times out");
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
}

/// DESIGN invariants 12, 19: an unreachable Gitea is `Unavailable`, retried like any outage.
#[tokio::test]
async fn an_unreachable_gitea_is_unavailable() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    drop(listener);
    let c = GiteaClient::new(ClientOptions::new(url), Some(&Credentials::new("u", "t")))
        .expect("client");
    assert_eq!(
        c.fetch_task(0).await.expect_err("refused").kind(),
        ErrorKind::Unavailable
    );
}

/// No DESIGN invariant (Gitea protocol): large gzip-compressed answers from Gitea are decoded.
#[tokio::test]
async fn large_gzipped_answers_are_decoded() {
    let mock = mock().await;
    let (_, c) = runner(&mock, &["self-hosted", "pod"]);
    let long_step = format!("      - run: echo {}\n", "x".repeat(8 * 1024));
    let workflow = format!("{POD_JOB}{long_step}");
    mock.handle
        .queue_workflow("owner/repo", &workflow)
        .expect("queue");
    let task = c
        .fetch_task(0)
        .await
        .expect("fetch")
        .task
        .into_option()
        .expect("task");
    let payload = String::from_utf8(task.workflow_payload.unwrap_or_default()).expect("utf8");
    assert!(payload.contains(&"x".repeat(8 * 1024)));
}

/// A FetchTask answer above connectrpc's 4 MiB default is a task Gitea has claimed for
/// us: it is read (up to `FETCH_TASK_MESSAGE_LIMIT`, 32 MiB), and one above the limit is
/// reported as too large with the limit, not as "Gitea is unavailable".
#[tokio::test]
async fn fetch_task_answers_above_4_mib_are_read_and_larger_ones_are_reported_as_too_large() {
    use gdr_gitea::FETCH_TASK_MESSAGE_LIMIT;
    let mock = mock().await;
    let (uuid, token) = mock
        .handle
        .create_runner("ctl", &["self-hosted", "pod"], false);
    let creds = Credentials::new(uuid, token);
    // Building and compressing MiBs in an unoptimised mock takes seconds.
    let mut options = ClientOptions::new(mock.url.clone());
    options.fetch_timeout = Duration::from_secs(60);
    assert_eq!(options.fetch_message_limit, FETCH_TASK_MESSAGE_LIMIT);
    const { assert!(FETCH_TASK_MESSAGE_LIMIT >= 32 * 1024 * 1024) };
    let c = GiteaClient::new(options.clone(), Some(&creds)).expect("client");
    // Secrets are per repository; distinct bytes keep gzip from hiding the size.
    let bulky = |len: usize| -> String {
        (0..len)
            .map(|i| char::from(b'a' + u8::try_from((i * 7 + i / 26) % 26).unwrap()))
            .collect()
    };
    let size = 4 * 1024 * 1024 + 512 * 1024;
    mock.handle.set_secret("owner/big", "BULK", &bulky(size));
    mock.handle
        .queue_workflow("owner/big", POD_JOB)
        .expect("queue");
    let task = c
        .fetch_task(0)
        .await
        .expect("a 4.5 MiB task is read")
        .task
        .into_option()
        .expect("task");
    assert_eq!(task.secrets.get("BULK").map(String::len), Some(size));

    // The same task over connectrpc's default 4 MiB (sending 32 MiB through an unoptimised
    // mock is slow).
    options.fetch_message_limit = 4 * 1024 * 1024;
    let small = GiteaClient::new(options, Some(&creds)).expect("client");
    mock.handle
        .queue_workflow("owner/big", POD_JOB)
        .expect("queue");
    let err = small.fetch_task(0).await.expect_err("over the limit");
    assert_eq!(err.kind(), ErrorKind::TooLarge, "{err}");
    assert!(!err.is_retryable());
    let text = err.to_string();
    assert!(
        text.contains("larger than the client accepts") && text.contains("4194304"),
        "{text}"
    );
}

/// No DESIGN invariant (operator interface): a CA file without a certificate is refused naming
/// `gitea_ca_file`.
#[test]
fn a_ca_file_without_certificates_is_refused_with_a_clear_message() {
    let mut options = ClientOptions::new("https://gitea.example.org");
    options.extra_ca_pem = Some(b"not a certificate".to_vec());
    let err = GiteaClient::new(options, None).expect_err("refused");
    assert!(err.to_string().contains("gitea_ca_file"), "{err}");
}

/// No DESIGN invariant (operator interface): a Gitea URL that is not http or https is refused.
#[test]
fn a_non_http_gitea_url_is_refused() {
    let err = GiteaClient::new(ClientOptions::new("ftp://gitea"), None).expect_err("refused");
    assert!(err.to_string().contains("expected http or https"), "{err}");
}

/// DESIGN invariant 17: even at trace level no log line holds the registration token, the
/// runner token, a task's token or a job secret (the capture sees the test's own event, so the
/// check is live).
#[test]
fn no_log_line_contains_a_token_or_task_secret_even_at_trace_level() {
    let capture = Capture::default();
    let subscriber = gdr_controller::logging::subscriber(
        tracing_subscriber::EnvFilter::new("trace"),
        capture.clone(),
    );
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let (runner_token, task_token) = tracing::subscriber::with_default(subscriber, || {
        runtime.block_on(async {
            let mock = mock().await;
            mock.handle
                .set_secret("owner/repo", "DEPLOY_KEY", "super-secret-deploy-key");
            let registered = client(&mock, None)
                .register(RegisterRequest {
                    name: "ctl".into(),
                    token: "reg-token".into(),
                    labels: vec!["self-hosted".into(), "pod".into()],
                    ..Default::default()
                })
                .await
                .expect("register");
            let creds = Credentials::new(registered.uuid.clone(), registered.token.clone());
            tracing::info!(credentials = ?creds, "using credentials");
            let c = client(&mock, Some(&creds));
            c.declare(vec!["self-hosted".into(), "pod".into()], vec![])
                .await
                .expect("declare");
            let job = mock
                .handle
                .queue_workflow("owner/repo", POD_JOB)
                .expect("queue")[0];
            let task = c
                .fetch_task(0)
                .await
                .expect("fetch")
                .task
                .into_option()
                .expect("task");
            c.update_task(UpdateTaskRequest {
                state: TaskState {
                    id: task.id,
                    result: TaskResult::RESULT_SUCCESS.into(),
                    ..Default::default()
                }
                .into(),
                ..Default::default()
            })
            .await
            .expect("update");
            let token = mock
                .handle
                .job(job)
                .and_then(|j| j.task)
                .map(|t| t.token)
                .expect("task token");
            (registered.token, token)
        })
    });
    let logs = capture.text();
    assert!(
        logs.contains("using credentials"),
        "the capture must see our own events"
    );
    for secret in [
        runner_token.as_str(),
        task_token.as_str(),
        "reg-token",
        "super-secret-deploy-key",
    ] {
        assert!(
            !logs.contains(secret),
            "a log line contains a secret: {secret}"
        );
    }
}
