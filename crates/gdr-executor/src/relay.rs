//! The relay between the runner's RunnerService calls and the facade (DESIGN invariant 19).
//!
//! - `Declare` is sent again while the facade is unreachable or asks for a retry, until the
//!   runner's own deadline: a restart of the controller just before the runner's first
//!   call no longer makes the runner exit.
//! - `FetchTask` is sent again while the facade is unreachable, within the runner's poll
//!   timeout; when that runs out it is answered "no task yet", as Gitea answers an idle
//!   poll. It is never sent once the runner may have given up on it: a task handed out to
//!   a runner that no longer listens would be lost. The answer tells whether the task was
//!   claimed, which decides whether the executor may start the runner again.
//! - `UpdateLog` and `UpdateTask` go straight through while the facade answers. When it
//!   does not (unreachable, connection lost, 502/503/504), the relay answers them itself as
//!   Gitea would and holds what it acknowledged ([`Outbox`]); from then on every report
//!   goes through the outbox, and a background task delivers it in order as soon as the
//!   facade is back. If the facade stays away longer than the outage tolerance, the relay
//!   gives up and says so.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use buffa::Message;
use bytes::Bytes;
use gdr_proto::runner::v1 as pb;
use http::{Response, StatusCode};
use tokio::sync::{Notify, watch};
use tokio::time::Instant;

use crate::outbox::{Delivery, Outbox};
use crate::proxy::{
    Body, Exchange, Facade, Failure, Head, OUTAGE_BACKOFF, ProxyError, Rpc, error_response,
    proto_response,
};

/// How much of a `FetchTask` caller's deadline is left for the answer to travel back: a
/// poll is sent only while at least this much remains.
const FETCH_MARGIN: Duration = Duration::from_secs(1);
/// The official runner's FetchTask timeout, when a poll carries no deadline.
const DEFAULT_FETCH_TIMEOUT: Duration = Duration::from_secs(5);

/// What the relay learned about the task's claim from the facade's `FetchTask` answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claim {
    /// No task was handed out through this executor yet.
    Unclaimed,
    /// The runner received its task.
    Claimed,
    /// The facade refused the runner (the task was handed out before, or the assignment
    /// is unknown): starting the runner again cannot help.
    Refused,
}

/// How the reports ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Settled {
    /// Everything the runner reported reached the facade (or nothing was held).
    Delivered,
    /// The facade stayed unreachable longer than the tolerance; this much was lost.
    GaveUp {
        /// How long the relay waited.
        waited: Duration,
        /// Log rows still held.
        rows: usize,
        /// Whether the task's final result was among them.
        result: bool,
    },
}

struct Shared {
    outbox: Outbox,
    /// Since when the facade has not taken what is held (`None`: nothing held).
    holding_since: Option<Instant>,
    /// The runner's own call of each method, the template of deliveries.
    heads: HashMap<Rpc, Head>,
    claim: Claim,
    gave_up: Option<Settled>,
}

/// Shared by the loopback proxy and the executor's run loop.
pub struct Relay {
    facade: Facade,
    tolerance: Duration,
    shared: Mutex<Shared>,
    /// Something new is held: the delivery task looks again.
    wake: Arc<Notify>,
    /// Bumped whenever the claim or the outbox changes.
    changed: watch::Sender<u64>,
}

impl Relay {
    /// A relay to the facade at `facade_url` with `client_config` (from
    /// [`gdr_identity::tls::executor_client_config`]; it must not preset ALPN), holding
    /// reports for at most `tolerance` of facade outage. Starts the delivery task.
    pub fn new(
        facade_url: &str,
        client_config: &rustls::ClientConfig,
        tolerance: Duration,
    ) -> Result<Arc<Self>, ProxyError> {
        let relay = Arc::new(Relay {
            facade: Facade::new(facade_url, client_config)?,
            tolerance,
            shared: Mutex::new(Shared {
                outbox: Outbox::default(),
                holding_since: None,
                heads: HashMap::new(),
                claim: Claim::Unclaimed,
                gave_up: None,
            }),
            wake: Arc::new(Notify::new()),
            changed: watch::channel(0).0,
        });
        // The task holds the relay only while delivering, and ends once it is dropped.
        let weak = Arc::downgrade(&relay);
        let wake = relay.wake.clone();
        tokio::spawn(async move {
            loop {
                let notified = wake.notified();
                match weak.upgrade() {
                    Some(relay) => relay.deliver().await,
                    None => return,
                }
                notified.await;
            }
        });
        Ok(relay)
    }

