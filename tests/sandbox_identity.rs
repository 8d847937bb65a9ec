//! `sandbox-identity` against the fake Kubernetes API serving BatchSandbox, Pod and
//! ClusterStaticEntry objects, through the real `kube` client.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use gdr_backends::warm::{CLAIMED, UNCLAIMED, WARM_KEY};
use gdr_core::backend::Backend;
use gdr_core::metadata::{MetadataCodec, keys};
use gdr_sandbox_identity::{
    Metrics, Reconciler, Settings, batchsandbox_resource, entry_resource, pool_resource,
};
use gdr_testkit::fake_kube::{self, RunningFakeKube, ServiceAccount};
use gdr_testkit::{backend_contract, eventually};
use http::{Method, StatusCode};
use k8s_openapi::api::core::v1::{Container, Pod, PodSpec};
use kube::api::{DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::{Value, json};

const NS: &str = "opensandbox";
const DEADLINE: Duration = Duration::from_secs(20);
/// A job identity of the (default) ref scheme.
const JOB_A: &str = "spiffe://example.org/ci/octo-org/hello-world/branch/main/build";
/// A job identity of the job scheme, as the Go version's sandboxes carry: accepted too.
const JOB_B: &str = "spiffe://example.org/ci/octo-org/other-repo/deploy";

struct Cluster {
    fake: RunningFakeKube,
    /// The test's own (cluster admin): sets up sandboxes and Pods, inspects entries.
    client: Client,
    /// sandbox-identity's service account, under the shipped RBAC.
    identity: Client,
}

impl Cluster {
    async fn start() -> Self {
        let fake = fake_kube::start().await.unwrap();
        fake.handle.enforce_shipped_rbac(&[]);
        let client = Client::try_from(kube::Config::new(fake.url.parse().unwrap())).unwrap();
        let identity = fake.client_as(&ServiceAccount::sandbox_identity()).unwrap();
        let cluster = Cluster {
            fake,
            client,
            identity,
        };
        cluster.pool("ci-vm", None).await;
        cluster
    }

    /// Creates the Pool `name`, whose `spec.recycleStrategy.type` is `recycle` (`None`:
    /// none given, the CRD's default `Delete`).
    async fn pool(&self, name: &str, recycle: Option<&str>) {
        let mut spec = json!({
            "capacitySpec": {"bufferMax": 2, "bufferMin": 1, "poolMax": 4, "poolMin": 1},
        });
        if let Some(recycle) = recycle {
            spec["recycleStrategy"] = json!({ "type": recycle });
        }
        let pool = DynamicObject::new(name, &pool_resource()).data(json!({ "spec": spec }));
        self.pools()
            .create(&PostParams::default(), &pool)
            .await
            .unwrap();
    }

    fn pools(&self) -> Api<DynamicObject> {
        Api::namespaced_with(self.client.clone(), NS, &pool_resource())
    }

    fn settings() -> Settings {
        Settings::new(backend_contract::trust_domain())
    }

    fn reconciler(&self) -> Reconciler {
        self.reconciler_with(Self::settings(), Metrics::default())
    }

    fn reconciler_with(&self, settings: Settings, metrics: Metrics) -> Reconciler {
        Reconciler::new(self.identity.clone(), settings, metrics)
    }

    fn sandboxes(&self) -> Api<DynamicObject> {
        Api::namespaced_with(self.client.clone(), NS, &batchsandbox_resource())
    }

    fn entries_api(&self) -> Api<DynamicObject> {
        Api::all_with(self.client.clone(), &entry_resource())
    }

    fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.client.clone(), NS)
    }

    /// Creates Pod `name`; its UID.
    async fn pod(&self, name: &str) -> String {
        let pod = Pod {
            metadata: kube::api::ObjectMeta {
                name: Some(name.into()),
                ..Default::default()
            },
            spec: Some(PodSpec {
                containers: vec![Container {
                    name: "sandbox".into(),
                    image: Some("runner".into()),
                    ..Default::default()
                }],
                ..Default::default()
            }),
            ..Default::default()
        };
        let created = self
            .pods()
            .create(&PostParams::default(), &pod)
            .await
            .unwrap();
        created.metadata.uid.unwrap()
    }

    /// Creates a runner BatchSandbox holding `pods`, whose task asks for `spiffe_id`.
    async fn sandbox(&self, name: &str, pods: &[&str], spiffe_id: Option<&str>) {
        self.sandbox_with(name, pods, spiffe_id, BTreeMap::new())
            .await;
    }

    async fn sandbox_with(
        &self,
        name: &str,
        pods: &[&str],
        spiffe_id: Option<&str>,
        labels: BTreeMap<String, String>,
    ) {
        self.sandbox_of("ci-vm", name, pods, spiffe_id, labels)
            .await;
    }

    /// Creates a runner BatchSandbox of the Pool `pool` holding `pods`, whose task asks for
    /// `spiffe_id`, with `labels` besides the runner label.
    async fn sandbox_of(
        &self,
        pool: &str,
        name: &str,
        pods: &[&str],
        spiffe_id: Option<&str>,
        mut labels: BTreeMap<String, String>,
    ) {
        labels
            .entry("ci.ddupan.top/runner".into())
            .or_insert_with(|| "true".into());
        let env: Vec<Value> = spiffe_id
            .map(|id| json!({"name": "CI_SPIFFE_ID", "value": id}))
            .into_iter()
            .chain([json!({"name": "CI_ASSIGNMENT_ID", "value": "gitea-task-1"})])
            .collect();
        let mut object = DynamicObject::new(name, &batchsandbox_resource()).data(json!({
            "spec": {
                "replicas": 1,
                "poolRef": pool,
                "taskTemplate": {"spec": {"process": {"command": ["/bin/sh"], "env": env}}},
            }
        }));
        object.metadata.labels = Some(labels);
        object.metadata.annotations = Some(BTreeMap::from([(
            "sandbox.opensandbox.io/alloc-status".into(),
            json!({"pods": pods, "poolRef": pool}).to_string(),
        )]));
        self.sandboxes()
            .create(&PostParams::default(), &object)
            .await
            .unwrap();
    }

    async fn annotate(&self, sandbox: &str, key: &str, value: Value) {
        let patch = json!({"metadata": {"annotations": {key: value.to_string()}}});
        self.sandboxes()
            .patch(sandbox, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .unwrap();
    }

    /// Merge-patches the sandbox's labels (`null` removes one), as OpenSandbox's metadata
    /// patch does.
    async fn label(&self, sandbox: &str, labels: Value) {
        let patch = json!({"metadata": {"labels": labels}});
        self.sandboxes()
            .patch(sandbox, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .unwrap();
    }

    /// Every ClusterStaticEntry by name.
    async fn entries(&self) -> BTreeMap<String, DynamicObject> {
        self.entries_api()
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .into_iter()
            .map(|e| (e.metadata.name.clone().unwrap(), e))
            .collect()
    }

    /// (parentID, spiffeID) of every entry.
    async fn bindings(&self) -> Vec<(String, String)> {
        let mut all: Vec<(String, String)> = self
            .entries()
            .await
            .values()
            .map(|e| {
                (
                    e.data["spec"]["parentID"].as_str().unwrap().to_owned(),
                    e.data["spec"]["spiffeID"].as_str().unwrap().to_owned(),
                )
            })
            .collect();
        all.sort();
        all
    }
}

fn parent(uid: &str) -> String {
    format!("spiffe://example.org/spire/agent/k8s_psat/sandbox-kata/pod/{uid}")
}

/// DESIGN (components, sandbox-identity) and invariant 13: each Pod a runner sandbox holds
/// gets exactly one entry: parent the Pod's own in-VM agent, selector the runner UID, the
/// job's SPIFFE ID, the controller manager's class, labels naming sandbox and Pod.
/// Sandboxes without the runner label are not touched.
#[tokio::test]
async fn each_allocated_pod_gets_one_entry_bound_to_its_agent_and_the_runner_uid() {
    let cluster = Cluster::start().await;
    let uid1 = cluster.pod("ci-vm-1").await;
    let uid2 = cluster.pod("ci-vm-2").await;
    cluster.pod("other-1").await;
    cluster
        .sandbox("sb-a", &["ci-vm-1", "ci-vm-2"], Some(JOB_A))
        .await;
    cluster
        .sandbox_with(
            "not-ours",
            &["other-1"],
            Some(JOB_B),
            BTreeMap::from([("ci.ddupan.top/runner".into(), "false".into())]),
        )
        .await;
    let pass = cluster.reconciler().reconcile_once().await.unwrap();
    assert_eq!((pass.sandboxes, pass.created), (1, 2));
    assert_eq!(cluster.bindings().await, {
        let mut want = vec![
            (parent(&uid1), JOB_A.to_owned()),
            (parent(&uid2), JOB_A.to_owned()),
        ];
        want.sort();
        want
    });
    for entry in cluster.entries().await.values() {
        assert_eq!(entry.data["spec"]["selectors"], json!(["unix:uid:2000"]));
        assert_eq!(entry.data["spec"]["className"], "spire-mgmt-spire");
        let labels = entry.metadata.labels.as_ref().unwrap();
        assert_eq!(labels["ci.ddupan.top/sandbox-id"], "sb-a");
        assert_eq!(
            labels["app.kubernetes.io/component"],
            "opensandbox-identity"
        );
    }
}

/// DESIGN invariant 13: without `CI_SPIFFE_ID` in its task, a sandbox's identity comes
/// from its metadata (the codec's chunks), re-derived from repository and job key.
#[tokio::test]
async fn the_identity_comes_from_the_sandbox_metadata_when_the_task_has_none() {
    let cluster = Cluster::start().await;
    let uid = cluster.pod("ci-vm-1").await;
    let codec = MetadataCodec::default();
    let assignment = backend_contract::assignment(
        9,
        "octo-org/hello-world",
        "build",
        Backend::Vm,
        &backend_contract::trust_domain(),
    );
    let labels = codec
        .flatten(&backend_contract::spec(&assignment, &codec).metadata)
        .unwrap();
    cluster
        .sandbox_with("sb-meta", &["ci-vm-1"], None, labels)
        .await;
    cluster.reconciler().reconcile_once().await.unwrap();
    assert_eq!(
        cluster.bindings().await,
        vec![(parent(&uid), JOB_A.to_owned())]
    );
}

/// DESIGN invariants 8 and 13 (issue 39 item 5, `vm_warm_pool`): a warm sandbox, made
/// before any job, names no job (no runner label, no identity) and gets no entry; once a
/// job's claim patches that job's metadata onto it, the next pass binds its Pod to the
/// job's SPIFFE ID, derived from the metadata (its task carries none).
#[tokio::test]
async fn a_warm_sandbox_gets_no_identity_until_a_job_claims_it_then_the_jobs() {
    let cluster = Cluster::start().await;
    let uid = cluster.pod("ci-vm-1").await;
    let codec = MetadataCodec::default();
    let warm = BTreeMap::from([(codec.key(WARM_KEY), UNCLAIMED.to_owned())]);
    cluster
        .sandbox_with("sb-warm", &["ci-vm-1"], None, warm)
        .await;
    // What the warm pool creates: no runner label.
    cluster
        .label("sb-warm", json!({codec.key(keys::RUNNER): null}))
        .await;
    let reconciler = cluster.reconciler();
    reconciler.reconcile_once().await.unwrap();
    assert_eq!(cluster.bindings().await, vec![], "unclaimed: no identity");
    let assignment = backend_contract::assignment(
        9,
        "octo-org/hello-world",
        "build",
        Backend::Vm,
        &backend_contract::trust_domain(),
    );
    let mut claim = codec
        .flatten(&backend_contract::spec(&assignment, &codec).metadata)
        .unwrap();
    claim.insert(codec.key(WARM_KEY), CLAIMED.into());
    cluster
        .label("sb-warm", serde_json::to_value(claim).unwrap())
        .await;
    reconciler.reconcile_once().await.unwrap();
    assert_eq!(
        cluster.bindings().await,
        vec![(parent(&uid), JOB_A.to_owned())],
        "claimed: the job's identity"
    );
}

/// A Pod the sandbox releases loses its identity at once; the sandbox's other Pods keep
/// theirs. A deleted sandbox loses every entry.
#[tokio::test]
async fn released_pods_and_deleted_sandboxes_lose_their_entries() {
    let cluster = Cluster::start().await;
    let uid1 = cluster.pod("ci-vm-1").await;
    let uid2 = cluster.pod("ci-vm-2").await;
    cluster
        .sandbox("sb-a", &["ci-vm-1", "ci-vm-2"], Some(JOB_A))
        .await;
    let reconciler = cluster.reconciler();
    reconciler.reconcile_once().await.unwrap();
    cluster
        .annotate(
            "sb-a",
            "sandbox.opensandbox.io/alloc-release",
            json!({"pods": ["ci-vm-1"]}),
        )
        .await;
    let pass = reconciler.reconcile_once().await.unwrap();
    assert_eq!(pass.deleted, 1);
    assert_eq!(
        cluster.bindings().await,
        vec![(parent(&uid2), JOB_A.to_owned())]
    );
    assert!(
        !cluster
            .bindings()
            .await
            .iter()
            .any(|(p, _)| *p == parent(&uid1))
    );
    cluster
        .sandboxes()
        .delete("sb-a", &DeleteParams::default())
        .await
        .unwrap();
    reconciler.reconcile_once().await.unwrap();
    assert!(
        cluster.entries().await.is_empty(),
        "a gone sandbox keeps no entry"
    );
}

/// DESIGN invariant 13: a Pod being deleted (its `deletionTimestamp` set while a finalizer
/// or the kubelet holds it, as a real API server keeps it) loses its identity at once,
/// before it is gone.
#[tokio::test]
async fn a_pod_being_deleted_loses_its_entry_before_it_is_gone() {
    let cluster = Cluster::start().await;
    cluster.pod("ci-vm-1").await;
    cluster.sandbox("sb-a", &["ci-vm-1"], Some(JOB_A)).await;
    let reconciler = cluster.reconciler();
    reconciler.reconcile_once().await.unwrap();
    assert_eq!(cluster.entries().await.len(), 1);
    cluster
        .pods()
        .patch(
            "ci-vm-1",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": ["example.org/hold"]}})),
        )
        .await
        .unwrap();
    cluster
        .pods()
        .delete("ci-vm-1", &DeleteParams::default())
        .await
        .unwrap();
    let terminating = cluster.pods().get("ci-vm-1").await.unwrap();
    assert!(terminating.metadata.deletion_timestamp.is_some());
    let pass = reconciler.reconcile_once().await.unwrap();
    assert_eq!(pass.deleted, 1);
    assert!(cluster.entries().await.is_empty());
}

/// The invariant this reconciler exists for: a Pod handed to the next job (the same Pod
/// with its UID, as a Pool switched to `recycleStrategy: Noop` under a live sandbox would
/// hand it on, or a new Pod of the same name) never keeps the previous job's identity, and
/// gets the new job's.
#[tokio::test]
async fn a_recycled_pod_never_keeps_the_previous_jobs_identity() {
    let cluster = Cluster::start().await;
    let uid = cluster.pod("ci-vm-1").await;
    cluster.sandbox("sb-a", &["ci-vm-1"], Some(JOB_A)).await;
    let reconciler = cluster.reconciler();
    reconciler.reconcile_once().await.unwrap();
    assert_eq!(
        cluster.bindings().await,
        vec![(parent(&uid), JOB_A.to_owned())]
    );

    // Same Pod, same UID, released by A and allocated to B.
    cluster
        .annotate(
            "sb-a",
            "sandbox.opensandbox.io/alloc-released",
            json!({"pods": ["ci-vm-1"]}),
        )
        .await;
    cluster.sandbox("sb-b", &["ci-vm-1"], Some(JOB_B)).await;
    reconciler.reconcile_once().await.unwrap();
    assert_eq!(
        cluster.bindings().await,
        vec![(parent(&uid), JOB_B.to_owned())]
    );

    // The Pod is replaced (new UID, same name) and B still holds the name.
    cluster
        .pods()
        .delete("ci-vm-1", &DeleteParams::default())
        .await
        .unwrap();
    let new_uid = cluster.pod("ci-vm-1").await;
    assert_ne!(new_uid, uid);
    reconciler.reconcile_once().await.unwrap();
    assert_eq!(
        cluster.bindings().await,
        vec![(parent(&new_uid), JOB_B.to_owned())]
    );
}

/// Two passes of a new reconciler: each refuses `refused` sandboxes, each of them counted
/// once, and only the Pod `ok_uid` is bound (to `JOB_A`). Returns the reconciler.
async fn two_passes_refusing(cluster: &Cluster, refused: usize, ok_uid: &str) -> Reconciler {
    let metrics = Metrics::default();
    let reconciler = cluster.reconciler_with(Cluster::settings(), metrics.clone());
    let first = reconciler.reconcile_once().await.unwrap();
    let second = reconciler.reconcile_once().await.unwrap();
    assert_eq!((first.refused, second.refused), (refused, refused));
    assert_eq!(
        metrics.refused.get(),
        refused as u64,
        "each refused sandbox is counted once"
    );
    assert_eq!(
        cluster.bindings().await,
        vec![(parent(ok_uid), JOB_A.to_owned())]
    );
    reconciler
}

/// DESIGN invariant 13: an identity that does not validate (another trust domain, a
/// metadata identity the task contradicts, none at all) is refused: no entry, logged and
/// counted once per sandbox however many passes see it.
#[tokio::test]
async fn invalid_identities_are_refused_and_counted_once() {
    let cluster = Cluster::start().await;
    let ok_uid = cluster.pod("ci-vm-0").await;
    for pod in ["ci-vm-1", "ci-vm-2", "ci-vm-3"] {
        cluster.pod(pod).await;
    }
    cluster.sandbox("good", &["ci-vm-0"], Some(JOB_A)).await;
    cluster
        .sandbox(
            "foreign",
            &["ci-vm-1"],
            Some("spiffe://evil.org/ci/octo-org/hello-world/build"),
        )
        .await;
    cluster.sandbox("anonymous", &["ci-vm-2"], None).await;
    let codec = MetadataCodec::default();
    let assignment = backend_contract::assignment(
        9,
        "octo-org/hello-world",
        "build",
        Backend::Vm,
        &backend_contract::trust_domain(),
    );
    let labels = codec
        .flatten(&backend_contract::spec(&assignment, &codec).metadata)
        .unwrap();
    cluster
        .sandbox_with("contradicted", &["ci-vm-3"], Some(JOB_B), labels)
        .await;
    two_passes_refusing(&cluster, 3, &ok_uid).await;
}

/// DESIGN (a job's environment is brand-new and destroyed afterwards; issue 39 item 5, the
/// one-job rule for VMs): the sandboxes of a Pool that hands released Pods to the next
/// sandbox (`Restart`, `Noop`) or of a Pool that does not exist get no identity, so their
/// executors never get an SVID and no job runs in another job's VM; each is refused,
/// logged and counted once. A Pool switched to recycling takes the identity from its live
/// sandboxes at the next pass.
#[tokio::test]
async fn sandboxes_of_a_pool_that_hands_its_pods_on_get_no_identity() {
    let cluster = Cluster::start().await;
    let ok_uid = cluster.pod("ci-vm-0").await;
    for pod in ["kept-1", "restarted-1", "gone-1"] {
        cluster.pod(pod).await;
    }
    cluster.pool("kept", Some("Noop")).await;
    cluster.pool("restarted", Some("Restart")).await;
    cluster.sandbox("good", &["ci-vm-0"], Some(JOB_A)).await;
    for (pool, name, pod) in [
        ("kept", "sb-kept", "kept-1"),
        ("restarted", "sb-restarted", "restarted-1"),
        ("gone", "sb-gone", "gone-1"),
    ] {
        cluster
            .sandbox_of(pool, name, &[pod], Some(JOB_B), BTreeMap::new())
            .await;
    }
    let reconciler = two_passes_refusing(&cluster, 3, &ok_uid).await;

    cluster
        .pools()
        .patch(
            "ci-vm",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"recycleStrategy": {"type": "Noop"}}})),
        )
        .await
        .unwrap();
    let pass = reconciler.reconcile_once().await.unwrap();
    assert_eq!((pass.refused, pass.deleted), (4, 1));
    assert!(cluster.bindings().await.is_empty());
    assert!(
        cluster.fake.handle.denied().is_empty(),
        "the shipped RBAC lets it read Pools: {:?}",
        cluster.fake.handle.denied()
    );
}

