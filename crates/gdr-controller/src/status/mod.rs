//! What the controller is doing, as an operator sees it: per backend the admission pool,
//! the executors by phase and the queue; per assignment its job, phase and last event.
//!
//! Everything comes from the state the controller already observes — each lifecycle pass's
//! listing of the backend ([`Observations`]), the admission pools and claims of
//! [`Dispatch`], the JetStream consumers ([`QueueDepth`]) — never from a second bookkeeping
//! that could disagree with it. It carries no secret and no task payload: IDs, repository,
//! job key, phases and times only.
//!
//! Served as JSON at `/status` and as HTML at `/` by the `health` module; printed by
//! `gitea-dynamic-runner status` ([`table`], [`client`]).

pub mod client;
pub mod page;
pub mod table;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use gdr_core::backend::Backend;
use gdr_core::executor::{ExecutorRecord, Phase as ExecutorPhase};
use serde::{Deserialize, Serialize};

use crate::dispatch::Dispatch;
use crate::job_metrics::{JobMetrics, PhaseLabels};
pub use crate::ports::QueueDepth;

/// How long `/status` waits for JetStream before it reports the queue as unknown.
const QUEUE_TIMEOUT: Duration = Duration::from_secs(2);

pub use crate::vocabulary::Phase;

/// The whole status document (`/status`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StatusReport {
    /// The controller's version.
    pub version: String,
    /// Whether this replica leads (a standby runs nothing and reports no backend).
    pub leader: bool,
    /// Whether `/readyz` answers ready.
    pub ready: bool,
    /// When the document was made (RFC 3339, UTC).
    pub generated_at: String,
    /// One entry per enabled backend.
    pub backends: Vec<BackendStatus>,
    /// Every executor the backends report, oldest task first.
    pub assignments: Vec<AssignmentStatus>,
}

/// One backend's pool, executors and queue.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BackendStatus {
    /// `pod` or `vm`.
    pub backend: String,
    /// Admission slots.
    pub capacity: usize,
    /// Admission slots in use.
    pub in_use: usize,
    /// Executors whose runner has not claimed the task yet.
    pub starting: usize,
    /// Executors running a claimed task.
    pub running: usize,
    /// Executors that ended or whose result is reported, waiting for clean-up.
    pub finishing: usize,
    /// Assignments in JetStream that have no executor yet (pool full or backend busy);
    /// `None` when JetStream could not be asked.
    pub queued_jetstream: Option<u64>,
    /// Every assignment in JetStream not yet claimed (queued and starting).
    pub unclaimed_jetstream: Option<u64>,
    /// Jobs waiting in Gitea for this runner: `None`, because Gitea's runner protocol does
    /// not tell a runner how many jobs wait for it.
    pub queued_gitea: Option<u64>,
    /// How old the backend listing is, in seconds (`None`: never listed yet).
    pub listed_seconds_ago: Option<u64>,
    /// Its unclaimed warm environments by profile, as the last lifecycle pass left them;
    /// `None`: it keeps no warm pool.
    #[serde(default)]
    pub warm: Option<Vec<WarmStatus>>,
    /// Why a number above is missing or stale.
    pub problems: Vec<String>,
}

/// The unclaimed warm environments of one profile.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WarmStatus {
    /// The profile they are kept for (empty: none).
    pub profile: String,
    /// Running, claimable by the next job of the profile.
    pub ready: usize,
    /// Created, not running yet.
    pub starting: usize,
}

/// One executor and its job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AssignmentStatus {
    /// Assignment ID (`gitea-task-<task id>`).
    pub id: String,
    /// Gitea task ID.
    pub task_id: i64,
    /// `owner/repo`.
    pub repository: String,
    /// The workflow's `jobs:` key.
    pub job_key: String,
    /// `pod` or `vm`.
    pub backend: String,
    /// Backend object name (Pod name, sandbox ID, process directory).
    pub executor: String,
    /// Where it stands.
    pub phase: Phase,
    /// Its runner fetched the task (durable claim marker).
    pub claimed: bool,
    /// Seconds since the executor was created.
    pub age_seconds: u64,
    /// The latest thing that happened, or what the controller waits for.
    pub last_event: String,
}

impl StatusReport {
    /// The document of a replica that does not lead (or has not started its components).
    pub fn standby(ready: bool) -> Self {
        StatusReport {
            version: crate::VERSION.to_owned(),
            leader: false,
            ready,
            generated_at: now_rfc3339(),
            backends: Vec::new(),
            assignments: Vec::new(),
        }
    }
}

fn now_rfc3339() -> String {
    humantime_serde::re::humantime::format_rfc3339_seconds(SystemTime::now()).to_string()
}

