#!/usr/bin/env python3
"""Benchmark: image rebuild time after an app-layer-only (sglang-only) bump, against a clean build.

    python docker/bench_rebuild.py                       # CI-size: docker/ci/ci-small(.bump).lock.yaml
    python docker/bench_rebuild.py --lock stack.lock.yaml --profile cu128 --sglang 0.5.10 \
        --wheelhouse WH --base-image bwstack-ci-base:bookworm-py312

One run each: a clean build of lock A (`--no-cache`), then a build of lock B on that cache; prints both build
times and B/A (bwstack.image.bench_rebuild). Lock B is --lock-b, or, with --sglang VERSION, lock A with only
its closure's sglang entry swapped for that release's wheel (URL and sha256 from PyPI's listing): a real
sglang release never moves alone (0.5.10 also moves FlashInfer), so this synthetic lock isolates what the
benchmark measures, the app layer's rebuild; its image is not meant to serve. Needs a Docker daemon.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from bwstack import image
from bwstack.lockfile import load_lock

DOCKER = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lock", default=str(DOCKER / "ci" / "ci-small.lock.yaml"))
    parser.add_argument("--lock-b", help="the bumped lock (default: ci-small-bump.lock.yaml for the CI lock)")
    parser.add_argument("--sglang", metavar="VERSION", help="make lock B from --lock by swapping sglang's wheel")
    parser.add_argument("--profile")
    parser.add_argument("--wheelhouse", action="append", default=[])
    parser.add_argument("--offline", action="store_true")
    parser.add_argument("--base-image")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    opts = image.BuildOptions(wheelhouses=args.wheelhouse, offline=args.offline, base_image=args.base_image)
    with tempfile.TemporaryDirectory(prefix="bwstack-bench-") as tmp:
        lock_b = args.lock_b
        if args.sglang:
            name = args.profile or load_lock(args.lock).default_profile
            lock_b = str(image.sglang_only_bump(args.lock, name, args.sglang, Path(tmp, "bumped.lock.yaml")))
        elif lock_b is None:
            lock_b = str(DOCKER / "ci" / "ci-small-bump.lock.yaml")
        result = image.bench_rebuild(args.lock, lock_b, args.profile, opts=opts, log=lambda m: None)
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
