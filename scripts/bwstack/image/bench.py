"""`bwstack image bench-rebuild`: a clean build of lock A, then lock B (an app-layer-only change of A) on its cache."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bwstack.errors import BwstackError
from bwstack.image import context, wheels
from bwstack.image.build import ImageBuildOptions, build_image
from bwstack.terminal import visible

Log = Callable[[str], None]
CI_BASE_TAG = "bwstack-ci-base:bookworm-py312"


def _stderr(message: str) -> None:
    print(visible(message), file=sys.stderr, flush=True)


@dataclass(frozen=True)
class RebuildBench:
    """Both builds' times, and what the second one rebuilt; as_dict() is the --json output."""

    profile: str
    clean_build_seconds: float
    rebuild_seconds: float
    ratio: float
    changed_layers: tuple[str, ...]
    rebuilt_run_steps: tuple[str, ...]
    cached_steps: int
    steps: int
    clean_size_bytes: int | None
    clean_tag: str
    bump_tag: str

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["changed_layers"] = list(self.changed_layers)
        out["rebuilt_run_steps"] = list(self.rebuilt_run_steps)
        return out


def bench_rebuild(
    lock_a: str,
    lock_b: str,
    profile: str | None = None,
    *,
    opts: ImageBuildOptions | None = None,
    log: Log = _stderr,
    out: Log = print,
) -> RebuildBench:
    """Clean build of lock A (no cache), then a build of lock B (an app-layer-only change of A, e.g. an
    sglang bump) on that cache; prints both times and their ratio, from one run each."""
    from bwstack.lock.model import load_lock

    first, second = load_lock(lock_a), load_lock(lock_b)
    prof_a, prof_b = first.profile(profile), second.profile(profile)
    dockerfile = context.docker_files().dockerfile
    with tempfile.TemporaryDirectory(prefix="bwstack-bench-") as tmp:
        a = context.stage_context(first, prof_a, Path(tmp, "a"), dockerfile).layer_files
        staged_b = context.stage_context(second, prof_b, Path(tmp, "b"), dockerfile)
        b = staged_b.layer_files
    changed = [name for name in a if a[name] != b.get(name)]
    if changed != [list(a)[-1]]:
        log(f"WARNING: the two locks differ in layers {changed or 'none'}, not in the last (app) layer only")
    base = opts or ImageBuildOptions()
    # lock B's wheels before the long clean build, so a missing one fails now, not ten minutes in
    store = wheels.private_store(base.store)
    wheels.gather_wheels(staged_b.env_selection, base.wheelhouses, offline=base.offline, store=store,
                         allow_unhashed=base.allow_unhashed, log=log)  # fmt: skip
    clean = build_image(first, prof_a, dataclasses.replace(base, no_cache=True), log=log)
    _stderr(f"bench-rebuild: clean build of {clean.tag}: {clean.build_seconds:.1f} s")
    # B's cache is exactly A's chain (--cache-from): no intermediate image of an earlier run can serve B
    bump = build_image(second, prof_b, dataclasses.replace(base, no_cache=False, cache_from=clean.stage_images),
                       log=log)  # fmt: skip
    ratio = bump.build_seconds / clean.build_seconds if clean.build_seconds else float("nan")
    rebuilt = [s.instruction[:60] for s in bump.steps if not s.cached and s.instruction.startswith("RUN")]
    result = RebuildBench(
        profile=prof_a.name,
        clean_build_seconds=clean.build_seconds,
        rebuild_seconds=bump.build_seconds,
        ratio=round(ratio, 4),
        changed_layers=tuple(changed),
        rebuilt_run_steps=tuple(rebuilt),
        cached_steps=bump.cached_steps,
        steps=len(bump.steps),
        clean_size_bytes=clean.size_bytes,
        clean_tag=clean.tag,
        bump_tag=bump.tag,
    )
    out(
        f"image rebuild after an app-layer-only bump ({', '.join(changed)}), profile {prof_a.name}: "
        f"clean build {clean.build_seconds:.1f} s, rebuild {bump.build_seconds:.1f} s, "
        f"ratio {ratio:.3f} ({bump.cached_steps}/{len(bump.steps)} steps from cache; "
        f"{len(rebuilt)} RUN steps rebuilt)"
    )
    return result


def sglang_only_bump(lock_path: str, profile: str, version: str, dest: Path) -> Path:
    """Lock A with closures.<profile>.env.sglang pointing at another sglang release's wheel."""
    import yaml

    from bwstack.lock import pypi
    from bwstack.lock.model import load_lock
    from bwstack.lock.resolve import render_lock_text

    lock = load_lock(lock_path)
    data = yaml.load(Path(lock_path).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    entry = data["closures"][profile]["env"]["sglang"]
    files = [f for f in pypi.project_files(pypi.session(), lock.indexes["pypi"].url, "sglang")
             if f.filename == f"sglang-{version}-py3-none-any.whl"]  # fmt: skip
    if not files or not files[0].sha256:
        raise BwstackError(f"PyPI lists no sglang-{version}-py3-none-any.whl with a sha256")
    entry["version"] = version
    entry["wheels"] = [{"file": files[0].filename, "url": files[0].url, "sha256": files[0].sha256,
                        "hash_source": "pypi"}]  # fmt: skip
    dest.write_text(render_lock_text(lock, data["closures"]))
    return dest


def ensure_bench_base() -> str:
    """The debootstrap base (docker/ci-base.sh: a test fixture, no CUDA, the host's Python 3.12), built if
    absent: the NVIDIA bases cannot be pulled where this project is built."""
    import docker

    client = docker.from_env()
    try:
        client.images.get(CI_BASE_TAG)
    except docker.errors.ImageNotFound:
        script = context.docker_dir() / "ci-base.sh"
        if not script.is_file():
            raise BwstackError("docker/ci-base.sh (a test fixture) is in bwstack's checkout only") from None
        result = subprocess.run(["bash", str(script)], capture_output=True, text=True)
        if result.returncode != 0:
            raise BwstackError(f"docker/ci-base.sh failed: {result.stderr.strip()[-400:]}") from None
    return CI_BASE_TAG
