//! An in-process fake Kubernetes API server for tests, driven by the real `kube` client.
//!
//! It follows the real API server for the parts the controller, the Pod backend, the fake
//! kubelet and the fake SPIRE agent use, and nothing more:
//! - one generic object store keyed by (resource type, namespace, name), so a new kind is
//!   one [`ResourceType`] registration ([`FakeKube::register`]); registered: `leases`,
//!   `pods`, `nodes`, `secrets`, and as their CRDs declare them `clusterstaticentries`
//!   (`spire.spiffe.io/v1alpha1`, cluster-scoped) and `batchsandboxes`
//!   (`sandbox.opensandbox.io/v1alpha1`);
//! - **the real schemas** ([`schema`]): every create, update and patch is checked against
//!   the OpenAPI schema of its kind in the oldest and the newest Kubernetes release the docs
//!   claim (unknown fields refused as under `fieldValidation=Strict`), custom resources
//!   against schemas written from their upstream CRDs; then the API server's own validation
//!   and what SPIRE and the SPIFFE CSI driver would refuse ([`validate`]), answered with the
//!   real `400`/`422` Status shapes;
//! - **RBAC** ([`rbac`]): requests presenting a ServiceAccount's token
//!   ([`RunningFakeKube::client_as`]) are authorised against the shipped Roles and
//!   ClusterRoles ([`FakeKube::enforce_shipped_rbac`]) and refused with the real `403`; the
//!   grants used are recorded ([`FakeKube::unused_grants`]);
//! - GET, LIST (label selectors with equality, existence and set-based `in`/`notin`, keys
//!   and values validated; field selectors on dotted paths), POST, PUT, DELETE and PATCH
//!   (`application/merge-patch+json`, RFC 7386);
//! - the `status` subresource of kinds that have one (writes to the main resource keep the
//!   stored status, writes to `/status` change only the status), the Pod `binding`
//!   subresource (how a scheduler sets `spec.nodeName`), and Pod spec immutability;
//! - optimistic concurrency: one monotonically increasing `resourceVersion` counter; a PUT
//!   (or a merge patch, or a delete precondition) carrying a stale one is refused with 409
//!   `Conflict`; POST of an existing name is 409 `AlreadyExists`;
//! - **watch** (`?watch=true`): from a `resourceVersion` (replaying what happened after it)
//!   or from now (synthetic `ADDED` for what exists), newline-delimited events filtered by
//!   namespace and selectors (an object that stops matching is `DELETED`, one that starts
//!   is `ADDED`, as the watch cache does), `BOOKMARK`s when `allowWatchBookmarks=true`
//!   ([`FakeKube::send_bookmarks`]), `timeoutSeconds`, and `410 Expired` as an `ERROR`
//!   event in a `200` stream, as the real server answers a compacted resourceVersion
//!   ([`FakeKube::expire_watches`]);
//! - server-set metadata: `uid`, `creationTimestamp`, `resourceVersion`, `generation`,
//!   `generateName`, `deletionTimestamp`; Secrets' `stringData` folded into base64 `data`;
//! - **deletion**: an object with finalizers is only marked (`deletionTimestamp`), takes no
//!   new finalizer and goes with its last one; a Pod a node runs terminates gracefully
//!   (marked for its grace period until deleted with none left, which the fake kubelet does
//!   once it has killed the containers), an unscheduled or finished Pod goes at once;
//! - garbage collection: deleting an object deletes (or, with
//!   `propagationPolicy=Orphan`, orphans) the objects whose `ownerReferences` name its uid;
//!   `propagationPolicy=Foreground` marks the object (the `foregroundDeletion` finalizer)
//!   before its dependents and it go.
//!
//! Not implemented: strategic merge, JSON patch and server-side apply (415), pagination
//! (`limit` returns everything), admission plugins (Pod Security,
//! quotas, LimitRanges, webhooks), namespaces as objects, CEL validation rules of CRDs
//! (neither shipped CRD has any). docs/pod-backend.md lists what that leaves unverified.
//!
//! Faults: [`FakeKube::fail_next`] / [`FakeKube::fail_always`] answer matching requests with
//! an error Status; [`RunningFakeKube::stop`] makes the server unreachable (listener closed,
//! open connections reset) and [`RunningFakeKube::restart`] brings it back on the same port.

pub mod rbac;
pub mod schema;
mod selector;
pub mod validate;
mod watch;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use base64::Engine;
use http::{HeaderMap, Method, StatusCode, Uri};
pub use rbac::{Grant, Rbac, ServiceAccount};
pub use selector::{FieldSelector, LabelSelector};
use serde_json::{Map, Value, json};
use tokio::task::{JoinHandle, JoinSet};
use tower::ServiceExt;

/// A kind of object the fake serves: where it lives in the URL space and how it behaves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResourceType {
    /// API group; empty for the core group (`/api/v1`).
    pub group: String,
    pub version: String,
    /// Lower-case plural used in URLs, e.g. `leases`.
    pub plural: String,
    /// `kind` of a single object, e.g. `Lease`; lists are `<kind>List`.
    pub kind: String,
    pub namespaced: bool,
    /// Whether a PUT of a missing object creates it (true for Leases on the real server).
    pub allow_create_on_update: bool,
    /// Whether the kind has a `status` subresource (writes to the main resource keep the
    /// stored status; writes to `/status` change only the status).
    pub status_subresource: bool,
}

impl ResourceType {
    /// `group/version`, or just `version` for the core group.
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.clone()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    /// `plural.group` as the real server names resources in messages (`leases.coordination.k8s.io`).
    fn qualified(&self) -> String {
        if self.group.is_empty() {
            self.plural.clone()
        } else {
            format!("{}.{}", self.plural, self.group)
        }
    }

    /// `Kind.group` as the real server names kinds in `Invalid` messages.
    fn qualified_kind(&self) -> String {
        if self.group.is_empty() {
            self.kind.clone()
        } else {
            format!("{}.{}", self.kind, self.group)
        }
    }

    /// `coordination.k8s.io/v1/leases`: the store key prefix.
    fn key(&self) -> String {
        format!("{}/{}/{}", self.group, self.version, self.plural)
    }

    fn has_status(&self) -> bool {
        self.status_subresource
    }

    fn is(&self, group: &str, plural: &str) -> bool {
        self.group == group && self.plural == plural
    }

    fn core(plural: &str, kind: &str, namespaced: bool, status: bool) -> Self {
        ResourceType {
            group: String::new(),
            version: "v1".into(),
            plural: plural.into(),
            kind: kind.into(),
            namespaced,
            allow_create_on_update: false,
            status_subresource: status,
        }
    }

    /// A custom resource as its CRD declares it (scope, plural, status subresource).
    pub fn from_crd(crd: &schema::Crd) -> Self {
        ResourceType {
            group: crd.group.clone(),
            version: crd.version.clone(),
            plural: crd.plural.clone(),
            kind: crd.kind.clone(),
            namespaced: crd.namespaced,
            allow_create_on_update: false,
            status_subresource: crd.status_subresource,
        }
    }

    #[allow(clippy::panic)]
    fn shipped_crd(group: &str, plural: &str) -> Self {
        match schema::crd(group, plural) {
            Some(crd) => Self::from_crd(crd),
            None => panic!("the test kit ships no CRD schema of {plural}.{group}"),
        }
    }

    /// `coordination.k8s.io/v1` Lease.
    pub fn leases() -> Self {
        ResourceType {
            group: "coordination.k8s.io".into(),
            version: "v1".into(),
            plural: "leases".into(),
            kind: "Lease".into(),
            namespaced: true,
            allow_create_on_update: true,
            status_subresource: false,
        }
    }

    /// Core `v1` Pod.
    pub fn pods() -> Self {
        Self::core("pods", "Pod", true, true)
    }

