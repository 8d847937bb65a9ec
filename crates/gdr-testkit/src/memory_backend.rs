//! An in-memory executor backend: a stand-in for Kubernetes/OpenSandbox that follows the
//! trait's contract (idempotent, keyed by assignment ID) and lets tests inject failures and
//! end executors. [`MemoryBackend::reopen`] gives a second instance over the same store, as
//! a restarted controller sees the same cluster.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use gdr_core::assignment::AssignmentId;
use gdr_core::backend::Backend;
use gdr_core::executor::{
    Binding, ExecutorBackend, ExecutorError, ExecutorRecord, ExecutorSpec, IdentityTarget, Phase,
};

/// A failure the backend answers every call with, until cleared.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// [`ExecutorError::Full`] with this retry hint.
    Full(Option<Duration>),
    /// [`ExecutorError::Unavailable`].
    Unavailable,
    /// [`ExecutorError::Permanent`].
    Permanent,
}

/// The cause injected failures carry.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Injected(pub String);

impl Failure {
    fn error(&self) -> ExecutorError {
        match self {
            Failure::Full(retry_after) => ExecutorError::Full {
                retry_after: *retry_after,
                source: Box::new(Injected("injected: pool full".into())),
            },
            Failure::Unavailable => {
                ExecutorError::unavailable(Injected("injected: backend unavailable".into()))
            }
            Failure::Permanent => {
                ExecutorError::permanent(Injected("injected: backend refused".into()))
            }
        }
    }
}

#[derive(Default)]
struct State {
    executors: BTreeMap<AssignmentId, ExecutorRecord>,
    specs: BTreeMap<AssignmentId, ExecutorSpec>,
    created: usize,
    deleted: usize,
    failing: Option<Failure>,
    /// Failures for `create` only (the other calls keep working).
    failing_create: Option<Failure>,
    /// Failures `create` answers after it stored the executor (a create call that timed
    /// out or whose answer was lost although the object was written).
    failing_after_create: Option<Failure>,
    /// How long `create` takes (a VM that boots).
    create_delay: Duration,
    /// Calls of `create`, including ones for an executor that exists already.
    create_calls: usize,
    /// Calls of `find`.
    find_calls: usize,
    delete_calls: usize,
    /// Assignments whose `delete` fails.
    failing_deletes: std::collections::BTreeSet<AssignmentId>,
    /// Assignments whose `mark_terminal` fails.
    failing_marks: std::collections::BTreeSet<AssignmentId>,
    not_ready_binds: usize,
    /// Warm members claimed by a job: standby ID → the assignment whose executor the
    /// claim made of it.
    standbys: BTreeMap<String, AssignmentId>,
    /// Calls of `claimed_standby`.
    standby_calls: usize,
}

/// Holds `record_claimed` back, as a slow Pod PATCH or sandbox metadata write would.
struct ClaimGate {
    held: tokio::sync::watch::Sender<bool>,
    /// Calls waiting at the gate right now (a dropped call leaves).
    waiting: AtomicUsize,
    /// Calls of `record_claimed` so far.
    calls: AtomicUsize,
}

/// Counts a call waiting at the gate for as long as it waits, however it ends.
struct AtGate<'a>(&'a AtomicUsize);

impl Drop for AtGate<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// In-memory executors of one backend kind.
pub struct MemoryBackend {
    backend: Backend,
    state: Arc<Mutex<State>>,
    claims: Arc<ClaimGate>,
}

impl MemoryBackend {
    /// An empty backend.
    pub fn new(backend: Backend) -> Self {
        MemoryBackend {
            backend,
            state: Arc::new(Mutex::new(State::default())),
            claims: Arc::new(ClaimGate {
                held: tokio::sync::watch::Sender::new(false),
                waiting: AtomicUsize::new(0),
                calls: AtomicUsize::new(0),
            }),
        }
    }

    /// A new instance over the same executors (a controller restart).
    pub fn reopen(&self) -> Self {
        MemoryBackend {
            backend: self.backend,
            state: Arc::clone(&self.state),
            claims: Arc::clone(&self.claims),
        }
    }

    /// `record_claimed` waits from now on until [`MemoryBackend::release_claims`]; an
    /// injected failure ([`MemoryBackend::set_failing`]) is looked at after the wait, so a
    /// write can be made to fail after its caller gave up.
    pub fn hold_claims(&self) {
        self.claims.held.send_replace(true);
    }

    /// Lets held and later `record_claimed` calls through.
    pub fn release_claims(&self) {
        self.claims.held.send_replace(false);
    }

    /// `record_claimed` calls waiting at the gate right now.
    pub fn claims_waiting(&self) -> usize {
        self.claims.waiting.load(Ordering::SeqCst)
    }

