//! The queue is a trust boundary (DESIGN invariants 20, 21, 22), tested from outside: the
//! real controller binary against a real nats-server (its embedded one, or a server of the
//! test's own that the test can also publish to as an intruder would) and the mock Gitea.
//!
//! Every wait is on observable state with a deadline; counts are asserted only after the
//! message they concern is seen settled.

use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;
use std::time::Duration;

use async_nats::jetstream;
use futures::StreamExt as _;
use gdr_controller::queue;
use gdr_core::assignment::{
    Assignment, EnvelopeError, EnvelopeRules, TaskKey, TaskKeyring, decode_with, encode_v2,
    encode_v2_with_id_mac,
};
use gdr_core::backend::Backend;
use gdr_core::capability::CapabilityKey;
use gdr_gitea::{ClientOptions, Credentials, GiteaClient};
use gdr_testkit::controller::{CAPABILITY_KEY, ControllerFixture};
use gdr_testkit::local_controller::{LocalController, Stop, stop};
use gdr_testkit::mock_gitea::{JobId, MockConfig, RpcMethod, Status};
use gdr_testkit::nats_server::NatsServer;
use gdr_testkit::{eventually, until};

use crate::queue_common::{STREAM, policy, stream_settings};

const WAIT: Duration = Duration::from_secs(60);
const BIN: &str = env!("CARGO_BIN_EXE_gitea-dynamic-runner");
const STANDIN: &str = env!("CARGO_BIN_EXE_gitea-runner-standin");
const POD_SUBJECT: &str = "ci.runner.pod";
/// Two task keys (64 hex digits each): the one an envelope is sealed with, and another.
const KEY_ONE: &str = "1111111111111111111111111111111111111111111111111111111111111111";
const KEY_TWO: &str = "2222222222222222222222222222222222222222222222222222222222222222";

fn task_key(key: &str) -> TaskKey {
    TaskKey::from_file_contents(key.as_bytes()).expect("a task key")
}

fn keyring(current: &str, previous: &[&str]) -> TaskKeyring {
    TaskKeyring::new(
        task_key(current),
        previous.iter().map(|k| task_key(k)).collect(),
    )
}

/// The fixture's trust domain and the default backend labels.
/// A controller with the pod backend only, on a nats-server of the test's own (the test
/// reads and writes its stream directly), sealing envelopes with [`KEY_ONE`].
async fn on_own_nats(
    nats: &NatsServer,
    configure: impl FnOnce(ControllerFixture) -> ControllerFixture,
) -> LocalController {
    on_own_nats_with(MockConfig::default(), nats, configure).await
}

/// [`on_own_nats`] with a mock Gitea of `mock`.
async fn on_own_nats_with(
    mock: MockConfig,
    nats: &NatsServer,
    configure: impl FnOnce(ControllerFixture) -> ControllerFixture,
) -> LocalController {
    LocalController::start(mock, BIN.as_ref(), STANDIN.as_ref(), |f| {
        let key_one = f.file("secrets/task-key-one", KEY_ONE);
        let f = f
            .set("nats_url", nats.url())
            .set("components", "scheduler,pod-worker")
            .set("pod_capacity", 1u32)
            .set("vm_capacity", 0u32)
            .set("heartbeat_interval", "1s")
            .set("nats_ack_wait", "3s")
            .set("task_encryption_key_file", key_one.as_path());
        configure(f)
    })
    .await
}

async fn jetstream_of(nats: &NatsServer) -> jetstream::Context {
    jetstream::new(async_nats::connect(nats.url()).await.expect("connect"))
}

/// Messages per subject in the controller's stream (0 while it does not exist yet).
async fn on_subject(js: &jetstream::Context, subject: &str) -> u64 {
    let Ok(stream) = js.get_stream(STREAM).await else {
        return 0;
    };
    let settings = stream_settings();
    let counts = if subject.contains(".held.") {
        queue::held_per_backend(&stream, &settings).await
    } else {
        queue::unclaimed_per_backend(&stream, &settings).await
    };
    counts
        .ok()
        .and_then(|c| c.get(&Backend::Pod).copied())
        .unwrap_or(0)
}

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .permissions()
        .mode()
        & 0o777
}

/// The port the embedded nats-server listens on, from the controller's start-up log line.
fn embedded_nats_url(log: &str) -> Option<String> {
    log.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|l| l["message"] == "embedded nats-server started")
        .and_then(|l| l["port"].as_u64())
        .map(|port| format!("nats://127.0.0.1:{port}"))
}

