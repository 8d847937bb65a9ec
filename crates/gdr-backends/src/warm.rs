//! The backend-neutral part of a warm pool (issue 39 item 5): executors created before
//! any job, so a job's start does not wait for its environment's. What to create and
//! delete is [`plan`], a pure function of the configured counts and the members observed
//! on the backend, run on every lifecycle pass: a restart loses nothing, since nothing is
//! remembered between passes. Used by the Pod backend (`pod_warm_pool`,
//! [`crate::kubernetes::warm`]) and the OpenSandbox backend (`vm_warm_pool`).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::SystemTime;

/// `<prefix>warm` of a member created for the pool and not claimed.
pub const UNCLAIMED: &str = "true";
/// `<prefix>warm` of a pool member a job claimed.
pub const CLAIMED: &str = "claimed";
/// Metadata key (under the codec's prefix) marking pool members.
pub const WARM_KEY: &str = "warm";
/// Metadata key (under the prefix): when the member was claimed (Unix seconds); the
/// executor's start deadline counts from here, not from the member's creation.
pub const CLAIMED_AT_KEY: &str = "warm-claimed-at";
/// Metadata key (under the prefix): the fingerprint of the template a member was made
/// from ([`template_fingerprint`]); a member of another template (made under earlier
/// settings) is replaced, never claimed.
pub const TEMPLATE_KEY: &str = "warm-template";

/// Where an unclaimed member is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// Created, its executor not running yet.
    Starting,
    /// Its executor runs, waiting for a job: claimable.
    Ready,
    /// Its executor ended (or its Pod or sandbox failed): it can serve no job.
    Ended,
    /// Made from another template (Pod template, sandbox request) than the current
    /// settings make: it would run a job with the old image, resources or environment.
    Outdated,
    /// Not running within the start deadline (its image cannot be pulled, it cannot be
    /// scheduled): it holds a place in the pool it cannot fill.
    Stalled,
    /// Being deleted.
    Deleting,
}

/// One unclaimed pool member as observed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    /// Backend object name (Pod name, sandbox ID).
    pub name: String,
    /// The profile it was made for (`None`: no profile).
    pub profile: Option<String>,
    /// Observed state.
    pub state: State,
    /// When it was created.
    pub created: SystemTime,
}

/// What one pass does to the pool.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Plan {
    /// One entry per member to create: its profile.
    pub create: Vec<Option<String>>,
    /// Members to delete: ended ones, those of a profile no longer pooled, a surplus.
    pub delete: Vec<String>,
}

/// What one pass over the pool did, and the pool it left.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct WarmPass {
    /// Pods created for the pool.
    pub created: usize,
    /// Members deleted (ended, outdated, stalled, surplus, of a profile no longer pooled).
    pub deleted: usize,
    /// Members deleted, by [`State::deletion_kind`].
    pub deleted_by: BTreeMap<&'static str, usize>,
    /// Unclaimed members left, by profile (`None`: without one): running (`ready`) or
    /// not yet (`starting`, the ones this pass created included).
    pub members: BTreeMap<(Option<String>, &'static str), usize>,
    /// Jobs' claims since the previous pass, by [`CLAIM_OUTCOMES`].
    pub claims: BTreeMap<&'static str, usize>,
}

