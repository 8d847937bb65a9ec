//! Wiring of the `sandbox-identity` subcommand: settings → kube client of the sandbox
//! cluster → leadership → the reconciler of `gdr-sandbox-identity`, with the controller's
//! health server, leader election and stop signal.
//!
//! It holds a kube client and nothing else: no OpenSandbox key, no Gitea token, no
//! secret-store credential. Only the leader reconciles; it reports ready once its first
//! pass completed (the entries then reflect the cluster), a standby reports not-ready. A
//! lost lease stops the reconciler and is an error, so the process exits non-zero.

use std::sync::Arc;
use std::time::Duration;

use gdr_sandbox_identity::{Metrics, Reconciler};
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::{ElectorTask, RuntimeError, campaign, setup};
use crate::backoff::Backoff;
use crate::health::Readiness;
use crate::settings::SandboxIdentitySettings;
use crate::shutdown::{Shutdown, shutdown_channel};

/// Retries of a first pass that failed (the API server unreachable, RBAC missing).
const FIRST_PASS_BACKOFF: Backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(30));
/// How long the reconciler gets to finish its pass at shutdown.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the elector gets to release the Lease at shutdown (so a standby starts at once).
const RELEASE_TIMEOUT: Duration = Duration::from_secs(10);

/// Runs `sandbox-identity` until `shutdown` (Ok) or until leadership is lost (Err).
pub fn run(
    settings: SandboxIdentitySettings,
    health: tokio::net::TcpListener,
    shutdown: Shutdown,
) -> super::Program {
    Box::pin(run_sandbox_identity(settings, health, shutdown))
}

async fn run_sandbox_identity(
    settings: SandboxIdentitySettings,
    health: tokio::net::TcpListener,
    shutdown: Shutdown,
) -> Result<(), RuntimeError> {
    let SandboxIdentitySettings {
        reconciler: reconciler_settings,
        // Bound by the caller (`health`).
        health_listen: _,
        leader,
    } = settings;
    let metrics = Metrics::default();
    let leading = Gauge::<i64>::default();
    let mut registry = Registry::with_prefix("gitea_dynamic_runner");
    metrics.register(&mut registry);
    registry.register(
        "leader",
        "1 while this replica holds the leader lease",
        leading.clone(),
    );
    let readiness = Arc::new(Readiness::default());
    let (stop_health, health_shutdown) = shutdown_channel();
    let health = tokio::spawn(crate::health::serve_probes(
        health,
        Arc::new(registry),
        readiness.clone(),
        health_shutdown,
    ));
    let (outcome, elector) = lead(
        Leading {
            settings: reconciler_settings,
            metrics,
            leading: &leading,
            readiness: &readiness,
        },
        leader,
        &stop_health,
        &shutdown,
    )
    .await;
    readiness.set(false);
    leading.set(0);
    stop_health.trigger();
    if let Some(e) = elector {
        let _ = tokio::time::timeout(RELEASE_TIMEOUT, e).await;
    }
    let _ = health.await;
    outcome
}

/// What the leader runs with.
struct Leading<'a> {
    settings: gdr_sandbox_identity::Settings,
    metrics: Metrics,
    leading: &'a Gauge<i64>,
    readiness: &'a Readiness,
}

/// Campaigns, then reconciles while leading; the outcome, and the elector to await (it
/// releases the Lease once `stop_elector` fires).
async fn lead(
    w: Leading<'_>,
    leader: Option<crate::settings::LeaderSettings>,
    stop_elector: &crate::shutdown::ShutdownTrigger,
    shutdown: &Shutdown,
) -> (Result<(), RuntimeError>, Option<ElectorTask>) {
    let client = match crate::lease::client_from_environment().await {
        Ok(client) => client,
        Err(e) => return (Err(setup("connecting to the sandbox cluster")(e)), None),
    };
    let (mut leadership, elector) = match campaign(leader, stop_elector).await {
        Ok(campaign) => campaign,
        Err(e) => return (Err(e), None),
    };
    tokio::select! {
        _ = shutdown.wait() => return (Ok(()), elector),
        acquired = leadership.acquired() => {
            if !acquired {
                return (Err(RuntimeError::LostLeadership), elector);
            }
        }
    }
    tracing::info!(namespace = %w.settings.namespace, "leading: reconciling sandbox identities");
    w.leading.set(1);
    let reconciler = Arc::new(Reconciler::new(client, w.settings, w.metrics));
    // Ready only after a complete pass: until then the entries may not match the cluster.
    let first_pass = async {
        let mut attempt = 0;
        loop {
            match reconciler.reconcile_once().await {
                Ok(pass) => {
                    tracing::info!(
                        sandboxes = pass.sandboxes,
                        entries = pass.desired,
                        created = pass.created,
                        deleted = pass.deleted,
                        refused = pass.refused,
                        "first pass complete"
                    );
                    return true;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "sandbox identity pass failed; retrying");
                    let delay = FIRST_PASS_BACKOFF.delay(attempt);
                    attempt += 1;
                    if !shutdown.sleep(delay).await {
                        return false;
                    }
                }
            }
        }
    };
    tokio::select! {
        passed = first_pass => if !passed { return (Ok(()), elector) },
        _ = leadership.lost() => return (Err(RuntimeError::LostLeadership), elector),
    }
    w.readiness.set(true);
    let (stop_reconciler, stopping) = crate::shutdown::shutdown_channel();
    let mut task = tokio::spawn(reconciler.run(stopping));
    let (outcome, ended) = tokio::select! {
        _ = shutdown.wait() => (Ok(()), false),
        _ = leadership.lost() => (Err(RuntimeError::LostLeadership), false),
        _ = &mut task => (Err(RuntimeError::Component("the sandbox identity reconciler")), true),
    };
    w.readiness.set(false);
    stop_reconciler.trigger();
    if !ended && tokio::time::timeout(STOP_TIMEOUT, task).await.is_err() {
        tracing::warn!(timeout = ?STOP_TIMEOUT, "the reconciler did not stop in time");
    }
    (outcome, elector)
}
