//! The scheduler's counters: the ones it exports are Prometheus metrics it registers
//! itself ([`SchedulerStats::register`]) and updates where the event happens; the others
//! are plain counters for the status page, the tests and the benchmarks.

use std::sync::atomic::{AtomicU64, Ordering};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;

use crate::metrics::Registrar;
use gdr_gitea::ErrorKind;

/// Label: kind of a Gitea error.
#[derive(Clone, Debug, Default, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorKindLabel {
    /// See `gdr_gitea::ErrorKind`.
    pub kind: String,
}

/// The fetch→stored window is normally a few milliseconds.
const HANDOFF_BUCKETS: [f64; 13] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// Counters shared by the pollers and the heartbeater.
#[derive(Debug)]
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
    pub tasks_fetched: Counter,
    /// Assignments JetStream acknowledged (duplicates included).
    pub tasks_published: AtomicU64,
    /// Longest fetch→stored window seen, in microseconds (the loss window of invariant 4).
    pub handoff_window_micros_max: Gauge,
    /// Sum of fetch→stored windows, in microseconds (divide by `tasks_published`).
    pub handoff_window_micros_total: AtomicU64,
    /// Publish attempts that failed and were retried (or given up).
    pub publish_retries: Counter,
    /// Publishes JetStream answered as duplicates (stored before).
    pub publish_duplicates: AtomicU64,
    /// Fetched tasks whose publish was given up at shutdown (the loss window).
    pub tasks_lost: Counter,
    /// Tasks that could not become assignments and were failed in Gitea.
    pub invalid_tasks_failed: Counter,
    /// Heartbeats Gitea accepted for queued assignments.
    pub heartbeats_sent: Counter,
    /// Heartbeats that failed.
    pub heartbeat_errors: AtomicU64,
    /// Queued assignments whose task Gitea reported as ended (e.g. cancelled).
    pub queued_tasks_ended: AtomicU64,
    /// Failed FetchTask calls by kind.
    fetch_errors: Family<ErrorKindLabel, Counter>,
    /// Every fetch→stored window, in seconds.
    handoff_histogram: Histogram,
}

impl Default for SchedulerStats {
    fn default() -> Self {
        let fetch_errors = Family::<ErrorKindLabel, Counter>::default();
        // Every kind exists from the start, at zero, for dashboards and `increase()`.
        for kind in ERROR_KINDS {
            fetch_errors.get_or_create_owned(&kind_label(kind));
        }
        SchedulerStats {
            fetch_calls: AtomicU64::default(),
            fetch_held: AtomicU64::default(),
            pollers_parked: AtomicU64::default(),
            pollers_waiting_for_backlog: AtomicU64::default(),
            tasks_fetched: Counter::default(),
            tasks_published: AtomicU64::default(),
            handoff_window_micros_max: Gauge::default(),
            handoff_window_micros_total: AtomicU64::default(),
            publish_retries: Counter::default(),
            publish_duplicates: AtomicU64::default(),
            tasks_lost: Counter::default(),
            invalid_tasks_failed: Counter::default(),
            heartbeats_sent: Counter::default(),
            heartbeat_errors: AtomicU64::default(),
            queued_tasks_ended: AtomicU64::default(),
            fetch_errors,
            handoff_histogram: Histogram::new(HANDOFF_BUCKETS),
        }
    }
}

fn kind_label(kind: ErrorKind) -> ErrorKindLabel {
    ErrorKindLabel {
        kind: kind.as_str().into(),
    }
}

pub use crate::vocabulary::ERROR_KINDS;

impl SchedulerStats {
    /// Fresh counters.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers the scheduler's metrics (the same values these counters hold).
    pub fn register(&self, r: &mut Registrar<'_>) {
        r.add(
            "tasks_fetched",
            "Tasks handed out by Gitea's FetchTask",
            &self.tasks_fetched,
        );
        r.add(
            "publish_retries",
            "Assignment publishes retried until JetStream accepted",
            &self.publish_retries,
        );
        r.add(
            "tasks_lost",
            "Tasks fetched from Gitea but not stored in JetStream before a shutdown's publish bound ran out (they stay Running in Gitea until its zombie timeout)",
            &self.tasks_lost,
        );
        r.add(
            "invalid_tasks",
            "Tasks that could not become assignments (bad runs-on, job key, repository or ref) and were failed in Gitea",
            &self.invalid_tasks_failed,
        );
        r.add(
            "handoff_window_seconds",
            "Time between a FetchTask answer and JetStream storing its assignment, in seconds (a controller killed inside it loses the task)",
            &self.handoff_histogram,
        )
        .buckets(&HANDOFF_BUCKETS);
        r.add(
            "handoff_window_max_micros",
            "Longest time between a FetchTask answer and JetStream storing its assignment, in microseconds",
            &self.handoff_window_micros_max,
        );
        r.add(
            "heartbeats",
            "UpdateTask heartbeats sent for queued tasks",
            &self.heartbeats_sent,
        );
        r.family(
            "gitea_errors",
            "Failed FetchTask calls by kind of error",
            &self.fetch_errors,
        )
        .values("kind", &ERROR_KINDS.map(ErrorKind::as_str));
    }

    /// Records one fetch→stored window.
    pub fn handoff(&self, window: std::time::Duration) {
        let micros = u64::try_from(window.as_micros()).unwrap_or(u64::MAX);
        self.handoff_window_micros_max
            .inner()
            .fetch_max(i64::try_from(micros).unwrap_or(i64::MAX), Ordering::Relaxed);
        self.handoff_window_micros_total
            .fetch_add(micros, Ordering::Relaxed);
        self.handoff_histogram.observe(window.as_secs_f64());
    }

    /// Counts a failed FetchTask.
    pub fn fetch_error(&self, kind: ErrorKind) {
        self.fetch_errors.get_or_create(&kind_label(kind)).inc();
    }

    /// Failed FetchTask calls of one kind.
    pub fn fetch_errors(&self, kind: ErrorKind) -> u64 {
        self.fetch_errors.get_or_create(&kind_label(kind)).get()
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
