//! The whole chain through the VM backend: mock Gitea → scheduler → JetStream (a real
//! nats-server) → vm-worker → the real `opensandbox-server` 1.1.1 → the test kit's VM host
//! (each ready sandbox's entrypoint started as a local process, with the SVID
//! `sandbox-identity` would grant it) → `gitea-dynamic-runner executor` → stand-in runner →
//! facade → mock Gitea. The controller is the real binary with `vm_backend = "opensandbox"`.
//!
//! Every test of this file shares one OpenSandbox server (start-up takes 8–19 s here) and
//! isolates itself by pool and metadata prefix. Server timeouts: a blocking create gives up
//! after `gdr_testkit::opensandbox::CREATE_TIMEOUT` (10 s here, 60 s in production) and a
//! full pool answers 429 after `POOL_ACQUISITION_TIMEOUT` (2 s here, 30 s in production).

use std::collections::BTreeMap;
use std::time::Duration;

use gdr_backends::opensandbox::client::{ListQuery, Sandbox};
use gdr_core::identity::TrustDomain;
use gdr_core::metadata::{MetadataCodec, keys};
use gdr_sandbox_identity::EntryTemplate;
use gdr_testkit::controller::{ControllerFixture, FACADE_SPIFFE_ID, listener};
use gdr_testkit::mock_gitea::{JobId, MockConfig, MockGitea, RunningMock, Status};
use gdr_testkit::nats_server::NatsServer;
use gdr_testkit::opensandbox::{OpenSandboxServer, PoolSpec};
use gdr_testkit::spiffe::{FakeWorkloadApi, RunningWorkloadApi, TestCa};
use gdr_testkit::vm_host::{VmHost, VmHostConfig};

use crate::opensandbox_common::{client, server, unique};

const WAIT: Duration = Duration::from_secs(90);
const BIN: &str = env!("CARGO_BIN_EXE_gitea-dynamic-runner");
const STANDIN: &str = env!("CARGO_BIN_EXE_gitea-runner-standin");

/// One test's world: its own pool and metadata prefix on the shared server, its own
/// Gitea, NATS, VM host and controller process.
struct Chain {
    server: &'static OpenSandboxServer,
    pool: String,
    codec: MetadataCodec,
    mock: RunningMock,
    fixture: ControllerFixture,
    host: VmHost,
    /// Bound once, handed to every controller incarnation (executors keep their address).
    facade: std::net::TcpListener,
    health: std::net::TcpListener,
    controller: Option<tokio::process::Child>,
    _facade_identity: RunningWorkloadApi,
    _nats: NatsServer,
    _dir: tempfile::TempDir,
}

impl Chain {
    /// A chain whose pool holds `pool_capacity` sandboxes and whose controller admits
    /// `vm_capacity` VM jobs at once.
    async fn start(pool_spec: PoolSpec, vm_capacity: u32) -> Self {
        Self::start_with(pool_spec, vm_capacity, |f| f).await
    }

