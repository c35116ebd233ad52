"""Running uv: the binary that ships with the `uv` package bwstack depends on, in a controlled environment."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from functools import cache

from bwstack.errors import BwstackError


@cache
def uv_bin() -> str:
    try:
        from uv import find_uv_bin

        return find_uv_bin()
    except (ImportError, FileNotFoundError):
        found = shutil.which("uv")
        if found:
            return found
    raise BwstackError("uv is not installed: `pip install uv` in bwstack's environment")


@cache
def uv_version() -> str:
    out = subprocess.run([uv_bin(), "--version"], capture_output=True, text=True, check=True).stdout
    return out.split()[1]


# What in the caller's environment steers which interpreter uv finds and runs, or what Python imports when it does.
CALLERS_INTERPRETER = ("VIRTUAL_ENV", "CONDA_PREFIX", "PYTHONPATH", "PYTHONHOME", "PYTHONUSERBASE", "PYTHONSTARTUP")


def uv_env(extra: Mapping[str, str] | None = None, *, ca_bundle: str | None = None) -> dict[str, str]:
    """Environment for uv: none of the caller's UV_* settings (uv reads dozens: overrides, constraints and excludes
    that change what is installed, a config file it reads even with UV_NO_CONFIG, a cache or none; a uv bwstack
    runs may install as root), none of what picks the interpreter it runs; no managed-Python downloads, no user
    config, the given CA bundle if any. What bwstack wants of uv it sets here or names in `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("UV_") and k not in CALLERS_INTERPRETER}
    env.update({"UV_PYTHON_DOWNLOADS": "never", "UV_NO_CONFIG": "1", "UV_NO_PROGRESS": "1"})
    if ca_bundle:
        env["SSL_CERT_FILE"] = ca_bundle
    if extra:
        env.update(extra)
    return env


def run_uv(
    args: Sequence[str], *, env: Mapping[str, str], capture: bool = False, cwd: str | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run([uv_bin(), *args], env=dict(env), capture_output=capture, text=True, cwd=cwd, check=False)
