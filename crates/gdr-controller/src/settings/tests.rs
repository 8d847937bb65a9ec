use std::io::Write;
use std::path::Path;

use super::*;

fn file_with(text: &str) -> tempfile::NamedTempFile {
    let mut f = tempfile::NamedTempFile::new().unwrap();
    f.write_all(text.as_bytes()).unwrap();
    f
}

fn sources(file: Option<&Path>, overrides: &[&str]) -> Sources {
    let mut s = Sources::overrides(overrides).unwrap();
    s.file = file.map(Path::to_path_buf);
    s
}

fn raw(overrides: &[&str]) -> Raw {
    sources(None, overrides).load().unwrap()
}

/// A complete single-host configuration, plus `extra`.
fn complete(extra: &[&str]) -> Vec<String> {
    let mut out: Vec<String> = [
        "gitea_instance_url=http://gitea.test:3000",
        "gitea_runner_uuid_file=/run/secrets/uuid",
        "gitea_runner_token_file=/run/secrets/token",
        "runner_facade_capability_key_file=/run/secrets/cap",
        "trust_domain=example.org",
        "runner_facade_url=https://127.0.0.1:8443",
        "runner_facade_spiffe_id=spiffe://example.org/controller",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    out.extend(extra.iter().map(|s| (*s).to_owned()));
    out
}

fn settings(extra: &[&str]) -> Result<Settings, SettingsError> {
    Settings::load(&Sources::overrides(complete(extra)).unwrap())
}

fn problems(extra: &[&str]) -> Vec<Problem> {
    match settings(extra) {
        Err(SettingsError::Invalid(p)) => p,
        other => panic!("expected problems, got {other:?}"),
    }
}

#[test]
fn defaults_match_the_go_version() {
    let r = Raw::default();
    assert_eq!(r.pod_capacity, 4);
    assert_eq!(r.vm_capacity, 1);
    assert_eq!(r.vm_runner_label, "vm");
    assert_eq!(r.nats_stream, "CI_RUNNER");
    assert_eq!(r.nats_subject_base, "ci.runner");
    assert_eq!(r.metadata_prefix, "ci.ddupan.top/");
    assert_eq!(r.components.0.len(), 3);
}

#[test]
fn every_key_of_the_raw_configuration_is_declared_and_every_declared_key_exists() {
    let mut all = serde_json::to_value(Raw::default())
        .unwrap()
        .as_object()
        .unwrap()
        .clone();
    for key in KEYS {
        assert!(
            all.remove(key.name).is_some(),
            "declared key {} is not a field",
            key.name
        );
        assert!(!key.doc.trim().is_empty(), "{} is undocumented", key.name);
    }
    assert!(
        all.is_empty(),
        "undeclared keys: {:?}",
        all.keys().collect::<Vec<_>>()
    );
}

#[test]
fn flags_override_the_file_and_the_file_overrides_defaults() {
    let f = file_with("pod_capacity = 7\nvm_capacity = 3\n");
    let r = sources(Some(f.path()), &["vm_capacity=9"]).load().unwrap();
    assert_eq!(r.pod_capacity, 7);
    assert_eq!(r.vm_capacity, 9);
}

#[test]
#[allow(clippy::result_large_err)] // figment::Jail's closure signature
fn the_environment_overrides_the_file_using_the_go_variable_names() {
    let f = file_with("pod_capacity = 7\ncomponents = [\"scheduler\"]\n");
    // figment::Jail isolates the process environment for this test.
    figment::Jail::expect_with(|jail| {
        jail.set_env("POD_CAPACITY", "11");
        jail.set_env("COMPONENTS", "scheduler,pod-worker");
        jail.set_env("VM_RUNNER_LABEL", "vm-dev");
        jail.set_env("HEARTBEAT_INTERVAL", "90");
        let mut s = sources(Some(f.path()), &[]);
        s.environment = true;
        let r = s.load().map_err(|e| e.to_string())?;
        assert_eq!(r.pod_capacity, 11);
        assert_eq!(r.vm_runner_label, "vm-dev");
        assert_eq!(r.heartbeat_interval, values::Secs::from_secs(90));
        assert_eq!(
            r.components.0,
            [Component::Scheduler, Component::PodWorker]
                .into_iter()
                .collect()
        );
        Ok(())
    });
}

#[test]
fn a_configuration_variable_that_is_not_utf8_is_named_instead_of_ignored() {
    use std::os::unix::ffi::OsStrExt;
    // The variable is set only in a child process running this same test, so no other
    // test sees it.
    let bin = std::env::current_exe().unwrap();
    if std::env::var_os("GDR_NOT_UTF8_PROBE").is_some() {
        let s = Sources {
            environment: true,
            ..Sources::default()
        };
        match s.load() {
            Err(SettingsError::NotUtf8 { name }) => {
                assert_eq!(name, "TRUST_DOMAIN");
                std::process::exit(0);
            }
            Err(other) => {
                eprintln!("unexpected error: {other}");
                std::process::exit(1);
            }
            Ok(_) => {
                eprintln!("the non-UTF-8 variable was not reported");
                std::process::exit(1);
            }
        }
    }
    let status = std::process::Command::new(bin)
        .args([
            "--exact",
            "settings::tests::a_configuration_variable_that_is_not_utf8_is_named_instead_of_ignored",
            "--nocapture",
        ])
        .env("GDR_NOT_UTF8_PROBE", "1")
        .env("TRUST_DOMAIN", std::ffi::OsStr::from_bytes(b"ex\xffample.org"))
        .status()
        .unwrap();
    assert!(
        status.success(),
        "the probe process did not report TRUST_DOMAIN"
    );
}

#[test]
fn a_malformed_value_names_the_key_and_the_variable() {
    let f = file_with("pod_capacity = \"many\"\n");
    let err = sources(Some(f.path()), &[])
        .load()
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("pod_capacity (POD_CAPACITY)"), "{err}");
    // figment shows the file relative to the working directory; the name is enough.
    let name = f.path().file_name().unwrap().to_string_lossy().into_owned();
    assert!(err.contains(&name), "{err}");
}

