//! The facade's mTLS server (DESIGN invariant 21): its own accept loop, because a facade
//! any peer of the network can reach must survive floods.
//!
//! - At most `max_connections` open connections (handshakes included), at most
//!   `max_connections_per_peer` from one address. At a limit, the oldest connection still
//!   in its TLS handshake makes room for the new one (nothing a legitimate client holds is
//!   ever evicted, and a flood cannot keep a real executor's fresh connection out), or the
//!   new one is closed at once, before any TLS work.
//! - The TLS handshake is bounded. A connection is then *bound* to one assignment by its
//!   first request carrying that assignment's credentials (`x-runner-uuid` and a
//!   capability that verifies for it — a stateless HMAC check; the application checks the
//!   rest); at most `max_connections_per_assignment` connections are bound to one
//!   assignment, and a request on a connection bound to another assignment is refused. The
//!   SPIFFE ID of a job is the same for every run of it (matrix entries, pull requests,
//!   re-runs), so it bounds only connections not bound yet: at most
//!   `max_connections_per_identity` of them are held per SPIFFE ID (one executor opening
//!   sessions without sending anything cannot hold the facade). A connection beyond that
//!   share stays evictable like a handshake until its first request binds it, and is
//!   closed unanswered if that request does not: a crowd of one job's executors connecting
//!   at once is never refused for it. An assignment that expired or finished (as the
//!   application knows it, see [`Binder`]) binds nothing, and a bound connection whose
//!   request the facade refuses (a [`Refused`] answer: its assignment finished, another
//!   assignment's request, an assignment at its limit) is closed once that answer is
//!   written, so it keeps neither its binding nor its place.
//! - A warm VM sandbox's executor asks for its assignment with a standby request, which
//!   carries no runner credentials ([`gdr_core::executor::standby`]): it binds its
//!   connection to nothing. It is served, like any request that binds nothing, on a
//!   connection within its SPIFFE ID's share; one on probation is closed unanswered, and
//!   the executor asks again on a new connection. One request, then the executor `exec`s
//!   and the connection ends, so a job's warm executors hold that share only for a moment,
//!   and a flood of standby requests holds no more of the facade than the share.
//! - The first request bytes, and every HTTP/1.1 request head, are bounded by the header
//!   timeout, and so is the idleness of a connection not bound to an assignment; a bound
//!   connection without a request in flight for `idle_timeout` is closed (HTTP/1.1 and
//!   HTTP/2), and HTTP/2 peers are pinged so a dead one is dropped.
//! - Accept errors back off instead of spinning (file descriptors exhausted makes
//!   `accept` fail at once, forever), and every refusal is counted and logged at most once
//!   per interval with the count, never once per connection.
//!
//! Without a capability key (a server that is not a facade) nothing binds: every connection
//! counts against its SPIFFE ID, and the header timeout bounds it until its first request.
//!
//! Every request reaches the application with the peer's [`PeerSpiffeId`] and
//! connectrpc's `PeerCerts` / `PeerAddr` in its extensions.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::response::IntoResponse;
use connectrpc::server::{PeerAddr, PeerCerts};
use gdr_core::capability::CapabilityKey;
use gdr_identity::tls::{PeerSpiffeId, peer_spiffe_id};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use tokio::time::Instant;
use tower::ServiceExt;

use gdr_gitea::{TOKEN_HEADER, UUID_HEADER};
use gdr_shutdown::Shutdown;

/// How often a connection looks at its own idleness.
const IDLE_CHECK: Duration = Duration::from_secs(1);
/// After a connection was asked to close (idle, shutdown), how long its peer gets to let
/// in-flight requests finish before the socket is dropped.
const CLOSE_GRACE: Duration = Duration::from_secs(30);
/// Streams one HTTP/2 connection may have open at once (hyper's default is 200; a runner
/// needs a handful).
const H2_MAX_STREAMS: u32 = 64;
/// Accept errors that mean "no resources now" (file descriptors, buffers): the first
/// retry comes after the minimum, then twice as late each time, up to the maximum.
const ACCEPT_BACKOFF_MIN: Duration = Duration::from_millis(20);
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);
/// Refusals, evictions and accept errors are logged at most once per this interval.
pub const LOG_INTERVAL: Duration = Duration::from_secs(10);

