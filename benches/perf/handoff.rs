//! Handoff: the scheduler's own cost per task (FetchTask decode, derive, seal, publish)
//! against raw JetStream publishes of the same size and concurrency on the same server.
//! Gitea is a stub that answers FetchTask from tasks built before the clock starts, so
//! the figure is ours, not a mock's.

#![allow(refining_impl_trait)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use async_nats::jetstream;
use connectrpc::{ConnectError, RequestContext, Response, ServiceRequest, ServiceResult};
use gdr_controller::queue::{self, StreamSettings};
use gdr_controller::scheduler::{Scheduler, SchedulerSettings, SchedulerStats};
use gdr_controller::shutdown::shutdown_channel;
use gdr_core::assignment::{TaskKey, TaskKeyring};
use gdr_core::backend::Backend;
use gdr_gitea::{ClientOptions, Credentials, GiteaClient};
use gdr_proto::runner::v1 as pb;
use gdr_testkit::mock_gitea::{MockConfig, MockGitea};
use gdr_testkit::nats_server::NatsServer;

use crate::table::{Table, mean, millis};

const TASKS: usize = 2000;
/// The default `fetch_pollers_max`.
const POLLERS: usize = 8;

/// A Gitea that costs nothing: `Declare` names a runner, `FetchTask` hands out the next
/// prepared task (then none).
struct Stub {
    tasks: Vec<pb::Task>,
    next: AtomicUsize,
}

impl pb::RunnerService for Stub {
    async fn register(
        &self,
        _ctx: RequestContext,
        _req: ServiceRequest<'_, pb::RegisterRequest>,
    ) -> ServiceResult<pb::RegisterResponse> {
        Err(ConnectError::unimplemented("stub"))
    }

    async fn declare(
        &self,
        _ctx: RequestContext,
        _req: ServiceRequest<'_, pb::DeclareRequest>,
    ) -> ServiceResult<pb::DeclareResponse> {
        Response::ok(pb::DeclareResponse {
            runner: pb::Runner {
                id: 1,
                name: "stub".into(),
                ..Default::default()
            }
            .into(),
            ..Default::default()
        })
    }

    async fn fetch_task(
        &self,
        _ctx: RequestContext,
        _req: ServiceRequest<'_, pb::FetchTaskRequest>,
    ) -> ServiceResult<pb::FetchTaskResponse> {
        let i = self.next.fetch_add(1, Ordering::Relaxed);
        Response::ok(pb::FetchTaskResponse {
            task: self.tasks.get(i).cloned().into(),
            tasks_version: 1,
            ..Default::default()
        })
    }

    async fn update_task(
        &self,
        _ctx: RequestContext,
        _req: ServiceRequest<'_, pb::UpdateTaskRequest>,
    ) -> ServiceResult<pb::UpdateTaskResponse> {
        Err(ConnectError::unimplemented("stub"))
    }

    async fn update_log(
        &self,
        _ctx: RequestContext,
        _req: ServiceRequest<'_, pb::UpdateLogRequest>,
    ) -> ServiceResult<pb::UpdateLogResponse> {
        Err(ConnectError::unimplemented("stub"))
    }
}

/// A task exactly as the mock Gitea hands it out (context, secrets, payload), to copy.
async fn realistic_task() -> pb::Task {
    let mock = MockGitea::start(MockConfig::default()).await.expect("mock");
    let (uuid, token) = mock
        .handle
        .create_runner("tmpl", &["self-hosted", "pod"], false);
    mock.handle
        .set_secret("owner/repo", "DEPLOY_KEY", &"k".repeat(64));
    mock.handle
        .queue_workflow(
            "owner/repo",
            "on: push\njobs:\n  build:\n    runs-on: [self-hosted, pod]\n    steps:\n      - run: make test\n",
        )
        .expect("queue");
    let client = GiteaClient::new(
        ClientOptions::new(mock.url.clone()),
        Some(&Credentials::new(uuid, token)),
    )
    .expect("client");
    client
        .fetch_task(0)
        .await
        .expect("fetch")
        .task
        .into_option()
        .expect("a task")
}

fn streams() -> (StreamSettings, StreamSettings) {
    let stream = |name: &str, base: &str| StreamSettings {
        stream: name.into(),
        subject_base: base.into(),
        duplicate_window: Duration::from_secs(120),
    };
    (
        stream("CI_RUNNER", "ci.runner"),
        stream("BENCH_RAW", "bench.raw"),
    )
}

