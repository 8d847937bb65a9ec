//! The backends of the wiring: each enabled backend's adapter built from its settings
//! (process, Kubernetes, OpenSandbox), what it gives the workers and lifecycle reconcilers
//! besides ([`Extras`]), and the dispatch state restored from what the backends hold.

#[cfg(feature = "kubernetes")]
mod kubernetes;
mod opensandbox;
mod spire;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use gdr_backends::opensandbox::{ApiKey, OpenSandboxBackend};
use gdr_backends::process::{IdentityProvider, ProcessBackend, ProcessBackendSettings};
use gdr_backends::warm::WarmPass;
use gdr_core::assignment::DerivationPolicy;
use gdr_core::backend::Backend;
use gdr_core::executor::{ExecutorBackend, WarmClaims};
use gdr_core::metadata::MetadataCodec;
use gdr_identity::workload_api::LocalIdentity;

use super::{
    LIFECYCLE_INTERVAL, PROCESS_STOP_GRACE, RuntimeError, first_start, in_context, private_dir,
    setup, step,
};
use crate::dispatch::Dispatch;
use crate::lifecycle::{Housekeeping, Upkeep};
use crate::settings::{
    BackendSettings, IdentitySource, OpenSandboxSettings, PodBackend, ProcessSettings,
    SecretPermissions, VmBackend, read_secret_file_with,
};
use crate::wake::Wake;

/// What building a backend needs besides its own settings.
pub(super) struct Wiring<'a> {
    pub(super) state_dir: &'a Path,
    pub(super) policy: &'a DerivationPolicy,
    pub(super) codec: &'a MetadataCodec,
    pub(super) local: Option<&'a Arc<LocalIdentity>>,
    /// The SPIRE agent's Workload API (`spiffe_endpoint_socket`), when SVIDs come from it.
    pub(super) workload_api: Option<&'a str>,
    pub(super) secrets: SecretPermissions,
}

impl<'a> Wiring<'a> {
    pub(super) fn new(
        state_dir: &'a Path,
        policy: &'a DerivationPolicy,
        codec: &'a MetadataCodec,
        identity: &'a IdentitySource,
        local: Option<&'a Arc<LocalIdentity>>,
        secrets: SecretPermissions,
    ) -> Self {
        Wiring {
            state_dir,
            policy,
            codec,
            local,
            workload_api: match identity {
                IdentitySource::WorkloadApi(endpoint) => Some(endpoint.as_str()),
                IdentitySource::Local => None,
            },
            secrets,
        }
    }
}

/// Each enabled backend's adapter and capacity.
pub(super) type Backends = Vec<(Arc<dyn ExecutorBackend>, usize)>;

/// What a backend gives the worker and the lifecycle reconciler besides its adapter.
pub(super) struct Extras {
    /// Its change signal (the Pod watch); none for backends without a watch.
    pub(super) wake: Wake,
    /// Its clean-up beyond executors (the Pod backend's sweep).
    pub(super) housekeeping: Option<Arc<dyn Housekeeping>>,
    /// Interval of lifecycle passes. With a wake signal passes follow the changes, and
    /// the timer is only the resync against a watch that went quiet.
    pub(super) resync: Duration,
}

impl Default for Extras {
    fn default() -> Self {
        Extras {
            wake: Wake::none(),
            housekeeping: None,
            resync: LIFECYCLE_INTERVAL,
        }
    }
}

