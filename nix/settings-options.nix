# Typed options for every key of the binary's configuration, keyed by TOML key.
#
# FIRST VERSION, TRANSCRIBED BY HAND from `gitea-dynamic-runner check-config --reference`
# (the FIELDS table of crates/gdr-controller/src/config.rs). It is to be replaced by the
# generated file (`gitea-dynamic-runner check-config --reference --format nix`), after which a
# test keeps the committed file identical to what the binary prints.
#
# Shape (agreed with the generator): a function of `{ lib }` returning, per key,
# `lib.mkOption { type = lib.types.nullOr …; default = null; description = "…"; }`.
# `null` means "not set": the binary's own default applies, and nix/module.nix renders only
# non-null keys to TOML. Durations are strings ("90s", "5m"); lists may also be given as one
# comma-separated string in TOML, but a list is what these options take.
#
# Keys marked "Secret" are filled by nix/module.nix from its credential options
# (LoadCredential); the module refuses a value for them here.
{ lib }:
{
  components = lib.mkOption {
    type = lib.types.nullOr (lib.types.listOf lib.types.str);
    default = null;
    description = "Components this process runs (comma-separated, or `all`). A worker without the scheduler (which serves the facade) is refused. Environment variable: COMPONENTS. Default: scheduler,pod-worker,vm-worker.";
  };
  gitea_instance_url = lib.mkOption {
    type = lib.types.nullOr lib.types.str;
    default = null;
    description = "Base URL of the Gitea instance (http or https); the runner API lives under <url>/api/actions. Environment variable: GITEA_INSTANCE_URL. Default: unset.";
  };
  gitea_runner_uuid_file = lib.mkOption {
    type = lib.types.nullOr lib.types.path;
    default = null;
    description = "File holding the controller's runner UUID (written by `register`). Environment variable: GITEA_RUNNER_UUID_FILE. Default: unset.";
  };
  gitea_runner_token_file = lib.mkOption {
    type = lib.types.nullOr lib.types.path;
    default = null;
    description = "File holding the controller's runner token (written by `register`, mode 0600). Secret: set it through the module's credential option, never here. Environment variable: GITEA_RUNNER_TOKEN_FILE. Default: unset.";
  };
  gitea_ca_file = lib.mkOption {
    type = lib.types.nullOr lib.types.path;
    default = null;
    description = "PEM bundle of extra CAs trusted for an https Gitea (the system roots are always trusted). Environment variable: GITEA_CA_FILE. Default: unset.";
  };
  gitea_request_timeout = lib.mkOption {
    type = lib.types.nullOr lib.types.str;
    default = null;
    description = "Timeout of each RPC to Gitea (Register, Declare, UpdateTask, UpdateLog). Environment variable: GITEA_REQUEST_TIMEOUT. Default: 60s.";
  };
  gitea_fetch_timeout = lib.mkOption {
    type = lib.types.nullOr lib.types.str;
    default = null;
    description = "Timeout of each FetchTask poll. Environment variable: GITEA_FETCH_TIMEOUT. Default: 5s.";
  };
  runner_name = lib.mkOption {
    type = lib.types.nullOr lib.types.str;
    default = null;
    description = "Name the controller registers under in Gitea. Environment variable: RUNNER_NAME. Default: gitea-dynamic-runner.";
  };
  runner_capabilities = lib.mkOption {
    type = lib.types.nullOr (lib.types.listOf lib.types.str);
    default = null;
    description = "Capabilities declared to Gitea; must match what the one-shot official runner supports (`cancelling` needs runner >= 2.0). Environment variable: RUNNER_CAPABILITIES. Default: cancelling.";
  };
  pod_capacity = lib.mkOption {
    type = lib.types.nullOr lib.types.int;
    default = null;
    description = "Concurrent Pod executors (and FetchTask pollers for the pod backend). 0 disables the pod backend. Environment variable: POD_CAPACITY. Default: 4.";
  };
  vm_capacity = lib.mkOption {
    type = lib.types.nullOr lib.types.int;
    default = null;
    description = "Concurrent VM executors (and FetchTask pollers for the vm backend). 0 disables the vm backend. Environment variable: VM_CAPACITY. Default: 1.";
  };
  vm_runner_label = lib.mkOption {
    type = lib.types.nullOr lib.types.str;
    default = null;
    description = "The runs-on label that selects the VM backend (`vm-dev` takes only test jobs while a backend is repaired). Environment variable: VM_RUNNER_LABEL. Default: vm.";
  };
  trust_domain = lib.mkOption {
    type = lib.types.nullOr lib.types.str;
    default = null;
    description = "SPIFFE trust domain of job identities (spiffe://<trust_domain>/ci/<owner>/<repo>/<job>). The Go version defaulted to ddupan.top. Environment variable: TRUST_DOMAIN. Default: unset.";
  };
  metadata_prefix = lib.mkOption {
    type = lib.types.nullOr lib.types.str;
    default = null;
    description = "Prefix of executor labels/annotations/metadata keys; keep it to take over a Go deployment. Environment variable: METADATA_PREFIX. Default: ci.ddupan.top/.";
  };
  runner_facade_capability_key_file = lib.mkOption {
    type = lib.types.nullOr lib.types.path;
    default = null;
    description = "File holding the >= 32-byte key that derives assignment capabilities (HMAC-SHA256); whitespace around it is trimmed. Secret: set it through the module's credential option, never here. Environment variable: RUNNER_FACADE_CAPABILITY_KEY_FILE. Default: unset.";
  };
  task_encryption_key_file = lib.mkOption {
    type = lib.types.nullOr lib.types.path;
    default = null;
    description = "File holding the AES-256 key (64 hex chars or base64 of 32 bytes) that encrypts tasks in the stream (envelope v2). Unset: tasks are stored as v1 (readable). Secret: set it through the module's credential option, never here. Environment variable: TASK_ENCRYPTION_KEY_FILE. Default: unset.";
  };
  task_encryption_previous_key_files = lib.mkOption {
    type = lib.types.nullOr (lib.types.listOf lib.types.str);
    default = null;
    description = "Older task keys still accepted for decryption during a rotation (comma-separated paths). Secret: set it through the module's credential option, never here. Environment variable: TASK_ENCRYPTION_PREVIOUS_KEY_FILES. Default: unset.";
  };
  nats_url = lib.mkOption {
    type = lib.types.nullOr lib.types.str;
    default = null;
    description = "NATS server URL(s), comma-separated. Unset: the embedded single-host mode (not implemented yet). Environment variable: NATS_URL. Default: unset.";
  };
  nats_producer_user = lib.mkOption {
    type = lib.types.nullOr lib.types.str;
    default = null;
    description = "NATS user of the scheduler's (publishing) connection. Environment variable: NATS_PRODUCER_USER. Default: ci-producer.";
  };
  nats_producer_password_file = lib.mkOption {
    type = lib.types.nullOr lib.types.path;
    default = null;
    description = "File holding the producer's NATS password. Secret: set it through the module's credential option, never here. Environment variable: NATS_PRODUCER_PASSWORD_FILE. Default: unset.";
  };
  nats_producer_creds_file = lib.mkOption {
    type = lib.types.nullOr lib.types.path;
    default = null;
    description = "NATS .creds file for the producer (instead of user/password). Secret: set it through the module's credential option, never here. Environment variable: NATS_PRODUCER_CREDS_FILE. Default: unset.";
  };
  nats_worker_user = lib.mkOption {
    type = lib.types.nullOr lib.types.str;
    default = null;
    description = "NATS user of the workers' (consuming) connection. Environment variable: NATS_WORKER_USER. Default: ci-worker.";
  };
  nats_worker_password_file = lib.mkOption {
    type = lib.types.nullOr lib.types.path;
    default = null;
    description = "File holding the worker's NATS password. Secret: set it through the module's credential option, never here. Environment variable: NATS_WORKER_PASSWORD_FILE. Default: unset.";
  };
  nats_worker_creds_file = lib.mkOption {
    type = lib.types.nullOr lib.types.path;
    default = null;
    description = "NATS .creds file for the workers (instead of user/password). Secret: set it through the module's credential option, never here. Environment variable: NATS_WORKER_CREDS_FILE. Default: unset.";
  };
  nats_ca_file = lib.mkOption {
    type = lib.types.nullOr lib.types.path;
    default = null;
    description = "PEM CA bundle for a tls:// NATS server. Environment variable: NATS_CA_FILE. Default: unset.";
  };
  nats_stream = lib.mkOption {
    type = lib.types.nullOr lib.types.str;
    default = null;
    description = "JetStream stream holding assignments. Environment variable: NATS_STREAM. Default: CI_RUNNER.";
  };
  nats_subject_base = lib.mkOption {
    type = lib.types.nullOr lib.types.str;
    default = null;
    description = "Subject base; assignments go to <base>.pod and <base>.vm. Environment variable: NATS_SUBJECT_BASE. Default: ci.runner.";
  };
  nats_create_stream = lib.mkOption {
    type = lib.types.nullOr lib.types.bool;
    default = null;
    description = "Create/update the stream and consumers at start; turn off where operators provision them. Environment variable: NATS_CREATE_STREAM. Default: true.";
  };
  heartbeat_interval = lib.mkOption {
    type = lib.types.nullOr lib.types.str;
    default = null;
    description = "Interval of the task-ID-only UpdateTask heartbeats that keep queued tasks alive in Gitea. Environment variable: HEARTBEAT_INTERVAL. Default: 60s.";
  };
  backlog_limit = lib.mkOption {
    type = lib.types.nullOr lib.types.int;
    default = null;
    description = "Stop fetching while this many assignments wait unclaimed in the stream. Environment variable: BACKLOG_LIMIT. Default: pod_capacity + vm_capacity.";
  };
  runner_facade_listen = lib.mkOption {
    type = lib.types.nullOr lib.types.str;
    default = null;
    description = "Listen address of the RunnerService facade (SPIFFE mTLS). Environment variable: RUNNER_FACADE_LISTEN. Default: 0.0.0.0:8443.";
  };
  runner_facade_url = lib.mkOption {
    type = lib.types.nullOr lib.types.str;
    default = null;
    description = "URL executors use to reach the facade. Environment variable: RUNNER_FACADE_URL. Default: unset.";
  };
  runner_facade_spiffe_id = lib.mkOption {
    type = lib.types.nullOr lib.types.str;
    default = null;
    description = "The facade's SPIFFE ID, which executors verify exactly. Environment variable: RUNNER_FACADE_SPIFFE_ID. Default: unset.";
  };
  spiffe_endpoint_socket = lib.mkOption {
    type = lib.types.nullOr lib.types.str;
    default = null;
    description = "SPIFFE Workload API socket, e.g. unix:///run/spire/agent-sockets/spire-agent.sock. Environment variable: SPIFFE_ENDPOINT_SOCKET. Default: unset.";
  };
  state_dir = lib.mkOption {
    type = lib.types.nullOr lib.types.path;
    default = null;
    description = "Directory for local state: the embedded NATS store, the local CA and process executors. Environment variable: STATE_DIR. Default: /var/lib/gitea-dynamic-runner.";
  };
  pod_backend = lib.mkOption {
    type = lib.types.nullOr lib.types.str;
    default = null;
    description = "What runs pod jobs: `kubernetes` (Pods; not implemented yet) or `process` (local child processes, single host). Environment variable: POD_BACKEND. Default: process without nats_url, else kubernetes.";
  };
  vm_backend = lib.mkOption {
    type = lib.types.nullOr lib.types.str;
    default = null;
    description = "What runs vm jobs: `opensandbox` (Kata VMs; not implemented yet) or `process` (local child processes, single host). Environment variable: VM_BACKEND. Default: process without nats_url, else opensandbox.";
  };
  local_identity = lib.mkOption {
    type = lib.types.nullOr lib.types.bool;
    default = null;
    description = "Serve SPIFFE identities from a CA under state_dir instead of SPIRE (required by the process backend). Environment variable: LOCAL_IDENTITY. Default: true without nats_url, else false.";
  };
  executor_program = lib.mkOption {
    type = lib.types.nullOr lib.types.path;
    default = null;
    description = "Program the process backend starts (with argument `executor`). Environment variable: EXECUTOR_PROGRAM. Default: this binary.";
  };
  runner_binary = lib.mkOption {
    type = lib.types.nullOr lib.types.path;
    default = null;
    description = "The official runner binary executors run as `daemon --once`. Environment variable: RUNNER_BINARY. Default: gitea-runner.";
  };
  executor_start_deadline = lib.mkOption {
    type = lib.types.nullOr lib.types.str;
    default = null;
    description = "An executor whose runner has not claimed its task by then is failed. Environment variable: EXECUTOR_START_DEADLINE. Default: 10m.";
  };
  executor_idle_timeout = lib.mkOption {
    type = lib.types.nullOr lib.types.str;
    default = null;
    description = "A claimed executor the facade has not heard from for this long is failed in Gitea (its runner died while its environment stayed up). Default: 5m. Environment variable: EXECUTOR_IDLE_TIMEOUT.";
  };
  nats_server_binary = lib.mkOption {
    type = lib.types.nullOr lib.types.path;
    default = null;
    description = "nats-server binary of the embedded single-host mode (used when nats_url is unset). Environment variable: NATS_SERVER_BINARY. Default: nats-server.";
  };
  leader_election = lib.mkOption {
    type = lib.types.nullOr lib.types.bool;
    default = null;
    description = "Campaign for a Kubernetes Lease; only the leader works, standbys report not ready. Environment variable: LEADER_ELECTION. Default: false.";
  };
  lease_namespace = lib.mkOption {
    type = lib.types.nullOr lib.types.str;
    default = null;
    description = "Namespace of the leader Lease. Environment variable: LEASE_NAMESPACE. Default: gitea-actions.";
  };
  lease_name = lib.mkOption {
    type = lib.types.nullOr lib.types.str;
    default = null;
    description = "Name of the leader Lease. Environment variable: LEASE_NAME. Default: gitea-dynamic-runner.";
  };
  leader_identity = lib.mkOption {
    type = lib.types.nullOr lib.types.str;
    default = null;
    description = "This replica's identity in the Lease. Environment variable: LEADER_IDENTITY. Default: $HOSTNAME.";
  };
  nats_ack_wait = lib.mkOption {
    type = lib.types.nullOr lib.types.str;
    default = null;
    description = "JetStream ack wait of the worker consumers: an assignment a dead controller held is redelivered after this. Environment variable: NATS_ACK_WAIT. Default: 60s.";
  };
  lease_duration = lib.mkOption {
    type = lib.types.nullOr lib.types.str;
    default = null;
    description = "How long a Lease holds without renewal (renewals every duration/7, given up after 2/3 of it). Environment variable: LEASE_DURATION. Default: 15s.";
  };
  health_listen = lib.mkOption {
    type = lib.types.nullOr lib.types.str;
    default = null;
    description = "Listen address of /healthz, /readyz and /metrics. Environment variable: HEALTH_LISTEN. Default: 0.0.0.0:9090.";
  };
  pod_namespace = lib.mkOption {
    type = lib.types.nullOr lib.types.str;
    default = null;
    description = "Namespace of executor Pods. Environment variable: POD_NAMESPACE. Default: gitea-actions.";
  };
  pod_executor_image = lib.mkOption {
    type = lib.types.nullOr lib.types.str;
    default = null;
    description = "Executor image (required for pod-worker). Environment variable: POD_EXECUTOR_IMAGE. Default: unset.";
  };
  pod_service_account = lib.mkOption {
    type = lib.types.nullOr lib.types.str;
    default = null;
    description = "Service account of executor Pods. Environment variable: POD_SERVICE_ACCOUNT. Default: gitea-task-executor.";
  };
  pod_executor_uid = lib.mkOption {
    type = lib.types.nullOr lib.types.int;
    default = null;
    description = "UID the executor runs as (also the SPIRE unix:uid selector). Environment variable: POD_EXECUTOR_UID. Default: 2000.";
  };
  spire_cluster = lib.mkOption {
    type = lib.types.nullOr lib.types.str;
    default = null;
    description = "SPIRE k8s_psat cluster name of the Pod cluster. Environment variable: SPIRE_CLUSTER. Default: homelab.";
  };
  spire_class = lib.mkOption {
    type = lib.types.nullOr lib.types.str;
    default = null;
    description = "className of ClusterStaticEntries (must match the SPIRE controller manager). Environment variable: SPIRE_CLASS. Default: spire-mgmt-spire.";
  };
  spire_agent_id = lib.mkOption {
    type = lib.types.nullOr lib.types.str;
    default = null;
    description = "Parent SPIFFE ID of Pod entries (required for pod-worker). Environment variable: SPIRE_AGENT_ID. Default: unset.";
  };
  opensandbox_api = lib.mkOption {
    type = lib.types.nullOr lib.types.str;
    default = null;
    description = "OpenSandbox Lifecycle API base URL (required for vm-worker). Environment variable: OPENSANDBOX_API. Default: unset.";
  };
  opensandbox_api_key_file = lib.mkOption {
    type = lib.types.nullOr lib.types.path;
    default = null;
    description = "File holding the OpenSandbox API key (required for vm-worker). Secret: set it through the module's credential option, never here. Environment variable: OPENSANDBOX_API_KEY_FILE. Default: unset.";
  };
  opensandbox_pool = lib.mkOption {
    type = lib.types.nullOr lib.types.str;
    default = null;
    description = "OpenSandbox pool (extensions.poolRef) of VM executors. Environment variable: OPENSANDBOX_POOL. Default: ci-vm.";
  };
  opensandbox_ca_file = lib.mkOption {
    type = lib.types.nullOr lib.types.path;
    default = null;
    description = "PEM bundle of extra CAs trusted for an https OpenSandbox API (the system roots are always trusted). Default: unset. Environment variable: OPENSANDBOX_CA_FILE.";
  };
  opensandbox_request_timeout = lib.mkOption {
    type = lib.types.nullOr lib.types.str;
    default = null;
    description = "Timeout of each OpenSandbox call except create. Default: 30s. Environment variable: OPENSANDBOX_REQUEST_TIMEOUT.";
  };
  opensandbox_create_timeout = lib.mkOption {
    type = lib.types.nullOr lib.types.str;
    default = null;
    description = "Timeout of a sandbox create, which blocks until the VM runs; keep it above the server's sandbox_create_timeout_seconds (60s). Default: 1m 30s. Environment variable: OPENSANDBOX_CREATE_TIMEOUT.";
  };
  vm_entrypoint = lib.mkOption {
    type = lib.types.nullOr (lib.types.listOf lib.types.str);
    default = null;
    description = "Command a VM sandbox runs (a path inside the pool's image, then its arguments). Default: /usr/local/bin/gitea-dynamic-runner,executor. Environment variable: VM_ENTRYPOINT.";
  };
  vm_executor_env = lib.mkOption {
    type = lib.types.nullOr (lib.types.listOf lib.types.str);
    default = null;
    description = "Extra environment of VM executors as NAME=value items (e.g. SPIFFE_ENDPOINT_SOCKET of the SPIRE agent in the VM); the CI_* variables of the assignment cannot be set here. Default: none. Environment variable: VM_EXECUTOR_ENV.";
  };
  vm_timeout_seconds = lib.mkOption {
    type = lib.types.nullOr lib.types.int;
    default = null;
    description = "Lifetime of a VM sandbox in seconds. Environment variable: VM_TIMEOUT_SECONDS. Default: 14400.";
  };
  vm_renew_before = lib.mkOption {
    type = lib.types.nullOr lib.types.str;
    default = null;
    description = "Extend a running sandbox's expiry once it is closer than this; below vm_timeout_seconds. Default: 10m. Environment variable: VM_RENEW_BEFORE.";
  };
  vm_terminal_grace = lib.mkOption {
    type = lib.types.nullOr lib.types.str;
    default = null;
    description = "A VM sandbox whose job's result Gitea accepted is deleted this long after the controller saw its terminal marker (OpenSandbox keeps an exited sandbox Running). Environment variable: VM_TERMINAL_GRACE. Default: 15s.";
  };
  spire_cluster_name = lib.mkOption {
    type = lib.types.nullOr lib.types.str;
    default = null;
    description = "SPIRE k8s_psat cluster name of the sandbox cluster (sandbox-identity). Default: sandbox-kata. Environment variable: SPIRE_CLUSTER_NAME.";
  };
  spire_class_name = lib.mkOption {
    type = lib.types.nullOr lib.types.str;
    default = null;
    description = "className of the ClusterStaticEntries sandbox-identity writes. Default: spire-mgmt-spire. Environment variable: SPIRE_CLASS_NAME.";
  };
  opensandbox_namespace = lib.mkOption {
    type = lib.types.nullOr lib.types.str;
    default = null;
    description = "Namespace of the OpenSandbox BatchSandboxes and their Pods (sandbox-identity). Default: opensandbox. Environment variable: OPENSANDBOX_NAMESPACE.";
  };
  runner_uid = lib.mkOption {
    type = lib.types.nullOr lib.types.int;
    default = null;
    description = "UID the executor runs as inside the VM: the unix:uid selector of sandbox-identity's entries. Default: 2000. Environment variable: RUNNER_UID.";
  };
  sandbox_identity_resync = lib.mkOption {
    type = lib.types.nullOr lib.types.str;
    default = null;
    description = "sandbox-identity reconciles at least this often, besides on every watch event. Default: 30s. Environment variable: SANDBOX_IDENTITY_RESYNC.";
  };
  sandbox_identity_lease_name = lib.mkOption {
    type = lib.types.nullOr lib.types.str;
    default = null;
    description = "Name of the Lease sandbox-identity replicas elect their leader with. Default: gitea-dynamic-runner-sandbox-identity. Environment variable: SANDBOX_IDENTITY_LEASE_NAME.";
  };
}
