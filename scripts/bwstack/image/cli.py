"""`bwstack image build|verify|bench-rebuild`: the command line of the image layer."""

from __future__ import annotations

import argparse
import json
import sys

from bwstack.image.build import DEFAULT_BUILD_PORT, ImageBuildOptions, build_image


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _options(args: argparse.Namespace) -> ImageBuildOptions:
    return ImageBuildOptions(
        wheelhouses=tuple(args.wheelhouse or ()),
        offline=args.offline,
        ca_bundle=args.ca_bundle,
        tag=args.tag,
        base_image=args.base_image,
        allow_unhashed=tuple(args.allow_unhashed or ()),
        no_cache=getattr(args, "no_cache", False),
        port=args.build_port,
        store=args.store,
        context_dir=getattr(args, "context_dir", None),
        cache_from=tuple(getattr(args, "cache_from", None) or ()),
    )


def _json(payload: dict) -> None:
    json.dump(payload, sys.stdout, indent=2)
    sys.stdout.write("\n")


def cmd_build(args: argparse.Namespace) -> int:
    from bwstack.lock.model import load_lock

    lock = load_lock(args.lock)
    profile = lock.profile(args.profile)
    log = (lambda m: None) if args.quiet else _stderr
    result = build_image(lock, profile, _options(args), log=log)
    if args.json:
        _json(result.as_dict())
    else:
        size = (result.size_bytes or 0) / (1 << 30)
        print(
            f"built {result.tag} ({result.image_id[:19]}, {size:.2f} GiB) in {result.seconds:.0f} s; "
            f"{result.cached_steps}/{len(result.steps)} steps from cache"
        )
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from bwstack.checks import verify as node_verify
    from bwstack.image.verify import verify_image
    from bwstack.lock.model import load_lock

    results = verify_image(
        load_lock(args.lock), args.image, profile_name=args.profile, skip=args.skip,
        runtime=not args.no_runtime, gpus=args.gpus, scan_ca=args.scan_ca,
    )  # fmt: skip
    print(node_verify.as_json(results) if args.json else node_verify.render(results))
    return 0 if node_verify.ok(results) else 1


def cmd_bench(args: argparse.Namespace) -> int:
    from bwstack.image.bench import bench_rebuild

    result = bench_rebuild(args.lock, args.lock_b, args.profile, opts=_options(args),
                           log=(lambda m: None) if args.quiet else _stderr)  # fmt: skip
    if args.json:
        _json(result.as_dict())
    return 0


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (0-65535; 0: any free port)")
    return port


def _gpus(text: str) -> str:
    if text == "all" or (text.isdigit() and int(text) > 0):
        return text
    raise argparse.ArgumentTypeError(f"{text!r}: give all or a count of GPUs (1 or more)")


def _build_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", help="the lock's profile (default: its default_profile)")
    p.add_argument("--wheelhouse", action="append", help="directory of wheels, used first by file name (repeatable)")
    p.add_argument("--offline", action="store_true", help="use only --wheelhouse: download nothing")
    p.add_argument(
        "--ca-bundle",
        help="CA bundle for the host's downloads and apt inside the build; never kept in the image",
    )
    p.add_argument(
        "--tag",
        help="image tag; {profile} and {digest} are filled in (default: bwstack/sglang:{profile}-{digest})",
    )
    p.add_argument("--base-image", help="base image (default: the profile's cuda.docker_base)")
    p.add_argument(
        "--allow-unhashed",
        action="append",
        metavar="NAME",
        help="build with NAME although the lock has no sha256 for it",
    )
    p.add_argument(
        "--build-port",
        type=_port,
        default=DEFAULT_BUILD_PORT,
        help="port of the build's file server on the Docker bridge (default: any free port; the address "
        "reaches the build outside the layer cache key, so any port keeps the cache)",
    )
    p.add_argument("--store", help="wheel store for downloads (default: bwstack's, e.g. /opt/bwstack/cache/wheels)")
    p.add_argument("--quiet", action="store_true", help="do not stream the build's output")
    p.add_argument("--json", action="store_true")


def register(sub: argparse._SubParsersAction) -> None:
    """Add `bwstack image build|verify|bench-rebuild`."""
    image = sub.add_parser("image", help="the serving image from the lock: build (Docker SDK), verify, bench-rebuild")
    isub = image.add_subparsers(dest="image_command", metavar="ACTION", required=True)

    p = isub.add_parser(
        "build", help="build the profile's SGLang image (offline from a wheelhouse, layer per lock layer)"
    )
    _build_flags(p)
    p.add_argument("--no-cache", action="store_true", help="rebuild every layer")
    p.add_argument(
        "--cache-from",
        action="append",
        metavar="IMAGE",
        help="use only IMAGE's layers (repeatable) as the build cache, e.g. the previous release",
    )
    p.add_argument("--context-dir", help="stage the build context here (kept) instead of a temporary directory")
    p.set_defaults(func=cmd_build)

    p = isub.add_parser("verify", help="run the node checks and image checks against a container of IMAGE")
    p.add_argument("image")
    p.add_argument("--profile", help="profile to check against (default: the image's io.bwstack.profile label)")
    p.add_argument(
        "--skip",
        action="append",
        metavar="CHECK=REASON",
        help="waive checks whose name contains CHECK, with the reason shown in the report",
    )
    p.add_argument("--no-runtime", action="store_true", help="skip the GPU runtime probes")
    p.add_argument(
        "--gpus", type=_gpus, help="give the container GPUs: all or a count (needs the NVIDIA container toolkit)"
    )
    p.add_argument(
        "--scan-ca",
        metavar="PEM",
        help="also search every layer the build added for the certificates in PEM (streams docker save)",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_verify)

    p = isub.add_parser(
        "bench-rebuild",
        help="clean build of --lock, then rebuild with --lock-b (an app-only bump): times and ratio",
    )
    p.add_argument("--lock-b", required=True, help="the bumped lock (differs from --lock in the app layer only)")
    _build_flags(p)
    p.set_defaults(func=cmd_bench)
