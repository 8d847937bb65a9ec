//! A fake SPIFFE Workload API: gRPC over a Unix socket, the real `FetchX509SVID` wire
//! contract (server streaming, `workload.spiffe.io: true` metadata required), backed by an
//! in-memory test CA.
//!
//! The `spiffe` crate's [`X509Source`](spiffe::X509Source) connects to it exactly as it
//! would to a SPIRE agent, so code under test runs unchanged. Tests drive it through
//! [`RunningWorkloadApi::rotate`] (new SVID, same ID) and
//! [`RunningWorkloadApi::set_identity`] (another ID); every open stream sees the change,
//! because the Workload API pushes the full state on every update.
//!
//! Only the X.509-SVID RPC is served; the JWT and bundle RPCs answer `UNIMPLEMENTED`,
//! which `X509Source` does not need.

use std::convert::Infallible;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::StreamExt;
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DistinguishedName, DnType,
    ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose, SanType, SerialNumber,
};
use tokio::net::UnixListener;
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;

/// Lifetime of SVIDs issued by [`FakeWorkloadApi::start`] unless changed with
/// [`RunningWorkloadApi::set_ttl`]. Long enough that no test sees one expire by accident.
pub const DEFAULT_SVID_TTL: Duration = Duration::from_secs(3600);

/// The gRPC service name: `workload.proto` has no `package`, so paths are
/// `/SpiffeWorkloadAPI/<Method>`.
const SERVICE_NAME: &str = "SpiffeWorkloadAPI";
const FETCH_X509_SVID_PATH: &str = "/SpiffeWorkloadAPI/FetchX509SVID";
/// Metadata every Workload API request must carry (SPIFFE Workload Endpoint spec).
const SECURITY_HEADER: &str = "workload.spiffe.io";

/// Errors of the fake Workload API and its test CA.
#[derive(Debug, thiserror::Error)]
pub enum FakeSpiffeError {
    #[error("test CA for trust domain {trust_domain:?}: {source}")]
    Ca {
        trust_domain: String,
        #[source]
        source: rcgen::Error,
    },
    #[error("issuing an SVID for {spiffe_id:?}: {source}")]
    Issue {
        spiffe_id: String,
        #[source]
        source: rcgen::Error,
    },
    #[error("{spiffe_id:?} is not a SPIFFE ID of trust domain {trust_domain:?}")]
    ForeignId {
        spiffe_id: String,
        trust_domain: String,
    },
    #[error("the workload at {socket} has no identity to rotate")]
    NoIdentity { socket: PathBuf },
    #[error("binding the Workload API socket {path}: {source}")]
    Bind {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// An X.509-SVID as the Workload API hands it out.
#[derive(Clone)]
pub struct Svid {
    pub spiffe_id: String,
    /// DER certificates, leaf first.
    pub cert_chain_der: Vec<Vec<u8>>,
    /// Unencrypted PKCS#8 DER private key of the leaf.
    pub key_pkcs8_der: Vec<u8>,
}

impl std::fmt::Debug for Svid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The key stays out of test logs, like any private key would.
        f.debug_struct("Svid")
            .field("spiffe_id", &self.spiffe_id)
            .field("certs", &self.cert_chain_der.len())
            .finish_non_exhaustive()
    }
}

/// A self-signed SPIFFE CA for one trust domain. Cheap to clone (shared key).
#[derive(Clone)]
pub struct TestCa {
    inner: Arc<CaInner>,
}

struct CaInner {
    trust_domain: String,
    issuer: CertifiedIssuer<'static, KeyPair>,
    serial: AtomicU64,
}

impl std::fmt::Debug for TestCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestCa")
            .field("trust_domain", &self.inner.trust_domain)
            .finish_non_exhaustive()
    }
}

/// Sets the validity window to `[now - backdate, now + lifetime]`. rcgen takes
/// `time::OffsetDateTime`; going through rcgen's own `date_time_ymd` keeps the `time`
/// crate out of our dependency list.
fn set_validity(params: &mut CertificateParams, backdate: Duration, lifetime: Duration) {
    let since_epoch = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let now = rcgen::date_time_ymd(1970, 1, 1) + since_epoch;
    params.not_before = now - backdate;
    params.not_after = now + lifetime;
}

