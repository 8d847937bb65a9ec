#!/usr/bin/env bash
# The machine's cache of Rust build outputs, so that a second `.ci/run` on a machine (a fresh
# clone, so no target/) compiles only the workspace's own crates, not its ~500 dependencies:
#
#   bash .ci/target-cache.sh restore   # before any cargo build: the cache into target/
#   bash .ci/target-cache.sh save      # after a green run: target/ into the cache
#   bash .ci/target-cache.sh selftest  # the staleness guard below, checked in a scratch repository
#
# One entry, keyed by what decides whether a dependency's artifacts can be reused: Cargo.lock,
# rust-toolchain.toml and the compiler's own version. A new key replaces the old entry, so the
# cache holds one build's outputs (a few GiB), never one per commit.
#
# Restoring copies (never links: cargo rewrites artifacts in place, which would change the
# cache under another run) and then marks every tracked file of the clone as newer than
# anything restored. Cargo decides by modification time whether a workspace crate is stale,
# and a cache saved after this clone was made (by a run of another commit beside this one)
# would otherwise hold outputs newer than this clone's sources: they would count as fresh
# and the tests would run another commit's code.
set -euo pipefail
cd "$(dirname "$0")/.."

root="${GDR_TARGET_CACHE:-${HOME}/.cache/gdr-cargo-target}"
key=$({ sha256sum Cargo.lock rust-toolchain.toml; rustc -vV; } | sha256sum | cut -c1-16)
entry="$root/$key"
# What is kept: the test build (clippy-checked) and the product's release build. Incremental
# state is left out: it is per crate and per source path, the workspace compiles anyway, and
# it is most of the size.
dirs=(target/debug target/product/release)

case "${1:-}" in
restore)
  if [ ! -f "$entry/complete" ]; then
    echo "target cache: nothing saved for key $key ($root)"
    exit 0
  fi
  start=$SECONDS
  for dir in "${dirs[@]}"; do
    [ -d "$entry/$dir" ] || continue
    mkdir -p "$dir"
    cp -a --reflink=auto "$entry/$dir/." "$dir/"
  done
  git ls-files -z | xargs -0 touch -c -h --
  echo "target cache: restored key $key ($(du -sh target | cut -f1)) in $((SECONDS - start)) s"
  ;;
save)
  start=$SECONDS
  mkdir -p "$root"
  staging=$(mktemp -d "$root/.saving.XXXXXX")
  trap 'rm -rf "$staging"' EXIT
  for dir in "${dirs[@]}"; do
    [ -d "$dir" ] || continue
    mkdir -p "$staging/$dir"
    tar -C "$dir" --exclude=./incremental -cf - . | tar -C "$staging/$dir" -xf -
  done
  touch "$staging/complete"
  # Every other entry (an older Cargo.lock or toolchain) and this key's previous copy go;
  # another run's save in progress stays, unless it was left behind hours ago.
  find "$root" -mindepth 1 -maxdepth 1 ! -name '.saving.*' -exec rm -rf {} +
  find "$root" -mindepth 1 -maxdepth 1 -name '.saving.*' -mmin +180 -exec rm -rf {} +
  mv "$staging" "$entry"
  trap - EXIT
  echo "target cache: saved key $key ($(du -sh "$entry" | cut -f1)) in $((SECONDS - start)) s"
  ;;
selftest)
  # This script, run on a scratch repository with a cache of its own: a cache saved after
  # the clone was made (outputs an hour old, sources two) is restored, and every tracked
  # file must then be newer than every restored output; a changed Cargo.lock restores
  # nothing. Fails if the restore stops making the sources newer.
  scratch=$(mktemp -d)
  trap 'rm -rf "$scratch"' EXIT
  repo="$scratch/repo"
  mkdir -p "$repo/.ci" "$repo/target/debug"
  cp "$0" "$repo/.ci/target-cache.sh"
  cp Cargo.lock rust-toolchain.toml "$repo/"
  echo 'fn main() {}' >"$repo/main.rs"
  git -C "$repo" init -q
  git -C "$repo" add -A
  git -C "$repo" -c user.name=selftest -c user.email=selftest@localhost commit -qm selftest
  git -C "$repo" ls-files -z | (cd "$repo" && xargs -0 touch -h -d '-2 hours' --)
  echo artefact >"$repo/target/debug/out"
  touch -d '-1 hour' "$repo/target/debug/out"
  run() { GDR_TARGET_CACHE="$scratch/cache" bash "$repo/.ci/target-cache.sh" "$1"; }
  run save >/dev/null
  rm -rf "$repo/target"
  run restore >/dev/null
  newest_output=$(find "$repo/target" -type f -printf '%T@\n' | sort -n | tail -n 1)
  oldest_source=$(git -C "$repo" ls-files -z | (cd "$repo" && xargs -0 stat -c %Y --) | sort -n | head -n 1)
  if [ -z "$newest_output" ] || ! awk -v s="$oldest_source" -v o="$newest_output" 'BEGIN { exit !(s > o) }'; then
    echo "target cache selftest: after a restore a tracked file (mtime $oldest_source) is not newer than the restored outputs (${newest_output:-none restored}): a cache saved after the clone would pass for its build" >&2
    exit 1
  fi
  echo "# changed" >>"$repo/Cargo.lock"
  rm -rf "$repo/target"
  if ! run restore | grep -q "nothing saved"; then
    echo "target cache selftest: a changed Cargo.lock still restored the old entry" >&2
    exit 1
  fi
  echo "target cache selftest: a restored cache never passes for the clone's sources; a new Cargo.lock misses it"
  ;;
*)
  echo "usage: .ci/target-cache.sh restore|save|selftest" >&2
  exit 2
  ;;
esac
