//! The executor's relay (DESIGN invariant 19) with real peers: a client speaking the
//! runner's side of the protocol → loopback proxy and relay → a gate that takes the facade
//! away and brings it back → the facade → mock Gitea.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use buffa::{Message, MessageField};
use connectrpc::client::{ClientConfig, HttpClient};
use gdr_core::assignment::Assignment;
use gdr_executor::relay::{Relay, Settled};
use gdr_identity::tls;
use gdr_proto::runner::v1::{
    DeclareRequest, FetchTaskRequest, FetchTaskResponse, LogRow, RunnerServiceClient, TaskResult,
    TaskState, UpdateLogRequest, UpdateTaskRequest,
};
use gdr_testkit::eventually;
use gdr_testkit::log_capture::Capture;
use gdr_testkit::mock_gitea::{GrpcCode, MockFault, RpcMethod, Status};
use gdr_testkit::spiffe::{FakeWorkloadApi, RunningWorkloadApi};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use crate::facade::{Env, FACADE_ID, WAIT, runtime_logging_into};

/// The facade's own request limit (connectrpc's default, which the facade keeps).
const FACADE_REQUEST_LIMIT: usize = 4 * 1024 * 1024;

/// A TCP gate in front of a facade. Closed, it accepts and drops every connection at once
/// (the TLS handshake fails: the facade is unreachable) and cuts the ones it forwards.
struct Gate {
    addr: SocketAddr,
    open: watch::Sender<bool>,
    refused: Arc<AtomicUsize>,
    /// Connections being forwarded now.
    forwarding: Arc<AtomicUsize>,
}

impl Gate {
    async fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (open, watched) = watch::channel(true);
        let refused = Arc::new(AtomicUsize::new(0));
        let counted = refused.clone();
        let forwarding = Arc::new(AtomicUsize::new(0));
        let live = forwarding.clone();
        tokio::spawn(async move {
            loop {
                let Ok((mut inbound, _)) = listener.accept().await else {
                    return;
                };
                if !*watched.borrow() {
                    counted.fetch_add(1, Ordering::SeqCst);
                    drop(inbound);
                    continue;
                }
                let mut watched = watched.clone();
                let live = live.clone();
                live.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    if let Ok(mut outbound) = TcpStream::connect(target).await {
                        tokio::select! {
                            _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                            _ = watched.wait_for(|open| !*open) => {}
                        }
                    }
                    live.fetch_sub(1, Ordering::SeqCst);
                });
            }
        });
        Gate {
            addr,
            open,
            refused,
            forwarding,
        }
    }

    /// Closes the gate and returns once every forwarded connection is cut: a request sent
    /// after this cannot slip through a connection whose forwarder had not yet seen the
    /// gate close (a race the gate at 0f553fd lost once).
    async fn close(&self) {
        self.open.send_replace(false);
        eventually(WAIT, "the gate's forwarded connections are cut", || async {
            (self.forwarding.load(Ordering::SeqCst) == 0).then_some(())
        })
        .await;
    }

    fn open(&self) {
        self.open.send_replace(true);
    }

    fn refused(&self) -> usize {
        self.refused.load(Ordering::SeqCst)
    }
}

/// The runner's side: a Connect client through its own relay and loopback proxy.
struct Runner {
    relay: Arc<Relay>,
    client: RunnerServiceClient<HttpClient>,
    task_id: i64,
    _workload: RunningWorkloadApi,
}

