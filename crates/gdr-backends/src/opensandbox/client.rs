//! A typed client of the OpenSandbox Lifecycle API (`…/v1`), as the 1.1.1 server answers
//! it (`shared/reference/opensandbox-1.1.1.md`).
//!
//! The HTTP status decides what an answer means; the body's `code` is kept only as a hint
//! for logs (the server reuses codes across runtimes, e.g. `DOCKER::INVALID_EXPIRATION` in
//! Kubernetes mode, and leaves some un-namespaced). Both error body shapes are read: the
//! server's `{"code","message"}` and FastAPI's validation `{"detail":[…]}`.
//!
//! `POST /sandboxes` blocks until the sandbox runs (server-side up to
//! `sandbox_create_timeout_seconds`, 60 s by default), so creates get their own, longer
//! timeout ([`ClientSettings::create_timeout`]). The API key is sent as
//! `OPEN-SANDBOX-API-KEY`, marked sensitive, and never appears in `Debug` or logs.

use std::collections::BTreeMap;
use std::fmt;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::{HeaderValue, Method, Request, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::{Deserialize, Serialize};
use url::Url;

/// The header carrying the API key.
pub const API_KEY_HEADER: &str = "OPEN-SANDBOX-API-KEY";
/// The server's upper bound on `pageSize`.
pub const MAX_PAGE_SIZE: u32 = 200;
/// The server's lower bound on a sandbox timeout.
pub const MIN_TIMEOUT: Duration = Duration::from_secs(60);
/// Largest response body read (a full page of sandboxes with chunked metadata is far less).
const MAX_BODY_BYTES: usize = 16 * 1024 * 1024;
/// How much of a non-JSON error body goes into an error message.
const MAX_RAW_MESSAGE: usize = 512;

/// The API key, from a file; redacted in `Debug`.
#[derive(Clone)]
pub struct ApiKey(String);

impl ApiKey {
    /// A key from the contents of the key file (surrounding whitespace removed).
    pub fn from_file_contents(contents: &str) -> Result<Self, ClientError> {
        let key = contents.trim();
        if key.is_empty() {
            return Err(ClientError::Config(
                "the OpenSandbox API key file is empty".into(),
            ));
        }
        Ok(ApiKey(key.to_owned()))
    }

    fn header(&self) -> Result<HeaderValue, ClientError> {
        let mut value = HeaderValue::from_str(&self.0).map_err(|_| {
            ClientError::Config("the OpenSandbox API key is not a valid header value".into())
        })?;
        value.set_sensitive(true);
        Ok(value)
    }
}

impl fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ApiKey(<redacted>)")
    }
}

/// Where the Lifecycle API is and how long calls may take.
#[derive(Debug, Clone)]
pub struct ClientSettings {
    /// Base URL including the version prefix, e.g. `https://opensandbox.example/v1`.
    pub base_url: Url,
    /// Timeout of every call but create.
    pub request_timeout: Duration,
    /// Timeout of a create, which blocks until the sandbox runs: keep it above the
    /// server's `sandbox_create_timeout_seconds` (60 s by default), so the server's own
    /// answer (504 after deleting the sandbox, 429 when the pool stays full) arrives.
    pub create_timeout: Duration,
}

impl ClientSettings {
    /// Settings for `base_url` with the defaults: 30 s per call, 90 s per create.
    pub fn new(base_url: Url) -> Self {
        ClientSettings {
            base_url,
            request_timeout: crate::defaults::opensandbox::REQUEST_TIMEOUT,
            create_timeout: crate::defaults::opensandbox::CREATE_TIMEOUT,
        }
    }
}

/// The error body of the server, whichever shape it had.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// The server's code (`KUBERNETES::POOL_NOT_FOUND`, …), or the first FastAPI error
    /// `type` (`greater_than_equal`, …); only a hint.
    pub code: Option<String>,
    /// What the server said, for operators and for the Gitea task log.
    pub message: String,
}

impl fmt::Display for ApiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.code {
            Some(code) => write!(f, "{} ({code})", self.message),
            None => f.write_str(&self.message),
        }
    }
}

