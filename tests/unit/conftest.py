"""Shared fixtures: the real lock, a fixture stack (small wheels built here), a store under tmp_path."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
sys.path.insert(0, str(TESTS))

from helpers import REAL_LOCK, bwstack  # noqa: E402

from fixtures import fakestack  # noqa: E402


@pytest.fixture(scope="session")
def real_lock_path() -> Path:
    return REAL_LOCK


@pytest.fixture
def stack(tmp_path: Path):
    """A fixture stack: lock + wheelhouse + store env vars pointing into tmp_path."""
    lock, wheelhouse = fakestack.make_stack(tmp_path)

    class Stack:
        pass

    s = Stack()
    s.tmp = tmp_path
    s.lock = lock
    s.wheelhouse = wheelhouse
    s.root = tmp_path / "root"
    s.ml_env = tmp_path / "ml-env"
    s.cuda_link = tmp_path / "cuda-link"
    s.env = {
        "BWSTACK_ROOT": str(s.root),
        "BWSTACK_ML_ENV": str(s.ml_env),
        "BWSTACK_CUDA_LINK": str(s.cuda_link),
        # a store of its own, cache included: these tests watch what enters the cache
        "BWSTACK_CACHE": str(s.root / "cache"),
    }

    def run(*args: str, check: bool = False, extra_env: dict | None = None):
        return bwstack("--lock", str(lock), *args, env={**s.env, **(extra_env or {})}, check=check)

    s.run = run

    def build(profile: str = "fixture-new", *more: str, check: bool = False, extra_env: dict | None = None):
        return run(
            "build",
            "--profile",
            profile,
            "--wheelhouse",
            str(wheelhouse),
            *more,
            check=check,
            extra_env=extra_env,
        )

    s.build = build
    return s


SLOW_TIER_MIN_FREE_GIB = 45  # the real cu128 env (10 GB), its wheels (5 GB), uv's cache, a copy for restore


def pytest_collection_modifyitems(config, items):
    """The slow tier runs when the machine has room for it (BWSTACK_SLOW=1 forces it, =0 skips it).

    The SSH node tests go first: their node needs 30 GiB for Docker, which the other real-env tests would have
    taken by the time their turn came, and when the node's flow runs, the local real playbook run it covers
    skips itself (helpers.REAL_PLAYBOOK_RUN) instead of taking four more minutes of CI."""
    items.sort(key=lambda item: 0 if item.path.name == "test_remote_node.py" else 1)  # stable: the rest keep order
    _check_disk_heavy_files(items)
    choice = os.environ.get("BWSTACK_SLOW", "auto")
    if choice == "1":
        return
    free = shutil.disk_usage(os.environ.get("TMPDIR", "/tmp")).free / 2**30
    if choice == "0":
        reason = "slow tier switched off (BWSTACK_SLOW=0)"
    elif free < SLOW_TIER_MIN_FREE_GIB:
        reason = (
            f"slow tier needs {SLOW_TIER_MIN_FREE_GIB} GiB free, this machine has {free:.0f} GiB "
            "(BWSTACK_SLOW=1 forces it)"
        )
    else:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


# Under pytest-xdist (`-n`, README's test command), these files share one worker and run there one at a time, in
# the order above: they take the real env (one build per worker that needs it, 10 GB) or build images, and run
# as they would without workers, so the disk they need is what SLOW_TIER_MIN_FREE_GIB was measured for. Every
# other file goes to a worker whole (a module's fixture, such as the Ansible flow's node, is made once; the cases
# of test_cli_json run in their order). _check_disk_heavy_files keeps the list complete.
DISK_HEAVY_FILES = frozenset(
    {
        "test_remote_node.py",
        "test_ansible_real.py",
        "test_real_stack.py",
        "test_serveplan_truth.py",
        "test_accept_runtime.py",
        "test_elfscan.py",
        "test_fatbin.py",
        "test_image.py",
    }
)


def _check_disk_heavy_files(items) -> None:
    strays = sorted(
        {
            item.path.name
            for item in items
            if ("slow" in item.keywords or "real" in getattr(item, "fixturenames", ()))
            and item.path.name not in DISK_HEAVY_FILES
        }
    )
    if strays:
        raise pytest.UsageError(f"tests/unit/conftest.py: add {', '.join(strays)} to DISK_HEAVY_FILES (slow tests)")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`-n` alone (xdist's `load`): whole files to workers, the disk-heavy ones to one worker."""
    if config.getvalue("dist") != "load":
        return None  # a --dist the caller chose
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = nodeid.split("::", 1)[0]
            return "disk-heavy" if Path(file).name in DISK_HEAVY_FILES else file

    return ByFile(config, log)


