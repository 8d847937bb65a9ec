//! The Kubernetes manifests under `deploy/kubernetes`: they render with `kubectl kustomize`,
//! grant every API call the Pod backend makes (and nothing else of Pods, Secrets, Nodes
//! or ClusterStaticEntries), and run the controller as DESIGN invariant 18 requires.
//! Schema validation is `deploy/validate.sh` (kubernetes-validate, pinned).

// A panic is how a test fails.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::path::Path;

use gdr_backends::kubernetes::{API_CALLS, ApiCall};
use serde_json::Value;

/// Renders a kustomization into its objects.
fn render(dir: &str) -> Vec<Value> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(dir);
    let out = std::process::Command::new("kubectl")
        .arg("kustomize")
        .arg(&path)
        .output()
        .expect("kubectl (kustomize) is installed");
    assert!(
        out.status.success(),
        "kubectl kustomize {dir}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    serde_saphyr::from_multiple::<Value>(&text).expect("rendered YAML")
}

fn find<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

fn strings(v: &Value) -> Vec<&str> {
    v.as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect()
}

/// (group, resource, verb) triples a role grants.
fn grants(role: &Value) -> BTreeSet<(String, String, String)> {
    let mut out = BTreeSet::new();
    for rule in role["rules"].as_array().unwrap() {
        for g in strings(&rule["apiGroups"]) {
            for r in strings(&rule["resources"]) {
                for v in strings(&rule["verbs"]) {
                    out.insert((g.to_owned(), r.to_owned(), v.to_owned()));
                }
            }
        }
    }
    out
}

fn triple(c: &ApiCall) -> (String, String, String) {
    (c.group.to_owned(), c.resource.to_owned(), c.verb.to_owned())
}

/// No DESIGN invariant (deployment): the base and the pod-only overlay render with every object
/// a deployment needs, and the overlay enables only the Pod worker.
#[test]
fn the_base_and_the_pod_only_overlay_render_with_kustomize() {
    for dir in [
        "deploy/kubernetes/base",
        "deploy/kubernetes/overlays/pod-only",
    ] {
        let objects = render(dir);
        let kinds: BTreeSet<&str> = objects.iter().filter_map(|o| o["kind"].as_str()).collect();
        for kind in [
            "Namespace",
            "ServiceAccount",
            "Role",
            "RoleBinding",
            "ClusterRole",
            "ClusterRoleBinding",
            "Deployment",
            "Service",
            "PodDisruptionBudget",
            "NetworkPolicy",
            "ConfigMap",
        ] {
            assert!(kinds.contains(kind), "{dir} lacks a {kind}");
        }
    }
    let overlay = render("deploy/kubernetes/overlays/pod-only");
    let env = &find(&overlay, "Deployment", "gitea-dynamic-runner")["spec"]["template"]["spec"]["containers"]
        [0]["env"];
    assert!(
        env.as_array()
            .unwrap()
            .iter()
            .any(|e| e["name"] == "COMPONENTS" && e["value"] == "scheduler,pod-worker")
    );
}

/// No DESIGN invariant (deployment, least privilege): RBAC grants every call of the Pod
/// backend's API table where it is made (the Role for namespaced calls, the ClusterRole for
/// cluster-scoped ones), nothing of those resources beyond it, and nothing to the executors'
/// account.
#[test]
fn the_rbac_rules_grant_exactly_the_pod_backends_api_calls() {
    let objects = render("deploy/kubernetes/base");
    let role = find(&objects, "Role", "gitea-dynamic-runner");
    let cluster_role = find(&objects, "ClusterRole", "gitea-dynamic-runner");
    assert_eq!(
        role["metadata"]["namespace"], "gitea-actions",
        "the Role lives in the executor namespace (pod_namespace default)"
    );
    let (ns_grants, cluster_grants) = (grants(role), grants(cluster_role));
    for call in API_CALLS {
        let granted = if call.namespaced {
            &ns_grants
        } else {
            &cluster_grants
        };
        assert!(
            granted.contains(&triple(call)),
            "RBAC does not grant {call} ({})",
            if call.namespaced {
                "Role"
            } else {
                "ClusterRole"
            }
        );
    }
    let table: BTreeSet<_> = API_CALLS.iter().map(triple).collect();
    // The leader Lease is the controller's, not the backend's.
    let lease = |(g, _, _): &&(String, String, String)| g == "coordination.k8s.io";
    let extra: Vec<_> = ns_grants
        .iter()
        .chain(cluster_grants.iter())
        .filter(|t| !lease(t) && !table.contains(*t))
        .collect();
    assert!(
        extra.is_empty(),
        "granted beyond what the backend calls: {extra:?}"
    );
    for binding in ["RoleBinding", "ClusterRoleBinding"] {
        let b = find(&objects, binding, "gitea-dynamic-runner");
        assert_eq!(b["subjects"][0]["name"], "gitea-dynamic-runner");
        assert_eq!(b["subjects"][0]["namespace"], "gitea-actions");
    }
    // The executors' account is granted nothing.
    let bound: Vec<&Value> = objects
        .iter()
        .filter(|o| o["kind"].as_str().is_some_and(|k| k.ends_with("Binding")))
        .flat_map(|b| b["subjects"].as_array().unwrap())
        .collect();
    assert!(bound.iter().all(|s| s["name"] != "gitea-task-executor"));
}

