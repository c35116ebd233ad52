#!/usr/bin/env bash
# Create .venv with bwstack installed from this checkout (idempotent). --dev adds the test and lint tools.
# Uses python3 (3.10+); the stack's own envs use the profile's Python (3.12), found separately.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
extras=""
[[ "${1:-}" == "--dev" ]] && extras="[dev]"
python="${PYTHON:-python3}"
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || { echo "bootstrap: need Python >= 3.10 ($python)" >&2; exit 2; }
if [[ ! -x "$here/.venv/bin/python" ]]; then
  "$python" -m venv "$here/.venv"
fi
stamp="$here/.venv/.bwstack-installed$extras"
if [[ ! -f "$stamp" || "$here/pyproject.toml" -nt "$stamp" ]]; then
  "$here/.venv/bin/python" -m pip install -q --upgrade pip
  "$here/.venv/bin/python" -m pip install -q -e "$here$extras"
  touch "$stamp"
fi
