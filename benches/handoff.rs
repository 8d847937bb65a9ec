//! Handoff throughput: assignments per second from the mock Gitea into JetStream
//! through the scheduler, next to the raw JetStream publish rate of the same payload
//! size and concurrency on the same nats-server.
//!
//! `NATS_SERVER_BIN=… cargo bench --bench handoff` (plain `main`, no harness).

// A panic is how a test (or a benchmark harness) fails.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use async_nats::jetstream;
use gdr_controller::gitea::{ClientOptions, Credentials, GiteaClient};
use gdr_controller::queue::{self, StreamSettings};
use gdr_controller::scheduler::{Scheduler, SchedulerSettings};
use gdr_controller::shutdown::shutdown_channel;
use gdr_core::assignment::DerivationPolicy;
use gdr_core::backend::BackendLabels;
use gdr_core::identity::TrustDomain;
use gdr_testkit::mock_gitea::{MockConfig, MockGitea};
use gdr_testkit::nats_server::NatsServer;

const JOBS: usize = 500;
const POLLERS: usize = 8;
const RAW_PUBLISHES: usize = 5000;

#[tokio::main]
async fn main() {
    let nats = NatsServer::start().await.expect("nats-server");
    let js = jetstream::new(async_nats::connect(nats.url()).await.expect("connect"));
    let settings = StreamSettings {
        stream: "CI_RUNNER".into(),
        subject_base: "ci.runner".into(),
        duplicate_window: Duration::from_secs(120),
    };
    let mut stream = queue::ensure_stream(&js, &settings).await.expect("stream");

    let mock = MockGitea::start(MockConfig::default()).await.expect("mock");
    let (uuid, token) = mock.handle.create_runner("bench", &[], false);
    let gitea = GiteaClient::new(
        ClientOptions::new(mock.url.clone()),
        Some(&Credentials::new(uuid, token)),
    )
    .expect("client");
    let mut yaml = String::from("on: push\njobs:\n");
    for i in 0..JOBS {
        yaml.push_str(&format!(
            "  job_{i}:\n    runs-on: [self-hosted, pod]\n    steps: []\n"
        ));
    }
    mock.handle
        .queue_workflow("owner/repo", &yaml)
        .expect("queue");

    let policy = DerivationPolicy {
        trust_domain: TrustDomain::new("example.org").expect("trust domain"),
        labels: BackendLabels::new("vm").expect("labels"),
    };
    let mut sched_settings = SchedulerSettings::new(
        vec!["self-hosted".into(), "pod".into(), "vm".into()],
        vec![],
        POLLERS,
        u64::MAX,
    );
    sched_settings.backlog_refresh = Duration::from_millis(50);
    sched_settings.idle_interval = Duration::from_millis(20);
    let scheduler = Scheduler::new(gitea, js.clone(), settings.clone(), policy, sched_settings);
    let stats = scheduler.stats();
    let (trigger, shutdown) = shutdown_channel();
    let started = Instant::now();
    let run = tokio::spawn(scheduler.run(shutdown));
    loop {
        if queue::unclaimed(&mut stream).await.expect("info") >= JOBS as u64 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(300),
            "handoff did not finish"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let handoff = started.elapsed();
    trigger.trigger();
    let report = run.await.expect("join").expect("run");
    assert_eq!(report.tasks_published, JOBS as u64);
    let payload_size = {
        let info = stream.info().await.expect("info");
        (info.state.bytes / info.state.messages.max(1)) as usize
    };
    println!(
        "scheduler handoff: {JOBS} jobs, {POLLERS} pollers: {:.3} s, {:.0} assignments/s \
         (fetch calls {}, publish retries {})",
        handoff.as_secs_f64(),
        JOBS as f64 / handoff.as_secs_f64(),
        stats.fetch_calls.load(std::sync::atomic::Ordering::Relaxed),
        stats
            .publish_retries
            .load(std::sync::atomic::Ordering::Relaxed),
    );

    // Raw JetStream: same server, same dedup window, same message size, same concurrency.
    let raw = StreamSettings {
        stream: "BENCH_RAW".into(),
        subject_base: "bench.raw".into(),
        duplicate_window: Duration::from_secs(120),
    };
    queue::ensure_stream(&js, &raw).await.expect("raw stream");
    let payload = bytes::Bytes::from(vec![b'x'; payload_size]);
    let started = Instant::now();
    let mut publishers = tokio::task::JoinSet::new();
    for p in 0..POLLERS {
        let js = js.clone();
        let raw = raw.clone();
        let payload = payload.clone();
        publishers.spawn(async move {
            for i in (p..RAW_PUBLISHES).step_by(POLLERS) {
                queue::publish(
                    &js,
                    &raw,
                    gdr_core::backend::Backend::Pod,
                    &format!("raw-{i}"),
                    payload.clone(),
                )
                .await
                .expect("publish");
            }
        });
    }
    while let Some(r) = publishers.join_next().await {
        r.expect("publisher");
    }
    let elapsed = started.elapsed();
    println!(
        "raw JetStream publish: {RAW_PUBLISHES} × {payload_size} B, {POLLERS} concurrent publishers: \
         {:.3} s, {:.0} publishes/s",
        elapsed.as_secs_f64(),
        RAW_PUBLISHES as f64 / elapsed.as_secs_f64()
    );
}
