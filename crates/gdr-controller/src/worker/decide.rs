//! The worker's decisions, as pure functions of what it observed and of the time it was
//! given (DESIGN invariants 5, 9, 12, 20): no NATS, no backend, no clock of their own. The
//! worker observes (finds the executor, reads the finished record, watches the claim),
//! asks here what to do, and performs it, so every transition is tested without a peer.

use std::time::{Duration, SystemTime};

use gdr_core::assignment::EnvelopeError;
use gdr_core::executor::{ExecutorRecord, Phase};

use crate::job_metrics::FailureReason;
use crate::vocabulary::Outcome;

/// How a delivery is settled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Settle {
    /// Acknowledged: it leaves the stream.
    Ack,
    /// Terminated: it leaves the stream and is never redelivered.
    Term,
    /// Put back, redelivered after the delay (at once without one).
    Nak(Option<Duration>),
}

/// The NAK delays of a worker ([`super::WorkerSettings`]).
#[derive(Debug, Clone, Copy)]
pub(super) struct Delays {
    pub full: Duration,
    pub not_ready: Duration,
    pub error: Duration,
    pub progress: Duration,
}

/// How a delivery that ended with `outcome` is settled; `retry_hint` is a full backend's
/// own `Retry-After`, which it knows best.
pub(super) fn settlement(outcome: Outcome, retry_hint: Option<Duration>, d: &Delays) -> Settle {
    match outcome {
        Outcome::Claimed | Outcome::AlreadyClaimed | Outcome::ExecutorFailed | Outcome::Held => {
            Settle::Ack
        }
        Outcome::Poison | Outcome::Plaintext | Outcome::Expired | Outcome::Replayed => Settle::Term,
        Outcome::Full => Settle::Nak(Some(retry_hint.unwrap_or(d.full))),
        Outcome::NotReady => Settle::Nak(Some(d.not_ready)),
        Outcome::InFlight => Settle::Nak(Some(d.progress)),
        Outcome::BackendError | Outcome::MissingKey | Outcome::ReportPending => {
            Settle::Nak(Some(d.error))
        }
        Outcome::Interrupted => Settle::Nak(None),
    }
}

/// What becomes of a delivery whose envelope did not open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Unopened {
    /// Sealed with a task key this process lacks: a configuration fault (e.g. a rotation
    /// rolled out in the wrong order) or a stranger's message, not a job this backend can
    /// start. Set aside on the held subject, so it holds no admission slot (invariant 21).
    Hold,
    /// Never retried: settled with this outcome; `why` is the log line's message.
    Terminate { outcome: Outcome, why: &'static str },
}

/// Invariant 21 and the queue's trust rules: which envelopes wait for their key, and why
/// every other one is terminated.
pub(super) fn unopened(error: &EnvelopeError) -> Unopened {
    let terminate = |outcome, why| Unopened::Terminate { outcome, why };
    match error {
        EnvelopeError::UnknownKey(_) | EnvelopeError::NoKeyring => Unopened::Hold,
        EnvelopeError::Plaintext => terminate(
            Outcome::Plaintext,
            "terminating a plaintext assignment: anyone able to publish could have written it",
        ),
        EnvelopeError::Expired { .. } | EnvelopeError::FromTheFuture { .. } => terminate(
            Outcome::Expired,
            "terminating an assignment outside its lifetime (stale or replayed)",
        ),
        EnvelopeError::Undated => terminate(
            Outcome::Expired,
            "terminating an assignment without a fetch time: its age cannot be checked, so it could be a replay (Gitea fails its task at its zombie timeout)",
        ),
        _ => terminate(
            Outcome::Poison,
            "terminating an undecodable or tampered assignment: it is never retried, and Gitea fails its task at its zombie timeout",
        ),
    }
}

/// What the worker observed of an executor, as far as its decisions go.
#[derive(Debug, Clone, Copy)]
pub(super) struct Observed<'a> {
    pub name: &'a str,
    /// The runner claimed the task, or Gitea has its result (invariants 9, 10).
    pub settled: bool,
    pub phase: &'a Phase,
    pub created_at: SystemTime,
}

impl<'a> From<&'a ExecutorRecord> for Observed<'a> {
    fn from(r: &'a ExecutorRecord) -> Self {
        Observed {
            name: &r.name,
            settled: r.claimed || r.terminal,
            phase: &r.phase,
            created_at: r.created_at,
        }
    }
}

/// What a delivery does once it knows whether the job finished before (asked only of an
/// assignment whose executor, if any, is not [`Observed::settled`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Start {
    /// Finished before and nothing is left of it: a replayed envelope, terminated.
    Replayed,
    /// Failed before, but its executor is still there (its clean-up failed, or the
    /// controller restarted after the report): failed again (Gitea keeps the first result)
    /// and cleaned up, never offered (invariants 12, 20).
    FailAgain(String),
    /// Take a slot, offer the task, create or adopt the executor.
    Admit,
}

