//! Wiring of the Kubernetes Pod backend (`pod_backend = "kubernetes"`): the API client from
//! the environment, the backend, its watch as the workers' and lifecycle's wake signal,
//! and its sweep and warm pool as the lifecycle's housekeeping.

use std::sync::Arc;

use async_trait::async_trait;
use gdr_backends::kubernetes::{KubernetesBackend, RESYNC};
use gdr_core::executor::ExecutorError;

use super::{Extras, upkeep};
use crate::kube_client::{self, Retries};
use crate::lifecycle::{Housekeeping, Upkeep};
use crate::runtime::{RuntimeError, setup};
use crate::settings::KubernetesSettings;

#[async_trait]
impl Housekeeping for KubernetesBackend {
    async fn sweep(&self) -> Result<usize, ExecutorError> {
        let swept = KubernetesBackend::sweep(self).await?;
        // With no pool configured, only every interval: warm Pods left from an earlier
        // configuration are deleted.
        let warm = if self.warm_pool_configured() {
            0
        } else {
            self.reconcile_warm_pool().await?.deleted
        };
        Ok(swept.entries + swept.secrets + warm)
    }

    async fn every_pass(&self) -> Result<Upkeep, ExecutorError> {
        if !self.warm_pool_configured() {
            return Ok(Upkeep::default());
        }
        let pass = self.reconcile_warm_pool().await?;
        Ok(upkeep(pass))
    }
}

/// The Pod backend over the cluster the environment names (in-cluster service account, or
/// `KUBECONFIG`).
pub(super) async fn pod_backend(
    settings: KubernetesSettings,
) -> Result<(Arc<KubernetesBackend>, Extras), RuntimeError> {
    let client = kube_client::from_environment(Retries::Caller)
        .await
        .map_err(setup(
            "connecting to the Kubernetes API for the pod backend",
        ))?;
    // `new` also warns when the executor image is a mutable tag.
    let backend = Arc::new(
        KubernetesBackend::new(client, settings).map_err(setup("building the pod backend"))?,
    );
    let s = backend.settings();
    tracing::info!(
        namespace = %s.namespace,
        image = %s.image,
        profiles = ?backend.profile_labels(),
        warm_pools = ?s.warm_pools(),
        spire_cluster = %s.spire_cluster,
        spire_class = %s.spire_class,
        "pod backend: Kubernetes Pods"
    );
    let extras = Extras {
        wake: backend.changes().into(),
        housekeeping: Some(backend.clone()),
        resync: RESYNC,
    };
    Ok((backend, extras))
}

#[cfg(test)]
mod tests {
    /// The reasons the backend deletes a warm Pod for are the label values the metric's
    /// reference documents.
    #[test]
    fn the_backends_discard_reasons_are_the_metrics_documented_values() {
        assert_eq!(
            gdr_backends::kubernetes::warm::DELETION_KINDS,
            crate::job_metrics::WARM_DISCARD_REASONS
        );
    }

    /// The outcomes the backend counts a job's claim by are the label values the metric's
    /// reference documents.
    #[test]
    fn the_backends_claim_outcomes_are_the_metrics_documented_values() {
        assert_eq!(
            gdr_backends::kubernetes::warm::CLAIM_OUTCOMES,
            crate::job_metrics::WARM_CLAIM_OUTCOMES
        );
    }
}
