//! The facade of a real controller process (single-host mode: embedded nats-server, process
//! backend, stand-in runner, mock Gitea) under connection floods, as issue 10 found them:
//! about a thousand idle connections used to exhaust the file descriptors, the accept loop
//! then spun and logged tens of thousands of lines a second, `/readyz` timed out and jobs
//! stopped starting.
//!
//! The flood comes from several loopback addresses (every `127.0.0.0/8` address reaches the
//! facade's `127.0.0.1` listener), so the per-peer limit and the total limit are both
//! exceeded. A second test takes file descriptors away from the controller process only
//! (`prlimit` on its pid), which is the one way its `accept` can fail with `EMFILE`: the
//! facade's own connections are capped at a quarter of the open-file limit.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use gdr_facade::tls::FACADE_CLOSE_REASONS;
use gdr_testkit::controller::{ControllerFixture, listener};
use gdr_testkit::mock_gitea::{JobId, MockConfig, MockGitea, RunningMock, Status};
use gdr_testkit::nats_server::NatsServer;
use gdr_testkit::spiffe::{Svid, TestCa, any_server_client_config, tls_over};
use rustix::process::{Pid, Resource, Rlimit};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

/// Bounds a hang (controller start, a job on the stand-in runner); not a speed target.
const WAIT: Duration = Duration::from_secs(60);
const BIN: &str = env!("CARGO_BIN_EXE_gitea-dynamic-runner");
const STANDIN: &str = env!("CARGO_BIN_EXE_gitea-runner-standin");

/// Limits small enough that a test-sized flood exceeds each of them.
const MAX_CONNECTIONS: u32 = 64;
const MAX_PER_PEER: u32 = 32;
const MAX_PER_IDENTITY: u32 = 2;
/// Short, so flood connections are closed (and reopened) many times during one job.
const HANDSHAKE_TIMEOUT: &str = "2s";
const HEADER_TIMEOUT: &str = "2s";
/// The least the controller accepts (the official runner reports every 5 s).
const IDLE_TIMEOUT: &str = "10s";
/// The facade logs refusals and accept errors at most once per this (its `LOG_INTERVAL`).
const LOG_INTERVAL_SECS: f64 = 10.0;

/// Sources of half-open connections, and of the idle HTTP/2 sessions. The job's executor
/// connects from 127.0.0.1, which no flood connection uses: the total limit is all it
/// shares with them.
const HALF_OPEN_PEERS: [Ipv4Addr; 2] = [Ipv4Addr::new(127, 0, 0, 2), Ipv4Addr::new(127, 0, 0, 3)];
const SESSION_PEER: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 4);
/// Source of one job's SVID opening sessions beyond its per-identity share of sessions not
/// bound to an assignment.
const GREEDY_PEER: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 5);
const GREEDY_SESSIONS: usize = 6;
/// Connections the first burst opens and holds (fewer if the hard open-file limit is low).
const BURST: usize = 3000;
/// Flood clients that reopen their connection whenever the facade closes it.
const CHURNERS: usize = 48;
/// SPIFFE IDs of the idle HTTP/2 sessions, and sessions per ID (above its limit).
const SESSION_IDS: usize = 20;
const SESSIONS_PER_ID: usize = 3;
/// A flood client's pause before it reconnects (keeps the flood from starving the machine
/// the test shares; the facade sees thousands of connections all the same).
const RECONNECT_PAUSE: Duration = Duration::from_millis(500);

/// A controller process with its own mock Gitea and embedded NATS, its facade limits set low.
struct Controller {
    mock: RunningMock,
    fixture: ControllerFixture,
    child: tokio::process::Child,
    facade: SocketAddr,
    health: SocketAddr,
    _listeners: (std::net::TcpListener, std::net::TcpListener),
}

