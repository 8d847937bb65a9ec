//! The Pod backend's keys (`pod_backend = "kubernetes"`) → the backend's typed settings.
//!
//! Tables (`pod_profiles`, `pod_resources`, `pod_volume_allow_list`, …) arrive as raw
//! [`Table`]s and are converted here, so every error names the key and the entry
//! (`pod_profiles (POD_PROFILES): large: …`). The backend's own checks
//! (`KubernetesSettings::validate`: quantities, operator maxima, the volume allow list) run
//! here too, so `check-config` reports them and a misconfigured profile stops the
//! controller at start instead of failing jobs.

use gdr_core::backend::BackendLabels;
use gdr_core::identity::TrustDomain;
use gdr_core::metadata::MetadataCodec;

use super::Check;
use super::keys::section;
use super::values::Table;

/// The Pod backend's settings in this build: the backend's own type with the
/// `kubernetes` feature, none without it.
#[cfg(feature = "kubernetes")]
pub use gdr_backends::kubernetes::KubernetesSettings;

/// Without the `kubernetes` feature no Pod backend settings can exist.
#[cfg(not(feature = "kubernetes"))]
#[derive(Debug, Clone)]
pub enum KubernetesSettings {}

/// What the Pod settings are derived with besides their own keys (`None`: that key is
/// broken and already reported).
#[cfg_attr(not(feature = "kubernetes"), allow(dead_code))]
pub(super) struct Context<'a> {
    pub trust_domain: Option<&'a TrustDomain>,
    pub codec: Option<&'a MetadataCodec>,
    pub labels: Option<&'a BackendLabels>,
    /// `executor_start_deadline`: also how long a warm Pod may take to run.
    pub start_deadline: std::time::Duration,
}

/// The typed Pod backend settings, or `None` with every problem recorded in `check`.
#[cfg(feature = "kubernetes")]
pub(super) fn kubernetes(
    check: &mut Check,
    keys: section::Pod,
    context: &Context<'_>,
) -> Option<KubernetesSettings> {
    use std::time::Duration;

    use super::values::{List, Secs};
    use gdr_backends::kubernetes::{Resources, WorkloadApiVolume};

    let section::Pod {
        pod_namespace: namespace,
        pod_executor_image: image,
        pod_service_account: service_account,
        pod_executor_uid: executor_uid,
        pod_privileged: privileged,
        pod_docker_storage_limit: docker_storage_limit,
        pod_active_deadline: Secs(active_deadline),
        pod_automount_service_account_token: automount_service_account_token,
        pod_executor_args: List(executor_args),
        pod_executor_env: executor_env,
        pod_spiffe_csi_driver: csi_driver,
        pod_spiffe_host_path: host_path,
        pod_spiffe_socket_dir: socket_dir,
        pod_spiffe_socket_name: socket_name,
        pod_resources: resources,
        pod_profiles: profiles,
        pod_profile_max: profile_max,
        pod_volume_allow_list: volume_allow_list,
        pod_orphan_secret_grace: Secs(orphan_secret_grace),
        pod_identity_bind_deadline: Secs(identity_deadline),
        pod_warm_pool: warm_pool,
        spire_cluster,
        spire_class,
        spire_agent_id,
    } = keys;
    let before = check.problems.len();
    let image = check.required(
        "pod_executor_image",
        image.filter(|i| !i.trim().is_empty()),
        "with the kubernetes pod backend",
    );
    if active_deadline < Duration::from_secs(1) {
        check.problem("pod_active_deadline", "must be at least 1s");
    }
    if executor_args.is_empty() {
        check.problem(
            "pod_executor_args",
            "must not be empty (the executor image runs `executor`)",
        );
    }
    let extra_env = strings(check, "pod_executor_env", executor_env);
    let maxima = quantities(check, "pod_profile_max", profile_max);
    let default_resources: Option<Resources> = typed(check, "pod_resources", None, resources);
    let typed_profiles = pod_profiles(check, profiles, context.labels);
    let volumes = volume_allow_list
        .0
        .into_iter()
        .filter_map(|(name, source)| Some((name.clone(), volume(check, &name, source)?)))
        .collect();
    let (Some(image), Some(trust_domain), Some(codec), Some(default_resources)) = (
        image,
        context.trust_domain,
        context.codec,
        default_resources,
    ) else {
        return None;
    };
    let mut s = KubernetesSettings::new(image, trust_domain.clone(), spire_cluster, spire_class);
    s.namespace = namespace;
    s.service_account = service_account;
    s.executor_args = executor_args;
    s.executor_uid = i64::from(executor_uid);
    s.privileged = privileged;
    s.docker_storage_limit = docker_storage_limit;
    s.active_deadline = active_deadline;
    s.automount_service_account_token = automount_service_account_token;
    s.spire_agent_id = spire_agent_id.filter(|id| !id.trim().is_empty());
    s.workload_api_volume = match host_path {
        Some(path) => WorkloadApiVolume::HostPath {
            path: path.display().to_string(),
        },
        None => WorkloadApiVolume::Csi { driver: csi_driver },
    };
    s.agent_socket_dir = socket_dir;
    s.agent_socket_name = socket_name;
    s.extra_env = extra_env;
    s.codec = codec.clone();
    s.default_resources = default_resources;
    s.profiles = typed_profiles;
    s.maxima = maxima;
    s.volume_allow_list = volumes;
    s.orphan_secret_grace = orphan_secret_grace;
    s.identity_deadline = identity_deadline;
    s.warm_pool = warm_pool;
    s.warm_start_deadline = context.start_deadline;
    if let Err(e) = s.validate() {
        report(check, &e.field, e.problem);
        return None;
    }
    (check.problems.len() == before).then_some(s)
}

