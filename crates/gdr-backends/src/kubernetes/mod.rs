//! The Kubernetes Pod backend (DESIGN invariants 8–13): one fresh Pod per assignment, bound
//! to the job's SPIFFE identity through a SPIRE `ClusterStaticEntry`.
//!
//! - **State lives on the cluster.** The Pod is named after the assignment ID and carries
//!   the metadata codec's labels and annotations (plus `app.kubernetes.io/name` and
//!   `component=executor`), so Pods of the Go controller are found and adopted and vice
//!   versa. `claimed`/`terminal` are labels set by merge patch. Reads (`find`, `list`) go
//!   to the API server, never to a cache: the watch only *wakes* callers
//!   ([`KubernetesBackend::changes`]), who then read observed state.
//! - **The capability is not in the Pod spec.** It travels in a per-Pod `Secret`
//!   (`<assignment>-capability`) read through `env.valueFrom.secretKeyRef`, so whoever can
//!   `get pods` (dashboards, `kubectl describe`) cannot read it; reading it needs `get
//!   secrets`. A projected file was the alternative, but a projected volume can only
//!   project a Secret, a ConfigMap or Pod fields, so it needs the same Secret (or exposes
//!   the value through the Pod), and the executor (this one and the Go one) reads
//!   `CI_RUNNER_CAPABILITY` from its environment. The Secret is created *before* the Pod,
//!   so the kubelet never waits in `CreateContainerConfigError` for it, and then owned by
//!   the Pod, so Kubernetes deletes it with the Pod; one left unowned by a crash between
//!   the two is removed by the sweep.
//! - **Identity.** Once the Pod is scheduled, an idempotent ClusterStaticEntry named after
//!   the assignment binds the job's SPIFFE ID to selector `k8s:pod-uid:<uid>` under the
//!   node's agent ID (`spiffe://<td>/spire/agent/k8s_psat/<cluster>/<Node UID>`, or the
//!   configured `spire_agent_id`). An existing entry with another spec is an error, never
//!   re-pointed. Entries are cluster-scoped and cannot be owned by a Pod: `delete` removes
//!   the entry before the Pod, and [`KubernetesBackend::sweep`] (run by the controller's
//!   lifecycle pass) removes entries whose Pod is gone.
//! - **Warm Pods** (`pod_warm_pool`, off by default): Pods created before any job, with no
//!   assignment, identity or capability, each claimed by exactly one job through a
//!   patch with a `resourceVersion` precondition; see [`warm`].
//! - **Errors** map onto the contract: 409/429/5xx/transport → retry, 403 → permanent,
//!   naming the RBAC verb and resource to grant, 422 → permanent with the server's message.
//!   Every call the backend makes is listed in [`API_CALLS`].

mod error;
mod manifest;
mod phase;
mod pool;
mod settings;
pub mod warm;

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use error::*;
pub use error::{API_CALLS, ApiCall, KubernetesError};
use futures::StreamExt;
use gdr_core::assignment::{AssignmentId, RecoveredAssignment};
use gdr_core::backend::Backend;
use gdr_core::executor::{
    Binding, ExecutorBackend, ExecutorError, ExecutorRecord, ExecutorSpec, IdentityTarget, Phase,
};
use gdr_core::metadata::{ExecutorMetadata, Marker, keys};
use k8s_openapi::api::core::v1::{Node, Pod, Secret};
use kube::api::{
    ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, Patch, PatchParams,
    PostParams, Preconditions,
};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, ResourceExt};
pub use manifest::{APP_NAME, CAPABILITY_KEY, CONTAINER, secret_name};
pub use phase::phase;
pub use pool::WarmPass;
use serde_json::{Value, json};
pub use settings::{
    KubernetesSettings, PodProfile, ProfileVolume, Resources, SettingsError, WorkloadApiVolume,
    parse_quantity,
};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// What one sweep removed.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Sweep {
    /// Identity entries whose Pod is gone.
    pub entries: usize,
    /// Capability Secrets left without a Pod.
    pub secrets: usize,
}

