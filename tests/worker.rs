//! Workers against a real nats-server, the mock Gitea and in-memory backends: capacity,
//! isolation between backends, poison messages and NATS restarts (DESIGN invariants 5–9).

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::{self};
use gdr_controller::dispatch::{ClaimState, Dispatch, Fetched};
use gdr_controller::queue::{self, ConsumerSettings};
use gdr_controller::shutdown::{ShutdownTrigger, shutdown_channel};
use gdr_controller::wake::Wake;
use gdr_controller::worker::{EnvelopeTrust, Outcome, Worker, WorkerSettings};
use gdr_core::assignment::{Assignment, AssignmentId, encode_v1};
use gdr_core::backend::Backend;
use gdr_core::capability::CapabilityKey;
use gdr_core::executor::ExecutorBackend;
use gdr_gitea::{ClientOptions, Credentials, GiteaClient};
use gdr_testkit::memory_backend::{Failure, MemoryBackend};
use gdr_testkit::mock_gitea::{MockConfig, MockGitea, RunningMock, Status};
use gdr_testkit::nats_server::NatsServer;
use tokio::sync::mpsc;

use crate::queue_common::{policy, stream_settings};

const WAIT: Duration = Duration::from_secs(20);
const KEY: &[u8] = b"0123456789abcdef0123456789abcdef";

struct Harness {
    nats: NatsServer,
    js: jetstream::Context,
    mock: RunningMock,
    gitea: GiteaClient,
    dispatch: Arc<Dispatch>,
    pod: Arc<MemoryBackend>,
    vm: Arc<MemoryBackend>,
    outcomes: mpsc::UnboundedReceiver<(String, Outcome)>,
    outcome_tx: mpsc::UnboundedSender<(String, Outcome)>,
    stop: ShutdownTrigger,
    workers: Vec<tokio::task::JoinHandle<()>>,
}

impl Harness {
    async fn new(pod_capacity: usize, vm_capacity: usize) -> Self {
        let nats = NatsServer::start().await.expect("nats-server");
        let js = jetstream::new(async_nats::connect(nats.url()).await.expect("connect"));
        queue::ensure_stream(&js, &stream_settings())
            .await
            .expect("stream");
        let mock = MockGitea::start(MockConfig::default()).await.expect("mock");
        let (uuid, token) = mock
            .handle
            .create_runner("ctl", &["self-hosted", "pod", "vm"], false);
        let gitea = GiteaClient::new(
            ClientOptions::new(mock.url.clone()),
            Some(&Credentials::new(uuid, token)),
        )
        .expect("client");
        let pod = Arc::new(MemoryBackend::new(Backend::Pod));
        let vm = Arc::new(MemoryBackend::new(Backend::Vm));
        let dispatch = Arc::new(Dispatch::new(
            [
                (pod.clone() as Arc<dyn ExecutorBackend>, pod_capacity),
                (vm.clone() as Arc<dyn ExecutorBackend>, vm_capacity),
            ],
            CapabilityKey::new(KEY).expect("key"),
        ));
        let (outcome_tx, outcomes) = mpsc::unbounded_channel();
        let (stop, _) = shutdown_channel();
        Harness {
            nats,
            js,
            mock,
            gitea,
            dispatch,
            pod,
            vm,
            outcomes,
            outcome_tx,
            stop,
            workers: Vec::new(),
        }
    }

    async fn consumer(&self, backend: Backend, capacity: i64, ack_wait: Duration) -> PullConsumer {
        let stream = queue::open_stream(&self.js, &stream_settings())
            .await
            .expect("stream");
        queue::ensure_consumer(
            &stream,
            &stream_settings(),
            backend,
            &ConsumerSettings {
                max_ack_pending: capacity,
                ack_wait,
                max_deliver: -1,
            },
        )
        .await
        .expect("consumer")
    }

    async fn start_worker(&mut self, backend: Backend, capacity: i64) {
        self.start_worker_with(backend, capacity, Duration::from_secs(5), |_| {})
            .await;
    }

    async fn start_worker_with(
        &mut self,
        backend: Backend,
        capacity: i64,
        ack_wait: Duration,
        tweak: impl FnOnce(&mut WorkerSettings),
    ) {
        self.start_woken_worker(backend, capacity, ack_wait, tweak, Wake::none())
            .await;
    }

    /// A worker that `wake` wakes (a backend's change signal).
    async fn start_woken_worker(
        &mut self,
        backend: Backend,
        capacity: i64,
        ack_wait: Duration,
        tweak: impl FnOnce(&mut WorkerSettings),
        wake: Wake,
    ) {
        let consumer = self.consumer(backend, capacity, ack_wait).await;
        let mut settings = WorkerSettings {
            backend,
            full_delay: Duration::from_millis(200),
            not_ready_delay: Duration::from_millis(100),
            error_delay: Duration::from_millis(300),
            progress_interval: Duration::from_millis(500),
            start_deadline: Duration::from_secs(60),
            channel: gdr_controller::channel::ExecutorChannel {
                facade_url: "https://facade.test:8443".into(),
                facade_spiffe_id: "spiffe://example.org/controller".into(),
                runner_label: backend.as_str().into(),
                report_outage_tolerance: Duration::from_secs(60),
            },
            codec: gdr_core::metadata::MetadataCodec::default(),
            envelopes: EnvelopeTrust {
                accept_plaintext: false,
                max_age: Duration::from_secs(3 * 3600),
                accept_undated: false,
            },
            held_subject: stream_settings().held_subject(backend),
        };
        tweak(&mut settings);
        let worker = Worker::new(
            self.dispatch.clone(),
            self.gitea.clone(),
            policy(),
            None,
            settings,
        )
        .expect("worker")
        .with_outcomes(self.outcome_tx.clone())
        .with_wake(wake);
        let stop = self.stop.signal();
        self.workers.push(tokio::spawn(async move {
            worker.run(consumer, stop).await;
        }));
    }