/// Connection limits and timeouts of the facade (DESIGN invariant 21). The controller's
/// settings declare them (the `runner_facade_…` keys); [`Default`] holds those keys'
/// defaults, for a facade run without settings (a unit test in the controller's settings
/// holds the two together).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FacadeLimits {
    /// Open connections, handshakes included.
    pub max_connections: usize,
    /// Open connections from one peer address.
    pub max_connections_per_peer: usize,
    /// Established connections of one SPIFFE ID not bound to an assignment yet.
    pub max_connections_per_identity: usize,
    /// Connections bound to one assignment.
    pub max_connections_per_assignment: usize,
    /// Bound of the TLS handshake.
    pub tls_handshake_timeout: Duration,
    /// Bound of the first bytes and of each HTTP/1.1 request head.
    pub header_read_timeout: Duration,
    /// A connection without a request in flight this long is closed.
    pub idle_timeout: Duration,
    /// HTTP/2 keep-alive: a ping every interval…
    pub h2_ping_interval: Duration,
    /// …and a peer that does not answer one within this is dropped.
    pub h2_ping_timeout: Duration,
}

impl Default for FacadeLimits {
    /// The defaults of the `runner_facade_…` keys.
    fn default() -> Self {
        FacadeLimits {
            max_connections: 1024,
            max_connections_per_peer: 512,
            max_connections_per_identity: 16,
            max_connections_per_assignment: 16,
            tls_handshake_timeout: Duration::from_secs(10),
            header_read_timeout: Duration::from_secs(15),
            idle_timeout: Duration::from_secs(90),
            h2_ping_interval: Duration::from_secs(30),
            h2_ping_timeout: Duration::from_secs(10),
        }
    }
}

/// Whether an assignment may still have connections bound to it (the application's
/// answer, from memory: no look-up per request).
pub type MayBind = Arc<dyn Fn(&str) -> bool + Send + Sync>;

/// What binds connections to assignments: the key their capabilities verify under, and
/// whether the assignment is still live.
#[derive(Clone)]
pub struct Binder {
    pub key: CapabilityKey,
    pub may_bind: MayBind,
}

/// Marks a response by which the application refused the request's credentials: its
/// connection is closed once the answer is written.
#[derive(Debug, Clone, Copy)]
pub struct Refused;

/// Why the facade closed a connection early: the values of [`CloseReasonLabel`].
pub const FACADE_CLOSE_REASONS: [&str; 5] = [
    CloseReason::Limit.as_str(),
    CloseReason::Evicted.as_str(),
    CloseReason::Handshake.as_str(),
    CloseReason::IdentityLimit.as_str(),
    CloseReason::Idle.as_str(),
];

/// Why the facade closed a connection early.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CloseReason {
    /// A new connection refused at once because a connection limit was reached.
    Limit,
    /// A connection still in its TLS handshake closed to make room for a new one.
    Evicted,
    /// A handshake failed or timed out.
    Handshake,
    /// Closed after the handshake: its SPIFFE ID holds its share of connections not bound
    /// to an assignment, and its first request did not bind it.
    IdentityLimit,
    /// Closed for idleness (or for not sending a request in time).
    Idle,
}

impl CloseReason {
    /// The label value.
    pub const fn as_str(self) -> &'static str {
        match self {
            CloseReason::Limit => "limit",
            CloseReason::Evicted => "evicted",
            CloseReason::Handshake => "handshake",
            CloseReason::IdentityLimit => "identity_limit",
            CloseReason::Idle => "idle",
        }
    }

    fn label(self) -> CloseReasonLabel {
        CloseReasonLabel {
            reason: self.as_str().into(),
        }
    }
}

/// Label: why the facade closed a connection early.
#[derive(Clone, Debug, Default, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CloseReasonLabel {
    /// The reason.
    pub reason: String,
}

/// Counters of the facade's connection handling; the exported ones are Prometheus metrics,
/// which the controller registers (`facade_…`).
#[derive(Debug)]
pub struct FacadeStats {
    /// Connections open now.
    pub open: Gauge,
    /// Connections accepted.
    pub accepted: AtomicU64,
    /// Requests refused because their assignment holds its connection limit.
    pub assignment_refused: AtomicU64,
    /// Failed `accept` calls.
    pub accept_errors: Counter,
    /// Connections closed early, by reason.
    closed: Family<CloseReasonLabel, Counter>,
}

impl Default for FacadeStats {
    fn default() -> Self {
        let closed = Family::<CloseReasonLabel, Counter>::default();
        // Every reason exists from the start, at zero, for alerts and `increase()`.
        for reason in FACADE_CLOSE_REASONS {
            closed.get_or_create_owned(&CloseReasonLabel {
                reason: reason.into(),
            });
        }
        FacadeStats {
            open: Gauge::default(),
            accepted: AtomicU64::default(),
            assignment_refused: AtomicU64::default(),
            accept_errors: Counter::default(),
            closed,
        }
    }
}

