//! Issue 40 item 3: the ClusterStaticEntry objects the Pod backend and `sandbox-identity`
//! write, turned into SPIRE registration entries by the real spire-controller-manager
//! (built from its Go module by `tests/spire-cm-peers/build.sh`) against the real
//! kube-apiserver (tests/kube-peers) and the real SPIRE server (tests/spire-peers), all on
//! loopback. Elsewhere the fake SPIRE agent reads the objects itself; here the program that
//! does it in a cluster does, so a spec it would not accept (a field, a class, an ID's form)
//! shows as a missing entry.
//!
//! Peers' timeouts named here: the manager reconciles on every change of the objects it
//! watches and at least every `gcInterval` (10 s by default); each wait below is only a bound
//! on a hang.

use std::time::Duration;

use gdr_backends::kubernetes::{KubernetesBackend, KubernetesSettings};
use gdr_core::executor::{Binding, ExecutorBackend};
use gdr_sandbox_identity::entry_resource as sandbox_entry_resource;
use gdr_testkit::backend_contract::{self, task_spec};
use gdr_testkit::eventually;
use gdr_testkit::real_kube::{RealKube, ServiceAccount};
use gdr_testkit::real_spire::{Entry, RealSpire, SpirePrograms, TRUST_DOMAIN};
use gdr_testkit::spire_controller_manager::{
    ControllerManager, ControllerManagerProgram, ManagerConfig,
};
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind, PostParams};
use serde_json::json;

use crate::real_kube::{
    allocated_sandbox, cluster, entry_resource, run_sandbox_identity, schedule,
};

/// Only a bound on a hang: the manager writes an entry within a second of its object.
const WAIT: Duration = Duration::from_secs(60);
const NS: &str = "gitea-actions";
/// The class both components write by default (`pod_spire_class`, `spire_class_name`).
const CLASS: &str = "spire-mgmt-spire";
const CLUSTER: &str = "test-cluster";
const IMAGE: &str = "registry.example/gitea-dynamic-runner@sha256:0000000000000000000000000000000000000000000000000000000000000000";

/// The control plane with the manager's own CRDs, the SPIRE server and agent, and the
/// manager serving `CLASS`.
async fn peers() -> (RealKube, RealSpire, ControllerManager) {
    let kube = cluster().await;
    let program = ControllerManagerProgram::from_env();
    let admin = kube.admin().await;
    for crd in program.crds().unwrap() {
        kube.apply(&crd).await;
        let names = &crd["spec"]["names"];
        let group = crd["spec"]["group"].as_str().unwrap();
        let version = crd["spec"]["versions"][0]["name"].as_str().unwrap();
        let resource = ApiResource::from_gvk_with_plural(
            &GroupVersionKind::gvk(group, version, names["kind"].as_str().unwrap()),
            names["plural"].as_str().unwrap(),
        );
        let api: Api<DynamicObject> = Api::all_with(admin.clone(), &resource);
        eventually(WAIT, "the API server serves the manager's CRD", || async {
            api.list(&Default::default()).await.ok().map(drop)
        })
        .await;
    }
    let spire = RealSpire::start(SpirePrograms::from_env()).await.unwrap();
    let manager = ControllerManager::start(
        &program,
        &kube.kubeconfig("default"),
        &spire.server_socket(),
        &ManagerConfig {
            trust_domain: TRUST_DOMAIN.into(),
            cluster: CLUSTER.into(),
            class: CLASS.into(),
        },
    )
    .unwrap();
    (kube, spire, manager)
}

fn pod_backend(client: kube::Client) -> KubernetesBackend {
    let mut settings =
        KubernetesSettings::new(IMAGE, backend_contract::trust_domain(), CLUSTER, CLASS);
    settings.namespace = NS.into();
    KubernetesBackend::new(client, settings).unwrap()
}

