//! A fake kubelet (and scheduler) for one Node of the fake API server: it runs each Pod
//! bound to its Node as a local process and reports the Pod's status through the API, as
//! a kubelet does.
//!
//! - **Scheduling**: a Pod without `spec.nodeName` is bound to this Node (`pods/binding`)
//!   unless its `nodeSelector` does not match the Node's labels or the Node is made
//!   unschedulable ([`FakeKubelet::set_unschedulable`]); then it gets `PodScheduled=False`,
//!   reason `Unschedulable`, with the scheduler's message.
//! - **Images** map to local programs ([`KubeletConfig::images`]); an unknown image gives
//!   `ErrImagePull`, then `ImagePullBackOff`, with the containerd-style message.
//! - **Environment**: `value`, `valueFrom.secretKeyRef` (a missing Secret or key gives
//!   `CreateContainerConfigError` until it exists), `valueFrom.fieldRef` for
//!   `metadata.name|namespace|uid` and `spec.nodeName`; nothing of the test's own
//!   environment leaks in but `PATH`, `HOME` and `TMPDIR`.
//! - **Volumes** map to directories under the kubelet's root: `emptyDir`, `secret` and
//!   `projected` Secret (an optional one may be missing) and downward API sources
//!   written as files, and kept up to date while the Pod runs, as the kubelet updates them
//!   on a change of the Pod's labels and annotations or of the Secret; the SPIFFE CSI volume
//!   (`csi.spiffe.io`) or the agent's node directory ([`AGENT_HOST_DIR`], a `hostPath`)
//!   mapped to the fake SPIRE agent's directory for that Pod. A process
//!   cannot see the mount paths, so every mount path appearing in an env value or argument
//!   is rewritten to its directory (the fake's one visible deviation).
//! - **Sidecars**: init containers with `restartPolicy: Always` (native sidecars, such as
//!   the executor Pod's `dockerd`) start before the first container, with their own
//!   environment and mounts, and are killed once it has ended (a real kubelet sends them
//!   SIGTERM then); the Pod's phase is the first container's. Other init containers are
//!   not run.
//! - **Lifecycle**: `Pending` → `Running` → `Succeeded`/`Failed` with the container's exit
//!   code (`Completed`/`Error`) and, with `terminationMessagePolicy: FallbackToLogsOnError`,
//!   the tail of its log as the termination message; [`FakeKubelet::oom_kill`] and
//!   [`FakeKubelet::evict`] end a Pod as the kernel or the eviction manager would;
//!   [`FakeKubelet::lose_node`] leaves its Pods `Unknown`.
//! - **Termination**: a deleted Pod's first container gets SIGTERM (its main process, as a
//!   container runtime signals PID 1), its sidecars once it has ended, and whatever still
//!   runs gets SIGKILL when the Pod's `deletionGracePeriodSeconds` have passed; then the
//!   Pod is deleted with no grace left, so the API server removes it (or keeps it, marked
//!   for deletion, while it has finalizers).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine;
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Container, Node, Pod, ProjectedVolumeSource, Secret, Volume};
use kube::api::{DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, ResourceExt};
use serde_json::{Value, json};
use tokio::task::JoinHandle;

use crate::fake_kube::now_rfc3339;
use crate::fake_spire::FakeSpireAgent;

/// The node directory where the fake node's SPIRE agent listens, for Pods that mount it
/// with `hostPath` (`pod_spiffe_host_path`) instead of the SPIFFE CSI driver; any other
/// `hostPath` fails the Pod's start as a missing `Directory` does on a real node.
pub const AGENT_HOST_DIR: &str = "/run/spire/agent-sockets";

/// A downward API field of `pod` (`metadata.labels['k']`, `metadata.annotations['k']`,
/// `metadata.name`, `metadata.namespace`, `metadata.uid`); a missing key is empty.
fn field_value(pod: &Pod, path: &str) -> String {
    let keyed = |prefix: &str| {
        path.strip_prefix(prefix)?
            .strip_prefix("['")?
            .strip_suffix("']")
            .map(str::to_owned)
    };
    if let Some(key) = keyed("metadata.labels") {
        return pod.labels().get(&key).cloned().unwrap_or_default();
    }
    if let Some(key) = keyed("metadata.annotations") {
        return pod.annotations().get(&key).cloned().unwrap_or_default();
    }
    match path {
        "metadata.name" => pod.name_any(),
        "metadata.namespace" => pod.namespace().unwrap_or_default(),
        "metadata.uid" => pod.uid().unwrap_or_default(),
        _ => String::new(),
    }
}

