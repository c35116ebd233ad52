"""Generations: immutable env directories, one `current` symlink, and the path users know as ml-env.

    <root>/generations/0003-cu130-1a2b3c4d5e6f/   one generation (never modified after it is committed)
        env/                                       the venv, bytecode compiled in
        cuda -> /usr/local/cuda-13.0               the toolkit this env was built against
        record.json  manifest.json                 what it is; every path with kind, mode, owner, sha256
    <root>/current -> generations/0003-...         the single switch (one atomic rename)
    <root>/history.jsonl                           one line per switch, written before the flip
    <ml-env> -> <root>/current/env                 e.g. /opt/ml-env or ~/ml-env
    /usr/local/cuda -> <root>/current/cuda         only where this store manages it

Switching rewrites `current` with one rename(2), so the env and its CUDA toolkit change together: a new
process sees the old pair or the new pair, never half. Generations are built under `.building-<name>`
and renamed into place only when complete, verified and sealed, so an interrupted run leaves debris that
the next run removes and never a half generation.

What the store may touch: its own root, and the ml-env and CUDA links while they are absent or already
point into this store's `current`. A link that another store or somebody else made is refused, naming it,
unless the operator asks this store to take it over.

Damaged metadata damages one generation, not the store: a generation whose record or manifest cannot be
read is listed as damaged with the reason, can never be switched to, and `prune` removes it.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import json
import os
import stat
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from importlib import resources
from pathlib import Path

from bwstack.errors import BwstackError, IntegrityError, UsageError
from bwstack.fsutil import append_line, atomic_symlink, atomic_write_text, fsync_dir
from bwstack.probe import envinspect, interp, sealed
from bwstack.probe.generation import MAX_RECORD_BYTES
from bwstack.probe.treecheck import read_bounded, sha256_file
from bwstack.store import manifest
from bwstack.store import record as record_module
from bwstack.store.layout import Layout
from bwstack.store.record import GenerationRecord, RecordError
from bwstack.store.tree import make_writable_parent, remove_tree, replace_sealed, seal

RECORD = "record.json"
MANIFEST = manifest.MANIFEST_NAME
# The static facts the node checks need, recorded when the generation is built (bwstack.probe.sealed).
FACTS = "facts.json"
HOOK_PTH = "zzzz_bwstack_generation.pth"  # last in site's alphabetical .pth order, after other path hooks
HOOK_MODULE = "_bwstack_generation.py"
BUILDING_PREFIX = ".building-"
TOP_LEVEL = {"env", "cuda", RECORD, MANIFEST}  # everything a generation directory may hold


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def checkpoint(name: str) -> None:
    """Test hook for the SIGKILL tests: dies right here when BWSTACK_TEST_KILL_AT names this point."""
    if os.environ.get("BWSTACK_TEST_KILL_AT") == name:
        os.kill(os.getpid(), 9)


# ------------------------------------------------------------------------------------------------ generation


def _id_from_name(name: str) -> int | None:
    head = name.split("-", 1)[0]
    return int(head) if head.isdigit() and len(head) == 4 else None


def read_record(gen_dir: Path) -> tuple[GenerationRecord, str | None]:
    """(record, problem): the record of a generation directory, or an empty one and why it is damaged."""
    gen_id = _id_from_name(gen_dir.name)
    damaged = record_module.empty(-1 if gen_id is None else gen_id)
    try:
        data = read_bounded(gen_dir / RECORD, MAX_RECORD_BYTES, "a record")
    except FileNotFoundError:
        return damaged, f"{RECORD} is missing"
    except (OSError, ValueError) as exc:
        return damaged, f"{RECORD} cannot be read ({getattr(exc, 'strerror', None) or exc})"
    try:
        doc = json.loads(data)
    except ValueError as exc:
        return damaged, f"{RECORD} is not valid JSON ({exc})"
    if not isinstance(doc, dict):
        return damaged, f"{RECORD} is not a JSON object"
    try:
        return GenerationRecord.from_json(doc, expected_id=_id_from_name(gen_dir.name)), None
    except RecordError as exc:
        return damaged, f"{RECORD}: {exc}"


@dataclass(frozen=True)
class Generation:
    path: Path
    record: GenerationRecord
    record_problem: str | None = field(default=None, compare=False)

    @property
    def id(self) -> int:
        return self.record.id

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def profile(self) -> str | None:
        return self.record.profile

    @property
    def env(self) -> Path:
        return self.path / "env"

    @property
    def cuda(self) -> Path:
        return self.path / "cuda"

    @cached_property
    def _manifest(self) -> tuple[manifest.Manifest | None, str | None]:
        try:
            return manifest.read(self.path / MANIFEST), None
        except manifest.ManifestError as exc:
            return None, f"{MANIFEST}: {str(exc).removeprefix(str(self.path / MANIFEST) + ': ')}"

    @property
    def manifest(self) -> manifest.Manifest:
        doc, problem = self._manifest
        if doc is None:
            raise IntegrityError(f"generation {self.name} is damaged: {problem}")
        return doc

    @property
    def damaged(self) -> str | None:
        """Why this generation's metadata cannot be trusted, or None."""
        if not stat.S_ISDIR(os.lstat(self.path).st_mode):
            return "not a directory"
        return self.record_problem or self._manifest[1]

    @property
    def verified(self) -> bool:
        """Its checks passed when it was built (or restored); says nothing about its files since."""
        return not self.damaged and self.record.passed

    def manifest_entries(self) -> list[manifest.Entry]:
        return list(self.manifest.entries)

    def verify(self, depth: str = "quick") -> list[manifest.Problem]:
        """Every way the generation differs from what it promised: its manifest file, then its files."""
        if self.damaged:
            return [manifest.Problem(self.name, f"damaged: {self.damaged}")]
        doc = self.manifest
        # A file rewritten in place with its mtime put back keeps its inode and mtime: the ones whose inode changed
        # since the bytes were last compared are hashed too, and once the whole tree matches, that moment moves.
        since = sealed.hashed_before(self.path)
        if doc.legacy:
            return manifest.check(self.env, doc, depth, changed_since=since)[0]
        problems = []
        st = os.lstat(self.path / MANIFEST)
        top = doc.by_path().get(".")
        owner = (top.uid, top.gid) if top else (st.st_uid, st.st_gid)
        if stat.S_IMODE(st.st_mode) & 0o022:
            problems.append(manifest.Problem(MANIFEST, f"mode {stat.S_IMODE(st.st_mode):04o}: writable by others"))
        if (st.st_uid, st.st_gid) != owner:
            problems.append(
                manifest.Problem(MANIFEST, f"owner {st.st_uid}:{st.st_gid}, the store's is {owner[0]}:{owner[1]}")
            )
        found, newest = manifest.check(self.path, doc, depth, changed_since=since)
        if not problems and not found:
            sealed.record_hashed(self.path, newest)
        return problems + found