pub(super) async fn backends(
    pod: Option<BackendSettings<PodBackend>>,
    vm: Option<BackendSettings<VmBackend>>,
    wiring: &Wiring<'_>,
    warm_claims: Arc<dyn WarmClaims>,
) -> Result<(Backends, BTreeMap<Backend, Extras>), RuntimeError> {
    let mut out: Backends = Vec::new();
    let mut extras = BTreeMap::new();
    // One provider for both process backends: one uid pool.
    let spire_settings = [
        pod.as_ref().and_then(|p| match &p.kind {
            PodBackend::Process(process) => process.spire.clone(),
            PodBackend::Kubernetes(_) => None,
        }),
        vm.as_ref().and_then(|v| match &v.kind {
            VmBackend::Process(process) => process.spire.clone(),
            VmBackend::OpenSandbox(_) => None,
        }),
    ]
    .into_iter()
    .flatten()
    .next();
    let spire = spire_settings
        .map(|s| spire::spire_identity(&s, wiring.workload_api))
        .transpose()?;
    let identity = |backend: &str| -> Result<Arc<dyn IdentityProvider>, RuntimeError> {
        match (&spire, wiring.local) {
            (Some(spire), _) => Ok(spire.clone()),
            (None, Some(local)) => Ok(local.clone()),
            (None, None) => Err(step("building the process backend")(
                format!("the {backend} process backend needs local_identity = true or executor_identity = \"spire\"").into(),
            )),
        }
    };
    if let Some(pod) = pod {
        let slots = pod.slots();
        let adapter: Arc<dyn ExecutorBackend> = match pod.kind {
            PodBackend::Process(process) => Arc::new(process_backend(
                Backend::Pod,
                &process,
                wiring,
                identity("pod")?,
            )?),
            #[cfg(feature = "kubernetes")]
            PodBackend::Kubernetes(settings) => {
                let (adapter, more) = kubernetes::pod_backend(*settings).await?;
                extras.insert(Backend::Pod, more);
                adapter
            }
            #[cfg(not(feature = "kubernetes"))]
            PodBackend::Kubernetes(settings) => match *settings {},
        };
        out.push((adapter, slots));
    }
    if let Some(vm) = vm {
        let slots = vm.slots();
        let adapter: Arc<dyn ExecutorBackend> = match vm.kind {
            VmBackend::Process(process) => Arc::new(process_backend(
                Backend::Vm,
                &process,
                wiring,
                identity("vm")?,
            )?),
            VmBackend::OpenSandbox(opensandbox) => {
                let backend = Arc::new(
                    opensandbox_backend(*opensandbox, wiring)?.with_warm_claims(warm_claims),
                );
                tracing::info!(
                    pool = %backend.settings().pool,
                    warm_pool = backend.settings().warm_pool,
                    "vm backend: OpenSandbox sandboxes"
                );
                extras.insert(
                    Backend::Vm,
                    Extras {
                        housekeeping: Some(backend.clone()),
                        ..Extras::default()
                    },
                );
                backend
            }
        };
        out.push((adapter, slots));
    }
    Ok((out, extras))
}

fn process_backend(
    backend: Backend,
    process: &ProcessSettings,
    wiring: &Wiring<'_>,
    identity: Arc<dyn IdentityProvider>,
) -> Result<ProcessBackend, RuntimeError> {
    let program = match &process.program {
        Some(p) => p.clone(),
        None => default_executor_program(
            &std::env::current_exe().map_err(setup("locating this binary for executors"))?,
        ),
    };
    let state_root = wiring.state_dir.join(backend.as_str());
    private_dir(&state_root).map_err(|e| step("building the process backend")(e.into()))?;
    let settings = ProcessBackendSettings {
        backend,
        state_root,
        program,
        args: vec!["executor".into()],
        extra_env: BTreeMap::from([(
            "GITEA_RUNNER_BINARY".to_owned(),
            first_start::runner_binary(
                process.runner_binary.as_deref(),
                std::env::var_os("PATH").as_deref(),
            )
            .map_err(setup("runner_binary"))?
            .display()
            .to_string(),
        )]),
        codec: wiring.codec.clone(),
        trust_domain: wiring.policy.trust_domain.clone(),
        stop_grace: PROCESS_STOP_GRACE,
        log_retention: process.log_retention,
    };
    let executors = settings.state_root.join("executors");
    let state_root = settings.state_root.clone();
    let built =
        ProcessBackend::new(settings, identity).map_err(setup("building the process backend"))?;
    if process.spire.is_some() {
        // Executors of other uids work in `<state_dir>/<backend>/executors/<id>/work`.
        spire::traversable(&[wiring.state_dir, &state_root, &executors])?;
    }
    Ok(built)
}

pub use crate::settings::EXECUTOR_BINARY;

