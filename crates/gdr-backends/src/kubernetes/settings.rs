//! Typed settings of the Pod backend, and per-label Pod profiles bounded by operator maxima.

use std::collections::BTreeMap;
use std::time::Duration;

use gdr_core::identity::TrustDomain;
use gdr_core::metadata::MetadataCodec;
use k8s_openapi::api::core::v1::{Toleration, Volume};
use serde::Deserialize;

/// Everything the Pod backend needs; every field has a documented default except the
/// image, the trust domain and the SPIRE cluster and class, which are deployment facts.
#[derive(Debug, Clone)]
pub struct KubernetesSettings {
    /// Namespace of the executor Pods and their Secrets (`pod_namespace`, default
    /// `gitea-actions`).
    pub namespace: String,
    /// Service account of executor Pods (`pod_service_account`, default
    /// `gitea-task-executor`).
    pub service_account: String,
    /// Executor image (`pod_executor_image`); a digest (`…@sha256:…`) is recommended, a
    /// mutable tag is accepted with a warning.
    pub image: String,
    /// Container arguments (default `["executor"]`).
    pub executor_args: Vec<String>,
    /// uid and gid the job runs as (`pod_executor_uid`, default 2000): a privileged Pod's
    /// executor starts as root and runs itself, the runner and the job as this uid
    /// (`CI_RUNNER_UID`); an unprivileged Pod's container runs as it from the start.
    pub executor_uid: i64,
    /// Run the job's Docker daemon in a privileged `dockerd` sidecar and start the
    /// executor's container (not privileged) as root (`pod_privileged`, default true).
    /// When false the one container runs
    /// as `executor_uid` with no privilege escalation, all capabilities dropped and the
    /// runtime's default seccomp profile, and the job has no Docker daemon.
    pub privileged: bool,
    /// Size limit of the `emptyDir` at `/var/lib/docker` (`pod_docker_storage_limit`,
    /// default `20Gi`).
    pub docker_storage_limit: String,
    /// `activeDeadlineSeconds` of executor Pods (`pod_active_deadline`, default 3 h 10 min:
    /// just past Gitea's 3 h endless-task timeout, so Kubernetes ends what Gitea gave up).
    pub active_deadline: Duration,
    /// Mount the service account token into executor Pods
    /// (`pod_automount_service_account_token`, default false: jobs get no Kubernetes
    /// credential).
    pub automount_service_account_token: bool,
    /// Trust domain of job SPIFFE IDs (`trust_domain`).
    pub trust_domain: TrustDomain,
    /// k8s_psat cluster name in SPIRE agent IDs (`spire_cluster`).
    pub spire_cluster: String,
    /// `className` of the ClusterStaticEntries, the spire-controller-manager's class
    /// (`spire_class`); an entry of another class is ignored by SPIRE.
    pub spire_class: String,
    /// Parent ID of every entry (`spire_agent_id`): for single-node clusters and node
    /// aliases. Unset (the default): the agent ID of the node the Pod is scheduled on,
    /// `spiffe://<td>/spire/agent/k8s_psat/<spire_cluster>/<Node UID>`.
    pub spire_agent_id: Option<String>,
    /// Where the Workload API volume comes from (default: the CSI driver `csi.spiffe.io`).
    pub workload_api_volume: WorkloadApiVolume,
    /// Where the Workload API volume is mounted (default `/run/spire/agent-sockets`).
    pub agent_socket_dir: String,
    /// Socket file name in it (default `spire-agent.sock`).
    pub agent_socket_name: String,
    /// Extra executor environment (e.g. `GITEA_RUNNER_BINARY`); the `CI_*` names and
    /// `SPIFFE_ENDPOINT_SOCKET` cannot be overridden.
    pub extra_env: BTreeMap<String, String>,
    /// The metadata codec (its prefix, default `ci.ddupan.top/`).
    pub codec: MetadataCodec,
    /// Requests and limits of Pods without a profile (default: none).
    pub default_resources: Resources,
    /// Per-label profiles (`[pod_profiles.<label>]`).
    pub profiles: BTreeMap<String, PodProfile>,
    /// Upper bounds on any profile's requests and limits (`pod_profile_max`).
    pub maxima: BTreeMap<String, String>,
    /// Volumes profiles may add, by name (`pod_volume_allow_list`); nothing else is mounted.
    pub volume_allow_list: BTreeMap<String, Volume>,
    /// How old an unowned capability Secret must be, with no Pod, before the sweep
    /// removes it (default 10 min; it only exists that way when a controller died between
    /// creating the Secret and the Pod).
    pub orphan_secret_grace: Duration,
    /// How long the executor waits for its SVID and the facade before it gives up and
    /// the Pod fails (`pod_identity_bind_deadline`, default 2 min; the executor's
    /// `CI_EXECUTOR_READY_TIMEOUT`). An identity that is never bound (a wrong
    /// `spire_cluster` or `spire_class`, SPIRE down) thus fails the job with the executor's
    /// error instead of waiting for the start deadline.
    pub identity_deadline: Duration,
    /// How many warm Pods without a profile to keep (`pod_warm_pool`, default 0: none);
    /// a profile's own count is [`PodProfile::warm_pool`]. A warm Pod is created without
    /// an assignment, identity or capability and is claimed by exactly one job
    /// ([`super::warm`]).
    pub warm_pool: u32,
    /// How long a warm Pod may take to run (`executor_start_deadline`, default 10 min): a
    /// member still not running then (an image that cannot be pulled, a Pod that cannot be
    /// scheduled) is deleted and replaced instead of holding its place in the pool.
    pub warm_start_deadline: Duration,
}