struct Inner {
    settings: KubernetesSettings,
    pods: Api<Pod>,
    secrets: Api<Secret>,
    nodes: Api<Node>,
    entries: Api<DynamicObject>,
    entry_resource: ApiResource,
    /// Jobs' claims of warm Pods since the last pass reported them.
    claims: warm::ClaimCounts,
}

/// Executors as Kubernetes Pods. Dropping it stops the watch (the Pods keep running).
pub struct KubernetesBackend {
    inner: Arc<Inner>,
    changes: watch::Receiver<u64>,
    watch_task: JoinHandle<()>,
}

impl Drop for KubernetesBackend {
    fn drop(&mut self) {
        self.watch_task.abort();
    }
}

fn entry_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("spire.spiffe.io", "v1alpha1", "ClusterStaticEntry"),
        "clusterstaticentries",
    )
}

impl KubernetesBackend {
    /// A backend over `client` (in-cluster, or a test's fake API server). Validates the
    /// settings and starts watching executor Pods; call within a Tokio runtime.
    pub fn new(
        client: kube::Client,
        settings: KubernetesSettings,
    ) -> Result<Self, KubernetesError> {
        settings.validate()?;
        if !settings.image.contains("@sha256:") {
            tracing::warn!(image = %settings.image, "pod_executor_image is a mutable tag; pin a digest (image@sha256:…) so every job runs the executor you reviewed");
        }
        for (label, profile) in &settings.profiles {
            if let Some(image) = profile.image.as_deref().filter(|i| !i.contains("@sha256:")) {
                tracing::warn!(profile = %label, %image, "the image of Pod profile {label} is a mutable tag; pin a digest (image@sha256:…)");
            }
        }
        let ns = settings.namespace.clone();
        let entry_resource = entry_resource();
        let inner = Arc::new(Inner {
            pods: Api::namespaced(client.clone(), &ns),
            secrets: Api::namespaced(client.clone(), &ns),
            nodes: Api::all(client.clone()),
            entries: Api::all_with(client, &entry_resource),
            entry_resource,
            settings,
            claims: warm::ClaimCounts::default(),
        });
        let (tx, changes) = watch::channel(0u64);
        // Every Pod of the backend, so that a warm Pod's changes wake the pass refilling
        // the pool too.
        let watch_selector = format!(
            "{}={}",
            inner.settings.codec.key(keys::BACKEND),
            Backend::Pod.as_str()
        );
        let watch_task = tokio::spawn(watch_pods(inner.pods.clone(), watch_selector, tx));
        Ok(KubernetesBackend {
            inner,
            changes,
            watch_task,
        })
    }

    /// A signal that moves on every observed change of an executor Pod (created, phase or
    /// label changed, deleted, and after every re-list): wait on `changed()`, then `find`.
    /// It carries no state; the API server stays the authority.
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.changes.clone()
    }

    /// The `runs-on` labels the profiles add, to declare to Gitea next to
    /// `self-hosted` and the backend label, so that Gitea offers those jobs.
    pub fn profile_labels(&self) -> Vec<String> {
        self.inner.settings.profiles.keys().cloned().collect()
    }

    /// The settings in force.
    pub fn settings(&self) -> &KubernetesSettings {
        &self.inner.settings
    }

    /// Brings the warm pool to the configured counts (`pod_warm_pool`, profiles'
    /// `warm_pool`) from the Pods the cluster holds: ended members are deleted, missing
    /// ones created, a surplus (a count lowered, the pool turned off) deleted.
    pub async fn reconcile_warm_pool(&self) -> Result<WarmPass, ExecutorError> {
        self.inner.reconcile_warm().await
    }

    /// Whether any warm pool is configured.
    pub fn warm_pool_configured(&self) -> bool {
        !self.inner.settings.warm_pools().is_empty()
    }

    /// Removes identity entries whose Pod is gone (or is another Pod of the same name) and
    /// capability Secrets that no Pod owns and no Pod needs.
    pub async fn sweep(&self) -> Result<Sweep, ExecutorError> {
        // Entries first: an entry is created only after its Pod, so a Pod missing from the
        // later Pod list is really gone, never one created in between.
        let entries = self.inner.list_entries().await?;
        let pods = self.inner.list_pods().await?;
        self.inner.sweep(&entries, &pods).await
    }
}