/// Whether `volume` carries the node's SPIRE agent socket: `None` for any other volume;
/// else whether this node can mount it (`agent`: a fake SPIRE agent runs here), with the
/// kubelet's reason when not. A real node's agent serves every Pod on one socket and
/// attests callers by their cgroup; the fake agent tells Pods apart by the directory it
/// gives each, so the volume becomes the Pod's own directory.
fn agent_volume(volume: &Volume, agent: bool) -> Option<Result<(), String>> {
    if let Some(host) = &volume.host_path {
        return Some(if agent && host.path == AGENT_HOST_DIR {
            Ok(())
        } else {
            Err(format!(
                "hostPath type check failed: {} is not a directory",
                host.path
            ))
        });
    }
    let csi = volume.csi.as_ref()?;
    Some(if agent && csi.driver == "csi.spiffe.io" {
        Ok(())
    } else {
        Err(format!(
            "kubernetes.io/csi: mounter.SetUpAt failed to get CSI client: driver name {} not found in the list of registered CSI drivers",
            csi.driver
        ))
    })
}

/// How often the kubelet re-examines its Pods besides watch events (a missing Secret may
/// appear; a real kubelet resyncs too).
const RESYNC: Duration = Duration::from_millis(200);

/// What the kubelet runs and where.
pub struct KubeletConfig {
    /// The Node's name.
    pub node_name: String,
    /// The Node's labels (matched against `nodeSelector`).
    pub node_labels: BTreeMap<String, String>,
    /// Image → the program its entrypoint is.
    pub images: BTreeMap<String, PathBuf>,
    /// Root of Pod directories (volumes, work directory, `container.log`).
    pub root: PathBuf,
    /// The SPIRE agent serving the SPIFFE CSI volume.
    pub spire: Option<Arc<FakeSpireAgent>>,
}

