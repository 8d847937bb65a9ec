//! The Kubernetes Pod backend through the real `kube` client against the fake API server,
//! with the fake kubelet running Pods as local processes (the real executor binary and the
//! stand-in runner) and the fake SPIRE agent issuing SVIDs only to Pods a
//! ClusterStaticEntry selects. Also the backend contract suite for the Pod backend.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Extension;
use gdr_backends::kubernetes::{KubernetesBackend, KubernetesSettings, PodProfile};
use gdr_core::backend::Backend;
use gdr_core::executor::{
    Binding, ExecutorBackend, ExecutorError, ExecutorSpec, IdentityTarget, Phase,
};
use gdr_core::identity::TrustDomain;
use gdr_identity::tls::{PeerSpiffeId, facade_server_config, x509_source_with_timeout};
use gdr_testkit::backend_contract::{self, Contract, FACADE_ID, TRUST_DOMAIN, task_spec as spec};
use gdr_testkit::fake_kube::{self, ResourceType, RunningFakeKube, ServiceAccount};
use gdr_testkit::fake_kubelet::{FakeKubelet, KubeletConfig, secret_value};
use gdr_testkit::fake_spire::FakeSpireAgent;
use gdr_testkit::spiffe::{FakeWorkloadApi, RunningWorkloadApi, TestCa};
use http::{Method, StatusCode};
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::{DeleteParams, PostParams};
use serde_json::{Value, json};
use tokio::time::Instant;

const NS: &str = "ci";
const CLUSTER: &str = "test-cluster";
const CLASS: &str = "spire-mgmt";
const IMAGE: &str = "registry.example/gitea-dynamic-runner@sha256:0000000000000000000000000000000000000000000000000000000000000000";
const EXECUTOR: &str = env!("CARGO_BIN_EXE_gitea-dynamic-runner");
const STANDIN: &str = env!("CARGO_BIN_EXE_gitea-runner-standin");
/// Generous: reached only when the behaviour under test is broken.
const DEADLINE: Duration = Duration::from_secs(30);

struct Cluster {
    fake: RunningFakeKube,
    kubelet: FakeKubelet,
    spire: Arc<FakeSpireAgent>,
    ca: TestCa,
    _dir: tempfile::TempDir,
}

async fn cluster() -> Cluster {
    let fake = cluster_api().await;
    let dir = tempfile::Builder::new().prefix("k").tempdir().unwrap();
    let ca = TestCa::new(TRUST_DOMAIN).unwrap();
    let node_name = "node-a";
    let node_labels = BTreeMap::from([("kubernetes.io/hostname".to_owned(), node_name.to_owned())]);
    // The agent's ID names the Node's UID: register the Node first, as a real node's
    // kubelet does before its SPIRE agent attests.
    let node_uid = FakeKubelet::register_node(fake.client().unwrap(), node_name, &node_labels)
        .await
        .unwrap();
    let agent_id = format!("spiffe://{TRUST_DOMAIN}/spire/agent/k8s_psat/{CLUSTER}/{node_uid}");
    let spire = Arc::new(FakeSpireAgent::start(
        fake.client().unwrap(),
        ca.clone(),
        &agent_id,
        CLASS,
        &dir.path().join("s"),
    ));
    let config = KubeletConfig {
        node_name: node_name.into(),
        node_labels,
        images: BTreeMap::from([(IMAGE.to_owned(), PathBuf::from(EXECUTOR))]),
        root: dir.path().join("p"),
        spire: Some(spire.clone()),
    };
    let kubelet = FakeKubelet::start(fake.client().unwrap(), config)
        .await
        .unwrap();
    Cluster {
        fake,
        kubelet,
        spire,
        ca,
        _dir: dir,
    }
}

fn settings() -> KubernetesSettings {
    let mut s = KubernetesSettings::new(
        IMAGE,
        TrustDomain::new(TRUST_DOMAIN).unwrap(),
        CLUSTER,
        CLASS,
    );
    s.namespace = NS.into();
    s.extra_env = BTreeMap::from([("GITEA_RUNNER_BINARY".to_owned(), STANDIN.to_owned())]);
    s.maxima = BTreeMap::from([("memory".to_owned(), "8Gi".to_owned())]);
    let mut large = PodProfile::default();
    large.resources.limits.insert("memory".into(), "4Gi".into());
    large
        .node_selector
        .insert("gdr.test/size".into(), "large".into());
    s.profiles.insert("large".into(), large);
    s.profiles.insert("gpu".into(), PodProfile::default());
    s
}

