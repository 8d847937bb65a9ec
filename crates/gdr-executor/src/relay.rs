//! The relay between the runner's RunnerService calls and the facade (DESIGN invariant 19).
//!
//! - `Declare` is sent again while the facade is unreachable or asks for a retry, until the
//!   runner's own deadline: a restart of the controller just before the runner's first
//!   call no longer makes the runner exit.
//! - `FetchTask` is sent again while the facade is unreachable, within the runner's poll
//!   timeout; when that runs out it is answered "no task yet", as Gitea answers an idle
//!   poll. It is never sent once the runner may have given up on it: a task handed out to
//!   a runner that no longer listens would be lost. A poll sent late carries only the
//!   deadline the runner has left (`connect-timeout-ms`), so the facade never answers it
//!   after the runner stopped listening. The answer tells whether the task was claimed,
//!   which decides whether the executor may start the runner again.
//! - `UpdateLog` and `UpdateTask` go straight through while the facade answers. When it
//!   cannot take them now (unreachable, connection lost, any 5xx but 501, 408, 429, or the
//!   Connect codes `unavailable`, `resource_exhausted`, `deadline_exceeded`) or a log batch
//!   is too large for it, the relay answers them itself as Gitea would and holds what it
//!   acknowledged ([`Outbox`]); from then on every report goes through the outbox, and a
//!   background task delivers it in order, in batches that fit the facade's request limit,
//!   as soon as the facade takes it. What the facade refuses for good is dropped alone and
//!   logged with what was lost, and the executor does not count its reports delivered. If
//!   the facade takes nothing for longer than the outage tolerance, the relay gives up and
//!   says so.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use buffa::Message;
use bytes::Bytes;
use gdr_proto::runner::v1 as pb;
use http::{Response, StatusCode};
use tokio::sync::{Notify, watch};
use tokio::time::Instant;

