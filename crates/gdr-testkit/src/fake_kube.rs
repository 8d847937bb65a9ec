//! An in-process fake Kubernetes API server for tests, driven by the real `kube` client.
//!
//! It follows the real API server for the parts the controller uses, and nothing more:
//! - one generic object store keyed by (resource type, namespace, name), so a new kind is
//!   one [`ResourceType`] registration ([`FakeKube::register`]);
//! - GET, LIST (with equality-based `labelSelector`), POST, PUT, DELETE and
//!   PATCH (`application/merge-patch+json`) over that store;
//! - optimistic concurrency: monotonically increasing `resourceVersion` strings, a PUT (or a
//!   merge patch, or a delete precondition) carrying a stale one is refused with 409
//!   `Conflict`; POST of an existing name is 409 `AlreadyExists`; errors are `Status` objects
//!   shaped like the real server's, so `kube::Error::Api` carries the same reason and code;
//! - server-set metadata: `uid`, `creationTimestamp`, `resourceVersion`, `generateName`.
//!
//! Registered now: `leases` (coordination.k8s.io/v1, namespaced) and `pods` (core v1,
//! namespaced). Not implemented: watch, field selectors, set-based label selectors,
//! subresources (`/status`), strategic merge, JSON patch and server-side apply (these get
//! a 415 or 400 Status, never a silent wrong answer).
//!
//! Faults: [`FakeKube::fail_next`] / [`FakeKube::fail_always`] answer matching requests with
//! an error Status; [`RunningFakeKube::stop`] makes the server unreachable (listener closed,
//! open connections reset) and [`RunningFakeKube::restart`] brings it back on the same port.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use http::{HeaderMap, Method, StatusCode, Uri};
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

    /// `coordination.k8s.io/v1, Resource=leases`: the store key prefix.
    fn key(&self) -> String {
        format!("{}/{}/{}", self.group, self.version, self.plural)
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
        }
    }

    /// Core `v1` Pod.
    pub fn pods() -> Self {
        ResourceType {
            group: String::new(),
            version: "v1".into(),
            plural: "pods".into(),
            kind: "Pod".into(),
            namespaced: true,
            allow_create_on_update: false,
        }
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

#[derive(Default)]
struct Store {
    types: Vec<ResourceType>,
    objects: BTreeMap<ObjectKey, Value>,
    /// Last issued resourceVersion; one counter for all kinds, as etcd's revision is.
    revision: u64,
    faults: Vec<Fault>,
    /// `METHOD path?query` of every request, for tests that assert on traffic.
    requests: Vec<String>,
}

/// Handle to the fake's state; cheap to clone.
#[derive(Clone, Default)]
pub struct FakeKube {
    inner: Arc<Mutex<Store>>,
}

impl FakeKube {
    /// An empty store with `leases` and `pods` registered.
    pub fn new() -> Self {
        let kube = FakeKube::default();
        kube.register(ResourceType::leases());
        kube.register(ResourceType::pods());
        kube
    }

    fn lock(&self) -> MutexGuard<'_, Store> {
        // A panic while holding the lock only happens in a failing test; keep serving.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
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
}

async fn handle(
    State(kube): State<FakeKube>,
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
    match (method.clone(), target.name.clone()) {
        (Method::GET, Some(name)) => get(&s, &target, &name),
        (Method::GET, None) => list(&s, &target, &params),
        (Method::POST, None) => create(&mut s, &target, &body),
        (Method::PUT, Some(name)) => replace(&mut s, &target, &name, &body),
        (Method::PATCH, Some(name)) => patch(&mut s, &target, &name, &headers, &body),
        (Method::DELETE, Some(name)) => delete(&mut s, &target, &name, &body),
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
    let (namespace, plural, name) = match rest {
        ["namespaces", ns, plural] => (Some(*ns), *plural, None),
        ["namespaces", ns, plural, name] => (Some(*ns), *plural, Some(*name)),
        [plural] => (None, *plural, None),
        [plural, name] => (None, *plural, Some(*name)),
        _ => return Err(Box::new(not_found_path(path))),
    };
    let rt = types
        .iter()
        .find(|t| t.group == group && t.version == version && t.plural == plural)
        .cloned()
        .ok_or_else(|| Box::new(not_found_path(path)))?;
    // A namespaced kind addressed without a namespace is only valid as a cluster-wide list;
    // a cluster-scoped kind never has one.
    if (rt.namespaced && namespace.is_none() && name.is_some())
        || (!rt.namespaced && namespace.is_some())
    {
        return Err(Box::new(not_found_path(path)));
    }
    Ok(Target {
        rt,
        namespace: namespace.map(str::to_owned),
        name: name.map(str::to_owned),
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

fn get(s: &Store, t: &Target, name: &str) -> Response {
    match s.objects.get(&key(t, name)) {
        Some(obj) => (StatusCode::OK, axum::Json(obj.clone())).into_response(),
        None => not_found(&t.rt, name),
    }
}

fn list(s: &Store, t: &Target, params: &BTreeMap<String, String>) -> Response {
    if params.get("watch").is_some_and(|w| w == "true" || w == "1") {
        return bad_request("watch is not implemented by the fake API server");
    }
    let selector = match params.get("labelSelector").map(|s| LabelSelector::parse(s)) {
        Some(Ok(sel)) => Some(sel),
        Some(Err(e)) => return bad_request(&e),
        None => None,
    };
    let type_key = t.rt.key();
    let items: Vec<Value> = s
        .objects
        .iter()
        .filter(|((k, ns, _), _)| {
            k == &type_key && t.namespace.as_ref().is_none_or(|want| want == ns)
        })
        .filter(|(_, obj)| selector.as_ref().is_none_or(|sel| sel.matches(obj)))
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
                "metadata.name: Required value: name or generateName is required",
            );
        }
    };
    let k = (t.rt.key(), namespace.clone(), name.clone());
    if s.objects.contains_key(&k) {
        return status(
            StatusCode::CONFLICT,
            "AlreadyExists",
            &format!("{} \"{name}\" already exists", t.rt.qualified()),
            Some(details(&t.rt, &name)),
        );
    }
    s.revision += 1;
    obj.insert("kind".into(), t.rt.kind.clone().into());
    obj.insert("apiVersion".into(), t.rt.api_version().into());
    let mut meta = take_metadata(&mut obj);
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
    s.objects.insert(k, obj.clone());
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

/// Copies server-owned metadata from the stored object and bumps the resourceVersion.
fn finish_update(s: &mut Store, t: &Target, old: &Value, mut obj: Map<String, Value>) -> Value {
    s.revision += 1;
    obj.insert("kind".into(), t.rt.kind.clone().into());
    obj.insert("apiVersion".into(), t.rt.api_version().into());
    let mut meta = take_metadata(&mut obj);
    for field in ["name", "namespace", "uid", "creationTimestamp"] {
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
    Value::Object(obj)
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
        if t.rt.allow_create_on_update {
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
    let updated = finish_update(s, t, &old, obj);
    s.objects.insert(k, updated.clone());
    (StatusCode::OK, axum::Json(updated)).into_response()
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
    // A patch that changes nothing does not bump the resourceVersion.
    let mut unchanged = merged.clone();
    if let Some(m) = unchanged.get_mut("metadata").and_then(Value::as_object_mut) {
        m.insert(
            "resourceVersion".into(),
            old["metadata"]["resourceVersion"].clone(),
        );
    }
    if unchanged == old {
        return (StatusCode::OK, axum::Json(old)).into_response();
    }
    let Value::Object(merged) = merged else {
        return bad_request("a merge patch must leave an object");
    };
    let updated = finish_update(s, t, &old, merged);
    s.objects.insert(k, updated.clone());
    (StatusCode::OK, axum::Json(updated)).into_response()
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

fn delete(s: &mut Store, t: &Target, name: &str, body: &[u8]) -> Response {
    let k = key(t, name);
    let Some(old) = s.objects.get(&k).cloned() else {
        return not_found(&t.rt, name);
    };
    // DeleteOptions preconditions (uid / resourceVersion), when a body is sent.
    if !body.is_empty()
        && let Ok(options) = serde_json::from_slice::<Value>(body)
    {
        for field in ["uid", "resourceVersion"] {
            if let Some(want) = options["preconditions"][field].as_str()
                && Some(want) != old["metadata"][field].as_str()
            {
                return conflict(&t.rt, name);
            }
        }
    }
    s.objects.remove(&k);
    // Pods are deleted immediately here (no kubelet, no grace period): the real server's
    // answer for an immediate delete is the object itself.
    (StatusCode::OK, axum::Json(old)).into_response()
}

// ----- label selectors ----------------------------------------------------------------------

/// Equality-based label selector: `a=b`, `a==b`, `a!=b`, `a` (exists), `!a` (absent),
/// comma-separated and all required. Set-based forms (`in`, `notin`) are refused.
pub struct LabelSelector(Vec<Requirement>);

enum Requirement {
    Eq(String, String),
    Ne(String, String),
    Exists(String),
    Absent(String),
}

impl LabelSelector {
    pub fn parse(s: &str) -> Result<Self, String> {
        let mut reqs = Vec::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            if part.contains('(') || part.contains(' ') {
                return Err(format!(
                    "unable to parse requirement {part:?}: set-based selectors are not implemented by the fake API server"
                ));
            }
            let req = if let Some((k, v)) = part.split_once("!=") {
                Requirement::Ne(k.into(), v.into())
            } else if let Some((k, v)) = part.split_once("==") {
                Requirement::Eq(k.into(), v.into())
            } else if let Some((k, v)) = part.split_once('=') {
                Requirement::Eq(k.into(), v.into())
            } else if let Some(k) = part.strip_prefix('!') {
                Requirement::Absent(k.into())
            } else {
                Requirement::Exists(part.into())
            };
            reqs.push(req);
        }
        Ok(LabelSelector(reqs))
    }

    pub fn matches(&self, obj: &Value) -> bool {
        let labels = &obj["metadata"]["labels"];
        let label = |k: &str| labels.get(k).and_then(Value::as_str);
        self.0.iter().all(|r| match r {
            Requirement::Eq(k, v) => label(k) == Some(v.as_str()),
            Requirement::Ne(k, v) => label(k) != Some(v.as_str()),
            Requirement::Exists(k) => label(k).is_some(),
            Requirement::Absent(k) => label(k).is_none(),
        })
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
fn status(code: StatusCode, reason: &str, message: &str, details: Option<Value>) -> Response {
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
    (code, axum::Json(body)).into_response()
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

fn invalid(rt: &ResourceType, name: &str, message: &str) -> Response {
    status(
        StatusCode::UNPROCESSABLE_ENTITY,
        "Invalid",
        &format!("{} \"{name}\" is invalid: {message}", rt.kind),
        Some(details(rt, name)),
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

/// `creationTimestamp` format: RFC 3339, whole seconds, UTC.
fn now_rfc3339() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    k8s_openapi::jiff::Timestamp::from_second(secs)
        .map(|t| t.to_string())
        .unwrap_or_else(|_| "1970-01-01T00:00:00Z".into())
}