    /// Queues a one-job workflow in Gitea and fetches its task as the scheduler would.
    async fn fetched(&self, job: &str, runs_on: &str) -> Assignment {
        let yaml = format!("on: push\njobs:\n  {job}:\n    runs-on: {runs_on}\n    steps: []\n");
        self.mock
            .handle
            .queue_workflow("owner/repo", &yaml)
            .expect("queue");
        let task = self
            .gitea
            .fetch_task(0)
            .await
            .expect("fetch")
            .task
            .into_option()
            .expect("task");
        Assignment::from_task(task, &policy()).expect("assignment")
    }

    /// Queues a job in Gitea, fetches it as the scheduler would and publishes it.
    async fn publish_job(&self, runs_on: &str) -> Assignment {
        let assignment = self.fetched("build", runs_on).await;
        let payload = encode_v1(&assignment).expect("encode");
        queue::publish(
            &self.js,
            &stream_settings(),
            assignment.backend(),
            assignment.id().as_str(),
            payload.into(),
        )
        .await
        .expect("publish");
        assignment
    }

    /// Plays the executor's runner, which can reach the facade once its executor exists
    /// and its identity is bound: authorise as the facade would and fetch the task.
    async fn claim(&self, assignment: &Assignment) -> bool {
        let backend = match assignment.backend() {
            Backend::Pod => &self.pod,
            Backend::Vm => &self.vm,
        };
        let deadline = tokio::time::Instant::now() + WAIT;
        while !backend
            .records()
            .iter()
            .any(|r| r.assignment.id() == assignment.id() && r.identity_bound)
        {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the executor of {} was never created and bound",
                assignment.id()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let capability = self.dispatch.capability_key().issue(assignment.id());
        let auth = self
            .dispatch
            .authorize(
                assignment.id().as_str(),
                capability.expose(),
                assignment.identity().spiffe_id(),
            )
            .expect("authorised");
        matches!(
            self.dispatch
                .take_task(&auth)
                .await
                .expect("claim recorded"),
            Fetched::Task(_)
        )
    }

    async fn finish(&self, assignment: &Assignment) {
        let capability = self.dispatch.capability_key().issue(assignment.id());
        let auth = self
            .dispatch
            .authorize(
                assignment.id().as_str(),
                capability.expose(),
                assignment.identity().spiffe_id(),
            )
            .expect("authorised");
        self.dispatch.finish(&auth).await.expect("finish");
    }

    async fn next_outcome(&mut self) -> (String, Outcome) {
        tokio::time::timeout(WAIT, self.outcomes.recv())
            .await
            .expect("an outcome in time")
            .expect("channel open")
    }

    /// Waits for `id` to reach `outcome`, returning every outcome seen meanwhile.
    async fn wait_outcome(&mut self, id: &str, outcome: Outcome) -> Vec<(String, Outcome)> {
        let deadline = tokio::time::Instant::now() + WAIT;
        let mut seen = Vec::new();
        loop {
            let next = tokio::time::timeout_at(deadline, self.outcomes.recv())
                .await
                .unwrap_or_else(|_| panic!("{id} never reached {outcome:?}; seen {seen:?}"))
                .expect("channel open");
            seen.push(next.clone());
            if next.0 == id && next.1 == outcome {
                return seen;
            }
        }
    }

    async fn wait_waiting(&self, backend: Backend, n: usize) {
        let deadline = tokio::time::Instant::now() + WAIT;
        while self.dispatch.waiting(backend) != n {
            assert!(
                tokio::time::Instant::now() < deadline,
                "never {n} waiting for a {backend} slot"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn wait_offered(&self, id: &AssignmentId) {
        let deadline = tokio::time::Instant::now() + WAIT;
        while self.dispatch.claim_state(id) != Some(ClaimState::Pending) {
            assert!(tokio::time::Instant::now() < deadline, "{id} never offered");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        self.stop.trigger();
    }
}

#[tokio::test]
async fn a_full_pod_pool_creates_nothing_beyond_capacity_and_runs_the_assignment_once_a_slot_frees()
{
    let mut h = Harness::new(2, 1).await;
    h.start_worker(Backend::Pod, 2).await;
    let a = h.publish_job("[self-hosted, pod]").await;
    let b = h.publish_job("[self-hosted, pod]").await;
    let c = h.publish_job("[self-hosted, pod]").await;
    for x in [&a, &b] {
        h.wait_offered(x.id()).await;
        assert!(h.claim(x).await);
    }
    // Both claimed and acknowledged: the third is delivered but the pool is full, so it
    // waits in line for a slot.
    h.wait_outcome(a.id().as_str(), Outcome::Claimed).await;
    h.wait_waiting(Backend::Pod, 1).await;
    assert_eq!(h.pod.created(), 2, "no executor beyond capacity");
    assert_eq!(h.dispatch.pool_usage(Backend::Pod), (2, 2));

    h.finish(&a).await;
    h.wait_offered(c.id()).await;
    assert_eq!(h.pod.created(), 3);
    assert!(h.claim(&c).await);
    h.wait_outcome(c.id().as_str(), Outcome::Claimed).await;
    assert_eq!(h.dispatch.pool_usage(Backend::Pod), (2, 2));
}

/// DESIGN invariant 6: a slot freed by a finishing executor admits the first assignment
/// waiting in line at once; it does not wait out a NAK delay (an hour here), and one that
/// came later does not jump the line. The line is as long as the pool: a delivery beyond
/// it is put back.
#[tokio::test]
async fn a_freed_slot_admits_the_first_waiting_assignment_at_once_not_after_a_nak_delay() {
    let mut h = Harness::new(1, 1).await;
    // Three deliveries at once: one running, one in line, one beyond the line.
    h.start_worker_with(Backend::Pod, 3, Duration::from_secs(5), |s| {
        s.full_delay = Duration::from_secs(3600);
    })
    .await;
    let a = h.publish_job("[self-hosted, pod]").await;
    h.wait_offered(a.id()).await;
    assert!(h.claim(&a).await);
    h.wait_outcome(a.id().as_str(), Outcome::Claimed).await;
    let b = h.publish_job("[self-hosted, pod]").await;
    h.wait_waiting(Backend::Pod, 1).await;
    let c = h.publish_job("[self-hosted, pod]").await;
    h.wait_outcome(c.id().as_str(), Outcome::Full).await;

    h.finish(&a).await;
    h.wait_offered(b.id()).await;
    assert_eq!(h.dispatch.claim_state(c.id()), None, "c jumped the line");
    assert_eq!(h.pod.created(), 2);
    assert_eq!(h.dispatch.pool_usage(Backend::Pod), (1, 1));
    assert_eq!(h.dispatch.waiting(Backend::Pod), 0);
}

#[tokio::test]
async fn a_failing_vm_backend_does_not_delay_pod_assignments() {
    let mut h = Harness::new(2, 1).await;
    h.vm.set_failing(Some(Failure::Unavailable));
    h.start_worker(Backend::Pod, 2).await;
    h.start_worker(Backend::Vm, 1).await;
    let vm_job = h.publish_job("[self-hosted, vm]").await;
    h.wait_outcome(vm_job.id().as_str(), Outcome::BackendError)
        .await;
    let pod_job = h.publish_job("[self-hosted, pod]").await;
    h.wait_offered(pod_job.id()).await;
    assert!(h.claim(&pod_job).await);
    h.wait_outcome(pod_job.id().as_str(), Outcome::Claimed)
        .await;
    assert_eq!(h.vm.created(), 0);

    // The VM assignment was kept, not lost: it runs once the backend recovers.
    h.vm.set_failing(None);
    h.wait_offered(vm_job.id()).await;
    assert!(h.claim(&vm_job).await);
    h.wait_outcome(vm_job.id().as_str(), Outcome::Claimed).await;
}

#[tokio::test]
async fn a_redelivered_assignment_is_admitted_once_and_its_executor_created_once() {
    let mut h = Harness::new(1, 1).await;
    h.pod.set_not_ready_binds(3);
    h.start_worker(Backend::Pod, 1).await;
    let a = h.publish_job("[self-hosted, pod]").await;
    for _ in 0..3 {
        h.wait_outcome(a.id().as_str(), Outcome::NotReady).await;
    }
    h.wait_offered(a.id()).await;
    assert_eq!(h.pod.created(), 1);
    assert_eq!(h.dispatch.pool_usage(Backend::Pod), (1, 1));
    assert!(h.claim(&a).await);
    h.wait_outcome(a.id().as_str(), Outcome::Claimed).await;
}

#[tokio::test]
async fn poison_and_tampered_messages_are_terminated_not_retried() {
    let mut h = Harness::new(1, 1).await;
    h.start_worker(Backend::Pod, 1).await;
    let subject = stream_settings().subject(Backend::Pod);
    h.js.publish(subject.clone(), "not an envelope".into())
        .await
        .expect("send")
        .await
        .expect("stored");

    // A vm task published on the pod subject, and a pod envelope with a forged identity.
    h.mock
        .handle
        .queue_workflow(
            "owner/repo",
            "on: push\njobs:\n  b:\n    runs-on: [self-hosted, vm]\n    steps: []\n",
        )
        .expect("queue");
    let task = h
        .gitea
        .fetch_task(0)
        .await
        .expect("fetch")
        .task
        .into_option()
        .expect("task");
    let misrouted =
        encode_v1(&Assignment::from_task(task, &policy()).expect("assignment")).expect("encode");
    h.js.publish(subject.clone(), misrouted.into())
        .await
        .expect("send")
        .await
        .expect("stored");
    h.mock
        .handle
        .queue_workflow(
            "owner/repo",
            "on: push\njobs:\n  c:\n    runs-on: [self-hosted, pod]\n    steps: []\n",
        )
        .expect("queue");
    let task = h
        .gitea
        .fetch_task(0)
        .await
        .expect("fetch")
        .task
        .into_option()
        .expect("task");
    let genuine = String::from_utf8(
        encode_v1(&Assignment::from_task(task, &policy()).expect("a")).expect("e"),
    )
    .expect("utf8");
    let forged = genuine.replace(
        "/ci/owner/repo/branch/main/c",
        "/ci/owner/repo/branch/main/admin",
    );
    assert_ne!(forged, genuine);
    h.js.publish(subject, forged.into())
        .await
        .expect("send")
        .await
        .expect("stored");

    for _ in 0..3 {
        assert_eq!(h.next_outcome().await.1, Outcome::Poison);
    }
    let mut consumer = h.consumer(Backend::Pod, 1, Duration::from_secs(5)).await;
    let info = consumer.info().await.expect("info").clone();
    assert_eq!(info.num_ack_pending, 0);
    assert_eq!(info.num_pending, 0);
    assert_eq!(
        info.num_redelivered, 0,
        "terminated messages are never redelivered"
    );
    assert_eq!(h.pod.created(), 0);
}

#[tokio::test]
async fn an_executor_that_ends_before_claiming_is_reported_failed_and_cleaned_up() {
    let mut h = Harness::new(1, 1).await;
    h.start_worker(Backend::Pod, 1).await;
    let a = h.publish_job("[self-hosted, pod]").await;
    h.wait_offered(a.id()).await;
    h.pod.finish(a.id(), false);
    h.wait_outcome(a.id().as_str(), Outcome::ExecutorFailed)
        .await;
    let job = h
        .mock
        .handle
        .wait_for_value(
            |m| {
                m.jobs()
                    .into_iter()
                    .find(|j| j.task_id == Some(a.id().task_id()) && j.status == Status::Failure)
            },
            WAIT,
        )
        .await
        .expect("the task is failed in Gitea");
    let logs = job.task.expect("task").log_rows;
    assert!(
        logs.iter()
            .any(|l| l.contains("before its runner fetched the task")),
        "{logs:?}"
    );
    assert_eq!(
        h.dispatch.pool_usage(Backend::Pod),
        (0, 1),
        "the slot is released"
    );
    assert_eq!(h.pod.deleted(), 1, "the executor is cleaned up");
}

#[tokio::test]
async fn restarting_the_nats_server_mid_run_loses_no_assignment() {
    let mut h = Harness::new(3, 1).await;
    h.start_worker(Backend::Pod, 3).await;
    let a = h.publish_job("[self-hosted, pod]").await;
    let b = h.publish_job("[self-hosted, pod]").await;
    h.wait_offered(a.id()).await;
    h.wait_offered(b.id()).await;
    h.nats.restart().await.expect("restart");
    let c = h.publish_job_after_restart("[self-hosted, pod]").await;
    for x in [&a, &b, &c] {
        h.wait_offered(x.id()).await;
        assert!(h.claim(x).await);
    }
    let mut claimed = std::collections::BTreeSet::new();
    while claimed.len() < 3 {
        let (id, outcome) = h.next_outcome().await;
        if matches!(outcome, Outcome::Claimed | Outcome::AlreadyClaimed) {
            claimed.insert(id);
        }
    }
    assert_eq!(h.pod.created(), 3, "each assignment ran exactly once");
}

impl Harness {
    /// Publishing right after a restart may race JetStream's recovery; retry as the
    /// scheduler does.
    async fn publish_job_after_restart(&self, runs_on: &str) -> Assignment {
        let assignment = self.fetched("build", runs_on).await;
        let payload: bytes::Bytes = encode_v1(&assignment).expect("encode").into();
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            match queue::publish(
                &self.js,
                &stream_settings(),
                Backend::Pod,
                assignment.id().as_str(),
                payload.clone(),
            )
            .await
            {
                Ok(_) => return assignment,
                Err(e) => {
                    assert!(
                        tokio::time::Instant::now() < deadline,
                        "publish never succeeded: {e}"
                    );
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    }
}

/// DESIGN invariant 21: an assignment sealed with a task key this controller lacks is kept
/// (a rotation rolled out in the wrong order must not lose jobs) but set aside on the held
/// subject, so it holds none of the consumer's `max_ack_pending` slots: a backend of
/// capacity 1 still runs its next job.
#[tokio::test]
async fn an_assignment_sealed_with_a_key_this_controller_lacks_is_set_aside_not_terminated() {
    use gdr_core::assignment::{TaskKey, TaskKeyring, encode_v2};
    let mut h = Harness::new(1, 1).await;
    h.start_worker(Backend::Pod, 1).await;
    let assignment = h.fetched("k", "[self-hosted, pod]").await;
    let sealed = encode_v2(
        &assignment,
        &TaskKeyring::new(TaskKey::from_bytes([3; 32]), vec![]),
    )
    .expect("seal");
    queue::publish(
        &h.js,
        &stream_settings(),
        Backend::Pod,
        assignment.id().as_str(),
        sealed.into(),
    )
    .await
    .expect("publish");
    let (_, outcome) = h.next_outcome().await;
    assert_eq!(outcome, Outcome::Held);
    let stream = queue::open_stream(&h.js, &stream_settings())
        .await
        .expect("stream");
    let held = queue::held_per_backend(&stream, &stream_settings())
        .await
        .expect("info");
    assert_eq!(held.get(&Backend::Pod), Some(&1), "the job stays, held");
    let unclaimed = queue::unclaimed_per_backend(&stream, &stream_settings())
        .await
        .expect("info");
    assert_eq!(
        unclaimed.get(&Backend::Pod),
        None,
        "nothing waits on the pod subject"
    );
    assert_eq!(h.pod.created(), 0);

    // The held message holds no slot of the capacity-1 consumer: the next job runs.
    let next = h.publish_job("[self-hosted, pod]").await;
    h.wait_offered(next.id()).await;
    assert_eq!(h.pod.created(), 1);
}

/// A spec of `assignment`'s executor as the worker builds it.
fn spec_of(h: &Harness, assignment: &Assignment) -> gdr_core::executor::ExecutorSpec {
    gdr_core::executor::ExecutorSpec::new(
        assignment,
        h.dispatch.capability_key().issue(assignment.id()),
        &gdr_core::metadata::MetadataCodec::default(),
        "https://facade.test:8443",
        "spiffe://example.org/controller",
        "pod",
    )
}

/// The task is offered before its executor is created, so a runner that starts the moment
/// its environment exists finds it on its first FetchTask (an empty answer would cost it
/// its poll interval).
#[tokio::test]
async fn the_task_is_offered_before_its_executor_is_created() {
    let mut h = Harness::new(1, 1).await;
    h.pod.set_create_delay(Duration::from_secs(3));
    h.start_worker(Backend::Pod, 1).await;
    let a = h.publish_job("[self-hosted, pod]").await;
    h.wait_offered(a.id()).await;
    assert_eq!(h.pod.create_calls(), 1, "the create is under way");
    assert_eq!(h.pod.created(), 0, "offered before the executor exists");
    assert!(h.claim(&a).await);
    h.wait_outcome(a.id().as_str(), Outcome::Claimed).await;
}

/// DESIGN invariants 6 and 8: OpenSandbox's create blocks up to a minute, as long as an ack
/// wait. The worker keeps the delivery's deadline alive meanwhile, so JetStream never
/// redelivers it and one executor is created.
#[tokio::test]
async fn a_create_that_outlasts_the_ack_wait_keeps_its_delivery_alive_and_creates_once() {
    let mut h = Harness::new(1, 1).await;
    h.pod.set_create_delay(Duration::from_secs(5));
    h.start_worker_with(Backend::Pod, 1, Duration::from_secs(2), |s| {
        s.progress_interval = Duration::from_millis(500);
    })
    .await;
    let a = h.publish_job("[self-hosted, pod]").await;
    h.wait_offered(a.id()).await;
    assert!(h.claim(&a).await);
    let seen = h.wait_outcome(a.id().as_str(), Outcome::Claimed).await;
    assert!(
        !seen.iter().any(|(_, o)| *o == Outcome::InFlight),
        "the message was redelivered during the create: {seen:?}"
    );
    assert_eq!(h.pod.create_calls(), 1);
}

/// DESIGN invariants 6 and 8: should a redelivery arrive while the first create still runs
/// (the deadline could not be extended in time), it is put back instead of starting a
/// second create: one job never gets two environments.
#[tokio::test]
async fn a_redelivery_while_the_create_still_runs_is_put_back_not_created_twice() {
    let mut h = Harness::new(1, 1).await;
    h.pod.set_create_delay(Duration::from_secs(6));
    // Progress every 10s cannot keep a 2s ack wait: JetStream redelivers during the create.
    h.start_worker_with(Backend::Pod, 2, Duration::from_secs(2), |s| {
        s.progress_interval = Duration::from_secs(10);
    })
    .await;
    let a = h.publish_job("[self-hosted, pod]").await;
    h.wait_outcome(a.id().as_str(), Outcome::InFlight).await;
    h.wait_offered(a.id()).await;
    assert!(h.claim(&a).await);
    h.wait_outcome(a.id().as_str(), Outcome::Claimed).await;
    assert_eq!(
        h.pod.create_calls(),
        1,
        "a second create ran for the same job"
    );
}

/// DESIGN invariant 12: the start deadline counts from the executor's creation, so a
/// controller that restarts again and again (each restart a new delivery) still fails an
/// executor whose runner never claims.
#[tokio::test]
async fn the_start_deadline_counts_from_the_executors_creation_not_from_each_delivery() {
    let mut h = Harness::new(1, 1).await;
    let a = h.fetched("stuck", "[self-hosted, pod]").await;
    // A previous controller created the executor long ago.
    h.pod.insert(
        &spec_of(&h, &a),
        std::time::SystemTime::now() - Duration::from_secs(120),
    );
    h.start_worker(Backend::Pod, 1).await;
    let payload = encode_v1(&a).expect("encode");
    queue::publish(
        &h.js,
        &stream_settings(),
        Backend::Pod,
        a.id().as_str(),
        payload.into(),
    )
    .await
    .expect("publish");
    h.wait_outcome(a.id().as_str(), Outcome::ExecutorFailed)
        .await;
    let task = h.mock.handle.task(a.id().task_id()).expect("task");
    assert!(
        task.log_rows
            .iter()
            .any(|r| r.contains("did not start the job within 1m")),
        "{:?}",
        task.log_rows
    );
    assert!(h.pod.records().is_empty(), "the failed executor is removed");
}

/// DESIGN invariant 12: a failure is reported first; while Gitea does not take the report,
/// the executor and the message are kept, and a later delivery reports it.
#[tokio::test]
async fn a_failure_gitea_does_not_take_keeps_the_executor_until_a_later_delivery_reports_it() {
    use gdr_testkit::mock_gitea::{MockFault, RpcMethod};
    let mut h = Harness::new(1, 1).await;
    h.start_worker(Backend::Pod, 1).await;
    let a = h.publish_job("[self-hosted, pod]").await;
    h.wait_offered(a.id()).await;
    for _ in 0..4 {
        h.mock.handle.fail_next(
            RpcMethod::UpdateTask,
            MockFault::Connect {
                code: connectrpc::ErrorCode::Unavailable,
                message: "Gitea restarting".into(),
            },
        );
    }
    h.pod.finish(a.id(), false);
    h.wait_outcome(a.id().as_str(), Outcome::ReportPending)
        .await;
    assert_eq!(h.pod.records().len(), 1, "kept until Gitea has the failure");
    assert_eq!(
        h.dispatch.pool_usage(Backend::Pod),
        (1, 1),
        "its slot is kept too"
    );
    h.wait_outcome(a.id().as_str(), Outcome::ExecutorFailed)
        .await;
    assert_eq!(
        h.mock.handle.task(a.id().task_id()).expect("task").result,
        gdr_proto::runner::v1::TaskResult::RESULT_FAILURE as i32
    );
    assert!(h.pod.records().is_empty());
    assert_eq!(h.dispatch.pool_usage(Backend::Pod), (0, 1));
}

/// Contract v2: a backend that refuses an executor for good (invalid spec) fails the task
/// with the backend's reason instead of retrying it forever.
#[tokio::test]
async fn a_permanent_create_error_fails_the_task_with_the_backends_reason() {
    let mut h = Harness::new(1, 1).await;
    h.pod.set_failing_create(Some(Failure::Permanent));
    h.start_worker(Backend::Pod, 1).await;
    let a = h.publish_job("[self-hosted, pod]").await;
    h.wait_outcome(a.id().as_str(), Outcome::ExecutorFailed)
        .await;
    let task = h.mock.handle.task(a.id().task_id()).expect("task");
    assert!(
        task.log_rows
            .iter()
            .any(|r| r.contains("injected: backend refused")),
        "{:?}",
        task.log_rows
    );
    assert_eq!(h.dispatch.pool_usage(Backend::Pod), (0, 1));
}

/// DESIGN invariant 6 with contract v2: a full backend (OpenSandbox 429) leaves the job
/// queued; it runs once the backend has room.
#[tokio::test]
async fn a_backend_that_is_full_leaves_the_job_queued_until_it_has_room() {
    let mut h = Harness::new(1, 1).await;
    h.pod
        .set_failing_create(Some(Failure::Full(Some(Duration::from_millis(300)))));
    h.start_worker(Backend::Pod, 1).await;
    let a = h.publish_job("[self-hosted, pod]").await;
    h.wait_outcome(a.id().as_str(), Outcome::Full).await;
    assert_eq!(h.pod.created(), 0);
    assert_eq!(h.dispatch.pool_usage(Backend::Pod), (0, 1), "no slot held");
    h.pod.set_failing_create(None);
    h.wait_offered(a.id()).await;
    assert!(h.claim(&a).await);
    h.wait_outcome(a.id().as_str(), Outcome::Claimed).await;
}

/// DESIGN invariant 6: a create that answers with an error although the backend stored the
/// executor (a call that timed out after the API server wrote the Pod) keeps its slot: the
/// job goes on with the executor the backend has, and the next job waits for the slot
/// instead of running beyond capacity.
#[tokio::test]
async fn a_create_error_after_the_executor_was_stored_keeps_its_slot_so_nothing_runs_beyond_capacity()
 {
    let mut h = Harness::new(1, 1).await;
    h.pod.set_failing_after_create(Some(Failure::Unavailable));
    // A put-back delivery does not come back within the test: only the slot decides.
    h.start_worker_with(Backend::Pod, 2, Duration::from_secs(5), |s| {
        s.error_delay = Duration::from_secs(3600);
    })
    .await;
    let a = h.publish_job("[self-hosted, pod]").await;
    gdr_testkit::until(WAIT, "the first executor stored", || async {
        h.pod.created() == 1
    })
    .await;
    h.pod.set_failing_after_create(None);
    let b = h.publish_job("[self-hosted, pod]").await;
    gdr_testkit::until(WAIT, "the second job in line, or created", || async {
        h.dispatch.waiting(Backend::Pod) == 1 || h.pod.created() > 1
    })
    .await;
    assert_eq!(
        h.pod.created(),
        1,
        "an executor was created beyond capacity"
    );
    assert_eq!(h.dispatch.pool_usage(Backend::Pod), (1, 1));

    // The first job runs on the executor its failed create left; its end frees the slot.
    assert!(h.claim(&a).await);
    h.wait_outcome(a.id().as_str(), Outcome::Claimed).await;
    h.finish(&a).await;
    h.wait_offered(b.id()).await;
    assert!(h.claim(&b).await);
    h.wait_outcome(b.id().as_str(), Outcome::Claimed).await;
    assert_eq!(h.pod.created(), 2);
}

/// A JetStream consumer that keeps failing (deleted under the worker) is re-subscribed
/// with backoff: a handful of attempts, not a spin that floods the log.
#[tokio::test]
async fn a_consumer_that_keeps_failing_is_retried_with_backoff_not_in_a_spin() {
    let captured = gdr_testkit::log_capture::Capture::default();
    let _guard = tracing::subscriber::set_default(gdr_controller::logging::subscriber(
        tracing_subscriber::EnvFilter::new("warn"),
        captured.clone(),
    ));
    let mut h = Harness::new(1, 1).await;
    h.start_worker(Backend::Pod, 1).await;
    let stream = queue::open_stream(&h.js, &stream_settings())
        .await
        .expect("stream");
    stream
        .delete_consumer("pod")
        .await
        .expect("delete consumer");
    let retries = || {
        captured
            .text()
            .lines()
            .filter(|l| l.contains("re-subscribing") || l.contains("cannot pull assignments"))
            .count()
    };
    // Noticed at once when the server's "consumer deleted" notice reaches the pull; when a
    // loaded run misses it (the deletion raced the first pull request), only when the pull's
    // idle heartbeats stop: async-nats sends them every 15 s and reports the second one
    // missed, so the wait covers three periods. Then the retries of the next 4 s are counted.
    const MISSED_HEARTBEATS: Duration = Duration::from_secs(3 * 15);
    gdr_testkit::until_sync(
        MISSED_HEARTBEATS + WAIT,
        "the worker notices its broken consumer",
        || retries() >= 1,
    )
    .await;
    let first = retries();
    tokio::time::sleep(Duration::from_secs(4)).await;
    let more = retries() - first;
    assert!(more <= 10, "{more} retries in 4s: the worker spins");
}

/// The backend's change signal wakes a worker waiting for the claim: an executor that ends
/// before its runner claimed is reported at once, not at the next progress tick.
#[tokio::test]
async fn a_wake_reports_an_executor_that_ended_before_claiming_without_waiting_for_a_tick() {
    let mut h = Harness::new(1, 1).await;
    let (tx, rx) = tokio::sync::watch::channel(0u64);
    // Without the wake the worker would look again only after half an hour.
    let slow = |s: &mut WorkerSettings| s.progress_interval = Duration::from_secs(1800);
    h.start_woken_worker(
        Backend::Pod,
        1,
        Duration::from_secs(3600),
        slow,
        Wake::from(rx),
    )
    .await;
    let a = h.publish_job("[self-hosted, pod]").await;
    h.wait_offered(a.id()).await;
    h.pod.finish(a.id(), false);
    tx.send_modify(|n| *n += 1);
    h.wait_outcome(a.id().as_str(), Outcome::ExecutorFailed)
        .await;
    assert_eq!(h.pod.deleted(), 1);
}

/// DESIGN invariant 12: a claim that arrives together with a wake (the runner fetched its
/// task, then its Pod was deleted before the worker looked again) hands the job over as
/// claimed, for the lifecycle reconciler to report the gone executor; it is not failed as an
/// executor that "disappeared before its runner fetched the task". Several jobs, because the
/// worker's choice between two ready signals was random.
#[tokio::test]
async fn a_claim_that_arrives_with_a_wake_hands_the_job_over_instead_of_failing_its_start() {
    const JOBS: usize = 12;
    let mut h = Harness::new(JOBS, 1).await;
    let (tx, rx) = tokio::sync::watch::channel(0u64);
    let slow = |s: &mut WorkerSettings| s.progress_interval = Duration::from_secs(1800);
    h.start_woken_worker(
        Backend::Pod,
        JOBS as i64,
        Duration::from_secs(3600),
        slow,
        Wake::from(rx),
    )
    .await;
    for _ in 0..JOBS {
        let a = h.publish_job("[self-hosted, pod]").await;
        h.wait_offered(a.id()).await;
        assert!(h.claim(&a).await);
        // Before the worker runs again (one test thread): the executor vanishes and the
        // backend's change signal fires.
        h.pod.vanish(a.id());
        tx.send_modify(|n| *n += 1);
        let (id, outcome) = h.next_outcome().await;
        assert_eq!(id, a.id().as_str());
        assert_eq!(outcome, Outcome::Claimed, "failed as a start failure");
    }
}

/// With a change signal, an identity target that is not ready yet (a Pod not scheduled)
/// is waited for within the delivery: no delivery is put back, and the job is offered as
/// soon as it is ready.
#[tokio::test]
async fn with_a_wake_an_identity_target_that_is_not_ready_is_waited_for_not_put_back() {
    let mut h = Harness::new(1, 1).await;
    let (_tx, rx) = tokio::sync::watch::channel(0u64);
    h.pod.set_not_ready_binds(3);
    h.start_woken_worker(
        Backend::Pod,
        1,
        Duration::from_secs(5),
        |_| {},
        Wake::from(rx),
    )
    .await;
    let a = h.publish_job("[self-hosted, pod]").await;
    h.wait_offered(a.id()).await;
    assert!(h.claim(&a).await);
    let seen = h.wait_outcome(a.id().as_str(), Outcome::Claimed).await;
    assert!(
        !seen.iter().any(|(_, o)| *o == Outcome::NotReady),
        "put back while not ready: {seen:?}"
    );
}

/// DESIGN invariant 12 (issue 23): a start deadline that passes while the runner's claim is
/// being written does not fail the job. Deadline failure and claim exclude each other: the
/// claim in flight wins, the worker keeps waiting and hands the job over as claimed; Gitea
/// never hears of a failure and the executor is kept. (The deadline passed long ago here;
/// the backend's change signal makes the worker look while the claim write is held.)
#[tokio::test]
async fn a_start_deadline_that_passes_while_the_claim_is_written_leaves_the_job_to_its_runner() {
    let mut h = Harness::new(1, 1).await;
    let a = h.fetched("late", "[self-hosted, pod]").await;
    h.pod.insert(
        &spec_of(&h, &a),
        std::time::SystemTime::now() - Duration::from_secs(120),
    );
    let (tx, rx) = tokio::sync::watch::channel(0u64);
    let slow = |s: &mut WorkerSettings| s.progress_interval = Duration::from_secs(1800);
    h.start_woken_worker(
        Backend::Pod,
        1,
        Duration::from_secs(3600),
        slow,
        Wake::from(rx),
    )
    .await;
    let payload = encode_v1(&a).expect("encode");
    queue::publish(
        &h.js,
        &stream_settings(),
        Backend::Pod,
        a.id().as_str(),
        payload.into(),
    )
    .await
    .expect("publish");
    h.wait_offered(a.id()).await;
    gdr_testkit::until_sync(WAIT, "the executor's identity to be bound", || {
        h.pod.records().iter().any(|r| r.identity_bound)
    })
    .await;

    h.pod.hold_claims();
    let claim = {
        let dispatch = h.dispatch.clone();
        let capability = dispatch.capability_key().issue(a.id());
        let auth = dispatch
            .authorize(
                a.id().as_str(),
                capability.expose(),
                a.identity().spiffe_id(),
            )
            .expect("authorised");
        tokio::spawn(async move { dispatch.take_task(&auth).await })
    };
    gdr_testkit::until_sync(WAIT, "the claim write to wait at the backend", || {
        h.pod.claims_waiting() == 1
    })
    .await;
    // The worker looks at the overdue executor twice: the first look did not fail it.
    let looked = h.pod.find_calls();
    gdr_testkit::until_sync(WAIT, "the worker to look at the executor twice", || {
        tx.send_modify(|n| *n += 1);
        h.pod.find_calls() >= looked + 2
    })
    .await;
    h.pod.release_claims();
    let claimed = claim.await.expect("join").expect("claim recorded");
    assert!(
        matches!(claimed, Fetched::Task(_)),
        "the runner gets its task"
    );
    h.wait_outcome(a.id().as_str(), Outcome::Claimed).await;
    assert_eq!(
        h.mock.handle.task(a.id().task_id()).expect("task").result,
        gdr_proto::runner::v1::TaskResult::RESULT_UNSPECIFIED as i32,
        "Gitea was told the running job failed"
    );
    assert_eq!(
        h.pod.records().len(),
        1,
        "the running job's executor is kept"
    );
    assert_eq!(h.pod.deleted(), 0);
}

impl Harness {
    /// Gives the harness's dispatch a finished-assignments bucket (invariant 20), as the
    /// controller has; workers started afterwards consult it.
    async fn with_finished_bucket(&mut self) -> gdr_controller::queue::FinishedAssignments {
        let finished = gdr_controller::queue::FinishedAssignments::open(
            &self.js,
            "finished-test",
            Duration::from_secs(3600),
            true,
        )
        .await
        .expect("bucket");
        self.dispatch = Arc::new(
            Dispatch::new(
                [
                    (self.pod.clone() as Arc<dyn ExecutorBackend>, 1),
                    (self.vm.clone() as Arc<dyn ExecutorBackend>, 1),
                ],
                CapabilityKey::new(KEY).expect("key"),
            )
            .with_finished(finished.clone()),
        );
        finished
    }

    /// Plays a runner polling for `a`'s task every 20 ms for `time`; whether it got it.
    async fn runner_got_task_within(&self, a: &Assignment, time: Duration) -> bool {
        let capability = self.dispatch.capability_key().issue(a.id());
        let deadline = tokio::time::Instant::now() + time;
        while tokio::time::Instant::now() < deadline {
            if let Ok(auth) = self.dispatch.authorize(
                a.id().as_str(),
                capability.expose(),
                a.identity().spiffe_id(),
            ) && let Ok(Fetched::Task(_)) = self.dispatch.take_task(&auth).await
            {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        false
    }
}

/// DESIGN invariant 12 (issue 37): once a job's start-deadline failure has won, no runner
/// can claim it, also after the delivery is put back because neither the terminal marker
/// nor the deletion could be written: the redelivery finds the unclaimed executor and must
/// not offer its task again.
#[tokio::test]
async fn a_job_failed_at_its_start_deadline_is_never_claimed_by_a_redelivery_after_its_clean_up_failed()
 {
    let mut h = Harness::new(1, 1).await;
    h.with_finished_bucket().await;
    let a = h.fetched("late", "[self-hosted, pod]").await;
    h.pod.insert(
        &spec_of(&h, &a),
        std::time::SystemTime::now() - Duration::from_secs(120),
    );
    h.pod.fail_marks_of(a.id());
    h.pod.fail_deletes_of(a.id());
    h.start_worker(Backend::Pod, 1).await;
    let payload = encode_v1(&a).expect("encode");
    queue::publish(
        &h.js,
        &stream_settings(),
        Backend::Pod,
        a.id().as_str(),
        payload.into(),
    )
    .await
    .expect("publish");
    h.wait_outcome(a.id().as_str(), Outcome::BackendError).await;
    assert_eq!(
        h.mock.handle.task(a.id().task_id()).expect("task").result,
        gdr_proto::runner::v1::TaskResult::RESULT_FAILURE as i32,
        "Gitea has the failure"
    );
    // Redeliveries come every 300 ms meanwhile.
    assert!(
        !h.runner_got_task_within(&a, Duration::from_secs(4)).await,
        "a job Gitea failed was handed to its runner"
    );
    h.wait_outcome(a.id().as_str(), Outcome::BackendError).await;
    h.pod.heal_marks(a.id());
    h.pod.heal_delete(a.id());
    h.wait_outcome(a.id().as_str(), Outcome::ExecutorFailed)
        .await;
    assert!(h.pod.records().is_empty(), "cleaned up in the end");
}

/// DESIGN invariant 12 (issue 37): the failure of an unclaimed job is durable before Gitea
/// hears of it, so a controller that restarts after the report (before the terminal
/// marker) never offers the job to the executor it finds: the restarted worker cleans the
/// executor up instead, and its runner gets nothing.
#[tokio::test]
async fn a_failure_recorded_before_a_restart_keeps_the_adopted_executor_from_claiming() {
    let mut h = Harness::new(1, 1).await;
    let finished = h.with_finished_bucket().await;
    let a = h.fetched("failed", "[self-hosted, pod]").await;
    // What the controller before the restart left: an unclaimed executor (not overdue by
    // this controller's clock) and the record of the job's failure.
    h.pod.insert(&spec_of(&h, &a), std::time::SystemTime::now());
    finished.record(a.id()).await.expect("record");
    h.start_worker(Backend::Pod, 1).await;
    let payload = encode_v1(&a).expect("encode");
    queue::publish(
        &h.js,
        &stream_settings(),
        Backend::Pod,
        a.id().as_str(),
        payload.into(),
    )
    .await
    .expect("publish");
    assert!(
        !h.runner_got_task_within(&a, Duration::from_secs(3)).await,
        "the runner of a failed job got its task"
    );
    h.wait_outcome(a.id().as_str(), Outcome::ExecutorFailed)
        .await;
    assert!(h.pod.records().is_empty(), "the executor is cleaned up");
    assert_eq!(
        h.mock.handle.task(a.id().task_id()).expect("task").result,
        gdr_proto::runner::v1::TaskResult::RESULT_FAILURE as i32,
        "Gitea has the failure"
    );
}

/// DESIGN invariant 12 (issue 37): the failure of an unclaimed job is recorded as finished
/// before it is reported, so no crash between the report and the terminal marker can leave
/// a failed job claimable; while the record cannot be written nothing is reported.
#[tokio::test]
async fn the_failure_of_an_unclaimed_job_is_recorded_before_gitea_hears_of_it() {
    use gdr_testkit::mock_gitea::{MockFault, RpcMethod};
    let mut h = Harness::new(1, 1).await;
    let finished = h.with_finished_bucket().await;
    h.start_worker(Backend::Pod, 1).await;
    let a = h.publish_job("[self-hosted, pod]").await;
    h.wait_offered(a.id()).await;
    for _ in 0..4 {
        h.mock.handle.fail_next(
            RpcMethod::UpdateTask,
            MockFault::Connect {
                code: connectrpc::ErrorCode::Unavailable,
                message: "Gitea restarting".into(),
            },
        );
    }
    h.pod.finish(a.id(), false);
    h.wait_outcome(a.id().as_str(), Outcome::ReportPending)
        .await;
    assert!(
        finished.contains(a.id()).await.expect("read"),
        "a report was sent before the failure was durable"
    );
}

/// Issue 39 item 5, DESIGN invariant 8: the controller's warm-claim arbiter, kept in the
/// finished-assignments bucket that every replica shares: of two assignments claiming one
/// warm sandbox, whichever comes first holds it and the other is refused, then and later;
/// the holder claiming again (a worker retrying its create) keeps it; another sandbox is
/// free; and the hold says since when, for the pass to find one a dead claimant left.
#[tokio::test]
async fn the_warm_claim_arbiter_gives_a_sandbox_to_exactly_one_assignment_and_keeps_it_for_its_retries()
 {
    use gdr_core::executor::WarmClaims;
    let nats = NatsServer::start().await.expect("nats-server");
    let js = jetstream::new(async_nats::connect(nats.url()).await.expect("connect"));
    let finished =
        queue::FinishedAssignments::open(&js, "finished-test", Duration::from_secs(3600), true)
            .await
            .expect("bucket");
    // Two replicas: each its own handle on the one bucket.
    let (one, two) = (finished.warm_claims(), finished.warm_claims());
    let (a, b) = (
        AssignmentId::from_task_id(1).unwrap(),
        AssignmentId::from_task_id(2).unwrap(),
    );
    assert!(one.held_since("sandbox-1").await.unwrap().is_none());
    let before = std::time::SystemTime::now() - Duration::from_secs(5);
    let (ra, rb) = tokio::join!(one.claim("sandbox-1", &a), two.claim("sandbox-1", &b));
    let (ra, rb) = (ra.unwrap(), rb.unwrap());
    assert!(ra != rb, "exactly one holds it: {ra} {rb}");
    let (holder, other, holder_id, other_id) = if ra {
        (&one, &two, &a, &b)
    } else {
        (&two, &one, &b, &a)
    };
    assert!(
        holder.claim("sandbox-1", holder_id).await.unwrap(),
        "a retry keeps it"
    );
    assert!(
        other.claim("sandbox-1", holder_id).await.unwrap(),
        "from any replica"
    );
    assert!(
        !other.claim("sandbox-1", other_id).await.unwrap(),
        "still refused"
    );
    assert!(
        other.claim("sandbox-2", other_id).await.unwrap(),
        "another is free"
    );
    let since = one.held_since("sandbox-1").await.unwrap().expect("held");
    assert!(since >= before, "{since:?}");
    assert!(
        !finished.contains(holder_id).await.unwrap(),
        "a claim is not a finished record"
    );
}
