//! The executor's side of the wire to the facade: the mTLS client ([`Facade`]), the calls it
//! sends and the answers it gets ([`Head`], [`Exchange`], [`Failure`]), the RunnerService
//! methods the relay handles ([`Rpc`]) and the answers the executor writes itself.
//!
//! Both the loopback proxy (which takes the runner's requests) and the relay (which sends
//! its RunnerService calls) use these; they live apart from both so that neither has to
//! import the other for them.

use std::time::Duration;

use bytes::Bytes;
use gdr_core::backoff::Backoff;
use http::header::{self, HeaderMap, HeaderName};
use http::{Method, Request, Response, StatusCode, Uri};
use http_body_util::combinators::{BoxBody, UnsyncBoxBody};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};

/// Bound on TCP connection establishment to the facade.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Bound of one buffered call to the facade (the official runner's request timeout).
const UNARY_TIMEOUT: Duration = Duration::from_secs(60);
/// Largest RunnerService request or answer the proxy buffers (a task with its secrets,
/// a log batch).
pub(crate) const MAX_UNARY_BODY: usize = 64 * 1024 * 1024;
/// Waiting for an unreachable facade: quick at first, then every few seconds.
pub(crate) const OUTAGE_BACKOFF: Backoff =
    Backoff::new(Duration::from_millis(200), Duration::from_secs(5));
/// The RunnerService path prefix under the runner's address.
pub(crate) const RUNNER_SERVICE: &str = "/api/actions/runner.v1.RunnerService/";
/// HTTP/2 flow-control window of one request to the facade.
const H2_STREAM_WINDOW: u32 = 1024 * 1024;
/// HTTP/2 flow-control window of the whole connection to the facade.
const H2_CONNECTION_WINDOW: u32 = 2 * 1024 * 1024;

