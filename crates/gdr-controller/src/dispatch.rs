//! Dispatch: the state the workers and the facade share in one controller process.
//!
//! - Admission pools per backend (invariants 6, 7).
//! - Offered assignments, which the facade hands only to their own executor's runner
//!   (invariants 9, 15), after the claim is durable on the backend. The claim is one step
//!   that runs detached from the runner's request, so it completes or is rolled back
//!   whatever becomes of that request; until the runner has reported on its task, a
//!   repeated FetchTask gets the same task (the answer to the first may have been lost).
//! - The start deadline and the claim exclude each other ([`Dispatch::expire`]).
//!
//! Everything here is rebuildable from the backends and JetStream: after a restart,
//! [`Dispatch::restore`] re-admits live executors and re-authorises *claimed* ones from
//! backend metadata; unclaimed ones wait for their redelivered assignment (the Go
//! version restored every live executor as claimed, which locked out a runner that had
//! not fetched yet).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};

use gdr_core::assignment::{Assignment, AssignmentId};
use gdr_core::backend::Backend;
use gdr_core::capability::CapabilityKey;
use gdr_core::capacity::{Admission, Pool};
use gdr_core::executor::{ExecutorBackend, ExecutorError, ExecutorRecord};
use gdr_proto::runner::v1::Task;
use tokio::sync::watch;
use tokio::time::Instant;

pub use gdr_facade::ports::{Authorized, ClaimError, Fetched, Finished};

use crate::ports::{FinishedLog, QueueError};
use crate::shutdown::Shutdown;

/// Where an offered assignment stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClaimState {
    /// Waiting for its runner's FetchTask (also while the claim is being recorded).
    Pending,
    /// Its runner fetched the task; the claim is durable on the backend.
    Claimed,
    /// No claim came in time (or the executor failed first): the worker fails the job,
    /// and no runner can claim it any more.
    Expired,
    /// Gitea accepted a terminal result; the slot is released.
    Terminal,
}

/// How a claim write ended, as every FetchTask waiting for it learns.
#[derive(Debug, Clone)]
enum ClaimOutcome {
    /// Durable on the backend.
    Recorded(Arc<Task>),
    /// The backend did not take it; rolled back, the task stays offered.
    Failed(Arc<ExecutorError>),
    /// The assignment was forgotten meanwhile (its executor failed or was deleted).
    Forgotten,
}

struct Entry {
    backend: Backend,
    task_id: i64,
    spiffe_id: String,
    /// Kept from the offer until the runner proves it has the task (its first report), so
    /// a runner whose FetchTask answer was lost gets the same task again.
    task: Option<Arc<Task>>,
    /// The claim being recorded right now; every FetchTask of the executor waits for it.
    claiming: Option<watch::Receiver<Option<ClaimOutcome>>>,
    /// When this process handed the task out (unknown for claims restored after a restart).
    claimed_at: Option<Instant>,
    state: watch::Sender<ClaimState>,
}

/// Ends a claim write that never finished (its task was aborted, it panicked): the claim
/// is rolled back so the runner's next FetchTask can claim again.
struct ClaimInFlight<'a> {
    dispatch: &'a Dispatch,
    id: &'a AssignmentId,
    settled: bool,
}

impl Drop for ClaimInFlight<'_> {
    fn drop(&mut self) {
        if !self.settled
            && let Some(entry) = lock(&self.dispatch.entries).get_mut(self.id)
        {
            entry.claiming = None;
        }
    }
}

/// Takes an assignment out of its pool's line however its wait ends.
struct InLine<'a> {
    dispatch: &'a Dispatch,
    backend: Backend,
    id: &'a AssignmentId,
}

impl Drop for InLine<'_> {
    fn drop(&mut self) {
        if let Some(pool) = lock(&self.dispatch.pools).get_mut(&self.backend) {
            pool.stop_waiting(self.id);
        }
        // Whoever was behind this waiter may be first now.
        self.dispatch
            .pools_changed
            .send_modify(|v| *v = v.wrapping_add(1));
    }
}

/// Why the facade refuses a caller.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    /// The assignment ID is malformed or unknown to this controller.
    #[error("unknown assignment")]
    UnknownAssignment,
    /// The capability does not belong to the assignment.
    #[error("invalid capability for the assignment")]
    BadCapability,
    /// The peer's SPIFFE ID is not the assignment's.
    #[error("peer identity does not match the assignment")]
    WrongIdentity,
    /// The backend could not be asked (after a restart, before the assignment's
    /// redelivery): the caller may well be legitimate, so it should retry, not give up.
    #[error("the backend cannot be read: {0}")]
    Unavailable(#[source] Unreadable),
    /// The assignment has ended (Gitea has its result, or it was failed): its
    /// credentials open nothing any more, after a restart as before one.
    #[error("the assignment has finished")]
    Finished,
}

/// Why a look-up on the backends could not answer whether an executor may call.
#[derive(Debug, thiserror::Error)]
pub enum Unreadable {
    /// A backend could not list its executors.
    #[error("asking the {backend} backend for the executor: {source}")]
    Backend {
        /// Which backend.
        backend: Backend,
        /// Why.
        #[source]
        source: ExecutorError,
    },
    /// The finished-assignments log could not be read.
    #[error("reading the finished-assignments log: {0}")]
    FinishedLog(#[source] QueueError),
}

/// How waiting for a slot ended ([`Dispatch::admit_when_free`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Waited {
    /// The assignment holds a slot (now or already).
    Admitted,
    /// As many assignments wait already as the pool has slots: put this one back.
    LineFull,
    /// Shutdown was requested while waiting.
    Stopped,
}