impl Runner {
    /// A runner of `assignment` whose relay reaches the facade at `facade`; its calls carry
    /// `timeout` as their deadline.
    async fn start(
        env: &Env,
        assignment: &Assignment,
        facade: SocketAddr,
        timeout: Option<Duration>,
    ) -> Self {
        let workload = env.workload(assignment.identity().spiffe_id()).await;
        let svids = gdr_identity::svid_stream::svid_stream(&workload.endpoint(), WAIT)
            .await
            .expect("svid");
        let tls_config = gdr_identity::svid_stream::executor_client_config(&svids, FACADE_ID)
            .expect("client tls");
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let local = listener.local_addr().expect("addr");
        let relay = Relay::new(
            assignment.id().as_str(),
            &format!("https://{facade}"),
            &tls_config,
            WAIT,
        )
        .expect("relay");
        let serving = relay.clone();
        let capability = env
            .dispatch
            .capability_key()
            .issue(assignment.id())
            .expose()
            .to_string();
        let credentials =
            gdr_executor::proxy::RunnerCredentials::new(assignment.id().as_str(), &capability)
                .expect("credentials");
        tokio::spawn(async move {
            let _svids = svids;
            gdr_executor::proxy::serve_loopback_proxy(
                listener,
                serving,
                credentials,
                gdr_controller::shutdown::Shutdown::never(),
            )
            .await
        });
        let mut config =
            ClientConfig::new(format!("http://{local}/api/actions").parse().expect("uri"))
                .with_default_header("x-runner-uuid", assignment.id().as_str())
                .with_default_header("x-runner-token", capability);
        if let Some(timeout) = timeout {
            config = config.with_default_timeout(timeout);
        }
        Runner {
            relay,
            client: RunnerServiceClient::new(HttpClient::plaintext(), config),
            task_id: assignment.id().task_id(),
            _workload: workload,
        }
    }

    /// Declares and takes the task, as the official runner does first.
    async fn claim(&self) {
        self.client
            .declare(DeclareRequest::default())
            .await
            .expect("declare");
        let fetched = self
            .client
            .fetch_task(FetchTaskRequest::default())
            .await
            .expect("fetch")
            .into_owned();
        assert!(fetched.task.is_set(), "the runner gets its task");
    }

    /// Sends `rows` from `index`; returns the acknowledged index the runner hears.
    async fn log(&self, index: i64, rows: Vec<LogRow>, no_more: bool) -> i64 {
        self.client
            .update_log(UpdateLogRequest {
                task_id: self.task_id,
                index,
                rows,
                no_more,
                ..Default::default()
            })
            .await
            .expect("update log")
            .into_owned()
            .ack_index
    }

    /// Reports the task's result; returns the result the runner hears.
    async fn finish(&self, result: TaskResult) -> Option<TaskResult> {
        let answer = self
            .client
            .update_task(UpdateTaskRequest {
                state: MessageField::some(TaskState {
                    id: self.task_id,
                    result: result.into(),
                    ..Default::default()
                }),
                ..Default::default()
            })
            .await
            .expect("update task")
            .into_owned();
        answer.state.as_option().and_then(|s| s.result.as_known())
    }

    async fn settled(&self) -> Settled {
        tokio::time::timeout(WAIT, self.relay.settled())
            .await
            .expect("the relay settles")
    }
}

/// Rows `from..from + n`, each `size` bytes long and naming its number.
fn rows(from: usize, n: usize, size: usize) -> Vec<LogRow> {
    (from..from + n)
        .map(|i| {
            let mut content = format!("row {i} ");
            content.extend(std::iter::repeat_n('x', size.saturating_sub(content.len())));
            LogRow {
                content,
                ..Default::default()
            }
        })
        .collect()
}

fn contents(rows: &[LogRow]) -> Vec<String> {
    rows.iter().map(|r| r.content.clone()).collect()
}

