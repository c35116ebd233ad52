"""Fetch a closure's wheels into a content-addressed store, each checked against the lock's sha256.

Sources, in order: the store itself, local wheelhouse directories (offline nodes, image builds), a mirror
for the wheel's index (`--index NAME=URL`, a PEP 503/691 simple index), then the URL the lock records;
`offline` stops before the mirror. A wheel whose bytes do not hash to the lock's value is refused with the
package and the file named and never enters the store. A wheel the lock has no hash for is fetched only when
the user names it in --allow-unhashed.

What a fetch reuses is checked where it enters: with `rehash_store` (`bwstack fetch`, `image build`) a store
entry is hashed again before it is used, and a damaged one is removed and fetched again; `export` hashes what
already lies in a destination directory before it keeps it. The node's own store (root-owned, written only
by bwstack) is not re-read on every build: uv checks every wheel's sha256 again when it installs it.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import secrets
import stat
import threading
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from bwstack.errors import BwstackError, HashMismatchError, UsageError
from bwstack.fsutil import free_bytes
from bwstack.lock import pypi
from bwstack.lock.model import LockedPackage, Wheel
from bwstack.probe import dirfd
from bwstack.probe.treecheck import sha256_file
from bwstack.provision.progress import DownloadProgress

if TYPE_CHECKING:
    import requests  # imported by pypi.session(), when the first download needs it

CHUNK = 1 << 20
DISK_MARGIN = 512 << 20


class DiskFullError(BwstackError):
    pass


@dataclass(frozen=True)
class LocalWheel:
    package: str
    version: str
    file: str
    path: Path
    sha256: str
    hash_verified: bool  # False: the lock had no hash; `sha256` is what we observed

    def as_dict(self) -> dict:
        return {
            "version": self.version,
            "wheel": self.file,
            "sha256": self.sha256,
            "hash_verified": self.hash_verified,
        }


@dataclass
class Sources:
    wheelhouses: list[Path] = field(default_factory=list)
    index_mirrors: dict[str, str] = field(default_factory=dict)
    offline: bool = False

    @classmethod
    def parse(cls, wheelhouses: Iterable[str] = (), mirrors: Iterable[str] = (), offline: bool = False) -> Sources:
        parsed = dict(parse_mirror(item) for item in mirrors)
        houses = []
        for item in wheelhouses:
            path = Path(item)
            if not path.is_dir():
                raise UsageError(f"--wheelhouse {item}: not a directory")
            houses.append(path)
        return cls(houses, parsed, offline)


def parse_mirror(item: str) -> tuple[str, str]:
    """One `--index` (or BWSTACK_INDEX line) NAME=URL: the lock's index NAME and the https:// or file:// mirror
    for it. The one rule, applied on the controller before a playbook runs and on the nodes."""
    name, sep, url = item.partition("=")
    if not sep or not name.strip() or not url.startswith(("https://", "file://")):
        raise UsageError(f"--index {item!r}: expected NAME=https://mirror/simple")
    return name, url


def _store_path(store: Path, sha256: str, file: str) -> Path:
    return store / sha256[:2] / sha256 / file


def _is_regular(path: Path) -> bool:
    """A regular file at path itself (no link, FIFO or device: hashing one of those could block or lie)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def hash_mismatch(pkg: LockedPackage, wheel: Wheel, origin: str, actual: str) -> HashMismatchError:
    return HashMismatchError(
        f"{pkg.name} {pkg.version}: {wheel.file} from {origin} has sha256 {actual}, the lock expects "
        f"{wheel.sha256}; refused (if upstream re-uploaded it, re-run `bwstack lock` from a network "
        f"that reaches it; otherwise the file is not the one the lock names)"
    )


def hash_local_wheel(pkg: LockedPackage, wheel: Wheel, path: Path, origin: str) -> tuple[str, os.stat_result]:
    """The sha256 of a local wheel file, which must be the lock's (when it has one), and the stat of what was read:
    one open, so whoever uses the file later can tell whether the name still leads to the bytes hashed here (a
    file rewritten while it was read is refused: its stat before and after differ)."""
    with _open_regular(pkg, wheel, path, origin) as source:
        before = os.fstat(source.fileno())
        digest = hashlib.sha256()
        while chunk := source.read(CHUNK):
            digest.update(chunk)
        st = os.fstat(source.fileno())
    if file_identity(st) != file_identity(before):
        raise BwstackError(f"{pkg.name} {pkg.version}: {path} from {origin} changed while it was hashed; refused")
    actual = digest.hexdigest()
    if wheel.sha256 is not None and actual != wheel.sha256:
        raise hash_mismatch(pkg, wheel, origin, actual)
    return actual, st