def generation_name(gen_id: int, profile: str | None, digest: str) -> str:
    return f"{gen_id:04d}-{profile or 'adopted'}-{digest.removeprefix('sha256:')[:12]}"


# ------------------------------------------------------------------------------------------------ links


class LinkState(enum.Enum):
    ABSENT = "absent"
    OURS = "ours"
    OTHER_STORE = "another store's"
    FOREIGN = "not made by bwstack"
    REAL = "a real directory or file"


def link_state(link: Path, want: Path) -> tuple[LinkState, str]:
    """Who a link belongs to: this store (it points at `want`), another bwstack store, or somebody else."""
    try:
        st = os.lstat(link)
    except FileNotFoundError:
        return LinkState.ABSENT, ""
    if not stat.S_ISLNK(st.st_mode):
        return LinkState.REAL, ""
    target = os.readlink(link)
    if target == str(want):
        return LinkState.OURS, target
    parts = Path(target).parts
    if len(parts) >= 3 and parts[-2] == "current" and parts[-1] in ("env", "cuda"):
        owner = Path(*parts[:-2])
        if (owner / "generations").is_dir():
            return LinkState.OTHER_STORE, f"{target} (the store at {owner})"
    return LinkState.FOREIGN, target


# ------------------------------------------------------------------------------------------------ store


@dataclass(frozen=True)
class HistoryEntry:
    at: str
    from_: str | None
    to: str
    why: str


def _changed_since(base: Path, entries: list[manifest.Entry], moment: int) -> bool:
    """Whether the inode of any file the manifest lists changed after `moment` (or cannot be read)."""
    for entry in entries:
        if entry.kind == "f":
            try:
                if os.lstat(base / entry.path).st_ctime_ns > moment:
                    return True
            except OSError:
                return True
    return False


