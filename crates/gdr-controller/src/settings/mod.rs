//! The controller's configuration, parsed once into a typed value.
//!
//! Layers, later wins: built-in defaults < TOML file (`--config`) < environment (the Go
//! version's variable names, e.g. `POD_CAPACITY`) < `--set key=value`. Every key is declared
//! once in [`keys`], which also generates the references. The layers produce a [`Raw`]
//! value that is converted once ([`Settings::try_from`]) into [`Settings`]: backend kinds
//! as enums, optional sections that exist only when their component is enabled, durations
//! and paths typed. The conversion destructures [`Raw`] exhaustively and the runtime
//! destructures [`Settings`] exhaustively, so a key that nothing reads is a compile error,
//! not a silent no-op.
//!
//! Secrets are never values: only paths to files that hold them (`*_file`).

mod keys;
mod reference;
mod secret;
mod sources;
mod values;

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use gdr_core::assignment::DerivationPolicy;
use gdr_core::backend::{Backend, BackendLabels};
use gdr_core::identity::TrustDomain;
use gdr_core::metadata::MetadataCodec;
pub(crate) use keys::Raw;
pub use keys::{KEYS, Key, Kind};
pub use reference::{Format, default_of, render as reference};
pub use secret::{SecretFileError, read_secret_file};
pub use sources::{ParseError, Sources};
pub use values::{Component, Components};

/// Largest capacity of one backend: more executors than this on one controller is a typo,
/// not a deployment (and the pollers, backlog and consumer settings derive from it).
pub const MAX_CAPACITY: u32 = 10_000;

/// Why the configuration could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    /// `--config` names no file.
    #[error("configuration file {} does not exist or is not a file", .0.display())]
    MissingFile(PathBuf),
    /// The file, an environment variable or a flag has a value of the wrong shape.
    #[error("{0}")]
    Parse(#[source] ParseError),
    /// A `--set` flag is not `key=value` with a known key.
    #[error("--set {0:?}: {1}")]
    Flag(String, String),
    /// A configuration variable's value is not UTF-8.
    #[error("{name}: the environment variable's value is not UTF-8 text")]
    NotUtf8 {
        /// The variable.
        name: String,
    },
    /// Values parsed but break rules; every problem is listed.
    #[error("{}", Problems(.0))]
    Invalid(Vec<Problem>),
}

struct Problems<'a>(&'a [Problem]);

impl fmt::Display for Problems<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, p) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{p}")?;
        }
        Ok(())
    }
}

/// One broken rule, naming the key, its environment variable and the rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// The offending key.
    pub key: &'static str,
    /// The rule it breaks.
    pub rule: String,
}