    /// The same with further settings (`tweak`).
    async fn start_with(
        pool_spec: PoolSpec,
        vm_capacity: u32,
        tweak: impl FnOnce(ControllerFixture) -> ControllerFixture,
    ) -> Self {
        let server = server().await;
        let pool = unique("chain");
        server.control.put_pool(&pool, &pool_spec).await.unwrap();
        let codec = MetadataCodec::new(format!("{}.gdr.test/", unique("c"))).unwrap();
        // Short: the VMs' Workload API sockets live under it.
        let dir = tempfile::Builder::new().prefix("vm").tempdir().unwrap();
        let ca = TestCa::new("example.org").unwrap();
        let facade_identity = FakeWorkloadApi::start(dir.path(), ca.clone(), FACADE_SPIFFE_ID)
            .await
            .unwrap();
        let host = VmHost::start(VmHostConfig {
            control: server.control.clone(),
            pool: pool.clone(),
            ca,
            identity: EntryTemplate {
                trust_domain: TrustDomain::new("example.org").unwrap(),
                cluster: "sandbox-kata".into(),
                class_name: "spire-mgmt-spire".into(),
                runner_uid: 2000,
                codec: codec.clone(),
            },
            dir: dir.path().to_path_buf(),
        });
        let nats = NatsServer::start().await.expect("nats");
        let mock = MockGitea::start(MockConfig::default()).await.expect("mock");
        let (facade, health) = (listener(), listener());
        let fixture = ControllerFixture::new(&mock, BIN.as_ref(), STANDIN.as_ref())
            .facade_at(facade.local_addr().unwrap());
        let key_file = fixture.file("secrets/opensandbox-api-key", &server.api_key);
        let fixture = fixture
            .set("components", "scheduler,vm-worker")
            .set("pod_capacity", 0u32)
            .set("vm_capacity", vm_capacity)
            .set("nats_url", nats.url())
            .set("nats_ack_wait", "5s")
            .set("heartbeat_interval", "1s")
            .set("local_identity", false)
            .set("spiffe_endpoint_socket", facade_identity.endpoint())
            .set("metadata_prefix", codec.prefix())
            .set("vm_backend", "opensandbox")
            .set("opensandbox_api", server.url.as_str())
            .set("opensandbox_api_key_file", key_file.as_path())
            .set("opensandbox_pool", pool.as_str())
            .set(
                "opensandbox_create_timeout",
                format!(
                    "{}s",
                    (gdr_testkit::opensandbox::CREATE_TIMEOUT + Duration::from_secs(20)).as_secs()
                ),
            )
            .set("vm_entrypoint", format!("{BIN},executor"))
            // As in production: the agent's socket inside the VM (the VM host points it at
            // the VM's own Workload API), and where the image keeps the runner.
            .set(
                "vm_executor_env",
                format!(
                    "SPIFFE_ENDPOINT_SOCKET=unix:///run/spire/agent.sock,GITEA_RUNNER_BINARY={STANDIN}"
                ),
            )
            .set("vm_timeout_seconds", 3600u32)
            // The exited executor's sandbox stays Running; do not keep it 15 s.
            .set("vm_terminal_grace", "1s");
        let fixture = tweak(fixture);
        let mut chain = Chain {
            server,
            pool,
            codec,
            mock,
            fixture,
            host,
            facade,
            health,
            controller: None,
            _facade_identity: facade_identity,
            _nats: nats,
            _dir: dir,
        };
        chain.start_controller();
        chain
    }

    fn start_controller(&mut self) {
        self.controller = Some(
            self.fixture
                .spawn(BIN.as_ref(), &self.facade, &self.health, &[]),
        );
    }

    /// SIGKILLs the controller and waits until it is gone.
    async fn kill_controller(&mut self) {
        let mut child = self.controller.take().expect("a controller runs");
        child.start_kill().unwrap();
        child.wait().await.unwrap();
    }

    fn queue_in(&self, repo: &str, job: &str, step: &str) -> JobId {
        let yaml = format!(
            "on: push\njobs:\n  {job}:\n    runs-on: [self-hosted, vm]\n    steps:\n      - run: {step}\n"
        );
        self.mock.handle.queue_workflow(repo, &yaml).expect("queue")[0]
    }

    fn queue(&self, job: &str, step: &str) -> JobId {
        self.queue_in("owner/repo", job, step)
    }

    async fn wait_status(&self, job: JobId, status: Status) {
        if self
            .mock
            .handle
            .wait_for(|m| m.job(job).is_some_and(|j| j.status == status), WAIT)
            .await
            .is_err()
        {
            panic!(
                "job {job:?} never reached {status:?} (is {:?})\ncontroller log:\n{}\nserver log tail:\n{}",
                self.mock
                    .handle
                    .job(job)
                    .map(|j| (j.status, j.task.map(|t| t.log_rows))),
                self.fixture.log(),
                tail(&self.server.log(), 40),
            );
        }
    }

    /// The job's task, once it has one.
    fn task_id(&self, job: JobId) -> Option<i64> {
        self.mock.handle.job(job).and_then(|j| j.task_id)
    }

