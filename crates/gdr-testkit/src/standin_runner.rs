//! A stand-in for the official Gitea runner's `daemon --once`, for tests that need a
//! runner process on the far side of the executor without Docker or the real binary.
//!
//! On the wire it does what `gitea-runner daemon --once` does (reference
//! `gitea-protocol.md` §4.2–§4.4): read `.runner` (v3.5.0 schema) from the working
//! directory and lock `.runner.lock`; talk Connect over HTTP/1.1 to
//! `<address>/api/actions` with `x-runner-uuid`/`x-runner-token`; `Declare` (the answer
//! must name a runner); poll `FetchTask` (5 s timeout, doubling back-off) until one task
//! arrives; run it while sending `UpdateLog` batches from the acknowledged index and
//! `UpdateTask` heartbeats; finish with `UpdateLog{no_more}` and a final `UpdateTask`
//! carrying the result and `stopped_at` (the official reporter's `Close` order). The exit
//! status does not reflect the job result.
//!
//! Instead of running steps, it runs a **script** picked from the task:
//! the first step whose `run:` starts with `standin:` (or `STANDIN_SCRIPT`, which wins):
//!
//! | script | behaviour |
//! |---|---|
//! | `standin:success` | logs a few rows, reports SUCCESS |
//! | `standin:failure` | logs a few rows, reports FAILURE |
//! | `standin:hang` | heartbeats until the server cancels (result in an `UpdateTask` answer) or SIGTERM/SIGINT, reports CANCELLED |
//! | `standin:sleep <ms>` | heartbeats for `<ms>` milliseconds, reports SUCCESS |
//! | `standin:crash` | logs one row, exits with status 3 and no final report |
//! | `standin:checkout <n>` | streams `GET <address>/_mock/blob/<n>`, logs the byte count, SUCCESS iff all `n` bytes arrived |
//! | `standin:wait-for <path>` | heartbeats until the file `<path>` exists (a test's release of many jobs at once), reports SUCCESS |
//! | `standin:id` | logs the process's identity (`identity: uid=… euid=… gid=… groups=…`), SUCCESS |
//! | `standin:exec <command>` | runs `sh -c <command>` (a real program, as a `run:` step), logs its output lines and `exit: <status>`, SUCCESS iff it exited 0 |
//! | `standin:fetch-jwt <audience> [socket=<path>] [spiffe-id=<id>]` | what `spire-agent api fetch jwt -audience <audience> [-socketPath <path>] [-spiffeID <id>]` does: `FetchJWTBundles`, then `FetchJWTSVID` through the Workload API at `<path>` (default: `SPIFFE_ENDPOINT_SOCKET`, as a job step sees it); logs `jwt-svid: sub=<sub> aud=<aud>` for a token that verifies against the bundle and reports SUCCESS, else logs `jwt-svid: <error>` and reports FAILURE |
//!
//! A payload without any `standin:` step runs as `standin:success`. Cancellation (server
//! answer or signal) wins over every script but `crash`.
//!
//! Environment knobs (milliseconds): `STANDIN_HEARTBEAT_MS` (1000; UpdateLog/UpdateTask
//! period), `STANDIN_FETCH_TIMEOUT_MS` (5000), `STANDIN_FETCH_INTERVAL_MS` (2000) and
//! `STANDIN_FETCH_INTERVAL_MAX_MS` (5000) for the polling back-off, `STANDIN_REQUEST_TIMEOUT_MS`
//! (60000; `runner.request_timeout`, the bound of every other RPC).
//!
//! The final report follows the official reporter's `Close`: it runs under one detached
//! deadline of `report_close_timeout` (10 s), so every retried `UpdateLog`/`UpdateTask` is
//! bounded by what is left of it, and after it the result is given up (logged, never
//! delivered later): a controller outage longer than that loses the result unless the
//! executor holds it.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use buffa::MessageField;
use buffa_types::google::protobuf::Timestamp;
use bytes::Bytes;
use connectrpc::client::{CallOptions, ClientConfig, HttpClient};
use connectrpc::{ConnectError, ErrorCode};
use gdr_proto::runner::v1 as pb;
use http_body_util::{BodyExt, Empty};
use serde::Deserialize;

/// Exit status of a `standin:crash` run (non-zero, no final report).
/// How the first log row of every task the stand-in runs begins: a test counts these rows
/// in Gitea's log to see how often a runner started a job.
pub const TASK_STARTED: &str = "stand-in runner: task";

