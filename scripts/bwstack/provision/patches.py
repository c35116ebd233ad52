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
"""

from __future__ import annotations

import hashlib
import stat
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from bwstack.errors import BwstackError, IntegrityError, PreflightError, UsageError
from bwstack.fsutil import atomic_write_bytes
from bwstack.lock.patch_catalogue import Edit, Family, Patch, PatchCatalogueError, catalogue
from bwstack.probe.features import dist_version
from bwstack.probe.treecheck import sha256_file

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
        path = site_packages / rel
        return sha256_file(path) if path.is_file() else None

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
            data = (site_packages / spec.path).read_bytes()
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


def _replace_file(path: Path, data: bytes) -> None:
    """Atomically replace `path` with `data`, keeping its permission bits (and owner, when we may)."""
    st = path.stat()
    atomic_write_bytes(path, data, stat.S_IMODE(st.st_mode), owner=(st.st_uid, st.st_gid))


def remove_bytecode(site_packages: Path, rel: str) -> tuple[str, ...]:
    """Delete `__pycache__/<module>.*.pyc` of one source file; returns what was removed (relative paths)."""
    source = Path(site_packages) / rel
    removed = []
    for pyc in sorted((source.parent / "__pycache__").glob(f"{source.stem}.*.pyc")):
        pyc.unlink(missing_ok=True)
        removed.append(pyc.relative_to(site_packages).as_posix())
    return tuple(removed)


def _run(site_packages: Path, patch_ids: Iterable[str], revert: bool) -> list[PatchResult]:
    site_packages = Path(site_packages)
    plans = _plan(site_packages, _patches(patch_ids), revert)
    results = []
    for state, family, writes in plans:
        written: dict[str, FileChange] = {}
        for spec, before, data, target in writes:
            path = site_packages / spec.path
            try:
                _replace_file(path, data)
            except OSError as exc:
                raise BwstackError(
                    f"patch {state.patch_id}: writing {path} failed ({exc}); files written before it: "
                    f"{', '.join(written) or 'none'}. `bwstack patch status` shows the state; apply or "
                    "revert finishes a partial patch"
                ) from exc
            after = sha256_file(path)
            if after != target:
                raise IntegrityError(f"patch {state.patch_id}: {path} has sha256 {after} after writing, not {target}")
            action = "restored" if revert else "patched"
            written[spec.path] = FileChange(spec.path, action, before, after, remove_bytecode(site_packages, spec.path))
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
