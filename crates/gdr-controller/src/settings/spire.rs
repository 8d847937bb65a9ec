//! `executor_identity = "spire"`: process executors' identities as entries in an existing
//! SPIRE server (see `gdr_backends::spire`). Off by default; its keys are read here only, so
//! that `Settings::try_from` calls one function for them.

use std::ops::RangeInclusive;
use std::path::PathBuf;
use std::time::Duration;

use super::Check;

/// The SPIRE server and uid pool of process executors with `executor_identity = "spire"`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpireExecutorSettings {
    /// The `spire-server` program (`spire_server_program`).
    pub server_program: PathBuf,
    /// The server's admin API socket (`spire_server_socket`).
    pub server_socket: PathBuf,
    /// The parent ID of every entry: this host's agent (`spire_agent_id`).
    pub agent_id: String,
    /// The uids executors run as (`spire_executor_uids`).
    pub uids: RangeInclusive<u32>,
    /// How long a freed uid stays unused (`spire_executor_uid_quarantine`).
    pub quarantine: Duration,
}

/// The keys of `executor_identity = "spire"`, as the file gives them.
pub(super) struct SpireKeys {
    pub(super) executor_identity: String,
    pub(super) server_socket: Option<PathBuf>,
    pub(super) server_program: PathBuf,
    pub(super) agent_id: Option<String>,
    pub(super) uids: Option<String>,
    pub(super) quarantine: Duration,
    /// Whether the controller's own identity comes from the local CA.
    pub(super) local_identity: bool,
}

/// The section's keys with the parent ID (`spire_agent_id`, a key of the Pod section) and
/// where the controller's own identity comes from.
pub(super) fn keys(
    section: super::keys::section::SpireExecutors,
    agent_id: Option<String>,
    local_identity: bool,
) -> SpireKeys {
    let super::keys::section::SpireExecutors {
        executor_identity,
        spire_server_socket,
        spire_server_program,
        spire_executor_uids,
        spire_executor_uid_quarantine,
    } = section;
    SpireKeys {
        executor_identity,
        server_socket: spire_server_socket,
        server_program: spire_server_program,
        agent_id,
        uids: spire_executor_uids,
        quarantine: spire_executor_uid_quarantine.0,
        local_identity,
    }
}

/// `None` with `executor_identity = "local"`; the SPIRE settings with `"spire"`, every
/// missing or wrong key a problem.
pub(super) fn spire_identity_settings(
    check: &mut Check,
    keys: SpireKeys,
) -> Option<SpireExecutorSettings> {
    match keys.executor_identity.as_str() {
        "local" => return None,
        "spire" => {}
        other => {
            check.problem(
                "executor_identity",
                format!("{other:?} must be \"local\" or \"spire\""),
            );
            return None;
        }
    }
    if keys.local_identity {
        // The facade verifies executors' SVIDs against its own Workload API's bundle: both
        // must come from SPIRE.
        check.problem(
            "local_identity",
            "must be false with executor_identity = \"spire\": the facade's SVID and bundle come from the SPIRE agent at spiffe_endpoint_socket too",
        );
    }
    let server_socket = required(check, "spire_server_socket", keys.server_socket);
    let agent_id = required(
        check,
        "spire_agent_id",
        keys.agent_id.filter(|id| !id.trim().is_empty()),
    );
    let uids = required(check, "spire_executor_uids", keys.uids)
        .and_then(|u| check.ok("spire_executor_uids", parse_uid_range(&u)));
    if keys.quarantine.is_zero() {
        check.problem(
            "spire_executor_uid_quarantine",
            "must be above the SPIRE agent's sync interval, not 0",
        );
    }
    Some(SpireExecutorSettings {
        server_program: keys.server_program,
        server_socket: server_socket?,
        agent_id: agent_id?,
        uids: uids?,
        quarantine: keys.quarantine,
    })
}

fn required<T>(check: &mut Check, key: &'static str, value: Option<T>) -> Option<T> {
    if value.is_none() {
        check.problem(key, "is required with executor_identity = \"spire\"");
    }
    value
}