#[test]
fn an_unknown_key_in_the_file_is_an_error_naming_it() {
    let f = file_with("pod_capacty = 3\n");
    let err = sources(Some(f.path()), &[])
        .load()
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("pod_capacty"), "{err}");
}

#[test]
fn an_unknown_set_flag_is_refused() {
    let err = Sources::parse_override("pod_capacty=3")
        .unwrap_err()
        .to_string();
    assert!(err.contains("unknown key"), "{err}");
    assert!(Sources::parse_override("novalue").is_err());
}

#[test]
fn an_unknown_component_is_refused_with_the_allowed_names() {
    let err = sources(None, &["components=scheduler,gpu-worker"])
        .load()
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("gpu-worker") && err.contains("pod-worker"),
        "{err}"
    );
}

#[test]
fn a_worker_without_the_scheduler_is_refused() {
    let p = problems(&["components=pod-worker"]);
    assert!(
        p.iter()
            .any(|p| p.key == "components" && p.rule.contains("scheduler")),
        "{p:?}"
    );
}

#[test]
fn missing_required_settings_are_all_reported_at_once() {
    let sources = Sources::overrides(["nats_url=nats://nats.test:4222"]).unwrap();
    let err = Settings::load(&sources).unwrap_err().to_string();
    for key in [
        "gitea_instance_url (GITEA_INSTANCE_URL)",
        "trust_domain (TRUST_DOMAIN)",
        "gitea_runner_token_file",
        "runner_facade_url",
        "runner_facade_spiffe_id",
        "runner_facade_capability_key_file",
    ] {
        assert!(err.contains(key), "{key} missing from: {err}");
    }
}

/// Issue 14 (one command on a host): on a single host only the Gitea URL is required;
/// everything else defaults under `state_dir` or to the local identity.
#[test]
fn a_single_host_needs_only_the_gitea_url() {
    let err = Settings::load(&Sources::default()).unwrap_err().to_string();
    assert_eq!(
        err,
        "gitea_instance_url (GITEA_INSTANCE_URL): is required (the Gitea base URL; `controller --gitea-url`)"
    );
    let s = Settings::load(
        &Sources::overrides([
            "gitea_instance_url=http://gitea.test:3000",
            "state_dir=/srv/gdr",
            "gitea_runner_registration_token_file=/run/reg",
        ])
        .unwrap(),
    )
    .unwrap();
    assert_eq!(s.state_dir, Path::new("/srv/gdr"));
    assert_eq!(s.gitea.uuid_file, Path::new("/srv/gdr/runner-uuid"));
    assert_eq!(s.gitea.token_file, Path::new("/srv/gdr/runner-token"));
    assert_eq!(
        s.gitea.registration_token_file.as_deref(),
        Some(Path::new("/run/reg"))
    );
    assert_eq!(
        s.capability_key_file,
        KeyFile::Generated("/srv/gdr/capability-key".into())
    );
    assert_eq!(s.policy.trust_domain.as_str(), LOCAL_TRUST_DOMAIN);
    let facade = s.scheduler.unwrap().facade;
    assert_eq!(facade.url, None, "derived from the facade listener");
    assert_eq!(
        facade.spiffe_id,
        "spiffe://gitea-dynamic-runner.local/gitea-dynamic-runner/facade"
    );
    assert_eq!(
        (facade.listen.as_str(), s.health_listen.as_str()),
        ("127.0.0.1:8443", "127.0.0.1:9090")
    );
}

/// Issue 14: explicitly configured credential and key files win over the state_dir
/// defaults.
#[test]
fn configured_credential_files_win_over_the_state_dir_defaults() {
    let s = settings(&["state_dir=/srv/gdr"]).unwrap();
    assert_eq!(s.gitea.uuid_file, Path::new("/run/secrets/uuid"));
    assert_eq!(s.gitea.token_file, Path::new("/run/secrets/token"));
    assert_eq!(
        s.capability_key_file,
        KeyFile::Configured("/run/secrets/cap".into())
    );
}

/// Issue 14: the state directory defaults to systemd's, root's /var/lib, or the user's XDG
/// state directory.
#[test]
fn state_dir_defaults_to_the_platform_state_location() {
    let env = fake_env;
    let user = env(&[("HOME", "/home/ada")]);
    assert_eq!(
        default_state_dir(user, false).unwrap(),
        Path::new("/home/ada/.local/state/gitea-dynamic-runner")
    );
    let xdg = env(&[("HOME", "/home/ada"), ("XDG_STATE_HOME", "/x/state")]);
    assert_eq!(
        default_state_dir(xdg, false).unwrap(),
        Path::new("/x/state/gitea-dynamic-runner")
    );
    // A relative XDG_STATE_HOME is invalid by the XDG spec and ignored.
    let relative = env(&[("HOME", "/home/ada"), ("XDG_STATE_HOME", "state")]);
    assert_eq!(
        default_state_dir(relative, false).unwrap(),
        Path::new("/home/ada/.local/state/gitea-dynamic-runner")
    );
    assert_eq!(
        default_state_dir(xdg, true).unwrap(),
        Path::new("/var/lib/gitea-dynamic-runner")
    );
    let systemd = env(&[
        ("HOME", "/home/ada"),
        ("STATE_DIRECTORY", "/var/lib/gdr:/var/lib/other"),
    ]);
    assert_eq!(
        default_state_dir(systemd, true).unwrap(),
        Path::new("/var/lib/gdr")
    );
    assert_eq!(
        default_state_dir(systemd, false).unwrap(),
        Path::new("/var/lib/gdr")
    );
    let err = default_state_dir(env(&[]), false).unwrap_err();
    assert!(err.contains("set state_dir"), "{err}");
}

#[test]
fn without_a_nats_url_the_single_host_defaults_are_process_executors_local_identity_and_loopback() {
    let s = settings(&[]).unwrap();
    assert!(s.single_host());
    assert!(matches!(
        s.pod.as_ref().unwrap().kind,
        PodBackend::Process(_)
    ));
    assert!(matches!(s.vm.as_ref().unwrap().kind, VmBackend::Process(_)));
    assert!(matches!(s.identity, IdentitySource::Local));
    assert_eq!(s.health_listen, "127.0.0.1:9090");
    assert_eq!(s.scheduler.unwrap().facade.listen, "127.0.0.1:8443");
}

