//! The objects the Pod backend writes: the executor Pod, its capability Secret and its
//! ClusterStaticEntry.

use std::collections::BTreeMap;

use gdr_core::assignment::AssignmentId;
use gdr_core::backend::Backend;
use gdr_core::executor::{ExecutorSpec, env};
use gdr_core::metadata::keys;
use k8s_openapi::api::core::v1::{
    CSIVolumeSource, Capabilities, Container, DownwardAPIProjection, DownwardAPIVolumeFile,
    EmptyDirVolumeSource, EnvVar, EnvVarSource, HostPathVolumeSource, KeyToPath,
    ObjectFieldSelector, Pod, PodSpec, ProjectedVolumeSource, ResourceRequirements, SeccompProfile,
    Secret, SecretKeySelector, SecretProjection, SecurityContext, Volume, VolumeMount,
    VolumeProjection,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use serde_json::{Value, json};

use super::settings::{KubernetesSettings, PodProfile, Resources, WorkloadApiVolume};
use super::warm;

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
/// Where a warm Pod's executor waits for its assignment (`gdr_executor::standby`).
const STANDBY_DIR_ENV: &str = "CI_EXECUTOR_STANDBY_DIR";
/// The volume it waits on, and its mount path.
pub const STANDBY_VOLUME: &str = "assignment";
const STANDBY_PATH: &str = "/run/gitea-dynamic-runner/assignment";
const STANDBY_ENVIRONMENT_FILE: &str = "environment";
const STANDBY_CAPABILITY_FILE: &str = "capability";

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
    secret_name_of(id.as_str())
}

/// Name of the capability Secret of the Pod named `pod` (a warm Pod's is not named after
/// its assignment).
pub fn secret_name_of(pod: &str) -> String {
    format!("{pod}-{CAPABILITY_KEY}")
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
    let assignment: BTreeMap<String, String> = spec
        .environment()
        .into_iter()
        .map(|(name, value)| (name.to_owned(), value))
        .collect();
    env_vars(s, assignment, &secret_name(spec.assignment.id()))
}

