"""`bwstack cuda status|install`: the profile's CUDA toolkit (install: from the lock's PyPI wheels)."""

from __future__ import annotations

import argparse
from pathlib import Path

from bwstack.cli import options
from bwstack.cli.console import Console

NAME = "cuda"
HELP = "the profile's CUDA toolkit: status, or install (pip)"
UNREAD = (
    options.Unread("action=status", reads=("profile", "prefix", "json")),  # status reads the toolkit only
    options.Unread("offline", ignores=("index",)),  # an offline run reaches no mirror
)


def add_options(p: argparse.ArgumentParser) -> None:
    # --ml-env and --cuda-link say where the store's links are, which must not overlap the store (Layout): a store
    # at /opt needs its env elsewhere. --python is not taken: a toolkit makes no env.
    options.add_node(p, take_over_links=False, verify=False)
    options.add_sources(p)
    p.add_argument("action", choices=["status", "install"])
    options.add_profile(p, help=None)
    p.add_argument("--prefix", help="install prefix (default: the profile's cuda.home)")


def run(args: argparse.Namespace) -> int:
    from bwstack.lock.model import load_lock
    from bwstack.provision import cudatk
    from bwstack.provision.wheelhouse import Fetcher
    from bwstack.store.layout import check_cache

    console = Console.of(args)
    profile = load_lock(args.lock).profile(args.profile)
    home = Path(args.prefix or profile.cuda.home)
    if args.action == "status":
        st = cudatk.status(home)
        payload = st.as_dict() | {"profile_version": profile.cuda.version, "matches": cudatk.matches(profile, st)}
        console.result(payload, f"{home}: {st.version or 'absent'} ({st.managed_by}) {st.note}".strip())
        return 0 if st.exists else 1
    options.apply_ca_bundle(args)
    layout = options.layout(args)
    check_cache(layout)
    # --allow-unhashed names the profile's packages (provision hands the env build the same list): one of the env's
    # is no error here, one of neither part is.
    closure = profile.require_closure()
    unhashed = args.allow_unhashed or ()
    fetcher = Fetcher(layout.wheel_store, options.sources(args), unhashed, log=console.log, elsewhere=closure.env)
    before = cudatk.status(home)
    st = cudatk.install_pip(profile, fetcher, home, cache_dir=layout.uv_cache, log=console.log)
    payload = st.as_dict() | {"changed": not before.exists}
    console.result(payload, f"{home}: CUDA {st.version} ({'installed' if not before.exists else 'already there'})")
    return 0
