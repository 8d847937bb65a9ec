//! The facade's mTLS server (DESIGN invariant 21): its own accept loop, because a facade
//! any peer of the network can reach must survive floods.
//!
//! - At most `max_connections` open connections (handshakes included), at most
//!   `max_connections_per_peer` from one address. At a limit, the oldest connection still
//!   in its TLS handshake makes room for the new one (nothing a legitimate client holds is
//!   ever evicted, and a flood cannot keep a real executor's fresh connection out), or the
//!   new one is closed at once, before any TLS work.
//! - The TLS handshake is bounded; after it, at most `max_connections_per_identity`
//!   connections per SPIFFE ID (one job cannot hold the facade).
//! - The first request bytes, and every HTTP/1.1 request head, are bounded by the header
//!   timeout; a connection without a request in flight for `idle_timeout` is closed
//!   (HTTP/1.1 and HTTP/2), and HTTP/2 peers are pinged so a dead one is dropped.
//! - Accept errors back off instead of spinning (file descriptors exhausted makes
//!   `accept` fail at once, forever), and every refusal is counted and logged at most once
//!   per interval with the count, never once per connection.
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

use connectrpc::server::{PeerAddr, PeerCerts};
use gdr_identity::tls::{PeerSpiffeId, peer_spiffe_id};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use tokio::time::Instant;
use tower::ServiceExt;

use crate::settings::FacadeLimits;
use crate::shutdown::Shutdown;

/// How often a connection looks at its own idleness.
const IDLE_CHECK: Duration = Duration::from_secs(1);
/// After a connection was asked to close (idle, shutdown), how long its peer gets to let
/// in-flight requests finish before the socket is dropped.
const CLOSE_GRACE: Duration = Duration::from_secs(30);
/// HTTP/2 keep-alive: a ping every interval; no answer within the timeout drops the
/// connection (a peer that vanished without closing: half-open TCP).
const H2_PING_INTERVAL: Duration = Duration::from_secs(30);
const H2_PING_TIMEOUT: Duration = Duration::from_secs(10);
/// Streams one HTTP/2 connection may have open at once (hyper's default is 200; a runner
/// needs a handful).
const H2_MAX_STREAMS: u32 = 64;
/// Accept errors that mean "no resources now" (file descriptors, buffers): the first
/// retry comes after the minimum, then twice as late each time, up to the maximum.
const ACCEPT_BACKOFF_MIN: Duration = Duration::from_millis(20);
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);
/// Refusals, evictions and accept errors are logged at most once per this interval.
pub const LOG_INTERVAL: Duration = Duration::from_secs(10);

/// Counters of the facade's connection handling (exported as metrics).
#[derive(Debug, Default)]
pub struct FacadeStats {
    /// Connections open now.
    pub open: AtomicUsize,
    /// Connections accepted.
    pub accepted: AtomicU64,
    /// New connections closed at once because a connection limit was reached.
    pub refused: AtomicU64,
    /// Connections still in their TLS handshake closed to make room for a new one.
    pub evicted: AtomicU64,
    /// Handshakes that failed or timed out.
    pub handshake_failures: AtomicU64,
    /// Connections closed after the handshake because their SPIFFE ID holds its limit.
    pub identity_refused: AtomicU64,
    /// Connections closed for idleness (or for not sending a request in time).
    pub idle_closed: AtomicU64,
    /// Failed `accept` calls.
    pub accept_errors: AtomicU64,
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
    /// Set once the handshake succeeded; such connections are never evicted.
    identity: Option<String>,
    evict: Arc<Notify>,
}

#[derive(Default)]
struct TrackerState {
    next_id: u64,
    entries: HashMap<u64, Entry>,
    per_peer: HashMap<IpAddr, usize>,
    per_identity: HashMap<String, usize>,
    /// Connections still in their handshake, oldest (lowest ID) first.
    handshaking: BTreeMap<u64, IpAddr>,
}

