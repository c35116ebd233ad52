"""The probe as one zipapp (bwstack's probe modules, standard library only), shipped to hosts that lack bwstack."""

from __future__ import annotations

import hashlib
import io
import zipfile
from functools import cache
from pathlib import Path

import bwstack
from bwstack.fsutil import atomic_write_bytes

# The probe is the package bwstack.probe, whole: its boundary is the folder (and the import-layer test keeps it
# standard library only), not a list of file names to keep in step.
SHIPPED_SUFFIXES = (".py", ".json")
MAIN = "from bwstack.probe.main import main\nraise SystemExit(main())\n"


@cache
def build() -> bytes:
    """Deterministic bytes (fixed timestamps), so the remote copy is reused while the code is unchanged."""
    buffer = io.BytesIO()
    stamp = (2026, 1, 1, 0, 0, 0)
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(zipfile.ZipInfo("__main__.py", stamp), MAIN)
        package = Path(bwstack.__file__).parent
        archive.writestr(zipfile.ZipInfo("bwstack/__init__.py", stamp), (package / "__init__.py").read_bytes())
        for path in sorted((package / "probe").rglob("*")):
            if path.is_file() and path.suffix in SHIPPED_SUFFIXES and "__pycache__" not in path.parts:
                rel = path.relative_to(package).as_posix()
                archive.writestr(zipfile.ZipInfo(f"bwstack/{rel}", stamp), path.read_bytes())
    return buffer.getvalue()


def sha256() -> str:
    return hashlib.sha256(build()).hexdigest()


def digest() -> str:
    """In the probe's file name: which code it is."""
    return sha256()[:16]


def write(path: str | Path) -> Path:
    """Into a new file beside `path` (mkstemp), renamed over it: a link at `path` is replaced, not followed."""
    path = Path(path)
    atomic_write_bytes(path, build())
    return path
