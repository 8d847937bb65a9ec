//! In-memory model of the parts of Gitea the runner protocol touches, and the rules from
//! `reference/gitea-protocol.md` §3 as plain functions over it. Nothing here awaits: the
//! server calls these while holding the mutex and releases it before answering.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::{Duration, Instant, SystemTime};

use buffa_types::google::protobuf::{Struct, Timestamp, Value};
use gdr_proto::runner::v1 as pb;
use rand::RngExt;

use super::workflow::ParsedWorkflow;
use super::{
    JobId, JobSnapshot, MockError, MockFault, RpcMethod, RunnerSnapshot, Status, StepSnapshot,
    TaskSnapshot,
};

/// Largest output key Gitea stores (bytes).
const MAX_OUTPUT_KEY: usize = 255;
/// Largest output value Gitea stores (bytes).
const MAX_OUTPUT_VALUE: usize = 1024 * 1024;
/// Gitea truncates runner names to this many characters.
const MAX_RUNNER_NAME: usize = 255;

/// gRPC status code names as Gitea's `status.Error` prints them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GrpcCode {
    Unknown,
    InvalidArgument,
    NotFound,
    AlreadyExists,
    PermissionDenied,
    FailedPrecondition,
    Internal,
    Unavailable,
    Unauthenticated,
}

impl GrpcCode {
    /// The Go `codes.Code.String()` spelling used in `rpc error: code = … desc = …`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Unknown => "Unknown",
            Self::InvalidArgument => "InvalidArgument",
            Self::NotFound => "NotFound",
            Self::AlreadyExists => "AlreadyExists",
            Self::PermissionDenied => "PermissionDenied",
            Self::FailedPrecondition => "FailedPrecondition",
            Self::Internal => "Internal",
            Self::Unavailable => "Unavailable",
            Self::Unauthenticated => "Unauthenticated",
        }
    }
}

/// An error as Gitea produces it. connect-go does not recognise grpc `status` errors or
/// plain Go errors, so on the wire every one of them is HTTP 500 / code `unknown` with
/// `err.Error()` as the message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GiteaError {
    /// `status.Error(code, desc)`: message `rpc error: code = <code> desc = <desc>`.
    Status { code: GrpcCode, desc: String },
    /// `errors.New(msg)`: the message is the bare text.
    Plain(String),
}

impl GiteaError {
    pub fn status(code: GrpcCode, desc: impl Into<String>) -> Self {
        Self::Status {
            code,
            desc: desc.into(),
        }
    }

    /// The message connect-go writes into the error body.
    pub fn message(&self) -> String {
        match self {
            Self::Status { code, desc } => {
                format!("rpc error: code = {} desc = {desc}", code.name())
            }
            Self::Plain(m) => m.clone(),
        }
    }

    fn unregistered() -> Self {
        Self::status(GrpcCode::Unauthenticated, "unregistered runner")
    }
}

pub(crate) struct RunnerRec {
    pub id: i64,
    pub uuid: String,
    pub token: String,
    pub name: String,
    pub version: String,
    pub labels: Vec<String>,
    pub ephemeral: bool,
    pub capabilities: Vec<String>,
    pub disabled: bool,
    pub last_online: SystemTime,
}

impl RunnerRec {
    fn has_cancelling_support(&self) -> bool {
        self.capabilities.iter().any(|c| c == "cancelling")
    }

    fn to_proto(&self, with_ephemeral: bool) -> pb::Runner {
        pb::Runner {
            id: self.id,
            uuid: self.uuid.clone(),
            token: self.token.clone(),
            name: self.name.clone(),
            version: self.version.clone(),
            labels: self.labels.clone(),
            // Declare's answer has no `ephemeral` in Gitea; Register's does.
            ephemeral: with_ephemeral && self.ephemeral,
            ..Default::default()
        }
    }

    fn snapshot(&self) -> RunnerSnapshot {
        RunnerSnapshot {
            id: self.id,
            uuid: self.uuid.clone(),
            name: self.name.clone(),
            version: self.version.clone(),
            labels: self.labels.clone(),
            ephemeral: self.ephemeral,
            capabilities: self.capabilities.clone(),
            disabled: self.disabled,
            last_online: self.last_online,
        }
    }
}

