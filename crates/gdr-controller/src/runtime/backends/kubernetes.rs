//! Wiring of the Kubernetes Pod backend (`pod_backend = "kubernetes"`): the API client from
//! the environment, the backend, its watch as the workers' and lifecycle's wake signal,
//! and its sweep as the lifecycle's housekeeping.

use std::sync::Arc;

use async_trait::async_trait;
use gdr_backends::kubernetes::{KubernetesBackend, RESYNC};
use gdr_core::executor::ExecutorError;

use super::Extras;
use crate::kube_client::{self, Retries};
use crate::lifecycle::Housekeeping;
use crate::runtime::{RuntimeError, setup};
use crate::settings::KubernetesSettings;

#[async_trait]
impl Housekeeping for KubernetesBackend {
    async fn sweep(&self) -> Result<usize, ExecutorError> {
        let swept = KubernetesBackend::sweep(self).await?;
        Ok(swept.entries + swept.secrets)
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
