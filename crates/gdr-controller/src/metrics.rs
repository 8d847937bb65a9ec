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

/// What a component registers its metrics through: a registry (a sub-registry of the
/// controller's, under a prefix of its own where it has one) that documents each metric as
/// it goes, so the reference is generated from the registration itself.
pub struct Registrar<'a> {
    registry: &'a mut Registry,
    docs: &'a mut Vec<MetricDoc>,
    /// The full prefix of the names registered here (`PREFIX`, then the sub-registries').
    prefix: String,
}

impl Registrar<'_> {
    /// A registrar for the metrics named `<prefix>_…` here (a component's own namespace).
    pub fn sub(&mut self, prefix: &str) -> Registrar<'_> {
        Registrar {
            registry: self.registry.sub_registry_with_prefix(prefix),
            docs: &mut *self.docs,
            prefix: format!("{}_{prefix}", self.prefix),
        }
    }

    /// Registers `metric` (a clone shares its value) and documents it.
    pub fn add<M: Metric + Clone>(&mut self, name: &str, help: &str, metric: &M) -> &mut MetricDoc {
        self.registry.register(name, help, metric.clone());
        let full = format!("{}_{name}", self.prefix);
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
    pub fn family<L, M, C>(
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
    /// Documents the fixed set of values `label` takes.
    pub fn values(&mut self, label: &str, values: &[&str]) -> &mut Self {
        self.label_values.push((
            label.to_owned(),
            values.iter().map(|v| (*v).to_owned()).collect(),
        ));
        self
    }

    /// Documents a histogram's bucket bounds.
    pub fn buckets(&mut self, bounds: &[f64]) -> &mut Self {
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
    /// Worker deliveries by outcome.
    pub assignments: Family<OutcomeLabels, Counter>,
    /// Admission slots in use.
    pub pool_in_use: Family<BackendLabel, Gauge>,
    /// Admission slots in total.
    pub pool_capacity: Family<BackendLabel, Gauge>,
    /// 1 while this replica leads.
    pub leader: Gauge,
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
    /// Executors by backend and phase, as the last lifecycle pass listed them.
    pub executors: Family<PhaseLabels, Gauge>,
    /// Assignments in JetStream not yet claimed by their runner, by backend.
    pub queue_depth: Family<BackendLabel, Gauge>,
    /// 1 while the NATS connection is up.
    pub nats_connected: Family<ConnectionLabel, Gauge>,
    /// Assignments held because they are sealed with a task key this controller lacks.
    pub held_assignments: Family<BackendLabel, Gauge>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A registry under the [`PREFIX`] with the jobs', pools' and connections' metrics;
    /// the scheduler and the facade register theirs through [`Metrics::registrar`].
    // TODO(issue 36 step 2): the workers' and the lifecycle's metrics move to their modules.
    #[allow(clippy::too_many_lines)]
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix(PREFIX);
        let mut docs = Vec::new();
        let mut b = Registrar {
            registry: &mut registry,
            docs: &mut docs,
            prefix: PREFIX.to_owned(),
        };
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
        Metrics {
            registry,
            docs,
            assignments,
            pool_in_use,
            pool_capacity,
            leader,
            lifecycle_errors,
            idle_executors_failed,
            queue_wait,
            start_latency,
            run_time,
            jobs_completed,
            jobs_failed,
            executors,
            queue_depth,
            nats_connected,
            held_assignments,
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

    /// Where a component registers its own metrics (before the registry is shared).
    pub fn registrar(&mut self) -> Registrar<'_> {
        Registrar {
            registry: &mut self.registry,
            docs: &mut self.docs,
            prefix: PREFIX.to_owned(),
        }
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

/// The reference of every metric `metrics` holds (the wiring's complete registry,
/// `runtime::metrics`), generated from its registration.
pub fn reference(metrics: &Metrics, format: ReferenceFormat) -> String {
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