#[cfg(feature = "kubernetes")]
#[test]
fn with_a_nats_url_the_defaults_are_the_cluster_backends_and_every_interface() {
    let p = problems(&["nats_url=nats://nats:4222", "local_identity=false"]);
    let keys: Vec<_> = p.iter().map(|p| p.key).collect();
    assert!(keys.contains(&"pod_executor_image"), "{p:?}");
    assert!(keys.contains(&"opensandbox_api"), "{p:?}");
    assert!(keys.contains(&"spiffe_endpoint_socket"), "{p:?}");
    let s = settings(&[
        "nats_url=nats://nats:4222",
        "local_identity=false",
        "spiffe_endpoint_socket=unix:///run/spire.sock",
        "pod_executor_image=registry.example/executor@sha256:00",
        "opensandbox_api=http://osb:8080/v1",
        "opensandbox_api_key_file=/run/secrets/osb",
    ])
    .unwrap();
    assert!(matches!(s.pod.unwrap().kind, PodBackend::Kubernetes(_)));
    assert!(matches!(s.vm.unwrap().kind, VmBackend::OpenSandbox(_)));
    assert_eq!(s.health_listen, "0.0.0.0:9090");
}

#[test]
fn a_disabled_backend_has_no_section_and_no_label() {
    // Defect (issue 8): `components = "scheduler,vm-worker"` still declared `pod`.
    let s = settings(&["components=scheduler,vm-worker"]).unwrap();
    assert!(s.pod.is_none());
    assert_eq!(s.declared_labels(), ["self-hosted", "vm"]);
    // Each enabled backend's backlog defaults to its own capacity; a disabled one has none.
    assert_eq!(s.scheduler.as_ref().unwrap().backlog_limit, None);
    assert_eq!(s.capacities(), [(Backend::Vm, 1)]);
    let s = settings(&["vm_capacity=0", "vm_runner_label=vm-dev"]).unwrap();
    assert!(s.vm.is_none());
    assert_eq!(s.declared_labels(), ["self-hosted", "pod"]);
    let s = settings(&["vm_runner_label=vm-dev"]).unwrap();
    assert_eq!(s.declared_labels(), ["self-hosted", "pod", "vm-dev"]);
    assert_eq!(s.capacities(), [(Backend::Pod, 4), (Backend::Vm, 1)]);
}

/// `fetch_pollers_max` defaults to a modest bound and refuses zero, naming the key.
#[test]
fn fetch_pollers_max_defaults_to_eight_and_must_be_at_least_one() {
    let s = settings(&[]).unwrap();
    assert_eq!(s.scheduler.unwrap().fetch_pollers_max, 8);
    let s = settings(&["fetch_pollers_max=2"]).unwrap();
    assert_eq!(s.scheduler.unwrap().fetch_pollers_max, 2);
    let e = settings(&["fetch_pollers_max=0"]).unwrap_err().to_string();
    assert!(e.contains("fetch_pollers_max"), "{e}");
}

/// `fetch_interval` defaults to the official runner's 2s, takes any duration from 100ms
/// and refuses a shorter one (an idle busy loop against Gitea), naming the key.
#[test]
fn fetch_interval_defaults_to_two_seconds_and_must_be_at_least_100ms() {
    let s = settings(&[]).unwrap();
    assert_eq!(s.scheduler.unwrap().fetch_interval, Duration::from_secs(2));
    let s = settings(&["fetch_interval=1h"]).unwrap();
    assert_eq!(
        s.scheduler.unwrap().fetch_interval,
        Duration::from_secs(3600)
    );
    let e = settings(&["fetch_interval=10ms"]).unwrap_err().to_string();
    assert!(e.contains("fetch_interval"), "{e}");
}

#[test]
fn register_settings_need_only_gitea_and_declare_the_enabled_labels() {
    let s = RegisterSettings::load(
        &Sources::overrides([
            "gitea_instance_url=http://gitea.test",
            "gitea_runner_uuid_file=/tmp/u",
            "gitea_runner_token_file=/tmp/t",
            "components=scheduler,pod-worker",
        ])
        .unwrap(),
    )
    .unwrap();
    assert_eq!(s.labels, ["self-hosted", "pod"]);
    let err = RegisterSettings::load(&Sources::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("gitea_instance_url"), "{err}");
}

#[test]
fn the_lease_duration_reaches_the_leader_settings() {
    // Defect (issue 8): the runtime hard-coded 15s.
    let s = settings(&["leader_election=true", "lease_duration=4s"]).unwrap();
    assert_eq!(s.leader.unwrap().lease_duration, Duration::from_secs(4));
    assert!(
        problems(&["lease_duration=1s"])
            .iter()
            .any(|p| p.key == "lease_duration")
    );
}

#[test]
fn a_non_http_gitea_url_is_refused() {
    assert!(
        problems(&["gitea_instance_url=ftp://x"])
            .iter()
            .any(|p| p.key == "gitea_instance_url")
    );
}

#[test]
fn a_plain_http_facade_url_is_refused_at_start_not_at_the_first_job() {
    let p = problems(&["runner_facade_url=http://127.0.0.1:8443"]);
    assert!(
        p.iter()
            .any(|p| p.key == "runner_facade_url" && p.rule.contains("https")),
        "{p:?}"
    );
}

#[test]
fn capacities_are_bounded_with_a_clear_message() {
    let p = problems(&["pod_capacity=20000"]);
    assert!(
        p.iter()
            .any(|p| p.key == "pod_capacity" && p.rule.contains("10000")),
        "{p:?}"
    );
    let err = sources(None, &["pod_capacity=4294967296"])
        .load()
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("pod_capacity"), "{err}");
}

#[test]
fn the_vm_label_is_checked_by_the_one_domain_rule() {
    for bad in ["pod", "self-hosted", "vm dev", ""] {
        let p = problems(&[&format!("vm_runner_label={bad}")]);
        assert!(
            p.iter().any(|p| p.key == "vm_runner_label"),
            "{bad:?}: {p:?}"
        );
    }
}