def file_identity(st: os.stat_result) -> tuple[int, int, int, int, int]:
    """What tells one file's state from another's: device, inode, size, modification and change times."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@contextlib.contextmanager
def _open_regular(pkg: LockedPackage, wheel: Wheel, path: Path, origin: str) -> Iterator[BinaryIO]:
    """The wheel file at path, open for reading (without blocking on a FIFO); anything but a regular file refused.
    A wheelhouse may link into a shared cache, so a link at the name is followed when the lock has the wheel's
    hash (only its bytes count); for a wheel without one it is not: the link could lead to any file of root's."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (os.O_NOFOLLOW if wheel.sha256 is None else 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise BwstackError(
                f"{pkg.name} {pkg.version}: {path} from {origin} is a link; the lock has no hash for this wheel, "
                "so only a regular file is read (put the wheel itself there)"
            ) from None
        why = exc.strerror
        raise BwstackError(f"{pkg.name} {pkg.version}: cannot read {wheel.file} from {origin}: {why}") from None
    with open(fd, "rb", buffering=0) as source:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise BwstackError(f"{pkg.name} {pkg.version}: {path} from {origin} is not a regular file")
        yield source  # type: ignore[misc]


class Fetcher:
    def __init__(
        self,
        store: Path,
        sources: Sources,
        allow_unhashed: Iterable[str] = (),
        http: requests.Session | None = None,
        log=print,
        *,
        rehash_store: bool = False,
        progress: DownloadProgress | None = None,
        inside: Path | None = None,
        elsewhere: Iterable[str] = (),
    ) -> None:
        self.store = Path(store)
        # `inside`: a folder the operator named that others may write (`fetch --dest`): the store's own folders
        # below it are opened without following a link. Otherwise the store path is the operator's own.
        self._base, self._parts = (Path(inside), self.store.relative_to(inside).parts) if inside else (self.store, ())
        self.sources = sources
        self.allow_unhashed = set(allow_unhashed)
        # The profile's other part (its CUDA toolkit for an env build, its env for a toolkit install): a provision
        # run hands one --allow-unhashed list to both, so a name of the other part is no error here.
        self.elsewhere = set(elsewhere)
        self._http = http
        self._http_made = threading.Lock()
        self.log = log
        self.rehash_store = rehash_store
        self.progress = progress or DownloadProgress()

    @property
    def http(self) -> requests.Session:
        """The HTTP session, made at the first download: a fetch from wheelhouses and the store needs none.
        Downloads run in threads: one lock, so they share one session (and its connection pool)."""
        with self._http_made:
            if self._http is None:
                self._http = pypi.session()
            return self._http

    def fetch_all(self, selection: Mapping[str, tuple[LockedPackage, Wheel]]) -> dict[str, LocalWheel]:
        unknown = self.allow_unhashed - set(selection) - self.elsewhere
        if unknown:
            raise UsageError(f"--allow-unhashed {', '.join(sorted(unknown))}: not in this closure")
        refused = [
            name for name, (_, wheel) in selection.items() if wheel.sha256 is None and name not in self.allow_unhashed
        ]
        if refused:
            raise BwstackError(
                "the lock has no sha256 for "
                + ", ".join(f"{n} {selection[n][0].version}" for n in sorted(refused))
                + "; refusing to install unverified wheels (pass --allow-unhashed "
                + " --allow-unhashed ".join(sorted(refused))
                + " to accept them knowingly)"
            )
        self.store.mkdir(parents=True, exist_ok=True)
        self.progress.files = len(selection)
        try:
            with ThreadPoolExecutor(max_workers=8) as pool:
                results = list(pool.map(lambda item: self._fetch_counted(*item[1]), sorted(selection.items())))
        finally:
            self.progress.close()
        return {w.package: w for w in results}

    def _fetch_counted(self, pkg: LockedPackage, wheel: Wheel) -> LocalWheel:
        got = self.fetch(pkg, wheel)
        self.progress.file_done()
        return got

    def fetch(self, pkg: LockedPackage, wheel: Wheel) -> LocalWheel:
        if wheel.sha256 is not None:
            cached = self._cached(pkg, wheel)
            if cached is not None:
                return LocalWheel(pkg.name, pkg.version, wheel.file, cached, wheel.sha256, True)
        for house in self.sources.wheelhouses:
            candidate = house / wheel.file
            if candidate.is_file():
                return self._admit_file(pkg, wheel, candidate, f"wheelhouse {house}")
        if self.sources.offline:
            raise BwstackError(
                f"{pkg.name} {pkg.version}: {wheel.file} is in no wheelhouse and the run is offline "
                f"(add it to a --wheelhouse directory)"
            )
        url = self._mirror_url(pkg, wheel) or wheel.url
        if url.startswith("file://"):
            return self._admit_file(pkg, wheel, Path(url[len("file://") :]), url)
        return self._admit(pkg, wheel, url, self._download(pkg, wheel, url))

    def _entry(self, sha256: str, *, make: bool) -> _Folder:
        """The store's folder for one hash, opened without following a link below the store's base."""
        return _Folder.of(self._base, (*self._parts, sha256[:2], sha256), make=make)

    def _cached(self, pkg: LockedPackage, wheel: Wheel) -> Path | None:
        """The store's copy of a hashed wheel, if it has one. With rehash_store it is read again through
        descriptors (no link followed) and hashed: something else there is removed, and fetched again."""
        assert wheel.sha256 is not None
        cached = _store_path(self.store, wheel.sha256, wheel.file)
        if not self.rehash_store:
            return cached if cached.is_file() else None
        try:
            entry = self._entry(wheel.sha256, make=False)
        except FileNotFoundError:
            return None
        with entry:
            try:
                actual = _hash_in(entry, wheel.file)
            except FileNotFoundError:
                return None
            except _NotRegular:
                if stat.S_ISDIR(os.stat(wheel.file, dir_fd=entry.fd, follow_symlinks=False).st_mode):
                    raise BwstackError(
                        f"{pkg.name} {pkg.version}: the store's {cached} is not a regular file; remove it by hand"
                    ) from None
                self._discard(pkg, entry, cached, "is not a regular file")
                return None
            if actual != wheel.sha256:
                self._discard(pkg, entry, cached, f"has sha256 {actual}, not the lock's {wheel.sha256}")
                return None
        return cached

    def _discard(self, pkg: LockedPackage, entry: _Folder, cached: Path, why: str) -> None:
        entry.remove(cached.name)
        self.log(f"WARNING: {pkg.name} {pkg.version}: the store's {cached} {why}: removed; fetching it again")

    def export(self, wheels: Mapping[str, LocalWheel], directory: Path, log=print) -> list[str]:
        """Put every fetched wheel at directory/<file> (a hard link into the store, else a copy); returns what was
        replaced. What already lies there is kept only if it is a regular file with the wheel's sha256: anything
        else (a damaged or swapped file, a link, a FIFO) is replaced with the verified wheel, and said so. The
        store's copy is read through descriptors and hashed again as it is placed: what is linked or copied is
        the inode whose bytes were just hashed."""
        replaced = []
        for wheel in sorted(wheels.values(), key=lambda w: w.file):
            out = directory / wheel.file
            if _is_regular(out):
                actual = sha256_file(out)
                if actual == wheel.sha256:
                    continue
                why = f"has sha256 {actual}, not {wheel.sha256}"
            elif os.path.lexists(out):
                if out.is_dir() and not out.is_symlink():
                    raise BwstackError(f"{out} is a directory where {wheel.package}'s wheel belongs: remove it")
                why = "is not a regular file"
            else:
                self._place(wheel, out)
                continue
            self._place(wheel, out)
            replaced.append(str(out))
            log(f"WARNING: {out} {why}: replaced with the verified wheel ({wheel.package} {wheel.version})")
        return replaced

    def _place(self, wheel: LocalWheel, out: Path) -> None:
        """The store's copy of `wheel` at out, atomically: its inode hard-linked where the filesystem allows,
        else its bytes copied, under a new name in out's folder renamed over out (a link planted at out or at a
        temporary name is replaced, never written through)."""
        with self._entry(wheel.sha256, make=False) as entry, entry.open_regular(wheel.file) as source:
            digest = hashlib.sha256()
            while chunk := source.read(CHUNK):
                digest.update(chunk)
            if digest.hexdigest() != wheel.sha256:
                raise BwstackError(f"the store's {wheel.path} changed while it was exported; run the fetch again")
            with _Folder.of(out.parent) as folder:
                name = f".{out.name}.{secrets.token_hex(8)}.tmp"
                try:  # the descriptor's own inode (linkat through /proc follows to it, not to any name)
                    os.link(f"/proc/self/fd/{source.fileno()}", name, dst_dir_fd=folder.fd, follow_symlinks=True)
                except OSError:
                    source.seek(0)
                    chunks = iter(lambda: source.read(CHUNK), b"")
                    name, actual = folder.write_new(f".{out.name}", chunks, where=str(out), mode=0o644)
                    if actual != wheel.sha256:
                        folder.remove(name)
                        raise BwstackError(
                            f"the store's {wheel.path} changed while it was exported; run the fetch again"
                        ) from None
                folder.move(name, folder, out.name)

    def _mirror_url(self, pkg: LockedPackage, wheel: Wheel) -> str | None:
        mirror = self.sources.index_mirrors.get(pkg.index)
        if not mirror:
            return None
        if mirror.startswith("file://"):
            base = Path(mirror[len("file://") :])
            for candidate in (base / pkg.name / wheel.file, base / wheel.file):
                if candidate.is_file():
                    return f"file://{candidate}"
            raise BwstackError(f"{pkg.name}: {wheel.file} not found in mirror {mirror}")
        for f in pypi.project_files(self.http, mirror, pkg.name):
            if f.filename == wheel.file:
                return f.url
        raise BwstackError(f"{pkg.name}: mirror {mirror} does not list {wheel.file}")

    def _download(self, pkg: LockedPackage, wheel: Wheel, url: str) -> Iterator[bytes]:
        """The wheel's bytes from url, as they arrive (progress counted, free disk checked first)."""
        import requests

        try:
            with self.http.get(url, stream=True, timeout=pypi.TIMEOUT) as response:
                if not response.ok:
                    raise BwstackError(f"{pkg.name} {pkg.version}: HTTP {response.status_code} for {url}")
                length = int(response.headers.get("Content-Length") or 0)
                if length and free_bytes(self.store) < length + DISK_MARGIN:
                    raise DiskFullError(
                        f"not enough disk for {wheel.file} ({length >> 20} MiB) in {self.store}: "
                        f"{free_bytes(self.store) >> 20} MiB free; free space or pass --root on a larger disk"
                    )
                self.progress.started_download(length)
                for chunk in response.iter_content(CHUNK):
                    self.progress.add(len(chunk))
                    yield chunk
        except requests.RequestException as exc:
            raise BwstackError(f"{pkg.name} {pkg.version}: cannot download {url}: {pypi._reason(exc)}") from None

    def _admit_file(self, pkg: LockedPackage, wheel: Wheel, path: Path, origin: str) -> LocalWheel:
        """A local wheel (a wheelhouse, a file:// URL): its bytes read through one open, the same bytes hashed and
        copied, so a name swapped after the check cannot put other bytes in the store."""
        with _open_regular(pkg, wheel, path, origin) as source:
            return self._admit(pkg, wheel, origin, iter(lambda: source.read(CHUNK), b""))

    def _admit(self, pkg: LockedPackage, wheel: Wheel, origin: str, chunks: Iterable[bytes]) -> LocalWheel:
        """Into the store: the bytes written to a new file (made here, in the store's own folders opened without
        following links) and hashed as they are written; kept only when the hash is the lock's. The file is made
        read-only through its descriptor before it is renamed into place, so nothing is ever done by name to a
        path someone else could have swapped."""
        with _Folder.of(self._base, (*self._parts, *PARTIAL)) as partial:
            name, actual = partial.write_new(f".{wheel.file}", chunks, where=f"{wheel.file} into {self.store}")
            if wheel.sha256 is not None and actual != wheel.sha256:
                partial.remove(name)
                raise hash_mismatch(pkg, wheel, origin, actual)
            if wheel.sha256 is None:
                self.log(
                    f"WARNING: {pkg.name} {pkg.version}: installing {wheel.file} with no hash in the lock "
                    f"(--allow-unhashed); its sha256 here is {actual}, recorded as unverified"
                )
            with self._entry(actual, make=True) as final:
                partial.move(name, final, wheel.file)
        path = _store_path(self.store, actual, wheel.file)
        return LocalWheel(pkg.name, pkg.version, wheel.file, path, actual, wheel.sha256 is not None)


