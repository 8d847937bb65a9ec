//! The metrics of a job's way through the workers, the lifecycle reconciler, the facade
//! and the held store (deliveries, waits, latencies, results, failures, executors by
//! phase), in one place because each of them counts some of the same job's steps. They
//! register through the `metrics::Registrar` the wiring hands out, like every component's.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;

use crate::metrics::{BackendLabel, Registrar};

/// Labels: backend and outcome.
#[derive(Clone, Debug, Default, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    /// `pod` or `vm`.
    pub backend: String,
    /// What happened to the delivery (see `worker::Outcome`).
    pub outcome: String,
}

/// Labels: backend and the result the job's runner reported.
#[derive(Clone, Debug, Default, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    /// `pod` or `vm`.
    pub backend: String,
    /// `success`, `failure`, `cancelled` or `skipped`.
    pub result: String,
}

/// Labels: backend and why the controller failed a job.
#[derive(Clone, Debug, Default, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    /// `pod` or `vm`.
    pub backend: String,
    /// A [`FailureReason`].
    pub reason: String,
}

/// Labels: backend and the phase of an executor.
#[derive(Clone, Debug, Default, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PhaseLabels {
    /// `pod` or `vm`.
    pub backend: String,
    /// A [`crate::status::Phase`].
    pub phase: String,
}

/// Labels: backend, profile and state of unclaimed warm environments.
#[derive(Clone, Debug, Default, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WarmLabels {
    /// `pod`.
    pub backend: String,
    /// The profile the environments are kept for (empty: none).
    pub profile: String,
    /// One of [`WARM_STATES`].
    pub state: String,
}

/// Labels: backend and why warm environments were discarded.
#[derive(Clone, Debug, Default, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DiscardLabels {
    /// `pod`.
    pub backend: String,
    /// One of [`WARM_DISCARD_REASONS`].
    pub reason: String,
}

/// Labels: backend and what a job's claim of a warm environment found.
#[derive(Clone, Debug, Default, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ClaimLabels {
    /// `pod`.
    pub backend: String,
    /// One of [`WARM_CLAIM_OUTCOMES`].
    pub outcome: String,
}

/// What a job whose profile is pooled found: a ready warm environment that served it, or
/// none, and one created for it.
pub const WARM_CLAIM_OUTCOMES: [&str; 2] = ["claimed", "missed"];
/// States of an unclaimed warm environment: claimable, or not running yet.
pub const WARM_STATES: [&str; 2] = ["ready", "starting"];
/// Why a warm environment is deleted unclaimed: its executor ended, it was made under
/// earlier settings, it did not run within `executor_start_deadline`, or the count is
/// lower than the pool.
pub const WARM_DISCARD_REASONS: [&str; 4] = ["ended", "outdated", "stalled", "surplus"];

/// Why the controller itself failed a job in Gitea (the runner never reported a result).
/// Low-cardinality label values; the log line of each failure carries the full reason.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailureReason {
    /// The backend refused to create the job's environment for good.
    BackendRefused,
    /// The job's workload identity cannot be bound.
    IdentityRefused,
    /// The executor did not start the job within `executor_start_deadline`.
    StartDeadline,
    /// The executor ended before its runner fetched the task.
    EndedBeforeClaim,
    /// The executor disappeared before its runner fetched the task.
    Disappeared,
    /// The executor ended after the claim without its runner reporting a result.
    EndedWithoutResult,
    /// The runner stopped reporting for `executor_idle_timeout` while its environment stayed up.
    RunnerSilent,
}

impl FailureReason {
    /// Every reason, in the order the reference lists them.
    pub const ALL: [FailureReason; 7] = [
        FailureReason::BackendRefused,
        FailureReason::IdentityRefused,
        FailureReason::StartDeadline,
        FailureReason::EndedBeforeClaim,
        FailureReason::Disappeared,
        FailureReason::EndedWithoutResult,
        FailureReason::RunnerSilent,
    ];

    /// The label value.
    pub const fn as_str(self) -> &'static str {
        match self {
            FailureReason::BackendRefused => "backend_refused",
            FailureReason::IdentityRefused => "identity_refused",
            FailureReason::StartDeadline => "start_deadline",
            FailureReason::EndedBeforeClaim => "ended_before_claim",
            FailureReason::Disappeared => "disappeared",
            FailureReason::EndedWithoutResult => "ended_without_result",
            FailureReason::RunnerSilent => "runner_silent",
        }
    }
}

/// The results a runner reports, as label values.
pub const RESULTS: [&str; 4] = ["success", "failure", "cancelled", "skipped"];

/// The label value of a runner's terminal result (the facade counts by it).
pub use gdr_facade::result_label;

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