impl ApiError {
    /// Parses `{"code","message"}`, FastAPI's `{"detail":[{type,loc,msg}]}` or
    /// `{"detail":"…"}`, else keeps the (shortened) raw body.
    pub fn parse(status: StatusCode, body: &[u8]) -> Self {
        #[derive(Deserialize)]
        struct Envelope {
            code: Option<String>,
            message: Option<String>,
            detail: Option<serde_json::Value>,
        }
        if let Ok(envelope) = serde_json::from_slice::<Envelope>(body) {
            if let Some(message) = envelope.message {
                return ApiError {
                    code: envelope.code,
                    message,
                };
            }
            match envelope.detail {
                Some(serde_json::Value::Array(items)) if !items.is_empty() => {
                    return Self::from_validation(&items);
                }
                Some(serde_json::Value::String(message)) => {
                    return ApiError {
                        code: envelope.code,
                        message,
                    };
                }
                _ => {}
            }
        }
        let text = String::from_utf8_lossy(body);
        let text = text.trim();
        ApiError {
            code: None,
            message: if text.is_empty() {
                status
                    .canonical_reason()
                    .unwrap_or("no error body")
                    .to_owned()
            } else {
                text.chars().take(MAX_RAW_MESSAGE).collect()
            },
        }
    }

    fn from_validation(items: &[serde_json::Value]) -> Self {
        let describe = |item: &serde_json::Value| {
            let msg = item
                .get("msg")
                .and_then(|m| m.as_str())
                .unwrap_or("invalid");
            let loc: Vec<String> = item
                .get("loc")
                .and_then(|l| l.as_array())
                .map(|parts| {
                    parts
                        .iter()
                        .map(|p| match p {
                            serde_json::Value::String(s) => s.clone(),
                            other => other.to_string(),
                        })
                        .collect()
                })
                .unwrap_or_default();
            if loc.is_empty() {
                msg.to_owned()
            } else {
                format!("{}: {msg}", loc.join("."))
            }
        };
        ApiError {
            code: items
                .first()
                .and_then(|i| i.get("type"))
                .and_then(|t| t.as_str())
                .map(str::to_owned),
            message: items.iter().map(describe).collect::<Vec<_>>().join("; "),
        }
    }
}

