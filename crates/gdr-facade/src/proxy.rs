//! Reverse proxy from the facade to Gitea for everything that is not the runner API:
//! git smart-HTTP (checkout), `/api/v1`, `/api/actions_pipeline`, artifact twirp calls.
//! The official runner uses its `.runner` address for all of these, and that address is
//! the executor's loopback proxy, which ends here. Only the executor of a live assignment
//! gets here (the facade authenticates it first, see [`super::Facade::app`]).
//!
//! Gitea trusts what a request says about its sender more than a job should be able to
//! make it: a reverse-proxy login (`X-WEBAUTH-USER`), session cookies, `Sudo`, forwarding
//! headers. So only the request headers of [`FORWARDED_REQUEST_HEADERS`] are sent on,
//! each because a client of the pass-through needs it; the job authenticates to Gitea with
//! its own task token (`Authorization`), never with anything of the controller's.
//!
//! Bodies stream in both directions (hyper bodies are passed through, never collected),
//! so a large checkout or artifact costs bounded memory. Every upstream call is bounded
//! ([`UpstreamTimeouts`]): connecting, waiting for the answer's head while nothing moves,
//! and pauses within the answer; a transfer that keeps moving is never cut.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use hyper::body::{Frame, SizeHint};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::time::Instant;

use gdr_gitea::GiteaError;

/// The request headers sent on to Gitea, each with why a client of the pass-through
/// needs it; every other header is dropped. Among the dropped ones, always: Gitea's
/// reverse-proxy login (`[security] REVERSE_PROXY_AUTHENTICATION_USER`/`_EMAIL`/
/// `_FULL_NAME`, by default `X-WEBAUTH-USER`, `X-WEBAUTH-EMAIL`, `X-WEBAUTH-FULLNAME`,
/// and whatever names an operator configured instead), `Cookie` (a Gitea session),
/// `Sudo` (an admin token acting as another user), `X-Gitea-OTP`, client-sent forwarding
/// headers (the facade writes its own), hop-by-hop headers, the facade's own runner
/// credentials (`x-runner-uuid`, `x-runner-token`) and `Host` (the client sets Gitea's).
pub const FORWARDED_REQUEST_HEADERS: &[(&str, &str)] = &[
    (
        "authorization",
        "the job's own task token: git's Basic auth on checkout, `token` on /api/v1, \
         `Bearer` ACTIONS_RUNTIME_TOKEN on artifact calls",
    ),
    (
        "content-type",
        "the body's type: git-upload-pack requests, JSON, twirp's protobuf JSON",
    ),
    (
        "content-encoding",
        "gzip request bodies (git negotiation, v3 artifact chunks, whose encoding Gitea stores)",
    ),
    (
        "content-length",
        "v4 artifact blocks are sized by it; also keeps a sized upload unchunked",
    ),
    (
        "content-range",
        "a v3 artifact chunk's position in its file",
    ),
    ("x-tfs-filelength", "a v3 artifact file's total length"),
    ("x-actions-results-md5", "a v3 artifact chunk's checksum"),
    ("x-actions-results-crc64", "a v3 artifact chunk's checksum"),
    (
        "git-protocol",
        "git's wire protocol version (v2), passed to git as GIT_PROTOCOL",
    ),
    (
        "accept",
        "content negotiation (git, LFS, artifact API versions)",
    ),
    ("accept-encoding", "compressed answers (git, downloads)"),
    ("accept-language", "content negotiation of /api/v1 messages"),
    ("cache-control", "git asks for uncached ref advertisements"),
    (
        "pragma",
        "git asks for uncached ref advertisements (HTTP/1.0 form)",
    ),
    ("range", "partial and resumed downloads"),
    ("if-match", "conditional requests"),
    ("if-none-match", "conditional requests (cached downloads)"),
    (
        "if-modified-since",
        "conditional requests (cached downloads)",
    ),
    ("if-unmodified-since", "conditional requests"),
    ("if-range", "resumed downloads"),
    (
        "user-agent",
        "Gitea tells git and LFS clients apart by it, and logs it",
    ),
];

/// Names of Gitea's reverse-proxy login headers by default; never in
/// [`FORWARDED_REQUEST_HEADERS`] (a test holds the two apart).
pub const REVERSE_PROXY_LOGIN_HEADERS: &[&str] =
    &["x-webauth-user", "x-webauth-email", "x-webauth-fullname"];

/// Headers that belong to one hop only (RFC 9110 §7.6.1).
const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// Bounds of every call the pass-through makes to Gitea. None bounds a whole transfer:
/// a checkout or an artifact that keeps moving takes as long as it takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UpstreamTimeouts {
    /// Establishing the TCP connection.
    pub connect: Duration,
    /// Waiting for the answer's head while nothing moves: counted from the request's start
    /// and again from every piece of its body sent (an upload is answered after its last
    /// byte). Also bounds a TLS handshake with an https Gitea.
    pub response: Duration,
    /// The longest pause within the answer's body.
    pub idle: Duration,
}

