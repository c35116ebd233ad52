"""Build a Python env from fetched wheels with uv: one implementation for provisioning and the image build."""

from __future__ import annotations

import heapq
import os
import stat
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

from bwstack.errors import BwstackError, UsageError
from bwstack.lock.uvtool import run_uv, uv_env
from bwstack.probe import envinspect, interp, preflight
from bwstack.provision.wheelhouse import LocalWheel, direct_requirements


def find_python(version: str, explicit: str | None = None) -> str:
    """An interpreter for `version` (e.g. "3.12"): the one given, else python3.X on PATH or usual places."""
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise UsageError(f"--python {explicit}: not an executable")
        return explicit
    found = preflight.find_python(version)
    if found is None:
        raise BwstackError(
            f"no Python {version} found (the profile's interpreter): install python{version} "
            f"(Ubuntu 24.04: apt install python3.12-venv) or pass --python PATH"
        )
    return found


def create_venv(dest: Path, python: str, *, cache_dir: Path) -> None:
    """A relocatable venv: its scripts find their interpreter relative to themselves, so the env can be
    built under a temporary name and renamed into place. `cache_dir`: uv's cache (it keeps what it learnt of the
    interpreter there), as for `install`."""
    env = uv_env({"UV_CACHE_DIR": str(cache_dir)})
    result = run_uv(["venv", "--relocatable", "--python", python, str(dest)], env=env, capture=True)
    if result.returncode != 0:
        raise BwstackError(f"uv venv failed for {dest}: {result.stderr.strip()[-800:]}")


def install(
    env_dir: Path,
    wheels: Mapping[str, LocalWheel],
    *,
    cache_dir: Path,
    link_mode: str = "hardlink",
    ca_bundle: str | None = None,
) -> None:
    """Install exactly `wheels` (no resolution, no index, hashes required) into the env. `cache_dir`: uv's cache,
    always named: uv takes what its cache holds as the wheel's files, so root never uses one the caller's
    environment (UV_CACHE_DIR) names."""
    if not wheels:
        return
    python = env_dir / "bin" / "python"
    extra = {"UV_CACHE_DIR": str(cache_dir)}
    # Direct file references into the content-addressed store (stable paths): later generations hard-link the
    # files uv's cache unpacked once.
    with tempfile.TemporaryDirectory(prefix="bwstack-install-") as tmp:
        reqs = Path(tmp, "requirements.txt")
        reqs.write_text(direct_requirements(wheels))
        args = [
            "pip", "install", "--python", str(python), "--no-index",
            "--require-hashes", "--no-deps", "--only-binary", ":all:",
            "--link-mode", link_mode, "-r", str(reqs),
        ]  # fmt: skip
        result = run_uv(args, env=uv_env(extra, ca_bundle=ca_bundle), capture=True)
    drop_world_write(cache_dir)
    if result.returncode != 0:
        detail = result.stderr.strip()[-1200:]
        if "No space left on device" in detail:
            raise BwstackError(f"disk full while installing into {env_dir}; nothing was switched")
        raise BwstackError(f"uv could not install into {env_dir}: {detail}")


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for running the env's tools during a build: the env as it runs on its own."""
    return interp.clean_env(extra, own=True)


# Folders of packages' own test suites (pandas/tests, sympy/**/tests, ...): a serving process never imports them,
# and they hold about a seventh of the env's Python source, so a seventh of the bytecode phase.
TEST_FOLDER = "tests"
# What compiling one file costs beside its size, in bytes of source (measured: 20,835 files, 312 MB).
PER_FILE_BYTES = 2000
BYTECODE_TIMEOUT_S = 3600

# Run by each of the env's own interpreters compile_bytecode starts: bytecode, with that Python's compileall, for
# the sources named on standard input (NUL-separated). A source that does not compile (templates, another Python's
# files) gets none, which is not ours to fix; any other exit is the interpreter failing (a MemoryError, a kill).
_COMPILE_LISTED = """import compileall, os, sys
for raw in sys.stdin.buffer.read().split(b"\\0"):
    if raw:
        compileall.compile_file(os.fsdecode(raw), quiet=2)
sys.exit(0)
"""


def bytecode_sources(site: Path) -> list[tuple[int, str]]:
    """(size, path) of each source that gets bytecode: a regular file named *.py below site-packages, links not
    followed, none under a folder named TEST_FOLDER below site-packages (only below it: the store's own path may
    hold such a name), none in a folder whose __pycache__ is not a real folder (a link there would have root write
    bytecode wherever it leads; no wheel can make one, but the env is not trusted for that). One listing a folder."""
    found: list[tuple[int, str]] = []
    folders = [str(site)]
    while folders:
        with os.scandir(folders.pop()) as listing:
            entries = list(listing)
        cache = next((e for e in entries if e.name == "__pycache__"), None)
        own_cache = cache is None or cache.is_dir(follow_symlinks=False)
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                if entry.name not in (TEST_FOLDER, "__pycache__"):
                    folders.append(entry.path)
            elif own_cache and entry.name.endswith(".py") and entry.is_file(follow_symlinks=False):
                found.append((entry.stat(follow_symlinks=False).st_size, entry.path))
    return found


