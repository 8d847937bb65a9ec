//! Heartbeats for queued tasks (invariant 5a).
//!
//! A fetched task is Running in Gitea's eyes, and Gitea fails a running task not
//! updated for `ZOMBIE_TASK_TIMEOUT`. While its assignment waits in JetStream, this
//! sends `UpdateTask{state: {id}}` (no result, no steps) for it every interval, one call at
//! a time. Two sources name the queued tasks:
//!
//! - The stream, read page by page and at most [`ReadLimits::max`] messages per round (a
//!   round that stops at the cap is continued by the next one), reading only the envelope's
//!   plain-JSON `id`, no decryption, so the list survives controller restarts. Work-queue
//!   retention removes a message when the claim acks it, which ends our heartbeats and
//!   leaves them to the runner. A held message (sealed with a task key this controller
//!   lacks) is beaten only if its `id_mac` verifies, since anyone who can publish can name
//!   any ID there, and only until the held timeout, when the held reconciler takes over.
//! - [`FetchedTasks`], the scheduler's own in-memory record of the tasks it fetched and
//!   published. It is beaten whatever the stream says, so a NATS outage longer than Gitea's
//!   zombie timeout fails no queued task (the stream cannot be read then, and a publish
//!   may still be retried), and pruned once a read of the stream shows a task's message
//!   gone (claimed, terminated or moved). Each read also adds the messages whose `id_mac`
//!   verifies (a scheduler of this deployment wrote them), so after a restart the record
//!   holds what an earlier process queued once the stream has been read.
//!
//! A task Gitea answers as ended (e.g. cancelled while queued) is recorded as finished
//! (Gitea's answer vouches for the ID: it is this runner's task, and it has ended), so no
//! worker starts an executor for it, even after a restart, and its end is reported back
//! once, as its runner would, so Gitea does not wait for a runner that never comes.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use async_nats::jetstream;
use buffa::MessageField;
use gdr_core::assignment::{AssignmentId, authenticated_id, envelope_id};
use gdr_core::capability::EnvelopeIdKey;
use gdr_proto::runner::v1 as pb;

use super::stats::SchedulerStats;
use crate::ports::{FinishedLog, QueueError};
use crate::queue::{self, QueuedReader, ReadLimits, StreamSettings};
use crate::shutdown::Shutdown;
use gdr_gitea::GiteaClient;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Plain data updated in single steps: a poisoned lock holds consistent data.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The tasks this controller fetched and has not seen leave the stream yet: task ID and,
/// once JetStream stored its assignment, the stream sequence. Held in memory only; after
/// a restart the stream is the record.
#[derive(Debug, Default)]
pub struct FetchedTasks {
    tasks: Mutex<BTreeMap<i64, Option<u64>>>,
}

impl FetchedTasks {
    /// An empty record.
    pub fn new() -> Self {
        Self::default()
    }

    /// A read of the stream found an authenticated message of `task_id` at `sequence` (after
    /// a restart this rebuilds the record); an entry recorded already is kept.
    fn found(&self, task_id: i64, sequence: u64) {
        lock(&self.tasks).entry(task_id).or_insert(Some(sequence));
    }

    /// A task was fetched; its publish may still be retried.
    pub fn fetched(&self, task_id: i64) {
        lock(&self.tasks).insert(task_id, None);
    }

    /// JetStream stored the task's assignment at `sequence`.
    pub fn stored(&self, task_id: i64, sequence: u64) {
        lock(&self.tasks).insert(task_id, Some(sequence));
    }

    /// The task needs no heartbeat from here any more (lost, failed, or ended in Gitea).
    pub fn forget(&self, task_id: i64) {
        lock(&self.tasks).remove(&task_id);
    }

    /// The task IDs recorded now.
    pub fn task_ids(&self) -> Vec<i64> {
        lock(&self.tasks).keys().copied().collect()
    }

    /// How many tasks are recorded.
    pub fn len(&self) -> usize {
        lock(&self.tasks).len()
    }

    /// Whether no task is recorded.
    pub fn is_empty(&self) -> bool {
        lock(&self.tasks).is_empty()
    }

    /// Forgets the stored tasks whose sequence lies in `covered` (a range a read of the
    /// stream looked at completely) but was not `seen` there: their message is gone.
    fn prune(&self, covered: &std::ops::Range<u64>, seen: &BTreeSet<u64>) -> usize {
        let mut tasks = lock(&self.tasks);
        let before = tasks.len();
        tasks.retain(|_, sequence| match sequence {
            Some(s) => !covered.contains(s) || seen.contains(s),
            None => true,
        });
        before - tasks.len()
    }
}

