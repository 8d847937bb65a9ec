//! The scheduler: claims tasks from Gitea and hands them to JetStream.
//!
//! - One `Declare`, then N concurrent FetchTask pollers sharing one
//!   [`TasksVersion`] (invariant 1). N is the enabled capacity bounded by
//!   `fetch_pollers_max`: Gitea serialises task picks per instance
//!   (`MAX_CONCURRENT_TASK_PICKS`), so more concurrent pollers only cost.
//! - While Gitea has nothing, one idle poller calls FetchTask once per idle interval
//!   (counted start to start) and the others park; the first task wakes them all, so a
//!   burst is fetched by every poller. Labels declared anew wake them too (the idle
//!   poller's pause included): a backend whose full backlog drained is offered its jobs
//!   again, and its free slots must not wait out the idle interval. A FetchTask Gitea holds open (long polling) that
//!   runs into the client deadline is an empty answer, not an error: no backoff.
//! - Every fetched task's assignment is published until JetStream acknowledges it
//!   (invariant 2); the message ID is the assignment ID (invariant 3), so a retry after
//!   a lost acknowledgement is de-duplicated. A poller fetches again while its earlier
//!   publishes await their acks, with at most `publish_window` unacknowledged at once
//!   (the module `in_flight`): the fetch and publish round trips overlap.
//! - [`Shutdown`] stops new fetches; an in-flight fetch finishes and its task is
//!   published for a bounded time (invariant 4). A task fetched and not stored within
//!   that time is logged at ERROR with its task ID: the documented loss window.
//! - A backlog gate stops fetching a backend's jobs while its subject holds its limit of
//!   unclaimed assignments (invariant 5b), by declaring the labels of only the backends
//!   with room, so a full or dead backend never stops the other (22); [`Heartbeater`]
//!   keeps queued tasks alive (5a), from the stream and from [`FetchedTasks`], the
//!   pollers' own record of what they fetched, so a NATS outage does not stop it.
//! - With a task key, envelopes are sealed (v2) and carry an `id_mac` under the key derived
//!   from the capability key, so a replica lacking that task key can still authenticate
//!   the assignment ID (invariant 21).
//! - A task that cannot become an assignment is failed in Gitea with a log row
//!   giving the reason, never dropped silently.

mod gate;
mod heartbeat;
mod idle;
mod in_flight;
mod stats;
mod version;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use gate::{BacklogGate, Slot};
use gdr_core::assignment::{
    Assignment, DerivationPolicy, TaskKeyring, encode_v1, encode_v2, encode_v2_with_id_mac,
};
use gdr_core::backend::Backend;
use gdr_core::capability::EnvelopeIdKey;
use gdr_proto::runner::v1 as pb;
pub use heartbeat::{FetchedTasks, HeartbeatRound, Heartbeater};
use idle::{IdleControl, Parked, Waker};
use in_flight::InFlight;
pub use stats::{ERROR_KINDS, SchedulerStats};
use tokio::task::JoinSet;
use tokio::time::Instant;
pub use version::TasksVersion;

pub use crate::backoff::Backoff;
use crate::queue::{self, QueueError, StreamSettings};
use crate::shutdown::{Shutdown, shutdown_channel};
use gdr_gitea::{ErrorKind, GiteaClient, GiteaError};

/// How the reason of a task that cannot run begins.
const INVALID_TASK_REASON: &str = "cannot run this job: ";

/// Prefix of the log row written when a task cannot run.
pub const INVALID_TASK_LOG_PREFIX: &str = "gitea-dynamic-runner: cannot run this job: ";

/// The idle poller's pace: the official runner's default `fetch_interval`, so an idle
/// controller costs Gitea what one idle runner does.
pub const IDLE_INTERVAL: Duration = Duration::from_secs(2);

/// Default [`SchedulerSettings::publish_window`]: enough for a poller's next FetchTask to
/// overlap several publish round trips, few enough that a NATS outage holds only a handful
/// of fetched tasks per poller (the backlog gate bounds them further).
pub const PUBLISH_WINDOW: usize = 8;