/// The source of the volume that carries the SPIRE agent's Workload API socket into an
/// executor Pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WorkloadApiVolume {
    /// A CSI volume of this driver (`pod_spiffe_csi_driver`; the SPIFFE CSI driver mounts
    /// the node agent's socket directory, read-only).
    Csi {
        /// The driver's name.
        driver: String,
    },
    /// The node directory at this absolute path, as a `hostPath` volume
    /// (`pod_spiffe_host_path`): for clusters without the CSI driver, where each node's
    /// agent listens in that directory.
    HostPath {
        /// The directory on the node.
        path: String,
    },
}

impl KubernetesSettings {
    /// Defaults for everything but the deployment facts.
    pub fn new(
        image: impl Into<String>,
        trust_domain: TrustDomain,
        spire_cluster: impl Into<String>,
        spire_class: impl Into<String>,
    ) -> Self {
        use crate::defaults::kubernetes as default;
        KubernetesSettings {
            namespace: default::NAMESPACE.into(),
            service_account: default::SERVICE_ACCOUNT.into(),
            image: image.into(),
            executor_args: default::EXECUTOR_ARGS
                .iter()
                .map(|a| (*a).to_owned())
                .collect(),
            executor_uid: i64::from(default::EXECUTOR_UID),
            privileged: default::PRIVILEGED,
            docker_storage_limit: default::DOCKER_STORAGE_LIMIT.into(),
            active_deadline: default::ACTIVE_DEADLINE,
            automount_service_account_token: default::AUTOMOUNT_SERVICE_ACCOUNT_TOKEN,
            trust_domain,
            spire_cluster: spire_cluster.into(),
            spire_class: spire_class.into(),
            spire_agent_id: None,
            workload_api_volume: WorkloadApiVolume::Csi {
                driver: default::SPIFFE_CSI_DRIVER.into(),
            },
            agent_socket_dir: default::SPIFFE_SOCKET_DIR.into(),
            agent_socket_name: default::SPIFFE_SOCKET_NAME.into(),
            extra_env: BTreeMap::new(),
            codec: MetadataCodec::default(),
            default_resources: Resources::default(),
            profiles: BTreeMap::new(),
            maxima: BTreeMap::new(),
            volume_allow_list: BTreeMap::new(),
            orphan_secret_grace: default::ORPHAN_SECRET_GRACE,
            identity_deadline: default::IDENTITY_DEADLINE,
            warm_pool: 0,
            warm_start_deadline: crate::defaults::executor::START_DEADLINE,
        }
    }