impl Default for UpstreamTimeouts {
    /// Gitea answers most calls at once; the slowest head is a large artifact's
    /// confirmation, which merges its chunks before answering, and a big repository's pack,
    /// which git computes before sending (with keep-alive packets only once it streams).
    fn default() -> Self {
        UpstreamTimeouts {
            connect: Duration::from_secs(10),
            response: Duration::from_secs(300),
            idle: Duration::from_secs(300),
        }
    }
}

/// Forwards requests to one upstream base URL.
#[derive(Clone)]
pub struct ReverseProxy {
    client: Client<hyper_rustls::HttpsConnector<HttpConnector>, Body>,
    base: Arc<url::Url>,
    timeouts: UpstreamTimeouts,
}

impl ReverseProxy {
    /// A proxy to `base` (Gitea's URL; a path prefix is kept), trusting the system roots
    /// plus `extra_ca_pem` for https, with the default [`UpstreamTimeouts`].
    pub fn new(base: &str, extra_ca_pem: Option<&[u8]>) -> Result<Self, GiteaError> {
        Self::with_timeouts(base, extra_ca_pem, UpstreamTimeouts::default())
    }

    /// [`Self::new`] with other bounds of the upstream calls.
    pub fn with_timeouts(
        base: &str,
        extra_ca_pem: Option<&[u8]>,
        timeouts: UpstreamTimeouts,
    ) -> Result<Self, GiteaError> {
        let base = url::Url::parse(base).map_err(|e| {
            GiteaError::config_caused(format!("upstream URL {base:?} is invalid"), e)
        })?;
        let tls = gdr_gitea::tls_config(extra_ca_pem)?;
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_nodelay(true);
        http.set_connect_timeout(Some(timeouts.connect));
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .enable_http2()
            .wrap_connector(http);
        Ok(ReverseProxy {
            client: Client::builder(TokioExecutor::new()).build(connector),
            base: Arc::new(base),
            timeouts,
        })
    }

    fn upstream_uri(&self, uri: &Uri) -> Result<Uri, String> {
        let prefix = self.base.as_str().trim_end_matches('/');
        let path_and_query = uri.path_and_query().map_or("/", |p| p.as_str());
        format!("{prefix}{path_and_query}")
            .parse::<Uri>()
            .map_err(|e| e.to_string())
    }

    /// Forwards one request and streams the answer back.
    pub async fn forward(&self, request: Request) -> Response {
        let upstream = match self.upstream_uri(request.uri()) {
            Ok(u) => u,
            Err(e) => {
                return (
                    StatusCode::BAD_REQUEST,
                    format!("cannot proxy this path: {e}\n"),
                )
                    .into_response();
            }
        };
        let path = request.uri().path().to_string();
        let method = request.method().clone();
        let peer = request
            .extensions()
            .get::<connectrpc::server::PeerAddr>()
            .map(|a| a.0.ip().to_string());
        let (mut parts, body) = request.into_parts();
        parts.uri = upstream;
        // The executor may reach us over h2; the upstream connection picks its own
        // version (hyper refuses an HTTP/2 request on an HTTP/1 connection).
        parts.version = axum::http::Version::HTTP_11;
        let mut headers = forwarded_headers(&parts.headers);
        // This facade is the first proxy: the peer is the whole chain.
        if let Some(ip) = peer.and_then(|p| HeaderValue::from_str(&p).ok()) {
            headers.insert(HeaderName::from_static("x-forwarded-for"), ip);
        }
        headers.insert(
            HeaderName::from_static("x-forwarded-proto"),
            HeaderValue::from_static("https"),
        );
        parts.headers = headers;
        let progress = Arc::new(Progress::new());
        let body = Body::new(Watched {
            inner: body,
            progress: progress.clone(),
        });
        let request = Request::from_parts(parts, body);
        let bound = self.timeouts.response;
        let answer = tokio::select! {
            answer = self.client.request(request) => answer,
            () = progress.stalled(bound) => {
                tracing::warn!(%method, path, timeout = ?bound, "Gitea did not answer the pass-through in time; the executor gets 504");
                return (
                    StatusCode::GATEWAY_TIMEOUT,
                    format!("Gitea did not answer within {bound:?} (facade pass-through)\n"),
                )
                    .into_response();
            }
        };
        match answer {
            Ok(response) => {
                let (mut parts, body) = response.into_parts();
                strip_hop_by_hop(&mut parts.headers);
                Response::from_parts(parts, Body::new(Idle::new(body, self.timeouts.idle)))
            }
            Err(e) => {
                tracing::warn!(%method, path, error = %e, "proxying to Gitea failed");
                (
                    StatusCode::BAD_GATEWAY,
                    "Gitea is unreachable from the facade\n",
                )
                    .into_response()
            }
        }
    }
}