/// Reconciling is idempotent: a restarted reconciler finds everything right and writes
/// nothing; a changed entry is repaired; an entry it does not own is left alone; an entry
/// the Python version left (one per sandbox, same component label) is replaced.
#[tokio::test]
async fn a_restart_writes_nothing_and_drift_is_repaired() {
    let cluster = Cluster::start().await;
    let uid = cluster.pod("ci-vm-1").await;
    cluster.sandbox("sb-a", &["ci-vm-1"], Some(JOB_A)).await;
    let mut foreign = DynamicObject::new("someone-elses", &entry_resource())
        .data(json!({"spec": {"spiffeID": JOB_B, "parentID": "spiffe://example.org/x", "selectors": ["unix:uid:0"], "className": "spire-mgmt-spire"}}));
    foreign.metadata.labels = Some(BTreeMap::from([("team".into(), "infra".into())]));
    cluster
        .entries_api()
        .create(&PostParams::default(), &foreign)
        .await
        .unwrap();
    let mut python = DynamicObject::new("gitea-ci-0123456789ab", &entry_resource())
        .data(json!({"spec": {"spiffeID": JOB_A, "parentID": parent("00000000-0000-4000-8000-000000000001"), "selectors": ["unix:uid:2000"], "className": "spire-mgmt-spire"}}));
    python.metadata.labels = Some(BTreeMap::from([
        (
            "app.kubernetes.io/component".into(),
            "opensandbox-identity".into(),
        ),
        ("ci.ddupan.top/sandbox-id".into(), "sb-a".into()),
    ]));
    cluster
        .entries_api()
        .create(&PostParams::default(), &python)
        .await
        .unwrap();

    let pass = cluster.reconciler().reconcile_once().await.unwrap();
    assert_eq!(
        (pass.created, pass.deleted),
        (1, 1),
        "the Python entry is replaced"
    );
    let versions = |entries: &BTreeMap<String, DynamicObject>| -> Vec<Option<String>> {
        entries
            .values()
            .map(|e| e.metadata.resource_version.clone())
            .collect()
    };
    let before = cluster.entries().await;
    let pass = cluster.reconciler().reconcile_once().await.unwrap();
    assert_eq!((pass.created, pass.updated, pass.deleted), (0, 0, 0));
    assert_eq!(
        versions(&cluster.entries().await),
        versions(&before),
        "a restart writes nothing"
    );

    let owned = before
        .keys()
        .find(|n| n.as_str() != "someone-elses")
        .unwrap()
        .clone();
    cluster
        .entries_api()
        .patch(
            &owned,
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"spiffeID": JOB_B}})),
        )
        .await
        .unwrap();
    let pass = cluster.reconciler().reconcile_once().await.unwrap();
    assert_eq!(pass.updated, 1);
    let entries = cluster.entries().await;
    assert_eq!(
        entries[&owned].data["spec"]["spiffeID"], JOB_A,
        "the changed entry is repaired"
    );
    assert_eq!(entries[&owned].data["spec"]["parentID"], parent(&uid));
    assert!(
        entries.contains_key("someone-elses"),
        "an entry without the component label is not ours"
    );
}

