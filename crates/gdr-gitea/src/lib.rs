//! The Gitea client: the Connect client for Gitea's `runner.v1.RunnerService`, runner
//! registration ([`register`]) and the mapping of Gitea's errors ([`GiteaError`]).
//!
//! Wire types stay at this boundary's edge: callers get typed errors
//! ([`GiteaError`]) instead of Connect codes, and the controller's credential is
//! held in a [`Credentials`] value whose `Debug` never shows the token. The crate knows
//! nothing of the controller (no settings, NATS or Kubernetes): the controller builds its
//! [`ClientOptions`] and [`Credentials`] from its configuration.

mod error;
pub mod register;
pub mod tls;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use connectrpc::client::{CallOptions, ClientConfig, HttpClient};
pub use error::{ErrorKind, GiteaError};
use gdr_proto::ping::v1::{PingRequest, PingServiceClient};
use gdr_proto::runner::v1::{
    DeclareRequest, FetchTaskRequest, FetchTaskResponse, RegisterRequest, Runner,
    RunnerServiceClient, UpdateLogRequest, UpdateLogResponse, UpdateTaskRequest,
    UpdateTaskResponse,
};
use http::HeaderValue;

/// The version reported to Gitea (Declare, Register): the workspace's, which is the
/// controller's.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
/// Header carrying the runner UUID on every call but Register/Ping.
pub const UUID_HEADER: &str = "x-runner-uuid";
/// Header carrying the runner token on every call but Register/Ping.
pub const TOKEN_HEADER: &str = "x-runner-token";
/// How every log row the controller itself writes into a task's log begins.
pub const FAILURE_LOG_PREFIX: &str = "gitea-dynamic-runner: ";
/// Response header of `Declare` listing server capabilities (e.g. `job-summary`).
pub const CAPABILITIES_HEADER: &str = "x-gitea-actions-capabilities";
/// The largest FetchTask answer read (connectrpc's default is 4 MiB). A task is the job's
/// workflow, context, secrets and variables; Gitea caps secret and variable values at
/// 64 KiB each but not their number nor the workflow's size, and an answer the client
/// cannot read is a task Gitea has claimed for us and nobody runs.
pub const FETCH_TASK_MESSAGE_LIMIT: usize = 32 * 1024 * 1024;

/// The runner identity the controller authenticates with.
#[derive(Clone)]
pub struct Credentials {
    /// Runner UUID (not secret, but only meaningful with the token).
    pub uuid: String,
    token: String,
}

impl Credentials {
    /// Builds credentials from a UUID and a token.
    pub fn new(uuid: impl Into<String>, token: impl Into<String>) -> Self {
        Credentials {
            uuid: uuid.into(),
            token: token.into(),
        }
    }
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credentials")
            .field("uuid", &self.uuid)
            .field("token", &"<redacted>")
            .finish()
    }
}

/// How to reach Gitea.
#[derive(Debug, Clone)]
pub struct ClientOptions {
    /// Gitea base URL, e.g. `https://gitea.example.org` (the client appends `/api/actions`).
    pub base_url: String,
    /// Extra CA certificates (PEM) trusted for an https Gitea, besides the system roots.
    pub extra_ca_pem: Option<Vec<u8>>,
    /// Timeout of every call except FetchTask.
    pub request_timeout: Duration,
    /// Timeout of FetchTask.
    pub fetch_timeout: Duration,
    /// TCP + TLS connection establishment bound.
    pub connect_timeout: Duration,
    /// Largest FetchTask answer read ([`FETCH_TASK_MESSAGE_LIMIT`]).
    pub fetch_message_limit: usize,
}

impl ClientOptions {
    /// Options with the defaults of the official runner (60 s requests, 5 s fetch).
    pub fn new(base_url: impl Into<String>) -> Self {
        ClientOptions {
            base_url: base_url.into(),
            extra_ca_pem: None,
            request_timeout: Duration::from_secs(60),
            fetch_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(10),
            fetch_message_limit: FETCH_TASK_MESSAGE_LIMIT,
        }
    }
}

/// What `Declare` answered.
#[derive(Debug, Clone)]
pub struct Declared {
    /// The runner record Gitea holds.
    pub runner: Runner,
    /// Raw `X-Gitea-Actions-Capabilities` value, passed on to one-shot runners.
    pub server_capabilities: Option<String>,
}

/// What became of a failure report Gitea answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reported {
    /// Gitea recorded the failure (or the task had ended already: its first result wins).
    Accepted,
    /// Gitea does not know the task: it was removed or never existed.
    TaskGone,
}

