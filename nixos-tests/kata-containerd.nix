# The containerd configuration template of the Kata VM test (nixos-tests/kata.nix), on its
# own so that tests/nix.rs can evaluate it and check it against containerd's config version 2.
#
# NixOS' k3s module writes services.k3s.containerdConfigTemplate to
# /var/lib/rancher/k3s/agent/etc/containerd/config.toml.tmpl, the file k3s renders with its
# version-2 "base" template (config-v3.toml.tmpl would be version 3). Tables appended to it
# must therefore use version 2's CRI plugin ID, `io.containerd.grpc.v1.cri`: a version-3 key
# (`io.containerd.cri.v1.runtime`) in a version-2 file makes containerd 2 migrate the file
# and drop the base's runc settings. `options.ConfigPath` points the kata-runtime 4.x shim
# at its configuration, which it otherwise looks for only under /etc/kata-containers/
# runtime-rs/, /usr/share/defaults/…, /opt/kata/share/defaults/… or KATA_CONF_FILE.
{ kataConfig }:
''
  {{ template "base" . }}

  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.kata]
    runtime_type = "io.containerd.kata.v2"
    privileged_without_host_devices = true

  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.kata.options]
    ConfigPath = "${kataConfig}"
''
