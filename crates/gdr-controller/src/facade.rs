//! The controller's side of the facade's ports ([`gdr_facade::ports`]): the dispatch
//! answers who may call and records the claims, the backends which job claimed a warm
//! sandbox ([`BackendStandbys`]), the job metrics count the outcomes, and the
//! controller's metrics registry names the facade's connection counters. Errors and states
//! are translated here, so the facade crate never sees the controller's types.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use gdr_core::assignment::AssignmentId;
use gdr_core::backend::Backend;
use gdr_core::capability::CapabilityKey;
use gdr_facade::ports::{
    Admission, AuthError, Authorized, ClaimError, ClaimedStandby, Claims, Fetched, Finished,
    Liveness, Outcomes, Standbys,
};
use gdr_facade::tls::{FACADE_CLOSE_REASONS, FacadeStats};

pub use crate::channel::ExecutorChannel;
use crate::dispatch::{self, ClaimState, Dispatch};
use crate::job_metrics::{JobMetrics, ResultLabels};
use crate::metrics::{BackendLabel, Registrar};

impl From<dispatch::AuthError> for AuthError {
    fn from(e: dispatch::AuthError) -> Self {
        match e {
            dispatch::AuthError::UnknownAssignment => AuthError::UnknownAssignment,
            dispatch::AuthError::BadCapability => AuthError::BadCapability,
            dispatch::AuthError::WrongIdentity => AuthError::WrongIdentity,
            dispatch::AuthError::Unavailable(why) => AuthError::Unavailable(Box::new(why)),
            dispatch::AuthError::Finished => AuthError::Finished,
        }
    }
}

#[async_trait::async_trait]
impl Admission for Dispatch {
    fn capability_key(&self) -> &CapabilityKey {
        Dispatch::capability_key(self)
    }

    fn authorize(
        &self,
        assignment_id: &str,
        capability: &str,
        peer_spiffe_id: &str,
    ) -> Result<Authorized, AuthError> {
        Ok(Dispatch::authorize(
            self,
            assignment_id,
            capability,
            peer_spiffe_id,
        )?)
    }

    async fn authorize_from_backend(
        &self,
        assignment_id: &str,
        capability: &str,
        peer_spiffe_id: &str,
    ) -> Result<Authorized, AuthError> {
        Ok(
            Dispatch::authorize_from_backend(self, assignment_id, capability, peer_spiffe_id)
                .await?,
        )
    }

    fn may_bind(&self, assignment_id: &str) -> bool {
        Dispatch::may_bind(self, assignment_id)
    }

    fn liveness(&self, id: &AssignmentId) -> Option<Liveness> {
        Some(match self.claim_state(id)? {
            ClaimState::Pending | ClaimState::Claimed => Liveness::Live,
            ClaimState::Terminal => Liveness::Finished,
            ClaimState::Expired => Liveness::Expired,
        })
    }

    fn heard_from(&self, id: &AssignmentId) {
        Dispatch::heard_from(self, id);
    }
}

#[async_trait::async_trait]
impl Claims for Dispatch {
    async fn take_task(self: Arc<Self>, auth: &Authorized) -> Result<Fetched, ClaimError> {
        Dispatch::take_task(&self, auth).await
    }

    fn received(&self, id: &AssignmentId) {
        Dispatch::received(self, id);
    }

    async fn finish(&self, auth: &Authorized) -> Result<Finished, ClaimError> {
        // Gitea has the result; the terminal marker is not written yet.
        crate::failpoint::hit(crate::failpoint::points::AFTER_TERMINAL_ACCEPTED);
        Dispatch::finish(self, auth).await
    }
}

impl Outcomes for JobMetrics {
    fn completed(&self, backend: Backend, result: &str, ran: Option<Duration>) {
        let backend = backend.as_str().to_owned();
        self.jobs_completed
            .get_or_create(&ResultLabels {
                backend: backend.clone(),
                result: result.to_owned(),
            })
            .inc();
        if let Some(ran) = ran {
            self.run_time
                .get_or_create(&BackendLabel { backend })
                .observe(ran.as_secs_f64());
        }
    }
}

/// Which job claimed a warm sandbox, from the backends ([`gdr_core::executor::ExecutorBackend::claimed_standby`]):
/// only the VM backend has warm sandboxes whose executor asks; the others answer `None`
/// without a call.
pub struct BackendStandbys {
    dispatch: Arc<Dispatch>,
    channels: BTreeMap<Backend, ExecutorChannel>,
}

impl BackendStandbys {
    /// The standbys of the backends of `dispatch` that `channels` has a channel for.
    pub fn new(dispatch: Arc<Dispatch>, channels: BTreeMap<Backend, ExecutorChannel>) -> Self {
        BackendStandbys { dispatch, channels }
    }
}

#[async_trait::async_trait]
impl Standbys for BackendStandbys {
    async fn claimed(&self, standby_id: &str) -> Result<Option<ClaimedStandby>, AuthError> {
        for (backend, channel) in &self.channels {
            let Some(adapter) = self.dispatch.backend(*backend) else {
                continue;
            };
            // Whatever the cause, the executor asks again: a member whose metadata cannot
            // be read now may be readable later, and the start deadline ends it if not.
            let record = adapter
                .claimed_standby(standby_id)
                .await
                .map_err(|e| AuthError::Unavailable(Box::new(e)))?;
            if let Some(record) = record {
                return Ok(Some(ClaimedStandby {
                    assignment_id: record.assignment.id().clone(),
                    spiffe_id: record.assignment.identity().spiffe_id().to_owned(),
                    claimed: record.claimed,
                    terminal: record.terminal,
                    variables: channel.environment(&record, self.dispatch.capability_key()),
                }));
            }
        }
        Ok(None)
    }
}

