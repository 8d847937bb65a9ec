//! Test peers for SPIFFE: the local Workload API under its test names, plus raw TLS
//! probes that reach a server's own client checks.

use std::sync::Arc;

pub use gdr_identity::workload_api::{
    DEFAULT_SVID_TTL, LocalCa as TestCa, RunningWorkloadApi, Svid, WorkloadApi as FakeWorkloadApi,
    WorkloadApiError as FakeSpiffeError, pb,
};

/// Accepts any server certificate: lets a test client reach the server's own client
/// check, which is what the refusal tests are about.
#[derive(Debug)]
pub struct AnyServer(Arc<rustls::crypto::CryptoProvider>);

impl rustls::client::danger::ServerCertVerifier for AnyServer {
    fn verify_server_cert(
        &self,
        _: &rustls::pki_types::CertificateDer<'_>,
        _: &[rustls::pki_types::CertificateDer<'_>],
        _: &rustls::pki_types::ServerName<'_>,
        _: &[u8],
        _: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }
    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }
    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }
    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// A client that trusts any server (optionally presenting `client_cert`), to probe a
/// server's own client checks.
pub fn any_server_client_config(
    client_cert: Option<&Svid>,
) -> Result<rustls::ClientConfig, rustls::Error> {
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AnyServer(provider)));
    match client_cert {
        None => Ok(builder.with_no_client_auth()),
        Some(svid) => builder.with_client_auth_cert(
            svid.cert_chain_der
                .iter()
                .map(|c| rustls::pki_types::CertificateDer::from(c.clone()))
                .collect(),
            rustls::pki_types::PrivateKeyDer::Pkcs8(rustls::pki_types::PrivatePkcs8KeyDer::from(
                svid.key_pkcs8_der.clone(),
            )),
        ),
    }
}

/// A TLS connection over `tcp` presenting `svid` and offering `alpn`, accepting any server
/// certificate (a job's client as the facade sees it, without the executor's server check).
pub async fn tls_over(
    tcp: tokio::net::TcpStream,
    svid: &Svid,
    alpn: &[&[u8]],
) -> std::io::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
    let mut config = any_server_client_config(Some(svid)).map_err(std::io::Error::other)?;
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    let name = rustls::pki_types::ServerName::IpAddress(
        std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST).into(),
    );
    tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(name, tcp)
        .await
}

/// Sends a raw HTTP/1.1 request over TLS; `Ok` only if an HTTP answer came back.
pub async fn raw_tls_get(
    config: rustls::ClientConfig,
    addr: std::net::SocketAddr,
    path: &str,
) -> Result<String, String> {
    let tcp = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| e.to_string())?;
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let name = rustls::pki_types::ServerName::IpAddress(
        std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST).into(),
    );
    let mut tls = connector
        .connect(name, tcp)
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    tokio::io::AsyncWriteExt::write_all(
        &mut tls,
        format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").as_bytes(),
    )
    .await
    .map_err(|e| format!("write: {e}"))?;
    let mut answer = Vec::new();
    tokio::io::AsyncReadExt::read_to_end(&mut tls, &mut answer)
        .await
        .map_err(|e| format!("read: {e}"))?;
    if answer.starts_with(b"HTTP/1.1") {
        Ok(String::from_utf8_lossy(&answer).into_owned())
    } else {
        Err(format!("no HTTP answer ({} bytes)", answer.len()))
    }
}