/// The fake API server enforcing the shipped RBAC, the controller's Role applied in the
/// executor namespace too (as an operator deploying executors to `NS` does).
async fn cluster_api() -> RunningFakeKube {
    let fake = fake_kube::start().await.unwrap();
    fake.handle.enforce_shipped_rbac(&[("gitea-actions", NS)]);
    fake
}

/// The backend as the controller runs it: as the controller's service account.
fn backend(fake: &RunningFakeKube, settings: KubernetesSettings) -> Arc<KubernetesBackend> {
    let client = fake.client_as(&ServiceAccount::controller()).unwrap();
    Arc::new(KubernetesBackend::new(client, settings).unwrap())
}

fn pod_spec(task: i64, runs_on: &str) -> ExecutorSpec {
    spec(task, runs_on, "https://127.0.0.1:9")
}

/// Re-reads the executor each time the backend's watch signals a change, until `check`
/// accepts it: proves the watch wakes callers (a dead watch ends at the deadline).
async fn wait_for<T>(
    backend: &KubernetesBackend,
    spec: &ExecutorSpec,
    what: &str,
    mut check: impl FnMut(Option<&gdr_core::executor::ExecutorRecord>) -> Option<T>,
) -> T {
    let mut changes = backend.changes();
    let deadline = Instant::now() + DEADLINE;
    loop {
        changes.borrow_and_update();
        let record = backend.find(spec.assignment.id()).await.unwrap();
        if let Some(v) = check(record.as_ref()) {
            return v;
        }
        tokio::time::timeout_at(deadline, changes.changed())
            .await
            .unwrap_or_else(|_| panic!("timed out waiting for {what}; last: {record:?}"))
            .unwrap();
    }
}

async fn until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + DEADLINE;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn pod_uid(record: &gdr_core::executor::ExecutorRecord) -> String {
    match &record.identity_target {
        Some(IdentityTarget::PodUid(u)) => u.clone(),
        other => panic!("no Pod UID: {other:?}"),
    }
}

// ----- the contract suite -------------------------------------------------------------------

/// DESIGN invariants 8–10: the Pod backend keeps it; a new backend instance over the same
/// API server is a restarted controller (Pods, markers and entries live on the cluster).
#[tokio::test]
async fn the_pod_backend_keeps_the_backend_contract() {
    let fake = cluster_api().await;
    // Nothing schedules these Pods: a fixed agent ID lets the entry name its parent
    // without a Node.
    let mut fixed_parent = settings();
    fixed_parent.spire_agent_id = Some(format!("spiffe://{TRUST_DOMAIN}/spire/agent/fixed"));
    let make = || backend(&fake, fixed_parent.clone()) as Arc<dyn ExecutorBackend>;
    backend_contract::run(make, &Contract::new(Backend::Pod, 300)).await;
    assert!(
        fake.handle
            .objects(&ResourceType::secrets(), Some(NS))
            .is_empty(),
        "capability Secrets went with their Pods"
    );
}

// ----- the Pod ------------------------------------------------------------------------------