/// DESIGN invariants 17, 18: two replicas with leader election, ready only as leader (so the
/// facade Service routes executors to it), non-root with a read-only root filesystem, every
/// secret given as a file; executors may reach only the facade, and nothing reaches them.
#[test]
fn the_controller_runs_two_leader_elected_non_root_replicas_ready_only_as_leader() {
    let objects = render("deploy/kubernetes/base");
    let d = find(&objects, "Deployment", "gitea-dynamic-runner");
    assert_eq!(d["spec"]["replicas"], 2);
    let pod = &d["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    assert!(
        c["env"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["name"] == "LEADER_ELECTION" && e["value"] == "true")
    );
    assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(c["securityContext"]["readOnlyRootFilesystem"], true);
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    assert!(c["resources"]["requests"].is_object());
    let config = find(&objects, "ConfigMap", "gitea-dynamic-runner")["data"]["config.toml"]
        .as_str()
        .unwrap();
    for line in config
        .lines()
        .filter(|l| l.contains("password") || l.contains("token") || l.contains("key"))
    {
        assert!(
            line.contains("_file = \"/run/secrets/"),
            "a secret not given as a file: {line}"
        );
    }
    let svc = find(&objects, "Service", "gitea-dynamic-runner-facade");
    assert_eq!(
        svc["spec"]["selector"],
        d["spec"]["selector"]["matchLabels"]
    );
    let np = find(&objects, "NetworkPolicy", "executors-reach-only-the-facade");
    assert_eq!(
        np["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"],
        "executor"
    );
    assert!(
        np["spec"]["ingress"].is_null(),
        "nothing may reach an executor"
    );
}

/// The pod-only overlay's configuration (its ConfigMap plus the container's environment,
/// as the controller reads them) loads into typed settings with the Pod backend and its
/// profile: a key the controller does not know, or a broken profile, fails here rather
/// than in the operator's cluster.
#[test]
fn the_pod_only_configuration_loads_with_the_pod_backend_and_its_profile() {
    use gdr_controller::settings::{KEYS, PodBackend, Settings, Sources};
    let objects = render("deploy/kubernetes/overlays/pod-only");
    let config = find(&objects, "ConfigMap", "gitea-dynamic-runner")["data"]["config.toml"]
        .as_str()
        .unwrap();
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), config).unwrap();
    let d = find(&objects, "Deployment", "gitea-dynamic-runner");
    let overrides: Vec<String> = d["spec"]["template"]["spec"]["containers"][0]["env"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| {
            Some((
                e["name"].as_str()?.to_ascii_lowercase(),
                e["value"].as_str()?,
            ))
        })
        .filter(|(k, _)| KEYS.iter().any(|key| key.name == k))
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    assert!(overrides.contains(&"components=scheduler,pod-worker".to_owned()));
    let mut sources = Sources::overrides(&overrides).unwrap();
    sources.file = Some(file.path().to_path_buf());
    let settings = Settings::load(&sources).expect("the shipped configuration");
    let pod = settings.pod.as_ref().expect("the pod backend is enabled");
    let PodBackend::Kubernetes(k) = &pod.kind else {
        panic!("the shipped pod backend is not kubernetes: {:?}", pod.kind);
    };
    assert_eq!(k.profiles["large"].resources.limits["memory"], "16Gi");
    assert!(settings.declared_labels().contains(&"large".to_owned()));
}

/// The operator guide names every key of the Pod section, so a new key cannot ship
/// undocumented there (the generated reference documents it anyway).
#[test]
fn the_pod_backend_guide_documents_every_pod_key() {
    let guide =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/pod-backend.md"))
            .expect("docs/pod-backend.md");
    let missing: Vec<&str> = gdr_controller::settings::KEYS
        .iter()
        .map(|k| k.name)
        .filter(|k| k.starts_with("pod_") || k.starts_with("spire_"))
        .filter(|k| !guide.contains(&format!("| `{k}` |")))
        .collect();
    assert!(missing.is_empty(), "docs/pod-backend.md lacks {missing:?}");
}