    /// Calls of `record_claimed` so far, finished or not.
    pub fn claim_calls(&self) -> usize {
        self.claims.calls.load(Ordering::SeqCst)
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Every operation fails with `failure` until cleared with `None`.
    pub fn set_failing(&self, failure: Option<Failure>) {
        self.state().failing = failure;
    }

    /// `create` takes `delay` before it answers (OpenSandbox blocks until the VM runs).
    pub fn set_create_delay(&self, delay: Duration) {
        self.state().create_delay = delay;
    }

    /// `delete` of `id` fails (Unavailable) until [`MemoryBackend::heal_delete`].
    pub fn fail_deletes_of(&self, id: &AssignmentId) {
        self.state().failing_deletes.insert(id.clone());
    }

    /// `mark_terminal` of `id` fails (Unavailable) until [`MemoryBackend::heal_marks`].
    pub fn fail_marks_of(&self, id: &AssignmentId) {
        self.state().failing_marks.insert(id.clone());
    }

    /// `mark_terminal` of `id` works again.
    pub fn heal_marks(&self, id: &AssignmentId) {
        self.state().failing_marks.remove(id);
    }

    /// `delete` of `id` works again.
    pub fn heal_delete(&self, id: &AssignmentId) {
        self.state().failing_deletes.remove(id);
    }

    /// Puts an executor on record as if created at `created_at` (a previous controller
    /// created it before a restart).
    pub fn insert(&self, spec: &ExecutorSpec, created_at: SystemTime) {
        let mut state = self.state();
        let id = spec.assignment.id().clone();
        let record = self.record(spec, created_at);
        state.created += 1;
        state.specs.insert(id.clone(), spec.clone());
        state.executors.insert(id, record);
    }

    fn record(&self, spec: &ExecutorSpec, created_at: SystemTime) -> ExecutorRecord {
        let id = spec.assignment.id();
        ExecutorRecord {
            name: format!("{}-{}", self.backend, id),
            assignment: spec.assignment.clone(),
            phase: Phase::Starting { reason: None },
            claimed: false,
            terminal: false,
            identity_bound: false,
            identity_target: Some(IdentityTarget::PodUid(format!("uid-{id}"))),
            created_at,
        }
    }

    /// `create` fails with `failure` until cleared with `None`.
    pub fn set_failing_create(&self, failure: Option<Failure>) {
        self.state().failing_create = failure;
    }

    /// `create` stores the executor and then fails with `failure` (until cleared with
    /// `None`): the API server wrote the object, the caller got an error.
    pub fn set_failing_after_create(&self, failure: Option<Failure>) {
        self.state().failing_after_create = failure;
    }

    /// The next `n` identity bindings answer not-ready.
    pub fn set_not_ready_binds(&self, n: usize) {
        self.state().not_ready_binds = n;
    }

    /// Current executors.
    pub fn records(&self) -> Vec<ExecutorRecord> {
        self.state().executors.values().cloned().collect()
    }

    /// The spec an executor was created from (the environment it would get).
    pub fn spec(&self, id: &AssignmentId) -> Option<ExecutorSpec> {
        self.state().specs.get(id).cloned()
    }

    /// Executors created so far (each assignment counts once).
    pub fn created(&self) -> usize {
        self.state().created
    }

    /// Calls of `create` so far. A real backend whose create blocks (OpenSandbox) would
    /// start a second environment for each overlapping call, so tests count calls.
    pub fn create_calls(&self) -> usize {
        self.state().create_calls
    }

    /// Calls of `find` so far (a worker waiting for a claim looks at its executor with each).
    pub fn find_calls(&self) -> usize {
        self.state().find_calls
    }

    /// `delete` calls so far, of executors there or not.
    pub fn delete_calls(&self) -> usize {
        self.state().delete_calls
    }

    /// Executors deleted so far.
    pub fn deleted(&self) -> usize {
        self.state().deleted
    }

    /// Marks an executor running.
    pub fn start(&self, id: &AssignmentId) {
        if let Some(r) = self.state().executors.get_mut(id) {
            r.phase = Phase::Running;
        }
    }

    /// Ends an executor as its process would.
    pub fn finish(&self, id: &AssignmentId, success: bool) {
        if let Some(r) = self.state().executors.get_mut(id) {
            r.phase = Phase::Finished {
                success,
                reason: Some(format!("memory executor ended (success: {success})")),
            };
        }
    }

    /// Removes an executor as someone else would (a Pod deleted by hand, a lost node); not
    /// counted in [`MemoryBackend::deleted`].
    pub fn vanish(&self, id: &AssignmentId) {
        let mut state = self.state();
        state.executors.remove(id);
        state.specs.remove(id);
    }

    /// Records that the job of `id` claimed the warm member with `standby_id`, as the VM
    /// backend's claim does: [`ExecutorBackend::claimed_standby`] then answers with the
    /// executor of `id` (while it exists).
    pub fn claim_standby(&self, standby_id: &str, id: &AssignmentId) {
        self.state()
            .standbys
            .insert(standby_id.to_owned(), id.clone());
    }

    /// Calls of [`ExecutorBackend::claimed_standby`] so far.
    pub fn standby_calls(&self) -> usize {
        self.state().standby_calls
    }

    fn check(&self) -> Result<(), ExecutorError> {
        match &self.state().failing {
            Some(f) => Err(f.error()),
            None => Ok(()),
        }
    }
}

#[async_trait]
impl ExecutorBackend for MemoryBackend {
    fn backend(&self) -> Backend {
        self.backend
    }

