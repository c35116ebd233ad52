"""Does a tree still hold what its manifest rows say: the one comparison of a generation with its manifest.

The store's `manifest.verify` (before a switch, `bwstack generations`, repair, restore) and the probe's reuse
of a sealed generation's facts (sealed.py: after a file's mtime moved, are its bytes still the sealed ones?)
both call `compared`. It lives in the probe because the probe runs on nodes as a standard-library-only
zipapp and the store may import the probe, not the other way round.

A row is the manifest's list `[path, kind, size, mode, sha256, ino, mtime_ns, uid, gid]`: kind "f", "l" or "d";
sha256 is a file's content hash and a link's target; uid and gid are None in a legacy (format 1) manifest.
`quick` re-hashes only the files whose inode or mtime moved (any ordinary write moves the mtime), and those whose
inode changed after a given moment (a write with the mtime put back moves the ctime, which nobody can set);
`full` re-hashes every file. Links are never followed.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import stat
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

CHUNK = 4 << 20
MAX_MANIFEST_BYTES = 512 << 20
MAX_TEXT_BYTES = 16 << 20  # sglang's largest source is 0.2 MB, torch's METADATA 0.05 MB
KINDS = ("f", "l", "d")
NAMES = {"f": "a file", "l": "a symlink", "d": "a directory", "?": "a special file"}


def sha256_file(path: str | os.PathLike, *, follow_links: bool = False) -> str:
    """The file's sha256 (hex). A link at `path` itself is refused (ELOOP) unless the caller allows it: a hash
    taken through a link someone else placed would vouch for their file. Anything but a regular file (a FIFO
    swapped in, a device) is refused without blocking on it."""
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | (0 if follow_links else os.O_NOFOLLOW)
    digest = hashlib.sha256()
    with open(os.open(path, flags), "rb", buffering=0) as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _whole(n: object) -> bool:
    # type() rather than isinstance: a bool is an int subclass, and a manifest of 90,000 rows calls this 500,000
    # times (json gives exact ints).
    return type(n) is int and n >= 0


def valid_row(row: object) -> bool:
    """A manifest row of the shape the store writes: 7 fields (legacy) or 9, a path without NUL, a known kind,
    whole non-negative numbers, a string hash, owners as numbers (or None in a legacy row)."""
    if not isinstance(row, list) or len(row) not in (7, 9):
        return False
    path, kind, size, mode, sha, ino, mtime = row[:7]
    uid, gid = row[7:9] if len(row) == 9 else (None, None)
    return (
        isinstance(path, str)
        and bool(path)
        and "\0" not in path
        and kind in KINDS
        and _whole(size)
        and _whole(mode)
        and _whole(ino)
        and _whole(mtime)
        and isinstance(sha, str)
        and (uid is None or _whole(uid))
        and (gid is None or _whole(gid))
    )


def read_bounded(path: Path, limit: int = MAX_MANIFEST_BYTES, what: str = "a manifest") -> bytes:
    """The bytes of a file the store wrote (a manifest, a record): a regular file, opened without following a
    link or blocking on a FIFO, of at most `limit` bytes. OSError, or ValueError saying what is wrong with it."""
    return _read_fd(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC), limit, what)


def read_regular(path: str | os.PathLike[str], limit: int = MAX_TEXT_BYTES, what: str = "a source file") -> bytes:
    """The bytes of a file of an env (METADATA, a module's source, a header), read as the env's interpreter
    reads it, through links, but only if it ends at a regular file of at most `limit` bytes: checked before it is
    opened for reading (opening a device can act on it), opened without blocking (a FIFO cannot hang a root
    probe), read at most `limit` + 1 bytes (a /proc file that claims 0 bytes cannot exhaust memory). An env's
    links may lead anywhere (a restored archive may hold absolute ones); files under /proc, /sys and /dev are
    refused whatever they claim to be (reading /proc/kmsg consumes the kernel's log). OSError or ValueError."""
    # O_PATH pins the file without opening it for reading (which can act on a device); only the regular file it
    # pinned is then opened, through its descriptor, so a link swapped meanwhile changes nothing.
    pinned = os.open(path, os.O_PATH | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(pinned).st_mode):
            raise ValueError(f"{path}: not a regular file")
        if kernels(pinned):
            raise ValueError(f"{path}: a file of the kernel's (/proc, /sys, /dev), not of the env")
        fd = os.open(f"/proc/self/fd/{pinned}", os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    finally:
        os.close(pinned)
    return _read_fd(fd, limit, what)


KERNEL_TREES = ("/proc", "/sys", "/dev")


def kernels(fd: int) -> bool:
    """The open file lies under /proc, /sys or /dev (their submounts too: cgroup, debugfs, tracefs), by the
    path the kernel gives the open file, or on the same filesystem as one of them."""
    with contextlib.suppress(OSError):
        where = os.readlink(f"/proc/self/fd/{fd}")
        if any(where == top or where.startswith(top + "/") for top in KERNEL_TREES):
            return True
    device = os.fstat(fd).st_dev
    for top in KERNEL_TREES:
        with contextlib.suppress(OSError):
            mounted = os.stat(top).st_dev
            if mounted == device and mounted != os.stat("/").st_dev:  # a tree of its own, not a folder of /
                return True
    return False


def read_text(path: str | os.PathLike[str], limit: int = MAX_TEXT_BYTES) -> str | None:
    """`read_regular` as text (undecodable bytes replaced), or None where `Path.is_file` said no before, and
    also for a file that cannot be read or is over `limit`: the callers treat those as absent."""
    try:
        return read_regular(path, limit).decode("utf-8", errors="replace")
    except (OSError, ValueError):
        return None


def _read_fd(fd: int, limit: int, what: str) -> bytes:
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file")
        if st.st_size > limit:
            raise ValueError(f"{st.st_size} bytes, more than {what} can be")
        with os.fdopen(os.dup(fd), "rb") as handle:
            data = handle.read(limit + 1)
        if data is None:  # opened without blocking, and it would block: no regular file does that
            raise ValueError("has nothing to read yet, as no regular file has")
        if len(data) > limit:
            raise ValueError(f"more than {limit} bytes, more than {what} can be")
        return data
    finally:
        os.close(fd)


class OtherFilesystem(ValueError):
    """A filesystem is mounted inside a tree that must be one filesystem: whoever serves it (a FUSE server
    runs as the user who mounted it) answers every stat and read as it likes, so what was hashed need not be
    what is run, and nothing would show the change."""


def walk(
    root: Path, *, skip_top: Iterable[str] = (), skip_dirs: Iterable[str] = (), one_filesystem: bool = False
) -> Iterator[tuple[str, os.stat_result]]:
    """(relative path, lstat) of root itself ("."), then everything under it in a stable order. Never follows
    a link. `skip_top` names entries of the root to leave out; `skip_dirs` directory names to leave out.
    `one_filesystem`: OtherFilesystem at the first path on another filesystem than the root (a mount point)."""
    root_str = str(root)
    skip_top, skip_dirs = set(skip_top), set(skip_dirs)
    top = os.lstat(root_str)
    yield ".", top
    for dirpath, dirnames, filenames in os.walk(root_str):
        at_top = dirpath == root_str
        dirnames[:] = sorted(d for d in dirnames if d not in skip_dirs and not (at_top and d in skip_top))
        rel_dir = os.path.relpath(dirpath, root_str)
        names = sorted(dirnames) + sorted(f for f in filenames if not (at_top and f in skip_top))
        for name in names:
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            st = os.lstat(os.path.join(dirpath, name))
            if one_filesystem and st.st_dev != top.st_dev:
                raise OtherFilesystem(
                    f"{os.path.join(dirpath, name)}: another filesystem is mounted there, inside {root_str} "
                    "(its files could change without a trace): unmount it"
                )
            yield rel, st


def kind_of(st: os.stat_result) -> str:
    mode = st.st_mode
    return "l" if stat.S_ISLNK(mode) else "d" if stat.S_ISDIR(mode) else "f" if stat.S_ISREG(mode) else "?"


def describe_mode(mode: int) -> str:
    notes = [
        w for bit, w in ((0o020, "group-writable"), (0o002, "world-writable"), (0o6000, "setuid/setgid")) if mode & bit
    ]
    return f"{mode:04o}" + (f" ({', '.join(notes)})" if notes else "")


class Seen(NamedTuple):
    """One path as a walk found it: what the comparison with its row reads. `target` is a link's target, read
    when the comparison needs it (None: read it from the path then)."""

    rel: str
    kind: str
    mode: int  # permission bits (stat.S_IMODE)
    uid: int
    gid: int
    size: int
    ino: int
    mtime_ns: int
    ctime_ns: int
    dev: int
    target: str | None = None


def seen(rel: str, st: os.stat_result) -> Seen:
    return Seen(rel, kind_of(st), stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, st.st_size, st.st_ino,
                st.st_mtime_ns, st.st_ctime_ns, st.st_dev)  # fmt: skip


def compare(root: Path, rel: str, st: os.stat_result, row: Sequence, legacy: bool = False) -> str | None:
    """What differs between one path and its row, besides its bytes (None: nothing)."""
    return _differs(root, seen(rel, st), row, legacy)


def _differs(root: Path, path: Seen, row: Sequence, legacy: bool) -> str | None:
    _path, want_kind, size, want_mode, sha, _ino, _mtime, uid, gid = (*row, None, None)[:9]
    kind, mode = path.kind, path.mode
    if kind != want_kind:
        return f"is {NAMES[kind]}, manifest says {NAMES.get(want_kind, want_kind)}"
    if kind == "l":
        target = path.target if path.target is not None else os.readlink(Path(root) / path.rel)
        if target != sha:
            return f"symlink now points to {target!r}, manifest says {sha!r}"
    if kind != "l" and mode != want_mode and not (legacy and kind == "d"):
        return f"mode {describe_mode(mode)}, manifest says {want_mode:04o}"
    if kind == "d" and mode & 0o022:
        return f"mode {describe_mode(mode)}: a sealed generation has nothing group- or world-writable"
    if uid is not None and (path.uid, path.gid) != (uid, gid):
        return f"owner {path.uid}:{path.gid}, manifest says {uid}:{gid}"
    if kind == "f" and path.size != size:
        return f"size {path.size}, manifest says {size}"
    return None


def _safe_hash(path: Path) -> str:
    try:
        return sha256_file(path)
    except OSError as exc:
        return f"unreadable ({exc.strerror})"


@dataclass(frozen=True)
class Compared:
    """What `compared` found, and the newest inode change time (ns) among the paths it walked: once nothing
    differs, every file that changed up to then has had its bytes compared."""

    found: list[tuple[str, str]]
    newest_change: int


def compared(
    root: Path,
    rows: Iterable[Sequence],
    depth: str = "quick",
    *,
    workers: int | None = None,
    skip_top: Iterable[str] = (),
    legacy: bool = False,
    first_only: bool = False,
    changed_since: int | None = None,
) -> Compared:
    """(path, what differs) for every path of `root` that does not match its row, sorted by path (empty when the
    tree holds exactly what the rows say), and the tree's newest inode change time. A legacy manifest never
    recorded bytecode or the root directory. `first_only` stops at the first difference found (the caller only
    needs to know whether one exists). `changed_since` (ns): a file whose inode changed after that moment (its
    ctime) is hashed too, whatever its inode and mtime say: rewriting a file in place and putting its mtime back
    leaves both as they were, and only the ctime moves."""
    walked = (
        seen(rel, st)
        for rel, st in walk(root, skip_top=skip_top, skip_dirs=("__pycache__",) if legacy else ())
        if not (legacy and rel == ".")
    )
    return _compared(root, walked, rows, depth, workers, legacy, first_only, changed_since)


def compared_listing(
    root: Path,
    rows: Iterable[Sequence],
    listing: Listing,
    *,
    first_only: bool = False,
    changed_since: int | None = None,
) -> Compared | None:
    """compared() of a tree a find walk has just listed (the generation stamp's walk, sealed.py): the same
    comparison, read from what find printed instead of a second walk of lstat calls (0.12 s against 0.7 s for
    88,000 paths). With first_only, the difference named is the first by path, not by walk order. None when the
    listing does not parse (the caller walks instead). What it finds differs; what it finds whole was whole as
    each path was listed, which a change during the walk can make untrue by the walk's end (sealed.py says when
    that matters)."""
    paths = listing.parsed()
    if paths is None:
        return None
    # Every path is compared before a first difference is named (cheap here): the first by path, not by the
    # order find happened to list them in.
    try:
        return _compared(root, paths, rows, "quick", None, False, first_only, changed_since, whole_walk=True)
    except _Unlisted:
        return None


def _compared(
    root: Path,
    paths: Iterator[Seen],
    rows: Iterable[Sequence],
    depth: str,
    workers: int | None,
    legacy: bool,
    first_only: bool,
    changed_since: int | None,
    whole_walk: bool = False,
) -> Compared:
    expected = {row[0]: row for row in rows}
    found: list[tuple[str, str]] = []
    suspects: list[Sequence] = []
    visited: set[str] = set()
    newest = 0
    device: int | None = None
    for path in paths:
        rel = path.rel
        if device is None:  # the root comes first
            device = path.dev if rel == "." else os.lstat(root).st_dev
        visited.add(rel)
        newest = max(newest, path.ctime_ns)
        row = expected.get(rel)
        what = "not in the manifest (added after the generation was sealed)" if row is None else None
        if path.dev != device:  # its server answers stats and reads as it likes: nothing below it can be believed
            what = "another filesystem is mounted here (its files could change without a trace)"
        what = what or _differs(root, path, row, legacy)
        if what:
            found.append((rel, what))
            if first_only and not whole_walk:
                return Compared(found, newest)
            if first_only:  # only the first by path is named: a tree of a million new files keeps one
                found = [min(found)]
        elif row[1] == "f" and (
            depth == "full"
            or (path.ino, path.mtime_ns) != (row[5], row[6])
            or (changed_since is not None and path.ctime_ns > changed_since)
        ):
            suspects.append(row)
    found += [(rel, "missing") for rel in sorted(set(expected) - visited)]
    if found and first_only:
        return Compared(sorted(found)[:1], newest)
    pool = ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 2)
    try:
        for row, sha in zip(suspects, pool.map(lambda r: _safe_hash(Path(root) / r[0]), suspects), strict=True):
            if sha != row[4]:
                found.append((row[0], f"content changed (sha256 {sha}, manifest {row[4]})"))
                if first_only:
                    break
    finally:
        pool.shutdown(cancel_futures=True)  # after a first difference, the files not hashed yet stay so
    return Compared(sorted(found), newest)


_FIND_KINDS = {b"f": "f", b"d": "d", b"l": "l"}


def find_time_ns(text: bytes) -> int:
    """Nanoseconds of a time find printed as seconds with a fraction (%T@, %C@: ten decimals)."""
    whole, _, frac = text.partition(b".")
    if len(frac) == 10 and whole[:1] != b"-":  # what GNU find prints: one conversion (170,000 per listing)
        return int(whole + frac[:9])
    return int(whole) * 1_000_000_000 + int((frac[:9] or b"0").ljust(9, b"0"))


@dataclass(frozen=True)
class Listing:
    """What one GNU find walk printed for every path, in walk order, in three outputs: FIND_RECORD (the tree
    stamp's records), FIND_CHANGE (each path's inode change time) and FIND_EXTRA (its device and link target)."""

    records: bytes
    changes: bytes
    extras: bytes

    def parsed(self) -> Iterator[Seen] | None:
        """The paths, read one at a time as they are compared (a list of them held 0.6 KB a path); None when the
        three outputs do not hold one entry each for the same paths. A record that is not what the formats print
        raises ValueError as it is read."""
        records = self.records.split(b"\0")
        changes = self.changes.split()
        extras = self.extras.split(b"\0")
        if records[-1] or extras[-1] or not (len(records) - 1 == len(changes) == len(extras) - 1):
            return None
        return _seen_in(records[:-1], changes, extras[:-1])


class _Unlisted(ValueError):
    """A listing record that is not what the formats print: the tree is walked instead."""


def _seen_in(records: list[bytes], changes: list[bytes], extras: list[bytes]) -> Iterator[Seen]:
    for record, change, extra in zip(records, changes, extras, strict=True):
        try:
            kind, ino, size, mtime, mode, uid, gid, rel = record.split(b" ", 7)
            dev, _, target = extra.partition(b" ")
            path = Seen(os.fsdecode(rel) or ".", _FIND_KINDS.get(kind, "?"), int(mode, 8), int(uid), int(gid),
                        int(size), int(ino), _listed_ns(mtime), _listed_ns(change), int(dev),
                        os.fsdecode(target) if kind == b"l" else None)  # fmt: skip
        except ValueError as exc:
            raise _Unlisted(str(exc)) from None
        yield path


def _listed_ns(text: bytes) -> int:
    """A listed time, only as GNU find prints it (ten decimals): a find that printed fewer (whole seconds) would
    make a changed file's time read earlier than it is, so that it would not be hashed."""
    _seconds, dot, frac = text.partition(b".")
    if not dot or len(frac) != 10 or not frac.isdigit():
        raise ValueError(f"a time find did not print with ten decimals: {text[:40]!r}")
    return find_time_ns(text)


# The three outputs of the walk a Listing is read from (find -printf / -fprintf formats).
FIND_RECORD = "%y %i %s %T@ %m %U %G %P\\0"
FIND_CHANGE = "%C@\\n"
FIND_EXTRA = "%D %l\\0"
