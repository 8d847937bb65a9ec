//! Backend selection from a job's `runs-on` labels (DESIGN invariant 5).
//!
//! Workflows keep writing `runs-on: [self-hosted, pod]` or `[self-hosted, vm]`; the backend is
//! decided by these labels alone, never by anything the scheduler or a queue message claims.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Label every job handled by this runner must carry, as with any self-hosted runner.
pub const SELF_HOSTED: &str = "self-hosted";

/// Where a job's disposable environment is created.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// A Kubernetes Pod created by the controller.
    Pod,
    /// A Kata microVM obtained from an OpenSandbox pool.
    Vm,
}

impl Backend {
    /// The wire spelling, shared by envelopes, subjects (`<base>.pod`), durable names and
    /// backend metadata, so it must never change.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Pod => "pod",
            Self::Vm => "vm",
        }
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A backend name other than `pod` or `vm`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown backend {0:?}: expected \"pod\" or \"vm\"")]
pub struct UnknownBackend(pub String);

impl FromStr for Backend {
    type Err = UnknownBackend;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "pod" => Ok(Self::Pod),
            "vm" => Ok(Self::Vm),
            other => Err(UnknownBackend(other.to_owned())),
        }
    }
}

/// The labels that select a backend.
///
/// `pod` is fixed; the VM label has a configurable alias (`VM_RUNNER_LABEL`, e.g. `vm-dev`
/// in the seed deployment) so a development runner can take VM jobs without clashing with
/// a production one. The plain `vm` label always selects the VM backend as well.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackendLabels {
    vm_label: String,
}

/// A VM label alias that would make backend selection ambiguous or meaningless.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "VM runner label {0:?} is not usable: it must be 1-63 characters of letters, digits, '.', '-' or '_' and differ from \"pod\" and \"self-hosted\" (e.g. vm or vm-dev)"
)]
pub struct InvalidVmLabel(pub String);

/// Longest label Gitea accepts for a runner label (its label column).
const MAX_LABEL_CHARS: usize = 63;

impl BackendLabels {
    /// Uses `vm_label` as the VM alias: a plain label (letters, digits, `.`, `-`, `_`) that
    /// is not `pod` (every job would then be ambiguous) nor `self-hosted` (every job would
    /// select a VM). This is the only rule for the VM label.
    pub fn new(vm_label: impl Into<String>) -> Result<Self, InvalidVmLabel> {
        let vm_label = vm_label.into();
        let plain = !vm_label.is_empty()
            && vm_label.len() <= MAX_LABEL_CHARS
            && vm_label
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_'));
        if !plain || vm_label == Backend::Pod.as_str() || vm_label == SELF_HOSTED {
            return Err(InvalidVmLabel(vm_label));
        }
        Ok(Self { vm_label })
    }

    /// The configured VM alias (`vm` unless configured otherwise).
    pub fn vm_label(&self) -> &str {
        &self.vm_label
    }

    /// The label a runner of `backend` declares: `pod`, or the VM alias. The one mapping
    /// from backend to label (Declare, `register`, the facade's runner record, executors).
    pub fn label_of(&self, backend: Backend) -> &str {
        match backend {
            Backend::Pod => Backend::Pod.as_str(),
            Backend::Vm => &self.vm_label,
        }
    }

    fn selects_vm(&self, label: &str) -> bool {
        label == Backend::Vm.as_str() || label == self.vm_label
    }
}

impl Default for BackendLabels {
    fn default() -> Self {
        Self {
            vm_label: Backend::Vm.as_str().to_owned(),
        }
    }
}

/// Why a job's labels do not select exactly one backend. Each variant carries the labels
/// seen, so the operator can tell which workflow to fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BackendError {
    /// The job did not ask for a self-hosted runner.
    #[error("runs-on must include \"self-hosted\"; labels seen: {}", Labels(.labels))]
    NotSelfHosted {
        /// The job's `runs-on` labels.
        labels: Vec<String>,
    },
    /// Neither `pod` nor a VM label is present.
    #[error("runs-on selects no backend: expected exactly one of \"pod\" or {vm_labels}; labels seen: {}", Labels(.labels))]
    NoBackend {
        /// The job's `runs-on` labels.
        labels: Vec<String>,
        /// The VM labels accepted, for the message.
        vm_labels: String,
    },
    /// Both `pod` and a VM label are present.
    #[error("runs-on selects both backends: expected exactly one of \"pod\" or {vm_labels}; labels seen: {}", Labels(.labels))]
    Ambiguous {
        /// The job's `runs-on` labels.
        labels: Vec<String>,
        /// The VM labels accepted, for the message.
        vm_labels: String,
    },
}

/// Renders labels as `[a, b]` in error messages.
struct Labels<'a>(&'a [String]);