#[derive(Default)]
struct PodState {
    pid: Option<u32>,
    /// The process groups of its sidecar containers.
    sidecars: Vec<u32>,
    /// The reason to report when the process ends (`OOMKilled`, `Evicted`), when not its own.
    end: Option<(&'static str, String)>,
}

struct Shared {
    config: KubeletConfig,
    pods: Api<Pod>,
    secrets: kube::Client,
    /// Pod UID → what runs for it.
    running: Mutex<BTreeMap<String, PodState>>,
    /// Pods whose termination (signals, then the final delete) is under way.
    terminating: Mutex<std::collections::BTreeSet<String>>,
    unschedulable: Mutex<bool>,
    node_lost: Mutex<bool>,
}

/// The running kubelet; dropping it stops it and kills what it started.
pub struct FakeKubelet {
    shared: Arc<Shared>,
    node_uid: String,
    task: JoinHandle<()>,
}

impl Drop for FakeKubelet {
    fn drop(&mut self) {
        self.task.abort();
        let running = self
            .shared
            .running
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        for state in running.values() {
            state.kill_all();
        }
    }
}

/// SIGKILLs the process group `pid` leads (a Pod's or VM's whole process tree).
pub(crate) fn kill_group(pid: u32) {
    signal_group(pid, rustix::process::Signal::KILL);
}

fn group_pid(pid: u32) -> Option<rustix::process::Pid> {
    i32::try_from(pid)
        .ok()
        .filter(|p| *p > 1)
        .and_then(rustix::process::Pid::from_raw)
}

/// Sends `signal` to the process group `pid` leads.
fn signal_group(pid: u32, signal: rustix::process::Signal) {
    if let Some(pid) = group_pid(pid) {
        let _ = rustix::process::kill_process_group(pid, signal);
    }
}

/// SIGTERM to the process `pid` alone.
fn terminate_process(pid: u32) {
    if let Some(pid) = group_pid(pid) {
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
    }
}

/// Whether the process `pid` still runs: a zombie has ended (a sidecar's handle was let
/// go, so nothing here reaps it at once).
fn process_alive(pid: u32) -> bool {
    let state = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok();
    // The state follows the parenthesised command name, which may itself hold spaces.
    let state = state
        .as_deref()
        .and_then(|s| s.rsplit_once(')'))
        .and_then(|(_, rest)| rest.split_whitespace().next());
    matches!(state, Some(s) if s != "Z" && s != "X")
}

impl PodState {
    /// Kills the Pod's first container and its sidecars.
    fn kill_all(&self) {
        for pid in self.pid.iter().chain(&self.sidecars) {
            kill_group(*pid);
        }
    }
}

/// The init containers that run beside the first container (`restartPolicy: Always`).
fn sidecars(pod: &Pod) -> Vec<Container> {
    pod.spec
        .iter()
        .flat_map(|s| s.init_containers.iter().flatten())
        .filter(|c| c.restart_policy.as_deref() == Some("Always"))
        .cloned()
        .collect()
}

/// Why a container cannot start yet.
struct Waiting(&'static str, String);

impl FakeKubelet {
    /// Registers `name` as a Node with `labels` (added to an existing Node of that name)
    /// and returns its UID, so that a SPIRE agent ID can be derived before the kubelet
    /// starts on it.
    pub async fn register_node(
        client: kube::Client,
        name: &str,
        labels: &BTreeMap<String, String>,
    ) -> Result<String, kube::Error> {
        let nodes: Api<Node> = Api::all(client);
        let node: Node = serde_json::from_value(
            json!({ "metadata": { "name": name, "labels": labels }, "spec": {} }),
        )
        .map_err(kube::Error::SerdeError)?;
        let node = match nodes.create(&PostParams::default(), &node).await {
            Ok(n) => n,
            Err(kube::Error::Api(s)) if s.code == 409 => {
                let labels = json!({ "metadata": { "labels": labels } });
                nodes
                    .patch(name, &PatchParams::default(), &Patch::Merge(&labels))
                    .await?
            }
            Err(e) => return Err(e),
        };
        Ok(node.uid().unwrap_or_default())
    }

    /// Registers the Node (or reuses it) and starts following Pods.
    pub async fn start(client: kube::Client, config: KubeletConfig) -> Result<Self, kube::Error> {
        let nodes: Api<Node> = Api::all(client.clone());
        let node: Node = serde_json::from_value(json!({
            "metadata": { "name": config.node_name, "labels": config.node_labels },
            "spec": {},
        }))
        .map_err(kube::Error::SerdeError)?;
        // A Node registered before (e.g. to learn its UID for the agent ID) is reused.
        let node = match nodes.create(&PostParams::default(), &node).await {
            Ok(n) => n,
            Err(kube::Error::Api(s)) if s.code == 409 => nodes.get(&config.node_name).await?,
            Err(e) => return Err(e),
        };
        let node_uid = node.uid().unwrap_or_default();
        let shared = Arc::new(Shared {
            pods: Api::all(client.clone()),
            secrets: client,
            config,
            running: Mutex::new(BTreeMap::new()),
            terminating: Mutex::default(),
            unschedulable: Mutex::new(false),
            node_lost: Mutex::new(false),
        });
        let task = tokio::spawn(run(Arc::clone(&shared)));
        Ok(FakeKubelet {
            shared,
            node_uid,
            task,
        })
    }

    /// The Node's UID (the last segment of its SPIRE agent ID).
    pub fn node_uid(&self) -> &str {
        &self.node_uid
    }

    /// The Node's name.
    pub fn node_name(&self) -> &str {
        &self.shared.config.node_name
    }

    /// Makes the scheduler refuse new Pods (`Unschedulable`), or accept them again.
    pub fn set_unschedulable(&self, yes: bool) {
        *self
            .shared
            .unschedulable
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = yes;
    }

    /// The pid of the process running for Pod `uid`.
    pub fn pid(&self, uid: &str) -> Option<u32> {
        self.shared
            .running
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(uid)
            .and_then(|s| s.pid)
    }

    /// Kills Pod `uid`'s process as the kernel's OOM killer would (`OOMKilled`, 137).
    pub fn oom_kill(&self, uid: &str) {
        self.end_with(uid, "OOMKilled", String::new());
    }

    /// Evicts Pod `uid` (`Failed`, reason `Evicted`, with `message`).
    pub fn evict(&self, uid: &str, message: &str) {
        self.end_with(uid, "Evicted", message.to_owned());
    }

    fn end_with(&self, uid: &str, reason: &'static str, message: String) {
        let mut running = self
            .shared
            .running
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(state) = running.get_mut(uid) {
            state.end = Some((reason, message));
            state.kill_all();
        }
    }

    /// The node stops reporting: the kubelet's Pods become `Unknown` (as the node
    /// controller marks them) and nothing is reported any more.
    pub async fn lose_node(&self) {
        *self
            .shared
            .node_lost
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = true;
        if let Ok(pods) = self.shared.pods.list(&Default::default()).await {
            for pod in pods.items.iter().filter(|p| self.shared.ours(p)) {
                let _ = self.shared.status(pod, json!({ "phase": "Unknown", "reason": "NodeLost", "message": format!("Node {} which was running pod {} is unresponsive", self.node_name(), pod.name_any()) })).await;
            }
        }
    }
}

async fn run(shared: Arc<Shared>) {
    let (reader, writer) = kube::runtime::reflector::store::<Pod>();
    let stream = kube::runtime::reflector(
        writer,
        watcher(shared.pods.clone(), watcher::Config::default()),
    )
    .default_backoff()
    .boxed();
    let mut stream = stream;
    let mut tick = tokio::time::interval(RESYNC);
    loop {
        tokio::select! {
            event = stream.next() => if event.is_none() { return },
            _ = tick.tick() => {}
        }
        if *shared.node_lost.lock().unwrap_or_else(|p| p.into_inner()) {
            continue;
        }
        let pods: Vec<Arc<Pod>> = reader.state();
        let live: Vec<String> = pods.iter().filter_map(|p| p.uid()).collect();
        // Pods deleted from the API: stop their processes.
        let gone: Vec<String> = shared
            .running
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .keys()
            .filter(|uid| !live.contains(uid))
            .cloned()
            .collect();
        for uid in gone {
            let state = shared
                .running
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&uid);
            if let Some(state) = state {
                state.kill_all();
            }
            if let Some(spire) = &shared.config.spire {
                spire.forget(&uid);
            }
        }
        for pod in pods {
            if let Err(e) = shared.sync(&pod).await {
                tracing::debug!(pod = %pod.name_any(), error = %e, "fake kubelet sync failed; retrying");
            }
        }
    }
}

fn container_status(image: &str, state: Value) -> Value {
    json!([{ "name": "executor", "image": image, "imageID": "", "ready": false, "restartCount": 0, "state": state }])
}

impl Shared {
    fn ours(&self, pod: &Pod) -> bool {
        pod.spec.as_ref().and_then(|s| s.node_name.as_deref())
            == Some(self.config.node_name.as_str())
    }

