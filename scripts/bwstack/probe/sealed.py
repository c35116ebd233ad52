"""Facts of a sealed generation, computed once and reused while the generation and the host are unchanged.

A generation's files do not change after it is sealed: its manifest (format 2) lists every path with kind,
mode, owner, size, inode and mtime. The expensive facts the checks need (installed distributions, the ELF scan,
fatbins, SM120 features) are read from those files, so `bwstack build` computes them once into `facts.json` in
the generation directory, before the manifest is written (the manifest covers it). `bwstack verify` reuses
them after a quick check: every path still matches its manifest row (kind, mode, owner, size, inode, mtime;
nothing added, nothing missing). When that stamp moved, the bytes decide: each path is compared with its
manifest row and the files whose inode or mtime moved are hashed (probe.treecheck); the same bytes (and mode,
owner, links) are the sealed generation (a `touch`, a repair's new inodes), and that answer is remembered for
the new stamp, unless the stamp could not be taken at all. Any real difference, or a host whose loader view
changed (the ld.so cache, the system library directories, the interpreter), makes the probe read the files
again ("cold").

The import checks also depend on the host (its libraries, the driver): their results are kept in the store's
cache, keyed by the generation, its manifest and the same host fingerprint plus the GPU and driver, and reused
only while all of those match.

A repaired generation keeps its facts.json, but its files have new inodes and mtimes: its first verify
compares the tree with its manifest (hashing what moved since the manifest's fingerprints), later ones are quick
again. A restored generation does not keep the archive's facts.json (what the archive's maker says the env
holds): its verify reads its files.

Standard library only: this module runs on target hosts inside the verify probe.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import stat
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from bwstack.probe import treecheck

FACTS_NAME = "facts.json"
FACTS_FORMAT = 1
MANIFEST_NAME = "manifest.json"
RECORD_NAME = "record.json"
# The facts read from the generation's own files (capability-dependent ones are keyed by capability).
STATIC_KEYS = ("installed", "torch_version_py", "elf", "fatbin", "features")
MAX_FACTS_BYTES = 64 << 20
UNREADABLE = "unreadable"  # the digest of a tree stamp that could not be taken


def generation_of(env: Path) -> Path | None:
    """The generation directory an env lives in (<root>/generations/<gen>/env), or None."""
    real = Path(env).resolve()
    gen = real.parent
    if real.name == "env" and (gen / MANIFEST_NAME).is_file() and gen.parent.name == "generations":
        return gen
    return None


def stat_key(path: str) -> list:
    try:
        st = os.stat(path)
    except OSError:
        return [path, None]
    return [path, st.st_ino, st.st_size, st.st_mtime_ns, stat.S_IMODE(st.st_mode)]


@functools.cache
def host_fingerprint(env: Path) -> str:
    """What the ELF resolution and the imports see outside the generation: the loader's cache and
    configuration, the system library directories (a package installed or removed changes them), the base
    interpreter, LD_LIBRARY_PATH and the libraries preloaded into every process. (The files the imports loaded
    are checked one by one before their outcome is reused: loaded_changed.)"""
    from bwstack.probe import elfscan

    parts: list = [stat_key("/etc/ld.so.cache"), stat_key("/etc/ld.so.conf")]
    parts += [stat_key(d) for d in elfscan.system_library_dirs()]
    library_path = os.environ.get("LD_LIBRARY_PATH", "")
    parts += [["LD_LIBRARY_PATH", library_path]] + [stat_key(d) for d in library_path.split(":") if d]
    parts.append(stat_key(str((Path(env) / "bin" / "python").resolve())))
    # Libraries loaded into every process: named only where there are any, so the fingerprint of a host without
    # them is what it was before they were part of it (the facts sealed then still match).
    preload = os.environ.get("LD_PRELOAD", "")
    if preload:
        parts.append(["LD_PRELOAD", preload])
    if os.path.lexists("/etc/ld.so.preload"):
        parts.append(stat_key("/etc/ld.so.preload"))
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def tree_stamp(
    env: Path, method: str | None = None, max_paths: int | None = None, follow_links: bool = False
) -> tuple[str, str]:
    """(method, digest) of every path under `env` with its kind, inode, size, mtime, mode and owner: what the
    manifest's quick check compares, as one digest. GNU find lists it at C speed (0.4 s for 92,000 paths);
    without it, the same in Python. The method is recorded with the digest: both sides use the same one.
    `max_paths`: a tree with more paths than that gets the UNREADABLE digest, its walk stopped there (a stamp
    is only worth taking where it is cheaper than what it saves). `follow_links`: what links lead to is
    stamped instead of the links (find -L, which refuses a loop; never for a generation, whose links are
    its own files), with each path's inode change time; without find that stamp is UNREADABLE. A tree that
    changes under the walk is UNREADABLE."""
    stamp = _walk_stamp(env, method, max_paths, follow_links)
    return stamp.method, stamp.digest


@dataclass(frozen=True)
class Stamp:
    method: str
    digest: str
    newest_change: int  # the newest inode change time (ns) of the paths walked (0: not known)
    listing: treecheck.Listing | None = None  # what the walk printed, when kept (find only)


def generation_stamp(env: Path, method: str | None = None, keep: bool = False) -> Stamp:
    """tree_stamp() of a generation's env, with the newest inode change time among its paths. The ctime is not in
    the digest (a later build's hard links to the same files move it, which a stamp recorded at build time must
    survive); it says whether any file changed after the generation's bytes were last compared
    (hashed_before). `keep`: the walk's listing is kept with it (when find made it), for a comparison with the
    manifest without walking again."""
    return _walk_stamp(env, method, None, False, newest=True, keep=keep)


def _walk_stamp(
    env: Path, method: str | None, max_paths: int | None, follow_links: bool, newest: bool = False, keep: bool = False
) -> Stamp:
    find = shutil.which("find") if method in (None, "find") else None
    if follow_links and find is None:
        return Stamp("python", UNREADABLE, 0)
    if find is not None:
        digest = hashlib.sha256()
        fmt = treecheck.FIND_RECORD
        if follow_links:  # a stamp only compared with itself: the inode change time too
            fmt = "%y %i %s %T@ %C@ %m %U %G %P\\0"
        cmd = [find, *(["-L"] if follow_links else []), str(env), "-printf", fmt]
        listed, latest = 0, 0
        kept: list[bytes] | None = [] if keep and newest and not follow_links else None
        # The change times, kept out of the digest, go to a second output of the same walk (an in-memory file), and
        # for a kept listing each path's device and link target to a third.
        ctimes = os.memfd_create("bwstack-ctimes", os.MFD_CLOEXEC) if newest else None
        extras = os.memfd_create("bwstack-extras", os.MFD_CLOEXEC) if kept is not None else None
        outputs = tuple(fd for fd in (ctimes, extras) if fd is not None)
        try:
            if ctimes is not None:
                cmd += ["-fprintf", f"/dev/fd/{ctimes}", treecheck.FIND_CHANGE]
            if extras is not None:
                cmd += ["-fprintf", f"/dev/fd/{extras}", treecheck.FIND_EXTRA]
            with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, pass_fds=outputs) as proc:
                assert proc.stdout is not None
                while chunk := proc.stdout.read(1 << 20):
                    digest.update(chunk)
                    if kept is not None:
                        kept.append(chunk)
                    listed += chunk.count(b"\0")
                    if max_paths is not None and listed > max_paths:
                        proc.kill()
                        return Stamp("find", UNREADABLE, 0)
            changes = b""
            if ctimes is not None:
                changes = os.pread(ctimes, os.fstat(ctimes).st_size, 0)
                # Seconds with ten decimals each: with as many digits before the point, the larger text is later.
                times = changes.split()
                latest = treecheck.find_time_ns(max(times, key=lambda t: (t.find(b"."), t))) if times else 0
            listing = None
            if kept is not None and extras is not None:
                listing = treecheck.Listing(b"".join(kept), changes, os.pread(extras, os.fstat(extras).st_size, 0))
        finally:
            for fd in outputs:
                os.close(fd)
        if proc.returncode == 0:
            return Stamp("find", digest.hexdigest(), latest, listing)
        if method == "find" or follow_links:
            return Stamp("find", UNREADABLE, 0)
    digest = hashlib.sha256()
    latest = 0
    try:
        for listed, (rel, st) in enumerate(treecheck.walk(env), start=1):
            if max_paths is not None and listed > max_paths:
                return Stamp("python", UNREADABLE, 0)
            rel = "" if rel == "." else rel  # the root as these digests have always named it
            kind = "l" if stat.S_ISLNK(st.st_mode) else "d" if stat.S_ISDIR(st.st_mode) else "f"
            latest = max(latest, st.st_ctime_ns)
            digest.update(
                f"{kind} {st.st_ino} {st.st_size} {st.st_mtime_ns} {stat.S_IMODE(st.st_mode):o} {st.st_uid} "
                f"{st.st_gid} {rel}\0".encode(errors="surrogateescape")
            )
    except OSError:  # a path that went away under the walk, a directory it may not read
        return Stamp("python", UNREADABLE, 0)
    return Stamp("python", digest.hexdigest(), latest)


def _manifest_row(gen: Path, path: str) -> list | None:
    """One row of the generation's manifest, found in its bytes (rows are written as compact JSON lists)
    without parsing the whole document."""
    try:
        data = treecheck.read_bounded(gen / MANIFEST_NAME)
    except (OSError, ValueError):
        return None
    start = data.find(b"[" + json.dumps(path).encode() + b",")
    if start < 0:
        return None
    end = data.find(b"]", start)
    try:
        row = json.loads(data[start : end + 1])
    except ValueError:
        return None
    return row if isinstance(row, list) and len(row) == 9 else None


def _matches_row(path: Path, row: list | None) -> bool:
    if row is None:
        return False
    try:
        st = os.lstat(path)
    except OSError:
        return False
    _rel, kind, size, mode, sha, ino, mtime_ns, uid, gid = row
    same = (
        kind == "f"
        and stat.S_ISREG(st.st_mode)
        and (st.st_size, stat.S_IMODE(st.st_mode), st.st_ino, st.st_mtime_ns, st.st_uid, st.st_gid)
        == (size, mode, ino, mtime_ns, uid, gid)
    )
    if same and st.st_ctime_ns > hashed_before(path.parent):  # its inode changed since: rewritten in place?
        try:
            return treecheck.sha256_file(path) == sha
        except OSError:
            return False
    return same


# ------------------------------------------------------------------------------------------------ the tree


def _manifest_rows_under_env(gen: Path) -> list[list] | None:
    """The manifest's rows for env/ with paths relative to env/ ("." for env/ itself); None when the manifest
    cannot be read as a format 2 manifest (regular file, bounded size, never through a link)."""
    try:
        doc = json.loads(treecheck.read_bounded(gen / MANIFEST_NAME))
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != 2 or not isinstance(doc.get("files"), list):
        return None
    rows = []
    for row in doc["files"]:
        if not (treecheck.valid_row(row) and len(row) == 9):
            return None
        if row[0] == "env" or row[0].startswith("env/"):
            rows.append([row[0][4:] or ".", *row[1:]])
    return rows


def _tree_changed(gen: Path, tree: dict) -> str | None:
    """None when the generation's env/ holds what it was sealed with, else why not.

    The quick answer is the tree stamp recorded with the facts (every path's kind, inode, size, mtime, mode and
    owner), and no inode changed since the generation's bytes were last compared (hashed_before: a file written
    in place with its mtime put back keeps the stamp; its ctime moves). Otherwise the bytes decide: every path is
    compared with its manifest row, re-hashing the files whose inode or mtime moved or whose inode changed since
    (probe.treecheck, the store's own comparison). Equal content is the sealed generation (a `touch`, a repair's
    new inodes, a later build's hard links to the same files): the facts hold, the new stamp is remembered in the
    store's cache and the moment of the comparison recorded, so the next run is quick again."""
    method, digest = tree.get("method"), tree.get("digest")
    walked = generation_stamp(gen / "env", method, keep=True)
    now = (walked.method, walked.digest)
    readable = walked.digest != UNREADABLE and digest != UNREADABLE
    before = hashed_before(gen)
    # A stamp that could not be taken describes no tree: nothing is remembered for it, the bytes decide each time.
    key = derived_key(gen / "env", "tree-content-checked", digest, now) if readable else None
    known = True if readable and now == (method, digest) else load_derived(gen / "env", key)
    if isinstance(known, str) and known:  # this very tree was compared before, and differed
        return known
    if known is True and walked.newest_change <= before:
        return None
    rows = _manifest_rows_under_env(gen)
    if rows is None:
        return f"generation {gen.name} changed since it was sealed (its manifest is unreadable or malformed)"
    try:
        # The walk that took the stamp listed every path: a difference it shows is found from that listing. It may
        # find the tree whole only if a second walk lists every path exactly as it did, inode change times
        # included: a file rewritten in place while the first walk ran, after it was listed, with a later path
        # touched, would otherwise be vouched for by that walk's newest change time (recorded below) with its
        # bytes never compared. With the same listing twice, every path was as listed when the first walk ended.
        found = None
        if walked.listing is not None:
            listed = treecheck.compared_listing(
                gen / "env", rows, walked.listing, first_only=True, changed_since=before
            )
            if listed is not None and (listed.found or _listed_again(gen / "env", method, walked.listing)):
                found = listed.found
        if found is None:
            found = treecheck.compared(gen / "env", rows, first_only=True, changed_since=before).found
    except (OSError, ValueError) as exc:  # a path that vanished or changed kind while it was compared
        return f"generation {gen.name} changed while it was compared with its manifest ({exc})"
    answer = f"generation {gen.name} changed since it was sealed (env/{found[0][0]}: {found[0][1]})" if found else True
    if key is not None and now != (method, digest):
        save_derived(gen / "env", key, answer)
    if answer is True and readable and _beside_env_as_sealed(gen):
        record_hashed(gen, walked.newest_change)  # every change up to the walk has had its bytes compared
    return None if answer is True else answer


def _listed_again(env: Path, method: str | None, listing: treecheck.Listing) -> bool:
    """A second walk of `env` lists every path exactly as `listing` does (kind, inode, size, times, mode,
    owner, device, link target)."""
    return generation_stamp(env, method, keep=True).listing == listing


def _beside_env_as_sealed(gen: Path) -> bool:
    """The generation's own files beside env/ (its record, facts, toolkit link) are as its manifest says (a file
    is hashed when its inode changed since the bytes were last compared): only then may a comparison of env/
    vouch for the whole generation, whose record the store's own check reads from the same moment on."""
    try:
        names = os.listdir(gen)
    except OSError:
        return False
    for name in names:
        if name in (MANIFEST_NAME, "env"):
            continue
        row = _manifest_row(gen, name)
        if row is None:
            return False
        if row[1] == "l":
            try:
                if not stat.S_ISLNK(os.lstat(gen / name).st_mode) or os.readlink(gen / name) != row[4]:
                    return False
            except OSError:
                return False
        elif not _matches_row(gen / name, row):
            return False
    return True


def record_as_sealed(gen: Path) -> bool:
    """The generation's record.json is the one its manifest holds (what it says it was built from can be
    believed)."""
    return _matches_row(gen / RECORD_NAME, _manifest_row(gen, RECORD_NAME))


HASHED_SUFFIX = ".hashed"  # <generation>.hashed in the derived folder: hashed_before's record


def _hashed_path(gen: Path) -> Path:
    return derived_folder(gen.parent.parent) / f"{gen.name}{HASHED_SUFFIX}"


def hashed_before(gen: Path) -> int:
    """The moment (ns) up to which every change to the generation's files has had its bytes compared with the
    manifest: recorded when the store indexed the committed generation (after its hard links were made) and
    each time a comparison found it whole; without a record (one the store's owner did not write), the moment
    its manifest was written, when every file had just been hashed."""
    path = _hashed_path(gen)
    try:
        if _written_by_the_store(path):
            value = int(treecheck.read_bounded(path, 64, "the hashed record").decode().strip())
            if value > 0:
                return value
    except (OSError, ValueError):
        pass
    try:
        return os.stat(gen / MANIFEST_NAME).st_mtime_ns
    except OSError:
        return 0


def record_hashed(gen: Path, moment: int | None) -> None:
    """Best effort, the store's owner only: every change up to `moment` (at most now) has had its bytes compared.
    None: up to now, read from the filesystem's own clock (the inode change time of the record as it is written,
    less one). Inode times come from the file server's clock on a network filesystem and from a coarse tick on some
    kernels: a change just after a reading of time.time_ns() could carry an earlier time and be vouched for. Less
    one: a change in the same tick as the record counts as later."""
    path = _hashed_path(gen)
    try:
        if (moment is not None and moment <= hashed_before(gen)) or os.geteuid() != os.stat(
            path.parent.parent.parent
        ).st_uid:
            return
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        with os.fdopen(fd, "w") as out:
            # Never later than the filesystem's now: a path whose inode change time lies ahead (a clock stepped back
            # since, a file server's clock running ahead) would otherwise vouch for changes not made yet.
            now = os.fstat(out.fileno()).st_ctime_ns - 1
            moment = now if moment is None else min(moment, now)
            if moment <= hashed_before(gen):
                os.unlink(tmp)
                return
            out.write(f"{moment}\n")
        os.replace(tmp, path)
    except OSError:
        return


# ------------------------------------------------------------------------------------------------ static facts


def write_static(gen_dir: Path, env: Path, capability: str, facts: dict) -> Path:
    """facts.json of a generation being built: after its env is sealed, before its manifest is written."""
    method, stamp = tree_stamp(env)
    doc = {
        "format": FACTS_FORMAT,
        "env_prefix": str(env),
        "tree": {"method": method, "digest": stamp},
        "capability": capability,
        "host": host_fingerprint(env),
        "probe": probe_digest(),
        "facts": {k: facts[k] for k in STATIC_KEYS if k in facts},
    }
    path = Path(gen_dir) / FACTS_NAME
    path.write_text(json.dumps(doc, separators=(",", ":")))
    os.chmod(path, 0o444)
    return path


def _relocate(text: str, old: str, new: str) -> str:
    """Paths recorded under the env the facts were computed in, moved to the env being checked."""
    if old == new:
        return text
    return text.replace(json.dumps(old)[1:-1], json.dumps(new)[1:-1])


def load_static(env: Path, capability: str) -> tuple[dict | None, str]:
    """(the generation's static facts relocated to `env`, why) or (None, why they cannot be used)."""
    gen = generation_of(env)
    if gen is None:
        return None, "the env is not a generation of a store"
    path = gen / FACTS_NAME
    if not path.is_file():
        return None, f"generation {gen.name} has no {FACTS_NAME} (built before facts were recorded)"
    if not _matches_row(path, _manifest_row(gen, FACTS_NAME)):
        return None, f"generation {gen.name}: {FACTS_NAME} does not match its manifest"
    try:
        doc = json.loads(treecheck.read_bounded(path, MAX_FACTS_BYTES, FACTS_NAME))
        if doc.get("format") != FACTS_FORMAT:
            return None, f"{FACTS_NAME} has another format"
        if doc.get("capability") != capability:
            return None, f"{FACTS_NAME} was computed for capability {doc.get('capability')}, not {capability}"
        changed = _tree_changed(gen, doc.get("tree") or {})
        if changed:
            return None, changed
        again = None
        moved = HOST_CHANGED if doc.get("host") != host_fingerprint(env) else None
        if moved is None and doc.get("probe") != probe_digest():
            moved = PROBE_CHANGED
        if moved is not None:
            again = load_derived(env, derived_key(env, "static-facts", capability))
            if not (isinstance(again, dict) and isinstance(again.get("facts"), dict)):
                return None, moved
            doc = again
        text = _relocate(json.dumps(doc["facts"]), doc["env_prefix"], str(env))
        note = ""
        if again is not None:
            what = "on this host" if moved == HOST_CHANGED else "by this bwstack's probe"
            note = f" (its facts read again {what}, which changed since)"
        return json.loads(text), f"generation {gen.name} unchanged since it was sealed{note}"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return None, f"{FACTS_NAME} unreadable ({exc})"


HOST_CHANGED = "the host's libraries or interpreter changed since the facts were computed"
PROBE_CHANGED = "bwstack's probe changed since the facts were computed"
# The generation is as sealed, only what reads it moved: its facts are read again and kept in the store's cache.
READ_AGAIN = (HOST_CHANGED, PROBE_CHANGED)


@functools.cache
def probe_digest() -> str:
    """A digest of the probe's own files (this package: its modules, the in-env scripts, the model references).
    Every result a verify reuses was computed by some version of this code: a result from another version (a
    check fixed or widened since) is computed again, not reused."""
    from importlib import resources

    digest = hashlib.sha256()

    def add(folder, prefix: str) -> None:
        for child in sorted(folder.iterdir(), key=lambda c: c.name):
            if child.name == "__pycache__" or child.name.endswith(".pyc"):
                continue
            if child.is_dir():
                add(child, f"{prefix}{child.name}/")
            else:
                data = child.read_bytes()
                digest.update(f"{prefix}{child.name}\0{len(data)}\0".encode() + data)

    add(resources.files("bwstack.probe"), "")
    return digest.hexdigest()


def save_static_again(env: Path, capability: str, facts: dict) -> None:
    """The static facts of an unchanged generation, read again from its files because the host changed since it
    was built (an apt upgrade of any library moves the library folders): its sealed facts.json cannot be
    rewritten, so they go to the store's verify cache, keyed by the host as it is now. Without this, every verify
    after such an upgrade read every file again (11 s here, against 1.2 s)."""
    doc = {"env_prefix": str(env), "facts": {k: facts[k] for k in STATIC_KEYS if k in facts}}
    save_derived(env, derived_key(env, "static-facts", capability), doc)


# ------------------------------------------------------------------------------------------------ derived facts

DERIVED_KEEP = 32  # results kept per generation (one per import set, serve-plan job, device)


def derived_folder(store_root: Path) -> Path:
    """Where the store keeps what verifies computed by running its generations: a file per generation."""
    return store_root / "cache" / "verify-facts"


def derived_cache(env: Path) -> Path | None:
    gen = generation_of(env)
    if gen is None:
        return None
    return derived_folder(gen.parent.parent) / f"{gen.name}.json"


def _cached_generation(name: str) -> str | None:
    """The generation a file of the derived folder belongs to: `<gen>.json` or `<gen>.hashed`, or
    `.<gen>.json.<pid>.tmp` that a writer killed before its rename left. None for a name this module never
    writes."""
    if name.startswith(".") and name.endswith(".tmp"):
        name = name[1:].rsplit(".", 2)[0] if name.count(".") >= 3 else ""
    for suffix in (".json", HASHED_SUFFIX):
        if name.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)]
    return None


