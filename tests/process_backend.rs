//! The local process backend with real child processes in temporary state directories.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use gdr_backends::process::{
    IdentityProvider, LOG_FILE, LOGS_DIR, LogRetention, METADATA_FILE, ProcessBackend,
    ProcessBackendSettings, Provisioned,
};
use gdr_core::assignment::{Assignment, AssignmentId, DerivationPolicy};
use gdr_core::backend::{Backend, BackendLabels};
use gdr_core::capability::CapabilityKey;
use gdr_core::executor::{
    Binding, ExecutorBackend, ExecutorError, ExecutorRecord, ExecutorSpec, Phase,
};
use gdr_core::identity::{IdentityScheme, TrustDomain};
use gdr_core::metadata::MetadataCodec;
use gdr_gitea::{ClientOptions, Credentials, GiteaClient};
use gdr_testkit::eventually;
use gdr_testkit::mock_gitea::{MockConfig, MockGitea, RunningMock};
use tempfile::TempDir;

const KEY: &[u8] = b"0123456789abcdef0123456789abcdef";
const DEADLINE: Duration = Duration::from_secs(20);

/// Records identity calls; "serves" an identity by creating a marker file where the
/// socket would be, so an executor can check it exists at start.
#[derive(Default)]
struct RecordingIdentity {
    provisioned: Mutex<Vec<(PathBuf, String)>>,
    revoked: Mutex<Vec<PathBuf>>,
}

impl RecordingIdentity {
    fn provisioned(&self) -> Vec<(PathBuf, String)> {
        self.provisioned.lock().expect("lock").clone()
    }
    fn revoked(&self) -> Vec<PathBuf> {
        self.revoked.lock().expect("lock").clone()
    }
}

#[async_trait]
impl IdentityProvider for RecordingIdentity {
    async fn provision(&self, dir: &Path, spiffe_id: &str) -> Result<Provisioned, ExecutorError> {
        let socket = dir.join("workload.sock");
        std::fs::write(&socket, b"").map_err(ExecutorError::unavailable)?;
        self.provisioned
            .lock()
            .expect("lock")
            .push((dir.to_path_buf(), spiffe_id.to_owned()));
        Ok(format!("unix:{}", socket.display()).into())
    }

    async fn revoke(&self, dir: &Path) {
        self.revoked.lock().expect("lock").push(dir.to_path_buf());
    }
}

struct Setup {
    mock: RunningMock,
    gitea: GiteaClient,
    state: TempDir,
    log_retention: LogRetention,
}

async fn setup() -> Setup {
    let mock = MockGitea::start(MockConfig::default()).await.expect("mock");
    let (uuid, token) = mock
        .handle
        .create_runner("ctl", &["self-hosted", "pod"], false);
    let gitea = GiteaClient::new(
        ClientOptions::new(mock.url.clone()),
        Some(&Credentials::new(uuid, token)),
    )
    .expect("client");
    Setup {
        mock,
        gitea,
        state: tempfile::tempdir().expect("tempdir"),
        log_retention: LogRetention::NONE,
    }
}

fn trust_domain() -> TrustDomain {
    TrustDomain::new("example.org").expect("td")
}

impl Setup {
    fn backend(&self, script: &str, identity: &Arc<RecordingIdentity>) -> ProcessBackend {
        self.backend_with_grace(script, identity, Duration::from_secs(5))
    }

    fn backend_with_grace(
        &self,
        script: &str,
        identity: &Arc<RecordingIdentity>,
        stop_grace: Duration,
    ) -> ProcessBackend {
        let settings = ProcessBackendSettings {
            backend: Backend::Pod,
            state_root: self.state.path().to_path_buf(),
            program: PathBuf::from("/bin/sh"),
            args: vec!["-c".into(), script.into()],
            extra_env: BTreeMap::from([("CI_RUNNER_LABEL".into(), "pod".into())]),
            codec: MetadataCodec::default(),
            trust_domain: trust_domain(),
            stop_grace,
            log_retention: self.log_retention,
        };
        ProcessBackend::new(settings, identity.clone() as Arc<dyn IdentityProvider>)
            .expect("backend")
    }

