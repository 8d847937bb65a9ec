//! Prometheus metrics: every metric the controller exports, registered once, and the
//! reference (`gitea-dynamic-runner metrics --format markdown` → `docs/metrics.md`)
//! generated from that same registration, so the documentation cannot drift.
//!
//! The health listener that serves them is [`crate::health`].

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Metric, Registry};
use std::fmt::Write as _;

/// Every metric name starts with this.
pub const PREFIX: &str = "gitea_dynamic_runner";

/// Label: backend.
#[derive(Clone, Debug, Default, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BackendLabel {
    /// `pod` or `vm`.
    pub backend: String,
}

impl BackendLabel {
    /// The label of `backend`.
    pub fn of(backend: gdr_core::backend::Backend) -> Self {
        BackendLabel {
            backend: backend.as_str().into(),
        }
    }
}

/// Labels: backend and outcome.
#[derive(Clone, Debug, Default, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    /// `pod` or `vm`.
    pub backend: String,
    /// What happened to the delivery (see `worker::Outcome`).
    pub outcome: String,
}

/// Labels: backend and the result the job's runner reported.
#[derive(Clone, Debug, Default, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    /// `pod` or `vm`.
    pub backend: String,
    /// `success`, `failure`, `cancelled` or `skipped`.
    pub result: String,
}

/// Labels: backend and why the controller failed a job.
#[derive(Clone, Debug, Default, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    /// `pod` or `vm`.
    pub backend: String,
    /// A [`FailureReason`].
    pub reason: String,
}

/// Labels: backend and the phase of an executor.
#[derive(Clone, Debug, Default, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PhaseLabels {
    /// `pod` or `vm`.
    pub backend: String,
    /// A [`crate::status::Phase`].
    pub phase: String,
}

/// Label: kind of a Gitea error.
#[derive(Clone, Debug, Default, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorKindLabel {
    /// See `gitea::ErrorKind`.
    pub kind: String,
}

/// Label: one of the controller's NATS connections.
#[derive(Clone, Debug, Default, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ConnectionLabel {
    /// `producer` (the scheduler's) or `worker` (the workers').
    pub connection: String,
}

/// Why the controller itself failed a job in Gitea (the runner never reported a result).
/// Low-cardinality label values; the log line of each failure carries the full reason.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailureReason {
    /// The backend refused to create the job's environment for good.
    BackendRefused,
    /// The job's workload identity cannot be bound.
    IdentityRefused,
    /// The executor did not start the job within `executor_start_deadline`.
    StartDeadline,
    /// The executor ended before its runner fetched the task.
    EndedBeforeClaim,
    /// The executor disappeared before its runner fetched the task.
    Disappeared,
    /// The executor ended after the claim without its runner reporting a result.
    EndedWithoutResult,
    /// The runner stopped reporting for `executor_idle_timeout` while its environment stayed up.
    RunnerSilent,
}

impl FailureReason {
    /// Every reason, in the order the reference lists them.
    pub const ALL: [FailureReason; 7] = [
        FailureReason::BackendRefused,
        FailureReason::IdentityRefused,
        FailureReason::StartDeadline,
        FailureReason::EndedBeforeClaim,
        FailureReason::Disappeared,
        FailureReason::EndedWithoutResult,
        FailureReason::RunnerSilent,
    ];

    /// The label value.
    pub const fn as_str(self) -> &'static str {
        match self {
            FailureReason::BackendRefused => "backend_refused",
            FailureReason::IdentityRefused => "identity_refused",
            FailureReason::StartDeadline => "start_deadline",
            FailureReason::EndedBeforeClaim => "ended_before_claim",
            FailureReason::Disappeared => "disappeared",
            FailureReason::EndedWithoutResult => "ended_without_result",
            FailureReason::RunnerSilent => "runner_silent",
        }
    }
}

/// The results a runner reports, as label values.
pub const RESULTS: [&str; 4] = ["success", "failure", "cancelled", "skipped"];