/// DESIGN invariant 21: loopback is no trust boundary, so the embedded nats-server of the
/// single-host mode requires the credentials the controller generated under `state_dir`.
/// A client without them (or with a wrong password) is refused with an authorization
/// violation; with the generated worker and producer passwords it connects and sees the
/// controller's stream. The store is 0700 and the credential files 0600.
#[tokio::test(flavor = "multi_thread")]
async fn an_anonymous_client_is_refused_by_the_embedded_nats_server() {
    let c = LocalController::start(MockConfig::default(), BIN.as_ref(), STANDIN.as_ref(), |f| {
        f.set("nats_server_binary", NatsServer::binary().as_path())
            .set("pod_capacity", 1u32)
            .set("vm_capacity", 0u32)
    })
    .await;
    let mut controller = c.spawn(&[]);
    c.ready().await;
    let url = embedded_nats_url(&c.fixture.log())
        .unwrap_or_else(|| panic!("no embedded server in the log:\n{}", c.fixture.log()));

    let store = c.fixture.state_dir().join("nats");
    let password = |user: &str| {
        std::fs::read_to_string(store.join(format!("{user}.password"))).expect("a password file")
    };
    let intruders = [
        ("an anonymous client", async_nats::ConnectOptions::new()),
        (
            "another user's password",
            async_nats::ConnectOptions::with_user_and_password(
                "gdr-worker".into(),
                password("gdr-producer"),
            ),
        ),
    ];
    for (who, options) in intruders {
        let refused = options
            .connect(&url)
            .await
            .expect_err("the intruder is refused");
        assert_eq!(
            refused.kind(),
            async_nats::ConnectErrorKind::AuthorizationViolation,
            "{who}: {refused}"
        );
    }

    for user in ["gdr-producer", "gdr-worker"] {
        let client =
            async_nats::ConnectOptions::with_user_and_password(user.into(), password(user))
                .connect(&url)
                .await
                .unwrap_or_else(|e| panic!("{user} connects with its generated password: {e}"));
        let mut stream = jetstream::new(client)
            .get_stream(STREAM)
            .await
            .unwrap_or_else(|e| panic!("{user} sees the controller's stream: {e}"));
        assert_eq!(stream.info().await.expect("info").config.name, STREAM);
    }

    assert_eq!(mode(&store), 0o700, "the store directory");
    for file in ["gdr-producer.password", "gdr-worker.password", "auth.conf"] {
        assert_eq!(mode(&store.join(file)), 0o600, "{file}");
    }
    stop(&mut controller, Stop::Term).await;
}

