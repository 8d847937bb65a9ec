//! Leader election over a Kubernetes `Lease` (DESIGN.md invariant 18).
//!
//! Several replicas run; the one holding the Lease runs everything and the others only
//! campaign. This is client-go's algorithm as a small resourceVersion compare-and-swap loop
//! rather than `kube-lease-manager`, whose server-side-apply locking a fake API server
//! cannot honestly reproduce (reference/rust-crates.md §3):
//!
//! - campaign: GET the Lease; create it when absent (a 409 means another candidate won
//!   the race); when another identity holds it and `renewTime + leaseDurationSeconds` is
//!   still ahead, wait `retry_period`; otherwise take it with a PUT carrying the
//!   `resourceVersion` we read, so of two candidates racing for the same expired lease
//!   exactly one succeeds and the other gets 409;
//! - leading: renew (PUT with our last resourceVersion) every `retry_period`; if another
//!   writer took the Lease (409 and someone else holds it), or no renewal succeeded within
//!   `renew_deadline`, leadership is lost: the `leadership` watch goes `false` and
//!   [`LeaderElector::run`] returns [`LeaseError::Lost`]. `renew_deadline <
//!   lease_duration` guarantees we stop believing we lead before anyone else may start;
//! - shutdown while leading: the watch goes `false`, then the Lease is released (holder
//!   cleared, `leaseDurationSeconds: 1`) so a standby takes over at once instead of waiting
//!   for expiry;
//! - one identity, one process: the identity is what the compare-and-swap cannot tell
//!   apart, so a second process with the same identity would lead beside the first. A
//!   Lease that names our identity but carries a renewTime this process never wrote is
//!   another process's: campaigning, we wait for it to expire (a previous run of this
//!   replica that died) and report a duplicate when it is renewed meanwhile; leading, we
//!   stop at once ([`LeaseError::DuplicateIdentity`]).
//!
//! Components gate their work on a [`Leadership`] (true only while we hold the Lease). With
//! election turned off, [`Leadership::always`] is the same interface and always true.
//!
//! Expiry compares the holder's `renewTime` with our clock, as the task specifies; client-go
//! instead times the lease from when it *observed* a change, which tolerates clock skew
//! between replicas. Keep node clocks synchronised (NTP), or switch to observed time.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::Api;
use kube::api::PostParams;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::shutdown::Shutdown;