/// Tunables of the pollers.
#[derive(Debug, Clone)]
pub struct SchedulerSettings {
    /// Labels sent with `Declare` (e.g. `self-hosted`, `pod`, `vm`).
    pub labels: Vec<String>,
    /// Capabilities sent with `Declare` (e.g. `cancelling`).
    pub capabilities: Vec<String>,
    /// Concurrent FetchTask pollers: the enabled capacity, bounded by `fetch_pollers_max`.
    pub pollers: usize,
    /// No fetch of a backend's jobs while its subject holds this many unclaimed
    /// assignments (≥ 1), unless `backlog_limits` names the backend.
    pub backlog_limit: u64,
    /// Per-backend limits overriding `backlog_limit`.
    pub backlog_limits: BTreeMap<Backend, u64>,
    /// How often the stream's message count is refreshed.
    pub backlog_refresh: Duration,
    /// While Gitea has nothing, the idle poller starts one FetchTask per this interval
    /// (start to start, so a request Gitea held open is followed by the next at once).
    pub idle_interval: Duration,
    /// Pause after failed Gitea calls or an unreadable stream.
    pub error_backoff: Backoff,
    /// Pause between publish attempts of one assignment.
    pub publish_backoff: Backoff,
    /// After shutdown is requested, how long a fetched task's publish is still retried.
    pub shutdown_publish_timeout: Duration,
    /// The most fetched tasks one poller keeps unacknowledged by JetStream at once (≥ 1;
    /// 1: it fetches nothing else until its task is stored).
    pub publish_window: usize,
}

impl SchedulerSettings {
    /// Settings with production defaults: a 2 s idle interval (the official runner's
    /// `fetch_interval`), 1–30 s error backoff,
    /// 100 ms–5 s publish backoff, 500 ms backlog refresh, 30 s publish bound at shutdown,
    /// [`PUBLISH_WINDOW`] unacknowledged publishes per poller.
    pub fn new(
        labels: Vec<String>,
        capabilities: Vec<String>,
        pollers: usize,
        backlog_limit: u64,
    ) -> Self {
        SchedulerSettings {
            labels,
            capabilities,
            pollers,
            backlog_limit,
            backlog_limits: BTreeMap::new(),
            backlog_refresh: Duration::from_millis(500),
            idle_interval: IDLE_INTERVAL,
            error_backoff: Backoff::new(Duration::from_secs(1), Duration::from_secs(30)),
            publish_backoff: Backoff::new(Duration::from_millis(100), Duration::from_secs(5)),
            shutdown_publish_timeout: Duration::from_secs(30),
            publish_window: PUBLISH_WINDOW,
        }
    }
}

/// Why the scheduler could not run.
#[derive(Debug, thiserror::Error)]
pub enum SchedulerError {
    /// Gitea refused `Declare` for a reason retrying does not fix.
    #[error("declaring the runner: {0}")]
    Declare(#[source] GiteaError),
    /// The settings cannot work.
    #[error("scheduler settings: {0}")]
    Settings(String),
    /// A poller task (or one of its handoffs) panicked or was aborted.
    #[error("poller stopped abnormally: {0}")]
    Poller(#[source] tokio::task::JoinError),
}

/// What a finished [`Scheduler::run`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    /// Tasks FetchTask handed out.
    pub tasks_fetched: u64,
    /// Assignments JetStream acknowledged.
    pub tasks_published: u64,
    /// Tasks failed in Gitea because they cannot become assignments.
    pub invalid_tasks_failed: u64,
    /// Tasks fetched but not stored before the shutdown bound ran out.
    pub lost_task_ids: Vec<i64>,
}

impl Report {
    fn merge(&mut self, other: Report) {
        self.tasks_fetched += other.tasks_fetched;
        self.tasks_published += other.tasks_published;
        self.invalid_tasks_failed += other.invalid_tasks_failed;
        self.lost_task_ids.extend(other.lost_task_ids);
    }
}

struct Shared {
    gitea: GiteaClient,
    js: jetstream::Context,
    stream: StreamSettings,
    policy: DerivationPolicy,
    keyring: Option<Arc<TaskKeyring>>,
    id_key: Option<EnvelopeIdKey>,
    fetched: Arc<FetchedTasks>,
    settings: SchedulerSettings,
    stats: Arc<SchedulerStats>,
    version: Arc<TasksVersion>,
    gate: BacklogGate,
    idle: IdleControl,
    /// Poked when the stream's count may have dropped (a worker settled a delivery), so
    /// the gate re-reads it at once instead of at the next refresh.
    backlog_changed: Arc<tokio::sync::Notify>,
    declared: tokio::sync::watch::Sender<Option<gdr_gitea::Declared>>,
}

/// The FetchTask pollers of one controller (one runner registration).
pub struct Scheduler {
    /// Shared by the pollers once [`Scheduler::run`] starts them.
    shared: Shared,
}

impl std::fmt::Debug for Scheduler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scheduler")
            .field("stream", &self.shared.stream.stream)
            .field("settings", &self.shared.settings)
            .finish_non_exhaustive()
    }
}

