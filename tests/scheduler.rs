//! The scheduler against real peers: the mock Gitea (real Connect protocol) and a
//! real nats-server child process.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_nats::jetstream;
use async_nats::jetstream::stream::LastRawMessageErrorKind;
use gdr_controller::queue;
use gdr_controller::scheduler::{
    Backoff, Heartbeater, INVALID_TASK_LOG_PREFIX, Report, Scheduler, SchedulerSettings,
    SchedulerStats, TasksVersion,
};
use gdr_controller::shutdown::{ShutdownTrigger, shutdown_channel};
use gdr_core::assignment::AssignmentId;
use gdr_gitea::{ClientOptions, Credentials, GiteaClient};
use gdr_proto::runner::v1 as pb;
use gdr_testkit::mock_gitea::{
    JobId, MockConfig, MockGitea, RpcMethod, RunningMock, Status, Trigger,
};
use gdr_testkit::nats_server::{AckDropper, NatsServer};
use gdr_testkit::until;
use tokio::task::JoinHandle;

use crate::queue_common::{policy, stream_settings};

const WAIT: Duration = Duration::from_secs(30);
/// The idle poller's pace in these tests (production: 2 s).
const IDLE: Duration = Duration::from_millis(100);

/// Mock Gitea, nats-server, and the controller's runner registration.
struct Env {
    mock: RunningMock,
    nats: NatsServer,
    js: jetstream::Context,
    gitea: GiteaClient,
}

impl Env {
    async fn start(config: MockConfig) -> Env {
        Self::start_with(config, ClientOptions::new("").fetch_timeout).await
    }

    /// With the controller's FetchTask deadline set to `fetch_timeout`.
    async fn start_with(config: MockConfig, fetch_timeout: Duration) -> Env {
        let nats = NatsServer::start().await.expect("nats-server");
        let client = async_nats::connect(nats.url()).await.expect("connect");
        let js = jetstream::new(client);
        queue::ensure_stream(&js, &stream_settings())
            .await
            .expect("stream");
        let mock = MockGitea::start(config).await.expect("mock");
        let (uuid, token) = mock.handle.create_runner("controller", &[], false);
        let mut options = ClientOptions::new(mock.url.clone());
        options.fetch_timeout = fetch_timeout;
        let gitea =
            GiteaClient::new(options, Some(&Credentials::new(uuid, token))).expect("client");
        Env {
            mock,
            nats,
            js,
            gitea,
        }
    }

    fn gitea_mock(&self) -> &MockGitea {
        &self.mock.handle
    }

    /// Queues one workflow run with `n` jobs `runs-on: [self-hosted, pod]`.
    fn queue_jobs(&self, n: usize) -> Vec<JobId> {
        let mut yaml = String::from("on: push\njobs:\n");
        for i in 0..n {
            yaml.push_str(&format!(
                "  job_{i}:\n    runs-on: [self-hosted, pod]\n    steps: []\n"
            ));
        }
        self.gitea_mock()
            .queue_workflow("owner/repo", &yaml)
            .expect("queue")
    }

    fn settings(&self, pollers: usize, backlog_limit: u64) -> SchedulerSettings {
        let mut settings = SchedulerSettings::new(
            vec!["self-hosted".into(), "pod".into(), "vm".into()],
            vec!["cancelling".into()],
            pollers,
            backlog_limit,
        );
        settings.backlog_refresh = Duration::from_millis(50);
        settings.idle_interval = IDLE;
        settings.error_backoff =
            Backoff::new(Duration::from_millis(20), Duration::from_millis(200));
        settings.publish_backoff =
            Backoff::new(Duration::from_millis(20), Duration::from_millis(200));
        settings.shutdown_publish_timeout = Duration::from_secs(10);
        settings
    }

    fn scheduler(&self, pollers: usize, backlog_limit: u64) -> Scheduler {
        self.scheduler_with(self.settings(pollers, backlog_limit))
    }

    fn scheduler_with(&self, settings: SchedulerSettings) -> Scheduler {
        Scheduler::new(
            self.gitea.clone(),
            self.js.clone(),
            stream_settings(),
            policy(),
            settings,
        )
    }

    /// Assignment IDs of the messages in the stream, in stream order.
    async fn stream_ids(&self) -> Vec<String> {
        let stream = queue::open_stream(&self.js, &stream_settings())
            .await
            .expect("open stream");
        let mut ids = Vec::new();
        let mut seq = 1;
        loop {
            match stream
                .get_first_raw_message_by_subject("ci.runner.>", seq)
                .await
            {
                Ok(m) => {
                    let v: serde_json::Value =
                        serde_json::from_slice(&m.payload).expect("envelope JSON");
                    ids.push(v["id"].as_str().expect("id").to_string());
                    seq = m.sequence + 1;
                }
                Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => return ids,
                Err(e) => panic!("reading the stream: {e}"),
            }
        }
    }

    async fn unclaimed(&self) -> u64 {
        self.try_unclaimed().await.expect("stream info")
    }

    /// `None` while NATS is unreachable.
    async fn try_unclaimed(&self) -> Option<u64> {
        let read = async {
            let mut stream = queue::open_stream(&self.js, &stream_settings())
                .await
                .ok()?;
            queue::unclaimed(&mut stream).await.ok()
        };
        tokio::time::timeout(Duration::from_secs(2), read)
            .await
            .ok()
            .flatten()
    }

    /// Deletes the messages in the stream now (as claims would, via acks); messages
    /// published meanwhile stay.
    async fn drain_stream(&self) {
        let mut stream = queue::open_stream(&self.js, &stream_settings())
            .await
            .expect("open stream");
        let last = stream.info().await.expect("info").state.last_sequence;
        let mut seq = 1;
        while let Ok(m) = stream
            .get_first_raw_message_by_subject("ci.runner.>", seq)
            .await
        {
            if m.sequence > last {
                break;
            }
            stream.delete_message(m.sequence).await.expect("delete");
            seq = m.sequence + 1;
        }
    }

    /// The stream holds `n` messages, one per task Gitea handed out, each under its
    /// assignment ID.
    async fn assert_each_task_stored_once(&self, n: usize) {
        let stored = self.stream_ids().await;
        let unique: BTreeSet<String> = stored.iter().cloned().collect();
        assert_eq!(stored.len(), n, "each assignment stored exactly once");
        assert_eq!(unique, self.assignment_ids_of_claimed_jobs());
    }

