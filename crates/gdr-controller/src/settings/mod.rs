//! The controller's configuration, parsed once into a typed value.
//!
//! Layers, later wins: built-in defaults < TOML file (`--config`) < environment (the Go
//! version's variable names, e.g. `POD_CAPACITY`) < `--set key=value`. Every key is declared
//! once in `keys`, which also generates the references. The layers produce a `Raw`
//! value that is split by section (`keys::Sections`: `gitea`, `nats`, `pod`, `vm`, …) and
//! converted once ([`Settings::try_from`]) into [`Settings`]: each section by a function of
//! its own into its component's settings type, backend kinds as enums, optional sections
//! that exist only when their component is enabled, durations and paths typed. The
//! conversion destructures every section exhaustively and the runtime destructures
//! [`Settings`] exhaustively, so a key that nothing reads is a compile error, not a silent
//! no-op.
//!
//! Secrets are never values: only paths to files that hold them (`*_file`).

/// The literals of computed defaults, for their constants below and for the key table's
/// `shown` texts (`concat!` takes literals only), so each is written once.
macro_rules! runner_uuid_file {
    () => {
        "runner-uuid"
    };
}
macro_rules! runner_token_file {
    () => {
        "runner-token"
    };
}
macro_rules! local_trust_domain {
    () => {
        "gitea-dynamic-runner.local"
    };
}
macro_rules! local_facade_path {
    () => {
        "/gitea-dynamic-runner/facade"
    };
}
macro_rules! loopback_address {
    () => {
        "127.0.0.1"
    };
}
macro_rules! any_address {
    () => {
        "0.0.0.0"
    };
}
macro_rules! facade_port {
    () => {
        8443
    };
}
macro_rules! health_port {
    () => {
        9090
    };
}
macro_rules! state_dir_name {
    () => {
        "gitea-dynamic-runner"
    };
}
macro_rules! root_state_parent {
    () => {
        "/var/lib"
    };
}
macro_rules! home_state_parent {
    () => {
        ".local/state"
    };
}
macro_rules! process_backend {
    () => {
        "process"
    };
}
macro_rules! kubernetes_backend {
    () => {
        "kubernetes"
    };
}
macro_rules! opensandbox_backend {
    () => {
        "opensandbox"
    };
}
macro_rules! executor_binary {
    () => {
        "gitea-dynamic-executor"
    };
}
macro_rules! gitea_runner {
    () => {
        "gitea-runner"
    };
}
macro_rules! act_runner {
    () => {
        "act_runner"
    };
}

mod keys;
mod pod;
mod reference;
mod secret;
mod sources;
mod spire;

pub use spire::SpireExecutorSettings;
mod values;

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use gdr_core::assignment::DerivationPolicy;
use gdr_core::backend::{Backend, BackendLabels};
use gdr_core::identity::{IdentityScheme, TrustDomain};
use gdr_core::metadata::MetadataCodec;
pub(crate) use keys::Raw;
pub use keys::{KEYS, Key, Kind};
use keys::{Sections, section};
pub use pod::KubernetesSettings;
pub use reference::{Format, default_of, render as reference};
pub use secret::{
    SecretFileError, SecretPermissions, check_secret_file_mode, read_secret_file,
    read_secret_file_with,
};
pub use sources::{ParseError, Sources};
pub use values::{Component, Components};
use values::{List, Secs};

/// The official runner's `report_close_timeout`: an executor that holds reports for less
/// adds nothing to what the runner does itself.
const MIN_REPORT_OUTAGE_TOLERANCE: Duration = Duration::from_secs(10);
/// The idle poller's shortest pace: below it an idle controller would load Gitea like a
/// busy loop.
const MIN_FETCH_INTERVAL: Duration = Duration::from_millis(100);

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
    pub capability_key_file: KeyFile,
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
    /// Which permissions secret files may have.
    pub secrets: SecretPermissions,
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
    /// Registration token file: register at start while the UUID and token files are
    /// missing (`gitea_runner_registration_token_file`).
    pub registration_token_file: Option<PathBuf>,
    /// Extra CAs for an https Gitea.
    pub ca_file: Option<PathBuf>,
    /// Timeout of every call but FetchTask.
    pub request_timeout: Duration,
    /// Timeout of FetchTask.
    pub fetch_timeout: Duration,
}

/// A secret key file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyFile {
    /// Configured by the operator: it must exist.
    Configured(PathBuf),
    /// Single-host mode's default under `state_dir`: generated (mode 0600) when missing.
    Generated(PathBuf),
}

impl KeyFile {
    /// The file.
    pub fn path(&self) -> &std::path::Path {
        match self {
            KeyFile::Configured(p) | KeyFile::Generated(p) => p,
        }
    }
}

/// File names single-host mode uses under `state_dir` for what is not configured.
pub mod state_files {
    /// The runner UUID (`gitea_runner_uuid_file`).
    pub const RUNNER_UUID: &str = runner_uuid_file!();
    /// The runner token (`gitea_runner_token_file`).
    pub const RUNNER_TOKEN: &str = runner_token_file!();
    /// The capability key (`runner_facade_capability_key_file`).
    pub const CAPABILITY_KEY: &str = "capability-key";
}

/// The trust domain of single-host mode's local identity when `trust_domain` is unset.
pub const LOCAL_TRUST_DOMAIN: &str = local_trust_domain!();

/// The facade's SPIFFE ID path under the local trust domain when
/// `runner_facade_spiffe_id` is unset.
pub const LOCAL_FACADE_PATH: &str = local_facade_path!();

/// The port of the facade's listener when `runner_facade_listen` is unset.
pub const FACADE_PORT: u16 = facade_port!();

/// The port of the health listener when `health_listen` is unset.
pub const HEALTH_PORT: u16 = health_port!();

/// Where `status` looks for the health listener unless told: `health_listen`'s single-host
/// default, as a URL.
pub const DEFAULT_STATUS_URL: &str = concat!("http://", loopback_address!(), ":", health_port!());

/// The kinds of backend `pod_backend` and `vm_backend` name.
pub mod backend_kinds {
    /// Local child processes (either backend, single host).
    pub const PROCESS: &str = process_backend!();
    /// Kubernetes Pods (the pod backend).
    pub const KUBERNETES: &str = kubernetes_backend!();
    /// OpenSandbox Kata VMs (the vm backend).
    pub const OPENSANDBOX: &str = opensandbox_backend!();
}

/// The executor's own binary (crate `gdr-executor`), installed next to the controller's:
/// the process backend's program when `executor_program` is unset and it is there.
pub const EXECUTOR_BINARY: &str = executor_binary!();

/// The official runner's names, in the order they are looked for on `PATH` when
/// `runner_binary` is unset (`gitea-runner` since 0.3; `act_runner` before).
pub const RUNNER_NAMES: [&str; 2] = [gitea_runner!(), act_runner!()];

