//! The real spire-controller-manager, built from its Go module by
//! `tests/spire-cm-peers/build.sh` (found through `SPIRE_CM_BIN`, its own
//! CustomResourceDefinitions through `SPIRE_CM_CRDS`; `.ci/run` exports both). It watches the
//! ClusterStaticEntry objects of one class on a Kubernetes API server and keeps the SPIRE
//! server's registration entries in step with them, as it does in a cluster: the component
//! that turns what the Pod backend and `sandbox-identity` write into identities.
//!
//! It runs without its admission webhook (`ENABLE_WEBHOOKS=false`: the webhook needs an
//! in-cluster Service and its own SVID), with metrics off and the cluster domain given (it
//! would look it up in DNS otherwise).

use std::path::{Path, PathBuf};
use std::process::Stdio;

use serde_json::{Value, json};

use crate::real_spire::{SpireError, io};

/// The program and the CRDs of its version.
#[derive(Clone, Debug)]
pub struct ControllerManagerProgram {
    /// `spire-controller-manager`.
    pub program: PathBuf,
    /// The directory of its CRDs (`spire.spiffe.io_cluster*.yaml`).
    pub crds: PathBuf,
}

impl ControllerManagerProgram {
    /// The program named by `SPIRE_CM_BIN` and its CRDs by `SPIRE_CM_CRDS`; a test without
    /// them fails saying how to build them (it never passes without its peer).
    pub fn from_env() -> ControllerManagerProgram {
        let var = |name: &str| {
            crate::peer_path(
                name,
                "this test needs spire-controller-manager built from its Go module",
                "tests/spire-cm-peers/build.sh",
            )
        };
        ControllerManagerProgram {
            program: var("SPIRE_CM_BIN"),
            crds: var("SPIRE_CM_CRDS"),
        }
    }

    /// Its CRDs (ClusterStaticEntry, ClusterSPIFFEID, ClusterFederatedTrustDomain): it
    /// watches every kind it reconciles from its start.
    pub fn crds(&self) -> Result<Vec<Value>, SpireError> {
        let dir = std::fs::read_dir(&self.crds).map_err(io("reading the CRD directory"))?;
        let mut files: Vec<PathBuf> = dir
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
            .collect();
        files.sort();
        files
            .iter()
            .map(|file| {
                let text = std::fs::read_to_string(file)
                    .map_err(io(format!("reading {}", file.display())))?;
                serde_saphyr::from_str(&text).map_err(|e| SpireError::Command {
                    command: format!("parsing {}", file.display()),
                    output: e.to_string(),
                })
            })
            .collect()
    }
}

/// What the manager is told about the cluster it serves.
#[derive(Clone, Debug)]
pub struct ManagerConfig {
    /// The trust domain of the SPIRE server.
    pub trust_domain: String,
    /// `clusterName`: the cluster's name in the agents' IDs.
    pub cluster: String,
    /// `className`: the ClusterStaticEntry objects of other classes are not its own.
    pub class: String,
}

/// A running spire-controller-manager, killed when dropped.
pub struct ControllerManager {
    dir: tempfile::TempDir,
    // Behind a lock so that a test can ask whether it runs through a shared reference.
    child: std::sync::Mutex<tokio::process::Child>,
}

impl ControllerManager {
    /// Starts it against the API server of `kubeconfig` (its text) and the SPIRE server's
    /// API socket.
    pub fn start(
        program: &ControllerManagerProgram,
        kubeconfig: &str,
        spire_server_socket: &Path,
        config: &ManagerConfig,
    ) -> Result<ControllerManager, SpireError> {
        let dir = tempfile::Builder::new()
            .prefix("scm")
            .tempdir()
            .map_err(io("creating the controller manager's directory"))?;
        let kubeconfig_path = dir.path().join("kubeconfig");
        std::fs::write(&kubeconfig_path, kubeconfig).map_err(io("writing its kubeconfig"))?;
        let config_path = dir.path().join("config.json");
        let text = config_file(config, spire_server_socket).to_string();
        std::fs::write(&config_path, text).map_err(io("writing its configuration"))?;
        let log = std::fs::File::create(dir.path().join("manager.log"))
            .map_err(io("creating manager.log"))?;
        let err = log.try_clone().map_err(io("duplicating a log"))?;
        let child = tokio::process::Command::new(&program.program)
            .arg("-config")
            .arg(&config_path)
            .env("KUBECONFIG", &kubeconfig_path)
            .env("ENABLE_WEBHOOKS", "false")
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err)
            .kill_on_drop(true)
            .spawn()
            .map_err(io(format!("starting {}", program.program.display())))?;
        Ok(ControllerManager {
            dir,
            child: std::sync::Mutex::new(child),
        })
    }

    /// Whether it is still running (a bad configuration ends it at once).
    pub fn running(&self) -> bool {
        self.child
            .lock()
            .is_ok_and(|mut child| matches!(child.try_wait(), Ok(None)))
    }

    /// Its log, for a failing test's message.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("manager.log")).unwrap_or_default()
    }
}

/// Its `ControllerManagerConfig` (JSON is YAML).
fn config_file(config: &ManagerConfig, spire_server_socket: &Path) -> Value {
    json!({
        "apiVersion": "spire.spiffe.io/v1alpha1",
        "kind": "ControllerManagerConfig",
        "clusterName": config.cluster,
        "clusterDomain": "cluster.local",
        "trustDomain": config.trust_domain,
        "className": config.class,
        "spireServerSocketPath": spire_server_socket,
        // Required even with the webhook off; names nothing here.
        "validatingWebhookConfigurationName": "spire-controller-manager-webhook",
        "entryIDPrefix": "gdr-test",
        "reconcile": {
            "clusterSPIFFEIDs": true,
            "clusterStaticEntries": true,
            "clusterFederatedTrustDomains": false,
        },
        "metrics": { "bindAddress": "0" },
        "health": { "healthProbeBindAddress": "0" },
    })
}
