//! The controller's one typed configuration, parsed once.
//!
//! Layers, later wins: built-in defaults < TOML file (`--config`) < environment
//! (the Go version's variable names, e.g. `POD_CAPACITY`) < `--set key=value` flags.
//! Every key is the lower-case form of its environment variable, so `POD_CAPACITY`
//! and `pod_capacity = 4` in the file are the same setting.
//!
//! Secrets are never configuration values: only paths to files that hold them
//! (`*_FILE`). [`FIELDS`] is the reference shown by `--help` and the README.

use std::collections::BTreeSet;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use figment::Figment;
use figment::providers::{Env, Format, Serialized, Toml};
use serde::{Deserialize, Deserializer, Serialize};

/// One documented configuration key.
pub struct FieldDoc {
    /// Key in the TOML file; the environment variable is its upper-case form.
    pub key: &'static str,
    /// Default shown in the reference (`-` when there is none).
    pub default: &'static str,
    /// What it does.
    pub doc: &'static str,
}

impl FieldDoc {
    /// The environment variable that sets this key.
    pub fn env(&self) -> String {
        self.key.to_ascii_uppercase()
    }
}

/// The configuration reference: every key, its default and meaning.
pub const FIELDS: &[FieldDoc] = &[
    FieldDoc {
        key: "components",
        default: "scheduler,pod-worker,vm-worker",
        doc: "Components this process runs (comma-separated, or `all`). A worker without the scheduler (which serves the facade) is refused.",
    },
    FieldDoc {
        key: "gitea_instance_url",
        default: "-",
        doc: "Base URL of the Gitea instance (http or https); the runner API lives under <url>/api/actions.",
    },
    FieldDoc {
        key: "gitea_runner_uuid_file",
        default: "-",
        doc: "File holding the controller's runner UUID (written by `register`).",
    },
    FieldDoc {
        key: "gitea_runner_token_file",
        default: "-",
        doc: "File holding the controller's runner token (written by `register`, mode 0600).",
    },
    FieldDoc {
        key: "gitea_ca_file",
        default: "-",
        doc: "PEM bundle of extra CAs trusted for an https Gitea (the system roots are always trusted).",
    },
    FieldDoc {
        key: "gitea_request_timeout",
        default: "60s",
        doc: "Timeout of each RPC to Gitea (Register, Declare, UpdateTask, UpdateLog).",
    },
    FieldDoc {
        key: "gitea_fetch_timeout",
        default: "5s",
        doc: "Timeout of each FetchTask poll.",
    },
    FieldDoc {
        key: "runner_name",
        default: "gitea-dynamic-runner",
        doc: "Name the controller registers under in Gitea.",
    },
    FieldDoc {
        key: "runner_capabilities",
        default: "cancelling",
        doc: "Capabilities declared to Gitea; must match what the one-shot official runner supports (`cancelling` needs runner >= 2.0).",
    },
    FieldDoc {
        key: "pod_capacity",
        default: "4",
        doc: "Concurrent Pod executors (and FetchTask pollers for the pod backend). 0 disables the pod backend.",
    },
    FieldDoc {
        key: "vm_capacity",
        default: "1",
        doc: "Concurrent VM executors (and FetchTask pollers for the vm backend). 0 disables the vm backend.",
    },
    FieldDoc {
        key: "vm_runner_label",
        default: "vm",
        doc: "The runs-on label that selects the VM backend (`vm-dev` takes only test jobs while a backend is repaired).",
    },
    FieldDoc {
        key: "trust_domain",
        default: "-",
        doc: "SPIFFE trust domain of job identities (spiffe://<trust_domain>/ci/<owner>/<repo>/<job>). The Go version defaulted to ddupan.top.",
    },
    FieldDoc {
        key: "metadata_prefix",
        default: "ci.ddupan.top/",
        doc: "Prefix of executor labels/annotations/metadata keys; keep it to take over a Go deployment.",
    },
    FieldDoc {
        key: "runner_facade_capability_key_file",
        default: "-",
        doc: "File holding the >= 32-byte key that derives assignment capabilities (HMAC-SHA256); whitespace around it is trimmed.",
    },
    FieldDoc {
        key: "task_encryption_key_file",
        default: "-",
        doc: "File holding the AES-256 key (64 hex chars or base64 of 32 bytes) that encrypts tasks in the stream (envelope v2). Unset: tasks are stored as v1 (readable).",
    },
    FieldDoc {
        key: "task_encryption_previous_key_files",
        default: "-",
        doc: "Older task keys still accepted for decryption during a rotation (comma-separated paths).",
    },
    FieldDoc {
        key: "nats_url",
        default: "-",
        doc: "NATS server URL(s), comma-separated. Unset: the embedded single-host mode (not implemented yet).",
    },
    FieldDoc {
        key: "nats_producer_user",
        default: "ci-producer",
        doc: "NATS user of the scheduler's (publishing) connection.",
    },
    FieldDoc {
        key: "nats_producer_password_file",
        default: "-",
        doc: "File holding the producer's NATS password.",
    },
    FieldDoc {
        key: "nats_producer_creds_file",
        default: "-",
        doc: "NATS .creds file for the producer (instead of user/password).",
    },
    FieldDoc {
        key: "nats_worker_user",
        default: "ci-worker",
        doc: "NATS user of the workers' (consuming) connection.",
    },
    FieldDoc {
        key: "nats_worker_password_file",
        default: "-",
        doc: "File holding the worker's NATS password.",
    },
    FieldDoc {
        key: "nats_worker_creds_file",
        default: "-",
        doc: "NATS .creds file for the workers (instead of user/password).",
    },
    FieldDoc {
        key: "nats_ca_file",
        default: "-",
        doc: "PEM CA bundle for a tls:// NATS server.",
    },
    FieldDoc {
        key: "nats_stream",
        default: "CI_RUNNER",
        doc: "JetStream stream holding assignments.",
    },
    FieldDoc {
        key: "nats_subject_base",
        default: "ci.runner",
        doc: "Subject base; assignments go to <base>.pod and <base>.vm.",
    },
    FieldDoc {
        key: "nats_create_stream",
        default: "true",
        doc: "Create/update the stream and consumers at start; turn off where operators provision them.",
    },
    FieldDoc {
        key: "heartbeat_interval",
        default: "60s",
        doc: "Interval of the task-ID-only UpdateTask heartbeats that keep queued tasks alive in Gitea.",
    },
    FieldDoc {
        key: "backlog_limit",
        default: "pod_capacity + vm_capacity",
        doc: "Stop fetching while this many assignments wait unclaimed in the stream.",
    },
    FieldDoc {
        key: "runner_facade_listen",
        default: "0.0.0.0:8443",
        doc: "Listen address of the RunnerService facade (SPIFFE mTLS).",
    },
    FieldDoc {
        key: "runner_facade_url",
        default: "-",
        doc: "URL executors use to reach the facade.",
    },
    FieldDoc {
        key: "runner_facade_spiffe_id",
        default: "-",
        doc: "The facade's SPIFFE ID, which executors verify exactly.",
    },
    FieldDoc {
        key: "spiffe_endpoint_socket",
        default: "-",
        doc: "SPIFFE Workload API socket, e.g. unix:///run/spire/agent-sockets/spire-agent.sock.",
    },
    FieldDoc {
        key: "state_dir",
        default: "/var/lib/gitea-dynamic-runner",
        doc: "Directory for local state: the embedded NATS store, the local CA and process executors.",
    },
    FieldDoc {
        key: "pod_backend",
        default: "process without nats_url, else kubernetes",
        doc: "What runs pod jobs: `kubernetes` (Pods; not implemented yet) or `process` (local child processes, single host).",
    },
    FieldDoc {
        key: "vm_backend",
        default: "process without nats_url, else opensandbox",
        doc: "What runs vm jobs: `opensandbox` (Kata VMs; not implemented yet) or `process` (local child processes, single host).",
    },
    FieldDoc {
        key: "local_identity",
        default: "true without nats_url, else false",
        doc: "Serve SPIFFE identities from a CA under state_dir instead of SPIRE (required by the process backend).",
    },
    FieldDoc {
        key: "executor_program",
        default: "this binary",
        doc: "Program the process backend starts (with argument `executor`).",
    },
    FieldDoc {
        key: "runner_binary",
        default: "gitea-runner",
        doc: "The official runner binary executors run as `daemon --once`.",
    },
    FieldDoc {
        key: "executor_start_deadline",
        default: "10m",
        doc: "An executor whose runner has not claimed its task by then is failed.",
    },
    FieldDoc {
        key: "nats_server_binary",
        default: "nats-server",
        doc: "nats-server binary of the embedded single-host mode (used when nats_url is unset).",
    },
    FieldDoc {
        key: "leader_election",
        default: "false",
        doc: "Campaign for a Kubernetes Lease; only the leader works, standbys report not ready.",
    },
    FieldDoc {
        key: "lease_namespace",
        default: "gitea-actions",
        doc: "Namespace of the leader Lease.",
    },
    FieldDoc {
        key: "lease_name",
        default: "gitea-dynamic-runner",
        doc: "Name of the leader Lease.",
    },
    FieldDoc {
        key: "leader_identity",
        default: "$HOSTNAME",
        doc: "This replica's identity in the Lease.",
    },
    FieldDoc {
        key: "nats_ack_wait",
        default: "60s",
        doc: "JetStream ack wait of the worker consumers: an assignment a dead controller held is redelivered after this.",
    },
    FieldDoc {
        key: "lease_duration",
        default: "15s",
        doc: "How long a Lease holds without renewal (renewals every duration/7, given up after 2/3 of it).",
    },
    FieldDoc {
        key: "health_listen",
        default: "0.0.0.0:9090",
        doc: "Listen address of /healthz, /readyz and /metrics.",
    },
    FieldDoc {
        key: "pod_namespace",
        default: "gitea-actions",
        doc: "Namespace of executor Pods.",
    },
    FieldDoc {
        key: "pod_executor_image",
        default: "-",
        doc: "Executor image (required for pod-worker).",
    },
    FieldDoc {
        key: "pod_service_account",
        default: "gitea-task-executor",
        doc: "Service account of executor Pods.",
    },
    FieldDoc {
        key: "pod_executor_uid",
        default: "2000",
        doc: "UID the executor runs as (also the SPIRE unix:uid selector).",
    },
    FieldDoc {
        key: "spire_cluster",
        default: "homelab",
        doc: "SPIRE k8s_psat cluster name of the Pod cluster.",
    },
    FieldDoc {
        key: "spire_class",
        default: "spire-mgmt-spire",
        doc: "className of ClusterStaticEntries (must match the SPIRE controller manager).",
    },
    FieldDoc {
        key: "spire_agent_id",
        default: "-",
        doc: "Parent SPIFFE ID of Pod entries (required for pod-worker).",
    },
    FieldDoc {
        key: "opensandbox_api",
        default: "-",
        doc: "OpenSandbox Lifecycle API base URL (required for vm-worker).",
    },
    FieldDoc {
        key: "opensandbox_api_key_file",
        default: "-",
        doc: "File holding the OpenSandbox API key (required for vm-worker).",
    },
    FieldDoc {
        key: "opensandbox_pool",
        default: "ci-vm",
        doc: "OpenSandbox pool (extensions.poolRef) of VM executors.",
    },
    FieldDoc {
        key: "vm_timeout_seconds",
        default: "14400",
        doc: "Lifetime of a VM sandbox in seconds.",
    },
];