/// Registers the facade's connection metrics (`facade_…`; the values its counters hold).
pub(crate) fn register_stats(stats: &FacadeStats, r: &mut Registrar<'_>) {
    let mut r = r.sub("facade");
    r.add(
        "connections",
        "Connections the facade holds open",
        &stats.open,
    );
    r.family(
        "connections_closed",
        "Facade connections refused or closed early, by reason (limit, evicted, handshake, identity_limit, idle)",
        stats.closed_by_reason(),
    )
    .values("reason", &FACADE_CLOSE_REASONS);
    r.add(
        "accept_errors",
        "Failed accept calls of the facade (for example, no file descriptors left)",
        &stats.accept_errors,
    );
}

#[cfg(test)]
mod tests {
    use std::error::Error as _;

    use gdr_core::executor::{ExecutorError, ExecutorSpec, env};

    use super::*;

    /// Issue 39 item 5 (DESIGN invariants 14 and 16): a warm executor is handed exactly the
    /// environment the worker gives a fresh executor of the claiming job (same facade,
    /// identity, label and tolerance), the capability excepted, which the facade adds from
    /// its key; nothing while no job has claimed the member.
    #[tokio::test]
    async fn a_claimed_standby_gets_a_fresh_executors_environment_without_the_capability() {
        use gdr_core::executor::ExecutorBackend as _;
        use gdr_core::metadata::MetadataCodec;
        use gdr_testkit::memory_backend::MemoryBackend;
        let vm = Arc::new(MemoryBackend::new(Backend::Vm));
        let dispatch = Arc::new(Dispatch::new(
            [(
                vm.clone() as Arc<dyn gdr_core::executor::ExecutorBackend>,
                2,
            )],
            CapabilityKey::new(b"0123456789abcdef0123456789abcdef").unwrap(),
        ));
        let channel = ExecutorChannel {
            facade_url: "https://facade:8443".into(),
            facade_spiffe_id: "spiffe://example.org/controller".into(),
            runner_label: "vm".into(),
            report_outage_tolerance: Duration::from_secs(600),
        };
        let a = gdr_testkit::tasks::assignment(7, "[self-hosted, vm]");
        let spec = ExecutorSpec::new(
            &a,
            dispatch.capability_key().issue(a.id()),
            &MetadataCodec::default(),
            &channel.facade_url,
            &channel.facade_spiffe_id,
            &channel.runner_label,
        )
        .with_report_outage_tolerance(channel.report_outage_tolerance);
        vm.create(&spec).await.unwrap();
        let standbys =
            BackendStandbys::new(dispatch.clone(), BTreeMap::from([(Backend::Vm, channel)]));
        assert_eq!(standbys.claimed("warm-1").await.unwrap(), None);
        vm.claim_standby("warm-1", a.id());
        let claimed = standbys.claimed("warm-1").await.unwrap().unwrap();
        let mut fresh: BTreeMap<String, String> = spec
            .environment()
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v))
            .collect();
        fresh.remove(env::CAPABILITY);
        assert_eq!(claimed.variables, fresh);
        assert_eq!(&claimed.assignment_id, a.id());
        assert_eq!(claimed.spiffe_id, a.identity().spiffe_id());
        assert!(!claimed.claimed && !claimed.terminal);
        vm.record_claimed(a.id()).await.unwrap();
        assert!(standbys.claimed("warm-1").await.unwrap().unwrap().claimed);
        vm.set_failing(Some(gdr_testkit::memory_backend::Failure::Unavailable));
        assert!(matches!(
            standbys.claimed("warm-1").await,
            Err(AuthError::Unavailable(_))
        ));
    }

    /// The facade logs and answers a refusal by its kind and its text: the translation keeps
    /// both, and the backend's cause stays attached as the source.
    #[test]
    fn a_refusal_keeps_its_kind_text_and_cause_across_the_boundary() {
        let unreadable = || dispatch::Unreadable::Backend {
            backend: Backend::Pod,
            source: ExecutorError::unavailable("the API is down"),
        };
        let text = dispatch::AuthError::Unavailable(unreadable()).to_string();
        let translated = AuthError::from(dispatch::AuthError::Unavailable(unreadable()));
        assert_eq!(translated.to_string(), text);
        let cause = translated.source().and_then(|s| s.source());
        assert!(
            cause.is_some_and(|c| c.to_string().contains("the API is down")),
            "{translated:?}"
        );
        for (from, to) in [
            (
                dispatch::AuthError::UnknownAssignment,
                AuthError::UnknownAssignment,
            ),
            (dispatch::AuthError::BadCapability, AuthError::BadCapability),
            (dispatch::AuthError::WrongIdentity, AuthError::WrongIdentity),
            (dispatch::AuthError::Finished, AuthError::Finished),
        ] {
            let text = from.to_string();
            let translated = AuthError::from(from);
            assert_eq!(translated.to_string(), text);
            assert_eq!(
                std::mem::discriminant(&translated),
                std::mem::discriminant(&to)
            );
        }
    }
}