class Store:
    def __init__(self, layout: Layout, log=print) -> None:
        self.layout = layout
        self.log = log

    # -- reading -----------------------------------------------------------------------------------

    def generations(self) -> list[Generation]:
        """Every generation directory, damaged ones included (`Generation.damaged` says why)."""
        out = []
        try:
            names = sorted(os.listdir(self.layout.generations))
        except FileNotFoundError:
            return out
        for name in names:
            if name.startswith("."):
                continue
            path = self.layout.generations / name
            try:
                mode = os.lstat(path).st_mode
            except FileNotFoundError:  # removed since it was listed
                continue
            if stat.S_ISDIR(mode):
                record, problem = read_record(path)
            else:  # a file or a link dropped there: listed as damaged (prune removes it), never followed
                gen_id = _id_from_name(name)
                record, problem = record_module.empty(-1 if gen_id is None else gen_id), "not a directory"
            out.append(Generation(path, record, problem))
        return sorted(out, key=lambda g: (g.id, g.name))

    def usable(self) -> list[Generation]:
        return [g for g in self.generations() if not g.damaged]

    def get(self, ref: str) -> Generation:
        for gen in self.generations():
            if ref in (str(gen.id), f"{gen.id:04d}", gen.name):
                if gen.damaged:
                    raise IntegrityError(
                        f"generation {gen.name} is damaged ({gen.damaged}); it cannot be switched to "
                        f"(`bwstack prune` removes it)"
                    )
                return gen
        known = ", ".join(g.name for g in self.generations()) or "none"
        raise UsageError(f"no generation {ref!r} in {self.layout.generations} (known: {known})")

    def current_problem(self) -> str | None:
        """Why `current` is not a link to a generation inside this store (None when it is, or is absent)."""
        try:
            target = os.readlink(self.layout.current)
        except FileNotFoundError:
            return None
        except OSError:
            return f"{self.layout.current} is not a symbolic link"
        parts = Path(target).parts
        if len(parts) != 2 or parts[0] != "generations" or parts[1].startswith("."):
            return f"{self.layout.current} points to {target!r}, not to a generation inside {self.layout.root}"
        try:
            if not stat.S_ISDIR(os.lstat(self.layout.generations / parts[1]).st_mode):
                return f"{self.layout.current} points to {target!r}, which is not a generation directory"
        except FileNotFoundError:
            return f"{self.layout.current} points to {target!r}, which does not exist"
        return None

    def active(self) -> Generation | None:
        """The generation `current` points to; an IntegrityError when it points anywhere else."""
        if not self.layout.current.is_symlink() and not self.layout.current.exists():
            return None
        problem = self.current_problem()
        if problem:
            raise IntegrityError(problem)
        name = Path(os.readlink(self.layout.current)).name
        path = self.layout.generations / name
        record, record_problem = read_record(path)
        return Generation(path, record, record_problem)

    def active_or_none(self) -> Generation | None:
        try:
            return self.active()
        except IntegrityError:
            return None

    def next_id(self) -> int:
        ids = [g.id for g in self.generations()]
        building = [p.name[len(BUILDING_PREFIX) :] for p in self._building_dirs()]
        ids += [i for i in (_id_from_name(n) for n in building) if i is not None]
        return max(ids, default=-1) + 1

    def history_lines(self) -> tuple[list[dict], list[str]]:
        """(entries, problems): the history's readable lines, and a note for each damaged one."""
        try:
            lines = self.layout.history.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return [], []
        except OSError as exc:
            return [], [f"{self.layout.history}: cannot be read ({exc.strerror})"]
        out, problems = [], []
        for number, line in enumerate(lines, 1):
            try:
                entry = json.loads(line)
                if not isinstance(entry, dict) or not isinstance(entry.get("to"), str):
                    raise ValueError("not a switch record")
                out.append(entry)
            except ValueError:
                problems.append(f"{self.layout.history} line {number} is damaged; ignored")
        return out, problems

    def history(self) -> list[dict]:
        """The switches that happened. Each line is written before its flip, so a line whose flip never
        happened (a kill in between) is the one whose successor does not start from it: left out."""
        entries, _ = self.history_lines()
        try:
            current = Path(os.readlink(self.layout.current)).name
        except OSError:
            current = None
        effective = []
        for i, entry in enumerate(entries):
            following = entries[i + 1] if i + 1 < len(entries) else None
            happened = following.get("from") == entry["to"] if following else entry["to"] == current
            if happened:
                effective.append(entry)
        return effective

    def _building_dirs(self):
        try:
            names = os.listdir(self.layout.generations)
        except FileNotFoundError:
            return
        for name in names:
            if name.startswith(BUILDING_PREFIX):
                yield self.layout.generations / name

    # -- housekeeping ------------------------------------------------------------------------------

    def prepare(self) -> None:
        """Create the store (0755, nothing world-writable) and clean what an interrupted run left."""
        for path in (self.layout.root, self.layout.generations):
            try:
                path.mkdir(parents=True, exist_ok=True)
            except PermissionError:
                raise UsageError(
                    f"{path}: permission denied (the store belongs to another user; pass --root)"
                ) from None
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode):
                raise UsageError(f"{path} is not a directory (a link or a file); refusing to use it as the store")
            if stat.S_IMODE(st.st_mode) != 0o755 and st.st_uid == os.geteuid():
                os.chmod(path, 0o755)
        for debris in self._building_dirs():
            self.log(f"removing {debris.name} left by an interrupted run")
            remove_tree(debris)
        for link in (self.layout.current, self.layout.ml_env, self.layout.cuda_link):
            if link is not None and link.parent.is_dir():
                for tmp in link.parent.glob(f".{link.name}.*.tmp"):
                    if tmp.is_symlink() and os.readlink(tmp).startswith((str(self.layout.root) + "/", "generations/")):
                        tmp.unlink()

    def begin(self, name: str) -> Path:
        building = self.layout.generations / f"{BUILDING_PREFIX}{name}"
        remove_tree(building)
        building.mkdir(mode=0o755)
        os.chmod(building, 0o755)
        return building

    def seal_and_hash(
        self,
        building: Path,
        *,
        sealed: bool = False,
        hashed: Mapping[tuple[int, int, int, int], str] | None = None,
        hashed_until: int = 0,
    ) -> list[manifest.Entry]:
        """Seal the env (unless `sealed`: done already) and hash everything in the generation directory so far
        (files shared with uv's cache or other generations are hashed once). `hashed`: what this build hashed of
        the same directory earlier (manifest.known_hashes), reused only for a file whose inode has not changed
        since `hashed_until` (manifest.build's `earlier`)."""
        if not sealed:
            seal(building / "env")
        checkpoint("before-manifest")
        dev = os.stat(building).st_dev
        known: dict = manifest.HashCache(self.layout.cache / "file-hashes.json").load(dev)
        for gen in self.usable():
            try:
                if os.stat(gen.path).st_dev == dev:
                    known.update(manifest.known_hashes(gen.manifest_entries(), dev))
            except (OSError, IntegrityError):
                continue
        return manifest.build(building, known, skip_top=(MANIFEST, RECORD), earlier=hashed, earlier_until=hashed_until)

    def commit(
        self,
        building: Path,
        record: GenerationRecord,
        meta: dict,
        entries: list[manifest.Entry] | None = None,
        *,
        link_objects: bool = True,
    ) -> Generation:
        """Write record and manifest (sealed), and give the generation its final name (one rename)."""
        if entries is None:
            entries = self.seal_and_hash(building)
        name = building.name[len(BUILDING_PREFIX) :]
        record = record.replace(size_bytes=manifest.total_size(entries), files=len(entries))
        atomic_write_text(building / RECORD, json.dumps(record.to_json(), indent=2), mode=0o444)
        st = os.lstat(building / RECORD)
        record_entry = manifest.Entry(
            RECORD, "f", st.st_size, 0o444, sha256_file(building / RECORD), st.st_ino, st.st_mtime_ns,
            st.st_uid, st.st_gid,
        )  # fmt: skip
        doc = manifest.Manifest(
            manifest.FORMAT,
            tuple(sorted([*entries, record_entry], key=lambda e: e.path)),
            {"generation": name, **meta},
        )
        atomic_write_text(building / MANIFEST, json.dumps(doc.document(), separators=(",", ":")), mode=0o444)
        checkpoint("before-commit-rename")
        final = self.layout.generations / name
        self.forget_removed()  # a generation of this name removed earlier: nothing of its may pass to this one
        os.rename(building, final)
        fsync_dir(self.layout.generations)
        gen = Generation(final, record)
        if link_objects:
            self.index_files(gen)
        return gen

    def index_files(self, gen: Generation) -> None:
        """Second names for every file of a committed generation (repair after drift) and its hashes for the
        next build, anchored at the generation's final paths."""
        entries = gen.manifest_entries()
        # Linking moves every file's inode change time, which is how a verify finds a file rewritten in place
        # with its mtime put back. Read them first: only when none moved since the bytes were last compared (the
        # manifest was written, for a new generation) may the store vouch for the links' new times. An adopted
        # env waited outside the store when a kill interrupted its adoption, for anyone who could write it.
        untouched = not _changed_since(gen.path, entries, sealed.hashed_before(gen.path))
        self.layout.objects.add_all(gen.path, entries)
        manifest.HashCache(self.layout.cache / "file-hashes.json").add(gen.path, entries)
        if untouched:
            sealed.record_hashed(gen.path, None)

    # -- switching ---------------------------------------------------------------------------------

    def _append_history(self, entry: dict) -> None:
        try:
            append_line(self.layout.history, json.dumps(entry))
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise BwstackError(
                    f"disk full: cannot record the switch in {self.layout.history}; nothing was switched "
                    f"(free space, e.g. `bwstack prune --keep 2`)"
                ) from None
            raise BwstackError(
                f"cannot record the switch in {self.layout.history}: {exc.strerror}; nothing was switched"
            ) from None

    def flip(self, gen_name: str | None, frm: str | None, why: str) -> None:
        """Record, then flip `current` (history first: a kill between the two is recognised on reading)."""
        self._append_history({"at": now_iso(), "from": frm, "to": gen_name or "", "why": why})
        if gen_name is None:
            self.layout.current.unlink(missing_ok=True)
        else:
            atomic_symlink(Path("generations") / gen_name, self.layout.current)

    def switch(self, gen: Generation, *, depth: str = "quick", why: str = "switch", post_check: bool = True) -> dict:
        """Verify `gen`, flip `current` to it, make sure the ml-env and CUDA links follow, check it runs.
        If a link cannot follow, `current` goes back and the command says so."""
        started = time.perf_counter()
        if gen.damaged:
            raise IntegrityError(f"refusing to switch to {gen.name}: it is damaged ({gen.damaged})")
        problems = [] if depth == "none" else gen.verify(depth)
        if problems:
            shown = "; ".join(str(p) for p in problems[:3])
            more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
            raise IntegrityError(
                f"refusing to switch to {gen.name}: its files no longer match its manifest: {shown}{more}"
            )
        self.check_links()
        verified_at = time.perf_counter()
        previous = self.active_or_none()
        prev_name = previous.name if previous else None
        checkpoint("before-flip")
        self.flip(gen.name, prev_name, why)
        flipped_at = time.perf_counter()
        checkpoint("after-flip")
        try:
            self.ensure_links()
        except OSError as exc:
            self.flip(prev_name, gen.name, f"undone: {why} could not update a link")
            where = exc.filename or "a link"
            raise BwstackError(
                f"switch to {gen.name} undone: {where}: {exc.strerror}; {self.layout.ml_env} still runs "
                f"{prev_name or 'nothing'}"
            ) from None
        timings = {"verify_s": verified_at - started, "flip_s": flipped_at - verified_at}
        if post_check:
            try:
                timings["post_check"] = post_switch_check(self.layout.ml_env, gen)
            except BwstackError:
                if prev_name is not None and prev_name != gen.name:
                    self.flip(prev_name, gen.name, "post-check failed")
                raise
        timings["total_s"] = time.perf_counter() - started
        return timings

    def _links(self) -> list[tuple[Path, Path]]:
        links = [(self.layout.ml_env, self.layout.current / "env")]
        if self.layout.cuda_link is not None:
            links.append((self.layout.cuda_link, self.layout.current / "cuda"))
        return links

    def check_links(self, *, adopting: bool = False) -> None:
        """Refuse, before anything changes, to re-point a link this store does not own. (Adoption turns the
        real directory at the ml-env path into the store's link: that path is taken over by design.)"""
        for link, want in self._links():
            state, detail = link_state(link, want)
            if state in (LinkState.OTHER_STORE, LinkState.FOREIGN) and not self.layout.take_over_links:
                raise UsageError(
                    f"{link} -> {detail} is {state.value}; refusing to re-point it (pass --take-over-links to "
                    f"let the store at {self.layout.root} manage it, or choose another path)"
                )
            if state is LinkState.REAL and link == self.layout.ml_env and not adopting:
                raise BwstackError(f"{link} is a real directory, not bwstack's link: adopt it first (`bwstack adopt`)")

    def ensure_links(self) -> None:
        """ml-env -> current/env, and the CUDA link -> current/cuda where this store manages it."""
        self.check_links()
        for link, want in self._links():
            state, detail = link_state(link, want)
            if state is LinkState.OURS:
                continue
            if state is LinkState.REAL:  # a real toolkit directory: never replaced (see cuda_link_note)
                continue
            if state in (LinkState.OTHER_STORE, LinkState.FOREIGN):
                self.log(f"taking over {link} (was -> {detail})")
            link.parent.mkdir(parents=True, exist_ok=True)
            atomic_symlink(want, link)
        if self.layout.profile_d is not None:
            text = (
                "# Written by bwstack: the CUDA toolkit of the active generation (switches with it).\n"
                f"export CUDA_HOME={self.layout.current}/cuda\n"
                f'case ":$PATH:" in *":{self.layout.current}/cuda/bin:"*) ;; '
                f'*) export PATH="{self.layout.current}/cuda/bin:$PATH" ;; esac\n'
            )
            try:
                if not self.layout.profile_d.is_file() or self.layout.profile_d.read_text() != text:
                    atomic_write_text(self.layout.profile_d, text)
            except OSError:
                self.log(f"note: could not write {self.layout.profile_d}; set CUDA_HOME yourself")

    def cuda_link_note(self) -> str | None:
        link = self.layout.cuda_link
        if link is not None and link.exists() and not link.is_symlink():
            kind = "directory" if link.is_dir() else "file"
            return (
                f"{link} is a real {kind} (not managed by bwstack), left untouched: processes use the generation's "
                f"toolkit through CUDA_HOME (set by the env itself)"
            )
        return None

    # -- repair ------------------------------------------------------------------------------------

    def repair(self, gen: Generation) -> list[manifest.Problem]:
        """Bring a drifted generation back to its manifest: remove what was added, re-link what was changed
        or removed from the objects that hold its original bytes, restore modes and owners. Returns what
        could not be repaired (empty when the generation verifies fully again)."""
        doc = gen.manifest
        if doc.legacy:
            return gen.verify("full")
        base = gen.path
        expected = doc.by_path()
        problems = gen.verify("full")
        added = sorted((p.path for p in problems if "not in the manifest" in p.what), key=len)
        removed_dirs: list[str] = []
        for rel in added:
            if any(rel.startswith(d + "/") for d in removed_dirs):
                continue
            path = base / rel
            if path.is_dir() and not path.is_symlink():
                remove_tree(path)
                removed_dirs.append(rel)
            else:
                make_writable_parent(path)
                path.unlink()
        repaired_files = False
        for problem in problems:
            entry = expected.get(problem.path)
            if entry is None:
                continue
            path = base / entry.path
            if entry.kind == "d":
                if not path.is_dir() or path.is_symlink():
                    make_writable_parent(path)
                    remove_tree(path)
                    path.mkdir()
                os.chmod(path, entry.mode, follow_symlinks=False)
            elif entry.kind == "l":
                make_writable_parent(path)
                remove_tree(path)
                os.symlink(entry.sha256, path)
            else:

                def clear(path: Path = path) -> None:
                    make_writable_parent(path)
                    remove_tree(path)

                if not self.layout.objects.restore(entry.sha256, path, entry.mode, (entry.uid, entry.gid), clear):
                    continue
                repaired_files = True
            if entry.uid is not None and os.geteuid() == 0:
                os.lchown(path, entry.uid, entry.gid)
        for entry in doc.entries:  # directories last: their modes may have been relaxed above
            if entry.kind == "d" and (base / entry.path).is_dir():
                os.chmod(base / entry.path, entry.mode)
        if repaired_files:
            fresh = manifest.Manifest(doc.format, tuple(manifest.refingerprint(base, doc.entries)), doc.meta)
            if fresh != doc:
                replace_sealed(base / MANIFEST, json.dumps(fresh.document(), separators=(",", ":")))
            gen.__dict__.pop("_manifest", None)
        return gen.verify("full")

    # -- retention ---------------------------------------------------------------------------------

    def prune(self, keep: int) -> list[str]:
        """Remove generations beyond the newest `keep`, and damaged ones; never the active one nor the last
        one that verified. Objects nothing links to any more go with them."""
        if keep < 1:
            raise UsageError("--keep must be at least 1")
        gens = self.generations()
        active_name = None
        if not self.current_problem():
            with contextlib.suppress(OSError):
                active_name = Path(os.readlink(self.layout.current)).name
        usable = [g for g in gens if not g.damaged]
        last_verified = max((g for g in usable if g.verified), key=lambda g: g.id, default=None)
        protected = {n for n in (active_name, last_verified.name if last_verified else None) if n}
        newest = {g.name for g in usable[-keep:]}
        removed = []
        for gen in gens:
            if gen.name in protected or (gen.name in newest and not gen.damaged):
                continue
            trash = self.layout.generations / f"{BUILDING_PREFIX}pruned-{gen.name}"
            os.rename(gen.path, trash)  # out of sight in one step; a kill leaves debris `prepare` removes
            remove_tree(trash)
            removed.append(gen.name)
        if removed:
            self.layout.objects.collect()
        self.forget_removed()  # every run: also what versions before this one left behind
        return removed

    def forget_removed(self) -> list[str]:
        """Drop what verifies remembered of generations this store no longer has."""
        return sealed.forget_derived(self.layout.root, {g.name for g in self.generations()})


