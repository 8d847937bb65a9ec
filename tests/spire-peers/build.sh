#!/usr/bin/env bash
# Builds the real SPIRE of the tests (spire-server and spire-agent, whose CLI is also what a
# job runs for `spire-agent api fetch jwt`) from the pinned Go module beside this script,
# once per machine: the binaries are cached under a directory keyed by go.mod, go.sum and
# this script, so a second run builds nothing. Prints `NAME=VALUE` lines (SPIRE_SERVER_BIN,
# SPIRE_AGENT_BIN, SPIRE_VERSION) for the caller to export. Test peers only: nothing here is
# shipped.
set -euo pipefail
cd "$(dirname "$0")"

command -v go >/dev/null 2>&1 || { echo "tests/spire-peers/build.sh: Go is required (go 1.26 or newer)" >&2; exit 1; }
command -v gcc >/dev/null 2>&1 || { echo "tests/spire-peers/build.sh: gcc is required (SPIRE's SQLite driver is cgo)" >&2; exit 1; }

# The version, read from go.mod so that it is declared once.
SPIRE_VERSION=$(awk '$1 == "github.com/spiffe/spire" && $2 ~ /^v/ { print $2; exit }' go.mod)
[ -n "$SPIRE_VERSION" ] || { echo "tests/spire-peers/build.sh: go.mod names no github.com/spiffe/spire version" >&2; exit 1; }

key=$(cat go.mod go.sum build.sh | sha256sum | cut -c1-16)
cache="${GDR_PEERS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gdr-test-peers}/spire-$key"
mkdir -p "$cache"

build() { # name, package
  local name=$1 pkg=$2
  if [ ! -x "$cache/$name" ]; then
    local started=$SECONDS
    # cgo: the server's datastore is SQLite through mattn/go-sqlite3.
    CGO_ENABLED=1 go build -mod=mod -trimpath -ldflags "-s -w" -o "$cache/$name.tmp" "$pkg"
    mv "$cache/$name.tmp" "$cache/$name"
    echo "built $name in $((SECONDS - started)) s ($(du -h "$cache/$name" | cut -f1))" >&2
  fi
}
build spire-server github.com/spiffe/spire/cmd/spire-server
build spire-agent github.com/spiffe/spire/cmd/spire-agent

echo "SPIRE_SERVER_BIN=$cache/spire-server"
echo "SPIRE_AGENT_BIN=$cache/spire-agent"
echo "SPIRE_VERSION=${SPIRE_VERSION#v}"
