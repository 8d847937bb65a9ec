#!/usr/bin/env bash
# Builds the real Kubernetes control plane of the tests (kube-apiserver and etcd, as
# controller-runtime's envtest runs them) from the pinned Go module beside this script, once
# per machine: the binaries are cached under a directory keyed by go.mod, go.sum and this
# script, so a second run builds nothing. Prints `NAME=VALUE` lines (KUBE_APISERVER_BIN,
# ETCD_BIN, KUBERNETES_VERSION, ETCD_VERSION) for the caller to export. Test peers only:
# nothing here is shipped.
set -euo pipefail
cd "$(dirname "$0")"

command -v go >/dev/null 2>&1 || { echo "tests/kube-peers/build.sh: Go is required (go 1.26 or newer)" >&2; exit 1; }

# The versions, read from go.mod so that they are declared once.
# A module is named either inside a `require (` block or on a one-line `require M V`.
version_of() { awk -v m="$1" '$1 == "require" { $1 = ""; $0 = $0 } $1 == m && $2 ~ /^v/ { print $2; exit }' go.mod; }
KUBERNETES_VERSION=$(version_of k8s.io/kubernetes)
ETCD_VERSION=$(version_of go.etcd.io/etcd/server/v3)
[ -n "$KUBERNETES_VERSION" ] && [ -n "$ETCD_VERSION" ] || {
  echo "tests/kube-peers/build.sh: go.mod names no k8s.io/kubernetes or etcd server version" >&2; exit 1
}

key=$(cat go.mod go.sum build.sh | sha256sum | cut -c1-16)
cache="${GDR_PEERS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gdr-test-peers}/kube-$key"
mkdir -p "$cache"

build() { # name, package, ldflags
  local name=$1 pkg=$2 ldflags=$3
  if [ ! -x "$cache/$name" ]; then
    local started=$SECONDS
    CGO_ENABLED=0 go build -mod=mod -trimpath -ldflags "$ldflags" -o "$cache/$name.tmp" "$pkg"
    mv "$cache/$name.tmp" "$cache/$name"
    echo "built $name in $((SECONDS - started)) s ($(du -h "$cache/$name" | cut -f1))" >&2
  fi
}
minor=${KUBERNETES_VERSION#v1.}; minor=${minor%%.*}
# Without these /version reports v0.0.0-master (the server still behaves as its own version).
kv=k8s.io/component-base/version
build kube-apiserver k8s.io/kubernetes/cmd/kube-apiserver \
  "-s -w -X $kv.gitVersion=$KUBERNETES_VERSION -X $kv.gitMajor=1 -X $kv.gitMinor=$minor"
build etcd go.etcd.io/etcd/server/v3 "-s -w"

echo "KUBE_APISERVER_BIN=$cache/kube-apiserver"
echo "ETCD_BIN=$cache/etcd"
echo "KUBERNETES_VERSION=${KUBERNETES_VERSION#v}"
echo "ETCD_VERSION=${ETCD_VERSION#v}"
