//! The Kubernetes manifests under `deploy/kubernetes`: they render with `kubectl kustomize`,
//! grant every API call the Pod backend makes (and nothing else of Pods, Secrets, Nodes
//! or ClusterStaticEntries), and run the controller as DESIGN invariant 18 requires.
//! Schema validation is `deploy/validate.sh` (kubernetes-validate, pinned).

use std::collections::{BTreeMap, BTreeSet};
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
        // `spire_cluster_name` and `spire_class_name` are sandbox-identity's
        // (docs/vm-backend.md); `spire_server_*` and `spire_executor_*` are the process
        // backend's `executor_identity = "spire"` (docs/security.md).
        .filter(|k| k.starts_with("pod_") || (k.starts_with("spire_") && !k.ends_with("_name")))
        .filter(|k| !k.starts_with("spire_server_") && !k.starts_with("spire_executor_"))
        .filter(|k| !guide.contains(&format!("| `{k}` |")))
        .collect();
    assert!(missing.is_empty(), "docs/pod-backend.md lacks {missing:?}");
}

/// The `config.toml` of a rendered ConfigMap, written to a file under `dir`.
fn config_file(objects: &[Value], name: &str, dir: &Path) -> std::path::PathBuf {
    let text = find(objects, "ConfigMap", name)["data"]["config.toml"]
        .as_str()
        .unwrap();
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, text).unwrap();
    path
}

fn sources(file: std::path::PathBuf) -> gdr_controller::settings::Sources {
    gdr_controller::settings::Sources {
        file: Some(file),
        overrides: Vec::new(),
        environment: false,
    }
}

/// The base configuration is one the controller starts with (every backend it enables is
/// configured, the VM backend included), and every secret it names is a file of the
/// Secret the Deployment mounts.
#[test]
fn the_base_configuration_is_a_complete_controller_configuration() {
    let objects = render("deploy/kubernetes/base");
    let dir = tempfile::tempdir().unwrap();
    let settings = gdr_controller::settings::Settings::load(&sources(config_file(
        &objects,
        "gitea-dynamic-runner",
        dir.path(),
    )))
    .unwrap_or_else(|e| panic!("the base config.toml does not load:\n{e}"));
    match settings.vm.map(|vm| vm.kind) {
        Some(gdr_controller::settings::VmBackend::OpenSandbox(o)) => {
            assert!(
                o.api_key_file
                    .starts_with("/run/secrets/gitea-dynamic-runner")
            );
            assert!(
                o.backend.extra_env.contains_key("SPIFFE_ENDPOINT_SOCKET"),
                "the executor in the VM is told where its SPIRE agent is"
            );
        }
        other => panic!("the base runs the OpenSandbox vm backend, not {other:?}"),
    }
    let np = find(&objects, "NetworkPolicy", "controller");
    assert!(
        np["spec"]["egress"]
            .as_array()
            .unwrap()
            .iter()
            .any(|rule| rule["ports"][0]["port"] == 443
                && rule["to"][0]["ipBlock"]["cidr"] == "192.0.2.20/32"),
        "the controller may reach the OpenSandbox API"
    );
}