    /// A spec built from a task really fetched from the mock Gitea.
    async fn spec(&self, repo: &str) -> ExecutorSpec {
        self.mock
            .handle
            .queue_workflow(
                repo,
                "on: push\njobs:\n  build:\n    runs-on: [self-hosted, pod]\n    steps: []\n",
            )
            .expect("queue");
        let task = self
            .gitea
            .fetch_task(0)
            .await
            .expect("fetch")
            .task
            .into_option()
            .expect("task");
        let policy = DerivationPolicy {
            trust_domain: trust_domain(),
            scheme: IdentityScheme::Ref,
            labels: BackendLabels::default(),
        };
        let assignment = Assignment::from_task(task, &policy).expect("assignment");
        ExecutorSpec::new(
            &assignment,
            CapabilityKey::new(KEY).expect("key").issue(assignment.id()),
            &MetadataCodec::default(),
            "https://facade.example:8443",
            "spiffe://example.org/controller",
            "pod",
        )
    }

    fn dir(&self, id: &AssignmentId) -> PathBuf {
        self.state.path().join("executors").join(id.as_str())
    }

    fn metadata(&self, id: &AssignmentId) -> serde_json::Value {
        let bytes = std::fs::read(self.dir(id).join(METADATA_FILE)).expect("metadata");
        serde_json::from_slice(&bytes).expect("json")
    }

    fn log(&self, id: &AssignmentId) -> String {
        std::fs::read_to_string(self.dir(id).join(LOG_FILE)).unwrap_or_default()
    }

    /// Rewrites `id`'s metadata as a controller killed before recording the spawn leaves
    /// it: no pid, no start time, no exit code.
    fn forget_pid(&self, id: &AssignmentId) {
        let mut meta = self.metadata(id);
        for field in ["pid", "pid_start_time", "exit_code"] {
            meta[field] = serde_json::Value::Null;
        }
        std::fs::write(
            self.dir(id).join(METADATA_FILE),
            serde_json::to_vec_pretty(&meta).expect("json"),
        )
        .expect("rewrite metadata");
    }

    fn pid(&self, id: &AssignmentId) -> i32 {
        let pid = self.metadata(id)["pid"].as_i64().expect("pid recorded");
        i32::try_from(pid).expect("pid")
    }
}

async fn phase_of(backend: &ProcessBackend, id: &AssignmentId) -> Phase {
    backend
        .find(id)
        .await
        .expect("find")
        .expect("executor exists")
        .phase
}

async fn wait_finished(backend: &ProcessBackend, id: &AssignmentId) -> bool {
    eventually(DEADLINE, "the executor to finish", || async {
        match phase_of(backend, id).await {
            Phase::Finished { success, .. } => Some(success),
            _ => None,
        }
    })
    .await
}

/// SIGKILLs a child this test started.
fn kill(pid: i32) {
    let pid = rustix::process::Pid::from_raw(pid).expect("pid");
    rustix::process::kill_process(pid, rustix::process::Signal::KILL).expect("kill");
}

/// Dead, or a zombie nobody reaped yet (the process no longer runs).
fn process_gone(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state == "Z" || state == "X"),
    }
}

fn by_name<'a>(records: &'a [ExecutorRecord], id: &AssignmentId) -> &'a ExecutorRecord {
    records
        .iter()
        .find(|r| r.assignment.id() == id)
        .expect("record listed")
}

/// A tracing sink shared with the test, so it can search what the backend logged.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("lock").extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().expect("lock")).into_owned()
    }
}

fn capture_logs() -> (Captured, tracing::subscriber::DefaultGuard) {
    let captured = Captured::default();
    let sink = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_ansi(false)
        .with_writer(move || sink.clone())
        .finish();
    (captured, tracing::subscriber::set_default(subscriber))
}

const PRINT_ENV_AND_WAIT: &str = "echo \"started id=$CI_ASSIGNMENT_ID cap=$CI_RUNNER_CAPABILITY spiffe=$CI_SPIFFE_ID backend=$CI_RUNNER_BACKEND facade=$CI_RUNNER_FACADE_URL socket=$SPIFFE_ENDPOINT_SOCKET workdir=$CI_RUNNER_WORKDIR pwd=$(pwd) label=$CI_RUNNER_LABEL\"; exec sleep 30";

