#!/usr/bin/env bash
# Create .venv with bwstack installed from this checkout (idempotent). --dev adds the test and lint tools.
# Uses python3 (3.10+); the stack's own envs use the profile's Python (3.12), found separately.
# Installs with uv (a dependency of bwstack, so the same uv bwstack runs): a uv on PATH, the venv's own, or one
# pip puts into the venv first (the requirement is read from pyproject.toml: no version is written here).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
extras=""
[[ "${1:-}" == "--dev" ]] && extras="[dev]"
python="${PYTHON:-python3}"
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || { echo "bootstrap: need Python >= 3.10 ($python)" >&2; exit 2; }
stamp="$here/.venv/.bwstack-installed$extras"
if [[ -x "$here/.venv/bin/python" && -f "$stamp" && ! "$here/pyproject.toml" -nt "$stamp" ]]; then
  exit 0
fi
start=$SECONDS
if [[ ! -x "$here/.venv/bin/python" ]]; then
  "$python" -m venv "$here/.venv"
fi
uv="$here/.venv/bin/uv"
if [[ ! -x "$uv" ]]; then
  uv_req="$(grep -o '"uv[<>=~!][^"]*"' "$here/pyproject.toml" | head -1 | tr -d '"')"
  "$here/.venv/bin/python" -m pip install -q --disable-pip-version-check "${uv_req:-uv}"
fi
# uv reads no pip.conf: hand it the system CA bundle when the default one is not trusted by this site's proxy.
if [[ -z "${SSL_CERT_FILE:-}" && -f /etc/ssl/certs/ca-certificates.crt ]]; then
  export SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
fi
UV_NO_PROGRESS=1 "$uv" pip install -q --python "$here/.venv/bin/python" -e "$here$extras"
touch "$stamp"
echo "bootstrap: .venv ready ($((SECONDS - start)) s; bwstack $("$here/.venv/bin/python" -c 'import importlib.metadata as m; print(m.version("bwstack"))'))" >&2
