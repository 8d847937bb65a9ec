use std::sync::atomic::AtomicU64;

use gdr_testkit::log_capture::Capture;

use super::*;

/// The controller's log format (`gdr_controller::logging::subscriber`): JSON lines, the
/// event's fields flattened.
fn json_subscriber<W>(
    filter: tracing_subscriber::EnvFilter,
    writer: W,
) -> impl tracing::Subscriber + Send + Sync
where
    W: for<'a> tracing_subscriber::fmt::MakeWriter<'a> + Send + Sync + 'static,
{
    use tracing_subscriber::layer::SubscriberExt;
    tracing_subscriber::registry().with(filter).with(
        tracing_subscriber::fmt::layer()
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_writer(writer),
    )
}

fn limits(total: usize, per_peer: usize, per_identity: usize) -> FacadeLimits {
    FacadeLimits {
        max_connections: total,
        max_connections_per_peer: per_peer,
        max_connections_per_identity: per_identity,
        ..FacadeLimits::default()
    }
}

fn tracker(limits: FacadeLimits) -> Arc<Tracker> {
    Arc::new(Tracker {
        limits,
        capabilities: None,
        may_bind: None,
        state: Mutex::new(TrackerState::default()),
        stats: Arc::new(FacadeStats::default()),
        refusals: Mutex::new(Throttle::new(LOG_INTERVAL)),
    })
}

const HELD: Option<Standing> = Some(Standing::Held);
const PROBATION: Option<Standing> = Some(Standing::Probation);

const A: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 1));
const B: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 2));

/// DESIGN invariant 21: at the connection limit the oldest connection still in its TLS
/// handshake makes room for a new one, so idle floods cannot keep a real client's fresh
/// connection out; established connections are never evicted, and with nothing left to
/// evict the new connection is refused.
#[test]
fn at_the_limit_the_oldest_handshake_makes_room_and_established_connections_stay() {
    let t = tracker(limits(3, 3, 8));
    let first = t.admit(A).unwrap();
    let second = t.admit(B).unwrap();
    let third = t.admit(A).unwrap();
    assert_eq!(
        t.established(&second, "spiffe://example.org/ci/o/r/job"),
        HELD
    );
    let fourth = t
        .admit(B)
        .expect("room made by evicting the oldest handshake");
    assert_eq!(t.stats.closed(CloseReason::Evicted), 1);
    assert_eq!(
        t.established(&first, "spiffe://example.org/ci/o/r/other"),
        None,
        "an evicted connection cannot become established"
    );
    assert_eq!(t.established(&third, "spiffe://example.org/ci/o/r/x"), HELD);
    assert_eq!(
        t.established(&fourth, "spiffe://example.org/ci/o/r/y"),
        HELD
    );
    assert_eq!(t.admit(A).err(), Some(Refusal::Total));
    assert_eq!(t.stats.open.get(), 3);
    drop(second);
    assert!(
        t.admit(A).is_ok(),
        "a closed connection gives its place back"
    );
    drop(first);
    assert_eq!(
        t.stats.open.get(),
        2,
        "dropping an evicted slot counts nothing twice"
    );
}

#[test]
fn one_peer_address_and_one_identity_hold_only_their_own_share() {
    let t = tracker(limits(100, 2, 1));
    let a1 = t.admit(A).unwrap();
    let a2 = t.admit(A).unwrap();
    assert_eq!(t.established(&a1, "spiffe://example.org/ci/o/r/job"), HELD);
    assert_eq!(t.established(&a2, "spiffe://example.org/ci/o/r/job2"), HELD);
    assert_eq!(t.admit(A).err(), Some(Refusal::Peer));
    let b1 = t.admit(B).expect("another address is not held back");
    assert_eq!(
        t.established(&b1, "spiffe://example.org/ci/o/r/job"),
        PROBATION,
        "a second unbound connection of one SPIFFE ID over its share is not held"
    );
    drop(b1);
    drop(a1);
    let b2 = t.admit(B).unwrap();
    assert_eq!(t.established(&b2, "spiffe://example.org/ci/o/r/job"), HELD);

    // At the per-peer limit, the peer's own oldest handshake makes room.
    let t = tracker(limits(100, 2, 8));
    let h1 = t.admit(A).unwrap();
    let b = t.admit(B).unwrap();
    let h2 = t.admit(A).unwrap();
    let h3 = t
        .admit(A)
        .expect("the oldest handshake of this peer makes room");
    assert_eq!(
        t.established(&h1, "spiffe://example.org/ci/o/r/one"),
        None,
        "evicted"
    );
    assert_eq!(
        t.established(&b, "spiffe://example.org/ci/o/r/b"),
        HELD,
        "another peer is untouched"
    );
    assert_eq!(t.established(&h2, "spiffe://example.org/ci/o/r/two"), HELD);
    assert_eq!(
        t.established(&h3, "spiffe://example.org/ci/o/r/three"),
        HELD
    );
}

