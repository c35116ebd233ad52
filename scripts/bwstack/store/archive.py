"""Off-node copies of a generation: tar + zstd with a .sha256 beside it, and a restore that trusts nothing.

An archive is hostile input: restore runs as root and reads whatever is on the NAS. So restore reads the
whole member list first and refuses the archive before writing a byte if any member is not something a
generation may hold:

  generation/record.json, generation/manifest.json   regular files (bounded size)
  generation/facts.json                              a regular file (the recorded facts, when it has them)
  generation/cuda                                    a symbolic link to an absolute path (the toolkit)
  generation/env, generation/env/...                 directories, regular files, symbolic links, and hard
                                                     links to regular files of the same archive

Names are relative, without `..`, `.`, empty or duplicate components; no member lives under a member that is
not a directory (a name can never traverse a link); relative link targets stay inside the generation; no
setuid, setgid or sticky bits, nothing writable by group or others, no devices, FIFOs or sparse files. Then
it extracts without ever following a link (every path is opened relative to its parent's descriptor with
O_NOFOLLOW, files are created O_EXCL), as the store's owner whatever the archive says, and checks on the way
that the stream still holds exactly the members it validated. The restored files must match the archived
manifest byte for byte; the generation's verification state is computed here, never taken from the archive.
"""

from __future__ import annotations

import errno
import fcntl
import glob
import hashlib
import io
import json
import os
import posixpath
import re
import stat
import tarfile
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import zstandard

from bwstack.errors import ArchiveRefusedError, BwstackError, IntegrityError, UsageError
from bwstack.fsutil import append_line, atomic_write_bytes
from bwstack.probe import treecheck
from bwstack.store import manifest
from bwstack.store.generations import (
    BUILDING_PREFIX,
    FACTS,
    MANIFEST,
    RECORD,
    Generation,
    Store,
    checkpoint,
    generation_name,
    now_iso,
    run_env_check,
)
from bwstack.store.layout import enclosing_store
from bwstack.store.record import GenerationRecord, RecordError
from bwstack.store.tree import make_writable_parent, remove_tree

TOP = "generation"
MAX_MEMBERS = 2_000_000
MAX_NAME = 4096
MAX_METADATA = {RECORD: 16 << 20, MANIFEST: 256 << 20}
COPY_CHUNK = 1 << 20


# ------------------------------------------------------------------------------------------------ write


class _HashingWriter(io.RawIOBase):
    def __init__(self, handle) -> None:
        self.handle = handle
        self.digest = hashlib.sha256()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.digest.update(data)
        self.size += len(data)
        return self.handle.write(data)