    /// `unix://<agent_socket_dir>/<agent_socket_name>`.
    pub fn endpoint_socket(&self) -> String {
        format!(
            "unix://{}/{}",
            self.agent_socket_dir.trim_end_matches('/'),
            self.agent_socket_name
        )
    }

    /// The warm Pods to keep, by profile (`None`: the Pods without one); only counts
    /// above 0.
    pub fn warm_pools(&self) -> BTreeMap<Option<String>, u32> {
        std::iter::once((None, self.warm_pool))
            .chain(
                self.profiles
                    .iter()
                    .map(|(label, p)| (Some(label.clone()), p.warm_pool)),
            )
            .filter(|(_, n)| *n > 0)
            .collect()
    }

    /// Checks what a Pod created from these settings needs; run once at start so that a
    /// misconfigured profile stops the controller instead of failing jobs.
    pub fn validate(&self) -> Result<(), SettingsError> {
        let bad = |field: &str, problem: String| {
            Err(SettingsError {
                field: field.to_owned(),
                problem,
            })
        };
        if self.image.trim().is_empty() {
            return bad("pod_executor_image", "is required".into());
        }
        match &self.workload_api_volume {
            WorkloadApiVolume::Csi { driver } if driver.trim().is_empty() => {
                return bad("pod_spiffe_csi_driver", "must not be empty".into());
            }
            WorkloadApiVolume::HostPath { path }
                if !path.starts_with('/') || path.contains("..") =>
            {
                return bad(
                    "pod_spiffe_host_path",
                    format!("{path:?} is not an absolute directory on the node"),
                );
            }
            _ => {}
        }
        if !is_dns_label(&self.namespace) {
            return bad(
                "pod_namespace",
                format!("{:?} is not an RFC 1123 label", self.namespace),
            );
        }
        if self.spire_cluster.is_empty() && self.spire_agent_id.is_none() {
            return bad(
                "spire_cluster",
                "is required unless spire_agent_id is set".into(),
            );
        }
        if let Some(id) = &self.spire_agent_id
            && !id.starts_with(&format!("spiffe://{}/", self.trust_domain.as_str()))
        {
            return bad(
                "spire_agent_id",
                format!("{id:?} is not a SPIFFE ID of the trust domain"),
            );
        }
        if self.identity_deadline < Duration::from_secs(1) {
            return bad("pod_identity_bind_deadline", "must be at least 1s".into());
        }
        if self.executor_uid == 0 {
            return bad(
                "pod_executor_uid",
                "must not be 0: jobs never run as root (a privileged Pod's executor starts as root by itself)".into(),
            );
        }
        if parse_quantity(&self.docker_storage_limit).is_none() {
            return bad(
                "pod_docker_storage_limit",
                format!("{:?} is not a quantity", self.docker_storage_limit),
            );
        }
        for (resource, max) in &self.maxima {
            if parse_quantity(max).is_none() {
                return bad(
                    &format!("pod_profile_max.{resource}"),
                    format!("{max:?} is not a quantity"),
                );
            }
        }
        self.default_resources
            .check("pod_resources", &self.maxima)?;
        for (label, profile) in &self.profiles {
            let field = format!("pod_profiles.{label}");
            if label.is_empty() || label == "self-hosted" {
                return bad(&field, "is not a usable runs-on label".into());
            }
            profile.resources.check(&field, &self.maxima)?;
            for v in &profile.volumes {
                if !self.volume_allow_list.contains_key(&v.name) {
                    return bad(
                        &format!("{field}.volumes"),
                        format!("{:?} is not in pod_volume_allow_list", v.name),
                    );
                }
            }
            if profile
                .image
                .as_deref()
                .is_some_and(|i| i.trim().is_empty())
            {
                return bad(&format!("{field}.image"), "is empty".into());
            }
        }
        Ok(())
    }
}

