//! The fake Kubernetes API server's watch, subresources, garbage collection and validation,
//! driven by the real `kube` client (and `kube::runtime::watcher`), so that the backend
//! tests built on it exercise what a real API server would answer.
//!
//! These tests protect no product invariant: they keep the test peer faithful to a real
//! kube-apiserver (watches with selectors, `410 Expired` and bookmarks; `422` validation with
//! field causes; the status and binding subresources; owner-reference garbage collection).
//! Each states the behaviour it pins in a `Peer fidelity` line.

use std::collections::BTreeMap;
use std::time::Duration;

use futures::StreamExt;
use gdr_testkit::fake_kube::{self, ResourceType, RunningFakeKube};
use gdr_testkit::until_sync;
use k8s_openapi::api::core::v1::{Pod, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use kube::{Api, ResourceExt};
use serde_json::{Value, json};
use tokio::time::Instant;

const NS: &str = "ci";
const DEADLINE: Duration = Duration::from_secs(20);

fn pod(name: &str, labels: &[(&str, &str)]) -> Pod {
    fake_kube::minimal_pod(name, labels)
}

fn count(fake: &RunningFakeKube, prefix: &str) -> usize {
    fake.handle
        .requests()
        .iter()
        .filter(|r| r.starts_with(prefix))
        .count()
}

/// Events of a `kube::runtime::watcher` as `Apply(name)` / `Delete(name)` / `Init…`.
fn spawn_watcher(
    api: Api<Pod>,
    config: watcher::Config,
) -> (
    tokio::sync::mpsc::UnboundedReceiver<String>,
    tokio::task::JoinHandle<()>,
) {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let task = tokio::spawn(async move {
        let mut stream = watcher(api, config).boxed();
        while let Some(event) = stream.next().await {
            let text = match event {
                Ok(watcher::Event::Apply(p)) => format!("Apply({})", p.name_any()),
                Ok(watcher::Event::Delete(p)) => format!("Delete({})", p.name_any()),
                Ok(watcher::Event::InitApply(p)) => format!("InitApply({})", p.name_any()),
                Ok(watcher::Event::Init) => "Init".into(),
                Ok(watcher::Event::InitDone) => "InitDone".into(),
                Err(e) => format!("Err({e})"),
            };
            if tx.send(text).is_err() {
                return;
            }
        }
    });
    (rx, task)
}

async fn next_event(rx: &mut tokio::sync::mpsc::UnboundedReceiver<String>, want: &str) {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let got = tokio::time::timeout_at(deadline, rx.recv())
            .await
            .unwrap_or_else(|_| panic!("timed out waiting for {want}"))
            .expect("watcher ended");
        if got == want {
            return;
        }
    }
}

/// Peer fidelity: a watch with a label selector reports creations, changes and deletions of
/// what it selects, and an object that stops matching as deleted, as the real watch cache does.
#[tokio::test]
async fn a_selective_watch_reports_added_modified_and_deleted_including_objects_leaving_the_selector()
 {
    let fake = fake_kube::start().await.unwrap();
    let pods: Api<Pod> = Api::namespaced(fake.client().unwrap(), NS);
    pods.create(
        &PostParams::default(),
        &pod("before", &[("role", "runner")]),
    )
    .await
    .unwrap();
    let (mut events, task) = spawn_watcher(
        pods.clone(),
        watcher::Config::default().labels("role in (runner)"),
    );
    next_event(&mut events, "InitApply(before)").await;
    next_event(&mut events, "InitDone").await;
    until_sync(DEADLINE, "the watch is open", || {
        fake.handle.open_watches() == 1
    })
    .await;

    pods.create(&PostParams::default(), &pod("other", &[("role", "db")]))
        .await
        .unwrap();
    pods.create(&PostParams::default(), &pod("job", &[("role", "runner")]))
        .await
        .unwrap();
    next_event(&mut events, "Apply(job)").await;
    let relabel = Patch::Merge(json!({ "metadata": { "labels": { "role": "done" } } }));
    pods.patch("job", &PatchParams::default(), &relabel)
        .await
        .unwrap();
    next_event(&mut events, "Delete(job)").await;
    pods.delete("before", &DeleteParams::default())
        .await
        .unwrap();
    next_event(&mut events, "Delete(before)").await;
    task.abort();
}