impl Problem {
    fn new(key: &'static str, rule: impl Into<String>) -> Self {
        Problem {
            key,
            rule: rule.into(),
        }
    }
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

// === The typed settings ===

/// Everything the controller runs with.
#[derive(Debug, Clone)]
pub struct Settings {
    /// How to reach Gitea, with which credential.
    pub gitea: GiteaSettings,
    /// Name and capabilities of the controller's runner registration.
    pub runner: RunnerSettings,
    /// Trust domain and backend labels: how a task becomes an assignment.
    pub policy: DerivationPolicy,
    /// The metadata codec of executor objects.
    pub codec: MetadataCodec,
    /// File of the key that derives assignment capabilities.
    pub capability_key_file: PathBuf,
    /// Task keys for envelope v2; `None`: plaintext v1 envelopes.
    pub task_keys: Option<TaskKeyFiles>,
    /// The JetStream handoff.
    pub nats: NatsSettings,
    /// Local state (embedded NATS store, local CA, process executors).
    pub state_dir: PathBuf,
    /// Listen address of `/healthz`, `/readyz`, `/metrics`.
    pub health_listen: String,
    /// Where SVIDs come from.
    pub identity: IdentitySource,
    /// The scheduler and its facade; present when the `scheduler` component runs.
    pub scheduler: Option<SchedulerSettings>,
    /// The pod backend; present when `pod-worker` runs with a capacity above 0.
    pub pod: Option<BackendSettings<PodBackend>>,
    /// The vm backend; present when `vm-worker` runs with a capacity above 0.
    pub vm: Option<BackendSettings<VmBackend>>,
    /// Executor deadlines shared by both workers.
    pub executors: ExecutorTimings,
    /// Leader election; present when enabled.
    pub leader: Option<LeaderSettings>,
}

/// How to reach Gitea.
#[derive(Debug, Clone)]
pub struct GiteaSettings {
    /// Base URL (`<url>/api/actions` is the runner API).
    pub url: url::Url,
    /// Runner UUID file.
    pub uuid_file: PathBuf,
    /// Runner token file.
    pub token_file: PathBuf,
    /// Extra CAs for an https Gitea.
    pub ca_file: Option<PathBuf>,
    /// Timeout of every call but FetchTask.
    pub request_timeout: Duration,
    /// Timeout of FetchTask.
    pub fetch_timeout: Duration,
}

/// The controller's runner registration.
#[derive(Debug, Clone)]
pub struct RunnerSettings {
    /// Name in Gitea.
    pub name: String,
    /// Capabilities declared to Gitea.
    pub capabilities: Vec<String>,
}

/// Current and previous task keys.
#[derive(Debug, Clone)]
pub struct TaskKeyFiles {
    /// Seals new envelopes.
    pub current: PathBuf,
    /// Still opens older envelopes during a rotation.
    pub previous: Vec<PathBuf>,
}

/// The JetStream handoff.
#[derive(Debug, Clone)]
pub struct NatsSettings {
    /// Which server.
    pub server: NatsServer,
    /// Stream name.
    pub stream: String,
    /// Subject base (`<base>.pod`, `<base>.vm`).
    pub subject_base: String,
    /// Create or update stream and consumers at start.
    pub create_stream: bool,
    /// Ack wait of the worker consumers.
    pub ack_wait: Duration,
}

/// Which NATS server.
#[derive(Debug, Clone)]
pub enum NatsServer {
    /// A supervised nats-server child with its store under `state_dir` (single host).
    Embedded {
        /// The nats-server binary.
        binary: PathBuf,
    },
    /// A NATS cluster.
    External {
        /// Server URL(s), comma-separated.
        url: String,
        /// Credentials of the scheduler's publishing connection.
        producer: NatsAuth,
        /// Credentials of the workers' consuming connection.
        worker: NatsAuth,
        /// CA bundle for `tls://`.
        ca_file: Option<PathBuf>,
    },
}

/// How a NATS connection authenticates.
#[derive(Debug, Clone)]
pub enum NatsAuth {
    /// No credentials.
    Anonymous,
    /// User and a password file.
    Password {
        /// User.
        user: String,
        /// Password file.
        file: PathBuf,
        /// The key naming the file (for errors).
        key: &'static str,
    },
    /// A `.creds` file.
    Creds(PathBuf),
}

/// Where SVIDs come from.
#[derive(Debug, Clone)]
pub enum IdentitySource {
    /// The controller's own CA under `state_dir`, served over per-workload sockets.
    Local,
    /// The SPIFFE Workload API (SPIRE agent) at this endpoint.
    WorkloadApi(String),
}

/// The scheduler and its facade.
#[derive(Debug, Clone)]
pub struct SchedulerSettings {
    /// Interval of heartbeats for queued tasks.
    pub heartbeat_interval: Duration,
    /// No fetch while this many assignments wait unclaimed.
    pub backlog_limit: u64,
    /// Most concurrent FetchTask pollers.
    pub fetch_pollers_max: usize,
    /// The facade.
    pub facade: FacadeSettings,
}

/// The RunnerService facade.
#[derive(Debug, Clone)]
pub struct FacadeSettings {
    /// Listen address.
    pub listen: String,
    /// URL executors dial.
    pub url: String,
    /// SPIFFE ID executors verify.
    pub spiffe_id: String,
}

/// One enabled backend.
#[derive(Debug, Clone)]
pub struct BackendSettings<K> {
    /// Concurrent executors (1..=[`MAX_CAPACITY`]).
    pub capacity: u32,
    /// What runs its executors.
    pub kind: K,
}

/// What runs pod jobs.
#[derive(Debug, Clone)]
pub enum PodBackend {
    /// Local child processes.
    Process(ProcessSettings),
    /// Kubernetes Pods.
    Kubernetes(KubernetesSettings),
}

/// What runs vm jobs.
#[derive(Debug, Clone)]
pub enum VmBackend {
    /// Local child processes.
    Process(ProcessSettings),
    /// OpenSandbox Kata VMs.
    OpenSandbox(OpenSandboxSettings),
}

/// The process backend.
#[derive(Debug, Clone)]
pub struct ProcessSettings {
    /// The executor program (`None`: this binary).
    pub program: Option<PathBuf>,
    /// The official runner the executor runs.
    pub runner_binary: PathBuf,
}

/// The Kubernetes Pod backend.
#[derive(Debug, Clone)]
pub struct KubernetesSettings {
    /// Namespace of executor Pods.
    pub namespace: String,
    /// Executor image.
    pub image: String,
    /// Service account of executor Pods.
    pub service_account: String,
    /// UID the executor runs as.
    pub executor_uid: u32,
    /// SPIRE k8s_psat cluster name.
    pub spire_cluster: String,
    /// `className` of ClusterStaticEntries.
    pub spire_class: String,
    /// Parent ID of entries, when not derived from the node.
    pub spire_agent_id: Option<String>,
}

/// The OpenSandbox VM backend.
#[derive(Debug, Clone)]
pub struct OpenSandboxSettings {
    /// Lifecycle API base URL.
    pub api: url::Url,
    /// API key file.
    pub api_key_file: PathBuf,
    /// Pool of VM executors.
    pub pool: String,
    /// Sandbox lifetime.
    pub timeout: Duration,
}

/// Executor deadlines.
#[derive(Debug, Clone, Copy)]
pub struct ExecutorTimings {
    /// An unclaimed executor older than this is failed.
    pub start_deadline: Duration,
    /// A claimed executor silent for this long is failed.
    pub idle_timeout: Duration,
}

/// Leader election.
#[derive(Debug, Clone)]
pub struct LeaderSettings {
    /// Namespace of the Lease.
    pub namespace: String,
    /// Name of the Lease.
    pub name: String,
    /// This replica's identity (`None`: `$HOSTNAME` at start).
    pub identity: Option<String>,
    /// Lease duration.
    pub lease_duration: Duration,
}

impl<K> BackendSettings<K> {
    /// The capacity as a count.
    pub fn slots(&self) -> usize {
        usize::try_from(self.capacity).unwrap_or(usize::MAX)
    }
}

impl Settings {
    /// Loads and validates the layered configuration.
    pub fn load(sources: &Sources) -> Result<Self, SettingsError> {
        Settings::try_from(sources.load()?)
    }