/// DESIGN invariants 11, 14 and the compatibility contract: the Pod is named after the
/// assignment, carries the codec's metadata and the Go version's spec, and its capability
/// is readable only through its own Secret (owned by the Pod), never through `pods/get`.
#[tokio::test]
async fn the_pod_carries_the_contract_metadata_and_spec_and_its_capability_only_in_its_own_secret()
{
    let fake = cluster_api().await;
    let b = backend(&fake, settings());
    let spec = pod_spec(42, "[self-hosted, pod]");
    b.create(&spec).await.unwrap();
    let pod = fake
        .handle
        .object(&ResourceType::pods(), NS, "gitea-task-42")
        .expect("Pod named after the assignment");
    let labels = &pod["metadata"]["labels"];
    for (k, v) in [
        ("ci.ddupan.top/assignment-id", "gitea-task-42"),
        ("ci.ddupan.top/task-id", "42"),
        ("ci.ddupan.top/backend", "pod"),
        ("ci.ddupan.top/runner", "true"),
        ("app.kubernetes.io/name", "gitea-dynamic-runner"),
        ("app.kubernetes.io/component", "executor"),
    ] {
        assert_eq!(labels[k], v, "label {k}");
    }
    let annotations = &pod["metadata"]["annotations"];
    assert_eq!(annotations["ci.ddupan.top/repository"], "owner/repo");
    assert_eq!(annotations["ci.ddupan.top/job-key"], "build");
    assert_eq!(
        annotations["ci.ddupan.top/spiffe-id"],
        "spiffe://example.org/ci/owner/repo/branch/main/build"
    );
    assert_eq!(annotations["ci.ddupan.top/ref"], "branch:main");
    let s = &pod["spec"];
    assert_eq!(s["restartPolicy"], "Never");
    assert_eq!(s["serviceAccountName"], "gitea-task-executor");
    assert_eq!(s["automountServiceAccountToken"], false);
    assert_eq!(s["activeDeadlineSeconds"], 3 * 3600 + 600);
    let c = &s["containers"][0];
    assert_eq!(
        (c["name"].as_str(), c["image"].as_str()),
        (Some("executor"), Some(IMAGE))
    );
    assert_eq!(c["args"], json!(["executor"]));
    // A privileged Pod's executor starts as root and runs the job as pod_executor_uid;
    // the privileged part, the job's Docker daemon, is its `dockerd` sidecar's (issue 37
    // item 3), so the executor keeps only what dropping to that user needs.
    assert_eq!(c["securityContext"]["privileged"], false);
    assert_eq!(c["securityContext"]["runAsUser"], 0);
    assert_eq!(
        c["securityContext"]["capabilities"],
        json!({ "drop": ["ALL"], "add": ["SETUID", "SETGID", "KILL"] })
    );
    let sidecar = &s["initContainers"][0];
    assert_eq!(sidecar["name"], "dockerd");
    assert_eq!(sidecar["image"], IMAGE);
    assert_eq!(sidecar["restartPolicy"], "Always", "a native sidecar");
    assert_eq!(sidecar["securityContext"]["privileged"], true);
    assert!(
        !sidecar.to_string().contains("CI_RUNNER_CAPABILITY"),
        "the daemon's container gets no capability"
    );
    let socket_dir = |c: &Value| {
        c["volumeMounts"]
            .as_array()
            .unwrap()
            .iter()
            .any(|m| m["name"] == "docker-socket" && m["mountPath"] == "/run/docker-socket")
    };
    assert!(
        socket_dir(c) && socket_dir(sidecar),
        "both mount the socket's volume"
    );
    let env: BTreeMap<String, Value> = c["env"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["name"].as_str().unwrap().to_owned(), e.clone()))
        .collect();
    assert_eq!(env["CI_RUNNER_UID"]["value"], "2000");
    assert_eq!(env["CI_DOCKER_EXTERNAL"]["value"], "true");
    assert_eq!(
        env["CI_DOCKER_SOCKET"]["value"],
        "/run/docker-socket/docker.sock"
    );
    assert_eq!(
        env["SPIFFE_ENDPOINT_SOCKET"]["value"],
        "unix:///run/spire/agent-sockets/spire-agent.sock"
    );
    assert_eq!(env["CI_ASSIGNMENT_ID"]["value"], "gitea-task-42");
    assert_eq!(env["CI_RUNNER_BACKEND"]["value"], "pod");
    assert_eq!(
        env["CI_RUNNER_CAPABILITY"]["valueFrom"]["secretKeyRef"],
        json!({ "name": "gitea-task-42-capability", "key": "capability", "optional": false })
    );
    let mounts = c["volumeMounts"].as_array().unwrap();
    assert!(
        mounts
            .iter()
            .any(|m| m["mountPath"] == "/run/spire/agent-sockets" && m["readOnly"] == true)
    );
    assert!(
        !mounts.iter().any(|m| m["mountPath"] == "/var/lib/docker"),
        "Docker's storage is the sidecar's"
    );
    let volumes = s["volumes"].as_array().unwrap();
    assert!(
        volumes
            .iter()
            .any(|v| v["csi"] == json!({ "driver": "csi.spiffe.io", "readOnly": true }))
    );
    assert!(volumes.iter().any(|v| v["emptyDir"]["sizeLimit"] == "20Gi"));

    let capability = spec.capability.expose();
    assert!(
        !pod.to_string().contains(capability),
        "the capability is readable through pods/get"
    );
    let secret = fake
        .handle
        .object(&ResourceType::secrets(), NS, "gitea-task-42-capability")
        .expect("capability Secret");
    assert_eq!(
        secret_value(&secret, "capability").as_deref(),
        Some(capability)
    );
    assert_eq!(
        secret["metadata"]["ownerReferences"][0]["uid"], pod["metadata"]["uid"],
        "owned by its Pod"
    );
    // Deleted with its Pod, by Kubernetes, whoever deletes the Pod.
    let pods: Api<Pod> = Api::namespaced(fake.client().unwrap(), NS);
    pods.delete("gitea-task-42", &DeleteParams::default())
        .await
        .unwrap();
    assert!(
        fake.handle
            .object(&ResourceType::secrets(), NS, "gitea-task-42-capability")
            .is_none()
    );
}

