//! A local SPIFFE identity provider for single-host mode (no SPIRE): a CA held by the
//! controller and SPIFFE Workload API endpoints, gRPC over Unix sockets with the real
//! `FetchX509SVID` wire contract (server streaming, `workload.spiffe.io: true` metadata
//! required). One socket per workload: the facade has one, each process executor has
//! its own in its directory, so each can only obtain its own identity.
//!
//! The `spiffe` crate's [`X509Source`](spiffe::X509Source) connects to it exactly as it
//! would to a SPIRE agent, so the executor and the facade run the same mTLS code in both
//! modes. SVIDs rotate at half their lifetime; every open stream sees the new one,
//! because the Workload API pushes the full state on every update. The test peers use
//! [`RunningWorkloadApi::rotate`] and [`RunningWorkloadApi::set_identity`] directly.
//!
//! The JWT RPCs are served as a SPIRE agent serves them, so a job's
//! `spire-agent api fetch jwt -audience X` works against it: `FetchJWTSVID` signs a
//! JWT-SVID (ES256, with the CA's key) for the workload's own SPIFFE ID only — a request
//! naming another ID, like a workload without identity, gets `PermissionDenied` ("no
//! identity issued"), an empty audience `InvalidArgument`; `FetchJWTBundles` streams the
//! trust domain's JWKS. The X.509 bundle and `ValidateJWTSVID` RPCs answer
//! `UNIMPLEMENTED`.

use std::convert::Infallible;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use futures::StreamExt;
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use gdr_shutdown::ShutdownGuard;
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DistinguishedName, DnType,
    ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose, SanType, SerialNumber,
};
use tokio::net::UnixListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Lifetime of SVIDs issued by [`WorkloadApi::start`] unless changed with
/// [`RunningWorkloadApi::set_ttl`]. Long enough that no test sees one expire by accident.
pub const DEFAULT_SVID_TTL: Duration = Duration::from_secs(3600);

/// The gRPC service name: `workload.proto` has no `package`, so paths are
/// `/SpiffeWorkloadAPI/<Method>`.
const SERVICE_NAME: &str = "SpiffeWorkloadAPI";
const FETCH_X509_SVID_PATH: &str = "/SpiffeWorkloadAPI/FetchX509SVID";
const FETCH_JWT_SVID_PATH: &str = "/SpiffeWorkloadAPI/FetchJWTSVID";
const FETCH_JWT_BUNDLES_PATH: &str = "/SpiffeWorkloadAPI/FetchJWTBundles";
/// Lifetime of JWT-SVIDs: a SPIRE agent's default (`default_jwt_svid_ttl`, 5 minutes).
pub const JWT_SVID_TTL: Duration = Duration::from_secs(300);
/// Metadata every Workload API request must carry (SPIFFE Workload Endpoint spec).
const SECURITY_HEADER: &str = "workload.spiffe.io";

/// Errors of the fake Workload API and its test CA.
#[derive(Debug, thiserror::Error)]
pub enum WorkloadApiError {
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
    #[error("CA files in {dir}: {message}")]
    CaFiles { dir: PathBuf, message: String },
    #[error("CA files in {dir}: {what}: {source}")]
    CaFile {
        dir: PathBuf,
        /// What was being done to which file.
        what: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error(
        "the CA key of trust domain {trust_domain:?} cannot sign JWT-SVIDs (ES256 needs a P-256 key): {source}"
    )]
    JwtKey {
        trust_domain: String,
        #[source]
        source: aws_lc_rs::error::KeyRejected,
    },
    #[error("signing a JWT-SVID for {spiffe_id:?}: {source}")]
    JwtSign {
        spiffe_id: String,
        #[source]
        source: aws_lc_rs::error::Unspecified,
    },
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
pub struct LocalCa {
    inner: Arc<CaInner>,
}

struct CaInner {
    trust_domain: String,
    issuer: CertifiedIssuer<'static, KeyPair>,
    /// The CA key as an ES256 signer of JWT-SVIDs, and its JWKS key ID.
    jwt_key: aws_lc_rs::signature::EcdsaKeyPair,
    jwt_kid: String,
}

impl std::fmt::Debug for LocalCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalCa")
            .field("trust_domain", &self.inner.trust_domain)
            .finish_non_exhaustive()
    }
}

