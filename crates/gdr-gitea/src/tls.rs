//! The one rustls client configuration of outgoing HTTPS (Gitea, its reverse proxy, the
//! OpenSandbox API): the aws-lc-rs provider, the system roots plus an optional PEM bundle
//! of extra CAs named by a configuration key.

use std::sync::Arc;

use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;

/// Why the TLS configuration cannot be built; names the key of the CA bundle.
#[derive(Debug, thiserror::Error)]
pub enum TlsConfigError {
    /// The bundle is not PEM.
    #[error("{key} is not a PEM bundle: {source}")]
    NotPem {
        /// The key naming the bundle.
        key: &'static str,
        /// The cause.
        #[source]
        source: rustls::pki_types::pem::Error,
    },
    /// A certificate of the bundle cannot be a root.
    #[error("{key} has an unusable certificate: {source}")]
    Unusable {
        /// The key naming the bundle.
        key: &'static str,
        /// The cause.
        #[source]
        source: rustls::Error,
    },
    /// The bundle holds no certificate.
    #[error("{key} holds no PEM certificate")]
    Empty {
        /// The key naming the bundle.
        key: &'static str,
    },
    /// Nothing would be trusted.
    #[error("no trusted CA certificates: the system store is empty and {key} is not set")]
    NoRoots {
        /// The key that would add roots.
        key: &'static str,
    },
    /// rustls refused the protocol versions.
    #[error("TLS setup failed: {0}")]
    Setup(#[source] rustls::Error),
}

/// A client configuration trusting the system roots and the certificates of `extra_ca_pem`
/// (the contents of the file named by `key`). With `require_roots` false (a plain-http
/// peer, whose connections never use it) an empty trust store is no error.
pub fn client_config(
    key: &'static str,
    extra_ca_pem: Option<&[u8]>,
    require_roots: bool,
) -> Result<rustls::ClientConfig, TlsConfigError> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls_native_certs::load_native_certs().certs {
        // A single unparsable system certificate must not disable TLS altogether.
        let _ = roots.add(cert);
    }
    if let Some(pem) = extra_ca_pem {
        let mut added = 0;
        for cert in CertificateDer::pem_slice_iter(pem) {
            let cert = cert.map_err(|source| TlsConfigError::NotPem { key, source })?;
            roots
                .add(cert)
                .map_err(|source| TlsConfigError::Unusable { key, source })?;
            added += 1;
        }
        if added == 0 {
            return Err(TlsConfigError::Empty { key });
        }
    }
    if roots.is_empty() && require_roots {
        return Err(TlsConfigError::NoRoots { key });
    }
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(TlsConfigError::Setup)?
        .with_root_certificates(roots)
        .with_no_client_auth())
}
