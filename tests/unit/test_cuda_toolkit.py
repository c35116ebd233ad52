"""`bwstack cuda install` (the pip method) and the env build share one uv cache: the store's.

TEST FIXTURES: the wheels are small ones the tests build (tests/fixtures/fakestack.py), one of them shaped like
NVIDIA's runtime wheel and taken by both the toolkit and the env, as the real cuBLAS, NVRTC and cuRAND wheels are.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import bwstack, needs_py312

from fixtures import fakestack

SHARED_FILE = "nvidia/cuda_runtime/lib/libcudart.so.12"


@pytest.fixture
def node(tmp_path: Path):
    lock, wheelhouse = fakestack.make_stack(tmp_path, toolkit_shares_env=True)
    root = tmp_path / "root"
    env = {
        "BWSTACK_ROOT": str(root),
        "BWSTACK_ML_ENV": str(tmp_path / "ml-env"),
        "BWSTACK_CUDA_LINK": str(tmp_path / "cuda-link"),
        "BWSTACK_CACHE": str(root / "cache"),
        # The caller's own uv cache: root must never install from a cache the caller's environment names.
        "UV_CACHE_DIR": str(tmp_path / "callers-uv-cache"),
    }

    class Node:
        pass

    n = Node()
    n.tmp, n.root, n.uv_cache = tmp_path, root, root / "cache" / "uv"
    n.home = tmp_path / "cuda-home"
    n.env = {**os.environ, **env}
    n.args = lambda *args: ["--lock", str(lock), *args, "--wheelhouse", str(wheelhouse), "--offline"]
    n.run = lambda *args: bwstack(*n.args(*args), env=env, timeout=600)
    return n


def _unpacked(uv_cache: Path) -> list[Path]:
    """Every copy of the shared wheel's library that uv unpacked into its cache."""
    return sorted(uv_cache.glob(f"archive-v*/*/{SHARED_FILE}"))


@needs_py312
def test_the_toolkit_is_unpacked_through_the_stores_uv_cache_not_the_callers(node):
    done = node.run("cuda", "install", "--profile", "fixture-old", "--prefix", str(node.home), "--json")
    assert done.returncode == 0, done.stderr
    assert (node.home / "lib" / "libcudart.so.12").read_text() == "TEST FIXTURE, not a library\n"
    assert len(_unpacked(node.uv_cache)) == 1
    assert not (node.tmp / "callers-uv-cache").exists()


@needs_py312
def test_a_wheel_the_toolkit_and_the_env_both_take_is_unpacked_once(node):
    """The toolkit's copy is its own (copied out of the cache); the env's build finds the wheel already unpacked
    and links those files, instead of unpacking the same wheel again (the real cuBLAS alone is 594 MB)."""
    assert node.run("cuda", "install", "--profile", "fixture-old", "--prefix", str(node.home)).returncode == 0
    (first,) = _unpacked(node.uv_cache)
    built = node.run("build", "--profile", "fixture-old", "--json")
    assert built.returncode == 0, built.stderr
    assert _unpacked(node.uv_cache) == [first]
    (in_env,) = (node.root / "generations").glob(f"*/env/lib/python3.12/site-packages/{SHARED_FILE}")
    assert os.stat(in_env).st_ino == os.stat(first).st_ino
    assert os.stat(node.home / "lib" / "libcudart.so.12").st_ino != os.stat(first).st_ino
    assert not (node.tmp / "callers-uv-cache").exists()  # the build's `uv venv` keeps interpreter facts there


@needs_py312
def test_the_toolkit_install_runs_no_interpreter_the_callers_folder_or_environment_names(node):
    """Without an interpreter named, uv finds one (a .venv in the folder it runs in, VIRTUAL_ENV) and runs it to
    learn its facts: root would run the caller's program. bwstack names its own."""
    planted = node.tmp / "project" / ".venv"
    (planted / "bin").mkdir(parents=True)
    (planted / "pyvenv.cfg").write_text("home = /usr/bin\nversion_info = 3.12.1\n")
    ran = node.tmp / "the-planted-interpreter-ran"
    (planted / "bin" / "python").write_text(f"#!/bin/sh\ntouch {ran}\nexit 1\n")
    (planted / "bin" / "python").chmod(0o755)
    (planted / "bin" / "python3").symlink_to("python")
    done = subprocess.run(
        [sys.executable, "-m", "bwstack", *node.args("cuda", "install", "--profile", "fixture-old",
                                                      "--prefix", str(node.home))],
        cwd=planted.parent, env={**node.env, "VIRTUAL_ENV": str(planted)}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert not ran.exists()
    assert (node.home / "lib" / "libcudart.so.12").is_file()