/// `assignment`'s variables with the settings' own (the extra environment, the agent's
/// socket, the Docker daemon's, the ready timeout), the capability read from `secret`.
fn env_vars(
    s: &KubernetesSettings,
    assignment: BTreeMap<String, String>,
    secret: &str,
) -> Vec<EnvVar> {
    let mut plain: BTreeMap<String, String> = s.extra_env.clone();
    plain.extend(assignment);
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
    plain
        .into_iter()
        .map(|(name, value)| {
            if name == env::CAPABILITY {
                EnvVar {
                    name,
                    value_from: Some(EnvVarSource {
                        secret_key_ref: Some(SecretKeySelector {
                            name: secret.to_owned(),
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
    let mut pod = executor_pod(s, profile, environment(s, spec), None);
    pod.metadata.name = Some(spec.assignment.id().as_str().to_owned());
    pod.metadata.labels = Some(labels);
    pod.metadata.annotations = Some(spec.metadata.annotations.clone());
    if let Some(spec) = pod.spec.as_mut() {
        spec.active_deadline_seconds = Some(active_deadline_seconds(s.active_deadline));
    }
    pod
}

fn active_deadline_seconds(deadline: std::time::Duration) -> i64 {
    i64::try_from(deadline.as_secs()).unwrap_or(i64::MAX).max(1)
}

/// An executor Pod without name, metadata or active deadline; `extra` is one more volume
/// and its mount in the executor's container.
fn executor_pod(
    s: &KubernetesSettings,
    profile: Option<&PodProfile>,
    env: Vec<EnvVar>,
    extra: Option<(Volume, VolumeMount)>,
) -> Pod {
    let (mut volumes, mut mounts) = volumes_and_mounts(s, profile);
    if let Some((volume, mount)) = extra {
        volumes.push(volume);
        mounts.push(mount);
    }
    let image = profile
        .and_then(|p| p.image.clone())
        .unwrap_or_else(|| s.image.clone());
    let resources = resources(&s.default_resources, profile);
    let init_containers = s
        .privileged
        .then(|| vec![dockerd_container(s, &image, resources.clone())]);
    Pod {
        metadata: ObjectMeta {
            namespace: Some(s.namespace.clone()),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            restart_policy: Some("Never".into()),
            service_account_name: Some(s.service_account.clone()),
            automount_service_account_token: Some(s.automount_service_account_token),
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
                env: Some(env),
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

/// A warm Pod named `name` for `profile_label`'s jobs: no assignment metadata, no
/// identity, no capability. Its executor waits in standby on a projected volume that
/// fills in only once a job claimed the Pod: the claim's environment annotation (the
/// downward API) and the Pod's capability Secret, optional until it exists. No active
/// deadline yet: the claim sets one counted from the claim. Annotated with the
/// fingerprint of its template ([`warm_template_fingerprint`]).
pub fn warm_pod(
    s: &KubernetesSettings,
    name: &str,
    profile_label: Option<&str>,
    profile: Option<&PodProfile>,
) -> Pod {
    let mut pod = warm_template(s, name, profile_label, profile);
    pod.metadata
        .annotations
        .get_or_insert_with(BTreeMap::new)
        .insert(
            s.codec.key(warm::TEMPLATE_KEY),
            warm_template_fingerprint(s, profile_label, profile),
        );
    pod
}

/// The fingerprint of the warm Pod these settings make for `profile_label`: what a
/// member's own must equal for it to be claimed (a member made under other settings is
/// replaced). Taken of the Pod under one fixed name, since its name shows in its
/// variables and volumes.
pub fn warm_template_fingerprint(
    s: &KubernetesSettings,
    profile_label: Option<&str>,
    profile: Option<&PodProfile>,
) -> String {
    let pod = warm_template(s, warm::NAME_PREFIX, profile_label, profile);
    warm::template_fingerprint(&serde_json::to_vec(&pod).unwrap_or_default())
}

/// [`warm_pod`] without its fingerprint.
fn warm_template(
    s: &KubernetesSettings,
    name: &str,
    profile_label: Option<&str>,
    profile: Option<&PodProfile>,
) -> Pod {
    let mut standby = BTreeMap::new();
    standby.insert(STANDBY_DIR_ENV.to_owned(), STANDBY_PATH.to_owned());
    let env = env_vars(s, standby, &secret_name_of(name));
    let volume = Volume {
        name: STANDBY_VOLUME.into(),
        projected: Some(ProjectedVolumeSource {
            sources: Some(vec![
                VolumeProjection {
                    downward_api: Some(DownwardAPIProjection {
                        items: Some(vec![DownwardAPIVolumeFile {
                            path: STANDBY_ENVIRONMENT_FILE.into(),
                            field_ref: Some(ObjectFieldSelector {
                                field_path: format!(
                                    "metadata.annotations['{}']",
                                    s.codec.key(warm::ENVIRONMENT_KEY)
                                ),
                                ..ObjectFieldSelector::default()
                            }),
                            ..DownwardAPIVolumeFile::default()
                        }]),
                    }),
                    ..VolumeProjection::default()
                },
                VolumeProjection {
                    secret: Some(SecretProjection {
                        name: secret_name_of(name),
                        optional: Some(true),
                        items: Some(vec![KeyToPath {
                            key: CAPABILITY_KEY.into(),
                            path: STANDBY_CAPABILITY_FILE.into(),
                            ..KeyToPath::default()
                        }]),
                    }),
                    ..VolumeProjection::default()
                },
            ]),
            ..ProjectedVolumeSource::default()
        }),
        ..Volume::default()
    };
    let mount = VolumeMount {
        name: STANDBY_VOLUME.into(),
        mount_path: STANDBY_PATH.into(),
        read_only: Some(true),
        ..VolumeMount::default()
    };
    let mut pod = executor_pod(s, profile, env, Some((volume, mount)));
    let mut labels = app_labels(COMPONENT_EXECUTOR);
    labels.insert(s.codec.key(keys::BACKEND), Backend::Pod.as_str().to_owned());
    labels.insert(s.codec.key(warm::WARM_KEY), warm::UNCLAIMED.to_owned());
    pod.metadata.name = Some(name.to_owned());
    pod.metadata.labels = Some(labels);
    pod.metadata.annotations = profile_label
        .map(|label| BTreeMap::from([(s.codec.key(warm::PROFILE_KEY), label.to_owned())]));
    pod
}

/// The merge patch by which `spec`'s job claims the warm Pod seen at `resource_version`
/// (the precondition: a Pod changed since, claimed or being deleted, is not claimed), at
/// `now` (Unix seconds) when the Pod started `age` seconds ago: the assignment's metadata,
/// `<prefix>warm=claimed`, the environment its executor waits for, and the active deadline
/// counted from the claim.
pub fn claim_patch(
    s: &KubernetesSettings,
    spec: &ExecutorSpec,
    resource_version: &str,
    now: u64,
    age: u64,
) -> Value {
    let mut labels = spec.metadata.labels.clone();
    labels.insert(s.codec.key(warm::WARM_KEY), warm::CLAIMED.to_owned());
    let environment: BTreeMap<&str, String> = spec
        .environment()
        .into_iter()
        .filter(|(name, _)| *name != env::CAPABILITY)
        .collect();
    let mut annotations = spec.metadata.annotations.clone();
    annotations.insert(
        s.codec.key(warm::ENVIRONMENT_KEY),
        serde_json::to_string(&environment).unwrap_or_default(),
    );
    annotations.insert(s.codec.key(warm::CLAIMED_AT_KEY), now.to_string());
    let deadline = active_deadline_seconds(s.active_deadline)
        .saturating_add(i64::try_from(age).unwrap_or(i64::MAX));
    json!({
        "metadata": {
            "resourceVersion": resource_version,
            "labels": labels,
            "annotations": annotations,
        },
        "spec": { "activeDeadlineSeconds": deadline },
    })
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

/// The capability Secret of the warm Pod `pod_name` a job claimed: named after the Pod,
/// whose projected volume waits for it, and owned by it from the start (the Pod exists).
pub fn claimed_capability_secret(
    s: &KubernetesSettings,
    spec: &ExecutorSpec,
    pod_name: &str,
    pod_uid: &str,
) -> Secret {
    let mut secret = capability_secret(s, spec);
    secret.metadata.name = Some(secret_name_of(pod_name));
    secret.metadata.owner_references = Some(vec![owner(pod_name, pod_uid)]);
    secret
}

fn owner(pod_name: &str, pod_uid: &str) -> OwnerReference {
    OwnerReference {
        api_version: "v1".into(),
        kind: "Pod".into(),
        name: pod_name.to_owned(),
        uid: pod_uid.to_owned(),
        controller: Some(true),
        block_owner_deletion: None,
    }
}

/// The merge patch making `pod` the owner of its Secret.
pub fn owner_patch(pod_name: &str, pod_uid: &str) -> Value {
    json!({ "metadata": { "ownerReferences": [owner(pod_name, pod_uid)] } })
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

#[cfg(test)]
mod tests {
    use gdr_core::identity::TrustDomain;
    use gdr_testkit::backend_contract::task_spec;

    use super::*;

    fn settings() -> KubernetesSettings {
        KubernetesSettings::new(
            "executor@sha256:00",
            TrustDomain::new("example.org").unwrap(),
            "c",
            "k",
        )
    }

    /// DESIGN invariant 14 (issue 39 item 5): a warm Pod holds nothing of a job — no
    /// assignment variable, no capability reference, no assignment label — and waits on
    /// its own Secret, optional until a claim creates it.
    #[test]
    fn a_warm_pod_carries_no_assignment_and_no_capability_invariant_14() {
        let s = settings();
        let pod = warm_pod(&s, "gitea-warm-1", None, None);
        let container = &pod.spec.as_ref().unwrap().containers[0];
        let env: Vec<&EnvVar> = container.env.iter().flatten().collect();
        assert!(
            env.iter()
                .all(|v| !env::ASSIGNMENT.contains(&v.name.as_str())),
            "{env:?}"
        );
        assert!(env.iter().all(|v| v.value_from.is_none()), "{env:?}");
        let labels = pod.metadata.labels.clone().unwrap();
        assert_eq!(labels[&s.codec.key(warm::WARM_KEY)], warm::UNCLAIMED);
        assert!(!labels.contains_key(&s.codec.key(keys::RUNNER)));
        assert!(!labels.contains_key(&s.codec.key(keys::ASSIGNMENT_ID)));
        assert!(pod.spec.as_ref().unwrap().active_deadline_seconds.is_none());
        let volume = pod
            .spec
            .as_ref()
            .unwrap()
            .volumes
            .iter()
            .flatten()
            .find(|v| v.name == STANDBY_VOLUME)
            .unwrap();
        let secret = volume
            .projected
            .as_ref()
            .unwrap()
            .sources
            .iter()
            .flatten()
            .find_map(|p| p.secret.clone())
            .unwrap();
        assert_eq!(secret.name, "gitea-warm-1-capability");
        assert_eq!(secret.optional, Some(true));
    }

    /// DESIGN invariant 8 (issue 39 item 5): a member carries the fingerprint of its
    /// template, the same for every member of one profile under one configuration, and
    /// another one once the image, the profile or the resources change.
    #[test]
    fn a_warm_pods_fingerprint_follows_its_template_not_its_name_invariant_8() {
        let s = settings();
        let key = s.codec.key(warm::TEMPLATE_KEY);
        let of = |pod: &Pod| pod.metadata.annotations.as_ref().unwrap()[&key].clone();
        let a = of(&warm_pod(&s, "gitea-warm-1", None, None));
        assert_eq!(a, of(&warm_pod(&s, "gitea-warm-2", None, None)));
        assert_eq!(a, warm_template_fingerprint(&s, None, None));
        let mut upgraded = settings();
        upgraded.image = "executor@sha256:01".into();
        assert_ne!(a, of(&warm_pod(&upgraded, "gitea-warm-1", None, None)));
        let large = PodProfile {
            warm_pool: 1,
            ..PodProfile::default()
        };
        let profiled = of(&warm_pod(&s, "gitea-warm-1", Some("large"), Some(&large)));
        assert_ne!(a, profiled);
        assert_eq!(
            profiled,
            warm_template_fingerprint(&s, Some("large"), Some(&large))
        );
    }

    /// DESIGN invariants 8 and 14: the claim is conditional on the member as seen, writes
    /// the assignment's metadata and `warm=claimed`, hands over the `CI_*` variables but
    /// never the capability, and counts the active deadline from the claim.
    #[test]
    fn a_claim_is_conditional_on_the_members_version_and_never_carries_the_capability_invariant_8()
    {
        let s = settings();
        let spec = task_spec(7, "[self-hosted, pod]", "https://facade:8443");
        let patch = claim_patch(&s, &spec, "42", 1000, 30);
        assert_eq!(patch["metadata"]["resourceVersion"], "42");
        assert_eq!(
            patch["metadata"]["labels"][s.codec.key(warm::WARM_KEY)],
            warm::CLAIMED
        );
        assert_eq!(
            patch["metadata"]["labels"][s.codec.key(keys::ASSIGNMENT_ID)],
            "gitea-task-7"
        );
        let environment: BTreeMap<String, String> = serde_json::from_str(
            patch["metadata"]["annotations"][s.codec.key(warm::ENVIRONMENT_KEY)]
                .as_str()
                .unwrap(),
        )
        .unwrap();
        assert_eq!(environment[env::ASSIGNMENT_ID], "gitea-task-7");
        assert!(!environment.contains_key(env::CAPABILITY));
        assert!(!patch.to_string().contains(spec.capability.expose()));
        assert_eq!(
            patch["spec"]["activeDeadlineSeconds"],
            active_deadline_seconds(s.active_deadline) + 30
        );
    }
}
