//! Heartbeats for queued tasks (invariant 5a).
//!
//! A fetched task is Running in Gitea's eyes, and Gitea fails a running task not
//! updated for `ZOMBIE_TASK_TIMEOUT`. While its assignment waits in JetStream, this
//! sends `UpdateTask{state: {id}}` (no result, no steps) for it every interval. The
//! list of queued tasks is the stream itself, read message by message (only the
//! envelope's plain-JSON `id`, no decryption), so it survives controller restarts;
//! work-queue retention removes a message when the claim acks it, which ends our
//! heartbeats and leaves them to the runner.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use buffa::MessageField;
use gdr_core::assignment::envelope_id;
use gdr_proto::runner::v1 as pb;

use super::stats::SchedulerStats;
use crate::gitea::GiteaClient;
use crate::queue::{self, QueueError, StreamSettings};
use crate::shutdown::Shutdown;

/// Sends heartbeats for the assignments waiting in the stream.
pub struct Heartbeater {
    gitea: GiteaClient,
    js: jetstream::Context,
    stream: StreamSettings,
    interval: Duration,
    stats: Arc<SchedulerStats>,
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
    /// Assignments found in the stream.
    pub queued: usize,
    /// Heartbeats Gitea accepted.
    pub sent: usize,
    /// Heartbeats that failed (or messages without a readable ID).
    pub failed: usize,
    /// Queued tasks Gitea reports as ended (task ID, result), e.g. cancelled.
    pub ended: Vec<(i64, pb::TaskResult)>,
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
        }
    }

    /// Counts into `stats` (e.g. shared with the scheduler).
    #[must_use]
    pub fn with_stats(mut self, stats: Arc<SchedulerStats>) -> Self {
        self.stats = stats;
        self
    }

    /// The counters.
    pub fn stats(&self) -> Arc<SchedulerStats> {
        self.stats.clone()
    }

    /// Beats at once, then every interval, until `shutdown`. Failures are logged and
    /// retried next round.
    pub async fn run(&self, shutdown: Shutdown) {
        loop {
            match self.beat_once().await {
                Ok(round) => {
                    tracing::debug!(
                        queued = round.queued,
                        sent = round.sent,
                        failed = round.failed,
                        "heartbeat round"
                    );
                }
                Err(e) => {
                    tracing::warn!(error = %e, retry_in = ?self.interval, "cannot list queued assignments; no heartbeat this round, retrying next round")
                }
            }
            if !shutdown.sleep(self.interval).await {
                return;
            }
        }
    }

    /// One round over the messages in the stream now.
    pub async fn beat_once(&self) -> Result<HeartbeatRound, QueueError> {
        // Opening reads the stream info: the snapshot this round covers.
        let stream = queue::open_stream(&self.js, &self.stream).await?;
        let mut round = HeartbeatRound::default();
        let subjects = format!("{}.>", self.stream.subject_base);
        for message in queue::queued(&stream, &subjects).await? {
            round.queued += 1;
            let task_id = match envelope_id(&message.payload) {
                Some(id) => id.task_id(),
                None => {
                    round.failed += 1;
                    tracing::warn!(
                        sequence = message.sequence,
                        "queued message has no readable assignment ID; no heartbeat"
                    );
                    continue;
                }
            };
            self.beat(task_id, &mut round).await;
        }
        Ok(round)
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
                SchedulerStats::inc(&self.stats.heartbeats_sent);
                let result = answer
                    .state
                    .as_option()
                    .and_then(|s| s.result.as_known())
                    .unwrap_or(pb::TaskResult::RESULT_UNSPECIFIED);
                if result != pb::TaskResult::RESULT_UNSPECIFIED {
                    SchedulerStats::inc(&self.stats.queued_tasks_ended);
                    round.ended.push((task_id, result));
                    tracing::info!(
                        task_id,
                        assignment_id = %gitea_assignment_id(task_id),
                        result = ?result,
                        "queued task ended in Gitea (e.g. cancelled) before a runner claimed it; its runner, once started, learns it from Gitea's first answer and stops"
                    );
                }
            }
            Err(e) => {
                round.failed += 1;
                SchedulerStats::inc(&self.stats.heartbeat_errors);
                tracing::warn!(task_id, assignment_id = %gitea_assignment_id(task_id), error = %e, "heartbeat for a queued task failed; retried next round (Gitea fails the task if none arrives within its zombie timeout)");
            }
        }
    }
}

/// The assignment ID of a task, for log lines (empty for an impossible task ID).
fn gitea_assignment_id(task_id: i64) -> String {
    gdr_core::assignment::AssignmentId::from_task_id(task_id)
        .map(|id| id.to_string())
        .unwrap_or_default()
}
