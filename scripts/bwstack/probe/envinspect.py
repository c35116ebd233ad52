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
    """The purelib site-packages of a venv (lib/pythonX.Y/site-packages)."""
    env = Path(env)
    candidates = sorted(env.glob("lib/python3.*/site-packages"))
    if not candidates:
        raise FileNotFoundError(f"{env} is not a Python env: no lib/python3.*/site-packages in it")
    return candidates[-1]


def env_python_version(env: Path) -> str | None:
    cfg = treecheck.read_text(Path(env) / "pyvenv.cfg")
    if cfg is not None:
        for line in cfg.splitlines():
            key, _, value = line.partition("=")
            if key.strip() in ("version_info", "version"):
                return ".".join(value.strip().split(".")[:3])
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