/// DESIGN invariants 8, 14, 17: creating twice, even concurrently, starts one process with one
/// identity; the executor gets its assignment-scoped capability in its environment, and the
/// capability is neither logged nor persisted.
/// Compatibility contract: the executor's environment names (`CI_ASSIGNMENT_ID`,
/// `CI_RUNNER_CAPABILITY`, `CI_SPIFFE_ID`, `CI_RUNNER_BACKEND`, `CI_RUNNER_FACADE_URL`,
/// `SPIFFE_ENDPOINT_SOCKET`) are the Go version's.
#[tokio::test]
async fn creating_twice_starts_one_process_with_the_executor_environment() {
    let (logs, _guard) = capture_logs();
    let s = setup().await;
    let identity = Arc::new(RecordingIdentity::default());
    let backend = s.backend(PRINT_ENV_AND_WAIT, &identity);
    let spec = s.spec("owner/repo").await;
    let id = spec.assignment.id().clone();

    let (first, second) = tokio::join!(backend.create(&spec), backend.create(&spec));
    let (first, second) = (first.expect("create"), second.expect("create"));
    let third = backend.create(&spec).await.expect("create again");
    assert_eq!(first.name, id.as_str());
    assert_eq!(second.name, first.name);
    assert_eq!(third.name, first.name);
    assert_eq!(third.created_at, first.created_at);
    assert_eq!(phase_of(&backend, &id).await, Phase::Running);

    let log = eventually(
        DEADLINE,
        "the executor to print its environment",
        || async {
            let log = s.log(&id);
            log.contains("started").then_some(log)
        },
    )
    .await;
    let capability = spec.capability.expose();
    let dir = s.dir(&id);
    for expected in [
        format!("id={id} "),
        format!("cap={capability} "),
        format!("spiffe={} ", spec.assignment.identity().spiffe_id()),
        "backend=pod ".to_string(),
        "facade=https://facade.example:8443 ".to_string(),
        format!("socket=unix:{}/workload.sock ", dir.display()),
        format!("workdir={}/work ", dir.display()),
        format!("pwd={}/work ", dir.display()),
        "label=pod".to_string(),
    ] {
        assert!(log.contains(&expected), "{expected:?} missing from {log:?}");
    }
    assert_eq!(log.matches("started").count(), 1, "one process only");
    assert_eq!(identity.provisioned().len(), 1);
    assert_eq!(backend.list().await.expect("list").len(), 1);

    let ours = logs.text();
    assert!(ours.contains("executor started"), "{ours}");
    assert!(!ours.contains(capability), "the capability was logged");
    let metadata = std::fs::read_to_string(dir.join(METADATA_FILE)).expect("metadata");
    assert!(
        !metadata.contains(capability),
        "the capability was persisted"
    );

    backend.delete(&id).await.expect("delete");
}

/// DESIGN invariants 7, 8, 19: a new backend instance (a controller restart) rebuilds its view
/// from the state directory: a live executor is re-adopted, not restarted, with its markers;
/// one that died meanwhile reads as finished, with the reason.
#[tokio::test]
async fn a_new_backend_instance_re_adopts_live_executors_and_sees_dead_ones() {
    let s = setup().await;
    let identity = Arc::new(RecordingIdentity::default());
    let backend = s.backend("exec sleep 30", &identity);
    let live = s.spec("owner/live").await;
    let dead = s.spec("owner/dead").await;
    let (live_id, dead_id) = (live.assignment.id().clone(), dead.assignment.id().clone());
    backend.create(&live).await.expect("create");
    backend.create(&dead).await.expect("create");
    backend.record_claimed(&live_id).await.expect("claim");
    backend.record_claimed(&dead_id).await.expect("claim");
    backend.mark_terminal(&dead_id).await.expect("terminal");
    let live_pid = s.pid(&live_id);

    kill(s.pid(&dead_id));
    drop(backend);

    let identity = Arc::new(RecordingIdentity::default());
    let backend = s.backend("exec sleep 30", &identity);
    let records = eventually(
        DEADLINE,
        "the killed executor to be seen as finished",
        || async {
            let records = backend.list().await.expect("list");
            matches!(by_name(&records, &dead_id).phase, Phase::Finished { .. }).then_some(records)
        },
    )
    .await;
    assert_eq!(records.len(), 2);
    let (l, d) = (by_name(&records, &live_id), by_name(&records, &dead_id));
    assert_eq!(l.phase, Phase::Running);
    assert!(l.claimed && !l.terminal);
    assert!(
        matches!(&d.phase, Phase::Finished { success: false, reason: Some(r) } if r.contains("no controller watched")),
        "{:?}",
        d.phase
    );
    assert!(d.claimed && d.terminal);
    assert_eq!(s.pid(&live_id), live_pid, "re-adopted, not restarted");

    for id in [&live_id, &dead_id] {
        backend.delete(id).await.expect("delete");
    }
    eventually(DEADLINE, "the re-adopted executor to stop", || async {
        process_gone(live_pid).then_some(())
    })
    .await;
}

