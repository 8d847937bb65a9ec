//! Prometheus metrics: every metric the controller exports, registered once, and the
//! reference (`gitea-dynamic-runner metrics --format markdown` → `docs/metrics.md`)
//! generated from that same registration, so the documentation cannot drift.
//!
//! The health listener that serves them is [`crate::health`].

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
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

/// Label: one of the controller's NATS connections.
#[derive(Clone, Debug, Default, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ConnectionLabel {
    /// `producer` (the scheduler's) or `worker` (the workers').
    pub connection: String,
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
    /// Admission slots in use.
    pub pool_in_use: Family<BackendLabel, Gauge>,
    /// Admission slots in total.
    pub pool_capacity: Family<BackendLabel, Gauge>,
    /// 1 while this replica leads.
    pub leader: Gauge,
    /// Assignments in JetStream not yet claimed by their runner, by backend.
    pub queue_depth: Family<BackendLabel, Gauge>,
    /// 1 while the NATS connection is up.
    pub nats_connected: Family<ConnectionLabel, Gauge>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A registry under the [`PREFIX`] with the pools', the queue's, the lease's and the
    /// NATS connections' metrics; the components register theirs through
    /// [`Metrics::registrar`].
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
        Metrics {
            registry,
            docs,
            pool_in_use,
            pool_capacity,
            leader,
            queue_depth,
            nats_connected,
        }
    }

    /// Creates every per-backend series of `backend` at zero, so dashboards and alerts see
    /// them (and `increase()` works) before the first event; an enabled backend's series
    /// always exist.
    pub fn init_backend(&self, backend: gdr_core::backend::Backend) {
        let label = BackendLabel::of(backend);
        for family in [&self.pool_in_use, &self.pool_capacity, &self.queue_depth] {
            family.get_or_create_owned(&label);
        }
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