/// DESIGN invariant 21: every run of one job shares its SPIFFE ID, so connections are
/// counted per assignment once a request binds them. Binding frees the identity's share of
/// unbound connections (and makes a connection on probation unevictable); one assignment
/// holds at most its own limit, and a connection stays with the assignment it was bound to.
#[test]
fn bound_connections_count_per_assignment_and_leave_their_identitys_share() {
    const JOB: &str = "spiffe://example.org/ci/o/r/job";
    let t = tracker(FacadeLimits {
        max_connections: 4,
        max_connections_per_peer: 100,
        max_connections_per_identity: 1,
        max_connections_per_assignment: 2,
        ..FacadeLimits::default()
    });
    // Three runs of one job: each connection binds to its own assignment.
    let mut bound = Vec::new();
    for run in ["gitea-task-1", "gitea-task-2", "gitea-task-3"] {
        let slot = t.admit(A).unwrap();
        assert_eq!(
            t.established(&slot, JOB),
            HELD,
            "{run}: the identity's share is free again once the previous run bound its connection"
        );
        assert_eq!(t.bind(&slot, run), Binding::Bound);
        assert_eq!(
            t.bind(&slot, run),
            Binding::Bound,
            "binding again is a no-op"
        );
        assert_eq!(t.bind(&slot, "gitea-task-9"), Binding::Other);
        bound.push(slot);
    }
    // At the total limit nothing bound is evicted: a new connection is refused.
    let fourth = t.admit(A).unwrap();
    assert_eq!(t.established(&fourth, JOB), HELD);
    assert_eq!(t.admit(A).err(), Some(Refusal::Total));

    // The identity's share is taken (by `fourth`): a further connection is on probation,
    // evictable until it binds; a bound one is not.
    drop(bound.pop());
    let probation = t.admit(A).unwrap();
    assert_eq!(t.established(&probation, JOB), PROBATION);
    assert_eq!(t.bind(&probation, "gitea-task-1"), Binding::Bound);
    assert_eq!(
        t.admit(A).err(),
        Some(Refusal::Total),
        "a bound connection is not evicted"
    );

    // The assignment's own limit: two connections of gitea-task-1 are bound now.
    drop(bound.remove(1));
    let third_of_one = t.admit(A).unwrap();
    assert_eq!(t.established(&third_of_one, JOB), PROBATION);
    assert_eq!(t.bind(&third_of_one, "gitea-task-1"), Binding::Full);
    assert_eq!(
        t.bind(&third_of_one, "gitea-task-2"),
        Binding::Bound,
        "another assignment of the same job is not held back"
    );
    drop(probation);
    let again = t.admit(A).unwrap();
    assert_eq!(t.established(&again, JOB), PROBATION);
    assert_eq!(
        t.bind(&again, "gitea-task-1"),
        Binding::Bound,
        "a closed connection gives its assignment's place back"
    );
    // The same assignment presented by another workload counts on its own.
    drop(third_of_one);
    let stranger = t.admit(B).unwrap();
    assert_eq!(
        t.established(&stranger, "spiffe://example.org/ci/o/other/job"),
        HELD
    );
    assert_eq!(t.bind(&stranger, "gitea-task-1"), Binding::Bound);
    drop((bound, fourth, again, stranger));
    let s = t.lock();
    assert!(
        s.entries.is_empty()
            && s.per_identity.is_empty()
            && s.per_assignment.is_empty()
            && s.handshaking.is_empty(),
        "every count is given back"
    );
}