def write_hook(env: Path, name: str) -> None:
    sp = envinspect.site_packages(env)
    # The hook is a real module of bwstack's (store/generation_hook.py: linted and read like any other code),
    # copied in with a first line that names the generation for whoever opens the file.
    source = resources.files("bwstack.store").joinpath("generation_hook.py").read_text(encoding="utf-8")
    # An adopted env was made by someone else: its site-packages must be its own folder, and a link already at
    # the hook's names is replaced, never written through (it could lead to any file root can write).
    real_env, real_sp = os.path.realpath(env), os.path.realpath(sp)
    if os.path.commonpath([real_env, real_sp]) != real_env:
        raise UsageError(f"{sp} leads out of the env (to {real_sp}): refusing to write the generation hook there")
    atomic_write_text(sp / HOOK_MODULE, f"# bwstack generation {name}\n{source}")
    atomic_write_text(sp / HOOK_PTH, "import _bwstack_generation\n")


def run_env_check(env_path: Path, real_env: Path, name: str, torch: dict, *, what: str = "env check") -> dict:
    """Run the env's interpreter through `env_path`: it must start inside `real_env` (generation `name`) and,
    where a torch was recorded, import that torch with its CUDA version. Writes no bytecode."""
    python = env_path / "bin" / "python"
    started = time.perf_counter()
    facts = interp.interpreter_facts(python)
    if "error" in facts:
        raise BwstackError(f"{what}: {python} did not run: {facts['error'][-400:]}")
    facts["seconds"] = round(time.perf_counter() - started, 3)
    if facts.get("generation") != name and facts.get("prefix") != os.path.realpath(real_env):
        raise BwstackError(f"{what}: {env_path} runs {facts.get('generation')}, expected {name}")
    if torch.get("version"):
        if "torch_error" in facts:
            raise BwstackError(f"{what}: import torch failed in {name}: {facts['torch_error']}")
        if facts.get("torch") != torch["version"] or facts.get("torch_cuda") != torch.get("cuda"):
            raise BwstackError(
                f"{what}: torch {facts.get('torch')} (CUDA {facts.get('torch_cuda')}) in {name}, "
                f"recorded {torch['version']} (CUDA {torch.get('cuda')})"
            )
    return facts


def post_switch_check(ml_env: Path, gen: Generation) -> dict:
    """Run the env through the ml-env path: the interpreter starts, and torch reports the recorded versions."""
    torch = dict(gen.record.torch)
    try:
        return run_env_check(ml_env, gen.env, gen.name, torch, what="post-switch check")
    except BwstackError as exc:
        raise BwstackError(f"{exc}; switched back") from None