pub const CRASH_EXIT_CODE: i32 = 3;

/// Rows per `UpdateLog` call, as the official runner's `log_report_batch_size`.
const LOG_BATCH: usize = 100;
/// How long the final report is retried, as `runner.report_close_timeout`: one deadline
/// for the whole `Close`, each call bounded by what is left of it.
pub const CLOSE_TIMEOUT: Duration = Duration::from_secs(10);
/// The line the stand-in logs when it gave its final report up.
pub const GAVE_UP: &str = "final report not delivered in time";
/// Pause between retries of the final report.
const CLOSE_RETRY: Duration = Duration::from_millis(200);

/// Errors that end the stand-in before or outside a job (exit status 1).
#[derive(Debug, thiserror::Error)]
pub enum StandinError {
    #[error("reading {path}: {source}")]
    RunnerFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a runner registration file: {source}")]
    RunnerFileFormat {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("{path} is locked by another runner process")]
    Locked { path: PathBuf },
    #[error("runner address {address:?} is unusable: {reason}")]
    Address { address: String, reason: String },
    #[error("{rpc} to {address} failed: {source}")]
    Rpc {
        rpc: &'static str,
        address: String,
        #[source]
        source: Box<ConnectError>,
    },
    #[error("Declare to {address} answered without a runner")]
    NoRunner { address: String },
    #[error("runner is no longer registered at {address}: {source}")]
    Unregistered {
        address: String,
        #[source]
        source: Box<ConnectError>,
    },
    #[error("installing signal handlers: {0}")]
    Signals(#[source] std::io::Error),
}

/// How a `daemon --once` run ended (all but `Crashed` exit 0, as the real runner does).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StandinOutcome {
    /// A signal arrived while polling; no task was taken.
    NoTask,
    /// The task was run and its final state reported with this result.
    Reported(pb::TaskResult),
    /// `standin:crash`: the process must exit non-zero without a final report.
    Crashed,
}

/// The `.runner` file (official runner v3.5.0 `registration.go`).
#[derive(Debug, Clone, Deserialize)]
pub struct RunnerFile {
    #[serde(rename = "WARNING", default)]
    pub warning: String,
    pub id: i64,
    pub uuid: String,
    pub name: String,
    pub token: String,
    pub address: String,
    #[serde(default)]
    pub labels: Vec<String>,
    #[serde(default)]
    pub ephemeral: bool,
}

/// Timing knobs (see the module docs for the environment names and defaults).
#[derive(Debug, Clone)]
pub struct StandinOptions {
    pub heartbeat: Duration,
    pub fetch_timeout: Duration,
    pub fetch_interval: Duration,
    pub fetch_interval_max: Duration,
    /// Bound of every RPC but FetchTask (`runner.request_timeout`).
    pub request_timeout: Duration,
    /// Overrides the script found in the task.
    pub script: Option<String>,
}

impl Default for StandinOptions {
    fn default() -> Self {
        StandinOptions {
            heartbeat: Duration::from_secs(1),
            fetch_timeout: Duration::from_secs(5),
            fetch_interval: Duration::from_secs(2),
            fetch_interval_max: Duration::from_secs(5),
            request_timeout: Duration::from_secs(60),
            script: None,
        }
    }
}

impl StandinOptions {
    /// Defaults overridden by the `STANDIN_*` environment variables.
    pub fn from_env() -> Self {
        let ms = |name: &str, default: Duration| {
            std::env::var(name)
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok())
                .map_or(default, Duration::from_millis)
        };
        let d = StandinOptions::default();
        StandinOptions {
            heartbeat: ms("STANDIN_HEARTBEAT_MS", d.heartbeat),
            fetch_timeout: ms("STANDIN_FETCH_TIMEOUT_MS", d.fetch_timeout),
            fetch_interval: ms("STANDIN_FETCH_INTERVAL_MS", d.fetch_interval),
            fetch_interval_max: ms("STANDIN_FETCH_INTERVAL_MAX_MS", d.fetch_interval_max),
            request_timeout: ms("STANDIN_REQUEST_TIMEOUT_MS", d.request_timeout),
            script: std::env::var("STANDIN_SCRIPT")
                .ok()
                .filter(|s| !s.trim().is_empty()),
        }
    }
}

