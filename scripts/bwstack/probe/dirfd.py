"""Folders opened and files made relative to directory descriptors, never through a link.

Root writes into folders someone else may change meanwhile: a wheel store or DEST others can write, an env its
owner can change, a recording's folder. A path looked at and then used again by name can be swapped in between
(a link planted at a temporary name, a folder renamed and replaced). Here a folder is opened once, without
following a link, and every file is made in it exclusively (O_EXCL, so never a link or someone else's file),
given its mode through its own descriptor, and renamed over its final name (a rename replaces a link, it never
writes through one). Standard library only: the probe ships it.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import secrets
import stat
from collections.abc import Iterable

FOLDER_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def open_folder(name: str | os.PathLike[str], dir_fd: int | None = None, *, make: int | None = None) -> int:
    """`name` (in `dir_fd`) opened as a folder, made first with mode `make` when it is missing. A link or a file
    there raises OSError (ELOOP, ENOTDIR): it is never followed."""
    if make is not None:
        with contextlib.suppress(FileExistsError):  # there already: the open below judges what it is
            os.mkdir(name, make, dir_fd=dir_fd)
    return os.open(name, FOLDER_FLAGS, dir_fd=dir_fd)


def write_new(
    folder: int,
    prefix: str,
    chunks: Iterable[bytes],
    *,
    mode: int,
    owner: tuple[int, int] | None = None,
    sync: bool = False,
) -> tuple[str, str]:
    """A new file in `folder` holding `chunks`: its name (`prefix` and a random part) and its sha256. Mode (and
    owner, where this user may give it) are set through its descriptor; `sync` flushes it to disk. Removed again
    when anything fails, the error raised as it came."""
    name = f"{prefix}.{secrets.token_hex(8)}.tmp"
    fd = os.open(name, NEW_FILE_FLAGS, 0o600, dir_fd=folder)
    digest = hashlib.sha256()
    try:
        with open(fd, "wb", closefd=False) as out:  # buffered: every byte is written, or it raises
            for chunk in chunks:
                digest.update(chunk)
                out.write(chunk)
        os.fchmod(fd, mode)
        if owner is not None and owner != (os.geteuid(), os.getegid()):
            with contextlib.suppress(PermissionError):  # not root: the file stays ours, as any rewrite would make it
                os.fchown(fd, *owner)
        if sync:
            os.fsync(fd)
    except BaseException:
        remove(folder, name)
        raise
    finally:
        os.close(fd)
    return name, digest.hexdigest()


def move(folder: int, name: str, final: str, into: int | None = None) -> None:
    """`name` in `folder` renamed to `final` in `into` (default: the same folder). Whatever lay at `final`, a
    planted link included, is replaced, never followed; `name` is removed when the rename fails."""
    try:
        os.replace(name, final, src_dir_fd=folder, dst_dir_fd=folder if into is None else into)
    except BaseException:
        remove(folder, name)
        raise


def replace(folder: int, final: str, chunks: Iterable[bytes], **new: object) -> str:
    """`final` in `folder` replaced by a new file of `chunks` (write_new's options), atomically; its sha256."""
    name, sha256 = write_new(folder, f".{final}", chunks, **new)  # type: ignore[arg-type]
    move(folder, name, final)
    return sha256


def remove(folder: int, name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=folder)


MAX_LINKS = 40  # as the kernel's own limit on links followed in one lookup
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class Outside(OSError):
    """A path inside a folder that leads out of it ('..' above it, or a link to an absolute path)."""


def open_beneath(root: int, path: str) -> int:
    """`path` (relative to the folder open as `root`, a leading / meaning that folder) opened read-only and not
    blocking, as openat2's RESOLVE_BENEATH would: every component opened with O_NOFOLLOW from the one before, a
    link read and resolved by hand inside `root` (relative ones only), never a step out of `root`. A folder
    others can change while it is read can swap names at will: whatever it swaps in is looked up the same way,
    so nothing outside `root` is ever opened. Raises Outside, or OSError (ELOOP past MAX_LINKS, ENOENT, ...)."""
    todo = [p for p in path.split("/") if p][::-1]
    stack = [os.dup(root)]
    links = 0
    try:
        while todo:
            name = todo.pop()
            if name == ".":
                continue
            if name == "..":
                if len(stack) == 1:
                    raise Outside(f"{path} leads out of the folder it is read in")
                os.close(stack.pop())
                continue
            last = not todo
            flags = READ_FLAGS | (0 if last else os.O_DIRECTORY)
            try:
                fd = os.open(name, flags, dir_fd=stack[-1])
            except OSError as exc:
                _link, target = _link_hit(exc, name, stack[-1], links, path)
                links += 1
                if target.startswith("/"):
                    raise Outside(f"{path} leads out of the folder it is read in (a link to {target})") from None
                todo.extend(p for p in reversed(target.split("/")) if p)
                continue
            stack.append(fd)
        return os.dup(stack[-1])
    finally:
        for fd in stack:
            os.close(fd)


def _link_hit(failed: OSError, name: str, folder: int, links: int, path: str) -> tuple[os.stat_result, str]:
    """The link `name` in `folder` that an O_NOFOLLOW open of it ran into (ELOOP, or ENOTDIR where a folder was
    wanted): its lstat and target. `failed` again when it is not a link; ELOOP once MAX_LINKS were followed."""
    if failed.errno not in (errno.ELOOP, errno.ENOTDIR):
        raise failed
    try:
        st = os.stat(name, dir_fd=folder, follow_symlinks=False)
        if not stat.S_ISLNK(st.st_mode):
            raise failed
        target = os.readlink(name, dir_fd=folder)
    except OSError:
        raise failed from None  # not a link (a file where a folder was wanted), or gone: as the open said
    if links >= MAX_LINKS:
        raise OSError(errno.ELOOP, "too many links", path) from None
    return st, target


class OthersLink(OSError):
    """A link another user made, on the way to a folder root was told to read."""


def open_trusted_folder(path: str | os.PathLike[str]) -> int:
    """The folder `path` names, opened one name at a time from / (or the working folder) with O_NOFOLLOW. A link on
    the way is followed only when root or this user made it (/var/run -> /run, a home moved to another disk):
    one another user made, in a folder they can write, would let them point root's read at a folder of root's
    own choosing (OthersLink). Raises OSError as open() would (ENOENT, ENOTDIR, ELOOP past MAX_LINKS)."""
    text = os.fspath(path)
    todo = [p for p in text.split("/") if p][::-1]
    fd = os.open("/" if text.startswith("/") else ".", FOLDER_FLAGS)
    links = 0
    try:
        while todo:
            name = todo.pop()
            if name == ".":
                continue
            try:
                sub = os.open(name, FOLDER_FLAGS, dir_fd=fd)
            except OSError as exc:
                link, target = _link_hit(exc, name, fd, links, text)
                links += 1
                if link.st_uid not in (0, os.geteuid()):
                    raise OthersLink(errno.EPERM, f"a link uid {link.st_uid} made, not followed", name) from None
                if link.st_dev == _procfs_device() and name not in ("self", "thread-self"):
                    # /proc/<pid>/cwd, root, fd/N: root's own name for them whoever's process they are (one that
                    # made itself undumpable), and their text is read again in root's view, not the process's.
                    raise OthersLink(errno.EPERM, "a process's link in /proc, not followed", name) from None
                if target.startswith("/"):
                    os.close(fd)
                    fd = os.open("/", FOLDER_FLAGS)
                todo.extend(p for p in reversed(target.split("/")) if p)
                continue
            os.close(fd)
            fd = sub
        return fd
    except BaseException:
        os.close(fd)
        raise


def _procfs_device() -> int:
    try:
        return os.stat("/proc/self", follow_symlinks=False).st_dev
    except OSError:
        return -1


def make_folders(path: str | os.PathLike[str], mode: int = 0o755) -> list[str]:
    """`path` and every missing folder above it made by this user, one name at a time: the nearest existing one
    opened as open_trusted_folder does, then each new one made (mkdir) and opened with no link followed, and
    judged by its descriptor (this user's). So a link or another user's folder that appears on the way (below a
    shared sticky folder such as /tmp) is refused, never made into or through (OthersLink, OSError). Returns the
    folders made, outermost first; on a refusal, those made by this call are removed again."""
    text = os.path.abspath(os.fspath(path))
    missing: list[str] = []
    base = text
    while not os.path.lexists(base) and base != "/":
        base, name = os.path.split(base)
        missing.append(name)
    fd = open_trusted_folder(base)
    made: list[str] = []
    try:
        owner = os.fstat(fd).st_uid
        if missing and owner not in (0, os.geteuid()):  # nothing of this user's goes into another user's folder
            raise OthersLink(errno.EPERM, f"a folder uid {owner} owns", base)
        for name in reversed(missing):
            try:
                os.mkdir(name, mode, dir_fd=fd)
                made.append(os.path.join(base, name))
            except FileExistsError:
                pass
            try:
                sub = os.open(name, FOLDER_FLAGS, dir_fd=fd)
            except OSError as exc:
                raise OthersLink(exc.errno, f"{exc.strerror} (a link or a file appeared there)", name) from None
            os.close(fd)
            fd = sub
            owner = os.fstat(fd).st_uid
            if owner != os.geteuid():
                raise OthersLink(errno.EPERM, f"a folder uid {owner} made on the way", os.path.join(base, name))
            base = os.path.join(base, name)
        return made
    except BaseException:
        for folder in reversed(made):
            with contextlib.suppress(OSError):
                os.rmdir(folder)
        raise
    finally:
        os.close(fd)
