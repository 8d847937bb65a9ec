//! Warm sandboxes (`vm_warm_pool`, off by default; issue 39 item 5): sandboxes created
//! before any job, their executor already running, so a job's start waits for neither the
//! VM nor the executor. The OpenSandbox Pool's buffer pre-starts VMs; this pool also
//! starts the executor and names the sandbox ahead of the job.
//!
//! A member is created with no assignment (not `runner=true`, so `list`, recovery and
//! `sandbox-identity` ignore it), no capability and no SPIFFE ID. Its environment is the
//! static part of an executor's (`CI_RUNNER_FACADE_URL`, `CI_RUNNER_FACADE_SPIFFE_ID`,
//! `CI_RUNNER_BACKEND`, `CI_RUNNER_LABEL`, `CI_EXECUTOR_REPORT_OUTAGE_TOLERANCE`, the
//! extra variables) and a random standby ID (`CI_EXECUTOR_STANDBY_ID`), also written to its
//! metadata (`<prefix>standby-id`) with `<prefix>warm=true` and the fingerprint of what it
//! was made from (`<prefix>warm-template`). Its executor waits in standby: once a job
//! claimed the sandbox and `sandbox-identity` issued the job's SVID, it asks the facade
//! for its assignment by its standby ID ([`gdr_core::executor::standby`]), which the
//! facade looks up with
//! [`ExecutorBackend::claimed_standby`](gdr_core::executor::ExecutorBackend::claimed_standby).
//!
//! **The claim.** OpenSandbox's metadata patch has no precondition, so two claimants of one
//! member would both succeed; the backend's [`WarmClaims`] arbiter decides first (DESIGN
//! invariant 8: one environment never serves two jobs), and only its winner patches the
//! job's metadata (`runner=true`, the assignment, the identity chunks) onto the member
//! with `<prefix>warm=claimed` and `<prefix>warm-claimed-at`. From there the sandbox is an
//! executor like any: found by its assignment label, listed, renewed, deleted after its
//! job; its start deadline counts from the claim. It never returns to the pool.
//!
//! **A claim that died** between the arbiter and the patch leaves the member held and
//! unclaimed: a retry of the same assignment gets it back (the arbiter answers `true` to
//! its holder again); otherwise no job can ever claim it, so a pass discards a member
//! held for longer than [`HOLD_GRACE`] that still reads `warm=true` (as ended).
//!
//! **The pass** ([`OpenSandboxBackend::reconcile_warm_pool`]) lists the members, maps them
//! to [`State`]s, runs [`warm::plan`], deletes and creates, and renews members' expiry
//! (they are not `runner=true`, so
//! [`ExecutorBackend::list`](gdr_core::executor::ExecutorBackend::list) does not). Before
//! deleting a live member (a surplus) it takes it in the arbiter itself, so a job claiming
//! it at that moment keeps it. Nothing is remembered between passes.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use gdr_core::assignment::AssignmentId;
use gdr_core::executor::{ExecutorError, ExecutorRecord, ExecutorSpec, Phase, WarmClaims, env};
use gdr_core::metadata;

use super::backend::{OpenSandboxBackend, api_error, phase};
use super::client::{ClientError, CreateSandbox, Sandbox};
use crate::warm::{
    self, CLAIMED, CLAIMED_AT_KEY, Member, State, TEMPLATE_KEY, UNCLAIMED, WARM_KEY, WarmPass,
};

/// Metadata key (under the prefix): the member's standby ID, the value of its executor's
/// `CI_EXECUTOR_STANDBY_ID`.
pub const STANDBY_ID_KEY: &str = "standby-id";

/// How long a member may be held in the arbiter while its metadata still reads
/// `warm=true` ([`crate::defaults::opensandbox::WARM_HOLD_GRACE`]).
pub const HOLD_GRACE: Duration = crate::defaults::opensandbox::WARM_HOLD_GRACE;

