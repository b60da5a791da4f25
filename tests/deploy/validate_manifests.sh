#!/usr/bin/env bash
# validate_manifests.sh WORKER_BIN KVCAL_BIN VENV_DIR
# Creates VENV_DIR with kubernetes-validate (once), then runs
# validate_manifests.py. Exit 77 (ctest: skipped) when kubectl is missing.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
WORKER="$1" KVCAL="$2" VENV="$3"
# Pinned: schemas and results must not change under us.
REQUIREMENT="kubernetes-validate==1.37.0"
if ! command -v kubectl >/dev/null; then
  echo "kubectl not found: manifest validation skipped (install kubectl >= 1.27)"
  exit 77
fi
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import kubernetes_validate" 2>/dev/null; then
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check "$REQUIREMENT"
fi
exec "$VENV/bin/python" "$HERE/validate_manifests.py" --root "$ROOT" \
  --worker "$WORKER" --kvcal "$KVCAL"