/// DESIGN (components, sandbox-identity): it runs in the sandbox cluster with two
/// leader-elected replicas, ready only as leader, with its own service account granted
/// exactly what the reconciler calls and no Secret, and a configuration it starts with.
#[test]
fn sandbox_identity_runs_leader_elected_with_its_own_least_privilege_and_no_secret() {
    let objects = render("deploy/kubernetes/sandbox-identity");
    let d = find(&objects, "Deployment", "sandbox-identity");
    assert_eq!(d["metadata"]["namespace"], "opensandbox");
    assert_eq!(d["spec"]["replicas"], 2);
    let pod = &d["spec"]["template"]["spec"];
    assert_eq!(pod["serviceAccountName"], "sandbox-identity");
    let c = &pod["containers"][0];
    assert_eq!(strings(&c["args"])[0], "sandbox-identity");
    assert!(
        c["env"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["name"] == "LEADER_ELECTION" && e["value"] == "true")
    );
    assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert_eq!(c["securityContext"]["readOnlyRootFilesystem"], true);
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    // No credential besides the service account token.
    let text = serde_json::to_string(&objects).unwrap();
    assert!(!text.contains("secretKeyRef") && !text.contains("\"secretName\""));
    assert!(objects.iter().all(|o| o["kind"] != "Secret"));

    let role = find(&objects, "Role", "sandbox-identity");
    let cluster_role = find(
        &objects,
        "ClusterRole",
        "gitea-dynamic-runner-sandbox-identity",
    );
    let t = |g: &str, r: &str, v: &str| (g.to_owned(), r.to_owned(), v.to_owned());
    let mut want: BTreeSet<_> = ["list", "watch"]
        .iter()
        .map(|v| t("sandbox.opensandbox.io", "batchsandboxes", v))
        .collect();
    want.insert(t("", "pods", "get"));
    want.insert(t("sandbox.opensandbox.io", "pools", "get"));
    for v in ["get", "create", "update"] {
        want.insert(t("coordination.k8s.io", "leases", v));
    }
    assert_eq!(grants(role), want, "the namespaced grants");
    let want: BTreeSet<_> = ["list", "watch", "create", "patch", "delete"]
        .iter()
        .map(|v| t("spire.spiffe.io", "clusterstaticentries", v))
        .collect();
    assert_eq!(grants(cluster_role), want, "the cluster-scoped grants");

    let dir = tempfile::tempdir().unwrap();
    let settings = gdr_controller::settings::SandboxIdentitySettings::load(&sources(config_file(
        &objects,
        "sandbox-identity",
        dir.path(),
    )))
    .unwrap_or_else(|e| panic!("sandbox-identity's config.toml does not load:\n{e}"));
    assert_eq!(settings.reconciler.namespace, role["metadata"]["namespace"]);
    // Leader election comes from the Deployment's environment.
    assert!(settings.leader.is_none());
    let lease_namespace = find(&objects, "ConfigMap", "sandbox-identity")["data"]["config.toml"]
        .as_str()
        .unwrap()
        .lines()
        .any(|l| l == "lease_namespace = \"opensandbox\"");
    assert!(lease_namespace, "the Lease lives where the Role grants it");
}

/// The kustomizations the project ships (every overlay included).
fn kustomizations() -> Vec<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut dirs = vec![
        "deploy/kubernetes/base".to_owned(),
        "deploy/kubernetes/sandbox-identity".to_owned(),
    ];
    let mut overlays: Vec<String> = std::fs::read_dir(root.join("deploy/kubernetes/overlays"))
        .unwrap()
        .map(|e| {
            format!(
                "deploy/kubernetes/overlays/{}",
                e.unwrap().file_name().to_string_lossy()
            )
        })
        .collect();
    overlays.sort();
    dirs.extend(overlays);
    dirs
}

/// The file a mounted path names: (volume name, path inside the volume), by the container's
/// mount whose directory holds `path`.
fn mounted<'a>(container: &'a Value, path: &str) -> Option<(&'a str, String)> {
    container["volumeMounts"].as_array()?.iter().find_map(|m| {
        let dir = m["mountPath"].as_str()?;
        let rest = path.strip_prefix(dir)?.strip_prefix('/')?;
        Some((m["name"].as_str()?, rest.to_owned()))
    })
}