#[test]
fn durations_accept_humantime_and_seconds_and_reject_garbage() {
    assert_eq!(
        raw(&["heartbeat_interval=2m"]).heartbeat_interval.0,
        Duration::from_secs(120)
    );
    let err = sources(None, &["heartbeat_interval=soon"])
        .load()
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("heartbeat_interval") && err.contains("soon"),
        "{err}"
    );
}

#[test]
fn rendering_masks_credentials_in_urls_and_shows_only_secret_paths() {
    let text = render(&raw(&[
        "nats_url=nats://user:hunter2@nats:4222",
        "gitea_runner_token_file=/run/secrets/token",
    ]));
    assert!(!text.contains("hunter2"), "{text}");
    assert!(text.contains("nats://<redacted>@nats:4222"), "{text}");
    assert!(
        text.contains("gitea_runner_token_file = \"/run/secrets/token\""),
        "{text}"
    );
}

#[test]
fn secret_files_are_trimmed_and_empty_ones_refused_without_showing_content() {
    let f = file_with("  s3cret\n");
    assert_eq!(read_secret_file("k", f.path()).unwrap(), "s3cret");
    let empty = file_with("\n");
    let err = read_secret_file("gitea_runner_token_file", empty.path())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("GITEA_RUNNER_TOKEN_FILE") && err.contains("empty"),
        "{err}"
    );
}

#[test]
fn check_lists_unreadable_secret_files_with_their_key() {
    let checked = check(&Sources::overrides(complete(&[])).unwrap()).unwrap();
    assert!(
        checked
            .problems
            .iter()
            .any(|p| p.contains("RUNNER_FACADE_CAPABILITY_KEY_FILE")
                && p.contains("/run/secrets/cap")),
        "{:?}",
        checked.problems
    );
}

/// Issue 36 step 3: `check-config` warns about a plain secret variable for every key the
/// key table marks secret, not for a hand-kept subset, and names that key's file variable.
#[test]
fn every_secret_key_has_its_plain_variable_warned_about() {
    let warned = plain_secret_variables();
    let secret: Vec<&Key> = KEYS.iter().filter(|k| k.secret).collect();
    assert_eq!(secret.len(), 10, "the secret keys changed: {secret:?}");
    for key in secret {
        assert!(
            warned.iter().any(|(_, file)| *file == key.env()),
            "{} is marked secret but its plain variable is not warned about: {warned:?}",
            key.name
        );
    }
    assert!(
        warned.contains(&(
            "GITEA_RUNNER_TOKEN".to_owned(),
            "GITEA_RUNNER_TOKEN_FILE".to_owned()
        )),
        "{warned:?}"
    );
}

/// DESIGN invariant 19: the executor's outage tolerance reaches the executors, defaults to
/// 30 minutes and is never below the official runner's own 10 s retry.
#[test]
fn the_report_outage_tolerance_defaults_to_30_minutes_and_is_at_least_the_runners_own_retry() {
    let s = settings(&[]).unwrap();
    assert_eq!(
        s.executors.report_outage_tolerance,
        Duration::from_secs(1800)
    );
    let s = settings(&["executor_report_outage_tolerance=2m"]).unwrap();
    assert_eq!(
        s.executors.report_outage_tolerance,
        Duration::from_secs(120)
    );
    let p = problems(&["executor_report_outage_tolerance=5s"]);
    assert!(
        p.iter()
            .any(|p| p.key == "executor_report_outage_tolerance"),
        "{p:?}"
    );
}

/// DESIGN invariant 5 (issue 9): wherever a plaintext v1 envelope would be written,
/// `check-config` names it; single-host mode generates a key instead.
#[test]
fn check_lists_plaintext_envelopes_as_a_problem_only_where_they_would_be_written() {
    let plaintext = |extra: &[&str]| {
        check(&Sources::overrides(complete(extra)).unwrap())
            .unwrap()
            .problems
            .iter()
            .any(|p| {
                p.starts_with("task_encryption_key_file (TASK_ENCRYPTION_KEY_FILE)")
                    && p.contains("plaintext v1")
            })
    };
    assert!(plaintext(&["nats_url=nats://nats:4222"]));
    assert!(!plaintext(&[]), "single host generates a key");
    assert!(!plaintext(&[
        "nats_url=nats://nats:4222",
        "task_encryption_key_file=/run/secrets/task-key"
    ]));
    assert!(
        !plaintext(&["nats_url=nats://nats:4222", "components=pod-worker"]),
        "only the scheduler writes envelopes"
    );
}

/// Issue 9: the process backend keeps ended executors' logs for the configured time and
/// count.
#[test]
fn the_executor_log_retention_reaches_the_process_backend() {
    let s = settings(&[
        "executor_log_retention=1h",
        "executor_log_retention_count=3",
    ])
    .unwrap();
    let Some(BackendSettings {
        kind: PodBackend::Process(process),
        ..
    }) = s.pod
    else {
        panic!("single host runs pod jobs as processes")
    };
    assert_eq!(process.log_retention.max_age, Duration::from_secs(3600));
    assert_eq!(process.log_retention.max_count, 3);
}

/// The Pod section: every key reaches the backend's settings; tables come from TOML or the
/// environment; errors name the key and the entry.
#[cfg(feature = "kubernetes")]
mod pod_keys {
    use super::*;

    /// A cluster configuration with the kubernetes pod backend, from `toml` on top of
    /// [`complete`].
    fn cluster(toml: &str) -> Result<Settings, SettingsError> {
        let f = file_with(toml);
        let mut overrides = complete(&[
            "nats_url=nats://nats:4222",
            "components=scheduler,pod-worker",
            "spiffe_endpoint_socket=unix:///run/spire.sock",
        ]);
        if !toml.contains("pod_executor_image") {
            overrides.push("pod_executor_image=registry.example/executor@sha256:00".into());
        }
        let refs: Vec<&str> = overrides.iter().map(String::as_str).collect();
        Settings::load(&sources(Some(f.path()), &refs))
    }

    fn kubernetes(s: &Settings) -> &KubernetesSettings {
        match &s.pod.as_ref().expect("pod backend").kind {
            PodBackend::Kubernetes(k) => k,
            other => panic!("not kubernetes: {other:?}"),
        }
    }

