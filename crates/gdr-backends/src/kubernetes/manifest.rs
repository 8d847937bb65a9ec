//! The objects the Pod backend writes: the executor Pod, its capability Secret and its
//! ClusterStaticEntry.

use std::collections::BTreeMap;

use gdr_core::assignment::AssignmentId;
use gdr_core::executor::{ExecutorSpec, env};
use gdr_core::metadata::keys;
use k8s_openapi::api::core::v1::{
    CSIVolumeSource, Capabilities, Container, EmptyDirVolumeSource, EnvVar, EnvVarSource,
    HostPathVolumeSource, Pod, PodSpec, ResourceRequirements, SeccompProfile, Secret,
    SecretKeySelector, SecurityContext, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use serde_json::{Value, json};

use super::settings::{KubernetesSettings, PodProfile, Resources, WorkloadApiVolume};

/// `app.kubernetes.io/name` of everything the backend creates.
pub const APP_NAME: &str = "gitea-dynamic-runner";
/// `app.kubernetes.io/component` of executor Pods.
pub const COMPONENT_EXECUTOR: &str = "executor";
/// `app.kubernetes.io/component` of capability Secrets.
pub const COMPONENT_CAPABILITY: &str = "executor-capability";
/// `app.kubernetes.io/component` of identity entries (as the Go version labels them).
pub const COMPONENT_IDENTITY: &str = "pod-identity";
/// The container name.
pub const CONTAINER: &str = "executor";
/// Key of the capability in its Secret.
pub const CAPABILITY_KEY: &str = "capability";
/// Volume holding the SPIFFE Workload API socket.
pub const SPIFFE_VOLUME: &str = "spiffe-workload-api";
/// Volume backing `/var/lib/docker`.
pub const DOCKER_VOLUME: &str = "docker-storage";
const DOCKER_PATH: &str = "/var/lib/docker";
/// The sidecar running a privileged Pod's Docker daemon (issue 37 item 3): dockerd and
/// the cgroup nesting it needs live in a container of their own, so the executor and the
/// job keep their container's cgroup, the path SPIRE's `k8s` attestor reads the
/// container ID from.
pub const DOCKERD_CONTAINER: &str = "dockerd";
/// Volume shared by the two containers, holding the daemon's socket (not dockerd's
/// `/run/docker` exec root, which holds containerd's socket too).
pub const DOCKER_SOCKET_VOLUME: &str = "docker-socket";
const DOCKER_SOCKET_DIR: &str = "/run/docker-socket";
/// The daemon's socket in both containers.
pub const DOCKER_SOCKET: &str = "/run/docker-socket/docker.sock";
/// The executor's variables naming the daemon (`gdr_executor::docker`).
const START_DOCKER_ENV: &str = "CI_RUNNER_START_DOCKER";
const DOCKER_SOCKET_ENV: &str = "CI_DOCKER_SOCKET";
const DOCKER_EXTERNAL_ENV: &str = "CI_DOCKER_EXTERNAL";
/// Makes the executor program the daemon's container (`gdr_executor::jobenv`).
const DOCKERD_ONLY_ENV: &str = "CI_EXECUTOR_DOCKERD_ONLY";
/// How long the executor waits for its SVID and the facade, in seconds.
const READY_TIMEOUT_ENV: &str = "CI_EXECUTOR_READY_TIMEOUT";

/// `app.kubernetes.io/name=…,app.kubernetes.io/component=<component>`.
pub fn component_selector(component: &str) -> String {
    format!("app.kubernetes.io/name={APP_NAME},app.kubernetes.io/component={component}")
}

fn app_labels(component: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        ("app.kubernetes.io/name".to_owned(), APP_NAME.to_owned()),
        (
            "app.kubernetes.io/component".to_owned(),
            component.to_owned(),
        ),
    ])
}

/// Name of the capability Secret of an assignment's Pod.
pub fn secret_name(id: &AssignmentId) -> String {
    format!("{id}-{CAPABILITY_KEY}")
}

fn quantities(map: &BTreeMap<String, String>) -> Option<BTreeMap<String, Quantity>> {
    (!map.is_empty()).then(|| {
        map.iter()
            .map(|(k, v)| (k.clone(), Quantity(v.clone())))
            .collect()
    })
}

fn resources(defaults: &Resources, profile: Option<&PodProfile>) -> Option<ResourceRequirements> {
    let mut merged = defaults.clone();
    if let Some(p) = profile {
        merged.requests.extend(p.resources.requests.clone());
        merged.limits.extend(p.resources.limits.clone());
    }
    if merged.requests.is_empty() && merged.limits.is_empty() {
        return None;
    }
    Some(ResourceRequirements {
        requests: quantities(&merged.requests),
        limits: quantities(&merged.limits),
        ..ResourceRequirements::default()
    })
}

