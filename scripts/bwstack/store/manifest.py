"""Integrity manifests of a generation: every path in it with kind, size, mode, owner and sha256.

A manifest (format 2) covers the whole generation directory except `manifest.json` itself: the directory,
`record.json`, the `cuda` link and every file, link and directory under `env/`, bytecode included. Bytecode
is compiled when a generation is built and is part of what it promises; a generation's start-up hook stops
Python from writing more (root ignores read-only bits), so any `__pycache__` file that appears later is an
added file, like a `.pth` someone dropped in.

Verification has two depths. `quick` compares each path's kind, mode, owner and size with the manifest and,
for files, the inode and mtime; it re-hashes only files whose fingerprint moved (any ordinary write moves
mtime), so it takes well under a second on a 10 GB env. `full` re-hashes every byte and also catches a
writer that reset the mtime. Both report every path that is not in the manifest.

Format 1 manifests (bwstack 0.1) listed `env/` only, without owners and without bytecode: they are read
as such (`legacy`), their generations verify what they recorded, and the listing says so.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from bwstack.fsutil import atomic_write_text
from bwstack.probe.treecheck import compared, read_bounded, sha256_file, valid_row, walk

FORMAT = 2
MANIFEST_NAME = "manifest.json"


class ManifestError(ValueError):
    """A manifest that cannot be read or does not have the expected shape; the message says where."""


@dataclass(frozen=True)
class Entry:
    path: str  # relative to the manifest's root; "." is the root itself
    kind: str  # "f" file, "l" symlink, "d" directory
    size: int
    mode: int
    sha256: str  # files: content hash; symlinks: the link target; dirs: ""
    ino: int = 0
    mtime_ns: int = 0
    uid: int | None = None  # None: a legacy manifest that did not record owners
    gid: int | None = None

    def as_row(self) -> list:
        return [self.path, self.kind, self.size, self.mode, self.sha256, self.ino, self.mtime_ns, self.uid, self.gid]

    @classmethod
    def from_row(cls, row: object) -> Entry:
        if not isinstance(row, list) or len(row) not in (7, 9):
            raise ManifestError(f"a file row is not a list of 7 or 9 fields: {str(row)[:80]}")
        if not valid_row(row):
            raise ManifestError(f"malformed file row for {str(row[0])[:80]!r}")
        path, kind, size, mode, sha, ino, mtime = row[:7]
        uid, gid = row[7:9] if len(row) == 9 else (None, None)
        return cls(path, kind, size, mode, sha, ino, mtime, uid, gid)

    @property
    def content(self) -> tuple:
        """What the generation promises about this path (fingerprints aside)."""
        return (self.path, self.kind, self.size, self.mode, self.sha256)


@dataclass(frozen=True)
class Manifest:
    """A parsed manifest document. `root` is what its paths are relative to: the generation directory for
    format 2, its `env/` for legacy format 1."""

    format: int
    entries: tuple[Entry, ...]
    meta: Mapping[str, object]

    @property
    def legacy(self) -> bool:
        return self.format == 1

    def content_digest(self) -> str:
        """Identity of a generation's content: equal for a generation and its restored archive."""
        rows = sorted(e.content for e in self.entries if e.path not in ("record.json", "."))
        return "sha256:" + hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest()

    def by_path(self) -> dict[str, Entry]:
        return {e.path: e for e in self.entries}

    def document(self) -> dict:
        return {**self.meta, "format": self.format, "files": [e.as_row() for e in self.entries]}


def parse(text: str | bytes) -> Manifest:
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise ManifestError(f"not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("files"), list):
        raise ManifestError("not a manifest (no `files` list)")
    fmt = doc.get("format")
    if fmt not in (1, FORMAT):
        raise ManifestError(f"unknown manifest format {str(fmt)[:20]!r}")
    entries = tuple(Entry.from_row(row) for row in doc["files"])
    paths = [e.path for e in entries]
    if len(set(paths)) != len(paths):
        raise ManifestError("lists a path twice")
    meta = {k: v for k, v in doc.items() if k not in ("files", "format")}
    return Manifest(fmt, entries, meta)


def read(path: Path) -> Manifest:
    """Read a manifest file: a regular file (never through a link) of bounded size."""
    try:
        data = read_bounded(path)
    except OSError as exc:
        raise ManifestError(f"{path}: cannot open ({exc.strerror})") from None
    except ValueError as exc:
        raise ManifestError(f"{path}: {exc}") from None
    return parse(data)


def build(
    root: Path,
    known: Mapping[tuple[int, int, int, int], str] | None = None,
    workers: int | None = None,
    skip_top: Iterable[str] = (MANIFEST_NAME,),
    *,
    earlier: Mapping[tuple[int, int, int, int], str] | None = None,
    earlier_until: int = 0,
) -> list[Entry]:
    """Manifest entries of `root` (a generation directory). `known` maps (dev, ino, size, mtime_ns) to a
    sha256 already computed for that inode (files hard-linked from the uv cache into several generations
    are hashed once). `earlier`: hashes of this same tree taken before (same keys), reused only for a file
    whose inode has not changed since `earlier_until` (ns, the filesystem's clock): a write in place moves the
    inode change time even when the writer puts the mtime back, and a new file made since has a later one."""
    known = known or {}
    earlier = earlier or {}
    entries: list[Entry | None] = []
    to_hash: list[tuple[int, str, os.stat_result]] = []
    for rel, st in walk(root, skip_top=skip_top, one_filesystem=True):
        if stat.S_ISLNK(st.st_mode):
            entries.append(_entry(rel, "l", st, os.readlink(root / rel), size=0))
        elif stat.S_ISDIR(st.st_mode):
            entries.append(_entry(rel, "d", st, "", size=0))
        elif stat.S_ISREG(st.st_mode):
            key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            sha = known.get(key)
            if sha is None and st.st_ctime_ns <= earlier_until:
                sha = earlier.get(key)
            if sha is None:
                to_hash.append((len(entries), rel, st))
                entries.append(None)
            else:
                entries.append(_entry(rel, "f", st, sha))
        else:
            raise ValueError(f"{root / rel}: not a regular file, directory or symlink")
    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 2) as pool:
        hashes = pool.map(lambda item: sha256_file(root / item[1]), to_hash)
        for (index, rel, st), sha in zip(to_hash, hashes, strict=True):
            entries[index] = _entry(rel, "f", st, sha)
    return [e for e in entries if e is not None]