/// Shared dispatch state.
pub struct Dispatch {
    backends: BTreeMap<Backend, Arc<dyn ExecutorBackend>>,
    capability_key: CapabilityKey,
    pools: Mutex<BTreeMap<Backend, Pool>>,
    /// Bumped whenever a slot may have become free.
    pools_changed: watch::Sender<u64>,
    entries: Mutex<HashMap<AssignmentId, Entry>>,
    /// When the facade last heard from each claimed assignment's runner (invariant 12: a
    /// claimed executor that falls silent is failed after the idle timeout).
    heard: Mutex<HashMap<AssignmentId, Instant>>,
    /// The assignments that finished, so a replayed envelope never runs one again
    /// (invariant 20); `None` only where no queue exists (unit tests).
    finished: Option<Arc<dyn FinishedLog>>,
    /// Definite "no" answers of the backend look-up, remembered for a while (21).
    negative: Mutex<Negative>,
}

/// How long a definite "no" of the backend look-up is remembered (invariant 21): a peer
/// repeating a finished or unknown assignment's credentials costs one look-up per
/// interval, not one per request.
const NEGATIVE_TTL: std::time::Duration = std::time::Duration::from_secs(30);
/// Assignments remembered at most: beyond, the expired ones go, then all.
const NEGATIVE_MAX: usize = 4096;

/// Why the backends said no.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refusal {
    /// No backend has an executor of the assignment.
    Unknown,
    /// Its executor is finished (terminal marker, or recorded as finished).
    Finished,
}

impl From<Refusal> for AuthError {
    fn from(r: Refusal) -> Self {
        match r {
            Refusal::Unknown => AuthError::UnknownAssignment,
            Refusal::Finished => AuthError::Finished,
        }
    }
}

/// The remembered refusals, each with when it was learnt.
#[derive(Default)]
struct Negative(HashMap<AssignmentId, (Instant, Refusal)>);

impl Negative {
    fn get(&self, id: &AssignmentId, now: Instant) -> Option<Refusal> {
        self.0
            .get(id)
            .filter(|(at, _)| now.duration_since(*at) < NEGATIVE_TTL)
            .map(|(_, r)| *r)
    }