/// Peer fidelity: an expired watch gets `410 Expired` as an `ERROR` event inside a `200`
/// stream, as the real server sends it, and the watcher re-lists without missing a creation
/// made meanwhile.
#[tokio::test]
async fn an_expired_watch_sends_410_in_the_stream_and_the_watcher_re_lists() {
    let fake = fake_kube::start().await.unwrap();
    let pods: Api<Pod> = Api::namespaced(fake.client().unwrap(), NS);
    let (mut events, task) = spawn_watcher(pods.clone(), watcher::Config::default());
    next_event(&mut events, "InitDone").await;
    until_sync(DEADLINE, "the watch is open", || {
        fake.handle.open_watches() == 1
    })
    .await;
    for name in ["early-1", "early-2"] {
        pods.create(&PostParams::default(), &pod(name, &[]))
            .await
            .unwrap();
    }
    next_event(&mut events, "Apply(early-2)").await;
    let lists = count(&fake, &format!("GET /api/v1/namespaces/{NS}/pods?")) - 1;
    fake.handle.expire_watches();
    // A creation while the watcher is re-listing must still be seen.
    pods.create(&PostParams::default(), &pod("during", &[]))
        .await
        .unwrap();
    next_event(&mut events, "InitApply(during)").await;
    assert!(
        count(&fake, &format!("GET /api/v1/namespaces/{NS}/pods?")) > lists + 1,
        "the watcher re-listed after 410"
    );

    // The raw shape: a watch from a compacted resourceVersion (early-1's).
    let resp = reqwest::get(format!(
        "{}/api/v1/namespaces/{NS}/pods?watch=true&resourceVersion=1",
        fake.url
    ))
    .await
    .unwrap();
    assert_eq!(resp.status(), 200);
    let body = resp.text().await.unwrap();
    let event: Value = serde_json::from_str(body.lines().next().unwrap()).unwrap();
    assert_eq!(event["type"], "ERROR");
    assert_eq!(event["object"]["code"], 410);
    assert_eq!(event["object"]["reason"], "Expired");
    task.abort();
}

/// Peer fidelity: bookmarks go only to watches that allow them, and the watcher resumes from
/// the bookmark's `resourceVersion` when its watch times out (not from the last object it saw).
#[tokio::test]
async fn bookmarks_reach_only_watches_that_allow_them_and_the_watcher_resumes_from_one() {
    let fake = fake_kube::start().await.unwrap();
    let pods: Api<Pod> = Api::namespaced(fake.client().unwrap(), NS);
    let (mut events, task) = spawn_watcher(
        pods.clone(),
        watcher::Config::default().labels("role=runner").timeout(2),
    );
    next_event(&mut events, "InitDone").await;
    pods.create(&PostParams::default(), &pod("job", &[("role", "runner")]))
        .await
        .unwrap();
    next_event(&mut events, "Apply(job)").await;
    // Unselected changes move the revision past the last object the watcher saw.
    pods.create(&PostParams::default(), &pod("other", &[]))
        .await
        .unwrap();
    let bookmark_rv = fake.handle.revision();
    let plain = reqwest::Client::new()
        .get(format!("{}/api/v1/namespaces/{NS}/pods?watch=true&resourceVersion={bookmark_rv}&timeoutSeconds=1", fake.url))
        .send()
        .await
        .unwrap();
    until_sync(DEADLINE, "both watches are open", || {
        fake.handle.open_watches() == 2
    })
    .await;
    fake.handle.send_bookmarks();
    assert_eq!(
        plain.text().await.unwrap(),
        "",
        "no bookmark without allowWatchBookmarks"
    );
    let resumed = format!("resourceVersion={bookmark_rv}");
    until_sync(DEADLINE, "the watcher resumes from the bookmark", || {
        fake.handle.requests().iter().any(|r| {
            r.contains("watch=true")
                && r.contains("allowWatchBookmarks=true")
                && r.contains(&resumed)
        })
    })
    .await;
    task.abort();
}