impl FacadeStats {
    /// Connections closed early, by reason: the family the controller registers (every
    /// reason of [`FACADE_CLOSE_REASONS`] present from the start).
    pub fn closed_by_reason(&self) -> &Family<CloseReasonLabel, Counter> {
        &self.closed
    }

    /// Counts a connection closed early.
    pub fn close(&self, reason: CloseReason) {
        self.closed.get_or_create(&reason.label()).inc();
    }

    /// Connections closed early for `reason`.
    pub fn closed(&self, reason: CloseReason) -> u64 {
        self.closed.get_or_create(&reason.label()).get()
    }
}

fn inc(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// One log line per interval for a recurring event, carrying how often it happened.
#[derive(Debug)]
pub(crate) struct Throttle {
    interval: Duration,
    last: Option<Instant>,
    suppressed: u64,
}

impl Throttle {
    pub(crate) fn new(interval: Duration) -> Self {
        Throttle {
            interval,
            last: None,
            suppressed: 0,
        }
    }

    /// Notes one event; `Some(n)` when a line should be logged now for `n` events (this one
    /// and those suppressed since the last line).
    pub(crate) fn note(&mut self) -> Option<u64> {
        self.suppressed += 1;
        let now = Instant::now();
        if self
            .last
            .is_some_and(|last| now.duration_since(last) < self.interval)
        {
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.suppressed))
    }
}

/// Where a tracked connection stands.
struct Entry {
    peer: IpAddr,
    /// Set once the handshake succeeded.
    identity: Option<String>,
    /// Counted in its identity's share of unbound connections (never evicted).
    held: bool,
    /// The assignment its first credentialed request bound it to (never evicted).
    assignment: Option<Bound>,
    evict: Arc<Notify>,
}

/// What a bound connection is counted under: the assignment, and the SPIFFE ID that bound
/// it, so a stolen capability presented by another workload cannot use up the share of
/// the assignment's own executor (the application refuses that workload anyway).
type Bound = (String, String);

#[derive(Default)]
struct TrackerState {
    next_id: u64,
    entries: HashMap<u64, Entry>,
    per_peer: HashMap<IpAddr, usize>,
    /// Held connections of each SPIFFE ID not bound to an assignment.
    per_identity: HashMap<String, usize>,
    per_assignment: HashMap<Bound, usize>,
    /// Connections that may be evicted, oldest (lowest ID) first: those still in their
    /// handshake, and those beyond their identity's share that no request has bound yet.
    handshaking: BTreeMap<u64, IpAddr>,
}

impl TrackerState {
    fn remove(&mut self, id: u64) -> Option<Entry> {
        let entry = self.entries.remove(&id)?;
        self.handshaking.remove(&id);
        decrement(&mut self.per_peer, &entry.peer);
        if entry.held
            && let Some(identity) = &entry.identity
        {
            decrement(&mut self.per_identity, identity);
        }
        if let Some(bound) = &entry.assignment {
            decrement(&mut self.per_assignment, bound);
        }
        Some(entry)
    }

    /// The oldest connection in its handshake, from `peer` if given.
    fn oldest_handshaking(&self, peer: Option<IpAddr>) -> Option<u64> {
        self.handshaking
            .iter()
            .find(|(_, ip)| peer.is_none_or(|p| **ip == p))
            .map(|(id, _)| *id)
    }
}

fn decrement<K: std::hash::Hash + Eq>(map: &mut HashMap<K, usize>, key: &K) {
    if let Some(n) = map.get_mut(key) {
        *n = n.saturating_sub(1);
        if *n == 0 {
            map.remove(key);
        }
    }
}

/// Why a new connection was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refusal {
    Total,
    Peer,
}

/// Where a connection stands once its handshake succeeded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Standing {
    /// Within its identity's share of unbound connections: never evicted.
    Held,
    /// Beyond that share: evictable until a request binds it, closed if one does not.
    Probation,
}

/// What binding a connection to an assignment came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Binding {
    /// Bound now, or before to the same assignment.
    Bound,
    /// Bound to another assignment before.
    Other,
    /// The assignment holds its connection limit.
    Full,
    /// The connection was evicted meanwhile.
    Gone,
    /// The assignment expired or finished: its capability binds nothing any more.
    Over,
}

/// The connection limits, shared by the accept loop and the connection tasks.
struct Tracker {
    limits: FacadeLimits,
    /// Verifies the capabilities that bind connections to assignments.
    capabilities: Option<CapabilityKey>,
    /// Whether an assignment is still live enough to bind (`None`: every one is).
    may_bind: Option<MayBind>,
    state: Mutex<TrackerState>,
    stats: Arc<FacadeStats>,
    /// Requests refused at an assignment's connection limit, logged once per interval.
    refusals: Mutex<Throttle>,
}