/// Follows the executor Pods; only bumps the change signal. `kube::runtime::watcher`
/// re-lists after `410 Expired` and resumes from bookmarks; errors back off and retry.
async fn watch_pods(pods: Api<Pod>, selector: String, tx: watch::Sender<u64>) {
    let config = watcher::Config::default().labels(&selector);
    let mut stream = watcher(pods, config).default_backoff().boxed();
    while let Some(event) = stream.next().await {
        match event {
            Ok(watcher::Event::Apply(_) | watcher::Event::Delete(_) | watcher::Event::InitDone) => {
                tx.send_modify(|n| *n = n.wrapping_add(1));
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(error = %e, "watching executor Pods failed; the watcher re-lists and retries");
            }
        }
    }
}

fn created_at(pod: &Pod) -> SystemTime {
    pod.metadata
        .creation_timestamp
        .as_ref()
        .map(|t| SystemTime::from(t.0))
        .unwrap_or_else(SystemTime::now)
}

fn entry_pod_uid(entry: &DynamicObject) -> Option<String> {
    entry.data["spec"]["selectors"]
        .as_array()?
        .iter()
        .filter_map(Value::as_str)
        .find_map(|s| s.strip_prefix("k8s:pod-uid:"))
        .map(str::to_owned)
}

impl Inner {
    fn ns(&self) -> &str {
        &self.settings.namespace
    }

    fn err(&self, call: ApiCall, name: &str, e: kube::Error) -> ExecutorError {
        api(call, name, self.ns(), e).into()
    }

    /// `<prefix>runner=true,<prefix>backend=pod`.
    fn selector(&self) -> String {
        let codec = &self.settings.codec;
        format!(
            "{},{}={}",
            codec.runner_selector(),
            codec.key(keys::BACKEND),
            Backend::Pod.as_str()
        )
    }

    /// The assignment a Pod records, re-validated.
    fn decode(&self, pod: &Pod) -> Result<RecoveredAssignment, KubernetesError> {
        let name = pod.name_any();
        let metadata = ExecutorMetadata {
            labels: pod.labels().clone(),
            annotations: pod.annotations().clone(),
        };
        let assignment = self
            .settings
            .codec
            .decode(&metadata, &self.settings.trust_domain)
            .map_err(|source| KubernetesError::Untrusted {
                pod: name.clone(),
                source,
            })?;
        // A claimed warm Pod keeps the name it was created with.
        let named_right = assignment.id().as_str() == name || self.is_claimed_warm(pod);
        if !named_right || assignment.backend() != Backend::Pod {
            return Err(KubernetesError::NotOurs {
                found: format!(
                    "assignment {} of backend {}",
                    assignment.id(),
                    assignment.backend()
                ),
                id: assignment.id().clone(),
                pod: name,
            });
        }
        Ok(assignment)
    }

    fn record(
        &self,
        pod: &Pod,
        assignment: RecoveredAssignment,
        entry: Option<&DynamicObject>,
    ) -> ExecutorRecord {
        let uid = pod.uid();
        let codec = &self.settings.codec;
        ExecutorRecord {
            name: pod.name_any(),
            assignment,
            phase: phase(pod),
            claimed: codec.has_marker(pod.labels(), Marker::Claimed),
            terminal: codec.has_marker(pod.labels(), Marker::Terminal),
            identity_bound: entry
                .is_some_and(|e| entry_pod_uid(e).is_some() && entry_pod_uid(e) == uid),
            identity_target: uid.map(IdentityTarget::PodUid),
            // A claimed warm Pod starts as the job's executor at its claim.
            created_at: self.claimed_at(pod).unwrap_or_else(|| created_at(pod)),
        }
    }

    async fn get_pod(&self, name: &str) -> Result<Option<Pod>, ExecutorError> {
        self.pods
            .get_opt(name)
            .await
            .map_err(|e| self.err(GET_POD, name, e))
    }