    fn pod_problems(toml: &str) -> Vec<String> {
        match cluster(toml) {
            Err(SettingsError::Invalid(p)) => p.iter().map(ToString::to_string).collect(),
            other => panic!("expected problems, got {other:?}"),
        }
    }

    const FULL: &str = r#"
pod_namespace = "ci"
pod_service_account = "runner"
pod_executor_uid = 3000
pod_privileged = false
pod_docker_storage_limit = "50Gi"
pod_active_deadline = "2h"
pod_automount_service_account_token = true
pod_executor_args = ["executor", "--verbose"]
pod_spiffe_csi_driver = "csi.example.org"
pod_spiffe_socket_dir = "/run/agent"
pod_spiffe_socket_name = "agent.sock"
pod_orphan_secret_grace = "20m"
pod_identity_bind_deadline = "45s"
spire_cluster = "c1"
spire_class = "k1"
spire_agent_id = "spiffe://example.org/spire/agent/fixed"

[pod_executor_env]
GITEA_RUNNER_BINARY = "/usr/local/bin/gitea-runner"

[pod_resources]
requests = { cpu = "500m", memory = "1Gi" }
limits = { memory = "4Gi" }

[pod_profile_max]
cpu = 8
memory = "32Gi"

[pod_volume_allow_list.cache]
persistentVolumeClaim = { claimName = "ci-cache" }

[pod_profiles.large]
requests = { cpu = 4 }
limits = { memory = "16Gi" }
node_selector = { "node.example.org/size" = "large" }
tolerations = [{ key = "size", operator = "Equal", value = "large", effect = "NoSchedule" }]
runtime_class_name = "hardened"
volumes = [{ name = "cache", mount_path = "/cache" }]
image = "registry.example/executor-large@sha256:11"

[pod_profiles.gpu]
node_selector = { gpu = "true" }
"#;

    /// Every Pod key of a TOML file reaches the backend's settings (the runtime hands
    /// them to the backend as they are).
    #[test]
    fn every_pod_key_of_the_file_reaches_the_backends_settings() {
        let s = cluster(FULL).unwrap();
        let k = kubernetes(&s);
        assert_eq!(k.namespace, "ci");
        assert_eq!(k.service_account, "runner");
        assert_eq!(k.executor_uid, 3000);
        assert!(!k.privileged && k.automount_service_account_token);
        assert_eq!(k.docker_storage_limit, "50Gi");
        assert_eq!(k.active_deadline, Duration::from_secs(7200));
        assert_eq!(k.executor_args, ["executor", "--verbose"]);
        assert_eq!(
            k.workload_api_volume,
            gdr_backends::kubernetes::WorkloadApiVolume::Csi {
                driver: "csi.example.org".into()
            }
        );
        assert_eq!(k.endpoint_socket(), "unix:///run/agent/agent.sock");
        assert_eq!(k.orphan_secret_grace, Duration::from_secs(1200));
        assert_eq!(k.identity_deadline, Duration::from_secs(45));
        assert_eq!(
            (k.spire_cluster.as_str(), k.spire_class.as_str()),
            ("c1", "k1")
        );
        assert_eq!(
            k.spire_agent_id.as_deref(),
            Some("spiffe://example.org/spire/agent/fixed")
        );
        assert_eq!(
            k.extra_env["GITEA_RUNNER_BINARY"],
            "/usr/local/bin/gitea-runner"
        );
        assert_eq!(k.default_resources.requests["cpu"], "500m");
        assert_eq!(k.default_resources.limits["memory"], "4Gi");
        assert_eq!(k.maxima["cpu"], "8", "a plain number is a quantity");
        let claim = k.volume_allow_list["cache"]
            .persistent_volume_claim
            .as_ref()
            .unwrap();
        assert_eq!(claim.claim_name, "ci-cache");
        let large = &k.profiles["large"];
        assert_eq!(large.resources.requests["cpu"], "4");
        assert_eq!(large.node_selector["node.example.org/size"], "large");
        assert_eq!(large.tolerations[0].effect.as_deref(), Some("NoSchedule"));
        assert_eq!(large.runtime_class_name.as_deref(), Some("hardened"));
        assert_eq!(large.volumes[0].mount_path, "/cache");
        assert!(large.volumes[0].read_only);
        assert_eq!(
            large.image.as_deref(),
            Some("registry.example/executor-large@sha256:11")
        );
        assert_eq!(
            s.declared_labels(),
            ["self-hosted", "pod", "gpu", "large"],
            "profile labels are declared to Gitea"
        );
        let full = file_with(FULL);
        assert!(
            check(&Sources::file(full.path()))
                .unwrap()
                .rendered
                .contains("pod_profile_max = { cpu = 8, memory = \"32Gi\" }"),
            "check-config renders tables as TOML"
        );
    }

    /// Issue 39 item 5: warm Pods are off unless counted, per profile or for Pods without
    /// one; the VM backend has no such key, its OpenSandbox Pool being its warm pool.
    #[test]
    fn warm_pools_are_off_by_default_and_counted_per_profile() {
        let s = cluster("").unwrap();
        assert!(kubernetes(&s).warm_pools().is_empty(), "off by default");
        let s =
            cluster("pod_warm_pool = 2\npod_profiles = { large = { warm_pool = 1 }, gpu = {} }\n")
                .unwrap();
        let pools: Vec<(Option<String>, u32)> = kubernetes(&s).warm_pools().into_iter().collect();
        assert_eq!(pools, [(None, 2), (Some("large".to_owned()), 1)]);
        assert_eq!(
            kubernetes(&s).warm_start_deadline,
            Duration::from_secs(600),
            "a member may take executor_start_deadline to run"
        );
        let s = cluster("pod_warm_pool = 1\nexecutor_start_deadline = \"3m\"\n").unwrap();
        assert_eq!(kubernetes(&s).warm_start_deadline, Duration::from_secs(180));
    }

