//! The integration tests, one module per file beside this one, linked into one test binary.
//!
//! One binary instead of one per file: each test binary monomorphizes and links the whole
//! test kit and controller again, and 28 of them were a quarter of the test build. Isolation
//! is unchanged: the test command (`cargo nextest run`) runs every test in a process of its
//! own. A module's tests are selected by its name, e.g. `cargo nextest run -E
//! 'test(/^kill_restart::/)'`; a file's `required-features` are the `cfg` on its module.

// A panic is how a test fails. A test is a scenario read top to bottom: the length limit
// on functions is for product code.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::too_many_lines)]

mod opensandbox_common;
mod queue_common;

mod architecture;
mod backend_contract;
mod cli;
#[cfg(feature = "kubernetes")]
mod deploy;
#[cfg(feature = "testkit")]
mod facade;
#[cfg(feature = "testkit")]
mod facade_flood;
mod fake_kube;
#[cfg(feature = "testkit")]
mod full_chain;
mod gitea_client;
#[cfg(feature = "testkit")]
mod ha;
mod handoff;
#[cfg(all(feature = "testkit", feature = "failpoints"))]
mod kill_restart;
mod lease;
mod lifecycle;
mod mock_gitea;
mod nix;
mod opensandbox_backend;
mod opensandbox_client;
#[cfg(feature = "testkit")]
mod operations;
#[cfg(feature = "testkit")]
mod pod_backend;
#[cfg(all(feature = "testkit", feature = "failpoints", feature = "kubernetes"))]
mod pod_chain;
mod process_backend;
#[cfg(feature = "testkit")]
mod queue_trust;
mod quick_start;
mod rbac;
mod real_gitea;
mod real_kube;
#[cfg(feature = "testkit")]
mod real_spire;
mod real_spire_cm;
#[cfg(feature = "testkit")]
mod real_spire_identity;
#[cfg(feature = "testkit")]
mod relay;
mod sandbox_identity;
mod scheduler;
#[cfg(feature = "testkit")]
mod spiffe_mtls;
#[cfg(feature = "testkit")]
mod vm_chain;
mod worker;

/// No DESIGN invariant (test layout): with `autotests = false`, a file in `tests/` that no
/// `mod` line above names is compiled by nothing, and its tests silently never run.
#[test]
fn every_file_in_tests_is_a_module_of_this_binary() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests");
    let root = std::fs::read_to_string(dir.join("integration.rs")).unwrap();
    let declared: std::collections::BTreeSet<&str> = root
        .lines()
        .filter_map(|line| line.strip_prefix("mod ")?.strip_suffix(';'))
        .collect();
    let mut missing = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let name = if path.is_dir() {
            path.join("mod.rs")
                .is_file()
                .then(|| path.file_name().unwrap().to_owned())
        } else {
            (path.extension() == Some("rs".as_ref())).then(|| path.file_stem().unwrap().to_owned())
        };
        let Some(name) = name else { continue };
        let name = name.to_str().unwrap().to_owned();
        if name != "integration" && !declared.contains(name.as_str()) {
            missing.push(name);
        }
    }
    assert!(
        missing.is_empty(),
        "tests/ files no `mod` line names: {missing:?}"
    );
}