/// No DESIGN invariant (deployment): in every shipped kustomization, each Deployment's
/// service account, ConfigMaps and Secrets exist under the names it mounts, the
/// configuration file its arguments name is a key of the mounted ConfigMap, and every
/// `*_file` the configuration reads lies in a mounted Secret under a key the documented
/// `kubectl create secret` command (deploy/kubernetes/base/config.yaml) creates.
#[test]
fn every_name_a_deployment_mounts_exists_in_what_ships() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let secret_doc =
        std::fs::read_to_string(root.join("deploy/kubernetes/base/config.yaml")).unwrap();
    let documented_keys: BTreeSet<&str> = secret_doc
        .split_whitespace()
        .filter_map(|w| w.strip_prefix("--from-file="))
        .collect();
    for dir in kustomizations() {
        let objects = render(&dir);
        let exists = |kind: &str, ns: &Value, name: &str| {
            objects.iter().any(|o| {
                o["kind"] == kind
                    && o["metadata"]["name"] == name
                    && o["metadata"]["namespace"] == *ns
            })
        };
        for d in objects.iter().filter(|o| o["kind"] == "Deployment") {
            let ns = &d["metadata"]["namespace"];
            let what = format!("{dir}: Deployment {}", d["metadata"]["name"]);
            let pod = &d["spec"]["template"]["spec"];
            let sa = pod["serviceAccountName"].as_str().unwrap();
            assert!(
                exists("ServiceAccount", ns, sa),
                "{what}: no ServiceAccount {sa}"
            );
            let mut configmaps = BTreeMap::new();
            let mut secrets = BTreeMap::new();
            for v in pod["volumes"].as_array().into_iter().flatten() {
                let vname = v["name"].as_str().unwrap();
                if let Some(cm) = v["configMap"]["name"].as_str() {
                    assert!(exists("ConfigMap", ns, cm), "{what}: no ConfigMap {cm}");
                    configmaps.insert(vname, cm);
                }
                if let Some(secret) = v["secret"]["secretName"].as_str() {
                    assert!(exists("Secret", ns, secret), "{what}: no Secret {secret}");
                    assert!(
                        secret_doc.contains(&format!("create secret generic {secret}")),
                        "{what}: the Secret {secret} is not in the documented create command"
                    );
                    secrets.insert(vname, secret);
                }
            }
            let c = &pod["containers"][0];
            let args = strings(&c["args"]);
            let config_path = args[args.iter().position(|a| *a == "--config").unwrap() + 1];
            let (volume, key) = mounted(c, config_path)
                .unwrap_or_else(|| panic!("{what}: {config_path} is in no mounted volume"));
            let cm = configmaps
                .get(volume)
                .unwrap_or_else(|| panic!("{what}: {config_path} is not in a ConfigMap"));
            let config = objects
                .iter()
                .find(|o| o["kind"] == "ConfigMap" && o["metadata"]["name"] == *cm)
                .unwrap()["data"][&key]
                .as_str()
                .unwrap_or_else(|| panic!("{what}: ConfigMap {cm} has no key {key}"));
            for line in config.lines().filter(|l| l.contains("_file = \"/")) {
                let path = line.split('"').nth(1).unwrap();
                let (volume, key) = mounted(c, path)
                    .unwrap_or_else(|| panic!("{what}: {path} ({line}) is in no mounted volume"));
                assert!(
                    secrets.contains_key(volume),
                    "{what}: {path} is not in a Secret"
                );
                assert!(
                    documented_keys.contains(key.as_str()),
                    "{what}: {path} reads key {key}, which the documented create command does not create (it creates {documented_keys:?})"
                );
            }
        }
    }
}

/// The schema check of the fake API server uses the Kubernetes releases the docs and
/// deploy/validate.sh claim: the oldest the manifests are validated against, and the
/// newest the pinned kubernetes-validate ships.
#[test]
fn the_fake_api_server_checks_against_the_oldest_and_newest_kubernetes_the_docs_claim() {
    use gdr_testkit::fake_kube::schema::{KUBERNETES_VERSIONS, schemas};
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let script = std::fs::read_to_string(root.join("deploy/validate.sh")).unwrap();
    let value = |key: &str| {
        script
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{key}=")))
            .unwrap_or_else(|| panic!("deploy/validate.sh sets no {key}"))
            .to_owned()
    };
    assert_eq!(KUBERNETES_VERSIONS[0], value("KUBERNETES_VERSION"));
    assert_eq!(KUBERNETES_VERSIONS[1], value("KUBERNETES_VALIDATE_VERSION"));
    let oldest = KUBERNETES_VERSIONS[0].trim_end_matches(".0");
    for doc in ["README.md", "docs/pod-backend.md"] {
        let text = std::fs::read_to_string(root.join(doc)).unwrap();
        assert!(
            text.contains(&format!("Kubernetes ≥ {oldest}")),
            "{doc} claims another oldest Kubernetes"
        );
    }
    assert_eq!(
        schemas().expect("the schemas load").versions(),
        KUBERNETES_VERSIONS
    );
}