/// The label value of a runner's terminal result.
pub fn result_label(result: gdr_proto::runner::v1::TaskResult) -> &'static str {
    use gdr_proto::runner::v1::TaskResult;
    match result {
        TaskResult::RESULT_SUCCESS => "success",
        TaskResult::RESULT_FAILURE => "failure",
        TaskResult::RESULT_CANCELLED => "cancelled",
        TaskResult::RESULT_SKIPPED => "skipped",
        TaskResult::RESULT_UNSPECIFIED => "unspecified",
    }
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

/// Queue wait: a job waits for a free slot or a backend that has room (seconds … an hour).
const QUEUE_WAIT_BUCKETS: [f64; 14] = [
    0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0,
];
/// Start latency: a process starts in a second, a Pod pulls an image, a VM boots.
const START_LATENCY_BUCKETS: [f64; 12] = [
    0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0,
];
/// Run time: up to Gitea's endless-task timeout of 3 h.
const RUN_TIME_BUCKETS: [f64; 13] = [
    1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0, 7200.0, 10800.0,
];
/// The fetch→stored window is normally a few milliseconds.
const HANDOFF_BUCKETS: [f64; 13] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

fn queue_wait_histogram() -> Histogram {
    Histogram::new(QUEUE_WAIT_BUCKETS)
}

fn start_latency_histogram() -> Histogram {
    Histogram::new(START_LATENCY_BUCKETS)
}

fn run_time_histogram() -> Histogram {
    Histogram::new(RUN_TIME_BUCKETS)
}

/// One exported metric as the reference documents it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct MetricDoc {
    /// The family name (prefix included, without `_total`/`_bucket` suffixes).
    pub name: String,
    /// `counter`, `gauge` or `histogram`.
    pub kind: &'static str,
    /// The sample names Prometheus scrapes.
    pub samples: Vec<String>,
    /// Label names, in the order they are encoded.
    pub labels: Vec<String>,
    /// The values a label takes, where the set is fixed.
    pub label_values: Vec<(String, Vec<String>)>,
    /// Upper bounds of a histogram's buckets.
    pub buckets: Vec<f64>,
    /// What it measures (the `# HELP` text).
    pub help: String,
}

/// Registers metrics and documents each one as it goes.
struct Builder {
    registry: Registry,
    docs: Vec<MetricDoc>,
}

impl Builder {
    fn add<M: Metric + Clone>(&mut self, name: &str, help: &str, metric: &M) -> &mut MetricDoc {
        self.registry.register(name, help, metric.clone());
        let full = format!("{PREFIX}_{name}");
        let (kind, samples) = match metric.metric_type() {
            MetricType::Counter => ("counter", vec![format!("{full}_total")]),
            MetricType::Histogram => (
                "histogram",
                ["bucket", "sum", "count"]
                    .iter()
                    .map(|s| format!("{full}_{s}"))
                    .collect(),
            ),
            MetricType::Gauge => ("gauge", vec![full.clone()]),
            _ => ("unknown", vec![full.clone()]),
        };
        self.docs.push(MetricDoc {
            name: full,
            kind,
            samples,
            labels: Vec::new(),
            label_values: Vec::new(),
            buckets: Vec::new(),
            help: help.to_owned(),
        });
        let last = self.docs.len() - 1;
        &mut self.docs[last]
    }

    /// Registers a labelled family; its label names come from the label type itself.
    fn family<L, M, C>(
        &mut self,
        name: &str,
        help: &str,
        family: &Family<L, M, C>,
    ) -> &mut MetricDoc
    where
        L: EncodeLabelSet
            + Default
            + Clone
            + std::hash::Hash
            + Eq
            + std::fmt::Debug
            + Send
            + Sync
            + 'static,
        Family<L, M, C>: Metric + Clone,
    {
        let labels = label_names::<L>();
        let doc = self.add(name, help, family);
        doc.labels = labels;
        doc
    }
}

impl MetricDoc {
    fn values(&mut self, label: &str, values: &[&str]) -> &mut Self {
        self.label_values.push((
            label.to_owned(),
            values.iter().map(|v| (*v).to_owned()).collect(),
        ));
        self
    }

    fn buckets(&mut self, bounds: &[f64]) -> &mut Self {
        self.buckets = bounds.to_vec();
        self
    }
}