/// DESIGN invariants 8 and 12: a controller killed between spawning an executor and
/// recording its pid leaves a running executor behind; the next backend instance finds it
/// by its working directory (running, so its job still runs), and `delete` stops it.
#[tokio::test]
async fn an_executor_whose_pid_was_never_recorded_is_found_running_and_stopped_on_delete() {
    let s = setup().await;
    let identity = Arc::new(RecordingIdentity::default());
    let backend = s.backend("exec sleep 30", &identity);
    let spec = s.spec("owner/repo").await;
    let id = spec.assignment.id().clone();
    backend.create(&spec).await.expect("create");
    let pid = s.pid(&id);
    drop(backend);
    // The state the kill leaves: metadata written before the spawn, no pid yet.
    s.forget_pid(&id);

    let backend = s.backend("exec sleep 30", &identity);
    assert_eq!(phase_of(&backend, &id).await, Phase::Running);
    backend.delete(&id).await.expect("delete");
    eventually(DEADLINE, "the unrecorded executor to stop", || async {
        process_gone(pid).then_some(())
    })
    .await;
}

/// DESIGN invariants 9, 10: the claimed and terminal markers are written idempotently and
/// durably (a new instance reads them); claiming an absent executor fails, marking one terminal
/// is a no-op.
#[tokio::test]
async fn claimed_and_terminal_markers_are_durable() {
    let s = setup().await;
    let identity = Arc::new(RecordingIdentity::default());
    let backend = s.backend("exec sleep 30", &identity);
    let spec = s.spec("owner/repo").await;
    let id = spec.assignment.id().clone();
    let created = backend.create(&spec).await.expect("create");
    assert!(!created.claimed && !created.terminal);

    backend.record_claimed(&id).await.expect("claim");
    backend
        .record_claimed(&id)
        .await
        .expect("claim is idempotent");
    let metadata = s.metadata(&id);
    assert_eq!(metadata["claimed"], true);
    assert_eq!(metadata["terminal"], false);
    backend.mark_terminal(&id).await.expect("terminal");
    backend
        .mark_terminal(&id)
        .await
        .expect("terminal is idempotent");
    assert_eq!(s.metadata(&id)["terminal"], true);

    drop(backend);
    let backend = s.backend("exec sleep 30", &identity);
    let found = backend.find(&id).await.expect("find").expect("exists");
    assert!(found.claimed && found.terminal);
    assert_eq!(found.created_at, created.created_at);

    let unknown = AssignmentId::from_task_id(999_999).expect("id");
    assert!(matches!(
        backend.record_claimed(&unknown).await,
        Err(ExecutorError::Unavailable(_))
    ));
    backend
        .mark_terminal(&unknown)
        .await
        .expect("marking an absent executor terminal is a no-op");
    backend.delete(&id).await.expect("delete");
}

