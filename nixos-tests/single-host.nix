# One VM: a real Gitea (nixpkgs' services.gitea, Actions on), NATS with JetStream
# (services.nats through our module's nats.enable) and our module with the process backend
# running the real official runner (nixpkgs' gitea-actions-runner) for both `pod` and `vm`
# jobs. The test script creates the admin user and the repository, starts the controller,
# whose first start registers it with the module's registrationTokenFile (the one-command
# start), pushes workflows and reads every result back through Gitea's API:
#   1. a [self-hosted, pod] and a [self-hosted, vm] job both succeed with their log lines;
#   2. `systemctl restart` while a job runs: the executor process survives, the job succeeds
#      and its output after the restart reaches Gitea (DESIGN invariant 19);
#   3. `systemctl stop` while a job runs: nothing of the unit is left running.
#
# Peers' limits this test stays inside: Gitea fails a task whose runner is silent for 10 min
# (the controller's heartbeats cover queued tasks); the official runner gives up a final
# report after 10 s (the executor buffers it across the restart). Every wait below is a poll
# of observable state with a deadline (Gitea helpers: ./gitea.nix).
{
  lib,
  pkgs,
  module,
  ...
}:
let
  gitea = import ./gitea.nix { host = "localhost"; };
  stateDir = "/var/lib/gitea-dynamic-runner";
  # Where the host sees the DynamicUser state directory.
  hostStateDir = "/var/lib/private/gitea-dynamic-runner";

  workflows = {
    backends = ''
      on:
        push:
          branches: [backends]
      jobs:
        pod-job:
          runs-on: [self-hosted, pod]
          steps:
            - run: echo "pod backend ran job $GITHUB_JOB"
        vm-job:
          runs-on: [self-hosted, vm]
          steps:
            - run: echo "vm backend ran job $GITHUB_JOB"
    '';
    restart = ''
      on:
        push:
          branches: [restart]
      jobs:
        restart-job:
          runs-on: [self-hosted, pod]
          steps:
            - run: echo "restart job started" && touch ${stateDir}/restart-job-started
            - run: |
                while [ ! -e ${stateDir}/restart-job-release ]; do sleep 1; done
                echo "restart job finished after the controller restart"
    '';
    stop = ''
      on:
        push:
          branches: [stop]
      jobs:
        stop-job:
          runs-on: [self-hosted, pod]
          steps:
            - run: |
                touch ${stateDir}/stop-job-started
                while true; do sleep 1; done
    '';
  };
  workflowFiles = lib.mapAttrs (name: text: pkgs.writeText "${name}.yml" text) workflows;
