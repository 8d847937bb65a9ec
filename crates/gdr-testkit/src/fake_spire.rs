//! A fake SPIRE agent: a SPIFFE Workload API per Pod that hands the Pod its SVID only while
//! a `ClusterStaticEntry` on the (fake) API server selects it: selector
//! `k8s:pod-uid:<uid>`, `parentID` equal to this agent's ID and `className` equal to the
//! controller manager's class, as spire-controller-manager and the agent would.
//!
//! A real agent serves one socket and attests each caller (cgroup → Pod UID through the
//! kubelet). A test process cannot be attested that way, so the fake gives each Pod its
//! own socket directory, which the fake kubelet mounts where the SPIFFE CSI volume goes:
//! which socket a process reaches *is* its attestation. Entries are followed with a real
//! `kube::runtime::watcher`; an entry deleted (or re-pointed) takes the identity away from
//! open streams at once (`PermissionDenied`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use futures::StreamExt;
use gdr_identity::workload_api::{LocalCa, RunningWorkloadApi, WorkloadApi, WorkloadApiError};
use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, ResourceExt};
use serde_json::Value;
use tokio::task::JoinHandle;

/// File name of the socket in each Pod's directory (the CSI driver's convention).
pub const SOCKET_NAME: &str = "spire-agent.sock";

struct State {
    /// ClusterStaticEntries by name, as last seen.
    entries: BTreeMap<String, Value>,
    /// Pod UID → its Workload API.
    workloads: BTreeMap<String, RunningWorkloadApi>,
}

struct Shared {
    ca: LocalCa,
    agent_id: String,
    class_name: String,
    dir: PathBuf,
    state: Mutex<State>,
}

/// The agent; dropping it stops every Workload API and the entry watch.
pub struct FakeSpireAgent {
    shared: Arc<Shared>,
    task: JoinHandle<()>,
}

impl Drop for FakeSpireAgent {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn entry_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("spire.spiffe.io", "v1alpha1", "ClusterStaticEntry"),
        "clusterstaticentries",
    )
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The SPIFFE ID an entry grants the Pod `uid`, if one does.
    fn granted(&self, entries: &BTreeMap<String, Value>, uid: &str) -> Option<String> {
        let selector = format!("k8s:pod-uid:{uid}");
        entries.values().find_map(|e| {
            let spec = &e["spec"];
            let selects = spec["selectors"]
                .as_array()
                .is_some_and(|s| s.iter().any(|v| v.as_str() == Some(selector.as_str())));
            let ours = spec["parentID"].as_str() == Some(self.agent_id.as_str())
                && spec["className"].as_str().unwrap_or_default() == self.class_name;
            (selects && ours)
                .then(|| spec["spiffeID"].as_str().map(str::to_owned))
                .flatten()
        })
    }

    fn reconcile(&self) {
        let state = self.lock();
        for (uid, api) in &state.workloads {
            let want = self.granted(&state.entries, uid);
            let have = api.current_svid().map(|s| s.spiffe_id);
            match want {
                Some(id) if have.as_deref() != Some(id.as_str()) => {
                    if let Err(e) = api.set_identity(&id) {
                        tracing::warn!(pod_uid = %uid, error = %e, "fake SPIRE agent cannot issue the SVID");
                    }
                }
                None if have.is_some() => api.clear_identity(),
                _ => {}
            }
        }
    }
}

impl FakeSpireAgent {
    /// An agent with ID `agent_id` serving entries of `class_name`, its sockets under `dir`.
    pub fn start(
        client: kube::Client,
        ca: LocalCa,
        agent_id: &str,
        class_name: &str,
        dir: &Path,
    ) -> Self {
        let shared = Arc::new(Shared {
            ca,
            agent_id: agent_id.to_owned(),
            class_name: class_name.to_owned(),
            dir: dir.to_path_buf(),
            state: Mutex::new(State {
                entries: BTreeMap::new(),
                workloads: BTreeMap::new(),
            }),
        });
        let entries: Api<DynamicObject> = Api::all_with(client, &entry_resource());
        let watch = Arc::clone(&shared);
        let task = tokio::spawn(async move {
            let mut stream = watcher(entries, watcher::Config::default())
                .default_backoff()
                .boxed();
            let mut listing: Option<BTreeMap<String, Value>> = None;
            while let Some(event) = stream.next().await {
                match event {
                    Ok(watcher::Event::Apply(e)) => {
                        watch
                            .lock()
                            .entries
                            .insert(e.name_any(), serde_json::to_value(&e).unwrap_or_default());
                    }
                    Ok(watcher::Event::Delete(e)) => {
                        watch.lock().entries.remove(&e.name_any());
                    }
                    Ok(watcher::Event::Init) => listing = Some(BTreeMap::new()),
                    Ok(watcher::Event::InitApply(e)) => {
                        if let Some(l) = listing.as_mut() {
                            l.insert(e.name_any(), serde_json::to_value(&e).unwrap_or_default());
                        }
                    }
                    Ok(watcher::Event::InitDone) => {
                        if let Some(l) = listing.take() {
                            watch.lock().entries = l;
                        }
                    }
                    Err(e) => tracing::debug!(error = %e, "fake SPIRE agent entry watch error"),
                }
                watch.reconcile();
            }
        });
        FakeSpireAgent { shared, task }
    }

    /// This agent's SPIFFE ID (the parent entries must name).
    pub fn agent_id(&self) -> &str {
        &self.shared.agent_id
    }

    /// The directory the SPIFFE CSI volume of Pod `uid` maps to (holding
    /// [`SOCKET_NAME`]); starts serving it, without identity until an entry selects it.
    pub async fn socket_dir(&self, uid: &str) -> Result<PathBuf, WorkloadApiError> {
        // Short paths: a Unix socket path is limited to about 100 bytes.
        let dir = self.shared.dir.join(&uid[..uid.len().min(8)]);
        if self.shared.lock().workloads.contains_key(uid) {
            return Ok(dir);
        }
        std::fs::create_dir_all(&dir).map_err(|source| WorkloadApiError::Bind {
            path: dir.clone(),
            source,
        })?;
        let socket = dir.join(SOCKET_NAME);
        let _ = std::fs::remove_file(&socket);
        let placeholder = format!(
            "spiffe://{}/fake-spire-agent/unattested",
            self.shared.ca.trust_domain()
        );
        let api = WorkloadApi::start_at(socket, self.shared.ca.clone(), &placeholder).await?;
        api.clear_identity();
        self.shared.lock().workloads.insert(uid.to_owned(), api);
        self.shared.reconcile();
        Ok(dir)
    }

    /// The SPIFFE ID Pod `uid` currently gets, if any.
    pub fn identity_of(&self, uid: &str) -> Option<String> {
        self.shared
            .lock()
            .workloads
            .get(uid)
            .and_then(|a| a.current_svid())
            .map(|s| s.spiffe_id)
    }

    /// How many `FetchX509SVID` streams Pod `uid` opened (0 if it never asked).
    pub fn fetches(&self, uid: &str) -> u64 {
        self.shared
            .lock()
            .workloads
            .get(uid)
            .map_or(0, RunningWorkloadApi::fetch_count)
    }

    /// Stops serving Pod `uid` (its Pod is gone).
    pub fn forget(&self, uid: &str) {
        self.shared.lock().workloads.remove(uid);
    }
}