/// Sends heartbeats for the assignments waiting in the stream.
pub struct Heartbeater {
    gitea: GiteaClient,
    js: jetstream::Context,
    stream: StreamSettings,
    interval: Duration,
    stats: Arc<SchedulerStats>,
    fetched: Arc<FetchedTasks>,
    finished: Option<Arc<dyn FinishedLog>>,
    id_key: Option<EnvelopeIdKey>,
    held_timeout: Duration,
    limits: ReadLimits,
    /// Where the next round starts reading (the previous one stopped at the cap), or 0.
    cursor: Mutex<u64>,
    /// Tasks Gitea answered as ended: never beaten again by this process.
    ended: Mutex<BTreeSet<i64>>,
}

impl std::fmt::Debug for Heartbeater {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Heartbeater")
            .field("stream", &self.stream.stream)
            .field("interval", &self.interval)
            .finish_non_exhaustive()
    }
}

/// What one round found and did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HeartbeatRound {
    /// Messages read from the stream.
    pub queued: usize,
    /// Whether the stream could be read to the end of its snapshot or the cap.
    pub stream_read: bool,
    /// Messages of the stream not read this round (at the cap, or unreadable).
    pub unread: u64,
    /// Tasks beaten from the controller's own record because the read did not show them.
    pub from_record: usize,
    /// Held messages not beaten: no valid `id_mac`, or past the held timeout.
    pub held_skipped: usize,
    /// Heartbeats Gitea accepted.
    pub sent: usize,
    /// Heartbeats that failed (or messages without a readable ID).
    pub failed: usize,
    /// Queued tasks Gitea reports as ended (task ID, result), e.g. cancelled.
    pub ended: Vec<(i64, pb::TaskResult)>,
}

/// What a read of the stream found, kept while it runs so a read cut short still counts.
#[derive(Default)]
struct Scan {
    /// Task IDs to beat, with the sequence of the message naming them.
    tasks: Vec<(i64, u64)>,
    /// Messages on a backend's subject whose `id_mac` verifies.
    authenticated: Vec<(i64, u64)>,
    /// Sequences of every message read.
    seen: BTreeSet<u64>,
    messages: usize,
    held_skipped: usize,
    unreadable: usize,
    covered: std::ops::Range<u64>,
    /// The read began at the stream's first message (not where a capped round stopped).
    from_start: bool,
    capped_at: Option<u64>,
    unread: u64,
}

impl Heartbeater {
    /// A heartbeater for the assignments in `stream`, every `interval`.
    pub fn new(
        gitea: GiteaClient,
        js: jetstream::Context,
        stream: StreamSettings,
        interval: Duration,
    ) -> Self {
        Heartbeater {
            gitea,
            js,
            stream,
            interval,
            stats: Arc::new(SchedulerStats::new()),
            fetched: Arc::new(FetchedTasks::new()),
            finished: None,
            id_key: None,
            held_timeout: Duration::MAX,
            limits: ReadLimits::DEFAULT,
            cursor: Mutex::new(0),
            ended: Mutex::new(BTreeSet::new()),
        }
    }

    /// Counts into `stats` (e.g. shared with the scheduler).
    #[must_use]
    pub fn with_stats(mut self, stats: Arc<SchedulerStats>) -> Self {
        self.stats = stats;
        self
    }

    /// Beats the tasks of the scheduler's own record too ([`super::Scheduler::fetched_tasks`]).
    #[must_use]
    pub fn with_fetched_tasks(mut self, fetched: Arc<FetchedTasks>) -> Self {
        self.fetched = fetched;
        self
    }

    /// Records queued tasks Gitea reports as ended in `finished`, so no executor starts.
    #[must_use]
    pub fn with_finished(mut self, finished: impl FinishedLog + 'static) -> Self {
        self.finished = Some(Arc::new(finished));
        self
    }

    /// Beats held messages whose `id_mac` verifies under `key` (without it, none), until
    /// they have been held `timeout`.
    #[must_use]
    pub fn with_held(mut self, key: EnvelopeIdKey, timeout: Duration) -> Self {
        self.id_key = Some(key);
        self.held_timeout = timeout;
        self
    }

    /// Reads the stream in pages of `limits.page`, at most `limits.max` messages a round.
    #[must_use]
    pub fn with_read_limits(mut self, limits: ReadLimits) -> Self {
        self.limits = limits;
        self
    }

    /// The counters.
    pub fn stats(&self) -> Arc<SchedulerStats> {
        self.stats.clone()
    }