    /// Single-host mode: the embedded NATS server.
    pub fn single_host(&self) -> bool {
        matches!(self.nats.server, NatsServer::Embedded { .. })
    }

    /// The enabled backends and their capacities.
    pub fn capacities(&self) -> Vec<(Backend, usize)> {
        let mut out = Vec::new();
        if let Some(pod) = &self.pod {
            out.push((Backend::Pod, pod.slots()));
        }
        if let Some(vm) = &self.vm {
            out.push((Backend::Vm, vm.slots()));
        }
        out
    }

    /// The labels Gitea must know this runner by: `self-hosted` plus the label of every
    /// enabled backend (and nothing for a disabled one, so Gitea never offers its jobs).
    pub fn declared_labels(&self) -> Vec<String> {
        declared_labels(
            &self.policy.labels,
            self.capacities().into_iter().map(|(b, _)| b),
        )
    }
}

/// `self-hosted` plus the label of each of `backends`.
pub fn declared_labels(
    labels: &BackendLabels,
    backends: impl IntoIterator<Item = Backend>,
) -> Vec<String> {
    std::iter::once(gdr_core::backend::SELF_HOSTED.to_owned())
        .chain(backends.into_iter().map(|b| labels.label_of(b).to_owned()))
        .collect()
}

// === Raw → Settings ===

/// Collects problems while converting, so one run reports every broken rule at once.
#[derive(Default)]
struct Check {
    problems: Vec<Problem>,
}

impl Check {
    fn problem(&mut self, key: &'static str, rule: impl Into<String>) {
        self.problems.push(Problem::new(key, rule));
    }

    /// `value`, or a "required" problem naming `why`.
    fn required<T>(&mut self, key: &'static str, value: Option<T>, why: &str) -> Option<T> {
        if value.is_none() {
            self.problem(key, format!("is required {why}"));
        }
        value
    }

