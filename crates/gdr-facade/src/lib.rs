//! The RunnerService facade the executors' official runners talk to (DESIGN invariant 15).
//!
//! Every call must come from an mTLS peer of the trust domain (enforced by the TLS
//! server) and present the assignment ID as runner UUID, the assignment's capability as
//! runner token, and a peer SPIFFE ID equal to the assignment's; this is checked from the
//! headers before the request body is read. Then:
//! - `Declare` answers an ephemeral runner record named after the assignment;
//! - `FetchTask` hands out the pre-assigned task once the claim is durable (the claim
//!   completes or is rolled back even if the runner gives up on the call), again to the
//!   same executor until its runner reports on the task, then never;
//! - `UpdateTask`/`UpdateLog` must name the assignment's task and are forwarded to Gitea
//!   with the controller's credential; Gitea's answer returns unchanged. A terminal
//!   result is persisted on the backend and releases the slot before the runner hears
//!   back (invariant 10);
//! - `Register` is refused.
//!
//! A warm VM sandbox's executor asks for its assignment at [`gdr_core::executor::standby::PATH`]
//! once a job claimed its sandbox (module `standby`): only the claiming job's workload gets it,
//! and only until its runner claimed the task.
//!
//! Everything else is reverse-proxied to Gitea ([`proxy`]), for the executor of a live
//! assignment only: the same credentials and peer identity are checked first, before the
//! body is read, and a finished assignment's executor is refused.
//!
//! The facade is a crate of its own: what it needs of the controller (who may call, the
//! claims, where outcomes are counted) are the traits of [`ports`], which the controller's
//! dispatch and metrics implement.

#![allow(refining_impl_trait)]

pub mod ports;
pub mod proxy;
mod standby;
pub mod tls;

use std::sync::Arc;

use connectrpc::{ConnectError, RequestContext, Response, ServiceRequest, ServiceResult};
use gdr_core::backend::BackendLabels;
pub use gdr_identity::tls::PeerSpiffeId;
use gdr_proto::runner::v1::{
    DeclareRequest, DeclareResponse, FetchTaskRequest, FetchTaskResponse, RegisterRequest,
    RegisterResponse, Runner, RunnerService, TaskResult, UpdateLogRequest, UpdateLogResponse,
    UpdateTaskRequest, UpdateTaskResponse,
};

use gdr_gitea::{
    CAPABILITIES_HEADER, ErrorKind, GiteaClient, GiteaError, TOKEN_HEADER, UUID_HEADER,
};
use gdr_shutdown::Shutdown;
use ports::{
    Admission, AuthError, Authorized, ClaimError, Claims, Fetched, Liveness, Outcomes, Standbys,
};
pub use tls::FacadeLimits;

/// The label value of a runner's terminal result (the `result` of the job metrics).
pub fn result_label(result: TaskResult) -> &'static str {
    match result {
        TaskResult::RESULT_SUCCESS => "success",
        TaskResult::RESULT_FAILURE => "failure",
        TaskResult::RESULT_CANCELLED => "cancelled",
        TaskResult::RESULT_SKIPPED => "skipped",
        TaskResult::RESULT_UNSPECIFIED => "unspecified",
    }
}

/// The facade service.
pub struct Facade {
    admission: Arc<dyn Admission>,
    claims: Arc<dyn Claims>,
    gitea: GiteaClient,
    /// `X-Gitea-Actions-Capabilities` from the controller's own Declare, once known.
    server_capabilities: std::sync::RwLock<Option<String>>,
    /// Label of each backend as declared to the runner.
    labels: BackendLabels,
    metrics: Option<Arc<dyn Outcomes>>,
    /// Pass-through requests without runner credentials, logged once per interval.
    uncredentialed: std::sync::Mutex<tls::Throttle>,
    /// Which job claimed a warm sandbox (`None`: no backend has warm sandboxes).
    standbys: Option<Arc<dyn Standbys>>,
    /// Standby requests refused or left unanswered, logged once per interval.
    standby_refusals: std::sync::Mutex<tls::Throttle>,
}