/// A setting that cannot work, named by its configuration key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {problem}")]
pub struct SettingsError {
    /// The configuration key.
    pub field: String,
    /// What is wrong.
    pub problem: String,
}

/// Container requests and limits (`cpu`, `memory`, `ephemeral-storage`, …) as quantities.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Resources {
    /// Requests.
    #[serde(default, deserialize_with = "quantities")]
    pub requests: BTreeMap<String, String>,
    /// Limits.
    #[serde(default, deserialize_with = "quantities")]
    pub limits: BTreeMap<String, String>,
}

/// Quantities as configuration writes them: `"500m"`, `"4Gi"`, or a plain number
/// (`cpu = 2` in TOML).
fn quantities<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<BTreeMap<String, String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Quantity {
        Text(String),
        Whole(u64),
        Fraction(f64),
    }
    Ok(BTreeMap::<String, Quantity>::deserialize(d)?
        .into_iter()
        .map(|(resource, q)| {
            let text = match q {
                Quantity::Text(t) => t,
                Quantity::Whole(n) => n.to_string(),
                Quantity::Fraction(f) => f.to_string(),
            };
            (resource, text)
        })
        .collect())
}

impl Resources {
    fn check(&self, field: &str, maxima: &BTreeMap<String, String>) -> Result<(), SettingsError> {
        let err = |problem: String| SettingsError {
            field: field.to_owned(),
            problem,
        };
        for (kind, map) in [("requests", &self.requests), ("limits", &self.limits)] {
            for (resource, value) in map {
                let q = parse_quantity(value)
                    .ok_or_else(|| err(format!("{kind}.{resource} {value:?} is not a quantity")))?;
                if let Some(max) = maxima.get(resource).and_then(|m| parse_quantity(m))
                    && q > max
                {
                    return Err(err(format!(
                        "{kind}.{resource} {value} exceeds the operator maximum {}",
                        maxima[resource]
                    )));
                }
            }
        }
        for (resource, request) in &self.requests {
            if let (Some(r), Some(l)) = (
                parse_quantity(request),
                self.limits.get(resource).and_then(|l| parse_quantity(l)),
            ) && r > l
            {
                return Err(err(format!(
                    "requests.{resource} {request} exceeds limits.{resource}"
                )));
            }
        }
        Ok(())
    }
}

/// What an extra `runs-on` label selects.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PodProfile {
    /// Requests and limits (replace the defaults per resource).
    #[serde(default, flatten)]
    pub resources: Resources,
    /// `nodeSelector`.
    #[serde(default)]
    pub node_selector: BTreeMap<String, String>,
    /// `tolerations`.
    #[serde(default)]
    pub tolerations: Vec<Toleration>,
    /// `runtimeClassName`.
    #[serde(default)]
    pub runtime_class_name: Option<String>,
    /// Volumes from the allow-list, and where to mount them.
    #[serde(default)]
    pub volumes: Vec<ProfileVolume>,
    /// Another executor image.
    #[serde(default)]
    pub image: Option<String>,
    /// How many warm Pods of this profile to keep (default 0: none).
    #[serde(default)]
    pub warm_pool: u32,
}

/// One allow-listed volume a profile mounts.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProfileVolume {
    /// Name in `pod_volume_allow_list`.
    pub name: String,
    /// Mount path in the executor container.
    pub mount_path: String,
    /// Mount read-only (default true).
    #[serde(default = "yes")]
    pub read_only: bool,
}

fn yes() -> bool {
    true
}

fn is_dns_label(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[0] != b'-'
        && b[b.len() - 1] != b'-'
}