/// DESIGN invariant 12: an executor that ends reads as finished with its exit status as the
/// reason, durably across instances; no identity is served for finished executors.
#[tokio::test]
async fn an_exited_executor_reports_its_exit_status() {
    let s = setup().await;
    let identity = Arc::new(RecordingIdentity::default());
    let failing = s.backend("exit 3", &identity);
    let spec = s.spec("owner/failing").await;
    let failing_id = spec.assignment.id().clone();
    failing.create(&spec).await.expect("create");
    assert!(!wait_finished(&failing, &failing_id).await);
    eventually(DEADLINE, "the exit code to be recorded", || async {
        (s.metadata(&failing_id)["exit_code"] == 3).then_some(())
    })
    .await;

    let succeeding = s.backend("exit 0", &identity);
    let spec = s.spec("owner/succeeding").await;
    let ok_id = spec.assignment.id().clone();
    succeeding.create(&spec).await.expect("create");
    assert!(wait_finished(&succeeding, &ok_id).await);
    eventually(DEADLINE, "the exit code to be recorded", || async {
        (s.metadata(&ok_id)["exit_code"] == 0).then_some(())
    })
    .await;
    drop(failing);
    drop(succeeding);

    // The status is durable: a new instance reads it from metadata.
    let backend = s.backend("exit 0", &identity);
    assert_eq!(
        phase_of(&backend, &failing_id).await,
        Phase::Finished {
            success: false,
            reason: Some("the executor exited with status 3".into())
        }
    );
    assert_eq!(
        phase_of(&backend, &ok_id).await,
        Phase::Finished {
            success: true,
            reason: Some("the executor exited with status 0".into())
        }
    );
    let provisions = identity.provisioned().len();
    backend.list().await.expect("list");
    assert_eq!(
        identity.provisioned().len(),
        provisions,
        "no identity is served for finished executors"
    );
}

/// DESIGN invariant 12 (issue 9): the cause of a failure survives the clean-up: the
/// backend's reason quotes the executor's last error line, and the executor's log is kept
/// after its directory is deleted (within the retention).
#[tokio::test]
async fn a_failed_executor_names_its_last_error_and_its_log_outlives_its_deletion() {
    let mut s = setup().await;
    s.log_retention = LogRetention {
        max_age: Duration::from_secs(3600),
        max_count: 5,
    };
    let identity = Arc::new(RecordingIdentity::default());
    let backend = s.backend(
        "echo 'runner noise'; echo 'error: the facade at 127.0.0.1:9 did not answer in time' >&2; echo 'more noise'; exit 1",
        &identity,
    );
    let spec = s.spec("owner/repo").await;
    let id = spec.assignment.id().clone();
    backend.create(&spec).await.expect("create");
    assert!(!wait_finished(&backend, &id).await);
    assert_eq!(
        phase_of(&backend, &id).await,
        Phase::Finished {
            success: false,
            reason: Some(
                "the executor exited with status 1; its last error: the facade at 127.0.0.1:9 did not answer in time"
                    .into()
            )
        }
    );
    backend.delete(&id).await.expect("delete");
    assert!(!s.dir(&id).exists());
    let kept = s
        .state
        .path()
        .join(LOGS_DIR)
        .join(format!("{}.log", id.as_str()));
    let text = std::fs::read_to_string(&kept).expect("the log is kept");
    assert!(text.contains("did not answer in time"), "{text}");
}

/// DESIGN invariant 8: delete is idempotent: it stops the executor's whole process group,
/// revokes its identity and removes its directory, and deleting again is a no-op.
#[tokio::test]
async fn delete_stops_the_process_group_and_removes_the_directory_and_is_idempotent() {
    let s = setup().await;
    let identity = Arc::new(RecordingIdentity::default());
    let backend = s.backend("sleep 30 & echo \"grandchild $!\"; wait", &identity);
    let spec = s.spec("owner/repo").await;
    let id = spec.assignment.id().clone();
    backend.create(&spec).await.expect("create");
    let leader = s.pid(&id);
    let grandchild: i32 = eventually(DEADLINE, "the grandchild pid in the log", || async {
        s.log(&id)
            .split_whitespace()
            .skip_while(|w| *w != "grandchild")
            .nth(1)
            .and_then(|p| p.parse().ok())
    })
    .await;

    backend.delete(&id).await.expect("delete");
    assert!(!s.dir(&id).exists());
    assert!(process_gone(leader), "the executor still runs");
    assert!(process_gone(grandchild), "its process group still runs");
    assert_eq!(identity.revoked(), vec![s.dir(&id)]);
    assert!(backend.find(&id).await.expect("find").is_none());
    assert!(backend.list().await.expect("list").is_empty());

    backend
        .delete(&id)
        .await
        .expect("deleting again is a no-op");
}