impl Scheduler {
    /// A scheduler publishing v1 envelopes; add a keyring with [`Scheduler::with_keyring`].
    /// The stream must exist (see [`queue::ensure_stream`]).
    pub fn new(
        gitea: GiteaClient,
        js: jetstream::Context,
        stream: StreamSettings,
        policy: DerivationPolicy,
        settings: SchedulerSettings,
    ) -> Self {
        let gate = BacklogGate::new(Self::backend_limits(&settings, &policy));
        let idle = IdleControl::new();
        Scheduler {
            shared: Shared {
                gitea,
                js,
                stream,
                policy,
                keyring: None,
                id_key: None,
                fetched: Arc::new(FetchedTasks::new()),
                settings,
                stats: Arc::new(SchedulerStats::new()),
                version: Arc::new(TasksVersion::new()),
                gate,
                idle,
                backlog_changed: Arc::new(tokio::sync::Notify::new()),
                declared: tokio::sync::watch::Sender::new(None),
            },
        }
    }

    /// Seals task bytes with `keyring` (v2 envelopes).
    #[must_use]
    pub fn with_keyring(mut self, keyring: Arc<TaskKeyring>) -> Self {
        self.shared.keyring = Some(keyring);
        self
    }

    /// Adds an `id_mac` under `key` to every sealed envelope, so a controller without the
    /// task key can authenticate its assignment ID (the held reconciler does).
    #[must_use]
    pub fn with_envelope_id_key(mut self, key: EnvelopeIdKey) -> Self {
        self.shared.id_key = Some(key);
        self
    }

    /// The pollers' record of the tasks they fetched and stored, for a [`Heartbeater`]
    /// ([`Heartbeater::with_fetched_tasks`]).
    pub fn fetched_tasks(&self) -> Arc<FetchedTasks> {
        self.shared.fetched.clone()
    }

    /// Counts into `stats` (e.g. shared with a [`Heartbeater`]).
    #[must_use]
    pub fn with_stats(mut self, stats: Arc<SchedulerStats>) -> Self {
        self.shared.stats = stats;
        self
    }

    /// Re-reads the backlog whenever `signal` is notified (the workers notify it when they
    /// settle a delivery), besides the periodic refresh.
    #[must_use]
    pub fn with_backlog_signal(mut self, signal: Arc<tokio::sync::Notify>) -> Self {
        self.shared.backlog_changed = signal;
        self
    }

    /// The counters.
    pub fn stats(&self) -> Arc<SchedulerStats> {
        self.shared.stats.clone()
    }

    /// What the controller's one `Declare` answered, once it has (the facade passes
    /// Gitea's capabilities header on to executors).
    pub fn declared(&self) -> tokio::sync::watch::Receiver<Option<gdr_gitea::Declared>> {
        self.shared.declared.subscribe()
    }

    /// The tasks version shared by the pollers.
    pub fn tasks_version(&self) -> Arc<TasksVersion> {
        self.shared.version.clone()
    }

    /// The backends whose labels `labels` declares, with their backlog limits.
    fn backend_limits(
        settings: &SchedulerSettings,
        policy: &DerivationPolicy,
    ) -> BTreeMap<Backend, u64> {
        [Backend::Pod, Backend::Vm]
            .into_iter()
            .filter(|b| {
                let label = policy.labels.label_of(*b);
                settings.labels.iter().any(|l| l == label)
            })
            .map(|b| {
                let limit = settings
                    .backlog_limits
                    .get(&b)
                    .copied()
                    .unwrap_or(settings.backlog_limit);
                (b, limit)
            })
            .collect()
    }

