"""Build a Python env from fetched wheels with uv: one implementation for provisioning and the image build."""

from __future__ import annotations

import os
import re
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path

from bwstack.errors import BwstackError, UsageError
from bwstack.lock.uvtool import run_uv, uv_env
from bwstack.probe import envinspect, interp, preflight
from bwstack.provision.wheelhouse import LocalWheel


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


def create_venv(dest: Path, python: str, *, env: Mapping[str, str] | None = None) -> None:
    """A relocatable venv: its scripts find their interpreter relative to themselves, so the env can be
    built under a temporary name and renamed into place."""
    result = run_uv(["venv", "--relocatable", "--python", python, str(dest)], env=env or uv_env(), capture=True)
    if result.returncode != 0:
        raise BwstackError(f"uv venv failed for {dest}: {result.stderr.strip()[-800:]}")


def install(
    env_dir: Path,
    wheels: Mapping[str, LocalWheel],
    *,
    cache_dir: Path | None = None,
    link_mode: str = "hardlink",
    ca_bundle: str | None = None,
) -> None:
    """Install exactly `wheels` (no resolution, no index, hashes required) into the env."""
    if not wheels:
        return
    python = env_dir / "bin" / "python"
    extra = {"UV_CACHE_DIR": str(cache_dir)} if cache_dir else {}
    # Direct file references into the content-addressed store: stable paths, so uv's cache (keyed on the
    # wheel's location) unpacks each wheel once and later generations hard-link the same files.
    with tempfile.TemporaryDirectory(prefix="bwstack-install-") as tmp:
        reqs = Path(tmp, "requirements.txt")
        reqs.write_text(
            "".join(
                f"{w.package} @ {w.path.absolute().as_uri()} --hash=sha256:{w.sha256}\n"
                for w in sorted(wheels.values(), key=lambda w: w.package)
            )
        )
        args = [
            "pip", "install", "--python", str(python), "--no-index",
            "--require-hashes", "--no-deps", "--only-binary", ":all:",
            "--link-mode", link_mode, "-r", str(reqs),
        ]  # fmt: skip
        result = run_uv(args, env=uv_env(extra, ca_bundle=ca_bundle), capture=True)
    if cache_dir is not None:
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


def bytecode_skipped(site: Path) -> str:
    """compileall's -x: a file under a folder named TEST_FOLDER anywhere below site-packages (only below it: the
    store's own path may hold such a name)."""
    return "^" + re.escape(str(site)) + "/(?:[^/]+/)*" + TEST_FOLDER + "/"


def compile_bytecode(env_dir: Path) -> None:
    """Bytecode for every module of the env but the packages' test suites, with the env's own interpreter, before
    the generation is sealed: it becomes part of the manifest, and Python never writes into the generation later
    (its hook stops that), so a test module imported later is compiled in memory each time. Sources that do not
    compile (templates, other Pythons' files) simply get none."""
    site = envinspect.site_packages(env_dir)
    cmd = [str(env_dir / "bin" / "python"), "-m", "compileall", "-q", "-q", "-j", "0",
           "-x", bytecode_skipped(site), str(site)]  # fmt: skip
    code, _out, err = interp.run(cmd, timeout=3600, env=clean_env())  # from "/", as every child of the probe
    if code not in (0, 1):  # 1: some file did not compile, which is not ours to fix
        raise BwstackError(f"compiling the bytecode of {env_dir} failed: {err.strip()[-400:]}")


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
