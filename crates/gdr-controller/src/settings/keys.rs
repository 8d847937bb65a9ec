//! Every configuration key, declared once: its field in [`Raw`], its default, its
//! documentation and its type. The environment variable is the key in upper case (the Go
//! version's names). `--help`, `check-config --reference` (text, markdown, nix, json), the
//! README table and the NixOS module's options are all generated from [`KEYS`].

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::values::{Components, List, Secs};

/// What kind of value a key takes, for the references (and the NixOS option types).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A string.
    Str,
    /// A file system path.
    Path,
    /// A non-negative integer.
    Int,
    /// `true` or `false`.
    Bool,
    /// A duration: `90s`, `5m`, `1h30m`, or plain seconds.
    Duration,
    /// A list: a TOML array or a comma-separated string.
    List,
}

impl Kind {
    /// How the reference names the kind.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Str => "string",
            Kind::Path => "path",
            Kind::Int => "integer",
            Kind::Bool => "boolean",
            Kind::Duration => "duration",
            Kind::List => "list",
        }
    }
}

/// The kind of a key's Rust type.
pub trait KeyType {
    /// The kind.
    const KIND: Kind;
}

macro_rules! key_type {
    ($($ty:ty => $kind:ident),* $(,)?) => {
        $(impl KeyType for $ty { const KIND: Kind = Kind::$kind; })*
    };
}
key_type!(String => Str, PathBuf => Path, u32 => Int, u64 => Int, bool => Bool,
    Secs => Duration, List => List, Components => List);

impl<T: KeyType> KeyType for Option<T> {
    const KIND: Kind = T::KIND;
}

/// One documented key.
#[derive(Debug, Clone, Copy)]
pub struct Key {
    /// Key in the TOML file (and `--set`); the environment variable is its upper case.
    pub name: &'static str,
    /// What it does (Markdown: `code` spans only).
    pub doc: &'static str,
    /// The default when it is not simply the serialised default value (computed defaults).
    pub shown: Option<&'static str>,
    /// Its type.
    pub kind: Kind,
    /// Whether it names a file holding a secret.
    pub secret: bool,
}

impl Key {
    /// The environment variable that sets this key.
    pub fn env(&self) -> String {
        self.name.to_ascii_uppercase()
    }
}