/// A job's extra runs-on label selects its profile (resources, node selector); an unknown
/// label or two profiles are refused permanently, naming the labels, and create nothing.
#[tokio::test]
async fn profiles_apply_and_an_unknown_label_or_two_profiles_are_refused_naming_the_labels() {
    let fake = cluster_api().await;
    let b = backend(&fake, settings());
    assert_eq!(b.profile_labels(), ["gpu", "large"]);
    for (runs_on, names) in [
        ("[self-hosted, pod, arm64]", vec!["arm64"]),
        ("[self-hosted, pod, large, gpu]", vec!["large", "gpu"]),
    ] {
        match b.create(&pod_spec(7, runs_on)).await {
            Err(ExecutorError::Permanent(e)) => {
                for n in names {
                    assert!(e.to_string().contains(&format!("{n:?}")), "{e}");
                }
            }
            other => panic!("expected a permanent refusal for {runs_on}, got {other:?}"),
        }
    }
    assert!(fake.handle.objects(&ResourceType::pods(), None).is_empty());
    assert!(
        fake.handle
            .objects(&ResourceType::secrets(), None)
            .is_empty()
    );
    b.create(&pod_spec(8, "[self-hosted, pod, large]"))
        .await
        .unwrap();
    let pod = fake
        .handle
        .object(&ResourceType::pods(), NS, "gitea-task-8")
        .unwrap();
    assert_eq!(pod["spec"]["nodeSelector"]["gdr.test/size"], "large");
    assert_eq!(
        pod["spec"]["containers"][0]["resources"]["limits"]["memory"],
        "4Gi"
    );
}

// ----- phases through the fake kubelet ------------------------------------------------------

/// DESIGN invariant 12: a Pod stuck pulling its image reports `ImagePullBackOff` with the
/// kubelet's message, and the backend's watch wakes the caller when it appears.
#[tokio::test]
async fn an_image_that_cannot_be_pulled_is_reported_as_image_pull_back_off_with_its_message() {
    let c = cluster().await;
    let mut s = settings();
    s.image = "registry.example/missing:latest".into();
    let b = backend(&c.fake, s);
    let spec = pod_spec(11, "[self-hosted, pod]");
    b.create(&spec).await.unwrap();
    let reason = wait_for(&b, &spec, "ImagePullBackOff", |r| match &r?.phase {
        Phase::Starting { reason: Some(r) } if r.starts_with("ImagePullBackOff") => Some(r.clone()),
        _ => None,
    })
    .await;
    assert!(
        reason.contains("Back-off pulling image \"registry.example/missing:latest\""),
        "{reason}"
    );
    let _ = &c.kubelet;
}

/// DESIGN invariant 12: a Pod no node can take reports `Unschedulable` with the scheduler's
/// message, and identity binding waits for it to be scheduled.
#[tokio::test]
async fn an_unschedulable_pod_reports_the_schedulers_message_and_binding_waits() {
    let c = cluster().await;
    let b = backend(&c.fake, settings());
    // The `large` profile selects nodes this cluster does not have.
    let spec = pod_spec(12, "[self-hosted, pod, large]");
    let record = b.create(&spec).await.unwrap();
    let reason = wait_for(&b, &spec, "Unschedulable", |r| match &r?.phase {
        Phase::Starting { reason: Some(r) } if r.starts_with("Unschedulable") => Some(r.clone()),
        _ => None,
    })
    .await;
    assert!(
        reason.contains("didn't match Pod's node affinity/selector"),
        "{reason}"
    );
    match b.bind_identity(&record).await.unwrap() {
        Binding::NotReady(why) => assert!(why.contains("Unschedulable"), "{why}"),
        Binding::Bound => panic!("bound before scheduling"),
    }
    assert!(
        c.fake
            .handle
            .objects(&ResourceType::cluster_static_entries(), None)
            .is_empty()
    );
}

// ----- identity -----------------------------------------------------------------------------

/// A stand-in facade: an mTLS server of the trust domain recording each peer's SPIFFE ID.
struct Facade {
    url: String,
    peers: Arc<Mutex<Vec<String>>>,
    connections: Arc<AtomicUsize>,
    _api: RunningWorkloadApi,
    _stop: gdr_controller::shutdown::ShutdownGuard,
}