/// Invariant 20: the record of a job's end outlives its executor.
pub(super) fn start(existing: Option<&Observed<'_>>, finished: bool) -> Start {
    match (finished, existing) {
        (false, _) => Start::Admit,
        (true, None) => Start::Replayed,
        (true, Some(e)) => Start::FailAgain(format!(
            "the job was failed before its runner claimed it; its executor {} is removed",
            e.name
        )),
    }
}

/// Why an executor created at `created_at` is past its start `deadline` at `now`, if it
/// is. Counted from the creation, not from the delivery, so a controller that restarts
/// again and again still fails a stuck executor.
pub(super) fn start_overdue(
    executor: &Observed<'_>,
    waiting_for: Option<&str>,
    now: SystemTime,
    deadline: Duration,
) -> Option<String> {
    let age = now.duration_since(executor.created_at).unwrap_or_default();
    (age > deadline).then(|| {
        let within = humantime_serde::re::humantime::format_duration(deadline);
        let name = executor.name;
        match waiting_for {
            Some(why) => {
                format!("the executor {name} did not start the job within {within}: {why}")
            }
            None => format!("the executor {name} did not start the job within {within}"),
        }
    })
}

/// Whether the executor the worker waits on has failed to start its job, from a fresh look
/// at it (`current`: `None` when the backend no longer has it); `None` while its runner may
/// still claim. `created` is the executor as the delivery created or found it.
pub(super) fn executor_failure(
    created: &Observed<'_>,
    current: Option<&Observed<'_>>,
    now: SystemTime,
    deadline: Duration,
) -> Option<(FailureReason, String)> {
    let overdue = |c: &Observed<'_>, why: Option<&str>| {
        start_overdue(c, why, now, deadline).map(|f| (FailureReason::StartDeadline, f))
    };
    let Some(current) = current else {
        return Some((
            FailureReason::Disappeared,
            format!(
                "the executor {} disappeared before its runner fetched the task",
                created.name
            ),
        ));
    };
    if current.settled {
        return None;
    }
    match current.phase {
        Phase::Finished { success, reason } => Some((
            FailureReason::EndedBeforeClaim,
            format!(
                "the executor {} ended before its runner fetched the task ({})",
                current.name,
                reason.clone().unwrap_or_else(|| if *success {
                    "exit 0".into()
                } else {
                    "failed".into()
                })
            ),
        )),
        Phase::Starting { reason } => overdue(current, reason.as_deref()),
        Phase::Running => overdue(current, None),
    }
}

/// What follows a create that answered with an error, from a second look at the backend
/// (`found`: whether it has the executor, `None` when it cannot tell): a create may have
/// stored the executor before failing (invariant 6: nothing runs beyond capacity, so the
/// slot goes back only when the backend confirms there is none).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum AfterCreateError {
    /// The backend has the executor after all: go on with it, slot kept.
    GoOn,
    /// Nothing was created: release the slot and the offer, then settle by the error.
    Release,
    /// The backend cannot tell: keep the slot until a later look tells, retry.
    KeepAndRetry,
    /// Settle by the error with the slot kept (a permanent refusal fails the job, and the
    /// failure frees the slot once Gitea has it).
    Keep,
}

/// See [`AfterCreateError`]; `permanent`: the backend refused for good.
pub(super) fn after_create_error(permanent: bool, found: Option<bool>) -> AfterCreateError {
    match (found, permanent) {
        (Some(true), true) | (None, true) => AfterCreateError::Keep,
        (Some(true), false) => AfterCreateError::GoOn,
        (Some(false), _) => AfterCreateError::Release,
        (None, false) => AfterCreateError::KeepAndRetry,
    }
}

/// The consumer's re-subscribe count: every way a pull ends (it cannot start, it breaks,
/// the stream just ends) is a failure until a message arrives again, so a consumer whose
/// stream keeps ending backs off like one whose pull keeps failing instead of spinning.
#[derive(Debug, Default)]
pub(super) struct Resubscribes {
    failures: u32,
}

impl Resubscribes {
    /// A message arrived: the next failure is a first one again.
    pub(super) fn delivered(&mut self) {
        self.failures = 0;
    }

    /// The pull ended; answers the attempt number (0-based) whose backoff delay to wait.
    pub(super) fn failed(&mut self) -> u32 {
        let attempt = self.failures;
        self.failures = self.failures.saturating_add(1);
        attempt
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEADLINE: Duration = Duration::from_secs(300);

    fn delays() -> Delays {
        let s = Duration::from_secs;
        Delays {
            full: s(1),
            not_ready: s(2),
            error: s(3),
            progress: s(4),
        }
    }

    fn executor(phase: &Phase, settled: bool, created_at: SystemTime) -> Observed<'_> {
        Observed {
            name: "gitea-task-7",
            settled,
            phase,
            created_at,
        }
    }

