//! The whole chain against plain runners: K stand-in runners registered directly with the
//! mock Gitea (a fresh `daemon --once` process per job, the official runner's 2 s poll)
//! next to the controller binary with `pod_capacity = K` on the process backend (a fresh
//! executor and stand-in runner per job). Both sides: idle FetchTask rate, idle pickup
//! (queued → first log row), and N jobs queued at once. Then the controller's memory idle
//! and with 1,000 assignments queued, and the executor's peak RSS through a 50 MiB
//! checkout. `PERF_EXECUTOR_PROGRAM` makes the controller start another build of the
//! executor (a file named `gitea-dynamic-executor`, e.g. built with `--profile dist`).

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use gdr_core::assignment::AssignmentId;
use gdr_testkit::controller::{ControllerFixture, Value, listener};
use gdr_testkit::mock_gitea::{JobId, MockConfig, MockGitea, RpcMethod, RunningMock, Status};
use gdr_testkit::nats_server::NatsServer;
use rand::RngExt;

use crate::facade::CHECKOUT;
use crate::table::{Table, mean, mib, millis, proc_status_kib, quantile, secs};

const BIN: &str = env!("CARGO_BIN_EXE_gitea-dynamic-runner");
const STANDIN: &str = env!("CARGO_BIN_EXE_gitea-runner-standin");
/// Capacity on our side, plain runners on the other.
const K: u32 = 3;
/// Jobs queued at once.
const N: usize = 30;
/// Idle-load window per side.
const IDLE_WINDOW: Duration = Duration::from_secs(12);
/// Idle pickups per side, each queued at a random moment.
const IDLE_SAMPLES: usize = 8;
/// Assignments queued in JetStream for the memory figure.
const QUEUED: usize = 1000;
const WAIT: Duration = Duration::from_secs(300);

/// What one side measured.
struct Side {
    idle_calls_per_s: f64,
    idle_pickups: Vec<Duration>,
    makespan: Duration,
    burst_pickups: Vec<Duration>,
    burst_tasks: Vec<i64>,
}

/// `jobs` jobs of one `run:` step each on `[self-hosted, pod]`, as one workflow.
pub fn workflow(jobs: usize, step: &str) -> String {
    let mut yaml = String::from("on: push\njobs:\n");
    for i in 0..jobs {
        yaml.push_str(&format!(
            "  job_{i}:\n    runs-on: [self-hosted, pod]\n    steps:\n      - run: {step}\n"
        ));
    }
    yaml
}

async fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !done() {
        assert!(Instant::now() < deadline, "not reached in {WAIT:?}: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn since(earlier: SystemTime, later: SystemTime) -> Duration {
    later.duration_since(earlier).unwrap_or_default()
}

/// Idle FetchTask rate, idle pickups and (with `burst`) a burst of `N`, against whatever
/// polls `mock`.
async fn measure(mock: &MockGitea, with_burst: bool) -> Side {
    // Let start-up polling settle into the idle pace first.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let before = mock.calls(RpcMethod::FetchTask);
    tokio::time::sleep(IDLE_WINDOW).await;
    let idle_calls_per_s =
        (mock.calls(RpcMethod::FetchTask) - before) as f64 / IDLE_WINDOW.as_secs_f64();
    eprintln!("  idle FetchTask rate {idle_calls_per_s:.2}/s");

    let mut idle_pickups = Vec::new();
    for _ in 0..IDLE_SAMPLES {
        let jitter = rand::rng().random_range(0..2000u64);
        tokio::time::sleep(Duration::from_millis(jitter)).await;
        let queued = SystemTime::now();
        let job = mock
            .queue_workflow("owner/idle", &workflow(1, "standin:success"))
            .expect("queue")[0];
        wait_until("the idle job ends", || {
            mock.job(job).is_some_and(|j| j.status == Status::Success)
        })
        .await;
        let first = mock
            .job(job)
            .and_then(|j| j.task)
            .and_then(|t| t.first_log)
            .expect("a log row");
        idle_pickups.push(since(queued, first));
    }
    eprintln!("  idle pickups {idle_pickups:?}");
    if !with_burst {
        return Side {
            idle_calls_per_s,
            idle_pickups,
            makespan: Duration::ZERO,
            burst_pickups: Vec::new(),
            burst_tasks: Vec::new(),
        };
    }

    let queued_at_once = burst(mock).await;
    Side {
        idle_calls_per_s,
        idle_pickups,
        makespan: queued_at_once.makespan,
        burst_pickups: queued_at_once.pickups,
        burst_tasks: queued_at_once.tasks,
    }
}

/// What one burst of N jobs queued at once showed.
struct Burst {
    makespan: Duration,
    /// Queued → first log row, per job.
    pickups: Vec<Duration>,
    tasks: Vec<i64>,
}

impl Burst {
    /// The longest time between two successive pickups: a slot refilled at once keeps it
    /// near one job's cycle; a fixed wait shows as a gap of its length.
    fn largest_gap(&self) -> Duration {
        let mut sorted = self.pickups.clone();
        sorted.sort();
        sorted
            .windows(2)
            .map(|w| w[1].saturating_sub(w[0]))
            .max()
            .unwrap_or_default()
    }
}

/// Queues N jobs at once and waits until every one succeeded.
async fn burst(mock: &MockGitea) -> Burst {
    let queued = SystemTime::now();
    let jobs = mock
        .queue_workflow("owner/burst", &workflow(N, "standin:success"))
        .expect("queue");
    let all_done = |m: &MockGitea, jobs: &[JobId]| {
        jobs.iter()
            .all(|j| m.job(*j).is_some_and(|s| s.status.is_done()))
    };
    wait_until("the burst ends", || all_done(mock, &jobs)).await;
    let tasks: Vec<_> = jobs
        .iter()
        .map(|j| {
            let job = mock.job(*j).expect("job");
            assert_eq!(job.status, Status::Success, "a burst job failed");
            job.task.expect("task")
        })
        .collect();
    let makespan = tasks
        .iter()
        .filter_map(|t| t.stopped)
        .map(|s| since(queued, s))
        .max()
        .unwrap_or_default();
    let pickups = tasks
        .iter()
        .filter_map(|t| t.first_log)
        .map(|f| since(queued, f))
        .collect();
    eprintln!("  burst of {N}: makespan {makespan:?}");
    Burst {
        makespan,
        pickups,
        tasks: tasks.iter().map(|t| t.id).collect(),
    }
}

/// Issue 39: the burst as the default configuration runs it, with the vm backend enabled
/// next to the pod backend (`vm_capacity = 1`): a full pod backlog then re-declares the
/// vm labels alone, and the pollers find nothing until the pod labels are declared again.
/// Next to it the same burst with the vm backend off, where the labels never change.
pub async fn run_burst(table: &mut Table) {
    let mut sides = Vec::new();
    for vm in [1u32, 0] {
        let mock = MockGitea::start(MockConfig::default()).await.expect("mock");
        let controller = Controller::start(&mock, K, &[("vm_capacity", Value::from(vm))]).await;
        eprintln!("this controller, pod_capacity {K}, vm_capacity {vm}:");
        sides.push(burst(&mock.handle).await);
        controller.stop(&[]).await;
    }
    let (with_vm, pod_only) = (&sides[0], &sides[1]);
    table.ratio(
        &format!(
            "{N} jobs queued at once, pod_capacity {K} with vm_capacity 1 (the default): makespan"
        ),
        (with_vm.makespan.as_secs_f64(), secs(with_vm.makespan)),
        (
            pod_only.makespan.as_secs_f64(),
            format!("{} with vm_capacity 0", secs(pod_only.makespan)),
        ),
        "≈ 1×",
    );
    table.row(
        "  largest gap between successive pickups in that burst",
        secs(with_vm.largest_gap()),
        format!("{} with vm_capacity 0", secs(pod_only.largest_gap())),
        "–".into(),
        "no fixed wait",
    );
}

// === plain runners ===

/// K plain runners, each a loop of fresh `daemon --once` processes in its own directory.
struct PlainRunners {
    stop: Arc<AtomicBool>,
    running: Arc<Mutex<Vec<Option<u32>>>>,
    loops: tokio::task::JoinSet<()>,
    _dir: tempfile::TempDir,
}

impl PlainRunners {
    fn start(mock: &RunningMock) -> Self {
        let dir = tempfile::tempdir().expect("dir");
        let stop = Arc::new(AtomicBool::new(false));
        let running = Arc::new(Mutex::new(vec![None; K as usize]));
        let mut loops = tokio::task::JoinSet::new();
        for i in 0..K as usize {
            let work = dir.path().join(format!("runner-{i}"));
            std::fs::create_dir_all(&work).expect("runner dir");
            let (uuid, token) =
                mock.handle
                    .create_runner(&format!("plain-{i}"), &["self-hosted", "pod"], false);
            let registration = serde_json::json!({
                "WARNING": "benchmark runner",
                "id": i,
                "uuid": uuid,
                "name": format!("plain-{i}"),
                "token": token,
                "address": mock.url,
                "labels": ["self-hosted", "pod"],
                "ephemeral": false,
            });
            std::fs::write(work.join(".runner"), registration.to_string()).expect(".runner");
            let (stop, running) = (stop.clone(), running.clone());
            loops.spawn(async move {
                while !stop.load(Ordering::Acquire) {
                    let mut child = tokio::process::Command::new(STANDIN)
                        .args(["daemon", "--once"])
                        .current_dir(&work)
                        .env("RUST_LOG", "warn")
                        .stdin(Stdio::null())
                        .stdout(Stdio::null())
                        .stderr(Stdio::null())
                        .kill_on_drop(true)
                        .spawn()
                        .expect("stand-in runner");
                    running.lock().expect("lock")[i] = child.id();
                    let _ = child.wait().await;
                    running.lock().expect("lock")[i] = None;
                }
            });
        }
        PlainRunners {
            stop,
            running,
            loops,
            _dir: dir,
        }
    }

    /// Lets each waiting runner exit (SIGINT: no task taken) and ends the loops.
    async fn stop(mut self) {
        self.stop.store(true, Ordering::Release);
        while !self.loops.is_empty() {
            for pid in self.running.lock().expect("lock").iter().flatten() {
                signal(*pid, rustix::process::Signal::INT);
            }
            if tokio::time::timeout(Duration::from_millis(200), self.loops.join_next())
                .await
                .is_ok_and(|j| j.is_some())
            {
                continue;
            }
        }
    }
}

fn signal(pid: u32, signal: rustix::process::Signal) {
    if let Some(pid) = i32::try_from(pid)
        .ok()
        .and_then(rustix::process::Pid::from_raw)
    {
        let _ = rustix::process::kill_process(pid, signal);
    }
}

fn kill_group(pgid: u32) {
    if let Some(pid) = i32::try_from(pgid)
        .ok()
        .and_then(rustix::process::Pid::from_raw)
    {
        let _ = rustix::process::kill_process_group(pid, rustix::process::Signal::KILL);
    }
}

// === the controller ===

struct Controller {
    child: tokio::process::Child,
    pid: u32,
    fixture: ControllerFixture,
    _listeners: (std::net::TcpListener, std::net::TcpListener),
}

impl Controller {
    async fn start(mock: &RunningMock, capacity: u32, extra: &[(&str, Value)]) -> Self {
        let facade = listener();
        let health = listener();
        let health_addr = health.local_addr().expect("addr");
        let mut fixture = ControllerFixture::new(mock, Path::new(BIN), Path::new(STANDIN))
            .facade_at(facade.local_addr().expect("addr"))
            .set("pod_capacity", capacity)
            .set("vm_capacity", 0u32)
            .set("nats_server_binary", NatsServer::binary().as_path());
        // Another build of the executor (the `dist` profile's, say) for its figures; its
        // file must keep the name `gitea-dynamic-executor` to be recognised.
        if let Some(program) = std::env::var_os("PERF_EXECUTOR_PROGRAM") {
            fixture = fixture.set("executor_program", Path::new(&program));
        }
        for (k, v) in extra {
            fixture = fixture.set(k, v.clone());
        }
        let mut child = fixture.spawn(
            Path::new(BIN),
            &facade,
            &health,
            &[("RUST_LOG", "info,gdr_controller::worker=debug")],
        );
        let pid = child.id().expect("controller pid");
        let ready = format!("http://{health_addr}/readyz");
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(5))
            .build()
            .expect("http client");
        let deadline = Instant::now() + WAIT;
        loop {
            if http
                .get(&ready)
                .send()
                .await
                .is_ok_and(|r| r.status().is_success())
            {
                break;
            }
            let exited = child.try_wait().ok().flatten();
            assert!(
                exited.is_none() && Instant::now() < deadline,
                "the controller never became ready ({exited:?}):\n{}",
                fixture.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Controller {
            child,
            pid,
            fixture,
            _listeners: (facade, health),
        }
    }

    /// SIGTERM, then kill the process groups of the executors it left (they outlive a
    /// controller by design).
    async fn stop(mut self, executors: &[u32]) {
        signal(self.pid, rustix::process::Signal::TERM);
        let _ = tokio::time::timeout(Duration::from_secs(60), self.child.wait()).await;
        for pgid in executors {
            kill_group(*pgid);
        }
    }
}

/// Live executor processes of `controller`: its children running the executor's own binary
/// (`gitea-dynamic-executor`, when it sits next to the controller's) or `<bin> executor`.
fn executors_of(controller: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                return false;
            };
            // Fields after the parenthesised command: state, ppid, …
            let ppid = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(1))
                .and_then(|p| p.parse::<u32>().ok());
            ppid == Some(controller)
                && std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| {
                    let mut args = c.split(|b| *b == 0);
                    let program = args.next().unwrap_or_default();
                    program.ends_with(b"gitea-dynamic-executor") || args.next() == Some(b"executor")
                })
        })
        .collect()
}