    fn ok<T, E: fmt::Display>(&mut self, key: &'static str, result: Result<T, E>) -> Option<T> {
        result.map_err(|e| self.problem(key, e.to_string())).ok()
    }
}

fn http_url(url: &str, schemes: &[&str]) -> Result<url::Url, String> {
    let parsed = url::Url::parse(url).map_err(|e| format!("{url:?} is not a URL: {e}"))?;
    if !schemes.contains(&parsed.scheme()) || parsed.host().is_none() {
        return Err(format!(
            "{url:?} must be a {} URL with a host",
            schemes
                .iter()
                .map(|s| format!("{s}://"))
                .collect::<Vec<_>>()
                .join(" or ")
        ));
    }
    if parsed.query().is_some() || parsed.fragment().is_some() {
        return Err(format!("{url:?} must not carry a query or fragment"));
    }
    Ok(parsed)
}

fn name_without_wildcards(check: &mut Check, key: &'static str, name: &str) {
    if name.is_empty() || name.contains(|c: char| c.is_whitespace() || c == '*' || c == '>') {
        check.problem(
            key,
            format!("{name:?} must be non-empty without spaces or wildcards"),
        );
    }
}

impl TryFrom<Raw> for Settings {
    type Error = SettingsError;

    fn try_from(raw: Raw) -> Result<Self, SettingsError> {
        // Exhaustive: a key declared but not converted does not compile (unused binding
        // under `-D warnings`).
        let Raw {
            components,
            gitea_instance_url,
            gitea_runner_uuid_file,
            gitea_runner_token_file,
            gitea_ca_file,
            gitea_request_timeout,
            gitea_fetch_timeout,
            runner_name,
            runner_capabilities,
            pod_capacity,
            vm_capacity,
            vm_runner_label,
            trust_domain,
            metadata_prefix,
            runner_facade_capability_key_file,
            task_encryption_key_file,
            task_encryption_previous_key_files,
            nats_url,
            nats_producer_user,
            nats_producer_password_file,
            nats_producer_creds_file,
            nats_worker_user,
            nats_worker_password_file,
            nats_worker_creds_file,
            nats_ca_file,
            nats_stream,
            nats_subject_base,
            nats_create_stream,
            nats_ack_wait,
            heartbeat_interval,
            backlog_limit,
            fetch_pollers_max,
            runner_facade_listen,
            runner_facade_url,
            runner_facade_spiffe_id,
            spiffe_endpoint_socket,
            health_listen,
            state_dir,
            pod_backend,
            vm_backend,
            local_identity,
            executor_program,
            runner_binary,
            executor_start_deadline,
            executor_idle_timeout,
            nats_server_binary,
            leader_election,
            lease_namespace,
            lease_name,
            leader_identity,
            lease_duration,
            pod_namespace,
            pod_executor_image,
            pod_service_account,
            pod_executor_uid,
            spire_cluster,
            spire_class,
            spire_agent_id,
            opensandbox_api,
            opensandbox_api_key_file,
            opensandbox_pool,
            vm_timeout_seconds,
        } = raw;
        let mut check = Check::default();
        let single_host = nats_url.is_none();

        // Gitea.
        let gitea = gitea_settings(
            &mut check,
            Purpose::Run,
            GiteaKeys {
                url: gitea_instance_url,
                uuid_file: gitea_runner_uuid_file,
                token_file: gitea_runner_token_file,
                ca_file: gitea_ca_file,
                request_timeout: gitea_request_timeout.0,
                fetch_timeout: gitea_fetch_timeout.0,
            },
        );
        let runner = RunnerSettings {
            name: runner_name,
            capabilities: runner_capabilities.0,
        };

        // Policy and identity.
        let trust_domain = check
            .required(
                "trust_domain",
                trust_domain,
                "(SPIFFE trust domain of job identities)",
            )
            .and_then(|td| check.ok("trust_domain", TrustDomain::new(td.trim())));
        let labels = check.ok("vm_runner_label", BackendLabels::new(vm_runner_label));
        let codec = check.ok("metadata_prefix", MetadataCodec::new(metadata_prefix));
        let capability_key_file = check.required(
            "runner_facade_capability_key_file",
            runner_facade_capability_key_file,
            "(key of assignment capabilities)",
        );
        let previous = task_encryption_previous_key_files.paths();
        let task_keys = match task_encryption_key_file {
            Some(current) => Some(TaskKeyFiles { current, previous }),
            None => {
                if !previous.is_empty() {
                    check.problem(
                        "task_encryption_previous_key_files",
                        "needs task_encryption_key_file (the key that seals new envelopes)",
                    );
                }
                None
            }
        };
        let local_identity = local_identity.unwrap_or(single_host);
        let identity = if local_identity {
            IdentitySource::Local
        } else {
            match spiffe_endpoint_socket {
                Some(endpoint) => IdentitySource::WorkloadApi(endpoint),
                None => {
                    check.problem(
                        "spiffe_endpoint_socket",
                        "is required without local_identity (the SPIRE agent's Workload API)",
                    );
                    IdentitySource::Local
                }
            }
        };

        // NATS.
        name_without_wildcards(&mut check, "nats_stream", &nats_stream);
        name_without_wildcards(&mut check, "nats_subject_base", &nats_subject_base);
        if nats_stream.contains('.') {
            check.problem("nats_stream", "stream names cannot contain '.'");
        }
        let auth = |user: String,
                    password: Option<PathBuf>,
                    creds: Option<PathBuf>,
                    key: &'static str| match (password, creds) {
            (_, Some(creds)) => NatsAuth::Creds(creds),
            (Some(file), None) => NatsAuth::Password { user, file, key },
            (None, None) => NatsAuth::Anonymous,
        };
        let producer = auth(
            nats_producer_user,
            nats_producer_password_file,
            nats_producer_creds_file,
            "nats_producer_password_file",
        );
        let worker = auth(
            nats_worker_user,
            nats_worker_password_file,
            nats_worker_creds_file,
            "nats_worker_password_file",
        );
        let server = match nats_url {
            None => NatsServer::Embedded {
                binary: nats_server_binary,
            },
            Some(url) => NatsServer::External {
                url,
                producer,
                worker,
                ca_file: nats_ca_file,
            },
        };
        let nats = NatsSettings {
            server,
            stream: nats_stream,
            subject_base: nats_subject_base,
            create_stream: nats_create_stream,
            ack_wait: nats_ack_wait.0,
        };
        if nats.ack_wait < Duration::from_secs(1) {
            check.problem(
                "nats_ack_wait",
                "must be at least 1s (the worker extends the deadline every third of it)",
            );
        }

