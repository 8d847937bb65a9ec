# The controller image: the binary, CA certificates and nothing else (no shell, no package
# manager). `nix build .#controller-image` gives a script that streams the image tarball:
#   ./result | docker load        ./result | k3s ctr image import -
#
# Matches the Go version's container/controller.Dockerfile: non-root 65532, entrypoint the
# binary, `controller` as the default command, the facade port (8443) and, new here, the
# health/metrics port (9090).
{
  lib,
  pkgs,
  package,
}:
let
  uid = 65532;
  # The binary does not look users up, but libraries and humans reading /etc/passwd do.
  etc = pkgs.runCommand "gitea-dynamic-runner-controller-etc" { } ''
    mkdir -p $out/etc
    cat > $out/etc/passwd <<EOF
    root:x:0:0:root:/var/empty:/sbin/nologin
    nonroot:x:${toString uid}:${toString uid}:gitea-dynamic-runner:/var/lib/gitea-dynamic-runner:/sbin/nologin
    EOF
    cat > $out/etc/group <<EOF
    root:x:0:
    nonroot:x:${toString uid}:
    EOF
    echo 'hosts: files dns' > $out/etc/nsswitch.conf
  '';
in
pkgs.dockerTools.streamLayeredImage {
  name = "gitea-dynamic-runner/controller";
  tag = package.version;

  contents = [
    pkgs.cacert
    etc
  ];

  # /tmp for libraries that want one; the state directory (local CA, embedded NATS) owned by
  # the runtime user so it works without a volume too.
  fakeRootCommands = ''
    mkdir -p tmp var/lib/gitea-dynamic-runner
    chmod 1777 tmp
    chown ${toString uid}:${toString uid} var/lib/gitea-dynamic-runner
    chmod 0700 var/lib/gitea-dynamic-runner
  '';

  config = {
    User = "${toString uid}:${toString uid}";
    Entrypoint = [ (lib.getExe package) ];
    Cmd = [ "controller" ];
    WorkingDir = "/var/lib/gitea-dynamic-runner";
    Env = [
      "SSL_CERT_FILE=${pkgs.cacert}/etc/ssl/certs/ca-bundle.crt"
      "STATE_DIR=/var/lib/gitea-dynamic-runner"
    ];
    ExposedPorts = {
      # runner_facade_listen (SPIFFE mTLS)
      "8443/tcp" = { };
      # health_listen: /healthz, /readyz, /metrics
      "9090/tcp" = { };
    };
    Labels = {
      "org.opencontainers.image.title" = "gitea-dynamic-runner controller";
      "org.opencontainers.image.version" = package.version;
      "org.opencontainers.image.licenses" = "Apache-2.0";
    };
  };
}