/// DESIGN invariant 20: an assignment runs at most once, ever. A finished job's real
/// envelope (captured off the wire, so it is authentic: sealed, its fetch time recent) is
/// published again without a message ID and under a new one, so JetStream's de-duplication
/// does not stop it. Each copy is terminated through the finished-assignments bucket: no
/// second executor, no second runner, no second final result in Gitea.
#[tokio::test(flavor = "multi_thread")]
async fn a_replayed_finished_envelope_never_runs_again() {
    let nats = NatsServer::start().await.expect("nats");
    let c = on_own_nats(&nats, |f| f).await;
    let client = async_nats::connect(nats.url()).await.expect("connect");
    // A plain subscriber gets a copy of every envelope the scheduler publishes.
    let mut wire = client.subscribe(POD_SUBJECT).await.expect("subscribe");
    let js = jetstream::new(client);

    let mut controller = c.spawn(&[]);
    let job = c.queue("standin:success");
    let envelope = tokio::time::timeout(WAIT, wire.next())
        .await
        .expect("the scheduler publishes the assignment")
        .expect("subscription open")
        .payload;
    // Sealed, with its fetch time authenticated: once older than Gitea's endless-task
    // timeout the copy is refused by age, when the finished record may have expired.
    let opened = decode_with(
        &envelope,
        &policy(),
        Some(&keyring(KEY_ONE, &[])),
        &EnvelopeRules::permissive(),
    )
    .expect("the real envelope opens");
    let fetched = opened
        .fetch_time()
        .expect("the envelope carries its fetch time");
    let lifetime = Duration::from_secs(3 * 3600);
    let later = EnvelopeRules {
        accept_plaintext: false,
        max_age: lifetime,
        accept_undated: false,
        now: fetched + lifetime + Duration::from_secs(2),
    };
    assert!(matches!(
        decode_with(&envelope, &policy(), Some(&keyring(KEY_ONE, &[])), &later),
        Err(EnvelopeError::Expired { .. })
    ));
    c.status(job, Status::Success).await;
    c.no_executor_left().await;
    let task_id = c
        .mock
        .handle
        .job(job)
        .and_then(|j| j.task_id)
        .expect("task");
    let id = format!("gitea-task-{task_id}");
    let finished = js
        .get_key_value("CI_RUNNER_FINISHED")
        .await
        .expect("the finished-assignments bucket");
    assert!(
        finished.get(&id).await.expect("read").is_some(),
        "{id} is recorded as finished"
    );
    let results = || {
        c.mock
            .handle
            .task(task_id)
            .map(|t| t.results_reported)
            .unwrap_or(0)
    };
    assert_eq!(results(), 1, "one final result reached Gitea");
    let created = || {
        c.fixture
            .log()
            .lines()
            .filter(|l| l.contains("executor created") && l.contains(&id))
            .count()
    };
    assert_eq!(created(), 1);

    let mut last = 0;
    for message_id in [None, Some("a-new-message-id")] {
        let mut publish = jetstream::message::PublishMessage::build().payload(envelope.clone());
        if let Some(message_id) = message_id {
            publish = publish.message_id(message_id);
        }
        let ack = js
            .send_publish(POD_SUBJECT, publish)
            .await
            .expect("publish")
            .await
            .expect("stored");
        assert!(!ack.duplicate, "JetStream stores the copy");
        last = ack.sequence;
    }
    // Settled: both copies left the stream and the consumer's ack floor passed them.
    until(WAIT, "both copies settled", || async {
        let Ok(stream) = js.get_stream(STREAM).await else {
            return false;
        };
        let Ok(consumer) = stream.consumer_info("pod").await else {
            return false;
        };
        consumer.ack_floor.stream_sequence >= last
            && consumer.num_pending == 0
            && consumer.num_ack_pending == 0
            && on_subject(&js, POD_SUBJECT).await == 0
    })
    .await;
    assert_eq!(created(), 1, "no second executor");
    assert_eq!(c.executors(), 0);
    let replayed = "gitea_dynamic_runner_assignments_total{backend=\"pod\",outcome=\"replayed\"}";
    until(WAIT, "both copies counted as replays", || async {
        c.metric(replayed).await == Some(2)
    })
    .await;
    assert_eq!(
        c.fixture
            .log()
            .matches("terminating an assignment that finished before (a replayed envelope)")
            .count(),
        2
    );
    assert_eq!(c.runs_of(job), 1, "no second runner");
    assert_eq!(results(), 1, "no second final result reached Gitea");
    assert_eq!(
        c.mock.handle.job(job).map(|j| j.status),
        Some(Status::Success)
    );
    stop(&mut controller, Stop::Term).await;
}

/// The task of a job queued now, fetched with the controller's own runner credential (as
/// another replica would), sealed with [`KEY_ONE`] and published to the pod subject, as the
/// scheduler writes it (fetch time, `id_mac` under the shared capability key): the
/// envelope a key-rotation mistake leaves for a controller without that key.
async fn published_with_key_one(c: &LocalController, js: &jetstream::Context) -> JobId {
    published_sealed(c, js, "standin:success", true).await
}

/// A job queued now whose task is published sealed with [`KEY_ONE`], as another replica
/// of this release would, or (`current` false) as an older release did: no fetch time,
/// no `id_mac`.
async fn published_sealed(
    c: &LocalController,
    js: &jetstream::Context,
    step: &str,
    current: bool,
) -> JobId {
    let job = c.queue(step);
    let credential = |name: &str| {
        std::fs::read_to_string(c.fixture.path().join("secrets").join(name)).expect("credential")
    };
    let gitea = GiteaClient::new(
        ClientOptions::new(c.mock.url.clone()),
        Some(&Credentials::new(credential("uuid"), credential("token"))),
    )
    .expect("client");
    let task = gitea
        .fetch_task(0)
        .await
        .expect("fetch")
        .task
        .into_option()
        .expect("the queued task");
    let mut assignment = Assignment::from_task(task, &policy()).expect("assignment");
    let sealed = if current {
        let id_key = CapabilityKey::new(CAPABILITY_KEY.as_bytes())
            .expect("capability key")
            .envelope_id_key();
        assignment = assignment.with_fetch_time(std::time::SystemTime::now());
        encode_v2_with_id_mac(&assignment, &keyring(KEY_ONE, &[]), &id_key)
    } else {
        encode_v2(&assignment, &keyring(KEY_ONE, &[]))
    }
    .expect("seal");
    queue::ensure_stream(js, &stream_settings())
        .await
        .expect("stream");
    queue::publish(
        js,
        &stream_settings(),
        Backend::Pod,
        assignment.id().as_str(),
        sealed.into(),
    )
    .await
    .expect("publish");
    job
}