/// Peer fidelity: invalid names, labels and Pod specs are refused with `422 Invalid` and field
/// causes, in the words `kubectl` prints, and nothing is stored; a Pod's spec is immutable
/// apart from a few fields.
#[tokio::test]
async fn invalid_names_labels_and_pod_specs_are_refused_with_422_and_field_causes() {
    let fake = fake_kube::start().await.unwrap();
    let pods: Api<Pod> = Api::namespaced(fake.client().unwrap(), NS);
    let refuse = |p: Pod| {
        let pods = pods.clone();
        async move {
            match pods.create(&PostParams::default(), &p).await {
                Err(kube::Error::Api(s)) => s,
                other => panic!("expected 422, got {other:?}"),
            }
        }
    };
    let mut no_image = pod("job", &[]);
    no_image.spec.as_mut().unwrap().containers[0].image = Some(String::new());
    let s = refuse(no_image).await;
    assert_eq!((s.code, s.reason.as_str()), (422, "Invalid"));
    assert_eq!(
        s.message,
        "Pod \"job\" is invalid: spec.containers[0].image: Required value"
    );
    let d = s.details.unwrap();
    assert_eq!((d.kind.as_str(), d.name.as_str()), ("Pod", "job"));
    assert_eq!(d.causes[0].field, "spec.containers[0].image");
    assert_eq!(d.causes[0].reason, "FieldValueRequired");

    let mut empty = pod("job", &[]);
    empty.spec.as_mut().unwrap().containers.clear();
    assert!(
        refuse(empty)
            .await
            .message
            .ends_with("spec.containers: Required value")
    );

    let s = refuse(pod("Bad_Name", &[])).await;
    assert!(s.message.starts_with("Pod \"Bad_Name\" is invalid: metadata.name: Invalid value: \"Bad_Name\": a lowercase RFC 1123 subdomain"), "{}", s.message);
    assert!(
        refuse(pod(&"a".repeat(254), &[]))
            .await
            .message
            .contains("must be no more than 253 characters")
    );

    let long = "v".repeat(64);
    let s = refuse(pod(
        "job",
        &[("ok", &long), ("bad/key/x", "v"), ("repo", "owner/repo")],
    ))
    .await;
    let fields: Vec<&str> = s
        .details
        .as_ref()
        .unwrap()
        .causes
        .iter()
        .map(|c| c.field.as_str())
        .collect();
    assert_eq!(fields, ["metadata.labels"; 3], "{}", s.message);
    assert!(
        s.message.contains("must be no more than 63 characters"),
        "{}",
        s.message
    );

    let mut mount = pod("job", &[]);
    mount.spec.as_mut().unwrap().containers[0].volume_mounts =
        Some(vec![k8s_openapi::api::core::v1::VolumeMount {
            name: "absent".into(),
            mount_path: "/x".into(),
            ..Default::default()
        }]);
    mount.spec.as_mut().unwrap().restart_policy = Some("Sometimes".into());
    let s = refuse(mount).await;
    assert!(
        s.message
            .contains("spec.containers[0].volumeMounts[0].name: Not found: \"absent\""),
        "{}",
        s.message
    );
    assert!(
        s.message
            .contains("spec.restartPolicy: Unsupported value: \"Sometimes\""),
        "{}",
        s.message
    );
    assert!(
        pods.list(&ListParams::default())
            .await
            .unwrap()
            .items
            .is_empty(),
        "nothing stored"
    );

    // A Pod's spec is immutable apart from a few fields.
    pods.create(&PostParams::default(), &pod("job", &[]))
        .await
        .unwrap();
    let change = Patch::Merge(json!({ "spec": { "restartPolicy": "Never" } }));
    match pods.patch("job", &PatchParams::default(), &change).await {
        Err(kube::Error::Api(s)) => assert!(
            s.message
                .contains("spec: Forbidden: pod updates may not change fields"),
            "{}",
            s.message
        ),
        other => panic!("expected 422, got {other:?}"),
    }
}

/// Peer fidelity: writes to a Pod keep its status, `/status` writes change only the status, and
/// a binding sets the node once (a second is a `409`) and marks the Pod scheduled.
#[tokio::test]
async fn the_status_and_binding_subresources_behave_as_on_a_real_server() {
    let fake = fake_kube::start().await.unwrap();
    let pods: Api<Pod> = Api::namespaced(fake.client().unwrap(), NS);
    let created = pods
        .create(&PostParams::default(), &pod("job", &[]))
        .await
        .unwrap();
    assert_eq!(created.status.unwrap().phase.as_deref(), Some("Pending"));
    let sneaky = Patch::Merge(
        json!({ "status": { "phase": "Succeeded" }, "metadata": { "labels": { "a": "b" } } }),
    );
    let p = pods
        .patch("job", &PatchParams::default(), &sneaky)
        .await
        .unwrap();
    assert_eq!(
        p.status.clone().unwrap().phase.as_deref(),
        Some("Pending"),
        "status ignored on the main resource"
    );
    assert_eq!(p.labels()["a"], "b");
    let st = Patch::Merge(
        json!({ "status": { "phase": "Running" }, "metadata": { "labels": { "a": "c" } } }),
    );
    let p = pods
        .patch_status("job", &PatchParams::default(), &st)
        .await
        .unwrap();
    assert_eq!(p.status.clone().unwrap().phase.as_deref(), Some("Running"));
    assert_eq!(p.labels()["a"], "b", "a status write changes nothing else");

    let http = reqwest::Client::new();
    let bind = |node: &str| {
        http.post(format!("{}/api/v1/namespaces/{NS}/pods/job/binding", fake.url))
            .json(&json!({ "apiVersion": "v1", "kind": "Binding", "metadata": { "name": "job" }, "target": { "kind": "Node", "name": node } }))
            .send()
    };
    assert_eq!(bind("node-a").await.unwrap().status(), 201);
    assert_eq!(bind("node-b").await.unwrap().status(), 409);
    let p = pods.get("job").await.unwrap();
    assert_eq!(p.spec.unwrap().node_name.as_deref(), Some("node-a"));
    let scheduled = p.status.unwrap().conditions.unwrap();
    assert!(
        scheduled
            .iter()
            .any(|c| c.type_ == "PodScheduled" && c.status == "True")
    );
}

