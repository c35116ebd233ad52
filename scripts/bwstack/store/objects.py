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
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from bwstack.probe import pathtrust
from bwstack.store import manifest

SHA_LEN = 64


_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
HEX = frozenset("0123456789abcdef")


def _ours(fd: int) -> bool:
    """A folder or file of this user's that nobody else can write: the only kind the store links from or into,
    removes from, or takes bytes from. (A cache folder shared with another user, BWSTACK_CACHE, is left alone.)"""
    st = os.fstat(fd)
    return st.st_uid == os.geteuid() and not st.st_mode & 0o022 and not pathtrust.has_acl(fd)


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

    @contextlib.contextmanager
    def _opened(self, sha: str) -> Iterator[tuple[int, int] | None]:
        """(its subfolder, the object) as descriptors when the object for `sha` exists, is this user's alone and
        holds exactly those bytes (hashed from the descriptor), else None."""
        if not _hex(sha, SHA_LEN):
            yield None
            return
        with self._folder() as folder:
            sub = self._sub(folder, sha[:2]) if folder is not None else None
            if sub is None:
                yield None
                return
            try:
                try:
                    fd = os.open(sha, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=sub)
                except OSError:
                    yield None
                    return
                try:
                    yield (sub, fd) if self._holds(fd, sha) else None
                finally:
                    os.close(fd)
            finally:
                os.close(sub)

    @staticmethod
    def _holds(fd: int, sha: str) -> bool:
        if not stat.S_ISREG(os.fstat(fd).st_mode) or not _ours(fd):
            return False
        digest = hashlib.sha256()
        offset = 0
        try:
            while chunk := os.pread(fd, 1 << 20, offset):
                digest.update(chunk)
                offset += len(chunk)
        except OSError:
            return False
        return digest.hexdigest() == sha

    def find(self, sha: str) -> Path | None:
        """The object for `sha`, if one exists, is this user's alone and still holds exactly those bytes."""
        with self._opened(sha) as opened:
            return self.path(sha) if opened is not None else None

    def restore(
        self, sha: str, target: Path, mode: int, owner: tuple[int | None, int | None], clear: Callable[[], None]
    ) -> bool:
        """Put the object for `sha` at `target`: a hard link to it where it already has the mode and owner the
        manifest wants, else a copy of its bytes. Both are made from the descriptors whose content was just
        checked (a path looked up again could lead to what another user swapped in meanwhile). `clear()` is
        called once the object is known good, to remove what is at `target`. False, with nothing cleared: no
        trusted object."""
        with self._opened(sha) as opened:
            if opened is None:
                return False
            sub, fd = opened
            clear()
            st = os.fstat(fd)
            if stat.S_IMODE(st.st_mode) == mode and (st.st_uid, st.st_gid) == owner:
                os.link(sha, target, src_dir_fd=sub, follow_symlinks=False)
                if os.lstat(target).st_ino == st.st_ino:
                    return True
                os.unlink(target)  # the name led elsewhere by now: copy the checked bytes instead
            out = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                offset = 0
                while chunk := os.pread(fd, 1 << 20, offset):
                    os.write(out, chunk)
                    offset += len(chunk)
                os.fchmod(out, mode)
                os.utime(out, ns=(st.st_atime_ns, st.st_mtime_ns))
            finally:
                os.close(out)
            return True

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