    /// Core `v1` Node (cluster-scoped).
    pub fn nodes() -> Self {
        Self::core("nodes", "Node", false, true)
    }

    /// Core `v1` Secret.
    pub fn secrets() -> Self {
        Self::core("secrets", "Secret", true, false)
    }

    /// `spire.spiffe.io/v1alpha1` ClusterStaticEntry, as spire-controller-manager's CRD
    /// declares it (cluster-scoped).
    pub fn cluster_static_entries() -> Self {
        Self::shipped_crd("spire.spiffe.io", "clusterstaticentries")
    }

    /// `sandbox.opensandbox.io/v1alpha1` BatchSandbox, as OpenSandbox's CRD declares it.
    pub fn batch_sandboxes() -> Self {
        Self::shipped_crd("sandbox.opensandbox.io", "batchsandboxes")
    }

    /// `sandbox.opensandbox.io/v1alpha1` Pool (the pre-warmed Pods a BatchSandbox's
    /// `poolRef` names), as OpenSandbox's CRD declares it.
    pub fn pools() -> Self {
        Self::shipped_crd("sandbox.opensandbox.io", "pools")
    }
}

/// Store key: (resource type key, namespace or "" when cluster-scoped, name).
type ObjectKey = (String, String, String);

#[derive(Clone, Debug)]
struct Fault {
    method: Method,
    path_prefix: String,
    status: StatusCode,
    /// `None` = until cleared.
    remaining: Option<usize>,
}

/// One committed change, kept so that watches can resume from a resourceVersion.
#[derive(Clone, Debug)]
struct Change {
    rv: u64,
    type_key: String,
    namespace: String,
    old: Option<Value>,
    /// `None` for a deletion.
    new: Option<Value>,
}

#[derive(Default)]
struct Store {
    types: Vec<ResourceType>,
    objects: BTreeMap<ObjectKey, Value>,
    /// Last issued resourceVersion; one counter for all kinds, as etcd's revision is.
    revision: u64,
    faults: Vec<Fault>,
    /// `METHOD path?query` of every request, for tests that assert on traffic.
    requests: Vec<String>,
    /// History after `oldest`; a watch from an older resourceVersion gets 410.
    changes: Vec<Change>,
    oldest: u64,
    /// Bumped by [`FakeKube::expire_watches`]: open watches end with 410.
    expiry: u64,
    /// Bumped by [`FakeKube::send_bookmarks`].
    bookmarks: u64,
    /// Watches currently streaming.
    open_watches: usize,
    /// The authorizer's grants, when RBAC is enforced ([`FakeKube::enforce_rbac`]).
    rbac: Option<Rbac>,
    /// Indices of the grants that allowed a request.
    exercised: std::collections::BTreeSet<usize>,
    /// The message of every request RBAC denied.
    denied: Vec<String>,
}

/// Handle to the fake's state; cheap to clone.
#[derive(Clone)]
pub struct FakeKube {
    inner: Arc<Mutex<Store>>,
    /// Carries the revision after every change, waking open watches.
    changed: Arc<tokio::sync::watch::Sender<u64>>,
}

impl Default for FakeKube {
    fn default() -> Self {
        FakeKube {
            inner: Arc::default(),
            changed: Arc::new(tokio::sync::watch::Sender::new(0)),
        }
    }
}

impl FakeKube {
    /// An empty store with Leases, Pods, Nodes, Secrets, ClusterStaticEntries and
    /// BatchSandboxes registered, checking every write against the real schemas.
    ///
    /// # Panics
    /// When the Kubernetes schemas cannot be found: the message says how to install them
    /// (a fake that checked nothing would let every test pass unchecked).
    #[allow(clippy::panic)]
    pub fn new() -> Self {
        if let Err(e) = schema::schemas() {
            panic!(
                "the fake Kubernetes API server checks every object against the real schemas: {e}"
            );
        }
        let kube = FakeKube::default();
        for rt in [
            ResourceType::leases(),
            ResourceType::pods(),
            ResourceType::nodes(),
            ResourceType::secrets(),
            ResourceType::cluster_static_entries(),
            ResourceType::batch_sandboxes(),
            ResourceType::pools(),
        ] {
            kube.register(rt);
        }
        kube
    }

    fn lock(&self) -> MutexGuard<'_, Store> {
        // A panic while holding the lock only happens in a failing test; keep serving.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn notify(&self) {
        let revision = self.lock().revision;
        self.changed.send_replace(revision);
    }

    /// Serves a new kind (replaces a registration with the same group/version/plural).
    pub fn register(&self, rt: ResourceType) {
        let mut s = self.lock();
        s.types.retain(|t| t.key() != rt.key());
        s.types.push(rt);
    }

    /// Answers the next request whose method matches and whose path starts with
    /// `path_prefix` with an error `Status` of `status`, once.
    pub fn fail_next(&self, method: Method, path_prefix: &str, status: StatusCode) {
        self.add_fault(method, path_prefix, status, Some(1));
    }

    /// Like [`Self::fail_next`] but for every matching request until [`Self::clear_faults`].
    pub fn fail_always(&self, method: Method, path_prefix: &str, status: StatusCode) {
        self.add_fault(method, path_prefix, status, None);
    }

    fn add_fault(&self, method: Method, path_prefix: &str, status: StatusCode, n: Option<usize>) {
        self.lock().faults.push(Fault {
            method,
            path_prefix: path_prefix.to_owned(),
            status,
            remaining: n,
        });
    }

    /// Enforces `rbac` for every request presenting a ServiceAccount's token (see
    /// [`rbac`]); requests without one stay the test's own, unchecked.
    pub fn enforce_rbac(&self, rbac: Rbac) {
        let mut s = self.lock();
        if s.rbac.as_ref() != Some(&rbac) {
            s.rbac = Some(rbac);
            s.exercised.clear();
        }
    }

    /// Enforces the RBAC of the shipped manifests, with the Roles of each `(from, to)`
    /// namespace pair also applied in `to` (where a test deploys executors elsewhere).
    ///
    /// # Panics
    /// When the manifests cannot be rendered (kubectl missing): such a test must not pass
    /// with RBAC unchecked.
    #[allow(clippy::panic)]
    pub fn enforce_shipped_rbac(&self, also_in: &[(&str, &str)]) {
        let mut rbac = Rbac::shipped().unwrap_or_else(|e| {
            panic!("the fake Kubernetes API server enforces the shipped RBAC: {e}")
        });
        for (from, to) in also_in {
            rbac = rbac.also_in(from, to);
        }
        self.enforce_rbac(rbac);
    }

    /// The grants of the enforced RBAC that allowed no request so far.
    pub fn unused_grants(&self) -> Vec<Grant> {
        let s = self.lock();
        s.rbac
            .as_ref()
            .map(|r| {
                r.grants()
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| !s.exercised.contains(i))
                    .map(|(_, g)| g.clone())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The messages of the requests RBAC denied so far.
    pub fn denied(&self) -> Vec<String> {
        self.lock().denied.clone()
    }

    /// Removes all injected faults.
    pub fn clear_faults(&self) {
        self.lock().faults.clear();
    }

    /// `METHOD path?query` of every request served so far.
    pub fn requests(&self) -> Vec<String> {
        self.lock().requests.clone()
    }

    /// The stored object, as the server would return it.
    pub fn object(&self, rt: &ResourceType, namespace: &str, name: &str) -> Option<Value> {
        let key = (rt.key(), ns_key(rt, namespace), name.to_owned());
        self.lock().objects.get(&key).cloned()
    }

    /// Every stored object of a kind (in `namespace`, or everywhere when `None`).
    pub fn objects(&self, rt: &ResourceType, namespace: Option<&str>) -> Vec<Value> {
        let type_key = rt.key();
        self.lock()
            .objects
            .iter()
            .filter(|((k, ns, _), _)| *k == type_key && namespace.is_none_or(|want| want == ns))
            .map(|(_, v)| v.clone())
            .collect()
    }

    /// The current resourceVersion (the revision of the last change).
    pub fn revision(&self) -> u64 {
        self.lock().revision
    }

    /// Number of watch streams currently open.
    pub fn open_watches(&self) -> usize {
        self.lock().open_watches
    }

    /// Compacts the history and ends every open watch with a `410 Expired` `ERROR` event,
    /// as etcd compaction does: a client must re-list.
    pub fn expire_watches(&self) {
        {
            let mut s = self.lock();
            s.expiry += 1;
            s.oldest = s.revision;
            s.changes.clear();
        }
        self.notify();
    }

    /// Sends a `BOOKMARK` (the current resourceVersion) on every open watch that allowed them.
    pub fn send_bookmarks(&self) {
        self.lock().bookmarks += 1;
        self.notify();
    }

    /// The router serving the API; [`FakeKube::start`] serves it on a loopback port.
    pub fn router(&self) -> Router {
        Router::new().fallback(handle).with_state(self.clone())
    }

    /// Binds `127.0.0.1:0` and serves in a background task.
    pub async fn start() -> std::io::Result<RunningFakeKube> {
        let handle = FakeKube::new();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let server = Some(tokio::spawn(serve(listener, handle.router())));
        Ok(RunningFakeKube {
            url: format!("http://{addr}"),
            addr,
            handle,
            server,
        })
    }
}

/// A minimal valid Pod named `name` with `labels` (one container `job`, image
/// `runner:latest`), for tests of the API server itself.
pub fn minimal_pod(name: &str, labels: &[(&str, &str)]) -> k8s_openapi::api::core::v1::Pod {
    use k8s_openapi::api::core::v1::{Container, Pod, PodSpec};
    Pod {
        metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
            name: Some(name.into()),
            labels: Some(
                labels
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect(),
            ),
            ..Default::default()
        },
        spec: Some(PodSpec {
            containers: vec![Container {
                name: "job".into(),
                image: Some("runner:latest".into()),
                ..Container::default()
            }],
            ..PodSpec::default()
        }),
        ..Pod::default()
    }
}

