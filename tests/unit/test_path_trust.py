"""A program bwstack runs as root without having installed it (a toolkit's nvcc, named by the lock's cuda.home or
the env's CUDA_HOME) is run only where nobody but root and this user could have put it: its folders and the file
itself closed to others. The toolkits here are TEST FIXTURES: a shell script named nvcc that leaves a mark when
it runs."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from helpers import OTHER_UID, acl_for_another_user

from bwstack.probe import main as probe
from bwstack.probe import pathtrust
from bwstack.provision import cudatk

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving files to another user needs root")
OTHER_GID = 65534  # nogroup: not this user's private group


def _toolkit(tmp_path: Path) -> Path:
    """tmp_path/cuda/bin/nvcc: prints a CUDA 13.0 version and marks that it ran."""
    os.chmod(tmp_path, 0o755)
    home = tmp_path / "cuda"
    (home / "bin").mkdir(parents=True)
    nvcc = home / "bin" / "nvcc"
    nvcc.write_text(f"#!/bin/sh\ntouch {tmp_path}/ran\necho 'Cuda compilation tools, release 13.0, V13.0.88'\n")
    nvcc.chmod(0o755)
    return home


def _world_writable_bin(home: Path) -> str:
    os.chmod(home / "bin", 0o777)
    return "is writable by everyone"


def _world_writable_nvcc(home: Path) -> str:
    os.chmod(home / "bin" / "nvcc", 0o777)
    return "is writable by everyone"


def _group_writable_folder(home: Path) -> str:
    os.chown(home, -1, OTHER_GID)
    os.chmod(home, 0o775)
    return f"is writable by group {OTHER_GID}"


def _folder_of_another_user(home: Path) -> str:
    os.chown(home / "bin", OTHER_UID, -1)
    return f"belongs to uid {OTHER_UID}"


def _nvcc_of_another_user(home: Path) -> str:
    os.chown(home / "bin" / "nvcc", OTHER_UID, -1)
    return f"belongs to uid {OTHER_UID}"


def _link_of_another_user_on_the_way(home: Path) -> str:
    """bin is a link another user owns (a -> b/c -> d, where the link is the attacker's)."""
    real = home / "real-bin"
    os.rename(home / "bin", real)
    os.symlink(real, home / "bin")
    os.lchown(home / "bin", OTHER_UID, -1)
    return f"the link {home / 'bin'} belongs to uid {OTHER_UID}"


def _acl_on_nvcc(home: Path) -> str:
    acl_for_another_user(home / "bin" / "nvcc")
    return "given to others by an access ACL"


def _acl_on_bin(home: Path) -> str:
    acl_for_another_user(home / "bin")
    return "given to others by an access ACL"


OPEN = [
    _acl_on_nvcc,
    _acl_on_bin,
    _world_writable_bin,
    _world_writable_nvcc,
    _group_writable_folder,
    _folder_of_another_user,
    _nvcc_of_another_user,
    _link_of_another_user_on_the_way,
]


@needs_root
@pytest.mark.parametrize("open_it", OPEN, ids=[f.__name__.strip("_") for f in OPEN])
def test_a_program_others_could_replace_is_named_with_the_reason(tmp_path, open_it):
    home = _toolkit(tmp_path)
    why = open_it(home)
    found = pathtrust.program_open_to_others(home / "bin" / "nvcc")
    assert found is not None and why in found, found


def test_a_program_only_root_or_this_user_can_replace_is_trusted(tmp_path):
    assert pathtrust.program_open_to_others(_toolkit(tmp_path) / "bin" / "nvcc") is None


def test_a_program_that_cannot_be_checked_is_not_trusted(tmp_path):
    assert "cannot be checked" in pathtrust.program_open_to_others(tmp_path / "absent" / "nvcc")


@needs_root
@pytest.mark.parametrize("open_it", OPEN, ids=[f.__name__.strip("_") for f in OPEN])
def test_cuda_status_does_not_run_an_nvcc_others_could_replace(tmp_path, open_it):
    home = _toolkit(tmp_path)
    open_it(home)
    status = cudatk.status(home)
    assert not (tmp_path / "ran").exists(), "the planted nvcc ran"
    assert status.version is None and status.note.startswith("nvcc not run: "), status


def test_cuda_status_runs_the_nvcc_of_a_closed_toolkit(tmp_path):
    status = cudatk.status(_toolkit(tmp_path))
    assert status.version == "13.0.88" and (tmp_path / "ran").exists()


@pytest.mark.parametrize("name", [cudatk.MARKER, "version.json"])
@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b"\xff\xfe", b'{"cuda": 7, "cuda_version": 13}'])
def test_cuda_status_of_a_toolkit_with_a_malformed_description_is_not_an_error(tmp_path, name, body):
    home = tmp_path / "cuda"
    home.mkdir()
    (home / name).write_bytes(body)
    status = cudatk.status(home)
    assert status.exists and status.version is None


