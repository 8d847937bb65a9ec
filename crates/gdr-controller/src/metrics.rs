//! Prometheus metrics and the `/healthz`, `/readyz`, `/metrics` server.
//!
//! The server takes its listener and a shutdown signal from the caller, so tests bind
//! `127.0.0.1:0` and nothing below `main` picks a port.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::shutdown::Shutdown;

/// Label: backend.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BackendLabel {
    /// `pod` or `vm`.
    pub backend: String,
}

/// Labels: backend and outcome.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    /// `pod` or `vm`.
    pub backend: String,
    /// What happened to the delivery (see `worker::Outcome`).
    pub outcome: String,
}

/// Label: kind of a Gitea error.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorKindLabel {
    /// See `gitea::ErrorKind`.
    pub kind: String,
}

/// Every metric the controller exports.
pub struct Metrics {
    registry: Registry,
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
    /// Lifecycle steps that failed (listing, reporting, marking, deleting) by backend.
    pub lifecycle_errors: Family<BackendLabel, Counter>,
    /// Claimed executors failed because their runner fell silent, by backend.
    pub idle_executors_failed: Family<BackendLabel, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A registry with every metric registered under the `gitea_dynamic_runner` prefix.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("gitea_dynamic_runner");
        let m = Metrics {
            registry: Registry::default(),
            tasks_fetched: Counter::default(),
            publish_retries: Counter::default(),
            assignments: Family::default(),
            pool_in_use: Family::default(),
            pool_capacity: Family::default(),
            heartbeats: Counter::default(),
            gitea_errors: Family::default(),
            leader: Gauge::default(),
            handoff_window_max_micros: Gauge::default(),
            lifecycle_errors: Family::default(),
            idle_executors_failed: Family::default(),
        };
        registry.register(
            "tasks_fetched",
            "Tasks handed out by Gitea's FetchTask",
            m.tasks_fetched.clone(),
        );
        registry.register(
            "publish_retries",
            "Assignment publishes retried until JetStream accepted",
            m.publish_retries.clone(),
        );
        registry.register(
            "assignments",
            "Worker deliveries by backend and outcome",
            m.assignments.clone(),
        );
        registry.register(
            "pool_in_use",
            "Admission slots in use per backend",
            m.pool_in_use.clone(),
        );
        registry.register(
            "pool_capacity",
            "Admission slots per backend",
            m.pool_capacity.clone(),
        );
        registry.register(
            "heartbeats",
            "UpdateTask heartbeats sent for queued tasks",
            m.heartbeats.clone(),
        );
        registry.register(
            "gitea_errors",
            "Failed Gitea calls by kind",
            m.gitea_errors.clone(),
        );
        registry.register(
            "leader",
            "1 while this replica holds the leader lease",
            m.leader.clone(),
        );
        registry.register(
            "handoff_window_max_micros",
            "Longest time between a FetchTask answer and JetStream storing its assignment, in microseconds",
            m.handoff_window_max_micros.clone(),
        );
        registry.register(
            "lifecycle_errors",
            "Lifecycle reconciler steps that failed and will be retried, by backend",
            m.lifecycle_errors.clone(),
        );
        registry.register(
            "idle_executors_failed",
            "Claimed executors failed in Gitea because their runner stopped reporting, by backend",
            m.idle_executors_failed.clone(),
        );
        Metrics { registry, ..m }
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

/// Readiness: ready only while leading and every component is up.
#[derive(Debug, Default)]
pub struct Readiness {
    ready: AtomicBool,
}

impl Readiness {
    /// Sets readiness.
    pub fn set(&self, ready: bool) {
        self.ready.store(ready, Ordering::SeqCst);
    }

    /// Current readiness.
    pub fn get(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
    }
}

struct HealthState<M> {
    metrics: Arc<M>,
    readiness: Arc<Readiness>,
}

impl<M> Clone for HealthState<M> {
    fn clone(&self) -> Self {
        HealthState {
            metrics: self.metrics.clone(),
            readiness: self.readiness.clone(),
        }
    }
}

/// The health and metrics router.
pub fn router<M: Exposition>(metrics: Arc<M>, readiness: Arc<Readiness>) -> axum::Router {
    axum::Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route(
            "/readyz",
            get(|State(s): State<HealthState<M>>| async move {
                if s.readiness.get() {
                    (StatusCode::OK, "ready\n")
                } else {
                    (
                        StatusCode::SERVICE_UNAVAILABLE,
                        "not ready (standby or starting)\n",
                    )
                }
            }),
        )
        .route(
            "/metrics",
            get(|State(s): State<HealthState<M>>| async move {
                (
                    [(
                        header::CONTENT_TYPE,
                        "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    )],
                    s.metrics.encode(),
                )
                    .into_response()
            }),
        )
        .with_state(HealthState { metrics, readiness })
}

/// Serves the health router until `shutdown` resolves.
pub async fn serve<M: Exposition>(
    listener: tokio::net::TcpListener,
    metrics: Arc<M>,
    readiness: Arc<Readiness>,
    shutdown: Shutdown,
) -> std::io::Result<()> {
    axum::serve(listener, router(metrics, readiness))
        .with_graceful_shutdown(async move { shutdown.wait().await })
        .await
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

    #[tokio::test]
    async fn readyz_reports_not_ready_until_told_and_healthz_is_always_ok() {
        let readiness = Arc::new(Readiness::default());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, shutdown) = crate::shutdown::shutdown_channel();
        let server = tokio::spawn(serve(
            listener,
            Arc::new(Metrics::new()),
            readiness.clone(),
            shutdown,
        ));
        let get = |path: &str| reqwest::get(format!("http://{addr}{path}"));
        assert_eq!(get("/healthz").await.unwrap().status(), 200);
        assert_eq!(get("/readyz").await.unwrap().status(), 503);
        readiness.set(true);
        assert_eq!(get("/readyz").await.unwrap().status(), 200);
        let metrics = get("/metrics").await.unwrap();
        assert!(
            metrics.headers()["content-type"]
                .to_str()
                .unwrap()
                .starts_with("application/openmetrics-text")
        );
        stop.trigger();
        server.await.unwrap().unwrap();
    }
}