/// Why a Lifecycle API call failed, by what the answer means.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The client cannot be set up as configured.
    #[error("OpenSandbox client configuration: {0}")]
    Config(String),
    /// A request cannot be built from what the settings give (its URL or a header).
    #[error("OpenSandbox client configuration: cannot build a request to {url}: {source}")]
    Request {
        /// The URL the request was for.
        url: String,
        /// The cause.
        #[source]
        source: http::Error,
    },
    /// An expiry that RFC 3339 cannot express (before year -9999 or after 9999).
    #[error("OpenSandbox client configuration: expiry out of range: {source}")]
    Expiry {
        /// The cause.
        #[source]
        source: jiff::Error,
    },
    /// The server could not be reached or the connection broke.
    #[error("OpenSandbox {op}: request failed: {source}")]
    Transport {
        /// The operation.
        op: &'static str,
        /// The cause.
        #[source]
        source: hyper_util::client::legacy::Error,
    },
    /// Reading the answer failed.
    #[error("OpenSandbox {op}: reading the response failed: {source}")]
    Body {
        /// The operation.
        op: &'static str,
        /// The cause.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// No answer within the timeout.
    #[error("OpenSandbox {op}: no answer within {after:?}")]
    Timeout {
        /// The operation.
        op: &'static str,
        /// The timeout that passed.
        after: Duration,
    },
    /// 401/403: the API key is missing, wrong or lacks permission (or, with code
    /// `KUBERNETES::QUOTA_EXCEEDED`, the namespace quota is exhausted): a configuration
    /// problem for the operator, not a property of the task.
    #[error(
        "OpenSandbox {op}: refused with HTTP {status}: {api}; check opensandbox_api_key_file and the key's permissions"
    )]
    Unauthorized {
        /// The operation.
        op: &'static str,
        /// 401 or 403.
        status: u16,
        /// The server's answer.
        api: ApiError,
    },
    /// 404 on a create naming a pool: the pool does not exist (configuration).
    #[error("OpenSandbox pool `{pool}` not found: {api}; check opensandbox_pool")]
    PoolNotFound {
        /// The pool named.
        pool: String,
        /// The server's answer.
        api: ApiError,
    },
    /// 404: the sandbox does not exist (any more).
    #[error("OpenSandbox {op}: sandbox not found: {api}")]
    NotFound {
        /// The operation.
        op: &'static str,
        /// The server's answer.
        api: ApiError,
    },
    /// 429: the pool had no room before the server's acquisition timeout; the server
    /// deleted the sandbox.
    #[error("OpenSandbox pool full: {api}")]
    PoolFull {
        /// The server's `Retry-After`.
        retry_after: Option<Duration>,
        /// The server's answer.
        api: ApiError,
    },
    /// 504 on a create: the sandbox did not become ready in time and the server deleted it.
    #[error("OpenSandbox create: the sandbox did not start in time and was deleted: {api}")]
    CreateTimedOut {
        /// The server's answer.
        api: ApiError,
    },
    /// 400/422: the request can never succeed as sent.
    #[error("OpenSandbox {op}: request refused with HTTP {status}: {api}")]
    Invalid {
        /// The operation.
        op: &'static str,
        /// 400 or 422.
        status: u16,
        /// The server's answer.
        api: ApiError,
    },
    /// 409: the sandbox's state forbids the operation (e.g. renew without expiry).
    #[error("OpenSandbox {op}: conflict: {api}")]
    Conflict {
        /// The operation.
        op: &'static str,
        /// The server's answer.
        api: ApiError,
    },
    /// Any other status (5xx and the unexpected).
    #[error("OpenSandbox {op}: HTTP {status}: {api}")]
    Status {
        /// The operation.
        op: &'static str,
        /// The status.
        status: u16,
        /// The server's answer.
        api: ApiError,
    },
    /// A success answer that does not have the documented shape.
    #[error("OpenSandbox {op}: unexpected response body: {source}")]
    Decode {
        /// The operation.
        op: &'static str,
        /// The cause.
        #[source]
        source: serde_json::Error,
    },
}

impl ClientError {
    /// Whether the operator must change the configuration (API key, pool name) before
    /// this can succeed.
    pub fn is_configuration(&self) -> bool {
        matches!(
            self,
            ClientError::Config(_)
                | ClientError::Request { .. }
                | ClientError::Expiry { .. }
                | ClientError::Unauthorized { .. }
                | ClientError::PoolNotFound { .. }
        )
    }
}

/// What to create: a sandbox of `pool` running `entrypoint`.
#[derive(Debug, Clone)]
pub struct CreateSandbox {
    /// `extensions.poolRef`.
    pub pool: String,
    /// The command the sandbox runs (pool mode: inside the pool's image).
    pub entrypoint: Vec<String>,
    /// Its environment.
    pub env: BTreeMap<String, String>,
    /// Label-valued metadata (≤ 63 characters of `[A-Za-z0-9._-]` per value).
    pub metadata: BTreeMap<String, String>,
    /// Lifetime before the server expires the sandbox (≥ 60 s); `None`: no expiry.
    pub timeout: Option<Duration>,
}

impl fmt::Display for CreateSandbox {
    // The environment holds the capability; only its names are shown.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "sandbox of pool {} running {:?} with env names {:?}",
            self.pool,
            self.entrypoint,
            self.env.keys().collect::<Vec<_>>()
        )
    }
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct CreateSandboxBody<'a> {
    entrypoint: &'a [String],
    env: &'a BTreeMap<String, String>,
    metadata: &'a BTreeMap<String, String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    timeout: Option<u64>,
    extensions: BTreeMap<&'static str, &'a str>,
}

/// `status` of a sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxStatus {
    /// `Pending`, `Allocated`, `Running`, `Pausing`, `Paused`, `Resuming`, `Stopping`,
    /// `Terminated` or `Failed`.
    pub state: String,
    /// A machine-readable reason (`TASK_FAILED`, `POOL_CAPACITY_EXHAUSTED`, …).
    #[serde(default)]
    pub reason: Option<String>,
    /// A human-readable message.
    #[serde(default)]
    pub message: Option<String>,
}