impl Facade {
    /// A facade over `dispatch` (who may call, and the claims), forwarding to Gitea with
    /// `gitea` (the controller's credential).
    pub fn new<D: Admission + Claims + 'static>(
        dispatch: Arc<D>,
        gitea: GiteaClient,
        server_capabilities: Option<String>,
        labels: BackendLabels,
    ) -> Self {
        Facade {
            admission: dispatch.clone(),
            claims: dispatch,
            gitea,
            server_capabilities: std::sync::RwLock::new(server_capabilities),
            labels,
            metrics: None,
            uncredentialed: std::sync::Mutex::new(tls::Throttle::new(tls::LOG_INTERVAL)),
            standbys: None,
            standby_refusals: std::sync::Mutex::new(tls::Throttle::new(tls::LOG_INTERVAL)),
        }
    }

    /// Answers warm executors' standby requests from `standbys` (without it, every one is
    /// answered "not claimed").
    #[must_use]
    pub fn with_standbys(mut self, standbys: Arc<dyn Standbys>) -> Self {
        self.standbys = Some(standbys);
        self
    }

    /// Observes run times and the results runners report into `metrics`.
    #[must_use]
    pub fn with_metrics(mut self, metrics: Arc<dyn Outcomes>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// Records Gitea's capabilities header from the controller's Declare.
    pub fn set_server_capabilities(&self, value: Option<String>) {
        *self
            .server_capabilities
            .write()
            .unwrap_or_else(|p| p.into_inner()) = value;
    }

    /// The Connect router serving this facade (mount it under `/api/actions`).
    pub fn router(self: Arc<Self>) -> connectrpc::Router {
        connectrpc::Router::new().add_service(self)
    }

    /// The whole facade application: the RunnerService under `/api/actions`, everything
    /// else reverse-proxied to Gitea. Every request is authenticated from its headers and
    /// the peer's SPIFFE ID before its body is read (DESIGN invariant 21): a peer without a
    /// valid assignment credential cannot make the facade buffer a body, and only the
    /// executor of a live assignment reaches Gitea through the pass-through (invariant 15).
    /// A warm executor's standby request is answered by its own route (module `standby`).
    pub fn app(self: Arc<Self>, proxy: proxy::ReverseProxy) -> axum::Router {
        let runner_api = axum::Router::new()
            .fallback_service(self.clone().router().into_axum_service())
            .layer(axum::middleware::from_fn_with_state(
                self.clone(),
                authenticate_request,
            ));
        let pass_through = axum::Router::new()
            .fallback(proxy::handler)
            .with_state(proxy)
            .layer(axum::middleware::from_fn_with_state(
                self.clone(),
                authenticate_pass_through,
            ));
        let standby = axum::Router::new()
            .route(
                gdr_core::executor::standby::PATH,
                axum::routing::post(standby::handler),
            )
            .with_state(self);
        axum::Router::new()
            .nest("/api/actions", runner_api)
            .merge(standby)
            .fallback_service(pass_through)
    }

    /// Serves the facade over SPIFFE mTLS with the default connection limits until
    /// `shutdown` resolves; see [`Facade::serve_limited`].
    pub async fn serve(
        self: Arc<Self>,
        listener: tokio::net::TcpListener,
        tls: Arc<rustls::ServerConfig>,
        proxy: proxy::ReverseProxy,
        shutdown: Shutdown,
    ) -> std::io::Result<()> {
        self.serve_limited(
            listener,
            tls,
            proxy,
            FacadeLimits::default(),
            Arc::new(tls::FacadeStats::default()),
            shutdown,
        )
        .await
    }

    /// Serves the facade over SPIFFE mTLS until `shutdown` resolves. Only peers of the
    /// trust domain complete the handshake; `limits` bound what any peer can hold, and
    /// `stats` counts connections, refusals and accept errors.
    pub async fn serve_limited(
        self: Arc<Self>,
        listener: tokio::net::TcpListener,
        tls: Arc<rustls::ServerConfig>,
        proxy: proxy::ReverseProxy,
        limits: FacadeLimits,
        stats: Arc<tls::FacadeStats>,
        shutdown: Shutdown,
    ) -> std::io::Result<()> {
        let admission = self.admission.clone();
        let binder = tls::Binder {
            key: self.admission.capability_key().clone(),
            may_bind: Arc::new(move |id: &str| admission.may_bind(id)),
        };
        tls::serve_tls_limited(
            listener,
            tls,
            self.app(proxy),
            limits,
            Some(binder),
            stats,
            shutdown,
        )
        .await
    }

    /// Like [`Self::authenticate`], but also accepts a runner whose assignment this
    /// process has not been offered (yet), e.g. after a restart: it may declare and
    /// poll, and gets its task once the redelivered assignment is offered.
    async fn authenticate_waiting(
        &self,
        headers: &http::HeaderMap,
        peer: Option<&PeerSpiffeId>,
        method: &str,
    ) -> Result<Authorized, ConnectError> {
        match self.authenticate(headers, peer, method) {
            Err(e) if e.code == connectrpc::ErrorCode::Unauthenticated => {
                let Some(PeerSpiffeId(peer)) = peer else {
                    return Err(e);
                };
                let uuid = header(headers, UUID_HEADER);
                match self
                    .admission
                    .authorize_from_backend(uuid, header(headers, TOKEN_HEADER), peer)
                    .await
                {
                    Ok(auth) => {
                        tracing::debug!(method, assignment_id = %auth.id, "runner of an assignment not offered yet authorised from backend metadata");
                        Ok(auth)
                    }
                    Err(AuthError::WrongIdentity) => Err(ConnectError::permission_denied(
                        "peer SPIFFE ID does not match the assignment",
                    )),
                    Err(AuthError::Finished) => {
                        tracing::warn!(
                            method,
                            assignment_id = uuid,
                            "call of a finished assignment refused (its terminal marker is on the backend)"
                        );
                        Err(ConnectError::permission_denied(format!(
                            "{uuid} has finished"
                        )))
                    }
                    Err(AuthError::Unavailable(why)) => {
                        tracing::warn!(method, assignment_id = uuid, reason = %why, "cannot check a runner against the backend; asking it to retry");
                        Err(ConnectError::unavailable(
                            "the controller cannot check this runner right now; retry",
                        ))
                    }
                    Err(_) => Err(e),
                }
            }
            other => other,
        }
    }

    fn authenticate(
        &self,
        headers: &http::HeaderMap,
        peer: Option<&PeerSpiffeId>,
        method: &str,
    ) -> Result<Authorized, ConnectError> {
        let uuid = header(headers, UUID_HEADER);
        let token = header(headers, TOKEN_HEADER);
        let Some(PeerSpiffeId(peer)) = peer else {
            tracing::warn!(
                method,
                assignment_id = uuid,
                "facade call without an mTLS peer identity refused"
            );
            return Err(ConnectError::unauthenticated(
                "a SPIFFE mTLS client certificate is required",
            ));
        };
        match self.admission.authorize(uuid, token, peer) {
            Ok(auth) => {
                // Only the runner's own calls show it is alive (invariant 12): an executor
                // that only fetches artifacts or git objects must still fall silent.
                if method != PASS_THROUGH {
                    self.admission.heard_from(&auth.id);
                }
                Ok(auth)
            }
            // Not offered in this process (yet): after a restart the fallback may accept it,
            // so this is not worth a warning by itself.
            Err(AuthError::UnknownAssignment) => {
                tracing::debug!(
                    method,
                    assignment_id = uuid,
                    "facade call for an assignment not offered here"
                );
                Err(ConnectError::unauthenticated("unregistered runner"))
            }
            Err(e) => {
                tracing::warn!(method, assignment_id = uuid, peer = %peer, reason = %e, "facade call refused");
                Err(match e {
                    AuthError::WrongIdentity => ConnectError::permission_denied(
                        "peer SPIFFE ID does not match the assignment",
                    ),
                    AuthError::Unavailable(_) => ConnectError::unavailable("retry"),
                    AuthError::Finished => {
                        ConnectError::permission_denied(format!("{uuid} has finished"))
                    }
                    AuthError::BadCapability | AuthError::UnknownAssignment => {
                        ConnectError::unauthenticated("unregistered runner")
                    }
                })
            }
        }
    }

    fn check_task(auth: &Authorized, task_id: i64, method: &str) -> Result<(), ConnectError> {
        if task_id == auth.task_id {
            Ok(())
        } else {
            tracing::warn!(method, assignment_id = %auth.id, task_id, "update for another task refused");
            Err(ConnectError::permission_denied(format!(
                "assignment {} may only update task {}",
                auth.id, auth.task_id
            )))
        }
    }

    fn runner_record(&self, auth: &Authorized, version: String) -> Runner {
        let label = self.labels.label_of(auth.backend).to_owned();
        Runner {
            id: auth.task_id,
            uuid: auth.id.as_str().to_string(),
            name: auth.id.as_str().to_string(),
            version,
            labels: vec!["self-hosted".into(), label],
            ephemeral: true,
            ..Default::default()
        }
    }
}