pub async fn run(table: &mut Table) {
    let template = realistic_task().await;
    let tasks: Vec<pb::Task> = (1..=TASKS)
        .map(|i| pb::Task {
            id: i64::try_from(i).expect("id"),
            ..template.clone()
        })
        .collect();
    let stub = Arc::new(Stub {
        tasks,
        next: AtomicUsize::new(0),
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let stub_url = format!("http://{}", listener.local_addr().expect("addr"));
    let app = axum::Router::new().nest_service(
        "/api/actions",
        connectrpc::Router::new()
            .add_service(stub)
            .into_axum_service(),
    );
    tokio::spawn(async move { axum::serve(listener, app).await });

    let nats = NatsServer::start().await.expect("nats-server");
    let js = jetstream::new(async_nats::connect(nats.url()).await.expect("connect"));
    let (ours, raw) = streams();
    let mut stream = queue::ensure_stream(&js, &ours).await.expect("stream");
    queue::ensure_stream(&js, &raw).await.expect("raw stream");

    let gitea = GiteaClient::new(
        ClientOptions::new(stub_url),
        Some(&Credentials::new("uuid", "token")),
    )
    .expect("client");
    let keyring = TaskKeyring::new(
        TaskKey::from_file_contents("ab".repeat(32).as_bytes()).expect("key"),
        vec![],
    );
    let policy = gdr_testkit::tasks::policy();
    let settings = SchedulerSettings::new(
        vec!["self-hosted".into(), "pod".into()],
        vec![],
        POLLERS,
        u64::MAX,
    );
    let scheduler = Scheduler::new(gitea, js.clone(), ours.clone(), policy, settings)
        .with_keyring(Arc::new(keyring));
    let stats = scheduler.stats();
    let (trigger, shutdown) = shutdown_channel();
    let started = Instant::now();
    let run = tokio::spawn(scheduler.run(shutdown));
    while SchedulerStats::get(&stats.tasks_published) < TASKS as u64 {
        assert!(
            started.elapsed() < Duration::from_secs(300),
            "the handoff did not finish"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let scheduled = started.elapsed();
    trigger.trigger();
    run.await.expect("join").expect("scheduler");
    let window = Duration::from_micros(
        SchedulerStats::get(&stats.handoff_window_micros_total) / TASKS as u64,
    );
    let size = stream
        .get_raw_message(1)
        .await
        .expect("first message")
        .payload
        .len();
    let _ = stream.info().await;

    // Raw JetStream: same server, same message-ID deduplication, same size, same
    // concurrency.
    let payload = bytes::Bytes::from(vec![b'x'; size]);
    let started = Instant::now();
    let mut publishers = tokio::task::JoinSet::new();
    for p in 0..POLLERS {
        let (js, raw, payload) = (js.clone(), raw.clone(), payload.clone());
        publishers.spawn(async move {
            let mut latencies = Vec::new();
            for i in (p..TASKS).step_by(POLLERS) {
                let one = Instant::now();
                queue::publish(
                    &js,
                    &raw,
                    Backend::Pod,
                    &format!("raw-{i}"),
                    payload.clone(),
                )
                .await
                .expect("publish");
                latencies.push(one.elapsed());
            }
            latencies
        });
    }
    let mut latencies = Vec::new();
    while let Some(r) = publishers.join_next().await {
        latencies.extend(r.expect("publisher"));
    }
    let raw_elapsed = started.elapsed();

    let ours_rate = TASKS as f64 / scheduled.as_secs_f64();
    let raw_rate = TASKS as f64 / raw_elapsed.as_secs_f64();
    table.ratio(
        &format!(
            "handoff: {TASKS} tasks of {size} B, {POLLERS} pollers, zero-cost Gitea stub (throughput)"
        ),
        (ours_rate, format!("{ours_rate:.0} tasks/s")),
        (
            raw_rate,
            format!("{raw_rate:.0} raw JetStream publishes/s, {POLLERS} publishers"),
        ),
        "≥ 0.8×",
    );
    let raw_latency = mean(&latencies);
    table.row(
        "handoff: derive + seal + publish per task (mean) vs one raw publish",
        millis(window, 2),
        millis(raw_latency, 2),
        format!("+{}", millis(window.saturating_sub(raw_latency), 2)),
        "–",
    );
}
