"""`bwstack image build|verify|bench-rebuild`: the serving image from the lock (Docker SDK), checked in a
container, and the rebuild benchmark. The work is bwstack.image's; this declares the options and prints."""

from __future__ import annotations

import argparse

from bwstack import paths
from bwstack.cli import options
from bwstack.cli.console import Console

NAME = "image"
HELP = "the serving image from the lock: build (Docker SDK), verify, bench-rebuild"


def add_options(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="image_command", metavar="ACTION", required=True)

    build = sub.add_parser(
        "build", help="build the profile's SGLang image (offline from a wheelhouse, layer per lock layer)"
    )
    _build_flags(build)
    build.add_argument("--no-cache", action="store_true", help="rebuild every layer")
    build.add_argument(
        "--cache-from",
        action="append",
        metavar="IMAGE",
        help="use only IMAGE's layers (repeatable) as the build cache, e.g. the previous release",
    )
    build.add_argument(
        "--context-dir",
        type=options.plain_path,
        help="keep a copy of the build context in this new folder (Docker reads a private one)",
    )

    verify = sub.add_parser("verify", help="run the node checks and image checks against a container of IMAGE")
    verify.add_argument("image")
    options.add_profile(verify, help="profile to check against (default: the image's io.bwstack.profile label)")
    options.add_waivers(verify, help="waive checks whose name contains CHECK, with the reason shown in the report")
    verify.add_argument("--no-runtime", action="store_true", help="skip the GPU runtime probes")
    verify.add_argument(
        "--gpus", type=_gpus, help="give the container GPUs: all or a count (needs the NVIDIA container toolkit)"
    )
    verify.add_argument(
        "--scan-ca",
        metavar="PEM",
        help="also search every layer the build added for the certificates in PEM (streams docker save)",
    )
    options.add_json(verify)

    bench = sub.add_parser(
        "bench-rebuild",
        help="clean build of --lock, then rebuild with --lock-b (an app-only bump): times and ratio",
    )
    bench.add_argument("--lock-b", required=True, help="the bumped lock (differs from --lock in the app layer only)")
    _build_flags(bench)


def _gpus(text: str) -> str:
    if text == "all" or (text.isdigit() and int(text) > 0):
        return text
    raise argparse.ArgumentTypeError(f"{text!r}: give all or a count of GPUs (1 or more)")


def _build_flags(p: argparse.ArgumentParser) -> None:
    from bwstack.image import DEFAULT_BUILD_PORT  # not image.build: --help and every other command start without it

    options.add_profile(p)
    options.add_sources(
        p, index=False, checked=False,
        ca_help="CA bundle for the host's downloads and apt inside the build; never kept in the image",
    )  # fmt: skip
    p.add_argument(
        "--tag",
        help="image tag; {profile} and {digest} are filled in (default: bwstack/sglang:{profile}-{digest})",
    )
    p.add_argument("--base-image", help="base image (default: the profile's cuda.docker_base)")
    p.add_argument(
        "--build-port",
        type=options.port,
        default=DEFAULT_BUILD_PORT,
        help="port of the build's file server on the Docker bridge (default: any free port; the address "
        "reaches the build outside the layer cache key, so any port keeps the cache)",
    )
    p.add_argument(
        "--store",
        type=options.plain_path,
        help=f"wheel store for downloads (default: bwstack's, e.g. {paths.DEFAULT_ROOT}/cache/wheels)",
    )
    p.add_argument("--quiet", action="store_true", help="do not stream the build's output")
    options.add_json(p)


def build_options(args: argparse.Namespace):
    from bwstack.image.build import ImageBuildOptions

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


def run(args: argparse.Namespace) -> int:
    return {"build": _build, "verify": _verify, "bench-rebuild": _bench}[args.image_command](args)


def _log(args: argparse.Namespace, console: Console):
    """The build's streamed output: stderr (stdout is the result), nothing with --quiet."""
    return (lambda _message: None) if args.quiet else console.note


def _build(args: argparse.Namespace) -> int:
    from bwstack.image.build import build_image
    from bwstack.lock.model import load_lock

    console = Console.of(args)
    lock = load_lock(args.lock)
    result = build_image(lock, lock.profile(args.profile), build_options(args), log=_log(args, console))
    size = (result.size_bytes or 0) / (1 << 30)
    console.result(
        result.as_dict(),
        f"built {result.tag} ({result.image_id[:19]}, {size:.2f} GiB) in {result.seconds:.0f} s; "
        f"{result.cached_steps}/{len(result.steps)} steps from cache",
    )
    return 0


def _verify(args: argparse.Namespace) -> int:
    from bwstack.checks import verify as node_verify
    from bwstack.image.verify import verify_image
    from bwstack.lock.model import load_lock

    console = Console.of(args)
    results = verify_image(
        load_lock(args.lock), args.image, profile_name=args.profile, skip=args.skip,
        runtime=not args.no_runtime, gpus=args.gpus, scan_ca=args.scan_ca,
    )  # fmt: skip
    if console.json_mode:
        console.json_text(node_verify.as_json(results))
    else:
        console.text(node_verify.render(results))
    return 0 if node_verify.ok(results) else 1


def _bench(args: argparse.Namespace) -> int:
    from bwstack.image.bench import bench_rebuild

    console = Console.of(args)
    result = bench_rebuild(args.lock, args.lock_b, args.profile, opts=build_options(args), log=_log(args, console))
    if console.json_mode:
        console.json(result.as_dict())
    return 0