/// The state directory when `state_dir` is unset: systemd's `$STATE_DIRECTORY` (its first
/// entry), else `/var/lib/gitea-dynamic-runner` for root, else the XDG state directory
/// (`$XDG_STATE_HOME`, which must be absolute, or `$HOME/.local/state`).
pub fn default_state_dir(
    env: impl Fn(&str) -> Option<std::ffi::OsString>,
    root: bool,
) -> Result<PathBuf, String> {
    const NAME: &str = state_dir_name!();
    let absolute = |name: &str| env(name).map(PathBuf::from).filter(|p| p.is_absolute());
    if let Some(dirs) = env("STATE_DIRECTORY") {
        // systemd lists one absolute path per `StateDirectory=` entry, colon-separated.
        if let Some(first) = std::env::split_paths(&dirs).find(|p| p.is_absolute()) {
            return Ok(first);
        }
    }
    if root {
        return Ok(PathBuf::from(root_state_parent!()).join(NAME));
    }
    if let Some(xdg) = absolute("XDG_STATE_HOME") {
        return Ok(xdg.join(NAME));
    }
    match absolute("HOME") {
        Some(home) => Ok(home.join(home_state_parent!()).join(NAME)),
        None => Err(
            "is not set and neither STATE_DIRECTORY, XDG_STATE_HOME nor HOME names an absolute directory: set state_dir".into(),
        ),
    }
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
    /// What a worker trusts of what it reads from the queue.
    pub security: QueueSecurity,
}

/// The queue's trust rules (DESIGN invariants 20, 21).
#[derive(Debug, Clone)]
pub struct QueueSecurity {
    /// Accept plaintext v1 envelopes although a task key is configured (a migration).
    pub accept_plaintext_envelopes: bool,
    /// Accept sealed envelopes without a fetch time (an upgrade from an older release).
    pub accept_undated_envelopes: bool,
    /// Gitea's endless-task timeout: an envelope fetched longer ago is refused, and a
    /// finished assignment is remembered at least this long.
    pub task_lifetime: Duration,
    /// Key-value bucket of finished assignment IDs.
    pub finished_bucket: String,
    /// An assignment sealed with an unknown task key is failed in Gitea after this long.
    pub held_timeout: Duration,
}

/// Which NATS server.
#[derive(Debug, Clone)]
pub enum NatsServer {
    /// A supervised nats-server child with its store under `state_dir` (single host).
    Embedded {
        /// The nats-server binary.
        binary: PathBuf,
        /// The program whose `exec-bound-to-parent` subcommand starts it (`None`: this
        /// binary; a test that runs the controller inside its own process names the real
        /// binary here).
        binder: Option<PathBuf>,
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
    /// No fetch of a backend's jobs while this many of its assignments wait unclaimed
    /// (`None`: the backend's capacity).
    pub backlog_limit: Option<u64>,
    /// Most concurrent FetchTask pollers.
    pub fetch_pollers_max: usize,
    /// The idle poller's pace while Gitea has nothing.
    pub fetch_interval: Duration,
    /// The facade.
    pub facade: FacadeSettings,
}

/// The RunnerService facade.
#[derive(Debug, Clone)]
pub struct FacadeSettings {
    /// Listen address.
    pub listen: String,
    /// URL executors dial (`None`: `https://<the facade listener's address>`, single
    /// host only).
    pub url: Option<String>,
    /// SPIFFE ID executors verify.
    pub spiffe_id: String,
    /// What one peer can hold of it.
    pub limits: FacadeLimits,
}

/// Connection limits and timeouts of the facade (DESIGN invariant 21): the facade's own
/// settings type, which the `runner_facade_…` keys fill.
pub use gdr_facade::FacadeLimits;

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
    /// Kubernetes Pods (the backend's own settings; none exist in a build without the
    /// `kubernetes` feature).
    Kubernetes(Box<KubernetesSettings>),
}

/// What runs vm jobs.
#[derive(Debug, Clone)]
pub enum VmBackend {
    /// Local child processes.
    Process(ProcessSettings),
    /// OpenSandbox Kata VMs.
    OpenSandbox(Box<OpenSandboxSettings>),
}

/// The process backend's keys. Not the backend's `ProcessBackendSettings`: the program
/// and the runner binary are resolved when the controller starts (next to this binary, on
/// `PATH`), and the state root, identity and codec come from the wiring; what the backend
/// takes as it is (the log retention) is its own type.
#[derive(Debug, Clone)]
pub struct ProcessSettings {
    /// `executor_identity = "spire"`: executors' entries in this SPIRE server, each
    /// executor under a uid of its own; `None`: the local CA.
    pub spire: Option<SpireExecutorSettings>,
    /// The executor program (`None`: this binary).
    pub program: Option<PathBuf>,
    /// The official runner the executor runs (`None`: `gitea-runner` or `act_runner`
    /// found on `PATH` at start).
    pub runner_binary: Option<PathBuf>,
    /// Which ended executors' logs are kept (`executor_log_retention`,
    /// `executor_log_retention_count`), as the backend takes it.
    pub log_retention: gdr_backends::process::LogRetention,
}

/// The OpenSandbox VM backend: the backend's own settings, and what the controller itself
/// does with the section's other keys (it reads the API key file once at start, adds the
/// CA bundle to the shared TLS configuration, and its lifecycle reconciler waits the
/// terminal grace).
#[derive(Debug, Clone)]
pub struct OpenSandboxSettings {
    /// The backend's settings (`opensandbox_api`, `opensandbox_pool`, the timeouts,
    /// `vm_entrypoint`, `vm_executor_env`, `vm_timeout_seconds`, `vm_renew_before`).
    pub backend: gdr_backends::opensandbox::OpenSandboxSettings,
    /// API key file (`opensandbox_api_key_file`).
    pub api_key_file: PathBuf,
    /// Extra CAs for an https API (`opensandbox_ca_file`).
    pub ca_file: Option<PathBuf>,
    /// Delete a terminal sandbox this long after its marker was seen (`vm_terminal_grace`).
    pub terminal_grace: Duration,
}

/// The server's lower bound on a sandbox lifetime.
const MIN_SANDBOX_TIMEOUT: Duration = Duration::from_secs(60);

/// Executor deadlines.
#[derive(Debug, Clone, Copy)]
pub struct ExecutorTimings {
    /// An unclaimed executor older than this is failed.
    pub start_deadline: Duration,
    /// A claimed executor silent for this long is failed.
    pub idle_timeout: Duration,
    /// How long an executor holds its runner's reports while the facade is unreachable.
    pub report_outage_tolerance: Duration,
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
    /// enabled backend (and nothing for a disabled one, so Gitea never offers its jobs),
    /// then the labels the Pod profiles add (Gitea offers a job only to a runner that has
    /// every one of its `runs-on` labels).
    pub fn declared_labels(&self) -> Vec<String> {
        let mut labels = declared_labels(
            &self.policy.labels,
            self.capacities().into_iter().map(|(b, _)| b),
        );
        labels.extend(self.pod_profile_labels());
        labels
    }

