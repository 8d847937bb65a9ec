//! `executor_identity = "spire"` in the wiring: the one SPIRE identity provider the process
//! backends share (one uid pool, so a uid is never handed to a pod and a vm executor at
//! once), and what the controller must be allowed for it.

use std::path::Path;
use std::sync::Arc;

use gdr_backends::spire::{SpireIdentity, SpireIdentitySettings, SpireServerCli};

use super::super::{RuntimeError, in_context, step};
use crate::settings::SpireExecutorSettings;

/// What the controller does to executors of other uids: chown their work directory
/// (CAP_CHOWN), remove what they wrote there (CAP_DAC_OVERRIDE), kill their leftovers
/// (CAP_KILL), start them as their uid (CAP_SETGID, CAP_SETUID). Bits of `CapEff`.
const NEEDED_CAPABILITIES: &[(u32, &str)] = &[
    (0, "CAP_CHOWN"),
    (1, "CAP_DAC_OVERRIDE"),
    (5, "CAP_KILL"),
    (6, "CAP_SETGID"),
    (7, "CAP_SETUID"),
];

/// The provider of `settings`, checking first that this process may run executors as the
/// pool's uids; `workload_api` is the agent's endpoint (`spiffe_endpoint_socket`).
pub(super) fn spire_identity(
    settings: &SpireExecutorSettings,
    workload_api: Option<&str>,
) -> Result<Arc<SpireIdentity>, RuntimeError> {
    const STEP: &str = "executor_identity = \"spire\"";
    let endpoint = workload_api.ok_or_else(|| {
        step(STEP)("needs spiffe_endpoint_socket (the SPIRE agent's Workload API)".into())
    })?;
    let status = std::fs::read_to_string("/proc/self/status")
        .map_err(|e| step(STEP)(in_context("cannot read /proc/self/status", e)))?;
    let missing = missing_capabilities(&status);
    if !missing.is_empty() {
        return Err(step(STEP)(
            format!(
                "executors run under uids of their own (spire_executor_uids), which needs root or {}; this process lacks {}",
                names(NEEDED_CAPABILITIES.iter().map(|(_, n)| *n)),
                names(missing.into_iter()),
            )
            .into(),
        ));
    }
    Ok(Arc::new(SpireIdentity::new(SpireIdentitySettings {
        server: SpireServerCli {
            program: settings.server_program.clone(),
            socket: settings.server_socket.clone(),
        },
        agent_id: settings.agent_id.clone(),
        endpoint: endpoint.to_owned(),
        uids: settings.uids.clone(),
        quarantine: settings.quarantine,
    })))
}

fn names<'a>(names: impl Iterator<Item = &'a str>) -> String {
    names.collect::<Vec<_>>().join(", ")
}

/// The needed capabilities missing from `CapEff` in a `/proc/<pid>/status`.
fn missing_capabilities(status: &str) -> Vec<&'static str> {
    let effective = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .unwrap_or(0);
    NEEDED_CAPABILITIES
        .iter()
        .filter(|(bit, _)| effective & (1 << bit) == 0)
        .map(|(_, name)| *name)
        .collect()
}

/// Lets executors of other uids reach their work directories: `dirs` become 0711
/// (traversable, not listable; what is in them stays 0600 or 0700).
pub(super) fn traversable(dirs: &[&Path]) -> Result<(), RuntimeError> {
    use std::os::unix::fs::PermissionsExt;
    for dir in dirs {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o711)).map_err(|e| {
            step("executor_identity = \"spire\"")(in_context(
                format_args!("cannot make {} traversable", dir.display()),
                e,
            ))
        })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spire_executors_need_the_capabilities_to_switch_users_and_are_refused_without() {
        let root = "Name:\tx\nCapEff:\t000001ffffffffff\n";
        assert!(missing_capabilities(root).is_empty());
        let setuid_only = "CapEff:\t00000000000000c0\n";
        assert_eq!(
            missing_capabilities(setuid_only),
            ["CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_KILL"]
        );
        assert_eq!(missing_capabilities("Name:\tx\n").len(), 5);
    }
}