    /// A cluster without the SPIFFE CSI driver gets the agent's socket directory from the
    /// node (`pod_spiffe_host_path`); a path that is not an absolute node directory is
    /// refused naming the key.
    #[test]
    fn a_host_path_replaces_the_csi_volume_and_must_be_absolute() {
        let s = cluster("pod_spiffe_host_path = \"/run/spire/agent-sockets\"").unwrap();
        assert_eq!(
            kubernetes(&s).workload_api_volume,
            gdr_backends::kubernetes::WorkloadApiVolume::HostPath {
                path: "/run/spire/agent-sockets".into()
            }
        );
        let problems = pod_problems("pod_spiffe_host_path = \"run/spire\"");
        assert!(
            problems
                .iter()
                .any(|p| p.contains("pod_spiffe_host_path")
                    && p.contains("not an absolute directory")),
            "{problems:?}"
        );
    }

    #[test]
    fn the_defaults_are_the_go_versions_pod_spec() {
        let s = cluster("").unwrap();
        let k = kubernetes(&s);
        assert_eq!(k.namespace, "gitea-actions");
        assert_eq!(k.service_account, "gitea-task-executor");
        assert_eq!(k.executor_uid, 2000);
        assert!(k.privileged && !k.automount_service_account_token);
        assert_eq!(k.docker_storage_limit, "20Gi");
        assert_eq!(k.active_deadline, Duration::from_secs(3 * 3600 + 600));
        assert_eq!(k.executor_args, ["executor"]);
        assert_eq!(
            k.endpoint_socket(),
            "unix:///run/spire/agent-sockets/spire-agent.sock"
        );
        assert_eq!(
            (k.spire_cluster.as_str(), k.spire_class.as_str()),
            ("homelab", "spire-mgmt-spire")
        );
        assert!(k.spire_agent_id.is_none() && k.profiles.is_empty());
        assert_eq!(s.declared_labels(), ["self-hosted", "pod"]);
    }

    /// A table in the environment uses figment's `{key = value}` syntax.
    #[test]
    #[allow(clippy::result_large_err)] // figment::Jail's closure signature
    fn profiles_can_come_from_the_environment() {
        figment::Jail::expect_with(|jail| {
            jail.set_env(
                "POD_PROFILES",
                r#"{large={limits={memory="8Gi"}, node_selector={"kubernetes.io/arch"="arm64"}}}"#,
            );
            let mut s = sources(None, &[]);
            s.environment = true;
            let r = s.load().map_err(|e| e.to_string())?;
            let large = &r.pod_profiles.0["large"];
            assert_eq!(large["limits"]["memory"], "8Gi");
            assert_eq!(large["node_selector"]["kubernetes.io/arch"], "arm64");
            Ok(())
        });
    }

    /// Errors name the key (and its variable) and the entry: a misconfigured profile stops
    /// the controller at start instead of failing jobs.
    #[test]
    fn broken_pod_tables_are_refused_naming_the_key_and_the_entry() {
        for (toml, key, detail) in [
            (
                "[pod_profiles.large]\nlimit = { memory = \"4Gi\" }\n",
                "pod_profiles (POD_PROFILES): large:",
                "unknown field `limit`",
            ),
            (
                "[pod_profile_max]\nmemory = \"8Gi\"\n[pod_profiles.large]\nlimits = { memory = \"16Gi\" }\n",
                "pod_profiles (POD_PROFILES): large:",
                "exceeds the operator maximum 8Gi",
            ),
            (
                "[pod_profiles.large]\nvolumes = [{ name = \"host\", mount_path = \"/host\" }]\n",
                "pod_profiles (POD_PROFILES): large.volumes:",
                "\"host\" is not in pod_volume_allow_list",
            ),
            (
                "[pod_volume_allow_list.cache]\npersistentVolumeclaim = { claimName = \"x\" }\n",
                "pod_volume_allow_list (POD_VOLUME_ALLOW_LIST): cache:",
                "unknown field \"persistentVolumeclaim\"",
            ),
            (
                "[pod_profiles.vm]\nruntime_class_name = \"kata\"\n",
                "pod_profiles (POD_PROFILES): \"vm\":",
                "selects the runner or a backend",
            ),
            // Issue 37: no SVID reaches a Kata guest through the SPIFFE CSI socket.
            (
                "[pod_profiles.isolated]\nruntime_class_name = \"kata-qemu\"\n",
                "pod_profiles (POD_PROFILES): \"isolated\": runtime_class_name \"kata-qemu\" runs the Pod in a Kata guest",
                "Run such jobs on the VM backend",
            ),
            (
                "[pod_executor_env]\nDEBUG = 1\n",
                "pod_executor_env (POD_EXECUTOR_ENV): DEBUG:",
                "must be a string",
            ),
            (
                "[pod_resources]\nrequests = { cpu = \"lots\" }\n",
                "pod_resources (POD_RESOURCES):",
                "is not a quantity",
            ),
            (
                "pod_docker_storage_limit = \"big\"\n",
                "pod_docker_storage_limit (POD_DOCKER_STORAGE_LIMIT):",
                "is not a quantity",
            ),
            (
                "pod_executor_image = \"\"\n",
                "pod_executor_image (POD_EXECUTOR_IMAGE):",
                "is required",
            ),
            (
                "pod_privileged = false\npod_executor_uid = 0\n",
                "pod_executor_uid (POD_EXECUTOR_UID):",
                "never run as root",
            ),
            (
                "pod_executor_uid = 0\n",
                "pod_executor_uid (POD_EXECUTOR_UID):",
                "never run as root",
            ),
        ] {
            let problems = pod_problems(toml);
            assert!(
                problems
                    .iter()
                    .any(|p| p.starts_with(key) && p.contains(detail)),
                "{toml}: expected {key} … {detail}, got {problems:?}"
            );
        }
    }

    #[test]
    fn register_declares_the_profile_labels_with_the_kubernetes_pod_backend_only() {
        let f = file_with("[pod_profiles.large]\n[pod_profiles.gpu]\n");
        let base = [
            "gitea_instance_url=http://gitea.test",
            "gitea_runner_uuid_file=/tmp/u",
            "gitea_runner_token_file=/tmp/t",
            "components=scheduler,pod-worker",
        ];
        let load = |extra: &str| {
            let mut o = base.to_vec();
            o.push(extra);
            RegisterSettings::load(&sources(Some(f.path()), &o)).unwrap()
        };
        assert_eq!(
            load("pod_backend=kubernetes").labels,
            ["self-hosted", "pod", "gpu", "large"]
        );
        assert_eq!(load("pod_backend=process").labels, ["self-hosted", "pod"]);
    }
}

