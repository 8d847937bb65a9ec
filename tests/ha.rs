//! Two controller processes against a fake Kubernetes Lease API (DESIGN invariant 18):
//! exactly one leads and works; killing it (SIGKILL) hands over, and nothing fetched is
//! lost or run twice. A small TCP forwarder plays the Kubernetes Service that routes
//! executors to the ready (leading) replica.

// A panic is how a test (or a benchmark harness) fails.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
use common::{free_port, write};

use std::net::SocketAddr;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use gdr_testkit::fake_kube::FakeKube;
use gdr_testkit::mock_gitea::{JobId, MockConfig, MockGitea, Status};
use gdr_testkit::nats_server::NatsServer;
use tokio::sync::Mutex;

const WAIT: Duration = Duration::from_secs(60);
const BIN: &str = env!("CARGO_BIN_EXE_gitea-dynamic-runner");
const STANDIN: &str = env!("CARGO_BIN_EXE_gitea-runner-standin");

struct Replica {
    child: tokio::process::Child,
    health: SocketAddr,
}

impl Replica {
    async fn ready(&self) -> bool {
        let url = format!("http://{}/readyz", self.health);
        matches!(reqwest::get(url).await, Ok(r) if r.status() == 200)
    }
}

/// Forwards every connection to the facade of whichever replica is ready.
async fn service(
    listener: tokio::net::TcpListener,
    targets: Arc<Mutex<Vec<(SocketAddr, SocketAddr)>>>,
) {
    loop {
        let Ok((mut inbound, _)) = listener.accept().await else {
            return;
        };
        let targets = targets.clone();
        tokio::spawn(async move {
            let candidates = targets.lock().await.clone();
            for (facade, health) in candidates {
                let ready = matches!(reqwest::get(format!("http://{health}/readyz")).await, Ok(r) if r.status() == 200);
                if ready {
                    if let Ok(mut outbound) = tokio::net::TcpStream::connect(facade).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                    return;
                }
            }
        });
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn exactly_one_replica_leads_and_killing_it_hands_over_without_losing_or_repeating_a_job() {
    let nats = NatsServer::start().await.expect("nats");
    let mock = MockGitea::start(MockConfig::default()).await.expect("mock");
    let kube = FakeKube::start().await.expect("fake kube");
    let dir = tempfile::Builder::new()
        .prefix("ha")
        .tempdir()
        .expect("dir");
    let (uuid, token) = mock
        .handle
        .create_runner("ctl", &["self-hosted", "pod"], false);
    let kubeconfig = write(
        dir.path(),
        "kubeconfig",
        &format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {}\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n    namespace: gitea-actions\ncurrent-context: fake\nusers:\n- name: fake\n  user: {{}}\n",
            kube.url
        ),
    );
    let svc = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("svc");
    let svc_addr = svc.local_addr().expect("addr");
    let targets = Arc::new(Mutex::new(Vec::new()));
    tokio::spawn(service(svc, targets.clone()));

    let config = format!(
        "components = \"scheduler,pod-worker\"\n\
         gitea_instance_url = {url:?}\n\
         gitea_runner_uuid_file = {uuid:?}\ngitea_runner_token_file = {token:?}\n\
         runner_facade_capability_key_file = {key:?}\n\
         trust_domain = \"example.org\"\n\
         runner_facade_url = \"https://{svc_addr}\"\n\
         runner_facade_spiffe_id = \"spiffe://example.org/controller\"\n\
         local_identity = true\npod_backend = \"process\"\npod_capacity = 2\nvm_capacity = 0\n\
         state_dir = {state:?}\nnats_url = {nats:?}\n\
         executor_program = {bin:?}\nrunner_binary = {standin:?}\n\
         heartbeat_interval = \"2s\"\nleader_election = true\nlease_duration = \"3s\"\nnats_ack_wait = \"5s\"\n",
        url = mock.url,
        uuid = write(dir.path(), "uuid", &uuid).display().to_string(),
        token = write(dir.path(), "token", &token).display().to_string(),
        key = write(dir.path(), "key", "0123456789abcdef0123456789abcdef")
            .display()
            .to_string(),
        state = dir.path().join("state").display().to_string(),
        nats = nats.url(),
        bin = BIN,
        standin = STANDIN,
    );
    let config_file = write(dir.path(), "controller.toml", &config);
    let mut replicas = Vec::new();
    for name in ["replica-a", "replica-b"] {
        let facade: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().expect("addr");
        let health: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().expect("addr");
        let child = tokio::process::Command::new(BIN)
            .args(["controller", "--config"])
            .arg(&config_file)
            .args(["--set", &format!("runner_facade_listen={facade}")])
            .args(["--set", &format!("health_listen={health}")])
            .args(["--set", &format!("leader_identity={name}")])
            .env("KUBECONFIG", &kubeconfig)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("controller starts");
        targets.lock().await.push((facade, health));
        replicas.push(Replica { child, health });
    }

    // Exactly one becomes ready and stays the only one.
    let deadline = tokio::time::Instant::now() + WAIT;
    let leader = loop {
        let mut ready = Vec::new();
        for (i, r) in replicas.iter().enumerate() {
            if r.ready().await {
                ready.push(i);
            }
        }
        assert!(ready.len() <= 1, "two replicas ready at once");
        if let [one] = ready[..] {
            break one;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no replica became leader"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let standby = 1 - leader;
    let jobs: Vec<JobId> = (0..4)
        .map(|i| {
            let yaml = format!("on: push\njobs:\n  j{i}:\n    runs-on: [self-hosted, pod]\n    steps:\n      - run: standin:sleep 4000\n");
            mock.handle.queue_workflow("owner/repo", &yaml).expect("queue")[0]
        })
        .collect();
    // Wait until the leader has claimed work, then kill it mid-job.
    mock.handle
        .wait_for(
            |m| {
                jobs.iter()
                    .filter(|j| m.job(**j).is_some_and(|s| s.status == Status::Running))
                    .count()
                    >= 2
            },
            WAIT,
        )
        .await
        .expect("the leader fetched jobs");
    assert!(
        !replicas[standby].ready().await,
        "the standby stays not ready"
    );
    let _ = replicas[leader].child.start_kill();
    let _ = replicas[leader].child.wait().await;

    let deadline = tokio::time::Instant::now() + WAIT;
    while !replicas[standby].ready().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the standby never took over"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for job in &jobs {
        mock.handle
            .wait_for(
                |m| m.job(*job).is_some_and(|s| s.status == Status::Success),
                Duration::from_secs(120),
            )
            .await
            .unwrap_or_else(|_| {
                let job = mock.handle.job(*job);
                panic!(
                    "job did not succeed: {:?} {:?}",
                    job.as_ref().map(|j| j.status),
                    job.and_then(|j| j.task).map(|t| t.log_rows)
                )
            });
    }
    for job in &jobs {
        let rows = mock
            .handle
            .job(*job)
            .and_then(|j| j.task)
            .expect("task")
            .log_rows;
        let starts = rows
            .iter()
            .filter(|r| r.contains("stand-in runner: task"))
            .count();
        assert_eq!(starts, 1, "job {job:?} ran {starts} times: {rows:?}");
    }
    let _ = replicas[standby].child.start_kill();
}