fn header<'a>(headers: &'a http::HeaderMap, name: &str) -> &'a str {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
}

/// The RunnerService methods and how each is authenticated.
enum Method {
    /// Refused outright.
    Register,
    /// May come from a runner whose assignment was not offered here yet (after a restart).
    Waiting(&'static str),
    /// Only from a runner of an assignment offered here.
    Offered(&'static str),
}

fn method_of(path: &str) -> Option<Method> {
    let name = path.strip_prefix("/runner.v1.RunnerService/")?;
    Some(match name {
        "Register" => Method::Register,
        "Declare" => Method::Waiting("Declare"),
        "FetchTask" => Method::Waiting("FetchTask"),
        "UpdateTask" => Method::Offered("UpdateTask"),
        "UpdateLog" => Method::Offered("UpdateLog"),
        _ => return None,
    })
}

/// Authenticates a RunnerService call from its headers and the peer's SPIFFE ID, before
/// anything reads its body; the handler finds the result in the request's extensions.
async fn authenticate_request(
    axum::extract::State(facade): axum::extract::State<Arc<Facade>>,
    mut request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let Some(method) = method_of(request.uri().path()) else {
        // Not a method this facade serves: the Connect router answers `unimplemented`
        // without reading a body.
        return next.run(request).await;
    };
    let peer = request.extensions().get::<PeerSpiffeId>().cloned();
    let auth = match method {
        Method::Register => Err(ConnectError::permission_denied(
            "executors cannot register runners: the facade accepts only its pre-assigned runner",
        )),
        Method::Waiting(name) => {
            facade
                .authenticate_waiting(request.headers(), peer.as_ref(), name)
                .await
        }
        Method::Offered(name) => facade.authenticate(request.headers(), peer.as_ref(), name),
    };
    match auth {
        Ok(auth) => {
            request.extensions_mut().insert(auth);
            next.run(request).await
        }
        Err(e) => {
            let refused = matches!(
                e.code,
                connectrpc::ErrorCode::PermissionDenied | connectrpc::ErrorCode::Unauthenticated
            );
            refusal(e.into_response(), refused)
        }
    }
}

/// Marks an answer that refuses the caller's credentials, so its connection is closed
/// (and unbound) once it is written (invariant 21); "retry later" answers keep it.
fn refusal(mut response: axum::response::Response, refused: bool) -> axum::response::Response {
    if refused {
        response.extensions_mut().insert(tls::Refused);
    }
    response
}

/// Lets only the executor of a live assignment use the pass-through to Gitea: its
/// credentials and peer SPIFFE ID are checked as a RunnerService call's are (offered here,
/// or found on a backend after a restart), before anything reads the body; an assignment
/// whose result Gitea has is refused. The credentials never reach Gitea (the proxy
/// forwards only its allow-listed headers).
/// Why an assignment in `state` is no longer live for the pass-through, if it is not: its
/// result is in Gitea, or its start deadline expired it and it is being failed there.
fn not_live(state: Option<Liveness>) -> Option<&'static str> {
    match state? {
        Liveness::Finished => Some("has finished"),
        Liveness::Expired => Some("expired before its runner claimed it"),
        Liveness::Live => None,
    }
}

/// The `method` name of pass-through requests in authentication and its log lines.
const PASS_THROUGH: &str = "pass-through";

async fn authenticate_pass_through(
    axum::extract::State(facade): axum::extract::State<Arc<Facade>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    const WHO: &str = "the facade forwards to Gitea only for the executor of a live assignment";
    if !request.headers().contains_key(UUID_HEADER) || !request.headers().contains_key(TOKEN_HEADER)
    {
        // Any peer of the trust domain can send these, as often as it likes: one line per
        // interval, not per request.
        let count = facade
            .uncredentialed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .note();
        if let Some(count) = count {
            let peer = request
                .extensions()
                .get::<PeerSpiffeId>()
                .map(|p| p.0.clone());
            tracing::warn!(peer = peer.as_deref().unwrap_or(""), path = request.uri().path(), count, interval = ?tls::LOG_INTERVAL, "pass-through requests without runner credentials refused");
        }
        let answer = (
            http::StatusCode::UNAUTHORIZED,
            format!("{WHO}: x-runner-uuid and x-runner-token are required\n"),
        );
        return refusal(answer.into_response(), true);
    }
    let peer = request.extensions().get::<PeerSpiffeId>().cloned();
    let auth = match facade
        .authenticate_waiting(request.headers(), peer.as_ref(), PASS_THROUGH)
        .await
    {
        Ok(auth) => auth,
        Err(e) => {
            let status = match e.code {
                connectrpc::ErrorCode::PermissionDenied => http::StatusCode::FORBIDDEN,
                connectrpc::ErrorCode::Unavailable => http::StatusCode::SERVICE_UNAVAILABLE,
                _ => http::StatusCode::UNAUTHORIZED,
            };
            let why = e.message.as_deref().unwrap_or("refused");
            let refused = status != http::StatusCode::SERVICE_UNAVAILABLE;
            return refusal((status, format!("{WHO}: {why}\n")).into_response(), refused);
        }
    };
    if let Some(why) = not_live(facade.admission.liveness(&auth.id)) {
        tracing::warn!(assignment_id = %auth.id, path = request.uri().path(), why, "pass-through request of an assignment that is not live refused");
        let answer = (
            http::StatusCode::FORBIDDEN,
            format!("{WHO}: {} {why}\n", auth.id),
        );
        return refusal(answer.into_response(), true);
    }
    next.run(request).await
}

/// The caller as [`authenticate_request`] authenticated it.
fn authorized(ctx: &RequestContext) -> Result<Authorized, ConnectError> {
    ctx.extensions()
        .get::<Authorized>()
        .cloned()
        .ok_or_else(|| ConnectError::internal("the call was not authenticated"))
}

/// Gitea's failure as the runner should see it. A refusal of the *controller's*
/// credential is not the runner's fault, so it becomes `unavailable` (retry later). A
/// task Gitea no longer has is `not_found`, not the internal error Gitea answers: the
/// executor's relay sends an internal error again, and nothing can deliver this.
fn forward_error(method: &'static str, auth: &Authorized, e: GiteaError) -> ConnectError {
    tracing::warn!(method, assignment_id = %auth.id, error = %e, kind = e.kind().as_str(), "forwarding to Gitea failed; the runner gets Gitea's answer and retries what it can");
    let message = e.message().to_string();
    if e.task_gone() {
        return ConnectError::not_found(message);
    }
    match e.kind() {
        ErrorKind::Invalid => ConnectError::invalid_argument(message),
        ErrorKind::NotFound => ConnectError::not_found(message),
        ErrorKind::Unavailable | ErrorKind::Unauthenticated => {
            ConnectError::unavailable(format!("Gitea: {message}"))
        }
        ErrorKind::Other | ErrorKind::TooLarge => {
            ConnectError::internal(format!("Gitea: {message}"))
        }
    }
}

impl RunnerService for Facade {
    async fn register(
        &self,
        _ctx: RequestContext,
        _request: ServiceRequest<'_, RegisterRequest>,
    ) -> ServiceResult<RegisterResponse> {
        Err(ConnectError::permission_denied(
            "executors cannot register runners: the facade accepts only its pre-assigned runner",
        ))
    }