def forget_derived(store_root: Path, generations: set[str]) -> list[str]:
    """Remove what verifies remembered of generations that are gone (pruned, or an adoption that never
    completed): nothing of theirs can be reused, and a store that builds often would keep a file per build.
    Names this module does not write are left alone; the folder is opened without following a link and each
    file is unlinked relative to it (unlink never follows one). Returns the names removed."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    folder = derived_folder(store_root)
    try:  # cache/ and verify-facts/ each opened without following a link (one at cache/ led elsewhere)
        parent = os.open(folder.parent, flags)
        try:
            fd = os.open(folder.name, flags, dir_fd=parent)
        finally:
            os.close(parent)
    except OSError:
        return []  # none yet, or not a folder this store made
    removed = []
    try:
        for name in sorted(os.listdir(fd)):
            gen = _cached_generation(name)
            if gen is None or gen in generations:
                continue
            with contextlib.suppress(OSError):  # gone meanwhile, or a folder of that name: not ours to empty
                os.unlink(name, dir_fd=fd)
                removed.append(name)
    finally:
        os.close(fd)
    return removed


PATH_PROGRAMS = ("cc", "gcc", "g++", "c++", "ldconfig", "nvcc", "ptxas")
# The variables the loader and the stack's libraries read (torch's TORCH_USE_RTLD_GLOBAL, the loader's LD_AUDIT,
# SGLang's switches, NCCL's and Triton's settings, ...). Only these key a result: the whole environment also holds
# what changes from one shell, login, Ansible task or pyenv shim to the next (PYENV_DIR is the directory a shim
# was started in), and keying on it made every verify after another kind of session run everything again.
# CUDA_HOME is left to the CUDA facts, which key what depends on the toolkit (the generation's hook sets it in
# every interpreter of the env where it is unset).
ENVIRONMENT_PREFIXES = (
    "LD_", "GLIBC_", "MALLOC_", "PYTHON", "TORCH", "PYTORCH", "SGLANG", "SGL_", "FLASHINFER", "NCCL", "NVIDIA",
    "CUDA_", "CUBLAS", "CUDNN", "NVTE", "TRITON", "HF_", "HUGGINGFACE", "TRANSFORMERS", "TOKENIZERS", "OMP_", "MKL_",
    "KMP_", "OPENBLAS", "GOTO", "DG_", "DEEPGEMM",
)  # fmt: skip


def environment_key() -> str:
    """The part of the environment the env's interpreters inherit that changes what they do (the probe's children
    keep the caller's environment, less what interp.clean_env drops), as one digest: a result computed under
    other values is not reused."""
    from bwstack.probe import interp

    kept: list = sorted(
        (k, v) for k, v in interp.clean_env().items() if k.startswith(ENVIRONMENT_PREFIXES) and k != "CUDA_HOME"
    )
    # PATH itself is left out (verify puts a folder of its own on it each run, holding Ansible's commands); what it
    # leads to for the programs imports and SGLang's planner start (Triton compiles with cc, finds libcuda with
    # ldconfig) is in.
    kept += [[name, stat_key(found) if (found := shutil.which(name)) else None] for name in PATH_PROGRAMS]
    return hashlib.sha256(json.dumps(kept).encode(errors="surrogateescape")).hexdigest()


def basis(env: Path) -> list | None:
    """What every result computed by running the env depends on besides its own inputs: the generation and its
    manifest, the host fingerprint, the compiler (the stand-in libcuda) and the environment it runs in."""
    gen = generation_of(env)
    if gen is None:
        return None
    compiler = [stat_key(p) for p in ("/usr/bin/gcc", "/usr/bin/cc")]
    return [
        gen.name, stat_key(str(gen / MANIFEST_NAME)), host_fingerprint(env), compiler, environment_key(),
        probe_digest(),
    ]  # fmt: skip


def basis_still_holds(env: Path, given: object) -> bool:
    """A basis the probe computed moments ago in this verify run (after its unchanged check) still names this
    generation and its manifest, and this process runs in the same environment: later serve-plan runs of the
    same verify reuse it instead of walking again."""
    gen = generation_of(env)
    return (
        gen is not None
        and isinstance(given, list)
        and len(given) == 6
        and given[0] == gen.name
        and given[1] == stat_key(str(gen / MANIFEST_NAME))
        and given[4] == environment_key()
        and given[5] == probe_digest()
    )


def derived_key(env: Path | None, kind: str, *inputs: object, base: list | None = None) -> str | None:
    """The key of a result computed by running the env (imports, SGLang's serve plan): its basis and what the
    caller names (the GPUs and driver, the job, the CUDA toolkit facts)."""
    base = base if base is not None else (basis(env) if env is not None else None)
    if base is None:
        return None
    key = [kind, base, list(inputs)]
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


def _written_by_the_store(path: Path) -> bool:
    """A file of the store's cache/verify-facts that only the store root's owner could have written: a regular
    file of that owner's, writable by nobody else."""
    st = os.lstat(path)
    owner = os.stat(path.parent.parent.parent)
    return stat.S_ISREG(st.st_mode) and not st.st_mode & 0o022 and st.st_uid == owner.st_uid


def _read_derived(path: Path) -> dict:
    try:
        if not _written_by_the_store(path):
            return {}
        doc = json.loads(treecheck.read_bounded(path, MAX_FACTS_BYTES, "the verify cache"))
    except (OSError, ValueError):
        return {}
    if not isinstance(doc, dict):
        return {}
    return {k: v for k, v in doc.items() if isinstance(v, dict) and isinstance(v.get("t", 0), (int, float))}


def load_derived(env: Path, key: str | None) -> object | None:
    path = derived_cache(env)
    if key is None or path is None:
        return None
    entry = _read_derived(path).get(key)
    return entry.get("value") if isinstance(entry, dict) else None


def save_derived(env: Path, key: str | None, value: object) -> None:
    """Best effort: only the store's owner writes there; any other reader just computes it again."""
    path = derived_cache(env)
    if key is None or path is None:
        return
    try:
        if os.geteuid() != os.stat(path.parent.parent.parent).st_uid:
            return
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
        doc = _read_derived(path)
        doc[key] = {"t": time.time(), "value": value}
        doc = dict(sorted(doc.items(), key=lambda kv: -float(kv[1].get("t", 0)))[:DERIVED_KEEP])
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(doc, default=str))
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except (OSError, TypeError, ValueError):
        return