/// A controller component.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Component {
    /// FetchTask pollers, the JetStream producer and the RunnerService facade.
    Scheduler,
    /// Consumes pod assignments and runs Kubernetes Pods.
    PodWorker,
    /// Consumes vm assignments and runs OpenSandbox microVMs.
    VmWorker,
}

impl Component {
    const ALL: [Component; 3] = [
        Component::Scheduler,
        Component::PodWorker,
        Component::VmWorker,
    ];

    /// The name used in `COMPONENTS`.
    pub fn as_str(self) -> &'static str {
        match self {
            Component::Scheduler => "scheduler",
            Component::PodWorker => "pod-worker",
            Component::VmWorker => "vm-worker",
        }
    }
}

/// The whole configuration. See [`FIELDS`] for what each key means.
#[derive(Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
#[allow(missing_docs)]
pub struct Config {
    #[serde(deserialize_with = "de_components")]
    pub components: BTreeSet<Component>,
    pub gitea_instance_url: Option<String>,
    pub gitea_runner_uuid_file: Option<PathBuf>,
    pub gitea_runner_token_file: Option<PathBuf>,
    pub gitea_ca_file: Option<PathBuf>,
    #[serde(with = "duration")]
    pub gitea_request_timeout: Duration,
    #[serde(with = "duration")]
    pub gitea_fetch_timeout: Duration,
    pub runner_name: String,
    #[serde(deserialize_with = "de_list")]
    pub runner_capabilities: Vec<String>,
    pub pod_capacity: u32,
    pub vm_capacity: u32,
    pub vm_runner_label: String,
    pub trust_domain: Option<String>,
    pub metadata_prefix: String,
    pub runner_facade_capability_key_file: Option<PathBuf>,
    pub task_encryption_key_file: Option<PathBuf>,
    #[serde(deserialize_with = "de_paths")]
    pub task_encryption_previous_key_files: Vec<PathBuf>,
    pub nats_url: Option<String>,
    pub nats_producer_user: String,
    pub nats_producer_password_file: Option<PathBuf>,
    pub nats_producer_creds_file: Option<PathBuf>,
    pub nats_worker_user: String,
    pub nats_worker_password_file: Option<PathBuf>,
    pub nats_worker_creds_file: Option<PathBuf>,
    pub nats_ca_file: Option<PathBuf>,
    pub nats_stream: String,
    pub nats_subject_base: String,
    pub nats_create_stream: bool,
    #[serde(with = "duration")]
    pub heartbeat_interval: Duration,
    pub backlog_limit: Option<u32>,
    pub runner_facade_listen: String,
    pub runner_facade_url: Option<String>,
    pub runner_facade_spiffe_id: Option<String>,
    pub spiffe_endpoint_socket: Option<String>,
    pub health_listen: String,
    pub state_dir: PathBuf,
    pub pod_backend: Option<String>,
    pub vm_backend: Option<String>,
    pub local_identity: Option<bool>,
    pub executor_program: Option<PathBuf>,
    pub runner_binary: PathBuf,
    #[serde(with = "duration")]
    pub executor_start_deadline: Duration,
    pub nats_server_binary: PathBuf,
    pub leader_election: bool,
    pub lease_namespace: String,
    pub lease_name: String,
    pub leader_identity: Option<String>,
    #[serde(with = "duration")]
    pub lease_duration: Duration,
    #[serde(with = "duration")]
    pub nats_ack_wait: Duration,
    pub pod_namespace: String,
    pub pod_executor_image: Option<String>,
    pub pod_service_account: String,
    pub pod_executor_uid: u32,
    pub spire_cluster: String,
    pub spire_class: String,
    pub spire_agent_id: Option<String>,
    pub opensandbox_api: Option<String>,
    pub opensandbox_api_key_file: Option<PathBuf>,
    pub opensandbox_pool: String,
    pub vm_timeout_seconds: u64,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            components: Component::ALL.into_iter().collect(),
            gitea_instance_url: None,
            gitea_runner_uuid_file: None,
            gitea_runner_token_file: None,
            gitea_ca_file: None,
            gitea_request_timeout: Duration::from_secs(60),
            gitea_fetch_timeout: Duration::from_secs(5),
            runner_name: "gitea-dynamic-runner".into(),
            runner_capabilities: vec!["cancelling".into()],
            pod_capacity: 4,
            vm_capacity: 1,
            vm_runner_label: "vm".into(),
            trust_domain: None,
            metadata_prefix: "ci.ddupan.top/".into(),
            runner_facade_capability_key_file: None,
            task_encryption_key_file: None,
            task_encryption_previous_key_files: Vec::new(),
            nats_url: None,
            nats_producer_user: "ci-producer".into(),
            nats_producer_password_file: None,
            nats_producer_creds_file: None,
            nats_worker_user: "ci-worker".into(),
            nats_worker_password_file: None,
            nats_worker_creds_file: None,
            nats_ca_file: None,
            nats_stream: "CI_RUNNER".into(),
            nats_subject_base: "ci.runner".into(),
            nats_create_stream: true,
            heartbeat_interval: Duration::from_secs(60),
            backlog_limit: None,
            runner_facade_listen: "0.0.0.0:8443".into(),
            runner_facade_url: None,
            runner_facade_spiffe_id: None,
            spiffe_endpoint_socket: None,
            health_listen: "0.0.0.0:9090".into(),
            state_dir: PathBuf::from("/var/lib/gitea-dynamic-runner"),
            pod_backend: None,
            vm_backend: None,
            local_identity: None,
            executor_program: None,
            runner_binary: PathBuf::from("gitea-runner"),
            executor_start_deadline: Duration::from_secs(600),
            nats_server_binary: PathBuf::from("nats-server"),
            leader_election: false,
            lease_namespace: "gitea-actions".into(),
            lease_name: "gitea-dynamic-runner".into(),
            leader_identity: None,
            lease_duration: Duration::from_secs(15),
            nats_ack_wait: Duration::from_secs(60),
            pod_namespace: "gitea-actions".into(),
            pod_executor_image: None,
            pod_service_account: "gitea-task-executor".into(),
            pod_executor_uid: 2000,
            spire_cluster: "homelab".into(),
            spire_class: "spire-mgmt-spire".into(),
            spire_agent_id: None,
            opensandbox_api: None,
            opensandbox_api_key_file: None,
            opensandbox_pool: "ci-vm".into(),
            vm_timeout_seconds: 14_400,
        }
    }
}