    async fn declare(
        &self,
        ctx: RequestContext,
        request: ServiceRequest<'_, DeclareRequest>,
    ) -> ServiceResult<DeclareResponse> {
        let auth = authorized(&ctx)?;
        let version = request.to_owned_message().version;
        tracing::info!(assignment_id = %auth.id, runner_version = %version, "executor runner declared");
        let response = Response::new(DeclareResponse {
            runner: self.runner_record(&auth, version).into(),
            ..Default::default()
        });
        let capabilities = self
            .server_capabilities
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        Ok(match capabilities {
            Some(value) => response.with_header(CAPABILITIES_HEADER, value),
            None => response,
        })
    }

    async fn fetch_task(
        &self,
        ctx: RequestContext,
        request: ServiceRequest<'_, FetchTaskRequest>,
    ) -> ServiceResult<FetchTaskResponse> {
        let auth = authorized(&ctx)?;
        let version = request.to_owned_message().tasks_version;
        // The claim runs detached from this call: if the runner's deadline drops this
        // future, the claim still completes (or is rolled back) and the next FetchTask
        // gets the task.
        match self.claims.clone().take_task(&auth).await {
            Ok(Fetched::Task(task)) => {
                tracing::debug!(assignment_id = %auth.id, task_id = auth.task_id, "task handed to its runner");
                Response::ok(FetchTaskResponse {
                    task: (*task).into(),
                    tasks_version: version + 1,
                    ..Default::default()
                })
            }
            // Not offered yet (e.g. after a restart, before redelivery): keep polling.
            Ok(Fetched::Nothing) => Response::ok(FetchTaskResponse {
                tasks_version: version,
                ..Default::default()
            }),
            Ok(Fetched::HandedOut) => {
                // A runner that has reported on its task never fetches again (`--once`);
                // one whose claim was recorded before a restart polls because the answer
                // was lost with the controller, and the task is not in memory any more.
                // It cannot be handed out twice: tell the runner it is unregistered so it
                // exits; the lifecycle reconciler then fails the task in Gitea instead of
                // leaving a polling executor behind.
                tracing::warn!(assignment_id = %auth.id, "FetchTask for a task already handed out refused");
                Err(ConnectError::unauthenticated(format!(
                    "the task of {} was already handed out; unregistered runner",
                    auth.id
                )))
            }
            Err(ClaimError::Backend(_) | ClaimError::Interrupted) => Err(
                ConnectError::unavailable("recording the claim failed; retry"),
            ),
            Err(e @ ClaimError::NoBackend(_)) => Err(ConnectError::internal(e.to_string())),
        }
    }