    async fn get_entry(&self, name: &str) -> Result<Option<DynamicObject>, ExecutorError> {
        self.entries
            .get_opt(name)
            .await
            .map_err(|e| self.err(GET_ENTRY, name, e))
    }

    async fn list_pods(&self) -> Result<Vec<Pod>, ExecutorError> {
        Ok(self
            .pods
            .list(&ListParams::default().labels(&self.selector()))
            .await
            .map_err(|e| self.err(LIST_PODS, self.ns(), e))?
            .items)
    }

    async fn list_entries(&self) -> Result<Vec<DynamicObject>, ExecutorError> {
        let selector = manifest::component_selector(manifest::COMPONENT_IDENTITY);
        Ok(self
            .entries
            .list(&ListParams::default().labels(&selector))
            .await
            .map_err(|e| self.err(LIST_ENTRIES, "", e))?
            .items)
    }

    /// The Pod of `id`: the one named after it, or the warm Pod its job claimed.
    async fn pod_of(&self, id: &AssignmentId) -> Result<Option<Pod>, ExecutorError> {
        match self.get_pod(id.as_str()).await? {
            Some(pod) => Ok(Some(pod)),
            None => self.claimed_warm(id).await,
        }
    }

    /// The existing executor of `id`, validated.
    async fn find(&self, id: &AssignmentId) -> Result<Option<ExecutorRecord>, ExecutorError> {
        Ok(self.find_pod(id).await?.map(|(_, record)| record))
    }

    /// [`Inner::find`] with the Pod.
    async fn find_pod(
        &self,
        id: &AssignmentId,
    ) -> Result<Option<(Pod, ExecutorRecord)>, ExecutorError> {
        let Some(pod) = self.pod_of(id).await? else {
            return Ok(None);
        };
        let assignment = self.decode(&pod)?;
        let entry = self.get_entry(id.as_str()).await?;
        let record = self.record(&pod, assignment, entry.as_ref());
        Ok(Some((pod, record)))
    }

