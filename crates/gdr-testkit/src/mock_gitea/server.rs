//! HTTP side of the mock: the Connect services under `/api/actions`, fault injection, the
//! `/_mock/` admin API and the streaming blob endpoint.
#![allow(refining_impl_trait)]

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response as HttpResponse};
use axum::routing::{get, post};
use connectrpc::{
    CompressionPolicy, ConnectError, ConnectRpcService, ErrorCode, RequestContext, Response,
    ServiceRequest, ServiceResult,
};
use gdr_proto::ping::v1 as ping;
use gdr_proto::runner::v1 as pb;
use serde::Deserialize;

use super::state::GiteaError;
use super::{JobId, MockError, MockFault, MockGitea, RpcMethod};

/// Gitea builds its handler with `connect.WithCompressMinBytes(1024)`.
const COMPRESS_MIN_BYTES: usize = 1024;
/// Chunk size of `/_mock/blob/{n}`; small enough that nothing large is ever buffered.
const BLOB_CHUNK: u64 = 64 * 1024;

pub(super) fn router(mock: MockGitea) -> axum::Router {
    let connect = connectrpc::Router::new()
        .add_service(Arc::new(RunnerSvc { mock: mock.clone() }))
        .add_service(Arc::new(PingSvc));
    let rpc = ConnectRpcService::new(connect)
        .with_compression_policy(CompressionPolicy::default().with_min_size(COMPRESS_MIN_BYTES));
    let admin = axum::Router::new()
        .route("/_mock/workflows", post(admin_queue))
        .route("/_mock/jobs", get(admin_jobs))
        .route("/_mock/jobs/{id}/cancel", post(admin_cancel))
        .route("/_mock/registration-tokens", post(admin_add_token))
        .route("/_mock/blob/{n}", get(blob))
        .with_state(mock.clone());
    axum::Router::new()
        .nest_service("/api/actions", rpc)
        .merge(admin)
        .fallback(|| async { StatusCode::NOT_FOUND })
        .layer(middleware::from_fn_with_state(mock, front))
}

impl MockGitea {
    /// Counts the call and takes the next fault queued for its method.
    fn take_fault(&self, method: RpcMethod) -> Option<MockFault> {
        let mut s = self.lock();
        *s.calls.entry(method).or_default() += 1;
        s.faults.get_mut(&method).and_then(|q| q.pop_front())
    }

    /// Counts a call in flight until the returned guard is dropped (the answer is sent or
    /// the client went away).
    fn enter(&self, method: RpcMethod) -> InFlight {
        let mut s = self.lock();
        let now = s.in_flight.entry(method).or_default();
        *now += 1;
        let now = *now;
        let peak = s.in_flight_peak.entry(method).or_default();
        *peak = (*peak).max(now);
        InFlight {
            mock: self.clone(),
            method,
        }
    }
}

struct InFlight {
    mock: MockGitea,
    method: RpcMethod,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Some(n) = self.mock.lock().in_flight.get_mut(&self.method) {
            *n = n.saturating_sub(1);
        }
    }
}

/// Runs before routing: records non-API paths, applies injected faults and the fetch delay.
async fn front(State(mock): State<MockGitea>, req: Request, next: Next) -> HttpResponse {
    let path = req.uri().path().to_owned();
    // `/api/actions_pipeline` (artifacts) is not the runner API, which is nested under
    // `/api/actions/`.
    let Some(procedure) = path
        .strip_prefix("/api/actions")
        .filter(|rest| rest.starts_with('/'))
    else {
        let seen = req
            .uri()
            .path_and_query()
            .map_or_else(|| path.clone(), |pq| pq.as_str().to_owned());
        let headers = req
            .headers()
            .iter()
            .map(|(k, v)| {
                (
                    k.as_str().to_owned(),
                    v.to_str().unwrap_or("<binary>").to_owned(),
                )
            })
            .collect();
        mock.mutate(|s| {
            s.seen_request_headers.push((seen.clone(), headers));
            s.seen_requests.push(seen);
        });
        return next.run(req).await;
    };
    let _in_flight = RpcMethod::from_procedure(procedure).map(|m| mock.enter(m));
    if let Some(method) = RpcMethod::from_procedure(procedure) {
        if let Some(fault) = mock.take_fault(method) {
            tracing::info!(?method, ?fault, "injecting fault");
            match fault {
                MockFault::Delay(d) => tokio::time::sleep(d).await,
                MockFault::Gitea { code, desc } => {
                    return gitea_error(GiteaError::status(code, desc)).into_response();
                }
                MockFault::Connect { code, message } => {
                    return ConnectError::new(code, message).into_response();
                }
                MockFault::Http { status, body } => {
                    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
                    return (status, [(header::CONTENT_TYPE, "text/plain")], body).into_response();
                }
            }
        }
        if method == RpcMethod::FetchTask
            && let Some(d) = mock.inner.config.fetch_delay
        {
            tokio::time::sleep(d).await;
        }
    }
    next.run(req).await
}