    async fn update_task(
        &self,
        ctx: RequestContext,
        request: ServiceRequest<'_, UpdateTaskRequest>,
    ) -> ServiceResult<UpdateTaskResponse> {
        let auth = authorized(&ctx)?;
        let request = request.to_owned_message();
        let (task_id, result) = request
            .state
            .as_option()
            .map_or((0, TaskResult::RESULT_UNSPECIFIED.into()), |s| {
                (s.id, s.result)
            });
        Self::check_task(&auth, task_id, "UpdateTask")?;
        self.claims.received(&auth.id);
        let response = self
            .gitea
            .update_task(request)
            .await
            .map_err(|e| forward_error("UpdateTask", &auth, e))?;
        if result != buffa::EnumValue::from(TaskResult::RESULT_UNSPECIFIED) {
            // Invariant 10: the terminal marker is durable before the runner hears back;
            // if it is not, the runner retries and Gitea ignores the repeated result.
            let finished = self.claims.finish(&auth).await.map_err(|e| {
                tracing::warn!(assignment_id = %auth.id, error = %e, "persisting the terminal marker failed; the runner retries its final report (Gitea keeps the first result)");
                ConnectError::unavailable("persisting the terminal state failed; retry")
            })?;
            let label =
                |r: buffa::EnumValue<TaskResult>| r.as_known().map_or("unknown", result_label);
            let reported = label(result);
            // Gitea keeps the first result of a task (a cancel, an earlier report): what it
            // answers is what the job ended with.
            let kept = response
                .state
                .as_option()
                .map_or(reported, |s| label(s.result));
            if finished.first {
                if let Some(m) = &self.metrics {
                    m.completed(auth.backend, kept, finished.ran);
                }
                tracing::info!(assignment_id = %auth.id, event = "terminal", backend = %auth.backend, task_id, result = kept, reported, run_time = finished.ran.map(tracing::field::debug), "task finished: Gitea accepted its result");
            } else {
                tracing::debug!(assignment_id = %auth.id, task_id, result = kept, reported, "repeated final report of a finished task");
            }
        }
        Response::ok(response)
    }

    async fn update_log(
        &self,
        ctx: RequestContext,
        request: ServiceRequest<'_, UpdateLogRequest>,
    ) -> ServiceResult<UpdateLogResponse> {
        let auth = authorized(&ctx)?;
        let request = request.to_owned_message();
        Self::check_task(&auth, request.task_id, "UpdateLog")?;
        self.claims.received(&auth.id);
        let response = self
            .gitea
            .update_log(request)
            .await
            .map_err(|e| forward_error("UpdateLog", &auth, e))?;
        Response::ok(response)
    }
}