/// Sets the validity window to `[now - backdate, now + lifetime]`. rcgen takes
/// `time::OffsetDateTime`; going through rcgen's own `date_time_ymd` keeps the `time`
/// crate out of our dependency list.
fn set_validity(params: &mut CertificateParams, backdate: Duration, lifetime: Duration) {
    set_validity_from(params, SystemTime::now(), backdate, lifetime);
}

fn set_validity_from(
    params: &mut CertificateParams,
    base: SystemTime,
    backdate: Duration,
    lifetime: Duration,
) {
    let since_epoch = base.duration_since(UNIX_EPOCH).unwrap_or_default();
    let now = rcgen::date_time_ymd(1970, 1, 1) + since_epoch;
    params.not_before = now - backdate;
    params.not_after = now + lifetime;
}

impl LocalCa {
    /// Creates an in-memory CA whose certificate carries the trust domain's SPIFFE ID as
    /// URI SAN.
    pub fn new(trust_domain: &str) -> Result<Self, WorkloadApiError> {
        let key = KeyPair::generate().map_err(|source| WorkloadApiError::Ca {
            trust_domain: trust_domain.to_string(),
            source,
        })?;
        Self::with_key(trust_domain, key, SystemTime::now())
    }

    /// Loads the CA kept in `dir` (`ca-key.pem`, mode 0600, and `ca.json`), or creates
    /// it. The certificate is rebuilt from the key and the recorded creation time, so
    /// SVIDs issued before a controller restart still verify against the bundle.
    pub fn load_or_create(dir: &Path, trust_domain: &str) -> Result<Self, WorkloadApiError> {
        let files = |message: String| WorkloadApiError::CaFiles {
            dir: dir.to_path_buf(),
            message,
        };
        let failed = |what: String, source: Box<dyn std::error::Error + Send + Sync>| {
            WorkloadApiError::CaFile {
                dir: dir.to_path_buf(),
                what,
                source,
            }
        };
        let key_path = dir.join("ca-key.pem");
        let meta_path = dir.join("ca.json");
        if key_path.exists() {
            let meta: serde_json::Value = std::fs::read(&meta_path)
                .map_err(|e| failed(format!("reading {}", meta_path.display()), e.into()))
                .and_then(|b| {
                    serde_json::from_slice(&b).map_err(|e| {
                        failed(format!("{} is not JSON", meta_path.display()), e.into())
                    })
                })?;
            let recorded = meta
                .get("trust_domain")
                .and_then(|v| v.as_str())
                .unwrap_or_default();
            if recorded != trust_domain {
                return Err(files(format!(
                    "the CA belongs to trust domain {recorded:?}, not {trust_domain:?}; use another state directory"
                )));
            }
            let created = meta
                .get("created_unix")
                .and_then(serde_json::Value::as_u64)
                .unwrap_or_default();
            let pem = std::fs::read_to_string(&key_path)
                .map_err(|e| failed(format!("reading {}", key_path.display()), e.into()))?;
            let key = KeyPair::from_pem(&pem)
                .map_err(|e| failed(format!("{} is not a key", key_path.display()), e.into()))?;
            return Self::with_key(trust_domain, key, UNIX_EPOCH + Duration::from_secs(created));
        }
        std::fs::create_dir_all(dir)
            .map_err(|e| failed("creating the directory".into(), e.into()))?;
        let key = KeyPair::generate().map_err(|source| WorkloadApiError::Ca {
            trust_domain: trust_domain.to_string(),
            source,
        })?;
        let now = SystemTime::now();
        let created = now.duration_since(UNIX_EPOCH).unwrap_or_default().as_secs();
        let mut options = std::fs::OpenOptions::new();
        options.write(true).create_new(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
        let mut file = options
            .open(&key_path)
            .map_err(|e| failed(format!("writing {}", key_path.display()), e.into()))?;
        std::io::Write::write_all(&mut file, key.serialize_pem().as_bytes())
            .map_err(|e| failed(format!("writing {}", key_path.display()), e.into()))?;
        let meta = serde_json::json!({ "trust_domain": trust_domain, "created_unix": created });
        std::fs::write(&meta_path, meta.to_string())
            .map_err(|e| failed(format!("writing {}", meta_path.display()), e.into()))?;
        Self::with_key(trust_domain, key, UNIX_EPOCH + Duration::from_secs(created))
    }

    fn with_key(
        trust_domain: &str,
        key: KeyPair,
        created: SystemTime,
    ) -> Result<Self, WorkloadApiError> {
        let ca_err = |source| WorkloadApiError::Ca {
            trust_domain: trust_domain.to_string(),
            source,
        };
        let mut params = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(
            DnType::CommonName,
            format!("gitea-dynamic-runner CA {trust_domain}"),
        );
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
        set_validity_from(
            &mut params,
            created,
            Duration::from_secs(3600),
            Duration::from_secs(10 * 365 * 24 * 3600),
        );
        let jwt_key = aws_lc_rs::signature::EcdsaKeyPair::from_pkcs8(
            &aws_lc_rs::signature::ECDSA_P256_SHA256_FIXED_SIGNING,
            &key.serialize_der(),
        )
        .map_err(|source| WorkloadApiError::JwtKey {
            trust_domain: trust_domain.to_string(),
            source,
        })?;
        let jwt_kid = URL_SAFE_NO_PAD.encode(
            &aws_lc_rs::digest::digest(
                &aws_lc_rs::digest::SHA256,
                aws_lc_rs::signature::KeyPair::public_key(&jwt_key).as_ref(),
            )
            .as_ref()[..18],
        );
        let issuer = CertifiedIssuer::self_signed(params, key).map_err(ca_err)?;
        Ok(LocalCa {
            inner: Arc::new(CaInner {
                trust_domain: trust_domain.to_string(),
                issuer,
                jwt_key,
                jwt_kid,
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

    /// The trust domain's JWT bundle as a JWKS document (what `FetchJWTBundles` carries):
    /// the CA's P-256 public key.
    pub fn jwks(&self) -> Vec<u8> {
        let point = aws_lc_rs::signature::KeyPair::public_key(&self.inner.jwt_key).as_ref();
        // An uncompressed SEC1 point: 0x04, then x and y of 32 bytes each.
        let (x, y) = point
            .get(1..)
            .unwrap_or_default()
            .split_at(point.len().saturating_sub(1) / 2);
        serde_json::json!({
            "keys": [{
                "kty": "EC",
                "kid": self.inner.jwt_kid,
                "crv": "P-256",
                "x": URL_SAFE_NO_PAD.encode(x),
                "y": URL_SAFE_NO_PAD.encode(y),
            }],
        })
        .to_string()
        .into_bytes()
    }

    /// Signs a JWT-SVID for `spiffe_id` and `audience`, valid for `ttl` from now: ES256,
    /// claims `sub`, `aud`, `iat` and `exp` (no `iss`, as SPIRE).
    pub fn sign_jwt_svid(
        &self,
        spiffe_id: &str,
        audience: &[String],
        ttl: Duration,
    ) -> Result<String, WorkloadApiError> {
        let prefix = format!("spiffe://{}/", self.inner.trust_domain);
        if !spiffe_id.starts_with(&prefix) {
            return Err(WorkloadApiError::ForeignId {
                spiffe_id: spiffe_id.to_string(),
                trust_domain: self.inner.trust_domain.clone(),
            });
        }
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs();
        let header = serde_json::json!({ "alg": "ES256", "kid": self.inner.jwt_kid, "typ": "JWT" });
        let claims = serde_json::json!({
            "sub": spiffe_id,
            "aud": audience,
            "iat": now,
            "exp": now + ttl.as_secs().max(1),
        });
        let signing_input = format!(
            "{}.{}",
            URL_SAFE_NO_PAD.encode(header.to_string()),
            URL_SAFE_NO_PAD.encode(claims.to_string())
        );
        let rng = aws_lc_rs::rand::SystemRandom::new();
        let signature = self
            .inner
            .jwt_key
            .sign(&rng, signing_input.as_bytes())
            .map_err(|source| WorkloadApiError::JwtSign {
                spiffe_id: spiffe_id.to_string(),
                source,
            })?;
        Ok(format!(
            "{signing_input}.{}",
            URL_SAFE_NO_PAD.encode(signature.as_ref())
        ))
    }

    /// Issues a leaf X.509-SVID for `spiffe_id`, valid from a minute ago for `ttl`.
    /// The leaf meets the X.509-SVID profile: not a CA, `digitalSignature`, one URI SAN.
    pub fn issue(&self, spiffe_id: &str, ttl: Duration) -> Result<Svid, WorkloadApiError> {
        let prefix = format!("spiffe://{}/", self.inner.trust_domain);
        if !spiffe_id.starts_with(&prefix) {
            return Err(WorkloadApiError::ForeignId {
                spiffe_id: spiffe_id.to_string(),
                trust_domain: self.inner.trust_domain.clone(),
            });
        }
        let issue_err = |source| WorkloadApiError::Issue {
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
        // Random serials stay unique across controller restarts (a counter would not),
        // and make every rotation observable in the peer's certificate.
        let mut serial: [u8; 16] = rand::random();
        serial[0] &= 0x7f;
        params.serial_number = Some(SerialNumber::from_slice(&serial));
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
/// only what `FetchX509SVID`, `FetchJWTSVID` and `FetchJWTBundles` need.
pub mod pb {
    #[derive(Clone, PartialEq, Eq, ::prost::Message)]
    pub struct JwtSvidRequest {
        #[prost(string, repeated, tag = "1")]
        pub audience: Vec<String>,
        /// Empty: every identity of the caller; else only this one.
        #[prost(string, tag = "2")]
        pub spiffe_id: String,
    }

    #[derive(Clone, PartialEq, Eq, ::prost::Message)]
    pub struct JwtSvidResponse {
        #[prost(message, repeated, tag = "1")]
        pub svids: Vec<JwtSvid>,
    }

    #[derive(Clone, PartialEq, Eq, ::prost::Message)]
    pub struct JwtSvid {
        #[prost(string, tag = "1")]
        pub spiffe_id: String,
        /// The compact JWS.
        #[prost(string, tag = "2")]
        pub svid: String,
        #[prost(string, tag = "3")]
        pub hint: String,
    }

    #[derive(Clone, Copy, PartialEq, Eq, ::prost::Message)]
    pub struct JwtBundlesRequest {}

    #[derive(Clone, PartialEq, Eq, ::prost::Message)]
    pub struct JwtBundlesResponse {
        /// Trust domain ID (`spiffe://<td>`) → JWKS document.
        #[prost(map = "string, bytes", tag = "1")]
        pub bundles: std::collections::HashMap<String, Vec<u8>>,
    }

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
    ca: LocalCa,
    ttl: std::sync::Mutex<Duration>,
    current: watch::Sender<Current>,
    /// Number of `FetchX509SVID` calls accepted so far (observable reconnects).
    fetches: AtomicU64,
}

impl Shared {
    fn ttl(&self) -> Duration {
        *self.ttl.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn publish(&self, spiffe_id: &str) -> Result<Svid, WorkloadApiError> {
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
pub struct WorkloadApi;

static SOCKET_COUNTER: AtomicU64 = AtomicU64::new(0);

impl WorkloadApi {
    /// Serves a Workload API on a fresh socket in `dir` whose workload has
    /// `initial_spiffe_id`. Call it once per fake workload (several may share `dir`
    /// and `ca`).
    pub async fn start(
        dir: &Path,
        ca: LocalCa,
        initial_spiffe_id: &str,
    ) -> Result<RunningWorkloadApi, WorkloadApiError> {
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
        ca: LocalCa,
        initial_spiffe_id: &str,
    ) -> Result<RunningWorkloadApi, WorkloadApiError> {
        Self::start_with_ttl(socket_path, ca, initial_spiffe_id, DEFAULT_SVID_TTL).await
    }

    /// Like [`Self::start_at`], with SVIDs valid for `ttl` from the first one on (one
    /// issuance at start, on the path of every new executor).
    pub async fn start_with_ttl(
        socket_path: PathBuf,
        ca: LocalCa,
        initial_spiffe_id: &str,
        ttl: Duration,
    ) -> Result<RunningWorkloadApi, WorkloadApiError> {
        let shared = Arc::new(Shared {
            ca,
            ttl: std::sync::Mutex::new(ttl),
            current: watch::Sender::new(None),
            fetches: AtomicU64::new(0),
        });
        shared.publish(initial_spiffe_id)?;
        let listener =
            UnixListener::bind(&socket_path).map_err(|source| WorkloadApiError::Bind {
                path: socket_path.clone(),
                source,
            })?;
        let incoming = futures::stream::unfold(listener, |listener| async move {
            let accepted = listener.accept().await.map(|(stream, _)| stream);
            Some((accepted, listener))
        });
        let (stop, stopped) = gdr_shutdown::shutdown_channel();
        let service = WorkloadApiService {
            shared: shared.clone(),
        };
        let join = tokio::spawn(async move {
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming_shutdown(incoming, async move { stopped.wait().await })
                .await
        });
        Ok(RunningWorkloadApi {
            socket_path,
            shared,
            rotation: None,
            stop: Some(stop.into_guard()),
            join: Some(join),
        })
    }
}

/// A fake Workload API serving in the background; dropping it stops the server and
/// removes the socket.
pub struct RunningWorkloadApi {
    pub socket_path: PathBuf,
    shared: Arc<Shared>,
    rotation: Option<JoinHandle<()>>,
    /// Stops the server when dropped (with the handle, or by `shutdown`).
    stop: Option<ShutdownGuard>,
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
    pub fn rotate(&self) -> Result<Svid, WorkloadApiError> {
        let id = self.current_svid().map(|s| s.spiffe_id).ok_or_else(|| {
            WorkloadApiError::ForeignId {
                spiffe_id: String::new(),
                trust_domain: self.shared.ca.trust_domain().to_string(),
            }
        })?;
        self.shared.publish(&id)
    }

    /// Gives the workload another identity (pushed to every open stream).
    pub fn set_identity(&self, spiffe_id: &str) -> Result<Svid, WorkloadApiError> {
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

    /// Re-issues the SVID every `every` (production: half the SVID lifetime), so a
    /// workload never holds an expired one.
    pub fn rotate_every(&mut self, every: Duration) {
        let shared = Arc::clone(&self.shared);
        let socket = self.socket_path.clone();
        if let Some(old) = self.rotation.take() {
            old.abort();
        }
        self.rotation = Some(tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                let id = shared
                    .current
                    .borrow()
                    .as_ref()
                    .map(|(svid, _)| svid.spiffe_id.clone());
                if let Some(id) = id
                    && let Err(e) = shared.publish(&id)
                {
                    tracing::error!(socket = %socket.display(), error = %e, "rotating an SVID failed");
                }
            }
        }));
    }

    /// Stops serving and waits for the server task.
    pub async fn shutdown(mut self) {
        if let Some(rotation) = self.rotation.take() {
            rotation.abort();
        }
        drop(self.stop.take());
        if let Some(join) = self.join.take() {
            let _ = join.await;
        }
        let _ = std::fs::remove_file(&self.socket_path);
    }
}

impl Drop for RunningWorkloadApi {
    fn drop(&mut self) {
        if let Some(rotation) = self.rotation.take() {
            rotation.abort();
        }
        drop(self.stop.take());
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
        let shared = self.shared.clone();
        match req.uri().path() {
            FETCH_X509_SVID_PATH => Box::pin(async move {
                let codec =
                    tonic_prost::ProstCodec::<pb::X509SvidResponse, pb::X509SvidRequest>::default();
                let mut grpc = tonic::server::Grpc::new(codec);
                Ok(grpc.server_streaming(FetchX509Svid { shared }, req).await)
            }),
            FETCH_JWT_SVID_PATH => Box::pin(async move {
                let codec =
                    tonic_prost::ProstCodec::<pb::JwtSvidResponse, pb::JwtSvidRequest>::default();
                let mut grpc = tonic::server::Grpc::new(codec);
                Ok(grpc.unary(FetchJwtSvid { shared }, req).await)
            }),
            FETCH_JWT_BUNDLES_PATH => Box::pin(async move {
                let codec = tonic_prost::ProstCodec::<pb::JwtBundlesResponse, pb::JwtBundlesRequest>::default();
                let mut grpc = tonic::server::Grpc::new(codec);
                Ok(grpc.server_streaming(FetchJwtBundles { shared }, req).await)
            }),
            path => {
                let path = path.to_string();
                Box::pin(async move {
                    Ok(tonic::Status::unimplemented(format!(
                        "fake Workload API does not serve {path}"
                    ))
                    .into_http())
                })
            }
        }
    }
}

/// The spec's answer to a request without the security header.
fn check_security_header(metadata: &tonic::metadata::MetadataMap) -> Result<(), tonic::Status> {
    if metadata.get(SECURITY_HEADER).and_then(|v| v.to_str().ok()) == Some("true") {
        Ok(())
    } else {
        Err(tonic::Status::invalid_argument(
            "security header workload.spiffe.io: true is missing",
        ))
    }
}

/// `FetchJWTSVID` as a SPIRE agent answers it: a JWT-SVID only for an identity the caller
/// has — here the workload's one SPIFFE ID. Naming another ID gets what a workload
/// without identity gets: `PermissionDenied`, "no identity issued".
struct FetchJwtSvid {
    shared: Arc<Shared>,
}

impl tonic::server::UnaryService<pb::JwtSvidRequest> for FetchJwtSvid {
    type Response = pb::JwtSvidResponse;
    type Future = BoxFuture<'static, Result<tonic::Response<Self::Response>, tonic::Status>>;

    fn call(&mut self, request: tonic::Request<pb::JwtSvidRequest>) -> Self::Future {
        let shared = self.shared.clone();
        Box::pin(async move {
            check_security_header(request.metadata())?;
            let request = request.into_inner();
            let audience: Vec<String> = request
                .audience
                .into_iter()
                .filter(|a| !a.trim().is_empty())
                .collect();
            if audience.is_empty() {
                return Err(tonic::Status::invalid_argument(
                    "audience must be specified",
                ));
            }
            if !request.spiffe_id.is_empty() && !is_spiffe_id(&request.spiffe_id) {
                return Err(tonic::Status::invalid_argument(
                    "invalid requested SPIFFE ID: scheme is missing or invalid",
                ));
            }
            let own = shared
                .current
                .borrow()
                .as_ref()
                .map(|(svid, _)| svid.spiffe_id.clone());
            let Some(own) =
                own.filter(|id| request.spiffe_id.is_empty() || *id == request.spiffe_id)
            else {
                return Err(tonic::Status::permission_denied("no identity issued"));
            };
            let token = shared
                .ca
                .sign_jwt_svid(&own, &audience, JWT_SVID_TTL)
                .map_err(|e| {
                    tonic::Status::unavailable(format!("could not fetch JWT-SVID: {e}"))
                })?;
            Ok(tonic::Response::new(pb::JwtSvidResponse {
                svids: vec![pb::JwtSvid {
                    spiffe_id: own,
                    svid: token,
                    hint: String::new(),
                }],
            }))
        })
    }
}

/// `spiffe://` followed by a trust domain and a path, as SPIRE's parser wants it.
fn is_spiffe_id(id: &str) -> bool {
    id.strip_prefix("spiffe://")
        .and_then(|rest| rest.split_once('/'))
        .is_some_and(|(domain, path)| !domain.is_empty() && !path.is_empty())
}

/// `FetchJWTBundles`: the trust domain's JWKS, again after every change of the
/// workload's identity; `PermissionDenied` while it has none (as SPIRE).
struct FetchJwtBundles {
    shared: Arc<Shared>,
}

impl tonic::server::ServerStreamingService<pb::JwtBundlesRequest> for FetchJwtBundles {
    type Response = pb::JwtBundlesResponse;
    type ResponseStream = BoxStream<'static, Result<pb::JwtBundlesResponse, tonic::Status>>;
    type Future = BoxFuture<'static, Result<tonic::Response<Self::ResponseStream>, tonic::Status>>;

    fn call(&mut self, request: tonic::Request<pb::JwtBundlesRequest>) -> Self::Future {
        let shared = self.shared.clone();
        Box::pin(async move {
            check_security_header(request.metadata())?;
            let rx = shared.current.subscribe();
            let bundles = std::collections::HashMap::from([(
                format!("spiffe://{}", shared.ca.trust_domain()),
                shared.ca.jwks(),
            )]);
            let stream = futures::stream::unfold((rx, true), move |(mut rx, first)| {
                let bundles = bundles.clone();
                async move {
                    if !first && rx.changed().await.is_err() {
                        return None;
                    }
                    let item = match rx.borrow_and_update().as_ref() {
                        Some(_) => Ok(pb::JwtBundlesResponse { bundles }),
                        None => Err(tonic::Status::permission_denied("no identity issued")),
                    };
                    Some((item, (rx, false)))
                }
            });
            Ok(tonic::Response::new(stream.boxed()))
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
            check_security_header(request.metadata())?;
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

/// The process backend's identity provider: one Workload API socket per executor
/// directory, serving only that executor's SPIFFE ID from the controller's local CA.
pub struct LocalIdentity {
    ca: LocalCa,
    ttl: Duration,
    servers: tokio::sync::Mutex<std::collections::HashMap<PathBuf, RunningWorkloadApi>>,
}

impl LocalIdentity {
    /// Issues SVIDs valid for `ttl`, rotated at half of it.
    pub fn new(ca: LocalCa, ttl: Duration) -> Self {
        LocalIdentity {
            ca,
            ttl,
            servers: tokio::sync::Mutex::new(std::collections::HashMap::new()),
        }
    }

    /// Serves `spiffe_id` at `socket` (used for the facade's own identity too).
    pub async fn serve(
        &self,
        socket: PathBuf,
        spiffe_id: &str,
    ) -> Result<String, WorkloadApiError> {
        let mut servers = self.servers.lock().await;
        if let Some(running) = servers.get(&socket)
            && running
                .current_svid()
                .is_some_and(|s| s.spiffe_id == spiffe_id)
        {
            return Ok(running.endpoint());
        }
        let _ = std::fs::remove_file(&socket);
        let mut running =
            WorkloadApi::start_with_ttl(socket.clone(), self.ca.clone(), spiffe_id, self.ttl)
                .await?;
        running.rotate_every(self.ttl / 2);
        let endpoint = running.endpoint();
        servers.insert(socket, running);
        Ok(endpoint)
    }

    /// Stops serving `socket`.
    pub async fn stop(&self, socket: &Path) {
        if let Some(running) = self.servers.lock().await.remove(socket) {
            running.shutdown().await;
        }
    }
}

#[cfg(test)]
mod tests;
