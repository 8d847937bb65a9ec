//! A stand-in for the Kata VMs of one pool of the real OpenSandbox server's in-memory
//! cluster (`opensandbox/fake_k8s.py`): once the cluster reports a sandbox ready, its
//! entrypoint is started as a local process, the way the fake kubelet runs a Pod's command;
//! once the sandbox is deleted (or gone), the process group is killed, as a VM powered off.
//!
//! Inside a real VM the executor reaches the SPIRE agent of that VM at one fixed socket,
//! and the agent hands it the job's SVID only because `sandbox-identity` created an entry
//! for the VM's Pod. Local processes share one file system, so one fixed socket cannot give
//! each "VM" its own identity; that is why this hook is Rust, beside the fake Workload API,
//! and not part of the Python cluster: each VM gets its own Workload API, serving the
//! identity the real `sandbox-identity` code derives from the BatchSandbox
//! ([`EntryTemplate::spiffe_id`], the same re-validation the reconciler applies), and its
//! `SPIFFE_ENDPOINT_SOCKET` points there (the one variable rewritten, as the fake kubelet
//! rewrites mount paths). A sandbox `sandbox-identity` would refuse gets a Workload API
//! without identity: its executor never obtains an SVID.
//!
//! A warm sandbox (`vm_warm_pool`) boots like any, before any job: its metadata names no
//! job, so `sandbox-identity` refuses it and its Workload API serves no identity. Once a
//! job claimed it (its metadata patched with the job's), the next look derives the job's
//! identity as `sandbox-identity` would then, and its Workload API starts serving it.
//!
//! The pool must not `spawn` itself (that is the Python cluster's own, identity-less hook).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gdr_core::executor::env;
use gdr_identity::workload_api::{LocalCa, RunningWorkloadApi, WorkloadApi};
use gdr_sandbox_identity::EntryTemplate;
use serde_json::Value;
use tokio::task::JoinHandle;

use crate::fake_kubelet::kill_group;
use crate::opensandbox::{Control, SandboxInfo};

/// How often the host looks at the cluster (the Python cluster has no watch API).
const POLL: Duration = Duration::from_millis(100);
/// The bootstrap the server wraps every entrypoint in (`exec bootstrap.sh <entrypoint…>`);
/// execd is not here, so the entrypoint is run directly.
const BOOTSTRAP: &str = "exec /opt/opensandbox/bootstrap.sh ";

/// What a VM host needs.
pub struct VmHostConfig {
    /// The cluster side of the server.
    pub control: Control,
    /// The pool whose sandboxes this host runs.
    pub pool: String,
    /// The CA the VMs' Workload APIs issue SVIDs from (the facade must trust it).
    pub ca: LocalCa,
    /// How `sandbox-identity` derives and validates a sandbox's identity.
    pub identity: EntryTemplate,
    /// Where the VMs' directories (work directory, `log`) and sockets go; keep it short
    /// (Unix socket paths are limited to about 100 bytes).
    pub dir: PathBuf,
}

/// One VM the host started.
#[derive(Debug, Clone)]
pub struct Vm {
    /// The sandbox (BatchSandbox name, the sandbox ID of the Lifecycle API).
    pub sandbox: String,
    /// `CI_ASSIGNMENT_ID` of its environment, or for a warm sandbox the assignment of the
    /// job that claimed it (its metadata), once one did.
    pub assignment_id: Option<String>,
    /// `CI_EXECUTOR_STANDBY_ID` of its environment: a warm sandbox's.
    pub standby_id: Option<String>,
    /// The identity its Workload API serves; `Err` with `sandbox-identity`'s refusal.
    pub identity: Result<String, String>,
    /// The process, once started.
    pub pid: Option<u32>,
    /// Its exit code, once it exited (`-1` when killed by a signal).
    pub exit_code: Option<i32>,
    /// Its stdout and stderr.
    pub log: PathBuf,
}

struct Running {
    /// Serves the VM's identity until the VM is gone.
    workload: RunningWorkloadApi,
}

#[derive(Default)]
struct State {
    /// Every VM ever started, by sandbox.
    vms: BTreeMap<String, Vm>,
    /// Sandboxes in the order their VMs booted.
    booted: Vec<String>,
    /// Most VMs whose sandboxes existed at once.
    peak: usize,
    /// VMs whose sandbox still exists.
    running: BTreeMap<String, Running>,
}