/// Peer fidelity: deleting a Pod garbage-collects the Secrets it owns, and only those; `Orphan`
/// keeps them without the owner reference; `stringData` is stored as base64 `data`.
#[tokio::test]
async fn deleting_an_owner_garbage_collects_its_secrets_unless_orphaned() {
    let fake = fake_kube::start().await.unwrap();
    let client = fake.client().unwrap();
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let secrets: Api<Secret> = Api::namespaced(client, NS);
    let mut owners = Vec::new();
    for name in ["a", "b"] {
        let p = pods
            .create(&PostParams::default(), &pod(name, &[]))
            .await
            .unwrap();
        owners.push(p);
    }
    let owned = |name: &str, owner: &Pod| Secret {
        metadata: ObjectMeta {
            name: Some(name.into()),
            owner_references: Some(vec![OwnerReference {
                api_version: "v1".into(),
                kind: "Pod".into(),
                name: owner.name_any(),
                uid: owner.uid().unwrap(),
                ..Default::default()
            }]),
            ..Default::default()
        },
        string_data: Some(BTreeMap::from([("token".to_owned(), "s3cret".to_owned())])),
        ..Default::default()
    };
    let s = secrets
        .create(&PostParams::default(), &owned("a-cap", &owners[0]))
        .await
        .unwrap();
    assert_eq!(s.data.unwrap()["token"].0, b"s3cret");
    assert!(s.string_data.is_none());
    secrets
        .create(&PostParams::default(), &owned("b-cap", &owners[1]))
        .await
        .unwrap();
    secrets
        .create(
            &PostParams::default(),
            &Secret {
                metadata: ObjectMeta {
                    name: Some("free".into()),
                    ..Default::default()
                },
                ..Default::default()
            },
        )
        .await
        .unwrap();

    pods.delete("a", &DeleteParams::default()).await.unwrap();
    assert!(
        secrets.get_opt("a-cap").await.unwrap().is_none(),
        "owned secret collected"
    );
    assert!(secrets.get_opt("free").await.unwrap().is_some());
    pods.delete("b", &DeleteParams::orphan()).await.unwrap();
    let orphan = secrets.get("b-cap").await.unwrap();
    assert!(
        orphan
            .metadata
            .owner_references
            .unwrap_or_default()
            .is_empty()
    );
    assert_eq!(
        fake.handle
            .objects(&ResourceType::secrets(), Some(NS))
            .len(),
        2
    );
}

// ----- the real schemas and what SPIRE and the SPIFFE CSI driver refuse ----------------------

fn api_error<T: std::fmt::Debug>(r: Result<T, kube::Error>) -> kube::core::Status {
    match r {
        Err(kube::Error::Api(s)) => *s,
        other => panic!("expected an API error, got {other:?}"),
    }
}

fn cause_fields(s: &kube::core::Status) -> Vec<String> {
    s.details
        .as_ref()
        .map(|d| d.causes.iter().map(|c| c.field.clone()).collect())
        .unwrap_or_default()
}

/// A raw JSON body to `path` (what a client that builds its own objects would send).
async fn post_json(fake: &RunningFakeKube, path: &str, body: Value) -> (u16, Value) {
    let resp = reqwest::Client::new()
        .post(format!("{}{path}", fake.url))
        .json(&body)
        .send()
        .await
        .unwrap();
    let code = resp.status().as_u16();
    (code, resp.json().await.unwrap())
}