/// `CI_RUNNER_UID`: the uid a root executor runs the job as.
const RUNNER_UID_ENV: &str = "CI_RUNNER_UID";

/// The `dockerd` sidecar's: privileged, as root, as `docker:dind` runs.
fn dockerd_security_context() -> SecurityContext {
    SecurityContext {
        privileged: Some(true),
        run_as_user: Some(0),
        run_as_group: Some(0),
        ..SecurityContext::default()
    }
}

fn security_context(s: &KubernetesSettings) -> SecurityContext {
    let uid = Some(s.executor_uid);
    if s.privileged {
        // The daemon is the `dockerd` sidecar's: the executor is no longer privileged. It
        // still starts as root, to link the agent's socket where jobs expect it and to run
        // itself, the runner and the job as `executor_uid` (`CI_RUNNER_UID`) with the
        // `docker` group, which needs SETUID and SETGID, and KILL to pass SIGTERM on to
        // that user's process; nothing else.
        SecurityContext {
            privileged: Some(false),
            allow_privilege_escalation: Some(false),
            run_as_user: Some(0),
            run_as_group: Some(0),
            capabilities: Some(Capabilities {
                drop: Some(vec!["ALL".into()]),
                add: Some(vec!["SETUID".into(), "SETGID".into(), "KILL".into()]),
            }),
            seccomp_profile: Some(SeccompProfile {
                type_: "RuntimeDefault".into(),
                ..SeccompProfile::default()
            }),
            ..SecurityContext::default()
        }
    } else {
        SecurityContext {
            privileged: Some(false),
            allow_privilege_escalation: Some(false),
            run_as_non_root: Some(true),
            run_as_user: uid,
            run_as_group: uid,
            capabilities: Some(Capabilities {
                drop: Some(vec!["ALL".into()]),
                ..Capabilities::default()
            }),
            seccomp_profile: Some(SeccompProfile {
                type_: "RuntimeDefault".into(),
                ..SeccompProfile::default()
            }),
            ..SecurityContext::default()
        }
    }
}

/// The executor environment. The capability is not a value in the Pod spec: it comes from
/// the Pod's own Secret (see [`capability_secret`]).
fn environment(s: &KubernetesSettings, spec: &ExecutorSpec) -> Vec<EnvVar> {
    let mut plain: BTreeMap<String, String> = s.extra_env.clone();
    for (name, value) in spec.environment() {
        plain.insert(name.to_owned(), value);
    }
    plain.insert(env::SPIFFE_ENDPOINT_SOCKET.to_owned(), s.endpoint_socket());
    if s.privileged {
        plain.insert(RUNNER_UID_ENV.to_owned(), s.executor_uid.to_string());
        // The daemon is the sidecar's: wait for it, start and prepare nothing.
        plain.insert(START_DOCKER_ENV.to_owned(), "true".into());
        plain.insert(DOCKER_EXTERNAL_ENV.to_owned(), "true".into());
        plain.insert(DOCKER_SOCKET_ENV.to_owned(), DOCKER_SOCKET.into());
    }
    plain.insert(
        READY_TIMEOUT_ENV.to_owned(),
        s.identity_deadline.as_secs().max(1).to_string(),
    );
    let secret = secret_name(spec.assignment.id());
    plain
        .into_iter()
        .map(|(name, value)| {
            if name == env::CAPABILITY {
                EnvVar {
                    name,
                    value_from: Some(EnvVarSource {
                        secret_key_ref: Some(SecretKeySelector {
                            name: secret.clone(),
                            key: CAPABILITY_KEY.into(),
                            optional: Some(false),
                        }),
                        ..EnvVarSource::default()
                    }),
                    ..EnvVar::default()
                }
            } else {
                EnvVar {
                    name,
                    value: Some(value),
                    ..EnvVar::default()
                }
            }
        })
        .collect()
}

/// The volume carrying the node agent's Workload API socket (mounted read-only either way).
fn workload_api_volume(source: &WorkloadApiVolume) -> Volume {
    match source {
        WorkloadApiVolume::Csi { driver } => Volume {
            name: SPIFFE_VOLUME.into(),
            // The SPIFFE CSI driver refuses to publish a writable volume.
            csi: Some(CSIVolumeSource {
                driver: driver.clone(),
                read_only: Some(true),
                ..CSIVolumeSource::default()
            }),
            ..Volume::default()
        },
        WorkloadApiVolume::HostPath { path } => Volume {
            name: SPIFFE_VOLUME.into(),
            // `Directory`: a node without the agent's directory fails the Pod's start with
            // the kubelet's reason instead of handing the job an empty directory.
            host_path: Some(HostPathVolumeSource {
                path: path.clone(),
                type_: Some("Directory".into()),
            }),
            ..Volume::default()
        },
    }
}