/// A pass that cannot see the whole cluster changes nothing: a failing Pod read (or list)
/// must not revoke the identity of running jobs.
#[tokio::test]
async fn a_pass_that_cannot_read_the_cluster_changes_nothing() {
    let cluster = Cluster::start().await;
    cluster.pod("ci-vm-1").await;
    cluster.sandbox("sb-a", &["ci-vm-1"], Some(JOB_A)).await;
    let reconciler = cluster.reconciler();
    reconciler.reconcile_once().await.unwrap();
    let before = cluster.bindings().await;
    cluster.fake.handle.fail_always(
        Method::GET,
        &format!("/api/v1/namespaces/{NS}/pods"),
        StatusCode::INTERNAL_SERVER_ERROR,
    );
    let error = reconciler.reconcile_once().await.unwrap_err();
    assert!(error.to_string().contains("reading Pod ci-vm-1"), "{error}");
    assert_eq!(cluster.bindings().await, before);
    cluster.fake.handle.clear_faults();
    cluster.fake.handle.fail_always(
        Method::GET,
        &format!("/apis/sandbox.opensandbox.io/v1alpha1/namespaces/{NS}/batchsandboxes"),
        StatusCode::FORBIDDEN,
    );
    assert!(reconciler.reconcile_once().await.is_err());
    assert_eq!(cluster.bindings().await, before);
}

