//! `sandbox-identity`: gives every Pod of a runner `BatchSandbox` (an OpenSandbox VM) the
//! job's SPIFFE identity, and takes it away as soon as the Pod is no longer the sandbox's.
//! It runs in the sandbox cluster with a kube client and holds no OpenSandbox key, Gitea
//! token or secret-store credential (DESIGN: components; invariant 13).
//!
//! One pass ([`Reconciler::reconcile_once`]) is level-triggered:
//! 1. list the `BatchSandbox`es (`sandbox.opensandbox.io/v1alpha1`) carrying
//!    `<prefix>runner=true` in the OpenSandbox namespace;
//! 2. for each, the Pods of its `alloc-status` not named by `alloc-release`/`alloc-released`
//!    ([`sandbox::live_pods`]), each Pod's current UID, and the SPIFFE ID it asks for,
//!    re-validated ([`sandbox::EntryTemplate::spiffe_id`]), and its Pool (`spec.poolRef`);
//!    a sandbox whose identity does not validate, or whose Pool hands released Pods to the
//!    next sandbox instead of deleting them ([`sandbox::pool_refusal`]: the next job would
//!    run in this job's VM), is refused (logged once, counted) and gets no entry;
//! 3. the desired `ClusterStaticEntry`s: one per (sandbox, Pod UID), parent
//!    `spiffe://<td>/spire/agent/k8s_psat/<cluster>/pod/<Pod UID>` (SPIRE ≥ 1.15.3 with
//!    `use_pod_uid_for_agent_id`), selector `unix:uid:<runner uid>`, `className`;
//! 4. delete every owned entry that is not desired **first** (a released or recycled Pod
//!    UID never keeps an old job's identity), then create the missing and repair the
//!    changed ones.
//!
//! A pass that cannot read the cluster completely (list, Pool or Pod read failing) changes
//! nothing. [`Reconciler::run`] repeats passes on watch events (coalesced: events arriving
//! during a pass cause one more pass) and on a resync interval, which alone suffices when
//! watches fail.

pub mod sandbox;

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use gdr_core::identity::TrustDomain;
use gdr_core::metadata::MetadataCodec;
use gdr_shutdown::Shutdown;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{
    ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, Patch, PatchParams,
    PostParams, WatchEvent, WatchParams,
};
use kube::{Api, Client};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
pub use sandbox::{DesiredEntry, EntryTemplate, Refusal};
use serde_json::json;
use tokio::sync::Notify;

/// Configuration of the reconciler; every field is one documented setting.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Namespace of the BatchSandboxes and their Pods (`opensandbox_namespace`, default
    /// `opensandbox`).
    pub namespace: String,
    /// Trust domain of the SPIFFE IDs (`trust_domain`).
    pub trust_domain: TrustDomain,
    /// k8s_psat cluster name the in-VM agents attest with (`spire_cluster_name`, default
    /// `sandbox-kata`).
    pub cluster: String,
    /// spire-controller-manager class of the entries (`spire_class_name`, default
    /// `spire-mgmt-spire`); an entry of another class is ignored by the manager.
    pub class_name: String,
    /// UID the runner runs as inside the VM (`runner_uid`, default 2000).
    pub runner_uid: u32,
    /// Metadata codec (prefix, default `ci.ddupan.top/`).
    pub codec: MetadataCodec,
    /// Passes happen at least this often (`sandbox_identity_resync`, default 30 s).
    pub resync: Duration,
}

/// The defaults of [`Settings`], declared once: [`Settings::new`] and the controller's key
/// table (`opensandbox_namespace`, `spire_cluster_name`, …) both read them.
pub mod defaults {
    use std::time::Duration;

    /// Namespace of the BatchSandboxes (`opensandbox_namespace`).
    pub const NAMESPACE: &str = "opensandbox";
    /// k8s_psat cluster name of the in-VM agents (`spire_cluster_name`).
    pub const CLUSTER: &str = "sandbox-kata";
    /// spire-controller-manager class of the entries (`spire_class_name`).
    pub const CLASS_NAME: &str = "spire-mgmt-spire";
    /// UID the runner runs as inside the VM (`runner_uid`).
    pub const RUNNER_UID: u32 = 2000;
    /// Least often a pass happens (`sandbox_identity_resync`).
    pub const RESYNC: Duration = Duration::from_secs(30);
}

impl Settings {
    /// Settings with the defaults for `trust_domain`.
    pub fn new(trust_domain: TrustDomain) -> Self {
        Settings {
            namespace: defaults::NAMESPACE.into(),
            trust_domain,
            cluster: defaults::CLUSTER.into(),
            class_name: defaults::CLASS_NAME.into(),
            runner_uid: defaults::RUNNER_UID,
            codec: MetadataCodec::default(),
            resync: defaults::RESYNC,
        }
    }
}