in
{
  name = "gitea-dynamic-runner-single-host";

  nodes.machine =
    { config, pkgs, ... }:
    {
      imports = [ module ];

      virtualisation.memorySize = 3072;
      virtualisation.diskSize = 4096;

      environment.systemPackages = [
        config.services.gitea.package
        pkgs.curl
        pkgs.git
        pkgs.jq
        pkgs.procps
      ];

      services.gitea = {
        enable = true;
        inherit (gitea) settings;
      };

      # Test secrets, generated at boot outside the store (a real host would use agenix,
      # sops-nix or systemd-creds). The registration token is written by the test script
      # once Gitea is up.
      systemd.services.gdr-test-secrets = {
        wantedBy = [ "multi-user.target" ];
        before = [ "nats.service" ];
        requiredBy = [ "nats.service" ];
        serviceConfig = {
          Type = "oneshot";
          RemainAfterExit = true;
        };
        path = [ pkgs.coreutils ];
        script = ''
          install -d -m 0700 /run/gdr-secrets
          head -c 48 /dev/urandom | base64 -w0 > /run/gdr-secrets/capability-key
          head -c 32 /dev/urandom | base64 -w0 | tr -d '+/=' > /run/gdr-secrets/nats-producer
          head -c 32 /dev/urandom | base64 -w0 | tr -d '+/=' > /run/gdr-secrets/nats-worker
          chmod 0600 /run/gdr-secrets/*
        '';
      };

      services.gitea-dynamic-runner = {
        enable = true;
        registrationTokenFile = "/run/gdr-secrets/registration-token";
        capabilityKeyFile = "/run/gdr-secrets/capability-key";
        natsProducerPasswordFile = "/run/gdr-secrets/nats-producer";
        natsWorkerPasswordFile = "/run/gdr-secrets/nats-worker";
        nats.enable = true;
        settings = {
          gitea_instance_url = "http://localhost:3000";
          trust_domain = "test.local";
          # With nats_url set the backends would default to kubernetes/opensandbox.
          pod_backend = "process";
          vm_backend = "process";
          local_identity = true;
          pod_capacity = 2;
          vm_capacity = 1;
          runner_facade_listen = "127.0.0.1:8443";
          runner_facade_url = "https://127.0.0.1:8443";
          runner_facade_spiffe_id = "spiffe://test.local/gitea-dynamic-runner/facade";
          health_listen = "127.0.0.1:9090";
        };
      };
      # Started by the test script once the registration token exists.
      systemd.services.gitea-dynamic-runner.wantedBy = lib.mkForce [ ];
    };

  testScript = gitea.testHelpers + ''
    STATE = "${hostStateDir}"
    # The executor's own binary, next to the controller's in the package (issue 39).
    EXECUTOR = "pgrep -f 'bin/gitea-dynamic-executor executor'"

    start_all()
    machine.wait_for_unit("nats.service")

    with subtest("Gitea: an admin, a token and a repository with Actions"):
        token, api = gitea_setup(machine)

    with subtest("the controller's first start registers it and it becomes ready"):
        runner_registration_token(machine, "/run/gdr-secrets/registration-token")
        machine.succeed("systemctl start gitea-dynamic-runner.service")
        machine.wait_for_unit("gitea-dynamic-runner.service")
        machine.wait_until_succeeds(f"test -s {STATE}/runner-uuid && test -s {STATE}/runner-token", timeout=120)
        machine.succeed(f"test \"$(stat -c %a {STATE}/runner-token)\" = 600")
        machine.wait_until_succeeds("curl -sSf http://127.0.0.1:9090/readyz", timeout=120)

    with subtest("a pod job and a vm job both succeed with their output"):
        push(machine, "backends", "${workflowFiles.backends}")
        assert_job_succeeded_with(machine, token, api, "pod-job", "pod backend ran job pod-job")
        assert_job_succeeded_with(machine, token, api, "vm-job", "vm backend ran job vm-job")

    with subtest("a restart mid-job keeps the executor and the job still succeeds"):
        push(machine, "restart", "${workflowFiles.restart}")
        machine.wait_until_succeeds(f"test -e {STATE}/restart-job-started", timeout=600)
        before = machine.succeed(EXECUTOR).split()
        assert before, "no executor process while the restart job runs"
        # Registered: the token is no longer needed, and the unit starts without it.
        machine.succeed("rm /run/gdr-secrets/registration-token")
        machine.succeed("systemctl restart gitea-dynamic-runner.service")
        machine.wait_for_unit("gitea-dynamic-runner.service")
        machine.fail("test -e /run/gitea-dynamic-runner/registration-token")
        for pid in before:
            machine.succeed(f"kill -0 {pid}")
        machine.wait_until_succeeds("curl -sSf http://127.0.0.1:9090/readyz", timeout=120)
        machine.succeed(f"touch {STATE}/restart-job-release")
        assert_job_succeeded_with(
            machine, token, api, "restart-job", "restart job finished after the controller restart"
        )

    with subtest("a stop ends executors and jobs with the service"):
        push(machine, "stop", "${workflowFiles.stop}")
        machine.wait_until_succeeds(f"test -e {STATE}/stop-job-started", timeout=600)
        machine.succeed(EXECUTOR)
        machine.succeed("systemctl stop gitea-dynamic-runner.service")
        machine.fail(EXECUTOR)
        # Nothing at all runs as the unit's (dynamic) user any more: no runner, no job shell.
        machine.fail("pgrep -u $(stat -c %u ${hostStateDir})")
  '';
}
