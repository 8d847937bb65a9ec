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
    let err = Settings::load(&Sources::default()).unwrap_err().to_string();
    for key in [
        "gitea_instance_url (GITEA_INSTANCE_URL)",
        "trust_domain (TRUST_DOMAIN)",
        "gitea_runner_token_file",
        "runner_facade_url",
    ] {
        assert!(err.contains(key), "{key} missing from: {err}");
    }
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
    assert_eq!(s.scheduler.as_ref().unwrap().backlog_limit, 1);
    let s = settings(&["vm_capacity=0", "vm_runner_label=vm-dev"]).unwrap();
    assert!(s.vm.is_none());
    assert_eq!(s.declared_labels(), ["self-hosted", "pod"]);
    let s = settings(&["vm_runner_label=vm-dev"]).unwrap();
    assert_eq!(s.declared_labels(), ["self-hosted", "pod", "vm-dev"]);
    assert_eq!(s.scheduler.unwrap().backlog_limit, 5);
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
