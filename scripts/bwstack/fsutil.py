"""Filesystem primitives that lose nothing when interrupted: atomic writes and renames, fsync'd."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes, mode: int = 0o644, owner: tuple[int, int] | None = None) -> None:
    """Replace `path` with `data` so that readers see the old or the new content, never a mix. A new inode:
    a hard link to the old file elsewhere (uv's cache, another generation) keeps the old content. Mode and owner
    are set through the open file, never by name: in a folder others can write, the temporary name could be
    made a link to another file between the write and a chmod."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fchmod(handle.fileno(), mode)
            if owner is not None and owner != (os.geteuid(), os.getegid()):
                with contextlib.suppress(PermissionError):  # not root: the file becomes ours, as any rewrite would
                    os.fchown(handle.fileno(), *owner)
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def new_file_mode() -> int:
    """The mode a new file of the user's gets: 0666 less this process's umask, as `open` would give it (for files
    written where the user points, not the store's own). Read from /proc, since setting the umask to read it
    would change it for every thread."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as status:
            umask = next((int(line.split()[1], 8) for line in status if line.startswith("Umask:")), None)
    except (OSError, ValueError, IndexError):
        umask = None
    if umask is None:
        umask = os.umask(0o022)
        os.umask(umask)
    return 0o666 & ~umask


def atomic_write_text(path: Path, text: str, mode: int = 0o644) -> None:
    atomic_write_bytes(path, text.encode("utf-8"), mode)


def append_line(path: Path, line: str) -> None:
    """`line` and a newline appended to `path` (made 0644 if missing) and synced; a link at `path` is refused,
    never followed. OSError for the caller to say what it could not record."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_symlink(target: str | os.PathLike, link: Path) -> None:
    """Point `link` at `target` with one rename: a new process resolves the old or the new target."""
    link = Path(link)
    tmp = link.with_name(f".{link.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    os.symlink(target, tmp)
    try:
        os.replace(tmp, link)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(link.parent)


def free_bytes(path: Path) -> int:
    path = Path(path)
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def tree_size(path: Path) -> int:
    """Bytes in a tree, each inode counted once (hard links shared inside the tree count once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for root, dirs, files in os.walk(path):
        for name in files + dirs:
            st = os.lstat(os.path.join(root, name))
            key = (st.st_dev, st.st_ino)
            if key not in seen:
                seen.add(key)
                total += st.st_blocks * 512
    return total