    fn assignment_ids_of_claimed_jobs(&self) -> BTreeSet<String> {
        self.gitea_mock()
            .jobs()
            .iter()
            .filter_map(|j| j.task_id)
            .map(|t| AssignmentId::from_task_id(t).expect("id").to_string())
            .collect()
    }

    fn jobs_with(&self, status: Status) -> usize {
        self.gitea_mock()
            .jobs()
            .iter()
            .filter(|j| j.status == status)
            .count()
    }
}

fn count(c: &AtomicU64) -> u64 {
    c.load(Ordering::Relaxed)
}

struct Running {
    trigger: ShutdownTrigger,
    join: JoinHandle<Result<Report, gdr_controller::scheduler::SchedulerError>>,
    stats: Arc<SchedulerStats>,
}

impl Running {
    fn start(scheduler: Scheduler) -> Running {
        let (trigger, shutdown) = shutdown_channel();
        let stats = scheduler.stats();
        let join = tokio::spawn(scheduler.run(shutdown));
        Running {
            trigger,
            join,
            stats,
        }
    }

    async fn stop(self) -> Report {
        self.trigger.trigger();
        self.join.await.expect("join").expect("scheduler run")
    }
}

/// DESIGN invariant 1: one registration and one Declare for the whole controller, whatever the
/// number of pollers (Gitea keeps one runner row; a Declare per poller would also race the
/// label update).
#[tokio::test]
async fn one_declare_serves_every_poller() {
    use gdr_testkit::mock_gitea::RpcMethod;
    let env = Env::start(MockConfig::default()).await;
    env.queue_jobs(6);
    let running = Running::start(env.scheduler(4, 100));
    until(WAIT, "all six assignments are in the stream", || async {
        env.unclaimed().await == 6
    })
    .await;
    running.stop().await;
    assert_eq!(env.gitea_mock().calls(RpcMethod::Declare), 1);
    assert!(env.gitea_mock().calls(RpcMethod::FetchTask) >= 6);
}

/// DESIGN invariant 1: a burst of ten waiting jobs is fetched completely by pollers sharing one
/// tasks version reset to 0 after every task; nothing depends on Gitea bumping its version.
#[tokio::test]
async fn a_burst_of_ten_waiting_jobs_is_fetched_completely_without_a_new_version_bump() {
    let env = Env::start(MockConfig::default()).await;
    env.queue_jobs(10);
    let version_after_queueing = env.gitea_mock().tasks_version();

    let running = Running::start(env.scheduler(3, 100));
    until(WAIT, "all ten assignments are in the stream", || async {
        env.unclaimed().await == 10
    })
    .await;
    let report = running.stop().await;

    assert_eq!(report.tasks_fetched, 10);
    assert_eq!(env.jobs_with(Status::Running), 10);
    let ids: BTreeSet<String> = env.stream_ids().await.into_iter().collect();
    assert_eq!(ids, env.assignment_ids_of_claimed_jobs());
    assert_eq!(
        env.gitea_mock().tasks_version(),
        version_after_queueing,
        "nothing bumped the version: the pollers found the jobs by resetting to 0"
    );
}

/// DESIGN invariant 1: the shared tasks version is reset to 0 after every task (sending the
/// version Gitea answered would hide the next waiting job), and a poller's stale empty answer
/// cannot undo the reset.
#[tokio::test]
async fn the_shared_version_is_reset_after_a_task() {
    let env = Env::start(MockConfig::default()).await;
    env.gitea
        .declare(vec!["self-hosted".into(), "pod".into()], vec![])
        .await
        .expect("declare");
    let version = TasksVersion::new();
    env.queue_jobs(2);

    let sent = version.current();
    let first = env.gitea.fetch_task(sent).await.expect("fetch");
    assert!(first.task.is_set(), "version 0 always picks");
    let latest = first.tasks_version;
    version.task_received();
    assert_eq!(version.current(), 0);

    // Claiming did not bump the version: sending the answered one would hide job 2.
    let skipped = env.gitea.fetch_task(latest).await.expect("fetch");
    assert!(
        !skipped.task.is_set(),
        "Gitea skips the pick at the latest version"
    );
    // A poller's stale empty answer must not undo the reset.
    version.empty_answer(latest, skipped.tasks_version);
    assert_eq!(version.current(), 0);

    let second = env
        .gitea
        .fetch_task(version.current())
        .await
        .expect("fetch");
    assert!(
        second.task.is_set(),
        "after the reset the waiting job is found"
    );
    version.task_received();
    let empty = env
        .gitea
        .fetch_task(version.current())
        .await
        .expect("fetch");
    assert!(!empty.task.is_set());
    version.empty_answer(0, empty.tasks_version);
    assert_eq!(version.current(), empty.tasks_version);
}

/// DESIGN invariants 2, 3: a poller holding a fetched task retries publishing it until
/// JetStream stores it, across a nats-server restart; every assignment is stored exactly once,
/// under its assignment ID, and none is lost.
#[tokio::test]
async fn publishing_retries_until_jetstream_accepts_and_loses_nothing_across_a_nats_restart() {
    // Each fetch takes a while, so fetches are in flight when NATS goes away.
    let mut env =
        Env::start(MockConfig::default().with_fetch_delay(Duration::from_millis(300))).await;
    env.queue_jobs(12);
    let running = Running::start(env.scheduler(3, 100));
    until(WAIT, "some assignments are stored", || async {
        env.unclaimed().await >= 3
    })
    .await;

    env.nats.kill().await.expect("kill nats-server");
    let stats = running.stats.clone();
    until(
        WAIT,
        "a fetched task's publish is being retried",
        || async { stats.publish_retries.get() >= 1 },
    )
    .await;
    env.nats.restart().await.expect("restart nats-server");

    until(
        WAIT,
        "every job is fetched and every assignment stored",
        || async { env.jobs_with(Status::Waiting) == 0 && env.try_unclaimed().await == Some(12) },
    )
    .await;
    let report = running.stop().await;
    assert_eq!(report.tasks_fetched, 12);
    assert!(report.lost_task_ids.is_empty());
    let stored = env.stream_ids().await;
    let unique: BTreeSet<String> = stored.iter().cloned().collect();
    assert_eq!(
        stored.len(),
        unique.len(),
        "each assignment stored exactly once"
    );
    assert_eq!(unique, env.assignment_ids_of_claimed_jobs());
}

