//! Every configuration key, declared once: its field in [`Raw`], its default, its
//! documentation and its type. The environment variable is the key in upper case (the Go
//! version's names). `--help`, `check-config --reference` (text, markdown, nix, json), the
//! README table and the NixOS module's options are all generated from [`KEYS`]. Keys come
//! in sections (`section gitea: Gitea;` opens one, up to the next): [`Sections`] holds
//! [`Raw`] split by them, and each section converts into its component's settings.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use gdr_backends::defaults::{
    executor as executor_default, kubernetes as pod_default, opensandbox as vm_default,
};
use gdr_sandbox_identity::defaults as sandbox_identity_default;

use super::values::{Components, List, Secs, Table};

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
    /// A table: TOML tables (`[key.<name>]`), or `{name = value, …}` in the environment.
    Table,
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
            Kind::Table => "table",
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
    Secs => Duration, List => List, Components => List, Table => Table);

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
        section $section:ident: $Section:ident;
        $(
            $(#[doc = $doc:literal])+
            $name:ident: $ty:ty = $default:expr $(, shown $shown:expr)? $(=> $secret:ident)?;
        )*
    )*) => {
        /// Every key as the file, the environment and `--set` give it, before validation.
        #[derive(Clone, Serialize, Deserialize)]
        #[serde(deny_unknown_fields, default)]
        pub(crate) struct Raw {
            $($(pub(crate) $name: $ty,)*)*
        }

        impl Default for Raw {
            fn default() -> Self {
                Raw { $($($name: $default,)*)* }
            }
        }

        /// The configuration reference, in declaration order.
        pub const KEYS: &[Key] = &[$($(Key {
            name: stringify!($name),
            doc: concat!($($doc),+),
            shown: keys!(@shown $($shown)?),
            kind: <$ty as KeyType>::KIND,
            secret: keys!(@secret $($secret)?),
        },)*)*];

        /// The keys of each section, as [`Raw`] holds them: what one section's conversion
        /// takes (its function destructures them, so a key it does not read is a compile
        /// error).
        pub(crate) mod section {
            // Without the `kubernetes` feature nothing reads the Pod section.
            #![cfg_attr(not(feature = "kubernetes"), allow(dead_code))]
            #[allow(clippy::wildcard_imports)]
            use super::*;

            $(
                #[doc = concat!("The keys of section `", stringify!($section), "`.")]
                pub(crate) struct $Section {
                    $($(#[doc = $doc])+ pub(crate) $name: $ty,)*
                }
            )*
        }

        /// [`Raw`] by section, in declaration order.
        pub(crate) struct Sections {
            $(
                #[doc = concat!("Section `", stringify!($section), "`.")]
                pub(crate) $section: section::$Section,
            )*
        }

        impl From<Raw> for Sections {
            fn from(raw: Raw) -> Self {
                let Raw { $($($name,)*)* } = raw;
                Sections { $($section: section::$Section { $($name,)* },)* }
            }
        }
    };
    (@shown $shown:expr) => { Some($shown) };
    (@shown) => { None };
    (@secret secret) => { true };
    (@secret) => { false };
}

keys! {
    section components: ComponentSet;
    /// Components this process runs (comma-separated, or `all`): `scheduler` (FetchTask
    /// pollers, heartbeats and the facade), `pod-worker`, `vm-worker`. A worker without the
    /// scheduler is refused: executors reach the facade of the replica that holds their
    /// assignment.
    components: Components = Components::all();
    section gitea: Gitea;
    /// Base URL of the Gitea instance (http or https); the runner API lives under
    /// `<url>/api/actions`.
    gitea_instance_url: Option<String> = None;
    /// File holding the controller's runner UUID (written by `register`, or by the
    /// controller's first start with `gitea_runner_registration_token_file`).
    gitea_runner_uuid_file: Option<PathBuf> = None,
        shown concat!("<state_dir>/", runner_uuid_file!(), " without nats_url, else required");
    /// File holding the controller's runner token (written by `register`, or by the
    /// controller's first start with `gitea_runner_registration_token_file`; mode 0600).
    gitea_runner_token_file: Option<PathBuf> = None,
        shown concat!("<state_dir>/", runner_token_file!(), " without nats_url, else required")
        => secret;
    /// PEM bundle of extra CAs trusted for an https Gitea (the system roots are always
    /// trusted).
    gitea_ca_file: Option<PathBuf> = None;
    /// Timeout of each RPC to Gitea (Register, Declare, UpdateTask, UpdateLog).
    gitea_request_timeout: Secs = Secs::from_secs(60);
    /// Timeout of each FetchTask poll (1ms to 60s).
    gitea_fetch_timeout: Secs = Secs::from_secs(5);
    section runner: Runner;
    /// Name the controller registers under in Gitea.
    runner_name: String = "gitea-dynamic-runner".into();
    /// Capabilities declared to Gitea; must match what the one-shot official runner
    /// supports (`cancelling` needs runner >= 2.0).
    runner_capabilities: List = List::of(&["cancelling"]);
    section backends: Backends;
    /// Concurrent Pod executors. 0 disables the pod backend.
    pod_capacity: u32 = 4;
    /// Concurrent VM executors. 0 disables the vm backend.
    vm_capacity: u32 = 1;
    /// The runs-on label that selects the VM backend besides `vm` itself (`vm-dev` takes
    /// only test jobs while a backend is repaired).
    vm_runner_label: String = "vm".into();
    section policy: Policy;
    /// SPIFFE trust domain of job identities (`spiffe://<trust_domain>/ci/…`, see
    /// `spiffe_id_scheme`). The Go version defaulted to `ddupan.top`.
    trust_domain: Option<String> = None,
        shown concat!(local_trust_domain!(), " with local_identity, else required");
    /// How job SPIFFE IDs are formed. `ref`:
    /// `spiffe://<trust_domain>/ci/<owner>/<repo>/<ref kind>/<ref name>/<job>`, the ref
    /// kind `branch`, `tag`, `pull` (named by the pull request's number,
    /// `pull_request_target` runs included) or `ref` (any other ref), so a pull request's or
    /// an unprotected branch's job never has the identity of `main`'s job of the same name;
    /// a task without a `ref` is failed. `job`:
    /// `spiffe://<trust_domain>/ci/<owner>/<repo>/<job>`, as the Go version formed them and
    /// weaker: whoever writes a workflow, in a pull request or on any branch, can give a
    /// job the identity of any job key of the repository. Keep `job` only to take over a Go
    /// deployment (its queued assignments, executors and SPIRE entries carry such IDs).
    /// Assignments queued under the other scheme are refused as tampered: drain the queue
    /// before changing it; running executors keep their identity.
    spiffe_id_scheme: String = "ref".into();
    /// Prefix of executor labels, annotations and metadata keys; keep it to take over a
    /// Go deployment.
    metadata_prefix: String = gdr_core::metadata::DEFAULT_PREFIX.into();
    section key_files: KeyFiles;
    /// File holding the >= 32-byte key that derives assignment capabilities
    /// (HMAC-SHA256); whitespace around it is trimmed. Unset in single-host mode: a key is
    /// generated as `<state_dir>/capability-key` (mode 0600) on first start and reused.
    runner_facade_capability_key_file: Option<PathBuf> = None,
        shown "generated under state_dir without nats_url, else required" => secret;
    /// File holding the AES-256 key (64 hex characters or base64 of 32 bytes) that
    /// encrypts tasks in the stream (envelope v2). Unset in single-host mode: a key is
    /// generated as `<state_dir>/task-encryption.key` (mode 0600) on first start. Unset
    /// with `nats_url`: tasks are stored as plaintext v1, readable by anyone who can read
    /// the stream (`check-config` reports it, the controller warns at start).
    task_encryption_key_file: Option<PathBuf> = None,
        shown "generated under state_dir without nats_url, else unset" => secret;
    /// Older task keys still accepted for decryption during a rotation (comma-separated
    /// paths).
    task_encryption_previous_key_files: List = List::default() => secret;
    section nats: Nats;
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
    section scheduler: Scheduler;
    /// Interval of the task-ID-only UpdateTask heartbeats that keep queued tasks alive in
    /// Gitea (at least 1s; keep it well below Gitea's 10 minute zombie timeout).
    heartbeat_interval: Secs = Secs::from_secs(60);
    /// Stop fetching a backend's jobs while this many of its assignments wait unclaimed on
    /// its subject (each backend is counted alone, so a full or dead one never stops the
    /// other).
    backlog_limit: Option<u32> = None, shown "the backend's capacity";
    /// Most concurrent FetchTask pollers (at least 1); there are as many as the enabled
    /// capacity up to this bound. Gitea serialises task picks per instance
    /// (`MAX_CONCURRENT_TASK_PICKS`, default 16), so more only cost. While Gitea has
    /// nothing, one poller calls FetchTask every `fetch_interval` and the others wait,
    /// whatever the bound.
    fetch_pollers_max: u32 = 8;
    /// While Gitea has no job for this controller, one FetchTask per this interval, as the
    /// official runner's `fetch_interval` (at least 100ms). Only the idle pace: a job
    /// arriving, a freed slot or a drained backlog makes the pollers fetch at once.
    fetch_interval: Secs = Secs::from_secs(2);
    section facade: Facade;
    /// Listen address of the RunnerService facade (SPIFFE mTLS).
    runner_facade_listen: Option<String> = None,
        shown concat!(
            loopback_address!(), ":", facade_port!(), " without nats_url (single host), else ",
            any_address!(), ":", facade_port!()
        );
    /// URL executors use to reach the facade (https only).
    runner_facade_url: Option<String> = None,
        shown "https://<the facade listener's address> without nats_url, else required";
    /// The facade's SPIFFE ID, which executors verify exactly.
    runner_facade_spiffe_id: Option<String> = None,
        shown concat!("spiffe://<trust_domain>", local_facade_path!(), " with local_identity, else required");
    section host: Host;
    /// SPIFFE Workload API socket of the controller, e.g.
    /// `unix:///run/spire/agent-sockets/spire-agent.sock` (not needed with `local_identity`).
    spiffe_endpoint_socket: Option<String> = None;
    /// Listen address of the health listener: `/healthz`, `/readyz`, `/metrics`, the
    /// `/status` JSON and the status page at `/` (read-only; shows repository and job names).
    health_listen: Option<String> = None,
        shown concat!(
            loopback_address!(), ":", health_port!(), " without nats_url (single host), else ",
            any_address!(), ":", health_port!(), "; sandbox-identity: ",
            any_address!(), ":", health_port!()
        );
    /// Directory for local state: the embedded NATS store, the local CA, process
    /// executors, and in single-host mode the runner credential, capability key and task
    /// key the first start writes. Unset: systemd's `$STATE_DIRECTORY` (`StateDirectory=`);
    /// else `/var/lib/gitea-dynamic-runner` when running as root; else
    /// `$XDG_STATE_HOME/gitea-dynamic-runner`, or `~/.local/state/gitea-dynamic-runner`
    /// without `XDG_STATE_HOME`.
    state_dir: Option<PathBuf> = None,
        shown concat!(
            "$STATE_DIRECTORY, ", root_state_parent!(), "/", state_dir_name!(), " as root, else $XDG_STATE_HOME/",
            state_dir_name!(), " (~/", home_state_parent!(), "/", state_dir_name!(), ")"
        );
    /// What runs pod jobs: `kubernetes` (Pods) or `process` (local child processes, single
    /// host).
    pod_backend: Option<String> = None,
        shown concat!(process_backend!(), " without nats_url, else ", kubernetes_backend!());
    /// What runs vm jobs: `opensandbox` (Kata VMs) or `process` (local child processes,
    /// single host).
    vm_backend: Option<String> = None,
        shown concat!(process_backend!(), " without nats_url, else ", opensandbox_backend!());
    /// Serve SPIFFE identities from a CA under `state_dir` instead of SPIRE (required by the
    /// process backend).
    local_identity: Option<bool> = None, shown "true without nats_url, else false";
    section spire_executors: SpireExecutors;
    /// Where process executors get their SPIFFE identity: `local` (the controller's CA,
    /// with `local_identity`) or `spire` (an entry per executor in an existing SPIRE
    /// server, created and deleted with the `spire-server` CLI; each executor runs under a
    /// uid of its own from `spire_executor_uids`, so the controller needs root or
    /// CAP_SETUID, CAP_SETGID, CAP_CHOWN, CAP_KILL and CAP_DAC_OVERRIDE; needs
    /// `local_identity = false`,
    /// `spiffe_endpoint_socket` (the agent's, which executors get too),
    /// `spire_server_socket` and `spire_agent_id`). Off by default.
    executor_identity: String = "local".into();
    /// The SPIRE server's admin API socket (`server.socket_path`), on which
    /// `executor_identity = "spire"` creates and deletes executors' entries.
    spire_server_socket: Option<PathBuf> = None;
    /// The `spire-server` program of `executor_identity = "spire"` (found on `PATH` unless
    /// a path).
    spire_server_program: PathBuf = "spire-server".into();
    /// With `executor_identity = "spire"`: the uids process executors run as, one per
    /// executor, as `<first>-<last>` (e.g. `60000-60063`). Reserved for this: any process
    /// still running as one is killed before it is handed out. At least the process
    /// backends' capacity (`pod_capacity` plus `vm_capacity`), better more, as a freed uid
    /// waits out `spire_executor_uid_quarantine`.
    spire_executor_uids: Option<String> = None;
    /// With `executor_identity = "spire"`: how long a freed executor uid stays unused after
    /// its entry was deleted (also every uid after a controller start). Must exceed the
    /// SPIRE agent's sync interval (5s by default), during which the agent may still serve
    /// the deleted entry.
    spire_executor_uid_quarantine: Secs = Secs::from_secs(30);
    section executors: Executors;
    /// Program the process backend starts (with argument `executor`). Unset: the executor's
    /// own binary `gitea-dynamic-executor` when it sits next to this binary, else this
    /// binary (its `executor` subcommand).
    executor_program: Option<PathBuf> = None,
        shown concat!(executor_binary!(), " next to this binary, else this binary");
    /// The official runner binary executors run as `daemon --once`. Unset: `gitea-runner`,
    /// else `act_runner`, found on `PATH` when the controller starts (a process backend
    /// without either fails to start, saying what to install).
    runner_binary: Option<PathBuf> = None,
        shown concat!(gitea_runner!(), " or ", act_runner!(), " on PATH");
    /// An executor whose runner has not claimed its task this long after the executor was
    /// created is failed (counted from its creation, across controller restarts); a warm
    /// Pod (`pod_warm_pool`) or sandbox (`vm_warm_pool`) not running this long after its
    /// creation is replaced.
    executor_start_deadline: Secs = Secs(executor_default::START_DEADLINE);
    /// A claimed executor the facade has not heard from for this long is failed in Gitea
    /// (its runner died while its environment stayed up). The official runner reports
    /// every 5s.
    executor_idle_timeout: Secs = Secs::from_secs(300);
    /// How long an executor holds what its runner reported (log rows, the result) while
    /// the facade is unreachable (a controller restart, an upgrade, a leader failover),
    /// answering the runner itself as Gitea would and delivering everything once the
    /// facade is back; also how long it starts its runner again when the runner exits
    /// before its task was claimed. After it the executor gives up, logs what was lost and
    /// exits non-zero. Restarts count silence anew, so `executor_idle_timeout` only fails
    /// an executor the running controller cannot hear from.
    executor_report_outage_tolerance: Secs = Secs::from_secs(30 * 60);
    /// How long the process backend keeps an ended executor's `executor.log` (moved to
    /// `<state_dir>/<backend>/logs/<assignment-id>.log` when the executor is deleted); `0`
    /// deletes it with the executor.
    executor_log_retention: Secs = Secs::from_secs(7 * 24 * 3600);
    /// How many ended executors' logs the process backend keeps at most; the oldest go
    /// first.
    executor_log_retention_count: u32 = 100;
    section embedded_nats: EmbeddedNats;
    /// nats-server binary of the embedded single-host mode (used when `nats_url` is unset).
    nats_server_binary: PathBuf = PathBuf::from("nats-server");
    section leader: Leader;
    /// Campaign for a Kubernetes Lease; only the leader works, standbys report not ready.
    leader_election: bool = false;
    /// Namespace of the leader Lease.
    lease_namespace: String = "gitea-actions".into();
    /// Name of the leader Lease.
    lease_name: String = "gitea-dynamic-runner".into();
    /// This replica's identity in the Lease, unique per process. Unset: the host (Pod) name
    /// and a random suffix drawn at start. A configured one must differ between replicas: a
    /// second process campaigning under it never leads, and says so.
    leader_identity: Option<String> = None, shown "$HOSTNAME-<random suffix>";
    /// How long a Lease holds without renewal; a standby takes over about this long after
    /// the leader dies (renewals every duration/7, given up after 2/3 of it).
    lease_duration: Secs = Secs::from_secs(15);
    // --- The Pod backend (`pod_backend = "kubernetes"`); see docs/pod-backend.md. ---
    section pod: Pod;
    /// Namespace of executor Pods and their capability Secrets.
    pod_namespace: String = pod_default::NAMESPACE.into();
    /// Executor image (required for the kubernetes pod backend). Pin a digest
    /// (`image@sha256:…`): every job runs it; a mutable tag is accepted with a warning.
    pod_executor_image: Option<String> = None;
    /// Service account of executor Pods.
    pod_service_account: String = pod_default::SERVICE_ACCOUNT.into();
    /// UID and GID the job runs as, never 0. With `pod_privileged` the executor starts as
    /// root and runs itself, the runner and the job as this UID (with the image's `docker`
    /// group); otherwise the container runs as it.
    pod_executor_uid: u32 = pod_default::EXECUTOR_UID;
    /// Give each executor Pod a privileged `dockerd` sidecar container running the job's
    /// Docker daemon on a socket shared with the executor's container, which starts as
    /// root (not privileged) to run the job as `pod_executor_uid`. `false`: one container,
    /// run as `pod_executor_uid`, non-root, no privilege escalation, all capabilities
    /// dropped, the runtime's default seccomp profile, and jobs have no Docker daemon.
    pod_privileged: bool = pod_default::PRIVILEGED;
    /// Size limit of the `emptyDir` mounted at `/var/lib/docker` in executor Pods (the
    /// `dockerd` sidecar's, with `pod_privileged`).
    pod_docker_storage_limit: String = pod_default::DOCKER_STORAGE_LIMIT.into();
    /// `activeDeadlineSeconds` of executor Pods: Kubernetes ends a Pod this long after it
    /// started (just past Gitea's 3 h limit for a task by default).
    pod_active_deadline: Secs = Secs(pod_default::ACTIVE_DEADLINE);
    /// Mount the service account token into executor Pods (jobs then hold a Kubernetes
    /// credential).
    pod_automount_service_account_token: bool = pod_default::AUTOMOUNT_SERVICE_ACCOUNT_TOKEN;
    /// Arguments of the executor container (its image's entrypoint is the binary).
    pod_executor_args: List = List::of(pod_default::EXECUTOR_ARGS);
    /// Extra environment of the executor container (e.g. `GITEA_RUNNER_BINARY`); the
    /// `CI_*` variables and `SPIFFE_ENDPOINT_SOCKET` are the controller's and cannot be
    /// overridden.
    pod_executor_env: Table = Table::default();
    /// CSI driver of the SPIFFE Workload API volume of executor Pods.
    pod_spiffe_csi_driver: String = pod_default::SPIFFE_CSI_DRIVER.into();
    /// A node directory holding the SPIRE agent's Workload API socket, mounted read-only
    /// into executor Pods as a `hostPath` volume instead of the CSI volume of
    /// `pod_spiffe_csi_driver`: for clusters without the SPIFFE CSI driver. Each node's agent
    /// must listen in it, and the namespace's Pod Security level must admit hostPath volumes
    /// (`privileged`, as `pod_privileged` needs anyway). Unset: the CSI volume.
    pod_spiffe_host_path: Option<PathBuf> = None;
    /// Where the Workload API volume is mounted in the executor container.
    pod_spiffe_socket_dir: String = pod_default::SPIFFE_SOCKET_DIR.into();
    /// The Workload API socket's file name in `pod_spiffe_socket_dir`.
    pod_spiffe_socket_name: String = pod_default::SPIFFE_SOCKET_NAME.into();
    /// Requests and limits of executor Pods without a profile: `requests = { cpu = "1" }`,
    /// `limits = { memory = "4Gi" }` (quantities as Kubernetes writes them).
    pod_resources: Table = Table::default();
    /// Per-label Pod profiles, `[pod_profiles.<label>]`: a job whose `runs-on` has the
    /// extra label gets `requests`, `limits`, `node_selector`, `tolerations`,
    /// `runtime_class_name`, `volumes` (`{ name, mount_path, read_only }` from
    /// `pod_volume_allow_list`), `image` and `warm_pool` (warm Pods of the profile to keep,
    /// as `pod_warm_pool`). Each label is declared to Gitea. A job with an
    /// unknown extra label, or two profiles, is failed with a log row naming them.
    pod_profiles: Table = Table::default();
    /// Upper bounds of any profile's (and `pod_resources`') requests and limits, per
    /// resource: `{ cpu = "8", memory = "32Gi" }`.
    pod_profile_max: Table = Table::default();
    /// Volumes profiles may mount, by name, each a Kubernetes volume source as in a Pod
    /// spec (`[pod_volume_allow_list.cache] persistentVolumeClaim = { claimName = "ci-cache" }`);
    /// nothing else is ever mounted.
    pod_volume_allow_list: Table = Table::default();
    /// A capability Secret with no Pod (a controller died between creating the two) is
    /// removed once it is this old.
    pod_orphan_secret_grace: Secs = Secs(pod_default::ORPHAN_SECRET_GRACE);
    /// How long an executor Pod waits for its SVID (its ClusterStaticEntry bound by SPIRE)
    /// and the facade before it gives up; the job is then failed with the executor's
    /// error as the reason.
    pod_identity_bind_deadline: Secs = Secs(pod_default::IDENTITY_DEADLINE);
    /// Warm Pods without a profile to keep ready (0, the default: none, every job's Pod
    /// is created for it). A warm Pod is created before any job, holds no identity and no
    /// capability, and is claimed by exactly one job, which then gets its identity bound
    /// and its capability; it is deleted after that job like any Pod and replaced. A
    /// profile's own count is its `warm_pool` field in `pod_profiles`. The VM backend's is
    /// `vm_warm_pool`.
    pod_warm_pool: u32 = 0;
    /// SPIRE k8s_psat cluster name of the Pod cluster (the `<cluster>` in agent IDs
    /// `spiffe://<trust_domain>/spire/agent/k8s_psat/<cluster>/<Node UID>`).
    spire_cluster: String = "homelab".into();
    /// `className` of ClusterStaticEntries (must match the SPIRE controller manager's
    /// class, else SPIRE ignores the entries).
    spire_class: String = "spire-mgmt-spire".into();
    /// Parent SPIFFE ID of every Pod entry (single-node clusters, node aliases). Unset:
    /// the agent ID of the node each Pod is scheduled on. With `executor_identity =
    /// "spire"`: the SPIFFE ID of this host's SPIRE agent, parent of every process
    /// executor's entry (required there).
    spire_agent_id: Option<String> = None;
    // --- the VM backend (OpenSandbox) ---
    section vm: Vm;
    /// OpenSandbox Lifecycle API base URL including the version, e.g.
    /// `https://opensandbox.example.org/v1` (required for the opensandbox vm backend).
    opensandbox_api: Option<String> = None;
    /// File holding the OpenSandbox API key, sent as `OPEN-SANDBOX-API-KEY` (required for
    /// the opensandbox vm backend; read once at start).
    opensandbox_api_key_file: Option<PathBuf> = None => secret;
    /// OpenSandbox pool (`extensions.poolRef`) every VM executor comes from; its image
    /// must hold `vm_entrypoint`.
    opensandbox_pool: String = "ci-vm".into();
    /// PEM bundle of extra CAs trusted for an https OpenSandbox API (the system roots are
    /// always trusted).
    opensandbox_ca_file: Option<PathBuf> = None;
    /// Timeout of each OpenSandbox call except create (get, list, patch, renew, delete).
    opensandbox_request_timeout: Secs = Secs(vm_default::REQUEST_TIMEOUT);
    /// Timeout of a sandbox create, which blocks until the VM runs: keep it above the
    /// server's `sandbox_create_timeout_seconds` (60s by default) so the server's own
    /// answer arrives (504: it gave up and deleted the sandbox; 429: the pool is full).
    opensandbox_create_timeout: Secs = Secs(vm_default::CREATE_TIMEOUT);
    /// Command a VM sandbox runs (a path inside the pool's image, then its arguments).
    vm_entrypoint: List = List::of(vm_default::ENTRYPOINT);
    /// Extra environment of VM executors as `NAME=value` items, e.g.
    /// `SPIFFE_ENDPOINT_SOCKET=unix:///run/spire/agent.sock` (the SPIRE agent in the VM)
    /// and `GITEA_RUNNER_BINARY=…`. The `CI_*` variables of the assignment cannot be set
    /// here. In the environment or `--set`, items are separated by commas.
    vm_executor_env: List = List::default();
    /// Lifetime of a VM sandbox in seconds (at least 60); renewed while its job runs.
    vm_timeout_seconds: u64 = vm_default::TIMEOUT.as_secs();
    /// Extend a running sandbox's expiry (by `vm_timeout_seconds`) once it is closer than
    /// this; below `vm_timeout_seconds`.
    vm_renew_before: Secs = Secs(vm_default::RENEW_BEFORE);
    /// A VM sandbox whose job's result Gitea accepted is deleted this long after the
    /// controller saw its terminal marker: OpenSandbox keeps a sandbox `Running` after its
    /// executor exited, so the exit cannot be waited for. The runner has its answer before
    /// the marker is written; this only gives the executor time to exit cleanly.
    vm_terminal_grace: Secs = Secs::from_secs(15);
    /// Warm VM sandboxes the opensandbox vm backend keeps ready (0, the default: none,
    /// every job's sandbox is created for it). The OpenSandbox Pool's buffer (its
    /// `bufferMin`, `bufferMax`) pre-starts the VMs either way; a warm sandbox also has its
    /// executor started and is named before any job: it holds no identity and no capability until exactly one job
    /// claims it, after which `sandbox-identity` binds the job's SPIFFE ID to it and its
    /// executor fetches its assignment from the facade. It is deleted after that job like
    /// any sandbox and replaced. Counted within the Pool's capacity, beside `vm_capacity`.
    vm_warm_pool: u32 = 0;

    // --- spire ---
    section sandbox_identity: SandboxIdentity;
    /// SPIRE k8s_psat cluster name of the sandbox cluster: the in-VM agents' parent ID is
    /// `spiffe://<trust_domain>/spire/agent/k8s_psat/<cluster>/pod/<Pod UID>`
    /// (`sandbox-identity`).
    spire_cluster_name: String = sandbox_identity_default::CLUSTER.into();
    /// `className` of the ClusterStaticEntries `sandbox-identity` writes (must match the
    /// sandbox cluster's SPIRE controller manager, which ignores other classes).
    spire_class_name: String = sandbox_identity_default::CLASS_NAME.into();

    // --- sandbox-identity ---
    /// Namespace of the OpenSandbox BatchSandboxes and their Pods (`sandbox-identity`).
    opensandbox_namespace: String = sandbox_identity_default::NAMESPACE.into();
    /// UID the executor runs as inside the VM: the `unix:uid` selector of the entries
    /// `sandbox-identity` writes.
    runner_uid: u32 = sandbox_identity_default::RUNNER_UID;
    /// `sandbox-identity` reconciles at least this often, besides on every watch event.
    sandbox_identity_resync: Secs = Secs(sandbox_identity_default::RESYNC);
    /// Name of the Lease `sandbox-identity` replicas elect their leader with (in
    /// `lease_namespace`, with `leader_election`).
    sandbox_identity_lease_name: String = "gitea-dynamic-runner-sandbox-identity".into();

    // === Facade limits: what one peer can hold of the facade (docs/security.md) ===

    section facade_limits: FacadeLimits;
    /// Most connections the facade holds at once, TLS handshakes included. At the limit a
    /// new connection replaces the oldest one still in its handshake, or is closed at once.
    /// Capped at a quarter of the open-file limit, which is raised to its hard limit at
    /// start.
    runner_facade_max_connections: u32 = 1024;
    /// Most connections from one peer address (all executors of a host share its address;
    /// in single-host mode all of them come from 127.0.0.1).
    runner_facade_max_connections_per_peer: u32 = 512;
    /// Most connections one SPIFFE ID holds after its handshake that no request has bound
    /// to an assignment yet. Every run of a job shares its SPIFFE ID (matrix entries, pull
    /// requests, re-runs); each executor binds its connections with its first request, so
    /// this bounds only sessions that send nothing useful.
    runner_facade_max_connections_per_identity: u32 = 16;
    /// Most connections bound to one assignment (one job's executor, which multiplexes
    /// over one or two). A request on a new connection beyond it is answered 429.
    runner_facade_max_connections_per_assignment: u32 = 16;
    /// A TLS handshake not finished within this closes the connection.
    runner_facade_tls_handshake_timeout: Secs = Secs::from_secs(10);
    /// The first bytes after the handshake and every HTTP/1.1 request head must arrive
    /// within this, or the connection is closed (slow-header clients).
    runner_facade_header_read_timeout: Secs = Secs::from_secs(15);
    /// A connection with no request in flight for this long is closed (HTTP/1.1 and
    /// HTTP/2); HTTP/2 peers are also pinged, and one that stops answering is dropped.
    runner_facade_idle_timeout: Secs = Secs::from_secs(90);
    /// HTTP/2 connections are pinged this often, so a peer that vanished without closing
    /// (half-open TCP) is found even while a request waits on it.
    runner_facade_h2_ping_interval: Secs = Secs::from_secs(30);
    /// An HTTP/2 peer that does not answer a ping within this is dropped; together with
    /// the interval, the bound on how long a dead peer holds its connection.
    runner_facade_h2_ping_timeout: Secs = Secs::from_secs(10);

    // === Queue security: who may write the queue, and what a worker trusts ===

    section queue_security: QueueSecurity;
    /// Accept plaintext (v1) envelopes although `task_encryption_key_file` is set. Only for
    /// draining a queue the Go version wrote: a v1 envelope proves nothing about its writer.
    /// Logged as a warning at start.
    accept_plaintext_envelopes: bool = false;
    /// Accept sealed (v2) envelopes without a fetch time, which releases before the fetch
    /// time existed wrote: they have no age limit, so a copy can be replayed once its
    /// finished record expired. Only while upgrading from such a release, until its queue
    /// is drained; removed in the next release. Logged as a warning at start.
    accept_undated_envelopes: bool = false;
    /// Gitea's `[actions] ENDLESS_TASK_TIMEOUT`: Gitea ends a task this long after it was
    /// fetched, so an envelope fetched longer ago is refused as stale or replayed, and
    /// finished assignments are remembered at least this long.
    gitea_endless_task_timeout: Secs = Secs::from_secs(3 * 3600);
    /// JetStream key-value bucket of finished assignment IDs: an assignment runs at most
    /// once, even when its envelope is published again.
    nats_finished_bucket: String = "CI_RUNNER_FINISHED".into();
    /// An assignment sealed with a task key this controller lacks is set aside (it takes
    /// no admission slot), released when the key is configured, and after this long failed
    /// in Gitea with the reason if a scheduler holding this capability key wrote it (its
    /// `id_mac` verifies), else dropped without touching Gitea.
    held_assignment_timeout: Secs = Secs::from_secs(3600);

    // === Secret files ===

    section secrets: Secrets;
    /// Which permissions a secret file may have: `owner-only` (no group or other access,
    /// as ssh requires of private keys), `group-readable` (also read by the file's group:
    /// Kubernetes Secret volumes with `fsGroup` are 0440), or `unchecked`.
    secret_file_permissions: String = "owner-only".into();

    // === One command on a host: registration at the first start ===

    section registration: Registration;
    /// File holding a registration token from Gitea's runner settings
    /// (`controller --registration-token-file`). While `gitea_runner_uuid_file` and
    /// `gitea_runner_token_file` do not exist, the controller registers itself with it at
    /// start (labels of the enabled backends) and writes them (mode 0600, never
    /// overwritten); later starts use them and never register again.
    gitea_runner_registration_token_file: Option<PathBuf> = None => secret;
}