/// The label names of `L`, in encoding order (read from an encoded sample).
fn label_names<L>() -> Vec<String>
where
    L: EncodeLabelSet
        + Default
        + Clone
        + std::hash::Hash
        + Eq
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
{
    let family = Family::<L, Gauge>::default();
    family.get_or_create_owned(&L::default());
    let mut registry = Registry::default();
    registry.register("probe", "", family);
    let mut text = String::new();
    let _ = prometheus_client::encoding::text::encode(&mut text, &registry);
    text.lines()
        .find_map(|l| l.strip_prefix("probe{"))
        .and_then(|l| l.split('}').next())
        .map(|inside| {
            inside
                .split(',')
                .filter_map(|pair| pair.split('=').next())
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default()
}

/// Every metric the controller exports.
pub struct Metrics {
    registry: Registry,
    docs: Vec<MetricDoc>,
    /// Tasks returned by FetchTask.
    pub tasks_fetched: Counter,
    /// Publish attempts that had to be retried.
    pub publish_retries: Counter,
    /// Worker deliveries by outcome.
    pub assignments: Family<OutcomeLabels, Counter>,
    /// Admission slots in use.
    pub pool_in_use: Family<BackendLabel, Gauge>,
    /// Admission slots in total.
    pub pool_capacity: Family<BackendLabel, Gauge>,
    /// Heartbeats sent for queued tasks.
    pub heartbeats: Counter,
    /// Failed Gitea calls by kind.
    pub gitea_errors: Family<ErrorKindLabel, Counter>,
    /// 1 while this replica leads.
    pub leader: Gauge,
    /// Longest fetch→stored window seen (µs): a kill inside it loses the task.
    pub handoff_window_max_micros: Gauge,
    /// The fetch→stored window of every stored task, in seconds.
    pub handoff_window: Histogram,
    /// Lifecycle steps that failed (listing, reporting, marking, deleting) by backend.
    pub lifecycle_errors: Family<BackendLabel, Counter>,
    /// Claimed executors failed because their runner fell silent, by backend.
    pub idle_executors_failed: Family<BackendLabel, Counter>,
    /// Fetched → admitted, by backend.
    pub queue_wait: HistogramFamily<BackendLabel>,
    /// Admitted (executor created) → claimed by its runner, by backend.
    pub start_latency: HistogramFamily<BackendLabel>,
    /// Claimed → terminal result accepted by Gitea, by backend.
    pub run_time: HistogramFamily<BackendLabel>,
    /// Terminal results the runners reported, by backend and result.
    pub jobs_completed: Family<ResultLabels, Counter>,
    /// Jobs the controller failed in Gitea, by backend and reason.
    pub jobs_failed: Family<ReasonLabels, Counter>,
    /// Tasks that could not become assignments and were failed in Gitea.
    pub invalid_tasks: Counter,
    /// Tasks fetched but not stored before a shutdown bound ran out.
    pub tasks_lost: Counter,
    /// Executors by backend and phase, as the last lifecycle pass listed them.
    pub executors: Family<PhaseLabels, Gauge>,
    /// Assignments in JetStream not yet claimed by their runner, by backend.
    pub queue_depth: Family<BackendLabel, Gauge>,
    /// 1 while the NATS connection is up.
    pub nats_connected: Family<ConnectionLabel, Gauge>,
    /// Assignments held because they are sealed with a task key this controller lacks.
    pub held_assignments: Family<BackendLabel, Gauge>,
    /// Facade connections open now.
    pub facade_connections: Gauge,
    /// Facade connections closed early, by why: `limit` (refused at a connection limit),
    /// `evicted` (in their handshake, to make room), `handshake` (failed or timed out),
    /// `identity_limit` (a SPIFFE ID at its limit), `idle`.
    pub facade_connections_closed: Family<CloseReasonLabel, Counter>,
    /// Failed `accept` calls of the facade (e.g. no file descriptors).
    pub facade_accept_errors: Counter,
}

/// Why the facade closed a connection early: the values of [`CloseReasonLabel`].
pub const FACADE_CLOSE_REASONS: [&str; 5] =
    ["limit", "evicted", "handshake", "identity_limit", "idle"];

/// Label: why the facade closed a connection early.
#[derive(Clone, Debug, Default, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CloseReasonLabel {
    /// The reason.
    pub reason: String,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A registry with every metric registered under the [`PREFIX`].
    // TODO(issue 36 step 2): split; each component registers its own metrics.
    #[allow(clippy::too_many_lines)]
    pub fn new() -> Self {
        let mut b = Builder {
            registry: Registry::with_prefix(PREFIX),
            docs: Vec::new(),
        };
        let tasks_fetched = Counter::default();
        b.add(
            "tasks_fetched",
            "Tasks handed out by Gitea's FetchTask",
            &tasks_fetched,
        );
        let publish_retries = Counter::default();
        b.add(
            "publish_retries",
            "Assignment publishes retried until JetStream accepted",
            &publish_retries,
        );
        let tasks_lost = Counter::default();
        b.add(
            "tasks_lost",
            "Tasks fetched from Gitea but not stored in JetStream before a shutdown's publish bound ran out (they stay Running in Gitea until its zombie timeout)",
            &tasks_lost,
        );
        let invalid_tasks = Counter::default();
        b.add(
            "invalid_tasks",
            "Tasks that could not become assignments (bad runs-on, job key, repository or ref) and were failed in Gitea",
            &invalid_tasks,
        );
        let handoff_window = Histogram::new(HANDOFF_BUCKETS);
        b.add(
            "handoff_window_seconds",
            "Time between a FetchTask answer and JetStream storing its assignment, in seconds (a controller killed inside it loses the task)",
            &handoff_window,
        )
        .buckets(&HANDOFF_BUCKETS);
        let handoff_window_max_micros = Gauge::default();
        b.add(
            "handoff_window_max_micros",
            "Longest time between a FetchTask answer and JetStream storing its assignment, in microseconds",
            &handoff_window_max_micros,
        );
        let heartbeats = Counter::default();
        b.add(
            "heartbeats",
            "UpdateTask heartbeats sent for queued tasks",
            &heartbeats,
        );
        let gitea_errors = Family::<ErrorKindLabel, Counter>::default();
        b.family(
            "gitea_errors",
            "Failed FetchTask calls by kind of error",
            &gitea_errors,
        )
        .values(
            "kind",
            &crate::vocabulary::ERROR_KINDS.map(crate::gitea::ErrorKind::as_str),
        );
        let queue_depth = Family::<BackendLabel, Gauge>::default();
        b.family(
            "queue_depth",
            "Assignments in JetStream whose runner has not claimed them yet (queued or starting), by backend",
            &queue_depth,
        );
        let assignments = Family::<OutcomeLabels, Counter>::default();
        b.family(
            "assignments",
            "Worker deliveries by backend and outcome",
            &assignments,
        )
        .values(
            "outcome",
            &crate::vocabulary::Outcome::ALL.map(|o| o.as_str()),
        );
        let pool_in_use = Family::<BackendLabel, Gauge>::default();
        b.family(
            "pool_in_use",
            "Admission slots in use per backend",
            &pool_in_use,
        );
        let pool_capacity = Family::<BackendLabel, Gauge>::default();
        b.family(
            "pool_capacity",
            "Admission slots per backend",
            &pool_capacity,
        );
        let executors = Family::<PhaseLabels, Gauge>::default();
        b.family(
            "executors",
            "Executors by backend and phase, as the last lifecycle pass listed them",
            &executors,
        )
        .values("phase", &crate::vocabulary::Phase::ALL.map(|p| p.as_str()));
        let queue_wait: HistogramFamily<BackendLabel> =
            Family::new_with_constructor(queue_wait_histogram);
        b.family(
            "queue_wait_seconds",
            "Time from the task's arrival in JetStream to its admission into the backend's pool, in seconds",
            &queue_wait,
        )
        .buckets(&QUEUE_WAIT_BUCKETS);
        let start_latency: HistogramFamily<BackendLabel> =
            Family::new_with_constructor(start_latency_histogram);
        b.family(
            "start_latency_seconds",
            "Time from the executor's creation to its runner claiming the task, in seconds",
            &start_latency,
        )
        .buckets(&START_LATENCY_BUCKETS);
        let run_time: HistogramFamily<BackendLabel> =
            Family::new_with_constructor(run_time_histogram);
        b.family(
            "run_time_seconds",
            "Time from the claim to Gitea accepting the runner's result, in seconds",
            &run_time,
        )
        .buckets(&RUN_TIME_BUCKETS);
        let jobs_completed = Family::<ResultLabels, Counter>::default();
        b.family(
            "jobs_completed",
            "Jobs that ended with a result their runner reported, once per job, by backend and the result Gitea kept (a cancel in Gitea outlasts a runner's success)",
            &jobs_completed,
        )
        .values("result", &RESULTS);
        let jobs_failed = Family::<ReasonLabels, Counter>::default();
        b.family(
            "jobs_failed",
            "Jobs the controller failed in Gitea because their runner could not report a result, by backend and reason",
            &jobs_failed,
        )
        .values("reason", &FailureReason::ALL.map(FailureReason::as_str));
        let lifecycle_errors = Family::<BackendLabel, Counter>::default();
        b.family(
            "lifecycle_errors",
            "Lifecycle reconciler steps that failed and will be retried, by backend",
            &lifecycle_errors,
        );
        let idle_executors_failed = Family::<BackendLabel, Counter>::default();
        b.family(
            "idle_executors_failed",
            "Claimed executors failed in Gitea because their runner stopped reporting, by backend",
            &idle_executors_failed,
        );
        let leader = Gauge::default();
        b.add(
            "leader",
            "1 while this replica holds the leader lease (always 1 without leader election)",
            &leader,
        );
        let nats_connected = Family::<ConnectionLabel, Gauge>::default();
        b.family(
            "nats_connected",
            "1 while the NATS connection is up, by connection",
            &nats_connected,
        )
        .values("connection", &["producer", "worker"]);
        let held_assignments = Family::<BackendLabel, Gauge>::default();
        b.family(
            "held_assignments",
            "Assignments set aside because they are sealed with a task key this controller lacks, by backend",
            &held_assignments,
        );
        let facade_connections = Gauge::default();
        b.add(
            "facade_connections",
            "Connections the facade holds open",
            &facade_connections,
        );
        let facade_connections_closed = Family::<CloseReasonLabel, Counter>::default();
        b.family(
            "facade_connections_closed",
            "Facade connections refused or closed early, by reason (limit, evicted, handshake, identity_limit, idle)",
            &facade_connections_closed,
        )
        .values("reason", &FACADE_CLOSE_REASONS);
        for reason in FACADE_CLOSE_REASONS {
            facade_connections_closed.get_or_create_owned(&CloseReasonLabel {
                reason: reason.into(),
            });
        }
        let facade_accept_errors = Counter::default();
        b.add(
            "facade_accept_errors",
            "Failed accept calls of the facade (for example, no file descriptors left)",
            &facade_accept_errors,
        );
        Metrics {
            registry: b.registry,
            docs: b.docs,
            tasks_fetched,
            publish_retries,
            assignments,
            pool_in_use,
            pool_capacity,
            heartbeats,
            gitea_errors,
            leader,
            handoff_window_max_micros,
            handoff_window,
            lifecycle_errors,
            idle_executors_failed,
            queue_wait,
            start_latency,
            run_time,
            jobs_completed,
            jobs_failed,
            invalid_tasks,
            tasks_lost,
            executors,
            queue_depth,
            nats_connected,
            held_assignments,
            facade_connections,
            facade_connections_closed,
            facade_accept_errors,
        }
    }

    /// Creates every per-backend series of `backend` at zero, so dashboards and alerts see
    /// them (and `increase()` works) before the first event; an enabled backend's series
    /// always exist.
    pub fn init_backend(&self, backend: gdr_core::backend::Backend) {
        let label = BackendLabel::of(backend);
        let name = label.backend.clone();
        for family in [
            &self.pool_in_use,
            &self.pool_capacity,
            &self.queue_depth,
            &self.held_assignments,
        ] {
            family.get_or_create_owned(&label);
        }
        for family in [&self.lifecycle_errors, &self.idle_executors_failed] {
            family.get_or_create_owned(&label);
        }
        for family in [&self.queue_wait, &self.start_latency, &self.run_time] {
            family.get_or_create_owned(&label);
        }
        for result in RESULTS {
            self.jobs_completed.get_or_create_owned(&ResultLabels {
                backend: name.clone(),
                result: result.into(),
            });
        }
        for reason in FailureReason::ALL {
            self.jobs_failed.get_or_create_owned(&ReasonLabels {
                backend: name.clone(),
                reason: reason.as_str().into(),
            });
        }
        for phase in crate::vocabulary::Phase::ALL {
            self.executors.get_or_create_owned(&PhaseLabels {
                backend: name.clone(),
                phase: phase.as_str().into(),
            });
        }
    }

    /// Counts a job the controller failed in Gitea.
    pub fn job_failed(&self, backend: gdr_core::backend::Backend, reason: FailureReason) {
        self.jobs_failed
            .get_or_create(&ReasonLabels {
                backend: backend.as_str().into(),
                reason: reason.as_str().into(),
            })
            .inc();
    }

    /// What [`Metrics::encode`] exports, documented.
    pub fn docs(&self) -> &[MetricDoc] {
        &self.docs
    }

    /// OpenMetrics text.
    pub fn encode(&self) -> String {
        Exposition::encode(&self.registry)
    }
}

/// What `/metrics` serves: the controller's [`Metrics`], or a plain [`Registry`] (the
/// `sandbox-identity` subcommand's).
pub trait Exposition: Send + Sync + 'static {
    /// OpenMetrics text.
    fn encode(&self) -> String;
}