    /// Declares the runner, then polls until `shutdown`; returns when every poller
    /// has stopped (in-flight fetches finished, their tasks published or given up).
    pub async fn run(self, shutdown: Shutdown) -> Result<Report, SchedulerError> {
        let shared = Arc::new(self.shared);
        if shared.settings.pollers == 0 {
            return Err(SchedulerError::Settings(
                "at least one poller is needed".into(),
            ));
        }
        if !declare(&shared, &shutdown).await? {
            return Ok(Report::default());
        }
        let (stop_watcher, watcher_stop) = shutdown_channel();
        let watcher = tokio::spawn(watch_backlog(shared.clone(), watcher_stop.clone()));
        let declarer = tokio::spawn(keep_declared(shared.clone(), watcher_stop));
        let mut pollers = JoinSet::new();
        // One poller starts active; the others start parked and join on the first task.
        for index in 0..shared.settings.pollers {
            let parked = (index > 0).then(|| shared.idle.waker());
            pollers.spawn(poll(shared.clone(), index, parked, shutdown.clone()));
        }
        let mut report = Report::default();
        let mut failure = None;
        while let Some(joined) = pollers.join_next().await {
            match joined {
                Ok((r, None)) => report.merge(r),
                Ok((r, Some(e))) => {
                    report.merge(r);
                    failure = Some(SchedulerError::Poller(e));
                }
                Err(e) => failure = Some(SchedulerError::Poller(e)),
            }
        }
        stop_watcher.trigger();
        let _ = watcher.await;
        let _ = declarer.await;
        tracing::info!(
            tasks_fetched = report.tasks_fetched,
            tasks_published = report.tasks_published,
            tasks_lost = report.lost_task_ids.len(),
            "scheduler stopped"
        );
        match failure {
            Some(e) => Err(e),
            None => Ok(report),
        }
    }
}

/// One `Declare`, retried while Gitea is unavailable; false if shutdown came first.
async fn declare(shared: &Shared, shutdown: &Shutdown) -> Result<bool, SchedulerError> {
    let mut attempt = 0;
    loop {
        if shutdown.is_triggered() {
            return Ok(false);
        }
        match shared
            .gitea
            .declare(
                shared.settings.labels.clone(),
                shared.settings.capabilities.clone(),
            )
            .await
        {
            Ok(declared) => {
                shared.declared.send_replace(Some(declared.clone()));
                shared.gate.declared(shared.gate_backends());
                tracing::info!(
                    runner = %declared.runner.name,
                    labels = ?shared.settings.labels,
                    pollers = shared.settings.pollers,
                    backlog_limit = shared.settings.backlog_limit,
                    "runner declared"
                );
                return Ok(true);
            }
            Err(e) if e.is_retryable() => {
                tracing::warn!(error = %e, "Declare failed; retrying");
                if !shutdown
                    .sleep(shared.settings.error_backoff.delay(attempt))
                    .await
                {
                    return Ok(false);
                }
                attempt = attempt.saturating_add(1);
            }
            Err(e) => return Err(SchedulerError::Declare(e)),
        }
    }
}

