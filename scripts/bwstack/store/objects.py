"""Second names for every sealed file, by content: `<cache>/objects/<sha256[:2]>/<sha256>`.

A generation shares its files' inodes with uv's cache and with other generations, and installers replace
files rather than writing through them. So when someone pip-installs into the active env, the bytes the
sealed generation promised still exist, but only under names nobody can find by content. Linking each
sealed file here once (a directory entry, no bytes) makes every promised byte findable by its sha256: a
drifted generation is brought back to its manifest by re-linking, and nothing is copied.

An object is trusted only after its content hashes to its name (someone could write through any hard link).
Objects nothing else links to any more (link count 1) are removed by `collect`, which `prune` runs.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path

from bwstack.store import manifest

SHA_LEN = 64


_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
HEX = frozenset("0123456789abcdef")


def _ours(fd: int) -> bool:
    """A folder or file of this user's that nobody else can write: the only kind the store links from or into,
    removes from, or takes bytes from. (A cache folder shared with another user, BWSTACK_CACHE, is left alone.)"""
    st = os.fstat(fd)
    return st.st_uid == os.geteuid() and not st.st_mode & 0o022


def _hex(name: str, length: int) -> bool:
    return len(name) == length and set(name) <= HEX


class ObjectStore:
    """Every operation opens `<cache>/objects` and its subfolders without following a link (a link planted at
    `cache/objects` led prune to delete files elsewhere), and works relative to those descriptors."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def path(self, sha: str) -> Path:
        return self.root / sha[:2] / sha

    @contextlib.contextmanager
    def _folder(self, create: bool = False) -> Iterator[int | None]:
        """The objects folder as a descriptor (None: absent, a link, or not a folder of this user's alone)."""
        fd = None
        try:
            if create:
                self.root.parent.mkdir(parents=True, exist_ok=True)
            parent = os.open(self.root.parent, _DIR)
            try:
                if create:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(self.root.name, 0o755, dir_fd=parent)
                fd = os.open(self.root.name, _DIR, dir_fd=parent)
            finally:
                os.close(parent)
        except OSError:
            fd = None
        try:
            yield fd if fd is not None and _ours(fd) else None
        finally:
            if fd is not None:
                os.close(fd)

    @staticmethod
    def _sub(folder: int, name: str, create: bool = False) -> int | None:
        if create:
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, 0o755, dir_fd=folder)
        try:
            fd = os.open(name, _DIR, dir_fd=folder)
        except OSError:
            return None
        if not _ours(fd):
            os.close(fd)
            return None
        return fd

    def add_all(self, base: Path, entries: Iterable[manifest.Entry]) -> int:
        """Link every file of `base` listed in `entries` here (best effort: a full disk or another filesystem
        only costs the ability to repair). Returns how many new objects were linked."""
        added = 0
        subs: dict[str, int | None] = {}
        with self._folder(create=True) as folder:
            if folder is None:
                return 0
            try:
                for entry in entries:
                    if entry.kind != "f" or not _hex(entry.sha256, SHA_LEN):
                        continue
                    prefix = entry.sha256[:2]
                    if prefix not in subs:
                        subs[prefix] = self._sub(folder, prefix, create=True)
                    sub = subs[prefix]
                    if sub is None:
                        continue
                    try:
                        os.link(base / entry.path, entry.sha256, dst_dir_fd=sub, follow_symlinks=False)
                        added += 1
                    except FileExistsError:
                        continue
                    except OSError as exc:
                        if exc.errno in (
                            errno.EXDEV, errno.ENOSPC, errno.EDQUOT, errno.EMLINK, errno.EROFS, errno.EACCES
                        ):  # fmt: skip
                            return added
                        raise
            finally:
                for sub in subs.values():
                    if sub is not None:
                        os.close(sub)
        return added

    def find(self, sha: str) -> Path | None:
        """The object for `sha`, if one exists, is this user's alone and still holds exactly those bytes."""
        if not _hex(sha, SHA_LEN):
            return None
        with self._folder() as folder:
            sub = self._sub(folder, sha[:2]) if folder is not None else None
            if sub is None:
                return None
            try:
                fd = os.open(sha, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=sub)
            except OSError:
                return None
            finally:
                os.close(sub)
            with open(fd, "rb", buffering=0) as handle:
                st = os.fstat(handle.fileno())
                if not stat.S_ISREG(st.st_mode) or not _ours(handle.fileno()):
                    return None
                digest = hashlib.sha256()
                try:
                    while chunk := handle.read(1 << 20):
                        digest.update(chunk)
                except OSError:
                    return None
            return self.path(sha) if digest.hexdigest() == sha else None

    def collect(self) -> int:
        """Remove objects that no generation or cache links to any more (only names this module writes)."""
        removed = 0
        with self._folder() as folder:
            if folder is None:
                return 0
            for name in os.listdir(folder):
                sub = self._sub(folder, name) if _hex(name, 2) else None
                if sub is None:
                    continue
                try:
                    for entry in os.listdir(sub):
                        if not _hex(entry, SHA_LEN):
                            continue
                        with contextlib.suppress(OSError):
                            st = os.stat(entry, dir_fd=sub, follow_symlinks=False)
                            if not stat.S_ISREG(st.st_mode) or st.st_nlink == 1:
                                os.unlink(entry, dir_fd=sub)
                                removed += 1
                finally:
                    os.close(sub)
        return removed