/// A sandbox as the server reports it (the fields this project reads).
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Sandbox {
    /// Server-generated ID.
    pub id: String,
    /// Current state.
    pub status: SandboxStatus,
    /// Creation time.
    #[serde(with = "rfc3339")]
    pub created_at: SystemTime,
    /// Expiry, when the sandbox has a timeout.
    #[serde(default, with = "rfc3339_option")]
    pub expires_at: Option<SystemTime>,
    /// User metadata (the server omits the key when there is none).
    #[serde(default)]
    pub metadata: Option<BTreeMap<String, String>>,
}

impl Sandbox {
    /// The metadata, empty when the server sent none.
    pub fn metadata(&self) -> BTreeMap<String, String> {
        self.metadata.clone().unwrap_or_default()
    }
}

/// One page of a list.
#[derive(Debug, Clone, Deserialize)]
pub struct SandboxPage {
    /// The sandboxes of this page (newest first).
    pub items: Vec<Sandbox>,
    /// Where this page is.
    pub pagination: Pagination,
}

/// `pagination` of a list page.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Pagination {
    /// This page (from 1).
    pub page: u32,
    /// Items per page.
    pub page_size: u32,
    /// Matching sandboxes in all pages.
    pub total_items: u64,
    /// Whether another page follows.
    pub has_next_page: bool,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RenewBody {
    #[serde(with = "rfc3339")]
    expires_at: SystemTime,
}

/// `at` as the server takes an expiry (RFC 3339).
fn expiry_text(at: SystemTime) -> Result<String, ClientError> {
    rfc3339::format(at).map_err(|source| ClientError::Expiry { source })
}

mod rfc3339 {
    use std::time::SystemTime;

    use serde::{Deserialize, Deserializer};

    pub(super) fn parse(text: &str) -> Result<SystemTime, jiff::Error> {
        text.parse::<jiff::Timestamp>().map(SystemTime::from)
    }

    pub(super) fn format(time: SystemTime) -> Result<String, jiff::Error> {
        jiff::Timestamp::try_from(time).map(|t| t.to_string())
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<SystemTime, D::Error> {
        let text = String::deserialize(d)?;
        parse(&text).map_err(serde::de::Error::custom)
    }
}

mod rfc3339_option {
    use std::time::SystemTime;

    use serde::{Deserialize, Deserializer};

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Option<SystemTime>, D::Error> {
        Option::<String>::deserialize(d)?
            .map(|text| super::rfc3339::parse(&text).map_err(serde::de::Error::custom))
            .transpose()
    }
}

/// A list query: exact-match metadata (AND), optional states (OR), page size ≤ 200.
#[derive(Debug, Clone, Default)]
pub struct ListQuery {
    /// Metadata every sandbox must carry.
    pub metadata: BTreeMap<String, String>,
    /// States to include (case-insensitive); empty: all.
    pub states: Vec<String>,
    /// Page size (1..=200); 0 means 200.
    pub page_size: u32,
}

/// The Lifecycle API client. Cheap to clone.
#[derive(Clone)]
pub struct LifecycleClient {
    settings: ClientSettings,
    key: HeaderValue,
    http: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
}

impl fmt::Debug for LifecycleClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LifecycleClient")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl LifecycleClient {
    /// A client of `settings.base_url`, authenticating with `api_key`, over `tls` for
    /// https (the shared rustls configuration; plain http is used as is).
    pub fn new(
        settings: ClientSettings,
        api_key: &ApiKey,
        tls: rustls::ClientConfig,
    ) -> Result<Self, ClientError> {
        match settings.base_url.scheme() {
            "http" | "https" => {}
            other => {
                return Err(ClientError::Config(format!(
                    "opensandbox_api must be http or https, not {other:?}"
                )));
            }
        }
        if settings.base_url.cannot_be_a_base() {
            return Err(ClientError::Config(format!(
                "opensandbox_api {} cannot be a base URL",
                settings.base_url
            )));
        }
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_nodelay(true);
        http.set_connect_timeout(Some(settings.request_timeout));
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .enable_http2()
            .wrap_connector(http);
        Ok(LifecycleClient {
            key: api_key.header()?,
            settings,
            http: Client::builder(TokioExecutor::new()).build(connector),
        })
    }

