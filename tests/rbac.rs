//! The shipped RBAC grants exactly what the code calls. The fake API server enforces the
//! Roles and ClusterRoles of `deploy/kubernetes/base` and `deploy/kubernetes/sandbox-identity`
//! for the controller's and sandbox-identity's service accounts (so a missing grant fails
//! the backend, chain and sandbox-identity tests that make the call); this test drives
//! every kind of call each component makes, through its real code, and lists the grants no
//! call used.

use std::collections::BTreeMap;
use std::time::Duration;

use gdr_backends::kubernetes::{KubernetesBackend, KubernetesSettings};
use gdr_controller::lease::{LeaderElector, Leadership, LeaseSettings};
use gdr_controller::shutdown::shutdown_channel;
use gdr_core::executor::{Binding, ExecutorBackend};
use gdr_sandbox_identity::{
    Metrics, Reconciler, Settings, batchsandbox_resource, entry_resource, pool_resource,
};
use gdr_testkit::backend_contract::{self, task_spec};
use gdr_testkit::eventually;
use gdr_testkit::fake_kube::{self, ResourceType, RunningFakeKube, ServiceAccount};
use k8s_openapi::api::core::v1::{Container, Node, Pod, PodSpec};
use kube::api::{DynamicObject, ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(20);
const CONTROLLER_NS: &str = "gitea-actions";
const SANDBOX_NS: &str = "opensandbox";
const IMAGE: &str = "registry.example/gitea-dynamic-runner@sha256:0000000000000000000000000000000000000000000000000000000000000000";

fn admin(fake: &RunningFakeKube) -> Client {
    fake.client().unwrap()
}

/// Campaigns as `account` for Lease `name` in `namespace` until it has led and renewed at
/// least once (get, create, update), then stops.
async fn lead_renew_and_release(
    fake: &RunningFakeKube,
    account: &ServiceAccount,
    namespace: &str,
    name: &str,
) {
    let settings = LeaseSettings {
        lease_duration: Duration::from_secs(2),
        renew_deadline: Duration::from_secs(1),
        retry_period: Duration::from_millis(100),
        ..LeaseSettings::new(namespace, name, "replica-a")
    };
    let (tx, mut leadership) = Leadership::channel();
    let (stop, stopped) = shutdown_channel();
    let elector = LeaderElector::new(fake.client_as(account).unwrap(), settings);
    let task = tokio::spawn(elector.run(tx, stopped));
    assert!(leadership.acquired().await, "{name} is led");
    let lease = ResourceType::leases();
    let version = |fake: &RunningFakeKube| {
        fake.handle.object(&lease, namespace, name).unwrap()["metadata"]["resourceVersion"].clone()
    };
    let acquired = version(fake);
    eventually(WAIT, "the leader renews its lease", || async {
        (version(fake) != acquired).then_some(())
    })
    .await;
    stop.trigger();
    task.await.unwrap().unwrap();
}

/// Everything the Pod backend calls: create (Secret, Pod, owner patch), bind (Pod, Node,
/// entry), the markers, find, list, sweep and delete, and its Pod watch.
async fn pod_backend_calls(fake: &RunningFakeKube) {
    let mut settings = KubernetesSettings::new(
        IMAGE,
        backend_contract::trust_domain(),
        "test-cluster",
        "spire-mgmt",
    );
    settings.namespace = CONTROLLER_NS.into();
    let client = fake.client_as(&ServiceAccount::controller()).unwrap();
    let backend = KubernetesBackend::new(client, settings).unwrap();
    let changes = backend.changes();
    let spec = task_spec(7, "[self-hosted, pod]", "https://127.0.0.1:9");
    let record = backend.create(&spec).await.unwrap();
    // Schedule it as a scheduler would, onto a Node the backend reads the UID of.
    let nodes: Api<Node> = Api::all(admin(fake));
    nodes
        .create(
            &PostParams::default(),
            &Node {
                metadata: ObjectMeta {
                    name: Some("node-a".into()),
                    ..Default::default()
                },
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let binding = json!({
        "apiVersion": "v1", "kind": "Binding",
        "metadata": {"name": record.name},
        "target": {"apiVersion": "v1", "kind": "Node", "name": "node-a"},
    });
    let resp = reqwest::Client::new()
        .post(format!(
            "{}/api/v1/namespaces/{CONTROLLER_NS}/pods/{}/binding",
            fake.url, record.name
        ))
        .json(&binding)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 201);
    assert_eq!(
        backend.bind_identity(&record).await.unwrap(),
        Binding::Bound
    );
    let id = spec.assignment.id();
    backend.record_claimed(id).await.unwrap();
    backend.mark_terminal(id).await.unwrap();
    assert!(backend.find(id).await.unwrap().unwrap().terminal);
    assert_eq!(backend.list().await.unwrap().len(), 1);
    backend.sweep().await.unwrap();
    backend.delete(id).await.unwrap();
    // The backend's Pod watch (a list, then a watch) wakes callers on each change.
    eventually(WAIT, "the backend's watch has reported changes", || async {
        changes.has_changed().unwrap_or(false).then_some(())
    })
    .await;
}

/// Everything sandbox-identity calls: its watches, a pass reading a sandbox's Pool and
/// creating an entry for its Pod, repairing a changed entry and deleting the entry of a
/// released Pod.
async fn sandbox_identity_calls(fake: &RunningFakeKube) {
    let admin = admin(fake);
    let pool = DynamicObject::new("ci-vm", &pool_resource()).data(json!({"spec": {
        "capacitySpec": {"bufferMax": 1, "bufferMin": 1, "poolMax": 2, "poolMin": 1},
    }}));
    Api::<DynamicObject>::namespaced_with(admin.clone(), SANDBOX_NS, &pool_resource())
        .create(&PostParams::default(), &pool)
        .await
        .unwrap();
    let pods: Api<Pod> = Api::namespaced(admin.clone(), SANDBOX_NS);
    let pod = pods
        .create(
            &PostParams::default(),
            &Pod {
                metadata: ObjectMeta {
                    name: Some("ci-vm-1".into()),
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
            },
        )
        .await
        .unwrap();
    let sandboxes: Api<DynamicObject> =
        Api::namespaced_with(admin.clone(), SANDBOX_NS, &batchsandbox_resource());
    let mut sandbox = DynamicObject::new("sb-a", &batchsandbox_resource()).data(json!({
        "spec": {
            "replicas": 1,
            "poolRef": "ci-vm",
            "taskTemplate": {"spec": {"process": {"command": ["/bin/sh"], "env": [
                {"name": "CI_SPIFFE_ID", "value": "spiffe://example.org/ci/octo-org/hello-world/build"}
            ]}}},
        }
    }));
    sandbox.metadata.labels = Some(BTreeMap::from([(
        "ci.ddupan.top/runner".into(),
        "true".into(),
    )]));
    sandbox.metadata.annotations = Some(BTreeMap::from([(
        "sandbox.opensandbox.io/alloc-status".into(),
        json!({"pods": ["ci-vm-1"], "poolRef": "ci-vm"}).to_string(),
    )]));
    sandboxes
        .create(&PostParams::default(), &sandbox)
        .await
        .unwrap();

    let identity = fake.client_as(&ServiceAccount::sandbox_identity()).unwrap();
    let reconciler = std::sync::Arc::new(Reconciler::new(
        identity,
        Settings::new(backend_contract::trust_domain()),
        Metrics::default(),
    ));
    let (stop, stopped) = gdr_controller::shutdown::shutdown_channel();
    let run = tokio::spawn(reconciler.run(stopped));
    let entries: Api<DynamicObject> = Api::all_with(admin.clone(), &entry_resource());
    let entry = eventually(WAIT, "the sandbox's Pod has its entry", || async {
        entries.list(&Default::default()).await.unwrap().items.pop()
    })
    .await;
    let name = entry.metadata.name.clone().unwrap();
    assert!(
        entry.data["spec"]["parentID"]
            .as_str()
            .unwrap()
            .ends_with(pod.metadata.uid.as_deref().unwrap())
    );
    // Drift is repaired (a merge patch).
    entries
        .patch(
            &name,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"selectors": ["unix:uid:0"]}})),
        )
        .await
        .unwrap();
    eventually(WAIT, "the changed entry is repaired", || async {
        let e = entries.get(&name).await.unwrap();
        (e.data["spec"]["selectors"] == json!(["unix:uid:2000"])).then_some(())
    })
    .await;
    // A released Pod loses its entry.
    sandboxes
        .patch(
            "sb-a",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {
                "sandbox.opensandbox.io/alloc-release": json!({"pods": ["ci-vm-1"]}).to_string()
            }}})),
        )
        .await
        .unwrap();
    eventually(WAIT, "the released Pod's entry is deleted", || async {
        entries
            .get_opt(&name)
            .await
            .unwrap()
            .is_none()
            .then_some(())
    })
    .await;
    stop.trigger();
    run.await.unwrap();
}

