//! The warm pool's calls (see [`super::warm`] for the design): listing and refilling the
//! pool, and a job's claim of one member.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use gdr_core::assignment::AssignmentId;
use gdr_core::executor::{ExecutorError, ExecutorRecord, ExecutorSpec, Phase};
use gdr_core::metadata::keys;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams, Preconditions};

use super::error::*;
pub use crate::warm::WarmPass;

use super::warm::{self, Member, State};
use super::{Inner, created_at, manifest, phase};

/// How often a claim patch is retried after the member changed under it.
const CLAIM_ATTEMPTS: usize = 5;

/// Tells apart the names of the Pods one process creates within one clock tick.
static SEQUENCE: AtomicU64 = AtomicU64::new(0);

/// A new member's name: unique enough that a collision is only a failed create, retried
/// by the next pass.
fn member_name() -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let n = SEQUENCE.fetch_add(1, Ordering::Relaxed);
    format!(
        "{}{:x}{:x}{n:x}",
        warm::NAME_PREFIX,
        nanos % (1 << 48),
        std::process::id()
    )
}

fn unix_secs(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

fn is_conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 409)
}

impl Inner {
    fn warm_key(&self) -> String {
        self.settings.codec.key(warm::WARM_KEY)
    }

    /// Whether `pod` is a pool member a job claimed (named unlike its assignment).
    pub(super) fn is_claimed_warm(&self, pod: &Pod) -> bool {
        pod.labels().get(&self.warm_key()).map(String::as_str) == Some(warm::CLAIMED)
    }

    /// When a claimed member was claimed: its start as an executor.
    pub(super) fn claimed_at(&self, pod: &Pod) -> Option<SystemTime> {
        let secs: u64 = pod
            .annotations()
            .get(&self.settings.codec.key(warm::CLAIMED_AT_KEY))?
            .parse()
            .ok()?;
        Some(UNIX_EPOCH + std::time::Duration::from_secs(secs))
    }

    /// The unclaimed members, as the API server holds them.
    async fn list_warm(&self) -> Result<Vec<Pod>, ExecutorError> {
        let selector = format!("{}={}", self.warm_key(), warm::UNCLAIMED);
        Ok(self
            .pods
            .list(&ListParams::default().labels(&selector))
            .await
            .map_err(|e| self.err(LIST_PODS, self.ns(), e))?
            .items)
    }

    /// The claimed member running `id`'s job, if any (the first by name, should two
    /// claims of one assignment ever have raced: see [`Inner::claim`]).
    pub(super) async fn claimed_warm(
        &self,
        id: &AssignmentId,
    ) -> Result<Option<Pod>, ExecutorError> {
        let codec = &self.settings.codec;
        let selector = format!(
            "{},{}={}",
            codec.assignment_selector(id),
            self.warm_key(),
            warm::CLAIMED
        );
        let mut pods = self
            .pods
            .list(&ListParams::default().labels(&selector))
            .await
            .map_err(|e| self.err(LIST_PODS, self.ns(), e))?
            .items;
        pods.sort_by_key(ResourceExt::name_any);
        Ok(pods.into_iter().next())
    }

    /// `pod` as a pool member; `locked_since`: when a capability Secret of it was
    /// created, if one exists (a claim under way, or one that died before its patch).
    fn member(&self, pod: &Pod, locked_since: Option<SystemTime>) -> Member {
        let now = SystemTime::now();
        let older_than = |since: SystemTime, limit| {
            now.duration_since(since)
                .is_ok_and(|age: std::time::Duration| age >= limit)
        };
        // A claim that died between its Secret and its patch leaves the member locked for
        // good: past the orphan grace it is discarded like an ended one.
        let stale = locked_since.is_some_and(|t| older_than(t, self.settings.orphan_secret_grace));
        let profile = pod
            .annotations()
            .get(&self.settings.codec.key(warm::PROFILE_KEY))
            .cloned();
        let created = created_at(pod);
        let state = if pod.metadata.deletion_timestamp.is_some() {
            State::Deleting
        } else if stale {
            State::Ended
        } else if !self.of_current_template(pod, profile.as_deref()) {
            State::Outdated
        } else {
            match phase(pod) {
                Phase::Starting { .. }
                    if older_than(created, self.settings.warm_start_deadline) =>
                {
                    State::Stalled
                }
                Phase::Starting { .. } => State::Starting,
                Phase::Running => State::Ready,
                Phase::Finished { .. } => State::Ended,
            }
        };
        Member {
            name: pod.name_any(),
            profile,
            state,
            created,
        }
    }

