//! Issue 14, "one command on a host": `gitea-dynamic-runner controller --gitea-url URL
//! --registration-token-file FILE` is the whole set-up on a fresh machine. The test gives
//! the real binary nothing else but what a machine provides: a state directory (systemd's
//! `STATE_DIRECTORY`), a `PATH` holding the runner and nats-server, and two loopback
//! listeners (socket activation, as systemd would hand them over).

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use gdr_testkit::controller::{listener, spawn_activated, terminate};
use gdr_testkit::mock_gitea::{JobId, MockConfig, MockGitea, RpcMethod, RunningMock, Status};
use gdr_testkit::nats_server::NatsServer;

/// A job on the stand-in runner ends within seconds; the deadline only bounds a hang.
const WAIT: Duration = Duration::from_secs(90);
const BIN: &str = env!("CARGO_BIN_EXE_gitea-dynamic-runner");
const STANDIN: &str = env!("CARGO_BIN_EXE_gitea-runner-standin");
const REGISTRATION_TOKEN: &str = "quick-start-registration-token";

/// What the first start writes under `state_dir`, each mode 0600.
const WRITTEN: [&str; 4] = [
    "runner-uuid",
    "runner-token",
    "capability-key",
    "task-encryption.key",
];

struct Host {
    dir: tempfile::TempDir,
    mock: RunningMock,
    facade: std::net::TcpListener,
    health: std::net::TcpListener,
}

impl Drop for Host {
    fn drop(&mut self) {
        // What its controllers left (executors in process groups of their own) ends with
        // the test.
        gdr_testkit::leftovers::end_processes_under(self.dir.path());
    }
}

impl Host {
    /// A fresh machine: the official runner (the stand-in, named as the real one is) and
    /// nats-server on `PATH`, a registration token in a file, an empty state directory.
    async fn new(runner_name: &str) -> Self {
        let mock =
            MockGitea::start(MockConfig::default().with_registration_token(REGISTRATION_TOKEN))
                .await
                .expect("mock Gitea");
        let dir = tempfile::tempdir().unwrap();
        let bin = dir.path().join("bin");
        std::fs::create_dir(&bin).unwrap();
        std::os::unix::fs::symlink(STANDIN, bin.join(runner_name)).unwrap();
        std::os::unix::fs::symlink(NatsServer::binary(), bin.join("nats-server")).unwrap();
        std::fs::write(dir.path().join("registration-token"), REGISTRATION_TOKEN).unwrap();
        std::fs::set_permissions(
            dir.path().join("registration-token"),
            std::fs::Permissions::from_mode(0o600),
        )
        .unwrap();
        Host {
            dir,
            mock,
            facade: listener(),
            health: listener(),
        }
    }

    fn state(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("controller.log")).unwrap_or_default()
    }

    /// The one command, with `path` as `PATH`.
    fn start_with_path(&self, path: &str) -> tokio::process::Child {
        let token = self.dir.path().join("registration-token");
        let url = self.mock.url.to_string();
        let state = self.state().display().to_string();
        spawn_activated(
            BIN.as_ref(),
            &[
                "controller",
                "--gitea-url",
                &url,
                "--registration-token-file",
                &token.display().to_string(),
            ],
            &[("facade", &self.facade), ("health", &self.health)],
            &[
                ("PATH", path),
                ("STATE_DIRECTORY", &state),
                ("HOME", &self.dir.path().display().to_string()),
            ],
            &self.dir.path().join("controller.log"),
        )
    }

    fn start(&self) -> tokio::process::Child {
        let path = format!("{}:/usr/bin:/bin", self.dir.path().join("bin").display());
        self.start_with_path(&path)
    }

    fn queue(&self, name: &str) -> JobId {
        self.queue_step(name, "standin:success")
    }

    fn queue_step(&self, name: &str, step: &str) -> JobId {
        let yaml = format!(
            "on: push\njobs:\n  {name}:\n    runs-on: [self-hosted, pod]\n    steps:\n      - run: {step}\n"
        );
        self.mock
            .handle
            .queue_workflow("owner/repo", &yaml)
            .expect("queue")[0]
    }

    async fn succeeds(&self, job: JobId) {
        self.mock
            .handle
            .wait_for(|m| m.job(job).is_some_and(|j| j.status.is_done()), WAIT)
            .await
            .unwrap_or_else(|_| panic!("job {job:?} never finished; log:\n{}", self.log()));
        let status = self.mock.handle.job(job).map(|j| j.status);
        assert_eq!(status, Some(Status::Success), "log:\n{}", self.log());
    }

    fn written(&self) -> Vec<(String, u32, String)> {
        WRITTEN
            .iter()
            .map(|name| {
                let path = self.state().join(name);
                let meta = std::fs::metadata(&path)
                    .unwrap_or_else(|e| panic!("{}: {e}; log:\n{}", path.display(), self.log()));
                let text = std::fs::read_to_string(&path).unwrap();
                ((*name).to_owned(), meta.permissions().mode() & 0o777, text)
            })
            .collect()
    }
}

