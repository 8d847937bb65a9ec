#!/usr/bin/env bash
# Runs a command in a view of this repository that holds exactly the files of one of the
# Nix checks' source sets, at the repository's own path, so cargo finds its target/ (bind
# mounted in) fresh and compiles nothing it would not compile here:
#
#   bash nix/source-view.sh build -- cargo build --locked --workspace --all-targets --all-features
#   bash nix/source-view.sh test -- cargo nextest run --workspace --all-features --locked
#
# `build` is the source set of the package, clippy, doc and fmt checks, `test` the one of the
# nextest check (nix/package.nix). Both are git's tracked files (a flake sees nothing else)
# filtered as nix/package.nix filters them: crane's commonCargoSources (every file named
# Cargo.toml or Cargo.lock, every *.rs and *.toml; crane lib/fileset/commonCargoSources.nix)
# plus the `build` (and for `test` also the `test`) entries of nix/sources.nix, minus its
# `exclude` entries. A test that reads a file outside the set fails here as it would in
# `nix flake check`.
#
# Needs root (a private mount namespace, unshare(1)), git, python3 and nix-instantiate.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD

set_name=${1:-}
[ "${2:-}" = "--" ] && [ $# -ge 3 ] && { [ "$set_name" = build ] || [ "$set_name" = test ]; } || {
  echo "usage: nix/source-view.sh build|test -- COMMAND..." >&2
  exit 2
}
shift 2

export NIX_STATE_DIR="${NIX_STATE_DIR:-$(mktemp -d)}"
sources_json=$(nix-instantiate --store dummy:// --eval --strict --json nix/sources.nix)

view=$(mktemp -d "${TMPDIR:-/tmp}/gdr-source-view.XXXXXX")
trap 'rm -rf "$view"' EXIT
# mktemp makes it 0700; mounted over the repository it must be as reachable as the
# repository is (a test runs the job as uid 2000 from target/).
chmod --reference="$repo" "$view"

# The selection, NUL-separated, as tar reads it.
git ls-files -z | python3 -c '
import json, sys
sources = json.loads(sys.argv[1])
prefixes = sources["build"] + (sources["test"] if sys.argv[2] == "test" else [])
def under(path, entries):
    return any(path == e or path.startswith(e.rstrip("/") + "/") for e in entries)
files, dirs = [], set()
for path in sys.stdin.buffer.read().decode().split("\0"):
    if not path or under(path, sources["exclude"]):
        continue
    name = path.rsplit("/", 1)[-1]
    cargo = name in ("Cargo.toml", "Cargo.lock") or name.endswith((".rs", ".toml"))
    if cargo or under(path, prefixes):
        files.append(path)
        parts = path.split("/")[:-1]
        dirs.update("/".join(parts[: i + 1]) for i in range(len(parts)))
# Directories too (without their contents): a build script watching a directory
# (rerun-if-changed) compares its modification time, which must be the original one. Each
# directory right before its contents, so tar sets its time once the last is extracted.
paths = sorted(dirs.union(files), key=lambda p: p.split("/"))
sys.stdout.write("".join(p + "\0" for p in paths))
' "$sources_json" "$set_name" >"$view.list"
count=$(tr -cd '\0' <"$view.list" | wc -c)
# tar keeps modification times, which cargo's fingerprints compare (the POSIX format to the
# nanosecond).
tar --format=posix --null --no-recursion -T "$view.list" -cf - | tar -xf - -C "$view"
rm -f "$view.list"
mkdir -p "$view/target" target
echo "nix/source-view.sh: the $set_name source set ($count files and directories) at $repo"

# The command runs with the view mounted over the repository in a mount namespace of its
# own: nothing outside it sees the change, and it ends with the command.
unshare --mount --propagation private -- bash -c '
  set -e
  mount --bind "$2/target" "$1/target"
  mount --rbind "$1" "$2"
  cd "$2"
  shift 2
  exec "$@"
' view-shell "$view" "$repo" "$@"
