//! The OpenSandbox VM backend against the real `opensandbox-server` 1.1.1 on the testkit's
//! in-memory cluster: the backend contract suite, pool capacity, phases, recovery of
//! untrustworthy metadata, expiry renewal, and the real executor binary started as the
//! sandbox's entrypoint. Each test uses its own pool and metadata prefix, so they share
//! one server. Server timeouts: `gdr_testkit::opensandbox::{CREATE_TIMEOUT,
//! POOL_ACQUISITION_TIMEOUT}` (10 s and 2 s here; 60 s and 30 s in production).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use gdr_backends::opensandbox::client::{ClientError, CreateSandbox};
use gdr_backends::opensandbox::warm::STANDBY_ID_KEY;
use gdr_backends::opensandbox::{OpenSandboxBackend, OpenSandboxSettings};
use gdr_backends::warm;
use gdr_core::assignment::AssignmentId;
use gdr_core::backend::Backend;
use gdr_core::executor::{
    ExecutorBackend, ExecutorError, ExecutorSpec, LocalWarmClaims, Phase, WarmClaims, env,
};
use gdr_core::metadata::{MetadataCodec, keys};
use gdr_sandbox_identity::EntryTemplate;
use gdr_testkit::backend_contract::{self, Contract};
use gdr_testkit::eventually;
use gdr_testkit::opensandbox::{OpenSandboxServer, POOL_ACQUISITION_TIMEOUT, PoolSpec};
use gdr_testkit::spiffe::{FakeWorkloadApi, TestCa};
use gdr_testkit::vm_host::{VmHost, VmHostConfig};

use crate::opensandbox_common::{DEADLINE, client, pool, server, settings, unique};

/// A test's own metadata prefix, pool and settings on the shared server.
struct Setup {
    server: &'static OpenSandboxServer,
    settings: OpenSandboxSettings,
}

impl Setup {
    async fn new(pool_spec: PoolSpec) -> Self {
        let server = server().await;
        let pool = pool(server, pool_spec).await;
        let codec = MetadataCodec::new(format!("{}.gdr.test/", unique("t"))).unwrap();
        let mut settings = OpenSandboxSettings::new(
            settings(server),
            pool,
            codec,
            backend_contract::trust_domain(),
        );
        settings.entrypoint = vec!["/bin/sh".into(), "-c".into(), "exec sleep 120".into()];
        settings.timeout = Duration::from_secs(3600);
        Setup { server, settings }
    }

    /// A backend instance (a controller start).
    fn backend(&self) -> OpenSandboxBackend {
        OpenSandboxBackend::new(self.settings.clone(), client(self.server)).unwrap()
    }

    fn spec(&self, task_id: i64) -> ExecutorSpec {
        let assignment = backend_contract::assignment(
            task_id,
            "octo-org/hello-world",
            "build",
            Backend::Vm,
            &self.settings.trust_domain,
        );
        backend_contract::spec(&assignment, &self.settings.codec)
    }
}

/// DESIGN invariants 8–10, 12: the OpenSandbox backend keeps the executor-backend
/// contract; each instance is a new client, as a restarted controller would have.
#[tokio::test]
async fn the_opensandbox_backend_keeps_the_executor_backend_contract() {
    let setup = Setup::new(PoolSpec::new(4)).await;
    let mut contract = Contract::new(Backend::Vm, 1000);
    contract.codec = setup.settings.codec.clone();
    backend_contract::run(
        || Arc::new(setup.backend()) as Arc<dyn ExecutorBackend>,
        &contract,
    )
    .await;
}