/// Shorthand for [`FakeKube::start`].
pub async fn start() -> std::io::Result<RunningFakeKube> {
    FakeKube::start().await
}

/// A fake API server serving in the background; dropping it stops the server.
pub struct RunningFakeKube {
    /// `http://127.0.0.1:<port>` (no trailing slash).
    pub url: String,
    pub addr: SocketAddr,
    pub handle: FakeKube,
    server: Option<JoinHandle<()>>,
}

impl RunningFakeKube {
    /// A real `kube` client for this server.
    pub fn client(&self) -> Result<kube::Client, kube::Error> {
        let url = self
            .url
            .parse()
            .map_err(|e: http::uri::InvalidUri| kube::Error::Service(Box::new(e)))?;
        kube::Client::try_from(kube::Config::new(url))
    }

    /// A kubeconfig for this server (default namespace `namespace`), for a process that
    /// finds the cluster through `KUBECONFIG`.
    pub fn kubeconfig(&self, namespace: &str) -> String {
        self.kubeconfig_with(namespace, "{}")
    }

    /// A real `kube` client authenticated as `account` (its bearer token): under
    /// [`FakeKube::enforce_rbac`] it may do what the RBAC grants that account.
    pub fn client_as(&self, account: &ServiceAccount) -> Result<kube::Client, kube::Error> {
        let url = self
            .url
            .parse()
            .map_err(|e: http::uri::InvalidUri| kube::Error::Service(Box::new(e)))?;
        let mut config = kube::Config::new(url);
        config.auth_info = serde_json::from_value(json!({ "token": account.token() }))
            .map_err(|e| kube::Error::Service(Box::new(e)))?;
        kube::Client::try_from(config)
    }

    /// Like [`Self::kubeconfig`], authenticating as `account`.
    pub fn kubeconfig_as(&self, namespace: &str, account: &ServiceAccount) -> String {
        self.kubeconfig_with(namespace, &format!("{{ token: {:?} }}", account.token()))
    }

    fn kubeconfig_with(&self, namespace: &str, user: &str) -> String {
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {}\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n    namespace: {namespace}\ncurrent-context: fake\nusers:\n- name: fake\n  user: {user}\n",
            self.url
        )
    }

    /// Makes the server unreachable: the listener closes (new connections are refused) and
    /// every open connection is reset, as when a client loses the network to the API server.
    pub async fn stop(&mut self) {
        if let Some(server) = self.server.take() {
            server.abort();
            // Wait so that the port is really closed when this returns.
            let _ = server.await;
        }
    }

    /// Serves again on the same port with the same store.
    pub async fn restart(&mut self) -> std::io::Result<()> {
        self.stop().await;
        let listener = tokio::net::TcpListener::bind(self.addr).await?;
        self.server = Some(tokio::spawn(serve(listener, self.handle.router())));
        Ok(())
    }
}

impl Drop for RunningFakeKube {
    fn drop(&mut self) {
        if let Some(server) = self.server.take() {
            server.abort();
        }
    }
}

/// Accept loop owning its connections: aborting this task drops the `JoinSet`, which aborts
/// every connection task, so a stopped fake leaves no half-alive keep-alive connections
/// (`axum::serve` spawns detached connection tasks that would outlive an abort).
async fn serve(listener: tokio::net::TcpListener, router: Router) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else { continue };
                let router = router.clone();
                connections.spawn(async move {
                    let io = hyper_util::rt::TokioIo::new(stream);
                    let service = hyper::service::service_fn(move |req| router.clone().oneshot(req));
                    let _ = hyper_util::server::conn::auto::Builder::new(
                        hyper_util::rt::TokioExecutor::new(),
                    )
                    .serve_connection(io, service)
                    .await;
                });
            }
            // Reap finished connections so the set does not grow without bound.
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

// ----- request handling ---------------------------------------------------------------------

/// A parsed API path.
struct Target {
    rt: ResourceType,
    /// `None` for a cluster-wide list of a namespaced kind (`/api/v1/pods`).
    namespace: Option<String>,
    name: Option<String>,
    /// `status` or `binding`.
    subresource: Option<String>,
}

async fn handle(
    State(kube): State<FakeKube>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let response = handle_locked(&kube, method, uri, headers, body);
    kube.notify();
    response
}

fn handle_locked(
    kube: &FakeKube,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let path = uri.path().to_owned();
    let query = uri.query().unwrap_or("").to_owned();
    let mut s = kube.lock();
    s.requests.push(if query.is_empty() {
        format!("{method} {path}")
    } else {
        format!("{method} {path}?{query}")
    });
    if let Some(status) = take_fault(&mut s, &method, &path) {
        return injected(status);
    }
    let target = match parse_path(&s.types, &path) {
        Ok(t) => t,
        Err(resp) => return *resp,
    };
    let params: BTreeMap<String, String> = url::form_urlencoded::parse(query.as_bytes())
        .into_owned()
        .collect();
    if let Err(r) = authorize(&mut s, &headers, &method, &target, &params) {
        return *r;
    }
    let sub = target.subresource.as_deref();
    match (method.clone(), target.name.clone(), sub) {
        (Method::GET, Some(name), None | Some("status")) => get(&s, &target, &name),
        (Method::GET, None, None) => {
            if params.get("watch").is_some_and(|w| w == "true" || w == "1") {
                watch::start(kube, &mut s, &target, &params)
            } else {
                list(&s, &target, &params)
            }
        }
        (Method::POST, None, None) => create(&mut s, &target, &body),
        (Method::POST, Some(name), Some("binding")) if target.rt.is("", "pods") => {
            bind(&mut s, &target, &name, &body)
        }
        (Method::PUT, Some(name), None | Some("status")) => replace(&mut s, &target, &name, &body),
        (Method::PATCH, Some(name), None | Some("status")) => {
            patch(&mut s, &target, &name, &headers, &body)
        }
        (Method::DELETE, Some(name), None) => delete(&mut s, &target, &name, &body),
        _ => status(
            StatusCode::METHOD_NOT_ALLOWED,
            "MethodNotAllowed",
            &format!(
                "the server does not allow this method on the requested resource ({method} {path})"
            ),
            None,
        ),
    }
}