/// A tracked connection; dropping it gives its place back.
struct Slot {
    tracker: Arc<Tracker>,
    id: u64,
    evict: Arc<Notify>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        if self.tracker.lock().remove(self.id).is_some() {
            self.tracker.stats.open.dec();
        }
    }
}

impl Tracker {
    fn lock(&self) -> std::sync::MutexGuard<'_, TrackerState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Admits a new connection from `peer`, evicting the oldest handshaking connection
    /// when a limit is reached and there is one to evict.
    fn admit(self: &Arc<Self>, peer: IpAddr) -> Result<Slot, Refusal> {
        let mut s = self.lock();
        let mut evicted = Vec::new();
        if s.per_peer.get(&peer).copied().unwrap_or(0) >= self.limits.max_connections_per_peer {
            let victim = s.oldest_handshaking(Some(peer)).ok_or(Refusal::Peer)?;
            evicted.extend(s.remove(victim));
        }
        if s.entries.len() >= self.limits.max_connections {
            let Some(victim) = s.oldest_handshaking(None) else {
                drop(s);
                self.evicted(evicted);
                return Err(Refusal::Total);
            };
            evicted.extend(s.remove(victim));
        }
        let id = s.next_id;
        s.next_id += 1;
        let evict = Arc::new(Notify::new());
        s.entries.insert(
            id,
            Entry {
                peer,
                identity: None,
                held: false,
                assignment: None,
                evict: evict.clone(),
            },
        );
        s.handshaking.insert(id, peer);
        *s.per_peer.entry(peer).or_default() += 1;
        drop(s);
        self.evicted(evicted);
        self.stats.open.inc();
        Ok(Slot {
            tracker: self.clone(),
            id,
            evict,
        })
    }

    fn evicted(&self, entries: Vec<Entry>) {
        for entry in entries {
            // `notify_one` stores a permit: an eviction before the task waits still counts.
            entry.evict.notify_one();
            self.stats.close(CloseReason::Evicted);
            self.stats.open.dec();
        }
    }

    /// The handshake of `slot` succeeded for `identity`: held (never evicted) within the
    /// identity's share of unbound connections, on probation beyond it; `None` if it was
    /// evicted while the handshake finished.
    fn established(&self, slot: &Slot, identity: &str) -> Option<Standing> {
        let mut s = self.lock();
        let held = s.per_identity.get(identity).copied().unwrap_or(0);
        let within = held < self.limits.max_connections_per_identity;
        let entry = s.entries.get_mut(&slot.id)?;
        entry.identity = Some(identity.to_owned());
        if !within {
            return Some(Standing::Probation);
        }
        entry.held = true;
        s.handshaking.remove(&slot.id);
        *s.per_identity.entry(identity.to_owned()).or_default() += 1;
        Some(Standing::Held)
    }

    /// Binds the connection of `slot` to `assignment` (whose capability the caller
    /// verified): it leaves its identity's share of unbound connections (and the evictable
    /// ones) and counts against the assignment's limit instead.
    fn bind(&self, slot: &Slot, assignment: &str) -> Binding {
        // Asked before the tracker's lock is taken: it takes the application's own.
        let over = self.may_bind.as_ref().is_some_and(|live| !live(assignment));
        let mut s = self.lock();
        let Some(entry) = s.entries.get(&slot.id) else {
            return Binding::Gone;
        };
        if let Some((bound, _)) = &entry.assignment {
            return if bound == assignment {
                Binding::Bound
            } else {
                Binding::Other
            };
        }
        if over {
            return Binding::Over;
        }
        let identity = entry.identity.clone().unwrap_or_default();
        let key = (assignment.to_owned(), identity.clone());
        if s.per_assignment.get(&key).copied().unwrap_or(0)
            >= self.limits.max_connections_per_assignment
        {
            return Binding::Full;
        }
        let held = entry.held;
        if held {
            decrement(&mut s.per_identity, &identity);
        }
        s.handshaking.remove(&slot.id);
        *s.per_assignment.entry(key.clone()).or_default() += 1;
        if let Some(entry) = s.entries.get_mut(&slot.id) {
            entry.held = false;
            entry.assignment = Some(key);
        }
        Binding::Bound
    }
}

/// Something that accepts connections: the listener, or a test's stand-in.
pub(crate) trait Accept: Send {
    /// The next connection.
    fn accept(
        &mut self,
    ) -> impl Future<Output = std::io::Result<(TcpStream, SocketAddr)>> + Send + '_;
}

