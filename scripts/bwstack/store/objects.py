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
import os
import stat
from collections.abc import Iterable
from pathlib import Path

from bwstack.probe.treecheck import sha256_file
from bwstack.store import manifest

SHA_LEN = 64


class ObjectStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def path(self, sha: str) -> Path:
        return self.root / sha[:2] / sha

    def add_all(self, base: Path, entries: Iterable[manifest.Entry]) -> int:
        """Link every file of `base` listed in `entries` here (best effort: a full disk or another filesystem
        only costs the ability to repair). Returns how many new objects were linked."""
        added = 0
        made: set[str] = set()
        for entry in entries:
            if entry.kind != "f" or len(entry.sha256) != SHA_LEN:
                continue
            target = self.path(entry.sha256)
            try:
                if entry.sha256[:2] not in made:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    made.add(entry.sha256[:2])
                os.link(base / entry.path, target, follow_symlinks=False)
                added += 1
            except FileExistsError:
                continue
            except OSError as exc:
                if exc.errno in (errno.EXDEV, errno.ENOSPC, errno.EDQUOT, errno.EMLINK, errno.EROFS, errno.EACCES):
                    return added
                raise
        return added

    def find(self, sha: str) -> Path | None:
        """The object for `sha`, if one exists and still holds exactly those bytes."""
        if len(sha) != SHA_LEN:
            return None
        path = self.path(sha)
        try:
            st = os.lstat(path)
        except OSError:
            return None
        if not stat.S_ISREG(st.st_mode):
            return None
        try:
            return path if sha256_file(path) == sha else None
        except OSError:
            return None

    def collect(self) -> int:
        """Remove objects that no generation or cache links to any more."""
        removed = 0
        if not self.root.is_dir():
            return 0
        for sub in self.root.iterdir():
            if sub.is_symlink() or not sub.is_dir():
                continue
            for entry in os.scandir(sub):
                with contextlib.suppress(OSError):
                    st = entry.stat(follow_symlinks=False)
                    if not stat.S_ISREG(st.st_mode) or st.st_nlink == 1:
                        os.unlink(entry.path)
                        removed += 1
        return removed