/// Debug output is the redacted rendering: a NATS URL may carry inline credentials.
impl fmt::Debug for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.render())
    }
}

/// Why the configuration could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file, an environment variable or a flag has a value of the wrong shape.
    #[error("{0}")]
    Parse(String),
    /// A `--set` flag is not `key=value` with a known key.
    #[error("--set {0:?}: {1}")]
    Flag(String, String),
    /// Values parsed but break rules; every problem is listed.
    #[error("{}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n"))]
    Invalid(Vec<Problem>),
}

/// One broken rule, naming the key, its environment variable and the rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// The offending key.
    pub key: &'static str,
    /// The rule it breaks.
    pub rule: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} ({}): {}",
            self.key,
            self.key.to_ascii_uppercase(),
            self.rule
        )
    }
}

/// Where configuration comes from, besides the built-in defaults.
#[derive(Debug, Default, Clone)]
pub struct Sources {
    /// TOML file given with `--config`.
    pub file: Option<PathBuf>,
    /// `(key, value)` pairs from `--set key=value`, applied last.
    pub overrides: Vec<(String, String)>,
    /// Read the process environment (off in tests that must not see it).
    pub environment: bool,
}

impl Sources {
    /// Parses `--set` values of the form `key=value`, rejecting unknown keys.
    pub fn parse_override(raw: &str) -> Result<(String, String), ConfigError> {
        let (key, value) = raw
            .split_once('=')
            .ok_or_else(|| ConfigError::Flag(raw.into(), "expected key=value".into()))?;
        let key = key.trim().to_ascii_lowercase();
        if !FIELDS.iter().any(|f| f.key == key) {
            return Err(ConfigError::Flag(
                raw.into(),
                format!("unknown key {key:?}; see the configuration reference in --help"),
            ));
        }
        Ok((key, value.to_string()))
    }
}