async fn facade(c: &Cluster) -> Facade {
    let api = FakeWorkloadApi::start(c._dir.path(), c.ca.clone(), FACADE_ID)
        .await
        .unwrap();
    let source = x509_source_with_timeout(&api.endpoint(), DEADLINE)
        .await
        .unwrap();
    let tls = Arc::new(facade_server_config(&source, TRUST_DOMAIN).unwrap());
    let peers = Arc::new(Mutex::new(Vec::new()));
    let seen = peers.clone();
    let app = axum::Router::new().fallback(move |peer: Option<Extension<PeerSpiffeId>>| {
        let seen = seen.clone();
        async move {
            if let Some(Extension(PeerSpiffeId(id))) = peer {
                seen.lock().unwrap().push(id);
            }
            StatusCode::NOT_FOUND
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    // Counts TCP connections in front of the TLS server: "reaches nothing" means none.
    let connections = Arc::new(AtomicUsize::new(0));
    let inner = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let inner_addr = inner.local_addr().unwrap();
    let counted = connections.clone();
    tokio::spawn(async move {
        while let Ok((mut client, _)) = listener.accept().await {
            counted.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                if let Ok(mut server) = tokio::net::TcpStream::connect(inner_addr).await {
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                }
            });
        }
    });
    let (stop, stopped) = gdr_controller::shutdown::shutdown_channel();
    let stop = stop.into_guard();
    tokio::spawn(async move {
        let _source = source;
        gdr_facade::tls::serve_tls(inner, tls, app, stopped).await
    });
    Facade {
        url: format!("https://{addr}"),
        peers,
        connections,
        _api: api,
        _stop: stop,
    }
}

/// DESIGN invariants 8 and 13: the executor asks the SPIRE agent for its SVID and is
/// refused while no entry selects its Pod, reaches nothing meanwhile, and reaches the
/// facade with the job's SPIFFE ID as soon as the entry (parent = the Node's agent ID,
/// selector = the Pod UID, class = the controller manager's) is bound.
#[tokio::test]
async fn an_executor_reaches_the_facade_with_the_jobs_identity_only_once_its_entry_is_bound() {
    let c = cluster().await;
    let f = facade(&c).await;
    // Unprivileged: no Docker daemon sidecar (this cluster has no dockerd for it), so the
    // runner starts, and its first call to the facade shows the identity it presents.
    let mut s = settings();
    s.privileged = false;
    let b = backend(&c.fake, s);
    let spec = spec(21, "[self-hosted, pod]", &f.url);
    let record = b.create(&spec).await.unwrap();
    let uid = pod_uid(&record);
    wait_for(&b, &spec, "Running", |r| {
        matches!(r?.phase, Phase::Running).then_some(())
    })
    .await;
    until("the executor asked the agent for its SVID", || {
        c.spire.fetches(&uid) > 0
    })
    .await;
    assert_eq!(c.spire.identity_of(&uid), None);
    assert_eq!(
        f.connections.load(Ordering::SeqCst),
        0,
        "reached the facade without an identity"
    );
    assert!(!record.identity_bound);

    assert_eq!(b.bind_identity(&record).await.unwrap(), Binding::Bound);
    assert_eq!(
        b.bind_identity(&record).await.unwrap(),
        Binding::Bound,
        "binding is idempotent"
    );
    let entry = c
        .fake
        .handle
        .object(&ResourceType::cluster_static_entries(), "", "gitea-task-21")
        .expect("entry named after the assignment");
    assert_eq!(
        entry["spec"],
        json!({
            "spiffeID": "spiffe://example.org/ci/owner/repo/branch/main/build",
            "parentID": c.spire.agent_id(),
            "selectors": [format!("k8s:pod-uid:{uid}")],
            "className": CLASS,
        })
    );
    assert!(
        c.spire.agent_id().ends_with(c.kubelet.node_uid()),
        "parent is the scheduled Node's agent"
    );
    assert_eq!(
        entry["metadata"]["labels"]["ci.ddupan.top/assignment-id"],
        "gitea-task-21"
    );
    until("the facade saw the job's identity", || {
        f.peers
            .lock()
            .unwrap()
            .iter()
            .any(|p| p == "spiffe://example.org/ci/owner/repo/branch/main/build")
    })
    .await;
    assert!(
        b.find(spec.assignment.id())
            .await
            .unwrap()
            .unwrap()
            .identity_bound
    );

    // Deleting removes the entry first: the agent takes the identity away.
    b.delete(spec.assignment.id()).await.unwrap();
    let order: Vec<String> = c
        .fake
        .handle
        .requests()
        .into_iter()
        .filter(|r| r.starts_with("DELETE"))
        .collect();
    assert!(
        order[0].contains("clusterstaticentries/gitea-task-21")
            && order[1].contains("pods/gitea-task-21"),
        "{order:?}"
    );
    until("the Pod's process is gone", || {
        c.kubelet.pid(&uid).is_none()
    })
    .await;
}

/// DESIGN invariant 13: an executor whose entry is never bound gets no SVID, reaches
/// nothing, and ends failed at `identity_deadline`, reported with the container's exit
/// and its error (the termination message falls back to the log's last line).
#[tokio::test]
async fn an_executor_whose_entry_is_never_bound_reaches_nothing_and_ends_failed() {
    let c = cluster().await;
    let f = facade(&c).await;
    let mut s = settings();
    s.identity_deadline = Duration::from_secs(2);
    let b = backend(&c.fake, s);
    let spec = spec(22, "[self-hosted, pod]", &f.url);
    let record = b.create(&spec).await.unwrap();
    let reason = wait_for(&b, &spec, "the executor to fail", |r| match &r?.phase {
        Phase::Finished {
            success: false,
            reason,
        } => Some(reason.clone().unwrap_or_default()),
        _ => None,
    })
    .await;
    assert!(reason.contains("exit code"), "{reason}");
    assert!(
        reason.contains("gave no X.509-SVID"),
        "the executor's error is the reason: {reason}"
    );
    assert!(
        c.spire.fetches(&pod_uid(&record)) > 0,
        "it did ask for an SVID"
    );
    assert_eq!(
        f.connections.load(Ordering::SeqCst),
        0,
        "it reached the facade"
    );
    assert!(f.peers.lock().unwrap().is_empty());
}

/// An existing entry with another spec is an error and is left alone (never re-pointed).
#[tokio::test]
async fn an_existing_entry_with_another_spec_is_refused_and_left_unchanged() {
    let c = cluster().await;
    let b = backend(&c.fake, settings());
    let spec = pod_spec(23, "[self-hosted, pod]");
    let record = b.create(&spec).await.unwrap();
    wait_for(&b, &spec, "scheduling", |r| {
        matches!(r?.phase, Phase::Running | Phase::Finished { .. }).then_some(())
    })
    .await;
    let entries: Api<kube::api::DynamicObject> = Api::all_with(
        c.fake.client().unwrap(),
        &kube::api::ApiResource::from_gvk_with_plural(
            &kube::api::GroupVersionKind::gvk("spire.spiffe.io", "v1alpha1", "ClusterStaticEntry"),
            "clusterstaticentries",
        ),
    );
    let foreign = json!({ "spiffeID": "spiffe://example.org/ci/other/repo/deploy", "parentID": c.spire.agent_id(), "selectors": [format!("k8s:pod-uid:{}", pod_uid(&record))], "className": CLASS });
    entries
        .create(
            &PostParams::default(),
            &kube::api::DynamicObject::new(
                "gitea-task-23",
                &kube::api::ApiResource::from_gvk_with_plural(
                    &kube::api::GroupVersionKind::gvk(
                        "spire.spiffe.io",
                        "v1alpha1",
                        "ClusterStaticEntry",
                    ),
                    "clusterstaticentries",
                ),
            )
            .data(json!({ "spec": foreign.clone() })),
        )
        .await
        .unwrap();
    match b.bind_identity(&record).await {
        Err(ExecutorError::Permanent(e)) => {
            assert!(e.to_string().contains("refusing to re-point"), "{e}")
        }
        other => panic!("expected a permanent error, got {other:?}"),
    }
    let entry = c
        .fake
        .handle
        .object(&ResourceType::cluster_static_entries(), "", "gitea-task-23")
        .unwrap();
    assert_eq!(entry["spec"], foreign);
}

// ----- lifecycle and recovery ---------------------------------------------------------------

/// DESIGN invariant 12: a Pod deleted by someone else mid-job is seen as gone (`find`
/// answers `None`, `list` omits it), its process is killed, and the sweep removes its entry.
#[tokio::test]
async fn a_pod_deleted_by_someone_else_mid_job_is_gone_and_its_entry_is_swept() {
    let c = cluster().await;
    let b = backend(&c.fake, settings());
    let spec = pod_spec(31, "[self-hosted, pod]");
    let record = b.create(&spec).await.unwrap();
    let uid = pod_uid(&record);
    wait_for(&b, &spec, "Running", |r| {
        matches!(r?.phase, Phase::Running).then_some(())
    })
    .await;
    assert_eq!(b.bind_identity(&record).await.unwrap(), Binding::Bound);
    until("the process runs", || c.kubelet.pid(&uid).is_some()).await;
    let pid = c.kubelet.pid(&uid).unwrap();
    let pods: Api<Pod> = Api::namespaced(c.fake.client().unwrap(), NS);
    pods.delete("gitea-task-31", &DeleteParams::default())
        .await
        .unwrap();
    wait_for(&b, &spec, "the Pod to be gone", |r| {
        r.is_none().then_some(())
    })
    .await;
    until("the kubelet killed the process", || {
        !std::path::Path::new(&format!("/proc/{pid}")).exists()
            || std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .is_ok_and(|s| s.contains(") Z "))
    })
    .await;
    assert!(b.list().await.unwrap().is_empty());
    assert_eq!(
        b.sweep().await.unwrap(),
        gdr_backends::kubernetes::Sweep {
            entries: 1,
            secrets: 0
        }
    );
    assert!(
        c.fake
            .handle
            .objects(&ResourceType::cluster_static_entries(), None)
            .is_empty(),
        "the sweep removed the entry of the gone Pod"
    );
}

/// DESIGN invariants 7 and 9: after a restart a new backend instance finds and lists the
/// Pods with their markers — including a Pod written the way the Go controller writes it.
#[tokio::test]
async fn a_new_backend_instance_adopts_running_pods_with_their_markers_including_go_ones() {
    let c = cluster().await;
    let first = backend(&c.fake, settings());
    let claimed = pod_spec(41, "[self-hosted, pod]");
    let fresh = pod_spec(42, "[self-hosted, pod]");
    first.create(&claimed).await.unwrap();
    first.create(&fresh).await.unwrap();
    first.record_claimed(claimed.assignment.id()).await.unwrap();
    // The Go controller's Pod: same codec metadata, its own (smaller) spec.
    let go = pod_spec(43, "[self-hosted, pod]");
    let mut labels = go.metadata.labels.clone();
    labels.insert(
        "app.kubernetes.io/name".into(),
        "gitea-dynamic-runner".into(),
    );
    labels.insert("app.kubernetes.io/component".into(), "executor".into());
    let go_pod: Pod = serde_json::from_value(json!({
        "metadata": { "name": "gitea-task-43", "labels": labels, "annotations": go.metadata.annotations },
        "spec": { "restartPolicy": "Never", "containers": [{ "name": "executor", "image": IMAGE, "args": ["executor"] }] },
    })).unwrap();
    Api::<Pod>::namespaced(c.fake.client().unwrap(), NS)
        .create(&PostParams::default(), &go_pod)
        .await
        .unwrap();
    drop(first);

    let second = backend(&c.fake, settings());
    let listed = second.list().await.unwrap();
    let names: Vec<&str> = listed.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, ["gitea-task-41", "gitea-task-42", "gitea-task-43"]);
    assert!(listed[0].claimed && !listed[1].claimed && !listed[2].claimed);
    assert!(listed.iter().all(|r| !r.terminal));
    assert!(
        second.find(go.assignment.id()).await.unwrap().is_some(),
        "the Go controller's Pod is adopted"
    );
}