/// DESIGN invariant 5b: while the backlog of unclaimed assignments is full the pollers fetch
/// nothing (exactly the bound is fetched), and fetching resumes as claims make room.
#[tokio::test]
async fn the_scheduler_stops_fetching_while_the_backlog_is_full() {
    let env = Env::start(MockConfig::default()).await;
    env.queue_jobs(5);
    let pollers = 3;
    // Only the pod backend: with its backlog full nothing is open.
    let mut settings = env.settings(pollers, 2);
    settings.labels = vec!["self-hosted".into(), "pod".into()];
    let running = Running::start(env.scheduler_with(settings));
    let stats = running.stats.clone();
    // Held back with a full backlog (the gate is also shut before its first read).
    let all_held_back = || async {
        count(&stats.pollers_waiting_for_backlog) == pollers as u64 && env.unclaimed().await == 2
    };

    until(
        WAIT,
        "the backlog is full and every poller is held back",
        all_held_back,
    )
    .await;
    assert_eq!(
        env.jobs_with(Status::Running),
        2,
        "exactly the backlog is fetched"
    );
    assert_eq!(env.jobs_with(Status::Waiting), 3);

    // Claims remove the messages (work-queue retention); room for two more.
    env.drain_stream().await;
    until(WAIT, "two more are fetched", || async {
        env.jobs_with(Status::Running) == 4
    })
    .await;
    until(WAIT, "the backlog is full again", all_held_back).await;
    assert_eq!(env.jobs_with(Status::Running), 4);
    assert_eq!(env.jobs_with(Status::Waiting), 1);

    env.drain_stream().await;
    until(WAIT, "the last job is fetched", || async {
        env.jobs_with(Status::Running) == 5 && env.unclaimed().await == 1
    })
    .await;
    let report = running.stop().await;
    assert_eq!(report.tasks_fetched, 5);
}

/// DESIGN invariant 22: each backend's backlog is counted on its own subject. Pod
/// assignments nothing consumes (a dead or disabled pod worker) fill only the pod backlog:
/// the controller declares the vm label alone and keeps polling for vm jobs, and declares
/// both again once the pod backlog has room — and then fetches the pod job Gitea held
/// back meanwhile, although Declare does not bump Gitea's tasks version.
#[tokio::test]
async fn a_full_pod_backlog_does_not_stop_fetching_vm_jobs() {
    let env = Env::start(MockConfig::default()).await;
    let queue = |key: &str, runs_on: &str| {
        env.gitea_mock()
            .queue_workflow(
                "owner/repo",
                &format!("on: push\njobs:\n  {key}:\n    runs-on: {runs_on}\n    steps: []\n"),
            )
            .expect("queue")[0]
    };
    let running_of = |jobs: &[JobId]| {
        jobs.iter()
            .filter(|j| {
                env.gitea_mock()
                    .job(**j)
                    .is_some_and(|j| j.status == Status::Running)
            })
            .count()
    };
    let pods: Vec<_> = (0..3)
        .map(|i| queue(&format!("pod_{i}"), "[self-hosted, pod]"))
        .collect();
    let running = Running::start(env.scheduler(2, 2));
    until(WAIT, "the pod backlog is full", || async {
        running_of(&pods) == 2
    })
    .await;
    until(
        WAIT,
        "the labels are declared without the full backend",
        || async { env.gitea_mock().calls(RpcMethod::Declare) >= 2 },
    )
    .await;
    // Idle polls for vm jobs: their empty answers bring the pollers' tasks version up to
    // Gitea's, which then answers without looking for jobs.
    let calls = env.gitea_mock().calls(RpcMethod::FetchTask);
    until(WAIT, "idle polls for vm jobs", || async {
        env.gitea_mock().calls(RpcMethod::FetchTask) >= calls + 3
    })
    .await;
    assert_eq!(running_of(&pods), 2, "no pod job beyond the pod backlog");

    // Claims drain the pod backlog: the pod label is declared again and the waiting pod
    // job fetched, although Gitea's tasks version did not move.
    env.drain_stream().await;
    until(WAIT, "the last pod job is fetched", || async {
        running_of(&pods) == 3
    })
    .await;

    // Meanwhile vm jobs were never held back by the pod backlog.
    let vms: Vec<_> = (0..3)
        .map(|i| queue(&format!("vm_{i}"), "[self-hosted, vm]"))
        .collect();
    until(WAIT, "vm jobs fill their own backlog", || async {
        running_of(&vms) == 2
    })
    .await;
    env.drain_stream().await;
    until(WAIT, "the last vm job is fetched", || async {
        running_of(&vms) == 3
    })
    .await;
    running.stop().await;
}

/// DESIGN invariant 5a: a queued assignment's task gets task-ID-only heartbeats from what the
/// stream holds (the scheduler may stop), so Gitea's zombie sweep (10 minutes in Gitea, 3 s
/// here) never fails it.
#[tokio::test]
async fn a_queued_assignment_outlives_a_three_second_zombie_timeout() {
    let env = Env::start(MockConfig::default().with_zombie_timeout(Duration::from_secs(3))).await;
    let job = env.queue_jobs(1)[0];
    let running = Running::start(env.scheduler(1, 10));
    let heartbeater = Heartbeater::new(
        env.gitea.clone(),
        env.js.clone(),
        stream_settings(),
        Duration::from_secs(1),
    );
    let hb_stats = heartbeater.stats();
    let (hb_trigger, hb_shutdown) = shutdown_channel();
    let hb = tokio::spawn(async move { heartbeater.run(hb_shutdown).await });

    until(WAIT, "the assignment is queued", || async {
        env.unclaimed().await == 1
    })
    .await;
    // The scheduler may stop: heartbeats come from what the stream holds.
    running.stop().await;

    let task_id = env
        .gitea_mock()
        .job(job)
        .expect("job")
        .task_id
        .expect("claimed");
    // Six heartbeats one second apart span five seconds, beyond the 3 s timeout and
    // several sweeps; stop early if the sweeper fails the task.
    env.gitea_mock()
        .wait_for(
            |m| {
                let t = m.task(task_id).expect("task");
                t.heartbeats >= 6 || t.status.is_done()
            },
            WAIT,
        )
        .await
        .expect("heartbeats");
    let task = env.gitea_mock().task(task_id).expect("task");
    assert_eq!(
        task.status,
        Status::Running,
        "the queued task was not reaped"
    );
    assert!(task.heartbeats >= 6);
    // The last answer may still be on its way back.
    assert!(hb_stats.heartbeats_sent.get() >= 5);
    assert_eq!(count(&hb_stats.heartbeat_errors), 0);
    hb_trigger.trigger();
    hb.await.expect("heartbeater");
}