/// The headers of [`FORWARDED_REQUEST_HEADERS`] that `headers` holds, all their values.
fn forwarded_headers(headers: &HeaderMap) -> HeaderMap {
    let mut out = HeaderMap::new();
    for (name, _) in FORWARDED_REQUEST_HEADERS {
        for value in headers.get_all(*name) {
            out.append(HeaderName::from_static(name), value.clone());
        }
    }
    out
}

/// When a request last made progress: its start, then every piece of its body sent.
struct Progress {
    last: Mutex<Instant>,
}

impl Progress {
    fn new() -> Self {
        Progress {
            last: Mutex::new(Instant::now()),
        }
    }

    fn touch(&self) {
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
    }

    /// Resolves once nothing moved for `bound`.
    async fn stalled(&self, bound: Duration) {
        loop {
            let deadline = *self.last.lock().unwrap_or_else(|p| p.into_inner()) + bound;
            if Instant::now() >= deadline {
                return;
            }
            tokio::time::sleep_until(deadline).await;
        }
    }
}

/// A request body that records its progress.
struct Watched {
    inner: Body,
    progress: Arc<Progress>,
}

impl hyper::body::Body for Watched {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if polled.is_ready() {
            self.progress.touch();
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Gitea paused within an answer for longer than the idle bound.
#[derive(Debug, thiserror::Error)]
#[error("Gitea sent nothing of its answer for {0:?}")]
struct IdleTimeout(Duration);

/// An answer body that fails once it pauses for longer than its bound.
struct Idle {
    inner: hyper::body::Incoming,
    bound: Duration,
    timer: Pin<Box<tokio::time::Sleep>>,
}

impl Idle {
    fn new(inner: hyper::body::Incoming, bound: Duration) -> Self {
        Idle {
            inner,
            bound,
            timer: Box::pin(tokio::time::sleep(bound)),
        }
    }
}

impl hyper::body::Body for Idle {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(frame) => {
                let deadline = Instant::now() + this.bound;
                this.timer.as_mut().reset(deadline);
                Poll::Ready(frame.map(|f| f.map_err(Into::into)))
            }
            Poll::Pending => match this.timer.as_mut().poll(cx) {
                Poll::Ready(()) => {
                    tracing::warn!(timeout = ?this.bound, "Gitea paused its pass-through answer too long; the transfer is cut");
                    Poll::Ready(Some(Err(IdleTimeout(this.bound).into())))
                }
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // Headers named in Connection are hop-by-hop too.
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in HOP_BY_HOP {
        headers.remove(*name);
    }
}

/// axum handler: `Router::fallback(proxy::handler).with_state(proxy)`.
pub async fn handler(State(proxy): State<ReverseProxy>, request: Request) -> Response {
    proxy.forward(request).await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// DESIGN invariant 15: the allow-list never lets through what Gitea would take as the
    /// sender's identity (a reverse-proxy login, a session, `Sudo`), a forwarding header a
    /// client could forge, a hop-by-hop header or the facade's own credentials, and every
    /// entry is a valid lowercase header name with its reason.
    #[test]
    fn the_forwarded_headers_hold_no_identity_forwarding_hop_by_hop_or_facade_header() {
        let never: Vec<&str> = REVERSE_PROXY_LOGIN_HEADERS
            .iter()
            .chain(HOP_BY_HOP)
            .copied()
            .chain([
                "cookie",
                "sudo",
                "x-gitea-otp",
                "host",
                "forwarded",
                "x-forwarded-for",
                "x-forwarded-host",
                "x-forwarded-proto",
                "x-real-ip",
                gdr_gitea::UUID_HEADER,
                gdr_gitea::TOKEN_HEADER,
            ])
            .collect();
        for (name, why) in FORWARDED_REQUEST_HEADERS {
            assert!(!never.contains(name), "{name} must never be forwarded");
            assert_eq!(HeaderName::from_bytes(name.as_bytes()).unwrap(), *name);
            assert!(!why.is_empty(), "{name} needs its reason");
        }
        let mut sent = HeaderMap::new();
        for name in never.iter().chain(["x-anything-else"].iter()) {
            sent.insert(
                HeaderName::from_bytes(name.as_bytes()).unwrap(),
                HeaderValue::from_static("forged"),
            );
        }
        sent.append(header::ACCEPT, HeaderValue::from_static("a"));
        sent.append(header::ACCEPT, HeaderValue::from_static("b"));
        let kept = forwarded_headers(&sent);
        assert_eq!(kept.len(), 2, "{kept:?}");
        assert_eq!(kept.get_all(header::ACCEPT).iter().count(), 2);
    }
}