/// Peer fidelity: every write is checked against the real OpenAPI schemas of the oldest and
/// the newest Kubernetes release the docs claim, as the API server checks it with
/// `fieldValidation=Strict`: an undeclared field (also one only the newer release knows) is
/// a `400` strict decoding error, a value of the wrong type a `400` decoding error, a
/// missing required field `422`; nothing is stored.
#[tokio::test]
async fn undeclared_fields_and_wrong_types_are_refused_as_the_real_schemas_of_both_releases_say() {
    use gdr_testkit::fake_kube::schema::KUBERNETES_VERSIONS;
    let fake = fake_kube::start().await.unwrap();
    let pods_path = format!("/api/v1/namespaces/{NS}/pods");
    let mut body = serde_json::to_value(pod("job", &[])).unwrap();
    body["spec"]["containers"][0]["bogus"] = json!(true);
    let (code, s) = post_json(&fake, &pods_path, body).await;
    assert_eq!((code, s["reason"].as_str()), (400, Some("BadRequest")));
    assert_eq!(
        s["message"],
        "strict decoding error: unknown field \"spec.containers[0].bogus\""
    );

    // A field the newest release has and the oldest does not.
    let mut newer = serde_json::to_value(pod("job", &[])).unwrap();
    newer["spec"]["hostnameOverride"] = json!("h");
    let (code, s) = post_json(&fake, &pods_path, newer).await;
    assert_eq!(code, 400);
    assert_eq!(
        s["message"],
        format!(
            "strict decoding error: unknown field \"spec.hostnameOverride\" (Kubernetes {})",
            KUBERNETES_VERSIONS[0]
        )
    );

    let mut wrong_type = serde_json::to_value(pod("job", &[])).unwrap();
    wrong_type["spec"]["activeDeadlineSeconds"] = json!("60");
    let (code, s) = post_json(&fake, &pods_path, wrong_type).await;
    assert_eq!(code, 400);
    assert!(
        s["message"]
            .as_str()
            .unwrap()
            .starts_with("Pod in version \"v1\" cannot be handled as a Pod: json: cannot unmarshal string into Go struct field spec.activeDeadlineSeconds of type integer"),
        "{s}"
    );

    let mut nameless = serde_json::to_value(pod("job", &[])).unwrap();
    nameless["spec"]["containers"][0]
        .as_object_mut()
        .unwrap()
        .remove("name");
    let (code, s) = post_json(&fake, &pods_path, nameless).await;
    assert_eq!((code, s["reason"].as_str()), (422, Some("Invalid")));
    assert_eq!(
        s["details"]["causes"][0],
        json!({"reason": "FieldValueRequired", "message": "Required value", "field": "spec.containers[0].name"})
    );
    let pods: Api<Pod> = Api::namespaced(fake.client().unwrap(), NS);
    assert!(
        pods.list(&ListParams::default())
            .await
            .unwrap()
            .items
            .is_empty()
    );

    // Merge patches are checked as the object they leave.
    pods.create(&PostParams::default(), &pod("job", &[]))
        .await
        .unwrap();
    let s = api_error(
        pods.patch(
            "job",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"lables": {"a": "b"}}})),
        )
        .await,
    );
    assert_eq!(s.code, 400);
    assert_eq!(
        s.message,
        "strict decoding error: unknown field \"metadata.lables\""
    );
}

fn entry(spec: Value) -> kube::api::DynamicObject {
    kube::api::DynamicObject::new("gitea-task-1", &entry_resource()).data(json!({ "spec": spec }))
}

fn entry_resource() -> kube::api::ApiResource {
    kube::api::ApiResource::from_gvk_with_plural(
        &kube::api::GroupVersionKind::gvk("spire.spiffe.io", "v1alpha1", "ClusterStaticEntry"),
        "clusterstaticentries",
    )
}

const POD_UID: &str = "7c9e6679-7425-40de-944b-e07fc1f90ae7";
const NODE_UID: &str = "0f8fad5b-d9cb-469f-a165-70867728950e";

fn good_entry_spec() -> Value {
    json!({
        "spiffeID": "spiffe://example.org/ci/octo-org/hello/build",
        "parentID": format!("spiffe://example.org/spire/agent/k8s_psat/c1/{NODE_UID}"),
        "selectors": [format!("k8s:pod-uid:{POD_UID}")],
        "className": "spire-mgmt",
    })
}