impl TrackerState {
    fn remove(&mut self, id: u64) -> Option<Entry> {
        let entry = self.entries.remove(&id)?;
        self.handshaking.remove(&id);
        decrement(&mut self.per_peer, &entry.peer);
        if let Some(identity) = &entry.identity {
            decrement(&mut self.per_identity, identity);
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

/// The connection limits, shared by the accept loop and the connection tasks.
struct Tracker {
    limits: FacadeLimits,
    state: Mutex<TrackerState>,
    stats: Arc<FacadeStats>,
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
            self.tracker.stats.open.fetch_sub(1, Ordering::Relaxed);
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
                evict: evict.clone(),
            },
        );
        s.handshaking.insert(id, peer);
        *s.per_peer.entry(peer).or_default() += 1;
        drop(s);
        self.evicted(evicted);
        self.stats.open.fetch_add(1, Ordering::Relaxed);
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
            inc(&self.stats.evicted);
            self.stats.open.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// The handshake of `slot` succeeded for `identity`: established (never evicted) if
    /// the identity is below its limit.
    fn established(&self, slot: &Slot, identity: &str) -> bool {
        let mut s = self.lock();
        let held = s.per_identity.get(identity).copied().unwrap_or(0);
        if held >= self.limits.max_connections_per_identity {
            return false;
        }
        let Some(entry) = s.entries.get_mut(&slot.id) else {
            // Evicted while the handshake finished.
            return false;
        };
        entry.identity = Some(identity.to_owned());
        s.handshaking.remove(&slot.id);
        *s.per_identity.entry(identity.to_owned()).or_default() += 1;
        true
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

/// Serves `app` over mTLS on `listener` with the default limits until `shutdown`
/// resolves; see [`serve_tls_limited`].
pub async fn serve_tls(
    listener: TcpListener,
    config: Arc<rustls::ServerConfig>,
    app: axum::Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let (trigger, stop) = crate::shutdown::shutdown_channel();
    let watcher = tokio::spawn(async move {
        shutdown.await;
        trigger.trigger();
    });
    let stats = Arc::new(FacadeStats::default());
    let result = serve_with(listener, config, app, FacadeLimits::default(), stats, stop).await;
    watcher.abort();
    result
}

/// Serves `app` over mTLS on `listener` until `shutdown`, then closes connections
/// gracefully (each within [`CLOSE_GRACE`]). HTTP/1.1 and h2 are both served (ALPN).
///
/// The result is `Err` only when the listener itself fails for good.
pub async fn serve_tls_limited(
    listener: TcpListener,
    config: Arc<rustls::ServerConfig>,
    app: axum::Router,
    limits: FacadeLimits,
    stats: Arc<FacadeStats>,
    shutdown: Shutdown,
) -> std::io::Result<()> {
    serve_with(listener, config, app, limits, stats, shutdown).await
}

pub(crate) async fn serve_with(
    mut listener: impl Accept,
    config: Arc<rustls::ServerConfig>,
    app: axum::Router,
    limits: FacadeLimits,
    stats: Arc<FacadeStats>,
    shutdown: Shutdown,
) -> std::io::Result<()> {
    let tracker = Arc::new(Tracker {
        limits,
        state: Mutex::new(TrackerState::default()),
        stats: stats.clone(),
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
        .keep_alive_interval(Some(H2_PING_INTERVAL))
        .keep_alive_timeout(H2_PING_TIMEOUT)
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
                inc(&stats.accept_errors);
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
                inc(&stats.refused);
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
    let limits = tracker.limits;
    let stats = tracker.stats.clone();
    let handshake = tokio::select! {
        _ = slot.evict.notified() => return,
        _ = shutdown.wait() => return,
        done = tokio::time::timeout(limits.tls_handshake_timeout, acceptor.accept(stream)) => done,
    };
    let tls = match handshake {
        Ok(Ok(tls)) => tls,
        Ok(Err(e)) => {
            inc(&stats.handshake_failures);
            tracing::debug!(peer = %remote, error = %e, "facade TLS handshake failed");
            return;
        }
        Err(_) => {
            inc(&stats.handshake_failures);
            tracing::debug!(peer = %remote, timeout = ?limits.tls_handshake_timeout, "facade TLS handshake timed out");
            return;
        }
    };
    let (_, session) = tls.get_ref();
    let certs = session
        .peer_certificates()
        .map(|chain| PeerCerts(chain.iter().map(|c| c.clone().into_owned()).collect()));
    let identity: Option<String> = certs.as_ref().and_then(|c| peer_spiffe_id(&c.0[..]));
    let Some(identity) = identity else {
        inc(&stats.handshake_failures);
        tracing::debug!(peer = %remote, "facade peer without a SPIFFE ID closed");
        return;
    };
    if !tracker.established(&slot, &identity) {
        inc(&stats.identity_refused);
        tracing::debug!(peer = %remote, %identity, "facade connection closed: this SPIFFE ID holds its connection limit");
        return;
    }

    let activity = Arc::new(Activity {
        in_flight: AtomicUsize::new(0),
        requests: AtomicU64::new(0),
        last: Mutex::new(Instant::now()),
    });
    let service = {
        let activity = activity.clone();
        let peer_id = PeerSpiffeId(identity.clone());
        hyper::service::service_fn(move |mut req: hyper::Request<hyper::body::Incoming>| {
            let in_flight = InFlight::start(&activity);
            let extensions = req.extensions_mut();
            extensions.insert(PeerAddr(remote));
            extensions.insert(peer_id.clone());
            if let Some(certs) = &certs {
                extensions.insert(certs.clone());
            }
            let response = app.clone().oneshot(req.map(axum::body::Body::new));
            async move {
                let response = response.await?;
                Ok::<_, std::convert::Infallible>(response.map(|inner| Tracked {
                    inner,
                    _in_flight: in_flight,
                }))
            }
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
                // Until its first request a connection gets the header timeout: a peer
                // that connects and sends nothing holds nothing for long.
                let bound = if activity.requests.load(Ordering::Relaxed) == 0 {
                    limits.header_read_timeout
                } else {
                    limits.idle_timeout
                };
                if activity.idle_for().is_some_and(|idle| idle >= bound) {
                    inc(&stats.idle_closed);
                    tracing::debug!(peer = %remote, %identity, "closing an idle facade connection");
                    conn.as_mut().graceful_shutdown();
                    closing = Some(Instant::now() + CLOSE_GRACE);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