/// DESIGN invariant 19: a held report the facade answers with a transient 500 (here
/// Gitea's own `database is locked`, which the facade passes on as `internal`) is sent
/// again, not dropped: once the facade takes it, the rows and the result are in Gitea and
/// only then does the relay count them delivered.
#[tokio::test(flavor = "multi_thread")]
async fn a_held_report_answered_with_a_transient_500_is_sent_again_until_the_facade_takes_it() {
    let env = Env::new().await;
    let a = env.assignment("standin:success").await;
    let gate = Gate::start(env.facade_addr).await;
    let runner = Runner::start(&env, &a, gate.addr, None).await;
    runner.claim().await;
    assert_eq!(runner.log(0, rows(0, 2, 10), false).await, 2);
    gate.close().await;
    assert_eq!(
        runner.log(2, rows(2, 2, 10), true).await,
        4,
        "held and acknowledged as Gitea would"
    );
    assert_eq!(
        runner.finish(TaskResult::RESULT_SUCCESS).await,
        Some(TaskResult::RESULT_SUCCESS)
    );
    for method in [RpcMethod::UpdateLog, RpcMethod::UpdateTask] {
        env.mock.handle.fail_next(
            method,
            MockFault::Gitea {
                code: GrpcCode::Internal,
                desc: "database is locked".into(),
            },
        );
    }
    let log_calls = env.mock.handle.calls(RpcMethod::UpdateLog);
    gate.open();
    assert_eq!(runner.settled().await, Settled::Delivered);
    let task = env.mock.handle.task(a.id().task_id()).expect("task");
    assert_eq!(task.log_rows, contents(&rows(0, 4, 10)));
    assert!(task.log_archived, "the held no_more arrived");
    assert_eq!(task.status, Status::Success, "the held result arrived");
    assert!(
        env.mock.handle.calls(RpcMethod::UpdateLog) >= log_calls + 2,
        "the refused delivery was sent again"
    );
}

/// DESIGN invariant 19: a held result for a task Gitea no longer has (`resource does not
/// exist`, which real Gitea answers as an internal error) is refused for good: dropped at
/// once rather than sent again for the whole tolerance, and the relay says it was lost.
#[tokio::test(flavor = "multi_thread")]
async fn a_held_result_for_a_task_gitea_no_longer_has_is_refused_at_once_and_counted_lost() {
    let env = Env::new().await;
    let a = env.assignment("standin:success").await;
    let gate = Gate::start(env.facade_addr).await;
    let runner = Runner::start(&env, &a, gate.addr, None).await;
    runner.claim().await;
    gate.close().await;
    runner.finish(TaskResult::RESULT_SUCCESS).await;
    env.mock.handle.fail_next(
        RpcMethod::UpdateTask,
        MockFault::Gitea {
            code: GrpcCode::Internal,
            desc: format!(
                "update task: task with id {}: resource does not exist",
                a.id().task_id()
            ),
        },
    );
    gate.open();
    assert_eq!(
        runner.settled().await,
        Settled::Refused {
            rows: 0,
            result: true
        }
    );
    assert_eq!(
        env.mock.handle.calls(RpcMethod::UpdateTask),
        1,
        "not sent again"
    );
}

/// DESIGN invariant 19: a backlog held through an outage (here 10 MiB of log rows, more
/// than the facade takes in one request) reaches Gitea in batches that fit the facade's
/// request limit, every row once and in order, each batch at the index Gitea acknowledged.
#[tokio::test(flavor = "multi_thread")]
async fn a_held_log_larger_than_the_facades_request_limit_reaches_gitea_in_order_in_batches_that_fit()
 {
    let env = Env::new().await;
    let a = env.assignment("standin:success").await;
    let gate = Gate::start(env.facade_addr).await;
    let runner = Runner::start(&env, &a, gate.addr, None).await;
    runner.claim().await;
    assert_eq!(runner.log(0, rows(0, 2, 10), false).await, 2);
    gate.close().await;
    // The official runner sends at most 100 rows per call; five calls of 2 MiB each.
    const ROW: usize = 20 * 1024;
    for call in 0..5 {
        let from = 2 + call * 100;
        let index = i64::try_from(from).expect("index");
        assert_eq!(
            runner.log(index, rows(from, 100, ROW), false).await,
            index + 100
        );
    }
    // The backlog needs several requests.
    const { assert!(500 * ROW > 2 * FACADE_REQUEST_LIMIT) };
    assert_eq!(runner.log(502, vec![], true).await, 502);
    runner.finish(TaskResult::RESULT_SUCCESS).await;
    gate.open();
    assert_eq!(runner.settled().await, Settled::Delivered);
    let task = env.mock.handle.task(a.id().task_id()).expect("task");
    let mut expected = contents(&rows(0, 2, 10));
    expected.extend(contents(&rows(2, 500, ROW)));
    assert_eq!(
        task.log_rows.len(),
        expected.len(),
        "every row arrived once"
    );
    assert!(task.log_rows == expected, "every row in order");
    assert!(task.log_archived);
    assert_eq!(task.status, Status::Success);
}

