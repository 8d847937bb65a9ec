//! The facade's cost as a runner sees it: `UpdateLog` round trips and a 50 MiB checkout
//! through the executor's loopback proxy, SPIFFE mTLS and the facade (the real facade
//! application and proxy, in this process), against the same calls made directly to the
//! same mock Gitea over loopback.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use connectrpc::client::{ClientConfig, HttpClient};
use gdr_controller::dispatch::Dispatch;
use gdr_core::assignment::{Assignment, DerivationPolicy};
use gdr_core::backend::{Backend, BackendLabels};
use gdr_core::capability::CapabilityKey;
use gdr_core::executor::{ExecutorBackend, ExecutorSpec};
use gdr_core::identity::{IdentityScheme, TrustDomain};
use gdr_core::metadata::MetadataCodec;
use gdr_executor::proxy::{RunnerCredentials, serve_loopback_proxy};
use gdr_executor::relay::Relay;
use gdr_facade::Facade;
use gdr_facade::proxy::ReverseProxy;
use gdr_facade::tls::serve_tls;
use gdr_gitea::{ClientOptions, Credentials, GiteaClient};
use gdr_identity::svid_stream::{executor_client_config, svid_stream};
use gdr_identity::tls::{facade_server_config, x509_source};
use gdr_proto::runner::v1 as pb;
use gdr_testkit::memory_backend::MemoryBackend;
use gdr_testkit::mock_gitea::{MockConfig, MockGitea};
use gdr_testkit::spiffe::{FakeWorkloadApi, TestCa};
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::net::TcpListener;

use crate::table::{Table, millis, quantile};

const TRUST_DOMAIN: &str = "bench.test";
const FACADE_ID: &str = "spiffe://bench.test/facade";
/// Round trips per side (after a warm-up), interleaved so both see the same machine.
const ROUND_TRIPS: usize = 400;
/// The checkout size of the issue's goal.
pub const CHECKOUT: u64 = 50 * 1024 * 1024;
const CHECKOUT_RUNS: usize = 3;

type Runner = pb::RunnerServiceClient<HttpClient>;

fn runner_client(base: &str, uuid: &str, token: &str) -> Runner {
    let config = ClientConfig::new(format!("{base}/api/actions").parse().expect("uri"))
        .with_default_timeout(Duration::from_secs(30))
        .with_default_header("x-runner-uuid", uuid)
        .with_default_header("x-runner-token", token);
    Runner::new(HttpClient::plaintext(), config)
}

/// One `UpdateLog` of one row at the acknowledged index; returns the new index.
async fn update_log(client: &Runner, task_id: i64, index: i64) -> i64 {
    client
        .update_log(pb::UpdateLogRequest {
            task_id,
            index,
            rows: vec![pb::LogRow {
                content: format!("row {index}"),
                ..Default::default()
            }],
            ..Default::default()
        })
        .await
        .expect("UpdateLog")
        .into_owned()
        .ack_index
}

/// CPU time this process has used so far: every live thread's time on a CPU
/// (`/proc/self/task/*/schedstat`, nanoseconds), so the checkout's cost can be told
/// apart from the machine's other load.
fn process_cpu() -> Duration {
    let mut total = 0u64;
    for task in std::fs::read_dir("/proc/self/task")
        .into_iter()
        .flatten()
        .flatten()
    {
        if let Ok(stat) = std::fs::read_to_string(task.path().join("schedstat")) {
            total += stat
                .split_whitespace()
                .next()
                .and_then(|ns| ns.parse::<u64>().ok())
                .unwrap_or(0);
        }
    }
    Duration::from_nanos(total)
}

/// Streams a GET body and counts it; returns bytes and elapsed time.
async fn download(url: &str) -> (u64, Duration) {
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let started = Instant::now();
    let resp = client.get(url.parse().expect("url")).await.expect("GET");
    assert!(resp.status().is_success(), "GET {url}: {}", resp.status());
    let mut body = resp.into_body();
    let mut total = 0u64;
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.expect("body").into_data() {
            total += data.len() as u64;
        }
    }
    (total, started.elapsed())
}