async fn stop(child: &mut tokio::process::Child) {
    terminate(child);
    tokio::time::timeout(WAIT, child.wait())
        .await
        .expect("the controller stops on SIGTERM")
        .expect("wait");
}

/// Issue 14: the first start registers once (labels of the enabled backends), writes the
/// runner credential, capability key and task key under state_dir (0600) and runs a job;
/// a restart reuses every file unchanged, registers nothing and runs the next job.
#[tokio::test(flavor = "multi_thread")]
async fn one_command_registers_on_first_start_runs_a_job_and_a_restart_reuses_the_registration() {
    let host = Host::new("gitea-runner").await;
    let mut first = host.start();
    host.succeeds(host.queue("first")).await;
    assert_eq!(host.mock.handle.calls(RpcMethod::Register), 1);
    let written = host.written();
    for (name, mode, _) in &written {
        assert_eq!(*mode, 0o600, "{name} is mode {mode:o}");
    }
    let uuid = written[0].2.trim().to_owned();
    let runner = host
        .mock
        .handle
        .runner(&uuid)
        .expect("the registered runner");
    assert_eq!(runner.labels, ["self-hosted", "pod", "vm"]);
    stop(&mut first).await;

    let mut second = host.start();
    host.succeeds(host.queue("second")).await;
    assert_eq!(
        host.mock.handle.calls(RpcMethod::Register),
        1,
        "a restart must not register again"
    );
    assert_eq!(host.written(), written, "nothing written is ever replaced");
    stop(&mut second).await;
}

/// Issue 14: without runner_binary the runner is looked up on PATH (act_runner, the older
/// name, too); with neither name on PATH the controller exits naming what to install and
/// which key to set.
#[tokio::test(flavor = "multi_thread")]
async fn without_a_runner_on_path_the_start_fails_naming_what_to_install() {
    let host = Host::new("act_runner").await;
    // nats-server alone on PATH: everything but the runner is there.
    let nats_only = host.dir.path().join("nats-only");
    std::fs::create_dir(&nats_only).unwrap();
    std::os::unix::fs::symlink(NatsServer::binary(), nats_only.join("nats-server")).unwrap();
    let mut child = host.start_with_path(&nats_only.display().to_string());
    let status = tokio::time::timeout(WAIT, child.wait())
        .await
        .expect("the controller exits")
        .expect("wait");
    assert!(!status.success());
    let log = host.log();
    assert!(
        log.contains("neither gitea-runner nor act_runner is on PATH")
            && log.contains("install the official Gitea runner")
            && log.contains("set runner_binary"),
        "{log}"
    );

    // act_runner on PATH is found, and the job runs.
    let mut child = host.start();
    host.succeeds(host.queue("act")).await;
    stop(&mut child).await;
    assert!(Path::new(&host.state().join("runner-uuid")).exists());
}