/// Keeps the gate's view of each backend subject's message count fresh.
async fn watch_backlog(shared: Arc<Shared>, stop: Shutdown) {
    let mut stream: Option<jetstream::stream::Stream> = None;
    let mut healthy = true;
    loop {
        let epoch = shared.gate.epoch();
        let read = async {
            let s = match &mut stream {
                Some(s) => s,
                None => stream.insert(queue::open_stream(&shared.js, &shared.stream).await?),
            };
            queue::unclaimed_per_backend(s, &shared.stream).await
        };
        let bound = shared.settings.backlog_refresh.max(Duration::from_secs(2));
        let result = match tokio::time::timeout(bound, read).await {
            Ok(r) => r,
            Err(_) => Err(QueueError::Stream {
                stream: shared.stream.stream.clone(),
                source: "stream info timed out".into(),
            }),
        };
        match result {
            Ok(messages) => {
                if !healthy {
                    tracing::info!(unclaimed = ?messages, "stream readable again");
                }
                healthy = true;
                shared.gate.refreshed(&messages, &epoch);
            }
            Err(e) => {
                if healthy {
                    tracing::warn!(error = %e, "cannot read the backlog; fetching paused");
                }
                healthy = false;
                shared.gate.unknown();
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(shared.settings.backlog_refresh) => {}
            _ = shared.backlog_changed.notified() => {}
            _ = stop.wait() => return,
        }
    }
}

impl Shared {
    /// The backends the gate limits (those whose labels the settings declare).
    fn gate_backends(&self) -> BTreeSet<Backend> {
        Scheduler::backend_limits(&self.settings, &self.policy)
            .into_keys()
            .collect()
    }

    /// The declared labels with those of the backends not in `open` left out.
    fn labels_for(&self, open: &BTreeSet<Backend>) -> Vec<String> {
        let closed: Vec<&str> = self
            .gate_backends()
            .difference(open)
            .map(|b| self.policy.labels.label_of(*b))
            .collect();
        self.settings
            .labels
            .iter()
            .filter(|l| !closed.contains(&l.as_str()))
            .cloned()
            .collect()
    }
}

/// Keeps the labels Gitea has equal to those of the backends with room in their backlog:
/// a Declare whenever that set changes, so Gitea offers only jobs that can be queued.
async fn keep_declared(shared: Arc<Shared>, stop: Shutdown) {
    let mut changes = shared.gate.subscribe();
    let mut attempt = 0u32;
    loop {
        if let Some(open) = shared.gate.wanted() {
            let labels = shared.labels_for(&open);
            match shared
                .gitea
                .declare(labels.clone(), shared.settings.capabilities.clone())
                .await
            {
                Ok(declared) => {
                    attempt = 0;
                    shared.declared.send_replace(Some(declared));
                    // Declare does not bump Gitea's tasks version: without a reset, a
                    // poller whose version is current would never pick a job the new
                    // labels match.
                    shared.version.task_received();
                    tracing::info!(
                        ?labels,
                        "labels declared for the backends whose backlog has room"
                    );
                    shared.gate.declared(open);
                    // The pollers parked by empty answers under the old labels (a backend
                    // whose backlog was full) fetch now, not after the idle interval.
                    shared.idle.wake_all();
                    continue;
                }
                Err(e) => {
                    tracing::warn!(error = %e, ?labels, "Declare of the open backends' labels failed; retrying");
                    let delay = shared.settings.error_backoff.delay(attempt);
                    attempt = attempt.saturating_add(1);
                    if !stop.sleep(delay).await {
                        return;
                    }
                    continue;
                }
            }
        }
        tokio::select! {
            changed = changes.changed() => if changed.is_err() { return },
            _ = stop.wait() => return,
        }
    }
}

/// One poller: gate, fetch, hand off; until shutdown, then waits for its handoffs still
/// unacknowledged (and the first of them that stopped abnormally).
async fn poll(
    shared: Arc<Shared>,
    index: usize,
    parked: Option<Waker>,
    shutdown: Shutdown,
) -> (Report, Option<tokio::task::JoinError>) {
    let mut in_flight = InFlight::new(shared.settings.publish_window);
    let mut report = fetch_until_stopped(&shared, index, parked, &shutdown, &mut in_flight).await;
    let (handed_off, failure) = in_flight.finish().await;
    report.merge(handed_off);
    (report, failure)
}

/// The poller's loop: gate, fetch, start the handoff. After an empty answer it parks
/// unless it is the idle poller, which waits out the idle interval instead.
async fn fetch_until_stopped(
    shared: &Arc<Shared>,
    index: usize,
    parked: Option<Waker>,
    shutdown: &Shutdown,
    in_flight: &mut InFlight,
) -> Report {
    let mut report = Report::default();
    let mut errors = 0u32;
    if let Some(mut waker) = parked {
        SchedulerStats::inc(&shared.stats.pollers_parked);
        let woken = shared.idle.wait(&mut waker, shutdown).await;
        SchedulerStats::dec(&shared.stats.pollers_parked);
        if woken == Parked::Stopped {
            return report;
        }
    }
    loop {
        let waiting = &shared.stats.pollers_waiting_for_backlog;
        let Some(slot) = shared.gate.admit(shutdown, waiting).await else {
            break;
        };
        // Before the version is read: a reset or new labels from here on wake this poller.
        let mut waker = shared.idle.waker();
        let sent = shared.version.current();
        let started = Instant::now();
        SchedulerStats::inc(&shared.stats.fetch_calls);
        // Not raced against shutdown: a task Gitea hands out must reach the stream.
        let fetched = shared.gitea.fetch_task(sent).await;
        let pause = match fetched {
            Ok(answer) => match answer.task.into_option() {
                Some(task) => {
                    errors = 0;
                    shared.version.task_received();
                    // More may be waiting: every poller fetches until Gitea runs dry.
                    shared.idle.wake_all();
                    shared.stats.tasks_fetched.inc();
                    report.tasks_fetched += 1;
                    crate::failpoint::hit(crate::failpoint::points::AFTER_FETCH);
                    in_flight
                        .start(hand_off_owned(shared.clone(), task, slot, shutdown.clone()))
                        .await;
                    continue;
                }
                None => {
                    errors = 0;
                    shared.gate.release(slot);
                    shared.version.empty_answer(sent, answer.tasks_version);
                    Pause::Idle
                }
            },
            // Gitea held the request open until our deadline (long polling): nothing came.
            Err(e) if e.timed_out() => {
                errors = 0;
                shared.gate.release(slot);
                SchedulerStats::inc(&shared.stats.fetch_held);
                Pause::Idle
            }
            Err(e) => {
                shared.gate.release(slot);
                shared.stats.fetch_error(e.kind());
                if e.kind() == ErrorKind::Unavailable {
                    tracing::warn!(poller = index, error = %e, "FetchTask failed");
                } else {
                    tracing::error!(poller = index, error = %e, kind = e.kind().as_str(), "FetchTask failed");
                }
                let delay = shared.settings.error_backoff.delay(errors);
                errors = errors.saturating_add(1);
                Pause::Error(delay)
            }
        };
        SchedulerStats::inc(&shared.stats.pollers_parked);
        let parked = shared.idle.park(&mut waker, shutdown).await;
        SchedulerStats::dec(&shared.stats.pollers_parked);
        let resumed = match (parked, pause) {
            (Parked::IdlePoller, Pause::Idle) => {
                let until = started + shared.settings.idle_interval;
                shared.idle.pause(&mut waker, until, shutdown).await
            }
            // A failing Gitea is backed off whatever happens meanwhile.
            (Parked::IdlePoller, Pause::Error(delay)) => {
                if shutdown.sleep(delay).await {
                    Parked::IdlePoller
                } else {
                    Parked::Stopped
                }
            }
            (other, _) => other,
        };
        if resumed == Parked::Stopped {
            break;
        }
    }
    report
}

/// Why a poller stopped fetching for now.
enum Pause {
    /// Gitea had nothing: the idle pace.
    Idle,
    /// The call failed: back off this long.
    Error(Duration),
}

/// [`hand_off`] as a task of its own (a poller's [`InFlight`] runs it), with its report.
async fn hand_off_owned(
    shared: Arc<Shared>,
    task: pb::Task,
    slot: Slot,
    shutdown: Shutdown,
) -> Report {
    let mut report = Report::default();
    hand_off(&shared, task, slot, &shutdown, &mut report).await;
    report
}

/// Turns a fetched task into a stored assignment, or fails it in Gitea.
async fn hand_off(
    shared: &Shared,
    task: pb::Task,
    slot: Slot,
    shutdown: &Shutdown,
    report: &mut Report,
) {
    let task_id = task.id;
    // The fetch→publish window (DESIGN invariant 4): a kill inside it loses the task.
    let fetched_at = std::time::Instant::now();
    let assignment = match Assignment::from_task(task, &shared.policy) {
        // Sealed into v2 envelopes, so a copy replayed after the task's lifetime is refused
        // by its age (DESIGN invariant 20); without it the age check has nothing to read.
        Ok(a) => a.with_fetch_time(std::time::SystemTime::now()),
        Err(e) => {
            shared.gate.release(slot);
            fail_invalid_task(shared, task_id, &e.to_string()).await;
            shared.stats.invalid_tasks_failed.inc();
            report.invalid_tasks_failed += 1;
            return;
        }
    };
    let encoded = match (&shared.keyring, &shared.id_key) {
        (Some(keyring), Some(id_key)) => encode_v2_with_id_mac(&assignment, keyring, id_key),
        (Some(keyring), None) => encode_v2(&assignment, keyring),
        (None, _) => encode_v1(&assignment),
    };
    let payload = match encoded {
        Ok(p) => bytes::Bytes::from(p),
        Err(e) => {
            shared.gate.release(slot);
            fail_invalid_task(
                shared,
                task_id,
                &format!("the assignment cannot be encoded: {e}"),
            )
            .await;
            shared.stats.invalid_tasks_failed.inc();
            report.invalid_tasks_failed += 1;
            return;
        }
    };
    let id = assignment.id().as_str();
    let backend = assignment.backend();
    // Heartbeats start now: the publish may wait out a NATS outage (DESIGN invariant 5a).
    shared.fetched.fetched(task_id);
    tracing::info!(
        task_id,
        assignment_id = id,
        event = "fetched",
        backend = backend.as_str(),
        repository = assignment.identity().repository(),
        job_key = assignment.identity().job_key(),
        "task fetched from Gitea"
    );
    match publish_until_stored(shared, &assignment, payload, shutdown).await {
        Ok(published) => {
            shared.fetched.stored(task_id, published.sequence);
            shared.gate.stored(slot, backend, published.duplicate);
            let window = fetched_at.elapsed();
            shared.stats.handoff(window);
            SchedulerStats::inc(&shared.stats.tasks_published);
            if published.duplicate {
                SchedulerStats::inc(&shared.stats.publish_duplicates);
            }
            report.tasks_published += 1;
            tracing::info!(
                task_id,
                assignment_id = id,
                event = "stored",
                backend = backend.as_str(),
                sequence = published.sequence,
                duplicate = published.duplicate,
                handoff_window = ?window,
                "assignment queued"
            );
        }
        // No retry stores it: holding the poller, its backlog room and the task's
        // heartbeats for it would only keep a job Running in Gitea that never runs.
        Err(Unstored::Refused(e)) => {
            shared.fetched.forget(task_id);
            shared.gate.release(slot);
            fail_invalid_task(shared, task_id, &e.to_string()).await;
            shared.stats.invalid_tasks_failed.inc();
            report.invalid_tasks_failed += 1;
        }
        Err(Unstored::Lost) => {
            shared.fetched.forget(task_id);
            shared.gate.release(slot);
            shared.stats.tasks_lost.inc();
            report.lost_task_ids.push(task_id);
            tracing::error!(
                task_id,
                assignment_id = id,
                event = "lost",
                backend = backend.as_str(),
                "task fetched from Gitea but not stored in JetStream before shutdown; \
                 it stays Running in Gitea until its zombie timeout"
            );
        }
    }
}

/// Why an assignment was not stored.
enum Unstored {
    /// Shutdown was requested and `shutdown_publish_timeout` passed first.
    Lost,
    /// The server refuses it for good (larger than its `max_payload`).
    Refused(queue::QueueError),
}

/// Publishes until JetStream acknowledges; gives up once shutdown has been requested and
/// `shutdown_publish_timeout` has passed since, or at once when the server refuses the
/// envelope for good.
async fn publish_until_stored(
    shared: &Shared,
    assignment: &Assignment,
    payload: bytes::Bytes,
    shutdown: &Shutdown,
) -> Result<queue::Published, Unstored> {
    let id = assignment.id().as_str();
    let backend = assignment.backend();
    let task_id = assignment.id().task_id();
    let mut attempt = 0u32;
    let mut deadline: Option<Instant> = None;
    // The assignment ID (invariant 3), unless another message holds it.
    let mut message_id = id.to_owned();
    loop {
        if deadline.is_none() && shutdown.is_triggered() {
            deadline = Some(Instant::now() + shared.settings.shutdown_publish_timeout);
        }
        let publish = queue::publish(
            &shared.js,
            &shared.stream,
            backend,
            &message_id,
            payload.clone(),
        );
        let result = match deadline {
            None => Some(publish.await),
            Some(d) => tokio::time::timeout_at(d, publish).await.ok(),
        };
        let duplicate = match &result {
            Some(Ok(published)) if published.duplicate => {
                stored_is_ours(shared, published.sequence, &payload, attempt > 0).await
            }
            // Not a duplicate (or not stored at all): nothing to look at.
            _ => Duplicate::Ours,
        };
        let error = match result {
            // Never taken as stored unread: a forgery could otherwise drop the assignment.
            Some(Ok(published)) if duplicate == Duplicate::Unread => format!(
                "JetStream counted the publish a duplicate of message {}, which cannot be read now",
                published.sequence
            ),
            Some(Ok(published)) if duplicate == Duplicate::Foreign => {
                // Anyone able to publish can take an upcoming assignment ID within the
                // duplicate window; the real assignment must not be dropped for it.
                tracing::error!(
                    task_id,
                    assignment_id = id,
                    backend = backend.as_str(),
                    sequence = published.sequence,
                    "another message holds this assignment's message ID (a forgery, or another writer); storing the assignment under a message ID of its own"
                );
                message_id = format!("{id}.after-{}", published.sequence);
                continue;
            }
            Some(Ok(published)) => {
                crate::failpoint::hit(crate::failpoint::points::AFTER_PUBLISH);
                return Ok(published);
            }
            Some(Err(e @ queue::QueueError::TooLarge { .. })) => {
                return Err(Unstored::Refused(e));
            }
            Some(Err(e)) => e.to_string(),
            None => "publish timed out at shutdown".to_string(),
        };
        shared.stats.publish_retries.inc();
        crate::failpoint::hit(crate::failpoint::points::PUBLISH_UNACKNOWLEDGED);
        tracing::warn!(
            task_id,
            assignment_id = id,
            backend = backend.as_str(),
            attempt,
            error = %error,
            "publish not acknowledged; retrying"
        );
        let delay = shared.settings.publish_backoff.delay(attempt);
        attempt = attempt.saturating_add(1);
        match deadline {
            Some(d) => {
                if Instant::now() >= d {
                    return Err(Unstored::Lost);
                }
                tokio::time::sleep_until(d.min(Instant::now() + delay)).await;
            }
            // A shutdown during the pause ends it early; the loop then sets the deadline.
            None => {
                shutdown.sleep(delay).await;
            }
        }
    }
}

/// What the message JetStream counted a publish a duplicate of turned out to be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Duplicate {
    /// This very envelope (an earlier attempt whose acknowledgement was lost): stored.
    Ours,
    /// Another message holds the assignment's message ID.
    Foreign,
    /// The message could not be read: nothing is known, so publish again and look again.
    Unread,
}

