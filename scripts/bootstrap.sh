#!/usr/bin/env bash
# Create .venv with bwstack installed from this checkout (idempotent). --dev adds the test and lint tools.
# Uses python3 (3.10+); the stack's own envs use the profile's Python (3.12), found separately.
# Installs with uv (a dependency of bwstack, so the same uv bwstack runs): the venv's own, or one pip puts into
# the venv first (the requirement is read from pyproject.toml: no version is written here).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
extras="[controller]"
[[ "${1:-}" == "--dev" ]] && extras="[dev,controller]"
python="${PYTHON:-python3}"
"$python" -I -c 'import sys; sys.exit(sys.version_info < (3, 10))' || { echo "bootstrap: need Python >= 3.10 ($python)" >&2; exit 2; }
stamp="$here/.venv/.bwstack-installed$extras"
if [[ -x "$here/.venv/bin/python" && -f "$stamp" && ! "$here/pyproject.toml" -nt "$stamp" ]]; then
  exit 0
fi
start=$SECONDS
# A pip of 22.3 or later installs into another interpreter (--python), so the venv needs no pip of its own:
# making one (ensurepip) took 6.8 s of this script's 14 s on a fresh clone on 2 cores. Older pips, or none,
# get a venv with its own pip, as before.
# (-I throughout: nothing from the current folder or PYTHON* variables is imported by what may run as root.)
outer_pip_installs_elsewhere() {
  "$python" -I -c 'import sys, pip; sys.exit(tuple(int(p) for p in pip.__version__.split(".")[:2]) < (22, 3))' 2>/dev/null
}
if [[ ! -x "$here/.venv/bin/python" ]]; then
  if outer_pip_installs_elsewhere; then
    "$python" -I -m venv --without-pip "$here/.venv"
  else
    "$python" -I -m venv "$here/.venv"
  fi
fi
uv="$here/.venv/bin/uv"
if [[ ! -x "$uv" ]]; then
  uv_req="$(grep -o '"uv[<>=~!][^"]*"' "$here/pyproject.toml" | head -1 | tr -d '"')"
  if ! "$here/.venv/bin/python" -I -c 'import pip' 2>/dev/null && ! outer_pip_installs_elsewhere; then
    # A venv made without pip by a run that stopped before uv was in, and no pip outside that can install into it.
    "$here/.venv/bin/python" -I -m ensurepip --default-pip >/dev/null
  fi
  if "$here/.venv/bin/python" -I -c 'import pip' 2>/dev/null; then
    "$here/.venv/bin/python" -I -m pip install -q --disable-pip-version-check "${uv_req:-uv}"
  else
    "$python" -I -m pip --python "$here/.venv/bin/python" install -q --disable-pip-version-check "${uv_req:-uv}"
  fi
fi
# uv reads no pip.conf: hand it the system CA bundle when the default one is not trusted by this site's proxy.
if [[ -z "${SSL_CERT_FILE:-}" && -f /etc/ssl/certs/ca-certificates.crt ]]; then
  export SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
fi
UV_NO_PROGRESS=1 "$uv" pip install -q --python "$here/.venv/bin/python" -e "$here$extras"
touch "$stamp"
echo "bootstrap: .venv ready ($((SECONDS - start)) s; bwstack $("$here/.venv/bin/python" -I -c 'import importlib.metadata as m; print(m.version("bwstack"))'))" >&2