    async fn status(&self, pod: &Pod, status: Value) -> Result<(), kube::Error> {
        let api: Api<Pod> =
            Api::namespaced(self.secrets.clone(), &pod.namespace().unwrap_or_default());
        api.patch_status(
            &pod.name_any(),
            &PatchParams::default(),
            &Patch::Merge(json!({ "status": status })),
        )
        .await
        .map(|_| ())
    }

    /// A Pod of this node being deleted, as the kubelet terminates one: its first container
    /// gets SIGTERM, and SIGKILL if it still runs when the Pod's deletion grace period
    /// (`deletionGracePeriodSeconds`) ends; its sidecars get SIGTERM once it has ended,
    /// SIGKILL at the same deadline; then the Pod is deleted with no grace left (the API
    /// server keeps it while it has finalizers). Off the watch loop, once per Pod; a failed
    /// delete is tried again at the next sync.
    fn terminate(self: &Arc<Self>, pod: &Pod, uid: &str) {
        let first = self
            .terminating
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(uid.to_owned());
        if !first {
            return;
        }
        let grace = pod
            .metadata
            .deletion_grace_period_seconds
            .and_then(|s| u64::try_from(s).ok())
            .map_or(Duration::ZERO, Duration::from_secs);
        let (shared, pod, uid) = (Arc::clone(self), pod.clone(), uid.to_owned());
        tokio::spawn(async move {
            shared.stop_containers(&uid, grace).await;
            if let Err(e) = shared.remove(&pod, &uid).await {
                tracing::debug!(pod = %pod.name_any(), error = %e, "fake kubelet could not delete a terminated Pod; retrying");
            }
            shared
                .terminating
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&uid);
        });
    }

    /// SIGTERM to the first container's main process (a container runtime signals its
    /// PID 1 only), then to the sidecars' once it has ended; SIGKILL to whatever of their
    /// process groups still runs after `grace`.
    async fn stop_containers(&self, uid: &str, grace: Duration) {
        let deadline = tokio::time::Instant::now() + grace;
        let state = |f: &dyn Fn(&PodState) -> Vec<u32>| {
            self.running
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(uid)
                .map(f)
                .unwrap_or_default()
        };
        let first = state(&|s| s.pid.into_iter().collect());
        let sidecars = state(&|s| s.sidecars.clone());
        for pid in &first {
            terminate_process(*pid);
        }
        // The wait task clears `pid` when the first container exits.
        let ended = || state(&|s| s.pid.into_iter().collect()).is_empty();
        while !ended() && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        for pid in &sidecars {
            terminate_process(*pid);
        }
        let alive = |pid: &u32| process_alive(*pid);
        while sidecars.iter().any(alive) && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        for pid in first.iter().chain(&sidecars) {
            kill_group(*pid);
        }
    }