def _remove_abandoned_partials(path: Path) -> None:
    """The partial archives a killed run left beside `path` (write_archive's temporary names): regular files of
    this user's that no run holds locked any more. Opened without following a link and removed only while the name
    is still that file: the folder may be a share others can write."""
    for stale in path.parent.glob(f".{glob.escape(path.name)}.*.partial"):
        try:
            fd = os.open(stale, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a run still writing it holds the lock: kept
            now = os.lstat(stale)
            if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                os.unlink(stale)
        except OSError:
            continue
        finally:
            os.close(fd)


def write_archive(store: Store, gen: Generation, path: Path, level: int = 3) -> dict:
    """Stream the generation as tar + zstd to `path`, with `path`.sha256 beside it. All or nothing. Both are
    written as new files (mkstemp) renamed into place: the folder may be a NAS share others can write, and a link
    left at a predictable name must not turn root's write to somewhere else."""
    path = Path(path).absolute()
    if path.is_dir():
        raise UsageError(f"--archive {path}: a directory; name the archive file to write")
    # In any store, this one too: a store keeps only its own files (its prune removes the others).
    inside = enclosing_store(path.parent)
    if inside is not None and inside == Path(os.path.realpath(store.layout.root)):
        raise UsageError(
            f"--archive {path}: inside the store {store.layout.root}, which keeps only its own files (and an archive "
            f"is the copy that outlives the store): write it to another disk or a NAS share"
        )
    if inside is not None:
        raise UsageError(
            f"--archive {path}: inside the store {inside}, which keeps only its own files (its prune would remove the "
            f"archive): write it outside every store"
        )
    started = time.perf_counter()
    _remove_abandoned_partials(path)
    try:
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise UsageError(f"--archive {path}: cannot be written there ({exc.strerror})") from None
        raise BwstackError(f"disk full: cannot write {path}; nothing changed") from None
    partial: Path | None = Path(name)
    try:
        with os.fdopen(fd, "wb") as raw:
            # Held while it is written: not abandoned (_remove_abandoned_partials). 0600 until it is whole, so that
            # nobody else can open it to hold a lock of their own on it (it would never be removed).
            fcntl.flock(raw.fileno(), fcntl.LOCK_EX)
            os.fchmod(raw.fileno(), 0o600)
            hashing = _HashingWriter(raw)
            compressor = zstandard.ZstdCompressor(level=level, threads=-1)
            with (
                compressor.stream_writer(hashing, closefd=False) as zst,
                tarfile.open(fileobj=zst, mode="w|", format=tarfile.PAX_FORMAT) as tar,
            ):
                for rel in (RECORD, MANIFEST, FACTS):
                    if rel != FACTS or (gen.path / rel).is_file():
                        tar.add(gen.path / rel, arcname=f"{TOP}/{rel}")
                if gen.cuda.is_symlink():
                    tar.add(gen.cuda, arcname=f"{TOP}/cuda")
                for rel, _ in treecheck.walk(gen.env):
                    name = f"{TOP}/env" if rel == "." else f"{TOP}/env/{rel}"
                    tar.add(gen.env / rel if rel != "." else gen.env, arcname=name, recursive=False)
                checkpoint("archive-before-close")
            raw.flush()
            os.fsync(raw.fileno())
            os.fchmod(raw.fileno(), 0o644)  # whole: readable as the archive it becomes
        sha = hashing.digest.hexdigest()
        # An old sidecar goes first and the new one comes last: a run stopped anywhere between leaves an archive
        # without one (a warning on restore), never one beside the wrong archive (a refusal).
        sidecar = path.with_name(path.name + ".sha256")
        sidecar.unlink(missing_ok=True)
        os.replace(partial, path)
        partial = None
        atomic_write_bytes(sidecar, f"{sha}  {path.name}\n".encode())
    except OSError as exc:
        if partial is not None:
            partial.unlink(missing_ok=True)
        if exc.errno == errno.ENOSPC:
            raise BwstackError(
                f"disk full while writing {path}; removed the partial archive, nothing else changed"
            ) from None
        raise BwstackError(f"cannot write {path}: {exc.strerror}") from None
    except BaseException:
        if partial is not None:
            partial.unlink(missing_ok=True)
        raise
    _remember_written(store, {"sha256": sha, "archive": str(path), "generation": gen.name, "at": now_iso()})
    return {"archive": str(path), "sha256": sha, "bytes": hashing.size, "seconds": time.perf_counter() - started}


# ------------------------------------------------------------------------------------------------ vouch

MAX_LEDGER_BYTES = 16 << 20
SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def _remember_written(store: Store, entry: dict) -> None:
    """One line in the store's ledger of archives it wrote (appended, never through a link)."""
    ledger = store.layout.archives
    try:
        append_line(ledger, json.dumps(entry))
    except OSError as exc:
        raise BwstackError(
            f"wrote {entry['archive']} but cannot record it in {ledger} ({exc.strerror}): restoring it will need "
            f"--sha256 {entry['sha256']}"
        ) from None


def _written_here(store: Store) -> tuple[set[str], str]:
    """The sha256 of the archives this store's ledger names, and why it could not be read (none, when it is
    missing, damaged or not a plain file: nothing is vouched for then, and --sha256 says what is)."""
    try:
        text = treecheck.read_bounded(store.layout.archives, MAX_LEDGER_BYTES, "an archive ledger").decode()
    except FileNotFoundError:
        return set(), ""
    except (OSError, ValueError) as exc:
        return set(), f" ({store.layout.archives} cannot be read: {getattr(exc, 'strerror', None) or exc})"
    found = set()
    for line in text.splitlines():
        try:
            sha = json.loads(line).get("sha256")
        except (ValueError, AttributeError):
            continue
        if isinstance(sha, str) and SHA256_HEX.fullmatch(sha):
            found.add(sha)
    return found, ""


def _vouch(store: Store, path: Path, digest: str, given: str | None, written: tuple[set[str], str]) -> None:
    """Restoring runs the archived env's code as root (its interpreter starts, torch is imported; later the node
    serves from it), so an archive is restored only when something other than the archive vouches for it: the
    sha256 the operator gives, or this store's record of having written it. The .sha256 beside it does not:
    whoever could change the archive could change that too."""
    if given is not None:
        if given != digest:
            raise UsageError(f"{path}: its sha256 is {digest}, not the {given} given with --sha256; nothing restored")
        return
    known, unreadable = written
    if digest not in known:
        raise UsageError(
            f"{path}: nothing vouches for this archive (sha256 {digest}): this store did not write it{unreadable}, and "
            f"restoring runs its code as root; compare that hash with the one `bwstack backup --archive` printed "
            f"(or {store.layout.archives.name} holds) where it was written, then give it with --sha256"
        )


# ------------------------------------------------------------------------------------------------ validate


@dataclass(frozen=True)
class Member:
    """What restore will create, relative to the generation directory."""

    name: str  # "env/lib/..." (never the generation directory itself)
    kind: str  # "d", "f", "l" (symlink), "h" (hard link)
    size: int
    mode: int
    target: str  # symlink target, or the generation-relative name a hard link points to
    mtime: int

    @classmethod
    def of(cls, info: tarfile.TarInfo, name: str, target: str) -> Member:
        kind = "d" if info.isdir() else "f" if info.isreg() else "l" if info.issym() else "h"
        return cls(name, kind, info.size if kind == "f" else 0, info.mode & 0o7777, target, int(info.mtime))


def _refuse(what: str) -> ArchiveRefusedError:
    return ArchiveRefusedError(f"{what}; refusing the archive (nothing was written)")


def _relative_name(raw: str) -> str:
    """The member's path inside the generation ("" for the generation directory itself)."""
    if not raw or len(raw) > MAX_NAME or "\0" in raw or "\\" in raw:
        raise _refuse(f"archive member name {raw[:80]!r} is not a plain path")
    name = raw[:-1] if raw.endswith("/") else raw
    parts = name.split("/")
    if parts[0] != TOP:
        raise _refuse(f"archive member {raw[:200]!r} is outside `{TOP}/`")
    if any(p in ("", ".", "..") for p in parts):
        raise _refuse(f"archive member {raw[:200]!r} has an empty, `.` or `..` component")
    return "/".join(parts[1:])


def _check_member(info: tarfile.TarInfo, name: str, seen: dict[str, Member]) -> Member:
    shown = f"{TOP}/{name}"
    if name in seen:
        raise _refuse(f"archive member {shown!r} appears twice")
    if not (info.isdir() or info.isreg() or info.issym() or info.islnk()) or info.issparse():
        raise _refuse(f"archive member {shown!r} is a device, FIFO or sparse file")
    if info.mode & 0o7000:
        raise _refuse(f"archive member {shown!r} has setuid, setgid or sticky bits (mode {info.mode & 0o7777:04o})")
    if not info.issym() and info.mode & 0o022:
        raise _refuse(f"archive member {shown!r} would be writable by group or others (mode {info.mode & 0o7777:04o})")
    parent = posixpath.dirname(name)
    if parent and (parent not in seen or seen[parent].kind != "d"):
        what = "comes before its directory" if parent not in seen else "lies under a member that is not a directory"
        raise _refuse(f"archive member {shown!r} {what}")
    top = name.split("/", 1)[0]
    allowed = {RECORD: "f", MANIFEST: "f", FACTS: "f", "cuda": "l", "env": "d"}
    if name in allowed and Member.of(info, name, "").kind != allowed[name]:
        raise _refuse(f"archive member {shown!r} is not what a generation holds there")
    if top not in allowed or (top != "env" and name != top):
        raise _refuse(f"archive member {shown!r} is not part of a generation")
    target = ""
    if info.issym():
        target = info.linkname
        if not target or len(target) > MAX_NAME or "\0" in target:
            raise _refuse(f"archive symlink {shown!r} has no usable target")
        if name == "cuda" and not posixpath.isabs(target):
            raise _refuse(f"archive member {shown!r} must point to an absolute toolkit path")
        if not posixpath.isabs(target):
            resolved = posixpath.normpath(posixpath.join(parent, target))
            if resolved == ".." or resolved.startswith("../") or resolved.startswith("/"):
                raise _refuse(f"archive symlink {shown!r} -> {target[:200]!r} points outside the generation")
    elif info.islnk():
        linked = _relative_name(info.linkname) if info.linkname.startswith(TOP + "/") else None
        source = seen.get(linked or "")
        while source is not None and source.kind == "h":
            source = seen.get(source.target)
        if linked is None or source is None or source.kind != "f" or not linked.startswith("env/"):
            raise _refuse(f"archive hard link {shown!r} -> {info.linkname[:200]!r} is not to a file of the archive")
        target = linked
    return Member.of(info, name, target)


class _HashingReader(io.RawIOBase):
    """The archive's bytes as the decompressor reads them, hashed on the way."""

    def __init__(self, handle, digest) -> None:
        self.handle = handle
        self.digest = digest

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = self.handle.readinto(buffer)
        if n:
            self.digest.update(memoryview(buffer)[:n])
        return n


def _open_stream(fd: int, digest) -> Iterator[tarfile.TarInfo]:
    """The members, read from the start; every byte of the file is hashed into `digest` (the rest after the last
    member too), so a pass can tell that it read the bytes that were vouched for."""
    os.lseek(fd, 0, os.SEEK_SET)
    raw = os.fdopen(os.dup(fd), "rb")
    source = _HashingReader(raw, digest)
    with raw, zstandard.ZstdDecompressor().stream_reader(source) as zst, tarfile.open(fileobj=zst, mode="r|") as tar:
        for info in tar:
            yield info, tar
        while source.read(COPY_CHUNK):
            pass


@dataclass
class _Scan:
    members: list[Member]
    metadata: dict[str, bytes]
    total_bytes: int


def _scan(fd: int, vouched: str) -> _Scan:
    """First pass: every member checked, and the record and manifest read (bounded). The bytes read must be the
    ones vouched for: what this pass reads decides what the restore keeps (the record, the
    manifest) and where it switches to (an archive already in the store), so an archive rewritten in place after
    it was hashed is refused here, as in the second pass."""
    seen: dict[str, Member] = {}
    members: list[Member] = []
    metadata: dict[str, bytes] = {}
    total = 0
    read = hashlib.sha256()
    for info, tar in _open_stream(fd, read):
        name = _relative_name(info.name)
        if not name:
            if not info.isdir():
                raise _refuse(f"archive member {TOP!r} is not a directory")
            continue
        member = _check_member(info, name, seen)
        if len(members) >= MAX_MEMBERS:
            raise _refuse(f"the archive has more than {MAX_MEMBERS} members")
        seen[name] = member
        members.append(member)
        total += member.size
        if name in MAX_METADATA:
            if member.size > MAX_METADATA[name]:
                raise _refuse(f"archive member {TOP}/{name} is {member.size} bytes, more than it can be")
            metadata[name] = tar.extractfile(info).read()
    if read.hexdigest() != vouched:
        raise IntegrityError("the archive changed while it was being restored; refusing it")
    for needed in (RECORD, MANIFEST, "env"):
        if needed not in seen:
            raise _refuse(f"the archive has no {TOP}/{needed}")
    return _Scan(members, metadata, total)


# ------------------------------------------------------------------------------------------------ extract


class _Extractor:
    """Creates members under `base` through directory descriptors opened with O_NOFOLLOW: no path it
    writes can resolve through a link, whatever else changes in the tree meanwhile."""

    FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

    def __init__(self, base: Path) -> None:
        self.base_fd = os.open(base, self.FLAGS)
        self.fds: dict[str, int] = {"": self.base_fd}

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

    def dir_fd(self, rel: str) -> int:
        if rel in self.fds:
            return self.fds[rel]
        if len(self.fds) > 256:
            for key in [k for k in self.fds if k][:128]:
                os.close(self.fds.pop(key))
        parent, leaf = posixpath.split(rel)
        fd = os.open(leaf, self.FLAGS, dir_fd=self.dir_fd(parent))
        self.fds[rel] = fd
        return fd

    def create(self, member: Member, data) -> None:
        parent, leaf = posixpath.split(member.name)
        pfd = self.dir_fd(parent)
        if member.kind == "d":
            os.mkdir(leaf, 0o700, dir_fd=pfd)
        elif member.kind == "l":
            os.symlink(member.target, leaf, dir_fd=pfd)
        elif member.kind == "h":
            src_parent, src_leaf = posixpath.split(member.target)
            os.link(src_leaf, leaf, src_dir_fd=self.dir_fd(src_parent), dst_dir_fd=pfd, follow_symlinks=False)
        else:
            fd = os.open(leaf, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=pfd)
            try:
                remaining = member.size
                while remaining > 0:
                    chunk = data.read(min(COPY_CHUNK, remaining))
                    if not chunk:
                        raise ArchiveRefusedError(
                            f"archive member {TOP}/{member.name} ends early; refusing the archive"
                        )
                    os.write(fd, chunk)
                    remaining -= len(chunk)
                os.fchmod(fd, member.mode)
                os.utime(fd, ns=(member.mtime * 10**9, member.mtime * 10**9))
            finally:
                os.close(fd)

    def finish_dirs(self, members: list[Member]) -> None:
        for member in sorted((m for m in members if m.kind == "d"), key=lambda m: -m.name.count("/")):
            os.fchmod(self.dir_fd(member.name), member.mode | 0o500)


def _extract(fd: int, scan: _Scan, building: Path, vouched: str) -> None:
    """Second pass: the members the first pass validated, written under `building`; the bytes read must be the
    ones vouched for (a file rewritten in place on a share since it was hashed is refused before anything of it
    runs)."""
    expected = iter(scan.members)
    extractor = _Extractor(building)
    read = hashlib.sha256()
    try:
        for info, tar in _open_stream(fd, read):
            name = _relative_name(info.name)
            if not name:
                continue
            want = next(expected, None)
            target = want.target if want is not None else ""
            if want is None or Member.of(info, name, target) != want:
                raise IntegrityError("the archive changed while it was being restored; refusing it")
            extractor.create(want, tar.extractfile(info) if want.kind == "f" else None)
        if next(expected, None) is not None or read.hexdigest() != vouched:
            raise IntegrityError("the archive changed while it was being restored; refusing it")
        extractor.finish_dirs(scan.members)
    finally:
        extractor.close()


# ------------------------------------------------------------------------------------------------ restore


def _open_archive(path: Path) -> int:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise UsageError(f"{path}: no such archive") from None
    except OSError as exc:
        raise UsageError(f"{path}: cannot open the archive ({exc.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode) or treecheck.kernels(fd):
        os.close(fd)
        raise UsageError(f"{path}: not a regular file (an archive is one; /proc and /sys files only look like one)")
    return fd


def _sha256_of(fd: int, path: Path) -> str:
    digest = hashlib.sha256()
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        while chunk := os.read(fd, 4 << 20):
            digest.update(chunk)
    except OSError as exc:
        raise UsageError(f"{path}: cannot read the archive ({exc.strerror})") from None
    return digest.hexdigest()


def _check_sidecar(path: Path, digest: str, vouched: bool, log) -> None:
    """The .sha256 beside the archive, when there is one, catches a copy damaged on its way (not a forgery). It
    is read without following a link, and what it holds is never shown (a link could name any file); what
    vouches for the archive (a matching --sha256, the store's ledger) outranks it."""
    sidecar = path.with_name(path.name + ".sha256")
    try:
        words = treecheck.read_bounded(sidecar, 4096, "a .sha256 file").decode("utf-8", errors="replace").split()
    except (OSError, ValueError):
        # None there: nothing to compare, and what vouches for the archive decides (unvouched, it is refused).
        # One there that cannot be read (a link, a folder) is odd enough to say.
        if os.path.lexists(sidecar):
            log(f"warning: {sidecar.name} beside the archive cannot be read; relying on what vouches for the archive")
        return
    if (words[0] if words else "") == digest:
        return
    if vouched:
        log(f"warning: {sidecar.name} does not hold the archive's sha256; what vouches for the archive does")
        return
    raise ArchiveRefusedError(f"{path}: sha256 {digest} is not the one in {sidecar.name}; refusing to restore")


# What a restored generation keeps of the archive's record (the rest - id, origin, verification - is its own).
RESTORED_KEYS = ("profile", "nearest_profile", "lock_digest", "closure_digest", "python", "cuda_home", "cuda_version",
                 "patches", "torch", "packages")  # fmt: skip


def _parse_metadata(scan: _Scan) -> tuple[dict, manifest.Manifest]:
    try:
        record = json.loads(scan.metadata[RECORD])
    except ValueError:
        raise _refuse(f"{TOP}/{RECORD} is not valid JSON") from None
    if not isinstance(record, dict):
        raise _refuse(f"{TOP}/{RECORD} is not a JSON object")
    try:  # what a restore keeps of it is typed like any record, or the archive is refused before a byte is written
        GenerationRecord.from_json({**{k: record[k] for k in RESTORED_KEYS if k in record}, "id": 0})
    except RecordError as exc:
        raise _refuse(f"{TOP}/{RECORD}: {exc}") from None
    try:
        doc = manifest.parse(scan.metadata[MANIFEST])
    except manifest.ManifestError as exc:
        raise _refuse(f"{TOP}/{MANIFEST}: {exc}") from None
    if doc.legacy:
        raise _refuse(f"{TOP}/{MANIFEST} is a format 1 manifest (bwstack 0.1): it does not cover the whole generation")
    listed = {e.path for e in doc.entries}
    present = {m.name for m in scan.members} | {"."}
    extra = sorted(present - listed - {MANIFEST})
    if extra:
        raise _refuse(f"{TOP}/{extra[0]} is in the archive but not in its manifest")
    return record, doc


def restore(store: Store, path: Path, *, sha256: str | None = None, switch: bool = True, log=print) -> dict:
    """Bring an archived generation back on this node as a new generation, verified byte for byte, once something
    vouches for it (`sha256`, or this store's ledger: `_vouch`)."""
    path = Path(path)
    started = time.perf_counter()
    fd = _open_archive(path)
    try:
        vouched = _sha256_of(fd, path)
        written = _written_here(store)
        _check_sidecar(path, vouched, sha256 == vouched or vouched in written[0], log)
        _vouch(store, path, vouched, sha256, written)
        try:
            scan = _scan(fd, vouched)
        except (tarfile.TarError, zstandard.ZstdError, EOFError, UnicodeError) as exc:
            raise ArchiveRefusedError(f"{path}: not a readable bwstack archive ({str(exc)[:200]})") from None
        record, doc = _parse_metadata(scan)
        digest = doc.content_digest()
        for gen in store.usable():
            try:
                same = not gen.manifest.legacy and gen.manifest.content_digest() == digest
            except IntegrityError:
                continue
            if same:
                result = {"generation": gen.name, "changed": False, "note": f"already in the store as {gen.name}"}
                active = store.active_or_none()
                if switch and (active is None or active.name != gen.name):
                    result.update({"changed": True, "switch": store.switch(gen, why=f"restore of {path.name}")})
                    result["note"] += "; switched to it"
                return result
        free = os.statvfs(store.layout.generations).f_bavail * os.statvfs(store.layout.generations).f_frsize
        if scan.total_bytes > free:
            raise BwstackError(
                f"not enough disk to restore {path}: {scan.total_bytes >> 20} MiB needed, {free >> 20} MiB free"
            )
        gen_id = store.next_id()
        building = store.begin(f"{gen_id:04d}-restore")
        try:
            try:
                _extract(fd, scan, building, vouched)
            except (tarfile.TarError, zstandard.ZstdError, EOFError) as exc:
                raise ArchiveRefusedError(f"{path}: not a readable bwstack archive ({str(exc)[:200]})") from None
            return _commit_restored(store, building, path, record, doc, gen_id, switch, started, log)
        except BaseException as exc:
            remove_tree(building)
            if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
                raise BwstackError(f"disk full while restoring {path}; nothing was switched") from None
            raise
    finally:
        os.close(fd)


def _commit_restored(
    store: Store, building: Path, path: Path, record: dict, doc: manifest.Manifest, gen_id: int,
    switch: bool, started: float, log,
) -> dict:  # fmt: skip
    uid, gid = os.geteuid(), os.getegid()
    # The store's owner owns what it restored, whatever the archive recorded.
    files = [
        manifest.Entry(e.path, e.kind, e.size, e.mode, e.sha256, e.ino, e.mtime_ns, uid, gid)
        for e in doc.entries
        if e.path not in (".", RECORD)
    ]
    problems = manifest.verify(building, files, "full", skip_top=(MANIFEST, RECORD))
    problems = [p for p in problems if p.path != "."]
    if problems:
        raise ArchiveRefusedError(f"{path}: restored files do not match the archived manifest: {problems[0]}")
    python_link = building / "env" / "bin" / "python"
    if python_link.is_symlink() and not python_link.exists():
        raise BwstackError(
            f"the archived env runs {os.readlink(python_link)}, which this node does not have: install Python "
            f"{str(record.get('python'))[:20]} there first"
        )
    checkpoint("restore-before-commit")
    name = generation_name(gen_id, _plain(record.get("profile")), doc.content_digest())
    kept = {key: record[key] for key in RESTORED_KEYS if key in record}
    kept.update(
        {
            "id": gen_id,
            "profile": _plain(record.get("profile")),
            "created": now_iso(),
            "origin": f"restored:{path} (was generation {str(record.get('id'))[:20]})",
        }
    )
    restored_record = GenerationRecord.from_json(kept).replace(verification=_verify_restored(building, name, record))
    final_building = building.with_name(f"{BUILDING_PREFIX}{name}")
    os.rename(building, final_building)
    # The archive's facts.json is what its maker says the env holds: a restored generation does not take it on
    # trust, so its verify reads its files (the facts are computed where a generation is built, not restored).
    restored_facts = final_building / FACTS
    if restored_facts.is_file() or restored_facts.is_symlink():
        mode = stat.S_IMODE(os.lstat(final_building).st_mode)
        make_writable_parent(restored_facts)
        restored_facts.unlink()
        os.chmod(final_building, mode)
    entries = manifest.build(final_building, skip_top=(MANIFEST, RECORD))
    meta = {k: v for k, v in doc.meta.items() if k != "generation"}
    gen = store.commit(final_building, restored_record, meta, entries)
    verification = restored_record.to_json()["verification"]
    if verification["status"] != "passed":
        failed = "; ".join(str(c.get("detail")) for c in verification["checks"] if not c["ok"])
        log(f"warning: restored {gen.name} did not pass its checks: {failed}")
    result = {
        "generation": gen.name,
        "changed": True,
        "verification": verification,
        "seconds": time.perf_counter() - started,
    }
    cuda = record.get("cuda_home")
    if isinstance(cuda, str) and not Path(cuda).is_dir():
        log(f"warning: the restored env was built against {cuda}, which is not on this node (install it)")
    if switch:
        result["switch"] = store.switch(gen, why=f"restore of {path.name}")
    return result


def _plain(value: object) -> str | None:
    return value if isinstance(value, str) and value.replace("-", "").replace("_", "").isalnum() else None


def _verify_restored(building: Path, name: str, record: dict) -> dict:
    """The restored generation's own checks, run here before it is sealed: its files against its manifest
    (done before this), its interpreter starting and torch reporting what the record says. Never copied
    from the archive."""
    checks: list[dict] = [{"check": "files match the archived manifest byte for byte", "ok": True}]
    torch = record.get("torch") if isinstance(record.get("torch"), dict) else {}
    label = "the env's Python starts and reports the recorded torch"
    try:
        facts = run_env_check(building / "env", building / "env", name, torch)
        checks.append({"check": label, "ok": True, "detail": facts})
    except BwstackError as exc:
        checks.append({"check": label, "ok": False, "detail": str(exc)})
    return {"status": "passed" if all(c["ok"] for c in checks) else "failed", "at": now_iso(), "checks": checks}