/// What an executor used at most: its peak RSS (`VmHWM`) and the largest anonymous
/// (heap, stacks) and file-backed (the binary's mapped code and data) parts seen.
#[derive(Debug, Default, Clone, Copy)]
struct Peak {
    hwm: u64,
    anon: u64,
    file: u64,
}

/// Samples the peak RSS of every executor of `controller` until stopped.
struct ExecutorSampler {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<HashMap<u32, Peak>>,
}

impl ExecutorSampler {
    fn start(controller: u32) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut peaks: HashMap<u32, Peak> = HashMap::new();
            while !flag.load(Ordering::Acquire) {
                for pid in executors_of(controller) {
                    if let Some(hwm) = proc_status_kib(pid, "VmHWM") {
                        let peak = peaks.entry(pid).or_default();
                        peak.hwm = peak.hwm.max(hwm);
                        let part = |field| proc_status_kib(pid, field).unwrap_or(0);
                        peak.anon = peak.anon.max(part("RssAnon"));
                        peak.file = peak.file.max(part("RssFile"));
                    }
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            peaks
        });
        ExecutorSampler { stop, thread }
    }

    fn finish(self) -> HashMap<u32, Peak> {
        self.stop.store(true, Ordering::Release);
        self.thread.join().expect("sampler")
    }
}