impl Accept for TcpListener {
    fn accept(
        &mut self,
    ) -> impl Future<Output = std::io::Result<(TcpStream, SocketAddr)>> + Send + '_ {
        TcpListener::accept(self)
    }
}

/// What an accept error means for the loop.
#[derive(Debug, PartialEq, Eq)]
enum AcceptFailure {
    /// No file descriptors or buffers now: back off.
    Resources,
    /// One connection failed before we got it: go on.
    Connection,
    /// The listener is broken.
    Fatal,
}

fn classify(e: &std::io::Error) -> AcceptFailure {
    use rustix::io::Errno;
    match e.raw_os_error().map(Errno::from_raw_os_error) {
        Some(Errno::MFILE | Errno::NFILE | Errno::NOBUFS | Errno::NOMEM) => {
            AcceptFailure::Resources
        }
        Some(
            Errno::CONNABORTED
            | Errno::CONNRESET
            | Errno::INTR
            | Errno::AGAIN
            | Errno::PROTO
            | Errno::PERM
            | Errno::TIMEDOUT
            | Errno::NETDOWN
            | Errno::NETUNREACH
            | Errno::HOSTDOWN
            | Errno::HOSTUNREACH
            | Errno::NOPROTOOPT
            | Errno::OPNOTSUPP,
        ) => AcceptFailure::Connection,
        _ => AcceptFailure::Fatal,
    }
}

/// Serves `app` over mTLS on `listener` with the default limits until `shutdown` is
/// triggered; see [`serve_tls_limited`].
pub async fn serve_tls(
    listener: TcpListener,
    config: Arc<rustls::ServerConfig>,
    app: axum::Router,
    shutdown: Shutdown,
) -> std::io::Result<()> {
    let stats = Arc::new(FacadeStats::default());
    serve_with(
        listener,
        config,
        app,
        FacadeLimits::default(),
        None,
        stats,
        shutdown,
    )
    .await
}

/// Serves `app` over mTLS on `listener` until `shutdown`, then closes connections
/// gracefully (each within `CLOSE_GRACE`). HTTP/1.1 and h2 are both served (ALPN).
/// Connections are bound to the live assignment whose capability under `binder` their
/// first request presents (see the module documentation); with `None` nothing binds.
///
/// The result is `Err` only when the listener itself fails for good.
pub async fn serve_tls_limited(
    listener: TcpListener,
    config: Arc<rustls::ServerConfig>,
    app: axum::Router,
    limits: FacadeLimits,
    binder: Option<Binder>,
    stats: Arc<FacadeStats>,
    shutdown: Shutdown,
) -> std::io::Result<()> {
    serve_with(listener, config, app, limits, binder, stats, shutdown).await
}

