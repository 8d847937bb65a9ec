//! The binary as an operator uses it: `--help`, `check-config`, `register`.

// A panic is how a test (or a benchmark harness) fails.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::{Command, Output};

use gdr_testkit::mock_gitea::{MockConfig, MockGitea};

const BIN: &str = env!("CARGO_BIN_EXE_gitea-dynamic-runner");

fn run(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        // The caller's environment must not leak configuration into the test.
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .output()
        .expect("binary runs")
}

async fn run_async(args: Vec<String>) -> Output {
    tokio::task::spawn_blocking(move || run(&args.iter().map(String::as_str).collect::<Vec<_>>()))
        .await
        .expect("join")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn help_lists_every_subcommand() {
    let out = run(&["--help"]);
    assert!(out.status.success());
    let help = text(&out.stdout);
    for sub in [
        "controller",
        "executor",
        "sandbox-identity",
        "register",
        "check-config",
        "version",
    ] {
        assert!(help.contains(sub), "{sub} missing from --help:\n{help}");
    }
}

#[test]
fn subcommand_help_carries_the_configuration_reference() {
    let out = run(&["check-config", "--help"]);
    let help = text(&out.stdout);
    assert!(help.contains("pod_capacity / POD_CAPACITY"), "{help}");
    assert!(
        help.contains("gitea_runner_token_file / GITEA_RUNNER_TOKEN_FILE"),
        "{help}"
    );
}

#[test]
fn sandbox_identity_without_its_settings_names_the_missing_key_and_fails() {
    let out = run(&[
        "sandbox-identity",
        "--set",
        "opensandbox_namespace=Bad_Name",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(
        err.contains("trust_domain (TRUST_DOMAIN): is required"),
        "{err}"
    );
    assert!(
        err.contains("opensandbox_namespace (OPENSANDBOX_NAMESPACE)"),
        "{err}"
    );
    let help = text(&run(&["sandbox-identity", "--help"]).stdout);
    assert!(
        help.contains("spire_cluster_name / SPIRE_CLUSTER_NAME"),
        "{help}"
    );
}

#[test]
fn version_prints_the_crate_version() {
    let out = run(&["version"]);
    assert!(out.status.success());
    assert_eq!(
        text(&out.stdout).trim(),
        format!("gitea-dynamic-runner {}", env!("CARGO_PKG_VERSION"))
    );
}

#[test]
fn check_config_with_a_broken_file_names_the_key_and_fails() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("broken.toml");
    std::fs::write(&file, "pod_capacity = \"lots\"\n").expect("write");
    let out = run(&["check-config", "--config", file.to_str().expect("utf8")]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("pod_capacity (POD_CAPACITY)") && err.contains("lots"),
        "{err}"
    );
}

#[test]
fn check_config_with_unparsable_toml_fails_with_the_file_position() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("broken.toml");
    std::fs::write(&file, "pod_capacity = = 3\n").expect("write");
    let out = run(&["check-config", "--config", file.to_str().expect("utf8")]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("line 1"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn check_config_lists_every_problem_and_unreadable_secret_files() {
    let out = run(&[
        "check-config",
        "--set",
        "gitea_instance_url=http://gitea.local",
        "--set",
        "gitea_runner_token_file=/nonexistent/token",
    ]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("trust_domain (TRUST_DOMAIN): is required"),
        "{err}"
    );
    assert!(
        err.contains("GITEA_RUNNER_TOKEN_FILE") && err.contains("/nonexistent/token"),
        "{err}"
    );
    assert!(text(&out.stdout).contains("gitea_instance_url = \"http://gitea.local\""));
}

#[test]
fn check_config_accepts_a_complete_configuration() {
    let dir = tempfile::tempdir().expect("tempdir");
    let secret = |name: &str, value: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, value).expect("write");
        p.to_string_lossy().into_owned()
    };
    let toml = format!(
        "components = \"scheduler,pod-worker\"\n\
         gitea_instance_url = \"https://gitea.example.org\"\n\
         gitea_runner_uuid_file = {uuid:?}\ngitea_runner_token_file = {token:?}\n\
         trust_domain = \"example.org\"\n\
         runner_facade_capability_key_file = {key:?}\n\
         runner_facade_url = \"https://facade:8443\"\n\
         runner_facade_spiffe_id = \"spiffe://example.org/controller\"\n\
         spiffe_endpoint_socket = \"unix:///run/spire.sock\"\n\
         pod_executor_image = \"registry/executor:1\"\n\
         spire_agent_id = \"spiffe://example.org/spire/agent/x\"\n",
        uuid = secret("uuid", "u"),
        token = secret("token", "t"),
        key = secret("key", "0123456789abcdef0123456789abcdef"),
    );
    let file = dir.path().join("ok.toml");
    std::fs::write(&file, toml).expect("write");
    let out = run(&["check-config", "--config", file.to_str().expect("utf8")]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    // Only the path of the token file is shown, never its content.
    assert!(!text(&out.stdout).contains("0123456789abcdef"));
}

fn mode(path: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path)
        .expect("metadata")
        .permissions()
        .mode()
        & 0o777
}

#[tokio::test(flavor = "multi_thread")]
async fn register_writes_private_credential_files_and_refuses_to_overwrite_them() {
    let mock = MockGitea::start(MockConfig::default().with_registration_token("reg-1"))
        .await
        .expect("mock");
    let dir = tempfile::tempdir().expect("tempdir");
    let reg = dir.path().join("registration-token");
    std::fs::write(&reg, "reg-1\n").expect("write");
    let uuid_file = dir.path().join("uuid");
    let token_file = dir.path().join("token");
    let args = |extra: &[&str]| {
        let mut a: Vec<String> = vec![
            "register".into(),
            "--set".into(),
            format!("gitea_instance_url={}", mock.url),
            "--set".into(),
            format!("gitea_runner_uuid_file={}", uuid_file.display()),
            "--set".into(),
            format!("gitea_runner_token_file={}", token_file.display()),
            "--set".into(),
            "vm_runner_label=vm-dev".into(),
            "--registration-token-file".into(),
            reg.display().to_string(),
        ];
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };

    let out = run_async(args(&[])).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains("Next:") && stdout.contains("GITEA_RUNNER_TOKEN_FILE"),
        "{stdout}"
    );
    let uuid = std::fs::read_to_string(&uuid_file)
        .expect("uuid")
        .trim()
        .to_string();
    let token = std::fs::read_to_string(&token_file)
        .expect("token")
        .trim()
        .to_string();
    assert_eq!(mode(&uuid_file), 0o600);
    assert_eq!(mode(&token_file), 0o600);
    let runner = mock.handle.runner(&uuid).expect("registered in Gitea");
    assert_eq!(runner.labels, vec!["self-hosted", "pod", "vm-dev"]);
    assert!(!runner.ephemeral);
    assert!(!stdout.contains(&token), "the token must not be printed");
    assert!(
        !text(&out.stderr).contains(&token),
        "the token must not be logged"
    );

    let again = run_async(args(&[])).await;
    assert!(!again.status.success());
    assert!(
        text(&again.stderr).contains("already exists"),
        "{}",
        text(&again.stderr)
    );
    assert_eq!(
        std::fs::read_to_string(&uuid_file).expect("uuid").trim(),
        uuid,
        "files untouched"
    );

    let forced = run_async(args(&["--force", "--labels", "self-hosted,pod"])).await;
    assert!(forced.status.success(), "{}", text(&forced.stderr));
    let new_uuid = std::fs::read_to_string(&uuid_file)
        .expect("uuid")
        .trim()
        .to_string();
    assert_ne!(new_uuid, uuid);
    assert_eq!(
        mock.handle.runner(&new_uuid).expect("runner").labels,
        vec!["self-hosted", "pod"]
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn register_with_a_wrong_token_fails_clearly_and_writes_nothing() {
    let mock = MockGitea::start(MockConfig::default().with_registration_token("right"))
        .await
        .expect("mock");
    let dir = tempfile::tempdir().expect("tempdir");
    let reg = dir.path().join("registration-token");
    std::fs::write(&reg, "wrong").expect("write");
    let uuid_file = dir.path().join("uuid");
    let out = run_async(vec![
        "register".into(),
        "--set".into(),
        format!("gitea_instance_url={}", mock.url),
        "--set".into(),
        format!("gitea_runner_uuid_file={}", uuid_file.display()),
        "--set".into(),
        format!(
            "gitea_runner_token_file={}",
            dir.path().join("token").display()
        ),
        "--registration-token-file".into(),
        reg.display().to_string(),
    ])
    .await;
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).starts_with("error: Register: "),
        "{}",
        text(&out.stderr)
    );
    assert!(!uuid_file.exists());
}

#[test]
fn register_without_the_gitea_settings_names_what_is_missing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let reg = dir.path().join("registration-token");
    std::fs::write(&reg, "x").expect("write");
    let out = run(&[
        "register",
        "--registration-token-file",
        reg.to_str().expect("utf8"),
    ]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("gitea_instance_url (GITEA_INSTANCE_URL): is required to register"),
        "{err}"
    );
}