def union_loaded(first: list | None, second: list | None) -> list | None:
    """Two interpreters' loaded lists (loaded_changed's), each entry once (a file whose stamp differs between them
    is kept twice: it changed between the runs, and no later verify finds both); None when either is not known."""
    if first is None or second is None:
        return None
    return [*first, *(entry for entry in second if entry not in first)]


def loaded_changed(loaded: object, ran: str = "the imports") -> str | None:
    """None when everything an env's interpreter depended on outside the env while importing (the import script's
    list) is as it was; else what moved. Each entry: [path, dev, ino, size, mtime_ns, ctime_ns] of a file it
    loaded or a folder it searched, [path, None] of a path that was absent (a bytecode file never written, a
    sys.path entry that does not exist), or [path] of a file replaced while it was mapped. The host fingerprint
    covers the library folders, which an in-place `cp` over a library leaves as they were: the library's own stat
    does not (the copy moves its mtime and ctime); a module dropped into a folder on sys.path moves the folder's.
    `ran`: what ran, for the message (the imports, SGLang's planner)."""
    if not isinstance(loaded, list):
        return f"the files {ran} loaded were not recorded"
    for entry in loaded:
        if not (isinstance(entry, list) and entry and isinstance(entry[0], str)):
            return f"the files {ran} loaded were recorded malformed"
        path = entry[0]
        if len(entry) == 1:
            return f"{path} was replaced while {ran} ran"
        try:
            st = os.stat(path)
        except FileNotFoundError:
            if entry[1:] == [None]:
                continue
            return f"{path} is gone since {ran} ran"
        except OSError:
            return f"{path} cannot be checked"
        if entry[1:] == [None]:
            return f"{path} appeared since {ran} ran"
        if [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns] != entry[1:]:
            return f"{path} changed since {ran} ran"
    return None


def unchanged_generation(env: Path, *, host: bool = True) -> str | None:
    """None when the env's sealed generation still matches what its facts.json recorded (its tree and, unless
    `host` is False, its host), else why not: the condition for reusing anything derived from it. A caller whose
    keys name the host as it is now (`derived_key`'s basis) passes host=False."""
    gen = generation_of(env)
    if gen is None:
        return "the env is not a generation of a store"
    path = gen / FACTS_NAME
    if not _matches_row(path, _manifest_row(gen, FACTS_NAME)):
        return f"generation {gen.name}: no {FACTS_NAME} matching its manifest"
    try:
        doc = json.loads(treecheck.read_bounded(path, MAX_FACTS_BYTES, FACTS_NAME))
        tree = doc.get("tree") or {}
    except (OSError, ValueError, AttributeError):
        return f"{FACTS_NAME} unreadable"
    changed = _tree_changed(gen, tree)
    if changed:
        return changed
    if host and doc.get("host") != host_fingerprint(env):
        return HOST_CHANGED
    return None