/// A Kubernetes quantity (`500m`, `2`, `4Gi`, `1.5G`, `1e3`) as a number, for comparisons.
pub fn parse_quantity(s: &str) -> Option<f64> {
    let s = s.trim();
    const SUFFIXES: &[(&str, f64)] = &[
        ("Ki", 1024.0),
        ("Mi", 1_048_576.0),
        ("Gi", 1_073_741_824.0),
        ("Ti", 1_099_511_627_776.0),
        ("Pi", 1_125_899_906_842_624.0),
        ("Ei", 1_152_921_504_606_846_976.0),
        ("n", 1e-9),
        ("u", 1e-6),
        ("m", 1e-3),
        ("k", 1e3),
        ("M", 1e6),
        ("G", 1e9),
        ("T", 1e12),
        ("P", 1e15),
        ("E", 1e18),
    ];
    let (number, factor) = SUFFIXES
        .iter()
        .find_map(|(suffix, f)| s.strip_suffix(suffix).map(|n| (n, *f)))
        .unwrap_or((s, 1.0));
    if number.is_empty()
        || !number
            .bytes()
            .all(|b| b.is_ascii_digit() || matches!(b, b'.' | b'e' | b'E' | b'+' | b'-'))
    {
        return None;
    }
    let value: f64 = number.parse().ok()?;
    (value.is_finite() && value >= 0.0).then_some(value * factor)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn quantities_compare_across_suffixes() {
        assert_eq!(parse_quantity("500m"), Some(0.5));
        assert_eq!(parse_quantity("2"), Some(2.0));
        assert!(parse_quantity("1Gi").unwrap() > parse_quantity("1G").unwrap());
        assert_eq!(parse_quantity("1e3"), Some(1000.0));
        for bad in ["", "Gi", "1 Gi", "-1", "x"] {
            assert_eq!(parse_quantity(bad), None, "{bad}");
        }
    }

    fn settings() -> KubernetesSettings {
        KubernetesSettings::new(
            "registry.example/executor@sha256:00",
            TrustDomain::new("example.org").unwrap(),
            "c",
            "k",
        )
    }

    #[test]
    fn a_profile_above_the_operator_maxima_or_with_an_unlisted_volume_is_refused() {
        let mut s = settings();
        s.maxima.insert("memory".into(), "8Gi".into());
        let mut big = PodProfile::default();
        big.resources.limits.insert("memory".into(), "16Gi".into());
        s.profiles.insert("large".into(), big);
        let e = s.validate().unwrap_err();
        assert_eq!(e.field, "pod_profiles.large");
        assert!(
            e.problem.contains("exceeds the operator maximum 8Gi"),
            "{e}"
        );

        let mut s = settings();
        s.profiles.insert(
            "cache".into(),
            PodProfile {
                volumes: vec![ProfileVolume {
                    name: "host-root".into(),
                    mount_path: "/host".into(),
                    read_only: true,
                }],
                ..PodProfile::default()
            },
        );
        assert!(s.validate().unwrap_err().problem.contains("host-root"));
        assert!(settings().validate().is_ok());
    }

    #[test]
    fn a_profile_deserialises_from_configuration_and_unknown_keys_are_refused() {
        let p: PodProfile = serde_json::from_value(serde_json::json!({
            "limits": { "memory": "4Gi" },
            "node_selector": { "gpu": "true" },
            "tolerations": [{ "key": "gpu", "operator": "Exists", "effect": "NoSchedule" }],
            "runtime_class_name": "nvidia",
            "volumes": [{ "name": "cache", "mount_path": "/cache" }],
        }))
        .unwrap();
        assert_eq!(p.resources.limits["memory"], "4Gi");
        let whole: PodProfile = serde_json::from_value(
            serde_json::json!({ "requests": { "cpu": 2, "memory": "1Gi" } }),
        )
        .unwrap();
        assert_eq!(
            whole.resources.requests["cpu"], "2",
            "a plain number is a quantity"
        );
        assert_eq!(p.node_selector["gpu"], "true");
        assert!(p.volumes[0].read_only, "read-only unless said otherwise");
        let typo = serde_json::json!({ "limit": { "memory": "4Gi" } });
        assert!(serde_json::from_value::<PodProfile>(typo).is_err());
    }
}