/// DESIGN invariant 5a: a heartbeat round reads Gitea's answer for each queued task, so a task
/// cancelled in Gitea while queued is reported as ended.
#[tokio::test]
async fn a_heartbeat_reports_a_queued_task_that_was_cancelled_in_gitea() {
    let env = Env::start(MockConfig::default()).await;
    let job = env.queue_jobs(1)[0];
    let running = Running::start(env.scheduler(1, 10));
    until(WAIT, "the assignment is queued", || async {
        env.unclaimed().await == 1
    })
    .await;
    running.stop().await;
    let task_id = env
        .gitea_mock()
        .job(job)
        .expect("job")
        .task_id
        .expect("claimed");
    let heartbeater = Heartbeater::new(
        env.gitea.clone(),
        env.js.clone(),
        stream_settings(),
        Duration::from_secs(60),
    );

    let round = heartbeater.beat_once().await;
    assert_eq!((round.queued, round.sent, round.failed), (1, 1, 0));
    assert!(round.ended.is_empty());

    env.gitea_mock().cancel_job(job).expect("cancel");
    let round = heartbeater.beat_once().await;
    assert_eq!(
        round.ended,
        vec![(task_id, pb::TaskResult::RESULT_CANCELLED)]
    );
    assert_eq!(count(&heartbeater.stats().queued_tasks_ended), 1);
}

/// The task IDs of `jobs` (each fetched already).
fn task_ids(env: &Env, jobs: &[JobId]) -> Vec<i64> {
    jobs.iter()
        .map(|j| {
            env.gitea_mock()
                .job(*j)
                .and_then(|j| j.task_id)
                .expect("fetched")
        })
        .collect()
}

/// DESIGN invariants 5a, 21: nothing loads the whole stream into memory (anyone able to
/// publish can fill it). A reader returns pages of at most its page size and stops at its
/// cap, counting what it left unread, and one started where it stopped reads the rest. A
/// heartbeat round reads at most its cap and the next round continues where it stopped, so
/// every queued task is beaten within a few rounds, each exactly once here.
#[tokio::test]
async fn the_stream_is_read_in_bounded_pages_and_a_capped_heartbeat_round_is_continued_by_the_next()
{
    let env = Env::start(MockConfig::default()).await;
    let jobs = env.queue_jobs(5);
    let running = Running::start(env.scheduler(1, 10));
    until(WAIT, "the assignments are queued", || async {
        env.unclaimed().await == 5
    })
    .await;
    running.stop().await;

    let stream = queue::open_stream(&env.js, &stream_settings())
        .await
        .expect("open stream");
    let limits = queue::ReadLimits { page: 2, max: 4 };
    let mut reader = queue::QueuedReader::new(&stream, "ci.runner.>", limits);
    let mut pages = Vec::new();
    while let Some(page) = reader.next_page().await.expect("page") {
        pages.push(page.len());
    }
    assert_eq!(pages, vec![2, 2], "pages of the page size, up to the cap");
    assert!(reader.capped());
    assert_eq!(reader.unread(), 1);
    let mut rest =
        queue::QueuedReader::new(&stream, "ci.runner.>", limits).starting_at(reader.position());
    let last = rest.next_page().await.expect("page").expect("the fifth");
    assert_eq!(last.len(), 1);
    assert!(rest.next_page().await.expect("end").is_none());
    assert!(!rest.capped());

    let heartbeater = Heartbeater::new(
        env.gitea.clone(),
        env.js.clone(),
        stream_settings(),
        Duration::from_secs(60),
    )
    .with_read_limits(queue::ReadLimits { page: 2, max: 3 });
    let first = heartbeater.beat_once().await;
    assert_eq!((first.queued, first.sent, first.unread), (3, 3, 2));
    let second = heartbeater.beat_once().await;
    assert_eq!((second.queued, second.sent, second.failed), (2, 2, 0));
    for task_id in task_ids(&env, &jobs) {
        assert_eq!(
            env.gitea_mock().task(task_id).map(|t| t.heartbeats),
            Some(1),
            "task {task_id}"
        );
    }
}

/// DESIGN invariant 5a: while the stream cannot be read, queued tasks are beaten from the
/// controller's own record of what it fetched and published, so a NATS outage longer than
/// Gitea's zombie timeout (10 minutes in Gitea, 3 s here) fails no queued task. Once the
/// stream is readable again, the record forgets the tasks whose message left it.
#[tokio::test]
async fn queued_tasks_outlive_a_nats_outage_longer_than_the_zombie_timeout() {
    let mut env =
        Env::start(MockConfig::default().with_zombie_timeout(Duration::from_secs(3))).await;
    let jobs = env.queue_jobs(2);
    let scheduler = env.scheduler(1, 10);
    let fetched = scheduler.fetched_tasks();
    let running = Running::start(scheduler);
    let heartbeater = Heartbeater::new(
        env.gitea.clone(),
        env.js.clone(),
        stream_settings(),
        Duration::from_millis(500),
    )
    .with_fetched_tasks(fetched.clone());
    let (hb_trigger, hb_shutdown) = shutdown_channel();
    let hb = tokio::spawn(async move { heartbeater.run(hb_shutdown).await });
    until(WAIT, "both assignments are queued", || async {
        env.unclaimed().await == 2
    })
    .await;
    let tasks = task_ids(&env, &jobs);
    assert_eq!(fetched.len(), 2);

    env.nats.kill().await.expect("kill nats-server");
    let beats = |m: &MockGitea| -> Vec<u64> {
        tasks
            .iter()
            .map(|t| m.task(*t).map(|t| t.heartbeats).unwrap_or(0))
            .collect()
    };
    let at_kill = beats(env.gitea_mock());
    // Ten more heartbeats each, at least half a second apart, span beyond the 3 s timeout
    // and several sweeps; stop early if the sweeper fails a task.
    env.gitea_mock()
        .wait_for(
            |m| {
                let done = tasks
                    .iter()
                    .any(|t| m.task(*t).is_some_and(|t| t.status.is_done()));
                done || beats(m)
                    .iter()
                    .zip(&at_kill)
                    .all(|(now, then)| *now >= then + 10)
            },
            WAIT,
        )
        .await
        .expect("heartbeats during the outage");
    for task_id in &tasks {
        assert_eq!(
            env.gitea_mock().task(*task_id).map(|t| t.status),
            Some(Status::Running),
            "queued task {task_id} was not reaped during the outage"
        );
    }

    env.nats.restart().await.expect("restart nats-server");
    until(WAIT, "the stream is readable again", || async {
        env.try_unclaimed().await == Some(2)
    })
    .await;
    env.drain_stream().await;
    until(
        WAIT,
        "the record forgets the tasks whose message left the stream",
        || async { fetched.is_empty() },
    )
    .await;
    hb_trigger.trigger();
    hb.await.expect("heartbeater");
    running.stop().await;
}