/// The `dockerd` sidecar of a privileged Pod: the executor image's program in its daemon
/// role (it nests the cgroups and puts the storage on a loop device where needed, as
/// `docker:dind`'s entrypoint does, then runs dockerd on the shared socket). A native
/// sidecar (an init container that restarts always) starts before the executor and is
/// stopped after it, so the Pod still ends with the executor's exit status.
fn dockerd_container(
    s: &KubernetesSettings,
    image: &str,
    resources: Option<ResourceRequirements>,
) -> Container {
    let mut env: BTreeMap<String, String> = s.extra_env.clone();
    env.insert(DOCKERD_ONLY_ENV.to_owned(), "true".into());
    env.insert(START_DOCKER_ENV.to_owned(), "true".into());
    env.insert(DOCKER_SOCKET_ENV.to_owned(), DOCKER_SOCKET.into());
    env.remove(env::CAPABILITY);
    Container {
        name: DOCKERD_CONTAINER.into(),
        image: Some(image.to_owned()),
        args: Some(s.executor_args.clone()),
        env: Some(
            env.into_iter()
                .map(|(name, value)| EnvVar {
                    name,
                    value: Some(value),
                    ..EnvVar::default()
                })
                .collect(),
        ),
        volume_mounts: Some(vec![
            VolumeMount {
                name: DOCKER_VOLUME.into(),
                mount_path: DOCKER_PATH.into(),
                ..VolumeMount::default()
            },
            VolumeMount {
                name: DOCKER_SOCKET_VOLUME.into(),
                mount_path: DOCKER_SOCKET_DIR.into(),
                ..VolumeMount::default()
            },
        ]),
        // The job's containers run under the daemon, so its container gets what bounded
        // them when they ran in the executor's.
        resources,
        restart_policy: Some("Always".into()),
        security_context: Some(dockerd_security_context()),
        termination_message_policy: Some("FallbackToLogsOnError".into()),
        ..Container::default()
    }
}

/// The Pod's volumes and the executor container's mounts: the SPIFFE volume, Docker's
/// storage (the sidecar's in a privileged Pod, which the executor reaches through the
/// socket's volume instead), the profile's allow-listed volumes.
fn volumes_and_mounts(
    s: &KubernetesSettings,
    profile: Option<&PodProfile>,
) -> (Vec<Volume>, Vec<VolumeMount>) {
    let mut volumes = vec![
        workload_api_volume(&s.workload_api_volume),
        Volume {
            name: DOCKER_VOLUME.into(),
            empty_dir: Some(EmptyDirVolumeSource {
                size_limit: Some(Quantity(s.docker_storage_limit.clone())),
                ..EmptyDirVolumeSource::default()
            }),
            ..Volume::default()
        },
    ];
    let mut mounts = vec![VolumeMount {
        name: SPIFFE_VOLUME.into(),
        mount_path: s.agent_socket_dir.clone(),
        read_only: Some(true),
        ..VolumeMount::default()
    }];
    if s.privileged {
        volumes.push(Volume {
            name: DOCKER_SOCKET_VOLUME.into(),
            empty_dir: Some(EmptyDirVolumeSource::default()),
            ..Volume::default()
        });
        mounts.push(VolumeMount {
            name: DOCKER_SOCKET_VOLUME.into(),
            mount_path: DOCKER_SOCKET_DIR.into(),
            ..VolumeMount::default()
        });
    } else {
        // Unchanged for an unprivileged Pod, whose executor starts no daemon.
        mounts.push(VolumeMount {
            name: DOCKER_VOLUME.into(),
            mount_path: DOCKER_PATH.into(),
            ..VolumeMount::default()
        });
    }
    for v in profile.map(|p| p.volumes.as_slice()).unwrap_or_default() {
        // `validate` checked every profile volume is allow-listed.
        if let Some(allowed) = s.volume_allow_list.get(&v.name) {
            volumes.push(Volume {
                name: v.name.clone(),
                ..allowed.clone()
            });
            mounts.push(VolumeMount {
                name: v.name.clone(),
                mount_path: v.mount_path.clone(),
                read_only: Some(v.read_only),
                ..VolumeMount::default()
            });
        }
    }
    (volumes, mounts)
}

