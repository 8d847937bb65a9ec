//! The executor's X.509-SVID from exactly one Workload API stream (issue 39 item 2).
//!
//! The `spiffe` crate's [`X509Source`](spiffe::X509Source) fetches the first SVID on
//! one stream and then opens a second one for its rotation supervisor: two streams,
//! and a second round trip to the agent, in every executor's start. An executor lives
//! for one job, so here the first `FetchX509SVID` stream is kept open and every later
//! message on it (the Workload API pushes the full state on each rotation) replaces the
//! certificate, key and trust bundle in place. A new stream is opened only when the
//! open one fails or ends.
//!
//! [`executor_client_config`] builds on it what `spiffe-rustls` built from an
//! `X509Source` before: our SVID as client certificate, and only a server whose chain
//! verifies against the bundle of the facade's own trust domain and whose leaf carries
//! exactly the facade's SPIFFE ID. TLS session resumption is off, as there: a resumed
//! session would skip the peer check and could outlive a short-lived SVID.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::Duration;

use futures::{Stream, StreamExt};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::{ResolvesClientCert, Resumption, verify_server_cert_signed_by_trust_anchor};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, UnixTime};
use rustls::server::ParsedCertificate;
use rustls::sign::CertifiedKey;
use rustls::{DigitallySignedStruct, RootCertStore, SignatureScheme};
use spiffe::{SpiffeId, TrustDomain, WorkloadApiClient, WorkloadApiError, X509Context};

/// First and longest wait between two attempts to get the first SVID (an executor may
/// start before its identity is bound, which SPIRE answers with "no identity issued").
const RETRY_MIN: Duration = Duration::from_millis(50);
const RETRY_MAX: Duration = Duration::from_secs(2);

/// Errors of the one-stream SVID source.
#[derive(Debug, thiserror::Error)]
pub enum SvidStreamError {
    #[error(
        "SPIFFE Workload API at {endpoint} gave no X.509-SVID within {after:?} (is the \
         socket there and does this workload have an identity?): {source}"
    )]
    NoSvid {
        endpoint: String,
        after: Duration,
        #[source]
        source: WorkloadApiError,
    },
    #[error(
        "SPIFFE Workload API at {endpoint} did not answer within {after:?} (is the socket \
         there and does this workload have an identity?)"
    )]
    Silent { endpoint: String, after: Duration },
    #[error("the X.509-SVID from {endpoint} is not usable for TLS: {source}")]
    Material {
        endpoint: String,
        #[source]
        source: rustls::Error,
    },
    #[error("{value:?} is not a valid facade SPIFFE ID: {source}")]
    InvalidId {
        value: String,
        #[source]
        source: spiffe::SpiffeIdError,
    },
    #[error("building the executor's mTLS configuration: {source}")]
    Config {
        #[source]
        source: rustls::Error,
    },
}

/// What one message of the stream carries, ready for handshakes.
struct Material {
    key: Arc<CertifiedKey>,
    roots: HashMap<TrustDomain, Arc<RootCertStore>>,
}

/// The current material and the task that keeps it current; the task ends when the
/// last handle (the [`SvidStream`] or a configuration built from it) is dropped.
struct Shared {
    current: RwLock<Arc<Material>>,
    consumer: Mutex<Option<tokio::task::AbortHandle>>,
}

impl Shared {
    fn current(&self) -> Arc<Material> {
        Arc::clone(&self.current.read().unwrap_or_else(|e| e.into_inner()))
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        if let Some(task) = self
            .consumer
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            task.abort();
        }
    }
}

/// The executor's SVID and trust bundles, kept current from one Workload API stream.
#[derive(Clone)]
pub struct SvidStream {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for SvidStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SvidStream").finish_non_exhaustive()
    }
}

type Contexts = std::pin::Pin<Box<dyn Stream<Item = Result<X509Context, WorkloadApiError>> + Send>>;

/// Opens one `FetchX509SVID` stream at `endpoint`, waits up to `timeout` for its first
/// SVID (retrying a missing socket or identity with backoff), then follows rotations
/// on that same stream in the background.
pub async fn svid_stream(endpoint: &str, timeout: Duration) -> Result<SvidStream, SvidStreamError> {
    let (material, contexts) = first_svid(endpoint, timeout).await?;
    Ok(following(endpoint, material, contexts))
}