impl Exposition for Metrics {
    fn encode(&self) -> String {
        Metrics::encode(self)
    }
}

impl Exposition for Registry {
    fn encode(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, self).is_err() {
            out.clear();
        }
        out
    }
}

/// A format of the metrics reference.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ReferenceFormat {
    /// Plain text.
    Text,
    /// Markdown (`docs/metrics.md`).
    Markdown,
    /// JSON, one object per metric.
    Json,
}

/// The reference of every metric, generated from the registry [`Metrics::new`] builds.
pub fn reference(format: ReferenceFormat) -> String {
    let metrics = Metrics::new();
    let docs = metrics.docs();
    match format {
        ReferenceFormat::Json => {
            let mut out = serde_json::to_string_pretty(docs).unwrap_or_default();
            out.push('\n');
            out
        }
        ReferenceFormat::Text => {
            let mut out = String::new();
            for d in docs {
                let _ = writeln!(out, "{} ({})", d.name, d.kind);
                let _ = writeln!(out, "    {}", d.help);
                if !d.labels.is_empty() {
                    let _ = writeln!(out, "    labels: {}", d.labels.join(", "));
                }
                for (label, values) in &d.label_values {
                    let _ = writeln!(out, "    {label}: {}", values.join(", "));
                }
            }
            out
        }
        ReferenceFormat::Markdown => markdown(docs),
    }
}

