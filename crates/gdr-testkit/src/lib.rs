//! Test peers that speak the real protocols, and the helpers the tests share. Only ever a
//! dev-dependency: nothing here reaches a product build.
//!
//! - [`mock_gitea`]: Gitea's RunnerService with Gitea's semantics, over real Connect.
//! - [`standin_runner`]: the official runner's side of the protocol, for executors to run.
//! - [`standin_dockerd`]: a stand-in `dockerd` for the executor's job Docker daemon, and a
//!   recording wrapper around the stand-in runner.
//! - [`fake_kube`]: an in-process Kubernetes API server for the real `kube` client, checking
//!   every write against the real schemas and enforcing the shipped RBAC.
//! - [`fake_kubelet`]: runs the Pods of one fake Node as local processes.
//! - [`fake_spire`]: a SPIRE agent issuing SVIDs only to Pods a ClusterStaticEntry selects.
//! - [`backend_contract`]: the executor-backend contract suite every backend passes.
//! - [`nats_server`]: a real `nats-server` child process with a temporary store.
//! - [`real_gitea`]: the real Gitea built from its Go module (`tests/peers`), headless on
//!   loopback, read through its own API.
//! - [`real_kube`]: the real kube-apiserver and etcd built from their Go modules
//!   (`tests/kube-peers`), as envtest runs them, with a client per ServiceAccount.
//! - [`real_spire`]: the real SPIRE server and agent built from their Go module
//!   (`tests/spire-peers`), join-token node attestation, `unix` workload attestation.
//! - [`spire_controller_manager`]: the real spire-controller-manager built from its Go
//!   module (`tests/spire-cm-peers`), turning ClusterStaticEntry objects into SPIRE entries.
//! - [`opensandbox`]: the real OpenSandbox server on an in-memory cluster.
//! - [`vm_host`]: runs the sandboxes of an OpenSandbox pool as local processes (the VMs),
//!   each with the identity `sandbox-identity` would grant it.
//! - [`spiffe`]: a fake SPIFFE Workload API with a test CA.
//! - [`backend_contract`]: the executor-backend contract as a suite any backend runs.
//! - [`memory_backend`]: an in-memory executor backend.
//! - [`log_capture`]: JSON log capture, for the tests that look for leaked secrets.
//! - [`browser`]: a real headless Chromium, for the status page.
//! - [`controller`]: one builder of controller configurations, and controller processes
//!   started with listeners the test bound.
//! - [`local_controller`]: a controller process under test on this host with its mock
//!   Gitea, and what a test reads back (jobs, executors, `/metrics`).
//! - [`service`]: a Kubernetes Service stand-in that routes to the ready replica.
//! - [`eventually`] / [`until`] / [`until_sync`]: waiting on observable state with a deadline.

// Test peers are test code: the length limit on functions is for product code.
#![allow(clippy::too_many_lines)]

pub mod backend_contract;
pub mod browser;
pub mod controller;
pub mod fake_kube;
pub mod fake_kubelet;
pub mod fake_spire;
pub mod leftovers;
pub mod local_controller;
pub mod log_capture;
pub mod memory_backend;
pub mod mock_gitea;
pub mod nats_server;
pub mod opensandbox;
pub mod real_gitea;
pub mod real_kube;
pub mod real_spire;
pub mod service;
pub mod spiffe;
pub mod spire_controller_manager;
pub mod standin_dockerd;
pub mod standin_runner;
pub mod tasks;
pub mod vm_host;
mod wait;

pub use wait::{eventually, until, until_sync};

/// The path a real peer's build script exported in `name` (`.ci/run` exports them all); a
/// test without it fails saying `why` and how to build it with `script` (it never passes
/// without its peer).
pub fn peer_path(name: &str, why: &str, script: &str) -> std::path::PathBuf {
    let value = std::env::var_os(name).unwrap_or_else(|| {
        panic!(
            "{name} is not set: {why}; run `eval \"$(bash {script} | sed 's/^/export /')\"` \
             (`.ci/run` does)"
        )
    });
    let path = std::path::PathBuf::from(value);
    assert!(path.exists(), "{name}={} does not exist", path.display());
    path
}