/// Why a pass failed (nothing was changed after the failure's cause).
#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    /// A Kubernetes API call failed.
    #[error("{what}: {source}")]
    Kube {
        /// What was being done.
        what: String,
        /// The cause.
        #[source]
        source: kube::Error,
    },
}

fn kube_error(what: impl Into<String>) -> impl FnOnce(kube::Error) -> ReconcileError {
    let what = what.into();
    move |source| ReconcileError::Kube { what, source }
}

/// What one pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Pass {
    /// Runner sandboxes seen.
    pub sandboxes: usize,
    /// Entries wanted.
    pub desired: usize,
    /// Entries created.
    pub created: usize,
    /// Entries whose spec or labels were repaired.
    pub updated: usize,
    /// Entries deleted.
    pub deleted: usize,
    /// Sandboxes refused this pass.
    pub refused: usize,
}

/// Metrics of the reconciler.
#[derive(Debug, Clone, Default)]
pub struct Metrics {
    /// Passes completed.
    pub passes: Counter,
    /// Passes that failed.
    pub pass_errors: Counter,
    /// Entries created.
    pub entries_created: Counter,
    /// Entries deleted.
    pub entries_deleted: Counter,
    /// Sandboxes refused an identity (an invalid one, or a Pool that recycles Pods; each
    /// sandbox once).
    pub refused: Counter,
    /// Entries that exist after the last pass.
    pub entries: Gauge,
}

impl Metrics {
    /// Registers the metrics under `sandbox_identity_*`.
    pub fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("sandbox_identity");
        r.register("passes", "Reconcile passes completed", self.passes.clone());
        r.register(
            "pass_errors",
            "Reconcile passes that failed",
            self.pass_errors.clone(),
        );
        r.register(
            "entries_created",
            "ClusterStaticEntries created",
            self.entries_created.clone(),
        );
        r.register(
            "entries_deleted",
            "ClusterStaticEntries deleted",
            self.entries_deleted.clone(),
        );
        r.register(
            "refused",
            "Sandboxes refused an identity: an invalid one, or a Pool that hands its Pods on",
            self.refused.clone(),
        );
        r.register(
            "entries",
            "ClusterStaticEntries owned after the last pass",
            self.entries.clone(),
        );
    }
}

/// `sandbox.opensandbox.io/v1alpha1` BatchSandbox.
pub fn batchsandbox_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("sandbox.opensandbox.io", "v1alpha1", "BatchSandbox"),
        "batchsandboxes",
    )
}

/// `sandbox.opensandbox.io/v1alpha1` Pool: read for its `recycleStrategy`.
pub fn pool_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("sandbox.opensandbox.io", "v1alpha1", "Pool"),
        "pools",
    )
}

/// `spire.spiffe.io/v1alpha1` ClusterStaticEntry (cluster-scoped).
pub fn entry_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("spire.spiffe.io", "v1alpha1", "ClusterStaticEntry"),
        "clusterstaticentries",
    )
}

/// The reconciler. Keeps no state but what it has already logged.
pub struct Reconciler {
    settings: Settings,
    template: EntryTemplate,
    sandboxes: Api<DynamicObject>,
    pools: Api<DynamicObject>,
    pods: Api<Pod>,
    entries: Api<DynamicObject>,
    metrics: Metrics,
    /// Sandboxes (name/uid) already reported as refused, so each is logged and counted once.
    refused: Mutex<HashSet<String>>,
}

impl Reconciler {
    /// A reconciler using `client`.
    pub fn new(client: Client, settings: Settings, metrics: Metrics) -> Self {
        let template = EntryTemplate {
            trust_domain: settings.trust_domain.clone(),
            cluster: settings.cluster.clone(),
            class_name: settings.class_name.clone(),
            runner_uid: settings.runner_uid,
            codec: settings.codec.clone(),
        };
        Reconciler {
            sandboxes: Api::namespaced_with(
                client.clone(),
                &settings.namespace,
                &batchsandbox_resource(),
            ),
            pools: Api::namespaced_with(client.clone(), &settings.namespace, &pool_resource()),
            pods: Api::namespaced(client.clone(), &settings.namespace),
            entries: Api::all_with(client, &entry_resource()),
            template,
            settings,
            metrics,
            refused: Mutex::new(HashSet::new()),
        }
    }

    fn runner_selector(&self) -> String {
        self.settings.codec.runner_selector()
    }

    fn owned_selector() -> String {
        format!(
            "{}={}",
            sandbox::COMPONENT_LABEL.0,
            sandbox::COMPONENT_LABEL.1
        )
    }