/// The program of process executors when `executor_program` is unset: the executor's own
/// binary when it sits next to `controller` (it links no controller code, so each job's
/// start loads a fraction of the bytes: issue 39), else `controller` itself, whose
/// `executor` subcommand is the same program. Both take the argument `executor`.
pub(crate) fn default_executor_program(controller: &Path) -> std::path::PathBuf {
    let sibling = controller.with_file_name(EXECUTOR_BINARY);
    if sibling.is_file() {
        sibling
    } else {
        controller.to_path_buf()
    }
}

/// How long a terminal VM may keep running: only OpenSandbox cannot see its executor exit.
pub(super) fn terminal_grace(vm: &BackendSettings<VmBackend>) -> Option<Duration> {
    match &vm.kind {
        VmBackend::OpenSandbox(o) => Some(o.terminal_grace),
        VmBackend::Process(_) => None,
    }
}

/// The VM backend: the API key is read once, here; the TLS configuration is the shared one
/// (system roots plus `opensandbox_ca_file`).
fn opensandbox_backend(
    settings: OpenSandboxSettings,
    wiring: &Wiring<'_>,
) -> Result<OpenSandboxBackend, RuntimeError> {
    let OpenSandboxSettings {
        backend,
        api_key_file,
        ca_file,
        // Read by the lifecycle reconciler ([`terminal_grace`]).
        terminal_grace: _,
    } = settings;
    let key = read_secret_file_with("opensandbox_api_key_file", &api_key_file, wiring.secrets)
        .map_err(setup("reading the OpenSandbox API key"))?;
    let key = ApiKey::from_file_contents(&key)
        .map_err(|e| step("opensandbox_api_key_file")(in_context(api_key_file.display(), e)))?;
    let extra_ca = match &ca_file {
        Some(p) => Some(std::fs::read(p).map_err(|e| {
            step("opensandbox_ca_file")(in_context(format_args!("cannot read {}", p.display()), e))
        })?),
        None => None,
    };
    let tls = gdr_gitea::tls::client_config(
        "opensandbox_ca_file",
        extra_ca.as_deref(),
        backend.api.base_url.scheme() == "https",
    )
    .map_err(setup("building the OpenSandbox TLS configuration"))?;
    OpenSandboxBackend::connect(backend, &key, tls).map_err(setup("building the vm backend"))
}

/// A pass over a warm pool as the lifecycle's metrics and status take it.
fn upkeep(pass: WarmPass) -> Upkeep {
    let WarmPass {
        created,
        deleted,
        deleted_by,
        members,
        claims,
    } = pass;
    Upkeep {
        changed: created + deleted,
        warm: Some(
            members
                .into_iter()
                .map(|((profile, state), n)| ((profile.unwrap_or_default(), state), n))
                .collect(),
        ),
        discarded: deleted_by,
        claims,
    }
}

pub(super) async fn restore(
    dispatch: &Dispatch,
    capacities: &BTreeMap<Backend, usize>,
) -> Result<(), RuntimeError> {
    for backend in capacities.keys() {
        if let Some(adapter) = dispatch.backend(*backend) {
            let records = adapter
                .list()
                .await
                .map_err(setup("listing executors to restore"))?;
            let (admitted, claimed) = dispatch.restore(&records);
            tracing::info!(%backend, admitted, claimed, "restored executors from the backend");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 39 item 2: with `executor_program` unset, the process backend starts the
    /// executor's own binary when it sits next to the controller's, else the controller's
    /// binary (its `executor` alias), so an installation without it keeps working.
    #[test]
    fn the_default_executor_program_is_the_sibling_executor_binary_if_present_else_this_binary() {
        let dir = tempfile::tempdir().expect("dir");
        let controller = dir.path().join("gitea-dynamic-runner");
        std::fs::write(&controller, b"").expect("controller");
        assert_eq!(default_executor_program(&controller), controller);
        let executor = dir.path().join(EXECUTOR_BINARY);
        std::fs::write(&executor, b"").expect("executor");
        assert_eq!(default_executor_program(&controller), executor);
    }
}