/// The run loop converges on its own (watch events when the API serves watches, the
/// resync interval otherwise) and stops on shutdown.
#[tokio::test]
async fn the_run_loop_converges_without_being_asked_and_stops_on_shutdown() {
    let cluster = Cluster::start().await;
    let uid = cluster.pod("ci-vm-1").await;
    let mut settings = Cluster::settings();
    settings.resync = Duration::from_millis(100);
    let reconciler = Arc::new(cluster.reconciler_with(settings, Metrics::default()));
    let (stop, shutdown) = gdr_controller::shutdown::shutdown_channel();
    let task = tokio::spawn(Arc::clone(&reconciler).run(shutdown));
    cluster.sandbox("sb-a", &["ci-vm-1"], Some(JOB_A)).await;
    eventually(DEADLINE, "the entry appears", || async {
        (cluster.bindings().await == vec![(parent(&uid), JOB_A.to_owned())]).then_some(())
    })
    .await;
    cluster
        .sandboxes()
        .delete("sb-a", &DeleteParams::default())
        .await
        .unwrap();
    eventually(DEADLINE, "the entry goes", || async {
        cluster.entries().await.is_empty().then_some(())
    })
    .await;
    stop.trigger();
    tokio::time::timeout(DEADLINE, task)
        .await
        .expect("the loop stops")
        .unwrap();
}