impl Config {
    /// Loads and validates the layered configuration.
    pub fn load(sources: &Sources) -> Result<Config, ConfigError> {
        let config = Self::load_unvalidated(sources)?;
        let problems = config.problems();
        if problems.is_empty() {
            Ok(config)
        } else {
            Err(ConfigError::Invalid(problems))
        }
    }

    /// Loads the layers without checking cross-field rules (for `register`,
    /// which needs only the Gitea settings, and for `check-config`).
    pub fn load_unvalidated(sources: &Sources) -> Result<Config, ConfigError> {
        let mut figment = Figment::from(Serialized::defaults(Config::default()));
        if let Some(file) = &sources.file {
            if !file.is_file() {
                return Err(ConfigError::Parse(format!(
                    "configuration file {} does not exist or is not a file",
                    file.display()
                )));
            }
            figment = figment.merge(Toml::file_exact(file));
        }
        if sources.environment {
            let keys: Vec<String> = FIELDS.iter().map(FieldDoc::env).collect();
            let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
            // Empty variables count as unset, as in the Go version's env().
            figment = figment.merge(
                Env::raw()
                    .only(&keys)
                    .filter_map(|k| {
                        let set = std::env::var(k.as_str()).is_ok_and(|v| !v.trim().is_empty());
                        set.then(|| k.as_str().to_ascii_lowercase().into())
                    })
                    .lowercase(true),
            );
        }
        for (key, value) in &sources.overrides {
            // Parsed like environment values, so `--set pod_capacity=3` is a number.
            let parsed: figment::value::Value = match value.parse() {
                Ok(v) => v,
                Err(never) => match never {},
            };
            figment = figment.merge(Serialized::global(key.as_str(), parsed));
        }
        figment
            .extract::<Config>()
            .map_err(|e| ConfigError::Parse(render_figment_error(e)))
    }