/// A controller of [`on_own_nats`] that has only [`KEY_TWO`].
async fn with_key_two_only(
    nats: &NatsServer,
    configure: impl FnOnce(ControllerFixture) -> ControllerFixture,
) -> LocalController {
    on_own_nats(nats, |f| {
        let key_two = f.file("secrets/task-key-two", KEY_TWO);
        configure(f.set("task_encryption_key_file", key_two.as_path()))
    })
    .await
}

/// Waits until the controller moved the envelope sealed with the unknown key to the held
/// subject (counted, logged), leaving nothing on the pod subject.
async fn held(c: &LocalController, js: &jetstream::Context) {
    let outcome = "gitea_dynamic_runner_assignments_total{backend=\"pod\",outcome=\"held\"}";
    until(WAIT, "the assignment moved to the held subject", || async {
        on_subject(js, "ci.runner.held.pod").await == 1
            && on_subject(js, POD_SUBJECT).await == 0
            && c.metric(outcome).await == Some(1)
    })
    .await;
    assert!(
        c.fixture.log().contains(
            "cannot decrypt an assignment: setting it aside until its task key is configured"
        ),
        "{}",
        c.fixture.log()
    );
}

/// DESIGN invariants 21 and 22: messages the controller cannot open never occupy admission
/// capacity, and are not lost. A controller lacking the key an envelope was sealed with
/// (a rotation rolled out in the wrong order) moves it to the held subject, so it takes
/// neither the pod backlog's room (1) nor the consumer's only ack slot, and the next job,
/// queued behind it, is fetched and runs on the capacity-1 backend. Restarted with the key among
/// `task_encryption_previous_key_files`, it releases the held envelope to its backend and
/// the job runs, once.
#[tokio::test(flavor = "multi_thread")]
async fn a_held_envelope_is_released_when_its_key_appears() {
    let nats = NatsServer::start().await.expect("nats");
    let js = jetstream_of(&nats).await;
    let mut c = with_key_two_only(&nats, |f| f).await;
    let sealed = published_with_key_one(&c, &js).await;

    let mut first = c.spawn(&[]);
    // Queued behind the sealed one: it runs only if that one leaves the only slot free.
    let next = c.queue("standin:success");
    c.status(next, Status::Success).await;
    held(&c, &js).await;
    let waiting = c
        .mock
        .handle
        .job(sealed)
        .and_then(|j| j.task)
        .expect("task");
    assert_eq!(waiting.status, Status::Running, "the held job waits");
    assert!(waiting.heartbeats > 0, "kept alive in Gitea meanwhile");
    assert_eq!(c.runs_of(sealed), 0);
    stop(&mut first, Stop::Term).await;

    let key_one = c.fixture.path().join("secrets/task-key-one");
    c.fixture
        .replace("task_encryption_previous_key_files", key_one.as_path());
    let mut second = c.spawn(&[]);
    // At once at start, unless the previous controller had looked at the held message
    // already (it then waits out that look's 30 s delay and the next look's).
    c.status_within(sealed, Status::Success, Duration::from_secs(120))
        .await;
    assert_eq!(c.runs_of(sealed), 1);
    assert!(
        c.fixture
            .log()
            .contains("a held assignment's task key is configured now; released to its backend"),
        "{}",
        c.fixture.log()
    );
    assert_eq!(on_subject(&js, "ci.runner.held.pod").await, 0);
    c.no_executor_left().await;
    stop(&mut second, Stop::Term).await;
}