impl Controller {
    async fn start() -> Self {
        // The flood's client sockets are this process's descriptors (raising is harmless to
        // the other tests of this binary; nothing here lowers a limit of this process).
        gdr_controller::limits::raise_open_files().expect("raise the open-file limit");
        let mock = MockGitea::start(MockConfig::default()).await.expect("mock");
        let facade = listener();
        let health = listener();
        let fixture = ControllerFixture::new(&mock, BIN.as_ref(), STANDIN.as_ref())
            .facade_at(facade.local_addr().expect("addr"))
            .set("components", "scheduler,pod-worker")
            .set("pod_capacity", 2u32)
            .set("vm_capacity", 0u32)
            .set("nats_server_binary", NatsServer::binary().as_path())
            .set("heartbeat_interval", "2s")
            .set("runner_facade_max_connections", MAX_CONNECTIONS)
            .set("runner_facade_max_connections_per_peer", MAX_PER_PEER)
            .set(
                "runner_facade_max_connections_per_identity",
                MAX_PER_IDENTITY,
            )
            .set("runner_facade_tls_handshake_timeout", HANDSHAKE_TIMEOUT)
            .set("runner_facade_header_read_timeout", HEADER_TIMEOUT)
            .set("runner_facade_idle_timeout", IDLE_TIMEOUT);
        let child = fixture.spawn(BIN.as_ref(), &facade, &health, &[]);
        let controller = Controller {
            mock,
            facade: facade.local_addr().expect("addr"),
            health: health.local_addr().expect("addr"),
            fixture,
            child,
            _listeners: (facade, health),
        };
        let client = fresh_connections();
        let ready = gdr_testkit::until(WAIT, "the controller to be ready", || async {
            controller.readyz(&client).await == Some(200)
        });
        // The deadline of `until` is the one that fails the test; this one only shows why.
        if tokio::time::timeout(WAIT - Duration::from_secs(1), ready)
            .await
            .is_err()
        {
            panic!(
                "the controller never got ready; log:\n{}",
                controller.fixture.log()
            );
        }
        controller
    }

    fn pid(&self) -> Pid {
        self.child
            .id()
            .and_then(|p| i32::try_from(p).ok())
            .and_then(Pid::from_raw)
            .expect("the controller runs")
    }

    async fn readyz(&self, client: &reqwest::Client) -> Option<u16> {
        readyz(client, self.health).await
    }

    async fn metric(&self, client: &reqwest::Client, prefix: &str) -> Option<u64> {
        metric(client, self.health, prefix).await
    }

    fn queue(&self, name: &str) -> JobId {
        let yaml = format!(
            "on: push\njobs:\n  {name}:\n    runs-on: [self-hosted, pod]\n    steps:\n      - run: standin:success\n"
        );
        self.mock
            .handle
            .queue_workflow("owner/repo", &yaml)
            .expect("queue")[0]
    }

    async fn succeeds(&self, job: JobId) {
        self.mock
            .handle
            .wait_for(|m| m.job(job).is_some_and(|j| j.status.is_done()), WAIT)
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "job {job:?} never finished; controller log:\n{}",
                    self.fixture.log()
                )
            });
        assert_eq!(
            self.mock.handle.job(job).map(|j| j.status),
            Some(Status::Success),
            "controller log:\n{}",
            self.fixture.log()
        );
    }

    /// SVIDs of the controller's own local CA (as its executors get them), for `n` jobs of
    /// repository `repo`.
    fn job_svids(&self, repo: &str, n: usize) -> Vec<Svid> {
        let ca = TestCa::load_or_create(&self.fixture.state_dir().join("ca"), "example.org")
            .expect("the controller's CA");
        (0..n)
            .map(|i| {
                ca.issue(
                    &format!("spiffe://example.org/ci/flood/{repo}/job-{i}"),
                    Duration::from_secs(600),
                )
                .expect("svid")
            })
            .collect()
    }

    /// The controller's log from byte `from` on.
    fn log_since(&self, from: usize) -> String {
        self.fixture
            .log()
            .get(from..)
            .unwrap_or_default()
            .to_owned()
    }
}

/// `/readyz`'s status (`None`: no answer).
async fn readyz(client: &reqwest::Client, health: SocketAddr) -> Option<u16> {
    let answer = client
        .get(format!("http://{health}/readyz"))
        .send()
        .await
        .ok()?;
    Some(answer.status().as_u16())
}

/// A counter or gauge of `/metrics` whose line starts with `prefix` (`None` while
/// `/metrics` does not answer).
async fn metric(client: &reqwest::Client, health: SocketAddr, prefix: &str) -> Option<u64> {
    let text = client
        .get(format!("http://{health}/metrics"))
        .send()
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    Some(
        text.lines()
            .find_map(|l| l.strip_prefix(prefix))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0),
    )
}

/// A client that opens a new connection for every request, as a kubelet's probe does.
fn fresh_connections() -> reqwest::Client {
    reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .timeout(Duration::from_secs(10))
        .build()
        .expect("client")
}

