#!/usr/bin/env bash
# Runs a command as the build sandbox of `nix flake check`'s nextest check would, as far as
# a test can tell:
#
#   bash nix/sandbox-like.sh -- cargo nextest run --workspace --all-features --locked --profile nix
#
# - PATH holds only what that check's derivation gives it: stdenv's tools (coreutils,
#   findutils, diffutils, sed, grep, awk, tar, gzip, bzip2, xz, make, bash, patch, file,
#   the C compiler), crane's (cargo, rustc, cargo-nextest) and the check's nativeBuildInputs
#   in nix/package.nix (nats-server, kubectl, promtool, nix);
# - no python3 and no /usr/bin/env (a `#!/usr/bin/env python3` or `#!/usr/bin/env bash`
#   script fails), only /bin/sh;
# - HOME is /homeless-shelter, which does not exist; TMPDIR is a fresh directory;
# - no network but a loopback interface (a network namespace of its own);
# - the environment is empty but for what the check's `env` sets (NATS_SERVER_BIN,
#   KUBERNETES_SCHEMA_DIR) and what the toolchain needs to be found.
#
# Not emulated: the build user (tests run as root here, as nixbld there), the store's
# read-only paths and the sandbox's own /dev and /proc.
#
# Needs root (unshare(1) for the mount and network namespaces) and ip(8).
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${1:-}" = "--" ] && [ $# -ge 2 ] || { echo "usage: nix/sandbox-like.sh -- COMMAND..." >&2; exit 2; }
shift

: "${NATS_SERVER_BIN:?the nextest check sets NATS_SERVER_BIN; set it to the real nats-server}"
: "${KUBERNETES_SCHEMA_DIR:?the nextest check sets KUBERNETES_SCHEMA_DIR (nix/kubernetes-schemas.nix)}"

tools=$(mktemp -d "${TMPDIR:-/tmp}/gdr-sandbox-bin.XXXXXX")
build_top=$(mktemp -d "${TMPDIR:-/tmp}/gdr-sandbox-build.XXXXXX")
trap 'rm -rf "$tools" "$build_top"' EXIT

# stdenv's initial path, read off Debian's packages of the same tools.
for package in coreutils findutils diffutils sed grep tar gzip bzip2 xz-utils make bash patch file; do
  dpkg -L "$package" | { grep -E '^(/usr)?/s?bin/[^/]+$' || true; } | while read -r tool; do
    ln -sf "$tool" "$tools/$(basename "$tool")"
  done
done
link() { # name [target]: the tool named, found on the caller's PATH unless given
  local target=${2:-$(command -v "$1" || true)}
  [ -n "$target" ] || { echo "nix/sandbox-like.sh: $1 not found" >&2; exit 1; }
  ln -sf "$(readlink -f "$target")" "$tools/$1"
}
for tool in sh awk cc gcc c++ g++ ld as ar nm ranlib strip cargo rustc rustdoc cargo-nextest \
  kubectl promtool nix nix-instantiate; do
  link "$tool"
done
link nats-server "$NATS_SERVER_BIN"
# coreutils' env is on a sandbox's PATH; only the path /usr/bin/env is missing there, and it
# is hidden below, so PATH gets a copy.
rm -f "$tools/env" && cp "$(command -v env)" "$tools/env"
# rustup's proxies find their toolchain through these (a Nix toolchain is a store path).
rustup_home=${RUSTUP_HOME:-$HOME/.rustup}
cargo_home=${CARGO_HOME:-$HOME/.cargo}
toolchain=$(rustc --print sysroot)
for tool in cargo rustc rustdoc; do ln -sf "$toolchain/bin/$tool" "$tools/$tool"; done

# The mount namespace hides the interpreters a sandbox lacks; the network namespace has
# only loopback. Everything ends with the command. The environment is emptied first, so the
# namespace's own set-up names its tools by path.
mount=$(command -v mount) ip=$(command -v ip) unshare=$(command -v unshare) bash=$(command -v bash)
env -i \
  PATH="$tools" \
  HOME=/homeless-shelter \
  TMPDIR="$build_top" TMP="$build_top" TEMP="$build_top" NIX_BUILD_TOP="$build_top" \
  RUSTUP_HOME="$rustup_home" CARGO_HOME="$cargo_home" CARGO_NET_OFFLINE=true \
  ${RUSTC_WORKSPACE_WRAPPER:+RUSTC_WORKSPACE_WRAPPER="$RUSTC_WORKSPACE_WRAPPER"} \
  ${CLIPPY_ARGS:+CLIPPY_ARGS="$CLIPPY_ARGS"} \
  NATS_SERVER_BIN="$tools/nats-server" \
  KUBERNETES_SCHEMA_DIR="$KUBERNETES_SCHEMA_DIR" \
  "$unshare" --mount --net --propagation private -- "$bash" -c '
    set -e
    mount=$1 ip=$2
    shift 2
    for hidden in /usr/bin/env /usr/bin/python3 /usr/local/bin/python3; do
      if [ -e "$hidden" ]; then "$mount" --bind /dev/null "$hidden"; fi
    done
    "$ip" link set lo up
    exec "$@"
  ' sandbox-like "$mount" "$ip" "$@"
