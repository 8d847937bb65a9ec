#!/usr/bin/env bash
# Builds the real peers of the end-to-end tests (Gitea, the official Gitea runner) from the
# pinned Go module beside this script, once per machine: the binaries are cached under a
# directory keyed by go.mod and go.sum, so a second run finds them and builds nothing.
# Prints `NAME=PATH` lines (GITEA_BIN, GITEA_RUNNER_BIN, GITEA_STATIC_ROOT) for the caller to
# export. These are test peers: nothing here is shipped.
set -euo pipefail
cd "$(dirname "$0")"

command -v go >/dev/null 2>&1 || { echo "tests/peers/build.sh: Go is required (go 1.26 or newer)" >&2; exit 1; }

# The versions, read from go.mod so that they are declared once.
version_of() { awk -v m="$1" '$1 == m && $2 ~ /^v/ { print $2; exit }' go.mod; }
GITEA_VERSION=$(version_of gitea.dev)
RUNNER_VERSION=$(version_of gitea.com/gitea/runner)
[ -n "$GITEA_VERSION" ] && [ -n "$RUNNER_VERSION" ] || {
  echo "tests/peers/build.sh: go.mod names no gitea.dev or gitea.com/gitea/runner version" >&2; exit 1
}

key=$(cat go.mod go.sum build.sh | sha256sum | cut -c1-16)
cache="${GDR_PEERS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gdr-test-peers}/$key"
mkdir -p "$cache"

build() { # name, package, ldflags
  local name=$1 pkg=$2 ldflags=$3
  if [ ! -x "$cache/$name" ]; then
    local started=$SECONDS
    # Pure Go: Gitea's default SQLite driver is modernc (no cgo), and without the `bindata`
    # tag it reads its templates and locales from STATIC_ROOT_PATH (the module's own copy).
    CGO_ENABLED=0 go build -mod=mod -trimpath -ldflags "$ldflags" -o "$cache/$name.tmp" "$pkg"
    mv "$cache/$name.tmp" "$cache/$name"
    echo "built $name in $((SECONDS - started)) s ($(du -h "$cache/$name" | cut -f1))" >&2
  fi
}
build gitea gitea.dev "-s -w -X main.Version=${GITEA_VERSION#v}"
build gitea-runner gitea.com/gitea/runner \
  "-s -w -X gitea.com/gitea/runner/internal/pkg/ver.version=${RUNNER_VERSION}"

echo "GITEA_BIN=$cache/gitea"
echo "GITEA_RUNNER_BIN=$cache/gitea-runner"
echo "GITEA_VERSION=${GITEA_VERSION#v}"
echo "GITEA_RUNNER_VERSION=${RUNNER_VERSION#v}"
# Gitea needs its locales and templates at run time; the module cache holds them read-only.
echo "GITEA_STATIC_ROOT=$(go list -mod=mod -m -f '{{.Dir}}' gitea.dev)"
