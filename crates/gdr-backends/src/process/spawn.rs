//! Creating an executor: its directory and identity first, then `metadata.json`, then the
//! child process (so that a redelivery after a crash finds the directory and never starts
//! a second one), then its pid.

use std::io;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::SystemTime;

use gdr_core::executor::{ExecutorError, ExecutorRecord, ExecutorSpec, env};
use rustix::process::Signal;

use super::identity::{Provisioned, hand_over};
use super::reaper::{proc_stat, signal_group, signal_target};
use super::store::{Durability, METADATA_VERSION, Metadata, process_target};
use super::{Inner, LOG_FILE, ProcessError, WORK_DIR, WORKDIR_ENV, unavailable};

/// Controller environment passed through to executors. Everything else is cleared so
/// that nothing of the controller's configuration leaks into a job by accident.
const INHERITED_ENV: &[&str] = &["PATH", "HOME", "USER", "LANG", "LC_ALL", "TMPDIR", "TZ"];
/// `CI_EXECUTOR_SANDBOXED` makes an executor started as root prepare its environment as
/// root (device nodes, mounts, cgroups): only ever inside a Pod or VM, never on this host.
const ROOT_START_ENV: &str = "CI_EXECUTOR_SANDBOXED";

impl Inner {
    /// Creates the directory, serves the identity, records metadata, then spawns.
    pub(super) async fn spawn_executor(
        self: &Arc<Self>,
        spec: &ExecutorSpec,
    ) -> Result<ExecutorRecord, ExecutorError> {
        let id = spec.assignment.id();
        let name = id.as_str().to_owned();
        let dir = self.dir(&name);
        let provisioned = self.prepare(spec, &name, &dir).await?;
        let mut meta = Metadata {
            version: METADATA_VERSION,
            labels: spec.metadata.labels.clone(),
            annotations: spec.metadata.annotations.clone(),
            claimed: false,
            terminal: false,
            identity_bound: false,
            created_at: SystemTime::now(),
            pid: None,
            pid_start_time: None,
            exit_code: None,
        };
        // Marked as spawning first: from the metadata write on, a look-up must not take the
        // record for one an earlier controller never started.
        self.live().spawning.insert(name.clone());
        // Recorded before the spawn: a redelivery after a crash finds the directory and
        // never starts a second executor.
        if let Err(e) = self.write(&name, &meta, Durability::CrashConsistent).await {
            self.live().spawning.remove(&name);
            return Err(e);
        }
        let (child, pid, log_path) = self
            .start(spec, &name, &dir, &provisioned, &mut meta)
            .await?;
        self.watch_child(&name, id, pid, meta.pid_start_time, child);
        tracing::info!(assignment_id = %id, executor = %name, pid, log = %log_path.display(), "executor started");
        let phase = self.phase(&name, &meta);
        Ok(ExecutorRecord {
            name,
            assignment: spec.assignment.clone(),
            phase,
            claimed: false,
            terminal: false,
            identity_bound: false,
            identity_target: process_target(&meta),
            created_at: meta.created_at,
        })
    }

    /// Creates the executor's directory and `work/` and serves its identity (the child
    /// needs its Workload API socket from its first instant), handing `work/` over to the
    /// user it runs as.
    async fn prepare(
        &self,
        spec: &ExecutorSpec,
        name: &str,
        dir: &Path,
    ) -> Result<Provisioned, ExecutorError> {
        for d in [dir.to_path_buf(), dir.join(WORK_DIR)] {
            match std::fs::DirBuilder::new().mode(0o700).create(&d) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(unavailable("create the executor directory", &d, e)),
            }
        }
        let spiffe_id = spec.assignment.identity().spiffe_id();
        let provisioned = self.identity.provision(dir, spiffe_id).await?;
        self.live().provisioned.insert(name.to_owned());
        if let Some(run_as) = provisioned.run_as
            && let Err(e) = hand_over(dir, run_as)
        {
            self.discard(name).await;
            return Err(unavailable("hand the work directory over in", dir, e));
        }
        Ok(provisioned)
    }

    /// Spawns the child and records its pid in `meta`; on failure nothing it started is
    /// left running and the creation is undone.
    async fn start(
        &self,
        spec: &ExecutorSpec,
        name: &str,
        dir: &Path,
        provisioned: &Provisioned,
        meta: &mut Metadata,
    ) -> Result<(tokio::process::Child, u32, PathBuf), ExecutorError> {
        let (mut child, log_path) = match self.spawn_child(spec, dir, provisioned) {
            Ok(c) => c,
            Err(e) => {
                self.abandon(name).await;
                return Err(unavailable("start the executor program in", dir, e));
            }
        };
        let Some(pid) = child.id() else {
            self.abandon(name).await;
            return Err(ExecutorError::unavailable(ProcessError::ExitedAtStart {
                dir: dir.to_path_buf(),
            }));
        };
        meta.pid = Some(pid);
        meta.pid_start_time = proc_stat(pid).map(|s| s.start_time);
        if let Err(e) = self.write(name, meta, Durability::CrashConsistent).await {
            // Without a durable pid a later delete could not stop it; nothing may run
            // that the backend does not record.
            if let Some(pgid) = signal_target(pid) {
                signal_group(pgid, Signal::KILL);
            }
            let _ = child.wait().await;
            self.abandon(name).await;
            return Err(e);
        }
        Ok((child, pid, log_path))
    }

    fn spawn_child(
        &self,
        spec: &ExecutorSpec,
        dir: &Path,
        provisioned: &Provisioned,
    ) -> io::Result<(tokio::process::Child, PathBuf)> {
        let log_path = dir.join(LOG_FILE);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(&log_path)?;
        let work = dir.join(WORK_DIR);
        let mut command = tokio::process::Command::new(&self.settings.program);
        command
            .args(&self.settings.args)
            .env_clear()
            .current_dir(&work)
            .stdin(Stdio::null())
            .stdout(Stdio::from(log.try_clone()?))
            .stderr(Stdio::from(log))
            // Executors must survive a controller crash, and signals aimed at the
            // controller's terminal must not reach them.
            .kill_on_drop(false)
            .process_group(0);
        for name in INHERITED_ENV {
            if let Some(value) = std::env::var_os(name) {
                command.env(name, value);
            }
        }
        command
            .envs(&self.settings.extra_env)
            .envs(spec.environment())
            .env(env::SPIFFE_ENDPOINT_SOCKET, &provisioned.endpoint)
            .env(WORKDIR_ENV, &work)
            .env_remove(ROOT_START_ENV);
        if let Some(run_as) = provisioned.run_as {
            // The controller's home is not the executor's to write in; without a group list
            // the standard library drops the controller's supplementary groups.
            command.uid(run_as.uid).gid(run_as.gid).env("HOME", &work);
        }
        Ok((command.spawn()?, log_path))
    }

    /// Undoes a creation that stopped between its first metadata write and its pid write.
    async fn abandon(&self, name: &str) {
        self.live().spawning.remove(name);
        self.discard(name).await;
    }

    /// Undoes a creation that did not produce a running executor.
    pub(super) async fn discard(&self, name: &str) {
        let dir = self.dir(name);
        self.identity.revoke(&dir).await;
        self.live().provisioned.remove(name);
        if let Err(e) = tokio::fs::remove_dir_all(&dir).await
            && e.kind() != io::ErrorKind::NotFound
        {
            tracing::warn!(executor = name, error = %e, "cannot remove the executor directory {}", dir.display());
        }
    }
}
