"""Where a store lives: its root, the env path users run, the CUDA link it keeps, and its cache; from the
command line, BWSTACK_* variables, or the defaults (root or user)."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bwstack import paths
from bwstack.errors import UsageError
from bwstack.probe import pathtrust
from bwstack.store.objects import ObjectStore
from bwstack.store.runlock import NAME as LOCK_NAME


def setting(explicit: str | None, variable: str) -> str | None:
    """A path setting from the command line or the environment; an empty value is an error, not a default, and
    so is one with a control character (the path goes into scripts and unit files, where a newline ends a line)."""
    value = explicit if explicit is not None else os.environ.get(variable)
    if value is None:
        return None
    source = variable if explicit is None else f"--{variable.removeprefix('BWSTACK_').lower().replace('_', '-')}"
    if not value.strip():
        raise UsageError(f"{source} is empty: give a path (or unset it to use the default)")
    why = paths.path_problem(value)
    if why:
        raise UsageError(f"{source} {value!r} {why}")
    return value


@dataclass(frozen=True)
class Layout:
    root: Path
    ml_env: Path
    cuda_link: Path | None
    profile_d: Path | None
    take_over_links: bool = False
    # Wheels and uv's unpacked cache (None: <root>/cache). BWSTACK_CACHE, read once by `default`, shares one
    # between stores (same filesystem, so generations still hard-link from it).
    cache_dir: Path | None = None

    @classmethod
    def default(
        cls,
        root: str | None = None,
        ml_env: str | None = None,
        cuda_link: str | None = None,
        take_over_links: bool = False,
    ) -> Layout:
        is_root = os.geteuid() == 0
        home = Path.home()
        root_value = setting(root, "BWSTACK_ROOT")
        root_path = Path(root_value or (paths.DEFAULT_ROOT if is_root else home / paths.USER_ROOT))
        ml = Path(setting(ml_env, "BWSTACK_ML_ENV") or ("/opt/ml-env" if is_root else home / "ml-env"))
        link_value = setting(cuda_link, "BWSTACK_CUDA_LINK")
        if link_value is None:
            link_value = "/usr/local/cuda" if is_root else "none"
        link = None if link_value == "none" else Path(link_value)
        profile_d = Path("/etc/profile.d/bwstack.sh") if is_root and root_value is None and link is not None else None
        cache_value = setting(None, "BWSTACK_CACHE")
        layout = cls(
            root_path.absolute(),
            ml.absolute(),
            link.absolute() if link else None,
            profile_d,
            take_over_links,
            Path(cache_value).absolute() if cache_value else None,
        )
        layout.check_apart()
        return layout

    def check_apart(self) -> None:
        """The store, the env link and the CUDA link are three places: a link named inside the store (or the store
        inside a link's path, or both links at one path) would have one of them overwrite what another keeps,
        such as the env link re-pointed at the toolkit."""
        named = [("--root", _place(self.root)), ("--ml-env", _place(self.ml_env))]
        if self.cuda_link is not None:
            named.append(("--cuda-link", _place(self.cuda_link)))
        for i, (flag, path) in enumerate(named):
            for other_flag, other in named[i + 1 :]:
                if path == other or path in other.parents or other in path.parents:
                    raise UsageError(
                        f"{flag} {path} and {other_flag} {other} overlap: the store, the env link and the CUDA link "
                        f"must be three separate places"
                    )

    @property
    def generations(self) -> Path:
        return self.root / "generations"

    @property
    def current(self) -> Path:
        return self.root / "current"

    @property
    def history(self) -> Path:
        return self.root / "history.jsonl"

    @property
    def archives(self) -> Path:
        """The sha256 of every archive this store wrote: what `restore` takes as vouched for without --sha256."""
        return self.root / "archives.jsonl"

    @property
    def cache(self) -> Path:
        return self.cache_dir if self.cache_dir is not None else self.root / "cache"

    @property
    def wheel_store(self) -> Path:
        return self.cache / "wheels"

    @property
    def uv_cache(self) -> Path:
        return self.cache / "uv"

    @property
    def objects(self) -> ObjectStore:
        return ObjectStore(self.cache / "objects")


def _place(path: Path) -> Path:
    """Where `path` is, its folder's links and `..` resolved (not the path itself: a link there is what is named)."""
    return Path(os.path.realpath(path.parent)) / path.name


def is_store(folder: Path) -> bool:
    """Whether `folder` is a bwstack store: its run lock (a file) and generations/ (a folder), links not followed."""
    try:
        lock, generations = os.lstat(Path(folder) / LOCK_NAME), os.lstat(Path(folder) / "generations")
    except OSError:
        return False
    return stat.S_ISREG(lock.st_mode) and stat.S_ISDIR(generations.st_mode)


def enclosing_store(path: Path) -> Path | None:
    """The store `path` lies in (the path itself or a folder above it, the path's links resolved as it reaches
    them); None when it lies in none."""
    here = Path(os.path.realpath(path))
    return next((folder for folder in (here, *here.parents) if is_store(folder)), None)


def check_cache(layout: Layout) -> None:
    """Refuse a cache folder others could write (a shared BWSTACK_CACHE another user owns or opened up): the wheels,
    uv's unpacked files and the hashes of sealed files kept there become root's generations."""
    check_private_folder(layout.cache, "the cache folder", "BWSTACK_CACHE")


def open_to_others(check: Callable[[Path], str | None], path: Path, what: str) -> str | None:
    """Why `check` (one of probe.pathtrust's) finds `path` open to others, or None; a path that cannot be looked
    at is one line naming `what`."""
    try:
        return check(path)
    except OSError as exc:
        raise UsageError(f"{what} {path}: {exc.strerror}") from None


def check_private_folder(folder: Path, what: str, setting: str) -> None:
    """Refuse a folder whose files become what bwstack installs (a cache, a wheel store) when others could write
    it. One this run is about to make is refused where others could write the folder it would be made in: they
    could rename it away and put theirs in its place while the run uses it. `setting` names where the user
    picks another."""
    if not os.path.lexists(folder):
        above = folder.parent
        while not os.path.lexists(above) and above != above.parent:
            above = above.parent
        why = open_to_others(pathtrust.folder_open_to_others, above, what)
        if why:
            raise UsageError(
                f"{what} {folder} would be made where others can write ({why}): they could put their own files in "
                f"its place; use a folder only this user can write ({setting})"
            )
        return
    why = open_to_others(pathtrust.own_folder_open_to_others, folder, what)
    if why:
        raise UsageError(
            f"{what} {folder} is not this user's alone ({why}): what others put there would become files that "
            f"bwstack installs; use a folder only this user can write ({setting})"
        )