/// Queue wait: a job waits for a free slot or a backend that has room (seconds … an hour).
const QUEUE_WAIT_BUCKETS: [f64; 14] = [
    0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0,
];
/// Start latency: a process starts in a second, a Pod pulls an image, a VM boots.
const START_LATENCY_BUCKETS: [f64; 12] = [
    0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0,
];
/// Run time: up to Gitea's endless-task timeout of 3 h.
const RUN_TIME_BUCKETS: [f64; 13] = [
    1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0, 7200.0, 10800.0,
];

fn queue_wait_histogram() -> Histogram {
    Histogram::new(QUEUE_WAIT_BUCKETS)
}

fn start_latency_histogram() -> Histogram {
    Histogram::new(START_LATENCY_BUCKETS)
}

fn run_time_histogram() -> Histogram {
    Histogram::new(RUN_TIME_BUCKETS)
}

/// Adds each of `counts` to its series of `family`, labelled by `labels` of its key.
fn add_counts<L>(
    family: &Family<L, Counter>,
    counts: &std::collections::BTreeMap<&'static str, usize>,
    labels: impl Fn(&str) -> L,
) where
    L: Clone + std::hash::Hash + Eq,
{
    for (key, n) in counts {
        family
            .get_or_create(&labels(key))
            .inc_by(u64::try_from(*n).unwrap_or(u64::MAX));
    }
}

/// The metrics of jobs, shared by the components that see a job's steps.
pub struct JobMetrics {
    /// Worker deliveries by outcome.
    pub assignments: Family<OutcomeLabels, Counter>,
    /// Executors by backend and phase, as the last lifecycle pass listed them.
    pub executors: Family<PhaseLabels, Gauge>,
    /// Fetched → admitted, by backend.
    pub queue_wait: HistogramFamily<BackendLabel>,
    /// Admitted (executor created) → claimed by its runner, by backend.
    pub start_latency: HistogramFamily<BackendLabel>,
    /// Claimed → terminal result accepted by Gitea, by backend.
    pub run_time: HistogramFamily<BackendLabel>,
    /// Terminal results the runners reported, by backend and result.
    pub jobs_completed: Family<ResultLabels, Counter>,
    /// Jobs the controller failed in Gitea, by backend and reason.
    pub jobs_failed: Family<ReasonLabels, Counter>,
    /// Lifecycle steps that failed (listing, reporting, marking, deleting) by backend.
    pub lifecycle_errors: Family<BackendLabel, Counter>,
    /// Claimed executors failed because their runner fell silent, by backend.
    pub idle_executors_failed: Family<BackendLabel, Counter>,
    /// Assignments held because they are sealed with a task key this controller lacks.
    pub held_assignments: Family<BackendLabel, Gauge>,
    /// Unclaimed warm environments, as the last lifecycle pass left them.
    pub warm_environments: Family<WarmLabels, Gauge>,
    /// Warm environments deleted unclaimed, by reason.
    pub warm_discarded: Family<DiscardLabels, Counter>,
    /// Jobs of pooled profiles, by whether a warm environment served them.
    pub warm_claims: Family<ClaimLabels, Counter>,
}

impl Default for JobMetrics {
    fn default() -> Self {
        JobMetrics {
            assignments: Family::default(),
            executors: Family::default(),
            queue_wait: Family::new_with_constructor(queue_wait_histogram),
            start_latency: Family::new_with_constructor(start_latency_histogram),
            run_time: Family::new_with_constructor(run_time_histogram),
            jobs_completed: Family::default(),
            jobs_failed: Family::default(),
            lifecycle_errors: Family::default(),
            idle_executors_failed: Family::default(),
            held_assignments: Family::default(),
            warm_environments: Family::default(),
            warm_discarded: Family::default(),
            warm_claims: Family::default(),
        }
    }
}