/// No DESIGN invariant (clean-up leaves nothing running): delete kills an executor that ignores
/// SIGTERM once the grace period is over.
#[tokio::test]
async fn delete_kills_an_executor_that_ignores_sigterm_after_the_grace_period() {
    let s = setup().await;
    let identity = Arc::new(RecordingIdentity::default());
    let backend = s.backend_with_grace(
        "trap '' TERM; echo ready; sleep 30",
        &identity,
        Duration::from_millis(100),
    );
    let spec = s.spec("owner/repo").await;
    let id = spec.assignment.id().clone();
    backend.create(&spec).await.expect("create");
    let leader = s.pid(&id);
    eventually(DEADLINE, "the trap to be installed", || async {
        s.log(&id).contains("ready").then_some(())
    })
    .await;
    backend.delete(&id).await.expect("delete");
    assert!(process_gone(leader));
    assert!(!s.dir(&id).exists());
}

/// DESIGN invariants 7, 20: an executor whose metadata does not decode is skipped by list
/// (logged with its directory) and refused by find and create, so no second executor starts
/// next to untrusted metadata; an operator can still delete it.
#[tokio::test]
async fn corrupt_metadata_is_skipped_not_fatal() {
    let (logs, _guard) = capture_logs();
    let s = setup().await;
    let identity = Arc::new(RecordingIdentity::default());
    let backend = s.backend("exec sleep 30", &identity);
    let broken = s.spec("owner/broken").await;
    let fine = s.spec("owner/fine").await;
    let (broken_id, fine_id) = (broken.assignment.id().clone(), fine.assignment.id().clone());
    backend.create(&broken).await.expect("create");
    backend.create(&fine).await.expect("create");
    let provisions = identity.provisioned().len();

    std::fs::write(s.dir(&broken_id).join(METADATA_FILE), b"{ not json").expect("corrupt");
    let records = backend
        .list()
        .await
        .expect("a corrupt executor does not fail list");
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].assignment.id(), &fine_id);
    assert!(
        logs.text()
            .contains(&s.dir(&broken_id).display().to_string()),
        "the WARN names the directory"
    );
    match backend.find(&broken_id).await {
        Err(ExecutorError::Permanent(why)) => {
            assert!(why.to_string().contains(broken_id.as_str()), "{why}")
        }
        other => panic!("expected a permanent error, got {other:?}"),
    }
    assert!(
        matches!(
            backend.create(&broken).await,
            Err(ExecutorError::Permanent(_))
        ),
        "never a second executor next to untrusted metadata"
    );
    assert_eq!(identity.provisioned().len(), provisions);

    // A new instance skips it too, and an operator can still delete it.
    drop(backend);
    let backend = s.backend("exec sleep 30", &identity);
    assert_eq!(backend.list().await.expect("list").len(), 1);
    backend.delete(&broken_id).await.expect("delete");
    backend.delete(&fine_id).await.expect("delete");
}

/// DESIGN invariant 13: metadata naming another SPIFFE ID than the task's is refused, and no
/// identity is served for it.
#[tokio::test]
async fn metadata_naming_another_spiffe_id_is_refused() {
    let s = setup().await;
    let identity = Arc::new(RecordingIdentity::default());
    let backend = s.backend("exec sleep 30", &identity);
    let spec = s.spec("owner/repo").await;
    let id = spec.assignment.id().clone();
    backend.create(&spec).await.expect("create");
    let pid = s.pid(&id);
    drop(backend);

    let mut metadata = s.metadata(&id);
    let key = format!("{}spiffe-id", gdr_core::metadata::DEFAULT_PREFIX);
    metadata["annotations"][&key] = "spiffe://example.org/ci/other/secrets/deploy".into();
    std::fs::write(
        s.dir(&id).join(METADATA_FILE),
        serde_json::to_vec(&metadata).expect("json"),
    )
    .expect("tamper");

    let identity = Arc::new(RecordingIdentity::default());
    let backend = s.backend("exec sleep 30", &identity);
    assert!(backend.list().await.expect("list").is_empty());
    match backend.find(&id).await {
        Err(ExecutorError::Permanent(why)) => {
            let why = why.to_string();
            assert!(why.contains("SPIFFE"), "{why}");
            assert!(why.contains(id.as_str()), "{why}");
        }
        other => panic!("expected a permanent error, got {other:?}"),
    }
    assert!(
        identity.provisioned().is_empty(),
        "no identity served for it"
    );

    backend.delete(&id).await.expect("delete");
    // Untrusted metadata names no process to signal; stop the test's own child.
    kill(pid);
}

