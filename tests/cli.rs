//! The binary as an operator uses it: `--help`, `check-config`, `register`.

use std::path::Path;
use std::process::{Command, Output};

use gdr_testkit::mock_gitea::{MockConfig, MockGitea};

const BIN: &str = env!("CARGO_BIN_EXE_gitea-dynamic-runner");

fn run(args: &[&str]) -> Output {
    run_with_env(args, &[])
}

/// [`run`] with `env` set (values need not be text).
fn run_with_env(args: &[&str], env: &[(&str, &std::ffi::OsStr)]) -> Output {
    Command::new(BIN)
        .args(args)
        // The caller's environment must not leak configuration into the test.
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .envs(env.iter().copied())
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

/// No DESIGN invariant (operator interface): `--help` names every subcommand of the binary.
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
        "status",
        "metrics",
        "version",
    ] {
        assert!(help.contains(sub), "{sub} missing from --help:\n{help}");
    }
}

/// DESIGN invariant 23: a subcommand's `--help` carries the configuration reference generated
/// from the key table, each key with its environment name.
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

/// DESIGN invariant 23: docs/configuration.md is byte for byte the reference the binary
/// generates from its key table, so it cannot drift from what the binary accepts.
#[test]
fn docs_configuration_md_is_exactly_the_reference_the_binary_generates() {
    let out = run(&["check-config", "--reference", "--format", "markdown"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let committed = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/configuration.md"),
    )
    .unwrap();
    assert!(
        committed == text(&out.stdout),
        "docs/configuration.md differs from `check-config --reference --format markdown`; \
         regenerate it:\n  cargo run -- check-config --reference --format markdown > \
         docs/configuration.md"
    );
}

/// DESIGN invariant 24: the metrics reference users read in the repository is generated
/// from the registry the controller serves, so it cannot drift from `/metrics`.
#[test]
fn docs_metrics_md_is_exactly_the_reference_the_binary_generates() {
    let out = run(&["metrics", "--format", "markdown"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let committed =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/metrics.md"))
            .unwrap();
    assert!(
        committed == text(&out.stdout),
        "docs/metrics.md differs from `metrics --format markdown`; regenerate it:\n  \
         cargo run -- metrics --format markdown > docs/metrics.md"
    );
}

#[test]
fn status_against_something_that_is_not_a_controller_names_the_url_and_fails() {
    let server = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = server.local_addr().unwrap();
    let answer = std::thread::spawn(move || {
        use std::io::{Read, Write};
        let (mut conn, _) = server.accept().unwrap();
        let mut request = [0u8; 1024];
        let _ = conn.read(&mut request).unwrap();
        conn.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello")
            .unwrap();
    });
    let out = run(&["status", "--url", &format!("http://{addr}")]);
    answer.join().unwrap();
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains(&format!(
            "http://{addr}/status did not answer with a status document"
        )),
        "{err}"
    );
    let out = run(&["status", "--url", "https://gitea.example"]);
    assert!(
        text(&out.stderr).contains("plain http"),
        "{}",
        text(&out.stderr)
    );
}

/// No DESIGN invariant (operator interface): a subcommand that is not implemented yet says so
/// and exits 2 instead of pretending to work.
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

/// No DESIGN invariant (operator interface): `version` prints the crate version.
#[test]
fn version_prints_the_crate_version() {
    let out = run(&["version"]);
    assert!(out.status.success());
    assert_eq!(
        text(&out.stdout).trim(),
        format!("gitea-dynamic-runner {}", env!("CARGO_PKG_VERSION"))
    );
}

/// DESIGN invariant 23: a value that does not have its key's declared type is refused, naming
/// the key, its environment name and the value.
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

/// No DESIGN invariant (operator interface): a configuration file that is not TOML is refused
/// with the position of the error.
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

/// DESIGN invariants 17, 23: `check-config` lists every problem at once — a required key by
/// name, a secret file it cannot read by key and path — and still shows what it parsed.
#[test]
fn check_config_lists_every_problem_and_unreadable_secret_files() {
    let out = run(&[
        "check-config",
        "--set",
        "gitea_instance_url=http://gitea.local",
        "--set",
        "gitea_runner_token_file=/nonexistent/token",
        // The cluster mode: single-host mode defaults the trust domain (issue 14).
        "--set",
        "nats_url=nats://127.0.0.1:4222",
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

/// No DESIGN invariant (issue 10, bad values from operators): a configuration variable
/// whose value is not UTF-8 is named as such. It used to be skipped as if unset, so a set
/// `TRUST_DOMAIN` was reported as "is required".
#[test]
fn check_config_names_a_configuration_variable_whose_value_is_not_utf8() {
    use std::os::unix::ffi::OsStrExt as _;
    let out = run_with_env(
        &[
            "check-config",
            "--set",
            "gitea_instance_url=http://gitea.local",
            // The cluster mode: single-host mode would default the trust domain.
            "--set",
            "nats_url=nats://127.0.0.1:4222",
        ],
        &[(
            "TRUST_DOMAIN",
            std::ffi::OsStr::from_bytes(b"ex\xffample.org"),
        )],
    );
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("TRUST_DOMAIN") && err.contains("not UTF-8"),
        "{err}"
    );
    assert!(!err.contains("is required"), "{err}");
}

/// DESIGN invariant 17: a complete configuration is accepted, and `check-config` shows secret
/// files by path, never their content.
#[test]
fn check_config_accepts_a_complete_configuration() {
    let dir = tempfile::tempdir().expect("tempdir");
    let secret = |name: &str, value: &str| {
        let p = dir.path().join(name);
        write_secret(&p, value);
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

    // DESIGN invariant 17: a secret file others can read is refused, naming it and its
    // mode (as ssh refuses such private keys); `group-readable` allows a platform's 0440.
    use std::os::unix::fs::PermissionsExt;
    let token = dir.path().join("token");
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    let out = run(&["check-config", "--config", file.to_str().expect("utf8")]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("GITEA_RUNNER_TOKEN_FILE")
            && err.contains(&token.display().to_string())
            && err.contains("mode 0644"),
        "{err}"
    );
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o440)).expect("chmod");
    let out = run(&["check-config", "--config", file.to_str().expect("utf8")]);
    assert!(!out.status.success(), "0440 is group-readable");
    let out = run(&[
        "check-config",
        "--config",
        file.to_str().expect("utf8"),
        "--set",
        "secret_file_permissions=group-readable",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
}

/// Writes a secret file as an operator should: readable by its owner only.
fn write_secret(path: &Path, content: &str) {
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .expect("open");
    std::io::Write::write_all(&mut file, content.as_bytes()).expect("write");
}

fn mode(path: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path)
        .expect("metadata")
        .permissions()
        .mode()
        & 0o777
}

/// DESIGN invariants 1, 17: `register` creates the controller's one Gitea registration
/// (`self-hosted`, `pod` and the VM label; not ephemeral) and keeps its credential only in
/// owner-only (0600) files: never printed or logged, never overwritten without `--force`.
#[tokio::test(flavor = "multi_thread")]
async fn register_writes_private_credential_files_and_refuses_to_overwrite_them() {
    let mock = MockGitea::start(MockConfig::default().with_registration_token("reg-1"))
        .await
        .expect("mock");
    let dir = tempfile::tempdir().expect("tempdir");
    let reg = dir.path().join("registration-token");
    write_secret(&reg, "reg-1\n");
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

/// No DESIGN invariant (operator interface): a registration Gitea refuses fails naming the
/// Register call and writes no credential file.
#[tokio::test(flavor = "multi_thread")]
async fn register_with_a_wrong_token_fails_clearly_and_writes_nothing() {
    let mock = MockGitea::start(MockConfig::default().with_registration_token("right"))
        .await
        .expect("mock");
    let dir = tempfile::tempdir().expect("tempdir");
    let reg = dir.path().join("registration-token");
    write_secret(&reg, "wrong");
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

/// No DESIGN invariant (operator interface): `register` without the Gitea settings names the
/// missing key and its environment name.
#[test]
fn register_without_the_gitea_settings_names_what_is_missing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let reg = dir.path().join("registration-token");
    write_secret(&reg, "x");
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

/// Compatibility contract: the executor reads its assignment from the Go version's environment
/// names and names a missing one (`CI_ASSIGNMENT_ID`).
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

/// No DESIGN invariant (operator interface): the controller refuses to start on an incomplete
/// configuration and lists every missing key (`local_identity` for the process backend,
/// `trust_domain`).
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

/// No DESIGN invariant (operator interface; a defect of issue 8): an unreadable `gitea_ca_file`
/// is reported as unreadable, naming the key and the path; it was reported as "cannot write …".
#[test]
fn register_with_an_unreadable_ca_file_says_it_cannot_read_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let reg = dir.path().join("registration-token");
    write_secret(&reg, "x");
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

/// Issue 9: the reference describes the binary as it is: leaving `nats_url` unset is the
/// implemented single-host mode, and no format of the reference says otherwise.
#[test]
fn the_reference_says_single_host_mode_is_what_an_unset_nats_url_means() {
    for format in ["text", "markdown", "nix", "json"] {
        let out = run(&["check-config", "--reference", "--format", format]);
        assert!(out.status.success());
        let reference = text(&out.stdout);
        assert!(
            !reference.contains("not implemented"),
            "the {format} reference claims something is not implemented"
        );
        assert!(
            reference.contains("Unset: single-host mode with an embedded, supervised nats-server"),
            "the {format} reference does not describe single-host mode"
        );
    }
}