impl JobMetrics {
    /// Registers them (the same values these families hold).
    pub fn register(&self, r: &mut Registrar<'_>) {
        r.family(
            "assignments",
            "Worker deliveries by backend and outcome",
            &self.assignments,
        )
        .values(
            "outcome",
            &crate::vocabulary::Outcome::ALL.map(|o| o.as_str()),
        );
        r.family(
            "executors",
            "Executors by backend and phase, as the last lifecycle pass listed them",
            &self.executors,
        )
        .values("phase", &crate::vocabulary::Phase::ALL.map(|p| p.as_str()));
        r.family(
            "queue_wait_seconds",
            "Time from the task's arrival in JetStream to its admission into the backend's pool, in seconds",
            &self.queue_wait,
        )
        .buckets(&QUEUE_WAIT_BUCKETS);
        r.family(
            "start_latency_seconds",
            "Time from the executor's creation to its runner claiming the task, in seconds",
            &self.start_latency,
        )
        .buckets(&START_LATENCY_BUCKETS);
        r.family(
            "run_time_seconds",
            "Time from the claim to Gitea accepting the runner's result, in seconds",
            &self.run_time,
        )
        .buckets(&RUN_TIME_BUCKETS);
        r.family(
            "jobs_completed",
            "Jobs that ended with a result their runner reported, once per job, by backend and the result Gitea kept (a cancel in Gitea outlasts a runner's success)",
            &self.jobs_completed,
        )
        .values("result", &RESULTS);
        r.family(
            "jobs_failed",
            "Jobs the controller failed in Gitea because their runner could not report a result, by backend and reason",
            &self.jobs_failed,
        )
        .values("reason", &FailureReason::ALL.map(FailureReason::as_str));
        r.family(
            "lifecycle_errors",
            "Lifecycle reconciler steps that failed and will be retried, by backend",
            &self.lifecycle_errors,
        );
        r.family(
            "idle_executors_failed",
            "Claimed executors failed in Gitea because their runner stopped reporting, by backend",
            &self.idle_executors_failed,
        );
        r.family(
            "held_assignments",
            "Assignments set aside because they are sealed with a task key this controller lacks, by backend",
            &self.held_assignments,
        );
        r.family(
            "warm_environments",
            "Unclaimed warm environments (pod_warm_pool, vm_warm_pool) by backend, profile (empty: none) and state (ready: claimable; starting: not running yet), as the last lifecycle pass left them",
            &self.warm_environments,
        )
        .values("state", &WARM_STATES);
        r.family(
            "warm_environments_discarded",
            "Warm environments deleted unclaimed, by backend and reason (ended; outdated: made under earlier settings; stalled: not running within executor_start_deadline; surplus: above the count)",
            &self.warm_discarded,
        )
        .values("reason", &WARM_DISCARD_REASONS);
        r.family(
            "warm_environment_claims",
            "Jobs of profiles (or the VM backend) with a warm pool, by backend and outcome (claimed: a ready warm environment served the job; missed: none was ready and one was created for the job)",
            &self.warm_claims,
        )
        .values("outcome", &WARM_CLAIM_OUTCOMES);
    }

    /// Records what a lifecycle pass left of `backend`'s warm pool (`warm`: by profile
    /// and state; `None`: it keeps none), what it discarded, by reason, and the jobs'
    /// claims since the previous pass, by outcome.
    pub fn record_warm(
        &self,
        backend: gdr_core::backend::Backend,
        warm: Option<&std::collections::BTreeMap<(String, &'static str), usize>>,
        discarded: &std::collections::BTreeMap<&'static str, usize>,
        claims: &std::collections::BTreeMap<&'static str, usize>,
    ) {
        let name = BackendLabel::of(backend).backend;
        if let Some(warm) = warm {
            // A profile no longer pooled loses its series: only the pass's are current.
            self.warm_environments.clear();
            for ((profile, state), n) in warm {
                self.warm_environments
                    .get_or_create(&WarmLabels {
                        backend: name.clone(),
                        profile: profile.clone(),
                        state: (*state).to_owned(),
                    })
                    .set(i64::try_from(*n).unwrap_or(i64::MAX));
            }
        }
        add_counts(&self.warm_discarded, discarded, |reason| DiscardLabels {
            backend: name.clone(),
            reason: reason.to_owned(),
        });
        add_counts(&self.warm_claims, claims, |outcome| ClaimLabels {
            backend: name.clone(),
            outcome: outcome.to_owned(),
        });
    }

    /// Creates every per-backend series of `backend` at zero, so dashboards and alerts see
    /// them (and `increase()` works) before the first event.
    pub fn init_backend(&self, backend: gdr_core::backend::Backend) {
        let label = BackendLabel::of(backend);
        let name = label.backend.clone();
        for family in [&self.lifecycle_errors, &self.idle_executors_failed] {
            family.get_or_create_owned(&label);
        }
        self.held_assignments.get_or_create_owned(&label);
        for family in [&self.queue_wait, &self.start_latency, &self.run_time] {
            family.get_or_create_owned(&label);
        }
        for result in RESULTS {
            self.jobs_completed.get_or_create_owned(&ResultLabels {
                backend: name.clone(),
                result: result.into(),
            });
        }
        for reason in FailureReason::ALL {
            self.jobs_failed.get_or_create_owned(&ReasonLabels {
                backend: name.clone(),
                reason: reason.as_str().into(),
            });
        }
        for phase in crate::vocabulary::Phase::ALL {
            self.executors.get_or_create_owned(&PhaseLabels {
                backend: name.clone(),
                phase: phase.as_str().into(),
            });
        }
    }

    /// Counts a job the controller failed in Gitea.
    pub fn job_failed(&self, backend: gdr_core::backend::Backend, reason: FailureReason) {
        self.jobs_failed
            .get_or_create(&ReasonLabels {
                backend: backend.as_str().into(),
                reason: reason.as_str().into(),
            })
            .inc();
    }
}