    /// DESIGN invariants 5, 9, 12: a claimed, already-claimed, failed-and-reported or held
    /// delivery leaves the stream; a poisoned, plaintext, expired or replayed one is never
    /// redelivered; everything else is put back with its own delay.
    #[test]
    fn every_outcome_settles_its_delivery_with_its_own_delay() {
        let d = delays();
        let s = Duration::from_secs;
        let cases = [
            (Outcome::Claimed, Settle::Ack),
            (Outcome::AlreadyClaimed, Settle::Ack),
            (Outcome::ExecutorFailed, Settle::Ack),
            (Outcome::Held, Settle::Ack),
            (Outcome::Poison, Settle::Term),
            (Outcome::Plaintext, Settle::Term),
            (Outcome::Expired, Settle::Term),
            (Outcome::Replayed, Settle::Term),
            (Outcome::Full, Settle::Nak(Some(s(1)))),
            (Outcome::NotReady, Settle::Nak(Some(s(2)))),
            (Outcome::BackendError, Settle::Nak(Some(s(3)))),
            (Outcome::MissingKey, Settle::Nak(Some(s(3)))),
            (Outcome::ReportPending, Settle::Nak(Some(s(3)))),
            (Outcome::InFlight, Settle::Nak(Some(s(4)))),
            (Outcome::Interrupted, Settle::Nak(None)),
        ];
        assert_eq!(cases.len(), Outcome::ALL.len(), "every outcome is covered");
        for (outcome, settle) in cases {
            assert_eq!(settlement(outcome, None, &d), settle, "{outcome:?}");
        }
        // A full backend's own hint wins over the configured delay.
        assert_eq!(
            settlement(Outcome::Full, Some(s(30)), &d),
            Settle::Nak(Some(s(30)))
        );
    }

    /// Invariant 21: only a missing task key holds an envelope (it waits on the held
    /// subject for its key, holding no slot); a plaintext one where a key is configured,
    /// one outside its lifetime and an undecodable or tampered one are terminated.
    #[test]
    fn only_a_missing_task_key_holds_an_envelope_every_other_refusal_terminates_it() {
        let d = delays();
        for e in [
            EnvelopeError::UnknownKey("0123456789abcdef".into()),
            EnvelopeError::NoKeyring,
        ] {
            assert_eq!(unopened(&e), Unopened::Hold, "{e}");
        }
        // Set aside: acked once the held subject has it; put back while it cannot be stored.
        assert_eq!(settlement(Outcome::Held, None, &d), Settle::Ack);
        assert_eq!(
            settlement(Outcome::MissingKey, None, &d),
            Settle::Nak(Some(d.error))
        );

        let terminated = [
            (EnvelopeError::Plaintext, Outcome::Plaintext),
            (
                EnvelopeError::Expired {
                    age: 90_000,
                    max_age: 86_400,
                },
                Outcome::Expired,
            ),
            (
                EnvelopeError::FromTheFuture { ahead: 600 },
                Outcome::Expired,
            ),
            (EnvelopeError::Undated, Outcome::Expired),
            (EnvelopeError::Malformed("not JSON".into()), Outcome::Poison),
            (EnvelopeError::UnsupportedVersion(3), Outcome::Poison),
            (EnvelopeError::Decrypt, Outcome::Poison),
            (EnvelopeError::Tampered { field: "id" }, Outcome::Poison),
        ];
        for (e, expected) in terminated {
            let Unopened::Terminate { outcome, .. } = unopened(&e) else {
                panic!("{e}: held");
            };
            assert_eq!(outcome, expected, "{e}");
            // Never redelivered.
            assert_eq!(settlement(outcome, None, &d), Settle::Term, "{e}");
        }
    }

    /// DESIGN invariants 12 and 20: a new job is admitted; a finished one with nothing
    /// left is a replay; a finished one whose executor is still there is failed again,
    /// never offered.
    #[test]
    fn a_delivery_admits_a_new_job_and_never_offers_a_finished_one() {
        let now = SystemTime::now();
        let phase = Phase::Starting { reason: None };
        let left = executor(&phase, false, now);
        assert_eq!(start(None, false), Start::Admit);
        assert_eq!(start(Some(&left), false), Start::Admit);
        assert_eq!(start(None, true), Start::Replayed);
        assert_eq!(
            start(Some(&left), true),
            Start::FailAgain(
                "the job was failed before its runner claimed it; its executor gitea-task-7 is removed"
                    .into()
            )
        );
    }