/// The RBAC verb of a request.
fn verb(method: &Method, t: &Target, params: &BTreeMap<String, String>) -> &'static str {
    let named = t.name.is_some();
    match *method {
        Method::GET if named => "get",
        Method::GET if params.get("watch").is_some_and(|w| w == "true" || w == "1") => "watch",
        Method::GET => "list",
        Method::POST => "create",
        Method::PUT => "update",
        Method::PATCH => "patch",
        Method::DELETE if named => "delete",
        Method::DELETE => "deletecollection",
        _ => "unknown",
    }
}

/// Authenticates the request's bearer token and, for a ServiceAccount, authorizes it
/// against the enforced RBAC: `401` for a token the fake did not issue, `403` with the real
/// server's Status when no grant allows it.
fn authorize(
    s: &mut Store,
    headers: &HeaderMap,
    method: &Method,
    t: &Target,
    params: &BTreeMap<String, String>,
) -> Result<(), Box<Response>> {
    let Some(auth) = headers.get(http::header::AUTHORIZATION) else {
        return Ok(());
    };
    let token = auth
        .to_str()
        .ok()
        .and_then(|a| a.strip_prefix("Bearer "))
        .unwrap_or_default();
    let Some(account) = ServiceAccount::from_token(token) else {
        return Err(Box::new(status(
            StatusCode::UNAUTHORIZED,
            "Unauthorized",
            "Unauthorized",
            None,
        )));
    };
    let attributes = rbac::Attributes {
        user: account.user(),
        verb: verb(method, t, params).to_owned(),
        group: t.rt.group.clone(),
        resource: match &t.subresource {
            Some(sub) => format!("{}/{sub}", t.rt.plural),
            None => t.rt.plural.clone(),
        },
        plural: t.rt.plural.clone(),
        namespace: t.namespace.clone(),
        name: t.name.clone(),
    };
    match s.rbac.as_ref().map(|r| r.authorize(&attributes)) {
        Some(Some(i)) => {
            s.exercised.insert(i);
            Ok(())
        }
        // A token without enforced RBAC is a test set up wrongly: deny, never allow.
        _ => {
            let message = rbac::forbidden_message(&attributes);
            s.denied.push(message.clone());
            let mut details = json!({ "kind": t.rt.plural });
            if let Some(name) = &t.name {
                details["name"] = name.clone().into();
            }
            if !t.rt.group.is_empty() {
                details["group"] = t.rt.group.clone().into();
            }
            Err(Box::new(status(
                StatusCode::FORBIDDEN,
                "Forbidden",
                &message,
                Some(details),
            )))
        }
    }
}

fn take_fault(s: &mut Store, method: &Method, path: &str) -> Option<StatusCode> {
    let i = s
        .faults
        .iter()
        .position(|f| f.method == method && path.starts_with(&f.path_prefix))?;
    let fault = &mut s.faults[i];
    let code = fault.status;
    if let Some(n) = fault.remaining.as_mut() {
        *n -= 1;
        if *n == 0 {
            s.faults.remove(i);
        }
    }
    Some(code)
}

fn injected(code: StatusCode) -> Response {
    let reason = match code.as_u16() {
        400 => "BadRequest",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "NotFound",
        409 => "Conflict",
        410 => "Expired",
        422 => "Invalid",
        429 => "TooManyRequests",
        503 => "ServiceUnavailable",
        504 => "Timeout",
        _ => "InternalError",
    };
    status(code, reason, "injected fault", None)
}

/// Errors are boxed: a `Response` is large and the error path is the rare one.
fn parse_path(types: &[ResourceType], path: &str) -> Result<Target, Box<Response>> {
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (group, version, rest) = match segs.as_slice() {
        ["api", version, rest @ ..] => ("", *version, rest),
        ["apis", group, version, rest @ ..] => (*group, *version, rest),
        _ => return Err(Box::new(not_found_path(path))),
    };
    let (namespace, plural, name, sub) = match rest {
        ["namespaces", ns, plural] => (Some(*ns), *plural, None, None),
        ["namespaces", ns, plural, name] => (Some(*ns), *plural, Some(*name), None),
        ["namespaces", ns, plural, name, sub] => (Some(*ns), *plural, Some(*name), Some(*sub)),
        [plural] => (None, *plural, None, None),
        [plural, name] => (None, *plural, Some(*name), None),
        [plural, name, sub] => (None, *plural, Some(*name), Some(*sub)),
        _ => return Err(Box::new(not_found_path(path))),
    };
    let rt = types
        .iter()
        .find(|t| t.group == group && t.version == version && t.plural == plural)
        .cloned()
        .ok_or_else(|| Box::new(not_found_path(path)))?;
    // A namespaced kind addressed without a namespace is only valid as a cluster-wide list;
    // a cluster-scoped kind never has one.
    let sub_ok = match sub {
        None => true,
        Some("status") => rt.has_status(),
        Some("binding") => rt.is("", "pods"),
        Some(_) => false,
    };
    if (rt.namespaced && namespace.is_none() && name.is_some())
        || (!rt.namespaced && namespace.is_some())
        || !sub_ok
    {
        return Err(Box::new(not_found_path(path)));
    }
    Ok(Target {
        rt,
        namespace: namespace.map(str::to_owned),
        name: name.map(str::to_owned),
        subresource: sub.map(str::to_owned),
    })
}

fn ns_key(rt: &ResourceType, namespace: &str) -> String {
    if rt.namespaced {
        namespace.to_owned()
    } else {
        String::new()
    }
}

fn key(t: &Target, name: &str) -> ObjectKey {
    (
        t.rt.key(),
        t.namespace.clone().unwrap_or_default(),
        name.to_owned(),
    )
}

/// Records a change in the store and its history (for watches).
fn commit(s: &mut Store, key: ObjectKey, old: Option<Value>, new: Option<Value>) {
    let (type_key, namespace, _) = key.clone();
    match &new {
        Some(v) => s.objects.insert(key, v.clone()),
        None => s.objects.remove(&key),
    };
    let rv = s.revision;
    s.changes.push(Change {
        rv,
        type_key,
        namespace,
        old,
        new,
    });
}

fn get(s: &Store, t: &Target, name: &str) -> Response {
    match s.objects.get(&key(t, name)) {
        Some(obj) => (StatusCode::OK, axum::Json(obj.clone())).into_response(),
        None => not_found(&t.rt, name),
    }
}

/// The label and field selectors of a request, or the real server's 400.
fn selectors(
    params: &BTreeMap<String, String>,
) -> Result<(Option<LabelSelector>, Option<FieldSelector>), Box<Response>> {
    let labels = params
        .get("labelSelector")
        .map(|s| LabelSelector::parse(s))
        .transpose()
        .map_err(|e| Box::new(bad_request(&e)))?;
    let fields = params
        .get("fieldSelector")
        .map(|s| FieldSelector::parse(s))
        .transpose()
        .map_err(|e| Box::new(bad_request(&e)))?;
    Ok((labels, fields))
}

