# What nixos-tests/cluster.nix deploys into k3s on top of deploy/kubernetes/base (copied in
# as `base/`): the test's kustomize overlay, the controller's config.toml, the files of the
# controller's Secret, and the addresses the controller dials.
#
# Pure (no pkgs), so tests/deploy.rs renders exactly this (evaluated with nix-instantiate,
# dummy Secret files) with `kubectl kustomize` and checks it against the base: every name the
# overlay replaces or patches exists, no CSI volume is left (the test cluster has no SPIFFE
# CSI driver) and the controller's NetworkPolicy admits every address below.
{ version }:
let
  trustDomain = "test.local";
  # The VM's address: Gitea, NATS and the k3s API server (its `kubernetes` endpoint) all
  # listen on the node.
  nodeIp = "192.168.1.2";
  ports = {
    gitea = 3000;
    nats = 4222;
    apiServer = 6443;
  };
  # The facade Service's ClusterIP, pinned: no CoreDNS in this offline cluster.
  facadeIp = "10.43.0.100";
  imageRef = kind: "gitea-dynamic-runner/${kind}:${version}";
  secretDir = "/run/secrets/gitea-dynamic-runner";
  # services.spire.agent's default socket directory on the node, mounted where the base
  # mounts the CSI volume.
  agentSocketDir = "/run/spire/agent/public";
  secretFiles = [
    "gitea-runner-uuid"
    "gitea-runner-token"
    "capability-key"
    "nats-producer-password"
    "nats-worker-password"
  ];
  egressTo = port: ''
    - to:
        - ipBlock:
            cidr: ${nodeIp}/32
      ports:
        - port: ${toString port}
          protocol: TCP
  '';
  indent =
    prefix: text:
    builtins.concatStringsSep "\n" (
      map (line: if line == "" then "" else prefix + line) (builtins.filter builtins.isString (builtins.split "\n" text))
    );
in
{
  inherit
    trustDomain
    nodeIp
    ports
    facadeIp
    agentSocketDir
    secretFiles
    ;
  controllerImage = imageRef "controller";
  executorImage = imageRef "executor";

  # File name (relative to the overlay directory) → content. The Secret's files come from the
  # test (secrets/<name> for each of secretFiles).
  files = {
    "kustomization.yaml" = ''
      apiVersion: kustomize.config.k8s.io/v1beta1
      kind: Kustomization
      resources:
        - base
      # The base's placeholders, replaced by the test's configuration and credentials.
      configMapGenerator:
        - name: gitea-dynamic-runner
          namespace: gitea-actions
          behavior: replace
          files:
            - config.toml
      secretGenerator:
        - name: gitea-dynamic-runner
          namespace: gitea-actions
          behavior: replace
          files:
      ${indent "      " (builtins.concatStringsSep "\n" (map (f: "- secrets/${f}") secretFiles))}
      generatorOptions:
        disableNameSuffixHash: true
      patches:
        # One replica with the imported image (never pulled); the agent's socket from the
        # node instead of the SPIFFE CSI driver, which nixpkgs does not package.
        - target:
            kind: Deployment
            name: gitea-dynamic-runner
          patch: |-
            apiVersion: apps/v1
            kind: Deployment
            metadata:
              name: gitea-dynamic-runner
            spec:
              replicas: 1
              template:
                spec:
                  containers:
                    - name: controller
                      image: ${imageRef "controller"}
                      imagePullPolicy: Never
                  volumes:
                    - name: spiffe-workload-api
                      csi: null
                      hostPath:
                        path: ${agentSocketDir}
                        type: Directory
        - target:
            kind: Service
            name: gitea-dynamic-runner-facade
          patch: |-
            - op: add
              path: /spec/clusterIP
              value: ${facadeIp}
        # k3s enforces NetworkPolicy: the controller reaches Gitea, NATS and the API server,
        # all on the node.
        - target:
            kind: NetworkPolicy
            name: controller
          patch: |-
            - op: replace
              path: /spec/egress
              value:
      ${indent "          " (egressTo ports.gitea + egressTo ports.nats + egressTo ports.apiServer)}
    '';

    "config.toml" = ''
      components = "scheduler,pod-worker"
      gitea_instance_url = "http://${nodeIp}:${toString ports.gitea}"
      gitea_runner_uuid_file = "${secretDir}/gitea-runner-uuid"
      gitea_runner_token_file = "${secretDir}/gitea-runner-token"
      runner_facade_capability_key_file = "${secretDir}/capability-key"
      trust_domain = "${trustDomain}"
      nats_url = "nats://${nodeIp}:${toString ports.nats}"
      nats_producer_password_file = "${secretDir}/nats-producer-password"
      nats_worker_password_file = "${secretDir}/nats-worker-password"
      runner_facade_listen = "0.0.0.0:8443"
      runner_facade_url = "https://${facadeIp}:8443"
      runner_facade_spiffe_id = "spiffe://${trustDomain}/gitea-dynamic-runner/facade"
      spiffe_endpoint_socket = "unix:///run/spire/agent-sockets/api.sock"
      health_listen = "0.0.0.0:9090"
      state_dir = "/var/lib/gitea-dynamic-runner"
      # The Secret volume's files are 0440 (the base's defaultMode 0400 plus the fsGroup's
      # read bit).
      secret_file_permissions = "group-readable"
      pod_backend = "kubernetes"
      pod_capacity = 2
      vm_capacity = 0
      pod_namespace = "gitea-actions"
      pod_service_account = "gitea-task-executor"
      pod_executor_image = "${imageRef "executor"}"
      pod_spiffe_socket_name = "api.sock"
      # No SPIFFE CSI driver in the test cluster: executor Pods mount the agent's directory.
      pod_spiffe_host_path = "${agentSocketDir}"
      spire_agent_id = "spiffe://${trustDomain}/node"
      spire_cluster = "test"
      lease_namespace = "gitea-actions"
    '';
  };
}