    pub(crate) fn facade(&self) -> &Facade {
        &self.facade
    }

    /// The outage tolerance.
    pub fn tolerance(&self) -> Duration {
        self.tolerance
    }

    fn lock(&self) -> MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn bump(&self) {
        self.changed.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// What the facade's answers said about the claim so far.
    pub fn claim(&self) -> Claim {
        self.lock().claim
    }

    /// Waits until everything held is delivered, or the relay gave up.
    pub async fn settled(&self) -> Settled {
        let mut changed = self.changed.subscribe();
        loop {
            {
                let shared = self.lock();
                if let Some(gave_up) = &shared.gave_up {
                    return gave_up.clone();
                }
                if shared.outbox.is_empty() {
                    return Settled::Delivered;
                }
            }
            if changed.changed().await.is_err() {
                return Settled::Delivered;
            }
        }
    }

    pub(crate) async fn rpc(&self, rpc: Rpc, head: Head, body: Bytes) -> Response<Body> {
        match rpc {
            Rpc::UpdateLog => self.update_log(head, body).await,
            Rpc::UpdateTask => self.update_task(head, body).await,
            Rpc::FetchTask => self.fetch_task(head, body).await,
            Rpc::Declare => self.waiting(head, body, true).await,
            Rpc::Other => self.waiting(head, body, false).await,
        }
    }

    /// Sends a call again while the facade is unreachable (and, for an idempotent call,
    /// while the answer was lost or the facade asked for a retry), until the caller's
    /// deadline or the tolerance.
    async fn waiting(&self, head: Head, body: Bytes, idempotent: bool) -> Response<Body> {
        let deadline = Instant::now() + head.deadline().unwrap_or(self.tolerance);
        let mut attempt = 0u32;
        loop {
            let outcome = self.facade.unary(&head, body.clone()).await;
            let retry = match &outcome {
                Ok(exchange) => idempotent && retry_status(exchange.status),
                Err(Failure::Unreachable(_)) => true,
                Err(Failure::Lost(_)) => idempotent,
            };
            let delay = OUTAGE_BACKOFF.delay(attempt);
            if !retry || Instant::now() + delay >= deadline {
                return match outcome {
                    Ok(exchange) => exchange.into_response(),
                    Err(failure) => self.bad_gateway(&head, &failure),
                };
            }
            if attempt == 0 {
                tracing::warn!(call = %head.path_and_query, outcome = %describe(&outcome), "the facade cannot take the runner's call now; sending it again");
            }
            tokio::time::sleep(delay).await;
            attempt += 1;
        }
    }

    async fn fetch_task(&self, head: Head, body: Bytes) -> Response<Body> {
        let budget = head
            .deadline()
            .unwrap_or(DEFAULT_FETCH_TIMEOUT)
            .saturating_sub(FETCH_MARGIN);
        let deadline = Instant::now() + budget;
        let mut attempt = 0u32;
        loop {
            if Instant::now() >= deadline {
                // Gitea's answer to an idle poll; the runner polls again.
                let version = pb::FetchTaskRequest::decode_from_slice(&body)
                    .map(|r| r.tasks_version)
                    .unwrap_or_default();
                tracing::debug!("facade unreachable: answering the runner's poll with no task");
                return proto_response(
                    pb::FetchTaskResponse {
                        tasks_version: version,
                        ..Default::default()
                    }
                    .encode_to_vec(),
                );
            }
            match self.facade.unary(&head, body.clone()).await {
                Ok(exchange) => {
                    self.learn_claim(&exchange);
                    return exchange.into_response();
                }
                Err(Failure::Unreachable(e)) => {
                    if attempt == 0 {
                        tracing::info!(error = %e, "facade unreachable while the runner polls for its task; waiting");
                    }
                }
                // The facade may have handed the task out: never send it again.
                Err(failure) => return self.bad_gateway(&head, &failure),
            }
            let left = deadline.saturating_duration_since(Instant::now());
            tokio::time::sleep(OUTAGE_BACKOFF.delay(attempt).min(left)).await;
            attempt += 1;
        }
    }

    fn learn_claim(&self, exchange: &Exchange) {
        let claim = match exchange.status {
            StatusCode::OK => match pb::FetchTaskResponse::decode_from_slice(&exchange.body) {
                Ok(answer) if answer.task.is_set() => Some(Claim::Claimed),
                Ok(_) => None,
                // An answer the relay cannot read may carry the task: assume it does, so
                // the runner is never started a second time for one task.
                Err(_) => Some(Claim::Claimed),
            },
            StatusCode::UNAUTHORIZED => Some(Claim::Refused),
            _ => None,
        };
        if let Some(claim) = claim {
            let mut shared = self.lock();
            if shared.claim != Claim::Claimed {
                shared.claim = claim;
            }
            drop(shared);
            self.bump();
        }
    }

    async fn update_log(&self, head: Head, body: Bytes) -> Response<Body> {
        let Ok(request) = pb::UpdateLogRequest::decode_from_slice(&body) else {
            return self.waiting(head, body, true).await;
        };
        self.reported(Rpc::UpdateLog, &head);
        if !self.holding() {
            match self.facade.unary(&head, body.clone()).await {
                Ok(exchange) if exchange.status == StatusCode::OK => {
                    if let Ok(answer) = pb::UpdateLogResponse::decode_from_slice(&exchange.body) {
                        self.lock().outbox.passed_log(&request, &answer);
                    }
                    return exchange.into_response();
                }
                Ok(exchange) if !retry_status(exchange.status) => return exchange.into_response(),
                outcome => self.start_holding(&outcome),
            }
        }
        let answer = self.lock().outbox.hold_log(&request);
        self.held();
        proto_response(answer.encode_to_vec())
    }

    async fn update_task(&self, head: Head, body: Bytes) -> Response<Body> {
        let Ok(request) = pb::UpdateTaskRequest::decode_from_slice(&body) else {
            return self.waiting(head, body, true).await;
        };
        self.reported(Rpc::UpdateTask, &head);
        if !self.holding() {
            match self.facade.unary(&head, body.clone()).await {
                Ok(exchange) if exchange.status == StatusCode::OK => {
                    if let Ok(answer) = pb::UpdateTaskResponse::decode_from_slice(&exchange.body) {
                        self.lock().outbox.passed_state(&request, &answer);
                    }
                    return exchange.into_response();
                }
                Ok(exchange) if !retry_status(exchange.status) => return exchange.into_response(),
                outcome => self.start_holding(&outcome),
            }
        }
        let answer = self.lock().outbox.hold_state(request);
        self.held();
        proto_response(answer.encode_to_vec())
    }

    /// A report implies the runner has its task.
    fn reported(&self, rpc: Rpc, head: &Head) {
        let mut shared = self.lock();
        shared.heads.insert(rpc, head.clone());
        shared.claim = Claim::Claimed;
    }

    fn holding(&self) -> bool {
        !self.lock().outbox.is_empty()
    }

    fn start_holding(&self, outcome: &Result<Exchange, Failure>) {
        let mut shared = self.lock();
        if shared.holding_since.is_none() {
            shared.holding_since = Some(Instant::now());
            tracing::warn!(outcome = %describe(outcome), tolerance = ?self.tolerance, "the facade cannot take the runner's reports now; holding them and answering the runner until it can");
        }
    }

    fn held(&self) {
        {
            let mut shared = self.lock();
            if shared.holding_since.is_none() {
                shared.holding_since = Some(Instant::now());
            }
        }
        self.bump();
        self.wake.notify_one();
    }

    /// Delivers what is held until the outbox is empty, or gives up after the tolerance.
    async fn deliver(&self) {
        let mut attempt = 0u32;
        loop {
            let (next, head) = {
                let shared = self.lock();
                if shared.gave_up.is_some() {
                    return;
                }
                let Some(next) = shared.outbox.next() else {
                    drop(shared);
                    self.finish_holding();
                    return;
                };
                let method = match next {
                    Delivery::Log { .. } => Rpc::UpdateLog,
                    Delivery::State { .. } => Rpc::UpdateTask,
                };
                let head = shared.heads.get(&method).map(|h| {
                    h.for_method(match method {
                        Rpc::UpdateLog => "UpdateLog",
                        _ => "UpdateTask",
                    })
                });
                (next, head)
            };
            let Some(head) = head else {
                // Held only through a call of that method, so its head exists.
                tracing::error!("no request template for a held report; dropping it");
                self.drop_delivery(&next);
                continue;
            };
            let body = match &next {
                Delivery::Log { request, .. } => request.encode_to_vec(),
                Delivery::State { request, .. } => request.encode_to_vec(),
            };
            let outcome = self.facade.unary(&head, Bytes::from(body)).await;
            match outcome {
                Ok(exchange) if exchange.status == StatusCode::OK => {
                    attempt = 0;
                    self.delivered(&next, &exchange);
                }
                Ok(exchange) if !retry_status(exchange.status) => {
                    let text = String::from_utf8_lossy(&exchange.body).into_owned();
                    tracing::error!(status = %exchange.status, answer = %text, delivery = %delivery_name(&next), "the facade refused a held report; dropping it");
                    self.drop_delivery(&next);
                }
                outcome => {
                    if self.waited_too_long() {
                        return;
                    }
                    let delay = OUTAGE_BACKOFF.delay(attempt);
                    if attempt.is_multiple_of(20) {
                        tracing::info!(outcome = %describe(&outcome), attempt, retry_in = ?delay, delivery = %delivery_name(&next), "held reports not delivered yet");
                    }
                    tokio::time::sleep(delay).await;
                    attempt += 1;
                }
            }
        }
    }

    fn delivered(&self, next: &Delivery, exchange: &Exchange) {
        let mut shared = self.lock();
        match next {
            Delivery::Log { request, rows } => {
                let progress = pb::UpdateLogResponse::decode_from_slice(&exchange.body)
                    .is_ok_and(|answer| shared.outbox.delivered_log(request, &answer));
                if !progress {
                    let dropped = shared.outbox.drop_log();
                    tracing::error!(
                        rows = dropped,
                        batch = rows,
                        index = request.index,
                        "Gitea does not take the held log rows at their index; dropping them"
                    );
                }
            }
            Delivery::State {
                generation,
                request,
            } => {
                let answer =
                    pb::UpdateTaskResponse::decode_from_slice(&exchange.body).unwrap_or_default();
                shared.outbox.delivered_state(*generation, &answer);
                let result = request.state.as_option().map(|s| s.result.to_i32());
                tracing::info!(?result, "held task state delivered");
            }
        }
        // Progress: the tolerance counts from the last delivery.
        shared.holding_since = Some(Instant::now());
        drop(shared);
        self.bump();
    }

    fn drop_delivery(&self, next: &Delivery) {
        let mut shared = self.lock();
        match next {
            Delivery::Log { .. } => {
                shared.outbox.drop_log();
            }
            Delivery::State { generation, .. } => shared.outbox.drop_state(*generation),
        }
        drop(shared);
        self.bump();
    }

    fn finish_holding(&self) {
        let mut shared = self.lock();
        if let Some(since) = shared.holding_since.take() {
            tracing::info!(held_for = ?since.elapsed(), "every held report reached the facade");
        }
        drop(shared);
        self.bump();
    }

    fn waited_too_long(&self) -> bool {
        let mut shared = self.lock();
        let Some(since) = shared.holding_since else {
            return false;
        };
        let waited = since.elapsed();
        if waited < self.tolerance {
            return false;
        }
        let rows = shared.outbox.held_rows();
        let result = shared.outbox.holds_result();
        tracing::error!(waited = ?waited, rows, "the facade stayed unreachable longer than executor_report_outage_tolerance; giving up the held reports");
        shared.gave_up = Some(Settled::GaveUp {
            waited,
            rows,
            result,
        });
        drop(shared);
        self.bump();
        true
    }

    fn bad_gateway(&self, head: &Head, failure: &Failure) -> Response<Body> {
        tracing::warn!(call = %head.path_and_query, error = ?failure, "loopback proxy: facade request failed");
        error_response(
            StatusCode::BAD_GATEWAY,
            &format!("facade {} unreachable: {failure}", self.facade.authority()),
        )
    }
}

/// Answers that mean "not now" rather than "no": the facade or something in front of it
/// is down, or the facade could not reach Gitea or its backend.
fn retry_status(status: StatusCode) -> bool {
    matches!(
        status,
        StatusCode::BAD_GATEWAY | StatusCode::SERVICE_UNAVAILABLE | StatusCode::GATEWAY_TIMEOUT
    )
}

fn describe(outcome: &Result<Exchange, Failure>) -> String {
    match outcome {
        Ok(exchange) => format!("answered {}", exchange.status),
        Err(failure) => failure.to_string(),
    }
}

fn delivery_name(delivery: &Delivery) -> &'static str {
    match delivery {
        Delivery::Log { .. } => "UpdateLog",
        Delivery::State { .. } => "UpdateTask",
    }
}