/// `gitea-dynamic-runner sandbox-identity` as a process against the fake API server.
struct Process {
    child: tokio::process::Child,
    health: std::net::TcpListener,
    log: std::path::PathBuf,
}

impl Process {
    fn spawn(dir: &std::path::Path, kubeconfig: &std::path::Path, name: &str) -> Self {
        let health = gdr_testkit::controller::listener();
        let log = dir.join(format!("{name}.log"));
        let child = gdr_testkit::controller::spawn_activated(
            env!("CARGO_BIN_EXE_gitea-dynamic-runner").as_ref(),
            &[
                "sandbox-identity",
                "--set",
                "trust_domain=example.org",
                "--set",
                "leader_election=true",
                "--set",
                &format!("lease_namespace={NS}"),
                "--set",
                "lease_duration=3s",
                "--set",
                &format!("leader_identity={name}"),
                "--set",
                "sandbox_identity_resync=1s",
            ],
            &[("health", &health)],
            &[("KUBECONFIG", &kubeconfig.display().to_string())],
            &log,
        );
        Process { child, health, log }
    }

    async fn get(&self, path: &str) -> Option<(u16, String)> {
        let url = format!("http://{}{path}", self.health.local_addr().ok()?);
        let response = tokio::time::timeout(Duration::from_secs(2), reqwest::get(url))
            .await
            .ok()?
            .ok()?;
        let status = response.status().as_u16();
        Some((status, response.text().await.ok()?))
    }