/// DESIGN invariant 21: a held envelope whose key never appears is not left waiting
/// forever: after `held_assignment_timeout` (60 s, its minimum) its task is failed in Gitea
/// with a reason naming the unknown key and where to configure it, and the held message
/// is gone. Meanwhile the gauge `held_assignments` shows it.
#[tokio::test(flavor = "multi_thread")]
async fn a_held_envelope_is_failed_in_gitea_after_the_held_timeout() {
    let nats = NatsServer::start().await.expect("nats");
    let js = jetstream_of(&nats).await;
    let c = with_key_two_only(&nats, |f| f.set("held_assignment_timeout", "60s")).await;
    let sealed = published_with_key_one(&c, &js).await;

    let mut controller = c.spawn(&[]);
    held(&c, &js).await;
    // The held reconciler looks every 30 s; its count shows once it has looked.
    let gauge = "gitea_dynamic_runner_held_assignments{backend=\"pod\"}";
    until(WAIT, "the held gauge to show the assignment", || async {
        c.metric(gauge).await == Some(1)
    })
    .await;
    // 60 s held, then the next look (every 30 s): the bound is the timeout plus two looks.
    c.status_within(sealed, Status::Failure, Duration::from_secs(150))
        .await;
    let rows = c.rows(sealed);
    let reason = rows
        .iter()
        .find(|r| r.contains("cannot be opened"))
        .unwrap_or_else(|| panic!("no failure reason in the task's log: {rows:?}"));
    assert!(
        reason.contains(&format!("unknown task key {}", task_key(KEY_ONE).key_id())),
        "{reason}"
    );
    assert!(
        reason.contains("task_encryption_previous_key_files"),
        "{reason}"
    );
    until(WAIT, "the held message to be gone", || async {
        on_subject(&js, "ci.runner.held.pod").await == 0
    })
    .await;
    assert_eq!(c.runs_of(sealed), 0, "it never ran");
    stop(&mut controller, Stop::Term).await;
}

/// An envelope as anyone able to publish can write it: sealed (as it claims) with a key
/// nobody here has, naming assignment `task_id`, with an `id_mac` of its own choosing or none.
fn forged_envelope(task_id: i64, id_mac: Option<&str>) -> Vec<u8> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs();
    let mut envelope = serde_json::json!({
        "version": 2,
        "id": format!("gitea-task-{task_id}"),
        "backend": "pod",
        "key_id": "0123456789abcdef",
        "nonce": "AAAAAAAAAAAAAAAA",
        "task": "AAAAAAAAAAAAAAAAAAAAAA==",
        "identity": {
            "Repository": "owner/repo",
            "Task": "build",
            "SPIFFEID": "spiffe://example.org/ci/owner/repo/build"
        },
        "fetched_at": now,
    });
    if let Some(mac) = id_mac {
        envelope["id_mac"] = mac.into();
    }
    serde_json::to_vec(&envelope).expect("json")
}

/// DESIGN invariants 20, 21: anyone who can publish can name the assignment IDs Gitea hands
/// out next. Two such envelopes on the held subject (sealed, as they claim, with a key
/// nobody here has; one without an `id_mac`, one with a made-up one) are dropped after
/// `held_assignment_timeout` without a single Gitea call (no heartbeat, no failure) and
/// without a finished record; the real tasks that later get those IDs run.
#[tokio::test(flavor = "multi_thread")]
async fn a_forged_held_envelope_for_a_task_gitea_hands_out_later_does_not_stop_that_task() {
    let nats = NatsServer::start().await.expect("nats");
    let js = jetstream_of(&nats).await;
    let c = on_own_nats(&nats, |f| f.set("held_assignment_timeout", "60s")).await;
    queue::ensure_stream(&js, &stream_settings())
        .await
        .expect("stream");
    // Nothing is fetched yet: Gitea hands out task IDs 1 and 2 next.
    for envelope in [
        forged_envelope(1, None),
        forged_envelope(2, Some("bm90IGEgbWFjIG9mIG91cnM")),
    ] {
        let publish = jetstream::message::PublishMessage::build().payload(envelope.into());
        js.send_publish("ci.runner.held.pod", publish)
            .await
            .expect("publish")
            .await
            .expect("stored");
    }
    assert_eq!(on_subject(&js, "ci.runner.held.pod").await, 2);
    let mut controller = c.spawn(&[]);
    // 60 s held, then the next look (every 30 s): the bound is the timeout plus two looks.
    until(
        Duration::from_secs(150),
        "the forged envelopes dropped",
        || async { on_subject(&js, "ci.runner.held.pod").await == 0 },
    )
    .await;
    let log = c.fixture.log();
    assert_eq!(
        log.matches("dropping a held assignment whose ID is not authenticated")
            .count(),
        2,
        "{log}"
    );
    assert!(!log.contains("failing a held assignment in Gitea"), "{log}");
    for method in [RpcMethod::UpdateTask, RpcMethod::UpdateLog] {
        assert_eq!(c.mock.handle.calls(method), 0, "{method:?}: no Gitea call");
    }
    let finished = js
        .get_key_value("CI_RUNNER_FINISHED")
        .await
        .expect("the finished-assignments bucket");
    for id in ["gitea-task-1", "gitea-task-2"] {
        assert!(
            finished.get(id).await.expect("read").is_none(),
            "{id} is not recorded as finished"
        );
    }

    let first = c.queue("standin:success");
    let second = c.queue("standin:success");
    c.status(first, Status::Success).await;
    c.status(second, Status::Success).await;
    let ids: Vec<Option<i64>> = [first, second]
        .iter()
        .map(|j| c.mock.handle.job(*j).and_then(|j| j.task_id))
        .collect();
    assert_eq!(
        ids,
        vec![Some(1), Some(2)],
        "the forged IDs were the real ones"
    );
    assert_eq!((c.runs_of(first), c.runs_of(second)), (1, 1));
    stop(&mut controller, Stop::Term).await;
}

