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
