"""The probe as one zipapp (bwstack's probe modules + pyelftools), shipped to hosts that lack bwstack."""

from __future__ import annotations

import hashlib
import io
import zipfile
from functools import cache
from pathlib import Path

import elftools

import bwstack

PROBE_MODULES = (
    "__init__.py",
    "probe.py",
    "preflight.py",
    "envinspect.py",
    "elfscan.py",
    "fatbin.py",
    "features.py",
    "waivers.py",
)
PROBE_FILES = (
    # node acceptance's static part (preflight runs it): readers and judge, standard library only
    "accept/__init__.py",
    "accept/machine.py",
    "accept/facts.py",
    "accept/pcie.py",
    "accept/driver.py",
    "accept/kernel.py",
    "accept/collect.py",
    "accept/judge.py",
    # serve-plan's node side and the data it reads there (the reference model configs)
    "serveplan/__init__.py",
    "serveplan/node.py",
    "serveplan/inenv.py",
    "serveplan/references.py",
    "data/__init__.py",
)
PROBE_DATA = ("data/models",)
MAIN = "from bwstack.probe import main\nraise SystemExit(main())\n"


@cache
def build() -> bytes:
    """Deterministic bytes (fixed timestamps), so the remote copy is reused while the code is unchanged."""
    buffer = io.BytesIO()
    stamp = (2026, 1, 1, 0, 0, 0)
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(zipfile.ZipInfo("__main__.py", stamp), MAIN)
        package = Path(bwstack.__file__).parent
        for name in (*PROBE_MODULES, *PROBE_FILES):
            archive.writestr(zipfile.ZipInfo(f"bwstack/{name}", stamp), (package / name).read_bytes())
        for folder in PROBE_DATA:
            for path in sorted((package / folder).rglob("*")):
                if path.is_file():
                    rel = path.relative_to(package).as_posix()
                    archive.writestr(zipfile.ZipInfo(f"bwstack/{rel}", stamp), path.read_bytes())
        root = Path(elftools.__file__).parent
        for path in sorted(root.rglob("*.py")):
            archive.writestr(zipfile.ZipInfo(f"elftools/{path.relative_to(root)}", stamp), path.read_bytes())
    return buffer.getvalue()


def digest() -> str:
    return hashlib.sha256(build()).hexdigest()[:16]


def write(path: str | Path) -> Path:
    path = Path(path)
    path.write_bytes(build())
    return path