    /// Profile chosen by the job's extra `runs-on` labels (none, or exactly one).
    fn profile<'s>(
        &'s self,
        spec: &'s ExecutorSpec,
    ) -> Result<Option<(&'s str, &'s PodProfile)>, KubernetesError> {
        let base = [
            "self-hosted",
            spec.runner_label.as_str(),
            Backend::Pod.as_str(),
        ];
        let mut chosen: Option<(&str, &PodProfile)> = None;
        for label in spec.runs_on.iter().filter(|l| !base.contains(&l.as_str())) {
            let Some(profile) = self.settings.profiles.get(label) else {
                let known: Vec<&str> = self.settings.profiles.keys().map(String::as_str).collect();
                return Err(KubernetesError::UnknownProfileLabel {
                    label: label.clone(),
                    known: if known.is_empty() {
                        "none".into()
                    } else {
                        known.join(", ")
                    },
                });
            };
            if let Some((first, _)) = chosen {
                if first != label {
                    return Err(KubernetesError::TwoProfiles {
                        first: first.to_owned(),
                        second: label.clone(),
                    });
                }
            } else {
                chosen = Some((label, profile));
            }
        }
        Ok(chosen)
    }

    /// Creates the capability Secret, or makes sure an existing one holds this capability.
    async fn ensure_secret(&self, spec: &ExecutorSpec) -> Result<(), ExecutorError> {
        let secret = manifest::capability_secret(&self.settings, spec);
        let name = manifest::secret_name(spec.assignment.id());
        match self.secrets.create(&PostParams::default(), &secret).await {
            Ok(_) => Ok(()),
            // Left by an earlier attempt; the capability is deterministic, so it is the same.
            Err(e) if is_already_exists(&e) => Ok(()),
            Err(e) => Err(self.err(CREATE_SECRET, &name, e)),
        }
    }

    async fn adopt_secret(&self, pod: &Pod) -> Result<(), ExecutorError> {
        let (Some(uid), Ok(id)) = (pod.uid(), AssignmentId::parse(&pod.name_any())) else {
            return Ok(());
        };
        let name = manifest::secret_name(&id);
        let patch = manifest::owner_patch(&pod.name_any(), &uid);
        match self
            .secrets
            .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if is_not_found(&e) => Ok(()),
            Err(e) => Err(self.err(PATCH_SECRET, &name, e)),
        }
    }

    async fn create(&self, spec: &ExecutorSpec) -> Result<ExecutorRecord, ExecutorError> {
        let id = spec.assignment.id();
        if spec.assignment.backend() != Backend::Pod {
            return Err(KubernetesError::WrongBackend {
                id: id.clone(),
                requested: spec.assignment.backend(),
            }
            .into());
        }
        let chosen = self.profile(spec)?;
        if let Some((pod, existing)) = self.find_pod(id).await? {
            // Its Secret is created before the claim; made sure of, as the fresh path does.
            if self.is_claimed_warm(&pod) {
                self.ensure_claimed_secret(spec, &pod).await?;
            }
            return Ok(existing);
        }
        if let Some(claimed) = self.claim(spec, chosen.map(|(label, _)| label)).await? {
            return Ok(claimed);
        }
        let profile = chosen.map(|(_, p)| p);
        self.ensure_secret(spec).await?;
        let pod = manifest::pod(&self.settings, spec, profile);
        let created = match self.pods.create(&PostParams::default(), &pod).await {
            Ok(p) => p,
            Err(e) if is_already_exists(&e) => match self.get_pod(id.as_str()).await? {
                Some(p) => p,
                None => return Err(self.err(CREATE_POD, id.as_str(), e)),
            },
            Err(e) => return Err(self.err(CREATE_POD, id.as_str(), e)),
        };
        self.adopt_secret(&created).await?;
        tracing::info!(assignment_id = %id, pod = %created.name_any(), uid = ?created.uid(), namespace = %self.ns(), "executor Pod created");
        let assignment = self.decode(&created)?;
        Ok(self.record(&created, assignment, None))
    }

    async fn parent_id(&self, pod: &Pod) -> Result<Result<String, String>, ExecutorError> {
        if let Some(id) = &self.settings.spire_agent_id {
            return Ok(Ok(id.clone()));
        }
        let Some(node_name) = pod.spec.as_ref().and_then(|s| s.node_name.clone()) else {
            let why = match phase(pod) {
                Phase::Starting { reason: Some(r) } => {
                    format!("the Pod is not scheduled yet ({r})")
                }
                _ => "the Pod is not scheduled yet".to_owned(),
            };
            return Ok(Err(why));
        };
        let node = self
            .nodes
            .get_opt(&node_name)
            .await
            .map_err(|e| self.err(GET_NODE, &node_name, e))?;
        Ok(match node.and_then(|n| n.uid()) {
            Some(uid) => Ok(format!(
                "spiffe://{}/spire/agent/k8s_psat/{}/{uid}",
                self.settings.trust_domain.as_str(),
                self.settings.spire_cluster
            )),
            None => Err(format!("node {node_name} of the Pod is not found")),
        })
    }

    async fn bind(&self, record: &ExecutorRecord) -> Result<Binding, ExecutorError> {
        let id = record.assignment.id();
        let name = id.as_str();
        let Some(pod) = self.pod_of(id).await? else {
            return Err(KubernetesError::NoExecutor {
                name: name.to_owned(),
            }
            .into());
        };
        let assignment = self.decode(&pod)?;
        let Some(uid) = pod.uid() else {
            return Ok(Binding::NotReady("the Pod has no UID yet".into()));
        };
        let parent = match self.parent_id(&pod).await? {
            Ok(p) => p,
            Err(why) => return Ok(Binding::NotReady(why)),
        };
        let wanted = manifest::entry_spec(
            &self.settings,
            assignment.identity().spiffe_id(),
            &uid,
            &parent,
        );
        let mut entry =
            DynamicObject::new(name, &self.entry_resource).data(json!({ "spec": wanted }));
        entry.metadata.labels = Some(manifest::entry_labels(&self.settings, id));
        let existing = match self.entries.create(&PostParams::default(), &entry).await {
            Ok(_) => {
                tracing::info!(assignment_id = %id, entry = name, parent_id = %parent, pod_uid = %uid, "identity entry created");
                return Ok(Binding::Bound);
            }
            Err(e) if is_already_exists(&e) => self.get_entry(name).await?,
            Err(e) => return Err(self.err(CREATE_ENTRY, name, e)),
        };
        match existing {
            Some(found) if found.data["spec"] == wanted => Ok(Binding::Bound),
            Some(found) => Err(KubernetesError::EntryMismatch {
                name: name.to_owned(),
                existing: found.data["spec"].to_string(),
                wanted: wanted.to_string(),
            }
            .into()),
            // Deleted between the create and the get: the next attempt creates it.
            None => Ok(Binding::NotReady(
                "the identity entry was deleted concurrently".into(),
            )),
        }
    }

    async fn set_marker(&self, id: &AssignmentId, marker: Marker) -> Result<bool, ExecutorError> {
        let (key, value) = self.settings.codec.marker(marker);
        let patch = json!({ "metadata": { "labels": { key: value } } });
        let mut name = id.as_str().to_owned();
        loop {
            match self
                .pods
                .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Ok(_) => return Ok(true),
                Err(e) if is_not_found(&e) && name == id.as_str() => {
                    // Not named after it: the warm Pod its job claimed, if any.
                    match self.claimed_warm(id).await? {
                        Some(pod) => name = pod.name_any(),
                        None => return Ok(false),
                    }
                }
                Err(e) if is_not_found(&e) => return Ok(false),
                Err(e) => return Err(self.err(PATCH_POD, &name, e)),
            }
        }
    }

    async fn delete_named<K>(
        &self,
        api: &Api<K>,
        call: ApiCall,
        name: &str,
        dp: &DeleteParams,
    ) -> Result<(), ExecutorError>
    where
        K: Clone + serde::de::DeserializeOwned + std::fmt::Debug,
    {
        match api.delete(name, dp).await {
            Ok(_) => Ok(()),
            Err(e) if is_not_found(&e) => Ok(()),
            Err(e) => Err(self.err(call, name, e)),
        }
    }

    async fn delete(&self, id: &AssignmentId) -> Result<(), ExecutorError> {
        let name = id.as_str();
        let background = DeleteParams::background();
        // The entry first: no SVID may be issued for a Pod the controller is deleting.
        self.delete_named(&self.entries, DELETE_ENTRY, name, &background)
            .await?;
        let pod = match self.pods.delete(name, &background).await {
            Ok(_) => name.to_owned(),
            // Not named after it: the warm Pod its job claimed, if any (its Secret is
            // named after it).
            Err(e) if is_not_found(&e) => match self.claimed_warm(id).await? {
                Some(warm) => {
                    let warm = warm.name_any();
                    self.delete_named(&self.pods, DELETE_POD, &warm, &background)
                        .await?;
                    warm
                }
                None => name.to_owned(),
            },
            Err(e) => return Err(self.err(DELETE_POD, name, e)),
        };
        self.delete_named(
            &self.secrets,
            DELETE_SECRET,
            &manifest::secret_name_of(&pod),
            &background,
        )
        .await?;
        tracing::info!(assignment_id = %id, pod = name, "executor Pod, identity entry and capability Secret deleted");
        Ok(())
    }

    async fn sweep(&self, entries: &[DynamicObject], pods: &[Pod]) -> Result<Sweep, ExecutorError> {
        let mut sweep = Sweep::default();
        let uids: HashSet<String> = pods.iter().filter_map(|p| p.uid()).collect();
        for entry in entries {
            if entry_pod_uid(entry).is_some_and(|u| uids.contains(&u)) {
                continue;
            }
            let name = entry.name_any();
            // Precondition: only the entry seen, not one re-created meanwhile.
            let dp = DeleteParams {
                preconditions: Some(Preconditions {
                    uid: entry.uid(),
                    resource_version: None,
                }),
                ..DeleteParams::background()
            };
            match self.entries.delete(&name, &dp).await {
                Ok(_) => {
                    sweep.entries += 1;
                    tracing::info!(entry = %name, "identity entry of a gone Pod removed");
                }
                Err(e)
                    if is_not_found(&e) || matches!(&e, kube::Error::Api(s) if s.code == 409) => {}
                Err(e) => return Err(self.err(DELETE_ENTRY, &name, e)),
            }
        }
        let selector = manifest::component_selector(manifest::COMPONENT_CAPABILITY);
        let secrets = self
            .secrets
            .list(&ListParams::default().labels(&selector))
            .await
            .map_err(|e| self.err(LIST_SECRETS, self.ns(), e))?
            .items;
        let names: HashSet<String> = pods.iter().map(|p| p.name_any()).collect();
        let grace = self.settings.orphan_secret_grace;
        for secret in secrets {
            let owned = secret
                .metadata
                .owner_references
                .as_ref()
                .is_some_and(|r| !r.is_empty());
            let pod_name = secret
                .name_any()
                .trim_end_matches(&format!("-{CAPABILITY_KEY}"))
                .to_owned();
            let old = secret
                .metadata
                .creation_timestamp
                .as_ref()
                .and_then(|t| SystemTime::now().duration_since(SystemTime::from(t.0)).ok())
                .is_some_and(|age| age >= grace);
            if owned || names.contains(&pod_name) || !old {
                continue;
            }
            self.delete_named(
                &self.secrets,
                DELETE_SECRET,
                &secret.name_any(),
                &DeleteParams::background(),
            )
            .await?;
            sweep.secrets += 1;
            tracing::info!(secret = %secret.name_any(), "capability Secret without a Pod removed");
        }
        Ok(sweep)
    }

    async fn list(&self) -> Result<Vec<ExecutorRecord>, ExecutorError> {
        let entries = self.list_entries().await?;
        let pods = self.list_pods().await?;
        let by_name: BTreeMap<String, &DynamicObject> =
            entries.iter().map(|e| (e.name_any(), e)).collect();
        let mut records = Vec::new();
        for pod in &pods {
            match self.decode(pod) {
                Ok(assignment) => {
                    let entry = by_name.get(&pod.name_any()).copied();
                    records.push(self.record(pod, assignment, entry));
                }
                Err(e) => {
                    tracing::warn!(pod = %pod.name_any(), error = %e, "skipping a Pod with untrustworthy executor metadata");
                }
            }
        }
        records.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(records)
    }
}

