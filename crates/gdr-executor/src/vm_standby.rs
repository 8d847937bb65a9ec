//! VM standby: the executor of a warm VM sandbox (`vm_warm_pool`), started before any job,
//! learns its assignment from the facade once a job claimed its sandbox (issue 39 item 5;
//! DESIGN invariants 14 and 16).
//!
//! OpenSandbox has no downward API: nothing on the sandbox can tell a running executor what
//! the claim wrote. So a warm sandbox's executor gets [`env::STANDBY_ID`] and the facade's
//! address and identity, but no assignment, no capability and no SVID: its SPIRE entry is
//! made only after a job claimed the sandbox. Until the Workload API issues its SVID the
//! executor only asks for it, every 200 ms, and dials nothing. With the SVID it asks
//! the facade for its assignment over mTLS, verifying the facade's exact SPIFFE ID as the
//! executor always does ([`gdr_core::executor::standby`]), and then runs itself again
//! (`exec`, keeping its process) with those variables, exactly as a fresh sandbox's
//! executor starts: its own single Workload API stream, its ready timeout counted from the
//! claim. The standby's stream and connection are closed before the `exec`.

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use gdr_core::backoff::Backoff;
use gdr_core::executor::{env, standby};
use gdr_identity::svid_stream::{self, SvidStream, SvidStreamError};
use http::{HeaderMap, HeaderValue, Method, StatusCode};

use crate::upstream::{Facade, Failure, Head, ProxyError};

/// How long the executor waits between two asks for its SVID: the claim is seen within
/// this after SPIRE issued it, and an idle warm sandbox costs its agent a few calls a second.
const SVID_POLL: Duration = Duration::from_millis(200);
/// Bound of one ask for the SVID: a Workload API that does not answer is asked again.
const SVID_ASK: Duration = Duration::from_secs(5);
/// Asking the facade again while it has no answer yet (not claimed there yet, backend
/// unreadable, unreachable): quick at first, as the claim is normally seen at once.
const ASK_AGAIN: Backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(2));
/// The longest part of a refusal's text quoted in the error.
const QUOTED: usize = 200;