use crate::outbox::{Delivery, FACADE_REQUEST_LIMIT, Logged, Outbox};
use crate::upstream::{
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
    /// The facade refused some held reports for good (each refusal was logged); the rest
    /// reached it.
    Refused {
        /// Log rows refused.
        rows: usize,
        /// Whether the task's final result was among them.
        result: bool,
    },
    /// The facade stayed unreachable longer than the tolerance; this much was lost.
    GaveUp {
        /// How long the relay waited.
        waited: Duration,
        /// Log rows still held, and those refused before.
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
    /// Held log rows the facade refused for good.
    refused_rows: usize,
    /// Whether the facade refused the held final result for good.
    refused_result: bool,
}

/// Shared by the loopback proxy and the executor's run loop.
pub struct Relay {
    /// The assignment whose runner this relays, for the log.
    assignment: String,
    facade: Facade,
    tolerance: Duration,
    shared: Mutex<Shared>,
    /// Something new is held: the delivery task looks again.
    wake: Arc<Notify>,
    /// Bumped whenever the claim or the outbox changes.
    changed: watch::Sender<u64>,
}

impl Relay {
    /// A relay for the runner of `assignment_id` to the facade at `facade_url` with
    /// `client_config` (from [`gdr_identity::svid_stream::executor_client_config`]; it must not
    /// preset ALPN), holding reports for at most `tolerance` of facade outage. Starts the
    /// delivery task.
    pub fn new(
        assignment_id: &str,
        facade_url: &str,
        client_config: &rustls::ClientConfig,
        tolerance: Duration,
    ) -> Result<Arc<Self>, ProxyError> {
        let relay = Arc::new(Relay {
            assignment: assignment_id.to_owned(),
            facade: Facade::new(facade_url, client_config)?,
            tolerance,
            shared: Mutex::new(Shared {
                outbox: Outbox::default(),
                holding_since: None,
                heads: HashMap::new(),
                claim: Claim::Unclaimed,
                gave_up: None,
                refused_rows: 0,
                refused_result: false,
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

    /// Returns once an answer of Gitea's said the job was cancelled.
    pub async fn cancelled(&self) {
        let mut changed = self.changed.subscribe();
        while !self.lock().outbox.cancelled_by_gitea() {
            if changed.changed().await.is_err() {
                // The relay is going away: no answer will come any more.
                std::future::pending::<()>().await;
            }
        }
    }

    /// Waits until nothing is held any more (delivered, or refused for good), or the relay
    /// gave up.
    pub async fn settled(&self) -> Settled {
        let mut changed = self.changed.subscribe();
        loop {
            {
                let shared = self.lock();
                if let Some(gave_up) = &shared.gave_up {
                    return gave_up.clone();
                }
                if shared.outbox.is_empty() {
                    return if shared.refused_rows > 0 || shared.refused_result {
                        Settled::Refused {
                            rows: shared.refused_rows,
                            result: shared.refused_result,
                        }
                    } else {
                        Settled::Delivered
                    };
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
    async fn waiting(&self, mut head: Head, body: Bytes, idempotent: bool) -> Response<Body> {
        let caller = head.deadline();
        let deadline = Instant::now() + caller.unwrap_or(self.tolerance);
        let mut attempt = 0u32;
        loop {
            if caller.is_some() {
                set_deadline(
                    &mut head,
                    deadline.saturating_duration_since(Instant::now()),
                );
            }
            let outcome = self.facade.unary(&head, body.clone()).await;
            let retry = match &outcome {
                Ok(_) => idempotent && judge(&outcome, body.len()) == Verdict::Retry,
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
                tracing::warn!(assignment_id = %self.assignment, call = %head.path_and_query, outcome = %describe(&outcome), "the facade cannot take the runner's call now; sending it again");
            }
            tokio::time::sleep(delay).await;
            attempt += 1;
        }
    }

    async fn fetch_task(&self, mut head: Head, body: Bytes) -> Response<Body> {
        let budget = head
            .deadline()
            .unwrap_or(DEFAULT_FETCH_TIMEOUT)
            .saturating_sub(FETCH_MARGIN);
        let deadline = Instant::now() + budget;
        let mut attempt = 0u32;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left < Duration::from_millis(1) {
                // Gitea's answer to an idle poll; the runner polls again.
                let version = pb::FetchTaskRequest::decode_from_slice(&body)
                    .map(|r| r.tasks_version)
                    .unwrap_or_default();
                tracing::debug!(assignment_id = %self.assignment, "facade unreachable: answering the runner's poll with no task");
                return proto_response(
                    pb::FetchTaskResponse {
                        tasks_version: version,
                        ..Default::default()
                    }
                    .encode_to_vec(),
                );
            }
            // The facade answers within what the runner has left, never after it gave up.
            set_deadline(&mut head, left);
            match self.facade.unary(&head, body.clone()).await {
                Ok(exchange) => {
                    self.learn_claim(&exchange);
                    return exchange.into_response();
                }
                Err(Failure::Unreachable(e)) => {
                    if attempt == 0 {
                        tracing::info!(assignment_id = %self.assignment, error = %e, "facade unreachable while the runner polls for its task; waiting");
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
            let mut sent = request.clone();
            let translated = self.lock().outbox.to_gitea(&mut sent);
            let body = if translated {
                Bytes::from(sent.encode_to_vec())
            } else {
                body
            };
            let outcome = self.facade.unary(&head, body.clone()).await;
            match (judge(&outcome, body.len()), outcome) {
                (Verdict::Accepted, Ok(exchange)) => {
                    let Ok(mut answer) = pb::UpdateLogResponse::decode_from_slice(&exchange.body)
                    else {
                        return exchange.into_response();
                    };
                    let shared = &mut self.lock().outbox;
                    shared.passed_log(&request, &answer);
                    if !translated {
                        return exchange.into_response();
                    }
                    shared.to_runner(&mut answer);
                    return proto_response(answer.encode_to_vec());
                }
                // The runner's own call: it hears the refusal and decides.
                (Verdict::Refused, Ok(exchange)) => return exchange.into_response(),
                (_, outcome) => self.start_holding(&outcome),
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
            // Step log ranges in Gitea's index, as the log's own index is (to_gitea).
            let mut sent = request.clone();
            let body = if self.lock().outbox.to_gitea_state(&mut sent) {
                Bytes::from(sent.encode_to_vec())
            } else {
                body
            };
            let outcome = self.facade.unary(&head, body.clone()).await;
            match (judge(&outcome, body.len()), outcome) {
                (Verdict::Accepted, Ok(exchange)) => {
                    if let Ok(answer) = pb::UpdateTaskResponse::decode_from_slice(&exchange.body) {
                        self.lock().outbox.passed_state(&request, &answer);
                        self.bump();
                    }
                    return exchange.into_response();
                }
                (Verdict::Refused, Ok(exchange)) => return exchange.into_response(),
                (_, outcome) => self.start_holding(&outcome),
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
            tracing::warn!(assignment_id = %self.assignment, outcome = %describe(outcome), tolerance = ?self.tolerance, "the facade cannot take the runner's reports now; holding them and answering the runner until it can");
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
                self.refuse(&next, "no request template for it");
                continue;
            };
            let body = Bytes::from(match &next {
                Delivery::Log { request, .. } => request.encode_to_vec(),
                Delivery::State { request, .. } => request.encode_to_vec(),
            });
            let outcome = self.facade.unary(&head, body.clone()).await;
            let settled = match (judge(&outcome, body.len()), &outcome) {
                (Verdict::Accepted, Ok(exchange)) => self.delivered(&next, exchange),
                (Verdict::TooLarge, _) => {
                    if !self.split(&next, body.len()) {
                        let why = format!("{} bytes, {}", body.len(), describe(&outcome));
                        self.refuse(&next, &why);
                    }
                    true
                }
                (Verdict::Refused, _) => {
                    self.refuse(&next, &describe(&outcome));
                    true
                }
                _ => false,
            };
            if settled {
                attempt = 0;
                continue;
            }
            // Not now: the same delivery again after a pause, within the tolerance.
            if self.waited_too_long() {
                return;
            }
            let delay = OUTAGE_BACKOFF.delay(attempt);
            if attempt.is_multiple_of(20) {
                tracing::info!(assignment_id = %self.assignment, outcome = %describe(&outcome), attempt, retry_in = ?delay, delivery = %delivery_name(&next), "held reports not delivered yet");
            }
            tokio::time::sleep(delay).await;
            attempt += 1;
        }
    }

    /// The facade took a delivery: what its answer says is no longer held. Returns false
    /// when a log answer is unreadable (its acknowledged index is unknown: the rows are
    /// sent again, which Gitea writes once).
    fn delivered(&self, next: &Delivery, exchange: &Exchange) -> bool {
        let mut shared = self.lock();
        match next {
            Delivery::Log { request, .. } => {
                let Ok(answer) = pb::UpdateLogResponse::decode_from_slice(&exchange.body) else {
                    return false;
                };
                match shared.outbox.delivered_log(request, &answer) {
                    Logged::Progress => {}
                    Logged::Behind { lost } => {
                        shared.refused_rows = shared.refused_rows.saturating_add(lost);
                        tracing::error!(
                            assignment_id = %self.assignment,
                            event = "report_lost",
                            rows = lost,
                            gitea_index = answer.ack_index,
                            "Gitea has fewer log rows than the runner was told; those are lost, the held rows follow at Gitea's index"
                        );
                    }
                    Logged::NotTaken => {
                        drop(shared);
                        self.refuse(next, "Gitea took none of the rows at its own index");
                        return true;
                    }
                }
            }
            Delivery::State {
                generation,
                request,
            } => {
                // Taken (200) even if the answer is unreadable: a result is Gitea's now.
                let answer =
                    pb::UpdateTaskResponse::decode_from_slice(&exchange.body).unwrap_or_default();
                shared.outbox.delivered_state(*generation, &answer);
                let result = request.state.as_option().map(|s| s.result.to_i32());
                tracing::info!(assignment_id = %self.assignment, ?result, "held task state delivered");
            }
        }
        // Progress: the tolerance counts from the last delivery.
        shared.holding_since = Some(Instant::now());
        drop(shared);
        self.bump();
        true
    }

    /// The facade found a log batch too large: later batches are smaller. Returns false
    /// when it cannot be split (one row).
    fn split(&self, next: &Delivery, bytes: usize) -> bool {
        let Delivery::Log { request, rows } = next else {
            return false;
        };
        if !self.lock().outbox.too_large(request, bytes) {
            return false;
        }
        tracing::info!(assignment_id = %self.assignment, rows, bytes, "the facade found a batch of held log rows too large; sending it in smaller ones");
        true
    }

    /// The facade refused a delivery for good: it alone is dropped, and said so.
    fn refuse(&self, next: &Delivery, why: &str) {
        let mut shared = self.lock();
        match next {
            Delivery::Log { request, .. } => {
                let refused = shared.outbox.refuse_log(request);
                shared.refused_rows = shared.refused_rows.saturating_add(refused.count);
                tracing::error!(
                    assignment_id = %self.assignment,
                    event = "report_refused",
                    rows = refused.count,
                    first_row = refused.first,
                    no_more = request.no_more,
                    why,
                    "the facade refused held log rows for good; dropping only them, the rows after them follow"
                );
            }
            Delivery::State { generation, .. } => {
                let result = next.carries_result();
                shared.outbox.drop_state(*generation);
                shared.refused_result |= result;
                tracing::error!(
                    assignment_id = %self.assignment,
                    event = "report_refused",
                    result,
                    why,
                    "the facade refused the held task state for good; dropping it"
                );
            }
        }
        shared.holding_since = Some(Instant::now());
        drop(shared);
        self.bump();
    }

    fn finish_holding(&self) {
        let mut shared = self.lock();
        if let Some(since) = shared.holding_since.take() {
            tracing::info!(assignment_id = %self.assignment, held_for = ?since.elapsed(), "nothing held any more: every report reached the facade or was refused");
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
        let gave_up = Self::give_up(&mut shared, waited);
        tracing::error!(assignment_id = %self.assignment, settled = ?gave_up, "the facade stayed unreachable longer than executor_report_outage_tolerance; giving up the held reports");
        drop(shared);
        self.bump();
        true
    }

    /// Records that what is still held is given up after `waited`.
    fn give_up(shared: &mut Shared, waited: Duration) -> Settled {
        let rows = shared
            .outbox
            .held_rows()
            .saturating_add(shared.refused_rows);
        let result = shared.outbox.holds_result() || shared.refused_result;
        let gave_up = Settled::GaveUp {
            waited,
            rows,
            result,
        };
        shared.gave_up = Some(gave_up.clone());
        gave_up
    }

    /// The executor is being terminated (a Pod's deletion sends SIGTERM, then SIGKILL
    /// after its grace period): what is held gets one last delivery attempt of at most
    /// `bound` instead of the whole outage tolerance, then is given up, so the executor
    /// exits on its own, saying what was lost, before it is killed.
    pub async fn settle_within(&self, bound: Duration) -> Settled {
        self.wake.notify_one();
        if let Ok(settled) = tokio::time::timeout(bound, self.settled()).await {
            return settled;
        }
        let mut shared = self.lock();
        if let Some(settled) = &shared.gave_up {
            return settled.clone();
        }
        let waited = shared
            .holding_since
            .map(|since| since.elapsed())
            .unwrap_or_default();
        let gave_up = Self::give_up(&mut shared, waited);
        tracing::error!(assignment_id = %self.assignment, settled = ?gave_up, bound = ?bound, "terminating: the held reports were not delivered in the last attempt; giving them up");
        drop(shared);
        self.bump();
        gave_up
    }

    fn bad_gateway(&self, head: &Head, failure: &Failure) -> Response<Body> {
        tracing::warn!(assignment_id = %self.assignment, call = %head.path_and_query, error = ?failure, "loopback proxy: facade request failed");
        error_response(
            StatusCode::BAD_GATEWAY,
            &format!("facade {} unreachable: {failure}", self.facade.authority()),
        )
    }
}

/// What an answer of the facade means for the call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    /// Taken (200).
    Accepted,
    /// Not now: the facade, something in front of it, Gitea or the backend cannot take it
    /// at the moment; the same call may succeed later.
    Retry,
    /// Larger than the facade (or a proxy in front of it) takes.
    TooLarge,
    /// No, for good: sending it again cannot help.
    Refused,
}

/// Judges the outcome of sending a request of `sent` bytes.
fn judge(outcome: &Result<Exchange, Failure>, sent: usize) -> Verdict {
    let over_limit = sent > FACADE_REQUEST_LIMIT;
    let exchange = match outcome {
        Ok(exchange) => exchange,
        // A request beyond the facade's limit may be cut off before its answer.
        Err(Failure::Lost(_)) if over_limit => return Verdict::TooLarge,
        Err(_) => return Verdict::Retry,
    };
    let status = exchange.status;
    if status == StatusCode::OK {
        return Verdict::Accepted;
    }
    let code = connect_code(exchange);
    let exhausted =
        status == StatusCode::TOO_MANY_REQUESTS || code.as_deref() == Some("resource_exhausted");
    if status == StatusCode::PAYLOAD_TOO_LARGE || (exhausted && over_limit) {
        return Verdict::TooLarge;
    }
    let transient_code = matches!(
        code.as_deref(),
        Some("unavailable" | "resource_exhausted" | "deadline_exceeded")
    );
    if transient_code
        || exhausted
        || status == StatusCode::REQUEST_TIMEOUT
        || (status.is_server_error() && status != StatusCode::NOT_IMPLEMENTED)
    {
        return Verdict::Retry;
    }
    Verdict::Refused
}

/// The Connect error code of an error answer (`{"code": "unavailable", ...}`), if it is one.
fn connect_code(exchange: &Exchange) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct ConnectError {
        code: String,
    }
    let json = exchange
        .headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim().starts_with("application/json"));
    if !json {
        return None;
    }
    serde_json::from_slice::<ConnectError>(&exchange.body)
        .ok()
        .map(|e| e.code)
}

/// Sets the deadline a call carries to the facade (`connect-timeout-ms`, as Connect
/// clients send it): what its caller has left, not what it had.
fn set_deadline(head: &mut Head, left: Duration) {
    let millis = u64::try_from(left.as_millis()).unwrap_or(u64::MAX).max(1);
    head.headers
        .insert("connect-timeout-ms", http::HeaderValue::from(millis));
}

fn describe(outcome: &Result<Exchange, Failure>) -> String {
    /// Enough of an error answer to say why.
    const SHOWN: usize = 300;
    match outcome {
        Ok(exchange) => {
            let text = String::from_utf8_lossy(&exchange.body);
            let cut = text
                .char_indices()
                .nth(SHOWN)
                .map_or(text.len(), |(i, _)| i);
            format!("answered {}: {}", exchange.status, &text[..cut])
        }
        Err(failure) => failure.to_string(),
    }
}

fn delivery_name(delivery: &Delivery) -> &'static str {
    match delivery {
        Delivery::Log { .. } => "UpdateLog",
        Delivery::State { .. } => "UpdateTask",
    }
}