/// The task ID whose assignment the pass holds a member under while deleting it: Gitea's
/// auto-incremented task IDs never reach it.
const REAPER_TASK_ID: i64 = i64::MAX;

/// A member's state from what the server and the arbiter say: `held_since` is when the
/// arbiter gave it to a job (it still reads `warm=true`, so that job's patch never came).
pub fn member_state(
    phase: &Phase,
    of_current_template: bool,
    created: SystemTime,
    held_since: Option<SystemTime>,
    (now, start_deadline, hold_grace): (SystemTime, Duration, Duration),
) -> State {
    let older_than = |since: SystemTime, limit: Duration| {
        now.duration_since(since).is_ok_and(|age| age >= limit)
    };
    match phase {
        Phase::Finished { .. } => State::Ended,
        _ if held_since.is_some_and(|t| older_than(t, hold_grace)) => State::Ended,
        _ if !of_current_template => State::Outdated,
        Phase::Starting { .. } if older_than(created, start_deadline) => State::Stalled,
        Phase::Starting { .. } => State::Starting,
        Phase::Running => State::Ready,
    }
}

/// The fingerprint of what a member is made from: the pool, the entrypoint and the
/// environment without its standby ID (each member's own).
pub fn template_of(pool: &str, entrypoint: &[String], env: &BTreeMap<String, String>) -> String {
    #[derive(serde::Serialize)]
    struct Template<'a> {
        pool: &'a str,
        entrypoint: &'a [String],
        env: BTreeMap<&'a str, &'a str>,
    }
    let env = env
        .iter()
        .filter(|(k, _)| k.as_str() != env::STANDBY_ID)
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let json = serde_json::to_vec(&Template {
        pool,
        entrypoint,
        env,
    })
    // A struct of strings always serialises; an empty input only replaces the pool once.
    .unwrap_or_default();
    warm::template_fingerprint(&json)
}

/// A new standby ID: 128 random bits as 32 hex digits (a label value).
fn standby_id() -> String {
    let n: u128 = rand::random();
    format!("{n:032x}")
}