#[cfg(not(feature = "kubernetes"))]
#[test]
fn without_the_kubernetes_feature_the_pod_backend_is_refused_naming_the_feature() {
    let p = problems(&[
        "pod_backend=kubernetes",
        "pod_executor_image=i",
        "vm_capacity=0",
    ]);
    assert!(
        p.iter()
            .any(|p| p.key == "pod_backend" && p.rule.contains("feature `kubernetes`")),
        "{p:?}"
    );
}

/// The VM backend's configuration, as a cluster deployment gives it.
fn opensandbox(extra: &[&str]) -> Vec<String> {
    let mut out: Vec<String> = [
        "nats_url=nats://nats:4222",
        "local_identity=false",
        "spiffe_endpoint_socket=unix:///run/spire.sock",
        "components=scheduler,vm-worker",
        "opensandbox_api=https://osb.example/v1",
        "opensandbox_api_key_file=/run/secrets/osb",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    out.extend(extra.iter().map(|s| (*s).to_owned()));
    out
}

fn opensandbox_settings(extra: &[&str]) -> Result<OpenSandboxSettings, SettingsError> {
    let keys = opensandbox(extra);
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    settings(&keys).map(|s| match s.vm.map(|vm| vm.kind) {
        Some(VmBackend::OpenSandbox(o)) => *o,
        other => panic!("expected the opensandbox backend, got {other:?}"),
    })
}

#[test]
fn the_vm_backend_keys_reach_the_opensandbox_settings_with_their_defaults() {
    let o = opensandbox_settings(&[]).unwrap();
    assert_eq!(o.backend.api.base_url.as_str(), "https://osb.example/v1");
    assert_eq!(o.backend.pool, "ci-vm");
    assert_eq!(o.backend.api.request_timeout, Duration::from_secs(30));
    assert_eq!(o.backend.api.create_timeout, Duration::from_secs(90));
    assert_eq!(
        o.backend.entrypoint,
        ["/usr/local/bin/gitea-dynamic-runner", "executor"]
    );
    assert!(o.backend.extra_env.is_empty());
    assert_eq!(o.backend.timeout, Duration::from_secs(4 * 3600));
    assert_eq!(o.backend.renew_before, Duration::from_secs(600));
    assert_eq!(o.terminal_grace, Duration::from_secs(15));
    assert_eq!(o.backend.warm_pool, 0, "no warm sandboxes by default");
    let o = opensandbox_settings(&[
        "opensandbox_pool=kata-small",
        "opensandbox_ca_file=/etc/osb-ca.pem",
        "opensandbox_create_timeout=2m",
        "vm_entrypoint=/opt/gdr/bin/gitea-dynamic-runner,executor",
        "vm_executor_env=SPIFFE_ENDPOINT_SOCKET=unix:///run/spire/agent.sock,GITEA_RUNNER_BINARY=/opt/runner",
        "vm_timeout_seconds=3600",
        "vm_renew_before=5m",
        "vm_terminal_grace=1s",
    ])
    .unwrap();
    assert_eq!(o.backend.pool, "kata-small");
    assert_eq!(o.ca_file.unwrap(), Path::new("/etc/osb-ca.pem"));
    assert_eq!(o.backend.api.create_timeout, Duration::from_secs(120));
    assert_eq!(
        o.backend.entrypoint,
        ["/opt/gdr/bin/gitea-dynamic-runner", "executor"]
    );
    assert_eq!(
        o.backend.extra_env["SPIFFE_ENDPOINT_SOCKET"],
        "unix:///run/spire/agent.sock"
    );
    assert_eq!(o.backend.extra_env["GITEA_RUNNER_BINARY"], "/opt/runner");
    assert_eq!(o.backend.timeout, Duration::from_secs(3600));
    assert_eq!(o.backend.renew_before, Duration::from_secs(300));
    assert_eq!(o.terminal_grace, Duration::from_secs(1));
}

/// Issue 39 item 5: `vm_warm_pool` counts the warm sandboxes (its members may take
/// `executor_start_deadline` to run, as warm Pods may), from the file, the environment's
/// spelling or `--set`; a value that is not a count is refused naming the key.
#[test]
fn vm_warm_pool_counts_warm_sandboxes_with_the_executor_start_deadline() {
    let o = opensandbox_settings(&["vm_warm_pool=3", "executor_start_deadline=3m"]).unwrap();
    assert_eq!(o.backend.warm_pool, 3);
    assert_eq!(o.backend.warm_start_deadline, Duration::from_secs(180));
    let o = opensandbox_settings(&[]).unwrap();
    assert_eq!(
        o.backend.warm_start_deadline,
        Duration::from_secs(600),
        "executor_start_deadline's default"
    );
    let e = opensandbox_settings(&["vm_warm_pool=-1"])
        .unwrap_err()
        .to_string();
    assert!(e.contains("vm_warm_pool"), "{e}");
    let keys = opensandbox(&["vm_executor_env=CI_EXECUTOR_STANDBY_ID=x"]);
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    let p = problems(&keys);
    assert!(
        p.iter().any(|p| p.key == "vm_executor_env"
            && p.to_string().contains("CI_EXECUTOR_STANDBY_ID")),
        "{p:?}"
    );
}

#[test]
fn vm_backend_values_the_server_or_the_executor_would_refuse_are_refused_naming_their_key() {
    let keys = opensandbox(&[
        "opensandbox_api=ftp://osb.example/v1",
        "opensandbox_pool=two words",
        "opensandbox_request_timeout=0s",
        "opensandbox_create_timeout=0s",
        "vm_executor_env=CI_SPIFFE_ID=spiffe://evil.example/x,NO_VALUE,1BAD=x,A=1,A=2",
        "vm_timeout_seconds=59",
        "vm_renew_before=10m",
    ]);
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    let p = problems(&keys);
    let text = |key: &str| -> Vec<String> {
        p.iter()
            .filter(|p| p.key == key)
            .map(ToString::to_string)
            .collect()
    };
    assert_eq!(text("opensandbox_api").len(), 1, "{p:?}");
    assert_eq!(text("opensandbox_pool").len(), 1, "{p:?}");
    assert_eq!(text("opensandbox_request_timeout").len(), 1, "{p:?}");
    assert_eq!(text("opensandbox_create_timeout").len(), 1, "{p:?}");
    let env = text("vm_executor_env").join("\n");
    for expected in [
        "CI_SPIFFE_ID comes from the assignment",
        "\"NO_VALUE\" must be NAME=value",
        "\"1BAD\" is not an environment variable name",
        "A is given twice",
    ] {
        assert!(env.contains(expected), "{expected}: {env}");
    }
    assert!(
        text("vm_timeout_seconds")[0].contains("below OpenSandbox's minimum of 60"),
        "{p:?}"
    );
    assert!(
        text("vm_renew_before")[0].contains("below vm_timeout_seconds"),
        "{p:?}"
    );
    let empty = opensandbox(&["vm_entrypoint="]);
    let empty: Vec<&str> = empty.iter().map(String::as_str).collect();
    assert!(
        problems(&empty).iter().any(|p| p.key == "vm_entrypoint"),
        "an empty entrypoint is refused"
    );
    let missing = problems(&[
        "nats_url=nats://nats:4222",
        "local_identity=false",
        "spiffe_endpoint_socket=unix:///run/spire.sock",
        "components=scheduler,vm-worker",
    ]);
    let keys: Vec<_> = missing.iter().map(|p| p.key).collect();
    assert!(keys.contains(&"opensandbox_api"), "{missing:?}");
    assert!(keys.contains(&"opensandbox_api_key_file"), "{missing:?}");
}

fn sandbox_identity(overrides: &[&str]) -> Result<SandboxIdentitySettings, SettingsError> {
    SandboxIdentitySettings::load(&Sources::overrides(overrides).unwrap())
}

#[test]
fn sandbox_identity_needs_only_the_trust_domain_and_has_the_python_versions_defaults() {
    let s = sandbox_identity(&["trust_domain=example.org"]).unwrap();
    let r = &s.reconciler;
    assert_eq!(r.trust_domain.as_str(), "example.org");
    assert_eq!(r.namespace, "opensandbox");
    assert_eq!(r.cluster, "sandbox-kata");
    assert_eq!(r.class_name, "spire-mgmt-spire");
    assert_eq!(r.runner_uid, 2000);
    assert_eq!(r.resync, Duration::from_secs(30));
    assert_eq!(r.codec.key("runner"), "ci.ddupan.top/runner");
    assert_eq!(s.health_listen, "0.0.0.0:9090");
    assert!(s.leader.is_none());
    let s = sandbox_identity(&[
        "trust_domain=example.org",
        "opensandbox_namespace=sandboxes",
        "spire_cluster_name=kata-east",
        "spire_class_name=other-class",
        "runner_uid=1001",
        "sandbox_identity_resync=10s",
        "metadata_prefix=ci.example.org/",
        "health_listen=127.0.0.1:0",
        "leader_election=true",
        "lease_namespace=sandboxes",
        "lease_duration=6s",
    ])
    .unwrap();
    let r = &s.reconciler;
    assert_eq!(
        (
            r.namespace.as_str(),
            r.cluster.as_str(),
            r.class_name.as_str()
        ),
        ("sandboxes", "kata-east", "other-class")
    );
    assert_eq!(r.runner_uid, 1001);
    assert_eq!(r.resync, Duration::from_secs(10));
    assert_eq!(r.codec.key("runner"), "ci.example.org/runner");
    assert_eq!(s.health_listen, "127.0.0.1:0");
    let leader = s.leader.unwrap();
    assert_eq!(leader.name, "gitea-dynamic-runner-sandbox-identity");
    assert_eq!(leader.namespace, "sandboxes");
    assert_eq!(leader.lease_duration, Duration::from_secs(6));
}

#[test]
fn sandbox_identity_settings_report_every_problem_naming_the_key() {
    let err = sandbox_identity(&[
        "opensandbox_namespace=Not_A_Namespace",
        "spire_cluster_name=a/b",
        "spire_class_name=",
        "sandbox_identity_resync=0s",
        "lease_duration=1s",
    ])
    .unwrap_err();
    let SettingsError::Invalid(problems) = err else {
        panic!("expected problems, got {err:?}");
    };
    let keys: Vec<_> = problems.iter().map(|p| p.key).collect();
    assert_eq!(
        keys,
        [
            "trust_domain",
            "opensandbox_namespace",
            "spire_cluster_name",
            "spire_class_name",
            "sandbox_identity_resync",
            "lease_duration",
        ],
        "{problems:?}"
    );
}

/// DESIGN invariant 13: job SPIFFE IDs name the ref by default; the Go version's weaker
/// scheme is there only when chosen, and a misspelt scheme is refused, naming the key.
#[test]
fn spiffe_id_scheme_defaults_to_ref_and_job_is_chosen_explicitly() {
    use gdr_core::identity::IdentityScheme;
    assert_eq!(settings(&[]).unwrap().policy.scheme, IdentityScheme::Ref);
    assert_eq!(
        settings(&["spiffe_id_scheme=job"]).unwrap().policy.scheme,
        IdentityScheme::Job
    );
    assert!(
        problems(&["spiffe_id_scheme=branch"])
            .iter()
            .any(|p| p.key == "spiffe_id_scheme" && p.rule.contains("\"ref\" or \"job\"")),
    );
}

/// An environment of `pairs` only, as `default_state_dir` reads one.
pub(super) fn fake_env(
    pairs: &'static [(&'static str, &'static str)],
) -> impl Fn(&str) -> Option<std::ffi::OsString> + Copy {
    move |name: &str| {
        pairs
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| std::ffi::OsString::from(v))
    }
}

/// The facade's own default limits (for a facade run without settings, as its tests do) are
/// the defaults of the `runner_facade_…` keys, which the reference documents.
#[test]
fn the_facades_default_limits_are_the_defaults_of_its_keys() {
    let mut check = Check::default();
    let from_keys = facade_limit_settings(&mut check, Sections::from(Raw::default()).facade_limits);
    assert_eq!(FacadeLimits::default(), from_keys);
}