/// Why election stopped.
#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    /// We were leader and are no longer (another holder, or no renewal within the
    /// deadline). The controller must stop work (invariant 4) and exit non-zero.
    #[error("leadership lost")]
    Lost,
    /// Another process wrote the Lease under this replica's identity while we led: two
    /// processes share one identity, and neither may lead on it.
    #[error("another process holds the lease under this replica's identity {0}")]
    DuplicateIdentity(String),
    /// A Kubernetes API error that retrying will not fix (e.g. an invalid Lease).
    #[error("Kubernetes API: {0}")]
    Api(#[source] Box<kube::Error>),
    /// The settings are unusable (what is wrong with them).
    #[error("configuration: {0}")]
    Config(String),
    /// No Kubernetes client could be built from the environment.
    #[error("configuration: {0}")]
    Client(#[source] crate::kube_client::KubeClientError),
}

impl From<kube::Error> for LeaseError {
    fn from(e: kube::Error) -> Self {
        LeaseError::Api(Box::new(e))
    }
}

/// Where the Lease lives, who we are, and client-go's three timings.
#[derive(Clone, Debug)]
pub struct LeaseSettings {
    pub namespace: String,
    /// Lease name, shared by all replicas.
    pub name: String,
    /// This replica's identity; must be unique per process among candidates (a duplicate
    /// is detected and refused, see the module documentation).
    pub identity: String,
    /// How long a lease is valid after its last renewal, as seen by other candidates.
    /// Written as whole seconds (`leaseDurationSeconds`), rounded up.
    pub lease_duration: Duration,
    /// The leader steps down when no renewal succeeded for this long.
    pub renew_deadline: Duration,
    /// Interval between acquire attempts and between renewals.
    pub retry_period: Duration,
}

impl LeaseSettings {
    /// client-go's defaults: 15 s lease, 10 s renew deadline, 2 s retry period.
    pub fn new(
        namespace: impl Into<String>,
        name: impl Into<String>,
        identity: impl Into<String>,
    ) -> Self {
        LeaseSettings {
            namespace: namespace.into(),
            name: name.into(),
            identity: identity.into(),
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
        }
    }

    /// Timings derived from one lease duration, as the `lease_duration` key documents: a
    /// renewal every duration/7 (several chances before anyone may take over) and stepping
    /// down after 2/3 of it without one (well before a standby may start at the full
    /// duration). `lease_duration` = 15s gives client-go's 10s deadline and ~2s retry.
    pub fn with_duration(
        namespace: impl Into<String>,
        name: impl Into<String>,
        identity: impl Into<String>,
        lease_duration: Duration,
    ) -> Self {
        LeaseSettings {
            lease_duration,
            renew_deadline: lease_duration * 2 / 3,
            retry_period: lease_duration / 7,
            ..LeaseSettings::new(namespace, name, identity)
        }
    }

    /// Whole seconds written to `leaseDurationSeconds` (at least 1).
    pub fn lease_duration_seconds(&self) -> i32 {
        let d = self.lease_duration;
        let secs = d.as_secs() + u64::from(d.subsec_nanos() > 0);
        i32::try_from(secs.max(1)).unwrap_or(i32::MAX)
    }

    /// Rejects timings under which two replicas could both believe they lead.
    pub fn validate(&self) -> Result<(), LeaseError> {
        let bad = |m: &str| Err(LeaseError::Config(m.to_owned()));
        if self.namespace.is_empty() || self.name.is_empty() {
            return bad("lease namespace and name must not be empty");
        }
        if self.identity.is_empty() {
            return bad("lease identity must not be empty");
        }
        if self.retry_period.is_zero() {
            return bad("retry_period must be positive");
        }
        // Others may take over lease_duration after our last renewal; we must have stepped
        // down by then, and must get at least one renewal attempt in before stepping down.
        if self.renew_deadline >= self.lease_duration {
            return bad("renew_deadline must be shorter than lease_duration");
        }
        if self.retry_period >= self.renew_deadline {
            return bad("retry_period must be shorter than renew_deadline");
        }
        Ok(())
    }
}

/// "Do we lead?" for the components: `true` only while this replica holds the Lease.
#[derive(Clone, Debug)]
pub struct Leadership {
    rx: watch::Receiver<bool>,
    /// Keeps the sender of [`Leadership::always`] alive so the value never closes.
    _always: Option<Arc<watch::Sender<bool>>>,
}

impl Leadership {
    /// A watch for [`LeaderElector::run`]: starts `false`.
    pub fn channel() -> (watch::Sender<bool>, Leadership) {
        let (tx, rx) = watch::channel(false);
        (tx, Leadership::from(rx))
    }

    /// Election turned off (single instance): leads from the start, forever.
    pub fn always() -> Self {
        let (tx, rx) = watch::channel(true);
        Leadership {
            rx,
            _always: Some(Arc::new(tx)),
        }
    }

    /// Whether we lead right now.
    pub fn is_leader(&self) -> bool {
        *self.rx.borrow()
    }

    /// Waits until we lead. Returns `false` if the elector is gone without us leading.
    pub async fn acquired(&mut self) -> bool {
        self.rx.wait_for(|lead| *lead).await.is_ok()
    }

    /// Waits until we no longer lead (a dropped elector counts as not leading).
    pub async fn lost(&mut self) {
        let _ = self.rx.wait_for(|lead| !*lead).await;
    }

    /// The underlying watch, for `select!` loops.
    pub fn receiver(&self) -> watch::Receiver<bool> {
        self.rx.clone()
    }
}

impl From<watch::Receiver<bool>> for Leadership {
    fn from(rx: watch::Receiver<bool>) -> Self {
        Leadership { rx, _always: None }
    }
}

/// A kube client from in-cluster configuration or a kubeconfig (`KUBECONFIG`,
/// `~/.kube/config`), with an error naming both when neither exists.
pub async fn client_from_environment() -> Result<kube::Client, LeaseError> {
    crate::kube_client::from_environment(crate::kube_client::Retries::Client)
        .await
        .map_err(LeaseError::Client)
}

/// Campaigns for, holds and releases one Lease.
pub struct LeaderElector {
    api: Api<Lease>,
    settings: LeaseSettings,
}

/// Outcome of one acquire attempt.
enum Attempt {
    /// We hold the lease; this is the object as stored (for the next CAS).
    Acquired(Box<Lease>),
    /// Someone else holds a valid lease (their identity, if any).
    HeldBy(Option<String>),
    /// A valid lease names our identity, written by another process (its renewTime).
    HeldUnderOurIdentity(Option<Timestamp>),
}

/// The renewTimes this process wrote and has not seen stored yet: a write whose answer was
/// lost is recognised as ours by them; any other renewTime under our identity is not.
#[derive(Default)]
struct Written(std::collections::VecDeque<Timestamp>);

impl Written {
    /// Unanswered writes remembered (a few renew deadlines' worth of retries).
    const KEEP: usize = 32;

    fn push(&mut self, at: Timestamp) {
        if self.0.len() == Self::KEEP {
            self.0.pop_front();
        }
        self.0.push_back(at);
    }

    fn contains(&self, at: Option<Timestamp>) -> bool {
        at.is_some_and(|at| self.0.contains(&at))
    }

    fn clear(&mut self) {
        self.0.clear();
    }
}

/// What a campaigning candidate saw of the holders, so each change is logged once.
#[derive(Default)]
struct Standby {
    last_holder: Option<String>,
    /// The renewTime last seen under our identity in another process's Lease.
    seen_own: Option<Option<Timestamp>>,
    duplicate_reported: bool,
}

impl Standby {
    /// Another candidate holds a valid Lease.
    fn held_by(&mut self, s: &LeaseSettings, holder: Option<String>) {
        self.seen_own = None;
        if holder != self.last_holder {
            tracing::info!(lease = %s.name, identity = %s.identity,
                holder = holder.as_deref().unwrap_or(""), "lease held by another candidate");
            self.last_holder = holder;
        }
    }

    /// A valid Lease names our identity, written by another process: a previous run of
    /// this replica (it expires) or, once it is renewed, a second process with our identity.
    fn held_under_our_identity(&mut self, s: &LeaseSettings, renewed: Option<Timestamp>) {
        match self.seen_own {
            None => tracing::warn!(lease = %s.name, identity = %s.identity,
                "the lease names this replica's identity but this process did not write it: waiting for it to expire (a previous run of this replica), unless it is renewed"),
            Some(before) if before != renewed && !self.duplicate_reported => {
                self.duplicate_reported = true;
                tracing::error!(lease = %s.name, identity = %s.identity,
                    "another process holds the lease under this replica's identity: every replica needs its own leader_identity (leave it unset for a unique one); this replica stays standby");
            }
            Some(_) => {}
        }
        self.seen_own = Some(renewed);
        self.last_holder = Some(s.identity.clone());
    }
}

impl LeaderElector {
    pub fn new(client: kube::Client, settings: LeaseSettings) -> Self {
        let api = Api::namespaced(client, &settings.namespace);
        LeaderElector { api, settings }
    }

    pub fn settings(&self) -> &LeaseSettings {
        &self.settings
    }

    /// The current holder's identity, for status reporting (`None`: absent or released).
    pub async fn holder(&self) -> Result<Option<String>, LeaseError> {
        let lease = self.api.get_opt(&self.settings.name).await?;
        Ok(lease.and_then(|l| l.spec?.holder_identity.filter(|h| !h.is_empty())))
    }

    /// Campaigns until leader, leads until `shutdown` resolves or leadership is lost.
    ///
    /// `leadership` is `true` exactly while we hold the Lease. Returns `Ok(())` after
    /// `shutdown` (the Lease released if we held it), [`LeaseError::Lost`] when leadership
    /// was lost, [`LeaseError::Config`] for unusable settings and [`LeaseError::Api`] for API
    /// errors that retrying cannot fix. Stop work before resolving `shutdown`: the release
    /// lets a standby start immediately.
    pub async fn run(
        self,
        leadership: watch::Sender<bool>,
        shutdown: Shutdown,
    ) -> Result<(), LeaseError> {
        leadership.send_replace(false);
        self.settings.validate()?;
        let s = &self.settings;
        let mut written = Written::default();
        let Some((current, renewed_at)) = self.campaign(&mut written, &shutdown).await? else {
            return Ok(());
        };
        // `renewed_at` is when the successful write was *sent*: the lease runs from the
        // renewTime we wrote, which is no earlier, so our deadline is conservative.
        leadership.send_replace(true);
        tracing::info!(lease = %s.name, identity = %s.identity, holder = %s.identity, "became leader");
        written.clear();
        self.lead(&leadership, &shutdown, current, renewed_at, written)
            .await
    }

    /// Tries to acquire the Lease every retry period until it is ours (the Lease as stored
    /// and when the winning write was sent) or `shutdown` (`None`).
    async fn campaign(
        &self,
        written: &mut Written,
        shutdown: &Shutdown,
    ) -> Result<Option<(Lease, Instant)>, LeaseError> {
        let s = &self.settings;
        let mut standby = Standby::default();
        loop {
            let started = Instant::now();
            let attempt = tokio::select! {
                () = shutdown.wait() => {
                    tracing::info!(lease = %s.name, identity = %s.identity, "shutdown while campaigning");
                    return Ok(None);
                }
                r = tokio::time::timeout(s.renew_deadline, self.try_acquire(written)) => r,
            };
            match attempt {
                Ok(Ok(Attempt::Acquired(lease))) => return Ok(Some((*lease, started))),
                Ok(Ok(Attempt::HeldBy(holder))) => standby.held_by(s, holder),
                Ok(Ok(Attempt::HeldUnderOurIdentity(renewed))) => {
                    standby.held_under_our_identity(s, renewed);
                }
                Ok(Err(e)) if is_permanent(&e) => return Err(e.into()),
                Ok(Err(e)) => {
                    tracing::warn!(lease = %s.name, identity = %s.identity, error = %e,
                        "acquiring the lease failed; retrying");
                }
                Err(_) => {
                    tracing::warn!(lease = %s.name, identity = %s.identity,
                        "acquiring the lease timed out; retrying");
                }
            }
            tokio::select! {
                () = shutdown.wait() => return Ok(None),
                () = tokio::time::sleep(jittered(s.retry_period)) => {}
            }
        }
    }

    /// Renews the Lease every retry period until `shutdown` (released, `Ok`) or until
    /// leadership is lost (`Err`).
    async fn lead(
        &self,
        leadership: &watch::Sender<bool>,
        shutdown: &Shutdown,
        mut current: Lease,
        mut renewed_at: Instant,
        mut written: Written,
    ) -> Result<(), LeaseError> {
        let s = &self.settings;
        loop {
            tokio::select! {
                () = shutdown.wait() => {
                    leadership.send_replace(false);
                    self.release(&current).await;
                    return Ok(());
                }
                () = tokio::time::sleep(s.retry_period) => {}
            }
            let remaining =
                (renewed_at + s.renew_deadline).saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                return self.lost(leadership, "no renewal within renew_deadline");
            }
            let sent = Instant::now();
            // Each request is bounded by what is left of the deadline: a hanging API server
            // must not keep us believing we lead.
            let outcome = tokio::select! {
                () = shutdown.wait() => {
                    leadership.send_replace(false);
                    self.release(&current).await;
                    return Ok(());
                }
                r = tokio::time::timeout(remaining, self.renew(&current, &mut written)) => r,
            };
            match outcome {
                Ok(Ok(lease)) => {
                    current = lease;
                    renewed_at = sent;
                    written.clear();
                    tracing::debug!(lease = %s.name, identity = %s.identity, "renewed");
                }
                Ok(Err(e)) if is_conflict(&e) => {
                    self.after_conflict(leadership, &mut current, &mut written, remaining)
                        .await?;
                }
                Ok(Err(e)) => {
                    tracing::warn!(lease = %s.name, identity = %s.identity, error = %e,
                        "renewing the lease failed; retrying until renew_deadline");
                }
                Err(_) => return self.lost(leadership, "no renewal within renew_deadline"),
            }
        }
    }

    /// A renewal met a conflict: someone wrote the Lease since our last write. If it is
    /// still ours (our own write whose answer we missed: its renewTime is one we wrote),
    /// leading continues from the stored version (`Ok`); under our identity with a
    /// renewTime we never wrote, another process uses our identity; otherwise another
    /// candidate took it.
    async fn after_conflict(
        &self,
        leadership: &watch::Sender<bool>,
        current: &mut Lease,
        written: &mut Written,
        remaining: Duration,
    ) -> Result<(), LeaseError> {
        let s = &self.settings;
        let reread = tokio::time::timeout(remaining, self.api.get_opt(&s.name)).await;
        match reread {
            Ok(Ok(Some(lease)))
                if holder_of(&lease) == Some(s.identity.as_str())
                    && written.contains(renew_time_of(&lease)) =>
            {
                *current = lease;
                written.clear();
                Ok(())
            }
            Ok(Ok(Some(lease))) if holder_of(&lease) == Some(s.identity.as_str()) => {
                leadership.send_replace(false);
                tracing::error!(lease = %s.name, identity = %s.identity,
                    "another process renewed the lease under this replica's identity: two processes share it, so this one stops leading; every replica needs its own leader_identity (leave it unset for a unique one)");
                Err(LeaseError::DuplicateIdentity(s.identity.clone()))
            }
            Ok(Ok(lease)) => {
                let holder = lease.as_ref().and_then(holder_of).unwrap_or("").to_owned();
                tracing::warn!(lease = %s.name, identity = %s.identity, holder = %holder,
                    "lease taken over by another holder");
                self.lost(leadership, "lease taken over (409)")
            }
            Ok(Err(e)) => {
                tracing::warn!(lease = %s.name, identity = %s.identity, error = %e,
                    "re-reading the lease after a conflict failed");
                Ok(())
            }
            Err(_) => self.lost(leadership, "no renewal within renew_deadline"),
        }
    }

    fn lost(&self, leadership: &watch::Sender<bool>, why: &str) -> Result<(), LeaseError> {
        leadership.send_replace(false);
        tracing::error!(lease = %self.settings.name, identity = %self.settings.identity,
            reason = why, "leadership lost");
        Err(LeaseError::Lost)
    }

    /// One client-go `tryAcquireOrRenew` for a non-leader.
    async fn try_acquire(&self, written: &mut Written) -> Result<Attempt, kube::Error> {
        let s = &self.settings;
        let now = now();
        let Some(existing) = self.api.get_opt(&s.name).await? else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(s.name.clone()),
                    namespace: Some(s.namespace.clone()),
                    ..ObjectMeta::default()
                },
                spec: Some(LeaseSpec {
                    holder_identity: Some(s.identity.clone()),
                    acquire_time: Some(MicroTime(now)),
                    renew_time: Some(MicroTime(now)),
                    lease_duration_seconds: Some(s.lease_duration_seconds()),
                    lease_transitions: Some(0),
                    ..LeaseSpec::default()
                }),
            };
            written.push(now);
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(created) => Ok(Attempt::Acquired(Box::new(created))),
                // Another candidate created it between our GET and POST: it won.
                Err(e) if is_already_exists(&e) || is_conflict(&e) => Ok(Attempt::HeldBy(None)),
                Err(e) => Err(e),
            };
        };
        let spec = existing.spec.clone().unwrap_or_default();
        let holder = spec.holder_identity.clone().filter(|h| !h.is_empty());
        let ours = holder.as_deref() == Some(s.identity.as_str());
        let valid = !expired(&spec, now, s.lease_duration_seconds());
        if !ours && holder.is_some() && valid {
            return Ok(Attempt::HeldBy(holder));
        }
        let renewed = spec.renew_time.as_ref().map(|t| t.0);
        // Ours only if this process wrote it; under our identity otherwise another's.
        let ours_here = ours && written.contains(renewed);
        if ours && valid && !ours_here {
            return Ok(Attempt::HeldUnderOurIdentity(renewed));
        }
        let mut lease = existing;
        let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
        if !ours_here {
            // A takeover (or the first holder after a release, or after a previous run
            // under the same identity) starts a new term.
            spec.acquire_time = Some(MicroTime(now));
            spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
        }
        spec.holder_identity = Some(s.identity.clone());
        spec.renew_time = Some(MicroTime(now));
        spec.lease_duration_seconds = Some(s.lease_duration_seconds());
        written.push(now);
        // `lease.metadata.resourceVersion` is the one we read: the PUT is a compare-and-swap.
        match self
            .api
            .replace(&s.name, &PostParams::default(), &lease)
            .await
        {
            Ok(stored) => Ok(Attempt::Acquired(Box::new(stored))),
            // Someone else wrote first; they won this round.
            Err(e) if is_conflict(&e) => Ok(Attempt::HeldBy(None)),
            Err(e) if is_not_found(&e) => Ok(Attempt::HeldBy(None)),
            Err(e) => Err(e),
        }
    }

    /// Writes a new renewTime over our last stored version.
    async fn renew(&self, current: &Lease, written: &mut Written) -> Result<Lease, kube::Error> {
        let mut lease = current.clone();
        let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
        let now = now();
        written.push(now);
        spec.renew_time = Some(MicroTime(now));
        spec.lease_duration_seconds = Some(self.settings.lease_duration_seconds());
        self.api
            .replace(&self.settings.name, &PostParams::default(), &lease)
            .await
    }

    /// Gives the lease up (client-go's ReleaseOnCancel): holder cleared, a 1 s duration and a
    /// fresh renewTime, so the next candidate need not wait for expiry. Best effort: if it
    /// fails, the lease simply expires.
    async fn release(&self, current: &Lease) {
        let s = &self.settings;
        let mut lease = current.clone();
        let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
        let now = now();
        spec.holder_identity = None;
        spec.lease_duration_seconds = Some(1);
        spec.renew_time = Some(MicroTime(now));
        spec.acquire_time = Some(MicroTime(now));
        let pp = PostParams::default();
        let put = self.api.replace(&s.name, &pp, &lease);
        match tokio::time::timeout(s.renew_deadline, put).await {
            Ok(Ok(_)) => tracing::info!(lease = %s.name, identity = %s.identity, holder = "",
                "released the lease"),
            Ok(Err(e)) => tracing::warn!(lease = %s.name, identity = %s.identity, error = %e,
                "releasing the lease failed; it will expire"),
            Err(_) => tracing::warn!(lease = %s.name, identity = %s.identity,
                "releasing the lease timed out; it will expire"),
        }
    }
}

