"""Read what is installed in a Python env from its files alone (no import, no subprocess).

Standard library only: this module also runs on target hosts inside the verify probe.
"""

from __future__ import annotations

import email.parser
import re
from dataclasses import dataclass
from pathlib import Path

from bwstack.probe import interp, treecheck


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Installed:
    name: str  # normalised
    version: str
    dist_info: Path
    installer: str


def site_packages(env: Path) -> Path:
    """The purelib site-packages of a venv (lib/pythonX.Y/site-packages): that of the Python its pyvenv.cfg
    names when the env has one, else that of the newest Python by number (as text, python3.9 sorts after
    python3.12): an env can hold the folders of more than one Python."""
    env = Path(env)
    candidates = sorted(env.glob("lib/python3.*/site-packages"), key=lambda sp: _python_number(sp.parent.name))
    if not candidates:
        raise FileNotFoundError(f"{env} is not a Python env: no lib/python3.*/site-packages in it")
    named = _configured_version(env)
    minor = "python" + ".".join(named.split(".")[:2]) if named else None
    return next((sp for sp in candidates if sp.parent.name == minor), candidates[-1])


def _python_number(folder: str) -> tuple[int, int, str]:
    """Sort key of a lib/ folder: (major, minor) of `python3.12` (`python3.13t` too), then the name."""
    match = re.match(r"python(\d+)\.(\d+)", folder)
    return (int(match[1]), int(match[2]), folder) if match else (0, 0, folder)


def pyvenv_cfg(env: Path) -> dict[str, str]:
    """A venv's pyvenv.cfg as CPython's site module reads it: keys case-insensitive, the first of each kept ({}
    without one)."""
    keys: dict[str, str] = {}
    for line in (treecheck.read_text(Path(env) / "pyvenv.cfg") or "").splitlines():
        key, sep, value = line.partition("=")
        if sep:
            keys.setdefault(key.strip().lower(), value.strip())
    return keys


def _configured_version(env: Path) -> str | None:
    """The Python version pyvenv.cfg names (`version = 3.12.3` from venv, `version_info = 3.12.3` from uv)."""
    keys = pyvenv_cfg(env)
    named = keys.get("version_info") or keys.get("version")
    return ".".join(named.split(".")[:3]) if named else None


def env_python_version(env: Path) -> str | None:
    named = _configured_version(env)
    if named is not None:
        return named
    match = re.search(r"python(3\.\d+)", str(site_packages(env)))
    return match.group(1) if match else None


def installed(env: Path) -> dict[str, Installed]:
    sp = site_packages(env)
    found: dict[str, Installed] = {}
    for dist_info in sorted(sp.glob("*.dist-info")):
        meta = treecheck.read_text(dist_info / "METADATA")
        if meta is None:
            continue
        headers = email.parser.Parser().parsestr(meta, headersonly=True)
        name = canonical(headers.get("Name", ""))
        installer = (treecheck.read_text(dist_info / "INSTALLER", 4096) or "").strip()
        found[name] = Installed(name, headers.get("Version", ""), dist_info, installer)
    return found


def import_torch(env: Path) -> dict:
    """torch's version and CUDA as the env's own interpreter reports them ({'error': ...} when it cannot)."""
    facts = interp.interpreter_facts(Path(env) / "bin" / "python", timeout=600)
    if "error" in facts:
        return {"error": facts["error"]}
    if "torch_error" in facts:
        return {"error": facts["torch_error"]}
    return {"version": facts.get("torch"), "cuda": facts.get("torch_cuda")}