/// One attempt of [`svid_stream`]: opens one stream and waits up to `timeout` for its first
/// SVID, without retrying. For a caller that polls at its own pace until a workload's
/// identity is issued (a warm VM sandbox's executor, before a job claimed its sandbox).
pub async fn try_svid_stream(
    endpoint: &str,
    timeout: Duration,
) -> Result<SvidStream, SvidStreamError> {
    let (context, contexts) = match tokio::time::timeout(timeout, open(endpoint)).await {
        Err(_) => {
            return Err(SvidStreamError::Silent {
                endpoint: endpoint.to_string(),
                after: timeout,
            });
        }
        Ok(Err(source)) => {
            return Err(SvidStreamError::NoSvid {
                endpoint: endpoint.to_string(),
                after: timeout,
                source,
            });
        }
        Ok(Ok(opened)) => opened,
    };
    let material = material_of(&context).map_err(|source| SvidStreamError::Material {
        endpoint: endpoint.to_string(),
        source,
    })?;
    Ok(following(endpoint, material, contexts))
}

/// The source of `material`, kept current from the rest of `contexts` in the background.
fn following(endpoint: &str, material: Material, contexts: Contexts) -> SvidStream {
    let shared = Arc::new(Shared {
        current: RwLock::new(Arc::new(material)),
        consumer: Mutex::new(None),
    });
    let task = tokio::spawn(follow(
        endpoint.to_string(),
        contexts,
        Arc::downgrade(&shared),
    ));
    *shared.consumer.lock().unwrap_or_else(|e| e.into_inner()) = Some(task.abort_handle());
    SvidStream { shared }
}

async fn first_svid(
    endpoint: &str,
    timeout: Duration,
) -> Result<(Material, Contexts), SvidStreamError> {
    let deadline = tokio::time::Instant::now() + timeout;
    let mut backoff = RETRY_MIN;
    loop {
        let Ok(opened) = tokio::time::timeout_at(deadline, open(endpoint)).await else {
            return Err(SvidStreamError::Silent {
                endpoint: endpoint.to_string(),
                after: timeout,
            });
        };
        let error = match opened {
            Ok((context, contexts)) => {
                let material =
                    material_of(&context).map_err(|source| SvidStreamError::Material {
                        endpoint: endpoint.to_string(),
                        source,
                    })?;
                return Ok((material, contexts));
            }
            Err(error) => error,
        };
        if tokio::time::Instant::now() + backoff >= deadline || error.is_invalid_argument() {
            return Err(SvidStreamError::NoSvid {
                endpoint: endpoint.to_string(),
                after: timeout,
                source: error,
            });
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(RETRY_MAX);
    }
}

/// One stream and its first message.
async fn open(endpoint: &str) -> Result<(X509Context, Contexts), WorkloadApiError> {
    let client = WorkloadApiClient::connect_to(endpoint).await?;
    let mut contexts: Contexts = Box::pin(client.stream_x509_contexts().await?);
    match contexts.next().await {
        Some(first) => Ok((first?, contexts)),
        None => Err(WorkloadApiError::EmptyResponse),
    }
}

/// Applies every later message of the stream; reopens the stream (with backoff) only
/// when it fails or ends, keeping the last SVID meanwhile.
async fn follow(endpoint: String, mut contexts: Contexts, shared: Weak<Shared>) {
    let mut backoff = RETRY_MIN;
    loop {
        while let Some(message) = contexts.next().await {
            let Some(shared) = shared.upgrade() else {
                return;
            };
            match message
                .map_err(|e| e.to_string())
                .and_then(|context| material_of(&context).map_err(|e| e.to_string()))
            {
                Ok(material) => {
                    *shared.current.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(material);
                    backoff = RETRY_MIN;
                }
                Err(error) => {
                    tracing::warn!(%endpoint, %error, "an X.509-SVID update was not usable; keeping the last one");
                }
            }
        }
        loop {
            tracing::warn!(%endpoint, "the Workload API stream ended; opening a new one");
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(RETRY_MAX);
            if shared.strong_count() == 0 {
                return;
            }
            match open(&endpoint).await {
                Ok((context, rest)) => {
                    if let (Some(shared), Ok(material)) = (shared.upgrade(), material_of(&context))
                    {
                        *shared.current.write().unwrap_or_else(|e| e.into_inner()) =
                            Arc::new(material);
                    }
                    contexts = rest;
                    break;
                }
                Err(error) => {
                    tracing::warn!(%endpoint, %error, "reopening the Workload API stream")
                }
            }
        }
    }
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

/// The default SVID as a rustls certified key, and each trust domain's bundle as roots.
fn material_of(context: &X509Context) -> Result<Material, rustls::Error> {
    let svid = context
        .default_svid()
        .ok_or_else(|| rustls::Error::General("the Workload API sent no SVID".into()))?;
    let chain: Vec<CertificateDer<'static>> = svid
        .cert_chain()
        .iter()
        .map(|c| CertificateDer::from(c.as_bytes().to_vec()))
        .collect();
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(
        svid.private_key().as_bytes().to_vec(),
    ));
    let key = CertifiedKey::from_der(chain, key, &provider())?;
    let mut roots = HashMap::new();
    for (td, bundle) in context.bundle_set().iter() {
        let mut store = RootCertStore::empty();
        for authority in bundle.authorities() {
            store.add(CertificateDer::from(authority.as_bytes()))?;
        }
        roots.insert(td.clone(), Arc::new(store));
    }
    Ok(Material {
        key: Arc::new(key),
        roots,
    })
}

/// The executor's client configuration: our current SVID as client certificate; only a
/// server presenting exactly `facade_spiffe_id`, chained to its trust domain's bundle,
/// is accepted. ALPN is left empty on purpose: the HTTP connector (hyper-rustls) sets
/// it to what it can speak and refuses a preset list.
pub fn executor_client_config(
    svids: &SvidStream,
    facade_spiffe_id: &str,
) -> Result<rustls::ClientConfig, SvidStreamError> {
    let id = SpiffeId::new(facade_spiffe_id).map_err(|source| SvidStreamError::InvalidId {
        value: facade_spiffe_id.to_string(),
        source,
    })?;
    let provider = provider();
    let verifier = FacadeVerifier {
        shared: Arc::clone(&svids.shared),
        trust_domain: id.trust_domain().clone(),
        id,
        provider: Arc::clone(&provider),
    };
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|source| SvidStreamError::Config { source })?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(verifier))
        .with_client_cert_resolver(Arc::new(OwnSvid {
            shared: Arc::clone(&svids.shared),
        }));
    config.resumption = Resumption::disabled();
    Ok(config)
}