    async fn find(&self, id: &AssignmentId) -> Result<Option<ExecutorRecord>, ExecutorError> {
        self.state().find_calls += 1;
        self.check()?;
        Ok(self.state().executors.get(id).cloned())
    }

    async fn create(&self, spec: &ExecutorSpec) -> Result<ExecutorRecord, ExecutorError> {
        self.check()?;
        let delay = {
            let mut state = self.state();
            state.create_calls += 1;
            state.create_delay
        };
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        let mut state = self.state();
        if let Some(f) = &state.failing_create {
            return Err(f.error());
        }
        let id = spec.assignment.id().clone();
        if spec.assignment.backend() != self.backend {
            return Err(ExecutorError::permanent(Injected(format!(
                "assignment {id} is for backend {}, this is {}",
                spec.assignment.backend(),
                self.backend
            ))));
        }
        if let Some(existing) = state.executors.get(&id) {
            return Ok(existing.clone());
        }
        let record = self.record(spec, SystemTime::now());
        state.created += 1;
        state.specs.insert(id.clone(), spec.clone());
        state.executors.insert(id, record.clone());
        if let Some(f) = &state.failing_after_create {
            return Err(f.error());
        }
        Ok(record)
    }

    async fn bind_identity(&self, record: &ExecutorRecord) -> Result<Binding, ExecutorError> {
        self.check()?;
        let mut state = self.state();
        if state.not_ready_binds > 0 {
            state.not_ready_binds -= 1;
            return Ok(Binding::NotReady("identity target not created yet".into()));
        }
        match state.executors.get_mut(record.assignment.id()) {
            Some(r) => {
                r.identity_bound = true;
                Ok(Binding::Bound)
            }
            None => Err(ExecutorError::unavailable(Injected(format!(
                "executor {} is gone",
                record.name
            )))),
        }
    }

    async fn record_claimed(&self, id: &AssignmentId) -> Result<(), ExecutorError> {
        self.claims.calls.fetch_add(1, Ordering::SeqCst);
        {
            self.claims.waiting.fetch_add(1, Ordering::SeqCst);
            let _at_gate = AtGate(&self.claims.waiting);
            let mut held = self.claims.held.subscribe();
            // The sender lives as long as `self`.
            let _ = held.wait_for(|held| !held).await;
        }
        self.check()?;
        match self.state().executors.get_mut(id) {
            Some(r) => {
                r.claimed = true;
                Ok(())
            }
            None => Err(ExecutorError::unavailable(Injected(format!(
                "no executor for {id}"
            )))),
        }
    }

    async fn mark_terminal(&self, id: &AssignmentId) -> Result<(), ExecutorError> {
        self.check()?;
        let mut state = self.state();
        if state.failing_marks.contains(id) {
            return Err(ExecutorError::unavailable(Injected(format!(
                "injected: marking {id} terminal fails"
            ))));
        }
        if let Some(r) = state.executors.get_mut(id) {
            r.terminal = true;
        }
        Ok(())
    }

    async fn list(&self) -> Result<Vec<ExecutorRecord>, ExecutorError> {
        self.check()?;
        Ok(self.records())
    }

    async fn delete(&self, id: &AssignmentId) -> Result<(), ExecutorError> {
        self.check()?;
        let mut state = self.state();
        state.delete_calls += 1;
        if state.failing_deletes.contains(id) {
            return Err(ExecutorError::unavailable(Injected(format!(
                "injected: deleting {id} fails"
            ))));
        }
        if state.executors.remove(id).is_some() {
            state.deleted += 1;
        }
        state.specs.remove(id);
        Ok(())
    }

    async fn claimed_standby(
        &self,
        standby_id: &str,
    ) -> Result<Option<ExecutorRecord>, ExecutorError> {
        self.state().standby_calls += 1;
        self.check()?;
        let state = self.state();
        Ok(state
            .standbys
            .get(standby_id)
            .and_then(|id| state.executors.get(id))
            .cloned())
    }
}