/// A problem the backend's own validation found in `field`, under the key it belongs to.
#[cfg(feature = "kubernetes")]
fn report(check: &mut Check, field: &str, problem: String) {
    let (key, entry) = key_of(field);
    match entry {
        Some(entry) => check.problem(key, format!("{entry}: {problem}")),
        None => check.problem(key, problem),
    }
}

/// `pod_profiles`: each label one Gitea stores that selects no backend, each body a
/// [`PodProfile`](gdr_backends::kubernetes::PodProfile) without a Kata runtime class.
#[cfg(feature = "kubernetes")]
fn pod_profiles(
    check: &mut Check,
    profiles: Table,
    labels: Option<&BackendLabels>,
) -> std::collections::BTreeMap<String, gdr_backends::kubernetes::PodProfile> {
    use gdr_backends::kubernetes::PodProfile;

    let mut typed_profiles = std::collections::BTreeMap::new();
    for (label, body) in profiles.0 {
        if let Some(labels) = labels
            && let Err(why) = profile_label(labels, &label)
        {
            check.problem("pod_profiles", format!("{label:?}: {why}"));
            continue;
        }
        if let Some(profile) = typed::<PodProfile>(check, "pod_profiles", Some(&label), body) {
            if let Some(why) = profile.runtime_class_name.as_deref().and_then(kata_refusal) {
                check.problem("pod_profiles", format!("{label:?}: {why}"));
                continue;
            }
            typed_profiles.insert(label, profile);
        }
    }
    typed_profiles
}

/// Without the `kubernetes` feature: a clear refusal.
#[cfg(not(feature = "kubernetes"))]
pub(super) fn kubernetes(
    check: &mut Check,
    _keys: section::Pod,
    _context: &Context<'_>,
) -> Option<KubernetesSettings> {
    check.problem(
        "pod_backend",
        "\"kubernetes\" is not supported by this build (built without the cargo feature `kubernetes`); set pod_backend = \"process\" for single-host mode",
    );
    None
}

/// The declared key a backend settings field belongs to (`pod_profiles.large.volumes` →
/// `pod_profiles`, entry `large.volumes`).
#[cfg(feature = "kubernetes")]
fn key_of(field: &str) -> (&'static str, Option<&str>) {
    let (head, rest) = field
        .split_once('.')
        .map_or((field, None), |(h, r)| (h, Some(r)));
    match super::KEYS.iter().find(|k| k.name == head) {
        Some(k) => (k.name, rest),
        // Every field the backend names is a declared key; keep the whole name otherwise.
        None => ("pod_backend", Some(field)),
    }
}

/// Why a Pod profile cannot use `runtime_class`: a Kata runtime class (by convention
/// named `kata`, `kata-qemu`, `kata-clh`, …) runs the Pod in a guest VM, and the SPIFFE CSI
/// driver's Workload API socket (a Unix socket on the node) does not cross into it, so the
/// executor would never get its SVID. The VM backend gives each sandbox its identity.
#[cfg_attr(not(feature = "kubernetes"), allow(dead_code))]
pub(super) fn kata_refusal(runtime_class: &str) -> Option<String> {
    runtime_class.to_ascii_lowercase().contains("kata").then(|| {
        format!(
            "runtime_class_name {runtime_class:?} runs the Pod in a Kata guest, which the SPIFFE CSI driver's Workload API socket does not reach: its executor would never get an SVID. Run such jobs on the VM backend instead (vm_backend = \"opensandbox\", `runs-on: [self-hosted, vm]`), which gives each sandbox its own identity"
        )
    })
}

/// Why `label` cannot name a profile: it must be a label Gitea stores and must not select
/// a backend itself.
pub(super) fn profile_label(labels: &BackendLabels, label: &str) -> Result<(), String> {
    let plain = !label.is_empty()
        && label.len() <= 63
        && label
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_'));
    if !plain {
        return Err(
            "a profile label must be 1-63 letters, digits, '.', '-' or '_' (a Gitea runner label)"
                .into(),
        );
    }
    let reserved = [
        gdr_core::backend::SELF_HOSTED,
        gdr_core::backend::Backend::Pod.as_str(),
        gdr_core::backend::Backend::Vm.as_str(),
        labels.vm_label(),
    ];
    if reserved.contains(&label) {
        return Err(format!(
            "{label:?} already selects the runner or a backend; a profile needs its own label"
        ));
    }
    Ok(())
}

