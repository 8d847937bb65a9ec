//! The backends' defaults, declared once: the backends' `new()` and the controller's key
//! table (its `pod_*`, `opensandbox_*` and `vm_*` keys) both read them. Not behind the
//! backends' features, because the key table documents every key in every build.

/// Every backend's executors.
pub mod executor {
    use std::time::Duration;

    /// How long an executor may take to start (`executor_start_deadline`): one whose
    /// runner has not claimed its task this long after its creation is failed, and a warm
    /// Pod not running this long after its creation is replaced.
    pub const START_DEADLINE: Duration = Duration::from_secs(600);
}

/// The Pod backend's defaults ([`crate::kubernetes::KubernetesSettings::new`]).
pub mod kubernetes {
    use std::time::Duration;

    /// Namespace of executor Pods (`pod_namespace`).
    pub const NAMESPACE: &str = "gitea-actions";
    /// Service account of executor Pods (`pod_service_account`).
    pub const SERVICE_ACCOUNT: &str = "gitea-task-executor";
    /// Arguments of the executor container (`pod_executor_args`).
    pub const EXECUTOR_ARGS: &[&str] = &["executor"];
    /// UID and GID the job runs as (`pod_executor_uid`).
    pub const EXECUTOR_UID: u32 = 2000;
    /// A privileged `dockerd` sidecar (`pod_privileged`).
    pub const PRIVILEGED: bool = true;
    /// Size limit of the Docker storage volume (`pod_docker_storage_limit`).
    pub const DOCKER_STORAGE_LIMIT: &str = "20Gi";
    /// `activeDeadlineSeconds` (`pod_active_deadline`): just past Gitea's 3 h task limit.
    pub const ACTIVE_DEADLINE: Duration = Duration::from_secs(3 * 3600 + 600);
    /// Whether the service account token is mounted (`pod_automount_service_account_token`).
    pub const AUTOMOUNT_SERVICE_ACCOUNT_TOKEN: bool = false;
    /// CSI driver of the Workload API volume (`pod_spiffe_csi_driver`).
    pub const SPIFFE_CSI_DRIVER: &str = "csi.spiffe.io";
    /// Mount point of the Workload API volume (`pod_spiffe_socket_dir`).
    pub const SPIFFE_SOCKET_DIR: &str = "/run/spire/agent-sockets";
    /// The Workload API socket's file name (`pod_spiffe_socket_name`).
    pub const SPIFFE_SOCKET_NAME: &str = "spire-agent.sock";
    /// Age at which a capability Secret without its Pod is removed
    /// (`pod_orphan_secret_grace`).
    pub const ORPHAN_SECRET_GRACE: Duration = Duration::from_secs(600);
    /// How long an executor Pod waits for its SVID (`pod_identity_bind_deadline`).
    pub const IDENTITY_DEADLINE: Duration = Duration::from_secs(120);
}

/// The VM backend's defaults ([`crate::opensandbox::OpenSandboxSettings::new`] and
/// [`crate::opensandbox::ClientSettings::new`]).
pub mod opensandbox {
    use std::time::Duration;

    /// Timeout of every Lifecycle API call but create (`opensandbox_request_timeout`).
    pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
    /// Timeout of a blocking create (`opensandbox_create_timeout`): above the server's own
    /// 60 s default, so its answer arrives.
    pub const CREATE_TIMEOUT: Duration = Duration::from_secs(90);
    /// Command a VM sandbox runs (`vm_entrypoint`).
    pub const ENTRYPOINT: &[&str] = &["/usr/local/bin/gitea-dynamic-runner", "executor"];
    /// Lifetime of a sandbox (`vm_timeout_seconds`).
    pub const TIMEOUT: Duration = Duration::from_secs(4 * 3600);
    /// Renew an expiry closer than this (`vm_renew_before`).
    pub const RENEW_BEFORE: Duration = Duration::from_secs(600);
    /// How long a warm sandbox may be held in the claims arbiter while its metadata still
    /// reads unclaimed (not a setting): above a claim's patch (one request,
    /// `opensandbox_request_timeout` defaults to 30 s), so only a claimant that died
    /// leaves one held longer.
    pub const WARM_HOLD_GRACE: Duration = Duration::from_secs(60);
}