    /// The settings.
    pub fn settings(&self) -> &ClientSettings {
        &self.settings
    }

    fn url(&self, segments: &[&str], query: &[(&str, String)]) -> Result<Url, ClientError> {
        let mut url = self.settings.base_url.clone();
        {
            let mut path = url.path_segments_mut().map_err(|()| {
                ClientError::Config(format!("{} cannot be a base URL", self.settings.base_url))
            })?;
            path.pop_if_empty().extend(segments);
        }
        if !query.is_empty() {
            let mut pairs = url.query_pairs_mut();
            for (k, v) in query {
                pairs.append_pair(k, v);
            }
        }
        Ok(url)
    }

    async fn call(
        &self,
        op: &'static str,
        method: Method,
        url: Url,
        body: Option<Vec<u8>>,
        timeout: Duration,
    ) -> Result<(StatusCode, http::HeaderMap, Bytes), ClientError> {
        let mut builder = Request::builder()
            .method(method)
            .uri(url.as_str())
            .header(API_KEY_HEADER, self.key.clone())
            .header(header::ACCEPT, "application/json");
        if body.is_some() {
            builder = builder.header(header::CONTENT_TYPE, "application/json");
        }
        let request = builder
            .body(Full::new(Bytes::from(body.unwrap_or_default())))
            .map_err(|source| ClientError::Request {
                url: url.to_string(),
                source,
            })?;
        let exchange = async {
            let response = self
                .http
                .request(request)
                .await
                .map_err(|source| ClientError::Transport { op, source })?;
            let (parts, body) = response.into_parts();
            let bytes = Limited::new(body, MAX_BODY_BYTES)
                .collect()
                .await
                .map_err(|source| ClientError::Body { op, source })?
                .to_bytes();
            Ok((parts.status, parts.headers, bytes))
        };
        tokio::time::timeout(timeout, exchange)
            .await
            .map_err(|_| ClientError::Timeout { op, after: timeout })?
    }

    /// The error of a non-success answer, by status.
    fn failure(
        op: &'static str,
        status: StatusCode,
        headers: &http::HeaderMap,
        body: &[u8],
    ) -> ClientError {
        let api = ApiError::parse(status, body);
        match status.as_u16() {
            401 | 403 => ClientError::Unauthorized {
                op,
                status: status.as_u16(),
                api,
            },
            404 => ClientError::NotFound { op, api },
            409 => ClientError::Conflict { op, api },
            400 | 422 => ClientError::Invalid {
                op,
                status: status.as_u16(),
                api,
            },
            429 => ClientError::PoolFull {
                retry_after: retry_after(headers),
                api,
            },
            code => ClientError::Status {
                op,
                status: code,
                api,
            },
        }
    }

    fn decode<T: for<'de> Deserialize<'de>>(
        op: &'static str,
        body: &[u8],
    ) -> Result<T, ClientError> {
        serde_json::from_slice(body).map_err(|source| ClientError::Decode { op, source })
    }

    /// Creates a sandbox and waits (server-side) until it runs: 202 with the sandbox.
    pub async fn create(&self, request: &CreateSandbox) -> Result<Sandbox, ClientError> {
        const OP: &str = "create";
        let body = CreateSandboxBody {
            entrypoint: &request.entrypoint,
            env: &request.env,
            metadata: &request.metadata,
            timeout: request.timeout.map(|t| t.as_secs()),
            extensions: BTreeMap::from([("poolRef", request.pool.as_str())]),
        };
        let body =
            serde_json::to_vec(&body).map_err(|source| ClientError::Decode { op: OP, source })?;
        let url = self.url(&["sandboxes"], &[])?;
        let (status, headers, bytes) = self
            .call(
                OP,
                Method::POST,
                url,
                Some(body),
                self.settings.create_timeout,
            )
            .await?;
        if status.is_success() {
            return Self::decode(OP, &bytes);
        }
        Err(match Self::failure(OP, status, &headers, &bytes) {
            // A create names exactly one thing that can be missing: the pool.
            ClientError::NotFound { api, .. } => ClientError::PoolNotFound {
                pool: request.pool.clone(),
                api,
            },
            ClientError::Status {
                status: 504, api, ..
            } => ClientError::CreateTimedOut { api },
            other => other,
        })
    }