/// DESIGN invariant 6: a full pool is `Full` with the server's Retry-After, so the
/// assignment stays queued; when room frees, the same create succeeds, and nothing was
/// left behind by the refusal.
#[tokio::test]
async fn a_full_pool_is_full_with_retry_after_and_room_lets_the_create_through() {
    let setup = Setup::new(PoolSpec::new(1)).await;
    let backend = setup.backend();
    let first = backend.create(&setup.spec(1)).await.unwrap();
    let waiting = setup.spec(2);
    match backend.create(&waiting).await {
        Err(ExecutorError::Full {
            retry_after,
            source,
        }) => {
            assert_eq!(retry_after, Some(POOL_ACQUISITION_TIMEOUT));
            // The client's own error, kept as the cause, not a string made of it.
            let client = source
                .downcast_ref::<ClientError>()
                .expect("the OpenSandbox client's error is the cause");
            assert!(
                client.to_string().contains("POOL_CAPACITY_EXHAUSTED"),
                "{client}"
            );
        }
        other => panic!("expected Full, got {other:?}"),
    }
    assert!(
        backend
            .find(waiting.assignment.id())
            .await
            .unwrap()
            .is_none(),
        "the refusal left no sandbox"
    );
    backend.delete(first.assignment.id()).await.unwrap();
    eventually(DEADLINE, "the first sandbox is gone", || async {
        backend
            .find(first.assignment.id())
            .await
            .unwrap()
            .is_none()
            .then_some(())
    })
    .await;
    let created = backend.create(&waiting).await.unwrap();
    assert_eq!(created.phase, Phase::Running);
    backend.delete(waiting.assignment.id()).await.unwrap();
}

/// The configuration contract: a missing pool and a wrong key are retried (the job stays
/// queued while the operator fixes it) with a message naming what to fix.
#[tokio::test]
async fn configuration_errors_name_the_setting_and_keep_the_job_queued() {
    let mut setup = Setup::new(PoolSpec::new(1)).await;
    setup.settings.pool = unique("missing");
    let error = setup.backend().create(&setup.spec(1)).await.unwrap_err();
    assert!(matches!(error, ExecutorError::Unavailable(_)), "{error}");
    assert!(
        error
            .to_string()
            .contains(&format!("pool `{}` not found", setup.settings.pool)),
        "{error}"
    );
    let wrong_key = OpenSandboxBackend::new(
        setup.settings.clone(),
        crate::opensandbox_common::client_with(setup.server, settings(setup.server), "wrong"),
    )
    .unwrap();
    let error = wrong_key.list().await.unwrap_err();
    assert!(matches!(error, ExecutorError::Unavailable(_)), "{error}");
    assert!(
        error.to_string().contains("opensandbox_api_key_file"),
        "{error}"
    );
}

/// The phase contract: an executor that exited leaves its sandbox `Running` (completion
/// comes from the terminal marker or the idle timeout, never from the state), while a
/// failed task reads `Finished` with the server's reason.
#[tokio::test]
async fn an_exited_executor_stays_running_and_a_failed_task_is_finished_with_its_reason() {
    let mut spawning = PoolSpec::new(2);
    spawning.spawn = true;
    let mut setup = Setup::new(spawning).await;
    setup.settings.entrypoint = vec!["/bin/sh".into(), "-c".into(), "exit 3".into()];
    let backend = setup.backend();
    let exited = backend.create(&setup.spec(1)).await.unwrap();
    let pod = eventually(DEADLINE, "the entrypoint exits", || async {
        let info = setup.server.control.sandbox(&exited.name).await.unwrap()?;
        info.pod.filter(|p| p.exit_code.is_some())
    })
    .await;
    assert_eq!(pod.exit_code, Some(3));
    let found = backend.find(exited.assignment.id()).await.unwrap().unwrap();
    assert_eq!(
        found.phase,
        Phase::Running,
        "OpenSandbox keeps a sandbox whose process exited Running"
    );

    let failing = backend.create(&setup.spec(2)).await.unwrap();
    assert!(
        setup
            .server
            .control
            .fail_sandbox(&failing.name)
            .await
            .unwrap()
    );
    match backend
        .find(failing.assignment.id())
        .await
        .unwrap()
        .unwrap()
        .phase
    {
        Phase::Finished {
            success: false,
            reason: Some(reason),
        } => {
            assert!(reason.contains("TASK_FAILED"), "{reason}");
        }
        other => panic!("expected Finished, got {other:?}"),
    }
    backend.delete(exited.assignment.id()).await.unwrap();
    backend.delete(failing.assignment.id()).await.unwrap();
}