fn list(s: &Store, t: &Target, params: &BTreeMap<String, String>) -> Response {
    let (labels, fields) = match selectors(params) {
        Ok(sel) => sel,
        Err(r) => return *r,
    };
    let type_key = t.rt.key();
    let items: Vec<Value> = s
        .objects
        .iter()
        .filter(|((k, ns, _), _)| {
            k == &type_key && t.namespace.as_ref().is_none_or(|want| want == ns)
        })
        .filter(|(_, obj)| labels.as_ref().is_none_or(|sel| sel.matches(obj)))
        .filter(|(_, obj)| fields.as_ref().is_none_or(|sel| sel.matches(obj)))
        .map(|(_, obj)| {
            // The real server leaves kind/apiVersion off list items in JSON.
            let mut item = obj.clone();
            if let Value::Object(m) = &mut item {
                m.remove("kind");
                m.remove("apiVersion");
            }
            item
        })
        .collect();
    let body = json!({
        "kind": format!("{}List", t.rt.kind),
        "apiVersion": t.rt.api_version(),
        "metadata": { "resourceVersion": s.revision.to_string() },
        "items": items,
    });
    (StatusCode::OK, axum::Json(body)).into_response()
}

fn parse_object(body: &[u8]) -> Result<Map<String, Value>, Box<Response>> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(Box::new(bad_request(
            "the request body is not a JSON object",
        ))),
        Err(e) => Err(Box::new(bad_request(&format!(
            "the request body is not valid JSON: {e}"
        )))),
    }
}

fn meta_str<'a>(obj: &'a Map<String, Value>, field: &str) -> Option<&'a str> {
    obj.get("metadata")?.get(field)?.as_str()
}

/// Takes `metadata` out of an object (a fresh map when absent or malformed); put it back
/// with `obj.insert("metadata", Value::Object(meta))`.
fn take_metadata(obj: &mut Map<String, Value>) -> Map<String, Value> {
    match obj.remove("metadata") {
        Some(Value::Object(m)) => m,
        _ => Map::new(),
    }
}

/// Checks that a body's namespace, if any, agrees with the URL (the real server's 400).
fn check_namespace(t: &Target, obj: &Map<String, Value>) -> Result<(), Box<Response>> {
    match (meta_str(obj, "namespace"), &t.namespace) {
        (Some(body_ns), Some(url_ns)) if !body_ns.is_empty() && body_ns != url_ns => {
            Err(Box::new(bad_request(
                "the namespace of the provided object does not match the namespace sent on the request",
            )))
        }
        _ => Ok(()),
    }
}

/// What the API server does to every written object of a kind before storing it.
fn normalise(rt: &ResourceType, obj: &mut Map<String, Value>) {
    if rt.is("", "secrets")
        && let Some(Value::Object(string_data)) = obj.remove("stringData")
    {
        let data = obj
            .entry("data")
            .or_insert_with(|| Value::Object(Map::new()));
        if let Value::Object(data) = data {
            for (k, v) in string_data {
                let text = v.as_str().unwrap_or_default();
                data.insert(
                    k,
                    base64::engine::general_purpose::STANDARD
                        .encode(text)
                        .into(),
                );
            }
        }
    }
}

fn create(s: &mut Store, t: &Target, body: &[u8]) -> Response {
    let Some(namespace) = t
        .namespace
        .clone()
        .or_else(|| (!t.rt.namespaced).then(String::new))
    else {
        return not_found_path("a namespaced create needs a namespace");
    };
    let mut obj = match parse_object(body) {
        Ok(o) => o,
        Err(r) => return *r,
    };
    if let Err(r) = check_namespace(t, &obj) {
        return *r;
    }
    let name = match (meta_str(&obj, "name"), meta_str(&obj, "generateName")) {
        (Some(n), _) if !n.is_empty() => n.to_owned(),
        (_, Some(prefix)) if !prefix.is_empty() => format!("{prefix}{}", random_suffix()),
        _ => {
            return invalid(
                &t.rt,
                "",
                &[validate::Cause {
                    reason: "FieldValueRequired",
                    message: "Required value: name or generateName is required".into(),
                    field: "metadata.name".into(),
                }],
            );
        }
    };
    if let Some(Value::Object(meta)) = obj.get_mut("metadata") {
        meta.insert("name".into(), name.clone().into());
    }
    let schema_causes = match schema_check(&t.rt, &Value::Object(obj.clone())) {
        Ok(c) => c,
        Err(r) => return *r,
    };
    let causes = merge_causes(
        schema_causes,
        validate::validate(&t.rt.group, &t.rt.plural, &obj),
    );
    if !causes.is_empty() {
        return invalid(&t.rt, &name, &causes);
    }
    let k = (t.rt.key(), namespace.clone(), name.clone());
    if s.objects.contains_key(&k) {
        return status(
            StatusCode::CONFLICT,
            "AlreadyExists",
            &format!("{} \"{name}\" already exists", t.rt.qualified()),
            Some(details(&t.rt, &name)),
        );
    }
    normalise(&t.rt, &mut obj);
    s.revision += 1;
    obj.insert("kind".into(), t.rt.kind.clone().into());
    obj.insert("apiVersion".into(), t.rt.api_version().into());
    if t.rt.has_status() {
        // The status of a kind with a status subresource is not the creator's to set.
        obj.remove("status");
    }
    if t.rt.is("", "pods") {
        obj.insert(
            "status".into(),
            json!({ "phase": "Pending", "qosClass": "BestEffort" }),
        );
    }
    let mut meta = take_metadata(&mut obj);
    meta.remove("generateName");
    meta.remove("deletionTimestamp");
    meta.remove("deletionGracePeriodSeconds");
    meta.insert("name".into(), name.clone().into());
    if t.rt.namespaced {
        meta.insert("namespace".into(), namespace.into());
    }
    meta.insert("uid".into(), new_uid().into());
    meta.insert("resourceVersion".into(), s.revision.to_string().into());
    meta.insert("creationTimestamp".into(), now_rfc3339().into());
    meta.insert("generation".into(), 1.into());
    obj.insert("metadata".into(), Value::Object(meta));
    let obj = Value::Object(obj);
    commit(s, k, None, Some(obj.clone()));
    (StatusCode::CREATED, axum::Json(obj)).into_response()
}

fn conflict(rt: &ResourceType, name: &str) -> Response {
    status(
        StatusCode::CONFLICT,
        "Conflict",
        &format!(
            "Operation cannot be fulfilled on {} \"{name}\": the object has been modified; please apply your changes to the latest version and try again",
            rt.qualified()
        ),
        Some(details(rt, name)),
    )
}

/// The Pod spec fields an update may change (the real server's list, abridged).
fn mutable_pod_spec(spec: &Value) -> Value {
    let mut spec = spec.clone();
    if let Some(m) = spec.as_object_mut() {
        m.remove("activeDeadlineSeconds");
        m.remove("tolerations");
        m.remove("schedulingGates");
        for list in ["containers", "initContainers"] {
            if let Some(Value::Array(cs)) = m.get_mut(list) {
                for c in cs {
                    if let Some(c) = c.as_object_mut() {
                        c.remove("image");
                    }
                }
            }
        }
    }
    spec
}