/// Produces the status document.
#[async_trait]
pub trait StatusSource: Send + Sync {
    /// The current document (`ready` is filled in by the caller).
    async fn report(&self) -> StatusReport;
}

/// One backend listing.
struct Snapshot {
    at: SystemTime,
    records: Vec<ExecutorRecord>,
    error: Option<String>,
}

/// The latest backend listing of each backend, as the lifecycle reconciler saw it, and
/// the warm pool its last upkeep left.
pub struct Observations {
    snapshots: Mutex<BTreeMap<Backend, Snapshot>>,
    warm: Mutex<BTreeMap<Backend, Vec<WarmStatus>>>,
    metrics: Option<Arc<JobMetrics>>,
}

impl Observations {
    /// Empty; with `metrics`, each listing also sets the `executors` gauges.
    pub fn new(metrics: Option<Arc<JobMetrics>>) -> Self {
        Observations {
            snapshots: Mutex::new(BTreeMap::new()),
            warm: Mutex::new(BTreeMap::new()),
            metrics,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<Backend, Snapshot>> {
        self.snapshots.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A pass listed `records` of `backend`.
    pub fn listed(&self, backend: Backend, records: &[ExecutorRecord]) {
        if let Some(metrics) = &self.metrics {
            for phase in Phase::ALL {
                let count = records.iter().filter(|r| Phase::of(r) == phase).count();
                metrics
                    .executors
                    .get_or_create(&PhaseLabels {
                        backend: backend.as_str().into(),
                        phase: phase.as_str().into(),
                    })
                    .set(i64::try_from(count).unwrap_or(i64::MAX));
            }
        }
        self.lock().insert(
            backend,
            Snapshot {
                at: SystemTime::now(),
                records: records.to_vec(),
                error: None,
            },
        );
    }

    /// A pass's upkeep of `backend` left `warm` (by profile and state, `ready` or
    /// `starting`); `None` or no profile pooled: it keeps no warm pool.
    pub fn warm_left(
        &self,
        backend: Backend,
        warm: Option<&BTreeMap<(String, &'static str), usize>>,
    ) {
        let mut profiles: BTreeMap<&str, WarmStatus> = BTreeMap::new();
        for ((profile, state), n) in warm.into_iter().flatten() {
            let entry = profiles.entry(profile).or_insert_with(|| WarmStatus {
                profile: profile.clone(),
                ready: 0,
                starting: 0,
            });
            match *state {
                "ready" => entry.ready += n,
                _ => entry.starting += n,
            }
        }
        let mut all = self.warm.lock().unwrap_or_else(|p| p.into_inner());
        if profiles.is_empty() {
            all.remove(&backend);
        } else {
            all.insert(backend, profiles.into_values().collect());
        }
    }

    fn warm_of(&self, backend: Backend) -> Option<Vec<WarmStatus>> {
        let all = self.warm.lock().unwrap_or_else(|p| p.into_inner());
        all.get(&backend).cloned()
    }

    /// A pass could not list `backend`; the last listing stays, marked stale.
    pub fn list_failed(&self, backend: Backend, error: &dyn std::fmt::Display) {
        let mut snapshots = self.lock();
        let entry = snapshots.entry(backend).or_insert_with(|| Snapshot {
            at: SystemTime::UNIX_EPOCH,
            records: Vec::new(),
            error: None,
        });
        entry.error = Some(error.to_string());
    }
}

/// The status of the backends a leading controller runs.
pub struct Observed {
    dispatch: Arc<Dispatch>,
    observations: Arc<Observations>,
    queue: Option<Arc<dyn QueueDepth>>,
    backends: Vec<Backend>,
}

impl Observed {
    /// Status of `backends` from `dispatch`, the lifecycle passes' `observations` and,
    /// when given, the JetStream `queue`.
    pub fn new(
        dispatch: Arc<Dispatch>,
        observations: Arc<Observations>,
        queue: Option<Arc<dyn QueueDepth>>,
        backends: Vec<Backend>,
    ) -> Self {
        Observed {
            dispatch,
            observations,
            queue,
            backends,
        }
    }

    async fn unclaimed(&self, backend: Backend) -> Result<Option<u64>, String> {
        let Some(queue) = &self.queue else {
            return Ok(None);
        };
        match tokio::time::timeout(QUEUE_TIMEOUT, queue.unclaimed(backend)).await {
            Ok(Ok(n)) => Ok(Some(n)),
            Ok(Err(e)) => Err(format!("JetStream: {e}")),
            Err(_) => Err(format!(
                "JetStream did not answer within {}",
                humantime_serde::re::humantime::format_duration(QUEUE_TIMEOUT)
            )),
        }
    }
}

#[async_trait]
impl StatusSource for Observed {
    async fn report(&self) -> StatusReport {
        let now = SystemTime::now();
        let mut backends = Vec::new();
        let mut assignments = Vec::new();
        for backend in &self.backends {
            let (in_use, capacity) = self.dispatch.pool_usage(*backend);
            let mut status = BackendStatus {
                backend: backend.as_str().to_owned(),
                capacity,
                in_use,
                starting: 0,
                running: 0,
                finishing: 0,
                queued_jetstream: None,
                unclaimed_jetstream: None,
                queued_gitea: None,
                listed_seconds_ago: None,
                warm: self.observations.warm_of(*backend),
                problems: Vec::new(),
            };
            let mut unacknowledged = 0u64;
            {
                let snapshots = self.observations.lock();
                if let Some(snapshot) = snapshots.get(backend) {
                    if snapshot.at > SystemTime::UNIX_EPOCH {
                        status.listed_seconds_ago =
                            now.duration_since(snapshot.at).ok().map(|d| d.as_secs());
                    }
                    if let Some(e) = &snapshot.error {
                        status
                            .problems
                            .push(format!("the last listing of the backend failed: {e}"));
                    }
                    for record in &snapshot.records {
                        let phase = Phase::of(record);
                        match phase {
                            Phase::Starting => status.starting += 1,
                            Phase::Running => status.running += 1,
                            Phase::Ended | Phase::Reported => status.finishing += 1,
                        }
                        // Its message stays in JetStream until the claim acknowledges it.
                        if !record.claimed && !record.terminal {
                            unacknowledged += 1;
                        }
                        assignments.push(self.assignment(record, phase, now));
                    }
                } else {
                    status
                        .problems
                        .push("the backend has not been listed yet".to_owned());
                }
            }
            match self.unclaimed(*backend).await {
                Ok(Some(n)) => {
                    status.unclaimed_jetstream = Some(n);
                    status.queued_jetstream = Some(n.saturating_sub(unacknowledged));
                }
                Ok(None) => {}
                Err(e) => status.problems.push(e),
            }
            backends.push(status);
        }
        assignments.sort_by(|a, b| (a.task_id, &a.backend).cmp(&(b.task_id, &b.backend)));
        StatusReport {
            version: crate::VERSION.to_owned(),
            leader: true,
            ready: false,
            generated_at: now_rfc3339(),
            backends,
            assignments,
        }
    }
}

impl Observed {
    fn assignment(
        &self,
        record: &ExecutorRecord,
        phase: Phase,
        now: SystemTime,
    ) -> AssignmentStatus {
        let a = &record.assignment;
        AssignmentStatus {
            id: a.id().as_str().to_owned(),
            task_id: a.task_id(),
            repository: a.identity().repository().to_owned(),
            job_key: a.identity().job_key().to_owned(),
            backend: a.backend().as_str().to_owned(),
            executor: record.name.clone(),
            phase,
            claimed: record.claimed,
            age_seconds: now
                .duration_since(record.created_at)
                .map_or(0, |d| d.as_secs()),
            last_event: last_event(record, phase, self.dispatch.silence(a.id())),
        }
    }
}

/// Column headings of the backend table (CLI and page).
pub const BACKEND_COLUMNS: [&str; 9] = [
    "backend",
    "capacity",
    "in use",
    "starting",
    "running",
    "finishing",
    "queued (JetStream)",
    "queued (Gitea)",
    "warm (ready/starting)",
];

/// Column headings of the assignment table (CLI and page).
pub const ASSIGNMENT_COLUMNS: [&str; 8] = [
    "assignment",
    "repository",
    "job",
    "backend",
    "phase",
    "claimed",
    "age",
    "last event",
];

fn known(n: Option<u64>) -> String {
    n.map_or_else(|| "unknown".to_owned(), |n| n.to_string())
}

/// `42s`, `3m05s`, `2h07m`.
pub fn age(seconds: u64) -> String {
    match seconds {
        s if s < 60 => format!("{s}s"),
        s if s < 3600 => format!("{}m{:02}s", s / 60, s % 60),
        s => format!("{}h{:02}m", s / 3600, (s % 3600) / 60),
    }
}

impl BackendStatus {
    /// The cells of its row, as [`BACKEND_COLUMNS`] names them.
    pub fn cells(&self) -> [String; 9] {
        [
            self.backend.clone(),
            self.capacity.to_string(),
            self.in_use.to_string(),
            self.starting.to_string(),
            self.running.to_string(),
            self.finishing.to_string(),
            known(self.queued_jetstream),
            known(self.queued_gitea),
            self.warm.as_ref().map_or_else(
                || "none".to_owned(),
                |w| {
                    let (ready, starting) = w
                        .iter()
                        .fold((0, 0), |(r, s), p| (r + p.ready, s + p.starting));
                    format!("{ready}/{starting}")
                },
            ),
        ]
    }
}

impl AssignmentStatus {
    /// The cells of its row, as [`ASSIGNMENT_COLUMNS`] names them.
    pub fn cells(&self) -> [String; 8] {
        [
            self.id.clone(),
            self.repository.clone(),
            self.job_key.clone(),
            self.backend.clone(),
            self.phase.as_str().to_owned(),
            if self.claimed { "yes" } else { "no" }.to_owned(),
            age(self.age_seconds),
            self.last_event.clone(),
        ]
    }
}

impl StatusReport {
    /// One line: version, role, readiness, time.
    pub fn summary(&self) -> String {
        format!(
            "gitea-dynamic-runner {} · {} · {} · {}",
            self.version,
            if self.leader { "leader" } else { "standby" },
            if self.ready { "ready" } else { "not ready" },
            self.generated_at
        )
    }
}

/// The latest thing that happened to an executor, or what the controller waits for.
fn last_event(record: &ExecutorRecord, phase: Phase, silence: Option<Duration>) -> String {
    let detail = match &record.phase {
        ExecutorPhase::Finished {
            reason: Some(r), ..
        }
        | ExecutorPhase::Starting { reason: Some(r) } => format!(" ({r})"),
        _ => String::new(),
    };
    match phase {
        Phase::Reported if record.phase.is_finished() => {
            "result reported to Gitea; deleting the executor".to_owned()
        }
        Phase::Reported => "result reported to Gitea; waiting for the executor to exit".to_owned(),
        Phase::Ended if record.claimed => {
            format!("executor ended without a result{detail}; failing the job in Gitea")
        }
        Phase::Ended => {
            format!("executor ended before its runner fetched the task{detail}; failing the job")
        }
        Phase::Running => match silence {
            Some(s) => format!("running; runner last heard {}s ago", s.as_secs()),
            None => "running (claimed before this controller started)".to_owned(),
        },
        Phase::Starting => match &record.phase {
            ExecutorPhase::Starting { reason: Some(r) } => format!("starting: {r}"),
            _ if !record.identity_bound => "executor created; binding its identity".to_owned(),
            _ => "identity bound; waiting for the runner to fetch its task".to_owned(),
        },
    }
}

#[cfg(test)]
mod tests {
    use crate::ports::QueueError;
    use gdr_core::capability::CapabilityKey;
    use gdr_core::executor::{ExecutorBackend, ExecutorSpec};
    use gdr_core::metadata::MetadataCodec;
    use gdr_testkit::memory_backend::MemoryBackend;
    use gdr_testkit::tasks::assignment;

    use super::*;

    struct FixedDepth(Result<u64, ()>);

    #[async_trait]
    impl QueueDepth for FixedDepth {
        async fn unclaimed(&self, backend: Backend) -> Result<u64, QueueError> {
            self.0.map_err(|()| QueueError::Consumer {
                consumer: backend.as_str().into(),
                source: "no responders".into(),
            })
        }
    }

    async fn create(
        backend: &MemoryBackend,
        d: &Dispatch,
        task: i64,
    ) -> gdr_core::assignment::Assignment {
        let a = assignment(task, "[self-hosted, pod]");
        let spec = ExecutorSpec::new(
            &a,
            d.capability_key().issue(a.id()),
            &MetadataCodec::default(),
            "https://facade",
            "spiffe://example.org/controller",
            "pod",
        );
        backend.create(&spec).await.unwrap();
        d.admit(Backend::Pod, a.id());
        a
    }

    /// DESIGN invariant 24: the status shows what the backend and the pools report — the
    /// lifecycle reconciler's view — and JetStream's queue without the executors already
    /// created for it.
    #[tokio::test]
    async fn status_counts_phases_from_the_backend_listing_and_the_queue_without_started_executors()
    {
        let backend = Arc::new(MemoryBackend::new(Backend::Pod));
        let d = Arc::new(Dispatch::new(
            [(backend.clone() as Arc<dyn ExecutorBackend>, 3)],
            CapabilityKey::new(b"0123456789abcdef0123456789abcdef").unwrap(),
        ));
        let running = create(&backend, &d, 7).await;
        let _starting = create(&backend, &d, 8).await;
        let done = create(&backend, &d, 9).await;
        backend.record_claimed(running.id()).await.unwrap();
        d.heard_from(running.id());
        backend.record_claimed(done.id()).await.unwrap();
        backend.mark_terminal(done.id()).await.unwrap();
        let observations = Arc::new(Observations::new(None));
        observations.listed(Backend::Pod, &backend.list().await.unwrap());
        // Five unclaimed in JetStream: the starting executor's and four without an executor.
        let observed = Observed::new(
            d.clone(),
            observations.clone(),
            Some(Arc::new(FixedDepth(Ok(5)))),
            vec![Backend::Pod],
        );
        let report = observed.report().await;
        assert!(report.leader);
        let pod = &report.backends[0];
        assert_eq!(
            (
                pod.capacity,
                pod.in_use,
                pod.starting,
                pod.running,
                pod.finishing
            ),
            (3, 3, 1, 1, 1)
        );
        assert_eq!(
            (pod.unclaimed_jetstream, pod.queued_jetstream),
            (Some(5), Some(4))
        );
        assert_eq!(pod.queued_gitea, None);
        let phases: Vec<(i64, Phase, bool)> = report
            .assignments
            .iter()
            .map(|a| (a.task_id, a.phase, a.claimed))
            .collect();
        assert_eq!(
            phases,
            vec![
                (7, Phase::Running, true),
                (8, Phase::Starting, false),
                (9, Phase::Reported, true)
            ]
        );
        let first = &report.assignments[0];
        assert_eq!(
            (first.repository.as_str(), first.id.as_str()),
            ("owner/repo", "gitea-task-7")
        );
        assert!(
            first.last_event.starts_with("running; runner last heard"),
            "{first:?}"
        );

        // JetStream unreachable, the backend listing failing: the numbers that are known
        // stay, and the report says what is missing.
        observations.list_failed(Backend::Pod, &"connection refused");
        let observed = Observed::new(
            d,
            observations,
            Some(Arc::new(FixedDepth(Err(())))),
            vec![Backend::Pod],
        );
        let pod = observed.report().await.backends.remove(0);
        assert_eq!((pod.running, pod.queued_jetstream), (1, None));
        assert!(
            pod.problems
                .iter()
                .any(|p| p.contains("connection refused")),
            "{pod:?}"
        );
        assert!(
            pod.problems.iter().any(|p| p.contains("no responders")),
            "{pod:?}"
        );
    }

    /// DESIGN invariant 24 (issue 39 item 5): the status shows the warm pool as the last
    /// upkeep left it, by profile, and no pool once none is kept.
    #[tokio::test]
    async fn status_shows_the_warm_pool_the_last_upkeep_left_by_profile() {
        let backend = Arc::new(MemoryBackend::new(Backend::Pod));
        let d = Arc::new(Dispatch::new(
            [(backend as Arc<dyn ExecutorBackend>, 1)],
            CapabilityKey::new(b"0123456789abcdef0123456789abcdef").unwrap(),
        ));
        let observations = Arc::new(Observations::new(None));
        let observed = Observed::new(d, observations.clone(), None, vec![Backend::Pod]);
        let left = BTreeMap::from([
            ((String::new(), "ready"), 2),
            ((String::new(), "starting"), 1),
            (("large".to_owned(), "ready"), 0),
            (("large".to_owned(), "starting"), 1),
        ]);
        observations.warm_left(Backend::Pod, Some(&left));
        let pod = observed.report().await.backends.remove(0);
        let warm = |profile: &str, ready, starting| WarmStatus {
            profile: profile.into(),
            ready,
            starting,
        };
        assert_eq!(pod.warm, Some(vec![warm("", 2, 1), warm("large", 0, 1)]));
        assert_eq!(pod.cells()[8], "2/2");
        observations.warm_left(Backend::Pod, Some(&BTreeMap::new()));
        let pod = observed.report().await.backends.remove(0);
        assert_eq!((pod.cells()[8].as_str(), pod.warm), ("none", None));
    }

    #[test]
    fn the_report_round_trips_through_json_with_snake_case_phases() {
        let mut report = StatusReport::standby(false);
        report.assignments.push(AssignmentStatus {
            id: "gitea-task-1".into(),
            task_id: 1,
            repository: "o/r".into(),
            job_key: "build".into(),
            backend: "pod".into(),
            executor: "gitea-task-1".into(),
            phase: Phase::Starting,
            claimed: false,
            age_seconds: 3,
            last_event: "starting".into(),
        });
        let json = serde_json::to_string(&report).unwrap();
        assert!(json.contains("\"phase\":\"starting\""), "{json}");
        assert_eq!(serde_json::from_str::<StatusReport>(&json).unwrap(), report);
    }
}