fn holder_of(lease: &Lease) -> Option<&str> {
    lease
        .spec
        .as_ref()?
        .holder_identity
        .as_deref()
        .filter(|h| !h.is_empty())
}

fn renew_time_of(lease: &Lease) -> Option<Timestamp> {
    lease.spec.as_ref()?.renew_time.as_ref().map(|t| t.0)
}

/// `renewTime + leaseDurationSeconds <= now`. A lease without renewTime is treated as expired.
fn expired(spec: &LeaseSpec, now: Timestamp, default_secs: i32) -> bool {
    let Some(MicroTime(renewed)) = spec.renew_time else {
        return true;
    };
    let secs = i64::from(spec.lease_duration_seconds.unwrap_or(default_secs));
    renewed.as_microsecond() + secs * 1_000_000 <= now.as_microsecond()
}

/// Wall-clock now with microsecond precision (what MicroTime carries).
fn now() -> Timestamp {
    let micros = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
        .unwrap_or(0);
    Timestamp::from_microsecond(micros).unwrap_or(Timestamp::UNIX_EPOCH)
}

/// client-go waits `retry_period * (1 + rand[0, 1.2))` between acquire attempts so candidates
/// do not retry in lock-step; a smaller spread keeps tests brisk.
fn jittered(d: Duration) -> Duration {
    d.mul_f64(1.0 + rand::random_range(0.0..0.2))
}

fn status_of(e: &kube::Error) -> Option<&kube::core::Status> {
    match e {
        kube::Error::Api(s) => Some(s),
        _ => None,
    }
}

fn is_conflict(e: &kube::Error) -> bool {
    status_of(e).is_some_and(|s| s.is_conflict())
}

fn is_already_exists(e: &kube::Error) -> bool {
    status_of(e).is_some_and(|s| s.is_already_exists())
}

fn is_not_found(e: &kube::Error) -> bool {
    status_of(e).is_some_and(|s| s.is_not_found())
}

/// Errors that retrying cannot fix: a malformed or invalid Lease (bad name, bad namespace).
/// Everything else (network, 5xx, 429, RBAC still propagating) is retried, as client-go does.
fn is_permanent(e: &kube::Error) -> bool {
    status_of(e).is_some_and(|s| s.is_invalid() || s.code == 400)
}