/// DESIGN invariant 19: when the facade refuses a held batch for good (here one row larger
/// than its request limit, which no split can make fit), only that batch is dropped, a
/// log line names the assignment and the rows lost, and the executor does not count its
/// reports delivered. The rows before and after it, and the result, still reach Gitea,
/// and the runner's later rows follow them without a gap.
#[test]
fn a_batch_the_facade_refuses_for_good_is_dropped_alone_and_said_so_and_the_rest_follows_it() {
    let capture = Capture::default();
    let subscriber = gdr_controller::logging::subscriber(
        tracing_subscriber::EnvFilter::new("info"),
        capture.clone(),
    );
    let (runtime, _guard) = runtime_logging_into(tracing::Dispatch::new(subscriber));
    let id = runtime.block_on(async {
        let env = Env::new().await;
        let a = env.assignment("standin:success").await;
        let gate = Gate::start(env.facade_addr).await;
        let runner = Runner::start(&env, &a, gate.addr, None).await;
        runner.claim().await;
        assert_eq!(runner.log(0, rows(0, 2, 10), false).await, 2);
        gate.close().await;
        let mut held = rows(2, 1, 10);
        held.extend(rows(3, 1, FACADE_REQUEST_LIMIT + 1024));
        held.extend(rows(4, 1, 10));
        assert_eq!(runner.log(2, held, false).await, 5);
        gate.open();
        assert_eq!(
            runner.settled().await,
            Settled::Refused {
                rows: 1,
                result: false
            },
            "one row was lost, and the relay says so"
        );
        // The facade is back: the runner's next rows go straight through, at its own index.
        assert_eq!(runner.log(5, rows(5, 2, 10), true).await, 7);
        assert_eq!(
            runner.finish(TaskResult::RESULT_SUCCESS).await,
            Some(TaskResult::RESULT_SUCCESS)
        );
        let task = env.mock.handle.task(a.id().task_id()).expect("task");
        let mut expected = contents(&rows(0, 3, 10));
        expected.extend(contents(&rows(4, 3, 10)));
        assert_eq!(task.log_rows, expected, "only the refused row is missing");
        assert!(task.log_archived);
        assert_eq!(task.status, Status::Success);
        a.id().as_str().to_owned()
    });
    let logs = capture.text();
    let line = logs
        .lines()
        .find(|l| l.contains("\"event\":\"report_refused\""))
        .unwrap_or_else(|| panic!("no line says what was refused:\n{logs}"));
    assert!(line.contains(&id), "{line}");
    assert!(
        line.contains("\"rows\":1") && line.contains("\"first_row\":3"),
        "{line}"
    );
}

/// A facade that answers every `FetchTask` with no task and records the deadline each
/// poll carried (`connect-timeout-ms`).
struct PollRecorder {
    addr: SocketAddr,
    deadlines: Arc<Mutex<Vec<Option<u64>>>>,
    _workload: RunningWorkloadApi,
}