/// DESIGN invariant 12: `OOMKilled`, eviction and a lost node end the executor with the
/// real reason.
#[tokio::test]
async fn oom_kills_evictions_and_lost_nodes_end_the_executor_with_their_reasons() {
    let c = cluster().await;
    let b = backend(&c.fake, settings());
    let oom = pod_spec(51, "[self-hosted, pod]");
    let evicted = pod_spec(52, "[self-hosted, pod]");
    let (r1, r2) = (
        b.create(&oom).await.unwrap(),
        b.create(&evicted).await.unwrap(),
    );
    for s in [&oom, &evicted] {
        wait_for(&b, s, "Running", |r| {
            matches!(r?.phase, Phase::Running).then_some(())
        })
        .await;
    }
    until("both run", || {
        c.kubelet.pid(&pod_uid(&r1)).is_some() && c.kubelet.pid(&pod_uid(&r2)).is_some()
    })
    .await;
    c.kubelet.oom_kill(&pod_uid(&r1));
    c.kubelet
        .evict(&pod_uid(&r2), "The node was low on resource: memory.");
    let finished = |want: &'static str| {
        move |r: Option<&gdr_core::executor::ExecutorRecord>| match &r?.phase {
            Phase::Finished {
                success: false,
                reason: Some(reason),
            } if reason.starts_with(want) => Some(reason.clone()),
            _ => None,
        }
    };
    assert!(
        wait_for(&b, &oom, "OOMKilled", finished("OOMKilled"))
            .await
            .contains("exit code 137")
    );
    assert!(
        wait_for(&b, &evicted, "Evicted", finished("Evicted"))
            .await
            .contains("low on resource")
    );
    let lost = pod_spec(53, "[self-hosted, pod]");
    b.create(&lost).await.unwrap();
    wait_for(&b, &lost, "Running", |r| {
        matches!(r?.phase, Phase::Running).then_some(())
    })
    .await;
    c.kubelet.lose_node().await;
    wait_for(&b, &lost, "NodeLost", finished("NodeLost")).await;
}