/// What a task asks the stand-in to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Script {
    Success,
    Failure,
    Hang,
    Sleep(Duration),
    Crash,
    Checkout(u64),
    WaitFor(PathBuf),
    Id,
    /// `standin:exec <command>`: a real program, as a job's `run:` step runs it.
    Exec(String),
    FetchJwt {
        audience: String,
        socket: Option<String>,
        spiffe_id: Option<String>,
    },
}

impl Script {
    /// Parses `standin:<verb> [arg]`; `None` for anything else.
    pub fn parse(text: &str) -> Option<Script> {
        let rest = text.trim().strip_prefix("standin:")?;
        if let Some(command) = rest.strip_prefix("exec ") {
            return Some(Script::Exec(command.trim().to_string()));
        }
        let mut words = rest.split_whitespace();
        let verb = words.next()?;
        if verb == "fetch-jwt" {
            let audience = words.next()?.to_string();
            let (mut socket, mut spiffe_id) = (None, None);
            for word in words {
                if let Some(v) = word.strip_prefix("socket=") {
                    socket = Some(v.to_string());
                } else if let Some(v) = word.strip_prefix("spiffe-id=") {
                    spiffe_id = Some(v.to_string());
                }
            }
            return Some(Script::FetchJwt {
                audience,
                socket,
                spiffe_id,
            });
        }
        let word = words.next();
        if verb == "wait-for" {
            return word.map(|path| Script::WaitFor(PathBuf::from(path)));
        }
        let arg = word.and_then(|a| a.parse::<u64>().ok());
        match (verb, arg) {
            ("success", _) => Some(Script::Success),
            ("failure", _) => Some(Script::Failure),
            ("hang", _) => Some(Script::Hang),
            ("crash", _) => Some(Script::Crash),
            ("id", _) => Some(Script::Id),
            ("sleep", Some(ms)) => Some(Script::Sleep(Duration::from_millis(ms))),
            ("checkout", Some(n)) => Some(Script::Checkout(n)),
            _ => None,
        }
    }

    /// The first `standin:` step of a single-job workflow payload (any job, in order).
    pub fn from_payload(payload: &[u8]) -> Option<Script> {
        let doc: serde_json::Value = serde_saphyr::from_slice(payload).ok()?;
        let jobs = doc.get("jobs")?.as_object()?;
        jobs.values()
            .filter_map(|job| job.get("steps")?.as_array())
            .flatten()
            .filter_map(|step| step.get("run")?.as_str())
            .find_map(|run| run.lines().find_map(Script::parse))
    }
}

/// Reads `<dir>/.runner`.
pub fn read_runner_file(dir: &Path) -> Result<RunnerFile, StandinError> {
    let path = dir.join(".runner");
    let text = std::fs::read(&path).map_err(|source| StandinError::RunnerFile {
        path: path.clone(),
        source,
    })?;
    serde_json::from_slice(&text).map_err(|source| StandinError::RunnerFileFormat { path, source })
}

type Client = pb::RunnerServiceClient<HttpClient>;

/// Runs `daemon --once` in `dir`.
pub async fn daemon_once(
    dir: &Path,
    options: StandinOptions,
) -> Result<StandinOutcome, StandinError> {
    let reg = read_runner_file(dir)?;
    // The official runner refuses to share a `.runner` between processes.
    let lock_path = dir.join(".runner.lock");
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(|source| StandinError::RunnerFile {
            path: lock_path.clone(),
            source,
        })?;
    if lock.try_lock().is_err() {
        return Err(StandinError::Locked { path: lock_path });
    }

    let address = reg.address.trim_end_matches('/').to_string();
    let api: http::Uri =
        format!("{address}/api/actions")
            .parse()
            .map_err(|e: http::uri::InvalidUri| StandinError::Address {
                address: address.clone(),
                reason: e.to_string(),
            })?;
    let config = ClientConfig::new(api)
        .with_default_timeout(options.request_timeout)
        .with_default_header("x-runner-uuid", reg.uuid.as_str())
        .with_default_header("x-runner-token", reg.token.as_str());
    let client = Client::new(HttpClient::plaintext(), config);
    let rpc_err = |rpc, source| StandinError::Rpc {
        rpc,
        address: address.clone(),
        source: Box::new(source),
    };

    let mut signals = Signals::install()?;

    // Label names only, as the runner declares them (`name:schema:args` → `name`).
    let labels = reg
        .labels
        .iter()
        .map(|l| l.split(':').next().unwrap_or_default().to_string())
        .collect();
    let declared = client
        .declare(pb::DeclareRequest {
            version: format!("standin-{}", env!("CARGO_PKG_VERSION")),
            labels,
            capabilities: vec!["cancelling".to_string()],
            ..Default::default()
        })
        .await
        .map_err(|e| rpc_err("Declare", e))?
        .into_owned();
    if declared.runner.is_unset() {
        return Err(StandinError::NoRunner { address });
    }
    tracing::info!(name = %reg.name, "declared; polling for a task");

    let task = tokio::select! {
        task = poll_once(&client, &options, &address) => task?,
        _ = signals.recv() => return Ok(StandinOutcome::NoTask),
    };
    let script = options
        .script
        .as_deref()
        .and_then(Script::parse)
        .or_else(|| {
            task.workflow_payload
                .as_deref()
                .and_then(Script::from_payload)
        })
        .unwrap_or(Script::Success);
    tracing::info!(task_id = task.id, ?script, "running task");
    let reporter = Reporter::new(client, task.id);
    let outcome = run_task(&reporter, &script, &address, &options, &mut signals).await;
    drop(lock);
    Ok(outcome)
}