async fn connect_from(source: Ipv4Addr, to: SocketAddr) -> std::io::Result<TcpStream> {
    let socket = tokio::net::TcpSocket::new_v4()?;
    socket.bind(SocketAddr::new(source.into(), 0))?;
    tokio::time::timeout(Duration::from_secs(10), socket.connect(to))
        .await
        .map_err(std::io::Error::other)?
}

/// The first half of a real TLS ClientHello: a handshake that never completes.
fn partial_client_hello() -> Vec<u8> {
    let config = any_server_client_config(None).expect("tls");
    let mut client = rustls::ClientConnection::new(
        Arc::new(config),
        rustls::pki_types::ServerName::IpAddress(std::net::IpAddr::V4(Ipv4Addr::LOCALHOST).into()),
    )
    .expect("client hello");
    let mut hello = Vec::new();
    client.write_tls(&mut hello).expect("client hello");
    hello.truncate(hello.len() / 2);
    hello
}

/// Reads until the facade closes the connection (or `WAIT` passes).
async fn until_closed(stream: &mut (impl tokio::io::AsyncRead + Unpin)) {
    let mut buf = [0u8; 512];
    let read = async {
        while let Ok(n) = stream.read(&mut buf).await {
            if n == 0 {
                break;
            }
        }
    };
    let _ = tokio::time::timeout(WAIT, read).await;
}

/// `count` connections from the half-open peers, each either silent or stopped halfway
/// through its ClientHello, all held open by this side.
async fn burst(to: SocketAddr, count: usize, hello: &[u8]) -> Vec<TcpStream> {
    futures::stream::iter(0..count)
        .map(|i| async move {
            let mut stream = connect_from(HALF_OPEN_PEERS[i % 2], to).await.ok()?;
            if i % 4 >= 2 {
                stream.write_all(hello).await.ok()?;
            }
            Some(stream)
        })
        .buffer_unordered(64)
        .filter_map(std::future::ready)
        .collect()
        .await
}

/// A flood client: a silent or half-ClientHello connection, reopened whenever the facade
/// closes it.
async fn churn(to: SocketAddr, source: Ipv4Addr, hello: Option<Vec<u8>>, opened: Arc<AtomicU64>) {
    loop {
        if let Ok(mut stream) = connect_from(source, to).await {
            opened.fetch_add(1, Ordering::Relaxed);
            if let Some(hello) = &hello {
                let _ = stream.write_all(hello).await;
            }
            until_closed(&mut stream).await;
        }
        tokio::time::sleep(RECONNECT_PAUSE).await;
    }
}

type Body = http_body_util::Empty<bytes::Bytes>;

/// An HTTP/2 session from `source` presenting `svid`: its request sender and the task
/// driving it (ends when the facade closes the connection).
async fn h2_session(
    source: Ipv4Addr,
    to: SocketAddr,
    svid: &Svid,
) -> Option<(
    hyper::client::conn::http2::SendRequest<Body>,
    tokio::task::JoinHandle<hyper::Result<()>>,
)> {
    let tcp = connect_from(source, to).await.ok()?;
    let tls = tls_over(tcp, svid, &[b"h2"]).await.ok()?;
    let (sender, session) = hyper::client::conn::http2::handshake::<_, _, Body>(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tls),
    )
    .await
    .ok()?;
    Some((sender, tokio::spawn(session)))
}

/// Whether the facade answers a request on `sender` (any status: it served the session).
async fn answered(sender: &mut hyper::client::conn::http2::SendRequest<Body>) -> bool {
    let request = http::Request::get("https://facade/")
        .body(Body::new())
        .expect("request");
    tokio::time::timeout(WAIT, sender.send_request(request))
        .await
        .is_ok_and(|r| r.is_ok())
}

/// A flood client holding a valid SVID: an HTTP/2 session that idles (after one request if
/// `request`), reopened whenever the facade closes it.
async fn idle_session(to: SocketAddr, svid: Svid, request: bool, opened: Arc<AtomicU64>) {
    loop {
        opened.fetch_add(1, Ordering::Relaxed);
        if let Some((mut sender, session)) = h2_session(SESSION_PEER, to, &svid).await {
            if request {
                answered(&mut sender).await;
            }
            // Until the facade ends it.
            let _ = session.await;
            drop(sender);
        }
        tokio::time::sleep(RECONNECT_PAUSE).await;
    }
}