// ----- the API server's answers -------------------------------------------------------------

/// Kubernetes errors map onto the contract: 403 is permanent and names the RBAC grant,
/// 409/429/5xx are retried, 422 is permanent with the server's message.
#[tokio::test]
async fn api_errors_map_to_retry_or_a_permanent_failure_naming_the_missing_grant() {
    let fake = cluster_api().await;
    // The kube client itself retries 429/503/504 (15 times, backing off up to 1000 s)
    // unless told not to; what is checked here is the backend's own mapping.
    let mut config = kube::Config::new(fake.url.parse().unwrap());
    config.default_retry = false;
    let client = kube::Client::try_from(config).unwrap();
    let b = Arc::new(KubernetesBackend::new(client, settings()).unwrap());
    let spec = pod_spec(61, "[self-hosted, pod]");
    let pods = format!("/api/v1/namespaces/{NS}/pods");
    fake.handle
        .fail_next(Method::POST, &pods, StatusCode::FORBIDDEN);
    match b.create(&spec).await {
        Err(ExecutorError::Permanent(e)) => {
            let text = e.to_string();
            assert!(
                text.contains("grant verb \"create\" on resource \"pods\"")
                    && text.contains(&format!("namespace \"{NS}\"")),
                "{text}"
            );
        }
        other => panic!("expected a permanent 403, got {other:?}"),
    }
    for code in [
        StatusCode::CONFLICT,
        StatusCode::TOO_MANY_REQUESTS,
        StatusCode::INTERNAL_SERVER_ERROR,
        StatusCode::SERVICE_UNAVAILABLE,
    ] {
        // Persistent: the kube client retries some codes itself before giving up.
        fake.handle.fail_always(Method::POST, &pods, code);
        assert!(
            matches!(b.create(&spec).await, Err(ExecutorError::Unavailable(_))),
            "{code} is retried"
        );
        fake.handle.clear_faults();
    }
    fake.handle
        .fail_next(Method::POST, &pods, StatusCode::UNPROCESSABLE_ENTITY);
    match b.create(&spec).await {
        Err(ExecutorError::Permanent(e)) => {
            assert!(
                e.to_string().contains("as invalid") && e.to_string().contains("injected fault"),
                "{e}"
            )
        }
        other => panic!("expected a permanent 422, got {other:?}"),
    }
    b.create(&spec)
        .await
        .expect("created once the faults are used up");
    fake.handle
        .fail_next(Method::GET, "/apis/spire.spiffe.io", StatusCode::FORBIDDEN);
    match b.find(spec.assignment.id()).await {
        Err(ExecutorError::Permanent(e)) => assert!(
            e.to_string().contains(
                "\"clusterstaticentries\" of API group \"spire.spiffe.io\" (cluster-wide)"
            ),
            "{e}"
        ),
        other => panic!("expected a permanent 403, got {other:?}"),
    }
}

/// The backend's Pod watch survives `410 Expired`: the watcher re-lists and changes keep
/// waking callers.
#[tokio::test]
async fn the_pod_watch_re_lists_after_410_and_keeps_waking_callers() {
    let c = cluster().await;
    let b = backend(&c.fake, settings());
    let first = pod_spec(71, "[self-hosted, pod]");
    b.create(&first).await.unwrap();
    wait_for(&b, &first, "Running", |r| {
        matches!(r?.phase, Phase::Running).then_some(())
    })
    .await;
    let watch_lists = || {
        c.fake
            .handle
            .requests()
            .iter()
            .filter(|r| {
                r.starts_with(&format!("GET /api/v1/namespaces/{NS}/pods?"))
                    && r.contains("limit=500")
            })
            .count()
    };
    let before = watch_lists();
    c.fake.handle.expire_watches();
    until("the watcher re-listed", || watch_lists() > before).await;
    let second = pod_spec(72, "[self-hosted, pod]");
    b.create(&second).await.unwrap();
    wait_for(&b, &second, "Running after the re-list", |r| {
        matches!(r?.phase, Phase::Running).then_some(())
    })
    .await;
}
