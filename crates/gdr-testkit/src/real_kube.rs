//! The real Kubernetes control plane, as controller-runtime's envtest runs it: a real `etcd`
//! and a real `kube-apiserver` on loopback, no kubelet, no controller manager. Both are built
//! from their Go modules by `tests/kube-peers/build.sh`, which `.ci/run` runs and whose
//! `KUBE_APISERVER_BIN` and `ETCD_BIN` it exports.
//!
//! The API server runs as a cluster's does where the product meets it: TLS with a serving
//! certificate of a CA made here, client certificates of the same CA (the fixture's admin is
//! in `system:masters`), `--authorization-mode=RBAC`, ServiceAccount tokens signed by a key
//! made here, and the default admission plugins (envtest turns `ServiceAccount` off; here it
//! stays on, so a Pod naming a missing account is refused as in a cluster). What the
//! controller manager would do and a test needs is done by the fixture instead: a
//! namespace it creates gets its `default` ServiceAccount
//! ([`RealKube::create_namespace`]). No controller manager means no garbage collector: an
//! owned object outlives its owner here.
//!
//! A client per ServiceAccount comes from a token of the TokenRequest API
//! ([`RealKube::client_as`]), so RBAC is the real authorizer's. Both processes are killed
//! when the fixture is dropped.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Namespace, ServiceAccount as KubeServiceAccount};
use kube::api::{ApiResource, DynamicObject, GroupVersionKind, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};
use serde_json::{Value, json};
use tokio::process::{Child, Command};

use crate::controller::listener;
pub use crate::fake_kube::ServiceAccount;

/// Start-up is about 3 s here (etcd under 1 s, the API server about 2 s); only a bound on a
/// hang.
const START: Duration = Duration::from_secs(90);

/// The control plane's programs, from the environment `.ci/run` sets from
/// `tests/kube-peers/build.sh`.
#[derive(Clone, Debug)]
pub struct Peers {
    /// `kube-apiserver`.
    pub apiserver: PathBuf,
    /// `etcd`.
    pub etcd: PathBuf,
}

impl Peers {
    /// The programs named by `KUBE_APISERVER_BIN` and `ETCD_BIN`; a test without them fails
    /// saying how to build them (it never passes without its peer), as the real-Gitea
    /// tests do.
    pub fn from_env() -> Peers {
        let var = |name: &str| {
            crate::peer_path(
                name,
                "the real-Kubernetes tests need kube-apiserver and etcd built from their Go module",
                "tests/kube-peers/build.sh",
            )
        };
        Peers {
            apiserver: var("KUBE_APISERVER_BIN"),
            etcd: var("ETCD_BIN"),
        }
    }
}

/// How a test wants the control plane to differ from a cluster's defaults.
#[derive(Clone, Debug)]
pub struct Options {
    /// The API server's watch cache (`--watch-cache`, on by default). Off, every watch goes
    /// to etcd, so a watch from a compacted revision is etcd's own `410 Expired`.
    pub watch_cache: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options { watch_cache: true }
    }
}

/// A running etcd and kube-apiserver with their certificates and data under a temporary
/// directory; both killed when dropped.
pub struct RealKube {
    /// `https://127.0.0.1:<port>`.
    pub url: String,
    /// etcd's client URL, `http://127.0.0.1:<port>` (for `etcdctl`-style operations).
    pub etcd_url: String,
    /// How long the two took to start until the API server was ready and had its `default`
    /// namespace.
    pub started_in: Duration,
    ca_pem: String,
    admin_cert_pem: String,
    admin_key_pem: String,
    peers: Peers,
    options: Options,
    port: u16,
    // Fields drop in declaration order: the API server is killed first, then etcd, and only
    // then is their directory removed.
    apiserver: Child,
    etcd: Child,
    dir: tempfile::TempDir,
}