/// What the probes saw while a flood ran.
#[derive(Debug, Default)]
struct Probes {
    /// `/readyz` answers (`None`: no answer).
    readyz: Vec<Option<u16>>,
    /// The most connections `/metrics` reported the facade holding.
    max_open: u64,
}

/// Probes `/readyz` and the facade's open connections with `client` until `stop` fires.
fn probe(
    controller: &Controller,
    client: reqwest::Client,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<Probes>,
) {
    let (stop, mut stopped) = tokio::sync::oneshot::channel();
    let health = controller.health;
    let handle = tokio::spawn(async move {
        let mut probes = Probes::default();
        loop {
            probes.readyz.push(readyz(&client, health).await);
            let open = metric(&client, health, "gitea_dynamic_runner_facade_connections ").await;
            probes.max_open = probes.max_open.max(open.unwrap_or(0));
            tokio::select! {
                _ = &mut stopped => return probes,
                () = tokio::time::sleep(Duration::from_millis(200)) => {}
            }
        }
    });
    (stop, handle)
}

fn closed(reason: &str) -> String {
    format!("gitea_dynamic_runner_facade_connections_closed_total{{reason=\"{reason}\"}} ")
}

/// Log lines at info or above that name one connection of `peers` (address and port).
fn per_connection_lines<'a>(log: &'a str, peers: &[Ipv4Addr]) -> Vec<&'a str> {
    log.lines()
        .filter(|l| {
            let level = serde_json::from_str::<serde_json::Value>(l)
                .ok()
                .and_then(|v| v["level"].as_str().map(str::to_owned))
                .unwrap_or_default();
            level != "DEBUG" && level != "TRACE"
        })
        .filter(|l| peers.iter().any(|p| l.contains(&format!("{p}:"))))
        .collect()
}