pub(crate) struct JobRec {
    pub id: i64,
    pub run_id: i64,
    pub run_number: i64,
    pub repo: String,
    pub key: String,
    pub name: String,
    pub workflow_name: String,
    pub runs_on: Vec<String>,
    pub payload: String,
    pub status: Status,
    pub task_id: Option<i64>,
    pub sha: String,
    pub trigger: Trigger,
}

/// What started a run, as Gitea's task context tells it (`services/actions/context.go`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Trigger {
    /// A push of the full ref (`refs/heads/…`, `refs/tags/…`).
    Push(String),
    /// A `pull_request` event: `ref` is `refs/pull/<number>/head`.
    PullRequest {
        /// The pull request's number (its index).
        number: i64,
        /// The head branch.
        head: String,
        /// The base branch.
        base: String,
    },
    /// A `pull_request_target` event: Gitea runs the base branch's workflow and rewrites
    /// `ref` to `refs/heads/<base>`.
    PullRequestTarget {
        /// The pull request's number (its index).
        number: i64,
        /// The head branch.
        head: String,
        /// The base branch.
        base: String,
    },
    /// A context without `ref`: nothing Gitea sends, for testing who refuses it.
    NoRef,
}

impl Default for Trigger {
    /// A push to `main`.
    fn default() -> Self {
        Trigger::Push("refs/heads/main".into())
    }
}

impl Trigger {
    /// The context fields Gitea derives from the trigger.
    fn write_context(&self, ctx: &mut Struct) {
        let (event_name, git_ref, pull) = match self {
            Trigger::Push(git_ref) => ("push", Some(git_ref.clone()), None),
            Trigger::PullRequest { number, head, base } => (
                "pull_request",
                Some(format!("refs/pull/{number}/head")),
                Some((*number, head, base)),
            ),
            Trigger::PullRequestTarget { number, head, base } => (
                "pull_request_target",
                Some(format!("refs/heads/{base}")),
                Some((*number, head, base)),
            ),
            Trigger::NoRef => ("push", None, None),
        };
        ctx.insert("event_name", event_name);
        let git_ref = git_ref.unwrap_or_default();
        let (ref_name, ref_type) = if let Some(name) = git_ref.strip_prefix("refs/heads/") {
            (name, "branch")
        } else if let Some(name) = git_ref.strip_prefix("refs/tags/") {
            (name, "tag")
        } else if let Some(name) = git_ref.strip_prefix("refs/pull/") {
            (name, "pull")
        } else {
            (git_ref.as_str(), "")
        };
        ctx.insert("ref_name", ref_name);
        ctx.insert("ref_type", ref_type);
        if !matches!(self, Trigger::NoRef) {
            ctx.insert("ref", git_ref.as_str());
        }
        let mut event = Struct::new();
        match pull {
            Some((number, head, base)) => {
                ctx.insert("base_ref", base.as_str());
                ctx.insert("head_ref", head.as_str());
                let branch = |name: &str| Struct::from_fields([("ref", Value::from(name))]);
                let pull_request = Struct::from_fields([
                    ("number", Value::from(number as f64)),
                    ("head", Value::from(branch(head))),
                    ("base", Value::from(branch(base))),
                ]);
                event.insert("number", number as f64);
                event.insert("pull_request", pull_request);
            }
            None => {
                ctx.insert("base_ref", "");
                ctx.insert("head_ref", "");
            }
        }
        ctx.insert("event", event);
    }
}

pub(crate) struct TaskRec {
    pub id: i64,
    pub job_id: i64,
    pub runner_id: i64,
    pub token: String,
    pub status: Status,
    pub started: SystemTime,
    pub stopped: Option<SystemTime>,
    pub updated: SystemTime,
    /// Monotonic twin of `updated`, used by the zombie sweeper.
    pub updated_at: Instant,
    pub heartbeats: u64,
    pub results_reported: u64,
    pub log_rows: Vec<String>,
    /// When the first log row was stored.
    pub first_log: Option<SystemTime>,
    pub log_archived: bool,
    pub outputs: BTreeMap<String, String>,
    pub steps: BTreeMap<i64, StepSnapshot>,
    /// Set while the runner still holds the task: a user cancel or the sweeper chose the end.
    pub cancel_requested: bool,
}

