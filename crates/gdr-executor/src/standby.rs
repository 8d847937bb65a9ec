//! Standby: the executor of a warm Pod (`pod_warm_pool`), started before any job, learns
//! its assignment only once one job claimed the Pod (DESIGN invariants 14 and 16).
//!
//! A warm Pod's environment names no assignment and its Pod carries no capability: the
//! executor gets `CI_EXECUTOR_STANDBY_DIR`, a projected volume holding two files the
//! kubelet fills in only after the claim — `environment`, the downward API's copy of the
//! Pod annotation the claim writes (the `CI_*` variables a fresh Pod's environment has,
//! as a JSON object, the capability excepted), and `capability`, from the Pod's own
//! capability Secret the controller creates after the claim. Until both are there the
//! executor only waits; it fetches no SVID (the Pod has no identity yet) and dials
//! nothing. Then it runs itself again (`exec`, keeping its process) with those variables,
//! exactly as a fresh Pod's executor starts, so its ready timeout counts from the claim.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use gdr_core::executor::env;

/// The directory the warm Pod's executor waits on.
pub const STANDBY_DIR: &str = "CI_EXECUTOR_STANDBY_DIR";
/// The file of the assignment's variables (a JSON object) in [`STANDBY_DIR`].
pub const ENVIRONMENT_FILE: &str = "environment";
/// The file of the capability in [`STANDBY_DIR`].
pub const CAPABILITY_FILE: &str = "capability";
/// How often the files are looked at: a claim is seen within this (the kubelet's own
/// update of the volume takes longer).
const LOOK: Duration = Duration::from_millis(50);

/// Why a claimed warm Pod's assignment cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum StandbyError {
    /// The environment file is not a JSON object of strings.
    #[error("{path}: the assignment's environment is not a JSON object of strings: {source}")]
    Malformed {
        /// The file.
        path: PathBuf,
        /// The parser's complaint.
        #[source]
        source: serde_json::Error,
    },
    /// The environment sets a variable that is not an assignment's.
    #[error("{path}: {name} is not a variable of an assignment")]
    NotAssignment {
        /// The file.
        path: PathBuf,
        /// The variable.
        name: String,
    },
    /// Running the executor again failed.
    #[error("running the executor again with its assignment: {0}")]
    Exec(#[source] std::io::Error),
}

/// The variables a claim may set: a fresh Pod's `CI_*` assignment variables.
fn allowed(name: &str) -> bool {
    (env::ASSIGNMENT.contains(&name) && name != env::CAPABILITY)
        || name == env::REPORT_OUTAGE_TOLERANCE
}

/// The assignment's variables, once both files hold something (`None`: not claimed yet).
pub fn read(dir: &Path) -> Result<Option<BTreeMap<String, String>>, StandbyError> {
    let text = |name: &str| {
        std::fs::read_to_string(dir.join(name))
            .ok()
            .filter(|t| !t.trim().is_empty())
    };
    let (Some(environment), Some(capability)) = (text(ENVIRONMENT_FILE), text(CAPABILITY_FILE))
    else {
        return Ok(None);
    };
    let path = dir.join(ENVIRONMENT_FILE);
    let mut vars: BTreeMap<String, String> =
        serde_json::from_str(&environment).map_err(|source| StandbyError::Malformed {
            path: path.clone(),
            source,
        })?;
    if let Some(name) = vars.keys().find(|n| !allowed(n)) {
        return Err(StandbyError::NotAssignment {
            path,
            name: name.clone(),
        });
    }
    if !vars.contains_key(env::ASSIGNMENT_ID) {
        // Written by a claim still on its way: wait for the whole of it.
        return Ok(None);
    }
    vars.insert(env::CAPABILITY.to_owned(), capability.trim().to_owned());
    Ok(Some(vars))
}

/// Waits in `dir` until the Pod is claimed, then replaces this process with the executor
/// of the assignment (returns only on an error).
pub fn wait_then_exec(dir: &Path) -> StandbyError {
    eprintln!("warm executor: waiting for a job in {}", dir.display());
    let vars = loop {
        match read(dir) {
            Ok(Some(vars)) => break vars,
            Ok(None) => std::thread::sleep(LOOK),
            Err(e) => return e,
        }
    };
    StandbyError::Exec(exec_with(STANDBY_DIR, vars))
}

/// Replaces this process with the executor again, same program and arguments, with `vars`
/// set and the standby variable `standby` removed, so it starts exactly as a fresh
/// executor does (returns only the error of a failed `exec`).
pub(crate) fn exec_with(standby: &str, vars: BTreeMap<String, String>) -> std::io::Error {
    use std::os::unix::process::CommandExt;
    let program = match std::env::current_exe() {
        Ok(p) => p,
        Err(e) => return e,
    };
    std::process::Command::new(program)
        .args(std::env::args_os().skip(1))
        .env_remove(standby)
        .envs(vars)
        .exec()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, text: &str) {
        std::fs::write(dir.join(name), text).unwrap();
    }

    #[test]
    fn an_unclaimed_warm_pod_has_no_assignment_until_both_files_are_filled_in_invariant_14() {
        let dir = tempfile::tempdir().unwrap();
        assert!(read(dir.path()).unwrap().is_none());
        // The kubelet writes an annotation the Pod does not have yet as an empty file.
        write(dir.path(), ENVIRONMENT_FILE, "");
        write(dir.path(), CAPABILITY_FILE, "");
        assert!(read(dir.path()).unwrap().is_none());
        write(
            dir.path(),
            ENVIRONMENT_FILE,
            r#"{"CI_ASSIGNMENT_ID":"gitea-task-7","CI_SPIFFE_ID":"spiffe://td/ci/o/r/branch/main/build"}"#,
        );
        assert!(read(dir.path()).unwrap().is_none(), "no capability yet");
        write(dir.path(), CAPABILITY_FILE, "cap\n");
        let vars = read(dir.path()).unwrap().unwrap();
        assert_eq!(vars[env::ASSIGNMENT_ID], "gitea-task-7");
        assert_eq!(vars[env::CAPABILITY], "cap");
    }

    #[test]
    fn a_claim_may_set_only_an_assignments_variables_invariant_16() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), CAPABILITY_FILE, "cap");
        write(
            dir.path(),
            ENVIRONMENT_FILE,
            r#"{"CI_ASSIGNMENT_ID":"gitea-task-7","LD_PRELOAD":"/x.so"}"#,
        );
        assert!(matches!(
            read(dir.path()),
            Err(StandbyError::NotAssignment { name, .. }) if name == "LD_PRELOAD"
        ));
        write(
            dir.path(),
            ENVIRONMENT_FILE,
            r#"{"CI_RUNNER_CAPABILITY":"other"}"#,
        );
        assert!(matches!(
            read(dir.path()),
            Err(StandbyError::NotAssignment { .. })
        ));
        write(dir.path(), ENVIRONMENT_FILE, "not json");
        assert!(matches!(
            read(dir.path()),
            Err(StandbyError::Malformed { .. })
        ));
    }
}