    /// The sandbox `id`, or `None` when it does not exist.
    pub async fn get(&self, id: &str) -> Result<Option<Sandbox>, ClientError> {
        const OP: &str = "get";
        let url = self.url(&["sandboxes", id], &[])?;
        let (status, headers, bytes) = self
            .call(OP, Method::GET, url, None, self.settings.request_timeout)
            .await?;
        match status {
            s if s.is_success() => Self::decode(OP, &bytes).map(Some),
            StatusCode::NOT_FOUND => Ok(None),
            s => Err(Self::failure(OP, s, &headers, &bytes)),
        }
    }

    /// One page (from 1) of the sandboxes matching `query`.
    pub async fn list_page(
        &self,
        query: &ListQuery,
        page: u32,
    ) -> Result<SandboxPage, ClientError> {
        const OP: &str = "list";
        let page_size = match query.page_size {
            0 => MAX_PAGE_SIZE,
            n => n.min(MAX_PAGE_SIZE),
        };
        let mut params = vec![
            ("page", page.max(1).to_string()),
            ("pageSize", page_size.to_string()),
        ];
        if !query.metadata.is_empty() {
            // One parameter holding `k=v&k2=v2`, itself URL-encoded.
            let filter = url::form_urlencoded::Serializer::new(String::new())
                .extend_pairs(&query.metadata)
                .finish();
            params.push(("metadata", filter));
        }
        params.extend(query.states.iter().map(|s| ("state", s.clone())));
        let url = self.url(&["sandboxes"], &params)?;
        let (status, headers, bytes) = self
            .call(OP, Method::GET, url, None, self.settings.request_timeout)
            .await?;
        if status.is_success() {
            Self::decode(OP, &bytes)
        } else {
            Err(Self::failure(OP, status, &headers, &bytes))
        }
    }

    /// Every sandbox matching `query`, following `hasNextPage`. Sandboxes created or
    /// deleted meanwhile shift the pages (the server sorts newest first): an ID seen twice
    /// is kept once, and one deleted during the walk may push another past a page end,
    /// so callers reconcile repeatedly rather than trusting a single walk.
    pub async fn list(&self, query: &ListQuery) -> Result<Vec<Sandbox>, ClientError> {
        let mut seen = std::collections::HashSet::new();
        let mut all = Vec::new();
        let mut page = 1;
        loop {
            let result = self.list_page(query, page).await?;
            for sandbox in result.items {
                if seen.insert(sandbox.id.clone()) {
                    all.push(sandbox);
                }
            }
            if !result.pagination.has_next_page {
                return Ok(all);
            }
            page += 1;
        }
    }

    /// Merge-patches the metadata of `id` (RFC 7396: `None` removes a key); the sandbox
    /// as patched.
    pub async fn patch_metadata(
        &self,
        id: &str,
        patch: &BTreeMap<String, Option<String>>,
    ) -> Result<Sandbox, ClientError> {
        const OP: &str = "patch metadata";
        let body =
            serde_json::to_vec(patch).map_err(|source| ClientError::Decode { op: OP, source })?;
        let url = self.url(&["sandboxes", id, "metadata"], &[])?;
        let (status, headers, bytes) = self
            .call(
                OP,
                Method::PATCH,
                url,
                Some(body),
                self.settings.request_timeout,
            )
            .await?;
        if status.is_success() {
            Self::decode(OP, &bytes)
        } else {
            Err(Self::failure(OP, status, &headers, &bytes))
        }
    }