macro_rules! keys {
    ($(
        $(#[doc = $doc:literal])+
        $name:ident: $ty:ty = $default:expr $(, shown $shown:literal)? $(=> $secret:ident)?;
    )*) => {
        /// Every key as the file, the environment and `--set` give it, before validation.
        #[derive(Clone, Serialize, Deserialize)]
        #[serde(deny_unknown_fields, default)]
        pub(crate) struct Raw {
            $(pub(crate) $name: $ty,)*
        }

        impl Default for Raw {
            fn default() -> Self {
                Raw { $($name: $default,)* }
            }
        }

        /// The configuration reference, in declaration order.
        pub const KEYS: &[Key] = &[$(Key {
            name: stringify!($name),
            doc: concat!($($doc),+),
            shown: keys!(@shown $($shown)?),
            kind: <$ty as KeyType>::KIND,
            secret: keys!(@secret $($secret)?),
        },)*];
    };
    (@shown $shown:literal) => { Some($shown) };
    (@shown) => { None };
    (@secret secret) => { true };
    (@secret) => { false };
}

keys! {
    /// Components this process runs (comma-separated, or `all`): `scheduler` (FetchTask
    /// pollers, heartbeats and the facade), `pod-worker`, `vm-worker`. A worker without the
    /// scheduler is refused: executors reach the facade of the replica that holds their
    /// assignment.
    components: Components = Components::all(), shown "scheduler,pod-worker,vm-worker";
    /// Base URL of the Gitea instance (http or https); the runner API lives under
    /// `<url>/api/actions`.
    gitea_instance_url: Option<String> = None;
    /// File holding the controller's runner UUID (written by `register`).
    gitea_runner_uuid_file: Option<PathBuf> = None => secret;
    /// File holding the controller's runner token (written by `register`, mode 0600).
    gitea_runner_token_file: Option<PathBuf> = None => secret;
    /// PEM bundle of extra CAs trusted for an https Gitea (the system roots are always
    /// trusted).
    gitea_ca_file: Option<PathBuf> = None;
    /// Timeout of each RPC to Gitea (Register, Declare, UpdateTask, UpdateLog).
    gitea_request_timeout: Secs = Secs::from_secs(60);
    /// Timeout of each FetchTask poll (1ms to 60s).
    gitea_fetch_timeout: Secs = Secs::from_secs(5);
    /// Name the controller registers under in Gitea.
    runner_name: String = "gitea-dynamic-runner".into();
    /// Capabilities declared to Gitea; must match what the one-shot official runner
    /// supports (`cancelling` needs runner >= 2.0).
    runner_capabilities: List = List::of(&["cancelling"]);
    /// Concurrent Pod executors. 0 disables the pod backend.
    pod_capacity: u32 = 4;
    /// Concurrent VM executors. 0 disables the vm backend.
    vm_capacity: u32 = 1;
    /// The runs-on label that selects the VM backend besides `vm` itself (`vm-dev` takes
    /// only test jobs while a backend is repaired).
    vm_runner_label: String = "vm".into();
    /// SPIFFE trust domain of job identities
    /// (`spiffe://<trust_domain>/ci/<owner>/<repo>/<job>`). The Go version defaulted to
    /// `ddupan.top`.
    trust_domain: Option<String> = None;
    /// Prefix of executor labels, annotations and metadata keys; keep it to take over a
    /// Go deployment.
    metadata_prefix: String = gdr_core::metadata::DEFAULT_PREFIX.into();
    /// File holding the >= 32-byte key that derives assignment capabilities
    /// (HMAC-SHA256); whitespace around it is trimmed.
    runner_facade_capability_key_file: Option<PathBuf> = None => secret;
    /// File holding the AES-256 key (64 hex characters or base64 of 32 bytes) that
    /// encrypts tasks in the stream (envelope v2). Unset: tasks are stored as v1, readable
    /// by anyone who can read the stream.
    task_encryption_key_file: Option<PathBuf> = None => secret;
    /// Older task keys still accepted for decryption during a rotation (comma-separated
    /// paths).
    task_encryption_previous_key_files: List = List::default() => secret;
    /// NATS server URL(s), comma-separated. Unset: single-host mode with an embedded,
    /// supervised nats-server whose store lives under `state_dir`.
    nats_url: Option<String> = None;
    /// NATS user of the scheduler's (publishing) connection.
    nats_producer_user: String = "ci-producer".into();
    /// File holding the producer's NATS password.
    nats_producer_password_file: Option<PathBuf> = None => secret;
    /// NATS .creds file for the producer (instead of user and password).
    nats_producer_creds_file: Option<PathBuf> = None => secret;
    /// NATS user of the workers' (consuming) connection.
    nats_worker_user: String = "ci-worker".into();
    /// File holding the worker's NATS password.
    nats_worker_password_file: Option<PathBuf> = None => secret;
    /// NATS .creds file for the workers (instead of user and password).
    nats_worker_creds_file: Option<PathBuf> = None => secret;
    /// PEM CA bundle for a `tls://` NATS server.
    nats_ca_file: Option<PathBuf> = None;
    /// JetStream stream holding assignments.
    nats_stream: String = "CI_RUNNER".into();
    /// Subject base; assignments go to `<base>.pod` and `<base>.vm`.
    nats_subject_base: String = "ci.runner".into();
    /// Create or update the stream and consumers at start; turn off where operators
    /// provision them.
    nats_create_stream: bool = true;
    /// JetStream ack wait of the worker consumers: an assignment a dead controller held is
    /// redelivered after this.
    nats_ack_wait: Secs = Secs::from_secs(60);
    /// Interval of the task-ID-only UpdateTask heartbeats that keep queued tasks alive in
    /// Gitea (at least 1s; keep it well below Gitea's 10 minute zombie timeout).
    heartbeat_interval: Secs = Secs::from_secs(60);
    /// Stop fetching while this many assignments wait unclaimed in the stream.
    backlog_limit: Option<u32> = None, shown "the sum of the enabled capacities";
    /// Most concurrent FetchTask pollers (at least 1); there are as many as the enabled
    /// capacity up to this bound. Gitea serialises task picks per instance
    /// (`MAX_CONCURRENT_TASK_PICKS`, default 16), so more only cost. While Gitea has
    /// nothing, one poller calls FetchTask every 2s and the others wait, whatever the
    /// bound.
    fetch_pollers_max: u32 = 8;
    /// Listen address of the RunnerService facade (SPIFFE mTLS).
    runner_facade_listen: Option<String> = None,
        shown "127.0.0.1:8443 without nats_url (single host), else 0.0.0.0:8443";
    /// URL executors use to reach the facade (https only).
    runner_facade_url: Option<String> = None;
    /// The facade's SPIFFE ID, which executors verify exactly.
    runner_facade_spiffe_id: Option<String> = None;
    /// SPIFFE Workload API socket of the controller, e.g.
    /// `unix:///run/spire/agent-sockets/spire-agent.sock` (not needed with `local_identity`).
    spiffe_endpoint_socket: Option<String> = None;
    /// Listen address of `/healthz`, `/readyz` and `/metrics`.
    health_listen: Option<String> = None,
        shown "127.0.0.1:9090 without nats_url (single host), else 0.0.0.0:9090";
    /// Directory for local state: the embedded NATS store, the local CA and process
    /// executors.
    state_dir: PathBuf = PathBuf::from("/var/lib/gitea-dynamic-runner");
    /// What runs pod jobs: `kubernetes` (Pods) or `process` (local child processes, single
    /// host).
    pod_backend: Option<String> = None, shown "process without nats_url, else kubernetes";
    /// What runs vm jobs: `opensandbox` (Kata VMs) or `process` (local child processes,
    /// single host).
    vm_backend: Option<String> = None, shown "process without nats_url, else opensandbox";
    /// Serve SPIFFE identities from a CA under `state_dir` instead of SPIRE (required by the
    /// process backend).
    local_identity: Option<bool> = None, shown "true without nats_url, else false";
    /// Program the process backend starts (with argument `executor`).
    executor_program: Option<PathBuf> = None, shown "this binary";
    /// The official runner binary executors run as `daemon --once`.
    runner_binary: PathBuf = PathBuf::from("gitea-runner");
    /// An executor whose runner has not claimed its task this long after the executor was
    /// created is failed (counted from its creation, across controller restarts).
    executor_start_deadline: Secs = Secs::from_secs(600);
    /// A claimed executor the facade has not heard from for this long is failed in Gitea
    /// (its runner died while its environment stayed up). The official runner reports
    /// every 5s.
    executor_idle_timeout: Secs = Secs::from_secs(300);
    /// nats-server binary of the embedded single-host mode (used when `nats_url` is unset).
    nats_server_binary: PathBuf = PathBuf::from("nats-server");
    /// Campaign for a Kubernetes Lease; only the leader works, standbys report not ready.
    leader_election: bool = false;
    /// Namespace of the leader Lease.
    lease_namespace: String = "gitea-actions".into();
    /// Name of the leader Lease.
    lease_name: String = "gitea-dynamic-runner".into();
    /// This replica's identity in the Lease.
    leader_identity: Option<String> = None, shown "$HOSTNAME";
    /// How long a Lease holds without renewal; a standby takes over about this long after
    /// the leader dies (renewals every duration/7, given up after 2/3 of it).
    lease_duration: Secs = Secs::from_secs(15);
    /// Namespace of executor Pods.
    pod_namespace: String = "gitea-actions".into();
    /// Executor image (required for the kubernetes pod backend).
    pod_executor_image: Option<String> = None;
    /// Service account of executor Pods.
    pod_service_account: String = "gitea-task-executor".into();
    /// UID the executor runs as (also the SPIRE `unix:uid` selector).
    pod_executor_uid: u32 = 2000;
    /// SPIRE k8s_psat cluster name of the Pod cluster.
    spire_cluster: String = "homelab".into();
    /// `className` of ClusterStaticEntries (must match the SPIRE controller manager).
    spire_class: String = "spire-mgmt-spire".into();
    /// Parent SPIFFE ID of Pod entries.
    spire_agent_id: Option<String> = None;
    /// OpenSandbox Lifecycle API base URL (required for the opensandbox vm backend).
    opensandbox_api: Option<String> = None;
    /// File holding the OpenSandbox API key (required for the opensandbox vm backend).
    opensandbox_api_key_file: Option<PathBuf> = None => secret;
    /// OpenSandbox pool (`extensions.poolRef`) of VM executors.
    opensandbox_pool: String = "ci-vm".into();
    /// Lifetime of a VM sandbox in seconds.
    vm_timeout_seconds: u64 = 14_400;
}