/// DESIGN invariant 21: the facade bounds connections, handshakes and idle time. Thousands
/// of idle and half-open connections (silent, or stopped halfway through a ClientHello) from
/// two addresses, flood clients reopening them as fast as the facade closes them, and idle
/// HTTP/2 sessions of twenty SPIFFE IDs of the trust domain (each above its per-identity
/// limit, together above the per-peer limit) never hold more than the connection limit, and
/// one job's SVID gets only its share of sessions served while no assignment's credentials
/// bind them (its requests carry none); meanwhile a job queued in Gitea
/// starts and finishes with its result in Gitea, `/readyz` answers 200 to every probe on a
/// fresh connection, and the controller's log grows by a bounded amount with no line per
/// connection.
#[tokio::test(flavor = "multi_thread")]
async fn a_connection_flood_leaves_jobs_running_readyz_answering_and_the_log_bounded() {
    let controller = Controller::start().await;
    let hard = rustix::process::getrlimit(Resource::Nofile)
        .maximum
        .unwrap_or(u64::MAX);
    // Half the hard limit at most: the test's other sockets and files need the rest.
    let burst_size = BURST.min(usize::try_from(hard / 2).unwrap_or(BURST));
    let log_start = controller.fixture.log().len();
    let (stop_probes, probes) = probe(&controller, fresh_connections());
    let hello = partial_client_hello();
    let opened = Arc::new(AtomicU64::new(0));

    // One job's SVID opens sessions, one after the other, each making a request: only its
    // share is served, the others are closed unanswered. They stay open (idle) meanwhile.
    let greedy = controller.job_svids("greedy", 1).remove(0);
    // A served session may end by the idle timeout before the last one is tried on a
    // loaded machine, which frees its place: count the served sessions open together.
    let mut greedy_sessions = Vec::new();
    let mut greedy_served = 0;
    let mut greedy_served_at_once = 0;
    let mut served_sessions: Vec<usize> = Vec::new();
    for i in 0..GREEDY_SESSIONS {
        let (mut sender, session) = h2_session(GREEDY_PEER, controller.facade, &greedy)
            .await
            .expect("a TLS session");
        if answered(&mut sender).await {
            greedy_served += 1;
            served_sessions.push(i);
        }
        greedy_sessions.push((sender, session));
        let open = served_sessions
            .iter()
            .filter(|&&k| !greedy_sessions[k].1.is_finished())
            .count();
        greedy_served_at_once = greedy_served_at_once.max(open);
    }

    let mut flood = tokio::task::JoinSet::new();
    for i in 0..CHURNERS {
        let source = HALF_OPEN_PEERS[i % 2];
        let hello = (i % 4 >= 2).then(|| hello.clone());
        flood.spawn(churn(controller.facade, source, hello, opened.clone()));
    }
    for svid in controller.job_svids("idle", SESSION_IDS) {
        for i in 0..SESSIONS_PER_ID {
            let request = i % 2 == 0;
            flood.spawn(idle_session(
                controller.facade,
                svid.clone(),
                request,
                opened.clone(),
            ));
        }
    }
    let held = burst(controller.facade, burst_size, &hello).await;
    assert!(
        held.len() * 10 >= burst_size * 9,
        "the burst connected only {} of {burst_size}",
        held.len()
    );

    // A job that arrives in the middle of the flood.
    let job = controller.queue("legit");
    controller.succeeds(job).await;
    // The flood goes on until each limit and the idle bound have closed some of its
    // connections: it did exceed what the facade holds. (Not the handshake timeout: under a
    // sustained flood the oldest handshake is always evicted for a newer connection first.)
    let client = fresh_connections();
    let seen = std::sync::Mutex::new(Vec::new());
    let every_reason = gdr_testkit::until(WAIT, "every limit to close a flood connection", || {
        let (client, controller, seen) = (&client, &controller, &seen);
        async move {
            let mut reasons = Vec::new();
            for reason in FACADE_CLOSE_REASONS {
                let n = controller
                    .metric(client, &closed(reason))
                    .await
                    .unwrap_or(0);
                reasons.push((reason, n));
            }
            let all = reasons
                .iter()
                .all(|(reason, n)| *reason == "handshake" || *n > 0);
            *seen.lock().unwrap() = reasons;
            all
        }
    });
    // The deadline of `until` fails the test; this one only shows what was seen.
    if tokio::time::timeout(WAIT - Duration::from_secs(1), every_reason)
        .await
        .is_err()
    {
        panic!("connections closed by reason: {:?}", seen.lock().unwrap());
    }
    let reasons = seen.into_inner().unwrap();

    stop_probes.send(()).expect("the probes run");
    let probes = probes.await.expect("probes");
    flood.shutdown().await;
    drop(greedy_sessions);
    let total = held.len() as u64 + opened.load(Ordering::Relaxed);
    drop(held);
    let log = controller.log_since(log_start);
    eprintln!(
        "flood: {total} connections ({} held by the burst); closed by reason {reasons:?}; \
         at most {} open; {greedy_served} of {GREEDY_SESSIONS} sessions of one SPIFFE ID \
         served, {greedy_served_at_once} at once; {} /readyz probes; log grew by {} lines, {} bytes",
        burst_size,
        probes.max_open,
        probes.readyz.len(),
        log.lines().count(),
        log.len()
    );

    assert_eq!(
        greedy_served_at_once, MAX_PER_IDENTITY as usize,
        "sessions of one SPIFFE ID served at once"
    );
    assert!(
        probes.readyz.len() >= 3 && probes.readyz.iter().all(|s| *s == Some(200)),
        "/readyz during the flood: {:?}",
        probes.readyz
    );
    assert!(
        probes.max_open <= u64::from(MAX_CONNECTIONS),
        "the facade held {} connections (limit {MAX_CONNECTIONS})",
        probes.max_open
    );
    let mut peers = HALF_OPEN_PEERS.to_vec();
    peers.extend([SESSION_PEER, GREEDY_PEER]);
    let per_connection = per_connection_lines(&log, &peers);
    assert!(
        per_connection.is_empty(),
        "log lines per connection: {per_connection:#?}"
    );
    // The job's own lines and a throttled line per interval, against thousands of
    // connections: a line per connection (or per refusal) would be thousands.
    assert!(
        log.lines().count() < 100 && log.len() < 32 * 1024,
        "the log grew by {} lines ({} bytes) during the flood:\n{log}",
        log.lines().count(),
        log.len()
    );
}

/// CPU time (user + system) the process has used so far, from `/proc/<pid>/stat`.
fn cpu_time(pid: Pid) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{}/stat", pid.as_raw_nonzero()))
        .expect("the controller's stat");
    // The fields after the command name, which is in parentheses and may hold spaces.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .expect("stat")
        .1
        .split_whitespace()
        .collect();
    let ticks: u64 =
        fields[11].parse::<u64>().expect("utime") + fields[12].parse::<u64>().expect("stime");
    // USER_HZ, which Linux fixes at 100 for everything it reports in /proc.
    Duration::from_millis(ticks * 10)
}

