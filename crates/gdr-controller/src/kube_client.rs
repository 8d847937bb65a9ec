//! The controller's Kubernetes API client (the leader Lease, the Pod backend): in-cluster
//! configuration (the Pod's service account) or a kubeconfig (`KUBECONFIG`,
//! `~/.kube/config`).

/// Why no client could be built.
#[derive(Debug, thiserror::Error)]
pub enum KubeClientError {
    /// Neither an in-cluster configuration nor a kubeconfig is usable.
    #[error(
        "no Kubernetes configuration: not running in a cluster (no service account / \
         KUBERNETES_SERVICE_HOST) and no usable kubeconfig (KUBECONFIG or ~/.kube/config): {0}"
    )]
    NoConfiguration(#[source] kube::config::InferConfigError),
    /// The configuration was found but the client cannot be built from it.
    #[error("building the Kubernetes client: {0}")]
    Build(#[source] kube::Error),
}

/// Who retries a request that failed transiently (429, 503, 504).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retries {
    /// The client itself (kube's default: up to 15 attempts, backing off to minutes).
    Client,
    /// The caller, on its own schedule. The Pod backend's callers are the worker (which
    /// puts the delivery back with a delay) and the lifecycle pass (the next pass): a
    /// client that kept retrying for minutes would hold a delivery past its ack wait.
    /// (Only the Pod backend asks for it.)
    #[cfg(feature = "kubernetes")]
    Caller,
}

/// A client from the environment.
pub async fn from_environment(retries: Retries) -> Result<kube::Client, KubeClientError> {
    let mut config = kube::Config::infer()
        .await
        .map_err(KubeClientError::NoConfiguration)?;
    config.default_retry = retries == Retries::Client;
    kube::Client::try_from(config).map_err(KubeClientError::Build)
}
