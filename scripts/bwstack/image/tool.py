"""tool.tar: bwstack itself as the build's RUN steps run it (`python3.12 -m bwstack ...` with PYTHONPATH on it).

Its code, its build-time dependencies' pure-Python files and uv; served by the build server, never kept in a layer.
Its digest (a build arg) is the layers' cache key for "which bwstack installed this".
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import io
import json
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from bwstack.errors import BwstackError
from bwstack.probe.treecheck import sha256_file

# What bwstack needs at build time inside the image (env install, cuda install, patch apply); the rest of its
# dependencies (docker, ansible-core, pytest, zstandard) serve other commands.
TOOL_DEPENDENCIES = ("packaging", "PyYAML", "requests", "urllib3", "idna", "certifi", "charset-normalizer")
# Modules that only run on the host: left out of the tool digest so editing them does not rebuild every layer.
HOST_ONLY = ("bwstack/image/",)


@dataclass(frozen=True)
class ToolBundle:
    path: Path
    digest: str
    size: int


def _tool_files() -> Iterator[tuple[str, Path]]:
    """(name in the bundle, file on this host): bwstack's code and its build-time dependencies' pure-Python
    files (compiled extensions are left out: PyYAML and charset-normalizer fall back to pure Python, so the
    bundle runs on any CPython >= 3.10 whatever this host's Python is)."""
    import bwstack

    package = Path(bwstack.__file__).parent
    for path in sorted(package.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
            yield f"bwstack/{path.relative_to(package).as_posix()}", path
    for dist_name in TOOL_DEPENDENCIES:
        try:
            dist = importlib.metadata.distribution(dist_name)
        except importlib.metadata.PackageNotFoundError:
            raise BwstackError(f"{dist_name} is not installed beside bwstack; reinstall bwstack") from None
        for rel in sorted(dist.files or (), key=str):
            parts = Path(str(rel)).parts
            if not parts or parts[0] == ".." or parts[0].endswith((".dist-info", ".data")):
                continue
            if "__pycache__" in parts or rel.suffix in (".so", ".pyc", ".pyd"):
                continue
            source = Path(dist.locate_file(rel))
            if source.is_file():
                yield Path(str(rel)).as_posix(), source


def build_tool_bundle(directory: Path, step_script: Path) -> ToolBundle:
    """tool.tar: what the build's RUN steps run (`python3.12 -m bwstack ...` with PYTHONPATH on it)."""
    from bwstack import __version__
    from bwstack.lock.uvtool import uv_bin, uv_version

    entries = list(_tool_files())
    entries.append(("bin/uv", Path(uv_bin())))
    digest = hashlib.sha256()
    for name, path in sorted(entries):
        if not name.startswith(HOST_ONLY):
            digest.update(name.encode() + b"\0" + bytes.fromhex(sha256_file(path, follow_links=True)))
    digest.update(b"step.py\0" + bytes.fromhex(sha256_file(step_script)))
    info = {
        "bwstack_version": __version__,
        "uv_version": uv_version(),
        "digest": "sha256:" + digest.hexdigest(),
        "dependencies": {d: importlib.metadata.version(d) for d in TOOL_DEPENDENCIES},
    }
    out = directory / "tool.tar"
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, path in sorted(entries):
            member = tar.gettarinfo(str(path), arcname=name)
            member.uid = member.gid = 0
            member.uname = member.gname = "root"
            member.mtime = 0
            member.mode = 0o755 if name.startswith("bin/") else 0o644
            with open(path, "rb") as handle:
                tar.addfile(member, handle)
        blob = json.dumps(info, indent=2).encode()
        member = tarfile.TarInfo("BWSTACK_TOOL.json")
        member.size = len(blob)
        tar.addfile(member, io.BytesIO(blob))
    return ToolBundle(out, info["digest"], out.stat().st_size)
