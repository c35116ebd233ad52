"""`bwstack env install`: install a rendered requirement file into an env (the Docker build's per-layer step)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from bwstack.cli import options
from bwstack.cli.console import Console
from bwstack.errors import UsageError

NAME = "env"
HELP = "low-level env operations"
UNREAD = (options.Unread("offline", ignores=("index",)),)  # an offline install reaches no mirror


def add_options(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="env_command", required=True)
    install = sub.add_parser("install", help="install a rendered requirement file into an env")
    options.add_sources(install, python=True)
    install.add_argument("--requirements", type=options.existing_file, required=True)
    install.add_argument("--into", required=True, type=options.plain_path)
    install.add_argument("--python-version", type=options.python_version, default="3.12")
    install.add_argument("--glibc", type=int, default=28, help="manylinux_2_N of the target (default 28)")
    install.add_argument(
        "--store",
        type=options.plain_path,
        help="wheel store, a folder only this user can write (default: bwstack's own)",
    )
    install.add_argument(
        "--uv-cache",
        type=options.plain_path,
        help="uv's cache, a folder only this user can write (default: bwstack's own, never the environment's)",
    )
    install.add_argument("--link-mode", default="copy", choices=["copy", "hardlink"])


def run(args: argparse.Namespace) -> int:
    from bwstack.lock import requirements
    from bwstack.lock.tags import Target, select
    from bwstack.provision import envbuild
    from bwstack.provision.wheelhouse import Fetcher
    from bwstack.store.layout import Layout, check_cache, check_private_folder

    if args.link_mode == "hardlink" and not args.uv_cache:
        # The env's files would be bwstack's own uv cache's: the same inodes its sealed generations hold.
        raise UsageError("--link-mode hardlink needs --uv-cache (a cache of this env's own): without it the env's "
                         "files would be hard links into bwstack's uv cache, which its generations share")  # fmt: skip
    options.apply_ca_bundle(args)
    env = _env_folder(args.into)
    sources = options.sources(args)
    packages = requirements.parse(Path(args.requirements))
    target = Target(python=args.python_version, glibc_minor=args.glibc)
    # The wheels become the env's files and uv's cache its unpacked copies: folders others could write are
    # refused. Without --store, bwstack's own wheel store (never a folder beside the env, which may be /tmp).
    # Likewise uv's cache: without --uv-cache, bwstack's own, never one the caller's environment (UV_CACHE_DIR) names.
    own = None if args.store and args.uv_cache else Layout.default()
    if own is not None:
        check_cache(own)
    if args.store:
        store = Path(args.store)
        check_private_folder(store, "the wheel store", "--store")
    else:
        store = own.wheel_store
    if args.uv_cache:
        uv_cache = Path(args.uv_cache)
        check_private_folder(uv_cache, "the uv cache", "--uv-cache")
    else:
        uv_cache = own.uv_cache
    # A build step gets its wheels from the build's server (a wheelhouse) or the lock's URLs; --index (and
    # BWSTACK_INDEX) mirrors are used as `fetch` and `cuda install` use them, never taken and ignored.
    fetcher = Fetcher(store, sources, args.allow_unhashed or ())
    wheels = fetcher.fetch_all(select(packages, target))
    if not (env / "bin" / "python").exists():
        envbuild.create_venv(env, envbuild.find_python(args.python_version, args.python), cache_dir=uv_cache)
    envbuild.install(env, wheels, link_mode=args.link_mode, cache_dir=uv_cache)
    Console().text(f"installed {len(wheels)} packages into {env}")
    return 0


def _env_folder(into: str) -> Path:
    """--into: an env folder, or where one is to be made. Anything else there is refused before a wheel is
    fetched (uv would say so only after the downloads, in several lines)."""
    env = Path(into)
    if os.path.lexists(env) and not env.is_dir():
        raise UsageError(f"--into {into}: exists and is not a directory (give an env folder or a new path)")
    return env