/// Seconds since midnight of an RFC 3339 UTC timestamp (the run stays within a day or
/// the differences are corrected for the wrap).
fn time_of_day(stamp: &str) -> Option<f64> {
    let clock = stamp.split_once('T')?.1.trim_end_matches('Z');
    let mut parts = clock.split(':');
    let h: f64 = parts.next()?.parse().ok()?;
    let m: f64 = parts.next()?.parse().ok()?;
    let s: f64 = parts.next()?.parse().ok()?;
    Some(h * 3600.0 + m * 60.0 + s)
}

/// Where the time of a job goes, from the controller's own log lines.
struct Breakdown {
    rows: Vec<(&'static str, Duration)>,
    /// The median of the executor's start (spawn → its runner's Declare answered): issue
    /// 39's goal is stated as a p50, the rows above are means.
    executor_start_p50: Duration,
}

fn breakdown(log: &str, tasks: &[i64]) -> Breakdown {
    // The `event` field chain of one job (docs/operations.md); the facade's Declare line
    // has no event and is found by its message.
    const DECLARED: &str = "executor runner declared";
    let wanted: BTreeMap<String, ()> = tasks
        .iter()
        .map(|t| (AssignmentId::from_task_id(*t).expect("id").to_string(), ()))
        .collect();
    let mut at: HashMap<(String, String), f64> = HashMap::new();
    let mut admissions = Vec::new();
    for line in log.lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let (Some(id), Some(t)) = (
            v["assignment_id"].as_str(),
            v["timestamp"].as_str().and_then(time_of_day),
        ) else {
            continue;
        };
        let event = match (v["event"].as_str(), v["message"].as_str()) {
            (Some(event), _) => event,
            (None, Some(DECLARED)) => "declared",
            _ => continue,
        };
        if !wanted.contains_key(id) {
            continue;
        }
        if event == "admitted" {
            admissions.push(t);
        }
        at.entry((id.to_owned(), event.to_owned())).or_insert(t);
    }
    // Every job has each event of the critical path; the executor's deletion may still be
    // pending for the last ones when the log is read (`required = false`).
    let spans = |from: &str, to: &str, required: bool| -> Vec<Duration> {
        let spans: Vec<Duration> = wanted
            .keys()
            .filter_map(|id| {
                let a = at.get(&(id.clone(), from.to_owned()))?;
                let b = at.get(&(id.clone(), to.to_owned()))?;
                let mut d = b - a;
                // Past midnight the time of day starts again. A small negative span is two
                // tasks' log lines racing: the worker may log `admitted` before the poller
                // collects the publish's acknowledgement and logs `stored` (the pipelined
                // handoff); it counts as no wait.
                if d < -43_200.0 {
                    d += 86_400.0;
                }
                Some(Duration::from_secs_f64(d.max(0.0)))
            })
            .collect();
        assert!(
            !required || spans.len() == wanted.len(),
            "the controller's log lacks `{from}` or `{to}` for some jobs: the breakdown's events are out of date"
        );
        spans
    };
    let span = |from: &str, to: &str, required: bool| mean(&spans(from, to, required));
    // The facade frees the slot when Gitea accepts the result (`terminal`), before the
    // executor exits: from each freed slot to the first admission after it (the last
    // jobs have no successor).
    admissions.sort_by(f64::total_cmp);
    let handovers: Vec<Duration> = wanted
        .keys()
        .filter_map(|id| at.get(&(id.clone(), "terminal".to_owned())))
        .filter_map(|f| {
            admissions
                .iter()
                .find(|a| **a >= *f)
                .map(|a| Duration::from_secs_f64(a - f))
        })
        .collect();
    Breakdown {
        rows: vec![
            (
                "queued in JetStream → admitted (waiting for a slot)",
                span("stored", "admitted", true),
            ),
            (
                "create: directories, identity socket and SVID, durable metadata, spawn",
                span("admitted", "executor_created", true),
            ),
            (
                "executor start: process, SVID fetch, proxy, runner start, Declare",
                span("executor_created", "declared", true),
            ),
            (
                "runner FetchTask through the facade, durable claim marker",
                span("declared", "claimed", true),
            ),
            (
                "job: log rows and updates forwarded to Gitea, result accepted",
                span("claimed", "terminal", true),
            ),
            (
                "result accepted (slot free) → next admission",
                mean(&handovers),
            ),
            (
                "off the critical path: result accepted → executor exited and deleted",
                span("terminal", "cleaned", false),
            ),
        ],
        executor_start_p50: quantile(&spans("executor_created", "declared", true), 0.5),
    }
}

fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
}

pub async fn run(table: &mut Table) {
    // Plain runners.
    let mock = MockGitea::start(MockConfig::default()).await.expect("mock");
    let plain_runners = PlainRunners::start(&mock);
    eprintln!("{K} plain runners:");
    let plain = measure(&mock.handle, true).await;
    plain_runners.stop().await;
    drop(mock);

    // This controller.
    let mock = MockGitea::start(MockConfig::default()).await.expect("mock");
    let controller = Controller::start(&mock, K, &[]).await;
    eprintln!("this controller, pod_capacity {K}:");
    let ours = measure(&mock.handle, true).await;
    let idle_rss = proc_status_kib(controller.pid, "VmRSS").unwrap_or(0);
    let idle_parts = (
        proc_status_kib(controller.pid, "RssAnon").unwrap_or(0),
        proc_status_kib(controller.pid, "RssFile").unwrap_or(0),
    );
    let sampler = ExecutorSampler::start(controller.pid);
    let job = mock
        .handle
        .queue_workflow(
            "owner/checkout",
            &workflow(1, &format!("standin:checkout {CHECKOUT}")),
        )
        .expect("queue")[0];
    wait_until("the checkout job ends", || {
        mock.handle.job(job).is_some_and(|j| j.status.is_done())
    })
    .await;
    let checkout_ok = mock
        .handle
        .job(job)
        .is_some_and(|j| j.status == Status::Success);
    // The executor exits right after its runner: wait for that, then read the peaks.
    wait_until("the checkout executor exits", || {
        executors_of(controller.pid).is_empty()
    })
    .await;
    let executor_peak = sampler
        .finish()
        .values()
        .copied()
        .max_by_key(|p| p.hwm)
        .unwrap_or_default();
    let parts = breakdown(&controller.fixture.log(), &ours.burst_tasks);
    controller.stop(&[]).await;
    drop(mock);

    // The controller with QUEUED assignments waiting in JetStream behind one running job.
    let mock = MockGitea::start(MockConfig::default()).await.expect("mock");
    let controller = Controller::start(
        &mock,
        1,
        &[
            ("backlog_limit", Value::Int(QUEUED as i64 + 1)),
            ("heartbeat_interval", Value::from("5s")),
        ],
    )
    .await;
    let running = mock
        .handle
        .queue_workflow("owner/hang", &workflow(1, "standin:hang"))
        .expect("queue")[0];
    wait_until("the blocking job runs", || {
        mock.handle
            .job(running)
            .and_then(|j| j.task)
            .is_some_and(|t| t.first_log.is_some())
    })
    .await;
    let executors = executors_of(controller.pid);
    let queued = mock
        .handle
        .queue_workflow("owner/queued", &workflow(QUEUED, "standin:success"))
        .expect("queue");
    wait_until("every job is fetched into JetStream", || {
        queued.iter().all(|j| {
            mock.handle
                .job(*j)
                .is_some_and(|s| s.status == Status::Running)
        })
    })
    .await;
    // At least one heartbeat round over the whole backlog.
    let heartbeats_before = mock
        .handle
        .jobs()
        .iter()
        .filter_map(|j| j.task.as_ref().map(|t| t.heartbeats))
        .sum::<u64>();
    wait_until("a heartbeat round over the queued tasks", || {
        mock.handle
            .jobs()
            .iter()
            .filter_map(|j| j.task.as_ref().map(|t| t.heartbeats))
            .sum::<u64>()
            >= heartbeats_before + QUEUED as u64
    })
    .await;
    let queued_rss = proc_status_kib(controller.pid, "VmRSS").unwrap_or(0);
    let queued_hwm = proc_status_kib(controller.pid, "VmHWM").unwrap_or(0);
    let fetched = reqwest::get(format!(
        "http://{}/metrics",
        controller._listeners.1.local_addr().expect("addr")
    ))
    .await
    .ok();
    let fetched = match fetched {
        Some(r) => r
            .text()
            .await
            .ok()
            .and_then(|t| metric(&t, "gitea_dynamic_runner_tasks_fetched_total")),
        None => None,
    };
    controller.stop(&executors).await;

    // Gitea with long polling (go-gitea/gitea#37482, 50 s hold by default): the controller's
    // 5 s FetchTask deadline ends each held poll.
    let mock = MockGitea::start(MockConfig::default().with_long_poll(Duration::from_secs(50)))
        .await
        .expect("mock");
    let controller = Controller::start(&mock, K, &[]).await;
    eprintln!("this controller, Gitea with long polling:");
    let held = measure(&mock.handle, false).await;
    controller.stop(&[]).await;
    drop(mock);

    report(
        table,
        &plain,
        &ours,
        &held,
        &parts,
        Memory {
            idle_rss,
            idle_parts,
            queued_rss,
            queued_hwm,
            fetched,
            executor_peak,
            checkout_ok,
        },
    );
}

