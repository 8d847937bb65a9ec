//! The facade's mTLS server: every request reaches the application with the peer's
//! verified SPIFFE ID in its extensions.

use std::future::Future;
use std::sync::Arc;

use gdr_identity::tls::{PeerSpiffeId, peer_spiffe_id};
use tokio::net::TcpListener;

/// Serves `app` over mTLS on `listener` until `shutdown` resolves, then drains open
/// connections. HTTP/1.1 and h2 are both served (picked per connection). Every request
/// reaches `app` with the peer's [`PeerSpiffeId`] and connectrpc's `PeerCerts` /
/// `PeerAddr` in its extensions, so axum handlers and Connect handlers
/// (`RequestContext::peer_certs()`) both see who is calling.
///
/// Handshake failures (wrong trust domain, no client certificate) only end that
/// connection; the result is `Err` only when accepting itself fails for good.
pub async fn serve_tls(
    listener: TcpListener,
    config: Arc<rustls::ServerConfig>,
    app: axum::Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = app.layer(axum::middleware::from_fn(stamp_peer_spiffe_id));
    connectrpc::axum::serve_tls(listener, app, config)
        .with_graceful_shutdown(shutdown)
        .await
}

/// Derives [`PeerSpiffeId`] from the certificate chain the accept loop captured.
async fn stamp_peer_spiffe_id(
    mut req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let id = req
        .extensions()
        .get::<connectrpc::server::PeerCerts>()
        .and_then(|certs| peer_spiffe_id(&certs.0));
    if let Some(id) = id {
        req.extensions_mut().insert(PeerSpiffeId(id));
    }
    next.run(req).await
}