impl TestCa {
    /// Creates a CA whose certificate carries the trust domain's SPIFFE ID as URI SAN.
    pub fn new(trust_domain: &str) -> Result<Self, FakeSpiffeError> {
        let ca_err = |source| FakeSpiffeError::Ca {
            trust_domain: trust_domain.to_string(),
            source,
        };
        let mut params = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, format!("test CA {trust_domain}"));
        params.distinguished_name = dn;
        params.subject_alt_names = vec![SanType::URI(
            format!("spiffe://{trust_domain}")
                .try_into()
                .map_err(ca_err)?,
        )];
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        set_validity(
            &mut params,
            Duration::from_secs(3600),
            Duration::from_secs(10 * 24 * 3600),
        );
        let key = KeyPair::generate().map_err(ca_err)?;
        let issuer = CertifiedIssuer::self_signed(params, key).map_err(ca_err)?;
        Ok(TestCa {
            inner: Arc::new(CaInner {
                trust_domain: trust_domain.to_string(),
                issuer,
                serial: AtomicU64::new(1),
            }),
        })
    }

    pub fn trust_domain(&self) -> &str {
        &self.inner.trust_domain
    }

    /// The CA certificate (DER): the trust bundle of the domain.
    pub fn bundle_der(&self) -> Vec<u8> {
        self.inner.issuer.der().to_vec()
    }

    /// Issues a leaf X.509-SVID for `spiffe_id`, valid from a minute ago for `ttl`.
    /// The leaf meets the X.509-SVID profile: not a CA, `digitalSignature`, one URI SAN.
    pub fn issue(&self, spiffe_id: &str, ttl: Duration) -> Result<Svid, FakeSpiffeError> {
        let prefix = format!("spiffe://{}/", self.inner.trust_domain);
        if !spiffe_id.starts_with(&prefix) {
            return Err(FakeSpiffeError::ForeignId {
                spiffe_id: spiffe_id.to_string(),
                trust_domain: self.inner.trust_domain.clone(),
            });
        }
        let issue_err = |source| FakeSpiffeError::Issue {
            spiffe_id: spiffe_id.to_string(),
            source,
        };
        let mut params = CertificateParams::default();
        params.distinguished_name = DistinguishedName::new();
        params.subject_alt_names = vec![SanType::URI(
            spiffe_id.to_string().try_into().map_err(issue_err)?,
        )];
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
            KeyUsagePurpose::KeyAgreement,
        ];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        // Distinct serials make every rotation observable in the peer's certificate.
        let serial = self.inner.serial.fetch_add(1, Ordering::Relaxed);
        params.serial_number = Some(SerialNumber::from_slice(&serial.to_be_bytes()));
        set_validity(&mut params, Duration::from_secs(60), ttl);
        let key = KeyPair::generate().map_err(issue_err)?;
        let cert = params
            .signed_by(&key, &self.inner.issuer)
            .map_err(issue_err)?;
        Ok(Svid {
            spiffe_id: spiffe_id.to_string(),
            cert_chain_der: vec![cert.der().to_vec()],
            key_pkcs8_der: key.serialize_der(),
        })
    }
}

/// Hand-written prost messages of `workload.proto` (field numbers per the SPIFFE spec);
/// only what `FetchX509SVID` needs.
pub mod pb {
    #[derive(Clone, Copy, PartialEq, Eq, ::prost::Message)]
    pub struct X509SvidRequest {}

    #[derive(Clone, PartialEq, ::prost::Message)]
    pub struct X509SvidResponse {
        #[prost(message, repeated, tag = "1")]
        pub svids: Vec<X509Svid>,
        #[prost(bytes = "vec", repeated, tag = "2")]
        pub crl: Vec<Vec<u8>>,
        #[prost(map = "string, bytes", tag = "3")]
        pub federated_bundles: std::collections::HashMap<String, Vec<u8>>,
    }

    #[derive(Clone, PartialEq, Eq, ::prost::Message)]
    pub struct X509Svid {
        #[prost(string, tag = "1")]
        pub spiffe_id: String,
        /// DER chain, leaf first, concatenated.
        #[prost(bytes = "vec", tag = "2")]
        pub x509_svid: Vec<u8>,
        #[prost(bytes = "vec", tag = "3")]
        pub x509_svid_key: Vec<u8>,
        /// DER CA certificates of the trust domain, concatenated.
        #[prost(bytes = "vec", tag = "4")]
        pub bundle: Vec<u8>,
        #[prost(string, tag = "5")]
        pub hint: String,
    }
}

/// What every `FetchX509SVID` stream currently sends; `None` means "no identity",
/// which the Workload API answers with `PermissionDenied`.
type Current = Option<(Svid, pb::X509SvidResponse)>;

struct Shared {
    ca: TestCa,
    ttl: std::sync::Mutex<Duration>,
    current: watch::Sender<Current>,
    /// Number of `FetchX509SVID` calls accepted so far (observable reconnects).
    fetches: AtomicU64,
}