/// DESIGN invariant 21 (issue 37): the capability of an assignment that expired or
/// finished binds nothing: the connection keeps its standing (held, or evictable on
/// probation) and no assignment count moves; a live one still binds.
#[test]
fn an_assignment_that_is_over_binds_no_connection() {
    const JOB: &str = "spiffe://example.org/ci/o/r/job";
    let mut t = Tracker {
        may_bind: Some(Arc::new(|id: &str| id != "gitea-task-1")),
        ..Arc::into_inner(tracker(limits(10, 10, 1))).expect("only reference")
    };
    t.limits.max_connections_per_assignment = 2;
    let t = Arc::new(t);
    let slot = t.admit(A).unwrap();
    assert_eq!(t.established(&slot, JOB), HELD);
    assert_eq!(t.bind(&slot, "gitea-task-1"), Binding::Over);
    {
        let s = t.lock();
        assert!(s.per_assignment.is_empty(), "nothing counted for it");
        assert_eq!(
            s.per_identity.get(JOB),
            Some(&1),
            "still in its identity's share"
        );
    }
    assert_eq!(t.bind(&slot, "gitea-task-2"), Binding::Bound);
}

/// A standby request ([`gdr_core::executor::standby`]): no runner credentials, only the
/// standby ID.
fn standby_headers() -> http::HeaderMap {
    let mut headers = http::HeaderMap::new();
    headers.insert(
        gdr_core::executor::standby::ID_HEADER,
        http::HeaderValue::from_static("warm-1"),
    );
    headers
}

fn connection_state(slot: Slot, standing: Standing) -> ConnectionState {
    ConnectionState {
        slot,
        standing,
        bound: std::sync::OnceLock::new(),
        close: Notify::new(),
        refused: Notify::new(),
    }
}

/// DESIGN invariant 21 (issue 39 item 5): a warm executor's standby request binds its
/// connection to no assignment. Within its SPIFFE ID's share of unbound connections it is
/// served (and the connection stays in that share); a connection on probation beyond the
/// share is closed unanswered, as any request that binds nothing, so a flood of one
/// identity's standby requests holds no more than its share.
#[test]
fn a_standby_request_binds_no_assignment_and_is_served_only_within_its_identitys_share() {
    const JOB: &str = "spiffe://example.org/ci/o/r/job";
    let key = CapabilityKey::new(b"0123456789abcdef0123456789abcdef").expect("key");
    let t = Arc::new(Tracker {
        capabilities: Some(key),
        ..Arc::into_inner(tracker(limits(10, 10, 1))).expect("only reference")
    });
    let remote = SocketAddr::new(A, 1);
    let slot = t.admit(A).unwrap();
    assert_eq!(t.established(&slot, JOB), HELD);
    let held = connection_state(slot, Standing::Held);
    for _ in 0..2 {
        assert!(matches!(
            admit_request(&t, &held, &standby_headers(), remote, JOB),
            Admitted::Serve
        ));
    }
    assert!(held.bound.get().is_none(), "bound to nothing");
    {
        let s = t.lock();
        assert!(
            s.per_assignment.is_empty(),
            "nothing counted for an assignment"
        );
        assert_eq!(s.per_identity.get(JOB), Some(&1), "in its identity's share");
    }
    let slot = t.admit(A).unwrap();
    assert_eq!(t.established(&slot, JOB), PROBATION);
    let probation = connection_state(slot, Standing::Probation);
    assert!(matches!(
        admit_request(&t, &probation, &standby_headers(), remote, JOB),
        Admitted::Close
    ));
    assert!(probation.bound.get().is_none());
}

/// An acceptor whose `accept` always fails with `EMFILE`, as a process out of file
/// descriptors sees it; it counts the calls and stops failing fast after `cap` so that a
/// loop without backoff ends the test instead of hanging it.
struct Exhausted {
    calls: Arc<AtomicU64>,
    cap: u64,
}

