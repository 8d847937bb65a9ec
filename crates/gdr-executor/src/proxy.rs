//! The executor's loopback proxy: the official runner's `.runner` `address` points here
//! (plain HTTP on 127.0.0.1), and every request is forwarded to the facade over mTLS
//! with the executor's X.509-SVID.
//!
//! Bodies of ordinary requests (checkout, artifacts) stream in both directions, so a
//! multi-GiB transfer never sits in memory. The runner's RunnerService calls are small and
//! go through the [`Relay`], which rides out facade outages (DESIGN invariant 19): while
//! the facade is unreachable it waits and retries instead of answering 502, and it holds
//! the runner's reports until the facade has them.
//!
//! "Unreachable" means no request byte reached the facade: the TCP connection was refused
//! or the TLS handshake failed (also a facade that is not the expected SPIFFE ID). Such a
//! request is sent again, for as long as its caller's deadline (`Connect-Timeout-Ms`) or
//! the outage tolerance allows. A streamed body is replayed only if none of it was read.
//!
//! Every request the proxy sends carries the assignment's runner credentials
//! (`x-runner-uuid`, `x-runner-token`), not only the RunnerService calls the runner itself
//! authenticates: the facade binds each connection to the assignment they name and lets
//! only a live assignment's executor use its pass-through to Gitea (checkout, artifacts).
//!
//! The TLS client configuration comes from `spiffe-rustls`; it resolves the current SVID
//! on every handshake, so new connections after a rotation present the new certificate
//! while established ones carry on.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use gdr_shutdown::Shutdown;
use http::header::{self, HeaderMap, HeaderName};
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use hyper::body::{Frame, Incoming, SizeHint};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::time::Instant;

use crate::relay::Relay;
pub use crate::upstream::ProxyError;
use crate::upstream::{
    Body, Failure, Head, MAX_UNARY_BODY, OUTAGE_BACKOFF, Rpc, error_response, strip_hop_by_hop,
};

/// Header naming the assignment (the runner UUID of its `.runner`).
const UUID_HEADER: HeaderName = HeaderName::from_static("x-runner-uuid");
/// Header carrying the assignment's capability (the runner token of its `.runner`).
const TOKEN_HEADER: HeaderName = HeaderName::from_static("x-runner-token");

/// The assignment's runner credentials, set on every request the proxy sends.
#[derive(Clone)]
pub struct RunnerCredentials {
    uuid: http::HeaderValue,
    token: http::HeaderValue,
}

impl RunnerCredentials {
    /// The credentials of `assignment_id` with its `capability`.
    pub fn new(assignment_id: &str, capability: &str) -> Result<Self, ProxyError> {
        let uuid =
            http::HeaderValue::from_str(assignment_id).map_err(|_| ProxyError::Credentials)?;
        let mut token =
            http::HeaderValue::from_str(capability).map_err(|_| ProxyError::Credentials)?;
        // Kept out of HPACK tables and `Debug` output.
        token.set_sensitive(true);
        Ok(RunnerCredentials { uuid, token })
    }

    /// Sets them on `headers`, replacing whatever a client sent: the proxy speaks for its
    /// assignment only.
    fn apply(&self, headers: &mut HeaderMap) {
        headers.insert(UUID_HEADER, self.uuid.clone());
        headers.insert(TOKEN_HEADER, self.token.clone());
    }
}

impl std::fmt::Debug for RunnerCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunnerCredentials")
            .field("uuid", &self.uuid)
            .field("token", &"<redacted>")
            .finish()
    }
}