        // Backends.
        for (key, capacity) in [("pod_capacity", pod_capacity), ("vm_capacity", vm_capacity)] {
            if capacity > MAX_CAPACITY {
                check.problem(
                    key,
                    format!(
                        "{capacity} is above the limit of {MAX_CAPACITY} executors per backend"
                    ),
                );
            }
        }
        let pod_on = components.contains(Component::PodWorker) && pod_capacity > 0;
        let vm_on = components.contains(Component::VmWorker) && vm_capacity > 0;
        let process = ProcessSettings {
            program: executor_program,
            runner_binary,
        };
        let default_kind = |single: &'static str, cluster: &'static str| {
            if single_host { single } else { cluster }
        };
        let pod_kind = pod_backend.unwrap_or_else(|| default_kind("process", "kubernetes").into());
        let vm_kind = vm_backend.unwrap_or_else(|| default_kind("process", "opensandbox").into());
        let pod = match pod_kind.as_str() {
            "process" => Some(PodBackend::Process(process.clone())),
            "kubernetes" if pod_on => check
                .required(
                    "pod_executor_image",
                    pod_executor_image,
                    "with the kubernetes pod backend",
                )
                .map(|image| {
                    PodBackend::Kubernetes(KubernetesSettings {
                        namespace: pod_namespace,
                        image,
                        service_account: pod_service_account,
                        executor_uid: pod_executor_uid,
                        spire_cluster,
                        spire_class,
                        spire_agent_id,
                    })
                }),
            "kubernetes" => None,
            other => {
                check.problem(
                    "pod_backend",
                    format!("{other:?} must be \"kubernetes\" or \"process\""),
                );
                None
            }
        };
        let vm = match vm_kind.as_str() {
            "process" => Some(VmBackend::Process(process)),
            "opensandbox" if vm_on => {
                let api = check
                    .required(
                        "opensandbox_api",
                        opensandbox_api,
                        "with the opensandbox vm backend",
                    )
                    .and_then(|api| {
                        check.ok("opensandbox_api", http_url(&api, &["http", "https"]))
                    });
                let key = check.required(
                    "opensandbox_api_key_file",
                    opensandbox_api_key_file,
                    "with the opensandbox vm backend",
                );
                api.zip(key).map(|(api, api_key_file)| {
                    VmBackend::OpenSandbox(OpenSandboxSettings {
                        api,
                        api_key_file,
                        pool: opensandbox_pool,
                        timeout: Duration::from_secs(vm_timeout_seconds),
                    })
                })
            }
            "opensandbox" => None,
            other => {
                check.problem(
                    "vm_backend",
                    format!("{other:?} must be \"opensandbox\" or \"process\""),
                );
                None
            }
        };
        let uses_process = (pod_on && matches!(pod, Some(PodBackend::Process(_))))
            || (vm_on && matches!(vm, Some(VmBackend::Process(_))));
        if uses_process && !local_identity {
            check.problem(
                "local_identity",
                "must be true with the process backend: local executors get their SPIFFE identity from the controller's CA",
            );
        }
        let pod = pod.filter(|_| pod_on).map(|kind| BackendSettings {
            capacity: pod_capacity,
            kind,
        });
        let vm = vm.filter(|_| vm_on).map(|kind| BackendSettings {
            capacity: vm_capacity,
            kind,
        });
        let enabled_capacity = u64::from(if pod_on { pod_capacity } else { 0 })
            + u64::from(if vm_on { vm_capacity } else { 0 });