/// DESIGN invariant 8 (metadata is never trusted as it is): a sandbox carrying the runner
/// and assignment labels but broken annotation chunks is skipped by recovery, refused by
/// find (so no second executor is created beside it), and still deleted.
#[tokio::test]
async fn a_sandbox_with_tampered_metadata_is_skipped_refused_and_deletable() {
    let setup = Setup::new(PoolSpec::new(2)).await;
    let backend = setup.backend();
    let spec = setup.spec(7);
    let codec = &setup.settings.codec;
    let mut metadata = codec.flatten(&spec.metadata).unwrap();
    metadata.insert(
        codec.key(&format!("{}000", keys::ANNOTATION_CHUNK)),
        "AAAA".into(),
    );
    let tampered = client(setup.server)
        .create(&CreateSandbox {
            pool: setup.settings.pool.clone(),
            entrypoint: setup.settings.entrypoint.clone(),
            env: BTreeMap::new(),
            metadata,
            timeout: Some(Duration::from_secs(600)),
        })
        .await
        .unwrap();
    let good = backend.create(&setup.spec(8)).await.unwrap();
    let listed = backend.list().await.unwrap();
    assert_eq!(
        listed.iter().map(|r| r.name.as_str()).collect::<Vec<_>>(),
        vec![good.name.as_str()],
        "recovery skips the tampered sandbox"
    );
    assert!(matches!(
        backend.find(spec.assignment.id()).await,
        Err(ExecutorError::Permanent(_))
    ));
    assert!(
        matches!(
            backend.create(&spec).await,
            Err(ExecutorError::Permanent(_))
        ),
        "no second sandbox beside it"
    );
    backend.delete(spec.assignment.id()).await.unwrap();
    eventually(DEADLINE, "the tampered sandbox is deleted", || async {
        client(setup.server)
            .get(&tampered.id)
            .await
            .unwrap()
            .is_none()
            .then_some(())
    })
    .await;
    backend.delete(good.assignment.id()).await.unwrap();
}

/// A job may run longer than the sandbox timeout: every lifecycle pass (`list`) extends
/// the expiry of running sandboxes close to it, and leaves terminal-marked ones to expire.
#[tokio::test]
async fn listing_extends_running_sandboxes_close_to_expiry_but_not_terminal_ones() {
    let mut setup = Setup::new(PoolSpec::new(2)).await;
    setup.settings.timeout = Duration::from_secs(120);
    setup.settings.renew_before = Duration::from_secs(119);
    let backend = setup.backend();
    let running = backend.create(&setup.spec(1)).await.unwrap();
    let terminal = backend.create(&setup.spec(2)).await.unwrap();
    backend
        .mark_terminal(terminal.assignment.id())
        .await
        .unwrap();
    let client = client(setup.server);
    let expiry = |id: String| {
        let client = client.clone();
        async move { client.get(&id).await.unwrap().unwrap().expires_at.unwrap() }
    };
    let (first_running, first_terminal) = (
        expiry(running.name.clone()).await,
        expiry(terminal.name.clone()).await,
    );
    eventually(DEADLINE, "a pass extends the running sandbox", || async {
        backend.list().await.unwrap();
        (expiry(running.name.clone()).await > first_running).then_some(())
    })
    .await;
    // The terminal sandbox becomes due a moment after the running one; one more pass once
    // it is due shows that it is left alone.
    let renew_before = setup.settings.renew_before;
    eventually(DEADLINE, "the terminal sandbox is due", || async {
        (SystemTime::now() + renew_before > first_terminal).then_some(())
    })
    .await;
    backend.list().await.unwrap();
    assert_eq!(
        expiry(terminal.name.clone()).await,
        first_terminal,
        "a terminal sandbox is not extended"
    );
    backend.delete(running.assignment.id()).await.unwrap();
    backend.delete(terminal.assignment.id()).await.unwrap();
}