/// Serves the loopback proxy on `listener` until `shutdown` is triggered, then lets open
/// requests finish. The relay holds the facade client (see [`Relay::new`]); every request
/// it sends carries `credentials`.
pub async fn serve_loopback_proxy(
    listener: TcpListener,
    relay: Arc<Relay>,
    credentials: RunnerCredentials,
    shutdown: Shutdown,
) -> Result<(), ProxyError> {
    let credentials = Arc::new(credentials);
    let local = listener
        .local_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| "<unknown>".to_string());
    let graceful = GracefulShutdown::new();
    loop {
        let (stream, peer) = tokio::select! {
            biased;
            _ = shutdown.wait() => break,
            accepted = listener.accept() => match accepted {
                Ok(conn) => conn,
                // Too many open files and the like pass; keep serving.
                Err(e) if is_transient(&e) => {
                    tracing::warn!(error = %e, "loopback proxy: transient accept error");
                    continue;
                }
                Err(source) => return Err(ProxyError::Accept { addr: local, source }),
            },
        };
        let _ = stream.set_nodelay(true);
        let relay = relay.clone();
        let credentials = credentials.clone();
        let service = hyper::service::service_fn(move |req: Request<Incoming>| {
            let relay = relay.clone();
            let credentials = credentials.clone();
            async move {
                Ok::<_, std::convert::Infallible>(handle(&relay, &credentials, req, peer).await)
            }
        });
        let conn = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .serve_connection(TokioIo::new(stream), service);
        let watched = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = watched.await {
                tracing::debug!(%peer, error = %e, "loopback proxy connection ended with an error");
            }
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

fn is_transient(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(
        e.kind(),
        ConnectionAborted | ConnectionReset | Interrupted | WouldBlock
    ) || matches!(e.raw_os_error(), Some(23 | 24)) // ENFILE, EMFILE
}

async fn handle(
    relay: &Relay,
    credentials: &RunnerCredentials,
    req: Request<Incoming>,
    peer: SocketAddr,
) -> Response<Body> {
    let (mut parts, body) = req.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    // The Host the runner used names the loopback socket; the client sets the facade's.
    parts.headers.remove(header::HOST);
    // The official runner authenticates only its RunnerService calls; the facade wants
    // every request, pass-through included, to name the assignment. The relay's deliveries
    // are built from these heads, so they carry them too.
    credentials.apply(&mut parts.headers);
    let mut head = Head {
        method: parts.method,
        path_and_query: parts
            .uri
            .path_and_query()
            .map_or_else(|| "/".to_owned(), |pq| pq.as_str().to_owned()),
        headers: parts.headers,
    };
    match Rpc::of(&head) {
        Some(rpc) => {
            let body = match Limited::new(body, MAX_UNARY_BODY).collect().await {
                Ok(collected) => collected.to_bytes(),
                Err(e) => {
                    return error_response(
                        StatusCode::PAYLOAD_TOO_LARGE,
                        &format!("request body unreadable or above {MAX_UNARY_BODY} bytes: {e}"),
                    );
                }
            };
            // The relay reads the answers: ask for them uncompressed.
            head.headers.remove(header::ACCEPT_ENCODING);
            relay.rpc(rpc, head, body).await
        }
        None => stream(relay, head, body, peer).await,
    }
}

/// Forwards an ordinary request with its body streamed. While the facade is unreachable
/// and none of the body was read, the request waits and is sent again.
async fn stream(relay: &Relay, head: Head, body: Incoming, peer: SocketAddr) -> Response<Body> {
    let facade = relay.facade();
    let deadline = Instant::now() + head.deadline().unwrap_or(relay.tolerance());
    let mut body = Some(body);
    let mut attempt = 0u32;
    loop {
        let Some(current) = body.take() else {
            return error_response(StatusCode::BAD_GATEWAY, "request body lost");
        };
        let replay = Replayable::new(current);
        let slot = replay.slot.clone();
        let started = replay.started.clone();
        let req = match facade.request(&head, replay.boxed_unsync()) {
            Ok(r) => r,
            Err(e) => {
                return error_response(StatusCode::BAD_REQUEST, &format!("bad request URI: {e}"));
            }
        };
        let failure = match facade.send(req).await {
            Ok(resp) => {
                let (mut parts, body) = resp.into_parts();
                strip_hop_by_hop(&mut parts.headers);
                // The runner always sees HTTP/1.1 from us, whatever the facade spoke.
                parts.version = http::Version::HTTP_11;
                return Response::from_parts(parts, body.boxed());
            }
            Err(failure) => failure,
        };
        let delay = OUTAGE_BACKOFF.delay(attempt);
        let retry = matches!(failure, Failure::Unreachable(_))
            && !started.load(Ordering::SeqCst)
            && Instant::now() + delay < deadline;
        body = slot.lock().unwrap_or_else(|p| p.into_inner()).take();
        if !retry || body.is_none() {
            // Paths may carry repository names but never credentials; the error chain
            // says whether TLS (e.g. wrong facade identity) or TCP failed.
            tracing::warn!(%peer, method = %head.method, error = ?failure, "loopback proxy: facade request failed");
            return error_response(
                StatusCode::BAD_GATEWAY,
                &format!("facade {} unreachable: {failure}", facade.authority()),
            );
        }
        if attempt == 0 {
            tracing::warn!(%peer, method = %head.method, error = %failure, "facade unreachable; waiting to send the request again");
        }
        tokio::time::sleep(delay).await;
        attempt += 1;
    }
}

/// A runner's streamed body that can be taken back for a second attempt as long as
/// nothing of it was read (a connect or TLS failure happens before the body is polled).
struct Replayable {
    slot: Arc<Mutex<Option<Incoming>>>,
    started: Arc<AtomicBool>,
}

impl Replayable {
    fn new(body: Incoming) -> Self {
        Replayable {
            slot: Arc::new(Mutex::new(Some(body))),
            started: Arc::new(AtomicBool::new(false)),
        }
    }
}

impl hyper::body::Body for Replayable {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        self.started.store(true, Ordering::SeqCst);
        let mut slot = self.slot.lock().unwrap_or_else(|p| p.into_inner());
        match slot.as_mut() {
            Some(body) => Pin::new(body).poll_frame(cx),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.slot
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .is_none_or(|b| b.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        self.slot
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), |b| b.size_hint())
    }
}