/// DESIGN invariant 21: when the controller has no file descriptor left, `accept` fails at
/// once, forever; the facade backs off instead of spinning (its failed accepts stay far
/// below one per millisecond, the process mostly idles) and logs the failure at most once
/// per interval with a count. `/readyz` keeps answering on its open connection, and once
/// descriptors are back a job runs.
#[tokio::test(flavor = "multi_thread")]
async fn without_file_descriptors_the_facade_backs_off_logs_once_per_interval_and_recovers() {
    let controller = Controller::start().await;
    let pid = controller.pid();
    // Kept alive across the shortage: a new connection cannot be accepted while it lasts.
    let kept = reqwest::Client::builder()
        .pool_idle_timeout(None)
        .timeout(Duration::from_secs(10))
        .build()
        .expect("client");
    assert_eq!(controller.readyz(&kept).await, Some(200));
    let errors = "gitea_dynamic_runner_facade_accept_errors_total ";
    let before = controller.metric(&kept, errors).await.expect("/metrics");

    // The controller's descriptors now plus a few: the facade gets them, then EMFILE.
    let open = std::fs::read_dir(format!("/proc/{}/fd", pid.as_raw_nonzero()))
        .expect("the controller's descriptors")
        .count() as u64;
    let hard = rustix::process::getrlimit(Resource::Nofile).maximum;
    let log_start = controller.fixture.log().len();
    let start = Instant::now();
    let cpu_start = cpu_time(pid);
    let original = rustix::process::prlimit(
        Some(pid),
        Resource::Nofile,
        Rlimit {
            current: Some(open + 8),
            maximum: hard,
        },
    )
    .expect("lower the controller's open-file limit");
    // Below the listen backlog (128): each is queued by the kernel, none waits for a SYN
    // retry, and every one the facade accepts costs it a descriptor.
    let mut pending = Vec::new();
    for _ in 0..100 {
        pending.push(
            connect_from(HALF_OPEN_PEERS[0], controller.facade)
                .await
                .expect("connect"),
        );
    }
    let (stop_probes, probes) = probe(&controller, kept.clone());
    let failed = gdr_testkit::eventually(WAIT, "the facade to fail accepting", || async {
        let n = controller.metric(&kept, errors).await?;
        (n >= before + 20).then_some(n - before)
    })
    .await;
    let elapsed = start.elapsed();
    let cpu = cpu_time(pid) - cpu_start;
    stop_probes.send(()).expect("the probes run");
    let probes = probes.await.expect("probes");
    rustix::process::prlimit(Some(pid), Resource::Nofile, original)
        .expect("restore the controller's open-file limit");
    drop(pending);
    let log = controller.log_since(log_start);
    let warnings = log
        .lines()
        .filter(|l| l.contains("the facade failed to accept connections"))
        .count();
    eprintln!(
        "no descriptors for {elapsed:?}: {failed} failed accepts, {cpu:?} CPU, {warnings} \
         accept-error lines, log grew by {} lines; {} /readyz probes",
        log.lines().count(),
        probes.readyz.len()
    );

    let per_second = failed as f64 / elapsed.as_secs_f64();
    assert!(
        per_second < 100.0,
        "{failed} failed accepts in {elapsed:?}: the accept loop does not back off"
    );
    assert!(
        cpu.as_secs_f64() < elapsed.as_secs_f64() / 2.0,
        "the controller used {cpu:?} of CPU in {elapsed:?}: it spins"
    );
    let allowed = 2 + (elapsed.as_secs_f64() / LOG_INTERVAL_SECS) as usize;
    assert!(
        warnings >= 1 && warnings <= allowed,
        "{warnings} accept-error lines in {elapsed:?} (at most {allowed}):\n{log}"
    );
    assert!(
        log.lines().count() < 50,
        "the log grew by {} lines:\n{log}",
        log.lines().count()
    );
    assert!(
        !probes.readyz.is_empty() && probes.readyz.iter().all(|s| *s == Some(200)),
        "/readyz without descriptors: {:?}",
        probes.readyz
    );

    // Descriptors are back: new connections are accepted and a job runs.
    controller.succeeds(controller.queue("after")).await;
    assert_eq!(controller.readyz(&fresh_connections()).await, Some(200));
}
