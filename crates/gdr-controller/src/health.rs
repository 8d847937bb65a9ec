//! The health listener: `/healthz`, `/readyz`, `/metrics`, the `/status` JSON and the
//! status page at `/`. Everything on it is read-only.
//!
//! The server takes its listener and a shutdown signal from the caller, so tests bind
//! `127.0.0.1:0` and nothing below `main` picks a port. It starts before leadership is
//! known; the runtime hands it the leader's status source once the components run
//! ([`StatusSlot::set`]), and until then (or on a standby) `/status` reports a standby.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;

use crate::metrics::{Exposition, Metrics};
use crate::shutdown::Shutdown;
use crate::status::{StatusReport, StatusSource};

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

/// Where the leader's status source is handed to the already running server.
#[derive(Default)]
pub struct StatusSlot(RwLock<Option<Arc<dyn StatusSource>>>);

impl StatusSlot {
    /// From now on `/status` reports `source`.
    pub fn set(&self, source: Arc<dyn StatusSource>) {
        *self.0.write().unwrap_or_else(|p| p.into_inner()) = Some(source);
    }

    /// From now on `/status` reports a standby (the components stopped).
    pub fn clear(&self) {
        *self.0.write().unwrap_or_else(|p| p.into_inner()) = None;
    }

    fn get(&self) -> Option<Arc<dyn StatusSource>> {
        self.0.read().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// What the health listener serves.
#[derive(Clone)]
pub struct Health {
    /// The metrics registry.
    pub metrics: Arc<Metrics>,
    /// `/readyz`.
    pub readiness: Arc<Readiness>,
    /// `/status` and `/`.
    pub status: Arc<StatusSlot>,
}

impl Health {
    /// Fresh metrics, not ready, no status source yet.
    pub fn new() -> Self {
        Self::with_metrics(Metrics::new())
    }

    /// Serving `metrics` (the wiring's registry, with every component's metrics in it),
    /// not ready, no status source yet.
    pub fn with_metrics(metrics: Metrics) -> Self {
        Health {
            metrics: Arc::new(metrics),
            readiness: Arc::new(Readiness::default()),
            status: Arc::new(StatusSlot::default()),
        }
    }

    async fn report(&self) -> StatusReport {
        let ready = self.readiness.get();
        match self.status.get() {
            Some(source) => {
                let mut report = source.report().await;
                report.ready = ready;
                report
            }
            None => StatusReport::standby(ready),
        }
    }
}

impl Default for Health {
    fn default() -> Self {
        Self::new()
    }
}

/// `/healthz`, `/readyz` and `/metrics` of any registry: what the health listener of every
/// long-running subcommand serves.
pub fn probes<M: Exposition>(metrics: Arc<M>, readiness: Arc<Readiness>) -> axum::Router {
    axum::Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route(
            "/readyz",
            get(|State(r): State<Arc<Readiness>>| async move {
                if r.get() {
                    (StatusCode::OK, "ready\n")
                } else {
                    (
                        StatusCode::SERVICE_UNAVAILABLE,
                        "not ready (standby or starting)\n",
                    )
                }
            })
            .with_state(readiness),
        )
        .route(
            "/metrics",
            get(|State(m): State<Arc<M>>| async move {
                (
                    [(
                        header::CONTENT_TYPE,
                        "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    )],
                    m.encode(),
                )
                    .into_response()
            })
            .with_state(metrics),
        )
}

/// Serves [`probes`] until `shutdown` resolves.
pub async fn serve_probes<M: Exposition>(
    listener: tokio::net::TcpListener,
    metrics: Arc<M>,
    readiness: Arc<Readiness>,
    shutdown: Shutdown,
) -> std::io::Result<()> {
    axum::serve(listener, probes(metrics, readiness))
        .with_graceful_shutdown(async move { shutdown.wait().await })
        .await
}

/// The controller's health router: the probes, `/status` and the status page.
pub fn router(health: Health) -> axum::Router {
    probes(health.metrics.clone(), health.readiness.clone()).merge(
        axum::Router::new()
            .route(
                "/status",
                get(|State(h): State<Health>| async move { axum::Json(h.report().await) }),
            )
            .route(
                "/",
                get(|State(h): State<Health>| async move {
                    axum::response::Html(crate::status::page::render(&h.report().await))
                }),
            )
            .with_state(health),
    )
}

/// Serves the health router until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    health: Health,
    shutdown: Shutdown,
) -> std::io::Result<()> {
    axum::serve(listener, router(health))
        .with_graceful_shutdown(async move { shutdown.wait().await })
        .await
}

#[cfg(test)]
mod tests {
    use async_trait::async_trait;

    use super::*;

    struct OneBackend;

    #[async_trait]
    impl StatusSource for OneBackend {
        async fn report(&self) -> StatusReport {
            let mut report = StatusReport::standby(false);
            report.leader = true;
            report.backends.push(crate::status::BackendStatus {
                backend: "pod".into(),
                capacity: 2,
                in_use: 1,
                starting: 1,
                running: 0,
                finishing: 0,
                queued_jetstream: Some(0),
                unclaimed_jetstream: Some(1),
                queued_gitea: None,
                listed_seconds_ago: Some(0),
                warm: None,
                problems: Vec::new(),
            });
            report
        }
    }

    #[tokio::test]
    async fn readyz_reports_not_ready_until_told_and_healthz_is_always_ok() {
        let health = Health::new();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, shutdown) = crate::shutdown::shutdown_channel();
        let server = tokio::spawn(serve(listener, health.clone(), shutdown));
        let get = |path: &str| reqwest::get(format!("http://{addr}{path}"));
        assert_eq!(get("/healthz").await.unwrap().status(), 200);
        assert_eq!(get("/readyz").await.unwrap().status(), 503);
        health.readiness.set(true);
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

    /// DESIGN invariant 18: a standby runs nothing, and its status says so; the leader's
    /// status is served once the runtime hands its source over.
    #[tokio::test]
    async fn status_reports_a_standby_until_the_leaders_source_is_set() {
        let health = Health::new();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, shutdown) = crate::shutdown::shutdown_channel();
        let server = tokio::spawn(serve(listener, health.clone(), shutdown));
        let status = || async {
            reqwest::get(format!("http://{addr}/status"))
                .await
                .unwrap()
                .json::<StatusReport>()
                .await
                .unwrap()
        };
        let before = status().await;
        assert!(!before.leader && before.backends.is_empty());
        health.status.set(Arc::new(OneBackend));
        health.readiness.set(true);
        let after = status().await;
        assert!(after.leader && after.ready);
        assert_eq!(after.backends[0].capacity, 2);
        let page = reqwest::get(format!("http://{addr}/")).await.unwrap();
        assert!(
            page.headers()["content-type"]
                .to_str()
                .unwrap()
                .starts_with("text/html")
        );
        assert!(
            page.text()
                .await
                .unwrap()
                .contains("<tr data-backend=\"pod\">")
        );
        health.status.clear();
        assert!(!status().await.leader);
        stop.trigger();
        server.await.unwrap().unwrap();
    }
}