def _open_folder(name: str | Path, dir_fd: int | None, where: Path, make: int | None = None) -> int:
    try:
        return dirfd.open_folder(name, dir_fd, make=make)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UsageError(
                f"{where} is a link or not a folder: bwstack does not follow links in a wheel store or destination "
                "it writes; remove it"
            ) from None
        raise


class _NotRegular(OSError):
    """A link, FIFO, device or folder where a store file belongs."""


def _hash_in(folder: _Folder, name: str) -> str:
    with folder.open_regular(name) as source:
        digest = hashlib.sha256()
        while chunk := source.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


PARTIAL = (".partial",)  # where the store's new files are written before they are renamed into place


class _Folder:
    """A folder of a wheel store or a destination, held by its descriptor: every file is made, moved and removed
    relative to it, and the folders below the base are made and opened without following a link (a store or
    DEST that others can write may hold links planted where bwstack's files go)."""

    def __init__(self, fd: int, path: Path) -> None:
        self.fd, self.path = fd, path

    @classmethod
    def of(cls, base: Path, parts: Iterable[str] = (), *, make: bool = True) -> _Folder:
        """base (the path the operator named: a link there is theirs, and followed) and the folders `parts` below
        it, each made when missing (make) and opened without following a link. FileNotFoundError when a part is
        missing and make is False."""
        where = Path(base)
        if make:
            os.makedirs(where, exist_ok=True)
        fd = os.open(where, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        for part in parts:
            where = where / part
            try:
                sub = _open_folder(part, fd, where, make=0o755 if make else None)
            finally:
                os.close(fd)
            fd = sub
        return cls(fd, where)

    def open_regular(self, name: str) -> BinaryIO:
        """name here, opened for reading only if it is a regular file itself (no link, FIFO or device)."""
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=self.fd)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise _NotRegular(name)
        return open(fd, "rb", buffering=0)  # type: ignore[return-value]

    def __enter__(self) -> _Folder:
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)

    def write_new(self, prefix: str, chunks: Iterable[bytes], *, where: str, mode: int = 0o444) -> tuple[str, str]:
        """A new file here holding chunks (dirfd.write_new): its name and sha256."""
        try:
            return dirfd.write_new(self.fd, prefix, chunks, mode=mode)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise DiskFullError(f"disk full while writing {where}") from None
            raise

    def move(self, name: str, into: _Folder, final: str) -> None:
        """name (here) renamed to final in `into` (dirfd.move): a planted link there is replaced, never followed."""
        try:
            dirfd.move(self.fd, name, final, into.fd)
        except IsADirectoryError:
            raise UsageError(f"{into.path / final} is a folder where a wheel belongs: remove it") from None

    def remove(self, name: str) -> None:
        dirfd.remove(self.fd, name)


def direct_requirements(wheels: Mapping[str, LocalWheel]) -> str:
    """uv's requirements for exactly `wheels`: each a direct reference to its file in the content-addressed store,
    with its hash. One form for every install from the store (the CUDA toolkit's and the env's): uv keys the wheels
    it unpacks into its cache by their location, so a wheel both take (the toolkit's cuBLAS, NVRTC, cuRAND, which
    torch also needs) is unpacked once and the second install links the same files."""
    return "".join(
        f"{w.package} @ {w.path.absolute().as_uri()} --hash=sha256:{w.sha256}\n"
        for w in sorted(wheels.values(), key=lambda w: w.package)
    )
