"""Real wheels from PyPI for tests: downloaded once into a cache, then unpacked into a temporary
"site-packages" (only the files the tests read).

    from realwheels import site_packages, wheel_bytes
    sp = site_packages(tmp_path, ("sglang", "0.5.9"), ("flashinfer-python", "0.6.4"))

The cache is `$BWSTACK_TEST_CACHE/wheels` (default `~/.cache/bwstack-tests/wheels`). A wheel already there is
used as is; otherwise `pip download --no-deps` fetches it (for platform wheels the cp312 manylinux_2_34 x86_64
build, the stack's target; the Python files used here are identical across sglang's per-Python wheels).
Tests that use it are marked `@pytest.mark.network`: a warm cache needs no network, a cold one does.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable
from pathlib import Path

import pytest

CACHE_ENV = "BWSTACK_TEST_CACHE"

# What the tests read from each distribution (prefixes of paths inside the wheel; dist-info METADATA always).
MEMBERS: dict[str, tuple[str, ...]] = {
    "sglang": (
        "sglang/srt/distributed/device_communicators/all_reduce_utils.py",
        "sglang/srt/distributed/device_communicators/torch_symm_mem.py",
        "sglang/srt/layers/communicator.py",  # the fusion gate up to 0.5.20
        "sglang/srt/layers/layer_boundary/residual/add_norm.py",  # the fusion gate from 0.5.21
        "sglang/srt/utils/common.py",  # is_sm90_supported & co.
        "sglang/srt/runtime_context.py",  # get_platform().is_sm90 -> is_sm90_supported (0.5.21+)
    ),
    "flashinfer-python": (
        "flashinfer/jit/comm.py",
        "flashinfer/data/include/flashinfer/comm/",
    ),
}


def cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "bwstack-tests"
    path = Path(root) / "wheels"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _cached(name: str, version: str) -> Path | None:
    prefix = f"{_normalise(name)}-{version}-"
    hits = sorted(p for p in cache_dir().glob("*.whl") if p.name.lower().startswith(prefix))
    return hits[0] if hits else None


def wheel(name: str, version: str) -> Path:
    """Path of the real wheel `name==version` in the cache, downloading it with pip if needed."""
    found = _cached(name, version)
    if found is not None:
        return found
    with tempfile.TemporaryDirectory(dir=cache_dir(), prefix=".download-") as tmp:
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "--quiet",
            "--only-binary=:all:", "--python-version", "3.12", "--platform", "manylinux_2_34_x86_64",
            f"{name}=={version}", "-d", tmp,
        ]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        got = sorted(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or len(got) != 1:
            pytest.fail(f"could not download {name}=={version} from PyPI:\n{proc.stdout}\n{proc.stderr}")
        target = cache_dir() / got[0].name
        os.replace(got[0], target)  # atomic: a concurrent run sees the whole wheel or none
    return target


def wheel_bytes(name: str, version: str, member: str) -> bytes:
    """The bytes of one file as the real wheel ships it."""
    with zipfile.ZipFile(wheel(name, version)) as zf:
        return zf.read(member)


def extract(name: str, version: str, dest: Path, members: Iterable[str] | None = None) -> Path:
    """Unpack the files of `name==version` under `dest` whose paths start with one of `members`
    (default: MEMBERS[name]), plus its dist-info METADATA. Returns `dest`."""
    prefixes = tuple(MEMBERS.get(name, ()) if members is None else members)
    dest.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel(name, version)) as zf:
        for info in zf.infolist():
            top = info.filename.split("/", 1)[0]
            is_metadata = top.endswith(".dist-info") and info.filename.endswith("/METADATA")
            if not info.is_dir() and (is_metadata or info.filename.startswith(prefixes)):
                zf.extract(info, dest)
    return dest


def site_packages(tmp_path: Path, *dists: tuple[str, str], name: str = "site-packages") -> Path:
    """A fresh directory holding the test-relevant files of each (name, version) real wheel."""
    dest = tmp_path / name
    for dist, version in dists:
        extract(dist, version, dest)
    return dest