/// What `nixos-tests/cluster.nix` deploys: `nixos-tests/cluster-manifests.nix` (evaluated
/// with nix-instantiate, as the VM test imports it) written out beside a copy of the base as
/// `base/`, with a dummy file for each of the Secret's files, rendered with kustomize.
struct ClusterTest {
    /// The evaluated manifests file: `files`, `secretFiles`, the addresses.
    manifests: Value,
    objects: Vec<Value>,
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

fn render_cluster_test() -> ClusterTest {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = std::process::Command::new("nix-instantiate")
        // Evaluation only: nothing is built or written to a store.
        .args(["--store", "dummy://", "--eval", "--strict", "--json"])
        .arg(repo.join("nixos-tests/cluster-manifests.nix"))
        .args(["--argstr", "version", env!("CARGO_PKG_VERSION")])
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "nix-instantiate ({e}); install it with `apt-get install nix-bin` — .ci/run does"
            )
        });
    assert!(
        out.status.success(),
        "nix-instantiate nixos-tests/cluster-manifests.nix: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let manifests: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let dir = tempfile::tempdir().unwrap();
    copy_dir(
        &repo.join("deploy/kubernetes/base"),
        &dir.path().join("base"),
    );
    for (name, text) in manifests["files"].as_object().expect("files") {
        std::fs::write(dir.path().join(name), text.as_str().unwrap()).unwrap();
    }
    std::fs::create_dir(dir.path().join("secrets")).unwrap();
    for name in strings(&manifests["secretFiles"]) {
        std::fs::write(dir.path().join("secrets").join(name), "dummy").unwrap();
    }
    let objects = render(dir.path().to_str().unwrap());
    ClusterTest { manifests, objects }
}

/// The `"…"` value of `key = "…"` in a TOML text.
fn toml_string<'a>(toml: &'a str, key: &str) -> Option<&'a str> {
    toml.lines().find_map(|line| {
        let (k, v) = line.split_once('=')?;
        (k.trim() == key).then(|| v.trim().trim_matches('"'))
    })
}

/// Whether an egress rule of `policy` lets the selected Pods open a TCP connection to
/// `ip:port` (an `ipBlock` containing the address, outside its `except`, and the port).
fn egress_admits(policy: &Value, ip: std::net::Ipv4Addr, port: u16) -> bool {
    let in_block = |block: &Value| {
        let contains = |cidr: &str| {
            let (net, len) = cidr.split_once('/').unwrap_or((cidr, "32"));
            let (net, len): (std::net::Ipv4Addr, u32) =
                (net.parse().unwrap(), len.parse().unwrap());
            let mask = u32::MAX.checked_shl(32 - len).unwrap_or(0);
            u32::from(ip) & mask == u32::from(net) & mask
        };
        block["cidr"].as_str().is_some_and(contains)
            && !strings(&block["except"]).into_iter().any(contains)
    };
    policy["spec"]["egress"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|rule| {
            let to_ok = rule["to"]
                .as_array()
                .is_none_or(|peers| peers.iter().any(|peer| in_block(&peer["ipBlock"])));
            let port_ok = rule["ports"].as_array().is_none_or(|ports| {
                ports.iter().any(|p| {
                    p["port"].as_u64() == Some(u64::from(port))
                        && p["protocol"].as_str().unwrap_or("TCP") == "TCP"
                })
            });
            to_ok && port_ok
        })
}

fn host_port(url: &str) -> (std::net::Ipv4Addr, u16) {
    let url = url::Url::parse(url).unwrap_or_else(|e| panic!("{url}: {e}"));
    let host = url.host_str().unwrap().parse().expect("an IPv4 address");
    (host, url.port_or_known_default().expect("a port"))
}

