"""A full disk (0 bytes free) never stops the remedy: every command that takes the run lock works or fails
with one line, and `prune` frees space."""

from __future__ import annotations

import errno
import json
import os
import subprocess

import pytest
from helpers import bwstack, needs_py312

from fixtures import fakestack

pytestmark = needs_py312


class _Stack:
    def __init__(self, tmp, mount) -> None:
        self.lock, self.wheelhouse = fakestack.make_stack(tmp)
        self.root = mount / "root"
        self.env = {
            "BWSTACK_ROOT": str(self.root),
            "BWSTACK_ML_ENV": str(tmp / "ml-env"),
            "BWSTACK_CUDA_LINK": "none",
            "BWSTACK_CACHE": str(self.root / "cache"),
        }

    def run(self, *args: str, check: bool = False):
        return bwstack("--lock", str(self.lock), *args, env=self.env, check=check)


@pytest.fixture(scope="module")
def full_store(tmp_path_factory):
    """A fixture store on its own tmpfs (room for the build's 1 GiB free-space margin), with two generations,
    then filled to the last byte. The commands run in order against the same full disk; prune runs last."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    tmp = tmp_path_factory.mktemp("full-disk")
    mount = tmp / "disk"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1200m", "tmpfs", str(mount)], capture_output=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.decode().strip()}")
    stack = _Stack(tmp, mount)
    stack.run("build", "--profile", "fixture-old", "--wheelhouse", str(stack.wheelhouse), check=True)
    stack.run("build", "--profile", "fixture-new", "--wheelhouse", str(stack.wheelhouse), check=True)
    archive = tmp / "gen.tar.zst"
    stack.run("backup", "--archive", str(archive), check=True)
    for n in range(2):  # two drifted snapshots: four generations, so prune always has one to remove
        site = next((mount / "root" / "current" / "env").glob("lib/python3.*/site-packages"))
        (site / f"drift{n}.py").write_text("X = 1\n")
        stack.run("backup", check=True)
    _fill(mount / "filler")
    yield stack, mount, archive
    subprocess.run(["umount", "-l", str(mount)], check=False)


def _fill(path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for size in (1 << 20, 1 << 12, 1):
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)


COMMANDS = {
    "build-converged": ["build", "--profile", "fixture-new", "--offline"],
    "build-new-profile": ["build", "--profile", "fixture-old", "--no-switch", "--offline"],
    "prune-nothing-to-remove": ["prune", "--keep", "5"],
    "rollback": ["rollback"],
    "rollback-to": ["rollback", "--to", "0"],
    "backup": ["backup"],
    "backup-archive": ["backup", "--archive", "{mount}/again.tar.zst"],
    "restore": ["restore", "{archive}", "--no-switch"],
    "adopt": ["adopt"],
    "generations": ["generations", "--check"],
}


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_a_run_lock_command_on_a_full_disk_works_or_fails_in_one_line(full_store, name):
    stack, mount, archive = full_store
    argv = [a.format(mount=mount, archive=archive) for a in COMMANDS[name]]
    result = stack.run(*argv)
    assert "Traceback" not in result.stderr
    if result.returncode != 0:
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    current = os.readlink(stack.root / "current")
    assert (stack.root / current / "env").is_dir(), "the active env is still there"


def test_prune_works_on_a_full_disk_and_frees_space(full_store):
    stack, mount, _archive = full_store
    assert os.statvfs(mount).f_bavail == 0
    result = stack.run("prune", "--keep", "1", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["removed"]
    assert os.statvfs(mount).f_bavail > 0