/// No DESIGN invariant (deployment, least privilege): every grant of the shipped Roles and
/// ClusterRoles is used by a call of the component it is granted to, so none can be
/// removed; a grant listed here is one no code path needs (remove it from the manifest).
/// A grant the code needs and the manifests lack fails the tests that make the call, which
/// all run under the same enforced RBAC.
#[tokio::test(flavor = "multi_thread")]
async fn every_shipped_rbac_grant_is_used_by_the_component_it_is_granted_to() {
    let fake = fake_kube::start().await.unwrap();
    fake.handle.enforce_shipped_rbac(&[]);
    pod_backend_calls(&fake).await;
    lead_renew_and_release(
        &fake,
        &ServiceAccount::controller(),
        CONTROLLER_NS,
        "gitea-dynamic-runner",
    )
    .await;
    sandbox_identity_calls(&fake).await;
    lead_renew_and_release(
        &fake,
        &ServiceAccount::sandbox_identity(),
        SANDBOX_NS,
        "sandbox-identity",
    )
    .await;
    assert!(
        fake.handle.denied().is_empty(),
        "the shipped RBAC denied calls the code makes: {:#?}",
        fake.handle.denied()
    );
    let unused: Vec<String> = fake
        .handle
        .unused_grants()
        .iter()
        .map(ToString::to_string)
        .collect();
    assert!(
        unused.is_empty(),
        "grants no call of the component uses:\n{}",
        unused.join("\n")
    );
}
