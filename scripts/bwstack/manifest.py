"""Integrity manifests of a generation: every file with size, mode and sha256; every symlink with its target.

`__pycache__` is left out: Python writes bytecode there at first import and validates it against the
source it was compiled from, so it is derived data, not part of what a generation promises.

Verification has two depths. `quick` compares each file's inode, size and mtime with the manifest and
re-hashes only files whose fingerprint moved (any ordinary write moves mtime), so it takes well under a
second on a 10 GB env. `full` re-hashes every byte and also catches a writer that reset the mtime.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

SKIP_DIRS = {"__pycache__"}
CHUNK = 4 << 20


@dataclass(frozen=True)
class Entry:
    path: str
    kind: str  # "f" file, "l" symlink, "d" directory
    size: int
    mode: int
    sha256: str  # files: content hash; symlinks: the link target; dirs: ""
    ino: int = 0
    mtime_ns: int = 0

    def as_row(self) -> list:
        return [self.path, self.kind, self.size, self.mode, self.sha256, self.ino, self.mtime_ns]

    @classmethod
    def from_row(cls, row: list) -> Entry:
        return cls(*row)


def hash_file(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def walk(root: Path) -> Iterator[tuple[str, os.stat_result]]:
    """(relative path, lstat) of everything under root except bytecode caches, in a stable order."""
    root_str = str(root)
    for dirpath, dirnames, filenames in os.walk(root_str):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        rel_dir = os.path.relpath(dirpath, root_str)
        for name in sorted(dirnames) + sorted(filenames):
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            yield rel, os.lstat(os.path.join(dirpath, name))


def build(
    root: Path, known: Mapping[tuple[int, int, int, int], str] | None = None, workers: int | None = None
) -> list[Entry]:
    """Manifest of `root`. `known` maps (dev, ino, size, mtime_ns) to a sha256 already computed for that
    inode (files hard-linked from the uv cache into several generations are hashed once)."""
    known = known or {}
    entries: list[Entry | None] = []
    to_hash: list[tuple[int, str, os.stat_result]] = []
    for rel, st in walk(root):
        if stat.S_ISLNK(st.st_mode):
            entries.append(Entry(rel, "l", 0, 0o777, os.readlink(root / rel)))
        elif stat.S_ISDIR(st.st_mode):
            entries.append(Entry(rel, "d", 0, stat.S_IMODE(st.st_mode), ""))
        elif stat.S_ISREG(st.st_mode):
            sha = known.get((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
            if sha is None:
                to_hash.append((len(entries), rel, st))
                entries.append(None)
            else:
                entries.append(_file_entry(rel, st, sha))
        else:
            raise ValueError(f"{root / rel}: not a regular file, directory or symlink")
    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 2) as pool:
        hashes = pool.map(lambda item: hash_file(root / item[1]), to_hash)
        for (index, rel, st), sha in zip(to_hash, hashes, strict=False):
            entries[index] = _file_entry(rel, st, sha)
    return [e for e in entries if e is not None]


def _file_entry(rel: str, st: os.stat_result, sha: str) -> Entry:
    return Entry(rel, "f", st.st_size, stat.S_IMODE(st.st_mode), sha, st.st_ino, st.st_mtime_ns)


@dataclass(frozen=True)
class Problem:
    path: str
    what: str

    def __str__(self) -> str:
        return f"{self.path}: {self.what}"


def verify(root: Path, entries: list[Entry], depth: str = "quick", workers: int | None = None) -> list[Problem]:
    """Differences between `root` now and its manifest; empty when it verifies."""
    expected = {e.path: e for e in entries}
    problems: list[Problem] = []
    suspects: list[Entry] = []
    seen: set[str] = set()
    for rel, st in walk(root):
        seen.add(rel)
        entry = expected.get(rel)
        if entry is None:
            problems.append(Problem(rel, "not in the manifest (added after the generation was sealed)"))
            continue
        if stat.S_ISLNK(st.st_mode):
            target = os.readlink(root / rel)
            if entry.kind != "l" or target != entry.sha256:
                problems.append(Problem(rel, f"symlink now points to {target!r}, manifest says {entry.sha256!r}"))
        elif stat.S_ISDIR(st.st_mode):
            if entry.kind != "d":
                problems.append(Problem(rel, "is a directory, manifest says it is not"))
        elif entry.kind != "f":
            problems.append(Problem(rel, f"is a file, manifest says {'symlink' if entry.kind == 'l' else 'directory'}"))
        elif st.st_size != entry.size:
            problems.append(Problem(rel, f"size {st.st_size}, manifest says {entry.size}"))
        elif depth == "full" or st.st_ino != entry.ino or st.st_mtime_ns != entry.mtime_ns:
            suspects.append(entry)
    for rel in sorted(set(expected) - seen):
        problems.append(Problem(rel, "missing"))
    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 2) as pool:
        for entry, sha in zip(suspects, pool.map(lambda e: _safe_hash(root / e.path), suspects), strict=False):
            if sha != entry.sha256:
                problems.append(Problem(entry.path, f"content changed (sha256 {sha}, manifest {entry.sha256})"))
    return sorted(problems, key=lambda p: p.path)


def _safe_hash(path: Path) -> str:
    try:
        return hash_file(path)
    except OSError as exc:
        return f"unreadable ({exc.strerror})"


def refingerprint(root: Path, entries: list[Entry]) -> list[Entry]:
    """The same entries with the inode and mtime the files have now (after a restore made new inodes)."""
    out = []
    for e in entries:
        if e.kind == "f":
            st = os.lstat(root / e.path)
            e = Entry(e.path, e.kind, e.size, stat.S_IMODE(st.st_mode), e.sha256, st.st_ino, st.st_mtime_ns)
        out.append(e)
    return out


def known_hashes(entries: list[Entry], dev: int) -> dict[tuple[int, int, int, int], str]:
    return {(dev, e.ino, e.size, e.mtime_ns): e.sha256 for e in entries if e.kind == "f" and e.ino}


def total_size(entries: list[Entry]) -> int:
    return sum(e.size for e in entries if e.kind == "f")


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
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return []

    def load(self, dev: int) -> dict[tuple[int, int, int, int], str]:
        known = {}
        for row in self._rows():
            if len(row) != 6 or row[0] != dev:
                continue
            d, ino, size, mtime, sha, anchor = row
            try:
                st = os.lstat(anchor)
            except OSError:
                continue
            if (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) == (d, ino, size, mtime):
                known[(d, ino, size, mtime)] = sha
        return known

    def add(self, root: Path, entries: list[Entry]) -> None:
        rows = [r for r in self._rows() if len(r) == 6]
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
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(rows, separators=(",", ":")))
        os.replace(tmp, self.path)