    /// Beats at once, then every interval, until `shutdown`. Failures are logged and
    /// retried next round.
    pub async fn run(&self, shutdown: Shutdown) {
        let mut readable = true;
        loop {
            let round = self.beat_once().await;
            if round.stream_read != readable {
                readable = round.stream_read;
                if readable {
                    tracing::info!(
                        queued = round.queued,
                        "the stream is readable again; queued tasks are beaten from it"
                    );
                }
            }
            if round.unread > 0 {
                tracing::warn!(
                    queued = round.queued,
                    unread = round.unread,
                    from_record = round.from_record,
                    "heartbeat round did not read every queued message (at its cap, or the stream is unreadable); the tasks this controller fetched are beaten from its own record, the rest in a later round"
                );
            } else {
                tracing::debug!(
                    queued = round.queued,
                    sent = round.sent,
                    failed = round.failed,
                    held_skipped = round.held_skipped,
                    "heartbeat round"
                );
            }
            if !shutdown.sleep(self.interval).await {
                return;
            }
        }
    }

    /// One round: the stream's messages now (as far as it can be read within half an
    /// interval, at most the cap), then the recorded tasks the read did not show.
    pub async fn beat_once(&self) -> HeartbeatRound {
        let mut round = HeartbeatRound::default();
        let mut scan = Scan::default();
        // Bounded, so an unreachable NATS (whose requests wait out their own timeout)
        // never delays the heartbeats from the record past the interval.
        let budget = self.interval / 2;
        let read = tokio::time::timeout(budget, self.read(&mut scan)).await;
        let result = match read {
            Ok(r) => r,
            Err(_) => Err(QueueError::Stream {
                stream: self.stream.stream.clone(),
                source: format!("not read within {budget:?}").into(),
            }),
        };
        round.stream_read = result.is_ok();
        if let Err(e) = &result {
            tracing::warn!(error = %e, read = scan.messages, recorded = self.fetched.len(), "cannot read the queued assignments; beating the tasks this controller fetched from its own record");
        }
        *lock(&self.cursor) = scan.capped_at.unwrap_or(0);
        round.queued = scan.messages;
        round.unread = scan.unread;
        round.held_skipped = scan.held_skipped;
        round.failed += scan.unreadable;
        let pruned = self.fetched.prune(&scan.covered, &scan.seen);
        for (task_id, sequence) in &scan.authenticated {
            if !self.is_ended(*task_id) {
                self.fetched.found(*task_id, *sequence);
            }
        }
        if pruned > 0 {
            tracing::debug!(
                pruned,
                "tasks whose message left the stream need no heartbeat from here"
            );
        }

        let mut beaten = BTreeSet::new();
        let stream_tasks: Vec<i64> = scan.tasks.iter().map(|(t, _)| *t).collect();
        for task_id in stream_tasks {
            if self.is_ended(task_id) || !beaten.insert(task_id) {
                continue;
            }
            self.beat(task_id, &mut round).await;
        }
        for task_id in self.fetched.task_ids() {
            if self.is_ended(task_id) || !beaten.insert(task_id) {
                continue;
            }
            round.from_record += 1;
            self.beat(task_id, &mut round).await;
        }
        if result.is_ok() && scan.from_start && scan.capped_at.is_none() {
            // The whole stream was looked at: ended tasks no message names any more can go.
            let named: BTreeSet<i64> = scan.tasks.iter().map(|(t, _)| *t).collect();
            lock(&self.ended).retain(|t| named.contains(t));
        }
        // After the heartbeats, and bounded: NATS may be the thing that is away.
        if let Some(finished) = &self.finished {
            let saved = tokio::time::timeout(self.interval / 4, finished.save_unsaved()).await;
            if !matches!(saved, Ok(0)) {
                tracing::warn!(
                    "the finished records of tasks that ended while queued are not written yet (NATS unreachable); this process counts them as finished, and the next round writes them"
                );
            }
        }
        round
    }

    fn is_ended(&self, task_id: i64) -> bool {
        lock(&self.ended).contains(&task_id)
    }