/// Peer fidelity: a ClusterStaticEntry is checked against spire-controller-manager's CRD
/// schema (required fields, types, no undeclared field) and, beyond it, against what
/// spire-controller-manager and the SPIRE server refuse: SPIFFE IDs go-spiffe cannot parse,
/// a workload ID in the reserved `/spire` namespace, a parent of another trust domain or a
/// k8s_psat agent ID of a shape no agent has, selectors no workload attestor emits (or a
/// Pod UID that is no UID), and an entry of no class, which the manager would ignore.
#[tokio::test]
async fn cluster_static_entries_are_refused_where_spire_would_refuse_them() {
    let fake = fake_kube::start().await.unwrap();
    let entries: Api<kube::api::DynamicObject> =
        Api::all_with(fake.client().unwrap(), &entry_resource());
    let refused = |spec: Value| {
        let entries = entries.clone();
        async move { api_error(entries.create(&PostParams::default(), &entry(spec)).await) }
    };
    let with = |field: &str, value: Value| {
        let mut spec = good_entry_spec();
        spec[field] = value;
        spec
    };

    let mut unknown = good_entry_spec();
    unknown["ttl"] = json!("1h");
    let s = refused(unknown).await;
    assert_eq!(
        (s.code, s.message.as_str()),
        (400, "strict decoding error: unknown field \"spec.ttl\"")
    );
    let s = refused(with("selectors", json!("k8s:ns:ci"))).await;
    assert_eq!((s.code, s.reason.as_str()), (422, "Invalid"));
    assert_eq!(
        s.details.as_ref().unwrap().causes[0].reason,
        "FieldValueTypeInvalid"
    );
    let mut missing = good_entry_spec();
    missing.as_object_mut().unwrap().remove("parentID");
    assert_eq!(cause_fields(&refused(missing).await), ["spec.parentID"]);

    for (field, value, says) in [
        (
            "spiffeID",
            json!("spiffe://Example.org/ci/a"),
            "trust domain characters",
        ),
        (
            "spiffeID",
            json!("spiffe://example.org/ci/a/"),
            "trailing slash",
        ),
        (
            "spiffeID",
            json!("spiffe://example.org/ci//a"),
            "empty segments",
        ),
        (
            "spiffeID",
            json!("spiffe://example.org/spire/ci"),
            "reserved namespace",
        ),
        ("spiffeID", json!("spiffe://example.org"), "path is empty"),
        (
            "parentID",
            json!(format!(
                "spiffe://other.org/spire/agent/k8s_psat/c1/{NODE_UID}"
            )),
            "trust domain",
        ),
        (
            "parentID",
            json!("spiffe://example.org/spire/agent/k8s_psat/c1/node-a"),
            "no k8s_psat agent has this ID",
        ),
        ("selectors", json!([]), "selector list is empty"),
        (
            "selectors",
            json!([format!("k8s:pod_uid:{POD_UID}")]),
            "emits no \"pod_uid\"",
        ),
        ("selectors", json!(["k8s:pod-uid:42"]), "takes a Pod UID"),
        ("selectors", json!(["k8s"]), "colon"),
        ("selectors", json!(["unix:uid:runner"]), "takes a number"),
        (
            "className",
            json!(""),
            "ignores an entry without the className",
        ),
    ] {
        let s = refused(with(field, value.clone())).await;
        assert_eq!(
            (s.code, s.reason.as_str()),
            (422, "Invalid"),
            "{field} {value}"
        );
        assert!(s.message.contains(says), "{field} {value}: {}", s.message);
        assert!(
            cause_fields(&s)
                .iter()
                .all(|f| f.starts_with(&format!("spec.{field}"))),
            "{field} {value}: {:?}",
            cause_fields(&s)
        );
    }
    // The shapes the Pod backend and sandbox-identity send are admitted.
    entries
        .create(&PostParams::default(), &entry(good_entry_spec()))
        .await
        .unwrap();
    let mut vm = entry(json!({
        "spiffeID": "spiffe://example.org/ci/octo-org/hello/build",
        "parentID": format!("spiffe://example.org/spire/agent/k8s_psat/sandbox-kata/pod/{POD_UID}"),
        "selectors": ["unix:uid:2000"],
        "className": "spire-mgmt",
    }));
    vm.metadata.name = Some("gitea-ci-0123456789ab".into());
    entries.create(&PostParams::default(), &vm).await.unwrap();
}

