"""CUDA toolkits side by side (/usr/local/cuda-13.0 beside /usr/local/cuda-12.8).

`pip` method: the profile's locked `cuda-toolkit[...]` wheels (hash-checked like the env's) laid out as a
toolkit directory: bin, include, lib (+ lib64 and targets/x86_64-linux links), nvvm. Works on air-gapped
nodes from a wheelhouse. The `apt` method lives in the Ansible `cuda` role (NVIDIA's repository and a
pinned package). Which toolkit is active is decided by the generation switch, never here.

NVIDIA's PyPI wheels for CUDA 12.x (nvidia-cuda-nvcc-cu12) ship ptxas and NVVM but no `nvcc` driver
program; the CUDA 13 wheels ship the whole compiler. `status` says plainly when nvcc is absent.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from bwstack.errors import BwstackError
from bwstack.fsutil import atomic_write_text, fsync_dir
from bwstack.lock.model import Profile
from bwstack.lock.tags import Target, select
from bwstack.lock.uvtool import run_uv, uv_env
from bwstack.probe import pathtrust, treecheck
from bwstack.provision.envbuild import drop_world_write
from bwstack.provision.wheelhouse import Fetcher, direct_requirements

MARKER = "bwstack-toolkit.json"
SKIP = {"__init__.py", "__pycache__", ".metadata"}


@dataclass
class ToolkitStatus:
    home: str
    exists: bool
    version: str | None  # from nvcc, else from the marker / version.json
    nvcc: str | None  # path to nvcc, None when absent
    managed_by: str  # "bwstack-pip", "other" or "absent"
    note: str = ""

    def as_dict(self) -> dict:
        return self.__dict__.copy()


def nvcc_version(nvcc: Path) -> str | None:
    try:
        out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"release \d+\.\d+, V(\d+\.\d+\.\d+)", out)
    return match.group(1) if match else None


def _json_file(path: Path) -> dict | None:
    """A small JSON document of the toolkit (bwstack's marker, NVIDIA's version.json): read bounded, never a FIFO
    or a device; None when absent, unreadable or not an object."""
    try:
        text = treecheck.read_text(path, 1 << 20)
        doc = json.loads(text) if text is not None else None
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def status(home: str | Path) -> ToolkitStatus:
    home = Path(home)
    if not home.exists():
        return ToolkitStatus(str(home), False, None, None, "absent", "not installed")
    nvcc = home / "bin" / "nvcc"
    # Run as root, a program others could have put there is theirs: the toolkit's folders, nvcc and what it starts
    # (bin/, nvvm/) must be closed to them (root's or this user's, not writable by others).
    unsafe = pathtrust.toolkit_open_to_others(home) if nvcc.is_file() else None
    version = nvcc_version(nvcc) if nvcc.is_file() and unsafe is None else None
    info = _json_file(home / MARKER)
    managed = "other"
    note = f"nvcc not run: {unsafe}" if unsafe else ""
    if info is not None:
        managed = "bwstack-pip"
        marked = info.get("cuda_version")
        version = version or (marked if isinstance(marked, str) else None)
        if not nvcc.is_file():
            note = str(info.get("note", ""))
    elif version is None:
        cuda = (_json_file(home / "version.json") or {}).get("cuda")
        found = cuda.get("version") if isinstance(cuda, dict) else None
        version = found if isinstance(found, str) else None
    if not nvcc.is_file() and not note:
        note = f"no nvcc in {home}/bin: FlashInfer cannot JIT-compile kernels with this toolkit"
    return ToolkitStatus(str(home), True, version, str(nvcc) if nvcc.is_file() else None, managed, note)


def matches(profile: Profile, st: ToolkitStatus) -> bool:
    return st.version is not None and st.version.startswith(profile.cuda.major_minor + ".")


def install_pip(
    profile: Profile, fetcher: Fetcher, home: Path | None = None, *, cache_dir: Path, log=print
) -> ToolkitStatus:
    """Lay the locked toolkit wheels out at `home` (default: the profile's). Idempotent. `cache_dir`: uv's cache,
    the store's (the env's build unpacks through the same one, so the wheels both take are unpacked once; and root
    never installs from a cache the caller's environment named)."""
    closure = profile.require_closure()
    home = Path(home or profile.cuda.home)
    current = status(home)
    if current.exists:
        if current.managed_by == "bwstack-pip" or matches(profile, current):
            return current
        raise BwstackError(
            f"{home} exists with CUDA {current.version or 'of unknown version'}, not {profile.cuda.version}: "
            f"refusing to overwrite a toolkit bwstack did not install (pass --prefix elsewhere)"
        )
    selection = select(closure.cuda_toolkit, Target.of(profile))
    wheels = fetcher.fetch_all(selection)
    building = home.with_name(f".{home.name}.building")
    if building.exists():
        shutil.rmtree(building)
    building.mkdir(parents=True)
    try:
        site = building / "site"
        reqs = building / "requirements.txt"
        reqs.write_text(direct_requirements(wheels))
        result = run_uv(
            [
                "pip",
                "install",
                "--target",
                str(site),
                # The interpreter uv asks for the target's facts: bwstack's own, never one uv would find from the
                # folder it runs in (a .venv there) or the caller's environment, which root would then run.
                "--python",
                sys.executable,
                "--no-index",
                "--require-hashes",
                "--no-deps",
                "--only-binary",
                ":all:",
                "--link-mode",
                "copy",
                "--python-version",
                profile.python,
                "--python-platform",
                f"x86_64-manylinux_2_{Target.of(profile).glibc_minor}",
                "-r",
                str(reqs),
            ],
            env=uv_env({"UV_CACHE_DIR": str(cache_dir)}),
            capture=True,
            cwd=str(building),
        )
        drop_world_write(cache_dir)
        if result.returncode != 0:
            raise BwstackError(f"uv could not unpack the toolkit wheels: {result.stderr.strip()[-800:]}")
        root = building / "root"
        _lay_out(site / "nvidia", root)
        nvcc = root / "bin" / "nvcc"
        note = (
            ""
            if nvcc.is_file()
            else (
                "NVIDIA's PyPI wheels for this CUDA release ship no nvcc (only ptxas and NVVM): FlashInfer cannot "
                "JIT-compile SM120 kernels with this toolkit; use the apt method for a full toolkit"
            )
        )
        marker = {
            "cuda_version": profile.cuda.version,
            "method": "pip",
            "components": list(profile.cuda.pip_components),
            "wheels": {w.package: w.as_dict() for w in wheels.values()},
            "note": note,
        }
        atomic_write_text(root / MARKER, json.dumps(marker, indent=2))
        home.parent.mkdir(parents=True, exist_ok=True)
        os.rename(root, home)
        fsync_dir(home.parent)
    finally:
        shutil.rmtree(building, ignore_errors=True)
    result_status = status(home)
    if note:
        log(f"WARNING: {note}")
    return result_status


def _lay_out(nvidia: Path, root: Path) -> None:
    """Merge nvidia/<component>/{bin,include,lib,nvvm,...} (cu12) or nvidia/cu13/... into one tree."""
    root.mkdir()
    for component in sorted(nvidia.iterdir()):
        if not component.is_dir() or component.name in SKIP:
            continue
        for part in sorted(component.iterdir()):
            if part.name in SKIP:
                continue
            _merge(part, root / part.name)
    (root / "lib").mkdir(exist_ok=True)
    for lib in list((root / "lib").glob("lib*.so.*")):
        unversioned = lib.with_name(lib.name.split(".so.")[0] + ".so")
        if not unversioned.exists():
            unversioned.symlink_to(lib.name)
    (root / "lib64").symlink_to("lib")
    targets = root / "targets" / "x86_64-linux"
    targets.mkdir(parents=True)
    (targets / "include").symlink_to("../../include")
    (targets / "lib").symlink_to("../../lib")


def _merge(src: Path, dest: Path) -> None:
    if src.is_dir() and not src.is_symlink():
        dest.mkdir(exist_ok=True)
        for child in src.iterdir():
            if child.name not in SKIP:
                _merge(child, dest / child.name)
        return
    if dest.exists() or dest.is_symlink():
        if dest.is_file() and src.is_file() and dest.read_bytes() == src.read_bytes():
            return
        raise BwstackError(f"toolkit layout: two wheels both provide {dest.name} with different content")
    os.rename(src, dest)