pub async fn run(table: &mut Table) {
    let mock = MockGitea::start(MockConfig::default()).await.expect("mock");
    let (uuid, token) = mock
        .handle
        .create_runner("ctl", &["self-hosted", "pod"], false);
    mock.handle
        .queue_workflow(
            "owner/repo",
            "on: push\njobs:\n  build:\n    runs-on: [self-hosted, pod]\n    steps: []\n",
        )
        .expect("queue");
    let gitea = GiteaClient::new(
        ClientOptions::new(mock.url.clone()),
        Some(&Credentials::new(uuid.clone(), token.clone())),
    )
    .expect("client");
    let task = gitea
        .fetch_task(0)
        .await
        .expect("fetch")
        .task
        .into_option()
        .expect("task");
    let policy = DerivationPolicy {
        trust_domain: TrustDomain::new(TRUST_DOMAIN).expect("trust domain"),
        labels: BackendLabels::default(),
        scheme: IdentityScheme::Ref,
    };
    let assignment = Assignment::from_task(task, &policy).expect("assignment");

    // Identities: the facade's and the executor's (the assignment's SPIFFE ID).
    let dir = tempfile::tempdir().expect("dir");
    let ca = TestCa::new(TRUST_DOMAIN).expect("ca");
    let facade_api = FakeWorkloadApi::start(dir.path(), ca.clone(), FACADE_ID)
        .await
        .expect("facade identity");
    let executor_api = FakeWorkloadApi::start(dir.path(), ca, assignment.identity().spiffe_id())
        .await
        .expect("executor identity");
    let facade_source = x509_source(&facade_api.endpoint()).await.expect("svid");
    let executor_source = svid_stream(&executor_api.endpoint(), Duration::from_secs(30))
        .await
        .expect("svid");

    // The facade with the assignment offered, as the worker leaves it.
    let backend = Arc::new(MemoryBackend::new(Backend::Pod));
    let dispatch = Arc::new(Dispatch::new(
        [(backend.clone() as Arc<dyn ExecutorBackend>, 1)],
        CapabilityKey::new(&[7u8; 32]).expect("key"),
    ));
    let capability = dispatch.capability_key().issue(assignment.id());
    let facade_listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let facade_url = format!("https://{}", facade_listener.local_addr().expect("addr"));
    let spec = ExecutorSpec::new(
        &assignment,
        capability.clone(),
        &MetadataCodec::default(),
        &facade_url,
        FACADE_ID,
        "pod",
    );
    backend.create(&spec).await.expect("executor record");
    dispatch.offer(&assignment);
    let app = Arc::new(Facade::new(dispatch, gitea, None, BackendLabels::default()))
        .app(ReverseProxy::new(&mock.url, None).expect("proxy"));
    let server_config = Arc::new(facade_server_config(&facade_source, TRUST_DOMAIN).expect("tls"));
    tokio::spawn(serve_tls(
        facade_listener,
        server_config,
        app,
        gdr_controller::shutdown::Shutdown::never(),
    ));
    let proxy = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let proxy_url = format!("http://{}", proxy.local_addr().expect("addr"));
    let client_config = executor_client_config(&executor_source, FACADE_ID).expect("client tls");
    // The executor's relay as it runs in production (outage tolerance as configured by
    // default); the facade never goes away here, so nothing is held.
    let relay = Relay::new(
        assignment.id().as_str(),
        &facade_url,
        &client_config,
        Duration::from_secs(1800),
    )
    .expect("relay");
    let credentials =
        RunnerCredentials::new(assignment.id().as_str(), capability.expose()).expect("credentials");
    tokio::spawn(serve_loopback_proxy(
        proxy,
        relay,
        credentials,
        gdr_controller::shutdown::Shutdown::never(),
    ));

    let via = runner_client(&proxy_url, assignment.id().as_str(), capability.expose());
    let direct = runner_client(&mock.url, &uuid, &token);
    let claimed = via
        .fetch_task(pb::FetchTaskRequest::default())
        .await
        .expect("FetchTask through the facade")
        .into_owned();
    let task_id = claimed.task.as_option().expect("the offered task").id;

    let mut index = 0;
    for _ in 0..20 {
        index = update_log(&via, task_id, index).await;
        index = update_log(&direct, task_id, index).await;
    }
    let (mut through, mut plain) = (Vec::new(), Vec::new());
    for _ in 0..ROUND_TRIPS {
        let t = Instant::now();
        index = update_log(&via, task_id, index).await;
        through.push(t.elapsed());
        let t = Instant::now();
        index = update_log(&direct, task_id, index).await;
        plain.push(t.elapsed());
    }
    let (p50_via, p50_direct) = (quantile(&through, 0.5), quantile(&plain, 0.5));
    table.row(
        &format!(
            "UpdateLog round trip, p50 of {ROUND_TRIPS} (runner → proxy → mTLS → facade → Gitea)"
        ),
        millis(p50_via, 2),
        format!("{} direct to the same Gitea", millis(p50_direct, 2)),
        format!("+{}", millis(p50_via.saturating_sub(p50_direct), 2)),
        "≤ +1 ms",
    );

    // Checkout: the mock's blob endpoint, through the facade's reverse proxy or directly.
    let blob = |base: &str| format!("{base}/_mock/blob/{CHECKOUT}");
    let _ = download(&format!("{}/_mock/blob/1024", proxy_url)).await;
    let (mut via_rates, mut direct_rates) = (Vec::new(), Vec::new());
    let (mut via_cpu, mut direct_cpu) = (Vec::new(), Vec::new());
    for _ in 0..CHECKOUT_RUNS {
        let cpu = process_cpu();
        let (n, d) = download(&blob(&proxy_url)).await;
        via_cpu.push(process_cpu().saturating_sub(cpu));
        assert_eq!(n, CHECKOUT, "the proxied checkout is incomplete");
        via_rates.push(n as f64 / d.as_secs_f64() / (1024.0 * 1024.0));
        let cpu = process_cpu();
        let (n, d) = download(&blob(&mock.url)).await;
        direct_cpu.push(process_cpu().saturating_sub(cpu));
        assert_eq!(n, CHECKOUT, "the direct checkout is incomplete");
        direct_rates.push(n as f64 / d.as_secs_f64() / (1024.0 * 1024.0));
    }
    let best = |v: &[f64]| v.iter().copied().fold(0.0, f64::max);
    let (via_rate, direct_rate) = (best(&via_rates), best(&direct_rates));
    table.ratio(
        &format!(
            "50 MiB checkout throughput, best of {CHECKOUT_RUNS} (proxy → mTLS → facade → Gitea)"
        ),
        (via_rate, format!("{via_rate:.0} MiB/s")),
        (
            direct_rate,
            format!("{direct_rate:.0} MiB/s direct over loopback"),
        ),
        "≥ 0.9×",
    );
    // Both sides run in this process, the mock Gitea included, so their CPU time is
    // comparable whatever else the machine runs; throughput is not when the machine lends
    // this process less than its two cores.
    let least = |v: &[Duration]| v.iter().min().copied().unwrap_or_default();
    let (via_cpu, direct_cpu) = (least(&via_cpu), least(&direct_cpu));
    table.ratio(
        "  50 MiB checkout: CPU time of this process (both ends, mock Gitea included), least of 3",
        (via_cpu.as_secs_f64(), millis(via_cpu, 0)),
        (
            direct_cpu.as_secs_f64(),
            format!("{} direct", millis(direct_cpu, 0)),
        ),
        "–",
    );
}