/// Peer fidelity: the custom resources are served as their CRDs (spire-controller-manager's,
/// OpenSandbox's) declare them: ClusterStaticEntry cluster-scoped, BatchSandbox and Pool
/// namespaced, each with a status subresource, and the fake's registration is read from those schemas.
#[tokio::test]
async fn custom_resources_are_served_with_the_scope_their_crds_declare() {
    use gdr_testkit::fake_kube::schema;
    for crd in schema::crds() {
        let rt = ResourceType::from_crd(crd);
        let builtin = match crd.kind.as_str() {
            "ClusterStaticEntry" => ResourceType::cluster_static_entries(),
            "BatchSandbox" => ResourceType::batch_sandboxes(),
            "Pool" => ResourceType::pools(),
            other => panic!("the fake serves no {other}"),
        };
        assert_eq!(rt, builtin);
        assert!(rt.status_subresource, "{}", crd.kind);
    }
    assert!(!ResourceType::cluster_static_entries().namespaced);
    assert!(ResourceType::batch_sandboxes().namespaced);
    assert!(ResourceType::pools().namespaced);
    let fake = fake_kube::start().await.unwrap();
    let get = |path: String| async move { reqwest::get(path).await.unwrap().status().as_u16() };
    let base = &fake.url;
    assert_eq!(
        get(format!(
            "{base}/apis/spire.spiffe.io/v1alpha1/namespaces/{NS}/clusterstaticentries"
        ))
        .await,
        404
    );
    assert_eq!(
        get(format!(
            "{base}/apis/spire.spiffe.io/v1alpha1/clusterstaticentries"
        ))
        .await,
        200
    );
    assert_eq!(
        get(format!(
            "{base}/apis/sandbox.opensandbox.io/v1alpha1/batchsandboxes/x"
        ))
        .await,
        404
    );
    // The BatchSandbox schema: replicas is defaulted, its status fields are typed.
    let (code, s) = post_json(
        &fake,
        &format!("/apis/sandbox.opensandbox.io/v1alpha1/namespaces/{NS}/batchsandboxes"),
        json!({"apiVersion": "sandbox.opensandbox.io/v1alpha1", "kind": "BatchSandbox",
               "metadata": {"name": "sb"}, "spec": {"poolRef": "ci", "replica": 1}}),
    )
    .await;
    assert_eq!(code, 400, "{s}");
    assert_eq!(
        s["message"],
        "strict decoding error: unknown field \"spec.replica\""
    );
}

/// Peer fidelity: the SPIFFE CSI driver refuses to mount a volume that is not
/// `readOnly: true` (the Pod would wait in ContainerCreating with the driver's message);
/// the fake refuses such a Pod at once, with that message.
#[tokio::test]
async fn a_writable_spiffe_csi_volume_is_refused_with_the_drivers_message() {
    use k8s_openapi::api::core::v1::{CSIVolumeSource, Volume};
    let fake = fake_kube::start().await.unwrap();
    let pods: Api<Pod> = Api::namespaced(fake.client().unwrap(), NS);
    let with_csi = |read_only: Option<bool>| {
        let mut p = pod("job", &[]);
        p.spec.as_mut().unwrap().volumes = Some(vec![Volume {
            name: "spiffe".into(),
            csi: Some(CSIVolumeSource {
                driver: "csi.spiffe.io".into(),
                read_only,
                ..Default::default()
            }),
            ..Default::default()
        }]);
        p
    };
    for read_only in [None, Some(false)] {
        let s = api_error(
            pods.create(&PostParams::default(), &with_csi(read_only))
                .await,
        );
        assert_eq!(s.code, 422);
        assert_eq!(cause_fields(&s), ["spec.volumes[0].csi.readOnly"]);
        assert!(
            s.message
                .contains("pod.spec.volumes[].csi.readOnly must be set to 'true'")
        );
    }
    pods.create(&PostParams::default(), &with_csi(Some(true)))
        .await
        .unwrap();
}

/// Peer fidelity: what the API server's own validation refuses beyond the schema: a Lease
/// of no duration, an env var with both `value` and `valueFrom`, a change to an immutable
/// Secret's data (its metadata may change: the backend makes it owned by its Pod), and a
/// label selector whose value no label can have (`400`).
#[tokio::test]
async fn leases_env_vars_immutable_secrets_and_selectors_are_validated_as_on_a_real_server() {
    use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
    use k8s_openapi::api::core::v1::{EnvVar, EnvVarSource, SecretKeySelector};
    let fake = fake_kube::start().await.unwrap();
    let client = fake.client().unwrap();
    let leases: Api<Lease> = Api::namespaced(client.clone(), NS);
    let lease = Lease {
        metadata: ObjectMeta {
            name: Some("leader".into()),
            ..Default::default()
        },
        spec: Some(LeaseSpec {
            lease_duration_seconds: Some(0),
            ..Default::default()
        }),
    };
    let s = api_error(leases.create(&PostParams::default(), &lease).await);
    assert_eq!(cause_fields(&s), ["spec.leaseDurationSeconds"]);

    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let mut both = pod("job", &[]);
    both.spec.as_mut().unwrap().containers[0].env = Some(vec![EnvVar {
        name: "CAP".into(),
        value: Some("x".into()),
        value_from: Some(EnvVarSource {
            secret_key_ref: Some(SecretKeySelector {
                name: "s".into(),
                key: "k".into(),
                optional: None,
            }),
            ..Default::default()
        }),
    }]);
    let s = api_error(pods.create(&PostParams::default(), &both).await);
    assert_eq!(cause_fields(&s), ["spec.containers[0].env[0].valueFrom"]);

    let secrets: Api<Secret> = Api::namespaced(client.clone(), NS);
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some("cap".into()),
            ..Default::default()
        },
        immutable: Some(true),
        string_data: Some(BTreeMap::from([("k".to_owned(), "v".to_owned())])),
        ..Default::default()
    };
    secrets
        .create(&PostParams::default(), &secret)
        .await
        .unwrap();
    let s = api_error(
        secrets
            .patch(
                "cap",
                &PatchParams::default(),
                &Patch::Merge(json!({"stringData": {"k": "w"}})),
            )
            .await,
    );
    assert_eq!(
        (s.code, cause_fields(&s).as_slice()),
        (422, &["data".to_owned()][..])
    );
    secrets
        .patch(
            "cap",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"owned": "yes"}}})),
        )
        .await
        .expect("an immutable Secret's metadata may change");

    let s = api_error(
        pods.list(&ListParams::default().labels("repo=owner/repo"))
            .await,
    );
    assert_eq!((s.code, s.reason.as_str()), (400, "BadRequest"));
}