/// Why a warm VM sandbox's executor cannot get its assignment.
#[derive(Debug, thiserror::Error)]
pub enum VmStandbyError {
    /// A variable the standby needs is missing or invalid.
    #[error("{name}: {problem}")]
    Env {
        /// The variable.
        name: &'static str,
        /// What is wrong.
        problem: String,
    },
    /// The facade URL cannot be used.
    #[error(transparent)]
    FacadeUrl(#[from] ProxyError),
    /// The mTLS configuration cannot be built from the SVID and the facade's SPIFFE ID.
    #[error("the mTLS configuration for the facade: {0}")]
    Tls(#[source] SvidStreamError),
    /// The facade refused for good (`403`): another job's identity, or the assignment was
    /// handed out already.
    #[error("the facade refused to hand standby {standby_id} its assignment: {message}")]
    Refused {
        /// The standby ID.
        standby_id: String,
        /// The facade's reason.
        message: String,
    },
    /// The facade answered outside the standby contract.
    #[error("the facade answered the standby request with {status}: {message}")]
    Unexpected {
        /// Its status.
        status: StatusCode,
        /// Its text.
        message: String,
    },
    /// The answer is not a JSON object of strings.
    #[error("the facade's assignment is not a JSON object of strings: {0}")]
    Malformed(#[source] serde_json::Error),
    /// The answer sets a variable that is not an assignment's.
    #[error("the facade's assignment sets {0}, which is not a variable of an assignment")]
    NotAssignment(String),
    /// The answer lacks a variable every assignment has.
    #[error("the facade's assignment lacks {0}")]
    Missing(&'static str),
    /// The standby's runtime could not be started.
    #[error("starting the warm executor's runtime: {0}")]
    Runtime(#[source] std::io::Error),
    /// Running the executor again failed.
    #[error("running the executor again with its assignment: {0}")]
    Exec(#[source] std::io::Error),
}

/// What the standby reads from its environment.
#[derive(Debug, Clone)]
struct StandbyConfig {
    standby_id: String,
    /// The standby ID as the request header carries it.
    header: HeaderValue,
    facade_url: String,
    facade_spiffe_id: String,
    workload_api: String,
}

impl StandbyConfig {
    fn from_env(get: impl Fn(&str) -> Option<String>) -> Result<Self, VmStandbyError> {
        let required = |name: &'static str| {
            get(name)
                .map(|v| v.trim().to_owned())
                .filter(|v| !v.is_empty())
                .ok_or(VmStandbyError::Env {
                    name,
                    problem: "is required".into(),
                })
        };
        let standby_id = required(env::STANDBY_ID)?;
        let header = HeaderValue::from_str(&standby_id).map_err(|_| VmStandbyError::Env {
            name: env::STANDBY_ID,
            problem: "is not a valid header value".into(),
        })?;
        Ok(StandbyConfig {
            standby_id,
            header,
            facade_url: required(env::FACADE_URL)?,
            facade_spiffe_id: required(env::FACADE_SPIFFE_ID)?,
            workload_api: required(env::SPIFFE_ENDPOINT_SOCKET)?,
        })
    }
}

/// The variables the facade may hand a warm VM sandbox's executor: a fresh sandbox's
/// assignment variables, the capability included (it comes over the mTLS channel, from
/// the facade the executor verified, not from anything on the sandbox).
fn allowed(name: &str) -> bool {
    env::ASSIGNMENT.contains(&name) || name == env::REPORT_OUTAGE_TOLERANCE
}

/// The assignment in a `200` answer of the facade.
fn parse(body: &[u8]) -> Result<BTreeMap<String, String>, VmStandbyError> {
    let vars: BTreeMap<String, String> =
        serde_json::from_slice(body).map_err(VmStandbyError::Malformed)?;
    if let Some(name) = vars.keys().find(|n| !allowed(n)) {
        return Err(VmStandbyError::NotAssignment(name.clone()));
    }
    for name in [env::ASSIGNMENT_ID, env::CAPABILITY] {
        if vars.get(name).is_none_or(|v| v.trim().is_empty()) {
            return Err(VmStandbyError::Missing(name));
        }
    }
    Ok(vars)
}

/// Waits until a job claimed this sandbox, then replaces this process with the executor of
/// its assignment (returns only on an error).
pub fn wait_then_exec(get: impl Fn(&str) -> Option<String>) -> VmStandbyError {
    let config = match StandbyConfig::from_env(get) {
        Ok(c) => c,
        Err(e) => return e,
    };
    // One thread, as the executor itself: the standby only waits.
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => return VmStandbyError::Runtime(e),
    };
    let vars = match runtime.block_on(assignment(&config)) {
        Ok(vars) => vars,
        Err(e) => return e,
    };
    // Its connection and Workload API stream close now, not with the exec.
    drop(runtime);
    VmStandbyError::Exec(crate::standby::exec_with(env::STANDBY_ID, vars))
}

/// The assignment of the job that claimed this sandbox, from the facade once the SVID is
/// issued.
async fn assignment(config: &StandbyConfig) -> Result<BTreeMap<String, String>, VmStandbyError> {
    let svids = svid(config).await;
    let client_config = svid_stream::executor_client_config(&svids, &config.facade_spiffe_id)
        .map_err(VmStandbyError::Tls)?;
    let facade = Facade::new(&config.facade_url, &client_config)?;
    let vars = ask(&facade, config).await?;
    tracing::info!(standby_id = %config.standby_id, assignment_id = vars.get(env::ASSIGNMENT_ID).map_or("", String::as_str), "warm executor: got its assignment from the facade; starting as its executor");
    Ok(vars)
}

/// Asks the Workload API for the SVID until it is issued (a job claimed the sandbox).
async fn svid(config: &StandbyConfig) -> SvidStream {
    tracing::info!(standby_id = %config.standby_id, endpoint = %config.workload_api, "warm executor: waiting for a job to claim this sandbox (its SVID comes with the claim)");
    const UNUSABLE: &str = "the SVID is not usable";
    // The first state is the one the line above announced.
    let mut last: Option<&'static str> = Some("no SVID yet");
    loop {
        let state = match svid_stream::try_svid_stream(&config.workload_api, SVID_ASK).await {
            Ok(svids) => {
                tracing::info!(standby_id = %config.standby_id, "warm executor: SVID issued; asking the facade for the assignment");
                return svids;
            }
            // No identity yet (or no agent yet): the normal state of a warm sandbox.
            Err(SvidStreamError::NoSvid { .. }) => "no SVID yet",
            Err(SvidStreamError::Silent { .. }) => "the Workload API does not answer",
            Err(e) => {
                if last != Some(UNUSABLE) {
                    tracing::warn!(standby_id = %config.standby_id, error = %e, "warm executor: the Workload API's answer is not usable; asking again");
                }
                UNUSABLE
            }
        };
        if last != Some(state) && state != UNUSABLE {
            tracing::info!(standby_id = %config.standby_id, state, "warm executor: still waiting for its SVID");
        }
        last = Some(state);
        tokio::time::sleep(SVID_POLL).await;
    }
}

/// Asks the facade for the assignment until it answers with it or refuses for good.
async fn ask(
    facade: &Facade,
    config: &StandbyConfig,
) -> Result<BTreeMap<String, String>, VmStandbyError> {
    let standby_id = config.standby_id.as_str();
    let mut headers = HeaderMap::new();
    headers.insert(standby::ID_HEADER, config.header.clone());
    let head = Head {
        method: Method::POST,
        path_and_query: standby::PATH.to_owned(),
        headers,
    };
    let mut last: Option<&'static str> = None;
    let mut attempt = 0u32;
    loop {
        let state = match facade.unary(&head, Bytes::new()).await {
            Ok(answer) => match answer.status {
                StatusCode::OK => return parse(&answer.body),
                StatusCode::FORBIDDEN => {
                    return Err(VmStandbyError::Refused {
                        standby_id: standby_id.to_owned(),
                        message: quote(&answer.body),
                    });
                }
                StatusCode::NOT_FOUND => "the facade does not know the claim yet",
                status if status.is_server_error() => "the facade cannot answer yet",
                status => {
                    return Err(VmStandbyError::Unexpected {
                        status,
                        message: quote(&answer.body),
                    });
                }
            },
            Err(Failure::Unreachable(_)) => "the facade is unreachable",
            Err(Failure::Lost(_)) => "the call to the facade failed",
        };
        if last != Some(state) {
            tracing::info!(
                standby_id,
                facade = facade.authority(),
                state,
                "warm executor: asking the facade again"
            );
        }
        last = Some(state);
        tokio::time::sleep(ASK_AGAIN.delay(attempt)).await;
        attempt = attempt.saturating_add(1);
    }
}

/// The start of a refusal's text, for the error (a refusal never carries a capability).
fn quote(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    text.trim().chars().take(QUOTED).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_facade_may_hand_a_warm_vm_executor_only_an_assignments_variables_invariant_16() {
        let vars = parse(
            br#"{"CI_ASSIGNMENT_ID":"gitea-task-7","CI_RUNNER_CAPABILITY":"cap","CI_EXECUTOR_REPORT_OUTAGE_TOLERANCE":"60"}"#,
        )
        .unwrap();
        assert_eq!(vars[env::CAPABILITY], "cap", "the capability comes with it");
        assert!(matches!(
            parse(br#"{"CI_ASSIGNMENT_ID":"gitea-task-7","CI_RUNNER_CAPABILITY":"cap","LD_PRELOAD":"/x.so"}"#),
            Err(VmStandbyError::NotAssignment(name)) if name == "LD_PRELOAD"
        ));
        assert!(matches!(
            parse(br#"{"CI_ASSIGNMENT_ID":"gitea-task-7","CI_RUNNER_CAPABILITY":"cap","CI_EXECUTOR_STANDBY_ID":"again"}"#),
            Err(VmStandbyError::NotAssignment(_))
        ));
        assert!(matches!(
            parse(br#"{"CI_ASSIGNMENT_ID":"gitea-task-7"}"#),
            Err(VmStandbyError::Missing(name)) if name == env::CAPABILITY
        ));
        assert!(matches!(
            parse(br#"{"CI_ASSIGNMENT_ID":7}"#),
            Err(VmStandbyError::Malformed(_))
        ));
    }

    #[test]
    fn a_warm_vm_executor_needs_its_standby_id_the_facade_and_the_workload_api_invariant_14() {
        let full = |name: &str| match name {
            "CI_EXECUTOR_STANDBY_ID" => Some("warm-1".to_owned()),
            "CI_RUNNER_FACADE_URL" => Some("https://facade:8443".to_owned()),
            "CI_RUNNER_FACADE_SPIFFE_ID" => Some("spiffe://td/controller".to_owned()),
            "SPIFFE_ENDPOINT_SOCKET" => Some("unix:/run/spire/agent.sock".to_owned()),
            _ => None,
        };
        assert_eq!(StandbyConfig::from_env(full).unwrap().standby_id, "warm-1");
        for missing in [
            env::STANDBY_ID,
            env::FACADE_URL,
            env::FACADE_SPIFFE_ID,
            env::SPIFFE_ENDPOINT_SOCKET,
        ] {
            let without = |name: &str| (name != missing).then(|| full(name)).flatten();
            assert!(
                matches!(StandbyConfig::from_env(without), Err(VmStandbyError::Env { name, .. }) if name == missing),
                "{missing}"
            );
        }
    }
}
