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
MAIN = "from bwstack.probe import main\nraise SystemExit(main())\n"


@cache
def build() -> bytes:
    """Deterministic bytes (fixed timestamps), so the remote copy is reused while the code is unchanged."""
    buffer = io.BytesIO()
    stamp = (2026, 1, 1, 0, 0, 0)
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(zipfile.ZipInfo("__main__.py", stamp), MAIN)
        package = Path(bwstack.__file__).parent
        for name in PROBE_MODULES:
            archive.writestr(zipfile.ZipInfo(f"bwstack/{name}", stamp), (package / name).read_bytes())
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