    /// The `runs-on` labels the Pod profiles add (none unless the kubernetes pod backend
    /// is enabled).
    pub fn pod_profile_labels(&self) -> Vec<String> {
        match self.pod.as_ref().map(|p| &p.kind) {
            #[cfg(feature = "kubernetes")]
            Some(PodBackend::Kubernetes(k)) => k.profiles.keys().cloned().collect(),
            _ => Vec::new(),
        }
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

    /// `trust_domain`, required and valid.
    fn trust_domain(&mut self, value: Option<String>) -> Option<TrustDomain> {
        self.required(
            "trust_domain",
            value,
            "(SPIFFE trust domain of job identities)",
        )
        .and_then(|td| self.ok("trust_domain", TrustDomain::new(td.trim())))
    }

    /// `state_dir`, or the platform's state directory when unset.
    fn state_dir(&mut self, value: Option<PathBuf>) -> PathBuf {
        value
            .map_or_else(
                || {
                    default_state_dir(
                        |name| std::env::var_os(name),
                        rustix::process::geteuid().is_root(),
                    )
                },
                Ok,
            )
            .map_err(|e| self.problem("state_dir", e))
            .unwrap_or_default()
    }

    /// The leader settings when `enabled` (the lease duration is checked either way).
    fn leader(&mut self, enabled: bool, settings: LeaderSettings) -> Option<LeaderSettings> {
        if settings.lease_duration < Duration::from_secs(3) {
            self.problem(
                "lease_duration",
                "must be at least 3s (renewals run every duration/7 and must beat the API's latency)",
            );
        }
        enabled.then_some(settings)
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

    /// One function per section, called in the order their problems are listed.
    fn try_from(raw: Raw) -> Result<Self, SettingsError> {
        // Exhaustive: a section not converted does not compile (unused binding under
        // `-D warnings`), and each section's function destructures its keys.
        let Sections {
            components: section::ComponentSet { components },
            gitea,
            runner,
            backends:
                section::Backends {
                    pod_capacity,
                    vm_capacity,
                    vm_runner_label,
                },
            policy,
            key_files,
            nats,
            scheduler,
            facade,
            host:
                section::Host {
                    spiffe_endpoint_socket,
                    health_listen,
                    state_dir,
                    pod_backend,
                    vm_backend,
                    local_identity,
                },
            spire_executors,
            executors,
            embedded_nats,
            leader,
            pod,
            vm,
            // Read by `sandbox-identity` only ([`SandboxIdentitySettings::load`]).
            sandbox_identity: _,
            facade_limits,
            queue_security,
            secrets,
            registration,
        } = raw.into();
        let mut check = Check::default();
        let single_host = nats.nats_url.is_none();
        let state_dir = check.state_dir(state_dir);
        let in_state = single_host.then(|| state_dir.clone());
        let gitea = gitea_settings(&mut check, Purpose::Run, gitea, registration, in_state);

        // Policy and identity. Local identity is a CA of the controller's own, so its
        // trust domain and the facade's ID need no choice by the operator.
        let local_identity = local_identity.unwrap_or(single_host);
        let derivation = Derivation::new(&mut check, policy, vm_runner_label, local_identity);
        let (capability_key_file, task_keys) =
            key_file_settings(&mut check, key_files, single_host.then_some(&state_dir));
        let identity = identity_source(&mut check, local_identity, spiffe_endpoint_socket);
        let nats = nats_settings(&mut check, nats, embedded_nats, queue_security);

        // Backends.
        let keys = WorkerKeys {
            pod_capacity,
            vm_capacity,
            pod_backend,
            vm_backend,
            spire_executors,
            executors,
            pod,
            vm,
            single_host,
            local_identity,
        };
        let (pod, vm, timings) = workers(&mut check, keys, &components, &derivation);

        // Scheduler and facade.
        check_scheduler_pace(&mut check, &scheduler);
        let limits = facade_limit_settings(&mut check, facade_limits);
        let secrets = secret_permissions(&mut check, secrets);
        let scheduler = components.contains(Component::Scheduler).then(|| {
            let local_id = derivation.local_facade_id(local_identity);
            scheduler_settings(&mut check, scheduler, facade, limits, single_host, local_id)
        });

        let leader = leader_settings(&mut check, leader);
        let executors = executor_timings(&mut check, timings);
        let (policy, codec) = derivation.finish();
        match (gitea, policy, codec, capability_key_file) {
            (Some(gitea), Some(policy), Some(codec), Some(capability_key_file))
                if check.problems.is_empty() =>
            {
                Ok(Settings {
                    gitea,
                    runner: runner.into(),
                    policy,
                    codec,
                    capability_key_file,
                    task_keys,
                    nats,
                    state_dir,
                    health_listen: health_listen
                        .unwrap_or_else(|| listen_default(single_host, HEALTH_PORT)),
                    identity,
                    scheduler: scheduler.flatten(),
                    pod,
                    vm,
                    executors,
                    leader,
                    secrets,
                })
            }
            _ => Err(SettingsError::Invalid(check.problems)),
        }
    }
}

// === Sections of [`Settings::try_from`] ===

/// `secret_file_permissions`.
fn secret_permissions(check: &mut Check, keys: section::Secrets) -> SecretPermissions {
    let section::Secrets {
        secret_file_permissions,
    } = keys;
    check
        .ok(
            "secret_file_permissions",
            secret_file_permissions.parse::<SecretPermissions>(),
        )
        .unwrap_or_default()
}

/// The worker sections' keys, and where the controller runs (what their defaults depend
/// on): what [`workers`] converts.
struct WorkerKeys {
    pod_capacity: u32,
    vm_capacity: u32,
    pod_backend: Option<String>,
    vm_backend: Option<String>,
    spire_executors: section::SpireExecutors,
    executors: section::Executors,
    pod: section::Pod,
    vm: section::Vm,
    single_host: bool,
    local_identity: bool,
}

/// The enabled backends, and the executor deadlines (checked last: [`executor_timings`]).
type Workers = (
    Option<BackendSettings<PodBackend>>,
    Option<BackendSettings<VmBackend>>,
    ExecutorTimings,
);

/// The backends: capacities, the process backend's keys, the SPIRE identity of process
/// executors, each backend's kind and settings, then which components run together.
fn workers(
    check: &mut Check,
    keys: WorkerKeys,
    components: &Components,
    derivation: &Derivation,
) -> Workers {
    let WorkerKeys {
        pod_capacity,
        vm_capacity,
        pod_backend,
        vm_backend,
        spire_executors,
        executors,
        pod,
        vm,
        single_host,
        local_identity,
    } = keys;
    check_capacities(check, pod_capacity, vm_capacity);
    let (process, timings) = executor_settings(executors);
    let pod_on = components.contains(Component::PodWorker) && pod_capacity > 0;
    let vm_on = components.contains(Component::VmWorker) && vm_capacity > 0;
    // The Pod section's agent ID is the parent of process executors' SPIRE entries too.
    let spire_keys = spire::keys(spire_executors, pod.spire_agent_id.clone(), local_identity);
    let spire = spire::spire_identity_settings(check, spire_keys);
    let process = ProcessSettings {
        spire: spire.clone(),
        ..process
    };
    let pod_kind = pod_backend.unwrap_or_else(|| default_pod_backend(single_host).to_owned());
    let vm_kind = vm_backend.unwrap_or_else(|| default_vm_backend(single_host).to_owned());
    let context = derivation.pod_context(timings.start_deadline);
    let pod = pod_backend_settings(check, &pod_kind, pod_on, pod, &process, &context)
        .filter(|_| pod_on)
        .map(|kind| BackendSettings {
            capacity: pod_capacity,
            kind,
        });
    let vm_context = (derivation, timings.start_deadline);
    let vm = vm_backend_settings(check, &vm_kind, vm_on, vm, process, vm_context)
        .filter(|_| vm_on)
        .map(|kind| BackendSettings {
            capacity: vm_capacity,
            kind,
        });
    let process_capacity = |on: bool, capacity: u32| if on { capacity } else { 0 };
    let pod_process = matches!(pod.as_ref().map(|p| &p.kind), Some(PodBackend::Process(_)));
    let vm_process = matches!(vm.as_ref().map(|v| &v.kind), Some(VmBackend::Process(_)));
    spire::check_process_identity(
        check,
        spire.as_ref(),
        local_identity,
        (pod_process || vm_process).then(|| {
            process_capacity(pod_process, pod_capacity) + process_capacity(vm_process, vm_capacity)
        }),
    );
    check_components(check, components, pod_capacity, vm_capacity);
    (pod, vm, timings)
}

impl From<section::Runner> for RunnerSettings {
    fn from(keys: section::Runner) -> Self {
        let section::Runner {
            runner_name,
            runner_capabilities,
        } = keys;
        RunnerSettings {
            name: runner_name,
            capabilities: runner_capabilities.0,
        }
    }
}

/// A listen address on `port`: loopback in single-host mode, every address otherwise.
fn listen_default(single_host: bool, port: u16) -> String {
    if single_host {
        format!("{}:{port}", loopback_address!())
    } else {
        format!("{}:{port}", any_address!())
    }
}

/// The parts of the derivation policy and the metadata codec, each `None` when its key is
/// broken (already reported): the backends are converted with them.
struct Derivation {
    trust_domain: Option<TrustDomain>,
    scheme: Option<IdentityScheme>,
    labels: Option<BackendLabels>,
    codec: Option<MetadataCodec>,
}

impl Derivation {
    /// `trust_domain` (with local identity: [`LOCAL_TRUST_DOMAIN`] when unset),
    /// `spiffe_id_scheme`, `vm_runner_label` and `metadata_prefix`, in that order.
    fn new(
        check: &mut Check,
        keys: section::Policy,
        vm_runner_label: String,
        local_identity: bool,
    ) -> Self {
        let section::Policy {
            trust_domain,
            spiffe_id_scheme,
            metadata_prefix,
        } = keys;
        let trust_domain = check.trust_domain(
            trust_domain.or_else(|| local_identity.then(|| LOCAL_TRUST_DOMAIN.to_owned())),
        );
        let scheme = check.ok(
            "spiffe_id_scheme",
            spiffe_id_scheme.parse::<IdentityScheme>(),
        );
        let labels = check.ok("vm_runner_label", BackendLabels::new(vm_runner_label));
        let codec = check.ok("metadata_prefix", MetadataCodec::new(metadata_prefix));
        Derivation {
            trust_domain,
            scheme,
            labels,
            codec,
        }
    }

    /// The facade's SPIFFE ID under local identity, when `runner_facade_spiffe_id` is unset.
    fn local_facade_id(&self, local_identity: bool) -> Option<String> {
        self.trust_domain
            .as_ref()
            .filter(|_| local_identity)
            .map(|td| format!("spiffe://{}{LOCAL_FACADE_PATH}", td.as_str()))
    }

    /// What the Pod backend is converted with.
    fn pod_context(&self, start_deadline: Duration) -> pod::Context<'_> {
        pod::Context {
            trust_domain: self.trust_domain.as_ref(),
            codec: self.codec.as_ref(),
            labels: self.labels.as_ref(),
            start_deadline,
        }
    }

    /// The policy and the codec, when their keys are sound.
    fn finish(self) -> (Option<DerivationPolicy>, Option<MetadataCodec>) {
        let policy = self.trust_domain.zip(self.scheme).zip(self.labels).map(
            |((trust_domain, scheme), labels)| DerivationPolicy {
                trust_domain,
                scheme,
                labels,
            },
        );
        (policy, self.codec)
    }
}

/// The capability key file, then the task keys; `state_dir` is given in single-host mode.
fn key_file_settings(
    check: &mut Check,
    keys: section::KeyFiles,
    state_dir: Option<&PathBuf>,
) -> (Option<KeyFile>, Option<TaskKeyFiles>) {
    let section::KeyFiles {
        runner_facade_capability_key_file,
        task_encryption_key_file,
        task_encryption_previous_key_files,
    } = keys;
    let capability = capability_key_file(
        check,
        runner_facade_capability_key_file,
        state_dir.map(PathBuf::as_path),
    );
    let task = task_keys(
        check,
        task_encryption_key_file,
        task_encryption_previous_key_files.paths(),
    );
    (capability, task)
}

/// `runner_facade_capability_key_file`; unset in single-host mode (`state_dir` given):
/// generated under `state_dir`.
fn capability_key_file(
    check: &mut Check,
    file: Option<PathBuf>,
    state_dir: Option<&std::path::Path>,
) -> Option<KeyFile> {
    match (file, state_dir) {
        (Some(file), _) => Some(KeyFile::Configured(file)),
        (None, Some(dir)) => Some(KeyFile::Generated(dir.join(state_files::CAPABILITY_KEY))),
        (None, None) => check.required(
            "runner_facade_capability_key_file",
            None,
            "(key of assignment capabilities)",
        ),
    }
}

/// The task keys; previous keys without a current one are refused (nothing would seal).
fn task_keys(
    check: &mut Check,
    current: Option<PathBuf>,
    previous: Vec<PathBuf>,
) -> Option<TaskKeyFiles> {
    match current {
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
    }
}

/// Where SVIDs come from: the local CA, else the Workload API at `spiffe_endpoint_socket`.
fn identity_source(
    check: &mut Check,
    local_identity: bool,
    endpoint: Option<String>,
) -> IdentitySource {
    match (local_identity, endpoint) {
        (true, _) => IdentitySource::Local,
        (false, Some(endpoint)) => IdentitySource::WorkloadApi(endpoint),
        (false, None) => {
            check.problem(
                "spiffe_endpoint_socket",
                "is required without local_identity (the SPIRE agent's Workload API)",
            );
            // A placeholder: the problem makes the conversion fail.
            IdentitySource::Local
        }
    }
}

/// The JetStream handoff: the embedded server without `nats_url`, else the cluster with
/// its credentials; then the queue's trust rules.
fn nats_settings(
    check: &mut Check,
    keys: section::Nats,
    embedded: section::EmbeddedNats,
    security: section::QueueSecurity,
) -> NatsSettings {
    let section::Nats {
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
    } = keys;
    let section::EmbeddedNats { nats_server_binary } = embedded;
    name_without_wildcards(check, "nats_stream", &nats_stream);
    name_without_wildcards(check, "nats_subject_base", &nats_subject_base);
    if nats_stream.contains('.') {
        check.problem("nats_stream", "stream names cannot contain '.'");
    }
    let server = match nats_url {
        None => NatsServer::Embedded {
            binary: nats_server_binary,
            binder: None,
        },
        Some(url) => NatsServer::External {
            url,
            producer: nats_auth(
                nats_producer_user,
                nats_producer_password_file,
                nats_producer_creds_file,
                "nats_producer_password_file",
            ),
            worker: nats_auth(
                nats_worker_user,
                nats_worker_password_file,
                nats_worker_creds_file,
                "nats_worker_password_file",
            ),
            ca_file: nats_ca_file,
        },
    };
    let security = queue_security(check, security);
    if nats_ack_wait.0 < Duration::from_secs(1) {
        check.problem(
            "nats_ack_wait",
            "must be at least 1s (the worker extends the deadline every third of it)",
        );
    }
    NatsSettings {
        server,
        stream: nats_stream,
        subject_base: nats_subject_base,
        create_stream: nats_create_stream,
        ack_wait: nats_ack_wait.0,
        security,
    }
}

/// How one NATS connection authenticates: a `.creds` file wins over a password file.
fn nats_auth(
    user: String,
    password: Option<PathBuf>,
    creds: Option<PathBuf>,
    key: &'static str,
) -> NatsAuth {
    match (password, creds) {
        (_, Some(creds)) => NatsAuth::Creds(creds),
        (Some(file), None) => NatsAuth::Password { user, file, key },
        (None, None) => NatsAuth::Anonymous,
    }
}

/// Each backend's capacity is at most [`MAX_CAPACITY`].
fn check_capacities(check: &mut Check, pod_capacity: u32, vm_capacity: u32) {
    for (key, capacity) in [("pod_capacity", pod_capacity), ("vm_capacity", vm_capacity)] {
        if capacity > MAX_CAPACITY {
            check.problem(
                key,
                format!("{capacity} is above the limit of {MAX_CAPACITY} executors per backend"),
            );
        }
    }
}

/// The process backend's keys, and the executor deadlines (checked last:
/// [`executor_timings`]).
fn executor_settings(keys: section::Executors) -> (ProcessSettings, ExecutorTimings) {
    let section::Executors {
        executor_program,
        runner_binary,
        executor_start_deadline,
        executor_idle_timeout,
        executor_report_outage_tolerance,
        executor_log_retention,
        executor_log_retention_count,
    } = keys;
    // `executor_identity`'s SPIRE settings join in `try_from`, after the Pod section.
    let process = ProcessSettings {
        spire: None,
        program: executor_program,
        runner_binary,
        log_retention: gdr_backends::process::LogRetention {
            max_age: executor_log_retention.0,
            max_count: count(executor_log_retention_count),
        },
    };
    let timings = ExecutorTimings {
        start_deadline: executor_start_deadline.0,
        idle_timeout: executor_idle_timeout.0,
        report_outage_tolerance: executor_report_outage_tolerance.0,
    };
    (process, timings)
}

/// The pod backend when `pod_backend` is unset: processes on a single host, else Pods.
fn default_pod_backend(single_host: bool) -> &'static str {
    if single_host {
        backend_kinds::PROCESS
    } else {
        backend_kinds::KUBERNETES
    }
}