impl WarmPass {
    /// The members a pass leaves: those it kept, and the ones it created as starting;
    /// every pooled profile's counts, at zero too.
    pub(crate) fn left(
        wanted: &BTreeMap<Option<String>, u32>,
        members: &[Member],
        plan: &Plan,
    ) -> BTreeMap<(Option<String>, &'static str), usize> {
        let mut left: BTreeMap<(Option<String>, &'static str), usize> = wanted
            .keys()
            .flat_map(|p| [((p.clone(), "ready"), 0), ((p.clone(), "starting"), 0)])
            .collect();
        for m in members.iter().filter(|m| !plan.delete.contains(&m.name)) {
            let state = match m.state {
                State::Ready => "ready",
                State::Starting => "starting",
                State::Ended | State::Outdated | State::Stalled | State::Deleting => continue,
            };
            *left.entry((m.profile.clone(), state)).or_default() += 1;
        }
        for profile in &plan.create {
            *left.entry((profile.clone(), "starting")).or_default() += 1;
        }
        left
    }
}

/// The pass that brings the observed `members` to the `wanted` counts per profile: every
/// ended, outdated or stalled member is discarded (and so replaced); a profile short of its
/// count gets new members (members still starting count, so a slow start is not answered
/// with more); a surplus loses its starting members first, then its newest, keeping the
/// oldest ready ones.
pub fn plan(wanted: &BTreeMap<Option<String>, u32>, members: &[Member]) -> Plan {
    let mut plan = Plan::default();
    let mut live: BTreeMap<Option<String>, Vec<&Member>> = BTreeMap::new();
    for m in members {
        match m.state {
            State::Ended | State::Outdated | State::Stalled => plan.delete.push(m.name.clone()),
            State::Deleting => {}
            State::Starting | State::Ready => live.entry(m.profile.clone()).or_default().push(m),
        }
    }
    for (profile, want) in wanted {
        let have = live.get(profile).map_or(0, Vec::len);
        let want = usize::try_from(*want).unwrap_or(usize::MAX);
        plan.create.extend(std::iter::repeat_n(
            profile.clone(),
            want.saturating_sub(have),
        ));
    }
    for (profile, mut pods) in live {
        let want = wanted
            .get(&profile)
            .map_or(0, |n| usize::try_from(*n).unwrap_or(usize::MAX));
        if pods.len() <= want {
            continue;
        }
        // Kept first: ready before starting, older before newer.
        pods.sort_by_key(|m| (m.state != State::Ready, m.created, m.name.clone()));
        plan.delete
            .extend(pods.into_iter().skip(want).map(|m| m.name.clone()));
    }
    plan
}

impl State {
    /// Why a pass deletes a member in this state, for its log line.
    pub fn deletion_reason(self) -> &'static str {
        match self {
            State::Ended => "its executor ended, or a claim that died left it locked",
            State::Outdated => {
                "made from an earlier Pod template or sandbox request (the settings changed)"
            }
            State::Stalled => "not running within executor_start_deadline",
            State::Starting | State::Ready | State::Deleting => "surplus: more than the count",
        }
    }

    /// The same as one word, a metric's label value: `ended`, `outdated`, `stalled` or
    /// `surplus`.
    pub fn deletion_kind(self) -> &'static str {
        match self {
            State::Ended => "ended",
            State::Outdated => "outdated",
            State::Stalled => "stalled",
            State::Starting | State::Ready | State::Deleting => "surplus",
        }
    }
}

/// Every [`State::deletion_kind`].
pub const DELETION_KINDS: [&str; 4] = ["ended", "outdated", "stalled", "surplus"];

/// What a job's claim found, as counted between two passes: a ready member of its pool
/// served it (`claimed`), or none was ready and an executor was created for it (`missed`).
pub const CLAIM_OUTCOMES: [&str; 2] = ["claimed", "missed"];

/// The claims of jobs whose profile is pooled since the last pass took them.
#[derive(Debug, Default)]
pub struct ClaimCounts {
    claimed: AtomicU64,
    missed: AtomicU64,
}

impl ClaimCounts {
    /// Counts one claim: `served` when a member served the job.
    pub fn count(&self, served: bool) {
        let n = if served { &self.claimed } else { &self.missed };
        n.fetch_add(1, Ordering::Relaxed);
    }

    /// The counts since the last take, by [`CLAIM_OUTCOMES`] (both, at zero too), reset.
    pub fn take(&self) -> BTreeMap<&'static str, usize> {
        let [claimed, missed] = CLAIM_OUTCOMES;
        let take =
            |n: &AtomicU64| usize::try_from(n.swap(0, Ordering::Relaxed)).unwrap_or(usize::MAX);
        BTreeMap::from([(claimed, take(&self.claimed)), (missed, take(&self.missed))])
    }
}

/// A fingerprint of a member template's JSON (a Pod template, a sandbox request): 64-bit
/// FNV-1a, as 16 hex digits. Only told apart from another template's, never trusted: a
/// collision keeps an outdated member, it does not let anything in. Serde's output of one
/// template is the same on every pass; a controller upgrade that serialises it
/// differently replaces the pool once.
pub fn template_fingerprint(template_json: &[u8]) -> String {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0100_0000_01b3;
    let hash = template_json
        .iter()
        .fold(OFFSET, |h, b| (h ^ u64::from(*b)).wrapping_mul(PRIME));
    format!("{hash:016x}")
}