#[test]
fn the_executor_without_its_environment_names_the_missing_variable() {
    let out = run(&["executor"]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("CI_ASSIGNMENT_ID: is required"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn the_controller_with_an_incomplete_configuration_lists_the_problems_and_fails() {
    let out = run(&[
        "controller",
        "--set",
        "pod_backend=process",
        "--set",
        "nats_url=nats://nats.example:4222",
    ]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("local_identity (LOCAL_IDENTITY)") && err.contains("trust_domain"),
        "{err}"
    );
}

/// Defect (issue 8): an unreadable CA file was reported as "cannot write …".
#[test]
fn register_with_an_unreadable_ca_file_says_it_cannot_read_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let reg = dir.path().join("registration-token");
    std::fs::write(&reg, "x").expect("write");
    let missing = dir.path().join("no-such-ca.pem");
    let out = run(&[
        "register",
        "--set",
        "gitea_instance_url=https://gitea.example",
        "--set",
        &format!(
            "gitea_runner_uuid_file={}",
            dir.path().join("uuid").display()
        ),
        "--set",
        &format!(
            "gitea_runner_token_file={}",
            dir.path().join("token").display()
        ),
        "--set",
        &format!("gitea_ca_file={}", missing.display()),
        "--registration-token-file",
        reg.to_str().expect("utf8"),
    ]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("gitea_ca_file")
            && err.contains("cannot read")
            && !err.contains("cannot write"),
        "{err}"
    );
    assert!(err.contains(&missing.display().to_string()), "{err}");
}