/// FetchTask until one task arrives, with the official back-off: `fetch_interval`,
/// doubled per consecutive empty answer or error, capped at `fetch_interval_max`.
async fn poll_once(
    client: &Client,
    options: &StandinOptions,
    address: &str,
) -> Result<pb::Task, StandinError> {
    let mut tasks_version = 0;
    let mut misses: u32 = 0;
    loop {
        let call = CallOptions::default().with_timeout(options.fetch_timeout);
        let request = pb::FetchTaskRequest {
            tasks_version,
            ..Default::default()
        };
        match client.fetch_task_with_options(request, call).await {
            Ok(resp) => {
                let resp = resp.into_owned();
                tasks_version = tasks_version.max(resp.tasks_version);
                if let Some(task) = resp.task.into_option() {
                    return Ok(task);
                }
            }
            Err(e) if is_unregistered(&e) => {
                return Err(StandinError::Unregistered {
                    address: address.to_string(),
                    source: Box::new(e),
                });
            }
            Err(e) => tracing::warn!(error = %e, "FetchTask failed; backing off"),
        }
        let factor = 1u32 << misses.min(5);
        let nap = options
            .fetch_interval
            .saturating_mul(factor)
            .min(options.fetch_interval_max.max(options.fetch_interval));
        misses = misses.saturating_add(1);
        tokio::time::sleep(nap).await;
    }
}

/// Gitea says "unregistered runner" as code `unknown` with a gRPC-style text; a real
/// Connect server would say `unauthenticated`.
fn is_unregistered(e: &ConnectError) -> bool {
    e.code == ErrorCode::Unauthenticated || e.to_string().contains("Unauthenticated")
}

async fn run_task(
    reporter: &Reporter,
    script: &Script,
    address: &str,
    options: &StandinOptions,
    signals: &mut Signals,
) -> StandinOutcome {
    reporter.log(format!(
        "{TASK_STARTED} {} script {script:?}",
        reporter.task_id
    ));
    let work = run_script(reporter, script, address);
    let mut work = std::pin::pin!(work);
    let mut tick = tokio::time::interval(options.heartbeat);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let result = loop {
        tokio::select! {
            done = &mut work => match done {
                Some(result) => break result,
                None => {
                    // Push what was logged so far, then die like a killed process.
                    let _ = reporter.flush_logs(false, None).await;
                    return StandinOutcome::Crashed;
                }
            },
            _ = tick.tick() => {
                if let Err(e) = reporter.flush_logs(false, None).await {
                    tracing::warn!(error = %e, "UpdateLog failed; will resend from the ack index");
                }
                match reporter.heartbeat().await {
                    Ok(true) => {
                        reporter.log("stand-in runner: the server cancelled the task".to_string());
                        break pb::TaskResult::RESULT_CANCELLED;
                    }
                    Ok(false) => {}
                    Err(e) => tracing::warn!(error = %e, "UpdateTask heartbeat failed"),
                }
            }
            signal = signals.recv() => {
                reporter.log(format!("stand-in runner: received {signal}, cancelling"));
                break pb::TaskResult::RESULT_CANCELLED;
            }
        }
    };
    reporter.close(result).await;
    StandinOutcome::Reported(result)
}