    /// Every cross-field rule this configuration breaks.
    pub fn problems(&self) -> Vec<Problem> {
        let mut out = Vec::new();
        // Problems found while `need` holds `out`, appended at the end.
        let mut extra: Vec<Problem> = Vec::new();
        let mut need = |key: &'static str, present: bool, why: &str| {
            if !present {
                out.push(Problem {
                    key,
                    rule: format!("is required {why}"),
                });
            }
        };
        need(
            "gitea_instance_url",
            self.gitea_instance_url.is_some(),
            "(the Gitea base URL)",
        );
        need(
            "gitea_runner_uuid_file",
            self.gitea_runner_uuid_file.is_some(),
            "(run `register` first)",
        );
        need(
            "gitea_runner_token_file",
            self.gitea_runner_token_file.is_some(),
            "(run `register` first)",
        );
        need(
            "trust_domain",
            self.trust_domain.is_some(),
            "(SPIFFE trust domain of job identities)",
        );
        need(
            "runner_facade_capability_key_file",
            self.runner_facade_capability_key_file.is_some(),
            "(key of assignment capabilities)",
        );
        let workers = self.components.contains(&Component::PodWorker)
            || self.components.contains(&Component::VmWorker);
        let pod_on = self.components.contains(&Component::PodWorker) && self.pod_capacity > 0;
        let vm_on = self.components.contains(&Component::VmWorker) && self.vm_capacity > 0;
        for (key, value, allowed) in [
            ("pod_backend", self.pod_backend(), ["kubernetes", "process"]),
            ("vm_backend", self.vm_backend(), ["opensandbox", "process"]),
        ] {
            if !allowed.contains(&value) {
                extra.push(Problem {
                    key,
                    rule: format!("{value:?} must be one of {allowed:?}"),
                });
            }
        }
        let process = (pod_on && self.pod_backend() == "process")
            || (vm_on && self.vm_backend() == "process");
        if process && !self.local_identity() {
            extra.push(Problem {
                key: "local_identity",
                rule: "must be true with the process backend: local executors get their SPIFFE identity from the controller's CA".into(),
            });
        }
        if pod_on && self.pod_backend() == "kubernetes" {
            need(
                "pod_executor_image",
                self.pod_executor_image.is_some(),
                "when pod-worker runs",
            );
            need(
                "spire_agent_id",
                self.spire_agent_id.is_some(),
                "when pod-worker runs",
            );
        }
        if vm_on && self.vm_backend() == "opensandbox" {
            need(
                "opensandbox_api",
                self.opensandbox_api.is_some(),
                "when vm-worker runs",
            );
            need(
                "opensandbox_api_key_file",
                self.opensandbox_api_key_file.is_some(),
                "when vm-worker runs",
            );
        }
        if self.components.contains(&Component::Scheduler) {
            need(
                "runner_facade_url",
                self.runner_facade_url.is_some(),
                "when the scheduler runs",
            );
            need(
                "runner_facade_spiffe_id",
                self.runner_facade_spiffe_id.is_some(),
                "when the scheduler runs",
            );
            need(
                "spiffe_endpoint_socket",
                self.spiffe_endpoint_socket.is_some() || self.local_identity(),
                "when the scheduler runs (or set local_identity)",
            );
        }
        if workers && !self.components.contains(&Component::Scheduler) {
            out.push(Problem {
                key: "components",
                rule: "a worker needs the scheduler in the same process: executors reach the facade of the replica that holds their assignment".into(),
            });
        }
        if self.components.is_empty() {
            out.push(Problem {
                key: "components",
                rule: "at least one component is required".into(),
            });
        }
        if let Some(url) = &self.gitea_instance_url
            && let Err(rule) = check_http_url(url)
        {
            out.push(Problem {
                key: "gitea_instance_url",
                rule,
            });
        }
        if let Some(url) = &self.runner_facade_url
            && let Err(rule) = check_http_url(url)
        {
            out.push(Problem {
                key: "runner_facade_url",
                rule,
            });
        }
        if let Some(id) = &self.runner_facade_spiffe_id
            && !id.starts_with("spiffe://")
        {
            out.push(Problem {
                key: "runner_facade_spiffe_id",
                rule: format!("{id:?} must be a spiffe:// URI"),
            });
        }
        if let Some(td) = &self.trust_domain
            && (td.is_empty()
                || !td.chars().all(|c| {
                    c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '.' | '-' | '_')
                }))
        {
            out.push(Problem {
                    key: "trust_domain",
                    rule: format!("{td:?} must be a trust domain name such as example.org (lower-case letters, digits, '.', '-', '_')"),
                });
        }
        if self.pod_capacity == 0 && self.vm_capacity == 0 {
            out.push(Problem {
                key: "pod_capacity",
                rule: "pod_capacity and vm_capacity are both 0: nothing would ever run".into(),
            });
        }
        let label_ok = |l: &str| {
            !l.is_empty()
                && l.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        };
        if !label_ok(&self.vm_runner_label)
            || self.vm_runner_label == "pod"
            || self.vm_runner_label == "self-hosted"
        {
            out.push(Problem {
                key: "vm_runner_label",
                rule: format!(
                    "{:?} must be a plain label other than pod and self-hosted (e.g. vm or vm-dev)",
                    self.vm_runner_label
                ),
            });
        }
        for (key, name) in [
            ("nats_stream", &self.nats_stream),
            ("nats_subject_base", &self.nats_subject_base),
        ] {
            if name.is_empty() || name.contains(|c: char| c.is_whitespace() || c == '*' || c == '>')
            {
                out.push(Problem {
                    key,
                    rule: format!("{name:?} must be non-empty without spaces or wildcards"),
                });
            }
        }
        if self.nats_stream.contains('.') {
            out.push(Problem {
                key: "nats_stream",
                rule: "stream names cannot contain '.'".into(),
            });
        }
        if self.heartbeat_interval < Duration::from_secs(1) {
            out.push(Problem {
                key: "heartbeat_interval",
                rule: "must be at least 1s".into(),
            });
        }
        if self.gitea_request_timeout.is_zero() {
            out.push(Problem {
                key: "gitea_request_timeout",
                rule: "must be greater than 0".into(),
            });
        }
        if self.gitea_fetch_timeout.is_zero() || self.gitea_fetch_timeout > Duration::from_secs(60)
        {
            out.push(Problem {
                key: "gitea_fetch_timeout",
                rule: "must be between 1ms and 60s".into(),
            });
        }
        if self.backlog_limit == Some(0) {
            out.push(Problem {
                key: "backlog_limit",
                rule: "must be at least 1".into(),
            });
        }
        out.extend(extra);
        out
    }

    /// Single-host mode: no NATS cluster configured, so the controller runs its own
    /// nats-server, process executors and local identities unless told otherwise.
    pub fn single_host(&self) -> bool {
        self.nats_url.is_none()
    }

    /// What runs pod jobs (default: `process` on a single host, else `kubernetes`).
    pub fn pod_backend(&self) -> &str {
        self.pod_backend
            .as_deref()
            .unwrap_or(if self.single_host() {
                "process"
            } else {
                "kubernetes"
            })
    }

    /// What runs vm jobs (default: `process` on a single host, else `opensandbox`).
    pub fn vm_backend(&self) -> &str {
        self.vm_backend.as_deref().unwrap_or(if self.single_host() {
            "process"
        } else {
            "opensandbox"
        })
    }

    /// Whether identities come from the controller's own CA (default: on a single host).
    pub fn local_identity(&self) -> bool {
        self.local_identity.unwrap_or(self.single_host())
    }

    /// Capacity-derived backlog bound (invariant 5b).
    pub fn effective_backlog_limit(&self) -> u32 {
        self.backlog_limit
            .unwrap_or(self.pod_capacity + self.vm_capacity)
            .max(1)
    }

    /// Every configured secret file: key and path.
    pub fn secret_files(&self) -> Vec<(&'static str, &Path)> {
        let mut out: Vec<(&'static str, &Path)> = [
            ("gitea_runner_uuid_file", &self.gitea_runner_uuid_file),
            ("gitea_runner_token_file", &self.gitea_runner_token_file),
            (
                "runner_facade_capability_key_file",
                &self.runner_facade_capability_key_file,
            ),
            ("task_encryption_key_file", &self.task_encryption_key_file),
            (
                "nats_producer_password_file",
                &self.nats_producer_password_file,
            ),
            ("nats_producer_creds_file", &self.nats_producer_creds_file),
            ("nats_worker_password_file", &self.nats_worker_password_file),
            ("nats_worker_creds_file", &self.nats_worker_creds_file),
            ("opensandbox_api_key_file", &self.opensandbox_api_key_file),
        ]
        .into_iter()
        .filter_map(|(k, p)| p.as_deref().map(|p| (k, p)))
        .collect();
        for p in &self.task_encryption_previous_key_files {
            out.push(("task_encryption_previous_key_files", p.as_path()));
        }
        out
    }

    /// Renders the effective configuration as TOML. Only paths of secrets appear,
    /// never their contents; values in URLs that look like credentials are masked.
    pub fn render(&self) -> String {
        let value = match toml_value(self) {
            Ok(v) => v,
            Err(e) => return format!("# could not render configuration: {e}\n"),
        };
        let mut out = String::new();
        for field in FIELDS {
            match value.get(field.key) {
                Some(v) => {
                    let shown = match v {
                        serde_json::Value::String(s) => format!("{:?}", redact_url_userinfo(s)),
                        other => other.to_string(),
                    };
                    out.push_str(&format!("{} = {}\n", field.key, shown));
                }
                None => out.push_str(&format!("# {} is not set\n", field.key)),
            }
        }
        out
    }
}