impl fmt::Display for Labels<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for (i, label) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{label:?}")?;
        }
        f.write_str("]")
    }
}

/// Picks the backend for a job from its `runs-on` labels: `self-hosted` is required, and
/// exactly one of `pod` / (`vm` or the configured VM alias) must be present. Labels are
/// compared case-sensitively, as Gitea does when it matches runners.
pub fn select_backend(runs_on: &[String], labels: &BackendLabels) -> Result<Backend, BackendError> {
    if !runs_on.iter().any(|label| label == SELF_HOSTED) {
        return Err(BackendError::NotSelfHosted {
            labels: runs_on.to_vec(),
        });
    }
    let pod = runs_on.iter().any(|label| label == Backend::Pod.as_str());
    let vm = runs_on.iter().any(|label| labels.selects_vm(label));
    let vm_labels = || {
        if labels.vm_label == Backend::Vm.as_str() {
            "\"vm\"".to_owned()
        } else {
            format!("\"vm\"/{:?}", labels.vm_label)
        }
    };
    match (pod, vm) {
        (true, false) => Ok(Backend::Pod),
        (false, true) => Ok(Backend::Vm),
        (false, false) => Err(BackendError::NoBackend {
            labels: runs_on.to_vec(),
            vm_labels: vm_labels(),
        }),
        (true, true) => Err(BackendError::Ambiguous {
            labels: runs_on.to_vec(),
            vm_labels: vm_labels(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(values: &[&str]) -> Vec<String> {
        values.iter().map(|v| (*v).to_owned()).collect()
    }

    #[test]
    fn self_hosted_with_one_backend_label_selects_that_backend() {
        let policy = BackendLabels::default();
        assert_eq!(
            select_backend(&labels(&["self-hosted", "pod"]), &policy),
            Ok(Backend::Pod)
        );
        assert_eq!(
            select_backend(&labels(&["vm", "self-hosted"]), &policy),
            Ok(Backend::Vm)
        );
    }

    #[test]
    fn the_configured_vm_alias_selects_the_vm_backend_and_plain_vm_still_does() {
        let policy = BackendLabels::new("vm-dev").unwrap();
        assert_eq!(
            select_backend(&labels(&["self-hosted", "vm-dev"]), &policy),
            Ok(Backend::Vm)
        );
        assert_eq!(
            select_backend(&labels(&["self-hosted", "vm"]), &policy),
            Ok(Backend::Vm)
        );
        // With the default policy the alias is just an unknown label.
        assert!(matches!(
            select_backend(
                &labels(&["self-hosted", "vm-dev"]),
                &BackendLabels::default()
            ),
            Err(BackendError::NoBackend { .. })
        ));
    }

    #[test]
    fn a_job_without_self_hosted_is_rejected() {
        let err = select_backend(&labels(&["pod"]), &BackendLabels::default()).unwrap_err();
        assert!(matches!(err, BackendError::NotSelfHosted { .. }));
        assert!(err.to_string().contains("[\"pod\"]"), "{err}");
    }

    #[test]
    fn ambiguous_or_missing_backend_labels_are_rejected_and_listed() {
        let policy = BackendLabels::new("vm-dev").unwrap();
        let err = select_backend(&labels(&["self-hosted", "pod", "vm-dev"]), &policy).unwrap_err();
        assert!(matches!(err, BackendError::Ambiguous { .. }));
        assert!(err.to_string().contains("\"vm-dev\""), "{err}");
        let err = select_backend(&labels(&["self-hosted"]), &policy).unwrap_err();
        assert!(matches!(err, BackendError::NoBackend { .. }));
        assert!(err.to_string().contains("[\"self-hosted\"]"), "{err}");
    }

    #[test]
    fn a_vm_alias_that_collides_with_other_labels_is_refused() {
        for bad in [
            "",
            " ",
            "pod",
            "self-hosted",
            " vm",
            "vm dev",
            "vm/dev",
            &"v".repeat(64),
        ] {
            assert!(BackendLabels::new(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn each_backend_has_one_label() {
        let policy = BackendLabels::new("vm-dev").unwrap();
        assert_eq!(policy.label_of(Backend::Pod), "pod");
        assert_eq!(policy.label_of(Backend::Vm), "vm-dev");
        assert_eq!(BackendLabels::default().label_of(Backend::Vm), "vm");
    }

    #[test]
    fn backend_names_round_trip_through_text_and_serde() {
        for backend in [Backend::Pod, Backend::Vm] {
            assert_eq!(backend.as_str().parse::<Backend>(), Ok(backend));
            let json = serde_json::to_string(&backend).unwrap();
            assert_eq!(json, format!("\"{backend}\""));
            assert_eq!(serde_json::from_str::<Backend>(&json).unwrap(), backend);
        }
        assert!("Pod".parse::<Backend>().is_err());
    }
}