/// DESIGN invariant 20: a sealed envelope without a fetch time (older releases wrote them)
/// has no age limit, so a copy could run again once its finished record expired: it is
/// terminated unopened as to its task. `accept_undated_envelopes`, meant for the upgrade
/// from such a release, admits one, and the job runs.
#[tokio::test(flavor = "multi_thread")]
async fn an_envelope_without_a_fetch_time_is_refused_unless_accept_undated_envelopes_admits_it() {
    let nats = NatsServer::start().await.expect("nats");
    let js = jetstream_of(&nats).await;
    let mut c = on_own_nats(&nats, |f| f).await;
    let refused = published_sealed(&c, &js, "standin:success", false).await;
    let mut first = c.spawn(&[]);
    let expired = "gitea_dynamic_runner_assignments_total{backend=\"pod\",outcome=\"expired\"}";
    until(WAIT, "the undated envelope terminated", || async {
        c.metric(expired).await == Some(1) && on_subject(&js, POD_SUBJECT).await == 0
    })
    .await;
    assert!(
        c.fixture
            .log()
            .contains("terminating an assignment without a fetch time"),
        "{}",
        c.fixture.log()
    );
    assert_eq!(c.runs_of(refused), 0);
    stop(&mut first, Stop::Term).await;

    c.fixture.replace("accept_undated_envelopes", true);
    let admitted = published_sealed(&c, &js, "standin:success", false).await;
    let mut second = c.spawn(&[]);
    c.status(admitted, Status::Success).await;
    assert_eq!(c.runs_of(admitted), 1);
    assert!(
        c.fixture.log().contains("accept_undated_envelopes = true"),
        "warned at start"
    );
    stop(&mut second, Stop::Term).await;
}