fn markdown(docs: &[MetricDoc]) -> String {
    let mut out = String::from(
        "# Metrics reference\n\n\
         <!-- Generated by `gitea-dynamic-runner metrics --format markdown`; do not edit by \
         hand (tests/cli.rs fails when it differs). -->\n\n\
         The health listener (`health_listen`, default `127.0.0.1:9090`) serves these at \
         `/metrics` in the OpenMetrics text format, next to `/healthz`, `/readyz`, the \
         `/status` JSON and the status page at `/`. Per-backend series exist for every \
         enabled backend from the start, at zero. A standby replica exports `leader 0` and \
         no per-backend series.\n\n\
         | metric | type | labels | meaning |\n|---|---|---|---|\n",
    );
    for d in docs {
        let labels = if d.labels.is_empty() {
            "–".to_owned()
        } else {
            d.labels
                .iter()
                .map(|l| format!("`{l}`"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let mut meaning = d.help.replace('|', "\\|");
        for (label, values) in &d.label_values {
            let _ = write!(
                meaning,
                "; `{label}`: {}",
                values
                    .iter()
                    .map(|v| format!("`{v}`"))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        if !d.buckets.is_empty() {
            let bounds: Vec<String> = d.buckets.iter().map(|b| format!("{b}")).collect();
            let _ = write!(meaning, "; buckets (s): {}", bounds.join(", "));
        }
        let samples = d
            .samples
            .iter()
            .map(|s| format!("`{s}`"))
            .collect::<Vec<_>>()
            .join("<br>");
        let _ = writeln!(out, "| {samples} | {} | {labels} | {meaning} |", d.kind);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_render_with_their_names_and_labels() {
        let m = Metrics::new();
        m.tasks_fetched.inc();
        m.assignments
            .get_or_create(&OutcomeLabels {
                backend: "pod".into(),
                outcome: "claimed".into(),
            })
            .inc();
        m.pool_capacity
            .get_or_create(&BackendLabel {
                backend: "vm".into(),
            })
            .set(1);
        let text = m.encode();
        assert!(
            text.contains("gitea_dynamic_runner_tasks_fetched_total 1"),
            "{text}"
        );
        assert!(
            text.contains(
                "gitea_dynamic_runner_assignments_total{backend=\"pod\",outcome=\"claimed\"} 1"
            ),
            "{text}"
        );
        assert!(
            text.contains("gitea_dynamic_runner_pool_capacity{backend=\"vm\"} 1"),
            "{text}"
        );
        assert!(text.ends_with("# EOF\n"));
    }

    /// DESIGN invariant 24: the reference documents exactly what `/metrics` exports, with
    /// the label names the encoder writes.
    #[test]
    fn every_documented_sample_and_label_is_what_the_registry_encodes() {
        let m = Metrics::new();
        m.init_backend(gdr_core::backend::Backend::Pod);
        m.gitea_errors
            .get_or_create_owned(&ErrorKindLabel::default());
        m.assignments.get_or_create_owned(&OutcomeLabels::default());
        m.nats_connected
            .get_or_create_owned(&ConnectionLabel::default());
        let text = m.encode();
        let documented: std::collections::BTreeSet<&str> = m
            .docs()
            .iter()
            .flat_map(|d| d.samples.iter().map(String::as_str))
            .collect();
        for d in m.docs() {
            for sample in &d.samples {
                let line = text
                    .lines()
                    .find(|l| {
                        l.starts_with(&format!("{sample}{{"))
                            || l.starts_with(&format!("{sample} "))
                    })
                    .unwrap_or_else(|| panic!("{sample} is documented but not exported:\n{text}"));
                for label in &d.labels {
                    assert!(
                        line.contains(&format!("{label}=\"")),
                        "{sample} lacks its documented label {label}: {line}"
                    );
                }
            }
        }
        for d in m.docs().iter().filter(|d| d.kind == "histogram") {
            let bucket = format!("{}_bucket{{", d.name);
            let encoded: Vec<f64> = text
                .lines()
                .filter(|l| l.starts_with(&bucket))
                .filter_map(|l| l.split("le=\"").nth(1)?.split('"').next()?.parse().ok())
                .filter(|b: &f64| b.is_finite())
                .collect();
            assert_eq!(encoded, d.buckets, "{} buckets", d.name);
        }
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let name = line.split(['{', ' ']).next().unwrap_or_default();
            assert!(
                documented.contains(name),
                "{name} is exported but not documented"
            );
        }
    }

    #[test]
    fn the_markdown_reference_lists_histograms_with_their_buckets_and_label_values() {
        let md = reference(ReferenceFormat::Markdown);
        assert!(
            md.contains("`gitea_dynamic_runner_start_latency_seconds_bucket`"),
            "{md}"
        );
        assert!(md.contains("buckets (s): 0.25, 0.5, 1,"), "{md}");
        assert!(md.contains("`runner_silent`"), "{md}");
        let json: serde_json::Value =
            serde_json::from_str(&reference(ReferenceFormat::Json)).expect("json");
        assert!(
            json.as_array()
                .is_some_and(|a| a.len() == Metrics::new().docs().len())
        );
    }
}