/// The fixture's certificates: one CA that signs the serving certificate and the clients'.
struct Pki {
    ca_pem: String,
    serving_cert_pem: String,
    serving_key_pem: String,
    admin_cert_pem: String,
    admin_key_pem: String,
    /// The ServiceAccount token signing key (PKCS#8) and its public key (SPKI).
    sa_key_pem: String,
    sa_pub_pem: String,
}

fn rcgen_fail(what: &str) -> impl FnOnce(rcgen::Error) -> String + '_ {
    move |e| format!("{what}: {e}")
}

impl Pki {
    fn new() -> Result<Pki, String> {
        let ca_key = KeyPair::generate().map_err(rcgen_fail("the CA key"))?;
        let mut ca = CertificateParams::default();
        ca.distinguished_name
            .push(DnType::CommonName, "gdr-testkit real-kube CA");
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca = CertifiedIssuer::self_signed(ca, ca_key).map_err(rcgen_fail("the CA"))?;

        let serving_key = KeyPair::generate().map_err(rcgen_fail("the serving key"))?;
        let mut serving =
            CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()])
                .map_err(rcgen_fail("the serving certificate's names"))?;
        serving
            .distinguished_name
            .push(DnType::CommonName, "localhost");
        serving.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let serving = serving
            .signed_by(&serving_key, &ca)
            .map_err(rcgen_fail("the serving certificate"))?;

        // The API server's user is the certificate's CN and its groups the Os.
        let admin_key = KeyPair::generate().map_err(rcgen_fail("the admin key"))?;
        let mut admin = CertificateParams::default();
        admin.distinguished_name.push(DnType::CommonName, "admin");
        admin
            .distinguished_name
            .push(DnType::OrganizationName, "system:masters");
        admin.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let admin = admin
            .signed_by(&admin_key, &ca)
            .map_err(rcgen_fail("the admin certificate"))?;

        let sa_key = KeyPair::generate().map_err(rcgen_fail("the ServiceAccount key"))?;
        Ok(Pki {
            ca_pem: ca.pem(),
            serving_cert_pem: serving.pem(),
            serving_key_pem: serving_key.serialize_pem(),
            admin_cert_pem: admin.pem(),
            admin_key_pem: admin_key.serialize_pem(),
            sa_pub_pem: sa_key.public_key_pem(),
            sa_key_pem: sa_key.serialize_pem(),
        })
    }
}

fn write(path: &Path, text: &str) {
    std::fs::write(path, text).unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
}

fn append(path: &Path) -> std::fs::File {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .unwrap_or_else(|e| panic!("cannot open {}: {e}", path.display()))
}

fn free_port() -> u16 {
    listener()
        .local_addr()
        .unwrap_or_else(|e| panic!("a loopback listener has no address: {e}"))
        .port()
}

/// The resident memory of a process in KiB (`VmRSS`), if it still runs.
fn rss_kib(child: &Child) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{}/status", child.id()?)).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()
}

/// The Node every test cluster has ([`RealKube::install_defaults`]).
pub const NODE: &str = "node-a";

impl RealKube {
    /// Starts etcd and the API server on free loopback ports (chosen again when one was
    /// taken meanwhile) and waits until the API server is ready and has its `default`
    /// namespace, as envtest does.
    pub async fn start(peers: &Peers) -> RealKube {
        Self::start_with(peers, Options::default()).await
    }

