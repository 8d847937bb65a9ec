#!/usr/bin/env bash
# Installs the real OpenSandbox server (pinned, from PyPI) into a virtualenv for the
# OpenSandbox integration tests. Idempotent: a venv that already holds the pinned
# version is left alone. constraints.txt pins every dependency to the tested versions.
#
#   install.sh [VENV_DIR]    default: $HOME/.cache/gdr-opensandbox-venv
#
# The tests find the interpreter through OPENSANDBOX_PYTHON, else <default venv>/bin/python.
set -euo pipefail

OPENSANDBOX_SERVER_VERSION=1.1.1
HERE="$(cd "$(dirname "$0")" && pwd)"
VENV="${1:-${HOME}/.cache/gdr-opensandbox-venv}"
PYTHON="${PYTHON:-python3}"

if [ -x "${VENV}/bin/python" ] \
  && "${VENV}/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('opensandbox-server') != '${OPENSANDBOX_SERVER_VERSION}')" 2>/dev/null; then
  echo "opensandbox-server ${OPENSANDBOX_SERVER_VERSION}: ${VENV}/bin/python (already installed)"
  exit 0
fi

"${PYTHON}" -m venv "${VENV}"
"${VENV}/bin/python" -m pip install --quiet --disable-pip-version-check \
  --constraint "${HERE}/constraints.txt" "opensandbox-server==${OPENSANDBOX_SERVER_VERSION}"
echo "opensandbox-server ${OPENSANDBOX_SERVER_VERSION}: ${VENV}/bin/python"