fn toml_value(config: &Config) -> Result<serde_json::Map<String, serde_json::Value>, String> {
    let mut value = serde_json::to_value(config).map_err(|e| e.to_string())?;
    let map = value.as_object_mut().ok_or("configuration is not a map")?;
    map.retain(|_, v| !v.is_null());
    if let Some(c) = map.get_mut("components")
        && let Some(list) = c.as_array()
    {
        let joined: Vec<String> = list
            .iter()
            .filter_map(|v| v.as_str().map(String::from))
            .collect();
        *c = serde_json::Value::String(joined.join(","));
    }
    Ok(map.clone())
}

/// Masks `user:password@` in URLs (e.g. a NATS URL with inline credentials).
pub fn redact_url_userinfo(value: &str) -> String {
    let Some(scheme_end) = value.find("://") else {
        return value.to_string();
    };
    let rest = &value[scheme_end + 3..];
    let authority_end = rest.find('/').unwrap_or(rest.len());
    match rest[..authority_end].rfind('@') {
        Some(at) => format!("{}://<redacted>@{}", &value[..scheme_end], &rest[at + 1..]),
        None => value.to_string(),
    }
}

fn check_http_url(url: &str) -> Result<(), String> {
    match url::Url::parse(url) {
        Ok(u) if matches!(u.scheme(), "http" | "https") && u.host().is_some() => {
            if u.query().is_some() || u.fragment().is_some() {
                Err(format!("{url:?} must not carry a query or fragment"))
            } else {
                Ok(())
            }
        }
        Ok(_) => Err(format!(
            "{url:?} must be an http:// or https:// URL with a host"
        )),
        Err(e) => Err(format!("{url:?} is not a URL: {e}")),
    }
}