/// The executor Pod of `spec`, named after its assignment.
pub fn pod(s: &KubernetesSettings, spec: &ExecutorSpec, profile: Option<&PodProfile>) -> Pod {
    let mut labels = spec.metadata.labels.clone();
    labels.extend(app_labels(COMPONENT_EXECUTOR));
    let (volumes, mounts) = volumes_and_mounts(s, profile);
    let image = profile
        .and_then(|p| p.image.clone())
        .unwrap_or_else(|| s.image.clone());
    let resources = resources(&s.default_resources, profile);
    let init_containers = s
        .privileged
        .then(|| vec![dockerd_container(s, &image, resources.clone())]);
    Pod {
        metadata: ObjectMeta {
            name: Some(spec.assignment.id().as_str().to_owned()),
            namespace: Some(s.namespace.clone()),
            labels: Some(labels),
            annotations: Some(spec.metadata.annotations.clone()),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            restart_policy: Some("Never".into()),
            service_account_name: Some(s.service_account.clone()),
            automount_service_account_token: Some(s.automount_service_account_token),
            active_deadline_seconds: Some(
                i64::try_from(s.active_deadline.as_secs())
                    .unwrap_or(i64::MAX)
                    .max(1),
            ),
            // Service links would put every Service of the namespace into the job's env.
            enable_service_links: Some(false),
            node_selector: profile
                .filter(|p| !p.node_selector.is_empty())
                .map(|p| p.node_selector.clone()),
            tolerations: profile
                .filter(|p| !p.tolerations.is_empty())
                .map(|p| p.tolerations.clone()),
            runtime_class_name: profile.and_then(|p| p.runtime_class_name.clone()),
            containers: vec![Container {
                name: CONTAINER.into(),
                image: Some(image),
                args: Some(s.executor_args.clone()),
                env: Some(environment(s, spec)),
                volume_mounts: Some(mounts),
                resources,
                security_context: Some(security_context(s)),
                // The executor writes no termination message file; its last error line
                // on stderr becomes the container's termination message, which is the
                // reason the job is failed with (an SVID that never came, a facade that
                // never answered).
                termination_message_policy: Some("FallbackToLogsOnError".into()),
                ..Container::default()
            }],
            init_containers,
            volumes: Some(volumes),
            ..PodSpec::default()
        }),
        ..Pod::default()
    }
}

/// The capability Secret: created before its Pod (so the Pod never waits in
/// `CreateContainerConfigError` for it), then owned by the Pod, so Kubernetes deletes it
/// with the Pod. Immutable.
pub fn capability_secret(s: &KubernetesSettings, spec: &ExecutorSpec) -> Secret {
    let mut labels = app_labels(COMPONENT_CAPABILITY);
    labels.insert(
        s.codec.key(keys::ASSIGNMENT_ID),
        spec.assignment.id().as_str().to_owned(),
    );
    Secret {
        metadata: ObjectMeta {
            name: Some(secret_name(spec.assignment.id())),
            namespace: Some(s.namespace.clone()),
            labels: Some(labels),
            ..ObjectMeta::default()
        },
        type_: Some("Opaque".into()),
        immutable: Some(true),
        string_data: Some(BTreeMap::from([(
            CAPABILITY_KEY.to_owned(),
            spec.capability.expose().to_owned(),
        )])),
        ..Secret::default()
    }
}

/// The merge patch making `pod` the owner of its Secret.
pub fn owner_patch(pod_name: &str, pod_uid: &str) -> Value {
    let owner = OwnerReference {
        api_version: "v1".into(),
        kind: "Pod".into(),
        name: pod_name.to_owned(),
        uid: pod_uid.to_owned(),
        controller: Some(true),
        block_owner_deletion: None,
    };
    json!({ "metadata": { "ownerReferences": [owner] } })
}

/// The spec of the identity entry binding `spiffe_id` to one Pod UID under `parent_id`.
pub fn entry_spec(
    s: &KubernetesSettings,
    spiffe_id: &str,
    pod_uid: &str,
    parent_id: &str,
) -> Value {
    json!({
        "spiffeID": spiffe_id,
        "parentID": parent_id,
        "selectors": [format!("k8s:pod-uid:{pod_uid}")],
        "className": s.spire_class,
    })
}

/// Labels of an identity entry.
pub fn entry_labels(s: &KubernetesSettings, id: &AssignmentId) -> BTreeMap<String, String> {
    let mut labels = app_labels(COMPONENT_IDENTITY);
    labels.insert(s.codec.key(keys::ASSIGNMENT_ID), id.as_str().to_owned());
    labels
}