impl TaskRec {
    fn touch(&mut self) {
        self.updated = SystemTime::now();
        self.updated_at = Instant::now();
    }

    fn snapshot(&self) -> TaskSnapshot {
        TaskSnapshot {
            id: self.id,
            job_id: JobId(self.job_id),
            runner_id: self.runner_id,
            status: self.status,
            result: self.status.as_result() as i32,
            started: self.started,
            stopped: self.stopped,
            updated: self.updated,
            heartbeats: self.heartbeats,
            results_reported: self.results_reported,
            log_rows: self.log_rows.clone(),
            first_log: self.first_log,
            log_archived: self.log_archived,
            outputs: self.outputs.clone(),
            steps: self.steps.values().cloned().collect(),
            token: self.token.clone(),
        }
    }
}

/// Everything the mock knows. Guarded by one `std::sync::Mutex` in [`super::MockGitea`].
pub(crate) struct State {
    tasks_version: i64,
    next_runner_id: i64,
    next_job_id: i64,
    next_task_id: i64,
    next_run_id: i64,
    run_numbers: HashMap<String, i64>,
    /// token → active
    registration_tokens: HashMap<String, bool>,
    runners: BTreeMap<String, RunnerRec>,
    jobs: BTreeMap<i64, JobRec>,
    tasks: BTreeMap<i64, TaskRec>,
    secrets: HashMap<String, BTreeMap<String, String>>,
    vars: HashMap<String, BTreeMap<String, String>>,
    pub faults: HashMap<RpcMethod, VecDeque<MockFault>>,
    /// Calls received per method (faulted ones included).
    pub calls: HashMap<RpcMethod, u64>,
    /// Calls being answered right now, per method.
    pub in_flight: HashMap<RpcMethod, u64>,
    /// The most calls of a method answered at once (since the last reset).
    pub in_flight_peak: HashMap<RpcMethod, u64>,
    pub seen_requests: Vec<String>,
    /// The headers of each of `seen_requests`, in order.
    pub seen_request_headers: Vec<(String, Vec<(String, String)>)>,
    /// Gitea's AppURL, with the trailing slash Gitea keeps.
    pub server_url: String,
    pub default_actions_url: String,
}

pub(crate) fn random_hex(bytes: usize) -> String {
    let mut rng = rand::rng();
    (0..bytes)
        .map(|_| format!("{:02x}", rng.random::<u8>()))
        .collect()
}