struct Shared {
    config: VmHostConfig,
    state: Mutex<State>,
    /// Claimed warm sandboxes get no identity ([`VmHost::refuse_claimed`]).
    refuse_claimed: std::sync::atomic::AtomicBool,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The host; dropping it kills every VM it runs.
pub struct VmHost {
    shared: Arc<Shared>,
    task: JoinHandle<()>,
}

impl Drop for VmHost {
    fn drop(&mut self) {
        self.task.abort();
        let state = self.shared.lock();
        for name in state.running.keys() {
            if let Some(pid) = state.vms.get(name).and_then(|vm| vm.pid) {
                kill_group(pid);
            }
        }
    }
}

impl VmHost {
    /// Starts following the pool.
    pub fn start(config: VmHostConfig) -> Self {
        let shared = Arc::new(Shared {
            config,
            state: Mutex::new(State::default()),
            refuse_claimed: std::sync::atomic::AtomicBool::new(false),
        });
        let task = tokio::spawn(follow(Arc::clone(&shared)));
        VmHost { shared, task }
    }

    /// Every VM started so far, oldest first.
    pub fn vms(&self) -> Vec<Vm> {
        let state = self.shared.lock();
        state
            .booted
            .iter()
            .filter_map(|name| state.vms.get(name).cloned())
            .collect()
    }

    /// The VMs started for `assignment_id` (a job runs once: one VM).
    pub fn vms_of(&self, assignment_id: &str) -> Vec<Vm> {
        self.vms()
            .into_iter()
            .filter(|vm| vm.assignment_id.as_deref() == Some(assignment_id))
            .collect()
    }