    fn remember(&mut self, id: &AssignmentId, refusal: Refusal, now: Instant) {
        if self.0.len() >= NEGATIVE_MAX {
            self.0
                .retain(|_, (at, _)| now.duration_since(*at) < NEGATIVE_TTL);
            if self.0.len() >= NEGATIVE_MAX {
                self.0.clear();
            }
        }
        self.0.insert(id.clone(), (now, refusal));
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding these locks leaves plain data in a consistent state
    // (single-step updates), so recovering from poison is safe.
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Dispatch {
    /// Dispatch over the given backends with their capacities.
    pub fn new(
        backends: impl IntoIterator<Item = (Arc<dyn ExecutorBackend>, usize)>,
        capability_key: CapabilityKey,
    ) -> Self {
        let mut map = BTreeMap::new();
        let mut pools = BTreeMap::new();
        for (backend, capacity) in backends {
            pools.insert(backend.backend(), Pool::new(capacity));
            map.insert(backend.backend(), backend);
        }
        Dispatch {
            backends: map,
            capability_key,
            pools: Mutex::new(pools),
            pools_changed: watch::Sender::new(0),
            entries: Mutex::new(HashMap::new()),
            heard: Mutex::new(HashMap::new()),
            finished: None,
            negative: Mutex::new(Negative::default()),
        }
    }

    /// Records finished assignments in `finished` and consults it before any executor is
    /// created (DESIGN invariant 20: an assignment runs at most once, ever).
    #[must_use]
    pub fn with_finished(mut self, finished: impl FinishedLog + 'static) -> Self {
        self.finished = Some(Arc::new(finished));
        self
    }

    /// Records that `id` finished: Gitea has its result, or it was failed there. Callers
    /// record before deleting the executor that proves it.
    pub async fn record_finished(&self, id: &AssignmentId) -> Result<(), QueueError> {
        match &self.finished {
            Some(f) => f.record(id).await,
            None => Ok(()),
        }
    }

    /// Whether `id` finished before (a replay, if its envelope arrives again).
    pub async fn has_finished(&self, id: &AssignmentId) -> Result<bool, QueueError> {
        match &self.finished {
            Some(f) => f.contains(id).await,
            None => Ok(false),
        }
    }

    /// The backend adapter, if configured.
    pub fn backend(&self, backend: Backend) -> Option<Arc<dyn ExecutorBackend>> {
        self.backends.get(&backend).cloned()
    }

    /// The capability key (issuing capabilities for executor specs).
    pub fn capability_key(&self) -> &CapabilityKey {
        &self.capability_key
    }

    /// Rebuilds pools and claims from what the backends report. Returns how many
    /// executors were re-admitted and how many re-authorised as claimed.
    pub fn restore(&self, records: &[ExecutorRecord]) -> (usize, usize) {
        let mut pools = lock(&self.pools);
        let mut entries = lock(&self.entries);
        let (mut admitted, mut claimed) = (0, 0);
        let mut live: BTreeMap<Backend, Vec<AssignmentId>> = BTreeMap::new();
        for record in records.iter().filter(|r| !r.terminal) {
            let backend = record.assignment.backend();
            if pools.contains_key(&backend) {
                live.entry(backend)
                    .or_default()
                    .push(record.assignment.id().clone());
                admitted += 1;
            }
            if record.claimed {
                let (state, _) = watch::channel(ClaimState::Claimed);
                entries.insert(
                    record.assignment.id().clone(),
                    Entry {
                        backend,
                        task_id: record.assignment.task_id(),
                        spiffe_id: record.assignment.identity().spiffe_id().to_string(),
                        task: None,
                        claiming: None,
                        claimed_at: None,
                        state,
                    },
                );
                claimed += 1;
            }
        }
        for (backend, ids) in live {
            if let Some(pool) = pools.get_mut(&backend) {
                *pool = Pool::restore(pool.capacity(), ids);
            }
        }
        self.pools_changed.send_modify(|v| *v = v.wrapping_add(1));
        // Silence is counted from now for executors this process has never heard from.
        let now = Instant::now();
        let mut heard = lock(&self.heard);
        for record in records.iter().filter(|r| r.claimed && !r.terminal) {
            heard.entry(record.assignment.id().clone()).or_insert(now);
        }
        (admitted, claimed)
    }

    /// Admits an assignment into its backend's pool.
    pub fn admit(&self, backend: Backend, id: &AssignmentId) -> Admission {
        lock(&self.pools)
            .get_mut(&backend)
            .map_or(Admission::Full, |p| p.admit(id))
    }

    /// Admits an assignment, waiting in line while the pool is full: the slot a finishing
    /// executor frees goes at once to the first waiter (invariant 6), instead of staying
    /// free until a put-back delivery returns. At most `capacity` assignments wait.
    pub async fn admit_when_free(
        &self,
        backend: Backend,
        id: &AssignmentId,
        shutdown: &Shutdown,
    ) -> Waited {
        let mut changed = self.pools_changed.subscribe();
        match self.admit(backend, id) {
            Admission::Admitted | Admission::AlreadyAdmitted => return Waited::Admitted,
            Admission::Full => {}
        }
        let queued = lock(&self.pools)
            .get_mut(&backend)
            .is_some_and(|p| p.wait(id));
        if !queued {
            return Waited::LineFull;
        }
        let _in_line = InLine {
            dispatch: self,
            backend,
            id,
        };
        loop {
            changed.mark_unchanged();
            match self.admit(backend, id) {
                Admission::Admitted | Admission::AlreadyAdmitted => return Waited::Admitted,
                Admission::Full => {}
            }
            tokio::select! {
                _ = changed.changed() => {}
                _ = shutdown.wait() => return Waited::Stopped,
            }
        }
    }

    /// Releases an assignment's slot (idempotent).
    pub fn release(&self, backend: Backend, id: &AssignmentId) -> bool {
        let released = lock(&self.pools)
            .get_mut(&backend)
            .is_some_and(|p| p.release(id));
        if released {
            self.pools_changed.send_modify(|v| *v = v.wrapping_add(1));
        }
        released
    }

    /// `(in use, capacity)` of a backend's pool.
    pub fn pool_usage(&self, backend: Backend) -> (usize, usize) {
        lock(&self.pools)
            .get(&backend)
            .map_or((0, 0), |p| (p.in_use(), p.capacity()))
    }

    /// Assignments waiting for a slot of a backend's pool.
    pub fn waiting(&self, backend: Backend) -> usize {
        lock(&self.pools).get(&backend).map_or(0, Pool::waiting)
    }

    /// Offers an assignment to its runner. Idempotent: a redelivered assignment keeps
    /// its state (a claimed one stays claimed). The watch reports the claim.
    pub fn offer(&self, assignment: &Assignment) -> watch::Receiver<ClaimState> {
        let mut entries = lock(&self.entries);
        let entry = entries.entry(assignment.id().clone()).or_insert_with(|| {
            let (state, _) = watch::channel(ClaimState::Pending);
            Entry {
                backend: assignment.backend(),
                task_id: assignment.id().task_id(),
                spiffe_id: assignment.identity().spiffe_id().to_string(),
                task: Some(Arc::new(assignment.task().clone())),
                claiming: None,
                claimed_at: None,
                state,
            }
        });
        entry.state.subscribe()
    }

    /// The claim state of an assignment, if offered or restored.
    pub fn claim_state(&self, id: &AssignmentId) -> Option<ClaimState> {
        lock(&self.entries).get(id).map(|e| *e.state.borrow())
    }

    /// The capability is checked first and in constant time, so an unknown ID and a
    /// wrong token are indistinguishable by timing to someone without the key.
    fn verified_id(
        &self,
        assignment_id: &str,
        capability: &str,
    ) -> Result<AssignmentId, AuthError> {
        if !self.capability_key.verify(assignment_id, capability) {
            return Err(AuthError::BadCapability);
        }
        AssignmentId::parse(assignment_id).map_err(|_| AuthError::UnknownAssignment)
    }

    /// Checks the facade caller: assignment ID (runner UUID), capability (runner
    /// token) and the mTLS peer's SPIFFE ID must all belong to one known assignment.
    pub fn authorize(
        &self,
        assignment_id: &str,
        capability: &str,
        peer_spiffe_id: &str,
    ) -> Result<Authorized, AuthError> {
        let id = self.verified_id(assignment_id, capability)?;
        let entries = lock(&self.entries);
        let entry = entries.get(&id).ok_or(AuthError::UnknownAssignment)?;
        if entry.spiffe_id != peer_spiffe_id {
            return Err(AuthError::WrongIdentity);
        }
        Ok(Authorized {
            id,
            task_id: entry.task_id,
            backend: entry.backend,
        })
    }

    /// Authenticates a runner whose assignment is not offered in this process (yet): the
    /// controller restarted and the assignment waits for redelivery. The capability
    /// proves we issued it; the backend's metadata says which workload may use it. A
    /// definite "no" (no executor, or a finished one) is remembered for `NEGATIVE_TTL` (30 s),
    /// so repeated requests do not each cost a look-up.
    pub async fn authorize_from_backend(
        &self,
        assignment_id: &str,
        capability: &str,
        peer_spiffe_id: &str,
    ) -> Result<Authorized, AuthError> {
        let id = self.verified_id(assignment_id, capability)?;
        if let Some(refusal) = lock(&self.negative).get(&id, Instant::now()) {
            return Err(refusal.into());
        }
        let found = self.look_up(&id, peer_spiffe_id).await;
        let refusal = match &found {
            Err(AuthError::UnknownAssignment) => Some(Refusal::Unknown),
            Err(AuthError::Finished) => Some(Refusal::Finished),
            _ => None,
        };
        if let Some(refusal) = refusal {
            lock(&self.negative).remember(&id, refusal, Instant::now());
        }
        found
    }

    /// Whether a connection may be bound to `assignment_id` (invariant 21): not once its
    /// start deadline expired it, nor once it finished (here, or as the backend look-up
    /// found), nor when no backend has it.
    pub fn may_bind(&self, assignment_id: &str) -> bool {
        let Ok(id) = AssignmentId::parse(assignment_id) else {
            return false;
        };
        match self.claim_state(&id) {
            Some(ClaimState::Expired | ClaimState::Terminal) => false,
            Some(ClaimState::Pending | ClaimState::Claimed) => true,
            None => lock(&self.negative).get(&id, Instant::now()).is_none(),
        }
    }

    /// Asks each backend for the executor of `id`.
    async fn look_up(
        &self,
        id: &AssignmentId,
        peer_spiffe_id: &str,
    ) -> Result<Authorized, AuthError> {
        let id = id.clone();
        let mut unavailable = None;
        for backend in self.backends.values() {
            match backend.find(&id).await {
                Ok(Some(record)) => {
                    if record.assignment.identity().spiffe_id() != peer_spiffe_id {
                        return Err(AuthError::WrongIdentity);
                    }
                    // The terminal marker is durable (invariant 10): a restarted controller
                    // must not reopen the pass-through to an executor whose result Gitea has.
                    if record.terminal || record.phase.is_finished() {
                        return Err(AuthError::Finished);
                    }
                    // A job failed before its claim is recorded as finished before Gitea
                    // hears of it, while its executor may outlive a failed clean-up.
                    match self.has_finished(&id).await {
                        Ok(false) => {}
                        Ok(true) => return Err(AuthError::Finished),
                        Err(e) => return Err(AuthError::Unavailable(Unreadable::FinishedLog(e))),
                    }
                    return Ok(Authorized {
                        id,
                        task_id: record.assignment.task_id(),
                        backend: backend.backend(),
                    });
                }
                Ok(None) => {}
                Err(source) => {
                    unavailable = Some(Unreadable::Backend {
                        backend: backend.backend(),
                        source,
                    });
                }
            }
        }
        // The capability is ours; if a backend could not answer, the executor may be in it.
        Err(unavailable.map_or(AuthError::UnknownAssignment, AuthError::Unavailable))
    }

    /// Hands the pre-assigned task to its runner once the claim is durable on the backend.
    ///
    /// The claim write runs detached from the caller, so it completes (the state turns
    /// `Claimed`, the worker is told) or is rolled back (the task stays offered) whatever
    /// becomes of the caller: a FetchTask dropped at the runner's deadline or by a
    /// disconnect leaves no half-done claim. A FetchTask that arrives while the claim is
    /// written waits for the same write; one that arrives after it gets the same task
    /// until the runner reports on it ([`Dispatch::received`]).
    pub async fn take_task(self: &Arc<Self>, auth: &Authorized) -> Result<Fetched, ClaimError> {
        let mut outcome = {
            let mut entries = lock(&self.entries);
            let Some(entry) = entries.get_mut(&auth.id) else {
                return Ok(Fetched::Nothing);
            };
            let state = *entry.state.borrow();
            match state {
                ClaimState::Pending => {}
                ClaimState::Expired => return Ok(Fetched::Nothing),
                ClaimState::Claimed | ClaimState::Terminal => {
                    return Ok(match &entry.task {
                        Some(task) => {
                            tracing::info!(assignment_id = %auth.id, "the runner fetched its task again before reporting on it (the answer to its first FetchTask was lost); handing it the same task");
                            Fetched::Task(Box::new(Task::clone(task)))
                        }
                        None => Fetched::HandedOut,
                    });
                }
            }
            match &entry.claiming {
                Some(in_flight) => in_flight.clone(),
                None => {
                    let Some(task) = entry.task.clone() else {
                        return Ok(Fetched::Nothing);
                    };
                    let backend = self
                        .backend(auth.backend)
                        .ok_or(ClaimError::NoBackend(auth.backend))?;
                    let (done, outcome) = watch::channel(None);
                    entry.claiming = Some(outcome.clone());
                    tokio::spawn(Arc::clone(self).record_claim(
                        auth.id.clone(),
                        backend,
                        task,
                        done,
                    ));
                    outcome
                }
            }
        };
        let settled = outcome
            .wait_for(Option::is_some)
            .await
            .ok()
            .and_then(|o| o.clone());
        match settled {
            Some(ClaimOutcome::Recorded(task)) => Ok(Fetched::Task(Box::new(Task::clone(&task)))),
            Some(ClaimOutcome::Failed(e)) => Err(ClaimError::Backend(e)),
            Some(ClaimOutcome::Forgotten) => Ok(Fetched::Nothing),
            None => Err(ClaimError::Interrupted),
        }
    }

    /// The detached claim write of [`Dispatch::take_task`]; `done` tells every waiting
    /// FetchTask how it ended.
    async fn record_claim(
        self: Arc<Self>,
        id: AssignmentId,
        backend: Arc<dyn ExecutorBackend>,
        task: Arc<Task>,
        done: watch::Sender<Option<ClaimOutcome>>,
    ) {
        let mut in_flight = ClaimInFlight {
            dispatch: &self,
            id: &id,
            settled: false,
        };
        let recorded = backend.record_claimed(&id).await;
        in_flight.settled = true;
        let outcome = {
            let mut entries = lock(&self.entries);
            match entries.get_mut(&id) {
                None => ClaimOutcome::Forgotten,
                Some(entry) => {
                    entry.claiming = None;
                    match recorded {
                        Ok(()) => {
                            crate::failpoint::hit(crate::failpoint::points::AFTER_CLAIM);
                            let now = Instant::now();
                            lock(&self.heard).insert(id.clone(), now);
                            entry.claimed_at = Some(now);
                            entry.state.send_replace(ClaimState::Claimed);
                            tracing::info!(assignment_id = %id, event = "claimed", backend = %entry.backend, task_id = entry.task_id, "task claimed by its executor");
                            ClaimOutcome::Recorded(task)
                        }
                        Err(e) => {
                            tracing::warn!(assignment_id = %id, error = %e, "recording the claim failed; the task stays with the controller and the runner's next FetchTask claims it");
                            ClaimOutcome::Failed(Arc::new(e))
                        }
                    }
                }
            }
        };
        done.send_replace(Some(outcome));
    }

    /// The runner reported on its task (an UpdateTask or UpdateLog naming it), so it has
    /// the task: its bytes leave memory, and a further FetchTask is refused.
    pub fn received(&self, id: &AssignmentId) {
        if let Some(entry) = lock(&self.entries).get_mut(id)
            && *entry.state.borrow() == ClaimState::Claimed
        {
            entry.task = None;
        }
    }

    /// Ends the wait for a claim before failing the job (its start deadline passed or its
    /// executor failed): from now on no runner can claim it. Refused (`false`) while a
    /// claim is being recorded or once one was: the runner has the job then, and failing it
    /// in Gitea would end a job that runs. The worker fails the job only if this succeeds.
    pub fn expire(&self, id: &AssignmentId) -> bool {
        let mut entries = lock(&self.entries);
        // Not offered here: nothing in this process can claim it.
        let Some(entry) = entries.get_mut(id) else {
            return true;
        };
        if entry.claiming.is_some() {
            return false;
        }
        let state = *entry.state.borrow();
        match state {
            ClaimState::Pending => {
                entry.task = None;
                entry.state.send_replace(ClaimState::Expired);
                true
            }
            ClaimState::Expired => true,
            ClaimState::Claimed | ClaimState::Terminal => false,
        }
    }

    /// Marks the task terminal on the backend and releases its slot. Called by the
    /// facade after Gitea accepted a terminal result and before answering the runner;
    /// again for every repeated final report (the marker is idempotent), but only the
    /// first call that ends the assignment says so.
    pub async fn finish(&self, auth: &Authorized) -> Result<Finished, ClaimError> {
        let backend = self
            .backend(auth.backend)
            .ok_or(ClaimError::NoBackend(auth.backend))?;
        backend.mark_terminal(&auth.id).await?;
        crate::failpoint::hit(crate::failpoint::points::AFTER_TERMINAL_MARKER);
        // The terminal marker already prevents a second run while the executor exists;
        // the record outlives it. The lifecycle reconciler records again (and must
        // succeed) before it deletes the executor, so a failure here costs nothing.
        if let Err(e) = self.record_finished(&auth.id).await {
            tracing::warn!(assignment_id = %auth.id, error = %e, "recording the finished assignment failed; the lifecycle reconciler records it before clean-up");
        }
        self.release(auth.backend, &auth.id);
        lock(&self.heard).remove(&auth.id);
        let mut finished = Finished {
            first: false,
            ran: None,
        };
        if let Some(entry) = lock(&self.entries).get_mut(&auth.id) {
            entry.task = None;
            finished.ran = entry.claimed_at.take().map(|at| at.elapsed());
            finished.first = entry.state.send_replace(ClaimState::Terminal) != ClaimState::Terminal;
        }
        Ok(finished)
    }

    /// Forgets an assignment whose executor was deleted or failed.
    pub fn forget(&self, backend: Backend, id: &AssignmentId) {
        self.release(backend, id);
        lock(&self.heard).remove(id);
        if let Some(entry) = lock(&self.entries).remove(id) {
            entry.state.send_replace(ClaimState::Terminal);
        }
    }

    /// The assignments of `backend` whose runner claimed its task and that have no
    /// terminal result yet (their executor must exist until they do).
    pub fn claimed(&self, backend: Backend) -> Vec<AssignmentId> {
        lock(&self.entries)
            .iter()
            .filter(|(_, e)| e.backend == backend && *e.state.borrow() == ClaimState::Claimed)
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// The assignments of `backend` whose result Gitea accepted and whose executor the
    /// lifecycle has not deleted yet.
    pub fn terminal(&self, backend: Backend) -> Vec<AssignmentId> {
        lock(&self.entries)
            .iter()
            .filter(|(_, e)| e.backend == backend && *e.state.borrow() == ClaimState::Terminal)
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// The facade heard from `id`'s runner just now.
    pub fn heard_from(&self, id: &AssignmentId) {
        lock(&self.heard).insert(id.clone(), Instant::now());
    }

    /// How long the facade has not heard from `id`'s runner; `None` if it never did (and
    /// the executor was not restored as claimed).
    pub fn silence(&self, id: &AssignmentId) -> Option<std::time::Duration> {
        lock(&self.heard).get(id).map(Instant::elapsed)
    }
}

#[cfg(test)]
mod tests {
    use gdr_core::executor::ExecutorSpec;
    use gdr_core::metadata::MetadataCodec;
    use gdr_testkit::memory_backend::{Failure, MemoryBackend};
    use gdr_testkit::tasks::assignment;

    use super::*;

    const KEY: &[u8] = b"0123456789abcdef0123456789abcdef";

    fn dispatch(backend: &Arc<MemoryBackend>, capacity: usize) -> Arc<Dispatch> {
        Arc::new(Dispatch::new(
            [(backend.clone() as Arc<dyn ExecutorBackend>, capacity)],
            CapabilityKey::new(KEY).unwrap(),
        ))
    }

    /// The task ID a FetchTask got, if it got a task.
    fn task_id(fetched: Result<Fetched, ClaimError>) -> Option<i64> {
        match fetched.unwrap() {
            Fetched::Task(task) => Some(task.id),
            Fetched::Nothing | Fetched::HandedOut => None,
        }
    }

    fn credentials(d: &Dispatch, a: &Assignment) -> (String, String, String) {
        (
            a.id().to_string(),
            d.capability_key().issue(a.id()).expose().to_owned(),
            a.identity().spiffe_id().to_owned(),
        )
    }

    async fn executor(backend: &MemoryBackend, d: &Dispatch, a: &Assignment) {
        let spec = ExecutorSpec::new(
            a,
            d.capability_key().issue(a.id()),
            &MetadataCodec::default(),
            "https://facade",
            "spiffe://example.org/controller",
            "pod",
        );
        backend.create(&spec).await.unwrap();
    }

    /// DESIGN invariant 15: the task is handed out once, and only after the claim is
    /// durable on the backend; a failed claim record puts it back for the runner's retry.
    #[tokio::test]
    async fn the_task_is_handed_out_once_and_only_after_the_claim_is_durable() {
        let backend = Arc::new(MemoryBackend::new(Backend::Pod));
        let d = dispatch(&backend, 1);
        let a = assignment(7, "[self-hosted, pod]");
        executor(&backend, &d, &a).await;
        d.offer(&a);
        let (id, cap, peer) = credentials(&d, &a);
        let auth = d.authorize(&id, &cap, &peer).unwrap();
        backend.set_failing(Some(Failure::Unavailable));
        assert!(matches!(
            d.take_task(&auth).await,
            Err(ClaimError::Backend(_))
        ));
        assert_eq!(d.claim_state(a.id()), Some(ClaimState::Pending));
        backend.set_failing(None);
        assert_eq!(task_id(d.take_task(&auth).await), Some(7));
        assert!(backend.records()[0].claimed);
        assert_eq!(d.claim_state(a.id()), Some(ClaimState::Claimed));
    }

    /// DESIGN invariant 15 (issue 23): until its runner has reported on the task, a
    /// FetchTask of the same executor gets the same task again (the answer to the first
    /// was lost); once the runner reported, its bytes leave memory and it is never
    /// handed out again.
    #[tokio::test]
    async fn the_task_is_handed_out_again_until_its_runner_reports_on_it_then_never() {
        let backend = Arc::new(MemoryBackend::new(Backend::Pod));
        let d = dispatch(&backend, 1);
        let a = assignment(7, "[self-hosted, pod]");
        executor(&backend, &d, &a).await;
        d.offer(&a);
        let (id, cap, peer) = credentials(&d, &a);
        let auth = d.authorize(&id, &cap, &peer).unwrap();
        assert_eq!(task_id(d.take_task(&auth).await), Some(7));
        assert_eq!(
            task_id(d.take_task(&auth).await),
            Some(7),
            "a repeated FetchTask before any report gets the task again"
        );
        assert_eq!(backend.claim_calls(), 1, "the claim was written once");
        d.received(a.id());
        assert_eq!(
            d.take_task(&auth).await.unwrap(),
            Fetched::HandedOut,
            "handed out again after the runner reported on it"
        );
        assert_eq!(d.claim_state(a.id()), Some(ClaimState::Claimed));
    }

    /// DESIGN invariant 12 (issue 23): the start deadline and the claim exclude each
    /// other. While a claim is being written, and once it is durable, the job cannot be
    /// expired (the worker does not fail it); once expired, no runner can claim it.
    #[tokio::test]
    async fn a_start_deadline_and_a_claim_exclude_each_other_whichever_comes_first() {
        let backend = Arc::new(MemoryBackend::new(Backend::Pod));
        let d = dispatch(&backend, 2);
        let claimed = assignment(7, "[self-hosted, pod]");
        let late = assignment(8, "[self-hosted, pod]");
        for a in [&claimed, &late] {
            executor(&backend, &d, a).await;
            d.offer(a);
        }

        let (id, cap, peer) = credentials(&d, &claimed);
        let auth = d.authorize(&id, &cap, &peer).unwrap();
        backend.hold_claims();
        let claim = {
            let (d, auth) = (d.clone(), auth.clone());
            tokio::spawn(async move { d.take_task(&auth).await })
        };
        claims_waiting(&backend, 1).await;
        assert!(
            !d.expire(claimed.id()),
            "expired while the claim is written"
        );
        backend.release_claims();
        assert_eq!(task_id(claim.await.unwrap()), Some(7));
        assert!(!d.expire(claimed.id()), "expired once claimed");
        assert_eq!(d.claim_state(claimed.id()), Some(ClaimState::Claimed));

        let (id, cap, peer) = credentials(&d, &late);
        let auth = d.authorize(&id, &cap, &peer).unwrap();
        assert!(d.expire(late.id()));
        assert!(d.expire(late.id()), "expiring again is harmless");
        assert_eq!(d.take_task(&auth).await.unwrap(), Fetched::Nothing);
        assert_eq!(d.claim_state(late.id()), Some(ClaimState::Expired));
        assert_eq!(
            backend.claim_calls(),
            1,
            "no claim was written for the late job"
        );
    }

    /// DESIGN invariant 10 (issue 23): only the first `finish` of an assignment ends it;
    /// repeated final reports mark it again (idempotent) but say they were not first.
    #[tokio::test]
    async fn only_the_first_finish_of_an_assignment_says_it_ended_it() {
        let backend = Arc::new(MemoryBackend::new(Backend::Pod));
        let d = dispatch(&backend, 1);
        let a = assignment(7, "[self-hosted, pod]");
        executor(&backend, &d, &a).await;
        d.admit(Backend::Pod, a.id());
        d.offer(&a);
        let (id, cap, peer) = credentials(&d, &a);
        let auth = d.authorize(&id, &cap, &peer).unwrap();
        assert_eq!(task_id(d.take_task(&auth).await), Some(7));
        let first = d.finish(&auth).await.unwrap();
        assert!(first.first && first.ran.is_some(), "{first:?}");
        let again = d.finish(&auth).await.unwrap();
        assert!(!again.first && again.ran.is_none(), "{again:?}");
        assert_eq!(d.claim_state(a.id()), Some(ClaimState::Terminal));
    }

    /// Waits until `n` claim writes wait at `backend`'s gate.
    async fn claims_waiting(backend: &MemoryBackend, n: usize) {
        gdr_testkit::until_sync(
            std::time::Duration::from_secs(10),
            "the claim write to wait at the backend",
            || backend.claims_waiting() == n,
        )
        .await;
    }

    /// DESIGN invariant 9 (issue 23): a FetchTask whose caller gives up while the claim is
    /// being written (the runner's 5 s deadline, a disconnect) leaves neither a claim that
    /// nobody can fetch nor a task that was taken out of memory: the write completes, a
    /// concurrent FetchTask joins it, and the runner's retry gets the same task; the claim
    /// is written once.
    #[tokio::test]
    async fn a_claim_whose_caller_gives_up_mid_write_completes_and_the_retry_gets_the_same_task() {
        let backend = Arc::new(MemoryBackend::new(Backend::Pod));
        let d = dispatch(&backend, 1);
        let a = assignment(7, "[self-hosted, pod]");
        executor(&backend, &d, &a).await;
        d.offer(&a);
        let (id, cap, peer) = credentials(&d, &a);
        let auth = d.authorize(&id, &cap, &peer).unwrap();
        backend.hold_claims();
        tokio::select! {
            _ = d.take_task(&auth) => panic!("the claim write is held"),
            () = claims_waiting(&backend, 1) => {}
        }
        // The caller is gone; a concurrent FetchTask of the same executor arrives.
        let joined = {
            let (d, auth) = (d.clone(), auth.clone());
            tokio::spawn(async move { d.take_task(&auth).await })
        };
        backend.release_claims();
        assert_eq!(
            task_id(joined.await.unwrap()),
            Some(7),
            "the joiner gets the task"
        );
        assert_eq!(
            task_id(d.take_task(&auth).await),
            Some(7),
            "the retry gets the same task"
        );
        assert!(backend.records()[0].claimed, "the claim is durable");
        assert_eq!(d.claim_state(a.id()), Some(ClaimState::Claimed));
        assert_eq!(backend.claim_calls(), 1, "the claim was written once");
    }

    /// DESIGN invariant 9 (issue 23): a claim write that fails after its caller gave up is
    /// rolled back, so the runner's next FetchTask claims the task.
    #[tokio::test]
    async fn a_claim_write_that_fails_after_its_caller_gave_up_is_rolled_back_and_the_retry_claims()
    {
        let backend = Arc::new(MemoryBackend::new(Backend::Pod));
        let d = dispatch(&backend, 1);
        let a = assignment(7, "[self-hosted, pod]");
        executor(&backend, &d, &a).await;
        d.offer(&a);
        let (id, cap, peer) = credentials(&d, &a);
        let auth = d.authorize(&id, &cap, &peer).unwrap();
        backend.hold_claims();
        tokio::select! {
            _ = d.take_task(&auth) => panic!("the claim write is held"),
            () = claims_waiting(&backend, 1) => {}
        }
        backend.set_failing(Some(Failure::Unavailable));
        backend.release_claims();
        // Joins the failing write or starts one of its own: either fails, and says so.
        assert!(
            matches!(d.take_task(&auth).await, Err(ClaimError::Backend(_))),
            "a failed claim is reported to the runner, which retries"
        );
        assert_eq!(d.claim_state(a.id()), Some(ClaimState::Pending));
        backend.set_failing(None);
        assert_eq!(task_id(d.take_task(&auth).await), Some(7));
        assert!(backend.records()[0].claimed);
        assert_eq!(d.claim_state(a.id()), Some(ClaimState::Claimed));
    }

    /// DESIGN invariant 15: every credential must belong to one assignment.
    #[tokio::test]
    async fn a_wrong_capability_or_peer_identity_is_refused() {
        let backend = Arc::new(MemoryBackend::new(Backend::Pod));
        let d = dispatch(&backend, 1);
        let a = assignment(7, "[self-hosted, pod]");
        let b = Assignment::from_task(
            gdr_testkit::tasks::task(8, "other/repo", "deploy", "[self-hosted, pod]"),
            &gdr_testkit::tasks::policy(),
        )
        .unwrap();
        d.offer(&a);
        let (id, cap, peer) = credentials(&d, &a);
        let (_, other_cap, other_peer) = credentials(&d, &b);
        assert!(matches!(
            d.authorize(&id, &other_cap, &peer),
            Err(AuthError::BadCapability)
        ));
        assert!(matches!(
            d.authorize(&id, &cap, &other_peer),
            Err(AuthError::WrongIdentity)
        ));
        assert!(d.authorize(&id, &cap, &peer).is_ok());
    }

    /// Defect (issue 8): a backend error while checking a runner after a restart was
    /// answered "unregistered runner", so a healthy runner exited and its job failed. It is
    /// answered "unavailable" now, so the runner retries.
    #[tokio::test]
    async fn a_backend_that_cannot_be_read_makes_the_runner_retry_instead_of_giving_up() {
        let backend = Arc::new(MemoryBackend::new(Backend::Pod));
        let d = dispatch(&backend, 1);
        let a = assignment(7, "[self-hosted, pod]");
        executor(&backend, &d, &a).await;
        let (id, cap, peer) = credentials(&d, &a);
        backend.set_failing(Some(Failure::Unavailable));
        let refused = d
            .authorize_from_backend(&id, &cap, &peer)
            .await
            .unwrap_err();
        // The cause is kept (issue 41 item 3), so the facade's log line names it.
        let cause = std::error::Error::source(&refused).expect("the look-up's cause");
        assert!(
            matches!(
                cause.downcast_ref::<Unreadable>(),
                Some(Unreadable::Backend {
                    backend: Backend::Pod,
                    source: ExecutorError::Unavailable(_),
                })
            ),
            "{refused:?}"
        );
        backend.set_failing(None);
        assert!(d.authorize_from_backend(&id, &cap, &peer).await.is_ok());
        let stranger = assignment(9, "[self-hosted, pod]");
        let (id, cap, peer) = credentials(&d, &stranger);
        assert!(matches!(
            d.authorize_from_backend(&id, &cap, &peer).await,
            Err(AuthError::UnknownAssignment)
        ));
    }

    /// DESIGN invariant 10: the terminal marker outlives the controller. A restarted controller
    /// that was never offered the assignment finds the executor on the backend, but its
    /// credentials must open nothing once the backend records the assignment as finished.
    #[tokio::test]
    async fn a_restarted_controller_refuses_the_executor_of_a_finished_assignment() {
        let backend = Arc::new(MemoryBackend::new(Backend::Pod));
        let before = dispatch(&backend, 1);
        let a = assignment(7, "[self-hosted, pod]");
        executor(&backend, &before, &a).await;
        let (id, cap, peer) = credentials(&before, &a);
        backend.record_claimed(a.id()).await.unwrap();
        backend.mark_terminal(a.id()).await.unwrap();

        let after = dispatch(&backend, 1);
        assert!(matches!(
            after.authorize_from_backend(&id, &cap, &peer).await,
            Err(AuthError::Finished)
        ));
    }

    /// DESIGN invariant 7: pools are restored from backend metadata; claimed executors are
    /// re-authorised as claimed, unclaimed ones wait for their redelivery.
    #[tokio::test]
    async fn a_restart_restores_slots_from_live_executors_and_claims_only_from_claimed_ones() {
        let backend = Arc::new(MemoryBackend::new(Backend::Pod));
        let before = dispatch(&backend, 2);
        let claimed = assignment(7, "[self-hosted, pod]");
        let waiting = assignment(8, "[self-hosted, pod]");
        let done = assignment(9, "[self-hosted, pod]");
        for a in [&claimed, &waiting, &done] {
            executor(&backend, &before, a).await;
        }
        backend.record_claimed(claimed.id()).await.unwrap();
        backend.mark_terminal(done.id()).await.unwrap();

        let after = dispatch(&backend, 2);
        assert_eq!(after.restore(&backend.records()), (2, 1));
        assert_eq!(after.pool_usage(Backend::Pod), (2, 2));
        assert_eq!(after.claim_state(claimed.id()), Some(ClaimState::Claimed));
        assert_eq!(after.claim_state(waiting.id()), None);
        assert!(
            after.silence(claimed.id()).is_some(),
            "silence counts from the restart"
        );
    }

    /// DESIGN invariant 12: silence is measured from the last call the facade heard.
    #[tokio::test(start_paused = true)]
    async fn silence_grows_until_the_runner_is_heard_from_again() {
        let backend = Arc::new(MemoryBackend::new(Backend::Pod));
        let d = dispatch(&backend, 1);
        let a = assignment(7, "[self-hosted, pod]");
        assert_eq!(d.silence(a.id()), None);
        d.heard_from(a.id());
        tokio::time::advance(std::time::Duration::from_secs(90)).await;
        assert!(d.silence(a.id()).unwrap() >= std::time::Duration::from_secs(90));
        d.heard_from(a.id());
        assert!(d.silence(a.id()).unwrap() < std::time::Duration::from_secs(1));
        d.forget(Backend::Pod, a.id());
        assert_eq!(d.silence(a.id()), None);
    }
}