#[async_trait]
impl ExecutorBackend for KubernetesBackend {
    fn backend(&self) -> Backend {
        Backend::Pod
    }

    async fn find(&self, id: &AssignmentId) -> Result<Option<ExecutorRecord>, ExecutorError> {
        self.inner.find(id).await
    }

    async fn create(&self, spec: &ExecutorSpec) -> Result<ExecutorRecord, ExecutorError> {
        self.inner.create(spec).await
    }

    async fn bind_identity(&self, record: &ExecutorRecord) -> Result<Binding, ExecutorError> {
        self.inner.bind(record).await
    }

    async fn record_claimed(&self, id: &AssignmentId) -> Result<(), ExecutorError> {
        if self.inner.set_marker(id, Marker::Claimed).await? {
            Ok(())
        } else {
            Err(KubernetesError::NoExecutor {
                name: id.as_str().to_owned(),
            }
            .into())
        }
    }

    async fn mark_terminal(&self, id: &AssignmentId) -> Result<(), ExecutorError> {
        self.inner
            .set_marker(id, Marker::Terminal)
            .await
            .map(|_| ())
    }

    async fn list(&self) -> Result<Vec<ExecutorRecord>, ExecutorError> {
        self.inner.list().await
    }

    async fn delete(&self, id: &AssignmentId) -> Result<(), ExecutorError> {
        self.inner.delete(id).await
    }
}

/// How long callers may wait for a change before re-reading anyway (watches can be
/// silently stuck behind proxies); a bound, not a poll interval of the design.
pub const RESYNC: Duration = Duration::from_secs(30);