    /// DESIGN invariant 12: the start deadline counts from the executor's creation, with
    /// the injected time; the backend's reason for waiting is part of the failure.
    #[test]
    fn the_start_deadline_passes_only_after_the_executors_creation_plus_the_deadline() {
        let created = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let phase = Phase::Starting { reason: None };
        let e = executor(&phase, false, created);
        assert_eq!(start_overdue(&e, None, created + DEADLINE, DEADLINE), None);
        assert_eq!(
            start_overdue(
                &e,
                Some("ImagePullBackOff: no such image"),
                created + DEADLINE + Duration::from_secs(1),
                DEADLINE
            )
            .as_deref(),
            Some(
                "the executor gitea-task-7 did not start the job within 5m: ImagePullBackOff: no such image"
            )
        );
        // A clock behind the creation is no age at all.
        assert_eq!(
            start_overdue(&e, None, created - Duration::from_secs(10), DEADLINE),
            None
        );
    }

    /// DESIGN invariants 9 and 12, while the worker waits for the claim: a claimed (or
    /// terminal) executor is the runner's; one that ended, disappeared or is past its
    /// deadline failed to start, each with its own reason; a starting or running one
    /// within the deadline may still claim.
    #[test]
    fn waiting_for_the_claim_tells_a_failed_start_from_one_that_may_still_claim() {
        let created = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let within = created + Duration::from_secs(10);
        let late = created + DEADLINE + Duration::from_secs(1);
        let starting = Phase::Starting {
            reason: Some("Unschedulable: 0/3 nodes".into()),
        };
        let running = Phase::Running;
        let ended = Phase::Finished {
            success: false,
            reason: Some("OOMKilled".into()),
        };
        let exited = Phase::Finished {
            success: true,
            reason: None,
        };
        let e = |phase, settled| executor(phase, settled, created);
        let created_one = e(&starting, false);
        let reason = |current: Option<Observed<'_>>, now| {
            executor_failure(&created_one, current.as_ref(), now, DEADLINE).map(|(r, _)| r)
        };
        assert_eq!(reason(Some(e(&starting, false)), within), None);
        assert_eq!(reason(Some(e(&running, false)), within), None);
        assert_eq!(
            reason(Some(e(&ended, true)), late),
            None,
            "claimed: the runner's"
        );
        assert_eq!(
            reason(Some(e(&starting, false)), late),
            Some(FailureReason::StartDeadline)
        );
        assert_eq!(
            reason(Some(e(&running, false)), late),
            Some(FailureReason::StartDeadline)
        );
        assert_eq!(
            reason(Some(e(&ended, false)), within),
            Some(FailureReason::EndedBeforeClaim)
        );
        assert_eq!(reason(None, within), Some(FailureReason::Disappeared));
        let text = |current: Observed<'_>| {
            executor_failure(&created_one, Some(&current), within, DEADLINE)
                .map(|(_, t)| t)
                .unwrap_or_default()
        };
        assert_eq!(
            text(e(&ended, false)),
            "the executor gitea-task-7 ended before its runner fetched the task (OOMKilled)"
        );
        assert_eq!(
            text(e(&exited, false)),
            "the executor gitea-task-7 ended before its runner fetched the task (exit 0)"
        );
    }

    /// DESIGN invariant 6: after a create that answered with an error, the slot goes back
    /// only when the backend confirms that nothing was created; an executor it has after
    /// all is gone on with, unless the refusal was for good.
    #[test]
    fn a_failed_create_releases_its_slot_only_when_the_backend_has_no_executor() {
        use AfterCreateError::*;
        assert_eq!(after_create_error(false, Some(true)), GoOn);
        assert_eq!(after_create_error(true, Some(true)), Keep);
        assert_eq!(after_create_error(false, Some(false)), Release);
        assert_eq!(after_create_error(true, Some(false)), Release);
        assert_eq!(after_create_error(false, None), KeepAndRetry);
        assert_eq!(after_create_error(true, None), Keep);
    }

    /// A stream that keeps ending waits longer each time; a message resets the backoff.
    #[test]
    fn a_stream_that_keeps_ending_backs_off() {
        let backoff = super::super::RESUBSCRIBE;
        let mut resubscribes = Resubscribes::default();
        let ceilings: Vec<Duration> = (0..4)
            .map(|_| backoff.ceiling(resubscribes.failed()))
            .collect();
        assert!(ceilings[0] > Duration::ZERO);
        assert!(ceilings.windows(2).all(|w| w[0] < w[1]), "{ceilings:?}");
        resubscribes.delivered();
        assert_eq!(resubscribes.failed(), 0);
        let mut saturated = Resubscribes { failures: u32::MAX };
        assert_eq!(saturated.failed(), u32::MAX);
        assert_eq!(saturated.failed(), u32::MAX);
    }
}
