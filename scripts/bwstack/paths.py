"""Where bwstack's own files are: the checkout it runs from (editable install) or the copies inside the package.

Every layer asks here instead of counting `parents[...]` from its own file, which breaks whenever a module moves.
"""

from __future__ import annotations

import os
from pathlib import Path

from bwstack.errors import UsageError

# bwstack's store when it runs as root (another user's is ~/.local/share/bwstack): the one place this default is
# written in Python. The Ansible side has one too, the bwstack role's `bwstack_root` (its defaults/main.yml).
DEFAULT_ROOT = Path("/opt/bwstack")
USER_ROOT = Path(".local/share/bwstack")  # under the user's home

PACKAGE = Path(__file__).resolve().parent
DATA = PACKAGE / "data"
_CHECKOUT = PACKAGE.parents[1]


def checkout() -> Path | None:
    """bwstack's own checkout when it runs from one (scripts/bwstack inside a tree with pyproject.toml)."""
    if (_CHECKOUT / "pyproject.toml").is_file() and (_CHECKOUT / "scripts" / "bwstack").is_dir():
        return _CHECKOUT
    return None


def in_checkout(*parts: str) -> Path | None:
    root = checkout()
    return root.joinpath(*parts) if root else None


def shipped(checkout_dir: str, package: str, marker: str, env: str | None = None) -> Path | None:
    """A directory bwstack ships as data: $env if set (see setting_dir), else the checkout's `checkout_dir`, else
    its copy installed as the top-level package `package` (pyproject.toml maps the directory to it); the first
    holding `marker`."""
    import importlib.util

    given = setting_dir(env, marker) if env else None
    if given is not None:
        return given
    candidates = [in_checkout(checkout_dir)]
    spec = importlib.util.find_spec(package)
    if spec is not None and spec.submodule_search_locations:
        candidates += list(spec.submodule_search_locations)
    for candidate in candidates:
        if candidate and (Path(candidate) / marker).is_file():
            return Path(candidate)
    return None


def setting_dir(variable: str, marker: str) -> Path | None:
    """The directory the environment variable names (None where it is unset), holding `marker`. A value that is
    set is used or refused, never passed over for the default: it was set to point somewhere else."""
    value = os.environ.get(variable)
    if value is None:
        return None
    if not value.strip():
        raise UsageError(f"{variable} is empty: give a directory (or unset it to use the default)")
    why = path_problem(value)
    if why:
        raise UsageError(f"{variable} {value!r} {why}")
    if not Path(value).is_dir():
        raise UsageError(f"{variable}={value}: not a directory (give one, or unset it to use the default)")
    if not (Path(value) / marker).is_file():
        raise UsageError(f"{variable}={value}: holds no {marker} (is it the right directory?)")
    return Path(value).absolute()  # a relative one is relative to where bwstack was started, not where it runs Ansible


def path_problem(value: str) -> str | None:
    """Why `value` cannot be a path bwstack passes on (into scripts, unit files, Ansible variables, where a
    newline starts a line of its own), or None."""
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        return "holds a control character (a newline, a tab): not a path"
    if any(0xDC80 <= ord(c) <= 0xDCFF for c in value):
        return "is not UTF-8: not a path bwstack can pass on"
    return None