/// The members a job of `profile` may claim, in the order to try them: ready ones of that
/// profile, oldest first.
pub fn candidates<'a>(members: &'a [Member], profile: Option<&str>) -> Vec<&'a Member> {
    let mut found: Vec<&Member> = members
        .iter()
        .filter(|m| m.state == State::Ready && m.profile.as_deref() == profile)
        .collect();
    found.sort_by_key(|m| (m.created, m.name.clone()));
    found
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn member(name: &str, profile: Option<&str>, state: State, age: u64) -> Member {
        Member {
            name: name.into(),
            profile: profile.map(str::to_owned),
            state,
            created: SystemTime::UNIX_EPOCH + Duration::from_secs(1000 - age),
        }
    }

    fn wanted(counts: &[(Option<&str>, u32)]) -> BTreeMap<Option<String>, u32> {
        counts
            .iter()
            .map(|(p, n)| (p.map(str::to_owned), *n))
            .collect()
    }

    #[test]
    fn with_no_pool_configured_nothing_is_created_and_leftover_members_are_deleted_invariant_8() {
        assert_eq!(plan(&wanted(&[]), &[]), Plan::default());
        let left = [member("a", None, State::Ready, 5)];
        assert_eq!(
            plan(&wanted(&[]), &left),
            Plan {
                create: vec![],
                delete: vec!["a".into()]
            }
        );
    }

    #[test]
    fn a_short_pool_is_refilled_counting_members_still_starting_invariant_7() {
        let members = [
            member("a", None, State::Ready, 5),
            member("b", None, State::Starting, 1),
            member("c", Some("large"), State::Deleting, 9),
        ];
        let p = plan(&wanted(&[(None, 3), (Some("large"), 1)]), &members);
        assert_eq!(p.create, vec![None, Some("large".to_owned())]);
        assert!(p.delete.is_empty());
    }

    #[test]
    fn an_ended_member_is_discarded_and_replaced_invariant_12() {
        let members = [
            member("a", None, State::Ended, 5),
            member("b", None, State::Ready, 1),
        ];
        let p = plan(&wanted(&[(None, 2)]), &members);
        assert_eq!(p.delete, vec!["a".to_owned()]);
        assert_eq!(p.create, vec![None]);
    }

    #[test]
    fn a_surplus_loses_starting_members_then_the_newest_and_keeps_the_oldest_ready_ones_invariant_7()
     {
        let members = [
            member("new", None, State::Ready, 1),
            member("old", None, State::Ready, 9),
            member("starting", None, State::Starting, 20),
            member("gpu", Some("gpu"), State::Ready, 3),
        ];
        let p = plan(&wanted(&[(None, 2)]), &members);
        assert!(p.create.is_empty());
        assert_eq!(p.delete, vec!["starting", "gpu"]);
        let p = plan(&wanted(&[(None, 1)]), &members);
        assert_eq!(p.delete, vec!["new", "starting", "gpu"]);
    }

    #[test]
    fn outdated_and_stalled_members_are_discarded_and_replaced_never_claimed_invariant_8() {
        let members = [
            member("outdated", None, State::Outdated, 9),
            member("stalled", None, State::Stalled, 8),
            member("ready", None, State::Ready, 1),
        ];
        let p = plan(&wanted(&[(None, 2)]), &members);
        assert_eq!(p.delete, vec!["outdated".to_owned(), "stalled".to_owned()]);
        assert_eq!(p.create, vec![None]);
        let claimable: Vec<&str> = candidates(&members, None)
            .into_iter()
            .map(|m| m.name.as_str())
            .collect();
        assert_eq!(claimable, vec!["ready"]);
    }

    #[test]
    fn a_templates_fingerprint_is_stable_and_tells_templates_apart() {
        let a = template_fingerprint(br#"{"image":"executor:1"}"#);
        assert_eq!(a, template_fingerprint(br#"{"image":"executor:1"}"#));
        assert_ne!(a, template_fingerprint(br#"{"image":"executor:2"}"#));
        assert_eq!(a.len(), 16);
        // FNV-1a's published value for the empty input: the fingerprint is the algorithm.
        assert_eq!(template_fingerprint(b""), "cbf29ce484222325");
    }

    #[test]
    fn only_ready_members_of_the_jobs_own_profile_are_claimable_oldest_first_invariant_8() {
        let members = [
            member("new", None, State::Ready, 1),
            member("old", None, State::Ready, 9),
            member("starting", None, State::Starting, 20),
            member("ended", None, State::Ended, 30),
            member("large", Some("large"), State::Ready, 3),
        ];
        let names = |p: Option<&str>| -> Vec<String> {
            candidates(&members, p)
                .into_iter()
                .map(|m| m.name.clone())
                .collect()
        };
        assert_eq!(names(None), vec!["old", "new"]);
        assert_eq!(names(Some("large")), vec!["large"]);
        assert!(names(Some("gpu")).is_empty());
    }

    #[test]
    fn claims_are_counted_by_outcome_once_each_and_reset_when_taken_invariant_8() {
        let counts = ClaimCounts::default();
        assert_eq!(
            counts.take(),
            BTreeMap::from([("claimed", 0), ("missed", 0)])
        );
        counts.count(true);
        counts.count(true);
        counts.count(false);
        assert_eq!(
            counts.take(),
            BTreeMap::from([("claimed", 2), ("missed", 1)])
        );
        assert_eq!(
            counts.take(),
            BTreeMap::from([("claimed", 0), ("missed", 0)])
        );
    }
}
