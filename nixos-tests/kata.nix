# The Kata layer under the VM backend, on its own: k3s in a test VM with nixpkgs'
# kata-runtime as the containerd shim behind a RuntimeClass `kata`, and the project's
# executor image run in a Kata microVM (nested KVM: the test VM starts the Kata VM).
#
# What it proves: the RuntimeClass wiring works with the Nix-built images (a Pod with
# runtimeClassName kata runs in a guest kernel that is not the node's, and the executor image's
# binary runs there). What it cannot prove, and why:
# - the VM backend itself (vm_backend = "opensandbox") asks an OpenSandbox server for a Kata
#   sandbox from a pool; nixpkgs packages neither the OpenSandbox server nor its Kubernetes
#   controller, so no OpenSandbox runs here (the Rust tests cover it against the real server);
# - a `[self-hosted, pod, kata]` job through the Pod backend (a profile with
#   runtime_class_name = "kata") would need the SPIFFE CSI driver the executor Pods mount
#   (see nixos-tests/cluster.nix), which nixpkgs does not package either.
#
# nixpkgs has no NixOS module for Kata (NixOS/nixpkgs#138595): the shim goes on k3s' PATH and
# the runtime into k3s' containerd template by hand. Built only by `nix build .#vm-kata` on a
# builder with the `nested` system feature (flake.nix); never run (nixos-tests/README.md).
{
  lib,
  pkgs,
  package,
  executor-image,
  ...
}:
let
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
  busyboxImage = pkgs.dockerTools.streamLayeredImage {
    name = "test.local/busybox";
    tag = "local";
    contents = [ pkgs.busybox ];
  };

  # nixpkgs' kata-runtime 4.x sets `virtio_fs_daemon` to virtiofsd's path but lists only
  # qemu's libexec path as valid, so the runtime would refuse its own daemon: the
  # configuration the shim is given lists the daemon it runs.
  kataConfig = pkgs.runCommand "kata-configuration-qemu-runtime-rs.toml" { } ''
    sed -e 's!^valid_virtio_fs_daemon_paths.*!valid_virtio_fs_daemon_paths = ["${pkgs.virtiofsd}/bin/virtiofsd"]!' \
      ${pkgs.kata-runtime}/share/defaults/kata-containers/runtime-rs/configuration-qemu-runtime-rs.toml > "$out"
    grep -qx 'virtio_fs_daemon *= *"${pkgs.virtiofsd}/bin/virtiofsd"' "$out"
  '';

  manifests = pkgs.writeText "kata.yaml" ''
    apiVersion: node.k8s.io/v1
    kind: RuntimeClass
    metadata:
      name: kata
    handler: kata
    ---
    apiVersion: v1
    kind: Pod
    metadata:
      name: guest-kernel
    spec:
      runtimeClassName: kata
      restartPolicy: Never
      containers:
        - name: uname
          image: test.local/busybox:local
          imagePullPolicy: Never
          command: ["uname", "-r"]
    ---
    apiVersion: v1
    kind: Pod
    metadata:
      name: executor-image
    spec:
      runtimeClassName: kata
      restartPolicy: Never
      containers:
        - name: executor
          image: gitea-dynamic-runner/executor:${package.version}
          imagePullPolicy: Never
          args: ["version"]
  '';
in
{
  name = "gitea-dynamic-runner-kata";

  nodes.machine =
    { ... }:
    {
      virtualisation.memorySize = 4096;
      virtualisation.diskSize = 8192;
      virtualisation.cores = 2;
      # The Kata VM needs /dev/kvm inside this VM: the builder's nested virtualisation and
      # the host CPU's virtualisation extensions passed through.
      virtualisation.qemu.options = [
        "-cpu"
        "host"
      ];
      boot.kernelModules = [
        "kvm-intel"
        "kvm-amd"
        "vhost_vsock"
      ];

      services.k3s = {
        enable = true;
        role = "server";
        extraFlags = [
          "--disable coredns"
          "--disable local-storage"
          "--disable metrics-server"
          "--disable servicelb"
          "--disable traefik"
          "--pause-image test.local/pause:local"
        ];
        # The `kata` handler runs containerd-shim-kata-v2 (found on k3s' PATH) with the
        # configuration above; kata-containerd.nix says why the keys are version 2's.
        containerdConfigTemplate = import ./kata-containerd.nix { inherit kataConfig; };
      };
      systemd.services.k3s.path = [ pkgs.kata-runtime ];
    };

  testScript = ''
    K = "k3s kubectl"

    start_all()
    machine.succeed("test -c /dev/kvm")
    machine.wait_for_unit("k3s.service")
    machine.succeed("${pauseImage} | k3s ctr image import -")
    machine.succeed("${busyboxImage} | k3s ctr image import -")
    machine.succeed("${executor-image} | k3s ctr image import -")
    machine.wait_until_succeeds(f"{K} get serviceaccount default", timeout=300)
    machine.succeed(f"{K} apply -f ${manifests}")

    with subtest("a Pod of RuntimeClass kata runs in a guest kernel, not the node's"):
        machine.wait_until_succeeds(
            f"{K} get pod guest-kernel -o jsonpath='{{.status.phase}}' | grep -x Succeeded",
            timeout=600,
        )
        guest = machine.succeed(f"{K} logs guest-kernel").strip()
        node = machine.succeed("uname -r").strip()
        assert guest and guest != node, f"guest kernel {guest!r}, node kernel {node!r}"

    with subtest("the executor image's binary runs in a Kata microVM"):
        machine.wait_until_succeeds(
            f"{K} get pod executor-image -o jsonpath='{{.status.phase}}' | grep -x Succeeded",
            timeout=600,
        )
        out = machine.succeed(f"{K} logs executor-image")
        assert "${package.version}" in out, out
  '';
}