    /// Whether `pod` was made from the template the settings make now for its profile (a
    /// profile no longer configured has none: its members are outdated).
    fn of_current_template(&self, pod: &Pod, profile_label: Option<&str>) -> bool {
        let profile = match profile_label {
            Some(label) => match self.settings.profiles.get(label) {
                Some(p) => Some(p),
                None => return false,
            },
            None => None,
        };
        let current = manifest::warm_template_fingerprint(&self.settings, profile_label, profile);
        pod.annotations()
            .get(&self.settings.codec.key(warm::TEMPLATE_KEY))
            .is_some_and(|theirs| *theirs == current)
    }

    /// When each capability Secret was created, by name.
    async fn secrets_created(&self) -> Result<BTreeMap<String, SystemTime>, ExecutorError> {
        let selector = manifest::component_selector(manifest::COMPONENT_CAPABILITY);
        Ok(self
            .secrets
            .list(&ListParams::default().labels(&selector))
            .await
            .map_err(|e| self.err(LIST_SECRETS, self.ns(), e))?
            .items
            .into_iter()
            .map(|s| {
                let created = s
                    .metadata
                    .creation_timestamp
                    .as_ref()
                    .map_or_else(SystemTime::now, |t| SystemTime::from(t.0));
                (s.name_any(), created)
            })
            .collect())
    }

    /// One pass: the pool brought to the configured counts from what the cluster holds.
    pub(super) async fn reconcile_warm(&self) -> Result<WarmPass, ExecutorError> {
        let pods = self.list_warm().await?;
        let secrets = if pods.is_empty() {
            BTreeMap::new()
        } else {
            self.secrets_created().await?
        };
        let members: Vec<Member> = pods
            .iter()
            .map(|p| {
                let locked = secrets
                    .get(&manifest::secret_name_of(&p.name_any()))
                    .copied();
                self.member(p, locked)
            })
            .collect();
        let wanted = self.settings.warm_pools();
        let plan = warm::plan(&wanted, &members);
        let mut pass = WarmPass {
            members: WarmPass::left(&wanted, &members, &plan),
            claims: self.claims.take(),
            ..WarmPass::default()
        };
        for name in &plan.delete {
            let Some((pod, member)) = pods
                .iter()
                .zip(&members)
                .find(|(p, _)| &p.name_any() == name)
            else {
                continue;
            };
            // Only the member as seen: one claimed since has another resourceVersion.
            let dp = DeleteParams {
                preconditions: Some(Preconditions {
                    uid: pod.uid(),
                    resource_version: pod.resource_version(),
                }),
                ..DeleteParams::background()
            };
            match self.pods.delete(name, &dp).await {
                Ok(_) => {
                    pass.deleted += 1;
                    *pass
                        .deleted_by
                        .entry(member.state.deletion_kind())
                        .or_default() += 1;
                    tracing::info!(pod = %name, profile = ?member.profile, reason = member.state.deletion_reason(), "warm Pod deleted");
                }
                Err(e) if is_conflict(&e) || is_not_found(&e) => {}
                Err(e) => return Err(self.err(DELETE_POD, name, e)),
            }
        }
        for profile_label in plan.create {
            let profile = profile_label
                .as_deref()
                .and_then(|l| self.settings.profiles.get(l));
            let name = member_name();
            let pod = manifest::warm_pod(&self.settings, &name, profile_label.as_deref(), profile);
            match self.pods.create(&PostParams::default(), &pod).await {
                Ok(_) => {
                    pass.created += 1;
                    tracing::info!(pod = %name, profile = ?profile_label, "warm Pod created");
                }
                Err(e) if is_already_exists(&e) => {}
                Err(e) => return Err(self.err(CREATE_POD, &name, e)),
            }
        }
        Ok(pass)
    }