        // Components.
        let scheduler_on = components.contains(Component::Scheduler);
        if components.0.is_empty() {
            check.problem("components", "at least one component is required");
        }
        if (components.contains(Component::PodWorker) || components.contains(Component::VmWorker))
            && !scheduler_on
        {
            check.problem(
                "components",
                "a worker needs the scheduler in the same process: executors reach the facade of the replica that holds their assignment",
            );
        }
        if pod_capacity == 0 && vm_capacity == 0 {
            check.problem(
                "pod_capacity",
                "pod_capacity and vm_capacity are both 0: nothing would ever run",
            );
        }

        // Scheduler and facade.
        if heartbeat_interval.0 < Duration::from_secs(1) {
            check.problem("heartbeat_interval", "must be at least 1s");
        }
        if backlog_limit == Some(0) {
            check.problem("backlog_limit", "must be at least 1");
        }
        if fetch_pollers_max == 0 {
            check.problem("fetch_pollers_max", "must be at least 1");
        }
        let listen_default = |port: u16| {
            if single_host {
                format!("127.0.0.1:{port}")
            } else {
                format!("0.0.0.0:{port}")
            }
        };
        let facade_listen = runner_facade_listen.unwrap_or_else(|| listen_default(8443));
        let scheduler = if scheduler_on {
            let url = check
                .required(
                    "runner_facade_url",
                    runner_facade_url,
                    "when the scheduler runs (the URL executors dial)",
                )
                .and_then(|u| {
                    check.ok(
                        "runner_facade_url",
                        http_url(&u, &["https"]).map(|_| u).map_err(|e| {
                            format!("{e}: executors reach the facade over SPIFFE mTLS only")
                        }),
                    )
                });
            let spiffe_id = check
                .required(
                    "runner_facade_spiffe_id",
                    runner_facade_spiffe_id,
                    "when the scheduler runs",
                )
                .filter(|id| {
                    let ok = id.starts_with("spiffe://");
                    if !ok {
                        check.problem(
                            "runner_facade_spiffe_id",
                            format!("{id:?} must be a spiffe:// URI"),
                        );
                    }
                    ok
                });
            url.zip(spiffe_id)
                .map(|(url, spiffe_id)| SchedulerSettings {
                    heartbeat_interval: heartbeat_interval.0,
                    backlog_limit: backlog_limit.map_or(enabled_capacity.max(1), u64::from),
                    fetch_pollers_max: usize::try_from(fetch_pollers_max).unwrap_or(usize::MAX),
                    facade: FacadeSettings {
                        listen: facade_listen,
                        url,
                        spiffe_id,
                    },
                })
        } else {
            None
        };

        // Leader election.
        if lease_duration.0 < Duration::from_secs(3) {
            check.problem(
                "lease_duration",
                "must be at least 3s (renewals run every duration/7 and must beat the API's latency)",
            );
        }
        let leader = leader_election.then_some(LeaderSettings {
            namespace: lease_namespace,
            name: lease_name,
            identity: leader_identity,
            lease_duration: lease_duration.0,
        });