/// A Connect client for Gitea's RunnerService.
#[derive(Clone)]
pub struct GiteaClient {
    runner: RunnerServiceClient<HttpClient>,
    ping: PingServiceClient<HttpClient>,
    options: Arc<ClientOptions>,
}

impl fmt::Debug for GiteaClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GiteaClient")
            .field("base_url", &self.options.base_url)
            .finish()
    }
}

impl GiteaClient {
    /// Builds a client. `credentials` is `None` only for registration.
    pub fn new(
        options: ClientOptions,
        credentials: Option<&Credentials>,
    ) -> Result<Self, GiteaError> {
        let base = options.base_url.trim_end_matches('/');
        let url = url::Url::parse(base)
            .map_err(|e| GiteaError::config_caused(format!("Gitea URL {base:?} is invalid"), e))?;
        let api: http::Uri = format!("{base}/api/actions")
            .parse()
            .map_err(|e| GiteaError::config_caused(format!("Gitea URL {base:?} is invalid"), e))?;
        let builder = HttpClient::builder().connect_timeout(options.connect_timeout);
        let http = match url.scheme() {
            "http" => builder.plaintext(),
            "https" => builder.with_tls(Arc::new(tls_config(options.extra_ca_pem.as_deref())?)),
            other => {
                return Err(GiteaError::config(format!(
                    "Gitea URL {base:?} has scheme {other:?}; expected http or https"
                )));
            }
        };
        let mut config = ClientConfig::new(api)
            .with_default_timeout(options.request_timeout)
            .with_default_header(
                http::header::USER_AGENT,
                HeaderValue::from_static(concat!(
                    "gitea-dynamic-runner/",
                    env!("CARGO_PKG_VERSION")
                )),
            );
        if let Some(creds) = credentials {
            let uuid = HeaderValue::from_str(&creds.uuid).map_err(|e| {
                GiteaError::config_caused("runner UUID is not a valid header value".into(), e)
            })?;
            let mut token = HeaderValue::from_str(&creds.token).map_err(|e| {
                GiteaError::config_caused("runner token is not a valid header value".into(), e)
            })?;
            // hyper keeps sensitive values out of HPACK tables and Debug output.
            token.set_sensitive(true);
            config = config
                .with_default_header(UUID_HEADER, uuid)
                .with_default_header(TOKEN_HEADER, token);
        }
        Ok(GiteaClient {
            runner: RunnerServiceClient::new(http.clone(), config.clone()),
            ping: PingServiceClient::new(http, config),
            options: Arc::new(options),
        })
    }

    /// The Gitea base URL this client talks to.
    pub fn base_url(&self) -> &str {
        &self.options.base_url
    }

    /// Registers a new runner with a registration token.
    pub async fn register(&self, request: RegisterRequest) -> Result<Runner, GiteaError> {
        let resp = self
            .runner
            .register(request)
            .await
            .map_err(|e| GiteaError::from_connect("Register", e))?;
        let resp = resp.into_owned();
        resp.runner
            .into_option()
            .ok_or_else(|| GiteaError::protocol("Register", "answer has no runner"))
    }

    /// Declares version, labels and capabilities before fetching.
    pub async fn declare(
        &self,
        labels: Vec<String>,
        capabilities: Vec<String>,
    ) -> Result<Declared, GiteaError> {
        let request = DeclareRequest {
            version: VERSION.to_string(),
            labels,
            capabilities,
            ..Default::default()
        };
        let resp = self
            .runner
            .declare(request)
            .await
            .map_err(|e| GiteaError::from_connect("Declare", e))?;
        let (headers, body, _) = resp.into_owned_parts();
        let runner = body
            .runner
            .into_option()
            .ok_or_else(|| GiteaError::protocol("Declare", "answer has no runner"))?;
        let server_capabilities = headers
            .get(CAPABILITIES_HEADER)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        Ok(Declared {
            runner,
            server_capabilities,
        })
    }

    /// Polls for a task; bounded by the fetch timeout.
    pub async fn fetch_task(&self, tasks_version: i64) -> Result<FetchTaskResponse, GiteaError> {
        let request = FetchTaskRequest {
            tasks_version,
            ..Default::default()
        };
        let options = CallOptions::default()
            .with_timeout(self.options.fetch_timeout)
            .with_max_message_size(self.options.fetch_message_limit);
        let resp = self
            .runner
            .fetch_task_with_options(request, options)
            .await
            .map_err(|e| GiteaError::from_connect("FetchTask", e))?;
        Ok(resp.into_owned())
    }