/// DESIGN invariants 14 and 16, as far as they reach without a controller: the sandbox's
/// entrypoint is the real executor, started (as a kubelet would) with the assignment's
/// environment from the sandbox spec; it fetches the job's SVID from the Workload API it
/// was pointed at and writes the one-shot `.runner` with the assignment ID and capability.
/// With no facade it gives up after its ready timeout (its runner, which would wait, is
/// started at once: no probe of the facade precedes it), and the sandbox stays `Running`;
/// deleting the sandbox stops its process.
#[tokio::test]
async fn the_sandbox_entrypoint_runs_the_real_executor_with_the_assignment_environment() {
    let mut spawning = PoolSpec::new(1);
    spawning.spawn = true;
    let mut setup = Setup::new(spawning).await;
    let dir = tempfile::tempdir().unwrap();
    let spec = setup.spec(42);
    let ca = TestCa::new("example.org").unwrap();
    let workload = FakeWorkloadApi::start(dir.path(), ca, spec.assignment.identity().spiffe_id())
        .await
        .unwrap();
    let work = dir.path().join("work");
    std::fs::create_dir(&work).unwrap();
    // A runner that waits for the facade as the real one would (its first call never
    // gets an answer here).
    let runner = dir.path().join("runner");
    std::fs::write(&runner, "#!/bin/sh\nexec sleep 60\n").unwrap();
    std::fs::set_permissions(&runner, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    setup.settings.entrypoint = vec![
        env!("CARGO_BIN_EXE_gitea-dynamic-runner").into(),
        "executor".into(),
    ];
    setup.settings.extra_env = BTreeMap::from([
        (env::SPIFFE_ENDPOINT_SOCKET.into(), workload.endpoint()),
        ("CI_RUNNER_WORKDIR".into(), work.display().to_string()),
        ("CI_EXECUTOR_READY_TIMEOUT".into(), "1".into()),
        ("GITEA_RUNNER_BINARY".into(), runner.display().to_string()),
    ]);
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let spec = ExecutorSpec {
        facade_url: format!("https://127.0.0.1:{closed}"),
        ..spec
    };
    let backend = setup.backend();
    let record = backend.create(&spec).await.unwrap();

    let info = setup
        .server
        .control
        .sandbox(&record.name)
        .await
        .unwrap()
        .unwrap();
    let pod = info.pod.expect("the sandbox has a pod");
    assert_eq!(pod.command, setup.settings.entrypoint);
    assert_eq!(pod.env[env::ASSIGNMENT_ID], spec.assignment.id().as_str());
    assert_eq!(pod.env[env::CAPABILITY], spec.capability.expose());
    assert_eq!(
        pod.env[env::SPIFFE_ID],
        spec.assignment.identity().spiffe_id()
    );
    assert_eq!(pod.env[env::BACKEND], "vm");

    let runner: serde_json::Value = eventually(DEADLINE, "the executor writes .runner", || async {
        let text = std::fs::read_to_string(work.join(".runner")).ok()?;
        serde_json::from_str(&text).ok()
    })
    .await;
    assert_eq!(runner["uuid"], spec.assignment.id().as_str());
    assert_eq!(runner["token"], spec.capability.expose());
    assert!(workload.fetch_count() > 0, "the executor fetched its SVID");
    let exited = eventually(
        DEADLINE,
        "the executor gives up on the missing facade",
        || async {
            let info = setup.server.control.sandbox(&record.name).await.unwrap()?;
            info.pod.filter(|p| p.exit_code.is_some())
        },
    )
    .await;
    assert_ne!(exited.exit_code, Some(0));
    let log = std::fs::read_to_string(&exited.log).unwrap();
    assert!(
        !log.contains(spec.capability.expose()),
        "the executor never logs its capability"
    );
    assert_eq!(
        backend
            .find(spec.assignment.id())
            .await
            .unwrap()
            .unwrap()
            .phase,
        Phase::Running
    );
    backend.delete(spec.assignment.id()).await.unwrap();
}

/// A sandbox started by the executor is stopped with its sandbox: deleting the sandbox
/// ends the local process (no VM outlives its executor record).
#[tokio::test]
async fn deleting_a_sandbox_stops_its_process() {
    let mut spawning = PoolSpec::new(1);
    spawning.spawn = true;
    let setup = Setup::new(spawning).await;
    let backend = setup.backend();
    let record = backend.create(&setup.spec(5)).await.unwrap();
    let pid = eventually(DEADLINE, "the sandbox process runs", || async {
        setup
            .server
            .control
            .sandbox(&record.name)
            .await
            .unwrap()?
            .pod?
            .pid
    })
    .await;
    assert!(std::path::Path::new(&format!("/proc/{pid}")).exists());
    backend.delete(record.assignment.id()).await.unwrap();
    eventually(DEADLINE, "the process is gone", || async {
        (!std::path::Path::new(&format!("/proc/{pid}")).exists()).then_some(())
    })
    .await;
}

/// The static environment a warm member's executor gets (the controller's is its workers').
fn standby_environment(facade: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (env::FACADE_URL.to_owned(), facade.to_owned()),
        (
            env::FACADE_SPIFFE_ID.to_owned(),
            "spiffe://example.org/gitea-runner-facade".to_owned(),
        ),
        (env::BACKEND.to_owned(), "vm".to_owned()),
        (env::RUNNER_LABEL.to_owned(), "vm".to_owned()),
    ])
}