        let executors = ExecutorTimings {
            start_deadline: executor_start_deadline.0,
            idle_timeout: executor_idle_timeout.0,
        };
        if executors.idle_timeout < Duration::from_secs(30) {
            check.problem(
                "executor_idle_timeout",
                "must be at least 30s: the official runner reports every 5s, and a slow report must not fail a job",
            );
        }

        let policy = trust_domain
            .zip(labels)
            .map(|(trust_domain, labels)| DerivationPolicy {
                trust_domain,
                labels,
            });
        match (gitea, policy, codec, capability_key_file) {
            (Some(gitea), Some(policy), Some(codec), Some(capability_key_file))
                if check.problems.is_empty() =>
            {
                Ok(Settings {
                    gitea,
                    runner,
                    policy,
                    codec,
                    capability_key_file,
                    task_keys,
                    nats,
                    state_dir,
                    health_listen: health_listen.unwrap_or_else(|| listen_default(9090)),
                    identity,
                    scheduler,
                    pod,
                    vm,
                    executors,
                    leader,
                })
            }
            _ => Err(SettingsError::Invalid(check.problems)),
        }
    }
}

/// The Gitea keys, for [`gitea_settings`].
struct GiteaKeys {
    url: Option<String>,
    uuid_file: Option<PathBuf>,
    token_file: Option<PathBuf>,
    ca_file: Option<PathBuf>,
    request_timeout: Duration,
    fetch_timeout: Duration,
}

/// What the Gitea settings are loaded for: the hints differ.
#[derive(Clone, Copy)]
enum Purpose {
    Run,
    Register,
}

fn gitea_settings(check: &mut Check, purpose: Purpose, keys: GiteaKeys) -> Option<GiteaSettings> {
    let (url_why, file_why) = match purpose {
        Purpose::Run => ("(the Gitea base URL)", "(run `register` first)"),
        Purpose::Register => (
            "to register (the Gitea base URL)",
            "to register (where the runner's credential is written)",
        ),
    };
    let GiteaKeys {
        url,
        uuid_file,
        token_file,
        ca_file,
        request_timeout,
        fetch_timeout,
    } = keys;
    let url = check
        .required("gitea_instance_url", url, url_why)
        .and_then(|u| check.ok("gitea_instance_url", http_url(&u, &["http", "https"])));
    let uuid_file = check.required("gitea_runner_uuid_file", uuid_file, file_why);
    let token_file = check.required("gitea_runner_token_file", token_file, file_why);
    if uuid_file.is_some() && uuid_file == token_file {
        check.problem(
            "gitea_runner_token_file",
            "must differ from gitea_runner_uuid_file",
        );
    }
    if request_timeout.is_zero() {
        check.problem("gitea_request_timeout", "must be greater than 0");
    }
    if fetch_timeout.is_zero() || fetch_timeout > Duration::from_secs(60) {
        check.problem("gitea_fetch_timeout", "must be between 1ms and 60s");
    }
    Some(GiteaSettings {
        url: url?,
        uuid_file: uuid_file?,
        token_file: token_file?,
        ca_file,
        request_timeout,
        fetch_timeout,
    })
}

/// What `register` needs: the Gitea settings, the runner name and capabilities, and the
/// labels of the enabled backends; nothing else is checked.
#[derive(Debug, Clone)]
pub struct RegisterSettings {
    /// How to reach Gitea and where the credential files go.
    pub gitea: GiteaSettings,
    /// Name and capabilities.
    pub runner: RunnerSettings,
    /// Labels of the enabled backends, `self-hosted` first.
    pub labels: Vec<String>,
}

impl RegisterSettings {
    /// Loads the layers and checks only what registration needs.
    pub fn load(sources: &Sources) -> Result<Self, SettingsError> {
        let raw = sources.load()?;
        let mut check = Check::default();
        let gitea = gitea_settings(
            &mut check,
            Purpose::Register,
            GiteaKeys {
                url: raw.gitea_instance_url,
                uuid_file: raw.gitea_runner_uuid_file,
                token_file: raw.gitea_runner_token_file,
                ca_file: raw.gitea_ca_file,
                request_timeout: raw.gitea_request_timeout.0,
                fetch_timeout: raw.gitea_fetch_timeout.0,
            },
        );
        let labels = check.ok("vm_runner_label", BackendLabels::new(raw.vm_runner_label));
        match (gitea, labels) {
            (Some(gitea), Some(labels)) if check.problems.is_empty() => {
                let enabled = [
                    (Backend::Pod, Component::PodWorker, raw.pod_capacity),
                    (Backend::Vm, Component::VmWorker, raw.vm_capacity),
                ]
                .into_iter()
                .filter(|(_, c, n)| raw.components.contains(*c) && *n > 0)
                .map(|(b, _, _)| b);
                Ok(RegisterSettings {
                    gitea,
                    runner: RunnerSettings {
                        name: raw.runner_name,
                        capabilities: raw.runner_capabilities.0,
                    },
                    labels: declared_labels(&labels, enabled),
                })
            }
            _ => Err(SettingsError::Invalid(check.problems)),
        }
    }
}

