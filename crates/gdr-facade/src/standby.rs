//! The standby route ([`gdr_core::executor::standby`]): a warm VM sandbox's executor,
//! started before any job, asks for the assignment of the job that claimed its sandbox
//! (issue 39 item 5; DESIGN invariants 14 and 15).
//!
//! The assignment, its capability included, goes only to the claiming job's workload (the
//! peer's SPIFFE ID must be the job's, which SPIRE issues to the sandbox only after the
//! claim), and only until its runner claimed the task: afterwards nothing may learn the
//! capability this way again. The request carries no runner credentials, so it binds its
//! connection to no assignment (see [`crate::tls`]: it is served on a connection within its
//! SPIFFE ID's share of unbound connections, and one on probation is closed unanswered,
//! which the executor takes as "ask again"). Its body is never read.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::response::{IntoResponse, Response};
use gdr_core::executor::{env, standby};
use http::StatusCode;

use crate::ports::{AuthError, Liveness};
use crate::{Facade, PeerSpiffeId, header, refusal};

/// What a standby request gets (no `Debug`: it holds the capability, never logged).
pub(crate) enum Answer {
    /// `200`: the assignment's variables, the capability included (never logged).
    Assignment(BTreeMap<String, String>),
    /// `404`: no job has claimed the sandbox (or no sandbox has the ID).
    NotClaimed,
    /// `403`: not for this peer, or not any more.
    Refused(&'static str),
    /// `503`: the backend cannot be read now.
    Unavailable,
    /// `400`: no standby ID.
    NoId,
}

impl Answer {
    fn into_response(self) -> Response {
        const WHO: &str = "the facade hands a warm executor its assignment";
        match self {
            Answer::Assignment(vars) => axum::Json(vars).into_response(),
            Answer::NotClaimed => {
                (StatusCode::NOT_FOUND, format!("{WHO}: not claimed yet\n")).into_response()
            }
            Answer::Refused(why) => refusal(
                (StatusCode::FORBIDDEN, format!("{WHO}: {why}\n")).into_response(),
                true,
            ),
            Answer::Unavailable => (
                StatusCode::SERVICE_UNAVAILABLE,
                format!("{WHO}: the backend cannot be read now; ask again\n"),
            )
                .into_response(),
            Answer::NoId => (
                StatusCode::BAD_REQUEST,
                format!("{WHO}: {} is required\n", standby::ID_HEADER),
            )
                .into_response(),
        }
    }
}

/// `POST` [`standby::PATH`].
pub(crate) async fn handler(
    axum::extract::State(facade): axum::extract::State<Arc<Facade>>,
    request: axum::extract::Request,
) -> Response {
    let peer = request
        .extensions()
        .get::<PeerSpiffeId>()
        .map(|p| p.0.clone());
    let standby_id = header(request.headers(), standby::ID_HEADER)
        .trim()
        .to_owned();
    // The body is dropped unread with the request.
    drop(request);
    facade
        .standby_answer(peer.as_deref(), &standby_id)
        .await
        .into_response()
}

impl Facade {
    /// The answer to the standby request of `peer` for `standby_id`.
    pub(crate) async fn standby_answer(&self, peer: Option<&str>, standby_id: &str) -> Answer {
        let Some(peer) = peer else {
            return Answer::Refused("a SPIFFE mTLS client certificate is required");
        };
        if standby_id.is_empty() {
            return Answer::NoId;
        }
        let Some(standbys) = &self.standbys else {
            return Answer::NotClaimed;
        };
        let claimed = match standbys.claimed(standby_id).await {
            Ok(Some(claimed)) => claimed,
            Ok(None) | Err(AuthError::UnknownAssignment) => return Answer::NotClaimed,
            Err(AuthError::Unavailable(why)) => {
                self.standby_refused(peer, standby_id, &why.to_string());
                return Answer::Unavailable;
            }
            Err(AuthError::Finished) => return self.refuse(peer, standby_id, "the job has ended"),
            Err(AuthError::BadCapability | AuthError::WrongIdentity) => {
                return self.refuse(peer, standby_id, "not for this peer");
            }
        };
        if claimed.spiffe_id != peer {
            return self.refuse(
                peer,
                standby_id,
                "the peer's SPIFFE ID is not the claiming job's",
            );
        }
        if claimed.claimed {
            return self.refuse(
                peer,
                standby_id,
                "handed out already: its runner has claimed the task",
            );
        }
        let ended = matches!(
            self.admission.liveness(&claimed.assignment_id),
            Some(Liveness::Finished | Liveness::Expired)
        );
        if claimed.terminal || ended {
            return self.refuse(peer, standby_id, "the job has ended");
        }
        let mut vars = claimed.variables;
        let capability = self
            .admission
            .capability_key()
            .issue(&claimed.assignment_id);
        vars.insert(env::CAPABILITY.to_owned(), capability.expose().to_owned());
        tracing::info!(assignment_id = %claimed.assignment_id, standby_id, event = "standby_assigned", "warm executor handed its assignment");
        Answer::Assignment(vars)
    }

    fn refuse(&self, peer: &str, standby_id: &str, why: &'static str) -> Answer {
        self.standby_refused(peer, standby_id, why);
        Answer::Refused(why)
    }

    /// Any peer of the trust domain can ask as often as it likes: one line per interval.
    fn standby_refused(&self, peer: &str, standby_id: &str, why: &str) {
        let count = self
            .standby_refusals
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .note();
        if let Some(count) = count {
            tracing::warn!(peer, standby_id, why, count, interval = ?crate::tls::LOG_INTERVAL, "standby requests refused or not answered");
        }
    }
}