#[cfg(feature = "kubernetes")]
fn describe(value: &serde_json::Value) -> &'static str {
    match value {
        serde_json::Value::Null => "nothing",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "a list",
        serde_json::Value::Object(_) => "a table",
    }
}

#[cfg(feature = "kubernetes")]
/// A table of strings (environment variables).
fn strings(
    check: &mut Check,
    key: &'static str,
    table: Table,
) -> std::collections::BTreeMap<String, String> {
    let mut out = std::collections::BTreeMap::new();
    for (name, value) in table.0 {
        match value {
            serde_json::Value::String(s) => {
                out.insert(name, s);
            }
            other => check.problem(
                key,
                format!("{name}: must be a string, not {}", describe(&other)),
            ),
        }
    }
    out
}

#[cfg(feature = "kubernetes")]
/// A table of quantities (`"8"`, `"32Gi"`, or a plain number).
fn quantities(
    check: &mut Check,
    key: &'static str,
    table: Table,
) -> std::collections::BTreeMap<String, String> {
    let mut out = std::collections::BTreeMap::new();
    for (resource, value) in table.0 {
        match value {
            serde_json::Value::String(s) => {
                out.insert(resource, s);
            }
            serde_json::Value::Number(n) => {
                out.insert(resource, n.to_string());
            }
            other => check.problem(
                key,
                format!(
                    "{resource}: must be a quantity like \"8\" or \"32Gi\", not {}",
                    describe(&other)
                ),
            ),
        }
    }
    out
}

#[cfg(feature = "kubernetes")]
/// `value` as `T` (a profile, the default resources), or a problem naming the key, the
/// entry and what serde found wrong (unknown fields included: these types deny them).
fn typed<T: serde::de::DeserializeOwned>(
    check: &mut Check,
    key: &'static str,
    entry: Option<&str>,
    value: impl Into<serde_json::Value>,
) -> Option<T> {
    serde_json::from_value(value.into())
        .map_err(|e| match entry {
            Some(entry) => check.problem(key, format!("{entry}: {e}")),
            None => check.problem(key, e.to_string()),
        })
        .ok()
}

impl From<Table> for serde_json::Value {
    fn from(t: Table) -> Self {
        serde_json::Value::Object(t.0)
    }
}

/// An allow-listed volume: a Kubernetes volume source as in a Pod spec, named by its
/// entry. The Kubernetes types ignore unknown fields, so a typo (`hostpath`) would mount
/// an empty volume source and fail every Pod of the profile with `422`: every field given
/// must be one the type knows.
#[cfg(feature = "kubernetes")]
fn volume(
    check: &mut Check,
    name: &str,
    source: serde_json::Value,
) -> Option<k8s_openapi::api::core::v1::Volume> {
    let serde_json::Value::Object(mut fields) = source else {
        check.problem(
            "pod_volume_allow_list",
            format!("{name}: must be a table holding a volume source, e.g. persistentVolumeClaim = {{ claimName = \"…\" }}"),
        );
        return None;
    };
    fields.insert("name".into(), serde_json::Value::String(name.to_owned()));
    let given = serde_json::Value::Object(fields);
    let volume: k8s_openapi::api::core::v1::Volume =
        typed(check, "pod_volume_allow_list", Some(name), given.clone())?;
    let kept = serde_json::to_value(&volume).unwrap_or_default();
    if let Some(path) = unknown_field(&given, &kept, "") {
        check.problem(
            "pod_volume_allow_list",
            format!("{name}: unknown field {path:?} (field names are the Pod spec's, e.g. persistentVolumeClaim, hostPath)"),
        );
        return None;
    }
    if kept.as_object().is_some_and(|o| o.len() < 2) {
        check.problem(
            "pod_volume_allow_list",
            format!("{name}: names no volume source"),
        );
        return None;
    }
    Some(volume)
}

/// The first field of `given` that did not survive deserialisation into `kept`.
#[cfg(feature = "kubernetes")]
fn unknown_field(given: &serde_json::Value, kept: &serde_json::Value, at: &str) -> Option<String> {
    let (serde_json::Value::Object(g), serde_json::Value::Object(k)) = (given, kept) else {
        return None;
    };
    for (field, value) in g {
        let path = if at.is_empty() {
            field.clone()
        } else {
            format!("{at}.{field}")
        };
        match k.get(field) {
            None => return Some(path),
            Some(inner) => {
                if let Some(found) = unknown_field(value, inner, &path) {
                    return Some(found);
                }
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_profile_label_may_not_select_the_runner_or_a_backend() {
        let labels = BackendLabels::new("vm-dev").unwrap();
        assert!(profile_label(&labels, "large").is_ok());
        for bad in [
            "pod",
            "vm",
            "vm-dev",
            "self-hosted",
            "",
            "a b",
            &"x".repeat(64),
        ] {
            assert!(profile_label(&labels, bad).is_err(), "{bad:?}");
        }
    }
}