    /// [`Self::start`] with `options`.
    pub async fn start_with(peers: &Peers, options: Options) -> RealKube {
        let started = Instant::now();
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("no temporary directory: {e}"));
        let pki = Pki::new().unwrap_or_else(|e| panic!("the fixture's certificates: {e}"));
        let path = |name: &str| dir.path().join(name);
        write(&path("ca.crt"), &pki.ca_pem);
        write(&path("apiserver.crt"), &pki.serving_cert_pem);
        write(&path("apiserver.key"), &pki.serving_key_pem);
        write(&path("sa.key"), &pki.sa_key_pem);
        write(&path("sa.pub"), &pki.sa_pub_pem);
        for _ in 0..5 {
            let (etcd, etcd_url) = start_etcd(peers, dir.path()).await;
            let Some(etcd_url) = etcd_url else { continue };
            let port = free_port();
            let mut kube = RealKube {
                url: format!("https://127.0.0.1:{port}"),
                etcd_url: etcd_url.clone(),
                started_in: Duration::ZERO,
                ca_pem: pki.ca_pem.clone(),
                admin_cert_pem: pki.admin_cert_pem.clone(),
                admin_key_pem: pki.admin_key_pem.clone(),
                apiserver: start_apiserver(peers, dir.path(), &etcd_url, port, &options),
                peers: peers.clone(),
                options: options.clone(),
                port,
                etcd,
                dir,
            };
            if kube.ready().await {
                kube.started_in = started.elapsed();
                tracing::info!(started_in = ?kube.started_in, url = %kube.url,
                    "the real kube-apiserver is ready");
                return kube;
            }
            let log = kube.apiserver_log();
            assert!(
                log.contains("address already in use"),
                "kube-apiserver exited at start:\n{log}"
            );
            // Another port, with a fresh etcd (its data directory is the fixture's).
            let RealKube { dir: kept, .. } = kube;
            let _ = std::fs::remove_dir_all(kept.path().join("etcd"));
            return Box::pin(Self::start_again(peers, options, kept, pki, started)).await;
        }
        panic!(
            "etcd found no free ports in five attempts:\n{}",
            etcd_log(dir.path())
        );
    }

    /// [`Self::start`] in the directory of an attempt whose port was taken meanwhile.
    async fn start_again(
        peers: &Peers,
        options: Options,
        dir: tempfile::TempDir,
        pki: Pki,
        started: Instant,
    ) -> RealKube {
        let (etcd, etcd_url) = start_etcd(peers, dir.path()).await;
        let etcd_url =
            etcd_url.unwrap_or_else(|| panic!("etcd did not start:\n{}", etcd_log(dir.path())));
        let port = free_port();
        let mut kube = RealKube {
            url: format!("https://127.0.0.1:{port}"),
            etcd_url: etcd_url.clone(),
            started_in: Duration::ZERO,
            ca_pem: pki.ca_pem,
            admin_cert_pem: pki.admin_cert_pem,
            admin_key_pem: pki.admin_key_pem,
            apiserver: start_apiserver(peers, dir.path(), &etcd_url, port, &options),
            peers: peers.clone(),
            options,
            port,
            etcd,
            dir,
        };
        assert!(
            kube.ready().await,
            "kube-apiserver exited at start:\n{}",
            kube.apiserver_log()
        );
        kube.started_in = started.elapsed();
        kube
    }

    /// Waits for `/readyz` and the `default` namespace; false when the API server exited.
    async fn ready(&mut self) -> bool {
        let deadline = Instant::now() + START;
        let admin = self.admin().await;
        let namespaces: Api<Namespace> = Api::all(admin.clone());
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.apiserver.try_wait() {
                tracing::warn!(%status, "kube-apiserver exited at start");
                return false;
            }
            let ready = match http::Request::get("/readyz").body(Vec::new()) {
                Ok(request) => admin
                    .request_text(request)
                    .await
                    .is_ok_and(|text| text.trim() == "ok"),
                Err(_) => false,
            };
            if ready && matches!(namespaces.get_opt("default").await, Ok(Some(_))) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!(
            "kube-apiserver was not ready within {START:?}:\n{}",
            self.apiserver_log()
        );
    }

    /// The API server's log (its stderr).
    pub fn apiserver_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("kube-apiserver.log")).unwrap_or_default()
    }

    /// etcd's log (its stderr).
    pub fn etcd_log(&self) -> String {
        etcd_log(self.dir.path())
    }

    /// The process IDs of (kube-apiserver, etcd).
    pub fn pids(&self) -> (Option<u32>, Option<u32>) {
        (self.apiserver.id(), self.etcd.id())
    }

    /// The resident memory of (kube-apiserver, etcd) in KiB, now.
    pub fn rss_kib(&self) -> (Option<u64>, Option<u64>) {
        (rss_kib(&self.apiserver), rss_kib(&self.etcd))
    }

    /// A kubeconfig for the admin (a client certificate in `system:masters`), default
    /// namespace `namespace`.
    pub fn kubeconfig(&self, namespace: &str) -> String {
        let b64 = |s: &str| base64::Engine::encode(&base64::engine::general_purpose::STANDARD, s);
        self.kubeconfig_with(
            namespace,
            json!({
                "client-certificate-data": b64(&self.admin_cert_pem),
                "client-key-data": b64(&self.admin_key_pem),
            }),
        )
    }

    fn kubeconfig_with(&self, namespace: &str, user: Value) -> String {
        let ca = base64::Engine::encode(&base64::engine::general_purpose::STANDARD, &self.ca_pem);
        // JSON is YAML: no second serializer.
        json!({
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "real", "cluster": {
                "server": self.url,
                "certificate-authority-data": ca,
            }}],
            "users": [{"name": "real", "user": user}],
            "contexts": [{"name": "real", "context": {
                "cluster": "real", "user": "real", "namespace": namespace,
            }}],
            "current-context": "real",
        })
        .to_string()
    }

    async fn client_from(kubeconfig: &str) -> Client {
        let kubeconfig = Kubeconfig::from_yaml(kubeconfig)
            .unwrap_or_else(|e| panic!("the fixture's kubeconfig: {e}"));
        let config =
            kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
                .await
                .unwrap_or_else(|e| panic!("the fixture's kubeconfig: {e}"));
        Client::try_from(config).unwrap_or_else(|e| panic!("a kube client: {e}"))
    }

    /// A client of the cluster's admin (`system:masters`: RBAC allows it everything).
    pub async fn admin(&self) -> Client {
        Self::client_from(&self.kubeconfig("default")).await
    }

    /// A token of `account` from the TokenRequest API (an hour, the API server's audience).
    pub async fn token(&self, account: &ServiceAccount) -> String {
        let accounts: Api<KubeServiceAccount> =
            Api::namespaced(self.admin().await, &account.namespace);
        let request = TokenRequest {
            spec: Some(TokenRequestSpec {
                expiration_seconds: Some(3600),
                ..Default::default()
            }),
            ..Default::default()
        };
        accounts
            .create_token_request(&account.name, &PostParams::default(), &request)
            .await
            .unwrap_or_else(|e| panic!("a token of {}: {e}", account.user()))
            .status
            .and_then(|status| status.token)
            .unwrap_or_else(|| panic!("the TokenRequest of {} has no token", account.user()))
    }

    /// A kubeconfig authenticating as `account` with a token of the TokenRequest API.
    pub async fn kubeconfig_as(&self, namespace: &str, account: &ServiceAccount) -> String {
        let token = self.token(account).await;
        self.kubeconfig_with(namespace, json!({ "token": token }))
    }

    /// A client authenticated as `account` (a bearer token of the TokenRequest API): it may
    /// do what the real RBAC authorizer grants that account. The account must exist.
    pub async fn client_as(&self, account: &ServiceAccount) -> Client {
        Self::client_from(&self.kubeconfig_as(&account.namespace, account).await).await
    }

    /// Creates `namespace` (with `labels`) and its `default` ServiceAccount, which a
    /// cluster's controller manager would create and this control plane has not.
    pub async fn create_namespace(&self, namespace: &str, labels: &[(&str, &str)]) {
        let labels: serde_json::Map<String, Value> = labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), json!(v)))
            .collect();
        self.apply(&json!({
            "apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": namespace, "labels": labels},
        }))
        .await;
    }

    /// Creates `object` as the admin (any kind the server serves; found by discovery). A
    /// Namespace also gets its `default` ServiceAccount; an existing object is left as it
    /// is.
    pub async fn apply(&self, object: &Value) {
        self.create(object).await;
        if object["apiVersion"] == "v1" && object["kind"] == "Namespace" {
            let name = object["metadata"]["name"].clone();
            self.create(&json!({
                "apiVersion": "v1", "kind": "ServiceAccount",
                "metadata": {"name": "default", "namespace": name},
            }))
            .await;
        }
    }

    async fn create(&self, object: &Value) {
        let admin = self.admin().await;
        let api_version = object["apiVersion"].as_str().unwrap_or_default();
        let kind = object["kind"].as_str().unwrap_or_default();
        let (group, version) = api_version.rsplit_once('/').unwrap_or(("", api_version));
        let gvk = GroupVersionKind::gvk(group, version, kind);
        let (resource, capabilities) = kube::discovery::pinned_kind(&admin, &gvk)
            .await
            .unwrap_or_else(|e| panic!("the API server does not serve {api_version} {kind}: {e}"));
        let namespaced = capabilities.scope == kube::discovery::Scope::Namespaced;
        let object: DynamicObject = serde_json::from_value(object.clone())
            .unwrap_or_else(|e| panic!("not an object: {e}: {object}"));
        let api: Api<DynamicObject> = match (&object.metadata.namespace, namespaced) {
            (Some(ns), true) => Api::namespaced_with(admin.clone(), ns, &resource),
            (None, true) => Api::default_namespaced_with(admin.clone(), &resource),
            (_, false) => Api::all_with(admin.clone(), &resource),
        };
        match api.create(&PostParams::default(), &object).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            Err(e) => panic!(
                "creating {kind} {:?}: {e}",
                object.metadata.name.as_deref().unwrap_or_default()
            ),
        }
    }

    /// Kills the API server and starts it again on the same port with the same etcd, as an
    /// API server restarts in a cluster: open watches break and clients reconnect.
    pub async fn restart_apiserver(&mut self) {
        let _ = self.apiserver.kill().await;
        self.apiserver = start_apiserver(
            &self.peers,
            self.dir.path(),
            &self.etcd_url,
            self.port,
            &self.options,
        );
        assert!(
            self.ready().await,
            "kube-apiserver did not come back on port {}:\n{}",
            self.port,
            self.apiserver_log()
        );
    }

    /// Compacts etcd's history up to its current revision (what `etcdctl compact` does,
    /// through etcd's JSON gateway); returns that revision. A watch from an older
    /// resourceVersion is then refused with `410 Expired`.
    pub async fn compact_etcd(&self) -> i64 {
        // A range over one key answers with the store's current revision in its header.
        let range = self
            .etcd_post("/v3/kv/range", json!({ "key": "AA==" }))
            .await;
        let revision: i64 = range["header"]["revision"]
            .as_str()
            .and_then(|r| r.parse().ok())
            .unwrap_or_else(|| panic!("etcd's range answer has no revision: {range}"));
        self.etcd_post(
            "/v3/kv/compaction",
            json!({ "revision": revision.to_string(), "physical": true }),
        )
        .await;
        revision
    }

    /// A call of etcd's JSON gateway (`/v3/...`, the gRPC API as JSON).
    async fn etcd_post(&self, path: &str, body: Value) -> Value {
        let answer = reqwest::Client::new()
            .post(format!("{}{path}", self.etcd_url))
            .json(&body)
            .send()
            .await
            .unwrap_or_else(|e| panic!("etcd {path}: {e}"));
        let status = answer.status();
        let text = answer.text().await.unwrap_or_default();
        assert!(status.is_success(), "etcd {path}: {status}: {text}");
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("etcd {path}: {e}: {text}"))
    }

    /// What a test cluster starts with: the shipped RBAC ([`Self::install_shipped_rbac`]),
    /// the vendored CRDs ([`Self::install_crds`]) and the Node [`NODE`] (no kubelet runs
    /// it until a test starts one: [`crate::fake_kubelet::FakeKubelet`] reuses it).
    pub async fn install_defaults(&self) {
        self.install_shipped_rbac().await;
        self.install_crds().await;
        let labels = std::collections::BTreeMap::from([(
            "kubernetes.io/hostname".to_owned(),
            NODE.to_owned(),
        )]);
        crate::fake_kubelet::FakeKubelet::register_node(self.admin().await, NODE, &labels)
            .await
            .unwrap_or_else(|e| panic!("cannot register the Node {NODE}: {e}"));
    }

    /// Installs the RBAC of the shipped manifests (`kubectl kustomize` of
    /// `deploy/kubernetes/base` and `deploy/kubernetes/sandbox-identity`): their Namespaces,
    /// ServiceAccounts, Roles, ClusterRoles and bindings, and the namespaces they name.
    pub async fn install_shipped_rbac(&self) {
        let mut objects = Vec::new();
        for dir in crate::fake_kube::rbac::SHIPPED {
            objects.extend(
                crate::fake_kube::rbac::render(dir)
                    .unwrap_or_else(|e| panic!("the shipped RBAC: {e}")),
            );
        }
        let kind = |o: &Value| o["kind"].as_str().unwrap_or_default().to_owned();
        for namespace in objects.iter().filter(|o| kind(o) == "Namespace") {
            self.apply(namespace).await;
        }
        let mut named: Vec<String> = objects
            .iter()
            .filter_map(|o| o["metadata"]["namespace"].as_str().map(str::to_owned))
            .collect();
        named.sort();
        named.dedup();
        for namespace in named {
            self.create_namespace(&namespace, &[]).await;
        }
        const RBAC: [&str; 5] = [
            "ServiceAccount",
            "Role",
            "RoleBinding",
            "ClusterRole",
            "ClusterRoleBinding",
        ];
        for object in objects.iter().filter(|o| RBAC.contains(&kind(o).as_str())) {
            self.apply(object).await;
        }
    }

    /// Installs the custom resources the test kit has schemas of (ClusterStaticEntry,
    /// BatchSandbox, Pool: [`crate::fake_kube::schema::crds`]) as CustomResourceDefinitions, and
    /// waits until the server serves each.
    pub async fn install_crds(&self) {
        let admin = self.admin().await;
        for crd in crate::fake_kube::schema::crds() {
            self.apply(&crd.definition()).await;
            let resource = ApiResource::from_gvk_with_plural(
                &GroupVersionKind::gvk(&crd.group, &crd.version, &crd.kind),
                &crd.plural,
            );
            let api: Api<DynamicObject> = Api::all_with(admin.clone(), &resource);
            let deadline = Instant::now() + START;
            // Established is not enough: discovery and the handler lag it briefly.
            while api.list(&Default::default()).await.is_err() {
                assert!(
                    Instant::now() < deadline,
                    "the API server does not serve {}.{} within {START:?}",
                    crd.plural,
                    crd.group
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

fn etcd_log(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("etcd.log")).unwrap_or_default()
}

/// Starts etcd on two free ports; its client URL once it answers `/health`, `None` when it
/// exited (a port was taken meanwhile).
async fn start_etcd(peers: &Peers, dir: &Path) -> (Child, Option<String>) {
    let client = format!("http://127.0.0.1:{}", free_port());
    let peer = format!("http://127.0.0.1:{}", free_port());
    let data = dir.join("etcd");
    let log = dir.join("etcd.log");
    let mut etcd = Command::new(&peers.etcd)
        .arg(format!("--data-dir={}", data.display()))
        .arg(format!("--listen-client-urls={client}"))
        .arg(format!("--advertise-client-urls={client}"))
        .arg(format!("--listen-peer-urls={peer}"))
        .arg(format!("--initial-advertise-peer-urls={peer}"))
        .arg(format!("--initial-cluster=default={peer}"))
        // A test's data is thrown away: no fsync (as envtest runs it).
        .arg("--unsafe-no-fsync=true")
        .stdin(Stdio::null())
        .stdout(append(&log))
        .stderr(append(&log))
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", peers.etcd.display()));
    let http = reqwest::Client::new();
    let deadline = Instant::now() + START;
    while Instant::now() < deadline {
        if let Ok(Some(_)) = etcd.try_wait() {
            let text = etcd_log(dir);
            assert!(
                text.contains("address already in use"),
                "etcd exited at start:\n{text}"
            );
            let _ = std::fs::remove_dir_all(&data);
            return (etcd, None);
        }
        let healthy = match http.get(format!("{client}/health")).send().await {
            Ok(answer) => answer
                .json::<Value>()
                .await
                .is_ok_and(|v| v["health"] == "true"),
            Err(_) => false,
        };
        if healthy {
            return (etcd, Some(client));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("etcd was not healthy within {START:?}:\n{}", etcd_log(dir));
}

/// Starts kube-apiserver on `port` against etcd at `etcd_url`, with envtest's flags but the
/// default admission plugins.
fn start_apiserver(
    peers: &Peers,
    dir: &Path,
    etcd_url: &str,
    port: u16,
    options: &Options,
) -> Child {
    let path = |name: &str| dir.join(name).display().to_string();
    let log = dir.join("kube-apiserver.log");
    Command::new(&peers.apiserver)
        .arg(format!("--etcd-servers={etcd_url}"))
        .arg("--bind-address=127.0.0.1")
        .arg(format!("--secure-port={port}"))
        .arg(format!("--cert-dir={}", path("certs")))
        .arg(format!("--tls-cert-file={}", path("apiserver.crt")))
        .arg(format!("--tls-private-key-file={}", path("apiserver.key")))
        .arg(format!("--client-ca-file={}", path("ca.crt")))
        .arg("--authorization-mode=RBAC")
        .arg(format!("--service-account-issuer=https://127.0.0.1:{port}"))
        .arg(format!("--service-account-key-file={}", path("sa.pub")))
        .arg(format!(
            "--service-account-signing-key-file={}",
            path("sa.key")
        ))
        .arg("--service-cluster-ip-range=10.0.0.0/24")
        // Executor Pods are privileged (their namespace allows it, as the shipped one does).
        .arg("--allow-privileged=true")
        .arg(format!("--watch-cache={}", options.watch_cache))
        .stdin(Stdio::null())
        .stdout(append(&log))
        .stderr(append(&log))
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", peers.apiserver.display()))
}

/// A watch of the Pods of one namespace that hands every Pod it sees (listed or applied)
/// to a callback, for a test that records what the API server held. It backs off between
/// failed attempts and stops when dropped: a watch that outlives its API server retries
/// without pause, and a task that never yields keeps the test's runtime from shutting
/// down (the test then hangs until the harness's timeout instead of ending).
pub struct PodWatch(tokio::task::JoinHandle<()>);

impl PodWatch {
    /// Watches `pods`, calling `seen` with every Pod applied or listed.
    pub fn start(
        pods: Api<k8s_openapi::api::core::v1::Pod>,
        mut seen: impl FnMut(k8s_openapi::api::core::v1::Pod) + Send + 'static,
    ) -> Self {
        use futures::StreamExt;
        use kube::runtime::WatchStreamExt;
        use kube::runtime::watcher::{self, Event};
        Self(tokio::spawn(async move {
            let mut events = kube::runtime::watcher(pods, watcher::Config::default())
                .default_backoff()
                .boxed();
            while let Some(event) = events.next().await {
                if let Ok(Event::Apply(pod) | Event::InitApply(pod)) = event {
                    seen(pod);
                }
            }
        }))
    }
}

impl Drop for PodWatch {
    fn drop(&mut self) {
        self.0.abort();
    }
}
