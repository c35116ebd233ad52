"""The build's wheels, found and checked on the host before Docker is asked for anything.

Every wheel found by file name in --wheelhouse directories is hashed against the lock first: a bad wheel is
refused in seconds, named by its path in the operator's wheelhouse, and no layer, container or image is made.
The rest are downloaded into bwstack's wheel store (hash-checked, store entries re-hashed; --offline forbids
downloads). A 4.8 GB wheelhouse never goes through the build context: the build server serves these files.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from bwstack.errors import BwstackError, UsageError
from bwstack.image.server import Pinned

Log = Callable[[str], None]


def private_store(given: str | None) -> Path:
    """Where downloads go: the folder given (--store), else bwstack's wheel store; refused when others could write
    it (their files would be served to the build as the lock's wheels)."""
    from bwstack.store.layout import Layout, check_cache, check_private_folder

    if given:
        check_private_folder(Path(given), "the wheel store", "--store")
        return Path(given)
    layout = Layout.default()
    check_cache(layout)
    return layout.wheel_store


def check_wheelhouses(selected: Iterable[tuple], wheelhouses: Iterable[Path | str]) -> dict[str, Pinned]:
    """file name -> the operator's file, for every selected wheel found (by name) in a wheelhouse, each hashed
    against the lock now, in parallel: a bad one is refused, named by its path in the wheelhouse, before
    Docker is asked for anything. Each comes pinned to the file that was read (the build server serves only that
    file). Wheels the lock has no hash for are pinned unchecked (gather_wheels refuses them unless allowed by
    name)."""
    from concurrent.futures import ThreadPoolExecutor, as_completed

    from bwstack.provision.wheelhouse import Sources, hash_local_wheel

    found: dict[str, tuple] = {}
    houses = Sources.parse([str(h) for h in wheelhouses]).wheelhouses  # each must be a folder (one line if not)
    for pkg, wheel in selected:  # (LockedPackage, Wheel) pairs, as select() gives them
        for house in houses:
            candidate = house / wheel.file
            if candidate.is_file():  # a link to a wheel counts; a FIFO or a directory of that name does not
                found[wheel.file] = (pkg, wheel, candidate)
                break

    def check(item: tuple) -> tuple[str, Pinned]:
        pkg, wheel, candidate = item
        _, st = hash_local_wheel(pkg, wheel, candidate, str(candidate))
        return wheel.file, Pinned.of(candidate, st)

    pinned: dict[str, Pinned] = {}
    pool = ThreadPoolExecutor(max_workers=4)
    try:
        for done in as_completed([pool.submit(check, item) for item in found.values()]):
            name, pin = done.result()  # the first bad wheel refuses the build; what is still queued is dropped
            pinned[name] = pin
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return pinned


def gather_wheels(
    selection: Mapping,
    wheelhouses: Iterable[Path | str],
    *,
    offline: bool,
    store: Path,
    allow_unhashed: Iterable[str],
    log: Log,
    checked: Mapping[str, Pinned] | None = None,
) -> dict[str, Path | Pinned]:
    """file name -> a local file for every selected wheel: from a wheelhouse (by name, hash-checked by
    check_wheelhouses unless `checked` is its result already), else downloaded into the store (hash-checked;
    store entries re-hashed). Refuses unhashed wheels not allowed by name."""
    from bwstack.provision.wheelhouse import Fetcher, Sources

    allowed = set(allow_unhashed)
    unknown = allowed - set(selection)
    if unknown:
        raise UsageError(f"--allow-unhashed {', '.join(sorted(unknown))}: not in this profile's closure")
    refused = sorted(n for n, (_, w) in selection.items() if w.sha256 is None and n not in allowed)
    if refused:
        raise BwstackError(
            f"the lock has no sha256 for {', '.join(refused)}; refusing to build with unverified wheels "
            f"(pass --allow-unhashed {' --allow-unhashed '.join(refused)} to accept them knowingly)"
        )
    if checked is None:
        checked = check_wheelhouses(selection.values(), wheelhouses)
    found: dict[str, Path | Pinned] = {}
    missing = {}
    for name, (pkg, wheel) in selection.items():
        if wheel.file in checked:
            found[wheel.file] = checked[wheel.file]
        else:
            missing[name] = (pkg, wheel)
    if missing and offline:
        listed = ", ".join(sorted(w.file for _, w in missing.values())[:6]) + (" ..." if len(missing) > 6 else "")
        raise BwstackError(
            f"--offline: {len(missing)} wheel(s) are in no --wheelhouse ({listed}); "
            "fill one with `bwstack fetch --profile P --part all --dest DIR`"
        )
    if missing:
        log(f"downloading {len(missing)} wheel(s) into {store} (hash-checked) ...")
        fetcher = Fetcher(store, Sources(), allowed & set(missing), log=log, rehash_store=True)
        for wheel in fetcher.fetch_all(missing).values():
            found[wheel.file] = wheel.path
    return found