    async fn ready(&self) -> bool {
        matches!(self.get("/readyz").await, Some((200, _)))
    }

    /// SIGTERM, then its exit status.
    async fn terminate(&mut self) -> std::process::ExitStatus {
        let pid = rustix::process::Pid::from_raw(self.child.id().unwrap() as i32).unwrap();
        rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
        tokio::time::timeout(DEADLINE, self.child.wait())
            .await
            .expect("it stops on SIGTERM")
            .unwrap()
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// DESIGN (components, sandbox-identity) and invariant 18: the subcommand, with nothing but
/// a kubeconfig, campaigns for its Lease, reports ready only while leading and after a
/// first pass, writes the entry of a runner sandbox's Pod, exports its metrics, and on
/// SIGTERM stops cleanly and releases the Lease, so the standby takes over and keeps the
/// entries in step.
#[tokio::test(flavor = "multi_thread")]
async fn the_subcommand_leads_reconciles_and_hands_over_on_sigterm() {
    use k8s_openapi::api::coordination::v1::Lease;
    let cluster = Cluster::start().await;
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        cluster
            .fake
            .kubeconfig_as(NS, &ServiceAccount::sandbox_identity()),
    )
    .unwrap();
    let holder = || async {
        let leases: Api<Lease> = Api::namespaced(cluster.client.clone(), NS);
        leases
            .get_opt("gitea-dynamic-runner-sandbox-identity")
            .await
            .unwrap()
            .and_then(|l| l.spec?.holder_identity)
            .filter(|h| !h.is_empty())
    };

    let mut first = Process::spawn(dir.path(), &kubeconfig, "si-a");
    eventually(DEADLINE, "the first replica is ready", || async {
        first.ready().await.then_some(())
    })
    .await;
    assert_eq!(holder().await.as_deref(), Some("si-a"));
    let mut second = Process::spawn(dir.path(), &kubeconfig, "si-b");
    eventually(DEADLINE, "the second replica serves its health", || async {
        matches!(second.get("/healthz").await, Some((200, _))).then_some(())
    })
    .await;
    assert!(!second.ready().await, "a standby is not ready");

    let uid = cluster.pod("ci-vm-1").await;
    cluster.sandbox("sb-a", &["ci-vm-1"], Some(JOB_A)).await;
    eventually(DEADLINE, "the leader writes the entry", || async {
        (cluster.bindings().await == vec![(parent(&uid), JOB_A.to_owned())]).then_some(())
    })
    .await;
    let entry = cluster.entries().await.into_values().next().unwrap();
    assert_eq!(entry.data["spec"]["selectors"], json!(["unix:uid:2000"]));
    let (_, metrics) = first.get("/metrics").await.unwrap();
    for line in [
        "gitea_dynamic_runner_sandbox_identity_entries_created_total 1",
        "gitea_dynamic_runner_leader 1",
    ] {
        assert!(metrics.contains(line), "{line} in\n{metrics}");
    }

    let status = first.terminate().await;
    assert!(status.success(), "{status:?}\n{}", first.log());
    eventually(DEADLINE, "the standby takes over", || async {
        (second.ready().await && holder().await.as_deref() == Some("si-b")).then_some(())
    })
    .await;
    cluster
        .sandboxes()
        .delete("sb-a", &DeleteParams::default())
        .await
        .unwrap();
    eventually(DEADLINE, "the new leader removes the entry", || async {
        cluster.entries().await.is_empty().then_some(())
    })
    .await;
    let status = second.terminate().await;
    assert!(status.success(), "{status:?}\n{}", second.log());
    assert_eq!(holder().await, None, "the Lease is released");
}
