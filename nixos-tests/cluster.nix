# One VM: k3s (services.k3s), Gitea (services.gitea) and NATS with JetStream (services.nats)
# on the node, SPIRE server and agent from nixpkgs (services.spire.{server,agent}), the
# Nix-built controller and executor images imported into k3s' containerd, and the controller
# deployed from deploy/kubernetes/ (issue 11's kustomize base) through a test overlay. A
# `[self-hosted, pod]` job then runs end to end through the Pod backend: Gitea → scheduler →
# JetStream → pod-worker → a fresh Pod from the executor image → the official runner →
# facade → Gitea, and the test reads the result back from Gitea's API.
#
# What nixpkgs lacks, and what stands in for it here:
# - spire-controller-manager (turns ClusterStaticEntry objects into SPIRE entries): not
#   packaged. The test registers the ClusterStaticEntry CRD (so the pod-worker's API calls are
#   accepted; nothing reconciles the objects) and creates the two SPIRE entries statically with
#   `spire-server entry create`: the facade's (unix:uid:65532) and the job's
#   (unix:uid:2000, SPIFFE ID spiffe://test.local/ci/admin/ci/pod-job, DESIGN invariant 13).
#   The agent attests workloads with the `unix` plugin, which sees container processes'
#   host-side uids (k3s runs no user namespaces). k8s_psat node attestation with
#   use_pod_uid_for_agent_id (the production parent ID) is therefore not exercised.
# - the SPIFFE CSI driver: not packaged; the overlay mounts the agent's socket directory into
#   the controller with hostPath instead of the base's csi.spiffe.io volume, and executor Pods
#   get the same directory through `pod_spiffe_host_path` (cluster-manifests.nix).
# - OpenSandbox and Kata: see nixos-tests/README.md; the vm backend is off (vm_capacity = 0).
#
# What is deployed on top of deploy/kubernetes/base (the overlay, the configuration, the
# Secret's files, the addresses) is nixos-tests/cluster-manifests.nix, which
# tests/deploy.rs renders with kubectl kustomize in every CI run and checks against the base
# (names, no CSI volume, the NetworkPolicy admitting Gitea, NATS and the API server).
#
# Never run here (no KVM, no Nix binary cache): see nixos-tests/README.md.
{
  lib,
  pkgs,
  package,
  controller-image,
  executor-image,
  deployDir,
  ...
}:
let
  manifests = import ./cluster-manifests.nix { inherit (package) version; };
  inherit (manifests) trustDomain nodeIp;
  gitea = import ./gitea.nix { host = nodeIp; };
  natsPasswords = {
    producer = "test-producer-password";
    worker = "test-worker-password";
  };
  overlayFiles = lib.mapAttrs (name: text: pkgs.writeText (baseNameOf name) text) manifests.files;

  pauseImage = pkgs.dockerTools.streamLayeredImage {
    name = "test.local/pause";
    tag = "local";
    contents = [ pkgs.tini ];
    config.Entrypoint = [
      "/bin/tini"
      "--"
      "${pkgs.coreutils}/bin/sleep"
      "inf"
    ];
  };

  # Enough of spire-controller-manager's CRD for the API server to store the objects the
  # pod-worker creates. Written for this test, not copied from upstream.
  clusterStaticEntryCrd = pkgs.writeText "clusterstaticentry-crd.yaml" ''
    apiVersion: apiextensions.k8s.io/v1
    kind: CustomResourceDefinition
    metadata:
      name: clusterstaticentries.spire.spiffe.io
    spec:
      group: spire.spiffe.io
      scope: Cluster
      names:
        kind: ClusterStaticEntry
        listKind: ClusterStaticEntryList
        plural: clusterstaticentries
        singular: clusterstaticentry
      versions:
        - name: v1alpha1
          served: true
          storage: true
          subresources:
            status: {}
          schema:
            openAPIV3Schema:
              type: object
              x-kubernetes-preserve-unknown-fields: true
  '';

  workflow = pkgs.writeText "pod.yml" ''
    on:
      push:
        branches: [pod]
    jobs:
      pod-job:
        runs-on: [self-hosted, pod]
        steps:
          - run: |
              echo "pod job ran as uid $(id -u) in $(hostname)"
              spire-agent api fetch jwt -audience cluster-test \
                -socketPath /run/spire/agent-sockets/api.sock > /dev/null
              echo "pod job holds its SVID"
  '';
