//! The executor's loopback proxy: the official runner's `.runner` `address` points here
//! (plain HTTP on 127.0.0.1), and every request is forwarded to the facade over mTLS
//! with the executor's X.509-SVID.
//!
//! Bodies stream in both directions (hyper's `Incoming` is handed straight to the
//! client and back), so a multi-GiB checkout or artifact upload never sits in memory.
//! The TLS client configuration comes from `spiffe-rustls`; it resolves the current
//! SVID on every handshake, so new connections after a rotation present the new
//! certificate while established ones carry on.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName};
use http::{Request, Response, StatusCode, Uri};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;

/// Bound on TCP connection establishment to the facade.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// HTTP/2 flow-control window of one request to the facade.
const H2_STREAM_WINDOW: u32 = 1024 * 1024;
/// HTTP/2 flow-control window of the whole connection to the facade.
const H2_CONNECTION_WINDOW: u32 = 2 * 1024 * 1024;

/// Errors that stop the proxy (per-request failures become 502 answers instead).
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

    fn target(&self, incoming: &Uri) -> Result<Uri, http::Error> {
        let pq = incoming
            .path_and_query()
            .map(|pq| pq.as_str())
            .unwrap_or("/");
        Uri::builder()
            .scheme(self.scheme.clone())
            .authority(self.authority.clone())
            .path_and_query(format!("{}{}", self.base_path, pq))
            .build()
    }
}

type FacadeClient = Client<HttpsConnector<HttpConnector>, Incoming>;

/// What the runner gets back: the facade's streamed body, or a short error text.
type Body = BoxBody<Bytes, hyper::Error>;

/// Serves the loopback proxy on `listener` until `shutdown` resolves, then lets open
/// requests finish. `facade_url` is `https://host:port[/base]`; `client_config` should
/// come from [`gdr_identity::tls::executor_client_config`] (it must not preset ALPN:
/// the connector offers `h2` and `http/1.1` itself).
pub async fn serve_loopback_proxy(
    listener: TcpListener,
    facade_url: &str,
    client_config: Arc<rustls::ClientConfig>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ProxyError> {
    let upstream = Upstream::parse(facade_url)?;
    let local = listener
        .local_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| "<unknown>".to_string());
    let mut http = HttpConnector::new();
    // The scheme check is the TLS layer's job; HttpConnector would refuse https URIs.
    http.enforce_http(false);
    http.set_connect_timeout(Some(CONNECT_TIMEOUT));
    http.set_nodelay(true);
    let connector = hyper_rustls::HttpsConnectorBuilder::new()
        // Cloning keeps spiffe-rustls' resolver and verifier (both shared, rotating).
        .with_tls_config((*client_config).clone())
        .https_only()
        .enable_all_versions()
        .wrap_connector(http);
    let client: FacadeClient = Client::builder(TokioExecutor::new())
        .timer(TokioTimer::new())
        .pool_timer(TokioTimer::new())
        // What the facade may send ahead of the runner reading it, per download and in
        // all: bounds the executor's buffers (hyper's defaults are 2 and 5 MiB) and still
        // fills a 1 ms round trip at 1 GiB/s.
        .http2_initial_stream_window_size(H2_STREAM_WINDOW)
        .http2_initial_connection_window_size(H2_CONNECTION_WINDOW)
        .build(connector);

    let mut shutdown = std::pin::pin!(shutdown);
    let graceful = GracefulShutdown::new();
    loop {
        let (stream, peer) = tokio::select! {
            biased;
            _ = &mut shutdown => break,
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
        let client = client.clone();
        let upstream = upstream.clone();
        let service = hyper::service::service_fn(move |req: Request<Incoming>| {
            let client = client.clone();
            let upstream = upstream.clone();
            async move {
                Ok::<_, std::convert::Infallible>(forward(&client, &upstream, req, peer).await)
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

async fn forward(
    client: &FacadeClient,
    upstream: &Upstream,
    req: Request<Incoming>,
    peer: SocketAddr,
) -> Response<Body> {
    let (mut parts, body) = req.into_parts();
    let target = match upstream.target(&parts.uri) {
        Ok(t) => t,
        Err(e) => return error_response(StatusCode::BAD_REQUEST, &format!("bad request URI: {e}")),
    };
    strip_hop_by_hop(&mut parts.headers);
    // The Host the runner used names the loopback socket; the client sets the facade's.
    parts.headers.remove(header::HOST);
    let method = parts.method.clone();
    parts.uri = target;
    // Requests to the facade are HTTP/1.1 or h2 as negotiated; hyper picks the wire form.
    parts.version = http::Version::HTTP_11;
    let upstream_req = Request::from_parts(parts, body);
    match client.request(upstream_req).await {
        Ok(resp) => {
            let (mut parts, body) = resp.into_parts();
            strip_hop_by_hop(&mut parts.headers);
            // The runner always sees HTTP/1.1 from us, whatever the facade spoke.
            parts.version = http::Version::HTTP_11;
            Response::from_parts(parts, body.boxed())
        }
        Err(e) => {
            // Paths may carry repository names but never credentials; the error chain
            // says whether TLS (e.g. wrong facade identity) or TCP failed.
            tracing::warn!(%peer, %method, error = ?e, "loopback proxy: facade request failed");
            error_response(
                StatusCode::BAD_GATEWAY,
                &format!("facade {} unreachable: {e}", upstream.authority),
            )
        }
    }
}

fn error_response(status: StatusCode, message: &str) -> Response<Body> {
    let body = Full::new(Bytes::from(message.to_owned()))
        .map_err(|never| match never {})
        .boxed();
    let mut resp = Response::new(body);
    *resp.status_mut() = status;
    resp
}

/// Headers that describe one hop (RFC 9110 §7.6.1), plus whatever `Connection` lists.
fn strip_hop_by_hop(headers: &mut HeaderMap) {
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