/// DESIGN invariants 8, 19: the identity is provisioned before the executor starts (its socket
/// exists at start), binding is idempotent, and after a restart a live executor's identity is
/// provisioned again, once.
#[tokio::test]
async fn the_identity_is_provisioned_before_the_spawn_and_again_after_a_restart_for_live_executors()
{
    let s = setup().await;
    let identity = Arc::new(RecordingIdentity::default());
    let script =
        "test -e \"${SPIFFE_ENDPOINT_SOCKET#unix:}\" && echo socket-present; exec sleep 30";
    let backend = s.backend(script, &identity);
    let spec = s.spec("owner/repo").await;
    let id = spec.assignment.id().clone();
    let record = backend.create(&spec).await.expect("create");
    let spiffe_id = spec.assignment.identity().spiffe_id().to_owned();
    assert_eq!(
        identity.provisioned(),
        vec![(s.dir(&id), spiffe_id.clone())]
    );
    eventually(
        DEADLINE,
        "the executor to see its socket at start",
        || async { s.log(&id).contains("socket-present").then_some(()) },
    )
    .await;
    assert!(!record.identity_bound);
    assert_eq!(
        backend.bind_identity(&record).await.expect("bind"),
        Binding::Bound
    );
    assert!(
        backend
            .find(&id)
            .await
            .expect("find")
            .expect("exists")
            .identity_bound
    );
    assert_eq!(
        identity.provisioned().len(),
        1,
        "bind does not provision twice"
    );
    drop(backend);

    let identity = Arc::new(RecordingIdentity::default());
    let backend = s.backend(script, &identity);
    assert!(identity.provisioned().is_empty());
    let restored = backend.restore().await.expect("restore");
    assert_eq!(restored.len(), 1);
    assert!(restored[0].identity_bound);
    assert_eq!(identity.provisioned(), vec![(s.dir(&id), spiffe_id)]);
    backend.list().await.expect("list");
    backend.find(&id).await.expect("find");
    assert_eq!(
        backend.bind_identity(&restored[0]).await.expect("bind"),
        Binding::Bound
    );
    assert_eq!(
        identity.provisioned().len(),
        1,
        "re-provisioning is idempotent"
    );

    backend.delete(&id).await.expect("delete");
    assert_eq!(identity.revoked(), vec![s.dir(&id)]);
}

/// DESIGN invariant 10 (nothing of a deleted executor keeps running): the job's Docker
/// daemon, orphaned when its executor is SIGKILLed outside a Pod or VM (no executor is
/// left to stop it), is stopped by the backend's delete.
#[cfg(feature = "testkit")]
#[tokio::test(flavor = "multi_thread")]
async fn a_docker_daemon_orphaned_by_a_sigkilled_executor_is_stopped_by_delete() {
    use gdr_testkit::standin_dockerd::{Readiness, StandinDockerd};
    const DOCKERD: &str = env!("CARGO_BIN_EXE_dockerd-standin");
    const BIN: &str = env!("CARGO_BIN_EXE_gitea-dynamic-runner");
    let s = setup().await;
    let ca = gdr_identity::workload_api::LocalCa::new("example.org").expect("ca");
    let identity = Arc::new(gdr_identity::workload_api::LocalIdentity::new(
        ca,
        Duration::from_secs(3600),
    ));
    let docker = tempfile::Builder::new().prefix("d").tempdir().expect("dir");
    let dockerd = StandinDockerd::install(
        docker.path(),
        Path::new(DOCKERD),
        Readiness::After(Duration::ZERO),
    )
    .expect("dockerd");
    let settings = ProcessBackendSettings {
        backend: Backend::Pod,
        state_root: s.state.path().to_path_buf(),
        program: PathBuf::from(BIN),
        args: vec!["executor".into()],
        extra_env: BTreeMap::from([
            ("CI_RUNNER_START_DOCKER".into(), "true".into()),
            ("CI_DOCKERD".into(), dockerd.program().display().to_string()),
            (
                "CI_DOCKER_SOCKET".into(),
                docker.path().join("docker.sock").display().to_string(),
            ),
            // The facade never answers: the executor waits, its daemon running.
            ("CI_EXECUTOR_READY_TIMEOUT".into(), "600".into()),
        ]),
        codec: MetadataCodec::default(),
        trust_domain: trust_domain(),
        stop_grace: Duration::from_secs(5),
        log_retention: LogRetention::NONE,
    };
    let backend =
        ProcessBackend::new(settings, identity as Arc<dyn IdentityProvider>).expect("backend");
    let spec = s.spec("owner/repo").await;
    let id = spec.assignment.id().clone();
    backend.create(&spec).await.expect("create");
    let daemon = eventually(DEADLINE, "the executor's Docker daemon", || async {
        dockerd.pid().filter(|_| dockerd.running())
    })
    .await;
    kill(s.pid(&id));
    assert!(
        !wait_finished(&backend, &id).await,
        "a killed executor failed"
    );
    assert!(!process_gone(daemon), "the daemon outlived its executor");

    backend.delete(&id).await.expect("delete");
    assert!(process_gone(daemon), "the orphaned daemon still runs");
}