impl Shared {
    fn ttl(&self) -> Duration {
        *self.ttl.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn publish(&self, spiffe_id: &str) -> Result<Svid, FakeSpiffeError> {
        let svid = self.ca.issue(spiffe_id, self.ttl())?;
        let response = pb::X509SvidResponse {
            svids: vec![pb::X509Svid {
                spiffe_id: svid.spiffe_id.clone(),
                x509_svid: svid.cert_chain_der.concat(),
                x509_svid_key: svid.key_pkcs8_der.clone(),
                bundle: self.ca.bundle_der(),
                hint: String::new(),
            }],
            ..Default::default()
        };
        self.current.send_replace(Some((svid.clone(), response)));
        Ok(svid)
    }
}

/// Entry point of the fake Workload API.
pub struct FakeWorkloadApi;

static SOCKET_COUNTER: AtomicU64 = AtomicU64::new(0);

impl FakeWorkloadApi {
    /// Serves a Workload API on a fresh socket in `dir` whose workload has
    /// `initial_spiffe_id`. Call it once per fake workload (several may share `dir`
    /// and `ca`).
    pub async fn start(
        dir: &Path,
        ca: TestCa,
        initial_spiffe_id: &str,
    ) -> Result<RunningWorkloadApi, FakeSpiffeError> {
        let n = SOCKET_COUNTER.fetch_add(1, Ordering::Relaxed);
        Self::start_at(
            dir.join(format!("workload-{}-{n}.sock", std::process::id())),
            ca,
            initial_spiffe_id,
        )
        .await
    }

    /// Like [`Self::start`] on an explicit socket path (kept short: Unix sockets allow
    /// about 100 bytes of path).
    pub async fn start_at(
        socket_path: PathBuf,
        ca: TestCa,
        initial_spiffe_id: &str,
    ) -> Result<RunningWorkloadApi, FakeSpiffeError> {
        let shared = Arc::new(Shared {
            ca,
            ttl: std::sync::Mutex::new(DEFAULT_SVID_TTL),
            current: watch::Sender::new(None),
            fetches: AtomicU64::new(0),
        });
        shared.publish(initial_spiffe_id)?;
        let listener =
            UnixListener::bind(&socket_path).map_err(|source| FakeSpiffeError::Bind {
                path: socket_path.clone(),
                source,
            })?;
        let incoming = futures::stream::unfold(listener, |listener| async move {
            let accepted = listener.accept().await.map(|(stream, _)| stream);
            Some((accepted, listener))
        });
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let service = WorkloadApiService {
            shared: shared.clone(),
        };
        let join = tokio::spawn(async move {
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming_shutdown(incoming, async {
                    // A dropped handle also stops the server.
                    let _ = stop_rx.await;
                })
                .await
        });
        Ok(RunningWorkloadApi {
            socket_path,
            shared,
            stop: Some(stop_tx),
            join: Some(join),
        })
    }
}

/// A fake Workload API serving in the background; dropping it stops the server and
/// removes the socket.
pub struct RunningWorkloadApi {
    pub socket_path: PathBuf,
    shared: Arc<Shared>,
    stop: Option<oneshot::Sender<()>>,
    join: Option<JoinHandle<Result<(), tonic::transport::Error>>>,
}

impl std::fmt::Debug for RunningWorkloadApi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunningWorkloadApi")
            .field("socket_path", &self.socket_path)
            .finish_non_exhaustive()
    }
}

impl RunningWorkloadApi {
    /// The `SPIFFE_ENDPOINT_SOCKET` value: `unix:<absolute path>`.
    pub fn endpoint(&self) -> String {
        format!("unix:{}", self.socket_path.display())
    }

    /// The SVID every stream currently carries, if the workload has an identity.
    pub fn current_svid(&self) -> Option<Svid> {
        self.shared
            .current
            .borrow()
            .as_ref()
            .map(|(svid, _)| svid.clone())
    }

    /// Issues a new SVID for the same SPIFFE ID and pushes it to every open stream.
    pub fn rotate(&self) -> Result<Svid, FakeSpiffeError> {
        let id =
            self.current_svid()
                .map(|s| s.spiffe_id)
                .ok_or_else(|| FakeSpiffeError::ForeignId {
                    spiffe_id: String::new(),
                    trust_domain: self.shared.ca.trust_domain().to_string(),
                })?;
        self.shared.publish(&id)
    }

    /// Gives the workload another identity (pushed to every open stream).
    pub fn set_identity(&self, spiffe_id: &str) -> Result<Svid, FakeSpiffeError> {
        self.shared.publish(spiffe_id)
    }

