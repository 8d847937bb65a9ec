//! Issue 40 item 2: `executor_identity = "spire"` against the real SPIRE (spire-server and
//! spire-agent built by `tests/spire-peers/build.sh`). The whole controller runs in this
//! process as root (the facade's SVID comes from the real agent, its entry selecting uid
//! 0); the process backend registers each executor's entry through the real `spire-server`
//! CLI and starts the executor under a uid of the pool, and the job's step fetches a
//! JWT-SVID of its own SPIFFE ID from the real agent with the real `spire-agent` CLI.
//!
//! What this proves: the entry the controller creates (SPIFFE ID, parent, `unix:uid`
//! selector) makes the real agent issue the job's identity to the executor's uid and to
//! that uid only, the facade accepts that SVID, and the entry is deleted when the executor
//! goes. What it does not: a SPIRE deployment with another node attestor or a remote
//! server (the CLI talks to the server's local admin socket either way).
//!
//! Peers' timeouts named here: the agent learns of a new entry at its next sync with the
//! server (about 5 s), which the executor waits out (`CI_EXECUTOR_READY_TIMEOUT`).

use std::os::unix::fs::PermissionsExt;

use gdr_testkit::controller::FACADE_SPIFFE_ID;
use gdr_testkit::mock_gitea::{MockConfig, MockGitea, Status};
use gdr_testkit::real_spire::{NODE_ID, RealSpire, SpirePrograms, TRUST_DOMAIN};

use crate::full_chain::Controller;
use crate::real_spire::{claims, fetched_token, programs_for_other_uids};

/// The executor uids of this test (none of another test's).
const FIRST_UID: u32 = 2481;
const LAST_UID: u32 = 2482;

/// With `executor_identity = "spire"`, the executor runs under a uid of the pool, the
/// controller's entry for it makes the real agent issue the job's own SPIFFE ID to it (a
/// JWT-SVID whose subject is that ID), and once the job is done and its executor deleted no
/// entry of the pool's uids is left in the SPIRE server.
#[tokio::test(flavor = "multi_thread")]
async fn with_spire_identity_the_executor_gets_its_jobs_svid_from_the_real_agent_and_its_entry_goes_with_it()
 {
    assert!(
        rustix::process::geteuid().is_root(),
        "the SPIRE identity test needs root: the controller starts executors as uids {FIRST_UID}-{LAST_UID}"
    );
    let spire = RealSpire::start(SpirePrograms::from_env())
        .await
        .expect("SPIRE");
    // The facade is this test process.
    spire
        .register_uid(FACADE_SPIFFE_ID, 0)
        .await
        .expect("entry");
    spire
        .wait_until_issued(0, FACADE_SPIFFE_ID)
        .await
        .expect("facade SVID");

    let (_programs, bin, standin) = programs_for_other_uids();
    let server_program = SpirePrograms::from_env().server;
    let (endpoint, socket, uids) = (
        spire.endpoint(),
        spire.server_socket(),
        format!("{FIRST_UID}-{LAST_UID}"),
    );
    let (bin, standin, socket, server_program) = (
        bin.display().to_string(),
        standin.display().to_string(),
        socket.display().to_string(),
        server_program.display().to_string(),
    );
    let mock = MockGitea::start(MockConfig::default()).await.expect("mock");
    let controller = Controller::start_against(
        mock,
        1,
        0,
        None,
        &[
            ("local_identity", "false"),
            ("spiffe_endpoint_socket", &endpoint),
            ("executor_identity", "spire"),
            ("spire_server_socket", &socket),
            ("spire_server_program", &server_program),
            ("spire_agent_id", NODE_ID),
            ("spire_executor_uids", &uids),
            // Above the agent's sync interval (5 s), short for a test: every uid starts in
            // quarantine.
            ("spire_executor_uid_quarantine", "6s"),
            ("executor_program", &bin),
            ("runner_binary", &standin),
        ],
    )
    .await;
    // Executors of the pool's uids reach their work directories under the fixture's.
    std::fs::set_permissions(
        controller.fixture.path(),
        std::fs::Permissions::from_mode(0o711),
    )
    .expect("chmod");

    let cli = spire.agent_program().display().to_string();
    let step = format!(
        "standin:exec id -u && {cli} api fetch jwt -audience ci-smoke -socketPath {agent}",
        agent = spire.agent_socket().display(),
    );
    let job = controller.queue("build", "[self-hosted, pod]", &step);
    let ended = controller
        .mock
        .handle
        .wait_for_value(
            |m| {
                m.job(job)
                    .map(|j| j.status)
                    .filter(|s| !matches!(s, Status::Waiting | Status::Running))
            },
            std::time::Duration::from_secs(90),
        )
        .await
        .expect("the job ends");
    let rows = controller.log_rows(job);
    assert_eq!(
        ended,
        Status::Success,
        "{rows:#?}\nexecutor logs:\n{}\nSPIRE:\n{}",
        executor_logs(controller.fixture.path()),
        spire.logs()
    );
    let uid: u32 = rows
        .iter()
        .find_map(|r| r.trim().parse().ok())
        .unwrap_or_else(|| panic!("no uid printed: {rows:?}"));
    assert!(
        (FIRST_UID..=LAST_UID).contains(&uid),
        "the executor ran as uid {uid}: {rows:?}"
    );
    let token = fetched_token(&rows).unwrap_or_else(|| panic!("no token printed: {rows:?}"));
    let sub = claims(&token)["sub"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(
        sub.starts_with(&format!("spiffe://{TRUST_DOMAIN}/")) && sub.contains("owner/repo"),
        "the job's JWT-SVID is not of its own SPIFFE ID: {sub} ({rows:?})"
    );

    gdr_testkit::until(
        std::time::Duration::from_secs(60),
        "no entry of an executor uid left",
        || async {
            spire.entries().await.is_ok_and(|entries| {
                entries
                    .iter()
                    .all(|e| e.selectors.iter().all(|s| !s.starts_with("unix:uid:24")))
            })
        },
    )
    .await;
    // What is left is what the test and the fixture registered: the facade's entry and
    // the node alias that parents the executors' entries.
    let left = spire.entries().await.expect("entries");
    let mut ids: Vec<&str> = left.iter().map(|e| e.spiffe_id.as_str()).collect();
    ids.sort_unstable();
    let mut expected = [FACADE_SPIFFE_ID, NODE_ID];
    expected.sort_unstable();
    assert_eq!(ids, expected, "{left:?}");
}

/// Every `*.log` file under `dir`, for a failure's message.
fn executor_logs(dir: &std::path::Path) -> String {
    let mut out = String::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            out.push_str(&executor_logs(&path));
        } else if path.extension().is_some_and(|e| e == "log") {
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            out.push_str(&format!("== {}\n{text}\n", path.display()));
        }
    }
    out
}