    /// The job's assignment ID, once Gitea handed its task out.
    fn assignment(&self, job: JobId) -> Option<String> {
        self.task_id(job).map(|task| format!("gitea-task-{task}"))
    }

    fn assignment_id(&self, job: JobId) -> String {
        self.assignment(job).expect("the job has a task")
    }

    /// The runner's final log rows of a job's task.
    fn log_rows(&self, job: JobId) -> Vec<String> {
        self.mock.handle.log_rows(job)
    }

    /// How often the job's task was run by a runner.
    fn runs_of(&self, job: JobId) -> usize {
        self.mock.handle.runner_starts(job)
    }

    /// This test's sandboxes, as the Lifecycle API lists them (the runner label of its
    /// metadata prefix).
    async fn sandboxes(&self) -> Vec<Sandbox> {
        client(self.server)
            .list(&ListQuery {
                metadata: BTreeMap::from([(self.codec.key(keys::RUNNER), "true".into())]),
                ..ListQuery::default()
            })
            .await
            .unwrap()
    }

    /// The sandbox of an assignment, once it exists.
    async fn sandbox_of(&self, assignment_id: &str) -> Option<Sandbox> {
        let key = self.codec.key(keys::ASSIGNMENT_ID);
        self.sandboxes()
            .await
            .into_iter()
            .find(|s| s.metadata().get(&key).map(String::as_str) == Some(assignment_id))
    }

    /// A gauge or counter of the controller's `/metrics` (0 while it cannot be read).
    async fn metric(&self, series: &str) -> u64 {
        gdr_testkit::local_controller::metric(self.health.local_addr().unwrap(), series)
            .await
            .unwrap_or(0)
    }

    async fn vm_slots_in_use(&self) -> u64 {
        self.metric("gitea_dynamic_runner_pool_in_use{backend=\"vm\"}")
            .await
    }