impl Setup {
    /// A backend with `vm_warm_pool = count` whose members' executors reach `facade`.
    fn warm_backend(&self, count: u32, facade: &str) -> OpenSandboxBackend {
        let mut settings = self.settings.clone();
        settings.warm_pool = count;
        let backend = OpenSandboxBackend::new(settings, client(self.server)).unwrap();
        backend.set_standby_environment(standby_environment(facade));
        backend
    }

    /// The unclaimed warm members, by sandbox ID, with their metadata.
    async fn members(&self) -> BTreeMap<String, BTreeMap<String, String>> {
        let query = gdr_backends::opensandbox::client::ListQuery {
            metadata: BTreeMap::from([(self.settings.codec.key(warm::WARM_KEY), "true".into())]),
            states: Vec::new(),
            page_size: 200,
        };
        client(self.server)
            .list(&query)
            .await
            .unwrap()
            .into_iter()
            .map(|s| (s.id.clone(), s.metadata()))
            .collect()
    }

    /// How many sandboxes the test's pool holds, of any kind.
    async fn sandboxes_in_pool(&self) -> usize {
        self.server
            .control
            .sandboxes(&self.settings.pool)
            .await
            .unwrap()
            .len()
    }
}

/// Issue 39 item 5, DESIGN invariant 7: a pass fills the warm pool to `vm_warm_pool` with
/// sandboxes carrying no assignment (so recovery does not list them) and a standby ID in
/// both their metadata and their executor's environment; after the members' environment
/// changes, the next pass replaces the outdated members.
#[tokio::test]
async fn the_warm_pass_fills_the_pool_to_its_count_and_replaces_outdated_members() {
    // Spawning: the testkit's kubelet starts each sandbox's process with its environment.
    let mut spawning = PoolSpec::new(6);
    spawning.spawn = true;
    let setup = Setup::new(spawning).await;
    let backend = setup.warm_backend(2, "https://facade-1.test");
    let pass = backend.reconcile_warm_pool().await.unwrap();
    assert_eq!(pass.created, 2);
    let first = setup.members().await;
    assert_eq!(first.len(), 2, "{first:?}");
    assert!(backend.list().await.unwrap().is_empty(), "no executor yet");
    let standby_key = setup.settings.codec.key(STANDBY_ID_KEY);
    for (id, metadata) in &first {
        let pod = setup.server.control.sandbox(id).await.unwrap().unwrap().pod;
        let env = pod.expect("the member has a pod").env;
        assert_eq!(env.get(env::STANDBY_ID), metadata.get(&standby_key));
        assert_eq!(env[env::FACADE_URL], "https://facade-1.test");
        assert!(!env.contains_key(env::CAPABILITY), "no capability: {env:?}");
        assert!(
            !env.contains_key(env::ASSIGNMENT_ID),
            "no assignment: {env:?}"
        );
    }
    let again = backend.reconcile_warm_pool().await.unwrap();
    assert_eq!(
        (again.created, again.deleted),
        (0, 0),
        "a full pool is kept"
    );

    let changed = setup.warm_backend(2, "https://facade-2.test");
    let replaced = changed.reconcile_warm_pool().await.unwrap();
    assert_eq!((replaced.created, replaced.deleted), (2, 2));
    assert_eq!(replaced.deleted_by.get("outdated"), Some(&2));
    // Deleted sandboxes stay listed a moment while they stop.
    eventually(DEADLINE, "only the two new members are left", || async {
        let now = setup.members().await;
        (now.len() == 2 && now.keys().all(|id| !first.contains_key(id))).then_some(())
    })
    .await;

    let off = setup.warm_backend(0, "https://facade-2.test");
    let emptied = off.reconcile_warm_pool().await.unwrap();
    assert_eq!((emptied.created, emptied.deleted), (0, 2));
    eventually(DEADLINE, "a pool turned off is emptied", || async {
        setup.members().await.is_empty().then_some(())
    })
    .await;
}

