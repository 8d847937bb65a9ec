//! Reverse proxy from the facade to Gitea for everything that is not the runner API:
//! git smart-HTTP (checkout), `/api/v1`, `/api/actions_pipeline`, artifact twirp calls.
//! The official runner uses its `.runner` address for all of these, and that address is
//! the executor's loopback proxy, which ends here.
//!
//! Bodies stream in both directions (hyper bodies are passed through, never collected),
//! so a large checkout or artifact costs bounded memory.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use crate::gitea::{GiteaError, TOKEN_HEADER, UUID_HEADER};

/// Forwarding headers a client may send but only a proxy may write: a client's own would
/// be believed by Gitea as where the request came from.
const FORWARDING: &[&str] = &[
    "forwarded",
    "x-forwarded-for",
    "x-forwarded-host",
    "x-forwarded-proto",
    "x-forwarded-port",
    "x-forwarded-server",
    "x-real-ip",
];

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

/// Forwards requests to one upstream base URL.
#[derive(Clone)]
pub struct ReverseProxy {
    client: Client<hyper_rustls::HttpsConnector<HttpConnector>, Body>,
    base: Arc<url::Url>,
}

impl ReverseProxy {
    /// A proxy to `base` (Gitea's URL; a path prefix is kept), trusting the system roots
    /// plus `extra_ca_pem` for https.
    pub fn new(base: &str, extra_ca_pem: Option<&[u8]>) -> Result<Self, GiteaError> {
        let base = url::Url::parse(base)
            .map_err(|e| GiteaError::config(format!("upstream URL {base:?} is invalid: {e}")))?;
        let tls = crate::gitea::tls_config(extra_ca_pem)?;
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_nodelay(true);
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .enable_http2()
            .wrap_connector(http);
        Ok(ReverseProxy {
            client: Client::builder(TokioExecutor::new()).build(connector),
            base: Arc::new(base),
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
    pub async fn forward(&self, mut request: Request) -> Response {
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
        *request.uri_mut() = upstream;
        // The executor may reach us over h2; the upstream connection picks its own
        // version (hyper refuses an HTTP/2 request on an HTTP/1 connection).
        *request.version_mut() = axum::http::Version::HTTP_11;
        let peer = request
            .extensions()
            .get::<connectrpc::server::PeerAddr>()
            .map(|a| a.0.ip().to_string());
        let headers = request.headers_mut();
        strip_hop_by_hop(headers);
        headers.remove(header::HOST);
        for name in FORWARDING {
            headers.remove(*name);
        }
        // The assignment's runner credential is for the facade only, never for Gitea.
        headers.remove(UUID_HEADER);
        headers.remove(TOKEN_HEADER);
        // This facade is the first proxy: the peer is the whole chain.
        if let Some(ip) = peer.and_then(|p| HeaderValue::from_str(&p).ok()) {
            headers.insert(HeaderName::from_static("x-forwarded-for"), ip);
        }
        headers.insert(
            HeaderName::from_static("x-forwarded-proto"),
            HeaderValue::from_static("https"),
        );
        match self.client.request(request).await {
            Ok(response) => {
                let (mut parts, body) = response.into_parts();
                strip_hop_by_hop(&mut parts.headers);
                Response::from_parts(parts, Body::new(body))
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