fn random_uuid() -> String {
    let mut b: [u8; 16] = rand::rng().random();
    b[6] = (b[6] & 0x0f) | 0x40; // version 4
    b[8] = (b[8] & 0x3f) | 0x80; // RFC 4122 variant
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

fn system_time(ts: Option<&Timestamp>) -> Option<SystemTime> {
    ts.and_then(|t| SystemTime::try_from(t.clone()).ok())
}

fn status_from_result(r: pb::TaskResult) -> Status {
    match r {
        pb::TaskResult::RESULT_SUCCESS => Status::Success,
        pb::TaskResult::RESULT_CANCELLED => Status::Cancelled,
        pb::TaskResult::RESULT_SKIPPED => Status::Skipped,
        // Gitea's Status(result) cast would store an unknown value; failing is the
        // closest observable behaviour.
        pb::TaskResult::RESULT_FAILURE | pb::TaskResult::RESULT_UNSPECIFIED => Status::Failure,
    }
}

impl State {
    pub fn new(server_url: String, default_actions_url: String, tokens: &[String]) -> Self {
        Self {
            tasks_version: 0,
            next_runner_id: 1,
            next_job_id: 1,
            next_task_id: 1,
            next_run_id: 1,
            run_numbers: HashMap::new(),
            registration_tokens: tokens.iter().map(|t| (t.clone(), true)).collect(),
            runners: BTreeMap::new(),
            jobs: BTreeMap::new(),
            tasks: BTreeMap::new(),
            secrets: HashMap::new(),
            vars: HashMap::new(),
            faults: HashMap::new(),
            calls: HashMap::new(),
            in_flight: HashMap::new(),
            in_flight_peak: HashMap::new(),
            seen_requests: Vec::new(),
            seen_request_headers: Vec::new(),
            server_url,
            default_actions_url,
        }
    }

    // ----- test-driving API -------------------------------------------------------------

    pub fn add_registration_token(&mut self, token: &str) {
        self.registration_tokens.insert(token.to_owned(), true);
    }

    pub fn invalidate_registration_token(&mut self, token: &str) {
        if let Some(active) = self.registration_tokens.get_mut(token) {
            *active = false;
        }
    }

    pub fn set_secret(&mut self, repo: &str, name: &str, value: &str) {
        self.secrets
            .entry(repo.to_owned())
            .or_default()
            .insert(name.to_owned(), value.to_owned());
    }

    pub fn set_variable(&mut self, repo: &str, name: &str, value: &str) {
        self.vars
            .entry(repo.to_owned())
            .or_default()
            .insert(name.to_owned(), value.to_owned());
    }

    fn insert_runner(
        &mut self,
        name: &str,
        version: &str,
        labels: Vec<String>,
        ephemeral: bool,
        capabilities: Vec<String>,
    ) -> &RunnerRec {
        let id = self.next_runner_id;
        self.next_runner_id += 1;
        let uuid = random_uuid();
        let rec = RunnerRec {
            id,
            uuid: uuid.clone(),
            token: random_hex(20),
            name: name.chars().take(MAX_RUNNER_NAME).collect(),
            version: version.to_owned(),
            labels,
            ephemeral,
            capabilities,
            disabled: false,
            last_online: SystemTime::now(),
        };
        self.runners.entry(uuid).or_insert(rec)
    }

    pub fn create_runner(
        &mut self,
        name: &str,
        labels: &[&str],
        ephemeral: bool,
    ) -> (String, String) {
        let labels = labels.iter().map(|l| (*l).to_owned()).collect();
        let r = self.insert_runner(name, "", labels, ephemeral, Vec::new());
        (r.uuid.clone(), r.token.clone())
    }

    pub fn set_runner_disabled(&mut self, uuid: &str, disabled: bool) -> bool {
        let Some(r) = self.runners.get_mut(uuid) else {
            return false;
        };
        r.disabled = disabled;
        // Gitea bumps the version on enable/disable so pollers re-pick.
        self.bump_version();
        true
    }

    fn bump_version(&mut self) {
        self.tasks_version = self.latest_version() + 1;
    }

    /// Gitea treats a missing/zero version row as 1 (bumping it on first use).
    fn latest_version(&mut self) -> i64 {
        if self.tasks_version == 0 {
            self.tasks_version = 1;
        }
        self.tasks_version
    }

    pub fn tasks_version(&self) -> i64 {
        self.tasks_version.max(1)
    }

    pub fn queue_workflow(
        &mut self,
        repo: &str,
        trigger: &Trigger,
        wf: ParsedWorkflow,
    ) -> Vec<JobId> {
        let run_id = self.next_run_id;
        self.next_run_id += 1;
        let run_number = {
            let n = self.run_numbers.entry(repo.to_owned()).or_insert(0);
            *n += 1;
            *n
        };
        let sha = random_hex(20);
        let mut ids = Vec::with_capacity(wf.jobs.len());
        for job in wf.jobs {
            let id = self.next_job_id;
            self.next_job_id += 1;
            self.jobs.insert(
                id,
                JobRec {
                    id,
                    run_id,
                    run_number,
                    repo: repo.to_owned(),
                    key: job.key,
                    name: job.name,
                    workflow_name: wf.name.clone(),
                    runs_on: job.runs_on,
                    payload: job.payload,
                    status: Status::Waiting,
                    task_id: None,
                    sha: sha.clone(),
                    trigger: trigger.clone(),
                },
            );
            ids.push(JobId(id));
        }
        // A job becoming waiting bumps the version (models/actions/run_job.go).
        self.bump_version();
        ids
    }

    /// A user pressing "cancel": a waiting job ends cancelled; a running task becomes
    /// Cancelling when its runner can clean up, else Cancelled at once.
    pub fn cancel_job(&mut self, job: JobId) -> Result<(), MockError> {
        let rec = self.jobs.get_mut(&job.0).ok_or(MockError::NoSuchJob(job))?;
        match rec.status {
            Status::Waiting => {
                rec.status = Status::Cancelled;
                Ok(())
            }
            Status::Running => {
                let task_id = rec.task_id.ok_or(MockError::NoSuchJob(job))?;
                let runner_id = self.tasks.get(&task_id).map(|t| t.runner_id);
                let cancelling = runner_id
                    .and_then(|rid| self.runners.values().find(|r| r.id == rid))
                    .is_some_and(RunnerRec::has_cancelling_support);
                if cancelling {
                    self.set_task_status(task_id, Status::Cancelling);
                    if let Some(t) = self.tasks.get_mut(&task_id) {
                        t.cancel_requested = true;
                    }
                } else {
                    self.finish_task(task_id, Status::Cancelled, SystemTime::now());
                }
                Ok(())
            }
            // Already cancelling or done: Gitea's StopTask leaves finished tasks alone.
            _ => Ok(()),
        }
    }

    fn set_task_status(&mut self, task_id: i64, status: Status) {
        if let Some(t) = self.tasks.get_mut(&task_id) {
            t.status = status;
            if let Some(j) = self.jobs.get_mut(&t.job_id) {
                j.status = status;
            }
        }
    }

    /// Ends a task: status, stop time, archived log, job status; deletes an ephemeral
    /// runner (models/actions/task.go UpdateTask → DeleteEphemeralRunner).
    fn finish_task(&mut self, task_id: i64, status: Status, stopped: SystemTime) {
        let Some(t) = self.tasks.get_mut(&task_id) else {
            return;
        };
        t.status = status;
        t.stopped = Some(stopped);
        t.touch();
        let (job_id, runner_id) = (t.job_id, t.runner_id);
        let repo = self.jobs.get_mut(&job_id).map(|j| {
            j.status = status;
            j.repo.clone()
        });
        let ephemeral_uuid = self
            .runners
            .values()
            .find(|r| r.id == runner_id && r.ephemeral)
            .map(|r| r.uuid.clone());
        if let Some(uuid) = ephemeral_uuid {
            self.runners.remove(&uuid);
        }
        // A finished job with waiting jobs left in its repo bumps the version.
        if let Some(repo) = repo
            && self
                .jobs
                .values()
                .any(|j| j.repo == repo && j.status == Status::Waiting)
        {
            self.bump_version();
        }
    }

    pub fn count_zombies(&self, timeout: Duration) -> usize {
        let now = Instant::now();
        self.tasks
            .values()
            .filter(|t| matches!(t.status, Status::Running | Status::Cancelling))
            .filter(|t| now.saturating_duration_since(t.updated_at) > timeout)
            .count()
    }

    pub fn sweep_zombies(&mut self, timeout: Duration) -> usize {
        let now = Instant::now();
        let zombies: Vec<(i64, Status)> = self
            .tasks
            .values()
            .filter(|t| matches!(t.status, Status::Running | Status::Cancelling))
            .filter(|t| now.saturating_duration_since(t.updated_at) > timeout)
            .map(|t| {
                let end = if t.status == Status::Cancelling {
                    Status::Cancelled
                } else {
                    Status::Failure
                };
                (t.id, end)
            })
            .collect();
        for (id, end) in &zombies {
            self.finish_task(*id, *end, SystemTime::now());
            if let Some(t) = self.tasks.get_mut(id) {
                t.log_archived = true;
            }
        }
        zombies.len()
    }

    // ----- snapshots ---------------------------------------------------------------------

    pub fn job(&self, id: JobId) -> Option<JobSnapshot> {
        let j = self.jobs.get(&id.0)?;
        Some(JobSnapshot {
            id,
            run_id: j.run_id,
            repo: j.repo.clone(),
            key: j.key.clone(),
            name: j.name.clone(),
            runs_on: j.runs_on.clone(),
            status: j.status,
            task_id: j.task_id,
            payload: j.payload.clone(),
            task: j
                .task_id
                .and_then(|t| self.tasks.get(&t))
                .map(TaskRec::snapshot),
        })
    }

    pub fn jobs(&self) -> Vec<JobSnapshot> {
        self.jobs
            .keys()
            .filter_map(|id| self.job(JobId(*id)))
            .collect()
    }

    pub fn task(&self, id: i64) -> Option<TaskSnapshot> {
        self.tasks.get(&id).map(TaskRec::snapshot)
    }

    pub fn runner(&self, uuid: &str) -> Option<RunnerSnapshot> {
        self.runners.get(uuid).map(RunnerRec::snapshot)
    }

    // ----- RPCs --------------------------------------------------------------------------

    /// interceptor.go: unknown uuid or wrong token → Unauthenticated "unregistered runner".
    fn authenticate(&mut self, uuid: &str, token: &str) -> Result<&mut RunnerRec, GiteaError> {
        let runner = self
            .runners
            .get_mut(uuid)
            .ok_or_else(GiteaError::unregistered)?;
        if !constant_time_eq(runner.token.as_bytes(), token.as_bytes()) {
            return Err(GiteaError::unregistered());
        }
        runner.last_online = SystemTime::now();
        Ok(runner)
    }

    pub fn register(&mut self, req: &pb::RegisterRequest) -> Result<pb::Runner, GiteaError> {
        if req.token.is_empty() || req.name.is_empty() {
            return Err(GiteaError::Plain("missing runner token, name".to_owned()));
        }
        match self.registration_tokens.get(&req.token) {
            None => {
                return Err(GiteaError::Plain(
                    "runner registration token not found".to_owned(),
                ));
            }
            Some(false) => {
                return Err(GiteaError::Plain(
                    "runner registration token has been invalidated, please use the latest one"
                        .to_owned(),
                ));
            }
            Some(true) => {}
        }
        let r = self.insert_runner(
            &req.name,
            &req.version,
            req.labels.clone(),
            req.ephemeral,
            req.capabilities.clone(),
        );
        Ok(r.to_proto(true))
    }

    pub fn declare(
        &mut self,
        uuid: &str,
        token: &str,
        req: &pb::DeclareRequest,
    ) -> Result<pb::Runner, GiteaError> {
        let r = self.authenticate(uuid, token)?;
        r.labels = req.labels.clone();
        r.version = req.version.clone();
        r.capabilities = req.capabilities.clone();
        Ok(r.to_proto(false))
    }

    pub fn fetch_task(
        &mut self,
        uuid: &str,
        token: &str,
        version: i64,
    ) -> Result<(Option<pb::Task>, i64), GiteaError> {
        let runner_id = self.authenticate(uuid, token)?.id;
        let latest = self.latest_version();
        if version == latest {
            // The runner is up to date: Gitea skips the pick entirely.
            return Ok((None, latest));
        }
        let Some(runner) = self.runners.get(uuid) else {
            return Err(GiteaError::unregistered());
        };
        if runner.disabled {
            return Ok((None, latest));
        }
        let labels = runner.labels.clone();
        if runner.ephemeral {
            let mine: Vec<&TaskRec> = self
                .tasks
                .values()
                .filter(|t| t.runner_id == runner_id)
                .collect();
            if !mine.is_empty() {
                if mine.iter().any(|t| !t.status.is_done()) {
                    return Ok((None, latest));
                }
                self.runners.remove(uuid);
                return Err(GiteaError::status(
                    GrpcCode::Internal,
                    "pick task: runner has been removed",
                ));
            }
        }
        let pick = self
            .jobs
            .values()
            .find(|j| j.status == Status::Waiting && j.runs_on.iter().all(|l| labels.contains(l)))
            .map(|j| j.id);
        let Some(job_id) = pick else {
            return Ok((None, latest));
        };
        let task = self.claim(job_id, runner_id, uuid)?;
        // Claiming does not bump the version; the runner resets to 0 itself.
        Ok((Some(task), latest))
    }

    fn claim(&mut self, job_id: i64, runner_id: i64, uuid: &str) -> Result<pb::Task, GiteaError> {
        let task_id = self.next_task_id;
        self.next_task_id += 1;
        let token = random_hex(20);
        let now = SystemTime::now();
        let job = self
            .jobs
            .get_mut(&job_id)
            .ok_or_else(|| GiteaError::status(GrpcCode::Internal, "pick task: job vanished"))?;
        job.status = Status::Running;
        job.task_id = Some(task_id);
        self.tasks.insert(
            task_id,
            TaskRec {
                id: task_id,
                job_id,
                runner_id,
                token: token.clone(),
                status: Status::Running,
                started: now,
                stopped: None,
                updated: now,
                updated_at: Instant::now(),
                heartbeats: 0,
                results_reported: 0,
                log_rows: Vec::new(),
                first_log: None,
                log_archived: false,
                outputs: BTreeMap::new(),
                steps: BTreeMap::new(),
                cancel_requested: false,
            },
        );
        let job = &self.jobs[&job_id];
        let (owner, _) = job.repo.split_once('/').unwrap_or((job.repo.as_str(), ""));
        let api_url = format!("{}api/v1", self.server_url);
        let actor = "mock-user";
        let mut ctx = Struct::new();
        for (k, v) in [
            ("action", ""),
            ("action_path", ""),
            ("action_ref", ""),
            ("action_repository", ""),
            ("action_status", ""),
            ("actor", actor),
            ("api_url", api_url.as_str()),
            ("env", ""),
            ("event_path", ""),
            ("graphql_url", ""),
            ("job", job.key.as_str()),
            ("path", ""),
            ("repository", job.repo.as_str()),
            ("repository_owner", owner),
            ("retention_days", ""),
            ("secret_source", "Actions"),
            ("server_url", self.server_url.as_str()),
            ("sha", job.sha.as_str()),
            ("triggering_actor", actor),
            ("workflow", job.workflow_name.as_str()),
            ("workspace", ""),
            (
                "gitea_default_actions_url",
                self.default_actions_url.as_str(),
            ),
            ("token", token.as_str()),
            // Gitea sends an HS256 JWT here; the mock's is opaque but unique per task.
            (
                "gitea_runtime_token",
                &format!("mock-runtime-{task_id}-{}", random_hex(8)),
            ),
        ] {
            ctx.insert(k, v);
        }
        ctx.insert(
            "repositoryUrl",
            format!("{}{}.git", self.server_url, job.repo),
        );
        ctx.insert("run_id", job.run_id.to_string());
        ctx.insert("run_number", job.run_number.to_string());
        ctx.insert("run_attempt", "1");
        ctx.insert("ref_protected", false);
        job.trigger.write_context(&mut ctx);

        let mut secrets: HashMap<String, String> = self
            .secrets
            .get(&job.repo)
            .map(|s| s.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
            .unwrap_or_default();
        secrets.insert("GITHUB_TOKEN".to_owned(), token.clone());
        secrets.insert("GITEA_TOKEN".to_owned(), token);
        let vars = self
            .vars
            .get(&job.repo)
            .map(|s| s.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
            .unwrap_or_default();
        tracing::debug!(task_id, job_id, runner = uuid, "job claimed");
        Ok(pb::Task {
            id: task_id,
            workflow_payload: Some(job.payload.clone().into_bytes()),
            context: buffa::MessageField::some(ctx),
            secrets: secrets.into_iter().collect(),
            vars,
            ..Default::default()
        })
    }

    /// The task `runner_id` may update. Failures read as Gitea's do: its handlers wrap
    /// `util.ErrNotExist` and the ownership check in `codes.Internal` with the step
    /// (`update task: …` in UpdateTask, `get task: …` in UpdateLog).
    fn owned_task(
        &mut self,
        runner_id: i64,
        task_id: i64,
        step: &str,
    ) -> Result<&mut TaskRec, GiteaError> {
        let t = self.tasks.get_mut(&task_id).ok_or_else(|| {
            GiteaError::status(
                GrpcCode::Internal,
                format!("{step}: task with id {task_id}: resource does not exist"),
            )
        })?;
        if t.runner_id != runner_id {
            return Err(GiteaError::status(
                GrpcCode::Internal,
                format!("{step}: invalid runner for task"),
            ));
        }
        Ok(t)
    }

    pub fn update_task(
        &mut self,
        uuid: &str,
        token: &str,
        req: &pb::UpdateTaskRequest,
    ) -> Result<(pb::TaskState, Vec<String>), GiteaError> {
        let runner_id = self.authenticate(uuid, token)?.id;
        let state = req
            .state
            .as_option()
            .ok_or_else(|| GiteaError::status(GrpcCode::InvalidArgument, "missing task state"))?;
        let task_id = state.id;
        let result = state
            .result
            .as_known()
            .unwrap_or(pb::TaskResult::RESULT_FAILURE);
        let task = self.owned_task(runner_id, task_id, "update task")?;
        if result != pb::TaskResult::RESULT_UNSPECIFIED {
            task.results_reported += 1;
        }
        let mut finish = None;
        if !task.status.is_done() {
            for s in &state.steps {
                task.steps.insert(
                    s.id,
                    StepSnapshot {
                        id: s.id,
                        result: s.result.to_i32(),
                        log_index: s.log_index,
                        log_length: s.log_length,
                        started: system_time(s.started_at.as_option()),
                        stopped: system_time(s.stopped_at.as_option()),
                    },
                );
            }
            if result == pb::TaskResult::RESULT_UNSPECIFIED {
                task.heartbeats += 1;
                task.touch();
            } else {
                // A task the user cancelled ends Cancelled whatever the runner reports.
                let end = if task.status == Status::Cancelling || task.cancel_requested {
                    Status::Cancelled
                } else {
                    status_from_result(result)
                };
                let stopped =
                    system_time(state.stopped_at.as_option()).unwrap_or_else(SystemTime::now);
                finish = Some((end, stopped));
            }
        }
        for (k, v) in &req.outputs {
            // Gitea logs and skips oversized outputs rather than failing the call.
            if k.len() > MAX_OUTPUT_KEY || v.len() > MAX_OUTPUT_VALUE {
                continue;
            }
            task.outputs.entry(k.clone()).or_insert_with(|| v.clone());
        }
        let sent_outputs: Vec<String> = task.outputs.keys().cloned().collect();
        if let Some((end, stopped)) = finish {
            self.finish_task(task_id, end, stopped);
        }
        let status = self
            .tasks
            .get(&task_id)
            .map_or(Status::Failure, |t| t.status);
        Ok((
            pb::TaskState {
                id: task_id,
                result: status.as_result().into(),
                ..Default::default()
            },
            sent_outputs,
        ))
    }

    pub fn update_log(
        &mut self,
        uuid: &str,
        token: &str,
        req: &pb::UpdateLogRequest,
    ) -> Result<i64, GiteaError> {
        let runner_id = self.authenticate(uuid, token)?.id;
        let task = self.owned_task(runner_id, req.task_id, "get task")?;
        let ack = i64::try_from(task.log_rows.len()).unwrap_or(i64::MAX);
        let len = i64::try_from(req.rows.len()).unwrap_or(i64::MAX);
        let has_new_rows = req.index <= ack && ack < req.index.saturating_add(len);
        if req.index > ack {
            // A gap: Gitea writes nothing and tells the runner where it stands.
            return Ok(ack);
        }
        if has_new_rows {
            if task.log_archived {
                return Err(GiteaError::status(
                    GrpcCode::AlreadyExists,
                    "log file has been archived",
                ));
            }
            let skip = usize::try_from(ack - req.index).unwrap_or(usize::MAX);
            task.first_log.get_or_insert_with(SystemTime::now);
            task.log_rows
                .extend(req.rows.iter().skip(skip).map(|r| r.content.clone()));
            task.touch();
        }
        if req.no_more && !task.log_archived {
            task.log_archived = true;
            task.touch();
        }
        Ok(i64::try_from(task.log_rows.len()).unwrap_or(i64::MAX))
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}