/// How reading the message at a duplicate's sequence ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DuplicateRead {
    /// Read; whether its payload is this envelope.
    Read { same_payload: bool },
    /// No message at that sequence (removed since).
    Gone,
    /// The stream or the message could not be read.
    Failed,
}

/// Judges a duplicate acknowledgement from the read of the message it names. A message
/// that is gone already is ours only if an earlier attempt may have stored it
/// (`retried`).
fn judge_duplicate(read: DuplicateRead, retried: bool) -> Duplicate {
    match read {
        DuplicateRead::Read { same_payload: true } => Duplicate::Ours,
        DuplicateRead::Read {
            same_payload: false,
        } => Duplicate::Foreign,
        DuplicateRead::Gone if retried => Duplicate::Ours,
        DuplicateRead::Gone => Duplicate::Foreign,
        DuplicateRead::Failed => Duplicate::Unread,
    }
}

/// What the message JetStream counted our publish a duplicate of is (see
/// [`judge_duplicate`]).
async fn stored_is_ours(
    shared: &Shared,
    sequence: u64,
    payload: &bytes::Bytes,
    retried: bool,
) -> Duplicate {
    use async_nats::jetstream::stream::LastRawMessageErrorKind;
    let read = match queue::open_stream(&shared.js, &shared.stream).await {
        Err(_) => DuplicateRead::Failed,
        Ok(stream) => match stream.get_raw_message(sequence).await {
            Ok(message) => DuplicateRead::Read {
                same_payload: message.payload == *payload,
            },
            Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => DuplicateRead::Gone,
            Err(_) => DuplicateRead::Failed,
        },
    };
    judge_duplicate(read, retried)
}

