#!/usr/bin/env bash
# Renders every kustomization under deploy/kubernetes and validates each object against
# the Kubernetes OpenAPI schemas (strict: unknown fields are errors). Offline: the pinned
# kubernetes-validate wheel ships the schemas. Usage: bash deploy/validate.sh
set -euo pipefail
cd "$(dirname "$0")/.."

KUBERNETES_VALIDATE_VERSION=1.37.0
# The sha256 of its wheel on PyPI: checked before every install here, and the hash of the
# fixed-output fetch that gives the Nix build sandbox the same schemas
# (nix/kubernetes-schemas.nix; tests/nix.rs checks that the two agree).
KUBERNETES_VALIDATE_WHEEL_SHA256=85136d018a27b50ec7fc049d902bfa5193f5976807e6c0f408e3ab6fe078cad9
# The oldest Kubernetes release the manifests must work on.
KUBERNETES_VERSION=1.33.0

installed="$(python3 -m pip show kubernetes-validate 2>/dev/null || true)"
if ! grep -qx "Version: ${KUBERNETES_VALIDATE_VERSION}" <<<"$installed"; then
  wheel_dir="$(mktemp -d)"
  python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary :all: \
    --dest "$wheel_dir" "kubernetes-validate==${KUBERNETES_VALIDATE_VERSION}"
  wheel="$wheel_dir/kubernetes_validate-${KUBERNETES_VALIDATE_VERSION}-py3-none-any.whl"
  echo "${KUBERNETES_VALIDATE_WHEEL_SHA256}  ${wheel}" | sha256sum --check --quiet || {
    echo "deploy/validate.sh: the kubernetes-validate wheel's sha256 is not the pinned one" >&2; exit 1
  }
  python3 -m pip install --quiet --disable-pip-version-check "$wheel"
  rm -rf "$wheel_dir"
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