/// connect-go writes Gitea's grpc-status and plain errors as code `unknown` (HTTP 500).
fn gitea_error(e: GiteaError) -> ConnectError {
    ConnectError::new(ErrorCode::Unknown, e.message())
}

fn credentials(ctx: &RequestContext) -> (String, String) {
    let get = |name: &str| {
        ctx.header(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned()
    };
    (get("x-runner-uuid"), get("x-runner-token"))
}

struct RunnerSvc {
    mock: MockGitea,
}

impl pb::RunnerService for RunnerSvc {
    async fn register(
        &self,
        _ctx: RequestContext,
        req: ServiceRequest<'_, pb::RegisterRequest>,
    ) -> ServiceResult<pb::RegisterResponse> {
        let req = req.to_owned_message();
        let res = self.mock.mutate(|s| s.register(&req));
        let runner = res.map_err(|e| {
            tracing::info!(rpc = "Register", name = %req.name, error = %e.message(), "rejected");
            gitea_error(e)
        })?;
        tracing::info!(rpc = "Register", name = %runner.name, runner = %runner.uuid, labels = ?runner.labels, ephemeral = runner.ephemeral, "registered");
        Response::ok(pb::RegisterResponse {
            runner: buffa::MessageField::some(runner),
            ..Default::default()
        })
    }

    async fn declare(
        &self,
        ctx: RequestContext,
        req: ServiceRequest<'_, pb::DeclareRequest>,
    ) -> ServiceResult<pb::DeclareResponse> {
        let (uuid, token) = credentials(&ctx);
        let req = req.to_owned_message();
        let runner = self
            .mock
            .mutate(|s| s.declare(&uuid, &token, &req))
            .map_err(|e| log_err("Declare", &uuid, e))?;
        tracing::info!(rpc = "Declare", runner = %uuid, version = %req.version, labels = ?req.labels, capabilities = ?req.capabilities, "declared");
        Ok(Response::new(pb::DeclareResponse {
            runner: buffa::MessageField::some(runner),
            ..Default::default()
        })
        .with_header(
            header::HeaderName::from_static("x-gitea-actions-capabilities"),
            HeaderValue::from_static("job-summary"),
        ))
    }

    async fn fetch_task(
        &self,
        ctx: RequestContext,
        req: ServiceRequest<'_, pb::FetchTaskRequest>,
    ) -> ServiceResult<pb::FetchTaskResponse> {
        let (uuid, token) = credentials(&ctx);
        let version = req.to_owned_message().tasks_version;
        let held_until = self
            .mock
            .inner
            .config
            .long_poll
            .map(|hold| tokio::time::Instant::now() + hold);
        let (task, latest) = loop {
            let mut changes = self.mock.subscribe();
            let (task, latest) = self
                .mock
                .mutate(|s| s.fetch_task(&uuid, &token, version))
                .map_err(|e| log_err("FetchTask", &uuid, e))?;
            let Some(until) = held_until.filter(|_| task.is_none()) else {
                break (task, latest);
            };
            // Held: wait for the version to move past this answer (a new job), then pick.
            let moved = loop {
                if self.mock.tasks_version() != latest {
                    break true;
                }
                match tokio::time::timeout_at(until, changes.changed()).await {
                    Ok(Ok(())) => {}
                    _ => break false,
                }
            };
            if !moved {
                break (None, latest);
            }
        };
        tracing::info!(rpc = "FetchTask", runner = %uuid, version, latest, task = task.as_ref().map(|t| t.id), "fetch");
        Response::ok(pb::FetchTaskResponse {
            task: task.map_or_else(buffa::MessageField::none, buffa::MessageField::some),
            tasks_version: latest,
            ..Default::default()
        })
    }

    async fn update_task(
        &self,
        ctx: RequestContext,
        req: ServiceRequest<'_, pb::UpdateTaskRequest>,
    ) -> ServiceResult<pb::UpdateTaskResponse> {
        let (uuid, token) = credentials(&ctx);
        let req = req.to_owned_message();
        let (state, sent_outputs) = self
            .mock
            .mutate(|s| s.update_task(&uuid, &token, &req))
            .map_err(|e| log_err("UpdateTask", &uuid, e))?;
        let reported = req.state.as_option().map(|s| s.result.to_i32());
        tracing::info!(rpc = "UpdateTask", runner = %uuid, task = state.id, reported, answered = state.result.to_i32(), outputs = req.outputs.len(), "update");
        Response::ok(pb::UpdateTaskResponse {
            state: buffa::MessageField::some(state),
            sent_outputs,
            ..Default::default()
        })
    }

    async fn update_log(
        &self,
        ctx: RequestContext,
        req: ServiceRequest<'_, pb::UpdateLogRequest>,
    ) -> ServiceResult<pb::UpdateLogResponse> {
        let (uuid, token) = credentials(&ctx);
        let req = req.to_owned_message();
        let ack = self
            .mock
            .mutate(|s| s.update_log(&uuid, &token, &req))
            .map_err(|e| log_err("UpdateLog", &uuid, e))?;
        tracing::info!(rpc = "UpdateLog", runner = %uuid, task = req.task_id, index = req.index, rows = req.rows.len(), no_more = req.no_more, ack, "log");
        Response::ok(pb::UpdateLogResponse {
            ack_index: ack,
            ..Default::default()
        })
    }
}

fn log_err(rpc: &'static str, uuid: &str, e: GiteaError) -> ConnectError {
    tracing::info!(rpc, runner = %uuid, error = %e.message(), "rejected");
    gitea_error(e)
}

struct PingSvc;

impl ping::PingService for PingSvc {
    async fn ping(
        &self,
        _ctx: RequestContext,
        req: ServiceRequest<'_, ping::PingRequest>,
    ) -> ServiceResult<ping::PingResponse> {
        let data = req.to_owned_message().data;
        tracing::info!(rpc = "Ping", "ping");
        Response::ok(ping::PingResponse {
            data: format!("Hello, {data}!"),
            ..Default::default()
        })
    }
}

// ----- admin API ---------------------------------------------------------------------------

#[derive(Deserialize)]
struct RepoQuery {
    repo: String,
}

async fn admin_queue(
    State(mock): State<MockGitea>,
    Query(q): Query<RepoQuery>,
    body: String,
) -> HttpResponse {
    match mock.queue_workflow(&q.repo, &body) {
        Ok(ids) => {
            tracing::info!(repo = %q.repo, jobs = ?ids, "workflow queued");
            axum::Json(serde_json::json!({ "job_ids": ids })).into_response()
        }
        Err(e) => (StatusCode::BAD_REQUEST, e.to_string()).into_response(),
    }
}

async fn admin_jobs(State(mock): State<MockGitea>) -> HttpResponse {
    axum::Json(mock.jobs()).into_response()
}

async fn admin_cancel(State(mock): State<MockGitea>, Path(id): Path<i64>) -> HttpResponse {
    match mock.cancel_job(JobId(id)) {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e @ MockError::NoSuchJob(_)) => (StatusCode::NOT_FOUND, e.to_string()).into_response(),
        Err(e) => (StatusCode::BAD_REQUEST, e.to_string()).into_response(),
    }
}

async fn admin_add_token(State(mock): State<MockGitea>, body: String) -> HttpResponse {
    let token = body.trim();
    if token.is_empty() {
        return (StatusCode::BAD_REQUEST, "empty token").into_response();
    }
    mock.add_registration_token(token);
    StatusCode::NO_CONTENT.into_response()
}

/// Byte `i` of every blob, so a receiver can verify content without a copy.
pub fn blob_byte(i: u64) -> u8 {
    // 251 is prime, so chunk boundaries never line up with the pattern.
    u8::try_from(i % 251).unwrap_or(0)
}

/// Streams `n` deterministic bytes chunk by chunk (for reverse-proxy tests).
async fn blob(Path(n): Path<u64>) -> HttpResponse {
    let stream = futures::stream::unfold(0u64, move |sent| async move {
        if sent >= n {
            return None;
        }
        let len = (n - sent).min(BLOB_CHUNK);
        let chunk: Vec<u8> = (sent..sent + len).map(blob_byte).collect();
        Some((Ok::<_, std::io::Error>(Bytes::from(chunk)), sent + len))
    });
    let mut resp = Body::from_stream(stream).into_response();
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    resp.headers_mut()
        .insert(header::CONTENT_LENGTH, HeaderValue::from(n));
    resp
}