impl Accept for Exhausted {
    fn accept(
        &mut self,
    ) -> impl Future<Output = std::io::Result<(TcpStream, SocketAddr)>> + Send + '_ {
        let calls = self.calls.fetch_add(1, Ordering::Relaxed) + 1;
        let cap = self.cap;
        async move {
            if calls > cap {
                std::future::pending::<()>().await;
            }
            Err(std::io::Error::from_raw_os_error(
                rustix::io::Errno::MFILE.raw_os_error(),
            ))
        }
    }
}

fn server_config() -> Arc<rustls::ServerConfig> {
    let ca = gdr_identity::workload_api::LocalCa::load_or_create(
        &tempfile::tempdir().unwrap().path().join("ca"),
        "example.org",
    )
    .unwrap();
    let svid = ca
        .issue("spiffe://example.org/controller", Duration::from_secs(600))
        .unwrap();
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            svid.cert_chain_der
                .iter()
                .map(|c| rustls::pki_types::CertificateDer::from(c.clone()))
                .collect(),
            rustls::pki_types::PrivateKeyDer::Pkcs8(rustls::pki_types::PrivatePkcs8KeyDer::from(
                svid.key_pkcs8_der.clone(),
            )),
        )
        .unwrap();
    Arc::new(config)
}

/// DESIGN invariant 21: when `accept` keeps failing for lack of file descriptors, the loop
/// backs off instead of retrying at once (a spin that burnt a core and logged ~46,000
/// lines a second), and logs the failure at most once per interval with a count.
#[test]
fn accept_errors_back_off_and_are_logged_once_per_interval_with_a_count() {
    let capture = Capture::default();
    let subscriber = json_subscriber(tracing_subscriber::EnvFilter::new("info"), capture.clone());
    let calls = Arc::new(AtomicU64::new(0));
    let config = server_config();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    let stats = Arc::new(FacadeStats::default());
    tracing::subscriber::with_default(subscriber, || {
        runtime.block_on(async {
            let (trigger, shutdown) = gdr_shutdown::shutdown_channel();
            let server = tokio::spawn(serve_with(
                Exhausted {
                    calls: calls.clone(),
                    cap: 100_000,
                },
                config,
                axum::Router::new(),
                FacadeLimits::default(),
                None,
                stats.clone(),
                shutdown,
            ));
            // One virtual minute of exhaustion.
            tokio::time::sleep(Duration::from_secs(60)).await;
            trigger.trigger();
            server.await.unwrap().unwrap();
        });
    });
    let calls = calls.load(Ordering::Relaxed);
    // 20 ms doubling to 1 s: about 6 calls to reach the maximum, then one a second.
    assert!(
        (50..=80).contains(&calls),
        "accept called {calls} times in a minute of EMFILE"
    );
    assert_eq!(stats.accept_errors.get(), calls);
    let log = capture.text();
    let lines = log
        .lines()
        .filter(|l| l.contains("failed to accept connections"))
        .count();
    assert!(
        (6..=7).contains(&lines),
        "{lines} log lines for a minute of accept errors:\n{log}"
    );
    assert!(log.contains("\"count\":"), "{log}");
}

#[test]
fn a_throttle_logs_the_first_event_then_once_per_interval_with_the_count() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    runtime.block_on(async {
        let mut t = Throttle::new(Duration::from_secs(10));
        assert_eq!(t.note(), Some(1));
        assert_eq!(t.note(), None);
        assert_eq!(t.note(), None);
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert_eq!(t.note(), Some(3));
    });
}

#[test]
fn accept_errors_are_told_apart() {
    use rustix::io::Errno;
    let e = |errno: Errno| std::io::Error::from_raw_os_error(errno.raw_os_error());
    assert_eq!(classify(&e(Errno::MFILE)), AcceptFailure::Resources);
    assert_eq!(classify(&e(Errno::NFILE)), AcceptFailure::Resources);
    assert_eq!(classify(&e(Errno::CONNABORTED)), AcceptFailure::Connection);
    assert_eq!(classify(&e(Errno::BADF)), AcceptFailure::Fatal);
    assert_eq!(classify(&e(Errno::INVAL)), AcceptFailure::Fatal);
}