/// No DESIGN invariant (deployment; the cluster VM test): what `nixos-tests/cluster.nix`
/// deploys is the base with the test's overlay, and the overlay fits the base: the
/// ConfigMap and Secret it replaces are the ones the Deployment mounts, the configuration it
/// supplies loads and names only files of that Secret, no CSI volume is left and executor
/// Pods get the agent's directory with `pod_spiffe_host_path` (the test cluster has no
/// SPIFFE CSI driver), the facade Service gets the address
/// `runner_facade_url` names, and the controller's NetworkPolicy (k3s enforces it) admits
/// Gitea, NATS and the API server at the addresses the test gives them.
#[test]
fn the_cluster_vm_tests_overlay_fits_the_base_it_deploys() {
    let ClusterTest { manifests, objects } = render_cluster_test();
    let d = find(&objects, "Deployment", "gitea-dynamic-runner");
    let pod = &d["spec"]["template"]["spec"];
    assert_eq!(d["spec"]["replicas"], 1);
    assert_eq!(pod["containers"][0]["image"], manifests["controllerImage"]);
    let volumes = pod["volumes"].as_array().unwrap();
    let csi: Vec<&Value> = volumes.iter().filter(|v| !v["csi"].is_null()).collect();
    assert!(
        csi.is_empty(),
        "CSI volumes left, no driver in the test cluster: {csi:?}"
    );

    // The mounted ConfigMap is the test's configuration, and it loads.
    let config_map = volumes
        .iter()
        .find_map(|v| v["configMap"]["name"].as_str())
        .unwrap();
    let config = find(&objects, "ConfigMap", config_map)["data"]["config.toml"]
        .as_str()
        .unwrap();
    assert_eq!(
        config, manifests["files"]["config.toml"],
        "the mounted ConfigMap {config_map} is not the test's configuration"
    );
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.toml");
    std::fs::write(&path, config).unwrap();
    let settings = gdr_controller::settings::Settings::load(&sources(path))
        .unwrap_or_else(|e| panic!("the cluster test's config.toml does not load:\n{e}"));
    // Executor Pods mount the node agent's directory too (no CSI driver there either).
    assert_eq!(
        toml_string(config, "pod_spiffe_host_path"),
        manifests["agentSocketDir"].as_str(),
        "executor Pods must get the agent's socket directory without the CSI driver"
    );

    // Every secret file it names is a file of the mounted Secret, readable under the mode
    // the Secret volume gives it (its group's read bit through fsGroup).
    let secret_volume = volumes.iter().find(|v| v["secret"].is_object()).unwrap();
    let secret_name = secret_volume["secret"]["secretName"].as_str().unwrap();
    let secret = find(&objects, "Secret", secret_name);
    let mount = pod["containers"][0]["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == secret_volume["name"])
        .unwrap()["mountPath"]
        .as_str()
        .unwrap();
    let mut named = 0;
    for line in config.lines().filter(|l| l.contains("_file = ")) {
        let (key, _) = line.split_once(" = ").unwrap();
        let file = toml_string(config, key.trim()).unwrap();
        if let Some(name) = file.strip_prefix(&format!("{mount}/")) {
            named += 1;
            assert!(
                secret["data"][name].is_string(),
                "{key} names {file}, but Secret {secret_name} has no {name}: {secret}"
            );
        }
    }
    assert!(named >= 4, "the configuration names too few secret files");
    if pod["securityContext"]["fsGroup"].is_number() {
        assert_eq!(
            settings.secrets,
            gdr_controller::settings::SecretPermissions::GroupReadable,
            "the Secret's files are group-readable through fsGroup; the controller must accept that"
        );
    }

    // The facade Service at the address runner_facade_url names.
    let svc = find(&objects, "Service", "gitea-dynamic-runner-facade");
    let (facade, _) = host_port(toml_string(config, "runner_facade_url").unwrap());
    assert_eq!(svc["spec"]["clusterIP"], facade.to_string());

    // The controller reaches what the test runs on the node.
    let policy = find(&objects, "NetworkPolicy", "controller");
    let node: std::net::Ipv4Addr = manifests["nodeIp"].as_str().unwrap().parse().unwrap();
    let api_port = manifests["ports"]["apiServer"].as_u64().unwrap() as u16;
    for (what, (ip, port)) in [
        (
            "Gitea",
            host_port(toml_string(config, "gitea_instance_url").unwrap()),
        ),
        ("NATS", host_port(toml_string(config, "nats_url").unwrap())),
        ("the API server", (node, api_port)),
    ] {
        assert!(
            egress_admits(policy, ip, port),
            "the controller's NetworkPolicy does not admit {what} at {ip}:{port}: {}",
            policy["spec"]["egress"]
        );
    }
}