@needs_root
def test_the_probe_does_not_run_an_nvcc_others_could_replace(tmp_path, monkeypatch):
    """CUDA_HOME as the env sees it names a toolkit whose bin/ anyone can write: the verify (root) does not run
    its nvcc, and says why."""
    home = _toolkit(tmp_path)
    _world_writable_bin(home)
    env = tmp_path / "env"
    (env / "bin").mkdir(parents=True)
    os.symlink(sys.executable, env / "bin" / "python")
    monkeypatch.setenv("CUDA_HOME", str(home))
    facts = probe.cuda_facts(env, "12.0")
    assert not (tmp_path / "ran").exists(), "the planted nvcc ran"
    assert "is writable by everyone" in facts["nvcc_refused"] and "compile" not in facts


def _open_ptxas(home: Path) -> str:
    (home / "bin" / "ptxas").write_text("#!/bin/sh\n")
    os.chmod(home / "bin" / "ptxas", 0o777)
    return "ptxas is writable by everyone"


def _open_profile(home: Path) -> str:
    (home / "bin" / "nvcc.profile").write_text("INCLUDES += -I$(TOP)/include\n")
    os.chmod(home / "bin" / "nvcc.profile", 0o666)
    return "nvcc.profile is writable by everyone"


def _cicc_of_another_user(home: Path) -> str:
    (home / "nvvm" / "bin").mkdir(parents=True)
    (home / "nvvm" / "bin" / "cicc").write_text("#!/bin/sh\n")
    os.chown(home / "nvvm" / "bin" / "cicc", OTHER_UID, -1)
    return f"cicc belongs to uid {OTHER_UID}"


def _link_to_a_program_others_can_write(home: Path) -> str:
    elsewhere = home.parent / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "fatbinary").write_text("#!/bin/sh\n")
    os.chmod(elsewhere / "fatbinary", 0o777)
    os.symlink(elsewhere / "fatbinary", home / "bin" / "fatbinary")
    return "fatbinary is writable by everyone"


WHAT_NVCC_RUNS = [_open_ptxas, _open_profile, _cicc_of_another_user, _link_to_a_program_others_can_write]


@needs_root
@pytest.mark.parametrize("open_it", WHAT_NVCC_RUNS, ids=[f.__name__.strip("_") for f in WHAT_NVCC_RUNS])
def test_nvcc_is_not_run_when_what_it_starts_could_be_replaced(tmp_path, open_it, monkeypatch):
    """nvcc is a driver: it runs cicc, ptxas and fatbinary from the toolkit and reads nvcc.profile."""
    home = _toolkit(tmp_path)
    why = open_it(home)
    found = pathtrust.toolkit_open_to_others(home)
    assert found is not None and why in found, found
    status = cudatk.status(home)
    assert not (tmp_path / "ran").exists() and status.note.startswith("nvcc not run: ")
    env = tmp_path / "env"
    (env / "bin").mkdir(parents=True)
    os.symlink(sys.executable, env / "bin" / "python")
    monkeypatch.setenv("CUDA_HOME", str(home))
    facts = probe.cuda_facts(env, "12.0")
    assert not (tmp_path / "ran").exists() and why in facts["nvcc_refused"]


def test_a_toolkit_with_more_paths_than_can_be_checked_is_not_trusted(tmp_path):
    home = _toolkit(tmp_path)
    for i in range(5):
        (home / "bin" / f"tool{i}").write_text("")
    assert "more than 3 paths" in pathtrust.toolkit_open_to_others(home, limit=3)