/// The SPIRE entry an object's spec asks for.
fn intended(spec: &serde_json::Value) -> Entry {
    let mut selectors: Vec<String> = spec["selectors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_owned())
        .collect();
    selectors.sort();
    Entry {
        spiffe_id: spec["spiffeID"].as_str().unwrap().to_owned(),
        parent_id: spec["parentID"].as_str().unwrap().to_owned(),
        selectors,
    }
}

/// The server's entries of jobs (the fixture's own node alias left out).
async fn job_entries(spire: &RealSpire, manager: &ControllerManager) -> Vec<Entry> {
    assert!(
        manager.running(),
        "spire-controller-manager exited:\n{}",
        manager.log()
    );
    let mut entries: Vec<Entry> = spire
        .entries()
        .await
        .unwrap()
        .into_iter()
        .filter(|e| {
            e.spiffe_id
                .starts_with(&format!("spiffe://{TRUST_DOMAIN}/ci/"))
        })
        .collect();
    entries.sort();
    entries
}

/// A ClusterStaticEntry as an operator (or a broken writer) might leave it: `spec` as given.
async fn foreign_entry(kube: &RealKube, name: &str, spec: serde_json::Value) {
    let entries: Api<DynamicObject> = Api::all_with(kube.admin().await, &entry_resource());
    let object = DynamicObject::new(name, &entry_resource()).data(json!({ "spec": spec }));
    entries
        .create(&PostParams::default(), &object)
        .await
        .unwrap();
}

/// DESIGN invariants 8 and 13 (issue 40): the entry the Pod backend binds a job's Pod with
/// becomes, through the real spire-controller-manager, a SPIRE entry of exactly the job's
/// SPIFFE ID, the Node's agent as parent and the Pod's UID as its one selector; objects of
/// another class, or with a parent ID that is no SPIFFE ID, become none; and deleting the
/// executor removes the SPIRE entry.
#[tokio::test(flavor = "multi_thread")]
async fn the_real_spire_controller_manager_turns_the_pod_backends_entry_into_exactly_the_intended_spire_entry()
 {
    let (kube, spire, manager) = peers().await;
    let job = |name: &str| format!("spiffe://{TRUST_DOMAIN}/ci/owner/repo/branch/main/{name}");
    foreign_entry(
        &kube,
        "another-class",
        json!({
            "spiffeID": job("other-class"),
            "parentID": format!("spiffe://{TRUST_DOMAIN}/spire/agent/k8s_psat/{CLUSTER}/n"),
            "selectors": ["k8s:pod-uid:0000"],
            "className": "someone-elses",
        }),
    )
    .await;
    foreign_entry(
        &kube,
        "parent-not-an-id",
        json!({
            "spiffeID": job("bad-parent"),
            "parentID": "node-a",
            "selectors": ["k8s:pod-uid:0001"],
            "className": CLASS,
        }),
    )
    .await;

    let backend = pod_backend(kube.client_as(&ServiceAccount::controller()).await);
    let spec = task_spec(40, "[self-hosted, pod]", "https://127.0.0.1:9");
    let record = backend.create(&spec).await.unwrap();
    schedule(&kube, &record.name).await;
    assert_eq!(
        backend.bind_identity(&record).await.unwrap(),
        Binding::Bound
    );
    let objects: Api<DynamicObject> = Api::all_with(kube.admin().await, &entry_resource());
    let object = objects.get(&record.name).await.unwrap();
    let wanted = intended(&object.data["spec"]);
    let pods: Api<Pod> = Api::namespaced(kube.admin().await, NS);
    let pod_uid = pods.get(&record.name).await.unwrap().metadata.uid.unwrap();
    assert_eq!(wanted.selectors, [format!("k8s:pod-uid:{pod_uid}")]);

    let entries = eventually(WAIT, "the manager writes the job's entry", || {
        let (spire, manager, wanted) = (&spire, &manager, &wanted);
        async move {
            let entries = job_entries(spire, manager).await;
            entries
                .iter()
                .any(|e| e.spiffe_id == wanted.spiffe_id)
                .then_some(entries)
        }
    })
    .await;
    // One pass of the manager reconciles every object: the others were there before.
    assert_eq!(entries, [wanted], "{}", manager.log());

    backend.delete(spec.assignment.id()).await.unwrap();
    eventually(WAIT, "the manager deletes the job's entry", || {
        let (spire, manager) = (&spire, &manager);
        async move { job_entries(spire, manager).await.is_empty().then_some(()) }
    })
    .await;
}

/// DESIGN invariant 13 (issue 40): the entry `sandbox-identity` writes for a VM sandbox's
/// Pod becomes, through the real spire-controller-manager, a SPIRE entry of exactly the
/// sandbox's SPIFFE ID, parent and selector.
#[tokio::test(flavor = "multi_thread")]
async fn the_real_spire_controller_manager_turns_sandbox_identitys_entry_into_exactly_the_intended_spire_entry()
 {
    let (kube, spire, manager) = peers().await;
    let spiffe_id = format!("spiffe://{TRUST_DOMAIN}/ci/octo-org/hello-world/build");
    allocated_sandbox(&kube, &spiffe_id).await;
    let (stop, run) = run_sandbox_identity(&kube).await;
    let admin = kube.admin().await;
    let objects: Api<DynamicObject> = Api::all_with(admin.clone(), &sandbox_entry_resource());
    let object = eventually(WAIT, "sandbox-identity writes the Pod's entry", || async {
        objects.list(&Default::default()).await.unwrap().items.pop()
    })
    .await;
    let wanted = intended(&object.data["spec"]);
    assert_eq!(wanted.spiffe_id, spiffe_id);

    let entries = eventually(WAIT, "the manager writes the sandbox's entry", || {
        let (spire, manager) = (&spire, &manager);
        async move {
            let entries = job_entries(spire, manager).await;
            (!entries.is_empty()).then_some(entries)
        }
    })
    .await;
    assert_eq!(entries, [wanted], "{}", manager.log());
    stop.trigger();
    run.await.unwrap();
}

/// No DESIGN invariant (documentation, issue 40): the version README.md and docs/testing.md
/// name is the one `tests/spire-cm-peers/go.mod` pins and `build.sh` reports.
#[test]
fn the_docs_name_the_pinned_spire_controller_manager() {
    let root = env!("CARGO_MANIFEST_DIR");
    let go_mod = std::fs::read_to_string(format!("{root}/tests/spire-cm-peers/go.mod")).unwrap();
    let pinned = go_mod
        .lines()
        .find_map(|l| {
            l.trim()
                .strip_prefix("github.com/spiffe/spire-controller-manager v")
        })
        .and_then(|rest| rest.split_whitespace().next())
        .expect("go.mod pins spire-controller-manager");
    if let Ok(built) = std::env::var("SPIRE_CM_VERSION") {
        assert_eq!(built, pinned, "SPIRE_CM_VERSION is not go.mod's version");
    }
    let readme = std::fs::read_to_string(format!("{root}/README.md")).unwrap();
    assert!(
        readme.contains(&format!("spire-controller-manager {pinned}")),
        "README.md does not name spire-controller-manager {pinned}"
    );
    let testing = std::fs::read_to_string(format!("{root}/docs/testing.md")).unwrap();
    assert!(
        testing.contains(&format!(
            "`github.com/spiffe/spire-controller-manager` v{pinned}"
        )),
        "docs/testing.md does not name v{pinned}"
    );
}