/// Figment already names the key and the source (file path or variable); make
/// sure the environment variable is named too.
fn render_figment_error(error: figment::Error) -> String {
    error
        .into_iter()
        .map(|e| {
            let key = e.path.join(".");
            if key.is_empty() {
                e.to_string()
            } else {
                format!("{key} ({}): {e}", key.to_ascii_uppercase())
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// A list given as a TOML array or as a comma-separated string (environment).
fn de_list<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Raw {
        One(String),
        Many(Vec<String>),
    }
    let items = match Raw::deserialize(d)? {
        Raw::One(s) => s.split(',').map(str::to_string).collect::<Vec<_>>(),
        Raw::Many(v) => v,
    };
    Ok(items
        .into_iter()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect())
}

fn de_paths<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<PathBuf>, D::Error> {
    Ok(de_list(d)?.into_iter().map(PathBuf::from).collect())
}

fn de_components<'de, D: Deserializer<'de>>(d: D) -> Result<BTreeSet<Component>, D::Error> {
    let names = de_list(d)?;
    if names.len() == 1 && names[0] == "all" {
        return Ok(Component::ALL.into_iter().collect());
    }
    names
        .iter()
        .map(|n| {
            Component::ALL
                .into_iter()
                .find(|c| c.as_str() == n)
                .ok_or_else(|| {
                    serde::de::Error::custom(format!(
                        "unknown component {n:?}; expected scheduler, pod-worker, vm-worker or all"
                    ))
                })
        })
        .collect()
}

/// Durations as humantime strings ("90s", "5m") or plain seconds.
mod duration {
    use super::*;

    pub fn serialize<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&humantime_serde::re::humantime::format_duration(*d).to_string())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Secs(u64),
            Text(String),
        }
        match Raw::deserialize(d)? {
            Raw::Secs(s) => Ok(Duration::from_secs(s)),
            Raw::Text(t) => match t.trim().parse::<u64>() {
                Ok(s) => Ok(Duration::from_secs(s)),
                Err(_) => humantime_serde::re::humantime::parse_duration(t.trim()).map_err(|e| {
                    serde::de::Error::custom(format!("{t:?} is not a duration like 30s or 5m: {e}"))
                }),
            },
        }
    }
}

/// Reads a secret file, trimming surrounding whitespace (as the Go version did).
/// The error names the key and the path, never the content.
pub fn read_secret_file(key: &str, path: &Path) -> Result<String, SecretFileError> {
    let raw = std::fs::read(path).map_err(|source| SecretFileError::Read {
        key: key.to_string(),
        path: path.to_path_buf(),
        source,
    })?;
    let text = String::from_utf8(raw).map_err(|_| SecretFileError::NotText {
        key: key.to_string(),
        path: path.to_path_buf(),
    })?;
    let trimmed = text.trim();
    if trimmed.is_empty() {
        return Err(SecretFileError::Empty {
            key: key.to_string(),
            path: path.to_path_buf(),
        });
    }
    Ok(trimmed.to_string())
}