    /// The entries the cluster's current state calls for.
    async fn desired(&self) -> Result<(BTreeMap<String, DesiredEntry>, Pass), ReconcileError> {
        let list = self
            .sandboxes
            .list(&ListParams::default().labels(&self.runner_selector()))
            .await
            .map_err(kube_error("listing runner BatchSandboxes"))?;
        let mut pass = Pass {
            sandboxes: list.items.len(),
            ..Pass::default()
        };
        let mut desired = BTreeMap::new();
        let mut refused_now = HashSet::new();
        let mut pools = BTreeMap::new();
        for object in &list.items {
            let name = object.metadata.name.clone().unwrap_or_default();
            let value = serde_json::to_value(object).unwrap_or_default();
            let pods = sandbox::live_pods(&value);
            if pods.is_empty() {
                continue;
            }
            let spiffe_id = match self.identity_of(&name, &value, &mut pools).await? {
                Ok(id) => id,
                Err(refusal) => {
                    pass.refused += 1;
                    let key = format!("{name}/{}", object.metadata.uid.clone().unwrap_or_default());
                    if !self.refused().contains(&key) {
                        self.metrics.refused.inc();
                        tracing::warn!(sandbox = %name, reason = %refusal, "refusing to give the sandbox an identity");
                    }
                    refused_now.insert(key);
                    continue;
                }
            };
            for pod in pods {
                let found = self
                    .pods
                    .get_opt(&pod)
                    .await
                    .map_err(kube_error(format!("reading Pod {pod} of sandbox {name}")))?;
                let Some(found) = found else {
                    tracing::debug!(sandbox = %name, pod = %pod, "allocated Pod not found (yet)");
                    continue;
                };
                if found.metadata.deletion_timestamp.is_some() {
                    continue;
                }
                let Some(uid) = found.metadata.uid.filter(|u| !u.is_empty()) else {
                    continue;
                };
                let entry = self.template.entry(&name, &uid, &spiffe_id);
                desired.insert(entry.name.clone(), entry);
            }
        }
        *self.refused() = refused_now;
        pass.desired = desired.len();
        Ok((desired, pass))
    }

    /// The identity the sandbox `value` asks for, or why it gets none: an identity that
    /// does not validate, or a Pool that hands its Pods on ([`sandbox::pool_refusal`]).
    /// `pools` holds the Pools this pass has read, so each is read once a pass.
    async fn identity_of(
        &self,
        name: &str,
        value: &serde_json::Value,
        pools: &mut BTreeMap<String, Option<serde_json::Value>>,
    ) -> Result<Result<String, Refusal>, ReconcileError> {
        let spiffe_id = match self.template.spiffe_id(value) {
            Ok(id) => id,
            Err(refusal) => return Ok(Err(refusal)),
        };
        let Some(pool) = sandbox::pool_ref(value) else {
            return Ok(Ok(spiffe_id));
        };
        if !pools.contains_key(&pool) {
            let found = if sandbox::is_pool_name(&pool) {
                self.pools
                    .get_opt(&pool)
                    .await
                    .map_err(kube_error(format!("reading Pool {pool} of sandbox {name}")))?
                    .map(|p| serde_json::to_value(p).unwrap_or_default())
            } else {
                None
            };
            pools.insert(pool.clone(), found);
        }
        let read = pools.get(&pool).and_then(Option::as_ref);
        Ok(match sandbox::pool_refusal(&pool, read) {
            Some(refusal) => Err(refusal),
            None => Ok(spiffe_id),
        })
    }