    /// No sandbox, no running VM and no admission slot left.
    async fn nothing_left(&self) {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let sandboxes = self.sandboxes().await.len();
            let (vms, slots) = (self.host.running(), self.vm_slots_in_use().await);
            if sandboxes == 0 && vms == 0 && slots == 0 {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "leaked: {sandboxes} sandboxes, {vms} VMs, {slots} slots\n{}",
                self.fixture.log()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for Chain {
    fn drop(&mut self) {
        if let Some(child) = self.controller.as_mut() {
            let _ = child.start_kill();
        }
    }
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Waits for `probe` to answer `Some` (re-checked every 100 ms), or fails naming `what`.
async fn eventually<T, F: std::future::Future<Output = Option<T>>>(
    what: &str,
    probe: impl FnMut() -> F,
) -> T {
    gdr_testkit::eventually(WAIT, what, probe).await
}

/// DESIGN invariants 8–12, 14–16: success, failure and cancellation of VM jobs reach Gitea
/// through the whole chain; each job runs in its own sandbox with its own identity, and
/// every sandbox, VM and slot is gone afterwards.
#[tokio::test(flavor = "multi_thread")]
async fn success_failure_and_cancellation_reach_gitea_through_opensandbox_vms() {
    let mut spec = PoolSpec::new(3);
    spec.start_delay = Some(Duration::from_millis(300));
    let c = Chain::start(spec, 3).await;
    let ok = c.queue("ok", "standin:success");
    let bad = c.queue("bad", "standin:failure");
    let hang = c.queue("hang", "standin:hang");
    c.wait_status(ok, Status::Success).await;
    c.wait_status(bad, Status::Failure).await;
    let hang_task = c
        .mock
        .handle
        .wait_for_value(
            |m| {
                m.job(hang)
                    .and_then(|j| j.task)
                    .filter(|t| t.log_rows.iter().any(|r| r.contains("stand-in runner")))
                    .map(|t| t.id)
            },
            WAIT,
        )
        .await
        .expect("the hanging job runs");
    c.mock.handle.cancel_job(hang).unwrap();
    c.wait_status(hang, Status::Cancelled).await;
    assert!(!c.mock.handle.task(hang_task).unwrap().log_rows.is_empty());
    for job in [ok, bad, hang] {
        assert_eq!(c.runs_of(job), 1, "{job:?} ran once");
        let vms = c.host.vms_of(&c.assignment_id(job));
        assert_eq!(vms.len(), 1, "{job:?} ran in one VM: {vms:?}");
        let name = c.mock.handle.job(job).unwrap().key;
        assert_eq!(
            vms[0].identity.as_deref(),
            Ok(format!("spiffe://example.org/ci/owner/repo/branch/main/{name}").as_str()),
            "the VM's identity is the job's"
        );
    }
    c.nothing_left().await;
}

/// DESIGN invariants 5a and 6: when the OpenSandbox pool is full (429 with Retry-After),
/// the job stays queued in JetStream, kept alive in Gitea by heartbeats, and runs once a
/// sandbox frees; never more VMs than the pool holds.
#[tokio::test(flavor = "multi_thread")]
async fn a_full_pool_keeps_the_job_queued_until_a_sandbox_frees_then_runs_it() {
    let c = Chain::start(PoolSpec::new(1), 2).await;
    let first = c.queue("first", "standin:hang");
    eventually("the first job runs in a VM", || async {
        c.task_id(first)
            .and_then(|_| c.host.vms_of(&c.assignment_id(first)).pop())
    })
    .await;
    let waiting = c.queue("waiting", "standin:success");
    eventually("the controller is told the pool is full", || async {
        let full = c
            .metric("gitea_dynamic_runner_assignments_total{backend=\"vm\",outcome=\"full\"}")
            .await;
        (full >= 2).then_some(())
    })
    .await;
    let queued = c.mock.handle.job(waiting).unwrap();
    assert_eq!(
        queued.status,
        Status::Running,
        "Gitea handed the task out and it is kept alive"
    );
    assert!(
        queued.task.as_ref().unwrap().heartbeats > 0,
        "heartbeats keep it alive"
    );
    assert!(
        c.sandbox_of(&c.assignment_id(waiting)).await.is_none(),
        "a refused create leaves no sandbox"
    );
    assert!(c.host.vms_of(&c.assignment_id(waiting)).is_empty());
    c.mock.handle.cancel_job(first).unwrap();
    c.wait_status(first, Status::Cancelled).await;
    c.wait_status(waiting, Status::Success).await;
    assert_eq!(c.runs_of(waiting), 1);
    assert_eq!(c.host.vms().len(), 2, "one VM per job");
    assert_eq!(c.host.peak(), 1, "never more VMs than the pool holds");
    c.nothing_left().await;
}

/// DESIGN invariant 12: a sandbox deleted by someone else while its job runs (an operator
/// with the OpenSandbox key, an expiry) powers off the VM; the controller fails the task in
/// Gitea saying why, and frees the slot.
#[tokio::test(flavor = "multi_thread")]
async fn a_sandbox_deleted_mid_job_fails_the_job_with_the_reason_and_frees_the_slot() {
    let c = Chain::start(PoolSpec::new(1), 1).await;
    let job = c.queue("doomed", "standin:hang");
    let vm = eventually("the job runs in a VM", || async {
        let task = c.mock.handle.task(c.task_id(job)?)?;
        task.log_rows
            .iter()
            .any(|r| r.contains("stand-in runner"))
            .then(|| c.host.vms_of(&c.assignment_id(job)).pop())
            .flatten()
    })
    .await;
    assert!(client(c.server).delete(&vm.sandbox).await.unwrap());
    c.wait_status(job, Status::Failure).await;
    let rows = c.log_rows(job).join("\n");
    assert!(
        rows.contains("is gone from the vm backend") || rows.contains("sandbox Stopping"),
        "the failure says why: {rows}"
    );
    c.nothing_left().await;
    let vm = c.host.vms_of(&c.assignment_id(job)).pop().unwrap();
    assert!(vm.exit_code.is_some(), "the VM was powered off");
}

/// DESIGN invariant 11: a job whose repository, job key and SPIFFE ID are far longer than
/// a metadata value may be (63 characters) runs: the long values travel as base64url
/// chunks, decode losslessly, and the identity `sandbox-identity` derives from them is the
/// job's.
#[tokio::test(flavor = "multi_thread")]
async fn long_metadata_values_travel_as_chunks_and_decode_to_the_jobs_identity() {
    let c = Chain::start(PoolSpec::new(1), 1).await;
    let owner = "an-organisation-whose-name-alone-is-longer-than-a-label-value";
    let repo = "and.a_repository.whose-name-is-long-too-so-the-identity-needs-chunks";
    let key = "a_job_key_that_is_long_as_well_to_make_sure_nothing_is_truncated_anywhere";
    let job = c.queue_in(&format!("{owner}/{repo}"), key, "standin:sleep 3000");
    let sandbox = eventually("the job's sandbox exists", || async {
        c.sandbox_of(&c.assignment(job)?).await
    })
    .await;
    let labels = sandbox.metadata();
    let chunk = c.codec.key(keys::ANNOTATION_CHUNK);
    let chunks: Vec<&String> = labels.keys().filter(|k| k.starts_with(&chunk)).collect();
    assert!(chunks.len() >= 2, "several chunks: {chunks:?}");
    for (k, v) in &labels {
        assert!(
            v.len() <= 63
                && v.chars()
                    .all(|ch| ch.is_ascii_alphanumeric() || matches!(ch, '.' | '_' | '-')),
            "{k}={v} is a valid metadata value"
        );
    }
    let decoded = c
        .codec
        .decode(
            &c.codec.unflatten(&labels).unwrap(),
            &TrustDomain::new("example.org").unwrap(),
        )
        .unwrap();
    let spiffe_id = format!("spiffe://example.org/ci/{owner}/{repo}/branch/main/{key}");
    assert_eq!(decoded.identity().spiffe_id(), spiffe_id);
    c.wait_status(job, Status::Success).await;
    let vm = c.host.vms_of(&c.assignment_id(job)).pop().unwrap();
    assert_eq!(
        vm.identity.as_deref(),
        Ok(spiffe_id.as_str()),
        "the VM got the decoded identity"
    );
    c.nothing_left().await;
}

/// DESIGN invariants 8 and 20: a controller SIGKILLed while its create blocks (the VM
/// still booting) leaves a sandbox; the restarted controller adopts that sandbox instead
/// of creating another, and the job runs exactly once.
#[tokio::test(flavor = "multi_thread")]
async fn a_controller_killed_while_the_vm_boots_adopts_the_sandbox_after_restart_and_runs_the_job_once()
 {
    // Room for a second sandbox, so a duplicate would be created and seen.
    let mut booting = PoolSpec::new(2);
    booting.start_delay = None;
    let mut c = Chain::start(booting, 1).await;
    let job = c.queue("once", "standin:success");
    let sandbox = eventually("the blocking create made a sandbox", || async {
        c.sandbox_of(&c.assignment(job)?).await
    })
    .await;
    assert_eq!(sandbox.status.state, "Pending");
    c.kill_controller().await;
    // The VM finishes booting while no controller runs.
    let mut ready = PoolSpec::new(2);
    ready.start_delay = Some(Duration::ZERO);
    c.server.control.put_pool(&c.pool, &ready).await.unwrap();
    c.start_controller();
    c.wait_status(job, Status::Success).await;
    assert_eq!(c.runs_of(job), 1, "ran once");
    let vms = c.host.vms_of(&c.assignment_id(job));
    assert_eq!(vms.len(), 1, "one VM: {vms:?}");
    assert_eq!(
        vms[0].sandbox, sandbox.id,
        "the adopted sandbox ran the job"
    );
    c.nothing_left().await;
}

/// A warm sandbox's VM, booted with its executor in standby and no job, once one exists
/// that is not `other`.
fn waiting_member(host: &VmHost, other: Option<&str>) -> Option<String> {
    host.vms()
        .into_iter()
        .find(|vm| {
            vm.standby_id.is_some()
                && vm.assignment_id.is_none()
                && vm.pid.is_some()
                && vm.exit_code.is_none()
                && Some(vm.sandbox.as_str()) != other
        })
        .map(|vm| vm.sandbox)
}

/// DESIGN invariants 8 and 14–16 (`vm_warm_pool`): a job runs in a sandbox made before it,
/// whose executor waited with no assignment, capability or identity until the job claimed
/// the sandbox, then got the job's SVID and fetched its assignment from the facade; the
/// sandbox serves that job only and is deleted after it, and the next job runs in the
/// member the pool made next.
#[tokio::test(flavor = "multi_thread")]
async fn a_warm_sandbox_made_before_its_job_runs_that_job_alone_with_the_jobs_identity() {
    let c = Chain::start_with(PoolSpec::new(3), 1, |f| f.set("vm_warm_pool", 1u32)).await;
    let first_member = eventually("a warm sandbox boots before any job", || async {
        waiting_member(&c.host, None)
    })
    .await;
    let first = c.queue("first", "standin:success");
    c.wait_status(first, Status::Success).await;
    let second_member = eventually("the pool makes a new member", || async {
        waiting_member(&c.host, Some(&first_member))
    })
    .await;
    let second = c.queue("second", "standin:success");
    c.wait_status(second, Status::Success).await;
    for (job, member) in [(first, &first_member), (second, &second_member)] {
        assert_eq!(c.runs_of(job), 1, "{job:?} ran once");
        let vms = c.host.vms_of(&c.assignment_id(job));
        assert_eq!(vms.len(), 1, "{job:?} ran in one VM: {vms:?}");
        assert_eq!(&vms[0].sandbox, member, "{job:?} ran in the warm member");
        assert!(
            vms[0].standby_id.is_some(),
            "{job:?}'s executor started in standby"
        );
        let name = c.mock.handle.job(job).unwrap().key;
        assert_eq!(
            vms[0].identity.as_deref(),
            Ok(format!("spiffe://example.org/ci/owner/repo/branch/main/{name}").as_str()),
            "the VM's identity is its job's"
        );
    }
    eventually(
        "the claimed sandboxes are deleted after their jobs",
        || async { c.sandboxes().await.is_empty().then_some(()) },
    )
    .await;
}

/// DESIGN invariants 8 and 12 (issue 39 item 5): a warm sandbox whose identity cannot be
/// bound once a job claimed it (`sandbox-identity` refuses it) gives its job no SVID, so
/// its executor never asks the facade; the job is failed after `executor_start_deadline`,
/// counted from the claim, and the sandbox is deleted, never back in the pool, which makes
/// a new member.
#[tokio::test(flavor = "multi_thread")]
async fn a_claimed_warm_sandbox_whose_identity_cannot_be_bound_is_discarded_and_its_job_failed() {
    let c = Chain::start_with(PoolSpec::new(3), 1, |f| {
        f.set("vm_warm_pool", 1u32)
            .set("executor_start_deadline", "4s")
    })
    .await;
    c.host.refuse_claimed();
    let member = eventually("a warm sandbox boots before any job", || async {
        waiting_member(&c.host, None)
    })
    .await;
    let job = c.queue("unbound", "standin:success");
    c.wait_status(job, Status::Failure).await;
    let rows = c.log_rows(job);
    assert!(
        rows.iter()
            .any(|r| r.contains("did not start the job within 4s")),
        "the start deadline failed it: {rows:?}"
    );
    assert_eq!(c.runs_of(job), 0, "no runner ran the job");
    let vms = c.host.vms_of(&c.assignment_id(job));
    assert_eq!(vms.len(), 1, "the job claimed one VM: {vms:?}");
    assert_eq!(vms[0].sandbox, member, "the job claimed the warm member");
    assert!(vms[0].identity.is_err(), "it never had an identity");
    eventually("the member is deleted, and a new one boots", || async {
        let gone = c.sandboxes().await.is_empty();
        (gone && waiting_member(&c.host, Some(&member)).is_some()).then_some(())
    })
    .await;
}
