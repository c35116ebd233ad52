"""The image's public build args: OCI labels (profile, lock digest, component versions), the step script's and
the tool's digests. They are in the layer cache key and `docker history`, so nothing secret and nothing that
changes from one build of the same lock to the next (except the labels' creation time, used last)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterable
from datetime import datetime, timezone

from bwstack import paths

ENV_PATH = "/opt/ml-env"
LABEL_PROFILE = "io.bwstack.profile"
LABEL_DIGEST = "io.bwstack.lock-digest"
LABEL_BASE = "org.opencontainers.image.base.name"
ENTRYPOINT = [f"{ENV_PATH}/bin/python", "-m", "sglang.launch_server"]


def git_revision() -> str:
    root = paths.checkout()
    if root is None or not (root / ".git").exists():
        return ""
    try:
        rev = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=30,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return f"{rev}{'-dirty' if dirty else ''}" if rev else ""


def build_args(lock, profile, base: str, step_sha256: str, tool, allow: Iterable[str]) -> dict:
    """The build's public args: in the cache key and `docker history`, so nothing secret and nothing that
    changes from one build of the same lock to the next (except the labels' creation time, used last)."""
    from bwstack import __version__
    from bwstack.lock.describe import stack_versions

    versions = stack_versions(profile)
    return {
        "BASE_IMAGE": base,
        "BWSTACK_STEP_SHA256": step_sha256,
        "BWSTACK_TOOL_DIGEST": tool.digest,
        "BWSTACK_PYTHON": profile.python,
        "BWSTACK_ALLOW_UNHASHED": " ".join(sorted(allow)),
        # The toolkit stage's share: its cache key then moves only with the toolkit's own names.
        "BWSTACK_ALLOW_UNHASHED_TOOLKIT": " ".join(sorted(set(allow) & set(profile.require_closure().cuda_toolkit))),
        "BWSTACK_PATCHES": " ".join(profile.patches),
        "BWSTACK_FLASHINFER_ARCH": f"{profile.expect.target_capability}a",
        "BWSTACK_PROFILE": profile.name,
        "BWSTACK_LOCK_DIGEST": profile.lock_digest(),
        "BWSTACK_VERSION": __version__,
        "BWSTACK_REVISION": git_revision(),
        "BWSTACK_CREATED": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "BWSTACK_VERSION_CUDA": versions.get("cuda", ""),
        "BWSTACK_VERSION_TORCH": versions.get("torch", ""),
        "BWSTACK_VERSION_SGL_KERNEL": versions.get("sgl-kernel", ""),
        "BWSTACK_VERSION_FLASHINFER": versions.get("flashinfer", ""),
        "BWSTACK_VERSION_SGLANG": versions.get("sglang", ""),
    }