pub(crate) async fn serve_with(
    mut listener: impl Accept,
    config: Arc<rustls::ServerConfig>,
    app: axum::Router,
    limits: FacadeLimits,
    binder: Option<Binder>,
    stats: Arc<FacadeStats>,
    shutdown: Shutdown,
) -> std::io::Result<()> {
    let (capabilities, may_bind) = binder.map(|b| (b.key, b.may_bind)).unzip();
    let tracker = Arc::new(Tracker {
        limits,
        capabilities,
        may_bind,
        state: Mutex::new(TrackerState::default()),
        stats: stats.clone(),
        refusals: Mutex::new(Throttle::new(LOG_INTERVAL)),
    });
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .keep_alive(true);
    builder
        .http2()
        .timer(TokioTimer::new())
        // A ping every interval; no answer within the timeout drops the connection (a peer
        // that vanished without closing: half-open TCP).
        .keep_alive_interval(Some(limits.h2_ping_interval))
        .keep_alive_timeout(limits.h2_ping_timeout)
        .max_concurrent_streams(H2_MAX_STREAMS);
    let builder = Arc::new(builder);
    let mut connections = tokio::task::JoinSet::new();
    let mut refusals = Throttle::new(LOG_INTERVAL);
    let mut accept_errors = Throttle::new(LOG_INTERVAL);
    let mut backoff = ACCEPT_BACKOFF_MIN;
    loop {
        let accepted = tokio::select! {
            biased;
            _ = shutdown.wait() => break,
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
            accepted = listener.accept() => accepted,
        };
        let (stream, remote) = match accepted {
            Ok(conn) => {
                backoff = ACCEPT_BACKOFF_MIN;
                conn
            }
            Err(e) => {
                stats.accept_errors.inc();
                let failure = classify(&e);
                if failure == AcceptFailure::Fatal {
                    tracing::error!(error = %e, "the facade cannot accept connections any more");
                    return Err(e);
                }
                if let Some(count) = accept_errors.note() {
                    tracing::warn!(error = %e, count, interval = ?LOG_INTERVAL, "the facade failed to accept connections");
                }
                if failure == AcceptFailure::Resources {
                    // Nothing frees a descriptor sooner than a connection closing; waiting
                    // is all the loop can do without spinning.
                    if !shutdown.sleep(backoff).await {
                        break;
                    }
                    backoff = (backoff * 2).min(ACCEPT_BACKOFF_MAX);
                }
                continue;
            }
        };
        inc(&stats.accepted);
        let slot = match tracker.admit(remote.ip()) {
            Ok(slot) => slot,
            Err(why) => {
                stats.close(CloseReason::Limit);
                drop(stream);
                if let Some(count) = refusals.note() {
                    let limit = match why {
                        Refusal::Total => "runner_facade_max_connections",
                        Refusal::Peer => "runner_facade_max_connections_per_peer",
                    };
                    tracing::warn!(peer = %remote.ip(), limit, count, interval = ?LOG_INTERVAL, "the facade refused new connections at its connection limit");
                }
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        connections.spawn(connection(
            stream,
            remote,
            slot,
            acceptor.clone(),
            builder.clone(),
            app.clone(),
            tracker.clone(),
            shutdown.clone(),
        ));
    }
    drop(listener);
    // Each connection closes itself within its grace once it sees the shutdown.
    while connections.join_next().await.is_some() {}
    Ok(())
}

/// Requests in flight and the last activity of one connection.
struct Activity {
    in_flight: AtomicUsize,
    requests: AtomicU64,
    last: Mutex<Instant>,
}

impl Activity {
    fn touch(&self) {
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
    }

    fn idle_for(&self) -> Option<Duration> {
        (self.in_flight.load(Ordering::Acquire) == 0).then(|| {
            self.last
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .elapsed()
        })
    }
}

/// Held by a request from its arrival until its response body is done (or dropped).
struct InFlight(Arc<Activity>);

impl InFlight {
    fn start(activity: &Arc<Activity>) -> Self {
        activity.in_flight.fetch_add(1, Ordering::AcqRel);
        activity.requests.fetch_add(1, Ordering::Relaxed);
        activity.touch();
        InFlight(activity.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.touch();
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A response body that keeps its request counted as in flight until it is sent.
struct Tracked {
    inner: axum::body::Body,
    _in_flight: InFlight,
}

impl hyper::body::Body for Tracked {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

#[allow(clippy::too_many_arguments)]
async fn connection(
    stream: TcpStream,
    remote: SocketAddr,
    slot: Slot,
    acceptor: tokio_rustls::TlsAcceptor,
    builder: Arc<Builder<TokioExecutor>>,
    app: axum::Router,
    tracker: Arc<Tracker>,
    shutdown: Shutdown,
) {
    let stats = tracker.stats.clone();
    let Some(Handshaken {
        tls,
        identity,
        certs,
    }) = handshake(stream, remote, &slot, &acceptor, &tracker, &shutdown).await
    else {
        return;
    };
    let Some(standing) = tracker.established(&slot, &identity) else {
        return;
    };

    let activity = Arc::new(Activity {
        in_flight: AtomicUsize::new(0),
        requests: AtomicU64::new(0),
        last: Mutex::new(Instant::now()),
    });
    let conn_state = Arc::new(ConnectionState {
        slot,
        standing,
        bound: std::sync::OnceLock::new(),
        close: Notify::new(),
        refused: Notify::new(),
    });
    let service = {
        let activity = activity.clone();
        let conn_state = conn_state.clone();
        let tracker = tracker.clone();
        let peer_id = PeerSpiffeId(identity.clone());
        hyper::service::service_fn(move |mut req: hyper::Request<hyper::body::Incoming>| {
            let in_flight = InFlight::start(&activity);
            let admitted = admit_request(&tracker, &conn_state, req.headers(), remote, &peer_id.0);
            let extensions = req.extensions_mut();
            extensions.insert(PeerAddr(remote));
            extensions.insert(peer_id.clone());
            if let Some(certs) = &certs {
                extensions.insert(certs.clone());
            }
            let response = match admitted {
                Admitted::Serve => Some(app.clone().oneshot(req.map(axum::body::Body::new))),
                Admitted::Refuse(..) | Admitted::Close => None,
            };
            respond(admitted, response, conn_state.clone(), in_flight)
        })
    };
    let conn = builder.serve_connection(TokioIo::new(tls), service);
    let mut conn = std::pin::pin!(conn);
    let mut closing: Option<Instant> = None;
    loop {
        tokio::select! {
            result = conn.as_mut() => {
                if let Err(e) = result {
                    tracing::trace!(peer = %remote, error = %e, "facade connection ended with an error");
                }
                return;
            }
            // Evicted while on probation, or closed by its first request.
            _ = conn_state.slot.evict.notified() => return,
            _ = conn_state.close.notified() => {
                stats.close(CloseReason::IdentityLimit);
                tracing::debug!(peer = %remote, %identity, "facade connection closed: this SPIFFE ID holds its share of connections not bound to an assignment, and the first request did not bind this one");
                return;
            }
            // A refused request: closed once its answer is written (unbound with its slot).
            _ = conn_state.refused.notified(), if closing.is_none() => {
                tracing::debug!(peer = %remote, %identity, "facade connection closed after a refused request");
                conn.as_mut().graceful_shutdown();
                closing = Some(Instant::now() + CLOSE_GRACE);
            }
            _ = shutdown.wait(), if closing.is_none() => {
                conn.as_mut().graceful_shutdown();
                closing = Some(Instant::now() + CLOSE_GRACE);
            }
            _ = tokio::time::sleep(IDLE_CHECK) => {
                if let Some(deadline) = closing {
                    if Instant::now() >= deadline {
                        tracing::debug!(peer = %remote, "facade connection did not close within its grace; dropped");
                        return;
                    }
                    continue;
                }
                if idle_too_long(&tracker, &conn_state, &activity) {
                    stats.close(CloseReason::Idle);
                    tracing::debug!(peer = %remote, %identity, "closing an idle facade connection");
                    conn.as_mut().graceful_shutdown();
                    closing = Some(Instant::now() + CLOSE_GRACE);
                }
            }
        }
    }
}

/// A connection whose TLS handshake completed with a SPIFFE ID.
struct Handshaken {
    tls: tokio_rustls::server::TlsStream<TcpStream>,
    /// The peer's SPIFFE ID.
    identity: String,
    certs: Option<PeerCerts>,
}

/// The TLS handshake, bounded by its timeout; `None` (counted and logged) when it fails,
/// the peer shows no SPIFFE ID, or the slot is evicted or the facade stops meanwhile.
async fn handshake(
    stream: TcpStream,
    remote: SocketAddr,
    slot: &Slot,
    acceptor: &tokio_rustls::TlsAcceptor,
    tracker: &Tracker,
    shutdown: &Shutdown,
) -> Option<Handshaken> {
    let limits = tracker.limits;
    let stats = &tracker.stats;
    let handshake = tokio::select! {
        _ = slot.evict.notified() => return None,
        _ = shutdown.wait() => return None,
        done = tokio::time::timeout(limits.tls_handshake_timeout, acceptor.accept(stream)) => done,
    };
    let tls = match handshake {
        Ok(Ok(tls)) => tls,
        Ok(Err(e)) => {
            stats.close(CloseReason::Handshake);
            tracing::debug!(peer = %remote, error = %e, "facade TLS handshake failed");
            return None;
        }
        Err(_) => {
            stats.close(CloseReason::Handshake);
            tracing::debug!(peer = %remote, timeout = ?limits.tls_handshake_timeout, "facade TLS handshake timed out");
            return None;
        }
    };
    let (_, session) = tls.get_ref();
    let certs = session
        .peer_certificates()
        .map(|chain| PeerCerts(chain.iter().map(|c| c.clone().into_owned()).collect()));
    let identity: Option<String> = certs.as_ref().and_then(|c| peer_spiffe_id(&c.0[..]));
    let Some(identity) = identity else {
        stats.close(CloseReason::Handshake);
        tracing::debug!(peer = %remote, "facade peer without a SPIFFE ID closed");
        return None;
    };
    Some(Handshaken {
        tls,
        identity,
        certs,
    })
}

/// One request's answer: the application's (`response`), a refusal, or none at all (the
/// connection task drops a connection closed unanswered). Its [`InFlight`] travels with
/// the body.
async fn respond(
    admitted: Admitted,
    response: Option<
        impl Future<Output = Result<axum::response::Response, std::convert::Infallible>>,
    >,
    conn_state: Arc<ConnectionState>,
    in_flight: InFlight,
) -> Result<hyper::Response<Tracked>, std::convert::Infallible> {
    let response = match (admitted, response) {
        (_, Some(response)) => response.await?,
        (Admitted::Refuse(status, text), _) => {
            conn_state.refused.notify_one();
            (status, text).into_response()
        }
        // The connection task drops the connection; nothing is answered.
        _ => std::future::pending::<axum::response::Response>().await,
    };
    // A bound connection keeps nothing once its assignment's credentials are
    // refused; an unbound one is bounded by its identity's share already.
    if conn_state.bound.get().is_some() && response.extensions().get::<Refused>().is_some() {
        conn_state.refused.notify_one();
    }
    Ok(response.map(|inner| Tracked {
        inner,
        _in_flight: in_flight,
    }))
}

/// Whether the connection has been idle past its bound. Until it is bound to an assignment
/// (or, where nothing binds, until its first request) a connection gets the header
/// timeout: a peer that connects and sends nothing useful holds nothing for long.
fn idle_too_long(tracker: &Tracker, conn_state: &ConnectionState, activity: &Activity) -> bool {
    let unbound = if tracker.capabilities.is_some() {
        conn_state.bound.get().is_none()
    } else {
        activity.requests.load(Ordering::Relaxed) == 0
    };
    let bound = if unbound {
        tracker.limits.header_read_timeout
    } else {
        tracker.limits.idle_timeout
    };
    activity.idle_for().is_some_and(|idle| idle >= bound)
}

/// One established connection's standing, shared by its requests.
struct ConnectionState {
    slot: Slot,
    standing: Standing,
    /// The assignment it is bound to, once bound.
    bound: std::sync::OnceLock<String>,
    /// Its first request did not bind a connection on probation: drop it unanswered.
    close: Notify,
    /// A request on it was refused: close it once the answer is written.
    refused: Notify,
}

/// What becomes of one request before the application sees it.
enum Admitted {
    Serve,
    Refuse(http::StatusCode, String),
    Close,
}

fn header<'a>(headers: &'a http::HeaderMap, name: &str) -> &'a str {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
}

/// Binds the connection to the assignment the request's credentials name, or refuses the
/// request; a request that binds nothing goes on to the application (which refuses it, or
/// answers a warm executor's standby request), unless its connection is on probation.
fn admit_request(
    tracker: &Tracker,
    conn: &ConnectionState,
    headers: &http::HeaderMap,
    remote: SocketAddr,
    identity: &str,
) -> Admitted {
    let uuid = header(headers, UUID_HEADER);
    if let Some(bound) = conn.bound.get() {
        return if uuid == bound {
            Admitted::Serve
        } else {
            tracing::debug!(peer = %remote, %identity, assignment_id = bound.as_str(), other = uuid, "facade request for another assignment than its connection's refused");
            Admitted::Refuse(
                http::StatusCode::FORBIDDEN,
                format!(
                    "this connection belongs to assignment {bound}; a request for another assignment needs its own connection\n"
                ),
            )
        };
    }
    let verified = tracker
        .capabilities
        .as_ref()
        .is_some_and(|key| key.verify(uuid, header(headers, TOKEN_HEADER)));
    let binding = if verified {
        tracker.bind(&conn.slot, uuid)
    } else {
        Binding::Over
    };
    match binding {
        // Binds nothing: the application refuses it (and the connection is then closed),
        // unless the connection is on probation, which is closed unanswered now.
        Binding::Over => match conn.standing {
            Standing::Held => Admitted::Serve,
            Standing::Probation => {
                conn.close.notify_one();
                Admitted::Close
            }
        },
        Binding::Bound => {
            // Set once; a concurrent first request of the same assignment finds it set.
            let _ = conn.bound.set(uuid.to_owned());
            Admitted::Serve
        }
        Binding::Other => Admitted::Refuse(
            http::StatusCode::FORBIDDEN,
            "this connection belongs to another assignment; a request for another assignment needs its own connection\n".to_owned(),
        ),
        Binding::Full => {
            inc(&tracker.stats.assignment_refused);
            let limit = tracker.limits.max_connections_per_assignment;
            let count = tracker
                .refusals
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .note();
            if let Some(count) = count {
                tracing::warn!(assignment_id = uuid, peer = %remote, limit = "runner_facade_max_connections_per_assignment", count, interval = ?LOG_INTERVAL, "the facade refused requests on new connections of an assignment at its connection limit");
            }
            Admitted::Refuse(
                http::StatusCode::TOO_MANY_REQUESTS,
                format!(
                    "assignment {uuid} holds {limit} connections to the facade, its limit; use one of them\n"
                ),
            )
        }
        // Evicted meanwhile: its eviction ends the connection.
        Binding::Gone => Admitted::Close,
    }
}

#[cfg(test)]
mod tests;
