"""What the store does to a generation's tree on disk: seal it, take it over, remove it, and swap two paths
atomically. Links inside a tree are never followed: they are changed, owned and removed as links (lstat,
lchown, unlink)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import shutil
import stat
from pathlib import Path

from bwstack.errors import BwstackError
from bwstack.fsutil import atomic_write_text
from bwstack.probe import treecheck


def make_writable_parent(path: Path) -> None:
    parent = path.parent
    mode = stat.S_IMODE(os.lstat(parent).st_mode)
    if not mode & 0o200:
        os.chmod(parent, mode | 0o200)


def replace_sealed(path: Path, text: str) -> None:
    atomic_write_text(path, text, mode=0o444)


def seal(env: Path, *, folders: bool = True) -> None:
    """Files read-only for everyone, no setuid/setgid bits, nothing group- or world-writable. Installers
    replace files (new inodes) rather than writing through, so a hard link shared with another generation
    is never modified; the generation hook stops Python from adding bytecode. `folders` False: the files only
    (the build's bytecode is written into the folders after; a file already sealed is not changed again)."""
    for dirpath, dirnames, filenames in os.walk(env):
        for name in filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode):
                mode = stat.S_IMODE(st.st_mode) & ~0o222 & ~0o7000
                if mode != stat.S_IMODE(st.st_mode):
                    os.chmod(path, mode)
        for name in dirnames if folders else ():
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            if stat.S_ISDIR(st.st_mode) and st.st_mode & 0o7022:
                os.chmod(path, stat.S_IMODE(st.st_mode) & ~0o7022)
    if not folders:
        return
    st = os.stat(env)
    if st.st_mode & 0o7022:
        os.chmod(env, stat.S_IMODE(st.st_mode) & ~0o7022)


def take_ownership(env: Path) -> list[str]:
    """Make every path of `env` owned by this process's user (root), or name what another user owns.
    treecheck.OtherFilesystem when a filesystem is mounted inside it (its files are its server's to answer)."""
    uid, gid = os.geteuid(), os.getegid()
    foreign = []
    for rel, st in treecheck.walk(env, one_filesystem=True):
        if (st.st_uid, st.st_gid) != (uid, gid):
            if uid == 0:
                os.lchown(env / rel, uid, gid)
            else:
                foreign.append(rel)
    return foreign


MOUNTINFO = "/proc/self/mountinfo"


def mounts_under(path: Path, mountinfo: str = MOUNTINFO) -> list[str]:
    """The mount points at or below `path` (its real path), as this process's mount table lists them: a bind
    mount of the same filesystem included, which no st_dev shows. Without the table (no /proc, or a table that
    does not read whole): the folders below `path` on another device than it."""
    real = os.path.realpath(path)
    try:
        with open(mountinfo, "rb") as table:
            data = table.read(MAX_MOUNTINFO + 1)
        if len(data) > MAX_MOUNTINFO:
            raise OSError(errno.EFBIG, "larger than bwstack reads")
    except OSError:
        return _other_devices_under(real)
    found = []
    for line in data.decode("utf-8", errors="surrogateescape").splitlines():
        fields = line.split(" ")
        if len(fields) > 4:
            # Field 5 is the mount point, with space, tab, newline and backslash written as octal escapes.
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
            if point == real or point.startswith(real.rstrip("/") + "/"):
                found.append(point)
    return found


MAX_MOUNTINFO = 64 << 20  # a host with a hundred thousand mounts has a table of about 15 MiB


def _other_devices_under(real: str) -> list[str]:
    try:
        device = os.lstat(real).st_dev
    except OSError:
        return []
    found = []
    for dirpath, dirnames, _ in os.walk(real):
        for name in list(dirnames):
            full = os.path.join(dirpath, name)
            with contextlib.suppress(OSError):
                if os.lstat(full).st_dev != device:
                    found.append(full)
                    dirnames.remove(name)
    return found


def remove_tree(path: Path) -> None:
    def _writable(func, p, _exc):  # sealed files sit in directories we may have made read-only
        # The folder itself, never what a link swapped in at its name leads to.
        fd = os.open(os.path.dirname(p), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.fchmod(fd, 0o755)
        finally:
            os.close(fd)
        func(p)

    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        # rmtree would go on into a filesystem mounted inside (a bind mount of a data disk), emptying it.
        mounted = mounts_under(path)
        if mounted:
            raise BwstackError(
                f"not removing {path}: a filesystem is mounted at {mounted[0]} inside it, and removing would empty "
                f"that too: unmount it (umount {mounted[0]}), then run the command again"
            )
        shutil.rmtree(path, onerror=_writable)
    else:
        os.unlink(path)


_RENAME_EXCHANGE = 2


def exchange(a: Path, b: Path) -> None:
    """Swap two paths atomically (renameat2 RENAME_EXCHANGE): used to turn a real ml-env directory into
    bwstack's link without a moment where the path does not exist."""
    libc = ctypes.CDLL(None, use_errno=True)
    func = getattr(libc, "renameat2", None)
    if func is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available in this libc")
    at_fdcwd = -100
    if func(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(a))
