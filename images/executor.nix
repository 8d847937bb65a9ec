# The executor image: what runs inside each Pod or VM. `nix build .#executor-image` gives a
# script that streams the image tarball (`./result | docker load`).
#
# It matches the Go version's container/runner.Dockerfile:
# - the executor's own binary (`gitea-dynamic-executor`: no controller code, so each job's
#   start loads a fraction of the controller's bytes) as the entrypoint, `executor` as the
#   command (it accepts it, as the controller binary's `executor` alias does);
# - the official, unmodified runner (nixpkgs' gitea-actions-runner), found by the executor
#   through GITEA_RUNNER_BINARY;
# - the userspace host-mode jobs and JavaScript actions expect: Node.js, git, bash, coreutils
#   and the usual text and archive tools;
# - Docker (dockerd, containerd, runc, the CLI and buildx) so jobs can build images inside the
#   Pod or VM;
# - spire-agent for `spire-agent api fetch jwt` in jobs (also at the Go image's
#   /opt/spire/bin/spire-agent, which existing workflows call);
# - the runner user (uid/gid 2000, also in the docker group), /data, and a runner
#   configuration file at /etc/gitea-runner/config.yaml.
#
# The Go image's job-started hook and its sudo are not here: the executor starts as root
# (CI_EXECUTOR_SANDBOXED marks it as its Pod's or VM's own), prepares what the job's Docker
# daemon needs (loop-backed /var/lib/docker where the root file system cannot hold
# overlay, creating the loop device nodes a Kata guest lacks; cgroup v2 delegation),
# links the SPIRE agent's socket to /run/spire/agent-sockets/spire-agent.sock, starts
# CI_DOCKERD, waits until it answers (CI_DOCKER_READY_TIMEOUT), then runs the rest of
# itself, the runner and the job as CI_RUNNER_UID (the runner user, 2000) with the docker
# group, and stops the daemon after the job. CI_RUNNER_START_DOCKER=false switches the
# daemon off. In a privileged Pod the daemon and its preparation are the Pod's dockerd
# sidecar's (the same image with CI_EXECUTOR_DOCKERD_ONLY=true) and the executor only
# waits for it (CI_DOCKER_EXTERNAL=true), keeping its container's cgroup for SPIRE's k8s
# attestor (docs/pod-backend.md). The runner reads its configuration from
# CI_RUNNER_CONFIG (`--config`).
{
  lib,
  pkgs,
  package,
}:
let
  uid = 2000;
  dockerGid = 2001;

  runner = pkgs.gitea-actions-runner;
  spireAgent = pkgs.spire.agent or pkgs.spire;

  # The official runner's configuration (keys of its config.example.yaml). JSON is YAML.
  # - runner.file: the executor writes the one-shot `.runner` into the runner's working
  #   directory, so the default relative name is kept explicit;
  # - runner.timeout: Gitea's ENDLESS_TASK_TIMEOUT (3 h) bounds a job anyway;
  # - cache.enabled = false: the actions cache server would be local to a disposable Pod;
  # - host.workdir_parent: job workspaces on the /data volume instead of $HOME/.cache.
  runnerConfig = pkgs.writeTextDir "etc/gitea-runner/config.yaml" (
    builtins.toJSON {
      log.level = "info";
      runner = {
        file = ".runner";
        capacity = 1;
        timeout = "3h";
        fetch_timeout = "5s";
        fetch_interval = "2s";
      };
      cache.enabled = false;
      host.workdir_parent = "/data/workspace";
    }
  );

  etc = pkgs.runCommand "gitea-dynamic-runner-executor-etc" { } ''
    mkdir -p $out/etc
    cat > $out/etc/passwd <<EOF
    root:x:0:0:root:/root:/bin/bash
    runner:x:${toString uid}:${toString uid}:runner:/home/runner:/bin/bash
    nobody:x:65534:65534:nobody:/var/empty:/sbin/nologin
    EOF
    cat > $out/etc/group <<EOF
    root:x:0:
    runner:x:${toString uid}:
    docker:x:${toString dockerGid}:runner
    nogroup:x:65534:
    EOF
    echo 'hosts: files dns' > $out/etc/nsswitch.conf
  '';

  userland = with pkgs; [
    bashInteractive
    coreutils
    findutils
    gnugrep
    gnused
    gawk
    gnutar
    gzip
    xz
    zstd
    unzip
    curl
    jq
    gitMinimal
    openssh
    nodejs
    procps
    util-linux # mount, losetup: Docker storage on a loop device inside a Kata guest
    e2fsprogs # mkfs.ext4 for that loop device
    iptables # dockerd's bridge networking
    docker
    containerd
    runc
    docker-buildx
  ];

  certs = "${pkgs.cacert}/etc/ssl/certs/ca-bundle.crt";
in
pkgs.dockerTools.streamLayeredImage {
  name = "gitea-dynamic-runner/executor";
  tag = package.version;

  contents = [
    package
    runner
    spireAgent
    pkgs.cacert
    runnerConfig
    etc
  ]
  ++ userland;

  fakeRootCommands = ''
    mkdir -p tmp root home/runner data/workspace var/lib/docker run opt/spire/bin \
      usr/bin usr/libexec/docker/cli-plugins
    chmod 1777 tmp
    chmod 0700 root
    chown -R ${toString uid}:${toString uid} home/runner data
    ln -s /run var/run
    ln -s ${pkgs.coreutils}/bin/env usr/bin/env
    ln -s ${lib.getExe' spireAgent "spire-agent"} opt/spire/bin/spire-agent
    ln -s ${pkgs.docker-buildx}/libexec/docker/cli-plugins/docker-buildx \
      usr/libexec/docker/cli-plugins/docker-buildx
  '';

  config = {
    # Root only until the executor has prepared the job's environment and started dockerd;
    # the job runs as CI_RUNNER_UID. A Pod with pod_privileged = false runs the container
    # as pod_executor_uid instead (no Docker), which a runAsNonRoot cluster accepts.
    User = "0:0";
    Entrypoint = [ "${package}/bin/gitea-dynamic-executor" ];
    Cmd = [ "executor" ];
    WorkingDir = "/home/runner";
    Volumes."/data" = { };
    Env = [
      "PATH=/bin:/usr/bin"
      "HOME=/home/runner"
      "GITEA_RUNNER_BINARY=${lib.getExe runner}"
      "CI_RUNNER_CONFIG=/etc/gitea-runner/config.yaml"
      "CI_DOCKERD=${lib.getExe' pkgs.docker "dockerd"}"
      "CI_EXECUTOR_SANDBOXED=true"
      "CI_RUNNER_UID=${toString uid}"
      "SSL_CERT_FILE=${certs}"
      "NIX_SSL_CERT_FILE=${certs}"
      "GIT_SSL_CAINFO=${certs}"
    ];
    Labels = {
      "org.opencontainers.image.title" = "gitea-dynamic-runner executor";
      "org.opencontainers.image.version" = package.version;
      "org.opencontainers.image.licenses" = "Apache-2.0";
    };
  };
}