in
{
  name = "gitea-dynamic-runner-cluster";

  nodes.machine =
    { config, pkgs, ... }:
    {
      virtualisation.memorySize = 4096;
      virtualisation.diskSize = 8192;
      virtualisation.cores = 2;
      networking.interfaces.eth1.ipv4.addresses = lib.mkForce [
        {
          address = nodeIp;
          prefixLength = 24;
        }
      ];
      networking.firewall.enable = false;

      environment.systemPackages = [
        config.services.gitea.package
        config.services.spire.server.package
        pkgs.curl
        pkgs.git
        pkgs.jq
      ];

      services.k3s = {
        enable = true;
        role = "server";
        # Offline: no CoreDNS, ingress, load balancer or metrics images to pull.
        extraFlags = lib.concatStringsSep " " [
          "--disable coredns"
          "--disable local-storage"
          "--disable metrics-server"
          "--disable servicelb"
          "--disable traefik"
          "--pause-image test.local/pause:local"
          "--node-ip ${nodeIp}"
        ];
      };

      services.gitea = {
        enable = true;
        inherit (gitea) settings;
      };

      # Test credentials in the store are acceptable in a hermetic VM test only.
      services.nats = {
        enable = true;
        jetstream = true;
        settings = {
          host = "0.0.0.0";
          authorization.users = [
            {
              user = "ci-producer";
              password = natsPasswords.producer;
            }
            {
              user = "ci-worker";
              password = natsPasswords.worker;
            }
          ];
        };
      };

      services.spire.server = {
        enable = true;
        settings = {
          server.trust_domain = trustDomain;
          plugins = {
            DataStore.sql.plugin_data = {
              database_type = "sqlite3";
              connection_string = "$STATE_DIRECTORY/datastore.sqlite3";
            };
            KeyManager.memory.plugin_data = { };
            NodeAttestor.join_token.plugin_data = { };
          };
        };
      };

      services.spire.agent = {
        enable = true;
        settings = {
          agent = {
            trust_domain = trustDomain;
            server_address = "127.0.0.1";
            join_token_file = "/run/spire-join-token";
            # The test's only trust anchor is this server; bootstrap without a bundle.
            insecure_bootstrap = true;
          };
          plugins = {
            KeyManager.memory.plugin_data = { };
            NodeAttestor.join_token.plugin_data = { };
            WorkloadAttestor.unix.plugin_data = { };
          };
        };
      };
      # The join token exists only after the server is up (test script).
      systemd.services.spire-agent.wantedBy = lib.mkForce [ ];
      # The module's UMask 0027 would leave the socket's directory closed to the controller
      # (uid 65532) and the job (uid 2000), which reach it through a hostPath mount.
      systemd.services.spire-agent.serviceConfig.UMask = lib.mkForce "0022";
    };

  testScript = gitea.testHelpers + ''
    K = "k3s kubectl"

    start_all()
    machine.wait_for_unit("k3s.service")
    machine.succeed("${pauseImage} | k3s ctr image import -")
    machine.succeed("${controller-image} | k3s ctr image import -")
    machine.succeed("${executor-image} | k3s ctr image import -")
    machine.wait_until_succeeds(f"{K} get serviceaccount default", timeout=300)

    with subtest("SPIRE: an attested agent and static entries for the facade and the job"):
        machine.wait_for_unit("spire-server.service")
        machine.wait_until_succeeds("spire-server healthcheck -socketPath /run/spire/server/private/api.sock")
        machine.succeed(
            "spire-server token generate -socketPath /run/spire/server/private/api.sock "
            "-spiffeID spiffe://${trustDomain}/node | awk '{print $2}' > /run/spire-join-token"
        )
        machine.succeed("systemctl start spire-agent.service")
        machine.wait_until_succeeds("test -S /run/spire/agent/public/api.sock", timeout=120)
        for spiffe_id, uid in [
            ("spiffe://${trustDomain}/gitea-dynamic-runner/facade", 65532),
            ("spiffe://${trustDomain}/ci/admin/ci/pod-job", 2000),
        ]:
            machine.succeed(
                "spire-server entry create -socketPath /run/spire/server/private/api.sock "
                f"-parentID spiffe://${trustDomain}/node -spiffeID {spiffe_id} -selector unix:uid:{uid}"
            )
        machine.succeed(f"{K} apply -f ${clusterStaticEntryCrd}")

    with subtest("Gitea: admin, repository, registration of the controller's runner"):
        token, api = gitea_setup(machine)
        # `register` with the packaged binary, writing the files the overlay's
        # secretGenerator turns into the Secret the Deployment mounts
        # (cluster-manifests.nix: secretFiles).
        machine.succeed("rm -rf /tmp/overlay && install -d -m 0700 /tmp/overlay/secrets /tmp/registration")
        runner_registration_token(machine, "/tmp/registration/token")
        machine.succeed(
            "head -c 48 /dev/urandom | base64 -w0 > /tmp/overlay/secrets/capability-key && "
            "printf %s ${natsPasswords.producer} > /tmp/overlay/secrets/nats-producer-password && "
            "printf %s ${natsPasswords.worker} > /tmp/overlay/secrets/nats-worker-password"
        )
        machine.succeed(
            "${lib.getExe package} register --set gitea_instance_url=http://${nodeIp}:${toString manifests.ports.gitea} "
            "--set gitea_runner_uuid_file=/tmp/overlay/secrets/gitea-runner-uuid "
            "--set gitea_runner_token_file=/tmp/overlay/secrets/gitea-runner-token "
            "--set components=scheduler,pod-worker --set vm_capacity=0 "
            "--registration-token-file /tmp/registration/token"
        )
        for name in ${builtins.toJSON manifests.secretFiles}:
            machine.succeed(f"test -s /tmp/overlay/secrets/{name}")

    with subtest("the controller from deploy/kubernetes/ becomes ready"):
        # The base as `base/` beside the overlay's files: what tests/deploy.rs renders.
        machine.succeed(
            "cp -r ${deployDir} /tmp/overlay/base && chmod -R u+w /tmp/overlay/base && "
            + " && ".join(
                f"cp {source} /tmp/overlay/{name}"
                for name, source in ${builtins.toJSON overlayFiles}.items()
            )
        )
        machine.succeed(f"{K} apply -k /tmp/overlay")
        machine.wait_until_succeeds(
            f"{K} -n gitea-actions rollout status deployment/gitea-dynamic-runner --timeout=10s",
            timeout=600,
        )

    with subtest("a pod job runs in a fresh Pod and succeeds with its output"):
        push(machine, "pod", "${workflow}")
        assert_job_succeeded_with(
            machine, token, api, "pod-job", "pod job ran as uid 2000", "pod job holds its SVID",
            timeout=900,
        )

    with subtest("the executor Pod is gone once the result is reported"):
        machine.wait_until_succeeds(
            f"test -z \"$({K} -n gitea-actions get pods -l ci.ddupan.top/assignment-id -o name)\"",
            timeout=300,
        )
  '';
}