/// Checks a write against the real schema of its kind ([`schema`]), as the API server does
/// with `fieldValidation=Strict`: an undeclared field, or (for a built-in kind) a value that
/// cannot decode into the Go type, is a `400 BadRequest` strict decoding error; a missing
/// required field, a value outside an enum or a format, or (for a custom resource) a value
/// of the wrong type is `422 Invalid` with field causes.
///
/// Returns the `422` causes, for the caller to answer together with its own validation's.
fn schema_check(rt: &ResourceType, obj: &Value) -> Result<Vec<validate::Cause>, Box<Response>> {
    let schemas = match schema::schemas() {
        Ok(s) => s,
        Err(e) => {
            return Err(Box::new(status(
                StatusCode::INTERNAL_SERVER_ERROR,
                "InternalError",
                e,
                None,
            )));
        }
    };
    if !schemas.knows(&rt.group, &rt.version, &rt.kind) {
        return Err(Box::new(status(
            StatusCode::INTERNAL_SERVER_ERROR,
            "InternalError",
            &format!(
                "the fake has no schema for {} {}: add one before serving it",
                rt.api_version(),
                rt.kind
            ),
            None,
        )));
    }
    let findings = schemas.check(&rt.group, &rt.version, &rt.kind, obj);
    if findings.is_empty() {
        return Ok(Vec::new());
    }
    let unknown: Vec<String> = findings
        .iter()
        .filter_map(|f| match &f.violation {
            schema::Violation::Unknown { path } => {
                Some(format!("unknown field {path:?}{}", f.release()))
            }
            _ => None,
        })
        .collect();
    if !unknown.is_empty() {
        return Err(Box::new(bad_request(&format!(
            "strict decoding error: {}",
            unknown.join(", ")
        ))));
    }
    let custom = schema::crd(&rt.group, &rt.plural).is_some();
    if !custom
        && let Some((
            schema::Violation::Type {
                path,
                expected,
                found,
            },
            release,
        )) = findings.iter().find_map(|f| match &f.violation {
            t @ schema::Violation::Type { .. } => Some((t, f.release())),
            _ => None,
        })
    {
        return Err(Box::new(bad_request(&format!(
            "{kind} in version {version:?} cannot be handled as a {kind}: json: cannot unmarshal {found} into Go struct field {path} of type {expected}{release}",
            kind = rt.kind,
            version = rt.version,
        ))));
    }
    let causes: Vec<validate::Cause> = findings
        .into_iter()
        .map(|f| {
            let release = f.release();
            match f.violation {
                schema::Violation::Type {
                    path,
                    expected,
                    found,
                } => validate::Cause {
                    reason: "FieldValueTypeInvalid",
                    message: format!(
                        "Invalid value: {found:?}: {path} in body must be of type {expected}: {found:?}{release}"
                    ),
                    field: path,
                },
                schema::Violation::Required { path } => validate::Cause {
                    reason: "FieldValueRequired",
                    message: format!("Required value{release}"),
                    field: path,
                },
                schema::Violation::NotSupported {
                    path,
                    value,
                    supported,
                } => validate::Cause {
                    reason: "FieldValueNotSupported",
                    message: format!(
                        "Unsupported value: {value:?}: supported values: {}{release}",
                        supported
                            .iter()
                            .map(|s| format!("{s:?}"))
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                    field: path,
                },
                schema::Violation::Invalid {
                    path,
                    value,
                    detail,
                } => validate::Cause {
                    reason: "FieldValueInvalid",
                    message: format!("Invalid value: {value:?}: {detail}{release}"),
                    field: path,
                },
                schema::Violation::Unknown { path } => validate::Cause {
                    reason: "FieldValueInvalid",
                    message: format!("unknown field{release}"),
                    field: path,
                },
            }
        })
        .collect();
    Ok(causes)
}

/// Schema causes first, then validation's, without repeating a (field, reason) the schema
/// already reported (an enum both check, say).
fn merge_causes(schema: Vec<validate::Cause>, more: Vec<validate::Cause>) -> Vec<validate::Cause> {
    let seen: Vec<(String, &str)> = schema.iter().map(|c| (c.field.clone(), c.reason)).collect();
    let mut all = schema;
    all.extend(
        more.into_iter()
            .filter(|c| !seen.iter().any(|(f, r)| *f == c.field && *r == c.reason)),
    );
    all
}

/// Turns a proposed new state of `old` into what the server stores: subresource rules,
/// immutability and validation, server-owned metadata and the resourceVersion bump.
fn apply_update(
    s: &mut Store,
    t: &Target,
    name: &str,
    old: &Value,
    mut obj: Map<String, Value>,
) -> Result<Value, Box<Response>> {
    let status_write = t.subresource.as_deref() == Some("status");
    if status_write {
        // A status write changes the status and nothing else.
        let status = obj.remove("status");
        let Value::Object(mut kept) = old.clone() else {
            return Err(Box::new(bad_request("stored object is not an object")));
        };
        match status {
            Some(st) => kept.insert("status".into(), st),
            None => kept.remove("status"),
        };
        obj = kept;
    } else if t.rt.has_status() {
        match old.get("status") {
            Some(st) => obj.insert("status".into(), st.clone()),
            None => obj.remove("status"),
        };
    }
    let schema_causes = schema_check(&t.rt, &Value::Object(obj.clone()))?;
    if status_write && !schema_causes.is_empty() {
        return Err(Box::new(invalid(&t.rt, name, &schema_causes)));
    }
    normalise(&t.rt, &mut obj);
    if !status_write {
        let mut causes = merge_causes(
            schema_causes,
            validate::validate(&t.rt.group, &t.rt.plural, &obj),
        );
        causes.extend(validate::validate_update(
            &t.rt.group,
            &t.rt.plural,
            old,
            &obj,
        ));
        if t.rt.is("", "pods")
            && mutable_pod_spec(obj.get("spec").unwrap_or(&Value::Null))
                != mutable_pod_spec(old.get("spec").unwrap_or(&Value::Null))
        {
            causes.push(validate::Cause::forbidden(
                "spec",
                "pod updates may not change fields other than `spec.containers[*].image`,`spec.initContainers[*].image`,`spec.activeDeadlineSeconds`,`spec.tolerations` (only additions to existing tolerations),`spec.terminationGracePeriodSeconds` (allow it to be set to 1 if it was previously negative)",
            ));
        }
        if !causes.is_empty() {
            return Err(Box::new(invalid(&t.rt, name, &causes)));
        }
    }
    s.revision += 1;
    obj.insert("kind".into(), t.rt.kind.clone().into());
    obj.insert("apiVersion".into(), t.rt.api_version().into());
    let mut meta = take_metadata(&mut obj);
    if old["metadata"]["deletionTimestamp"].is_string() && !status_write {
        let before: Vec<&Value> = old["metadata"]["finalizers"]
            .as_array()
            .map(|f| f.iter().collect())
            .unwrap_or_default();
        let added = meta
            .get("finalizers")
            .and_then(Value::as_array)
            .is_some_and(|f| f.iter().any(|x| !before.contains(&x)));
        if added {
            s.revision -= 1;
            return Err(Box::new(invalid(
                &t.rt,
                name,
                &[validate::Cause::forbidden(
                    "metadata.finalizers",
                    "no new finalizers can be added if the object is being deleted",
                )],
            )));
        }
    }
    for field in [
        "name",
        "namespace",
        "uid",
        "creationTimestamp",
        "deletionTimestamp",
        "deletionGracePeriodSeconds",
    ] {
        match old.get("metadata").and_then(|m| m.get(field)) {
            Some(v) => meta.insert(field.into(), v.clone()),
            None => meta.remove(field),
        };
    }
    let generation = old
        .get("metadata")
        .and_then(|m| m.get("generation"))
        .and_then(Value::as_i64)
        .unwrap_or(0);
    let spec_changed = old.get("spec") != obj.get("spec");
    meta.insert(
        "generation".into(),
        (if spec_changed {
            generation + 1
        } else {
            generation
        })
        .into(),
    );
    meta.insert("resourceVersion".into(), s.revision.to_string().into());
    obj.insert("metadata".into(), Value::Object(meta));
    Ok(Value::Object(obj))
}

fn replace(s: &mut Store, t: &Target, name: &str, body: &[u8]) -> Response {
    let obj = match parse_object(body) {
        Ok(o) => o,
        Err(r) => return *r,
    };
    if let Err(r) = check_namespace(t, &obj) {
        return *r;
    }
    if meta_str(&obj, "name") != Some(name) {
        return bad_request("the name of the object does not match the name on the URL");
    }
    let k = key(t, name);
    let Some(old) = s.objects.get(&k).cloned() else {
        if t.rt.allow_create_on_update && t.subresource.is_none() {
            return create(s, t, body);
        }
        return not_found(&t.rt, name);
    };
    // Optimistic concurrency: an update carrying a resourceVersion must carry the current one.
    if let Some(rv) = meta_str(&obj, "resourceVersion")
        && !rv.is_empty()
        && Some(rv) != old["metadata"]["resourceVersion"].as_str()
    {
        return conflict(&t.rt, name);
    }
    match apply_update(s, t, name, &old, obj) {
        Ok(updated) => {
            commit(s, k.clone(), Some(old), Some(updated.clone()));
            finish_deletion(s, k, &updated)
                .unwrap_or_else(|| (StatusCode::OK, axum::Json(updated)).into_response())
        }
        Err(r) => *r,
    }
}

fn patch(s: &mut Store, t: &Target, name: &str, headers: &HeaderMap, body: &[u8]) -> Response {
    let content_type = headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if !content_type.starts_with("application/merge-patch+json") {
        return status(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "UnsupportedMediaType",
            &format!(
                "the fake API server only implements application/merge-patch+json, not {content_type:?}"
            ),
            None,
        );
    }
    let patch = match serde_json::from_slice::<Value>(body) {
        Ok(p @ Value::Object(_)) => p,
        Ok(_) => return bad_request("a merge patch must be a JSON object"),
        Err(e) => return bad_request(&format!("the patch is not valid JSON: {e}")),
    };
    let k = key(t, name);
    let Some(old) = s.objects.get(&k).cloned() else {
        return not_found(&t.rt, name);
    };
    // A resourceVersion in the patch is a precondition, as on the real server.
    if let Some(rv) = patch["metadata"]["resourceVersion"].as_str()
        && Some(rv) != old["metadata"]["resourceVersion"].as_str()
    {
        return conflict(&t.rt, name);
    }
    let mut merged = old.clone();
    merge_patch(&mut merged, &patch);
    let Value::Object(merged) = merged else {
        return bad_request("a merge patch must leave an object");
    };
    let updated = match apply_update(s, t, name, &old, merged) {
        Ok(u) => u,
        Err(r) => return *r,
    };
    // A patch that changes nothing does not bump the resourceVersion (nor the history).
    let mut unchanged = updated.clone();
    if let Some(m) = unchanged.get_mut("metadata").and_then(Value::as_object_mut) {
        m.insert(
            "resourceVersion".into(),
            old["metadata"]["resourceVersion"].clone(),
        );
    }
    if unchanged == old {
        s.revision -= 1;
        return (StatusCode::OK, axum::Json(old)).into_response();
    }
    commit(s, k.clone(), Some(old), Some(updated.clone()));
    finish_deletion(s, k, &updated)
        .unwrap_or_else(|| (StatusCode::OK, axum::Json(updated)).into_response())
}

/// RFC 7386 JSON merge patch: objects merge recursively, `null` deletes, anything else replaces.
pub fn merge_patch(target: &mut Value, patch: &Value) {
    let Value::Object(patch) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = Value::Object(Map::new());
    }
    if let Value::Object(t) = target {
        for (k, v) in patch {
            if v.is_null() {
                t.remove(k);
            } else {
                merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
            }
        }
    }
}