@pytest.fixture(scope="session")
def real(tmp_path_factory):
    """The real cu128 env built from the lock (slow tier): one build per session, shared by the slow tests.
    BWSTACK_TEST_REAL_ROOT reuses a store between runs (and BWSTACK_CACHE shares downloads with other tiers)."""
    from bwstack.store.generations import Store
    from bwstack.store.layout import Layout

    base = Path(os.environ.get("BWSTACK_TEST_REAL_ROOT") or tmp_path_factory.mktemp("real"))
    base.mkdir(parents=True, exist_ok=True)
    env = {
        "BWSTACK_ROOT": str(base / "root"),
        "BWSTACK_ML_ENV": str(base / "ml-env"),
        "BWSTACK_CUDA_LINK": "none",
    }
    lock = base / "stack.lock.yaml"
    _write_lock_with_unpatched_twin(lock)
    started = time.perf_counter()
    result = bwstack("--lock", str(lock), "build", "--profile", "cu128", "--json", env=env, timeout=3600)
    assert result.returncode == 0, result.stderr[-3000:]
    print(f"\ncu128 build from the lock: {time.perf_counter() - started:.1f} s")
    tk = bwstack("--lock", str(lock), "cuda", "install", "--profile", "cu128", "--json", env=env, timeout=1800)
    assert tk.returncode == 0, tk.stderr[-2000:]

    class Real:
        pass

    r = Real()
    r.base, r.env, r.lock = base, env, lock
    r.build = json.loads(result.stdout)
    r.run = lambda *args, **kw: bwstack("--lock", str(lock), *args, env={**env, **kw.pop("extra_env", {})}, **kw)
    r.store = Store(Layout.default(str(base / "root"), str(base / "ml-env"), "none"))  # BWSTACK_CACHE as the CLI
    r.ml_env = base / "ml-env"
    return r


def _write_lock_with_unpatched_twin(path: Path) -> None:
    """The real lock plus `cu128-unpatched`: the same closure without the SM120 patch, a second real
    generation that installs in seconds from the warm cache."""
    doc = yaml.safe_load(REAL_LOCK.read_text())
    # The toolkit goes beside the store, not to the lock's /usr/local/cuda-12.8: a test writes nothing outside its
    # own folders (the home is in no digest, so the closures stay the lock's).
    doc["profiles"]["cu128"]["cuda"]["home"] = str(path.parent / "cuda" / "cuda-12.8")
    twin = json.loads(json.dumps(doc["profiles"]["cu128"]))
    twin["patches"] = []
    twin["description"] = "TEST: the cu128 profile without the SM120 patch"
    doc["profiles"]["cu128-unpatched"] = twin
    doc["closures"]["cu128-unpatched"] = json.loads(json.dumps(doc["closures"]["cu128"]))  # no YAML aliases
    path.write_text(yaml.safe_dump(doc, sort_keys=False))


@pytest.fixture(scope="session")
def real_flashinfer_064(real, tmp_path_factory):
    """A hard-link twin of the real cu128 env with FlashInfer 0.6.4 (python and cubin wheels from PyPI, as the
    cu130 profile pins) in place of 0.6.3: installers replace files, so the real env is untouched."""
    from realwheels import wheel

    from bwstack.lock.uvtool import run_uv, uv_env

    wheels = [wheel("flashinfer-python", "0.6.4"), wheel("flashinfer-cubin", "0.6.4")]
    dest = tmp_path_factory.mktemp("fi064") / "env"
    subprocess.run(["cp", "-al", str(real.store.active().env), str(dest)], check=True)
    # the twin's own directories only: its files are the real generation's inodes, whose modes it promises
    subprocess.run(["find", str(dest), "-type", "d", "-exec", "chmod", "u+w", "{}", "+"], check=True)
    result = run_uv(
        ["pip", "install", "--python", str(dest / "bin" / "python"), "--no-deps", *map(str, wheels)],
        env=uv_env({"UV_CACHE_DIR": str(real.store.layout.uv_cache)}),
        capture=True,
    )
    assert result.returncode == 0, result.stderr[-1000:]
    yield dest
    shutil.rmtree(dest, ignore_errors=True)