def share_out(sources: list[tuple[int, str]], workers: int) -> list[list[str]]:
    """The sources in `workers` lists of about equal work (compiling takes about as long as the file is big, plus
    a fixed cost per file): the biggest first, each to the list with the least so far."""
    lists: list[tuple[int, int, list[str]]] = [(0, i, []) for i in range(max(1, workers))]
    heapq.heapify(lists)
    for size, path in sorted(sources, reverse=True):
        work, index, paths = heapq.heappop(lists)
        paths.append(path)
        heapq.heappush(lists, (work + size + PER_FILE_BYTES, index, paths))
    return [paths for _work, _index, paths in sorted(lists, key=lambda entry: entry[1]) if paths]


def compile_bytecode(env_dir: Path, workers: int | None = None) -> None:
    """Bytecode for every module of the env but the packages' test suites, with the env's own interpreter, before
    the generation is sealed: it becomes part of the manifest, and Python never writes into the generation later
    (its hook stops that), so a test module imported later is compiled in memory each time.

    One interpreter per core, each given its share of the files at once: compileall's own -j hands out one file
    at a time through its pool, which kept the main process busy and the two cores of a small node a third
    idle (25.4 s against 19.2 s for the seed's env)."""
    site = envinspect.site_packages(env_dir)
    shares = share_out(bytecode_sources(site), workers or len(os.sched_getaffinity(0)))
    # -S: the env's .pth files are not run for this (root runs it); compileall needs nothing from site-packages.
    cmd = [str(env_dir / "bin" / "python"), "-I", "-S", "-W", "ignore", "-c", _COMPILE_LISTED]
    with tempfile.TemporaryDirectory(prefix="bwstack-bytecode-") as tmp:
        running = []
        try:
            for index, paths in enumerate(shares):
                listed = Path(tmp, f"{index}.list")
                listed.write_bytes(b"\0".join(os.fsencode(p) for p in paths))
                with open(listed, "rb") as stdin, open(Path(tmp, f"{index}.err"), "wb") as stderr:
                    # From "/", as every child of the probe; the env as it runs on its own.
                    child = subprocess.Popen(
                        cmd, stdin=stdin, stdout=subprocess.DEVNULL, stderr=stderr, cwd="/", env=clean_env()
                    )
                running.append(child)
            deadline = time.monotonic() + BYTECODE_TIMEOUT_S
            codes = [child.wait(timeout=max(0.0, deadline - time.monotonic())) for child in running]
        except subprocess.TimeoutExpired:
            raise BwstackError(
                f"compiling the bytecode of {env_dir} took over {BYTECODE_TIMEOUT_S} s; nothing was switched"
            ) from None
        except OSError as exc:
            raise BwstackError(f"could not run {cmd[0]} to compile the bytecode of {env_dir}: {exc}") from None
        finally:
            for child in running:
                if child.poll() is None:
                    child.kill()
                    child.wait()
        for index, code in enumerate(codes):
            if code != 0:
                err = Path(tmp, f"{index}.err").read_bytes().decode(errors="replace")
                last = " | ".join(line.strip() for line in err.strip().splitlines()[-3:] if line.strip())
                raise BwstackError(f"compiling the bytecode of {env_dir} failed (exit {code}): {last[-400:]}")


def drop_world_write(cache_dir: Path) -> None:
    """uv creates its lock files mode 0666 (shared caches); bwstack's store keeps nothing world-writable."""
    for dirpath, dirnames, filenames in os.walk(cache_dir):
        if dirpath == str(cache_dir):
            dirnames[:] = [d for d in dirnames if not d.startswith("archive-")]  # unpacked wheels: uv's own modes
        for name in filenames:
            if name.endswith(".lock"):
                path = os.path.join(dirpath, name)
                mode = os.lstat(path).st_mode
                # A link reports 0777 and chmod would follow it to whatever it names: only uv's own files.
                if stat.S_ISREG(mode) and mode & 0o022:
                    _chmod_no_follow(path, stat.S_IMODE(mode) & 0o755)


def _chmod_no_follow(path: str, mode: int) -> None:
    """chmod of the file at path itself: opened without following a link swapped in since it was looked at."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return  # gone or swapped for a link since the walk: nothing of uv's to change
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            os.fchmod(fd, mode)
    finally:
        os.close(fd)


def differences(env_dir: Path, expected: Mapping[str, str]) -> list[str]:
    """What the env has that the closure does not, and the other way round, and version mismatches."""
    have = {name: dist.version for name, dist in envinspect.installed(env_dir).items()}
    problems = []
    for name, version in sorted(expected.items()):
        if name not in have:
            problems.append(f"{name} {version} missing")
        elif have[name] != version:
            problems.append(f"{name} is {have[name]}, expected {version}")
    for name in sorted(set(have) - set(expected)):
        problems.append(f"{name} {have[name]} is not in the closure")
    return problems