/// Runs the script; `None` means "crash".
async fn run_script(reporter: &Reporter, script: &Script, address: &str) -> Option<pb::TaskResult> {
    match script {
        Script::Success => {
            reporter.log("hello from the stand-in runner".to_string());
            reporter.log("job succeeded".to_string());
            Some(pb::TaskResult::RESULT_SUCCESS)
        }
        Script::Failure => {
            reporter.log("hello from the stand-in runner".to_string());
            reporter.log("job failed on purpose".to_string());
            Some(pb::TaskResult::RESULT_FAILURE)
        }
        Script::Hang => {
            reporter.log("hanging until cancelled".to_string());
            std::future::pending::<()>().await;
            None
        }
        Script::Sleep(d) => {
            tokio::time::sleep(*d).await;
            reporter.log(format!("slept {d:?}"));
            Some(pb::TaskResult::RESULT_SUCCESS)
        }
        Script::WaitFor(path) => {
            // Polling a file is the least a test needs to release many jobs at once.
            while !path.exists() {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            reporter.log(format!("{} appeared", path.display()));
            Some(pb::TaskResult::RESULT_SUCCESS)
        }
        Script::Crash => {
            reporter.log("crashing on purpose".to_string());
            None
        }
        Script::Id => {
            let groups = rustix::process::getgroups()
                .unwrap_or_default()
                .iter()
                .map(|g| g.as_raw().to_string())
                .collect::<Vec<_>>()
                .join(",");
            reporter.log(format!(
                "identity: uid={} euid={} gid={} groups={groups}",
                rustix::process::getuid().as_raw(),
                rustix::process::geteuid().as_raw(),
                rustix::process::getgid().as_raw(),
            ));
            Some(pb::TaskResult::RESULT_SUCCESS)
        }
        Script::Exec(command) => Some(exec(reporter, command).await),
        Script::FetchJwt {
            audience,
            socket,
            spiffe_id,
        } => {
            let line = match fetch_jwt(audience, socket.as_deref(), spiffe_id.as_deref()).await {
                Ok(line) => {
                    reporter.log(format!("jwt-svid: {line}"));
                    return Some(pb::TaskResult::RESULT_SUCCESS);
                }
                Err(e) => e,
            };
            reporter.log(format!("jwt-svid: {line}"));
            Some(pb::TaskResult::RESULT_FAILURE)
        }
        Script::Checkout(n) => {
            let url = format!("{address}/_mock/blob/{n}");
            match download(&url).await {
                Ok(got) => {
                    reporter.log(format!("checkout: received {got} bytes"));
                    Some(if got == *n {
                        pb::TaskResult::RESULT_SUCCESS
                    } else {
                        pb::TaskResult::RESULT_FAILURE
                    })
                }
                Err(e) => {
                    reporter.log(format!("checkout: {url} failed: {e}"));
                    Some(pb::TaskResult::RESULT_FAILURE)
                }
            }
        }
    }
}

/// Runs `sh -c <command>` and logs what it wrote, each line a row (standard output, then
/// standard error), then `exit: <status>`; SUCCESS iff it exited 0, as a `run:` step.
async fn exec(reporter: &Reporter, command: &str) -> pb::TaskResult {
    let output = tokio::process::Command::new("sh")
        .args(["-c", command])
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .output()
        .await;
    match output {
        Ok(out) => {
            for stream in [&out.stdout, &out.stderr] {
                for line in String::from_utf8_lossy(stream).lines() {
                    reporter.log(line.to_string());
                }
            }
            reporter.log(format!("exit: {}", out.status));
            if out.status.success() {
                pb::TaskResult::RESULT_SUCCESS
            } else {
                pb::TaskResult::RESULT_FAILURE
            }
        }
        Err(e) => {
            reporter.log(format!("exec: sh: {e}"));
            pb::TaskResult::RESULT_FAILURE
        }
    }
}

/// `spire-agent api fetch jwt`: the bundles, then the token, which must verify against
/// them. Returns `sub=… aud=…` of the first token.
async fn fetch_jwt(
    audience: &str,
    socket: Option<&str>,
    spiffe_id: Option<&str>,
) -> Result<String, String> {
    let endpoint = match socket {
        Some(path) => path.to_string(),
        None => std::env::var("SPIFFE_ENDPOINT_SOCKET")
            .map_err(|_| "SPIFFE_ENDPOINT_SOCKET is not set".to_string())?,
    };
    let bundles = crate::spiffe::fetch_jwt_bundles(&endpoint)
        .await
        .map_err(|e| e.to_string())?;
    let svids = crate::spiffe::fetch_jwt_svids(&endpoint, &[audience], spiffe_id)
        .await
        .map_err(|e| e.to_string())?;
    let svid = svids.first().ok_or("no JWT-SVID in the answer")?;
    let claims = bundles
        .values()
        .find_map(|jwks| crate::spiffe::verify_jwt_svid(&svid.svid, jwks).ok())
        .ok_or("the token does not verify against the trust bundle")?;
    let aud = claims["aud"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str())
                .collect::<Vec<_>>()
                .join(",")
        })
        .unwrap_or_default();
    Ok(format!(
        "sub={} aud={aud}",
        claims["sub"].as_str().unwrap_or_default()
    ))
}

