//! Plain counters of the scheduler (Prometheus wiring reads them later).

use std::sync::atomic::{AtomicU64, Ordering};

use crate::gitea::ErrorKind;

/// Counters shared by the pollers and the heartbeater.
#[derive(Debug, Default)]
pub struct SchedulerStats {
    /// FetchTask calls sent.
    pub fetch_calls: AtomicU64,
    /// FetchTask calls Gitea held open until the client deadline (long polling), counted
    /// as empty answers, not errors.
    pub fetch_held: AtomicU64,
    /// Pollers parked while another one polls an idle Gitea (a gauge).
    pub pollers_parked: AtomicU64,
    /// Pollers currently waiting for the backlog to drop below its limit (a gauge).
    pub pollers_waiting_for_backlog: AtomicU64,
    /// FetchTask answers that carried a task.
    pub tasks_fetched: AtomicU64,
    /// Assignments JetStream acknowledged (duplicates included).
    pub tasks_published: AtomicU64,
    /// Longest fetch→stored window seen, in microseconds (the loss window of invariant 4).
    pub handoff_window_micros_max: AtomicU64,
    /// Sum of fetch→stored windows, in microseconds (divide by `tasks_published`).
    pub handoff_window_micros_total: AtomicU64,
    /// Publish attempts that failed and were retried (or given up).
    pub publish_retries: AtomicU64,
    /// Publishes JetStream answered as duplicates (stored before).
    pub publish_duplicates: AtomicU64,
    /// Fetched tasks whose publish was given up at shutdown (the loss window).
    pub tasks_lost: AtomicU64,
    /// Tasks that could not become assignments and were failed in Gitea.
    pub invalid_tasks_failed: AtomicU64,
    /// Heartbeats Gitea accepted for queued assignments.
    pub heartbeats_sent: AtomicU64,
    /// Heartbeats that failed.
    pub heartbeat_errors: AtomicU64,
    /// Queued assignments whose task Gitea reported as ended (e.g. cancelled).
    pub queued_tasks_ended: AtomicU64,
    fetch_errors: [AtomicU64; ERROR_KINDS.len()],
    /// Where each fetch→stored window is observed, once the metrics are wired.
    handoff_histogram: std::sync::OnceLock<prometheus_client::metrics::histogram::Histogram>,
}

fn kind_index(kind: ErrorKind) -> usize {
    match kind {
        ErrorKind::Unauthenticated => 0,
        ErrorKind::NotFound => 1,
        ErrorKind::Invalid => 2,
        ErrorKind::Unavailable => 3,
        ErrorKind::Other => 4,
        ErrorKind::TooLarge => 5,
    }
}

pub use crate::vocabulary::ERROR_KINDS;

impl SchedulerStats {
    /// Fresh counters.
    pub fn new() -> Self {
        Self::default()
    }

    /// Observes every later fetch→stored window into `histogram` (set once).
    pub fn observe_handoff_into(
        &self,
        histogram: prometheus_client::metrics::histogram::Histogram,
    ) {
        let _ = self.handoff_histogram.set(histogram);
    }

    /// Records one fetch→stored window.
    pub fn handoff(&self, window: std::time::Duration) {
        let micros = u64::try_from(window.as_micros()).unwrap_or(u64::MAX);
        self.handoff_window_micros_max
            .fetch_max(micros, Ordering::Relaxed);
        self.handoff_window_micros_total
            .fetch_add(micros, Ordering::Relaxed);
        if let Some(h) = self.handoff_histogram.get() {
            h.observe(window.as_secs_f64());
        }
    }

    /// Counts a failed FetchTask.
    pub fn fetch_error(&self, kind: ErrorKind) {
        self.fetch_errors[kind_index(kind)].fetch_add(1, Ordering::Relaxed);
    }

    /// Failed FetchTask calls of one kind.
    pub fn fetch_errors(&self, kind: ErrorKind) -> u64 {
        self.fetch_errors[kind_index(kind)].load(Ordering::Relaxed)
    }

    /// Failed FetchTask calls of any kind.
    pub fn fetch_errors_total(&self) -> u64 {
        ERROR_KINDS.iter().map(|k| self.fetch_errors(*k)).sum()
    }

    pub(crate) fn inc(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn dec(gauge: &AtomicU64) {
        gauge.fetch_sub(1, Ordering::Relaxed);
    }

    /// Reads a counter.
    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}
