#!/usr/bin/env bash
# Builds the real spire-controller-manager of the tests (tests/real_spire_cm.rs: it turns the
# ClusterStaticEntry objects the Pod backend and sandbox-identity write into SPIRE entries)
# from the pinned Go module beside this script, once per machine: the binary and the module's
# own CustomResourceDefinitions are cached under a directory keyed by go.mod, go.sum and this
# script, so a second run builds nothing. Prints `NAME=VALUE` lines (SPIRE_CM_BIN,
# SPIRE_CM_CRDS, SPIRE_CM_VERSION) for the caller to export. A module of its own: its
# Kubernetes libraries (v0.34) differ from SPIRE's and from kube-apiserver's pins. Test peers
# only: nothing here is shipped.
set -euo pipefail
cd "$(dirname "$0")"

command -v go >/dev/null 2>&1 || { echo "tests/spire-cm-peers/build.sh: Go is required (go 1.26 or newer)" >&2; exit 1; }

module=github.com/spiffe/spire-controller-manager
# The version, read from go.mod so that it is declared once.
SPIRE_CM_VERSION=$(awk -v m="$module" '$1 == m && $2 ~ /^v/ { print $2; exit }' go.mod)
[ -n "$SPIRE_CM_VERSION" ] || { echo "tests/spire-cm-peers/build.sh: go.mod names no $module version" >&2; exit 1; }

key=$(cat go.mod go.sum build.sh | sha256sum | cut -c1-16)
cache="${GDR_PEERS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gdr-test-peers}/spire-cm-$key"
mkdir -p "$cache"

if [ ! -x "$cache/spire-controller-manager" ]; then
  started=$SECONDS
  CGO_ENABLED=0 go build -mod=mod -trimpath -ldflags "-s -w" \
    -o "$cache/spire-controller-manager.tmp" "$module/cmd"
  mv "$cache/spire-controller-manager.tmp" "$cache/spire-controller-manager"
  echo "built spire-controller-manager in $((SECONDS - started)) s ($(du -h "$cache/spire-controller-manager" | cut -f1))" >&2
fi
# The CRDs of this very version (ClusterStaticEntry, ClusterSPIFFEID,
# ClusterFederatedTrustDomain), which it watches at start.
if [ ! -d "$cache/crds" ]; then
  dir=$(go list -mod=mod -m -f '{{.Dir}}' "$module")
  mkdir -p "$cache/crds.tmp"
  cp "$dir"/config/crd/bases/spire.spiffe.io_cluster*.yaml "$cache/crds.tmp/"
  chmod u+w "$cache"/crds.tmp/*
  mv "$cache/crds.tmp" "$cache/crds"
fi

echo "SPIRE_CM_BIN=$cache/spire-controller-manager"
echo "SPIRE_CM_CRDS=$cache/crds"
echo "SPIRE_CM_VERSION=${SPIRE_CM_VERSION#v}"