/// DESIGN invariant 16: an executor of this backend runs on the controller's host, so it
/// never gets `CI_EXECUTOR_SANDBOXED`, the variable that makes a root executor prepare its
/// environment (device nodes, mounts, cgroups) as it does inside a Pod or VM.
#[tokio::test]
async fn a_process_executor_never_gets_the_variable_that_starts_it_as_root() {
    let s = setup().await;
    let identity = Arc::new(RecordingIdentity::default());
    let settings = ProcessBackendSettings {
        backend: Backend::Pod,
        state_root: s.state.path().to_path_buf(),
        program: PathBuf::from("/bin/sh"),
        args: vec![
            "-c".into(),
            "echo \"sandboxed=${CI_EXECUTOR_SANDBOXED-unset}\"; echo started; sleep 30".into(),
        ],
        extra_env: BTreeMap::from([("CI_EXECUTOR_SANDBOXED".into(), "true".into())]),
        codec: MetadataCodec::default(),
        trust_domain: trust_domain(),
        stop_grace: Duration::from_secs(5),
        log_retention: LogRetention::NONE,
    };
    let backend = ProcessBackend::new(settings, identity.clone() as Arc<dyn IdentityProvider>)
        .expect("backend");
    let spec = s.spec("owner/repo").await;
    let id = spec.assignment.id().clone();
    backend.create(&spec).await.expect("create");
    let log = eventually(DEADLINE, "the executor to start", || async {
        let log = s.log(&id);
        log.contains("started").then_some(log)
    })
    .await;
    assert!(log.contains("sandboxed=unset"), "{log}");
    backend.delete(&id).await.expect("delete");
}

/// DESIGN invariant 8 (nothing lost to a controller's death): a controller killed between
/// writing an executor's metadata and spawning it leaves a record of a process that never
/// ran (no pid, no process in its working directory, never claimed). The next backend
/// instance treats it as a creation that never completed: `find` and `list` do not report
/// it (it was reported as an executor that ended, so the job was failed), and `create`
/// starts the executor, so the redelivered job runs.
#[tokio::test]
async fn an_executor_a_killed_controller_never_started_is_started_by_the_next_create() {
    let s = setup().await;
    let identity = Arc::new(RecordingIdentity::default());
    let backend = s.backend("exec sleep 30", &identity);
    let spec = s.spec("owner/repo").await;
    let id = spec.assignment.id().clone();
    backend.create(&spec).await.expect("create");
    let first = s.pid(&id);
    kill(first);
    eventually(DEADLINE, "the first process to end", || async {
        process_gone(first).then_some(())
    })
    .await;
    drop(backend);
    // The state the kill leaves: metadata written before the spawn, no pid, no process.
    s.forget_pid(&id);

    let backend = s.backend("exec sleep 30", &identity);
    let found = backend.find(&id).await.expect("find");
    assert!(found.is_none(), "reported as an executor: {found:?}");
    let listed = backend.list().await.expect("list");
    assert!(
        listed.iter().all(|r| r.assignment.id() != &id),
        "{listed:?}"
    );
    let record = backend.create(&spec).await.expect("create again");
    assert_eq!(record.phase, Phase::Running);
    let second = s.pid(&id);
    assert_ne!(second, first);
    backend.delete(&id).await.expect("delete");
    eventually(DEADLINE, "the restarted executor to stop", || async {
        process_gone(second).then_some(())
    })
    .await;
}