fn unix_secs(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

impl OpenSandboxBackend {
    /// The same backend deciding warm claims with `claims` (the controller's is shared by
    /// every replica); without it,
    /// [`LocalWarmClaims`](gdr_core::executor::LocalWarmClaims), right within one
    /// process only.
    #[must_use]
    pub fn with_warm_claims(mut self, claims: Arc<dyn WarmClaims>) -> Self {
        self.warm.claims = claims;
        self
    }

    /// The `CI_*` variables every executor of this backend gets whatever its job (the
    /// facade's URL and SPIFFE ID, the backend, the runner label, the report outage
    /// tolerance): a warm member's environment before any job. Until it is set, the pass
    /// creates no member and no job claims one.
    pub fn set_standby_environment(&self, environment: BTreeMap<String, String>) {
        *self.warm_environment() = Some(environment);
    }

    /// Whether `vm_warm_pool` is above 0.
    pub fn warm_pool_configured(&self) -> bool {
        self.settings.warm_pool > 0
    }

    fn warm_environment(&self) -> std::sync::MutexGuard<'_, Option<BTreeMap<String, String>>> {
        self.warm
            .environment
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// A member's environment without its standby ID: the extra variables, then the
    /// static `CI_*` ones, which win (as in a job's own sandbox).
    fn member_environment(&self) -> Option<BTreeMap<String, String>> {
        let statics = self.warm_environment().clone()?;
        let mut env = self.settings.extra_env.clone();
        env.extend(statics);
        Some(env)
    }

    fn template(&self) -> Option<String> {
        let env = self.member_environment()?;
        Some(template_of(
            &self.settings.pool,
            &self.settings.entrypoint,
            &env,
        ))
    }

    fn warm_value<'a>(&self, sandbox: &'a Sandbox, key: &str) -> Option<&'a String> {
        let key = self.settings.codec.key(key);
        sandbox.metadata.as_ref()?.get(&key)
    }

    /// When a claimed member was claimed: its start as an executor.
    pub(super) fn claimed_at(&self, sandbox: &Sandbox) -> Option<SystemTime> {
        if self.warm_value(sandbox, WARM_KEY).map(String::as_str) != Some(CLAIMED) {
            return None;
        }
        let secs: u64 = self.warm_value(sandbox, CLAIMED_AT_KEY)?.parse().ok()?;
        Some(UNIX_EPOCH + Duration::from_secs(secs))
    }

    /// The unclaimed members as the server holds them.
    async fn list_warm(&self) -> Result<Vec<Sandbox>, ExecutorError> {
        self.client
            .list(&self.query(WARM_KEY, UNCLAIMED))
            .await
            .map_err(api_error)
    }

    /// `sandboxes` as members; with `ask_arbiter`, a ready member is looked up in the
    /// arbiter to find one a dead claim holds.
    async fn members(
        &self,
        sandboxes: &[Sandbox],
        template: Option<&str>,
        ask_arbiter: bool,
    ) -> Result<Vec<Member>, ExecutorError> {
        let now = SystemTime::now();
        let mut members = Vec::with_capacity(sandboxes.len());
        for sandbox in sandboxes {
            let phase = phase(sandbox);
            let current = template.is_some()
                && self.warm_value(sandbox, TEMPLATE_KEY).map(String::as_str) == template;
            let held_since = if ask_arbiter && current && phase == Phase::Running {
                self.warm.claims.held_since(&sandbox.id).await?
            } else {
                None
            };
            // Deleted by an earlier pass and still listed while it stops: not counted,
            // not deleted (and counted) again.
            let state = if sandbox.status.state.eq_ignore_ascii_case("stopping") {
                State::Deleting
            } else {
                member_state(
                    &phase,
                    current,
                    sandbox.created_at,
                    held_since,
                    (
                        now,
                        self.settings.warm_start_deadline,
                        self.settings.warm_hold_grace,
                    ),
                )
            };
            members.push(Member {
                name: sandbox.id.clone(),
                profile: None,
                state,
                created: sandbox.created_at,
            });
        }
        Ok(members)
    }

    /// One pass: the pool brought to `vm_warm_pool` from what the server holds (with the
    /// pool off, leftover members are deleted). Creates wait until their sandbox runs (the
    /// API answers then), at most `opensandbox_create_timeout`, all at once.
    pub async fn reconcile_warm_pool(&self) -> Result<WarmPass, ExecutorError> {
        let template = self.template();
        let wanted = match (self.settings.warm_pool, &template) {
            (0, _) => BTreeMap::new(),
            (n, Some(_)) => BTreeMap::from([(None, n)]),
            // Not yet known what a member's environment is: touch nothing.
            (_, None) => return Ok(WarmPass::default()),
        };
        let sandboxes = self.list_warm().await?;
        let members = self.members(&sandboxes, template.as_deref(), true).await?;
        let plan = warm::plan(&wanted, &members);
        let mut pass = WarmPass {
            members: WarmPass::left(&wanted, &members, &plan),
            claims: self.warm.counts.take(),
            ..WarmPass::default()
        };
        for member in members.iter().filter(|m| plan.delete.contains(&m.name)) {
            if self.delete_member(member).await? {
                pass.deleted += 1;
                *pass
                    .deleted_by
                    .entry(member.state.deletion_kind())
                    .or_default() += 1;
            }
        }
        let creates = plan.create.iter().map(|_| self.create_member());
        for created in futures::future::join_all(creates).await {
            match created {
                Ok(()) => pass.created += 1,
                Err(e) => {
                    tracing::warn!(pool = %self.settings.pool, error = %e, "cannot create a warm sandbox; the next pass tries again");
                }
            }
        }
        for sandbox in sandboxes.iter().filter(|s| !plan.delete.contains(&s.id)) {
            self.renew_member_if_due(sandbox).await;
        }
        Ok(pass)
    }

    /// Deletes a member the plan discards; `false` when a job holds it (a live member
    /// the pass lost to a claim in the arbiter) or it was gone.
    async fn delete_member(&self, member: &Member) -> Result<bool, ExecutorError> {
        if matches!(member.state, State::Ready | State::Starting) {
            let reaper = AssignmentId::from_task_id(REAPER_TASK_ID)
                .map_err(|e| ExecutorError::permanent(e.to_string()))?;
            if !self.warm.claims.claim(&member.name, &reaper).await? {
                return Ok(false);
            }
        }
        let deleted = self.client.delete(&member.name).await.map_err(api_error)?;
        if deleted {
            tracing::info!(sandbox = %member.name, reason = member.state.deletion_reason(), "warm sandbox deleted");
        }
        Ok(deleted)
    }

    /// Creates one member and waits until it runs.
    async fn create_member(&self) -> Result<(), ExecutorError> {
        let (Some(mut env), Some(template)) = (self.member_environment(), self.template()) else {
            return Ok(());
        };
        let standby = standby_id();
        env.insert(env::STANDBY_ID.to_owned(), standby.clone());
        let codec = &self.settings.codec;
        let request = CreateSandbox {
            pool: self.settings.pool.clone(),
            entrypoint: self.settings.entrypoint.clone(),
            env,
            metadata: BTreeMap::from([
                (codec.key(WARM_KEY), UNCLAIMED.to_owned()),
                (codec.key(STANDBY_ID_KEY), standby),
                (codec.key(TEMPLATE_KEY), template),
            ]),
            timeout: Some(self.settings.timeout),
        };
        let sandbox = self.client.create(&request).await.map_err(api_error)?;
        tracing::info!(sandbox = %sandbox.id, pool = %self.settings.pool, state = %sandbox.status.state, "warm sandbox created");
        Ok(())
    }

    /// Extends the expiry of a member that expires within `renew_before`.
    async fn renew_member_if_due(&self, sandbox: &Sandbox) {
        if phase(sandbox).is_finished() {
            return;
        }
        if let Some(Err(e)) = self.renew_due(sandbox).await {
            tracing::warn!(sandbox = %sandbox.id, error = %e, "cannot extend the warm sandbox's expiry; retrying on the next pass");
        }
    }

    /// Claims a ready member for `spec`'s job, its flattened `metadata` written onto it;
    /// `None`: the pool is off, or no member could be had (create a fresh sandbox).
    pub(super) async fn claim_warm(
        &self,
        spec: &ExecutorSpec,
        metadata: &BTreeMap<String, String>,
    ) -> Result<Option<ExecutorRecord>, ExecutorError> {
        let Some(template) = self.template().filter(|_| self.warm_pool_configured()) else {
            return Ok(None);
        };
        let id = spec.assignment.id();
        let sandboxes = self.list_warm().await?;
        let members = self.members(&sandboxes, Some(&template), false).await?;
        for member in warm::candidates(&members, None) {
            if !self.warm.claims.claim(&member.name, id).await? {
                continue;
            }
            let codec = &self.settings.codec;
            let mut patch: BTreeMap<String, Option<String>> = metadata
                .iter()
                .map(|(k, v)| (k.clone(), Some(v.clone())))
                .collect();
            patch.insert(codec.key(WARM_KEY), Some(CLAIMED.to_owned()));
            let now = unix_secs(SystemTime::now());
            patch.insert(codec.key(CLAIMED_AT_KEY), Some(now.to_string()));
            let sandbox = match self.client.patch_metadata(&member.name, &patch).await {
                Ok(sandbox) => sandbox,
                // Deleted since the listing (it ended, a pass discarded it).
                Err(ClientError::NotFound { .. }) => continue,
                Err(e) => return Err(api_error(e)),
            };
            let record = self.record(&sandbox).map_err(ExecutorError::permanent)?;
            self.ids().insert(id.clone(), sandbox.id.clone());
            self.warm.counts.count(true);
            tracing::info!(assignment_id = %id, sandbox = %sandbox.id, "warm sandbox claimed");
            return Ok(Some(record));
        }
        self.warm.counts.count(false);
        tracing::info!(assignment_id = %id, pool = %self.settings.pool, "no warm sandbox ready for the job; creating its own");
        Ok(None)
    }

    /// The record of the job that claimed the member with standby ID `standby_id`.
    pub(super) async fn claimed_standby_record(
        &self,
        standby_id: &str,
    ) -> Result<Option<ExecutorRecord>, ExecutorError> {
        // Only what this backend writes: anything else names no member (and the server
        // would refuse it as a filter).
        if standby_id.is_empty() || !metadata::is_label_value(standby_id) {
            return Ok(None);
        }
        let mut sandboxes = self
            .client
            .list(&self.query(STANDBY_ID_KEY, standby_id))
            .await
            .map_err(api_error)?;
        sandboxes.retain(|s| self.warm_value(s, WARM_KEY).map(String::as_str) == Some(CLAIMED));
        sandboxes.sort_by(|a, b| (a.created_at, &a.id).cmp(&(b.created_at, &b.id)));
        match sandboxes.first() {
            Some(sandbox) => self
                .record(sandbox)
                .map(Some)
                .map_err(ExecutorError::permanent),
            None => Ok(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEADLINE: Duration = Duration::from_secs(600);

    fn at(secs: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(secs)
    }

    fn state(phase: Phase, current: bool, held: Option<u64>, now: u64) -> State {
        member_state(
            &phase,
            current,
            at(1000),
            held.map(at),
            (at(now), DEADLINE, HOLD_GRACE),
        )
    }

    fn starting() -> Phase {
        Phase::Starting { reason: None }
    }

    #[test]
    fn a_members_state_follows_its_sandbox_template_start_deadline_and_hold_invariant_8() {
        assert_eq!(state(starting(), true, None, 1001), State::Starting);
        assert_eq!(state(Phase::Running, true, None, 1001), State::Ready);
        let ended = Phase::Finished {
            success: false,
            reason: None,
        };
        assert_eq!(state(ended, true, None, 1001), State::Ended);
        assert_eq!(state(Phase::Running, false, None, 1001), State::Outdated);
        assert_eq!(state(starting(), true, None, 1000 + 600), State::Stalled);
        assert_eq!(state(starting(), true, None, 1000 + 599), State::Starting);
        // Held by a claim under way: still ready (its claimant is patching it).
        assert_eq!(state(Phase::Running, true, Some(1990), 2000), State::Ready);
        // Held past the grace while reading warm=true: its claimant died; no job can have it.
        assert_eq!(state(Phase::Running, true, Some(1900), 2000), State::Ended);
    }

    #[test]
    fn a_members_template_ignores_its_standby_id_and_follows_everything_else_invariant_8() {
        let entrypoint = vec!["/bin/executor".to_owned()];
        let env = |standby: &str, facade: &str| {
            BTreeMap::from([
                (env::STANDBY_ID.to_owned(), standby.to_owned()),
                (env::FACADE_URL.to_owned(), facade.to_owned()),
            ])
        };
        let a = template_of("p", &entrypoint, &env("aa", "https://f"));
        assert_eq!(a, template_of("p", &entrypoint, &env("bb", "https://f")));
        assert_ne!(a, template_of("p", &entrypoint, &env("aa", "https://g")));
        assert_ne!(a, template_of("q", &entrypoint, &env("aa", "https://f")));
        assert_ne!(a, template_of("p", &[], &env("aa", "https://f")));
    }

    #[test]
    fn a_standby_id_is_32_hex_digits_a_metadata_value_and_new_each_time() {
        let (a, b) = (standby_id(), standby_id());
        assert_eq!(a.len(), 32);
        assert!(metadata::is_label_value(&a), "{a}");
        assert_ne!(a, b);
    }
}