/// Issue 39 item 5, DESIGN invariant 8: a job's create claims a ready member instead of
/// creating a sandbox; the member becomes that job's executor (found, listed, its standby
/// ID naming the job, its start deadline counted from the claim), leaves the pool for
/// good, and is deleted with the job.
#[tokio::test]
async fn a_job_claims_a_ready_warm_member_which_becomes_its_executor_and_leaves_the_pool() {
    let setup = Setup::new(PoolSpec::new(4)).await;
    let backend = setup.warm_backend(1, "https://facade.test");
    backend.reconcile_warm_pool().await.unwrap();
    let members = setup.members().await;
    let (member, metadata) = members.iter().next().expect("one member");
    let standby = metadata[&setup.settings.codec.key(STANDBY_ID_KEY)].clone();
    assert!(backend.claimed_standby(&standby).await.unwrap().is_none());
    let before = setup.sandboxes_in_pool().await;

    let spec = setup.spec(1);
    let claimed_after = SystemTime::now() - Duration::from_secs(1);
    let record = backend.create(&spec).await.unwrap();
    assert_eq!(&record.name, member, "the member serves the job");
    assert_eq!(
        setup.sandboxes_in_pool().await,
        before,
        "no sandbox created"
    );
    assert!(
        record.created_at >= claimed_after,
        "created_at is the claim"
    );
    let found = backend.find(spec.assignment.id()).await.unwrap().unwrap();
    assert_eq!(&found.name, member);
    let listed = backend.list().await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(&listed[0].name, member);
    let by_standby = backend.claimed_standby(&standby).await.unwrap().unwrap();
    assert_eq!(by_standby.assignment.id(), spec.assignment.id());
    assert_eq!(
        by_standby.assignment.identity().spiffe_id(),
        spec.assignment.identity().spiffe_id()
    );
    assert!(backend.claimed_standby("unknown").await.unwrap().is_none());

    let refill = backend.reconcile_warm_pool().await.unwrap();
    assert_eq!(refill.created, 1, "the pool is refilled");
    assert_eq!(refill.claims.get("claimed"), Some(&1));
    assert!(
        !setup.members().await.contains_key(member),
        "never again a member"
    );

    backend.delete(spec.assignment.id()).await.unwrap();
    eventually(DEADLINE, "the claimed member is deleted", || async {
        client(setup.server)
            .get(member)
            .await
            .unwrap()
            .is_none()
            .then_some(())
    })
    .await;
    assert_eq!(setup.members().await.len(), 1);
}

/// DESIGN invariant 8: two jobs created at once (two replicas, one arbiter) with one
/// ready member: exactly one gets it, the other a sandbox of its own.
#[tokio::test]
async fn two_jobs_racing_for_one_warm_member_get_it_once_and_a_fresh_sandbox_invariant_8() {
    let setup = Setup::new(PoolSpec::new(4)).await;
    let claims: Arc<dyn WarmClaims> = Arc::new(LocalWarmClaims::default());
    let replica = || {
        setup
            .warm_backend(1, "https://facade.test")
            .with_warm_claims(claims.clone())
    };
    let (one, two) = (replica(), replica());
    one.reconcile_warm_pool().await.unwrap();
    let member = setup.members().await.into_keys().next().expect("a member");
    let (a, b) = (setup.spec(1), setup.spec(2));
    let (ra, rb) = tokio::join!(one.create(&a), two.create(&b));
    let (ra, rb) = (ra.unwrap(), rb.unwrap());
    let served: Vec<_> = [&ra, &rb]
        .into_iter()
        .filter(|r| r.name == member)
        .collect();
    assert_eq!(
        served.len(),
        1,
        "exactly one job has the member: {ra:?} {rb:?}"
    );
    assert_ne!(ra.name, rb.name);
    for (backend, spec) in [(&one, &a), (&two, &b)] {
        let found = backend.find(spec.assignment.id()).await.unwrap().unwrap();
        assert_eq!(found.assignment.id(), spec.assignment.id());
        assert_eq!(found.phase, Phase::Running);
    }
    one.delete(a.assignment.id()).await.unwrap();
    two.delete(b.assignment.id()).await.unwrap();
}