/// DESIGN invariants 5a, 19: after a restart the heartbeater's record starts empty; its
/// first read of the stream adds the assignments a scheduler of this deployment wrote
/// (their `id_mac` verifies), so a NATS outage right after a restart fails none of the
/// tasks an earlier process queued either.
#[tokio::test]
async fn a_restarted_heartbeater_rebuilds_its_record_from_the_stream_and_beats_it_through_an_outage()
 {
    use gdr_core::assignment::{TaskKey, TaskKeyring};
    use gdr_core::capability::CapabilityKey;
    let mut env =
        Env::start(MockConfig::default().with_zombie_timeout(Duration::from_secs(3))).await;
    let id_key = CapabilityKey::new(&[7; 32])
        .expect("capability key")
        .envelope_id_key();
    let job = env.queue_jobs(1)[0];
    // The earlier process: it queued the task and went away.
    let running = Running::start(
        env.scheduler(1, 10)
            .with_keyring(Arc::new(TaskKeyring::new(
                TaskKey::from_bytes([1; 32]),
                vec![],
            )))
            .with_envelope_id_key(id_key.clone()),
    );
    until(WAIT, "the assignment is queued", || async {
        env.unclaimed().await == 1
    })
    .await;
    running.stop().await;
    let task_id = task_ids(&env, &[job])[0];

    let heartbeater = Heartbeater::new(
        env.gitea.clone(),
        env.js.clone(),
        stream_settings(),
        Duration::from_millis(500),
    )
    .with_held(id_key, Duration::from_secs(3600));
    let first = heartbeater.beat_once().await;
    assert_eq!((first.queued, first.sent, first.from_record), (1, 1, 0));
    env.nats.kill().await.expect("kill nats-server");
    let (hb_trigger, hb_shutdown) = shutdown_channel();
    let hb = tokio::spawn(async move { heartbeater.run(hb_shutdown).await });
    // Ten more heartbeats, at least half a second apart, span beyond the 3 s timeout.
    env.gitea_mock()
        .wait_for(
            |m| {
                m.task(task_id)
                    .is_some_and(|t| t.status.is_done() || t.heartbeats >= 11)
            },
            WAIT,
        )
        .await
        .expect("heartbeats during the outage");
    assert_eq!(
        env.gitea_mock().task(task_id).map(|t| t.status),
        Some(Status::Running),
        "the task an earlier process queued was not reaped during the outage"
    );
    hb_trigger.trigger();
    hb.await.expect("heartbeater");
}