/// `POST pods/<name>/binding`: how a scheduler assigns a Pod to a Node.
fn bind(s: &mut Store, t: &Target, name: &str, body: &[u8]) -> Response {
    let binding = match parse_object(body) {
        Ok(b) => b,
        Err(r) => return *r,
    };
    let binding_type = ResourceType::core("bindings", "Binding", true, false);
    match schema_check(&binding_type, &Value::Object(binding.clone())) {
        Ok(causes) if causes.is_empty() => {}
        Ok(causes) => return invalid(&binding_type, name, &causes),
        Err(r) => return *r,
    }
    let Some(node) = binding
        .get("target")
        .and_then(|t| t.get("name"))
        .and_then(Value::as_str)
        .map(str::to_owned)
    else {
        return bad_request("a binding needs target.name");
    };
    let k = key(t, name);
    let Some(old) = s.objects.get(&k).cloned() else {
        return not_found(&t.rt, name);
    };
    if let Some(current) = old["spec"]["nodeName"].as_str() {
        return status(
            StatusCode::CONFLICT,
            "Conflict",
            &format!(
                "Operation cannot be fulfilled on pods/binding \"{name}\": pod {name} is already assigned to node \"{current}\""
            ),
            Some(details(&t.rt, name)),
        );
    }
    let mut new = old.clone();
    new["spec"]["nodeName"] = node.into();
    let mut conditions: Vec<Value> = new["status"]["conditions"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    conditions.retain(|c| c["type"] != "PodScheduled");
    conditions.push(
        json!({ "type": "PodScheduled", "status": "True", "lastTransitionTime": now_rfc3339() }),
    );
    new["status"]["conditions"] = Value::Array(conditions);
    s.revision += 1;
    new["metadata"]["resourceVersion"] = s.revision.to_string().into();
    commit(s, k, Some(old), Some(new));
    (
        StatusCode::CREATED,
        axum::Json(json!({ "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201 })),
    )
        .into_response()
}

fn delete(s: &mut Store, t: &Target, name: &str, body: &[u8]) -> Response {
    let k = key(t, name);
    let Some(old) = s.objects.get(&k).cloned() else {
        return not_found(&t.rt, name);
    };
    let options = if body.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice::<Value>(body).unwrap_or(Value::Null)
    };
    // DeleteOptions preconditions (uid / resourceVersion), when a body is sent.
    for field in ["uid", "resourceVersion"] {
        if let Some(want) = options["preconditions"][field].as_str()
            && Some(want) != old["metadata"][field].as_str()
        {
            return conflict(&t.rt, name);
        }
    }
    let orphan = options["propagationPolicy"] == "Orphan";
    let deleting = old["metadata"]["deletionTimestamp"].is_string();
    let grace = graceful_period(&t.rt, &old, &options);
    if options["propagationPolicy"] == "Foreground" && grace.is_none() && !has_finalizers(&old) {
        return foreground(s, k, &old);
    }
    if grace.is_some() || has_finalizers(&old) {
        // Marked, not removed: the kubelet ends a running Pod's containers and then removes
        // it; an object with finalizers stays until whoever owns them removes the last one.
        let secs = grace.unwrap_or(0);
        let earlier = old["metadata"]["deletionGracePeriodSeconds"]
            .as_i64()
            .is_some_and(|current| current <= secs);
        if deleting && earlier {
            return (StatusCode::OK, axum::Json(old)).into_response();
        }
        let marked = mark(s, k, &old, secs);
        return (StatusCode::OK, axum::Json(marked)).into_response();
    }
    if t.rt.is("", "pods") {
        // The real server's Pod strategy makes every Pod deletion graceful: one with no
        // grace left (grace 0, no node, a terminal phase) is stored marked first, then
        // removed, and a watch sees both (a node sends SIGTERM on the mark).
        let marked = mark(s, k.clone(), &old, 0);
        return remove(s, k, &marked, orphan);
    }
    remove(s, k, &old, orphan)
}

/// Stores `old` marked for deletion in `secs` (a `MODIFIED` event); the marked object.
fn mark(s: &mut Store, k: ObjectKey, old: &Value, secs: i64) -> Value {
    let mut marked = old.clone();
    s.revision += 1;
    marked["metadata"]["deletionTimestamp"] = rfc3339_after(secs).into();
    marked["metadata"]["deletionGracePeriodSeconds"] = secs.into();
    marked["metadata"]["resourceVersion"] = s.revision.to_string().into();
    commit(s, k, Some(old.clone()), Some(marked.clone()));
    marked
}

/// A `Foreground` deletion as a cluster carries it out: the object is marked (a
/// `deletionTimestamp` and the `foregroundDeletion` finalizer, which is what the real server
/// answers), its dependents are collected, then the garbage collector removes it. The fake
/// does the collector's part at once; the real server alone (no kube-controller-manager, as
/// in the tests) leaves the object marked.
fn foreground(s: &mut Store, k: ObjectKey, old: &Value) -> Response {
    let mut marked = old.clone();
    s.revision += 1;
    marked["metadata"]["deletionTimestamp"] = rfc3339_after(0).into();
    marked["metadata"]["deletionGracePeriodSeconds"] = 0.into();
    marked["metadata"]["finalizers"] = json!(["foregroundDeletion"]);
    marked["metadata"]["resourceVersion"] = s.revision.to_string().into();
    commit(s, k.clone(), Some(old.clone()), Some(marked.clone()));
    let _gone = remove(s, k, &marked, false);
    (StatusCode::OK, axum::Json(marked)).into_response()
}

/// Removes a stored object and collects its dependents; the answer is the object, as the
/// real server answers an immediate delete.
fn remove(s: &mut Store, k: ObjectKey, old: &Value, orphan: bool) -> Response {
    s.revision += 1;
    let mut gone = old.clone();
    gone["metadata"]["resourceVersion"] = s.revision.to_string().into();
    commit(s, k, Some(old.clone()), None);
    if let Some(uid) = old["metadata"]["uid"].as_str() {
        collect_garbage(s, uid, orphan);
    }
    (StatusCode::OK, axum::Json(gone)).into_response()
}

fn has_finalizers(obj: &Value) -> bool {
    obj["metadata"]["finalizers"]
        .as_array()
        .is_some_and(|f| !f.is_empty())
}

/// The grace period of a Pod's deletion, as the API server's Pod strategy decides it:
/// `None` (marked with none left and removed at once) for a Pod no node runs, one in a terminal phase, or a zero
/// grace; else `gracePeriodSeconds` of the request, the Pod's
/// `terminationGracePeriodSeconds`, or 30.
fn graceful_period(rt: &ResourceType, pod: &Value, options: &Value) -> Option<i64> {
    if !rt.is("", "pods") || !pod["spec"]["nodeName"].is_string() {
        return None;
    }
    if matches!(
        pod["status"]["phase"].as_str(),
        Some("Succeeded" | "Failed")
    ) {
        return None;
    }
    let secs = options["gracePeriodSeconds"]
        .as_i64()
        .or_else(|| pod["spec"]["terminationGracePeriodSeconds"].as_i64())
        .unwrap_or(30);
    (secs > 0).then_some(secs)
}

/// Completes the deletion of an object being deleted once its last finalizer is gone
/// (and, for a Pod, once it was deleted with no grace left).
fn finish_deletion(s: &mut Store, k: ObjectKey, updated: &Value) -> Option<Response> {
    let meta = &updated["metadata"];
    if !meta["deletionTimestamp"].is_string()
        || has_finalizers(updated)
        || meta["deletionGracePeriodSeconds"].as_i64().unwrap_or(0) > 0
    {
        return None;
    }
    Some(remove(s, k, updated, false))
}

/// Deletes (or orphans) every object owned by `uid`, then their dependents, as the garbage
/// collector does in the background after the owner is gone.
fn collect_garbage(s: &mut Store, uid: &str, orphan: bool) {
    let owned = |v: &Value| {
        v["metadata"]["ownerReferences"]
            .as_array()
            .is_some_and(|refs| refs.iter().any(|r| r["uid"] == uid))
    };
    let dependents: Vec<(ObjectKey, Value)> = s
        .objects
        .iter()
        .filter(|(_, v)| owned(v))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    for (k, old) in dependents {
        s.revision += 1;
        if orphan {
            let mut new = old.clone();
            if let Some(refs) = new["metadata"]["ownerReferences"].as_array_mut() {
                refs.retain(|r| r["uid"] != uid);
            }
            new["metadata"]["resourceVersion"] = s.revision.to_string().into();
            commit(s, k, Some(old), Some(new));
        } else if has_finalizers(&old) {
            let mut marked = old.clone();
            if !marked["metadata"]["deletionTimestamp"].is_string() {
                marked["metadata"]["deletionTimestamp"] = now_rfc3339().into();
                marked["metadata"]["deletionGracePeriodSeconds"] = 0.into();
            }
            marked["metadata"]["resourceVersion"] = s.revision.to_string().into();
            commit(s, k, Some(old), Some(marked));
        } else {
            commit(s, k, Some(old.clone()), None);
            if let Some(child) = old["metadata"]["uid"].as_str() {
                collect_garbage(s, child, false);
            }
        }
    }
}

// ----- Status objects -----------------------------------------------------------------------

/// `details` as the real server fills it: `kind` is the resource (plural), and `group` is
/// omitted for the core group.
fn details(rt: &ResourceType, name: &str) -> Value {
    let mut d = json!({ "name": name, "kind": rt.plural });
    if let (false, Value::Object(m)) = (rt.group.is_empty(), &mut d) {
        m.insert("group".into(), rt.group.clone().into());
    }
    d
}

/// A `Status` object as the real API server sends it with an error code.
fn status_body(code: StatusCode, reason: &str, message: &str, details: Option<Value>) -> Value {
    let mut body = json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code.as_u16(),
    });
    if let (Some(d), Value::Object(m)) = (details, &mut body) {
        m.insert("details".into(), d);
    }
    body
}

fn status(code: StatusCode, reason: &str, message: &str, details: Option<Value>) -> Response {
    (
        code,
        axum::Json(status_body(code, reason, message, details)),
    )
        .into_response()
}

fn not_found(rt: &ResourceType, name: &str) -> Response {
    status(
        StatusCode::NOT_FOUND,
        "NotFound",
        &format!("{} \"{name}\" not found", rt.qualified()),
        Some(details(rt, name)),
    )
}

fn not_found_path(path: &str) -> Response {
    status(
        StatusCode::NOT_FOUND,
        "NotFound",
        &format!("the server could not find the requested resource ({path})"),
        None,
    )
}

fn bad_request(message: &str) -> Response {
    status(StatusCode::BAD_REQUEST, "BadRequest", message, None)
}

/// `422 Invalid`: `<Kind> "<name>" is invalid: <cause>` (or `[<cause>, <cause>]`), with the
/// causes in `details`, where `kind` is the Kind (not the plural) as the real server sends it.
fn invalid(rt: &ResourceType, name: &str, causes: &[validate::Cause]) -> Response {
    let lines: Vec<String> = causes.iter().map(validate::Cause::line).collect();
    let joined = match lines.as_slice() {
        [one] => one.clone(),
        many => format!("[{}]", many.join(", ")),
    };
    let mut d = json!({
        "name": name,
        "kind": rt.kind,
        "causes": causes.iter().map(|c| json!({ "reason": c.reason, "message": c.message, "field": c.field })).collect::<Vec<_>>(),
    });
    if !rt.group.is_empty() {
        d["group"] = rt.group.clone().into();
    }
    status(
        StatusCode::UNPROCESSABLE_ENTITY,
        "Invalid",
        &format!("{} \"{name}\" is invalid: {joined}", rt.qualified_kind()),
        Some(d),
    )
}

// ----- server-set values --------------------------------------------------------------------

fn new_uid() -> String {
    let b: [u8; 16] = rand::random();
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

fn random_suffix() -> String {
    // The real server appends five characters from a consonant/digit alphabet.
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    (0..5)
        .map(|_| ALPHABET[rand::random_range(0..ALPHABET.len())] as char)
        .collect()
}

/// `now_rfc3339` plus `secs` seconds (a deletion deadline).
fn rfc3339_after(secs: i64) -> String {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    k8s_openapi::jiff::Timestamp::from_second(now.saturating_add(secs))
        .map(|t| t.to_string())
        .unwrap_or_else(|_| "1970-01-01T00:00:00Z".into())
}

/// `creationTimestamp` format: RFC 3339, whole seconds, UTC.
pub fn now_rfc3339() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    k8s_openapi::jiff::Timestamp::from_second(secs)
        .map(|t| t.to_string())
        .unwrap_or_else(|_| "1970-01-01T00:00:00Z".into())
}
