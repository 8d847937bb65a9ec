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
    description = "A claimed executor the facade has not heard from for this long is failed in Gitea (its runner died while its environment stayed up). Environment variable: EXECUTOR_IDLE_TIMEOUT. Default: 5m.";
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
    description = "Executor image (required for the kubernetes pod backend); pin a digest. Environment variable: POD_EXECUTOR_IMAGE. Default: unset.";
  };
  pod_service_account = lib.mkOption {
    type = lib.types.nullOr lib.types.str;
    default = null;
    description = "Service account of executor Pods. Environment variable: POD_SERVICE_ACCOUNT. Default: gitea-task-executor.";
  };
  pod_executor_uid = lib.mkOption {
    type = lib.types.nullOr lib.types.int;
    default = null;
    description = "UID and GID the executor container runs as (also the SPIRE unix:uid selector). Environment variable: POD_EXECUTOR_UID. Default: 2000.";
  };
  pod_privileged = lib.mkOption {
    type = lib.types.nullOr lib.types.bool;
    default = null;
    description = "Run the executor container privileged (Docker inside the Pod needs it); false: non-root, no privilege escalation, all capabilities dropped, RuntimeDefault seccomp. Environment variable: POD_PRIVILEGED. Default: true.";
  };
  pod_docker_storage_limit = lib.mkOption {
    type = lib.types.nullOr lib.types.str;
    default = null;
    description = "Size limit of the emptyDir at /var/lib/docker in executor Pods. Environment variable: POD_DOCKER_STORAGE_LIMIT. Default: 20Gi.";
  };
  pod_active_deadline = lib.mkOption {
    type = lib.types.nullOr lib.types.str;
    default = null;
    description = "activeDeadlineSeconds of executor Pods, as a duration. Environment variable: POD_ACTIVE_DEADLINE. Default: 3h 10m.";
  };
  pod_automount_service_account_token = lib.mkOption {
    type = lib.types.nullOr lib.types.bool;
    default = null;
    description = "Mount the service account token into executor Pods. Environment variable: POD_AUTOMOUNT_SERVICE_ACCOUNT_TOKEN. Default: false.";
  };
  pod_executor_args = lib.mkOption {
    type = lib.types.nullOr (lib.types.listOf lib.types.str);
    default = null;
    description = "Arguments of the executor container. Environment variable: POD_EXECUTOR_ARGS. Default: [ \"executor\" ].";
  };
  pod_executor_env = lib.mkOption {
    type = lib.types.nullOr (lib.types.attrsOf lib.types.str);
    default = null;
    description = "Extra environment of the executor container (CI_* and SPIFFE_ENDPOINT_SOCKET cannot be overridden). Environment variable: POD_EXECUTOR_ENV. Default: {}.";
  };
  pod_spiffe_csi_driver = lib.mkOption {
    type = lib.types.nullOr lib.types.str;
    default = null;
    description = "CSI driver of the SPIFFE Workload API volume of executor Pods. Environment variable: POD_SPIFFE_CSI_DRIVER. Default: csi.spiffe.io.";
  };
  pod_spiffe_socket_dir = lib.mkOption {
    type = lib.types.nullOr lib.types.str;
    default = null;
    description = "Mount path of the Workload API volume in the executor container. Environment variable: POD_SPIFFE_SOCKET_DIR. Default: /run/spire/agent-sockets.";
  };
  pod_spiffe_socket_name = lib.mkOption {
    type = lib.types.nullOr lib.types.str;
    default = null;
    description = "File name of the Workload API socket in pod_spiffe_socket_dir. Environment variable: POD_SPIFFE_SOCKET_NAME. Default: spire-agent.sock.";
  };
  pod_resources = lib.mkOption {
    type = lib.types.nullOr (lib.types.attrsOf lib.types.anything);
    default = null;
    description = "Requests and limits of executor Pods without a profile ({ requests = { cpu = \"1\"; }; limits = { memory = \"4Gi\"; }; }). Environment variable: POD_RESOURCES. Default: {}.";
  };
  pod_profiles = lib.mkOption {
    type = lib.types.nullOr (lib.types.attrsOf lib.types.anything);
    default = null;
    description = "Per-label Pod profiles: requests, limits, node_selector, tolerations, runtime_class_name, volumes (from pod_volume_allow_list), image; each label is declared to Gitea. Environment variable: POD_PROFILES. Default: {}.";
  };
  pod_profile_max = lib.mkOption {
    type = lib.types.nullOr (lib.types.attrsOf lib.types.anything);
    default = null;
    description = "Upper bounds of any profile's requests and limits, per resource. Environment variable: POD_PROFILE_MAX. Default: {}.";
  };
  pod_volume_allow_list = lib.mkOption {
    type = lib.types.nullOr (lib.types.attrsOf lib.types.anything);
    default = null;
    description = "Volumes profiles may mount, by name, each a Kubernetes volume source. Environment variable: POD_VOLUME_ALLOW_LIST. Default: {}.";
  };
  pod_orphan_secret_grace = lib.mkOption {
    type = lib.types.nullOr lib.types.str;
    default = null;
    description = "Age after which a capability Secret without a Pod is removed. Environment variable: POD_ORPHAN_SECRET_GRACE. Default: 10m.";
  };
  pod_identity_bind_deadline = lib.mkOption {
    type = lib.types.nullOr lib.types.str;
    default = null;
    description = "How long an executor Pod waits for its SVID and the facade before the job is failed with its error. Environment variable: POD_IDENTITY_BIND_DEADLINE. Default: 2m.";
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
    description = "Parent SPIFFE ID of every Pod entry (single-node clusters, node aliases); unset: the agent ID of the node each Pod is scheduled on. Environment variable: SPIRE_AGENT_ID. Default: unset.";
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
  vm_timeout_seconds = lib.mkOption {
    type = lib.types.nullOr lib.types.int;
    default = null;
    description = "Lifetime of a VM sandbox in seconds. Environment variable: VM_TIMEOUT_SECONDS. Default: 14400.";
  };
}