/// The vm backend when `vm_backend` is unset: processes on a single host, else OpenSandbox.
fn default_vm_backend(single_host: bool) -> &'static str {
    if single_host {
        backend_kinds::PROCESS
    } else {
        backend_kinds::OPENSANDBOX
    }
}

/// What runs pod jobs (`None`: off, or broken and reported); the kubernetes backend's
/// keys are converted only when the backend is `on`.
fn pod_backend_settings(
    check: &mut Check,
    kind: &str,
    on: bool,
    keys: section::Pod,
    process: &ProcessSettings,
    context: &pod::Context<'_>,
) -> Option<PodBackend> {
    use backend_kinds::{KUBERNETES, PROCESS};
    match kind {
        PROCESS => Some(PodBackend::Process(process.clone())),
        KUBERNETES if on => {
            pod::kubernetes(check, keys, context).map(|k| PodBackend::Kubernetes(Box::new(k)))
        }
        KUBERNETES => None,
        other => {
            check.problem(
                "pod_backend",
                format!("{other:?} must be {KUBERNETES:?} or {PROCESS:?}"),
            );
            None
        }
    }
}

/// What runs vm jobs (`None`: off, or broken and reported); the opensandbox backend's
/// keys are converted only when the backend is `on`.
fn vm_backend_settings(
    check: &mut Check,
    kind: &str,
    on: bool,
    keys: section::Vm,
    process: ProcessSettings,
    (derivation, start_deadline): (&Derivation, Duration),
) -> Option<VmBackend> {
    use backend_kinds::{OPENSANDBOX, PROCESS};
    match kind {
        PROCESS => Some(VmBackend::Process(process)),
        OPENSANDBOX if on => opensandbox_settings(
            check,
            derivation.trust_domain.as_ref(),
            derivation.codec.as_ref(),
            keys,
            start_deadline,
        )
        .map(|o| VmBackend::OpenSandbox(Box::new(o))),
        OPENSANDBOX => None,
        other => {
            check.problem(
                "vm_backend",
                format!("{other:?} must be {OPENSANDBOX:?} or {PROCESS:?}"),
            );
            None
        }
    }
}

