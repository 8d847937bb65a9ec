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

/// gRPC status codes, as [`JwtFetchError::code`] reports them.
pub use tonic::Code;

/// Why a Workload API JWT call failed.
#[derive(Debug, thiserror::Error)]
pub enum JwtFetchError {
    /// The socket could not be reached.
    #[error("connecting to the Workload API {endpoint}: {source}")]
    Connect {
        endpoint: String,
        #[source]
        source: tonic::transport::Error,
    },
    /// The agent answered with an error status (e.g. `PermissionDenied`).
    #[error("the Workload API answered {}: {}", .0.code(), .0.message())]
    Status(#[source] tonic::Status),
    /// The bundle stream ended without a message.
    #[error("the Workload API sent no JWT bundles")]
    NoBundles,
}

impl JwtFetchError {
    /// The gRPC status code of an answered call.
    pub fn code(&self) -> Option<tonic::Code> {
        match self {
            JwtFetchError::Status(s) => Some(s.code()),
            _ => None,
        }
    }
}

async fn workload_channel(endpoint: &str) -> Result<tonic::transport::Channel, JwtFetchError> {
    let path = endpoint
        .strip_prefix("unix://")
        .or_else(|| endpoint.strip_prefix("unix:"))
        .unwrap_or(endpoint)
        .to_owned();
    let connect_error = |source| JwtFetchError::Connect {
        endpoint: endpoint.to_owned(),
        source,
    };
    // The URI is required by the API and ignored by the connector.
    tonic::transport::Endpoint::from_static("http://workload.local")
        .connect_with_connector(tower::service_fn(move |_: http::Uri| {
            let path = path.clone();
            async move {
                tokio::net::UnixStream::connect(path)
                    .await
                    .map(hyper_util::rt::TokioIo::new)
            }
        }))
        .await
        .map_err(connect_error)
}

fn workload_request<T>(message: T) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request.metadata_mut().insert(
        "workload.spiffe.io",
        tonic::metadata::MetadataValue::from_static("true"),
    );
    request
}

/// `FetchJWTSVID` as `spire-agent api fetch jwt -audience <audience> [-spiffeID <id>]`
/// sends it, through the Workload API at `endpoint` (`unix:<path>`, `unix://<path>` or a
/// path).
pub async fn fetch_jwt_svids(
    endpoint: &str,
    audience: &[&str],
    spiffe_id: Option<&str>,
) -> Result<Vec<pb::JwtSvid>, JwtFetchError> {
    let channel = workload_channel(endpoint).await?;
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready()
        .await
        .map_err(|e| JwtFetchError::Status(tonic::Status::unavailable(e.to_string())))?;
    let request = workload_request(pb::JwtSvidRequest {
        audience: audience.iter().map(|a| (*a).to_owned()).collect(),
        spiffe_id: spiffe_id.unwrap_or_default().to_owned(),
    });
    let codec = tonic_prost::ProstCodec::<pb::JwtSvidRequest, pb::JwtSvidResponse>::default();
    let response = grpc
        .unary(
            request,
            http::uri::PathAndQuery::from_static("/SpiffeWorkloadAPI/FetchJWTSVID"),
            codec,
        )
        .await
        .map_err(JwtFetchError::Status)?;
    Ok(response.into_inner().svids)
}

/// The first `FetchJWTBundles` message: trust domain ID → JWKS.
pub async fn fetch_jwt_bundles(
    endpoint: &str,
) -> Result<std::collections::HashMap<String, Vec<u8>>, JwtFetchError> {
    let channel = workload_channel(endpoint).await?;
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready()
        .await
        .map_err(|e| JwtFetchError::Status(tonic::Status::unavailable(e.to_string())))?;
    let codec = tonic_prost::ProstCodec::<pb::JwtBundlesRequest, pb::JwtBundlesResponse>::default();
    let response = grpc
        .server_streaming(
            workload_request(pb::JwtBundlesRequest {}),
            http::uri::PathAndQuery::from_static("/SpiffeWorkloadAPI/FetchJWTBundles"),
            codec,
        )
        .await
        .map_err(JwtFetchError::Status)?;
    let mut stream = response.into_inner();
    match stream.message().await.map_err(JwtFetchError::Status)? {
        Some(message) => Ok(message.bundles),
        None => Err(JwtFetchError::NoBundles),
    }
}

/// Verifies an ES256 JWT-SVID against a JWKS document (as a resource server would) and
/// returns its claims; `Err` says what does not hold.
pub fn verify_jwt_svid(token: &str, jwks: &[u8]) -> Result<serde_json::Value, String> {
    use base64::Engine;
    use base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let mut parts = token.split('.');
    let (Some(header), Some(claims), Some(signature), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err("not a compact JWS of three parts".into());
    };
    let decode = |part: &str| URL_SAFE_NO_PAD.decode(part).map_err(|e| e.to_string());
    let json = |bytes: Vec<u8>| -> Result<serde_json::Value, String> {
        serde_json::from_slice(&bytes).map_err(|e| e.to_string())
    };
    let head = json(decode(header)?)?;
    if head["alg"] != "ES256" {
        return Err(format!("alg is {}", head["alg"]));
    }
    let keys: serde_json::Value = json(jwks.to_vec())?;
    let key = keys["keys"]
        .as_array()
        .and_then(|k| k.iter().find(|k| k["kid"] == head["kid"]))
        .ok_or_else(|| format!("no key {} in the bundle", head["kid"]))?;
    let mut point = vec![4u8];
    point.extend(decode(key["x"].as_str().unwrap_or_default())?);
    point.extend(decode(key["y"].as_str().unwrap_or_default())?);
    aws_lc_rs::signature::UnparsedPublicKey::new(
        &aws_lc_rs::signature::ECDSA_P256_SHA256_FIXED,
        point,
    )
    .verify(format!("{header}.{claims}").as_bytes(), &decode(signature)?)
    .map_err(|_| "the signature does not verify".to_string())?;
    json(decode(claims)?)
}