/// Issue 39 item 5, DESIGN invariant 14: the test kit's VM host boots a warm member's
/// executor before any job with no identity (`sandbox-identity` would refuse a sandbox
/// naming no job), and serves the claiming job's SPIFFE ID once the claim's metadata is
/// there, as `sandbox-identity` would bind it.
#[tokio::test]
async fn a_warm_members_vm_has_no_identity_until_a_job_claims_it_then_the_jobs() {
    let setup = Setup::new(PoolSpec::new(2)).await;
    let dir = tempfile::Builder::new().prefix("vm").tempdir().unwrap();
    let host = VmHost::start(VmHostConfig {
        control: setup.server.control.clone(),
        pool: setup.settings.pool.clone(),
        ca: TestCa::new("example.org").unwrap(),
        identity: EntryTemplate {
            trust_domain: setup.settings.trust_domain.clone(),
            cluster: "sandbox-kata".into(),
            class_name: "spire-mgmt-spire".into(),
            runner_uid: 2000,
            codec: setup.settings.codec.clone(),
        },
        dir: dir.path().to_path_buf(),
    });
    let backend = setup.warm_backend(1, "https://facade.test");
    backend.reconcile_warm_pool().await.unwrap();
    let vm = eventually(DEADLINE, "the member's VM boots", || async {
        host.vms().into_iter().find(|vm| vm.pid.is_some())
    })
    .await;
    assert!(vm.standby_id.is_some(), "{vm:?}");
    assert!(vm.identity.is_err(), "no job, no identity: {vm:?}");
    assert!(vm.assignment_id.is_none());

    let spec = setup.spec(3);
    let record = backend.create(&spec).await.unwrap();
    assert_eq!(record.name, vm.sandbox);
    let claimed = eventually(DEADLINE, "the VM serves the job's identity", || async {
        host.vms()
            .into_iter()
            .find(|v| v.sandbox == vm.sandbox && v.identity.is_ok())
    })
    .await;
    assert_eq!(
        claimed.identity.as_deref(),
        Ok(spec.assignment.identity().spiffe_id())
    );
    assert_eq!(
        claimed.assignment_id.as_deref(),
        Some(spec.assignment.id().as_str())
    );
    assert_eq!(host.vms().len(), 1, "no second VM for the job");
    backend.delete(spec.assignment.id()).await.unwrap();
}

/// Issue 39 item 5, DESIGN invariant 8: a claimant that won a member in the arbiter and
/// died before its patch leaves the member held and unclaimed. The same job's retry gets
/// that member back (the arbiter answers its holder again); a member held for another
/// job that never comes back can serve no one, so a pass past the hold grace discards it
/// as ended and replaces it.
#[tokio::test]
async fn a_member_a_dead_claimant_left_held_goes_to_its_retry_or_is_discarded_after_the_grace() {
    let mut setup = Setup::new(PoolSpec::new(4)).await;
    setup.settings.warm_hold_grace = Duration::from_secs(1);
    let claims: Arc<dyn WarmClaims> = Arc::new(LocalWarmClaims::default());
    let backend = setup
        .warm_backend(1, "https://facade.test")
        .with_warm_claims(claims.clone());
    backend.reconcile_warm_pool().await.unwrap();
    let member = setup.members().await.into_keys().next().expect("a member");

    // The claimant of job 1 won the member, then died before patching it.
    let retried = setup.spec(1);
    assert!(
        claims
            .claim(&member, retried.assignment.id())
            .await
            .unwrap()
    );
    let record = backend.create(&retried).await.unwrap();
    assert_eq!(record.name, member, "the retry gets its member back");
    backend.delete(retried.assignment.id()).await.unwrap();

    backend.reconcile_warm_pool().await.unwrap();
    let orphan = eventually(DEADLINE, "a new member", || async {
        setup.members().await.into_keys().find(|id| *id != member)
    })
    .await;
    // Job 2's claimant won this one and died; job 2 never comes back.
    let gone = AssignmentId::from_task_id(2).unwrap();
    assert!(claims.claim(&orphan, &gone).await.unwrap());
    let other = setup.spec(3);
    let fresh = backend.create(&other).await.unwrap();
    assert_ne!(fresh.name, orphan, "a held member serves no other job");
    let discarded = std::sync::atomic::AtomicUsize::new(0);
    eventually(DEADLINE, "a pass discards the held member", || async {
        let pass = backend.reconcile_warm_pool().await.unwrap();
        let ended = pass.deleted_by.get("ended").copied().unwrap_or(0);
        let total = discarded.fetch_add(ended, std::sync::atomic::Ordering::Relaxed) + ended;
        (total == 1).then_some(())
    })
    .await;
    eventually(DEADLINE, "a replacement takes its place", || async {
        let now = setup.members().await;
        (now.len() == 1 && !now.contains_key(&orphan)).then_some(())
    })
    .await;
    backend.delete(other.assignment.id()).await.unwrap();
}