    /// Deletes `id`: `true` when deleted, `false` when it was already gone (404).
    pub async fn delete(&self, id: &str) -> Result<bool, ClientError> {
        const OP: &str = "delete";
        let url = self.url(&["sandboxes", id], &[])?;
        let (status, headers, bytes) = self
            .call(OP, Method::DELETE, url, None, self.settings.request_timeout)
            .await?;
        match status {
            s if s.is_success() => Ok(true),
            StatusCode::NOT_FOUND => Ok(false),
            s => Err(Self::failure(OP, s, &headers, &bytes)),
        }
    }

    /// Moves the expiry of `id` to `expires_at`; the expiry the server recorded.
    pub async fn renew_expiration(
        &self,
        id: &str,
        expires_at: SystemTime,
    ) -> Result<SystemTime, ClientError> {
        const OP: &str = "renew expiration";
        let at = expiry_text(expires_at)?;
        let body = serde_json::to_vec(&serde_json::json!({ "expiresAt": at }))
            .map_err(|source| ClientError::Decode { op: OP, source })?;
        let url = self.url(&["sandboxes", id, "renew-expiration"], &[])?;
        let (status, headers, bytes) = self
            .call(
                OP,
                Method::POST,
                url,
                Some(body),
                self.settings.request_timeout,
            )
            .await?;
        if status.is_success() {
            Self::decode::<RenewBody>(OP, &bytes).map(|b| b.expires_at)
        } else {
            Err(Self::failure(OP, status, &headers, &bytes))
        }
    }
}

/// `Retry-After` as delta-seconds (what the server sends); an HTTP date is not used by it.
fn retry_after(headers: &http::HeaderMap) -> Option<Duration> {
    headers
        .get(header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim()
        .parse::<u64>()
        .ok()
        .map(Duration::from_secs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_error_body_shapes_are_read() {
        let api = ApiError::parse(
            StatusCode::NOT_FOUND,
            br#"{"code":"KUBERNETES::POOL_NOT_FOUND","message":"Pool 'x' not found."}"#,
        );
        assert_eq!(api.code.as_deref(), Some("KUBERNETES::POOL_NOT_FOUND"));
        assert_eq!(api.message, "Pool 'x' not found.");
        let api = ApiError::parse(
            StatusCode::UNPROCESSABLE_ENTITY,
            br#"{"detail":[{"type":"greater_than_equal","loc":["body","timeout"],"msg":"Input should be greater than or equal to 60","input":30}]}"#,
        );
        assert_eq!(api.code.as_deref(), Some("greater_than_equal"));
        assert_eq!(
            api.message,
            "body.timeout: Input should be greater than or equal to 60"
        );
        let api = ApiError::parse(StatusCode::BAD_GATEWAY, b"<html>bad gateway</html>");
        assert_eq!(api.message, "<html>bad gateway</html>");
        let api = ApiError::parse(StatusCode::BAD_GATEWAY, b"");
        assert_eq!(api.message, "Bad Gateway");
    }

    #[test]
    fn timestamps_with_and_without_fractions_parse() {
        for text in [
            "2026-12-01T11:00:56Z",
            "2026-12-01T11:00:56.721872Z",
            "2026-12-01T11:00:56.721872+00:00",
        ] {
            assert!(rfc3339::parse(text).is_ok(), "{text}");
        }
    }

    /// Issue 41 item 3: an expiry RFC 3339 cannot express is a configuration error that
    /// keeps jiff's cause, not a string made of it.
    #[test]
    fn an_expiry_out_of_range_is_a_configuration_error_keeping_its_cause() {
        let far = SystemTime::UNIX_EPOCH + Duration::from_secs(1 << 40);
        let e = expiry_text(far).unwrap_err();
        assert!(e.is_configuration(), "{e}");
        assert!(
            std::error::Error::source(&e).is_some(),
            "the cause is kept: {e:?}"
        );
        assert!(expiry_text(SystemTime::UNIX_EPOCH).is_ok());
    }

    #[test]
    fn the_api_key_never_shows_in_debug_output() {
        let key = ApiKey::from_file_contents("s3cret-key\n").unwrap();
        assert!(!format!("{key:?}").contains("s3cret"));
        assert!(ApiKey::from_file_contents(" \n").is_err());
    }
}