    /// Creates the capability Secret of the member `pod` for `spec`'s job. `Ok(false)`:
    /// the member has one of another job's, whose claim holds it.
    pub(super) async fn ensure_claimed_secret(
        &self,
        spec: &ExecutorSpec,
        pod: &Pod,
    ) -> Result<bool, ExecutorError> {
        let name = pod.name_any();
        let Some(uid) = pod.uid() else {
            return Ok(false);
        };
        let secret = manifest::claimed_capability_secret(&self.settings, spec, &name, &uid);
        let secret_name = manifest::secret_name_of(&name);
        match self.secrets.create(&PostParams::default(), &secret).await {
            Ok(_) => Ok(true),
            Err(e) if is_already_exists(&e) => {
                // Whether it is this job's (an earlier attempt of this claim): selected by
                // its labels, since the controller may list Secrets but not get them.
                let selector = format!(
                    "{},{}={}",
                    manifest::component_selector(manifest::COMPONENT_CAPABILITY),
                    self.settings.codec.key(keys::ASSIGNMENT_ID),
                    spec.assignment.id()
                );
                let params = ListParams::default()
                    .labels(&selector)
                    .fields(&format!("metadata.name={secret_name}"));
                let found = self
                    .secrets
                    .list(&params)
                    .await
                    .map_err(|e| self.err(LIST_SECRETS, self.ns(), e))?;
                Ok(!found.items.is_empty())
            }
            Err(e) => Err(self.err(CREATE_SECRET, &secret_name, e)),
        }
    }

    /// Claims a ready member of `profile` for `spec`'s job, if its profile is pooled and
    /// one is there (`None`: create a fresh Pod).
    ///
    /// The member's capability Secret is created first: its name is the member's, so of
    /// two claims only the one that created it goes on (the other tries the next member),
    /// and the kubelet finds it when the claim's change of the Pod makes it refresh the
    /// Pod's volume. The claim itself is one patch with the member's `resourceVersion` as
    /// precondition; a 409 (the kubelet wrote the Pod's status meanwhile) is retried on a
    /// fresh read while the member is still unclaimed and not being deleted.
    pub(super) async fn claim(
        &self,
        spec: &ExecutorSpec,
        profile: Option<&str>,
    ) -> Result<Option<ExecutorRecord>, ExecutorError> {
        let pooled = match profile {
            Some(label) => self.settings.profiles.get(label).map_or(0, |p| p.warm_pool),
            None => self.settings.warm_pool,
        };
        if pooled == 0 {
            return Ok(None);
        }
        let pods = self.list_warm().await?;
        let members: Vec<Member> = pods.iter().map(|p| self.member(p, None)).collect();
        for member in warm::candidates(&members, profile) {
            let Some(pod) = pods.iter().find(|p| p.name_any() == member.name) else {
                continue;
            };
            if !self.ensure_claimed_secret(spec, pod).await? {
                continue;
            }
            if let Some(claimed) = self.patch_claim(spec, pod.clone()).await? {
                self.claims.count(true);
                return self.claimed(spec, claimed).await.map(Some);
            }
        }
        self.claims.count(false);
        tracing::info!(assignment_id = %spec.assignment.id(), profile = ?profile, "no warm Pod ready for the job; creating its own");
        Ok(None)
    }