def _entry(rel: str, kind: str, st: os.stat_result, sha: str, size: int | None = None) -> Entry:
    fingerprint = (st.st_ino, st.st_mtime_ns) if kind == "f" else (0, 0)
    mode = 0o777 if kind == "l" else stat.S_IMODE(st.st_mode)
    return Entry(rel, kind, st.st_size if size is None else size, mode, sha, *fingerprint, st.st_uid, st.st_gid)


@dataclass(frozen=True)
class Problem:
    path: str
    what: str

    def __str__(self) -> str:
        return f"{self.path}: {self.what}"


def verify(
    root: Path,
    manifest: Manifest | list[Entry],
    depth: str = "quick",
    workers: int | None = None,
    skip_top: Iterable[str] = (MANIFEST_NAME,),
) -> list[Problem]:
    """Differences between `root` now and its manifest; empty when it verifies (probe.treecheck compares)."""
    return check(root, manifest, depth, workers=workers, skip_top=skip_top)[0]


def check(
    root: Path,
    manifest: Manifest | list[Entry],
    depth: str = "quick",
    *,
    workers: int | None = None,
    skip_top: Iterable[str] = (MANIFEST_NAME,),
    changed_since: int | None = None,
) -> tuple[list[Problem], int]:
    """verify(), hashing also the files whose inode changed after `changed_since` (ns), with the newest inode
    change time of the tree (probe.treecheck.compared)."""
    if isinstance(manifest, Manifest):
        entries, legacy = manifest.entries, manifest.legacy
    else:
        entries, legacy = manifest, False
    rows = [e.as_row() for e in entries]
    got = compared(root, rows, depth, workers=workers, skip_top=skip_top, legacy=legacy, changed_since=changed_since)
    return [Problem(path, what) for path, what in got.found], got.newest_change


def refingerprint(root: Path, entries: Iterable[Entry]) -> list[Entry]:
    """The same entries with the inode and mtime the files have now (after a restore or a repair made new
    inodes with verified content)."""
    out = []
    for e in entries:
        if e.kind == "f":
            st = os.lstat(root / e.path)
            e = replace(e, ino=st.st_ino, mtime_ns=st.st_mtime_ns)
        out.append(e)
    return out


def known_hashes(entries: Iterable[Entry], dev: int) -> dict[tuple[int, int, int, int], str]:
    return {(dev, e.ino, e.size, e.mtime_ns): e.sha256 for e in entries if e.kind == "f" and e.ino}


def total_size(entries: Iterable[Entry]) -> int:
    return sum(e.size for e in entries if e.kind == "f")


MAX_HASH_CACHE_BYTES = 256 << 20  # 400,000 rows of about 200 bytes, with room


class HashCache:
    """sha256 of files hard-linked from uv's cache into generations, so that a generation built in another
    store from the same cache is not hashed again.

    An entry is trusted only while the generation file it was recorded from (its anchor) still holds the same
    inode with the same size and mtime: a live link keeps the inode from being recycled, so a new file that
    merely got the same inode number never inherits someone else's hash. A stale entry could only make a
    manifest fail a full verify, never pass one: `verify` re-hashes what it checks."""

    LIMIT = 400_000

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def _rows(self) -> list:
        try:
            rows = json.loads(read_bounded(self.path, MAX_HASH_CACHE_BYTES, "the file-hash cache"))
        except (OSError, ValueError):
            return []
        return rows if isinstance(rows, list) else []

    def load(self, dev: int) -> dict[tuple[int, int, int, int], str]:
        known = {}
        for row in self._rows():
            if not isinstance(row, list) or len(row) != 6 or row[0] != dev:
                continue
            d, ino, size, mtime, sha, anchor = row
            try:
                st = os.lstat(anchor)
            except (OSError, TypeError, ValueError):
                continue
            if (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) == (d, ino, size, mtime):
                known[(d, ino, size, mtime)] = sha
        return known

    def add(self, root: Path, entries: Iterable[Entry]) -> None:
        """Best effort: a full disk or an unwritable cache only costs a re-hash later."""
        rows = [r for r in self._rows() if isinstance(r, list) and len(r) == 6]
        seen = {(r[0], r[1]) for r in rows}
        for e in entries:
            if e.kind != "f":
                continue
            path = root / e.path
            st = os.lstat(path)
            if st.st_nlink > 1 and (st.st_dev, st.st_ino) not in seen:
                rows.append([st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, e.sha256, str(path)])
                seen.add((st.st_dev, st.st_ino))
        rows = rows[-self.LIMIT :]
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.path, json.dumps(rows, separators=(",", ":")))  # never through a link
        except OSError:
            return