/// A secret file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum SecretFileError {
    /// The file could not be read.
    #[error("{key} ({}): cannot read {}: {source}", key.to_ascii_uppercase(), path.display())]
    Read {
        /// Config key.
        key: String,
        /// Path.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
    /// The file is not UTF-8 text.
    #[error("{key} ({}): {} is not UTF-8 text", key.to_ascii_uppercase(), path.display())]
    NotText {
        /// Config key.
        key: String,
        /// Path.
        path: PathBuf,
    },
    /// The file is empty or only whitespace.
    #[error("{key} ({}): {} is empty", key.to_ascii_uppercase(), path.display())]
    Empty {
        /// Config key.
        key: String,
        /// Path.
        path: PathBuf,
    },
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn file_with(text: &str) -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(text.as_bytes()).unwrap();
        f
    }

    fn sources(file: Option<&Path>, overrides: &[&str]) -> Sources {
        Sources {
            file: file.map(Path::to_path_buf),
            overrides: overrides
                .iter()
                .map(|o| Sources::parse_override(o).unwrap())
                .collect(),
            environment: false,
        }
    }

    #[test]
    fn defaults_match_the_go_version() {
        let c = Config::default();
        assert_eq!(c.pod_capacity, 4);
        assert_eq!(c.vm_capacity, 1);
        assert_eq!(c.vm_runner_label, "vm");
        assert_eq!(c.nats_stream, "CI_RUNNER");
        assert_eq!(c.nats_subject_base, "ci.runner");
        assert_eq!(c.metadata_prefix, "ci.ddupan.top/");
        assert_eq!(c.components.len(), 3);
    }

    #[test]
    fn every_config_key_is_documented_and_every_documented_key_exists() {
        let value = toml_value(&Config::default()).unwrap();
        let mut all = serde_json::to_value(Config::default())
            .unwrap()
            .as_object()
            .unwrap()
            .clone();
        for f in FIELDS {
            assert!(
                all.remove(f.key).is_some(),
                "documented key {} is not a field",
                f.key
            );
        }
        assert!(
            all.is_empty(),
            "undocumented keys: {:?}",
            all.keys().collect::<Vec<_>>()
        );
        assert!(value.contains_key("pod_capacity"));
    }

    #[test]
    fn flags_override_the_file_and_the_file_overrides_defaults() {
        let f = file_with("pod_capacity = 7\nvm_capacity = 3\n");
        let c = Config::load_unvalidated(&sources(Some(f.path()), &["vm_capacity=9"])).unwrap();
        assert_eq!(c.pod_capacity, 7);
        assert_eq!(c.vm_capacity, 9);
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
            let c = Config::load_unvalidated(&s).map_err(|e| e.to_string())?;
            assert_eq!(c.pod_capacity, 11);
            assert_eq!(c.vm_runner_label, "vm-dev");
            assert_eq!(c.heartbeat_interval, Duration::from_secs(90));
            assert_eq!(
                c.components,
                [Component::Scheduler, Component::PodWorker]
                    .into_iter()
                    .collect()
            );
            Ok(())
        });
    }

    #[test]
    fn a_malformed_value_names_the_key_and_the_variable() {
        let f = file_with("pod_capacity = \"many\"\n");
        let err = Config::load_unvalidated(&sources(Some(f.path()), &[]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("pod_capacity (POD_CAPACITY)"), "{err}");
        // figment shows the file relative to the working directory; the name is enough.
        let name = f.path().file_name().unwrap().to_string_lossy().into_owned();
        assert!(err.contains(&name), "{err}");
    }

    #[test]
    fn an_unknown_key_in_the_file_is_an_error_naming_it() {
        let f = file_with("pod_capacty = 3\n");
        let err = Config::load_unvalidated(&sources(Some(f.path()), &[]))
            .unwrap_err()
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
        let err = Config::load_unvalidated(&sources(None, &["components=scheduler,gpu-worker"]))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("gpu-worker") && err.contains("pod-worker"),
            "{err}"
        );
    }

    #[test]
    fn a_worker_without_the_scheduler_is_refused() {
        let c = Config::load_unvalidated(&sources(None, &["components=pod-worker"])).unwrap();
        let problems = c.problems();
        assert!(
            problems
                .iter()
                .any(|p| p.key == "components" && p.rule.contains("scheduler")),
            "{problems:?}"
        );
    }

    #[test]
    fn missing_required_settings_are_all_reported_at_once() {
        let err = Config::load(&sources(None, &[])).unwrap_err().to_string();
        for key in [
            "gitea_instance_url (GITEA_INSTANCE_URL)",
            "trust_domain (TRUST_DOMAIN)",
            "gitea_runner_token_file",
        ] {
            assert!(err.contains(key), "{key} missing from: {err}");
        }
    }

    #[test]
    fn without_a_nats_url_the_single_host_defaults_are_process_executors_and_local_identity() {
        let single = Config::default();
        assert_eq!(
            (
                single.pod_backend(),
                single.vm_backend(),
                single.local_identity()
            ),
            ("process", "process", true)
        );
        let cluster =
            Config::load_unvalidated(&sources(None, &["nats_url=nats://nats:4222"])).unwrap();
        assert_eq!(
            (
                cluster.pod_backend(),
                cluster.vm_backend(),
                cluster.local_identity()
            ),
            ("kubernetes", "opensandbox", false)
        );
        let explicit =
            Config::load_unvalidated(&sources(None, &["pod_backend=kubernetes"])).unwrap();
        assert_eq!(explicit.pod_backend(), "kubernetes");
    }

    #[test]
    fn a_non_http_gitea_url_is_refused() {
        let c = Config::load_unvalidated(&sources(None, &["gitea_instance_url=ftp://x"])).unwrap();
        assert!(c.problems().iter().any(|p| p.key == "gitea_instance_url"));
    }

    #[test]
    fn durations_accept_humantime_and_seconds_and_reject_garbage() {
        let c = Config::load_unvalidated(&sources(None, &["heartbeat_interval=2m"])).unwrap();
        assert_eq!(c.heartbeat_interval, Duration::from_secs(120));
        let err = Config::load_unvalidated(&sources(None, &["heartbeat_interval=soon"]))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("heartbeat_interval") && err.contains("soon"),
            "{err}"
        );
    }

    #[test]
    fn rendering_masks_credentials_in_urls_and_shows_only_secret_paths() {
        let c = Config::load_unvalidated(&sources(
            None,
            &[
                "nats_url=nats://user:hunter2@nats:4222",
                "gitea_runner_token_file=/run/secrets/token",
            ],
        ))
        .unwrap();
        let text = c.render();
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
}