/// DESIGN invariants 3, 21: the message ID is the assignment ID, so a retried publish is
/// stored once; but anyone able to publish can take an upcoming assignment ID within
/// JetStream's duplicate window. A message that is not the assignment holding its ID does
/// not make the real publish a "duplicate": the assignment is stored beside it.
#[tokio::test]
async fn a_forged_message_holding_an_assignments_message_id_does_not_drop_the_assignment() {
    let env = Env::start(MockConfig::default()).await;
    // Nothing fetched yet: Gitea hands out task 1 next.
    let forged = jetstream::message::PublishMessage::build()
        .payload(br#"{"id":"gitea-task-1"}"#.to_vec().into())
        .message_id("gitea-task-1");
    env.js
        .send_publish("ci.runner.pod", forged)
        .await
        .expect("publish")
        .await
        .expect("stored");
    let job = env.queue_jobs(1)[0];
    let running = Running::start(env.scheduler(1, 10));
    until(
        WAIT,
        "the real assignment stored beside the forged message",
        || async { env.unclaimed().await == 2 },
    )
    .await;
    let report = running.stop().await;
    assert_eq!(report.tasks_published, 1);
    assert_eq!(task_ids(&env, &[job]), vec![1]);
    let stream = queue::open_stream(&env.js, &stream_settings())
        .await
        .expect("open stream");
    let stored = stream
        .get_raw_message(stream.cached_info().state.last_sequence)
        .await
        .expect("the real assignment");
    let assignment =
        gdr_core::assignment::decode(&stored.payload, &policy(), None).expect("the real envelope");
    assert_eq!(assignment.id().task_id(), 1);
}

/// DESIGN invariant 5: the backend is derived from the task alone; a task whose `runs-on`
/// selects none never reaches the stream and is failed in Gitea with the reason in its log.
#[tokio::test]
async fn a_task_whose_runs_on_selects_no_backend_is_failed_in_gitea_with_a_reason() {
    let env = Env::start(MockConfig::default()).await;
    let job = env
        .gitea_mock()
        .queue_workflow(
            "owner/repo",
            "on: push\njobs:\n  lonely:\n    runs-on: [self-hosted]\n    steps: []\n",
        )
        .expect("queue")[0];
    let running = Running::start(env.scheduler(1, 10));
    env.gitea_mock()
        .wait_for(|m| m.job(job).is_some_and(|j| j.status.is_done()), WAIT)
        .await
        .expect("job ends");
    let report = running.stop().await;

    let job = env.gitea_mock().job(job).expect("job");
    assert_eq!(job.status, Status::Failure);
    let task = job.task.expect("task");
    assert_eq!(task.log_rows.len(), 1, "{:?}", task.log_rows);
    assert!(
        task.log_rows[0].starts_with(INVALID_TASK_LOG_PREFIX),
        "{:?}",
        task.log_rows
    );
    assert!(task.stopped.is_some());
    assert_eq!(report.invalid_tasks_failed, 1);
    assert_eq!(report.tasks_published, 0);
    assert_eq!(env.unclaimed().await, 0, "nothing reached the stream");
}

/// DESIGN invariant 13: the SPIFFE ID names the ref a job runs for, so a task whose
/// context has no `ref` gets no identity: it never reaches the stream (not even with a
/// weaker identity) and is failed in Gitea with a reason naming the field.
#[tokio::test]
async fn a_task_without_a_ref_is_failed_in_gitea_with_a_reason_naming_it() {
    let env = Env::start(MockConfig::default()).await;
    let job = env
        .gitea_mock()
        .queue_workflow_for(
            "owner/repo",
            &Trigger::NoRef,
            "on: push\njobs:\n  deploy:\n    runs-on: [self-hosted, pod]\n    steps: []\n",
        )
        .expect("queue")[0];
    let running = Running::start(env.scheduler(1, 10));
    env.gitea_mock()
        .wait_for(|m| m.job(job).is_some_and(|j| j.status.is_done()), WAIT)
        .await
        .expect("job ends");
    let report = running.stop().await;

    let job = env.gitea_mock().job(job).expect("job");
    assert_eq!(job.status, Status::Failure);
    let rows = job.task.expect("task").log_rows;
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert!(
        rows[0].starts_with(INVALID_TASK_LOG_PREFIX) && rows[0].contains("has no ref"),
        "{rows:?}"
    );
    assert_eq!(report.invalid_tasks_failed, 1);
    assert_eq!(report.tasks_published, 0);
    assert_eq!(env.unclaimed().await, 0, "nothing reached the stream");
}

/// DESIGN invariant 2 (issue 37): a poller publishes until JetStream stores the
/// assignment, but an envelope larger than the NATS server's `max_payload` (1 MiB by
/// default) is never stored: its task is failed in Gitea at once with a reason naming the
/// limit, its poller and its backlog room are freed, and the next job is fetched.
#[tokio::test]
async fn an_envelope_larger_than_the_servers_max_payload_fails_its_task_at_once_with_the_reason() {
    let env = Env::start(MockConfig::default()).await;
    // A workflow just under its own limit (1 MiB): its envelope (the task, base64) is larger.
    let large = env
        .gitea_mock()
        .queue_workflow(
            "owner/repo",
            &format!(
                "on: push\njobs:\n  big:\n    runs-on: [self-hosted, pod]\n    steps:\n      - run: echo {}\n",
                "x".repeat(1_000_000)
            ),
        )
        .expect("queue")[0];
    let running = Running::start(env.scheduler(1, 1));
    env.gitea_mock()
        .wait_for(|m| m.job(large).is_some_and(|j| j.status.is_done()), WAIT)
        .await
        .expect("the oversized job is failed");
    let small = env.queue_jobs(1)[0];
    env.gitea_mock()
        .wait_for(|m| m.job(small).is_some_and(|j| j.task_id.is_some()), WAIT)
        .await
        .expect("the next job is fetched by the freed poller within the backlog of one");
    let report = running.stop().await;

    let job = env.gitea_mock().job(large).expect("job");
    assert_eq!(job.status, Status::Failure);
    let rows = job.task.expect("task").log_rows;
    assert!(
        rows.iter()
            .any(|r| r.starts_with(INVALID_TASK_LOG_PREFIX) && r.contains("max_payload")),
        "{rows:?}"
    );
    assert_eq!(report.invalid_tasks_failed, 1);
    assert_eq!(report.tasks_published, 1, "only the small job was stored");
}

/// DESIGN invariant 4: stopping stops new fetches but lets a fetch in flight publish its task.
#[tokio::test]
async fn shutdown_lets_an_in_flight_fetch_publish_its_task() {
    let env = Env::start(MockConfig::default().with_fetch_delay(Duration::from_millis(500))).await;
    let job = env.queue_jobs(1)[0];
    let running = Running::start(env.scheduler(1, 10));
    let stats = running.stats.clone();
    until(WAIT, "the first FetchTask is sent", || async {
        count(&stats.fetch_calls) >= 1
    })
    .await;
    // Gitea answers only after its delay: the fetch is in flight now.
    let report = running.stop().await;

    assert_eq!(report.tasks_fetched, 1);
    assert_eq!(report.tasks_published, 1);
    assert!(report.lost_task_ids.is_empty());
    assert_eq!(count(&stats.fetch_calls), 1, "no new fetch after shutdown");
    let task_id = env
        .gitea_mock()
        .job(job)
        .expect("job")
        .task_id
        .expect("claimed");
    assert_eq!(
        env.stream_ids().await,
        vec![AssignmentId::from_task_id(task_id).expect("id").to_string()]
    );
}

/// DESIGN invariant 4: the wait for an in-flight publish at shutdown is bounded; a task that
/// cannot be stored within it is reported and counted as lost, never dropped silently.
#[tokio::test]
async fn a_task_that_cannot_be_stored_within_the_shutdown_bound_is_reported_lost() {
    let mut env =
        Env::start(MockConfig::default().with_fetch_delay(Duration::from_millis(500))).await;
    let job = env.queue_jobs(1)[0];
    let mut settings = env.settings(1, 10);
    settings.shutdown_publish_timeout = Duration::from_millis(300);
    let running = Running::start(env.scheduler_with(settings));
    let stats = running.stats.clone();
    until(WAIT, "the first FetchTask is sent", || async {
        count(&stats.fetch_calls) >= 1
    })
    .await;
    env.nats.kill().await.expect("kill nats-server");
    let report = running.stop().await;

    let task_id = env
        .gitea_mock()
        .job(job)
        .expect("job")
        .task_id
        .expect("claimed");
    assert_eq!(report.tasks_fetched, 1);
    assert_eq!(report.tasks_published, 0);
    assert_eq!(report.lost_task_ids, vec![task_id]);
    assert_eq!(stats.tasks_lost.get(), 1);
}

/// DESIGN invariant 1 (idle load): an idle controller costs Gitea one FetchTask per idle
/// interval whatever its number of pollers: after the first round every poller but one
/// parks. Counted against the mock over a window measured as it passes: the bound grows
/// with the elapsed time, so a slow machine only makes fewer calls.
#[tokio::test]
async fn an_idle_controller_calls_fetch_task_once_per_idle_interval_whatever_its_pollers() {
    use gdr_testkit::mock_gitea::RpcMethod;
    let env = Env::start(MockConfig::default()).await;
    let pollers = 8;
    let running = Running::start(env.scheduler(pollers, 100));
    let stats = running.stats.clone();
    // A burst first, so every poller has been woken and has found Gitea empty since.
    env.queue_jobs(12);
    until(WAIT, "the burst is fetched", || async {
        env.unclaimed().await == 12
    })
    .await;
    until(WAIT, "all but the idle poller parked again", || async {
        count(&stats.pollers_parked) == pollers as u64 - 1
    })
    .await;
    let started = tokio::time::Instant::now();
    let before = env.gitea_mock().calls(RpcMethod::FetchTask);
    let idle_rounds = 15;
    until(WAIT, "the idle poller has polled for a while", || async {
        env.gitea_mock().calls(RpcMethod::FetchTask) >= before + idle_rounds
    })
    .await;
    let calls = env.gitea_mock().calls(RpcMethod::FetchTask) - before;
    let elapsed = started.elapsed();
    assert_eq!(
        count(&stats.pollers_parked),
        pollers as u64 - 1,
        "all but the idle poller park"
    );
    running.stop().await;
    // One call per interval, counted start to start, plus calls of pollers that were
    // still finding Gitea empty when the window opened.
    let bound = (elapsed.as_millis() / IDLE.as_millis()) as u64 + pollers as u64;
    assert!(
        calls <= bound,
        "{calls} FetchTask calls in {elapsed:?} from an idle controller (bound {bound})"
    );
}

/// DESIGN invariant 1 (burst): the task the idle poller gets wakes the parked pollers, so
/// a burst is fetched by every poller at once, and never by more.
#[tokio::test]
async fn a_task_wakes_the_parked_pollers_and_every_poller_fetches_the_burst() {
    use gdr_testkit::mock_gitea::RpcMethod;
    let env = Env::start(MockConfig::default().with_fetch_delay(Duration::from_millis(150))).await;
    let pollers = 4;
    let running = Running::start(env.scheduler(pollers, 100));
    let stats = running.stats.clone();
    until(WAIT, "every poller but one parked", || async {
        count(&stats.pollers_parked) == pollers as u64 - 1
    })
    .await;
    env.gitea_mock().reset_in_flight_peaks();
    env.queue_jobs(24);
    until(WAIT, "the burst is fetched", || async {
        env.unclaimed().await == 24
    })
    .await;
    let peak = env.gitea_mock().in_flight_peak(RpcMethod::FetchTask);
    running.stop().await;
    assert_eq!(
        peak, pollers as u64,
        "every poller (and no more) fetched the burst at once"
    );
}

/// Gitea's long polling (go-gitea/gitea#37482): a FetchTask held open until the client's
/// deadline is an empty answer, neither an error nor a reason to back off. The error
/// backoff here is a minute, so a poller that took the timeout for an error would stop.
#[tokio::test]
async fn a_fetch_task_held_until_the_deadline_is_neither_an_error_nor_backed_off() {
    let mock = MockConfig::default().with_long_poll(Duration::from_secs(3600));
    let env = Env::start_with(mock, Duration::from_millis(300)).await;
    let mut settings = env.settings(3, 100);
    settings.error_backoff = Backoff::new(Duration::from_secs(60), Duration::from_secs(60));
    let running = Running::start(env.scheduler_with(settings));
    let stats = running.stats.clone();
    until(WAIT, "several held polls ran into the deadline", || async {
        count(&stats.fetch_held) >= 5
    })
    .await;
    assert_eq!(stats.fetch_errors_total(), 0, "a held poll is no error");
    env.queue_jobs(1);
    until(WAIT, "a job queued meanwhile is fetched", || async {
        env.unclaimed().await == 1
    })
    .await;
    running.stop().await;
    assert_eq!(stats.fetch_errors_total(), 0);
}

/// With long polling the held request itself picks up the job the moment it is queued:
/// the idle poller's open FetchTask answers with it.
#[tokio::test]
async fn a_held_fetch_task_answers_with_the_job_queued_while_it_is_held() {
    use gdr_testkit::mock_gitea::RpcMethod;
    let mock = MockConfig::default().with_long_poll(Duration::from_secs(3600));
    let env = Env::start_with(mock, Duration::from_secs(60)).await;
    let pollers = 3;
    let running = Running::start(env.scheduler(pollers, 100));
    let stats = running.stats.clone();
    until(WAIT, "one poll held, every other poller parked", || async {
        count(&stats.pollers_parked) == pollers as u64 - 1
            && env.gitea_mock().calls(RpcMethod::FetchTask) == 1
    })
    .await;
    env.queue_jobs(1);
    until(WAIT, "the job is fetched", || async {
        env.unclaimed().await == 1
    })
    .await;
    assert_eq!(stats.fetch_errors_total(), 0);
    assert_eq!(
        count(&stats.fetch_held),
        0,
        "Gitea answered before the deadline"
    );
    // The next poll is held again; a graceful stop would wait out its deadline.
    running.join.abort();
}

/// DESIGN invariant 5b: the backlog bound holds under concurrency. Eight pollers race for
/// a hundred waiting jobs of both backends (Gitea answering each fetch after a delay, so
/// many fetches overlap) while claims keep draining the stream: no backend ever holds
/// more unclaimed assignments than its limit.
#[tokio::test(flavor = "multi_thread")]
async fn racing_pollers_never_queue_more_than_each_backends_backlog_limit() {
    use gdr_core::backend::Backend;
    let config = MockConfig {
        fetch_delay: Some(Duration::from_millis(30)),
        ..MockConfig::default()
    };
    let env = Env::start(config).await;
    let mut yaml = String::from("on: push\njobs:\n");
    for i in 0..100 {
        let backend = if i % 2 == 0 { "pod" } else { "vm" };
        yaml.push_str(&format!(
            "  job_{i}:\n    runs-on: [self-hosted, {backend}]\n    steps: []\n"
        ));
    }
    env.gitea_mock()
        .queue_workflow("owner/repo", &yaml)
        .expect("queue");
    let mut settings = env.settings(8, 5);
    settings.backlog_limits = [(Backend::Pod, 3), (Backend::Vm, 2)].into();
    let running = Running::start(env.scheduler_with(settings));
    let stream = || async {
        queue::open_stream(&env.js, &stream_settings())
            .await
            .expect("open stream")
    };
    let mut worst = (0, 0);
    let mut drained = 0usize;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(8);
    while tokio::time::Instant::now() < deadline {
        let counts = queue::unclaimed_per_backend(&stream().await, &stream_settings())
            .await
            .expect("counts");
        let pod = counts.get(&Backend::Pod).copied().unwrap_or(0);
        let vm = counts.get(&Backend::Vm).copied().unwrap_or(0);
        worst = (worst.0.max(pod), worst.1.max(vm));
        assert!(
            pod <= 3 && vm <= 2,
            "backlog overshot: {pod} pod (limit 3), {vm} vm (limit 2) unclaimed"
        );
        // Claims now and then: room opens and every poller races for it.
        if pod + vm == 5 {
            env.drain_stream().await;
            drained += 1;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    running.stop().await;
    assert!(drained >= 3, "the backlog filled only {drained} times");
    assert_eq!(worst, (3, 2), "both backlogs reached their limit");
}

/// A JetStream context through `proxy` whose publishes give up on an ack after a second
/// (production: 5 s), so a dropped ack is retried soon.
async fn jetstream_via(proxy: &AckDropper) -> jetstream::Context {
    let client = async_nats::connect(proxy.url()).await.expect("connect");
    jetstream::ContextBuilder::new()
        .timeout(Duration::from_secs(1))
        .build(client)
}

/// One poller with a publish window of `window`, publishing through an [`AckDropper`] that
/// drops every publish ack from the start; returns once `window` tasks are stored in the
/// stream and a retried publish's ack was dropped too.
async fn pipelined_with_acks_dropped(env: &Env, window: usize) -> (AckDropper, Running) {
    let proxy = AckDropper::start(&env.nats.url()).await;
    proxy.drop_acks(true);
    let mut settings = env.settings(1, 100);
    settings.publish_window = window;
    let scheduler = Scheduler::new(
        env.gitea.clone(),
        jetstream_via(&proxy).await,
        stream_settings(),
        policy(),
        settings,
    );
    let running = Running::start(scheduler);
    let stats = running.stats.clone();
    until(
        WAIT,
        "the window's tasks are stored and a retried publish lost its ack too",
        || async {
            env.unclaimed().await == window as u64
                && stats.publish_retries.get() >= 1
                && proxy.dropped() > window as u64
        },
    )
    .await;
    (proxy, running)
}

/// DESIGN invariants 2, 3: a poller fetches again while its publishes await their acks, up
/// to its publish window and no further, and a publish whose ack never comes is retried
/// under the assignment's message ID until one does: with every ack dropped and then let
/// through, each fetched task is stored exactly once and none is lost (invariant 2).
#[tokio::test]
async fn a_dropped_publish_ack_is_retried_under_its_message_id_and_every_task_is_stored_exactly_once()
 {
    let env = Env::start(MockConfig::default()).await;
    env.queue_jobs(6);
    let (proxy, running) = pipelined_with_acks_dropped(&env, 4).await;
    let stats = running.stats.clone();
    assert_eq!(
        count(&stats.tasks_published),
        0,
        "no ack reached the controller"
    );
    assert_eq!(
        env.jobs_with(Status::Running),
        4,
        "the poller fetched its window of unacknowledged tasks and nothing more"
    );

    proxy.drop_acks(false);
    until(WAIT, "every job is fetched and stored", || async {
        env.jobs_with(Status::Waiting) == 0 && count(&stats.tasks_published) == 6
    })
    .await;
    let report = running.stop().await;
    assert_eq!(report.tasks_fetched, 6);
    assert_eq!(report.tasks_published, 6);
    assert!(report.lost_task_ids.is_empty());
    assert!(
        count(&stats.publish_duplicates) >= 4,
        "the retries of the stored tasks were de-duplicated"
    );
    env.assert_each_task_stored_once(6).await;
}

/// DESIGN invariant 4 (with invariant 2's publish window): stopping fetches nothing more but
/// waits for every publish still awaiting its ack; acks let through before the shutdown
/// bound count every outstanding task as handed off, none lost.
#[tokio::test]
async fn shutdown_waits_for_every_publish_still_awaiting_its_ack() {
    let env = Env::start(MockConfig::default()).await;
    env.queue_jobs(6);
    let (proxy, running) = pipelined_with_acks_dropped(&env, 3).await;
    let stats = running.stats.clone();
    let Running { trigger, join, .. } = running;
    trigger.trigger();
    proxy.drop_acks(false);
    let report = join.await.expect("join").expect("scheduler run");

    assert_eq!(report.tasks_fetched, 3, "nothing fetched after shutdown");
    assert_eq!(report.tasks_published, 3);
    assert!(report.lost_task_ids.is_empty());
    assert_eq!(count(&stats.tasks_published), 3);
    assert_eq!(env.jobs_with(Status::Waiting), 3);
    env.assert_each_task_stored_once(3).await;
}

/// DESIGN invariants 2, 3: a burst fetched by pollers that keep several publishes
/// outstanding stores every task exactly once under its assignment ID, and every publish
/// is counted as handed off.
#[tokio::test]
async fn a_burst_fetched_with_publishes_outstanding_stores_every_task_exactly_once() {
    let env = Env::start(MockConfig::default()).await;
    env.queue_jobs(40);
    let mut settings = env.settings(3, 1000);
    settings.publish_window = 5;
    let running = Running::start(env.scheduler_with(settings));
    let stats = running.stats.clone();
    until(WAIT, "every job is fetched and stored", || async {
        env.jobs_with(Status::Waiting) == 0 && count(&stats.tasks_published) == 40
    })
    .await;
    let report = running.stop().await;
    assert_eq!(report.tasks_fetched, 40);
    assert_eq!(report.tasks_published, 40);
    assert!(report.lost_task_ids.is_empty());
    env.assert_each_task_stored_once(40).await;
}
