"""Backups: adopt a hand-made env as generation 0, snapshot the active env, archive and restore off-node.

Nothing here copies gigabytes on the node. Adoption moves the directory into the store with one atomic
exchange (the ml-env path is a working env before and after, never missing). A generation that has not
changed since it was sealed already is its own backup; one that drifted (someone pip-installed into it) is
captured as a new generation of hard links plus a fresh manifest. Archives stream tar + zstd with a
sha256 beside them and restore into a new generation that must verify against its manifest.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import shutil
import stat
import tarfile
import time
from pathlib import Path

import zstandard

from bwstack import envinspect, manifest
from bwstack.errors import BwstackError, IntegrityError, UsageError
from bwstack.fsutil import atomic_symlink, fsync_dir
from bwstack.generations import (
    MANIFEST,
    RECORD,
    Generation,
    Store,
    checkpoint,
    exchange,
    generation_name,
    now_iso,
    remove_tree,
    seal,
    write_hook,
)
from bwstack.lockfile import Lock

ARCHIVE_TOP = "generation"


# ------------------------------------------------------------------------------------------------ adopt


def detect_profile(lock: Lock, env: Path) -> tuple[str | None, str | None, dict]:
    """(exact profile, nearest profile, facts) for a hand-made env, from its installed distributions."""
    have = {name: dist.version for name, dist in envinspect.installed(env).items()}
    exact = None
    nearest = None
    best = None
    for profile in lock.profiles.values():
        if profile.closure is None:
            continue
        want = {name: pkg.version for name, pkg in profile.closure.env.items()}
        diff = sum(have.get(n) != v for n, v in want.items()) + len(set(have) - set(want))
        if diff == 0:
            exact = profile.name
        torch = have.get("torch", "")
        same_torch = torch == want.get("torch")
        score = (not same_torch, diff)
        if best is None or score < best:
            best, nearest = score, profile.name
    facts = {k: have[k] for k in ("torch", "sglang", "sgl-kernel", "flashinfer-python") if k in have}
    return exact, nearest, facts


def _cuda_home_guess(profile_home: str | None) -> str | None:
    for candidate in (
        os.environ.get("CUDA_HOME"),
        profile_home,
        shutil.which("nvcc") and str(Path(shutil.which("nvcc")).resolve().parents[1]),
    ):
        if candidate and Path(candidate, "bin").is_dir():
            return str(Path(candidate).resolve())
    return profile_home


def _torch_record(env: Path) -> dict:
    facts = envinspect.import_torch(env)
    return {} if "error" in facts else facts


def adopt(store: Store, lock: Lock, log=print) -> Generation:
    """Turn the real directory at the ml-env path into generation 0 of the store, in place."""
    layout = store.layout
    src = layout.ml_env
    if src.is_symlink() or not src.is_dir():
        raise UsageError(f"{src} is not a real env directory (already adopted, or nothing there)")
    if not (src / "pyvenv.cfg").is_file():
        raise UsageError(f"{src} has no pyvenv.cfg: bwstack adopts virtual environments only")
    store.prepare()
    if os.stat(src).st_dev != os.stat(layout.generations).st_dev:
        raise BwstackError(
            f"{src} and the store {layout.root} are on different filesystems; adoption moves the env without "
            f"copying it, so pass --root on the filesystem of {src}"
        )
    exact, nearest, facts = detect_profile(lock, src)
    log(f"adopting {src} ({', '.join(f'{k} {v}' for k, v in facts.items()) or 'no known packages'}) ...")
    installed = envinspect.installed(src)
    digest = hashlib.sha256(json.dumps(sorted((n, d.version) for n, d in installed.items())).encode()).hexdigest()
    gen_id = store.next_id()
    name = generation_name(gen_id, None, digest)
    write_hook(src, name)  # the generation hook: pins processes to it and sets CUDA_HOME (two small files)
    seal(src)
    entries = manifest.build(src)
    building = store.begin(name)
    profile_home = lock.profiles[nearest].cuda.home if nearest else None
    cuda_home = _cuda_home_guess(profile_home)
    if cuda_home:
        os.symlink(cuda_home, building / "cuda")
    record = {
        "id": gen_id,
        "profile": exact,
        "nearest_profile": nearest,
        "created": now_iso(),
        "origin": f"adopted:{src}",
        "lock_digest": lock.profiles[exact].lock_digest() if exact else None,
        "python": envinspect.env_python_version(src),
        "cuda_home": cuda_home,
        "patches": [],
        "packages": {n: {"version": d.version} for n, d in envinspect.installed(src).items()},
        "torch": _torch_record(src) if facts.get("torch") else {},
        "verification": {"status": "not-run", "at": now_iso(), "why": "adopted as found"},
        "size_bytes": manifest.total_size(entries),
        "files": len(entries),
    }
    doc = {"format": 1, "generation": name, "packages": record["packages"], "python": record["python"],
           "cuda_home": cuda_home, "lock_digest": record["lock_digest"], "created": record["created"],
           "files": [e.as_row() for e in entries]}  # fmt: skip
    (building / MANIFEST).write_text(json.dumps(doc, separators=(",", ":")))
    (building / RECORD).write_text(json.dumps(record, indent=2))
    os.symlink(str(layout.current / "env"), building / "env")  # placeholder, swapped with the real dir below
    final = layout.generations / name
    os.rename(building, final)
    fsync_dir(layout.generations)
    checkpoint("adopt-before-current")
    atomic_symlink(Path("generations") / name, layout.current)
    checkpoint("adopt-before-exchange")
    _swap_in(src, final / "env", log)
    store.ensure_links()
    gen = Generation(final, record)
    log(f"adopted {src} as generation {name} ({record['size_bytes'] >> 20} MiB, nothing copied)")
    return gen


def _swap_in(real_dir: Path, placeholder: Path, log) -> None:
    try:
        exchange(real_dir, placeholder)
    except OSError as exc:
        if exc.errno not in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
            raise
        # No RENAME_EXCHANGE on this filesystem: two renames, with a moment where the path is missing.
        log(f"warning: {real_dir.parent} does not support atomic exchange; moving in two steps")
        link_target = os.readlink(placeholder)
        placeholder.unlink()
        os.rename(real_dir, placeholder)
        atomic_symlink(link_target, real_dir)


def finish_interrupted_adoption(store: Store, log=print) -> None:
    """A kill between committing an adopted generation and swapping the directory in: finish the swap."""
    layout = store.layout
    for gen in store.generations():
        if gen.env.is_symlink() and str(gen.record.get("origin", "")).startswith("adopted:"):
            src = Path(gen.record["origin"].split(":", 1)[1])
            if src.is_dir() and not src.is_symlink():
                log(f"finishing the interrupted adoption of {src} as {gen.name}")
                atomic_symlink(Path("generations") / gen.name, layout.current)
                _swap_in(src, gen.env, log)
            else:
                log(f"removing {gen.name}: its adoption never completed")
                remove_tree(gen.path)


# ------------------------------------------------------------------------------------------------ snapshot


def _link_tree(src: Path, dest: Path) -> None:
    """cp -al: directories recreated, files hard-linked, symlinks copied; bytecode caches skipped."""
    os.mkdir(dest, 0o755)
    src_s, dest_s = str(src), str(dest)
    for rel, st in manifest.walk(src):
        source, target = os.path.join(src_s, rel), os.path.join(dest_s, rel)
        if stat.S_ISDIR(st.st_mode):
            os.mkdir(target, stat.S_IMODE(st.st_mode) | 0o700)
        elif stat.S_ISLNK(st.st_mode):
            os.symlink(os.readlink(source), target)
        else:
            os.link(source, target)


def backup(store: Store, lock: Lock, *, depth: str = "quick", log=print) -> dict:
    """Make sure the active env is captured as a verified, immutable generation; return what was done."""
    layout = store.layout
    started = time.perf_counter()
    if layout.ml_env.is_dir() and not layout.ml_env.is_symlink():
        gen = adopt(store, lock, log)
        return {"action": "adopted", "generation": gen.name, "seconds": time.perf_counter() - started}
    active = store.active()
    if active is None:
        return {"action": "nothing", "generation": None, "seconds": 0.0, "note": "no active env to back up"}
    problems = active.verify(depth)
    if not problems:
        return {
            "action": "verified",
            "generation": active.name,
            "seconds": time.perf_counter() - started,
            "note": "the active generation is unchanged since it was sealed; it is its own backup",
        }
    log(f"{active.name} changed since it was sealed ({len(problems)} paths, e.g. {problems[0]}); snapshotting")
    gen_id = store.next_id()
    source_entries = {e.path: e for e in active.manifest_entries()}
    building = store.begin(f"{gen_id:04d}-snapshot")
    _link_tree(active.env, building / "env")
    if active.cuda.is_symlink():
        os.symlink(os.readlink(active.cuda), building / "cuda")
    seal(building / "env")
    dev = os.stat(building / "env").st_dev
    entries = manifest.build(building / "env", manifest.known_hashes(list(source_entries.values()), dev))
    digest = hashlib.sha256(json.dumps([e.as_row()[:5] for e in entries]).encode()).hexdigest()
    name = generation_name(gen_id, active.profile, digest)
    record = {
        **active.record,
        "id": gen_id,
        "created": now_iso(),
        "origin": f"snapshot-of:{active.name}",
        "packages": {n: {"version": d.version} for n, d in envinspect.installed(building / "env").items()},
        "verification": {
            "status": "not-run",
            "at": now_iso(),
            "why": f"snapshot of a modified {active.name}",
        },
        "drift": [str(p) for p in problems[:50]],
        "size_bytes": manifest.total_size(entries),
        "files": len(entries),
    }
    doc = {**active.manifest_doc(), "generation": name, "created": record["created"],
           "packages": record["packages"], "files": [e.as_row() for e in entries]}  # fmt: skip
    (building / MANIFEST).write_text(json.dumps(doc, separators=(",", ":")))
    (building / RECORD).write_text(json.dumps(record, indent=2))
    final = layout.generations / name
    os.rename(building, final)
    fsync_dir(layout.generations)
    gen = Generation(final, record)
    # just hashed from these very files: no second manifest pass before the switch
    store.switch(gen, depth="none", why=f"snapshot of modified {active.name}", post_check=False)
    return {
        "action": "snapshot",
        "generation": gen.name,
        "from": active.name,
        "seconds": time.perf_counter() - started,
    }


# ------------------------------------------------------------------------------------------------ archive


class _HashingWriter(io.RawIOBase):
    def __init__(self, handle) -> None:
        self.handle = handle
        self.digest = hashlib.sha256()

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.digest.update(data)
        return self.handle.write(data)


def write_archive(gen: Generation, path: Path, level: int = 3) -> dict:
    """Stream the generation as tar + zstd to `path`, with `path`.sha256 beside it. All or nothing."""
    path = Path(path).absolute()
    partial = path.with_name(path.name + ".partial")
    started = time.perf_counter()
    try:
        with open(partial, "wb") as raw:
            hashing = _HashingWriter(raw)
            compressor = zstandard.ZstdCompressor(level=level, threads=-1)
            with (
                compressor.stream_writer(hashing, closefd=False) as zst,
                tarfile.open(fileobj=zst, mode="w|") as tar,
            ):
                for rel in (RECORD, MANIFEST):
                    tar.add(gen.path / rel, arcname=f"{ARCHIVE_TOP}/{rel}")
                if gen.cuda.is_symlink():
                    tar.add(gen.cuda, arcname=f"{ARCHIVE_TOP}/cuda")
                tar.add(gen.env, arcname=f"{ARCHIVE_TOP}/env", recursive=False)
                for rel, _ in manifest.walk(gen.env):
                    tar.add(gen.env / rel, arcname=f"{ARCHIVE_TOP}/env/{rel}", recursive=False)
                checkpoint("archive-before-close")
            raw.flush()
            os.fsync(raw.fileno())
        sha = hashing.digest.hexdigest()
        sidecar = path.with_name(path.name + ".sha256")
        sidecar.write_text(f"{sha}  {path.name}\n")
        os.replace(partial, path)
    except OSError as exc:
        partial.unlink(missing_ok=True)
        if exc.errno == errno.ENOSPC:
            raise BwstackError(
                f"disk full while writing {path}; removed the partial archive, nothing else changed"
            ) from None
        raise BwstackError(f"cannot write {path}: {exc.strerror}") from None
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return {
        "archive": str(path),
        "sha256": sha,
        "bytes": path.stat().st_size,
        "seconds": time.perf_counter() - started,
    }


def _safe_member(member: tarfile.TarInfo) -> None:
    name = member.name
    if (
        name.startswith("/")
        or ".." in Path(name).parts
        or not (name == ARCHIVE_TOP or name.startswith(ARCHIVE_TOP + "/"))
    ):
        raise IntegrityError(f"archive member {name!r} would land outside the generation; refusing the archive")
    if not (member.isfile() or member.isdir() or member.issym() or member.islnk()):
        raise IntegrityError(f"archive member {name!r} is a device or fifo; refusing the archive")
    if member.islnk() and (member.linkname.startswith("/") or ".." in Path(member.linkname).parts):
        raise IntegrityError(f"archive hard link {name!r} points outside the generation; refusing the archive")


def restore(store: Store, path: Path, *, switch: bool = True, log=print) -> dict:
    """Bring an archived generation back on this node as a new generation, verified byte for byte."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{path}: no such archive")
    started = time.perf_counter()
    sidecar = path.with_name(path.name + ".sha256")
    if sidecar.is_file():
        want = sidecar.read_text().split()[0]
        got = manifest.hash_file(path)
        if got != want:
            raise IntegrityError(f"{path}: sha256 {got} does not match {sidecar.name} ({want}); refusing to restore")
    else:
        log(f"warning: no {sidecar.name} beside the archive; relying on the manifest inside it")
    store.prepare()
    gen_id = store.next_id()
    building = store.begin(f"{gen_id:04d}-restore")
    try:
        with (
            open(path, "rb") as raw,
            zstandard.ZstdDecompressor().stream_reader(raw) as zst,
            tarfile.open(fileobj=zst, mode="r|") as tar,
        ):
            for member in tar:
                _safe_member(member)
                member.name = member.name[len(ARCHIVE_TOP) :].lstrip("/") or "."
                if member.islnk():
                    member.linkname = member.linkname[len(ARCHIVE_TOP) :].lstrip("/")
                tar.extract(member, building, set_attrs=True)
    except (tarfile.TarError, zstandard.ZstdError, EOFError) as exc:
        remove_tree(building)
        raise IntegrityError(f"{path}: not a readable bwstack archive ({exc})") from None
    except OSError as exc:
        remove_tree(building)
        if exc.errno == errno.ENOSPC:
            raise BwstackError(f"disk full while restoring {path}; nothing was switched") from None
        raise
    record = json.loads((building / RECORD).read_text())
    doc = json.loads((building / MANIFEST).read_text())
    entries = [manifest.Entry.from_row(r) for r in doc["files"]]
    problems = manifest.verify(building / "env", entries, "full")
    if problems:
        remove_tree(building)
        raise IntegrityError(f"{path}: restored files do not match the archived manifest: {problems[0]}")
    python_link = building / "env" / "bin" / "python"
    if python_link.is_symlink() and not python_link.exists():
        remove_tree(building)
        raise BwstackError(
            f"the archived env runs {os.readlink(python_link)}, which this node does not have: install Python "
            f"{record.get('python')} there first"
        )
    seal(building / "env")
    entries = manifest.refingerprint(building / "env", entries)  # new inodes, same verified content
    doc["files"] = [e.as_row() for e in entries]
    original = record.get("id")
    name = generation_name(gen_id, record.get("profile"), doc.get("generation", "")[-12:] or "restored")
    record.update({"id": gen_id, "origin": f"restored:{path} (was generation {original})", "restored": now_iso()})
    doc["generation"] = name
    (building / MANIFEST).write_text(json.dumps(doc, separators=(",", ":")))
    (building / RECORD).write_text(json.dumps(record, indent=2))
    final = store.layout.generations / name
    os.rename(building, final)
    fsync_dir(store.layout.generations)
    gen = Generation(final, record)
    cuda = record.get("cuda_home")
    if cuda and not Path(cuda).is_dir():
        log(f"warning: the restored env was built against {cuda}, which is not on this node (install it)")
    result = {"generation": gen.name, "seconds": time.perf_counter() - started}
    if switch:
        result["switch"] = store.switch(gen, why=f"restore of {path.name}")
    return result
