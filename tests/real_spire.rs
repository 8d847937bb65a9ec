//! The real SPIRE (spire-server and spire-agent v1.13, built from their Go module by
//! `tests/spire-peers/build.sh`) under the facade's and the executor's mTLS and under the
//! job's own `spire-agent api fetch jwt`, in place of the fake Workload API of the other
//! tests: the facade's SVID and the executor's come from the real agent, which tells them
//! apart by uid (the `unix` workload attestor, entries created with `spire-server entry
//! create`), and a job step runs the real CLI.
//!
//! What this proves: the executor and the facade work with SPIRE's own Workload API (its
//! X.509 SVIDs, bundle and JWT-SVIDs), and a job can obtain a JWT-SVID of its own SPIFFE ID
//! only. What it does not: the Kubernetes workload attestor (selectors by Pod UID) and the
//! SPIFFE CSI driver, which need a kubelet and a node (the Pod chain tests play those).
//!
//! Peers' timeouts named here: the agent learns of a new entry at its next sync with the
//! server (a few seconds), so each test waits for the agent to issue an entry's SVID before
//! starting the workload that needs it.

use std::os::unix::fs::PermissionsExt;

use base64::Engine;
use gdr_testkit::mock_gitea::Status;
use gdr_testkit::real_spire::{RealSpire, SpirePrograms, TRUST_DOMAIN};

use crate::facade::{Env, FACADE_ID, WAIT};

const BIN: &str = env!("CARGO_BIN_EXE_gitea-dynamic-runner");
const STANDIN: &str = env!("CARGO_BIN_EXE_gitea-runner-standin");
/// The uid the executor (and so the runner and the job) runs as; the entry of the job's
/// SPIFFE ID selects it.
const JOB_UID: u32 = 2471;
/// A uid whose entry gives another job's identity, which the job must not obtain.
const OTHER_UID: u32 = 2472;

/// The claims of a JWT-SVID (its payload, unverified: the facade's trust in the token is
/// SPIRE's business here, what matters is which identity the agent handed out).
/// Copies of the executor and the stand-in runner that another uid can execute wherever
/// the checkout lives (a 0700 home, say): the directory (kept while it is held) and both
/// paths.
pub(crate) fn programs_for_other_uids()
-> (tempfile::TempDir, std::path::PathBuf, std::path::PathBuf) {
    let programs = tempfile::Builder::new()
        .prefix("rb")
        .tempdir()
        .expect("dir");
    std::fs::set_permissions(programs.path(), std::fs::Permissions::from_mode(0o755))
        .expect("chmod");
    let (bin, standin) = (
        programs.path().join("executor"),
        programs.path().join("runner"),
    );
    std::fs::copy(BIN, &bin).expect("copy the executor");
    std::fs::copy(STANDIN, &standin).expect("copy the stand-in runner");
    (programs, bin, standin)
}

pub(crate) fn claims(token: &str) -> serde_json::Value {
    let payload = token.split('.').nth(1).expect("a JWT");
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload)
        .expect("base64url");
    serde_json::from_slice(&bytes).expect("JSON claims")
}

/// The first token `spire-agent api fetch jwt` printed among `rows` (its output is
/// `token(<spiffe id>):` followed by the token on the next line).
pub(crate) fn fetched_token(rows: &[String]) -> Option<String> {
    let at = rows
        .iter()
        .position(|r| r.trim_start().starts_with("token("))?;
    rows.get(at + 1).map(|t| t.trim().to_owned())
}

/// DESIGN invariants 13 and 17, against the real SPIRE: the executor, started as its own
/// uid, gets its X.509 SVID from the real agent and the facade (its SVID from the same
/// agent) admits it; the job's step runs the real `spire-agent api fetch jwt -audience
/// ci-smoke` and gets a JWT-SVID whose subject is its own SPIFFE ID, while asking for the
/// identity registered for another uid gets nothing.
#[tokio::test(flavor = "multi_thread")]
async fn with_the_real_spire_the_job_fetches_a_jwt_svid_of_its_own_id_and_nothing_else() {
    assert!(
        rustix::process::geteuid().is_root(),
        "the real-SPIRE test needs root: it starts the executor as uid {JOB_UID}"
    );
    let spire = RealSpire::start(SpirePrograms::from_env())
        .await
        .expect("SPIRE");
    // The facade is this test process.
    spire.register_uid(FACADE_ID, 0).await.expect("entry");
    spire
        .wait_until_issued(0, FACADE_ID)
        .await
        .expect("facade SVID");
    let env = Env::with_facade_identity(spire.endpoint()).await;

    let socket = spire.agent_socket();
    let cli = spire.agent_program().display().to_string();
    let other = format!("spiffe://{TRUST_DOMAIN}/ci/someone/else/branch/main/build");
    let step = format!(
        "standin:exec {cli} api fetch jwt -audience ci-smoke -socketPath {socket} && \
         if {cli} api fetch jwt -audience ci-smoke -socketPath {socket} -spiffeID {other}; \
         then echo other-identity-obtained; else echo other-identity-refused; fi",
        socket = socket.display(),
    );
    let a = env.assignment(&step).await;
    let own = a.identity().spiffe_id().to_owned();
    spire.register_uid(&own, JOB_UID).await.expect("entry");
    spire.register_uid(&other, OTHER_UID).await.expect("entry");
    spire
        .wait_until_issued(JOB_UID, &own)
        .await
        .expect("job SVID");

    let work = tempfile::Builder::new()
        .prefix("rs")
        .tempdir()
        .expect("dir");
    std::fs::set_permissions(work.path(), std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let (_programs, bin, standin) = programs_for_other_uids();
    let capability = env.dispatch.capability_key().issue(a.id());
    let mut executor = tokio::process::Command::new(&bin);
    executor
        .arg("executor")
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("CI_ASSIGNMENT_ID", a.id().as_str())
        .env("CI_RUNNER_CAPABILITY", capability.expose())
        .env("CI_RUNNER_BACKEND", "pod")
        .env("CI_RUNNER_FACADE_URL", env.facade_url())
        .env("CI_RUNNER_FACADE_SPIFFE_ID", FACADE_ID)
        .env("SPIFFE_ENDPOINT_SOCKET", spire.endpoint())
        .env("GITEA_RUNNER_BINARY", &standin)
        .env("CI_EXECUTOR_READY_TIMEOUT", "20")
        .current_dir(work.path())
        .uid(JOB_UID)
        .gid(JOB_UID)
        .kill_on_drop(true);
    let output = tokio::time::timeout(WAIT, executor.output())
        .await
        .expect("the executor ends")
        .expect("the executor starts");
    assert!(
        output.status.success(),
        "{}\n{}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr),
        spire.logs()
    );
    env.job_status(&a, Status::Success).await;
    let job = env
        .mock
        .handle
        .jobs()
        .into_iter()
        .find(|j| j.task_id == Some(a.id().task_id()))
        .expect("the job");
    let rows = env.mock.handle.log_rows(job.id);
    let token = fetched_token(&rows).unwrap_or_else(|| panic!("no token printed: {rows:?}"));
    let claims = claims(&token);
    assert_eq!(claims["sub"], own.as_str(), "{rows:?}");
    assert_eq!(claims["aud"], serde_json::json!(["ci-smoke"]), "{rows:?}");
    assert!(
        rows.iter().any(|r| r == "other-identity-refused"),
        "the job obtained another uid's identity: {rows:?}"
    );
}