    /// Takes the identity away: new and open streams get `PermissionDenied`.
    pub fn clear_identity(&self) {
        self.shared.current.send_replace(None);
    }

    /// Lifetime of SVIDs issued from now on.
    pub fn set_ttl(&self, ttl: Duration) {
        *self.shared.ttl.lock().unwrap_or_else(|e| e.into_inner()) = ttl;
    }

    /// How many `FetchX509SVID` streams were opened so far.
    pub fn fetch_count(&self) -> u64 {
        self.shared.fetches.load(Ordering::Relaxed)
    }

    /// Stops serving and waits for the server task.
    pub async fn shutdown(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(join) = self.join.take() {
            let _ = join.await;
        }
        let _ = std::fs::remove_file(&self.socket_path);
    }
}

impl Drop for RunningWorkloadApi {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        let _ = std::fs::remove_file(&self.socket_path);
    }
}

/// The tower service tonic routes `/SpiffeWorkloadAPI/*` to (what `tonic-build` would
/// generate, written out because only one RPC is needed).
#[derive(Clone)]
struct WorkloadApiService {
    shared: Arc<Shared>,
}

impl tonic::server::NamedService for WorkloadApiService {
    const NAME: &'static str = SERVICE_NAME;
}

impl tower::Service<http::Request<tonic::body::Body>> for WorkloadApiService {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        if req.uri().path() != FETCH_X509_SVID_PATH {
            let path = req.uri().path().to_string();
            return Box::pin(async move {
                Ok(
                    tonic::Status::unimplemented(format!(
                        "fake Workload API does not serve {path}"
                    ))
                    .into_http(),
                )
            });
        }
        let handler = FetchX509Svid {
            shared: self.shared.clone(),
        };
        Box::pin(async move {
            let codec =
                tonic_prost::ProstCodec::<pb::X509SvidResponse, pb::X509SvidRequest>::default();
            let mut grpc = tonic::server::Grpc::new(codec);
            Ok(grpc.server_streaming(handler, req).await)
        })
    }
}

struct FetchX509Svid {
    shared: Arc<Shared>,
}

impl tonic::server::ServerStreamingService<pb::X509SvidRequest> for FetchX509Svid {
    type Response = pb::X509SvidResponse;
    type ResponseStream = BoxStream<'static, Result<pb::X509SvidResponse, tonic::Status>>;
    type Future = BoxFuture<'static, Result<tonic::Response<Self::ResponseStream>, tonic::Status>>;

    fn call(&mut self, request: tonic::Request<pb::X509SvidRequest>) -> Self::Future {
        let shared = self.shared.clone();
        Box::pin(async move {
            let header_ok = request
                .metadata()
                .get(SECURITY_HEADER)
                .and_then(|v| v.to_str().ok())
                == Some("true");
            if !header_ok {
                // The spec's answer to a request without the security header.
                return Err(tonic::Status::invalid_argument(
                    "security header workload.spiffe.io: true is missing",
                ));
            }
            shared.fetches.fetch_add(1, Ordering::Relaxed);
            let rx = shared.current.subscribe();
            // Yield the current state at once, then the full state after every change.
            let stream = futures::stream::unfold((rx, true), |(mut rx, first)| async move {
                if !first && rx.changed().await.is_err() {
                    return None;
                }
                let item = match rx.borrow_and_update().as_ref() {
                    Some((_, response)) => Ok(response.clone()),
                    None => Err(tonic::Status::permission_denied("no identity issued")),
                };
                Some((item, (rx, false)))
            });
            Ok(tonic::Response::new(stream.boxed()))
        })
    }
}

/// Accepts any server certificate: lets a test client reach the server's own client
/// check, which is what the refusal tests are about.
#[derive(Debug)]
pub struct AnyServer(Arc<rustls::crypto::CryptoProvider>);

impl rustls::client::danger::ServerCertVerifier for AnyServer {
    fn verify_server_cert(
        &self,
        _: &rustls_pki_types::CertificateDer<'_>,
        _: &[rustls_pki_types::CertificateDer<'_>],
        _: &rustls_pki_types::ServerName<'_>,
        _: &[u8],
        _: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }
    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls_pki_types::CertificateDer<'_>,
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
        cert: &rustls_pki_types::CertificateDer<'_>,
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
                .map(|c| rustls_pki_types::CertificateDer::from(c.clone()))
                .collect(),
            rustls_pki_types::PrivateKeyDer::Pkcs8(rustls_pki_types::PrivatePkcs8KeyDer::from(
                svid.key_pkcs8_der.clone(),
            )),
        ),
    }
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
    let name = rustls_pki_types::ServerName::IpAddress(
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