    /// Reads the stream's messages into `scan`; stops at the cap.
    async fn read(&self, scan: &mut Scan) -> Result<(), QueueError> {
        let stream = queue::open_stream(&self.js, &self.stream).await?;
        let subjects = format!("{}.>", self.stream.subject_base);
        let held_prefix = format!("{}.held.", self.stream.subject_base);
        let start = *lock(&self.cursor);
        scan.from_start = start == 0;
        let mut reader = QueuedReader::new(&stream, &subjects, self.limits).starting_at(start);
        let now = SystemTime::now();
        scan.covered = reader.covered();
        let outcome = loop {
            let page = match reader.next_page().await {
                Ok(Some(page)) => page,
                Ok(None) => break Ok(()),
                Err(e) => break Err(e),
            };
            for message in page {
                scan.messages += 1;
                scan.seen.insert(message.sequence);
                if message.subject.starts_with(&held_prefix) {
                    let held_for = now.duration_since(message.published).unwrap_or_default();
                    let authenticated = self
                        .id_key
                        .as_ref()
                        .and_then(|k| authenticated_id(&message.payload, k));
                    match authenticated {
                        Some(a) if held_for < self.held_timeout => {
                            scan.tasks.push((a.id().task_id(), message.sequence));
                        }
                        _ => scan.held_skipped += 1,
                    }
                    continue;
                }
                if let Some(a) = self
                    .id_key
                    .as_ref()
                    .and_then(|k| authenticated_id(&message.payload, k))
                {
                    scan.authenticated
                        .push((a.id().task_id(), message.sequence));
                }
                match envelope_id(&message.payload) {
                    Some(id) => scan.tasks.push((id.task_id(), message.sequence)),
                    None => {
                        scan.unreadable += 1;
                        tracing::warn!(
                            sequence = message.sequence,
                            "queued message has no readable assignment ID; no heartbeat"
                        );
                    }
                }
            }
            scan.covered = reader.covered();
        };
        scan.covered = reader.covered();
        scan.unread = reader.unread();
        if reader.capped() {
            scan.capped_at = Some(reader.position());
        }
        outcome
    }

    async fn beat(&self, task_id: i64, round: &mut HeartbeatRound) {
        let request = pb::UpdateTaskRequest {
            state: MessageField::some(pb::TaskState {
                id: task_id,
                ..Default::default()
            }),
            ..Default::default()
        };
        match self.gitea.update_task(request).await {
            Ok(answer) => {
                round.sent += 1;
                self.stats.heartbeats_sent.inc();
                let result = answer
                    .state
                    .as_option()
                    .and_then(|s| s.result.as_known())
                    .unwrap_or(pb::TaskResult::RESULT_UNSPECIFIED);
                if result != pb::TaskResult::RESULT_UNSPECIFIED {
                    SchedulerStats::inc(&self.stats.queued_tasks_ended);
                    round.ended.push((task_id, result));
                    self.ended(task_id, result).await;
                }
            }
            Err(e) => {
                round.failed += 1;
                SchedulerStats::inc(&self.stats.heartbeat_errors);
                tracing::warn!(task_id, assignment_id = %gitea_assignment_id(task_id), error = %e, "heartbeat for a queued task failed; retried next round (Gitea fails the task if none arrives within its zombie timeout)");
            }
        }
    }

    /// A queued task Gitea answered as ended: no executor may start for it.
    async fn ended(&self, task_id: i64, result: pb::TaskResult) {
        lock(&self.ended).insert(task_id);
        self.fetched.forget(task_id);
        let assignment_id = gitea_assignment_id(task_id);
        // Counted as finished at once; written to the bucket at the end of the round.
        if let (Some(finished), Ok(id)) = (&self.finished, AssignmentId::from_task_id(task_id)) {
            finished.remember(&id);
        }
        tracing::info!(
            task_id,
            %assignment_id,
            event = "ended_while_queued",
            result = ?result,
            recorded = self.finished.is_some(),
            "queued task ended in Gitea (e.g. cancelled) before a runner claimed it; counted as finished, so no executor is started for it"
        );
        // What its runner would have sent on learning the end; Gitea keeps the first
        // result, so this only ends a task that waits for its runner (cancelling).
        let now = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default();
        let request = pb::UpdateTaskRequest {
            state: MessageField::some(pb::TaskState {
                id: task_id,
                result: result.into(),
                stopped_at: buffa_types::google::protobuf::Timestamp {
                    seconds: i64::try_from(now.as_secs()).unwrap_or(i64::MAX),
                    nanos: i32::try_from(now.subsec_nanos()).unwrap_or(0),
                    ..Default::default()
                }
                .into(),
                ..Default::default()
            }),
            ..Default::default()
        };
        if let Err(e) = self.gitea.update_task(request).await {
            tracing::warn!(task_id, %assignment_id, error = %e, "reporting the end of a queued task to Gitea failed; Gitea ends it at its zombie timeout");
        }
    }
}

/// The assignment ID of a task, for log lines (empty for an impossible task ID).
fn gitea_assignment_id(task_id: i64) -> String {
    AssignmentId::from_task_id(task_id)
        .map(|id| id.to_string())
        .unwrap_or_default()
}