    /// The claim patch of `pod` for `spec`'s job, retried on a fresh read after a 409
    /// while the member is claimable; `None`: it is not (deleted, being deleted).
    async fn patch_claim(
        &self,
        spec: &ExecutorSpec,
        mut pod: Pod,
    ) -> Result<Option<Pod>, ExecutorError> {
        let name = pod.name_any();
        let ours = (
            self.settings.codec.key(keys::ASSIGNMENT_ID),
            spec.assignment.id().as_str(),
        );
        for _ in 0..CLAIM_ATTEMPTS {
            // Claimed meanwhile by another attempt of this same job: it is this job's Pod,
            // and its Secret stays.
            if self.is_claimed_warm(&pod)
                && pod.labels().get(&ours.0).map(String::as_str) == Some(ours.1)
            {
                return Ok(Some(pod));
            }
            // Read again after a 409: a member that stopped running since the listing
            // (its executor ended, its node went) is not claimed, and the job tries the
            // next one or a fresh Pod.
            let claimable = pod.metadata.deletion_timestamp.is_none()
                && pod.labels().get(&self.warm_key()).map(String::as_str) == Some(warm::UNCLAIMED)
                && phase(&pod) == Phase::Running;
            if !claimable {
                break;
            }
            let Some(version) = pod.resource_version() else {
                break;
            };
            let now = SystemTime::now();
            let age = unix_secs(now).saturating_sub(unix_secs(created_at(&pod)));
            let patch = manifest::claim_patch(&self.settings, spec, &version, unix_secs(now), age);
            match self
                .pods
                .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Ok(claimed) => return Ok(Some(claimed)),
                Err(e) if is_conflict(&e) => match self.get_pod(&name).await? {
                    Some(fresh) => pod = fresh,
                    None => break,
                },
                Err(e) if is_not_found(&e) => break,
                Err(e) => return Err(self.err(PATCH_POD, &name, e)),
            }
        }
        // Not claimed: its Secret goes (the Pod's deletion would take it too).
        let secret = manifest::secret_name_of(&name);
        self.delete_named(
            &self.secrets,
            DELETE_SECRET,
            &secret,
            &DeleteParams::background(),
        )
        .await?;
        Ok(None)
    }

    /// After a successful claim: should two claims of one assignment have raced (a
    /// redelivery while the first still ran), the first Pod by name keeps the job and the
    /// other is deleted before it ever got a capability; the winner gets its Secret.
    async fn claimed(
        &self,
        spec: &ExecutorSpec,
        pod: Pod,
    ) -> Result<ExecutorRecord, ExecutorError> {
        let id = spec.assignment.id();
        let winner = match self.get_pod(id.as_str()).await? {
            Some(fresh) => Some(fresh),
            None => self.claimed_warm(id).await?,
        };
        let pod = match winner {
            Some(w) if w.name_any() != pod.name_any() => {
                let dp = DeleteParams {
                    preconditions: Some(Preconditions {
                        uid: pod.uid(),
                        resource_version: None,
                    }),
                    ..DeleteParams::background()
                };
                match self.pods.delete(&pod.name_any(), &dp).await {
                    Ok(_) => {}
                    Err(e) if is_conflict(&e) || is_not_found(&e) => {}
                    Err(e) => return Err(self.err(DELETE_POD, &pod.name_any(), e)),
                }
                tracing::warn!(assignment_id = %id, pod = %pod.name_any(), kept = %w.name_any(), "two Pods claimed for one assignment; the second was deleted before it got a capability");
                w
            }
            _ => pod,
        };
        tracing::info!(assignment_id = %id, pod = %pod.name_any(), uid = ?pod.uid(), namespace = %self.ns(), "warm Pod claimed");
        let assignment = self.decode(&pod)?;
        Ok(self.record(&pod, assignment, None))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn member(name: &str, profile: Option<&str>, state: State) -> Member {
        Member {
            name: name.into(),
            profile: profile.map(str::to_owned),
            state,
            created: UNIX_EPOCH + Duration::from_secs(1),
        }
    }

    /// What `warm_environments` shows: the members a pass keeps and creates, by profile
    /// and state, with every pooled profile present at zero.
    #[test]
    fn a_pass_reports_the_members_it_leaves_with_every_pooled_profile_at_zero_too() {
        let wanted = BTreeMap::from([(None, 2), (Some("large".to_owned()), 1)]);
        let members = [
            member("ready", None, State::Ready),
            member("outdated", None, State::Outdated),
            member("gone", Some("gpu"), State::Ready),
        ];
        let plan = warm::plan(&wanted, &members);
        let left = WarmPass::left(&wanted, &members, &plan);
        let at = |p: Option<&str>, s: &'static str| left.get(&(p.map(str::to_owned), s)).copied();
        assert_eq!(at(None, "ready"), Some(1));
        assert_eq!(
            at(None, "starting"),
            Some(1),
            "the replacement of the outdated one"
        );
        assert_eq!(at(Some("large"), "ready"), Some(0));
        assert_eq!(at(Some("large"), "starting"), Some(1));
        assert_eq!(
            at(Some("gpu"), "ready"),
            None,
            "deleted: its profile is not pooled"
        );
    }
}