/// Peer fidelity: deletion as the real API server does it: an object with finalizers is
/// only marked (`deletionTimestamp`), takes no new finalizer, and goes when its last one is
/// removed; a Pod a node runs terminates gracefully (marked with its grace period until
/// deleted with none left, as the kubelet does), while an unscheduled or finished Pod goes
/// at once.
#[tokio::test]
async fn finalizers_and_graceful_pod_termination_keep_objects_until_released() {
    let fake = fake_kube::start().await.unwrap();
    let client = fake.client().unwrap();
    let secrets: Api<Secret> = Api::namespaced(client.clone(), NS);
    let held = Secret {
        metadata: ObjectMeta {
            name: Some("held".into()),
            finalizers: Some(vec!["example.org/a".into()]),
            ..Default::default()
        },
        ..Default::default()
    };
    secrets.create(&PostParams::default(), &held).await.unwrap();
    secrets
        .delete("held", &DeleteParams::default())
        .await
        .unwrap();
    let marked = secrets.get("held").await.unwrap();
    assert!(
        marked.metadata.deletion_timestamp.is_some(),
        "marked, not gone"
    );
    let s = api_error(
        secrets
            .patch(
                "held",
                &PatchParams::default(),
                &Patch::Merge(
                    json!({"metadata": {"finalizers": ["example.org/a", "example.org/b"]}}),
                ),
            )
            .await,
    );
    assert!(s.message.contains("no new finalizers"), "{}", s.message);
    secrets
        .patch(
            "held",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": null}})),
        )
        .await
        .unwrap();
    assert!(
        secrets.get_opt("held").await.unwrap().is_none(),
        "gone with its last finalizer"
    );

    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    for name in ["running", "pending", "finished"] {
        pods.create(&PostParams::default(), &pod(name, &[]))
            .await
            .unwrap();
    }
    let bind = |name: &'static str| {
        let url = format!("{}/api/v1/namespaces/{NS}/pods/{name}/binding", fake.url);
        async move {
            let body = json!({"apiVersion": "v1", "kind": "Binding", "metadata": {"name": name},
                              "target": {"apiVersion": "v1", "kind": "Node", "name": "node-a"}});
            let resp = reqwest::Client::new()
                .post(url)
                .json(&body)
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), 201);
        }
    };
    bind("running").await;
    bind("finished").await;
    pods.patch_status(
        "finished",
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"phase": "Succeeded"}})),
    )
    .await
    .unwrap();
    for name in ["running", "pending", "finished"] {
        pods.delete(name, &DeleteParams::default()).await.unwrap();
    }
    let terminating = pods.get("running").await.unwrap();
    assert_eq!(terminating.metadata.deletion_grace_period_seconds, Some(30));
    assert!(terminating.metadata.deletion_timestamp.is_some());
    assert!(
        pods.get_opt("pending").await.unwrap().is_none(),
        "unscheduled: at once"
    );
    assert!(
        pods.get_opt("finished").await.unwrap().is_none(),
        "finished: at once"
    );
    let now = DeleteParams {
        grace_period_seconds: Some(0),
        ..Default::default()
    };
    pods.delete("running", &now).await.unwrap();
    assert!(
        pods.get_opt("running").await.unwrap().is_none(),
        "deleted with no grace left"
    );
}