    /// Deletes the terminated Pod with no grace left (only this Pod: the UID is a
    /// precondition).
    async fn remove(&self, pod: &Pod, uid: &str) -> Result<(), kube::Error> {
        let api: Api<Pod> =
            Api::namespaced(self.secrets.clone(), &pod.namespace().unwrap_or_default());
        let dp = DeleteParams {
            grace_period_seconds: Some(0),
            preconditions: Some(Preconditions {
                uid: Some(uid.to_owned()),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        match api.delete(&pod.name_any(), &dp).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => Ok(()),
            Err(e) => Err(e),
        }
    }

    async fn sync(self: &Arc<Self>, pod: &Pod) -> Result<(), kube::Error> {
        let Some(uid) = pod.uid() else { return Ok(()) };
        if pod.metadata.deletion_timestamp.is_some() {
            if self.ours(pod) {
                self.terminate(pod, &uid);
            }
            return Ok(());
        }
        let phase = pod
            .status
            .as_ref()
            .and_then(|s| s.phase.clone())
            .unwrap_or_default();
        if phase == "Running"
            && self.ours(pod)
            && self
                .running
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .contains_key(&uid)
        {
            self.refresh(pod, &uid).await;
        }
        if phase != "Pending" {
            return Ok(());
        }
        let spec = pod.spec.clone().unwrap_or_default();
        if spec.node_name.is_none() {
            return self.schedule(pod).await;
        }
        if !self.ours(pod)
            || self
                .running
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .contains_key(&uid)
        {
            return Ok(());
        }
        let Some(container) = spec.containers.first() else {
            return Ok(());
        };
        let image = container.image.clone().unwrap_or_default();
        let waiting = |reason: &str, message: String| {
            let mut status = json!({ "phase": "Pending", "containerStatuses": container_status(&image, json!({ "waiting": { "reason": reason, "message": message } })) });
            status["conditions"] = json!([{ "type": "PodScheduled", "status": "True" }]);
            status
        };
        let Some(program) = self.config.images.get(&image).cloned() else {
            let pulled = format!(
                "failed to pull and unpack image \"{image}\": failed to resolve reference \"{image}\": not found"
            );
            let already = pod
                .status
                .as_ref()
                .and_then(|s| s.container_statuses.as_ref())
                .is_some();
            let status = if already {
                waiting(
                    "ImagePullBackOff",
                    format!("Back-off pulling image \"{image}\": ErrImagePull: {pulled}"),
                )
            } else {
                waiting("ErrImagePull", pulled)
            };
            return self.status(pod, status).await;
        };
        let mut started = Vec::new();
        let prepared = async {
            let main = self.prepare(pod, &uid, container).await?;
            for sidecar in sidecars(pod) {
                let image = sidecar.image.clone().unwrap_or_default();
                let program = self.config.images.get(&image).cloned().ok_or_else(|| {
                    Waiting(
                        "ErrImagePull",
                        format!("failed to pull and unpack image \"{image}\": not found"),
                    )
                })?;
                let (env, mounts) = self.prepare(pod, &uid, &sidecar).await?;
                started.push(self.start_sidecar(&uid, &sidecar, &program, env, &mounts)?);
            }
            Ok(main)
        };
        match prepared.await {
            Ok((env, mounts)) => {
                let program = Program {
                    image: &image,
                    path: &program,
                    sidecars: started,
                };
                self.launch(pod, &uid, program, env, &mounts).await
            }
            Err(Waiting(reason, message)) => {
                for pid in started {
                    kill_group(pid);
                }
                self.status(pod, waiting(reason, message)).await
            }
        }
    }

    /// Starts a sidecar container's process (logging to `<name>.log`); its process group.
    fn start_sidecar(
        &self,
        uid: &str,
        container: &Container,
        program: &Path,
        env: Vec<(String, String)>,
        mounts: &[(String, PathBuf)],
    ) -> Result<u32, Waiting> {
        let pod_dir = self.config.root.join(&uid[..uid.len().min(8)]);
        let log_path = pod_dir.join(format!("{}.log", container.name));
        let mut command = container_command(container, program, env, mounts, &pod_dir, &log_path);
        let child = command
            .spawn()
            .map_err(|e| Waiting("StartError", format!("{}: {e}", container.name)))?;
        child
            .id()
            .ok_or_else(|| Waiting("StartError", format!("{}: exited at once", container.name)))
    }

    async fn schedule(&self, pod: &Pod) -> Result<(), kube::Error> {
        let selector = pod
            .spec
            .as_ref()
            .and_then(|s| s.node_selector.clone())
            .unwrap_or_default();
        let fits = selector
            .iter()
            .all(|(k, v)| self.config.node_labels.get(k) == Some(v));
        let refused = *self.unschedulable.lock().unwrap_or_else(|p| p.into_inner());
        if !fits || refused {
            let why = if refused {
                "1 node(s) were unschedulable"
            } else {
                "1 node(s) didn't match Pod's node affinity/selector"
            };
            let message = format!(
                "0/1 nodes are available: {why}. preemption: 0/1 nodes are available: 1 Preemption is not helpful for scheduling."
            );
            let already = pod
                .status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|c| {
                    c.iter()
                        .any(|c| c.message.as_deref() == Some(message.as_str()))
                });
            if already {
                return Ok(());
            }
            return self.status(pod, json!({ "phase": "Pending", "conditions": [{ "type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message, "lastTransitionTime": now_rfc3339() }] })).await;
        }
        let api: Api<Pod> =
            Api::namespaced(self.secrets.clone(), &pod.namespace().unwrap_or_default());
        let binding = json!({ "apiVersion": "v1", "kind": "Binding", "metadata": { "name": pod.name_any() }, "target": { "apiVersion": "v1", "kind": "Node", "name": self.config.node_name } });
        let body = serde_json::to_vec(&binding).map_err(kube::Error::SerdeError)?;
        let url = format!(
            "/api/v1/namespaces/{}/pods/{}/binding",
            pod.namespace().unwrap_or_default(),
            pod.name_any()
        );
        let request = http::Request::post(url)
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(body)
            .map_err(kube::Error::HttpError)?;
        let _ = api;
        match self.secrets.request::<Value>(request).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
            Err(e) => Err(e),
        }
    }

    async fn secret(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<BTreeMap<String, Vec<u8>>, Waiting> {
        let api: Api<Secret> = Api::namespaced(self.secrets.clone(), namespace);
        match api.get_opt(name).await {
            Ok(Some(s)) => Ok(s
                .data
                .unwrap_or_default()
                .into_iter()
                .map(|(k, v)| (k, v.0))
                .collect()),
            Ok(None) => Err(Waiting(
                "CreateContainerConfigError",
                format!("secret \"{name}\" not found"),
            )),
            Err(e) => Err(Waiting(
                "CreateContainerConfigError",
                format!("reading secret \"{name}\": {e}"),
            )),
        }
    }

    /// Writes a projected volume's files into `dir`: Secret sources (a missing optional
    /// one is left out, as the kubelet does, and written once it exists) and downward API
    /// items (`metadata.labels['…']`, `metadata.annotations['…']`, `metadata.name|uid`;
    /// a missing key is an empty file). Each file is replaced whole (the kubelet swaps a
    /// symlink), so a reader never sees half of one.
    async fn project(
        &self,
        pod: &Pod,
        projected: &ProjectedVolumeSource,
        dir: &Path,
    ) -> Result<(), Waiting> {
        let ns = pod.namespace().unwrap_or_default();
        let io = |e: std::io::Error| Waiting("CreateContainerError", e.to_string());
        std::fs::create_dir_all(dir).map_err(io)?;
        let write = |name: &str, value: &[u8]| -> Result<(), Waiting> {
            let tmp = dir.join(format!("..{name}.tmp"));
            std::fs::write(&tmp, value).map_err(io)?;
            std::fs::rename(&tmp, dir.join(name)).map_err(io)
        };
        for source in projected.sources.iter().flatten() {
            if let Some(secret) = &source.secret {
                let data = match self.secret(&ns, &secret.name).await {
                    Ok(data) => data,
                    Err(_) if secret.optional == Some(true) => continue,
                    Err(e) => return Err(e),
                };
                match &secret.items {
                    Some(items) => {
                        for item in items {
                            if let Some(value) = data.get(&item.key) {
                                write(&item.path, value)?;
                            }
                        }
                    }
                    None => {
                        for (key, value) in &data {
                            write(key, value)?;
                        }
                    }
                }
            }
            if let Some(downward) = &source.downward_api {
                for item in downward.items.iter().flatten() {
                    let Some(field) = &item.field_ref else {
                        continue;
                    };
                    write(&item.path, field_value(pod, &field.field_path).as_bytes())?;
                }
            }
        }
        Ok(())
    }

    /// Refreshes the projected volumes of a running Pod of this node, as the kubelet does
    /// when the Pod (its labels, annotations) or a Secret it projects changes.
    async fn refresh(&self, pod: &Pod, uid: &str) {
        let pod_dir = self.config.root.join(&uid[..uid.len().min(8)]);
        for volume in pod.spec.iter().flat_map(|s| s.volumes.iter().flatten()) {
            if let Some(projected) = &volume.projected {
                let dir = pod_dir.join("volumes").join(&volume.name);
                if let Err(Waiting(_, e)) = self.project(pod, projected, &dir).await {
                    tracing::debug!(pod = %pod.name_any(), error = %e, "fake kubelet could not refresh a projected volume");
                }
            }
        }
    }

    /// Resolves the environment and maps the volumes to directories.
    async fn prepare(
        &self,
        pod: &Pod,
        uid: &str,
        container: &Container,
    ) -> Result<(Vec<(String, String)>, Vec<(String, PathBuf)>), Waiting> {
        let ns = pod.namespace().unwrap_or_default();
        let spec = pod.spec.clone().unwrap_or_default();
        let pod_dir = self.config.root.join(&uid[..uid.len().min(8)]);
        let io = |e: std::io::Error| Waiting("CreateContainerError", e.to_string());
        std::fs::create_dir_all(pod_dir.join("work")).map_err(io)?;
        let mut dirs: BTreeMap<String, PathBuf> = BTreeMap::new();
        for volume in spec.volumes.iter().flatten() {
            let dir = pod_dir.join("volumes").join(&volume.name);
            let write_secret =
                |data: &BTreeMap<String, Vec<u8>>, dir: &Path| -> Result<(), Waiting> {
                    std::fs::create_dir_all(dir).map_err(io)?;
                    for (k, v) in data {
                        std::fs::write(dir.join(k), v).map_err(io)?;
                    }
                    Ok(())
                };
            if let Some(mount) = agent_volume(volume, self.config.spire.is_some()) {
                let spire = match (mount, &self.config.spire) {
                    (Ok(()), Some(spire)) => spire,
                    (result, _) => {
                        return Err(Waiting(
                            "ContainerCreating",
                            format!(
                                "MountVolume.SetUp failed for volume \"{}\" : {}",
                                volume.name,
                                result.err().unwrap_or_default()
                            ),
                        ));
                    }
                };
                let d = spire
                    .socket_dir(uid)
                    .await
                    .map_err(|e| Waiting("ContainerCreating", e.to_string()))?;
                dirs.insert(volume.name.clone(), d);
                continue;
            }
            if let Some(secret) = &volume.secret {
                let data = self
                    .secret(&ns, secret.secret_name.as_deref().unwrap_or_default())
                    .await?;
                write_secret(&data, &dir)?;
            } else if let Some(projected) = &volume.projected {
                self.project(pod, projected, &dir).await?;
            } else {
                std::fs::create_dir_all(&dir).map_err(io)?;
            }
            dirs.insert(volume.name.clone(), dir);
        }
        let mut mounts: Vec<(String, PathBuf)> = container
            .volume_mounts
            .iter()
            .flatten()
            .filter_map(|m| dirs.get(&m.name).map(|d| (m.mount_path.clone(), d.clone())))
            .collect();
        // Longest first, so `/a/b` is rewritten before `/a`.
        mounts.sort_by_key(|(path, _)| std::cmp::Reverse(path.len()));
        let mut env = Vec::new();
        for var in container.env.iter().flatten() {
            let value = match (&var.value, &var.value_from) {
                (Some(v), _) => v.clone(),
                (None, Some(from)) => {
                    if let Some(r) = &from.secret_key_ref {
                        let data = self.secret(&ns, &r.name).await?;
                        let v = data.get(&r.key).ok_or_else(|| {
                            Waiting(
                                "CreateContainerConfigError",
                                format!("couldn't find key {} in Secret {ns}/{}", r.key, r.name),
                            )
                        })?;
                        String::from_utf8_lossy(v).into_owned()
                    } else if let Some(f) = &from.field_ref {
                        match f.field_path.as_str() {
                            "metadata.name" => pod.name_any(),
                            "metadata.namespace" => ns.clone(),
                            "metadata.uid" => uid.to_owned(),
                            "spec.nodeName" => self.config.node_name.clone(),
                            _ => String::new(),
                        }
                    } else {
                        String::new()
                    }
                }
                (None, None) => String::new(),
            };
            env.push((var.name.clone(), rewrite(&value, &mounts)));
        }
        Ok((env, mounts))
    }

    async fn launch(
        self: &Arc<Self>,
        pod: &Pod,
        uid: &str,
        program: Program<'_>,
        env: Vec<(String, String)>,
        mounts: &[(String, PathBuf)],
    ) -> Result<(), kube::Error> {
        let container = pod
            .spec
            .as_ref()
            .and_then(|s| s.containers.first().cloned())
            .unwrap_or_default();
        let image = program.image;
        let sidecars = program.sidecars;
        let pod_dir = self.config.root.join(&uid[..uid.len().min(8)]);
        let log_path = pod_dir.join("container.log");
        let fallback_to_logs =
            container.termination_message_policy.as_deref() == Some("FallbackToLogsOnError");
        let mut command =
            container_command(&container, program.path, env, mounts, &pod_dir, &log_path);
        let mut child = match command.spawn() {
            Ok(c) => c,
            Err(e) => {
                for pid in sidecars {
                    kill_group(pid);
                }
                let status = json!({ "phase": "Failed", "containerStatuses": container_status(image, json!({ "terminated": { "exitCode": 128, "reason": "StartError", "message": e.to_string() } })) });
                return self.status(pod, status).await;
            }
        };
        let pid = child.id();
        self.running
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(
                uid.to_owned(),
                PodState {
                    pid,
                    sidecars,
                    end: None,
                },
            );
        let now = now_rfc3339();
        self.status(pod, json!({
            "phase": "Running",
            "startTime": now,
            "conditions": [{ "type": "PodScheduled", "status": "True" }, { "type": "Ready", "status": "True" }],
            "containerStatuses": [{ "name": "executor", "image": image, "imageID": "", "ready": true, "started": true, "restartCount": 0, "state": { "running": { "startedAt": now } } }],
        }))
        .await?;
        let shared = Arc::clone(self);
        let pod = pod.clone();
        let uid = uid.to_owned();
        let image = image.to_owned();
        tokio::spawn(async move {
            let status = child.wait().await;
            let code = match status {
                Ok(s) => s.code().unwrap_or_else(|| {
                    128 + std::os::unix::process::ExitStatusExt::signal(&s).unwrap_or(9)
                }),
                Err(_) => 255,
            };
            let end = {
                let mut running = shared.running.lock().unwrap_or_else(|p| p.into_inner());
                match running.get_mut(&uid) {
                    Some(state) => {
                        // The first container ended: its sidecars are stopped.
                        for pid in std::mem::take(&mut state.sidecars) {
                            kill_group(pid);
                        }
                        state.pid = None;
                        state.end.take()
                    }
                    // Deleted: nothing is left to report on.
                    None => return,
                }
            };
            if *shared.node_lost.lock().unwrap_or_else(|p| p.into_inner()) {
                return;
            }
            let finished = now_rfc3339();
            let status = match end {
                Some(("Evicted", message)) => {
                    json!({ "phase": "Failed", "reason": "Evicted", "message": message })
                }
                Some((reason, _)) => {
                    json!({ "phase": "Failed", "containerStatuses": container_status(&image, json!({ "terminated": { "exitCode": 137, "reason": reason, "finishedAt": finished } })) })
                }
                None => {
                    let mut terminated = json!({ "exitCode": code, "reason": if code == 0 { "Completed" } else { "Error" }, "finishedAt": finished });
                    if code != 0 && fallback_to_logs {
                        terminated["message"] = json!(log_tail(&log_path));
                    }
                    json!({
                        "phase": if code == 0 { "Succeeded" } else { "Failed" },
                        "containerStatuses": container_status(&image, json!({ "terminated": terminated })),
                    })
                }
            };
            if let Err(e) = shared.status(&pod, status).await {
                tracing::debug!(pod = %pod.name_any(), error = %e, "fake kubelet could not report the end");
            }
        });
        Ok(())
    }
}

/// The first container's program and image, and its sidecars' process groups.
struct Program<'a> {
    image: &'a str,
    path: &'a Path,
    sidecars: Vec<u32>,
}

/// The process of `container`: `program` (its image's entrypoint) with the arguments
/// after `command[0]` and `args`, mount paths rewritten, in its own process group, its
/// output appended to `log_path`.
fn container_command(
    container: &Container,
    program: &Path,
    env: Vec<(String, String)>,
    mounts: &[(String, PathBuf)],
    pod_dir: &Path,
    log_path: &Path,
) -> tokio::process::Command {
    let mut args: Vec<String> = container
        .command
        .clone()
        .unwrap_or_default()
        .into_iter()
        .skip(1)
        .collect();
    args.extend(container.args.clone().unwrap_or_default());
    let args: Vec<String> = args.iter().map(|a| rewrite(a, mounts)).collect();
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log_path);
    let mut command = tokio::process::Command::new(program);
    command
        .args(&args)
        .env_clear()
        .current_dir(pod_dir.join("work"))
        .stdin(Stdio::null())
        .process_group(0)
        .kill_on_drop(false);
    if let Ok(log) = log {
        if let Ok(copy) = log.try_clone() {
            command.stdout(Stdio::from(copy));
        }
        command.stderr(Stdio::from(log));
    }
    for name in ["PATH", "HOME", "TMPDIR"] {
        if let Some(v) = std::env::var_os(name) {
            command.env(name, v);
        }
    }
    command.envs(env);
    command
}

/// The termination message `FallbackToLogsOnError` gives a container that failed without
/// writing one: the end of its log, at most 80 lines and 2048 bytes, as the kubelet does.
fn log_tail(path: &Path) -> String {
    const MAX_BYTES: usize = 2048;
    const MAX_LINES: usize = 80;
    let log = std::fs::read(path).unwrap_or_default();
    let tail = &log[log.len().saturating_sub(MAX_BYTES)..];
    let text = String::from_utf8_lossy(tail);
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(MAX_LINES)..].join("\n")
}

/// Replaces every mount path in `value` (at a path boundary) with its directory.
fn rewrite(value: &str, mounts: &[(String, PathBuf)]) -> String {
    let mut out = value.to_owned();
    for (path, dir) in mounts {
        let path = path.trim_end_matches('/');
        let mut result = String::new();
        let mut rest = out.as_str();
        while let Some(i) = rest.find(path) {
            let after = &rest[i + path.len()..];
            result.push_str(&rest[..i]);
            if after.is_empty() || after.starts_with('/') {
                result.push_str(&dir.display().to_string());
            } else {
                result.push_str(path);
            }
            rest = after;
        }
        result.push_str(rest);
        out = result;
    }
    out
}

/// Decodes a Secret's base64 `data` value (for tests reading the fake store directly).
pub fn secret_value(secret: &Value, key: &str) -> Option<String> {
    let encoded = secret["data"][key].as_str()?;
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(encoded)
        .ok()?;
    String::from_utf8(bytes).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mount_paths_are_rewritten_only_at_path_boundaries() {
        let mounts = vec![(
            "/run/spire/agent-sockets".to_owned(),
            PathBuf::from("/tmp/x"),
        )];
        assert_eq!(
            rewrite("unix:///run/spire/agent-sockets/spire-agent.sock", &mounts),
            "unix:///tmp/x/spire-agent.sock"
        );
        assert_eq!(
            rewrite("/run/spire/agent-socketsX", &mounts),
            "/run/spire/agent-socketsX"
        );
    }
}