/// DESIGN invariants 5a, 20: a NATS outage longer than Gitea's zombie timeout (6 s here)
/// fails no queued task: the controller beats the tasks it fetched from its own record
/// while the stream cannot be read. A task cancelled in Gitea meanwhile (here the one
/// waiting in line for the only slot) is recorded as finished once Gitea says so, and gets
/// no executor when NATS and the slot are back; the other queued task runs.
#[tokio::test(flavor = "multi_thread")]
async fn a_nats_outage_beyond_the_zombie_timeout_fails_no_queued_task_and_a_cancelled_one_gets_no_executor()
 {
    let mut nats = NatsServer::start().await.expect("nats");
    let js = jetstream_of(&nats).await;
    let mock = MockConfig::default().with_zombie_timeout(Duration::from_secs(6));
    let c = on_own_nats_with(mock, &nats, |f| f.set("backlog_limit", 5u32)).await;
    let mut controller = c.spawn(&[]);
    // Holds the only slot until it is cancelled.
    let holder = c.queue("standin:hang");
    c.runner_started(holder).await;
    let cancelled = c.queue("standin:success");
    let runs = c.queue("standin:success");
    until(WAIT, "both jobs queued behind the holder", || async {
        on_subject(&js, POD_SUBJECT).await == 2
    })
    .await;
    let task = |job: JobId| {
        c.mock
            .handle
            .job(job)
            .and_then(|j| j.task_id)
            .expect("fetched")
    };
    let (cancelled_task, runs_task) = (task(cancelled), task(runs));

    nats.kill().await.expect("kill nats-server");
    c.mock.handle.cancel_job(cancelled).expect("cancel");
    let beats = |m: &gdr_testkit::mock_gitea::MockGitea| {
        m.task(runs_task).map(|t| t.heartbeats).unwrap_or(0)
    };
    let at_kill = beats(&c.mock.handle);
    // Eight more heartbeats, a second apart, span beyond the 6 s timeout and several
    // sweeps; stop early if the sweeper fails the task.
    c.mock
        .handle
        .wait_for(
            |m| m.task(runs_task).is_some_and(|t| t.status.is_done()) || beats(m) >= at_kill + 8,
            WAIT,
        )
        .await
        .expect("heartbeats during the outage");
    assert_eq!(
        c.mock.handle.task(runs_task).map(|t| t.status),
        Some(Status::Running),
        "the queued task was not reaped during the outage:\n{}",
        c.fixture.log()
    );
    let cancelled_id = format!("gitea-task-{cancelled_task}");
    until(WAIT, "the controller learned of the cancel", || async {
        c.fixture
            .log()
            .lines()
            .any(|l| l.contains("queued task ended in Gitea") && l.contains(&cancelled_id))
    })
    .await;
    c.status(cancelled, Status::Cancelled).await;

    nats.restart().await.expect("restart nats-server");
    c.mock.handle.cancel_job(holder).expect("cancel the holder");
    c.status(runs, Status::Success).await;
    until(
        WAIT,
        "the cancelled job's assignment terminated",
        || async { on_subject(&js, POD_SUBJECT).await == 0 },
    )
    .await;
    let created = c
        .fixture
        .log()
        .lines()
        .filter(|l| l.contains("executor created") && l.contains(&cancelled_id))
        .count();
    assert_eq!(created, 0, "no executor for the cancelled task");
    assert_eq!(c.runs_of(cancelled), 0);
    let finished = js
        .get_key_value("CI_RUNNER_FINISHED")
        .await
        .expect("the finished-assignments bucket");
    assert!(
        finished.get(&cancelled_id).await.expect("read").is_some(),
        "{cancelled_id} is recorded as finished, so a restart starts nothing for it either"
    );
    stop(&mut controller, Stop::Term).await;
}

/// The durable pod consumer's `max_ack_pending` and `ack_wait`, once it exists.
async fn pod_consumer(js: &jetstream::Context) -> Option<(i64, Duration)> {
    let stream = js.get_stream(STREAM).await.ok()?;
    let info = stream.consumer_info("pod").await.ok()?;
    Some((info.config.max_ack_pending, info.config.ack_wait))
}

/// DESIGN invariant 22: consumer settings are reconciled to the configuration at every
/// start. JetStream keeps an existing durable consumer's configuration as it is, so a
/// capacity raised across a restart would otherwise never reach `max_ack_pending` (the
/// backend would keep admitting at the old capacity while its metrics showed the new one).
#[tokio::test(flavor = "multi_thread")]
async fn a_capacity_change_across_a_restart_updates_the_consumers_max_ack_pending() {
    let nats = NatsServer::start().await.expect("nats");
    let js = jetstream_of(&nats).await;
    let mut c = on_own_nats(&nats, |f| f.set("pod_capacity", 2u32)).await;
    let mut first = c.spawn(&[]);
    c.ready().await;
    let first_settings = eventually(WAIT, "the pod consumer", || pod_consumer(&js)).await;
    assert_eq!(first_settings, (2, Duration::from_secs(3)));
    stop(&mut first, Stop::Term).await;

    c.fixture.replace("pod_capacity", 5u32);
    c.fixture.replace("nats_ack_wait", "7s");
    let mut second = c.spawn(&[]);
    c.ready().await;
    until(WAIT, "the pod consumer at the new capacity", || async {
        pod_consumer(&js).await == Some((5, Duration::from_secs(7)))
    })
    .await;
    let capacity = "gitea_dynamic_runner_pool_capacity{backend=\"pod\"}";
    assert_eq!(c.metric(capacity).await, Some(5));
    stop(&mut second, Stop::Term).await;
}
