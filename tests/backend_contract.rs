//! The executor-backend contract suite (`gdr_testkit::backend_contract`) against the
//! in-memory backend and the local process backend. The OpenSandbox backend runs the same
//! suite in `opensandbox_backend.rs`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use gdr_backends::process::{
    IdentityProvider, LogRetention, ProcessBackend, ProcessBackendSettings, Provisioned,
};
use gdr_core::backend::Backend;
use gdr_core::executor::{ExecutorBackend, ExecutorError};
use gdr_testkit::backend_contract::{self, Contract};
use gdr_testkit::memory_backend::MemoryBackend;

/// DESIGN invariants 8–10, 12: the in-memory backend, reopened as a restarted controller
/// would, keeps the contract the real backends keep.
#[tokio::test]
async fn the_memory_backend_keeps_the_executor_backend_contract() {
    let store = MemoryBackend::new(Backend::Vm);
    backend_contract::run(
        || Arc::new(store.reopen()) as Arc<dyn ExecutorBackend>,
        &Contract::new(Backend::Vm, 100),
    )
    .await;
}

/// Serves no identity: the contract is about executor state, not SVIDs.
struct NoIdentity;

#[async_trait]
impl IdentityProvider for NoIdentity {
    async fn provision(&self, dir: &Path, _spiffe_id: &str) -> Result<Provisioned, ExecutorError> {
        Ok(format!("unix:{}", dir.join("workload.sock").display()).into())
    }

    async fn revoke(&self, _dir: &Path) {}
}

/// DESIGN invariants 8–10, 12: the process backend keeps the contract across instances
/// over one state directory, with real child processes.
#[tokio::test]
async fn the_process_backend_keeps_the_executor_backend_contract() {
    let state = tempfile::tempdir().unwrap();
    let root: PathBuf = state.path().to_path_buf();
    let make = || {
        let settings = ProcessBackendSettings {
            backend: Backend::Pod,
            state_root: root.clone(),
            program: PathBuf::from("/bin/sh"),
            args: vec!["-c".into(), "exec sleep 60".into()],
            extra_env: BTreeMap::new(),
            codec: Default::default(),
            trust_domain: backend_contract::trust_domain(),
            stop_grace: Duration::from_secs(5),
            log_retention: LogRetention::NONE,
        };
        Arc::new(ProcessBackend::new(settings, Arc::new(NoIdentity)).unwrap())
            as Arc<dyn ExecutorBackend>
    };
    backend_contract::run(make, &Contract::new(Backend::Pod, 200)).await;
}