// === check-config ===

/// What `check-config` reports.
#[derive(Debug)]
pub struct Checked {
    /// The effective configuration as TOML (secrets as paths only, URL credentials masked).
    pub rendered: String,
    /// Every problem found; empty when the configuration is usable.
    pub problems: Vec<String>,
}

/// Loads the layers, renders the effective configuration and lists every problem: broken
/// rules, unreadable secret files and secrets given as plain environment values.
pub fn check(sources: &Sources) -> Result<Checked, SettingsError> {
    let raw = sources.load()?;
    let rendered = render(&raw);
    let secret_files = secret_files(&raw);
    let mut problems = match Settings::try_from(raw) {
        Ok(_) => Vec::new(),
        Err(SettingsError::Invalid(problems)) => problems.iter().map(ToString::to_string).collect(),
        Err(e) => vec![e.to_string()],
    };
    for (key, path) in secret_files {
        if let Err(e) = read_secret_file(key, &path) {
            problems.push(e.to_string());
        }
    }
    if sources.environment {
        for plain in [
            "GITEA_RUNNER_TOKEN",
            "NATS_PRODUCER_PASSWORD",
            "NATS_WORKER_PASSWORD",
            "OPENSANDBOX_API_KEY",
            "RUNNER_FACADE_CAPABILITY_KEY",
        ] {
            if std::env::var_os(plain).is_some() {
                problems.push(format!(
                    "{plain} is set but ignored: secrets are read only from files ({plain}_FILE)"
                ));
            }
        }
    }
    Ok(Checked { rendered, problems })
}

/// Every configured secret file: its key and path.
fn secret_files(raw: &Raw) -> Vec<(&'static str, PathBuf)> {
    let Ok(serde_json::Value::Object(values)) = serde_json::to_value(raw) else {
        return Vec::new();
    };
    KEYS.iter()
        .filter(|k| k.secret)
        .flat_map(|k| match values.get(k.name) {
            Some(serde_json::Value::String(p)) => vec![(k.name, PathBuf::from(p))],
            Some(serde_json::Value::Array(items)) => items
                .iter()
                .filter_map(|v| v.as_str())
                .map(|p| (k.name, PathBuf::from(p)))
                .collect(),
            _ => Vec::new(),
        })
        .collect()
}

/// The effective configuration as TOML. Only paths of secrets appear, never their contents;
/// credentials inside URLs are masked.
fn render(raw: &Raw) -> String {
    let Ok(serde_json::Value::Object(values)) = serde_json::to_value(raw) else {
        return "# could not render the configuration\n".into();
    };
    let mut out = String::new();
    for key in KEYS {
        match values.get(key.name) {
            None | Some(serde_json::Value::Null) => {
                out.push_str(&format!("# {} is not set\n", key.name));
            }
            Some(serde_json::Value::String(s)) => {
                out.push_str(&format!("{} = {:?}\n", key.name, redact_url_userinfo(s)));
            }
            Some(other) => out.push_str(&format!("{} = {other}\n", key.name)),
        }
    }
    out
}

/// Masks `user:password@` in URLs (e.g. a NATS URL with inline credentials).
pub fn redact_url_userinfo(value: &str) -> String {
    let Some(scheme_end) = value.find("://") else {
        return value.to_owned();
    };
    let rest = &value[scheme_end + 3..];
    let authority_end = rest.find('/').unwrap_or(rest.len());
    match rest[..authority_end].rfind('@') {
        Some(at) => format!("{}://<redacted>@{}", &value[..scheme_end], &rest[at + 1..]),
        None => value.to_owned(),
    }
}

#[cfg(test)]
mod tests;
