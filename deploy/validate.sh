#!/usr/bin/env bash
# Renders every kustomization under deploy/kubernetes and validates each object against
# the Kubernetes OpenAPI schemas (strict: unknown fields are errors). Offline: the pinned
# kubernetes-validate wheel ships the schemas. Usage: bash deploy/validate.sh
set -euo pipefail
cd "$(dirname "$0")/.."

KUBERNETES_VALIDATE_VERSION=1.37.0
# The oldest Kubernetes release the manifests must work on.
KUBERNETES_VERSION=1.33.0

installed="$(python3 -m pip show kubernetes-validate 2>/dev/null || true)"
if ! grep -qx "Version: ${KUBERNETES_VALIDATE_VERSION}" <<<"$installed"; then
  python3 -m pip install --quiet --disable-pip-version-check "kubernetes-validate==${KUBERNETES_VALIDATE_VERSION}"
fi
validate() { python3 -c 'import sys; from kubernetes_validate.__main__ import main; sys.exit(main())' "$@"; }

out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
status=0
for dir in deploy/kubernetes/base deploy/kubernetes/overlays/*/ deploy/kubernetes/sandbox-identity; do
  dir="${dir%/}"
  name="$(echo "$dir" | tr / -)"
  kubectl kustomize "$dir" > "$out/$name.yaml"
  echo "== $dir ($(grep -c '^kind:' "$out/$name.yaml") objects)"
  validate --strict --quiet -k "$KUBERNETES_VERSION" "$out/$name.yaml" || status=1
done
exit "$status"
