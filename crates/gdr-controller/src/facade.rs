//! The controller's side of the facade's ports ([`gdr_facade::ports`]): the dispatch
//! answers who may call and records the claims, the job metrics count the outcomes, and the
//! controller's metrics registry names the facade's connection counters. Errors and states
//! are translated here, so the facade crate never sees the controller's types.

use std::sync::Arc;
use std::time::Duration;

use gdr_core::assignment::AssignmentId;
use gdr_core::backend::Backend;
use gdr_core::capability::CapabilityKey;
use gdr_facade::ports::{
    Admission, AuthError, Authorized, ClaimError, Claims, Fetched, Finished, Liveness, Outcomes,
};
use gdr_facade::tls::{FACADE_CLOSE_REASONS, FacadeStats};

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

    use gdr_core::executor::ExecutorError;

    use super::*;

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