/// Streams a GET body, counting bytes without keeping them.
async fn download(url: &str) -> Result<u64, String> {
    let uri: http::Uri = url.parse().map_err(|e| format!("bad URL: {e}"))?;
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Empty<Bytes>>();
    let resp = client.get(uri).await.map_err(|e| e.to_string())?;
    if !resp.status().is_success() {
        return Err(format!("status {}", resp.status()));
    }
    let mut body = resp.into_body();
    let mut total = 0u64;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| e.to_string())?;
        if let Some(data) = frame.data_ref() {
            total += data.len() as u64;
        }
    }
    Ok(total)
}

/// The task reporter: log rows with their acknowledged prefix, and the task state.
struct Reporter {
    client: Client,
    task_id: i64,
    started_at: Timestamp,
    logs: Mutex<LogState>,
}

#[derive(Default)]
struct LogState {
    rows: Vec<pb::LogRow>,
    /// Rows the server confirmed (its `ack_index`); the next batch starts here.
    acked: usize,
}

impl Reporter {
    fn new(client: Client, task_id: i64) -> Self {
        Reporter {
            client,
            task_id,
            started_at: Timestamp::now(),
            logs: Mutex::new(LogState::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, LogState> {
        self.logs.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn log(&self, content: String) {
        self.lock().rows.push(pb::LogRow {
            time: MessageField::some(Timestamp::now()),
            content,
            ..Default::default()
        });
    }

    /// Sends one batch from the ack index; `no_more` marks the final call. Returns
    /// whether everything is acknowledged afterwards. `timeout` bounds the call (the
    /// default request timeout when `None`).
    async fn flush_logs(
        &self,
        no_more: bool,
        timeout: Option<Duration>,
    ) -> Result<bool, ConnectError> {
        let (index, rows, total) = {
            let logs = self.lock();
            let end = logs.rows.len().min(logs.acked + LOG_BATCH);
            (
                logs.acked,
                logs.rows[logs.acked..end].to_vec(),
                logs.rows.len(),
            )
        };
        if rows.is_empty() && !no_more {
            return Ok(true);
        }
        let last_batch = index + rows.len() == total;
        let request = pb::UpdateLogRequest {
            task_id: self.task_id,
            index: i64::try_from(index).unwrap_or(i64::MAX),
            rows,
            no_more: no_more && last_batch,
            ..Default::default()
        };
        let resp = match timeout {
            Some(t) => {
                self.client
                    .update_log_with_options(request, CallOptions::default().with_timeout(t))
                    .await
            }
            None => self.client.update_log(request).await,
        }?
        .into_owned();
        let mut logs = self.lock();
        // The server's word decides where the next batch starts (it may be behind).
        logs.acked = usize::try_from(resp.ack_index)
            .unwrap_or(0)
            .min(logs.rows.len());
        Ok(logs.acked == logs.rows.len() && (last_batch || !no_more))
    }

    fn state(&self, result: pb::TaskResult, stopped: bool) -> pb::TaskState {
        let length = i64::try_from(self.lock().rows.len()).unwrap_or(i64::MAX);
        let stopped_at = if stopped {
            MessageField::some(Timestamp::now())
        } else {
            MessageField::none()
        };
        pb::TaskState {
            id: self.task_id,
            result: result.into(),
            started_at: MessageField::some(self.started_at.clone()),
            stopped_at: stopped_at.clone(),
            steps: vec![pb::StepState {
                id: 0,
                result: result.into(),
                started_at: MessageField::some(self.started_at.clone()),
                stopped_at,
                log_index: 0,
                log_length: length,
                ..Default::default()
            }],
            ..Default::default()
        }
    }

    /// A heartbeat; `true` when the answer carries a result (the server cancelled).
    async fn heartbeat(&self) -> Result<bool, ConnectError> {
        let resp = self
            .client
            .update_task(pb::UpdateTaskRequest {
                state: MessageField::some(self.state(pb::TaskResult::RESULT_UNSPECIFIED, false)),
                ..Default::default()
            })
            .await?
            .into_owned();
        let result = resp.state.as_option().map_or(0, |s| s.result.to_i32());
        Ok(result != pb::TaskResult::RESULT_UNSPECIFIED as i32)
    }

    /// Final report under one deadline of [`CLOSE_TIMEOUT`] (the official reporter's
    /// detached close context): all logs with `no_more`, then the state with the result
    /// and `stopped_at`; each call is bounded by what is left of the deadline, and once it
    /// passes the result is given up.
    async fn close(&self, result: pb::TaskResult) {
        let deadline = tokio::time::Instant::now() + CLOSE_TIMEOUT;
        let left = || deadline.saturating_duration_since(tokio::time::Instant::now());
        let mut logs_done = false;
        while !left().is_zero() {
            if !logs_done {
                match self
                    .flush_logs(true, Some(left().max(Duration::from_millis(1))))
                    .await
                {
                    Ok(true) => logs_done = true,
                    Ok(false) => continue,
                    Err(e) => {
                        tracing::warn!(error = %e, "final UpdateLog failed; retrying");
                        tokio::time::sleep(CLOSE_RETRY.min(left())).await;
                        continue;
                    }
                }
            }
            let request = pb::UpdateTaskRequest {
                state: MessageField::some(self.state(result, true)),
                ..Default::default()
            };
            let call = CallOptions::default().with_timeout(left().max(Duration::from_millis(1)));
            match self.client.update_task_with_options(request, call).await {
                Ok(_) => return,
                Err(e) => {
                    tracing::warn!(error = %e, "final UpdateTask failed; retrying");
                    tokio::time::sleep(CLOSE_RETRY.min(left())).await;
                }
            }
        }
        tracing::error!(task_id = self.task_id, "{GAVE_UP}");
    }
}

/// SIGTERM and SIGINT, the signals that make the official runner cancel its job.
struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl Signals {
    fn install() -> Result<Self, StandinError> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Signals {
            term: signal(SignalKind::terminate()).map_err(StandinError::Signals)?,
            int: signal(SignalKind::interrupt()).map_err(StandinError::Signals)?,
        })
    }

    async fn recv(&mut self) -> &'static str {
        tokio::select! {
            _ = self.term.recv() => "SIGTERM",
            _ = self.int.recv() => "SIGINT",
        }
    }
}

/// The stand-in binary's `main`: logs to stderr (so a test harness shows them next to its
/// own output), runs [`main_with_args`] on a fresh runtime and exits with its code.
pub fn main() -> std::process::ExitCode {
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .try_init();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("gitea-runner-standin: cannot start a runtime: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    let code = runtime.block_on(main_with_args(std::env::args().skip(1).collect()));
    std::process::ExitCode::from(u8::try_from(code).unwrap_or(1))
}

/// Entry point of the `gitea-runner-standin` binary: `gitea-runner-standin daemon --once`
/// in the directory holding `.runner`. Returns the process exit status.
pub async fn main_with_args(args: Vec<String>) -> i32 {
    let wanted = args.iter().any(|a| a == "daemon") && args.iter().any(|a| a == "--once");
    if !wanted {
        eprintln!("usage: gitea-runner-standin daemon --once   (in the directory holding .runner)");
        return 2;
    }
    let dir = match std::env::current_dir() {
        Ok(d) => d,
        Err(e) => {
            eprintln!("gitea-runner-standin: no working directory: {e}");
            return 1;
        }
    };
    match daemon_once(&dir, StandinOptions::from_env()).await {
        Ok(StandinOutcome::Crashed) => CRASH_EXIT_CODE,
        Ok(outcome) => {
            tracing::info!(?outcome, "done");
            0
        }
        Err(e) => {
            eprintln!("gitea-runner-standin: {e}");
            1
        }
    }
}
