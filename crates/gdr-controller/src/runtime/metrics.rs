//! The controller's one metrics registry, composed: the pools', the queue's, the lease's
//! and the NATS connections' metrics of `crate::metrics::Metrics`, and the ones each
//! component registers itself (the scheduler's, the facade's, the jobs'). The reference
//! (`gitea-dynamic-runner metrics`, docs/metrics.md) is generated from this same
//! composition.

use crate::job_metrics::JobMetrics;
use crate::metrics::{Metrics, ReferenceFormat};
use crate::scheduler::SchedulerStats;
use gdr_facade::tls::FacadeStats;

/// The registry `/metrics` serves, with the metrics of the components in it.
pub fn registry(scheduler: &SchedulerStats, facade: &FacadeStats, jobs: &JobMetrics) -> Metrics {
    let mut metrics = Metrics::new();
    jobs.register(&mut metrics.registrar());
    scheduler.register(&mut metrics.registrar());
    crate::facade::register_stats(facade, &mut metrics.registrar());
    metrics
}

/// A registry with fresh components, as the reference and the tests read it.
fn fresh() -> (Metrics, SchedulerStats, JobMetrics) {
    let (stats, jobs) = (SchedulerStats::new(), JobMetrics::default());
    let metrics = registry(&stats, &FacadeStats::default(), &jobs);
    (metrics, stats, jobs)
}

/// The reference of every metric the controller exports.
pub fn reference(format: ReferenceFormat) -> String {
    crate::metrics::reference(&fresh().0, format)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job_metrics::OutcomeLabels;
    use crate::metrics::{BackendLabel, ConnectionLabel};

    #[test]
    fn metrics_render_with_their_names_and_labels() {
        let (m, stats, jobs) = fresh();
        stats.tasks_fetched.inc();
        jobs.assignments
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
        let (m, _, jobs) = fresh();
        m.init_backend(gdr_core::backend::Backend::Pod);
        jobs.init_backend(gdr_core::backend::Backend::Pod);
        jobs.assignments
            .get_or_create_owned(&OutcomeLabels::default());
        // The warm families have series only once a pool's pass has counted its members.
        jobs.record_warm(
            gdr_core::backend::Backend::Pod,
            Some(&[((String::new(), "ready"), 1)].into()),
            &[("outdated", 1)].into(),
            &[("claimed", 1)].into(),
        );
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
                .is_some_and(|a| { a.len() == fresh().0.docs().len() })
        );
    }
}