    fn refused(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        self.refused.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// One level-triggered pass (see the crate docs).
    pub async fn reconcile_once(&self) -> Result<Pass, ReconcileError> {
        let result = self.pass().await;
        match &result {
            Ok(pass) => {
                self.metrics.passes.inc();
                self.metrics
                    .entries
                    .set(i64::try_from(pass.desired).unwrap_or(i64::MAX));
            }
            Err(_) => {
                self.metrics.pass_errors.inc();
            }
        }
        result
    }

    async fn pass(&self) -> Result<Pass, ReconcileError> {
        let (desired, mut pass) = self.desired().await?;
        let existing = self
            .entries
            .list(&ListParams::default().labels(&Self::owned_selector()))
            .await
            .map_err(kube_error("listing owned ClusterStaticEntries"))?;
        let mut present = BTreeMap::new();
        // Revoke before granting.
        for entry in existing.items {
            let name = entry.metadata.name.clone().unwrap_or_default();
            if desired.contains_key(&name) {
                present.insert(name, entry);
                continue;
            }
            match self.entries.delete(&name, &DeleteParams::default()).await {
                Ok(_) => {}
                Err(kube::Error::Api(status)) if status.is_not_found() => {}
                Err(e) => return Err(kube_error(format!("deleting ClusterStaticEntry {name}"))(e)),
            }
            pass.deleted += 1;
            self.metrics.entries_deleted.inc();
            let labels = entry.metadata.labels.unwrap_or_default();
            tracing::info!(entry = %name, sandbox = ?labels.get(&self.settings.codec.key(sandbox::SANDBOX_ID_LABEL)), "removed a SPIRE entry whose sandbox or Pod is gone");
        }
        for (name, want) in &desired {
            match present.get(name) {
                Some(have) => {
                    let labels_ok = want.labels.iter().all(|(k, v)| {
                        have.metadata.labels.as_ref().and_then(|l| l.get(k)) == Some(v)
                    });
                    if have.data["spec"] == want.spec && labels_ok {
                        continue;
                    }
                    let patch = json!({"metadata": {"labels": want.labels}, "spec": want.spec});
                    self.entries
                        .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
                        .await
                        .map_err(kube_error(format!("repairing ClusterStaticEntry {name}")))?;
                    pass.updated += 1;
                    tracing::warn!(entry = %name, sandbox = %want.sandbox, "repaired a SPIRE entry that had been changed");
                }
                None => {
                    let mut object = DynamicObject::new(name, &entry_resource())
                        .data(json!({ "spec": want.spec }));
                    object.metadata.labels = Some(want.labels.clone());
                    match self.entries.create(&PostParams::default(), &object).await {
                        Ok(_) => {}
                        // Created meanwhile (another pass): the next pass compares it.
                        Err(kube::Error::Api(status)) if status.code == 409 => continue,
                        Err(e) => {
                            return Err(kube_error(format!("creating ClusterStaticEntry {name}"))(
                                e,
                            ));
                        }
                    }
                    pass.created += 1;
                    self.metrics.entries_created.inc();
                    tracing::info!(entry = %name, sandbox = %want.sandbox, pod_uid = %want.pod_uid, spiffe_id = %want.spec["spiffeID"], "SPIRE entry ready");
                }
            }
        }
        Ok(pass)
    }

    /// Runs passes on watch events and every `resync` until `shutdown` is triggered.
    pub async fn run(self: Arc<Self>, shutdown: Shutdown) {
        let trigger = Arc::new(Notify::new());
        let watches = [
            tokio::spawn(watch_changes(
                self.sandboxes.clone(),
                self.runner_selector(),
                Arc::clone(&trigger),
                shutdown.clone(),
            )),
            tokio::spawn(watch_changes(
                self.entries.clone(),
                Self::owned_selector(),
                Arc::clone(&trigger),
                shutdown.clone(),
            )),
        ];
        while !shutdown.is_triggered() {
            if let Err(e) = self.reconcile_once().await {
                tracing::warn!(error = %e, "sandbox identity pass failed; retrying");
            }
            tokio::select! {
                _ = trigger.notified() => {}
                _ = tokio::time::sleep(self.settings.resync) => {}
                _ = shutdown.wait() => {}
            }
        }
        for watch in watches {
            // Each ends on the same signal; a watch stuck in a call is not waited for.
            watch.abort();
        }
    }
}

/// Notifies `trigger` on every change of the objects `selector` selects; re-lists and
/// re-watches after errors and expiries (with backoff). Events only trigger passes: a
/// missed one is caught by the next resync.
async fn watch_changes(
    api: Api<DynamicObject>,
    selector: String,
    trigger: Arc<Notify>,
    shutdown: Shutdown,
) {
    const MAX_BACKOFF: Duration = Duration::from_secs(30);
    let mut backoff = Duration::from_secs(1);
    let mut warned = false;
    while !shutdown.is_triggered() {
        let params = WatchParams::default().labels(&selector).timeout(290);
        let started = match api
            .list(&ListParams::default().labels(&selector).limit(1))
            .await
        {
            Ok(list) => {
                let version = list.metadata.resource_version.unwrap_or_else(|| "0".into());
                api.watch(&params, &version).await
            }
            Err(e) => Err(e),
        };
        match started {
            Ok(stream) => {
                let mut stream = std::pin::pin!(stream);
                loop {
                    tokio::select! {
                        event = stream.next() => match event {
                            Some(Ok(WatchEvent::Added(_) | WatchEvent::Modified(_) | WatchEvent::Deleted(_))) => {
                                backoff = Duration::from_secs(1);
                                warned = false;
                                trigger.notify_one();
                            }
                            Some(Ok(WatchEvent::Bookmark(_))) => {}
                            Some(Ok(WatchEvent::Error(_)) | Err(_)) | None => break,
                        },
                        _ = shutdown.wait() => return,
                    }
                }
            }
            Err(e) => {
                if !warned {
                    tracing::warn!(selector = %selector, error = %e, "cannot watch; relying on resync until the watch works");
                    warned = true;
                }
            }
        }
        // Something may have changed while no watch was open.
        trigger.notify_one();
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = shutdown.wait() => return,
        }
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}