impl PollRecorder {
    async fn start(env: &Env) -> Self {
        let workload = FakeWorkloadApi::start(env.dir.path(), env.ca.clone(), FACADE_ID)
            .await
            .expect("workload api");
        let source = tls::x509_source(&workload.endpoint())
            .await
            .expect("facade svid");
        let config = Arc::new(tls::facade_server_config(&source, "example.org").expect("tls"));
        let deadlines = Arc::new(Mutex::new(Vec::new()));
        let seen = deadlines.clone();
        let app = axum::Router::new().route(
            "/api/actions/runner.v1.RunnerService/FetchTask",
            axum::routing::post(move |headers: http::HeaderMap| {
                let seen = seen.clone();
                async move {
                    let deadline = headers
                        .get("connect-timeout-ms")
                        .and_then(|v| v.to_str().ok())
                        .and_then(|v| v.parse().ok());
                    seen.lock().unwrap().push(deadline);
                    (
                        [(http::header::CONTENT_TYPE, "application/proto")],
                        FetchTaskResponse::default().encode_to_vec(),
                    )
                }
            }),
        );
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move {
            let _source = source;
            gdr_facade::tls::serve_tls(
                listener,
                config,
                app,
                gdr_controller::shutdown::Shutdown::never(),
            )
            .await
        });
        PollRecorder {
            addr,
            deadlines,
            _workload: workload,
        }
    }

    fn deadlines(&self) -> Vec<Option<u64>> {
        self.deadlines.lock().unwrap().clone()
    }
}

/// DESIGN invariants 9 and 19: a poll the relay holds through a facade outage reaches the
/// facade with only the deadline the runner has left, never the runner's whole one: the
/// facade must not hand a task out to a runner that has stopped listening.
#[tokio::test(flavor = "multi_thread")]
async fn a_poll_held_through_a_facade_outage_carries_only_the_deadline_the_runner_has_left() {
    let env = Env::new().await;
    let a = env.assignment("standin:success").await;
    let facade = PollRecorder::start(&env).await;
    let gate = Gate::start(facade.addr).await;
    gate.close().await;
    const DEADLINE: Duration = Duration::from_secs(5);
    let runner = Runner::start(&env, &a, gate.addr, Some(DEADLINE)).await;
    let started = tokio::time::Instant::now();
    let client = runner.client.clone();
    let poll = tokio::spawn(async move { client.fetch_task(FetchTaskRequest::default()).await });
    gdr_testkit::until_sync(WAIT, "the relay to try the facade twice", || {
        gate.refused() >= 2
    })
    .await;
    let down = started.elapsed();
    gate.open();
    let answer = poll.await.expect("join").expect("the poll is answered");
    assert!(answer.into_owned().task.is_unset());
    let deadlines = facade.deadlines();
    let [Some(forwarded)] = deadlines[..] else {
        panic!("one poll with a deadline reached the facade: {deadlines:?}")
    };
    let whole = u64::try_from(DEADLINE.as_millis()).expect("ms");
    let waited = u64::try_from(down.as_millis()).expect("ms");
    assert!(
        forwarded + waited <= whole,
        "forwarded {forwarded} ms after the runner waited {waited} ms of its {whole} ms"
    );
}

/// DESIGN invariants 9 and 19: a poll whose deadline runs out while the facade is away is
/// answered "no task" by the relay and never sent afterwards; the runner's next poll is.
#[tokio::test(flavor = "multi_thread")]
async fn a_poll_whose_deadline_ran_out_during_a_facade_outage_is_answered_no_task_and_never_sent() {
    let env = Env::new().await;
    let a = env.assignment("standin:success").await;
    let facade = PollRecorder::start(&env).await;
    let gate = Gate::start(facade.addr).await;
    gate.close().await;
    let runner = Runner::start(&env, &a, gate.addr, Some(Duration::from_millis(1500))).await;
    let answer = runner
        .client
        .fetch_task(FetchTaskRequest::default())
        .await
        .expect("the relay answers the poll itself")
        .into_owned();
    assert!(
        answer.task.is_unset(),
        "no task, as Gitea answers an idle poll"
    );
    assert!(gate.refused() >= 1, "the facade was away");
    gate.open();
    runner
        .client
        .fetch_task(FetchTaskRequest::default())
        .await
        .expect("the next poll is answered");
    assert_eq!(
        facade.deadlines().len(),
        1,
        "only the second poll reached the facade"
    );
}
