//! Adapter: SPIFFE X.509-SVIDs (from the Workload API) turned into rustls configurations,
//! and an mTLS HTTP server that tells handlers who the peer is.
//!
//! The facade's configuration comes from `spiffe-rustls`, which watches the [`X509Source`] and
//! swaps the certificate, key and trust bundle on every rotation, so a configuration
//! built once keeps serving with the current SVID for the life of the process. TLS
//! session resumption is off there by design: a resumed session would skip the peer
//! check and could outlive a short-lived SVID. The executor's client configuration is
//! in [`crate::svid_stream`] (one Workload API stream instead of `X509Source`'s two).
//!
//! Crypto provider: `spiffe-rustls` is compiled with `aws-lc-rs` only and installs it as
//! the process default when none is set; nothing here pulls in `ring`.

use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::CertificateDer;
use spiffe::{TrustDomain, X509Source};
use spiffe_rustls::{TrustDomainPolicy, authorizer};

/// How long [`x509_source`] waits for the first SVID before giving up.
pub const DEFAULT_INITIAL_SYNC_TIMEOUT: Duration = Duration::from_secs(30);

/// Errors of the SPIFFE/mTLS layer; each names the socket, ID or trust domain involved.
#[derive(Debug, thiserror::Error)]
pub enum SpiffeError {
    #[error(
        "SPIFFE Workload API at {endpoint} gave no X.509-SVID (is the socket there and does \
         this workload have an identity?): {source}"
    )]
    Source {
        endpoint: String,
        #[source]
        source: spiffe::x509_source::X509SourceError,
    },
    #[error("{value:?} is not a valid {what}: {source}")]
    Invalid {
        what: &'static str,
        value: String,
        #[source]
        source: spiffe::SpiffeIdError,
    },
    #[error("building the {side} mTLS configuration: {source}")]
    Config {
        side: &'static str,
        #[source]
        source: spiffe_rustls::Error,
    },
}

/// The verified SPIFFE ID of the mTLS peer, put into every request's extensions by the
/// facade's TLS server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerSpiffeId(pub String);

/// Connects to the Workload API at `endpoint` (`unix:/path`, `unix:///path` or
/// `tcp://IP:port`) and waits up to [`DEFAULT_INITIAL_SYNC_TIMEOUT`] for the first SVID.
pub async fn x509_source(endpoint: &str) -> Result<Arc<X509Source>, SpiffeError> {
    x509_source_with_timeout(endpoint, DEFAULT_INITIAL_SYNC_TIMEOUT).await
}

/// [`x509_source`] with an explicit bound on the initial sync. Without a bound the
/// source would retry an absent socket forever; the bound turns that into an error
/// that names the socket.
pub async fn x509_source_with_timeout(
    endpoint: &str,
    initial_sync_timeout: Duration,
) -> Result<Arc<X509Source>, SpiffeError> {
    let source = X509Source::builder()
        .endpoint(endpoint)
        .initial_sync_timeout(initial_sync_timeout)
        .build()
        .await
        .map_err(|source| SpiffeError::Source {
            endpoint: endpoint.to_string(),
            source,
        })?;
    Ok(Arc::new(source))
}

fn trust_domain_of(value: &str) -> Result<TrustDomain, SpiffeError> {
    TrustDomain::new(value).map_err(|source| SpiffeError::Invalid {
        what: "trust domain",
        value: value.to_string(),
        source,
    })
}

/// The facade's server configuration: a client certificate is required and any SPIFFE
/// ID of `trust_domain` passes the handshake (the facade then checks the exact
/// assignment ID per request). ALPN offers `h2` and `http/1.1`; the official runner
/// speaks HTTP/1.1, other clients may multiplex.
pub fn facade_server_config(
    source: &X509Source,
    trust_domain: &str,
) -> Result<rustls::ServerConfig, SpiffeError> {
    let td = trust_domain_of(trust_domain)?;
    let authorize =
        authorizer::trust_domains([td.clone()]).map_err(|source| SpiffeError::Config {
            side: "facade server",
            source,
        })?;
    spiffe_rustls::mtls_server(source.clone())
        .authorize(authorize)
        // Federated bundles, if the agent ever hands some out, must not widen who may
        // connect.
        .trust_domain_policy(TrustDomainPolicy::LocalOnly(td))
        .with_alpn_protocols([b"h2".as_slice(), b"http/1.1".as_slice()])
        .build()
        .map_err(|source| SpiffeError::Config {
            side: "facade server",
            source,
        })
}

/// The SPIFFE ID (URI SAN) of the leaf of a verified peer chain; `None` without a
/// chain or when the leaf does not carry exactly one SPIFFE ID.
pub fn peer_spiffe_id(certs: &[CertificateDer<'_>]) -> Option<String> {
    let leaf = certs.first()?;
    spiffe::cert::spiffe_id_from_der(leaf.as_ref())
        .ok()
        .map(|id| id.to_string())
}
