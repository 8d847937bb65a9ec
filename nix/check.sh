#!/usr/bin/env bash
# What CI can check of the Nix files without nixpkgs, a binary cache or the internet
# (see ../shared/reference/nix-offline.md): it installs nothing, it needs `nix-instantiate`
# on PATH (Debian's nix-bin is enough).
#
# 1. `nix-instantiate --parse` of every .nix file: syntax errors, duplicate attributes and
#    free variables outside `with`.
# 2. Evaluation of the pure files: nix/credentials.nix (data), nix/settings-options.nix
#    against a stand-in lib (nix/check-settings-options.nix: agreed option shape), and the
#    inputs flake.nix declares.
#
# The deeper checks (types, assertions, the systemd unit) need nixpkgs' lib: see
# nix/eval-module.nix, run on a machine that can fetch it.
set -euo pipefail
cd "$(dirname "$0")/.."

command -v nix-instantiate >/dev/null || {
  echo "nix/check.sh: nix-instantiate not found (apt-get install nix-bin)" >&2
  exit 1
}
# Nix wants a writable state directory even to parse; keep it away from the real one.
export NIX_STATE_DIR="${NIX_STATE_DIR:-$(mktemp -d)}"
export NIX_CONFIG="experimental-features = nix-command flakes"

echo "nix/check.sh: $(nix-instantiate --version)"

mapfile -t files < <(find . -name '*.nix' -not -path './target/*' -not -path './fuzz/target/*' \
  -not -path './.git/*' | sort)
[ "${#files[@]}" -gt 0 ] || { echo "no .nix files found" >&2; exit 1; }
status=0
for f in "${files[@]}"; do
  if ! out=$(nix-instantiate --parse "$f" 2>&1 >/dev/null); then
    echo "FAIL parse $f: $out" >&2
    status=1
  fi
done
echo "parsed ${#files[@]} .nix files"

eval_json() {
  local what=$1
  shift
  local out
  if ! out=$(nix-instantiate --eval --strict --json "$@" 2>&1); then
    echo "FAIL eval $what: $out" >&2
    status=1
    return
  fi
  echo "evaluated $what: $(printf %s "$out" | head -c 160)"
}
eval_json nix/credentials.nix nix/credentials.nix
eval_json nix/settings-options.nix nix/check-settings-options.nix
eval_json "flake.nix inputs" -E 'builtins.attrNames (import ./flake.nix).inputs'

# Optional, where nixpkgs' lib is at hand (not in CI): the module through lib.evalModules.
if [ -n "${NIXPKGS_LIB:-}" ]; then
  if failed=$(nix-instantiate --read-write-mode --eval --strict --json \
    -E "(import ./nix/eval-module.nix { lib = import $NIXPKGS_LIB; }).failed" 2>&1) &&
    [ "$failed" = "[]" ]; then
    echo "evaluated nix/module.nix with lib.evalModules ($NIXPKGS_LIB): every expectation holds"
  else
    echo "FAIL nix/eval-module.nix: $failed" >&2
    status=1
  fi
fi

exit "$status"
