# One VM: a real Gitea (nixpkgs' services.gitea, Actions on), NATS with JetStream
# (services.nats through our module's nats.enable) and our module with the process backend
# running the real official runner (nixpkgs' gitea-actions-runner) for both `pod` and `vm`
# jobs. The test script creates the admin user and the repository, registers the controller
# through the module (ExecStartPre runs `gitea-dynamic-runner register`), pushes workflows and
# reads every result back through Gitea's API:
#   1. a [self-hosted, pod] and a [self-hosted, vm] job both succeed with their log lines;
#   2. `systemctl restart` while a job runs: the executor process survives, the job succeeds
#      and its output after the restart reaches Gitea (DESIGN invariant 19);
#   3. `systemctl stop` while a job runs: nothing of the unit is left running.
#
# Peers' limits this test stays inside: Gitea fails a task whose runner is silent for 10 min
# (the controller's heartbeats cover queued tasks); the official runner gives up a final
# report after 10 s (the executor buffers it across the restart). Every wait below is a poll
# of observable state with a deadline.
#
# Gitea API used (go-gitea/gitea routers/api/v1/api.go): POST /user/repos,
# PATCH /repos/{owner}/{repo}, GET /repos/{owner}/{repo}/actions/jobs and
# GET /repos/{owner}/{repo}/actions/jobs/{job_id}/logs (the latter two: Gitea >= 1.25).
{
  lib,
  pkgs,
  module,
  ...
}:
let
  adminPassword = "correct-horse-battery-staple";
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
        settings = {
          server = {
            HTTP_PORT = 3000;
            DOMAIN = "localhost";
            ROOT_URL = "http://localhost:3000/";
          };
          service.DISABLE_REGISTRATION = true;
          actions.ENABLED = true;
        };
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

  testScript = ''
    import json
    import shlex

    GITEA = "http://localhost:3000"
    STATE = "${hostStateDir}"
    EXECUTOR = "pgrep -f 'bin/gitea-dynamic-runner executor'"

    start_all()
    machine.wait_for_unit("gitea.service")
    machine.wait_for_open_port(3000)
    machine.wait_for_unit("nats.service")

    with subtest("Gitea: an admin, a token and a repository with Actions"):
        machine.succeed(
            "su -l gitea -c 'GITEA_WORK_DIR=/var/lib/gitea gitea admin user create "
            "--admin --username admin --password ${adminPassword} --email admin@localhost "
            "--must-change-password=false'"
        )
        token = json.loads(machine.succeed(
            "curl -sSf -X POST -u admin:${adminPassword} -H 'Content-Type: application/json' "
            + GITEA + "/api/v1/users/admin/tokens -d "
            + shlex.quote(json.dumps({"name": "test", "scopes": ["write:repository", "write:user", "write:admin"]}))
        ))["sha1"]

        def api(path, method="GET", data=None):
            cmd = (f"curl -sSf -X {method} -H 'Authorization: token {token}' "
                   f"-H 'Content-Type: application/json' {GITEA}/api/v1{path}")
            if data is not None:
                cmd += " -d " + shlex.quote(json.dumps(data))
            return machine.succeed(cmd)

        api("/user/repos", "POST", {"name": "ci", "auto_init": False, "private": False})
        api("/repos/admin/ci", "PATCH", {"has_actions": True})

    with subtest("the controller registers through `register` and becomes ready"):
        machine.succeed(
            "su -l gitea -c 'GITEA_WORK_DIR=/var/lib/gitea gitea actions generate-runner-token' "
            "| tail -n1 | tr -d '[:space:]' > /run/gdr-secrets/registration-token"
        )
        machine.succeed("test -s /run/gdr-secrets/registration-token")
        machine.succeed("systemctl start gitea-dynamic-runner.service")
        machine.wait_for_unit("gitea-dynamic-runner.service")
        machine.succeed(f"test -s {STATE}/runner-uuid && test -s {STATE}/runner-token")
        machine.succeed(f"test \"$(stat -c %a {STATE}/runner-token)\" = 600")
        machine.wait_until_succeeds("curl -sSf http://127.0.0.1:9090/readyz", timeout=120)

    def push(branch, workflow):
        machine.succeed(
            f"rm -rf /tmp/{branch} && git init -q -b {branch} /tmp/{branch} && "
            f"mkdir -p /tmp/{branch}/.gitea/workflows && "
            f"cp {workflow} /tmp/{branch}/.gitea/workflows/{branch}.yml && "
            f"git -C /tmp/{branch} add . && "
            f"git -C /tmp/{branch} -c user.name=test -c user.email=test@localhost commit -q -m {branch} && "
            f"git -C /tmp/{branch} push -q http://admin:${adminPassword}@localhost:3000/admin/ci.git {branch}"
        )

    def job(name):
        jobs = json.loads(api("/repos/admin/ci/actions/jobs?limit=50"))["jobs"]
        matching = [j for j in jobs if j["name"] == name]
        return matching[0] if matching else None

    def wait_completed(name, timeout=600):
        machine.wait_until_succeeds(
            f"curl -sSf -H 'Authorization: token {token}' {GITEA}/api/v1/repos/admin/ci/actions/jobs?limit=50 "
            f"| jq -e --arg n {name} '.jobs[] | select(.name == $n and .status == \"completed\")'",
            timeout=timeout,
        )
        return job(name)

    def assert_succeeded_with(name, line):
        j = wait_completed(name)
        assert j["conclusion"] == "success", f"{name}: conclusion {j['conclusion']!r}"
        log = api(f"/repos/admin/ci/actions/jobs/{j['id']}/logs")
        assert line in log, f"{name}: {line!r} not in its log:\n{log}"

    with subtest("a pod job and a vm job both succeed with their output"):
        push("backends", "${workflowFiles.backends}")
        assert_succeeded_with("pod-job", "pod backend ran job pod-job")
        assert_succeeded_with("vm-job", "vm backend ran job vm-job")

    with subtest("a restart mid-job keeps the executor and the job still succeeds"):
        push("restart", "${workflowFiles.restart}")
        machine.wait_until_succeeds(f"test -e {STATE}/restart-job-started", timeout=600)
        before = machine.succeed(EXECUTOR).split()
        assert before, "no executor process while the restart job runs"
        machine.succeed("systemctl restart gitea-dynamic-runner.service")
        machine.wait_for_unit("gitea-dynamic-runner.service")
        for pid in before:
            machine.succeed(f"kill -0 {pid}")
        machine.wait_until_succeeds("curl -sSf http://127.0.0.1:9090/readyz", timeout=120)
        machine.succeed(f"touch {STATE}/restart-job-release")
        assert_succeeded_with("restart-job", "restart job finished after the controller restart")

    with subtest("a stop ends executors and jobs with the service"):
        push("stop", "${workflowFiles.stop}")
        machine.wait_until_succeeds(f"test -e {STATE}/stop-job-started", timeout=600)
        machine.succeed(EXECUTOR)
        machine.succeed("systemctl stop gitea-dynamic-runner.service")
        machine.fail(EXECUTOR)
        # Nothing at all runs as the unit's (dynamic) user any more: no runner, no job shell.
        machine.fail("pgrep -u $(stat -c %u ${hostStateDir})")
  '';
}