    /// From now on a warm sandbox a job claims gets no identity, as when
    /// `sandbox-identity` refuses it (say, its Pool recycles released Pods): its executor
    /// never obtains the job's SVID. The VM still records the claiming assignment.
    pub fn refuse_claimed(&self) {
        self.shared
            .refuse_claimed
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// VMs whose sandbox still exists.
    pub fn running(&self) -> usize {
        self.shared.lock().running.len()
    }

    /// The most VMs whose sandboxes existed at once.
    pub fn peak(&self) -> usize {
        self.shared.lock().peak
    }
}

async fn follow(shared: Arc<Shared>) {
    loop {
        match shared.config.control.sandboxes(&shared.config.pool).await {
            Ok(sandboxes) => reconcile(&shared, &sandboxes).await,
            Err(e) => tracing::warn!(error = %e, "vm host: cannot list the pool's sandboxes"),
        }
        tokio::time::sleep(POLL).await;
    }
}

async fn reconcile(shared: &Arc<Shared>, sandboxes: &[SandboxInfo]) {
    let live: BTreeMap<&str, &Value> = sandboxes
        .iter()
        .map(|info| &info.batchsandbox)
        .filter(|object| object["metadata"]["deletionTimestamp"].is_null())
        .filter_map(|object| Some((object["metadata"]["name"].as_str()?, object)))
        .collect();
    // Deleted sandboxes first: their VMs are powered off before new ones count.
    {
        let mut state = shared.lock();
        let gone: Vec<String> = state
            .running
            .keys()
            .filter(|name| !live.contains_key(name.as_str()))
            .cloned()
            .collect();
        for name in gone {
            state.running.remove(&name);
            if let Some(vm) = state.vms.get(&name)
                && let Some(pid) = vm.pid
                && vm.exit_code.is_none()
            {
                kill_group(pid);
            }
        }
    }
    for (name, object) in live {
        let ready = object["status"]["phase"] == "Succeed";
        if ready && !shared.lock().vms.contains_key(name) {
            boot(shared, name, object).await;
        } else {
            claimed(shared, name, object);
        }
    }
}

/// A running VM refused an identity so far (a warm sandbox no job had claimed) gets the
/// one `sandbox-identity` derives now, if it derives one: the claiming job's.
fn claimed(shared: &Shared, name: &str, object: &Value) {
    let mut state = shared.lock();
    let waiting = state.vms.get(name).is_some_and(|vm| vm.identity.is_err());
    if !waiting || !state.running.contains_key(name) {
        return;
    }
    let Ok(identity) = shared.config.identity.spiffe_id(object) else {
        return;
    };
    let key = shared
        .config
        .identity
        .codec
        .key(gdr_core::metadata::keys::ASSIGNMENT_ID);
    let assignment = object["metadata"]["labels"][&key]
        .as_str()
        .map(str::to_owned);
    if shared
        .refuse_claimed
        .load(std::sync::atomic::Ordering::Relaxed)
    {
        if let Some(vm) = state.vms.get_mut(name) {
            vm.assignment_id = vm.assignment_id.take().or(assignment);
        }
        return;
    }
    if let Some(running) = state.running.get(name)
        && let Err(e) = running.workload.set_identity(&identity)
    {
        tracing::warn!(sandbox = name, error = %e, "vm host: cannot issue the claimed sandbox's SVID");
        return;
    }
    if let Some(vm) = state.vms.get_mut(name) {
        vm.identity = Ok(identity);
        vm.assignment_id = vm.assignment_id.take().or(assignment);
    }
}

/// `name=value` pairs of the task's environment.
fn task_env(object: &Value) -> BTreeMap<String, String> {
    object["spec"]["taskTemplate"]["spec"]["process"]["env"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|item| {
            Some((
                item["name"].as_str()?.to_owned(),
                item["value"].as_str().unwrap_or_default().to_owned(),
            ))
        })
        .collect()
}

/// The task's command with the bootstrap taken out (its quoting is left to `/bin/sh`, as
/// in the VM).
fn command(object: &Value) -> Vec<String> {
    let command: Vec<String> = object["spec"]["taskTemplate"]["spec"]["process"]["command"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c.as_str().map(str::to_owned))
        .collect();
    match command.as_slice() {
        [sh, c, script] if sh == "/bin/sh" && c == "-c" && script.starts_with(BOOTSTRAP) => {
            vec![
                sh.clone(),
                c.clone(),
                format!("exec {}", &script[BOOTSTRAP.len()..]),
            ]
        }
        _ => command,
    }
}

async fn boot(shared: &Arc<Shared>, name: &str, object: &Value) {
    let config = &shared.config;
    let identity = config
        .identity
        .spiffe_id(object)
        .map_err(|refusal| refusal.to_string());
    let mut env = task_env(object);
    let dir = config.dir.join(&name[name.len().saturating_sub(12)..]);
    let log = dir.join("log");
    let mut vm = Vm {
        sandbox: name.to_owned(),
        assignment_id: env.get(env::ASSIGNMENT_ID).cloned(),
        standby_id: env.get(env::STANDBY_ID).cloned(),
        identity: identity.clone(),
        pid: None,
        exit_code: None,
        log: log.clone(),
    };
    let started = async {
        std::fs::create_dir_all(&dir)?;
        // A refused sandbox's placeholder is of the CA's trust domain (it cannot issue
        // another's); it is cleared at once, and replaced should a claim name a job.
        let placeholder = format!("spiffe://{}/none", config.ca.trust_domain());
        let workload = WorkloadApi::start(
            &config.dir,
            config.ca.clone(),
            identity.as_deref().unwrap_or(&placeholder),
        )
        .await
        .map_err(std::io::Error::other)?;
        if identity.is_err() {
            workload.clear_identity();
        }
        env.insert(env::SPIFFE_ENDPOINT_SOCKET.into(), workload.endpoint());
        let out = std::fs::File::create(&log)?;
        let command = command(object);
        let (program, args) = command
            .split_first()
            .ok_or_else(|| std::io::Error::other("the sandbox has no command"))?;
        let mut process = tokio::process::Command::new(program);
        process
            .args(args)
            .env_clear()
            .envs(std::env::var_os("PATH").map(|p| ("PATH", p)))
            .env("HOME", &dir)
            .envs(&env)
            .current_dir(&dir)
            .stdin(Stdio::null())
            .stdout(Stdio::from(out.try_clone()?))
            .stderr(Stdio::from(out))
            .process_group(0)
            .kill_on_drop(false);
        let child = process.spawn()?;
        Ok::<_, std::io::Error>((workload, child))
    };
    match started.await {
        Ok((workload, mut child)) => {
            vm.pid = child.id();
            let mut state = shared.lock();
            state.vms.insert(name.to_owned(), vm);
            state.booted.push(name.to_owned());
            state.running.insert(name.to_owned(), Running { workload });
            state.peak = state.peak.max(state.running.len());
            drop(state);
            let shared = Arc::clone(shared);
            let name = name.to_owned();
            tokio::spawn(async move {
                let code = child.wait().await.ok().map(|s| s.code().unwrap_or(-1));
                if let Some(vm) = shared.lock().vms.get_mut(&name) {
                    vm.exit_code = Some(code.unwrap_or(-1));
                }
            });
        }
        Err(e) => {
            let _ = std::fs::write(&log, format!("cannot boot the VM: {e}\n"));
            vm.exit_code = Some(127);
            let mut state = shared.lock();
            state.vms.insert(name.to_owned(), vm);
            state.booted.push(name.to_owned());
        }
    }
}