struct Memory {
    idle_rss: u64,
    /// Anonymous and file-backed parts of `idle_rss`.
    idle_parts: (u64, u64),
    queued_rss: u64,
    queued_hwm: u64,
    fetched: Option<f64>,
    executor_peak: Peak,
    checkout_ok: bool,
}

fn report(
    table: &mut Table,
    plain: &Side,
    ours: &Side,
    held: &Side,
    parts: &Breakdown,
    memory: Memory,
) {
    table.ratio(
        &format!("{N} jobs queued at once, capacity {K}: makespan"),
        (ours.makespan.as_secs_f64(), secs(ours.makespan)),
        (
            plain.makespan.as_secs_f64(),
            format!(
                "{} on {K} plain runners (fresh process per job)",
                secs(plain.makespan)
            ),
        ),
        "≤ 1.3×",
    );
    // Per-job time of a makespan: each of the K slots ran N/K jobs one after another.
    let per_job_row = |table: &mut Table, what: &str, ours: Duration, plain: Duration| {
        let (ours, plain) = (ours * K / N as u32, plain * K / N as u32);
        table.row(
            what,
            millis(ours, 0),
            millis(plain, 0),
            format!("+{} per job", millis(ours.saturating_sub(plain), 0)),
            "–",
        );
    };
    per_job_row(
        table,
        "per-job time (makespan × K / N)",
        ours.makespan,
        plain.makespan,
    );
    // The makespan above starts when the burst is queued: an idle controller's first
    // FetchTask comes at its idle poller's next turn (up to `fetch_interval`, 2 s), and
    // spread over the K × N/K cycles that wait reads as per-job cost. From the first
    // pickup on, the makespan is the slots' own work, which the breakdown below adds up.
    let first_pickup = |side: &Side| side.burst_pickups.iter().min().copied().unwrap_or_default();
    table.row(
        "  of which before the first pickup (queued → first log row: the idle poll's wait)",
        secs(first_pickup(ours)),
        secs(first_pickup(plain)),
        "–".into(),
        "–",
    );
    let working = |side: &Side| side.makespan.saturating_sub(first_pickup(side));
    table.ratio(
        &format!("the same {N} jobs from the first pickup on: makespan"),
        (working(ours).as_secs_f64(), secs(working(ours))),
        (working(plain).as_secs_f64(), secs(working(plain))),
        "≤ 1.5×",
    );
    per_job_row(
        table,
        "per-job time from the first pickup on (its makespan × K / N)",
        working(ours),
        working(plain),
    );
    for (what, d) in &parts.rows {
        table.row(
            &format!("  breakdown: {what}"),
            millis(*d, 1),
            "–".into(),
            "–".into(),
            "–",
        );
    }
    table.row(
        &format!(
            "executor start p50 of the {N} burst jobs (spawn → its runner's Declare answered)"
        ),
        millis(parts.executor_start_p50, 1),
        "–".into(),
        "–".into(),
        "≤ 100 ms",
    );
    table.row(
        &format!("{N} jobs queued at once: pickup p50 / p90 (queued → first log row)"),
        format!(
            "{} / {}",
            secs(quantile(&ours.burst_pickups, 0.5)),
            secs(quantile(&ours.burst_pickups, 0.9))
        ),
        format!(
            "{} / {}",
            secs(quantile(&plain.burst_pickups, 0.5)),
            secs(quantile(&plain.burst_pickups, 0.9))
        ),
        format!(
            "{:.2}× (p50)",
            quantile(&ours.burst_pickups, 0.5).as_secs_f64()
                / quantile(&plain.burst_pickups, 0.5).as_secs_f64().max(1e-9)
        ),
        "–",
    );
    table.ratio(
        &format!(
            "FetchTask calls per second against an idle Gitea ({}s window)",
            IDLE_WINDOW.as_secs()
        ),
        (
            ours.idle_calls_per_s,
            format!("{:.2}/s (pod_capacity {K})", ours.idle_calls_per_s),
        ),
        (
            0.5,
            format!(
                "0.50/s (one runner's 2 s poll); {K} plain runners measured {:.2}/s",
                plain.idle_calls_per_s
            ),
        ),
        "≤ 1×",
    );
    table.row(
        &format!("idle pickup p50 / max of {IDLE_SAMPLES} (queued → first log row)"),
        format!(
            "{} / {}",
            secs(quantile(&ours.idle_pickups, 0.5)),
            secs(quantile(&ours.idle_pickups, 1.0))
        ),
        format!(
            "{} / {} on {K} plain runners",
            secs(quantile(&plain.idle_pickups, 0.5)),
            secs(quantile(&plain.idle_pickups, 1.0))
        ),
        format!(
            "{:.2}× (p50)",
            quantile(&ours.idle_pickups, 0.5).as_secs_f64()
                / quantile(&plain.idle_pickups, 0.5).as_secs_f64().max(1e-9)
        ),
        "p50 ≤ 1 s",
    );
    table.row(
        "with Gitea long polling: idle FetchTask calls per second; idle pickup p50 / max",
        format!(
            "{:.2}/s; {} / {}",
            held.idle_calls_per_s,
            secs(quantile(&held.idle_pickups, 0.5)),
            secs(quantile(&held.idle_pickups, 1.0))
        ),
        "–".into(),
        "–".into(),
        "held polls are not errors",
    );
    table.ratio(
        "controller RSS, idle",
        (memory.idle_rss as f64, mib(memory.idle_rss)),
        (20.0 * 1024.0, "20 MiB (goal)".into()),
        "≤ 1×",
    );
    table.ratio(
        &format!(
            "controller RSS, {QUEUED} assignments queued in JetStream (peak {}; fetched {})",
            mib(memory.queued_hwm),
            memory
                .fetched
                .map_or_else(|| "?".to_owned(), |f| format!("{f:.0}"))
        ),
        (memory.queued_rss as f64, mib(memory.queued_rss)),
        (64.0 * 1024.0, "64 MiB (goal)".into()),
        "≤ 1×",
    );
    table.ratio(
        &format!(
            "executor peak RSS through a job with a 50 MiB checkout{}",
            if memory.checkout_ok {
                ""
            } else {
                " (THE CHECKOUT FAILED)"
            }
        ),
        (
            memory.executor_peak.hwm as f64,
            mib(memory.executor_peak.hwm),
        ),
        (10.0 * 1024.0, "10 MiB (goal)".into()),
        "≤ 1×",
    );
    // Where the resident memory is: the largest anonymous and file-backed parts sampled
    // (each may peak at another moment, so they need not add up to the peak).
    table.row(
        "of which anonymous (heap, stacks) / file-backed (mapped binary): executor at most; controller idle",
        format!(
            "{} / {}; {} / {}",
            mib(memory.executor_peak.anon),
            mib(memory.executor_peak.file),
            mib(memory.idle_parts.0),
            mib(memory.idle_parts.1)
        ),
        "–".into(),
        "–".into(),
        "where the bytes are",
    );
}