/// DESIGN invariant 21: what lives under `state_dir` is reachable only by the controller's
/// user. A first start on a machine where none of them exists creates `state_dir`, the
/// local CA's directory, the embedded NATS store and the process backend's directories —
/// down to each running executor's directory, which holds its Workload API socket — as
/// 0700 (the umask would leave `create_dir_all`'s directories 0755, readable and
/// traversable by every local user, who could then ask the socket for the job's SVID).
#[tokio::test(flavor = "multi_thread")]
async fn a_first_start_creates_state_dir_the_ca_and_the_workload_api_socket_directories_0700() {
    let host = Host::new("gitea-runner").await;
    assert!(!host.state().exists(), "nothing is created beforehand");
    let mut child = host.start();
    let job = host.queue_step("held", "standin:hang");
    let task = host
        .mock
        .handle
        .wait_for_value(
            |m| {
                let task = m.job(job)?.task?;
                m.task(task.id).filter(|t| t.heartbeats > 0).map(|t| t.id)
            },
            WAIT,
        )
        .await
        .unwrap_or_else(|_| panic!("the job never ran; log:\n{}", host.log()));
    let state = host.state();
    let executor = state
        .join("pod/executors")
        .join(format!("gitea-task-{task}"));
    // The sockets the modes protect: the facade's and the running executor's. The task's
    // first heartbeat may be the controller's own (sent while the job waits to be
    // claimed), so the executor's socket may still be on its way.
    for socket in [
        state.join("facade-workload.sock"),
        executor.join("workload.sock"),
    ] {
        let what = format!("{} to be served", socket.display());
        gdr_testkit::until_sync(WAIT, &what, || socket.exists()).await;
    }
    for dir in [
        state.clone(),
        state.join("ca"),
        state.join("nats"),
        state.join("pod"),
        state.join("pod/executors"),
        executor,
        state.join("vm"),
        state.join("vm/executors"),
    ] {
        let mode = std::fs::metadata(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}; log:\n{}", dir.display(), host.log()))
            .permissions()
            .mode()
            & 0o7777;
        assert_eq!(mode, 0o700, "{} is mode {mode:04o}", dir.display());
    }
    host.mock.handle.cancel_job(job).expect("cancel");
    stop(&mut child).await;
}

impl Host {
    /// The one command as [`Host::start`] runs it, but binding its own listeners, with
    /// `PATH` and `env` as given.
    fn start_binding(&self, path: &str, env: &[(&str, &str)]) -> tokio::process::Child {
        let token = self.dir.path().join("registration-token");
        let url = self.mock.url.to_string();
        let state = self.state().display().to_string();
        let home = self.dir.path().display().to_string();
        let mut vars = vec![
            ("PATH", path),
            ("STATE_DIRECTORY", state.as_str()),
            ("HOME", home.as_str()),
        ];
        vars.extend_from_slice(env);
        spawn_activated(
            BIN.as_ref(),
            &[
                "controller",
                "--gitea-url",
                &url,
                "--registration-token-file",
                &token.display().to_string(),
            ],
            &[],
            &vars,
            &self.dir.path().join("controller.log"),
        )
    }

    async fn fails(&self, mut child: tokio::process::Child) -> String {
        let status = tokio::time::timeout(WAIT, child.wait())
            .await
            .expect("the controller exits")
            .expect("wait");
        assert!(!status.success());
        self.log()
    }
}

/// DESIGN invariant 24 (issue 37): a listen address that cannot be bound fails the start
/// naming the key, its environment variable and the value, so the operator knows what to
/// change.
#[tokio::test(flavor = "multi_thread")]
async fn a_facade_listen_address_that_cannot_be_bound_names_the_key_its_variable_and_the_value() {
    let host = Host::new("act_runner").await;
    let path = format!("{}:/usr/bin:/bin", host.dir.path().join("bin").display());
    let log = host
        .fails(host.start_binding(&path, &[("RUNNER_FACADE_LISTEN", "not-an-address")]))
        .await;
    assert!(
        log.contains("runner_facade_listen")
            && log.contains("RUNNER_FACADE_LISTEN")
            && log.contains("not-an-address"),
        "{log}"
    );
}

/// DESIGN invariant 24 (issue 37): a nats-server that exits at start (a pyenv shim in the
/// controller's cleaned environment) fails the start with the server's own last stderr
/// lines in the error, not only its exit status.
#[tokio::test(flavor = "multi_thread")]
async fn a_nats_server_that_exits_at_start_fails_the_start_with_its_last_stderr_lines() {
    let host = Host::new("act_runner").await;
    let shim = host.dir.path().join("shim");
    std::fs::create_dir(&shim).unwrap();
    std::os::unix::fs::symlink(STANDIN, shim.join("act_runner")).unwrap();
    let script = shim.join("nats-server");
    std::fs::write(
        &script,
        "#!/bin/sh\necho 'pyenv: nats-server: command not found' >&2\necho \"The 'nats-server' command exists in these Python versions: 3.11.7\" >&2\nexit 127\n",
    )
    .unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = format!("{}:/usr/bin:/bin", shim.display());
    let log = host.fails(host.start_with_path(&path)).await;
    assert!(
        log.contains("pyenv: nats-server: command not found")
            && log.contains("command exists in these Python versions"),
        "{log}"
    );
}