/// `<first>-<last>`: a range of unprivileged uids (root or a system user would give the
/// job their rights).
pub(super) fn parse_uid_range(text: &str) -> Result<RangeInclusive<u32>, String> {
    let bad = || format!("{text:?} must be <first>-<last>, e.g. 60000-60063");
    let (first, last) = text.trim().split_once('-').ok_or_else(bad)?;
    let first: u32 = first.trim().parse().map_err(|_| bad())?;
    let last: u32 = last.trim().parse().map_err(|_| bad())?;
    if first > last {
        return Err(format!("{text:?}: the first uid is above the last"));
    }
    if first < 1000 {
        return Err(format!(
            "{text:?} starts below 1000: executors must not run as root or a system user"
        ));
    }
    Ok(first..=last)
}

/// The process backends' identity: without SPIRE the local CA; with SPIRE at least one
/// uid per executor the process backends may run at once.
pub(super) fn check_process_identity(
    check: &mut Check,
    spire: Option<&SpireExecutorSettings>,
    local_identity: bool,
    process_capacity: Option<u32>,
) {
    let Some(capacity) = process_capacity else {
        return;
    };
    match spire {
        None if !local_identity => check.problem(
            "local_identity",
            "must be true with the process backend unless executor_identity = \"spire\": local executors get their SPIFFE identity from the controller's CA",
        ),
        None => {}
        Some(spire) => {
            let size = u64::from(*spire.uids.end()) + 1 - u64::from(*spire.uids.start());
            if u64::from(capacity) > size {
                check.problem(
                    "spire_executor_uids",
                    format!(
                        "has {size} uids, fewer than the process backends' capacity of {capacity} (pod_capacity plus vm_capacity): each executor needs a uid of its own"
                    ),
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys() -> SpireKeys {
        SpireKeys {
            executor_identity: "spire".into(),
            server_socket: Some("/run/spire/server.sock".into()),
            server_program: "spire-server".into(),
            agent_id: Some("spiffe://example.org/host".into()),
            uids: Some("60000-60003".into()),
            quarantine: Duration::from_secs(30),
            local_identity: false,
        }
    }

    fn problem_keys(check: &Check) -> Vec<&'static str> {
        check.problems.iter().map(|p| p.key).collect()
    }

    #[test]
    fn executor_identity_is_local_by_default_and_spire_reads_its_keys() {
        let mut check = Check::default();
        let local = SpireKeys {
            executor_identity: "local".into(),
            ..keys()
        };
        assert_eq!(spire_identity_settings(&mut check, local), None);
        let spire = spire_identity_settings(&mut check, keys()).expect("spire");
        assert!(check.problems.is_empty());
        assert_eq!(spire.uids, 60000..=60003);
        assert_eq!(spire.agent_id, "spiffe://example.org/host");
    }

    #[test]
    fn spire_without_its_keys_or_with_the_local_ca_is_refused_naming_each_key() {
        let mut check = Check::default();
        let keys = SpireKeys {
            server_socket: None,
            agent_id: Some(" ".into()),
            uids: None,
            local_identity: true,
            quarantine: Duration::ZERO,
            ..keys()
        };
        assert_eq!(spire_identity_settings(&mut check, keys), None);
        assert_eq!(
            problem_keys(&check),
            [
                "local_identity",
                "spire_server_socket",
                "spire_agent_id",
                "spire_executor_uids",
                "spire_executor_uid_quarantine"
            ]
        );
    }

    #[test]
    fn the_uid_range_is_first_dash_last_of_unprivileged_uids() {
        assert_eq!(parse_uid_range("60000-60063"), Ok(60000..=60063));
        assert_eq!(parse_uid_range(" 5000 - 5000 "), Ok(5000..=5000));
        for bad in ["60000", "a-b", "60010-60000", "0-100", "999-2000"] {
            assert!(parse_uid_range(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_process_capacity_above_the_uid_pool_is_refused_naming_the_pool() {
        let spire = spire_identity_settings(&mut Check::default(), keys()).expect("spire");
        let mut check = Check::default();
        check_process_identity(&mut check, Some(&spire), false, Some(4));
        assert!(check.problems.is_empty());
        check_process_identity(&mut check, Some(&spire), false, Some(5));
        assert_eq!(problem_keys(&check), ["spire_executor_uids"]);
        assert!(check.problems[0].rule.contains("pod_capacity"));
        let mut check = Check::default();
        check_process_identity(&mut check, None, false, Some(1));
        assert_eq!(problem_keys(&check), ["local_identity"]);
    }
}