/// Presents the SVID current at each handshake.
struct OwnSvid {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for OwnSvid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnSvid").finish_non_exhaustive()
    }
}

impl ResolvesClientCert for OwnSvid {
    fn resolve(
        &self,
        _root_hint_subjects: &[&[u8]],
        _sigschemes: &[SignatureScheme],
    ) -> Option<Arc<CertifiedKey>> {
        Some(Arc::clone(&self.shared.current().key))
    }

    fn has_certs(&self) -> bool {
        true
    }
}

/// Accepts exactly the facade: a chain to the current bundle of the facade's own trust
/// domain (federated bundles never widen it), and the leaf's one SPIFFE ID equal to
/// the configured one. The TLS server name is not checked: SVIDs carry no DNS names,
/// the SPIFFE ID is the identity.
struct FacadeVerifier {
    shared: Arc<Shared>,
    trust_domain: TrustDomain,
    id: SpiffeId,
    provider: Arc<CryptoProvider>,
}

impl std::fmt::Debug for FacadeVerifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FacadeVerifier")
            .field("id", &self.id.to_string())
            .finish_non_exhaustive()
    }
}

impl ServerCertVerifier for FacadeVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let material = self.shared.current();
        let roots = material.roots.get(&self.trust_domain).ok_or_else(|| {
            rustls::Error::General(format!("no trust bundle for {}", self.trust_domain))
        })?;
        let parsed = ParsedCertificate::try_from(end_entity)?;
        verify_server_cert_signed_by_trust_anchor(
            &parsed,
            roots,
            intermediates,
            now,
            self.provider.signature_verification_algorithms.all,
        )?;
        let peer = spiffe::cert::spiffe_id_from_der(end_entity.as_ref()).map_err(|e| {
            rustls::Error::InvalidCertificate(rustls::CertificateError::Other(rustls::OtherError(
                Arc::new(e),
            )))
        })?;
        if peer != self.id {
            return Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::ApplicationVerificationFailure,
            ));
        }
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}