    /// Reports task state (a heartbeat when `result` is unspecified).
    pub async fn update_task(
        &self,
        request: UpdateTaskRequest,
    ) -> Result<UpdateTaskResponse, GiteaError> {
        let resp = self
            .runner
            .update_task(request)
            .await
            .map_err(|e| GiteaError::from_connect("UpdateTask", e))?;
        Ok(resp.into_owned())
    }

    /// Uploads log rows.
    pub async fn update_log(
        &self,
        request: UpdateLogRequest,
    ) -> Result<UpdateLogResponse, GiteaError> {
        let resp = self
            .runner
            .update_log(request)
            .await
            .map_err(|e| GiteaError::from_connect("UpdateLog", e))?;
        Ok(resp.into_owned())
    }

    /// Fails a task in Gitea with the controller's credential, appending `reason` to the
    /// task's log so the user sees why (invariant 12: nothing fails silently).
    ///
    /// The log row goes after whatever the runner already uploaded: an empty batch at an
    /// index beyond any real log is a gap Gitea does not write, and it answers the
    /// current row count, which is where the row is then appended.
    pub async fn fail_task(
        &self,
        task_id: i64,
        reason: &str,
    ) -> Result<UpdateTaskResponse, GiteaError> {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let timestamp = buffa_types::google::protobuf::Timestamp {
            seconds: i64::try_from(now.as_secs()).unwrap_or(i64::MAX),
            nanos: i32::try_from(now.subsec_nanos()).unwrap_or(0),
            ..Default::default()
        };
        let probe = self
            .update_log(UpdateLogRequest {
                task_id,
                index: i64::MAX / 2,
                ..Default::default()
            })
            .await;
        if let Ok(ack) = probe {
            let row = gdr_proto::runner::v1::LogRow {
                time: timestamp.clone().into(),
                content: format!("{FAILURE_LOG_PREFIX}{reason}"),
                ..Default::default()
            };
            // The log row is a courtesy; the result below is what must land.
            if let Err(e) = self
                .update_log(UpdateLogRequest {
                    task_id,
                    index: ack.ack_index,
                    rows: vec![row],
                    ..Default::default()
                })
                .await
            {
                tracing::warn!(task_id, error = %e, "could not append the failure reason to the task log");
            }
        }
        self.update_task(UpdateTaskRequest {
            state: gdr_proto::runner::v1::TaskState {
                id: task_id,
                result: gdr_proto::runner::v1::TaskResult::RESULT_FAILURE.into(),
                stopped_at: timestamp.into(),
                ..Default::default()
            }
            .into(),
            ..Default::default()
        })
        .await
    }

    /// Fails a task as [`GiteaClient::fail_task`] does, retrying with `backoff` while Gitea
    /// is unavailable, at most `attempts` times. `Ok(Reported::TaskGone)` when Gitea says the
    /// task does not exist (any more): nothing is left to report, so callers may clean up.
    /// On `Err` the report did not land and callers must keep what they would clean up,
    /// so a later attempt can still report (DESIGN invariant 12: report first).
    pub async fn report_failure(
        &self,
        task_id: i64,
        reason: &str,
        backoff: &gdr_core::backoff::Backoff,
        attempts: u32,
    ) -> Result<Reported, GiteaError> {
        let mut attempt = 0;
        loop {
            match self.fail_task(task_id, reason).await {
                Ok(_) => return Ok(Reported::Accepted),
                Err(e) if e.task_gone() => return Ok(Reported::TaskGone),
                Err(e) if e.is_retryable() && attempt + 1 < attempts => {
                    tracing::warn!(task_id, attempt, error = %e, "reporting the failure to Gitea failed; retrying");
                    tokio::time::sleep(backoff.delay(attempt)).await;
                    attempt += 1;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Ping; Gitea answers `Hello, <data>!`.
    pub async fn ping(&self, data: &str) -> Result<String, GiteaError> {
        let request = PingRequest {
            data: data.to_string(),
            ..Default::default()
        };
        let resp = self
            .ping
            .ping(request)
            .await
            .map_err(|e| GiteaError::from_connect("Ping", e))?;
        Ok(resp.into_owned().data)
    }
}

/// rustls configuration for an https Gitea: system roots plus optional extra CAs.
pub fn tls_config(extra_ca_pem: Option<&[u8]>) -> Result<rustls::ClientConfig, GiteaError> {
    tls::client_config("gitea_ca_file", extra_ca_pem, true)
        .map_err(|e| GiteaError::config_caused("cannot build the TLS client for Gitea".into(), e))
}