/// Reports a task that cannot run as failed, with one log row saying why.
async fn fail_invalid_task(shared: &Shared, task_id: i64, reason: &str) {
    let assignment_id = gdr_core::assignment::AssignmentId::from_task_id(task_id)
        .map(|id| id.to_string())
        .unwrap_or_default();
    tracing::error!(
        task_id,
        assignment_id,
        event = "failing",
        failure = "invalid_task",
        reason,
        "task cannot become an assignment; failing it in Gitea"
    );
    let reason = format!("{INVALID_TASK_REASON}{reason}");
    if let Err(e) = retry_gitea(shared, || shared.gitea.fail_task(task_id, &reason)).await {
        tracing::error!(
            task_id,
            assignment_id,
            error = %e,
            "could not fail the task in Gitea; it ends at Gitea's zombie timeout"
        );
    }
}

/// A few attempts while Gitea is unavailable.
async fn retry_gitea<T, F, Fut>(shared: &Shared, mut call: F) -> Result<T, GiteaError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, GiteaError>>,
{
    const ATTEMPTS: u32 = 5;
    let mut attempt = 0;
    loop {
        match call().await {
            Ok(v) => return Ok(v),
            Err(e) if e.is_retryable() && attempt + 1 < ATTEMPTS => {
                tokio::time::sleep(shared.settings.error_backoff.delay(attempt)).await;
                attempt += 1;
            }
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// DESIGN invariant 21 (issue 37): a duplicate acknowledgement whose message cannot be
    /// read is never taken as this assignment stored: the publish is tried again (and the
    /// message looked at again), so a forged message can never drop the assignment by
    /// making the stream unreadable at the wrong moment.
    #[test]
    fn a_duplicate_whose_message_cannot_be_read_is_published_again_never_taken_as_ours() {
        for retried in [false, true] {
            assert_eq!(
                judge_duplicate(DuplicateRead::Failed, retried),
                Duplicate::Unread
            );
        }
        assert_eq!(
            judge_duplicate(DuplicateRead::Read { same_payload: true }, false),
            Duplicate::Ours
        );
        assert_eq!(
            judge_duplicate(
                DuplicateRead::Read {
                    same_payload: false
                },
                true
            ),
            Duplicate::Foreign
        );
        assert_eq!(judge_duplicate(DuplicateRead::Gone, true), Duplicate::Ours);
        assert_eq!(
            judge_duplicate(DuplicateRead::Gone, false),
            Duplicate::Foreign
        );
    }
}