/// Which components run together, and that something can run at all.
fn check_components(
    check: &mut Check,
    components: &Components,
    pod_capacity: u32,
    vm_capacity: u32,
) {
    if components.0.is_empty() {
        check.problem("components", "at least one component is required");
    }
    if (components.contains(Component::PodWorker) || components.contains(Component::VmWorker))
        && !components.contains(Component::Scheduler)
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
}

/// The scheduler's pace, checked whether or not the scheduler runs.
fn check_scheduler_pace(check: &mut Check, keys: &section::Scheduler) {
    let section::Scheduler {
        heartbeat_interval,
        backlog_limit,
        fetch_pollers_max,
        fetch_interval,
    } = keys;
    if heartbeat_interval.0 < Duration::from_secs(1) {
        check.problem("heartbeat_interval", "must be at least 1s");
    }
    if *backlog_limit == Some(0) {
        check.problem("backlog_limit", "must be at least 1");
    }
    if *fetch_pollers_max == 0 {
        check.problem("fetch_pollers_max", "must be at least 1");
    }
    if fetch_interval.0 < MIN_FETCH_INTERVAL {
        check.problem("fetch_interval", "must be at least 100ms");
    }
}

/// The scheduler and its facade, when the scheduler runs: the URL executors dial
/// (required but in single-host mode) and the facade's SPIFFE ID (`local_id` when unset).
fn scheduler_settings(
    check: &mut Check,
    keys: section::Scheduler,
    facade: section::Facade,
    limits: FacadeLimits,
    single_host: bool,
    local_id: Option<String>,
) -> Option<SchedulerSettings> {
    let section::Scheduler {
        heartbeat_interval,
        backlog_limit,
        fetch_pollers_max,
        fetch_interval,
    } = keys;
    let section::Facade {
        runner_facade_listen,
        runner_facade_url,
        runner_facade_spiffe_id,
    } = facade;
    let url = match runner_facade_url {
        Some(u) => check
            .ok(
                "runner_facade_url",
                http_url(&u, &["https"])
                    .map(|_| u)
                    .map_err(|e| format!("{e}: executors reach the facade over SPIFFE mTLS only")),
            )
            .map(Some),
        // Executors on this host dial the listener the controller binds.
        None if single_host => Some(None),
        None => check.required(
            "runner_facade_url",
            None,
            "when the scheduler runs (the URL executors dial)",
        ),
    };
    let spiffe_id = check
        .required(
            "runner_facade_spiffe_id",
            runner_facade_spiffe_id.or(local_id),
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
    let (url, spiffe_id) = url.zip(spiffe_id)?;
    Some(SchedulerSettings {
        heartbeat_interval: heartbeat_interval.0,
        backlog_limit: backlog_limit.map(u64::from),
        fetch_pollers_max: count(fetch_pollers_max),
        fetch_interval: fetch_interval.0,
        facade: FacadeSettings {
            listen: runner_facade_listen
                .unwrap_or_else(|| listen_default(single_host, FACADE_PORT)),
            url,
            spiffe_id,
            limits,
        },
    })
}

/// Leader election, when `leader_election` is on (the lease duration is checked either way).
fn leader_settings(check: &mut Check, keys: section::Leader) -> Option<LeaderSettings> {
    let section::Leader {
        leader_election,
        lease_namespace,
        lease_name,
        leader_identity,
        lease_duration,
    } = keys;
    check.leader(
        leader_election,
        LeaderSettings {
            namespace: lease_namespace,
            name: lease_name,
            identity: leader_identity,
            lease_duration: lease_duration.0,
        },
    )
}

/// The executor deadlines, checked against what the official runner itself does.
fn executor_timings(check: &mut Check, timings: ExecutorTimings) -> ExecutorTimings {
    if timings.report_outage_tolerance < MIN_REPORT_OUTAGE_TOLERANCE {
        check.problem(
            "executor_report_outage_tolerance",
            "must be at least 10s: the official runner itself retries its final report for 10s (report_close_timeout), so less would hold nothing it does not",
        );
    }
    if timings.idle_timeout < Duration::from_secs(30) {
        check.problem(
            "executor_idle_timeout",
            "must be at least 30s: the official runner reports every 5s, and a slow report must not fail a job",
        );
    }
    timings
}

// === Facade limits and queue security (docs/security.md) ===

/// A count key as the `usize` its component counts with (saturating: a bound beyond the
/// address space is no bound).
fn count(n: u32) -> usize {
    usize::try_from(n).unwrap_or(usize::MAX)
}

/// The facade's limits, checked: every count at least 1, every timeout at its least.
fn facade_limit_settings(check: &mut Check, keys: section::FacadeLimits) -> FacadeLimits {
    let section::FacadeLimits {
        runner_facade_max_connections,
        runner_facade_max_connections_per_peer,
        runner_facade_max_connections_per_identity,
        runner_facade_max_connections_per_assignment,
        runner_facade_tls_handshake_timeout,
        runner_facade_header_read_timeout,
        runner_facade_idle_timeout,
        runner_facade_h2_ping_interval,
        runner_facade_h2_ping_timeout,
    } = keys;
    let limits = FacadeLimits {
        max_connections: count(runner_facade_max_connections),
        max_connections_per_peer: count(runner_facade_max_connections_per_peer),
        max_connections_per_identity: count(runner_facade_max_connections_per_identity),
        max_connections_per_assignment: count(runner_facade_max_connections_per_assignment),
        tls_handshake_timeout: runner_facade_tls_handshake_timeout.0,
        header_read_timeout: runner_facade_header_read_timeout.0,
        idle_timeout: runner_facade_idle_timeout.0,
        h2_ping_interval: runner_facade_h2_ping_interval.0,
        h2_ping_timeout: runner_facade_h2_ping_timeout.0,
    };
    for (key, n) in [
        ("runner_facade_max_connections", limits.max_connections),
        (
            "runner_facade_max_connections_per_peer",
            limits.max_connections_per_peer,
        ),
        (
            "runner_facade_max_connections_per_identity",
            limits.max_connections_per_identity,
        ),
        (
            "runner_facade_max_connections_per_assignment",
            limits.max_connections_per_assignment,
        ),
    ] {
        if n == 0 {
            check.problem(key, "must be at least 1");
        }
    }
    for (key, value, least) in [
        (
            "runner_facade_tls_handshake_timeout",
            limits.tls_handshake_timeout,
            Duration::from_secs(1),
        ),
        (
            "runner_facade_header_read_timeout",
            limits.header_read_timeout,
            Duration::from_secs(1),
        ),
        // The official runner reports every 5s; an idle bound below that would close
        // connections it is about to use.
        (
            "runner_facade_idle_timeout",
            limits.idle_timeout,
            Duration::from_secs(10),
        ),
        (
            "runner_facade_h2_ping_interval",
            limits.h2_ping_interval,
            Duration::from_secs(1),
        ),
        (
            "runner_facade_h2_ping_timeout",
            limits.h2_ping_timeout,
            Duration::from_secs(1),
        ),
    ] {
        if value < least {
            check.problem(
                key,
                format!(
                    "must be at least {}",
                    humantime_serde::re::humantime::format_duration(least)
                ),
            );
        }
    }
    limits
}

/// The queue's trust rules, checked: lifetimes of at least a minute, a usable bucket name.
fn queue_security(check: &mut Check, keys: section::QueueSecurity) -> QueueSecurity {
    let section::QueueSecurity {
        accept_plaintext_envelopes,
        accept_undated_envelopes,
        gitea_endless_task_timeout,
        nats_finished_bucket,
        held_assignment_timeout,
    } = keys;
    let security = QueueSecurity {
        accept_plaintext_envelopes,
        accept_undated_envelopes,
        task_lifetime: gitea_endless_task_timeout.0,
        finished_bucket: nats_finished_bucket,
        held_timeout: held_assignment_timeout.0,
    };
    if security.task_lifetime < Duration::from_secs(60) {
        check.problem(
            "gitea_endless_task_timeout",
            "must be at least 1m (Gitea's default ENDLESS_TASK_TIMEOUT is 3h)",
        );
    }
    if security.held_timeout < Duration::from_secs(60) {
        check.problem("held_assignment_timeout", "must be at least 1m");
    }
    let bucket = &security.finished_bucket;
    if bucket.is_empty()
        || !bucket
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    {
        check.problem(
            "nats_finished_bucket",
            format!("{bucket:?} must be a key-value bucket name: letters, digits, '_' and '-'"),
        );
    }
    security
}

/// The VM backend's settings, or `None` with every problem recorded (`trust_domain` and
/// `codec` are `None` when their own keys are broken, already reported). A warm sandbox
/// (`vm_warm_pool`) may take `start_deadline` (`executor_start_deadline`) to run.
fn opensandbox_settings(
    check: &mut Check,
    trust_domain: Option<&TrustDomain>,
    codec: Option<&MetadataCodec>,
    keys: section::Vm,
    start_deadline: Duration,
) -> Option<OpenSandboxSettings> {
    const WHY: &str = "with the opensandbox vm backend";
    let section::Vm {
        opensandbox_api: api,
        opensandbox_api_key_file: api_key_file,
        opensandbox_pool: pool,
        opensandbox_ca_file: ca_file,
        opensandbox_request_timeout: Secs(request_timeout),
        opensandbox_create_timeout: Secs(create_timeout),
        vm_entrypoint: List(entrypoint),
        vm_executor_env: List(executor_env),
        vm_timeout_seconds: timeout_seconds,
        vm_renew_before: Secs(renew_before),
        vm_terminal_grace: Secs(terminal_grace),
        vm_warm_pool: warm_pool,
    } = keys;
    let api = check
        .required("opensandbox_api", api, WHY)
        .and_then(|api| check.ok("opensandbox_api", http_url(&api, &["http", "https"])));
    let api_key_file = check.required("opensandbox_api_key_file", api_key_file, WHY);
    if pool.is_empty() || pool.contains(|c: char| c.is_whitespace() || c == '/') {
        check.problem(
            "opensandbox_pool",
            format!("{pool:?} must be a non-empty pool name without spaces or '/'"),
        );
    }
    for (key, timeout) in [
        ("opensandbox_request_timeout", request_timeout),
        ("opensandbox_create_timeout", create_timeout),
    ] {
        if timeout < Duration::from_secs(1) {
            check.problem(key, "must be at least 1s");
        }
    }
    if entrypoint.first().is_none_or(|program| program.is_empty()) {
        check.problem(
            "vm_entrypoint",
            "must name the program to run (a path inside the pool's image)",
        );
    }
    let env = vm_executor_env(check, executor_env);
    let timeout = Duration::from_secs(timeout_seconds);
    if timeout < MIN_SANDBOX_TIMEOUT {
        check.problem(
            "vm_timeout_seconds",
            format!(
                "{timeout_seconds} is below OpenSandbox's minimum of {}",
                MIN_SANDBOX_TIMEOUT.as_secs()
            ),
        );
    }
    if renew_before.is_zero() || renew_before >= timeout {
        check.problem(
            "vm_renew_before",
            "must be above 0 and below vm_timeout_seconds (a renewal extends the expiry by vm_timeout_seconds)",
        );
    }
    let api = gdr_backends::opensandbox::ClientSettings {
        base_url: api?,
        request_timeout,
        create_timeout,
    };
    let mut backend = gdr_backends::opensandbox::OpenSandboxSettings::new(
        api,
        pool,
        codec?.clone(),
        trust_domain?.clone(),
    );
    backend.entrypoint = entrypoint;
    backend.extra_env = env;
    backend.timeout = timeout;
    backend.renew_before = renew_before;
    backend.warm_pool = warm_pool;
    backend.warm_start_deadline = start_deadline;
    Some(OpenSandboxSettings {
        backend,
        api_key_file: api_key_file?,
        ca_file,
        terminal_grace,
    })
}

/// `vm_executor_env`: `NAME=value` items, each name a variable name the assignment does not
/// set, given once.
fn vm_executor_env(check: &mut Check, items: Vec<String>) -> BTreeMap<String, String> {
    let mut env = BTreeMap::new();
    for item in items {
        let Some((name, value)) = item.split_once('=') else {
            check.problem("vm_executor_env", format!("{item:?} must be NAME=value"));
            continue;
        };
        let valid = name.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !valid {
            check.problem(
                "vm_executor_env",
                format!("{name:?} is not an environment variable name"),
            );
        } else if gdr_core::executor::env::ASSIGNMENT.contains(&name) {
            check.problem(
                "vm_executor_env",
                format!("{name} comes from the assignment and cannot be configured"),
            );
        } else if name == gdr_core::executor::env::STANDBY_ID {
            // It would put every job's executor in standby, waiting for a claim.
            check.problem(
                "vm_executor_env",
                format!("{name} names a warm sandbox (vm_warm_pool) and cannot be configured"),
            );
        } else if env.insert(name.to_owned(), value.to_owned()).is_some() {
            check.problem("vm_executor_env", format!("{name} is given twice"));
        }
    }
    env
}

/// What the Gitea settings are loaded for: the hints differ.
#[derive(Clone, Copy)]
enum Purpose {
    Run,
    Register,
}

/// How to reach Gitea; `state_defaults`: single-host mode's `state_dir`, where unset
/// credential files default to.
fn gitea_settings(
    check: &mut Check,
    purpose: Purpose,
    keys: section::Gitea,
    registration: section::Registration,
    state_defaults: Option<PathBuf>,
) -> Option<GiteaSettings> {
    let (url_why, file_why) = match purpose {
        Purpose::Run => (
            "(the Gitea base URL; `controller --gitea-url`)",
            "(run `register` first)",
        ),
        Purpose::Register => (
            "to register (the Gitea base URL)",
            "to register (where the runner's credential is written)",
        ),
    };
    let section::Gitea {
        gitea_instance_url: url,
        gitea_runner_uuid_file: uuid_file,
        gitea_runner_token_file: token_file,
        gitea_ca_file: ca_file,
        gitea_request_timeout: Secs(request_timeout),
        gitea_fetch_timeout: Secs(fetch_timeout),
    } = keys;
    let section::Registration {
        gitea_runner_registration_token_file: registration_token_file,
    } = registration;
    let url = check
        .required("gitea_instance_url", url, url_why)
        .and_then(|u| check.ok("gitea_instance_url", http_url(&u, &["http", "https"])));
    let in_state = |name: &str| state_defaults.as_ref().map(|dir| dir.join(name));
    let uuid_file = uuid_file.or_else(|| in_state(state_files::RUNNER_UUID));
    let token_file = token_file.or_else(|| in_state(state_files::RUNNER_TOKEN));
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
        registration_token_file,
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
    /// Labels of the enabled backends, `self-hosted` first, then the Pod profiles' labels.
    pub labels: Vec<String>,
}

impl RegisterSettings {
    /// Loads the layers and checks only what registration needs.
    pub fn load(sources: &Sources) -> Result<Self, SettingsError> {
        let Sections {
            components: section::ComponentSet { components },
            gitea,
            runner,
            backends:
                section::Backends {
                    pod_capacity,
                    vm_capacity,
                    vm_runner_label,
                },
            nats,
            host,
            pod,
            registration,
            ..
        } = sources.load()?.into();
        let mut check = Check::default();
        // Where the controller looks for its credential in single-host mode.
        let state_defaults = nats
            .nats_url
            .is_none()
            .then(|| check.state_dir(host.state_dir));
        let gitea = gitea_settings(
            &mut check,
            Purpose::Register,
            gitea,
            registration,
            state_defaults,
        );
        let labels = check.ok("vm_runner_label", BackendLabels::new(vm_runner_label));
        // The labels the Pod profiles add, as the controller declares them.
        let pods_on = components.contains(Component::PodWorker) && pod_capacity > 0;
        let kubernetes = host
            .pod_backend
            .as_deref()
            .unwrap_or_else(|| default_pod_backend(nats.nats_url.is_none()))
            == backend_kinds::KUBERNETES;
        let mut profile_labels = Vec::new();
        if let (Some(l), true) = (&labels, pods_on && kubernetes) {
            for label in pod.pod_profiles.0.keys() {
                match pod::profile_label(l, label) {
                    Ok(()) => profile_labels.push(label.clone()),
                    Err(why) => check.problem("pod_profiles", format!("{label:?}: {why}")),
                }
            }
        }
        match (gitea, labels) {
            (Some(gitea), Some(labels)) if check.problems.is_empty() => {
                let enabled = [
                    (Backend::Pod, Component::PodWorker, pod_capacity),
                    (Backend::Vm, Component::VmWorker, vm_capacity),
                ]
                .into_iter()
                .filter(|(_, c, n)| components.contains(*c) && *n > 0)
                .map(|(b, _, _)| b);
                let mut labels = declared_labels(&labels, enabled);
                labels.extend(profile_labels);
                Ok(RegisterSettings {
                    gitea,
                    runner: runner.into(),
                    labels,
                })
            }
            _ => Err(SettingsError::Invalid(check.problems)),
        }
    }
}

// === sandbox-identity ===

/// What `sandbox-identity` runs with: only the keys of the sandbox cluster (no Gitea, NATS,
/// OpenSandbox or secret-store credential).
#[derive(Debug, Clone)]
pub struct SandboxIdentitySettings {
    /// The reconciler.
    pub reconciler: gdr_sandbox_identity::Settings,
    /// Listen address of `/healthz`, `/readyz`, `/metrics`.
    pub health_listen: String,
    /// Leader election; present when enabled.
    pub leader: Option<LeaderSettings>,
}

impl SandboxIdentitySettings {
    /// Loads the layers and checks only what `sandbox-identity` needs.
    pub fn load(sources: &Sources) -> Result<Self, SettingsError> {
        let Sections {
            policy,
            host,
            leader,
            sandbox_identity,
            ..
        } = sources.load()?.into();
        let section::SandboxIdentity {
            spire_cluster_name,
            spire_class_name,
            opensandbox_namespace: namespace,
            runner_uid,
            sandbox_identity_resync: Secs(resync),
            sandbox_identity_lease_name,
        } = sandbox_identity;
        let mut check = Check::default();
        let trust_domain = check.trust_domain(policy.trust_domain);
        let codec = check.ok(
            "metadata_prefix",
            MetadataCodec::new(policy.metadata_prefix),
        );
        if !is_dns_label(&namespace) {
            check.problem(
                "opensandbox_namespace",
                format!("{namespace:?} is not a Kubernetes namespace name"),
            );
        }
        for (key, value) in [
            ("spire_cluster_name", &spire_cluster_name),
            ("spire_class_name", &spire_class_name),
        ] {
            if value.is_empty() || value.contains(|c: char| c.is_whitespace() || c == '/') {
                check.problem(
                    key,
                    format!("{value:?} must be non-empty without spaces or '/'"),
                );
            }
        }
        if resync < Duration::from_secs(1) {
            check.problem("sandbox_identity_resync", "must be at least 1s");
        }
        let leader = check.leader(
            leader.leader_election,
            LeaderSettings {
                namespace: leader.lease_namespace,
                name: sandbox_identity_lease_name,
                identity: leader.leader_identity,
                lease_duration: leader.lease_duration.0,
            },
        );
        match (trust_domain, codec) {
            (Some(trust_domain), Some(codec)) if check.problems.is_empty() => {
                Ok(SandboxIdentitySettings {
                    reconciler: gdr_sandbox_identity::Settings {
                        namespace,
                        trust_domain,
                        cluster: spire_cluster_name,
                        class_name: spire_class_name,
                        runner_uid,
                        codec,
                        resync,
                    },
                    health_listen: host
                        .health_listen
                        .unwrap_or_else(|| listen_default(false, HEALTH_PORT)),
                    leader,
                })
            }
            _ => Err(SettingsError::Invalid(check.problems)),
        }
    }
}

/// A Kubernetes namespace name (an RFC 1123 label).
fn is_dns_label(name: &str) -> bool {
    (1..=63).contains(&name.len())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !name.starts_with('-')
        && !name.ends_with('-')
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
    let plaintext = writes_plaintext_envelopes(&raw);
    // A wrong spelling is reported by the conversion below; check with the default then.
    let permissions = raw
        .secret_file_permissions
        .parse::<SecretPermissions>()
        .unwrap_or_default();
    let mut problems = match Settings::try_from(raw) {
        Ok(_) => Vec::new(),
        Err(SettingsError::Invalid(problems)) => problems.iter().map(ToString::to_string).collect(),
        Err(e) => vec![e.to_string()],
    };
    for (key, path) in secret_files {
        if let Err(e) = read_secret_file_with(key, &path, permissions) {
            problems.push(e.to_string());
        }
    }
    if plaintext {
        problems.push(
            Problem::new(
                "task_encryption_key_file",
                "is not set: the scheduler would publish plaintext v1 envelopes, and job secrets would be readable by anyone who can read the stream; configure a key file (64 hex digits or base64 of 32 bytes) for envelope v2",
            )
            .to_string(),
        );
    }
    if sources.environment {
        for (plain, file) in plain_secret_variables() {
            if std::env::var_os(&plain).is_some() {
                problems.push(format!(
                    "{plain} is set but ignored: secrets are read only from files ({file})"
                ));
            }
        }
    }
    Ok(Checked { rendered, problems })
}

/// The environment variables an operator might set to give a secret as a plain value,
/// each with the variable of the file that holds it instead: derived from the key table's
/// secret marks, so a new secret key is warned about without a second list to keep.
/// `X_FILE` → `X`; `X_KEY_FILES` → `X_KEYS`.
fn plain_secret_variables() -> Vec<(String, String)> {
    KEYS.iter()
        .filter(|k| k.secret)
        .filter_map(|k| {
            let file = k.env();
            let plain = match file.strip_suffix("_FILES") {
                Some(stem) => format!("{stem}S"),
                None => file.strip_suffix("_FILE")?.to_owned(),
            };
            Some((plain, file))
        })
        .collect()
}

/// Whether the scheduler would write plaintext v1 envelopes: it runs, NATS is external
/// (single-host mode generates a key) and no task key is configured.
fn writes_plaintext_envelopes(raw: &Raw) -> bool {
    raw.components.contains(Component::Scheduler)
        && raw.nats_url.is_some()
        && raw.task_encryption_key_file.is_none()
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
            Some(other) => out.push_str(&format!("{} = {}\n", key.name, inline_toml(other))),
        }
    }
    out
}

/// A value as TOML writes it inline (`{ large = { limits = { memory = "4Gi" } } }`).
fn inline_toml(value: &serde_json::Value) -> String {
    match value {
        serde_json::Value::Object(map) if map.is_empty() => "{}".into(),
        serde_json::Value::Object(map) => {
            let fields: Vec<String> = map
                .iter()
                .map(|(k, v)| {
                    let bare = !k.is_empty()
                        && k.bytes()
                            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-'));
                    if bare {
                        format!("{k} = {}", inline_toml(v))
                    } else {
                        format!("{k:?} = {}", inline_toml(v))
                    }
                })
                .collect();
            format!("{{ {} }}", fields.join(", "))
        }
        serde_json::Value::Array(items) => format!(
            "[{}]",
            items.iter().map(inline_toml).collect::<Vec<_>>().join(", ")
        ),
        serde_json::Value::String(s) => format!("{s:?}"),
        other => other.to_string(),
    }
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
