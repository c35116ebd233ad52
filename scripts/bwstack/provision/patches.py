"""Source patches to installed packages: hash-guarded, idempotent, reversible (catalogue: data/patches.yaml).

A patch edits named files of one distribution. For every family of releases with byte-identical files the
catalogue holds each file's original and patched sha256 and the edit as exact text replacements, so:

- `status` says, per file, whether it is the known original, the known patched file, or something else;
- `apply` writes only when every file is a known original or already patched; anything else (a hand edit, a
  release nobody verified) is refused before a single byte is written;
- `revert` undoes the edit and must land on the original hash exactly.

Writes are atomic (temp file in the same directory, fsync, rename), keep the file's mode (and owner, when run
as root), break hard links into a uv cache instead of writing through them, and delete the files' stale
`__pycache__/<module>.*.pyc`. The dist-info RECORD keeps the wheel's hashes: nothing checks it at run time.

bwstack runs as root on envs others may own, so it never follows a link inside the env: every file is reached
from the env one name at a time through folder descriptors opened without following a link (lib/pythonX.Y/
site-packages, then the catalogue path), read and replaced relative to its folder's descriptor. A link on the
way would let the env's owner point `sglang` at another env's (root's, a sealed generation) and have root
rewrite that env's files; it is refused (UsageError) instead.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import hashlib
import os
import re
import stat
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from bwstack.errors import BwstackError, IntegrityError, PreflightError, UsageError
from bwstack.lock.patch_catalogue import Edit, Family, Patch, PatchCatalogueError, catalogue
from bwstack.probe import dirfd
from bwstack.probe.features import dist_version
from bwstack.probe.treecheck import MAX_TEXT_BYTES

# per-file states
ORIGINAL = "original"
APPLIED = "applied"
UNKNOWN = "unknown"  # content matches neither hash
MISSING = "missing"  # the package is installed but the file is not there
NOT_INSTALLED = "not-installed"
UNSUPPORTED = "unsupported-version"
# overall state only: some files original, the others applied (an interrupted apply/revert; both finish it)
PARTIAL = "partial"


class PatchRefusedError(PreflightError):
    """A patch cannot be applied or reverted safely here; nothing was written."""

    def __init__(self, patch_id: str, message: str, path: str | None = None, sha256: str | None = None) -> None:
        self.patch_id = patch_id
        self.path = path
        self.sha256 = sha256
        super().__init__(f"patch {patch_id}: {message}")


# ------------------------------------------------------------------------------------- files, without links

_VENV_SITE = re.compile(r"lib/python\d+\.\d+[^/]*/site-packages")


def _refusal(folder: int, name: str, shown: Path, kind: str) -> UsageError:
    """Why `name` in `folder` (shown as `shown`) cannot be opened as `kind`: a link, or something else."""
    try:
        link = stat.S_ISLNK(os.stat(name, dir_fd=folder, follow_symlinks=False).st_mode)
    except OSError:
        link = False
    if link:
        return UsageError(f"{shown} is a link: bwstack does not follow links inside an env; refusing to patch it")
    return UsageError(f"{shown} is not {kind}; refusing to patch it")


def _open_folder(folder: int, name: str, shown: Path) -> int:
    try:
        return dirfd.open_folder(name, folder)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        raise _refusal(folder, name, shown, "a folder") from None


def _walk_start(site_packages: Path) -> tuple[Path, tuple[str, ...]]:
    """Where the walk starts, and the names from there to site-packages. In a venv's layout the walk starts at the
    env, opened as the caller named it (--env, or the store's own ml-env link): lib, pythonX.Y and site-packages
    are the env owner's, and a link there would lead all of site-packages into another env."""
    parts = site_packages.parts
    if len(parts) > 3 and _VENV_SITE.fullmatch("/".join(parts[-3:])):
        return Path(*parts[:-3]), parts[-3:]
    return site_packages.parent, parts[-1:]


@contextlib.contextmanager
def _folder_of(site_packages: Path, rel: str) -> Iterator[tuple[int, Path]]:
    """The folder that holds `rel` (a catalogue path) as a descriptor, and that folder's path for messages."""
    start, names = _walk_start(Path(site_packages))
    fd, shown = os.open(start, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC), start
    try:
        for name in (*names, *rel.split("/")[:-1]):
            shown = shown / name
            child = _open_folder(fd, name, shown)
            os.close(fd)
            fd = child
        yield fd, shown
    finally:
        os.close(fd)


def _open_source(folder: int, name: str, shown: Path) -> int:
    """`name` in `folder` opened for reading, only if it is a regular file: never through a link, and without
    blocking on a FIFO put in its place."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        fd = os.open(name, flags, dir_fd=folder)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise _refusal(folder, name, shown, "a regular file") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _refusal(folder, name, shown, "a regular file")
    return fd


def _read(site_packages: Path, rel: str) -> bytes | None:
    """The bytes of `rel` (None where it or a folder on its way is absent); UsageError for a link on the way."""
    name = rel.rsplit("/", 1)[-1]
    try:
        with (
            _folder_of(site_packages, rel) as (folder, shown),
            open(_open_source(folder, name, shown / name), "rb") as f,
        ):
            data = f.read(MAX_TEXT_BYTES + 1)
    except FileNotFoundError:
        return None
    if len(data) > MAX_TEXT_BYTES:  # no source file is that large; reading on could exhaust memory
        raise UsageError(f"{site_packages / rel} is over {MAX_TEXT_BYTES} bytes: not a source file of {rel}")
    return data


def _sha256(site_packages: Path, rel: str) -> str | None:
    data = _read(site_packages, rel)
    return None if data is None else hashlib.sha256(data).hexdigest()


def _patches(patch_ids: Iterable[str] | None) -> list[Patch]:
    known = catalogue()
    ids = list(known) if patch_ids is None else list(dict.fromkeys(patch_ids))
    unknown = [pid for pid in ids if pid not in known]
    if unknown:
        raise UsageError(f"unknown patch {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    return [known[pid] for pid in ids]


# ------------------------------------------------------------------------------------------------ status


@dataclass(frozen=True)
class FileState:
    path: str  # relative to site-packages
    state: str  # original | applied | unknown | missing | not-installed | unsupported-version
    sha256: str | None  # of the file as it is now (None when absent)
    original_sha256: str | None = None  # from the catalogue family that matches the installed version
    patched_sha256: str | None = None

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class PatchState:
    patch_id: str
    package: str
    version: str | None  # installed version of `package`
    versions: str | None  # the catalogue family's specifier that covers it
    state: str  # a file state, or `partial`
    reason: str
    files: tuple[FileState, ...]

    def as_dict(self) -> dict:
        out = asdict(self)
        out["files"] = [f.as_dict() for f in self.files]
        return out


def _patch_state(site_packages: Path, patch: Patch) -> tuple[PatchState, Family | None]:
    version = dist_version(site_packages, patch.package)

    def current(rel: str) -> str | None:
        return _sha256(site_packages, rel)

    if version is None:
        files = tuple(FileState(p, NOT_INSTALLED, current(p)) for p in patch.paths)
        reason = f"{patch.package} is not installed in {site_packages}"
        return PatchState(patch.id, patch.package, None, None, NOT_INSTALLED, reason, files), None
    family = patch.family_for(version)
    if family is None:
        files = tuple(FileState(p, UNSUPPORTED, current(p)) for p in patch.paths)
        reason = _unsupported_reason(patch, version, {f.path: f.sha256 for f in files})
        return PatchState(patch.id, patch.package, version, None, UNSUPPORTED, reason, files), None

    states = []
    for spec in family.files:
        sha = current(spec.path)
        if sha is None:
            state = MISSING
        elif sha == spec.original_sha256:
            state = ORIGINAL
        elif sha == spec.patched_sha256:
            state = APPLIED
        else:
            state = UNKNOWN
        states.append(FileState(spec.path, state, sha, spec.original_sha256, spec.patched_sha256))
    kinds = {f.state for f in states}
    if UNKNOWN in kinds:
        overall = UNKNOWN
        reason = "; ".join(
            f"{f.path} has sha256 {f.sha256}, neither the original nor the patched file of {patch.package} {version}"
            for f in states
            if f.state == UNKNOWN
        )
    elif MISSING in kinds:
        overall = MISSING
        reason = "; ".join(f"{f.path} is missing" for f in states if f.state == MISSING)
    elif kinds == {ORIGINAL}:
        overall, reason = ORIGINAL, "not applied"
    elif kinds == {APPLIED}:
        overall, reason = APPLIED, "applied"
    else:
        overall = PARTIAL
        reason = "partly applied (" + ", ".join(f"{f.path}: {f.state}" for f in states) + "); apply or revert"
    return PatchState(patch.id, patch.package, version, family.versions, overall, reason, tuple(states)), family


def _unsupported_reason(patch: Patch, version: str, current: dict[str, str | None]) -> str:
    for entry in patch.unsupported:
        if entry.contains(version):
            return f"{patch.package} {version} is not supported: {entry.reason}"
    covered = "; ".join(fam.versions for fam in patch.families)
    reason = f"{patch.package} {version} is in no verified range of this patch ({covered})"
    for fam in patch.families:
        if all(current.get(f.path) == f.original_sha256 for f in fam.files):
            reason += (
                f"; its files match the originals of the {fam.versions!r} entry: check the release and add "
                "it to data/patches.yaml"
            )
            break
    return reason


def status(site_packages: Path, patch_ids: Iterable[str] | None = None) -> list[PatchState]:
    """The state of each patch (all known patches when `patch_ids` is None) in one env's site-packages."""
    site_packages = Path(site_packages)
    return [_patch_state(site_packages, patch)[0] for patch in _patches(patch_ids)]


# ---------------------------------------------------------------------------------------------- apply/revert


@dataclass(frozen=True)
class FileChange:
    path: str
    action: str  # patched | restored | unchanged
    sha256_before: str
    sha256: str  # after
    bytecode_removed: tuple[str, ...] = ()

    def as_dict(self) -> dict:
        out = asdict(self)
        out["bytecode_removed"] = list(self.bytecode_removed)
        return out


@dataclass(frozen=True)
class PatchResult:
    patch_id: str
    package: str
    version: str
    versions: str  # the catalogue family used
    action: str  # applied | already applied | reverted | already original
    files: tuple[FileChange, ...]

    def as_dict(self) -> dict:
        out = asdict(self)
        out["files"] = [f.as_dict() for f in self.files]
        return out


def _apply_edits(text: str, edits: Sequence[Edit], reverse: bool) -> str | None:
    steps = [(e.new, e.old) for e in reversed(edits)] if reverse else [(e.old, e.new) for e in edits]
    for old, new in steps:
        if text.count(old) != 1:
            return None
        text = text.replace(old, new)
    return text


def _plan(site_packages: Path, patches: list[Patch], revert: bool) -> list[tuple[PatchState, Family, list]]:
    """Check every file of every patch; compute new contents in memory. Raises before anything is written."""
    verb = "revert" if revert else "apply"
    target_state = ORIGINAL if revert else APPLIED
    plans, claimed = [], {}
    for patch in patches:
        state, family = _patch_state(site_packages, patch)
        if family is None:
            raise PatchRefusedError(patch.id, f"refusing to {verb}: {state.reason}")
        for f in state.files:
            if f.state == MISSING:
                raise PatchRefusedError(patch.id, f"refusing to {verb}: {f.path} is missing", f.path)
            if f.state == UNKNOWN:
                raise PatchRefusedError(
                    patch.id,
                    f"refusing to {verb}: {site_packages / f.path} has sha256 {f.sha256}, which is neither "
                    f"the original ({f.original_sha256}) nor the patched file ({f.patched_sha256}) of "
                    f"{patch.package} {state.version}; nothing was changed",
                    f.path,
                    f.sha256,
                )
            if f.path in claimed:
                raise PatchRefusedError(patch.id, f"{f.path} is also edited by patch {claimed[f.path]}", f.path)
            claimed[f.path] = patch.id
        writes = []
        for spec, f in zip(family.files, state.files, strict=True):
            if f.state == target_state:
                continue
            data = _read(site_packages, spec.path)
            if data is None or hashlib.sha256(data).hexdigest() != f.sha256:
                raise PatchRefusedError(patch.id, f"refusing to {verb}: {f.path} changed while it was checked", f.path)
            new = _apply_edits(data.decode("utf-8"), spec.edits, reverse=revert)
            target = spec.original_sha256 if revert else spec.patched_sha256
            if new is None or hashlib.sha256(new.encode("utf-8")).hexdigest() != target:
                raise PatchCatalogueError(
                    f"patch {patch.id}: the catalogue's edits for {spec.path} ({family.versions}) do not "
                    f"produce sha256 {target}; nothing was changed"
                )
            writes.append((spec, f.sha256, new.encode("utf-8"), target))
        plans.append((state, family, writes))
    return plans


def _write_new(folder: int, name: str, data: bytes, old: os.stat_result) -> None:
    """Replace `name` in `folder` by a new file of `data` with `old`'s mode (and owner, when we may): a new inode,
    so a hard link to the old file (uv's cache, another generation) keeps the old content. Made through the
    folder's descriptor (dirfd), never by name: the folder is the env owner's to change meanwhile."""
    owner = (old.st_uid, old.st_gid)
    dirfd.replace(folder, name, [data], mode=stat.S_IMODE(old.st_mode), owner=owner, sync=True)
    os.fsync(folder)


def _remove_bytecode(folder: int, stem: str) -> list[str]:
    """Delete `__pycache__/<stem>.*.pyc` in `folder`; returns the names removed. A `__pycache__` that is a link
    (or no folder) is left alone: the bytecode it leads to is not the env's to delete."""
    try:
        cache = dirfd.open_folder("__pycache__", folder)
    except OSError:
        return []
    removed = []
    try:
        for pyc in sorted(fnmatch.filter(os.listdir(cache), f"{stem}.*.pyc")):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(pyc, dir_fd=cache)  # unlink never follows a link: at worst it removes the link
                removed.append(pyc)
    finally:
        os.close(cache)
    return removed


def _replace_file(site_packages: Path, rel: str, data: bytes) -> tuple[str, ...]:
    """Atomically replace `rel` with `data` and delete its stale bytecode; returns what was removed (relative
    paths). The folder is reached as `_read` reaches it: a link on the way is refused, never written through."""
    parent, _, name = rel.rpartition("/")
    with _folder_of(site_packages, rel) as (folder, shown):
        old = _open_source(folder, name, shown / name)
        try:
            st = os.fstat(old)
        finally:
            os.close(old)
        _write_new(folder, name, data, st)
        removed = _remove_bytecode(folder, name.rsplit(".", 1)[0])
    return tuple(f"{parent}/__pycache__/{pyc}".lstrip("/") for pyc in removed)


def _run(site_packages: Path, patch_ids: Iterable[str], revert: bool) -> list[PatchResult]:
    site_packages = Path(site_packages)
    plans = _plan(site_packages, _patches(patch_ids), revert)
    results = []
    for state, family, writes in plans:
        written: dict[str, FileChange] = {}
        for spec, before, data, target in writes:
            path = site_packages / spec.path
            try:
                removed = _replace_file(site_packages, spec.path, data)
            except OSError as exc:
                raise BwstackError(
                    f"patch {state.patch_id}: writing {path} failed ({exc}); files written before it: "
                    f"{', '.join(written) or 'none'}. `bwstack patch status` shows the state; apply or "
                    "revert finishes a partial patch"
                ) from exc
            after = _sha256(site_packages, spec.path)
            if after != target:
                raise IntegrityError(f"patch {state.patch_id}: {path} has sha256 {after} after writing, not {target}")
            action = "restored" if revert else "patched"
            written[spec.path] = FileChange(spec.path, action, before, after, removed)
        files = tuple(written.get(f.path) or FileChange(f.path, "unchanged", f.sha256, f.sha256) for f in state.files)
        if revert:
            action = "reverted" if written else "already original"
        else:
            action = "applied" if written else "already applied"
        results.append(PatchResult(state.patch_id, state.package, state.version, family.versions, action, files))
    return results


def apply(site_packages: Path, patch_ids: Iterable[str]) -> list[PatchResult]:
    """Apply patches; refuses (PatchRefusedError, nothing written) unless every file is a known original or
    already patched. Already-applied patches are a no-op with action "already applied"."""
    return _run(site_packages, patch_ids, revert=False)


def revert(site_packages: Path, patch_ids: Iterable[str]) -> list[PatchResult]:
    """Restore the byte-identical originals; same refusal rules as `apply`."""
    return _run(site_packages, patch_ids, revert=True)