/// Errors that stop the proxy (per-request failures become error answers instead).
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// The facade URL is not `https://host[:port][/base]`.
    #[error("facade URL {url:?} is unusable: {reason}")]
    FacadeUrl {
        /// The URL.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The assignment ID or capability cannot be sent as a header value.
    #[error("the assignment's runner credentials are not valid header values")]
    Credentials,
    /// Accepting connections failed for good.
    #[error("loopback proxy listener {addr}: {source}")]
    Accept {
        /// The listener's address.
        addr: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// Where requests go: the facade's scheme, authority and optional base path.
#[derive(Clone)]
struct Upstream {
    scheme: http::uri::Scheme,
    authority: http::uri::Authority,
    /// Base path without trailing slash ("" for the root).
    base_path: String,
}

impl Upstream {
    fn parse(facade_url: &str) -> Result<Self, ProxyError> {
        let bad = |reason: &str| ProxyError::FacadeUrl {
            url: facade_url.to_string(),
            reason: reason.to_string(),
        };
        let uri: Uri = facade_url.parse().map_err(|_| bad("not a URI"))?;
        let scheme = uri.scheme().cloned().ok_or_else(|| bad("no scheme"))?;
        if scheme != http::uri::Scheme::HTTPS {
            // The facade only speaks mTLS; plain HTTP would leak the capability.
            return Err(bad("the facade must be reached over https"));
        }
        let authority = uri.authority().cloned().ok_or_else(|| bad("no host"))?;
        let base_path = uri.path().trim_end_matches('/').to_string();
        Ok(Upstream {
            scheme,
            authority,
            base_path,
        })
    }

    fn target(&self, path_and_query: &str) -> Result<Uri, http::Error> {
        Uri::builder()
            .scheme(self.scheme.clone())
            .authority(self.authority.clone())
            .path_and_query(format!("{}{}", self.base_path, path_and_query))
            .build()
    }
}

/// The body the facade client sends: a buffered one or a runner's stream.
type ClientBody = UnsyncBoxBody<Bytes, hyper::Error>;
type FacadeClient = Client<HttpsConnector<HttpConnector>, ClientBody>;

/// What the runner gets back: the facade's streamed or buffered body, or a short text.
pub(crate) type Body = BoxBody<Bytes, hyper::Error>;

/// Why a call to the facade got no answer.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Failure {
    /// No request byte reached the facade (connection refused, TLS handshake failed).
    #[error("facade unreachable: {0}")]
    Unreachable(#[source] hyper_util::client::legacy::Error),
    /// The connection failed after (part of) the request was sent, or no answer came in
    /// time: the facade may have acted on it.
    #[error("facade call failed: {0}")]
    Lost(#[source] Box<dyn std::error::Error + Send + Sync>),
}

/// A request's method, target and headers, kept to send it again.
#[derive(Debug, Clone)]
pub(crate) struct Head {
    pub(crate) method: Method,
    pub(crate) path_and_query: String,
    pub(crate) headers: HeaderMap,
}

impl Head {
    /// The same call to another RunnerService method (the relay's deliveries).
    pub(crate) fn for_method(&self, method: &str) -> Head {
        let mut head = self.clone();
        head.path_and_query = format!("{RUNNER_SERVICE}{method}");
        // The runner's deadline was for its own call, not for a delivery.
        head.headers.remove("connect-timeout-ms");
        head
    }

    /// The caller's own deadline (`Connect-Timeout-Ms`), if it sent one.
    pub(crate) fn deadline(&self) -> Option<Duration> {
        self.headers
            .get("connect-timeout-ms")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map(Duration::from_millis)
    }
}

/// A buffered answer of the facade.
#[derive(Debug)]
pub(crate) struct Exchange {
    pub(crate) status: StatusCode,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
}

impl Exchange {
    /// The answer as the runner gets it.
    pub(crate) fn into_response(self) -> Response<Body> {
        let mut resp = Response::new(full(self.body));
        *resp.status_mut() = self.status;
        *resp.headers_mut() = self.headers;
        // The body is whole now; hyper frames it.
        resp.headers_mut().remove(header::CONTENT_LENGTH);
        resp
    }
}

/// The facade, reached over mTLS.
#[derive(Clone)]
pub(crate) struct Facade {
    client: FacadeClient,
    upstream: Upstream,
    /// Whether the facade has answered any request yet: the runner's first call proves
    /// the channel (mTLS, the facade's identity, the route), so no probe of its own is
    /// sent before the runner starts.
    answered: std::sync::Arc<tokio::sync::watch::Sender<bool>>,
}

impl Facade {
    /// A client for `facade_url` with `client_config` (it must not preset ALPN: the
    /// connector offers `h2` and `http/1.1` itself).
    pub(crate) fn new(
        facade_url: &str,
        client_config: &rustls::ClientConfig,
    ) -> Result<Self, ProxyError> {
        let upstream = Upstream::parse(facade_url)?;
        let mut http = HttpConnector::new();
        // The scheme check is the TLS layer's job; HttpConnector would refuse https URIs.
        http.enforce_http(false);
        http.set_connect_timeout(Some(CONNECT_TIMEOUT));
        http.set_nodelay(true);
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            // Cloning keeps spiffe-rustls' resolver and verifier (both shared, rotating).
            .with_tls_config(client_config.clone())
            .https_only()
            .enable_all_versions()
            .wrap_connector(http);
        let client: FacadeClient = Client::builder(TokioExecutor::new())
            .timer(TokioTimer::new())
            .pool_timer(TokioTimer::new())
            // What the facade may send ahead of the runner reading it, per download and
            // in all: bounds the executor's buffers (hyper's defaults are 2 and 5 MiB) and
            // still fills a 1 ms round trip at 1 GiB/s.
            .http2_initial_stream_window_size(H2_STREAM_WINDOW)
            .http2_initial_connection_window_size(H2_CONNECTION_WINDOW)
            .build(connector);
        Ok(Facade {
            client,
            upstream,
            answered: std::sync::Arc::new(tokio::sync::watch::Sender::new(false)),
        })
    }

    /// Whether the facade answers a request within `bound` (or has answered one before).
    pub(crate) async fn answered_within(&self, bound: Duration) -> bool {
        let mut answered = self.answered.subscribe();
        tokio::time::timeout(bound, answered.wait_for(|a| *a))
            .await
            .is_ok_and(|seen| seen.is_ok())
    }

    /// The facade's host and port, for messages.
    pub(crate) fn authority(&self) -> &str {
        self.upstream.authority.as_str()
    }

    pub(crate) fn request(
        &self,
        head: &Head,
        body: ClientBody,
    ) -> Result<Request<ClientBody>, http::Error> {
        let mut req = Request::builder()
            .method(head.method.clone())
            .uri(self.upstream.target(&head.path_and_query)?)
            // Requests to the facade are HTTP/1.1 or h2 as negotiated; hyper picks the form.
            .version(http::Version::HTTP_11)
            .body(body)?;
        *req.headers_mut() = head.headers.clone();
        Ok(req)
    }

    pub(crate) async fn send(
        &self,
        req: Request<ClientBody>,
    ) -> Result<Response<Incoming>, Failure> {
        let response = self.client.request(req).await.map_err(|e| {
            if e.is_connect() {
                Failure::Unreachable(e)
            } else {
                Failure::Lost(Box::new(e))
            }
        })?;
        self.answered
            .send_if_modified(|a| !std::mem::replace(a, true));
        Ok(response)
    }

    /// One buffered call: the whole request body, the whole answer (both bounded).
    pub(crate) async fn unary(&self, head: &Head, body: Bytes) -> Result<Exchange, Failure> {
        let mut head = head.clone();
        // The body may not be the one the head came with (a delivery); hyper frames it.
        head.headers.remove(header::CONTENT_LENGTH);
        let head = &head;
        let req = self
            .request(
                head,
                Full::new(body)
                    .map_err(|never| match never {})
                    .boxed_unsync(),
            )
            .map_err(|e| Failure::Lost(Box::new(e)))?;
        let call = async {
            let resp = self.send(req).await?;
            let (mut parts, body) = resp.into_parts();
            let body = Limited::new(body, MAX_UNARY_BODY)
                .collect()
                .await
                .map_err(Failure::Lost)?
                .to_bytes();
            strip_hop_by_hop(&mut parts.headers);
            Ok(Exchange {
                status: parts.status,
                headers: parts.headers,
                body,
            })
        };
        tokio::time::timeout(UNARY_TIMEOUT, call)
            .await
            .unwrap_or_else(|elapsed| Err(Failure::Lost(Box::new(elapsed))))
    }
}

/// A RunnerService method the relay handles itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Rpc {
    Declare,
    FetchTask,
    UpdateTask,
    UpdateLog,
    /// Any other method (Register): buffered and retried while unreachable, no more.
    Other,
}

impl Rpc {
    /// The method of a binary-protobuf Connect call to the RunnerService, if `head` is one.
    /// Other encodings pass through as ordinary requests (the official runner sends
    /// uncompressed `application/proto`).
    pub(crate) fn of(head: &Head) -> Option<Rpc> {
        let method = head.path_and_query.strip_prefix(RUNNER_SERVICE)?;
        let proto = head
            .headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.trim().eq_ignore_ascii_case("application/proto"));
        if head.method != Method::POST
            || !proto
            || head.headers.contains_key(header::CONTENT_ENCODING)
        {
            return None;
        }
        Some(match method {
            "Declare" => Rpc::Declare,
            "FetchTask" => Rpc::FetchTask,
            "UpdateTask" => Rpc::UpdateTask,
            "UpdateLog" => Rpc::UpdateLog,
            _ => Rpc::Other,
        })
    }
}

fn full(bytes: Bytes) -> Body {
    Full::new(bytes).map_err(|never| match never {}).boxed()
}

/// A short plain-text answer of the proxy itself.
pub(crate) fn error_response(status: StatusCode, message: &str) -> Response<Body> {
    let mut resp = Response::new(full(Bytes::from(message.to_owned())));
    *resp.status_mut() = status;
    resp
}

/// A Connect unary answer of the relay itself (binary protobuf).
pub(crate) fn proto_response(body: Vec<u8>) -> Response<Body> {
    let mut resp = Response::new(full(Bytes::from(body)));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/proto"),
    );
    resp
}

/// Headers that describe one hop (RFC 9110 §7.6.1), plus whatever `Connection` lists.
pub(crate) fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let listed: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in listed {
        headers.remove(name);
    }
    for name in [
        header::CONNECTION,
        header::PROXY_AUTHENTICATE,
        header::PROXY_AUTHORIZATION,
        header::TE,
        header::TRAILER,
        header::TRANSFER_ENCODING,
        header::UPGRADE,
    ] {
        headers.remove(name);
    }
    headers.remove("keep-alive");
    headers.remove("proxy-connection");
}
