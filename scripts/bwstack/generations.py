"""Generations: immutable env directories, one `current` symlink, and the path users know as ml-env.

    <root>/generations/0003-cu130-1a2b3c4d5e6f/   one generation (never modified after it is committed)
        env/                                       the venv
        cuda -> /usr/local/cuda-13.0               the toolkit this env was built against
        record.json  manifest.json                 what it is; every file with size and sha256
    <root>/current -> generations/0003-...         the single switch (one atomic rename)
    <ml-env> -> <root>/current/env                 e.g. /opt/ml-env or ~/ml-env, created once
    /usr/local/cuda -> <root>/current/cuda         only where the node uses it (absent or already a link)

Switching rewrites `current` with one rename(2), so the env and its CUDA toolkit change together: a new
process sees the old pair or the new pair, never half. Generations are built under `.building-<name>`
and renamed into place only when complete, verified and sealed, so an interrupted run leaves debris that
the next run removes and never a half generation.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import stat
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from bwstack import envinspect, manifest
from bwstack.errors import BwstackError, IntegrityError, UsageError
from bwstack.fsutil import atomic_symlink, atomic_write_text, fsync_dir

RECORD = "record.json"
MANIFEST = "manifest.json"
HOOK_PTH = "zzzz_bwstack_generation.pth"  # last in site's alphabetical .pth order, after other path hooks
HOOK_MODULE = "_bwstack_generation.py"
BUILDING_PREFIX = ".building-"


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def checkpoint(name: str) -> None:
    """Test hook for the SIGKILL tests: dies right here when BWSTACK_TEST_KILL_AT names this point."""
    if os.environ.get("BWSTACK_TEST_KILL_AT") == name:
        os.kill(os.getpid(), 9)


# ------------------------------------------------------------------------------------------------ layout


@dataclass(frozen=True)
class Layout:
    root: Path
    ml_env: Path
    cuda_link: Path | None
    profile_d: Path | None

    @classmethod
    def default(cls, root: str | None = None, ml_env: str | None = None, cuda_link: str | None = None) -> Layout:
        is_root = os.geteuid() == 0
        home = Path.home()
        root_path = Path(
            root or os.environ.get("BWSTACK_ROOT") or ("/opt/bwstack" if is_root else home / ".local/share/bwstack")
        )
        ml = Path(ml_env or os.environ.get("BWSTACK_ML_ENV") or ("/opt/ml-env" if is_root else home / "ml-env"))
        link_value = cuda_link if cuda_link is not None else os.environ.get("BWSTACK_CUDA_LINK")
        if link_value is None:
            link_value = "/usr/local/cuda" if is_root else "none"
        link = None if link_value in ("", "none") else Path(link_value)
        profile_d = Path("/etc/profile.d/bwstack.sh") if is_root and root is None and link is not None else None
        return cls(root_path.absolute(), ml.absolute(), link, profile_d)

    @property
    def generations(self) -> Path:
        return self.root / "generations"

    @property
    def current(self) -> Path:
        return self.root / "current"

    @property
    def history(self) -> Path:
        return self.root / "history.jsonl"

    @property
    def cache(self) -> Path:
        """Wheels and uv's unpacked cache. BWSTACK_CACHE shares one between stores (same filesystem, so
        generations still hard-link from it)."""
        return Path(os.environ.get("BWSTACK_CACHE") or self.root / "cache")

    @property
    def wheel_store(self) -> Path:
        return self.cache / "wheels"

    @property
    def uv_cache(self) -> Path:
        return self.cache / "uv"


# ------------------------------------------------------------------------------------------------ generation


@dataclass(frozen=True)
class Generation:
    path: Path
    record: dict

    @property
    def id(self) -> int:
        return int(self.record["id"])

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def profile(self) -> str | None:
        return self.record.get("profile")

    @property
    def env(self) -> Path:
        return self.path / "env"

    @property
    def cuda(self) -> Path:
        return self.path / "cuda"

    @property
    def verified(self) -> bool:
        return self.record.get("verification", {}).get("status") == "passed"

    def manifest_doc(self) -> dict:
        try:
            return json.loads((self.path / MANIFEST).read_text())
        except (OSError, ValueError) as exc:
            raise IntegrityError(f"generation {self.name}: manifest unreadable ({exc})") from None

    def manifest_entries(self) -> list[manifest.Entry]:
        return [manifest.Entry.from_row(row) for row in self.manifest_doc()["files"]]

    def verify(self, depth: str = "quick") -> list[manifest.Problem]:
        return manifest.verify(self.env, self.manifest_entries(), depth)


def generation_name(gen_id: int, profile: str | None, digest: str) -> str:
    return f"{gen_id:04d}-{profile or 'adopted'}-{digest.removeprefix('sha256:')[:12]}"


# ------------------------------------------------------------------------------------------------ store


class Store:
    def __init__(self, layout: Layout, log=print) -> None:
        self.layout = layout
        self.log = log

    # -- reading -----------------------------------------------------------------------------------

    def generations(self) -> list[Generation]:
        out = []
        if not self.layout.generations.is_dir():
            return out
        for path in sorted(self.layout.generations.iterdir()):
            if path.name.startswith(".") or not (path / RECORD).is_file():
                continue
            try:
                out.append(Generation(path, json.loads((path / RECORD).read_text())))
            except ValueError:
                self.log(f"warning: {path / RECORD} is not valid JSON; ignoring that generation")
        return sorted(out, key=lambda g: g.id)

    def get(self, ref: str) -> Generation:
        for gen in self.generations():
            if ref in (str(gen.id), f"{gen.id:04d}", gen.name):
                return gen
        known = ", ".join(g.name for g in self.generations()) or "none"
        raise UsageError(f"no generation {ref!r} in {self.layout.generations} (known: {known})")

    def active(self) -> Generation | None:
        try:
            target = os.readlink(self.layout.current)
        except (FileNotFoundError, OSError):
            return None
        name = Path(target).name
        for gen in self.generations():
            if gen.name == name:
                return gen
        return None

    def next_id(self) -> int:
        ids = [g.id for g in self.generations()]
        building = [p.name[len(BUILDING_PREFIX) :] for p in self._building_dirs()]
        ids += [int(n.split("-", 1)[0]) for n in building if n[:4].isdigit()]
        return max(ids, default=-1) + 1

    def history(self) -> list[dict]:
        try:
            lines = self.layout.history.read_text().splitlines()
        except FileNotFoundError:
            return []
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # a line cut short by a kill
        return out

    def _building_dirs(self) -> Iterator[Path]:
        if self.layout.generations.is_dir():
            yield from (p for p in self.layout.generations.iterdir() if p.name.startswith(BUILDING_PREFIX))

    # -- housekeeping ------------------------------------------------------------------------------

    def prepare(self) -> None:
        """Create the store (0755, nothing world-writable) and clean what an interrupted run left."""
        for path in (self.layout.root, self.layout.generations):
            path.mkdir(parents=True, exist_ok=True)
            os.chmod(path, 0o755)
        for debris in self._building_dirs():
            self.log(f"removing {debris.name} left by an interrupted run")
            remove_tree(debris)
        for parent in {
            self.layout.root,
            self.layout.ml_env.parent,
            *([self.layout.cuda_link.parent] if self.layout.cuda_link else []),
        }:
            if parent.is_dir():
                for tmp in parent.glob(".*.tmp"):
                    if tmp.is_symlink():
                        tmp.unlink()

    def begin(self, name: str) -> Path:
        building = self.layout.generations / f"{BUILDING_PREFIX}{name}"
        if building.exists():
            remove_tree(building)
        building.mkdir(mode=0o755)
        return building

    def seal_and_hash(self, building: Path) -> list[manifest.Entry]:
        """Seal the env and hash it for the manifest (files shared with uv's cache are hashed once)."""
        env = building / "env"
        seal(env)
        checkpoint("before-manifest")
        dev = os.stat(env).st_dev
        cache = manifest.HashCache(self.layout.cache / "file-hashes.json")
        known: dict = cache.load(dev)
        for gen in self.generations():
            try:
                if os.stat(gen.env).st_dev == dev:
                    known.update(manifest.known_hashes(gen.manifest_entries(), dev))
            except (OSError, IntegrityError):
                continue
        return manifest.build(env, known)

    def commit(
        self, building: Path, record: dict, extra_manifest: dict, entries: list[manifest.Entry] | None = None
    ) -> Generation:
        """Write manifest and record, and give the generation its final name (one rename)."""
        if entries is None:
            entries = self.seal_and_hash(building)
        doc = {"format": 1, "generation": building.name[len(BUILDING_PREFIX) :], **extra_manifest}
        doc["files"] = [e.as_row() for e in entries]
        record = {**record, "size_bytes": manifest.total_size(entries), "files": len(entries)}
        atomic_write_text(building / MANIFEST, json.dumps(doc, separators=(",", ":")))
        atomic_write_text(building / RECORD, json.dumps(record, indent=2))
        checkpoint("before-commit-rename")
        final = self.layout.generations / building.name[len(BUILDING_PREFIX) :]
        os.rename(building, final)
        fsync_dir(self.layout.generations)
        # anchored at the generation's final paths, which keep the inodes alive
        manifest.HashCache(self.layout.cache / "file-hashes.json").add(final / "env", entries)
        return Generation(final, record)

    # -- switching ---------------------------------------------------------------------------------

    def switch(self, gen: Generation, *, depth: str = "quick", why: str = "switch", post_check: bool = True) -> dict:
        """Verify `gen`, flip `current` to it, make sure the ml-env and CUDA links exist, check it runs."""
        started = time.perf_counter()
        problems = [] if depth == "none" else gen.verify(depth)
        if problems:
            shown = "; ".join(str(p) for p in problems[:3])
            more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
            raise IntegrityError(
                f"refusing to switch to {gen.name}: its files no longer match its manifest: {shown}{more}"
            )
        verified_at = time.perf_counter()
        previous = self.active()
        checkpoint("before-flip")
        atomic_symlink(Path("generations") / gen.name, self.layout.current)
        flipped_at = time.perf_counter()
        checkpoint("after-flip")
        self.ensure_links()
        self._append_history({"at": now_iso(), "from": previous.name if previous else None, "to": gen.name, "why": why})
        timings = {"verify_s": verified_at - started, "flip_s": flipped_at - verified_at}
        if post_check:
            try:
                timings["post_check"] = post_switch_check(self.layout.ml_env, gen)
            except BwstackError:
                if previous is not None and previous.name != gen.name:
                    atomic_symlink(Path("generations") / previous.name, self.layout.current)
                    self._append_history(
                        {"at": now_iso(), "from": gen.name, "to": previous.name, "why": "post-check failed"}
                    )
                raise
        timings["total_s"] = time.perf_counter() - started
        return timings

    def _append_history(self, entry: dict) -> None:
        with open(self.layout.history, "a") as handle:
            handle.write(json.dumps(entry) + "\n")
            handle.flush()
            os.fsync(handle.fileno())

    def ensure_links(self) -> None:
        """ml-env -> current/env, and /usr/local/cuda -> current/cuda where we manage it (once; idempotent)."""
        want = self.layout.current / "env"
        ml = self.layout.ml_env
        if ml.is_symlink():
            if os.readlink(ml) != str(want):
                atomic_symlink(want, ml)
        elif not ml.exists():
            ml.parent.mkdir(parents=True, exist_ok=True)
            atomic_symlink(want, ml)
        else:
            raise BwstackError(f"{ml} is a real directory, not bwstack's link: adopt it first (`bwstack adopt {ml}`)")
        link = self.layout.cuda_link
        if link is not None:
            want_cuda = self.layout.current / "cuda"
            ours = link.is_symlink() or not link.exists()  # never replace a real toolkit directory
            if ours and (not link.is_symlink() or os.readlink(link) != str(want_cuda)):
                link.parent.mkdir(parents=True, exist_ok=True)
                atomic_symlink(want_cuda, link)
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
            return (
                f"{link} is a real directory (not managed by bwstack), left untouched: processes use the "
                f"generation's toolkit through CUDA_HOME (set by the env itself)"
            )
        return None

    # -- retention ---------------------------------------------------------------------------------

    def prune(self, keep: int) -> list[str]:
        if keep < 1:
            raise UsageError("--keep must be at least 1")
        gens = self.generations()
        active = self.active()
        last_verified = max((g for g in gens if g.verified), key=lambda g: g.id, default=None)
        protected = {g.name for g in (active, last_verified) if g is not None}
        newest = {g.name for g in gens[-keep:]}
        removed = []
        for gen in gens:
            if gen.name in protected or gen.name in newest:
                continue
            trash = self.layout.generations / f"{BUILDING_PREFIX}pruned-{gen.name}"
            os.rename(gen.path, trash)  # out of sight in one step; a kill leaves debris `prepare` removes
            remove_tree(trash)
            removed.append(gen.name)
        return removed


# ------------------------------------------------------------------------------------------------ helpers


def seal(env: Path) -> None:
    """Files read-only for everyone and nothing group- or world-writable. Directories stay writable by
    their owner so Python can write __pycache__; installers replace files (new inodes) rather than
    writing through, so a hard link shared with another generation is never modified."""
    for dirpath, dirnames, filenames in os.walk(env):
        for name in filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode):
                mode = stat.S_IMODE(st.st_mode) & ~0o222
                if mode != stat.S_IMODE(st.st_mode):
                    os.chmod(path, mode)
        for name in dirnames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            if stat.S_ISDIR(st.st_mode) and st.st_mode & 0o022:
                os.chmod(path, stat.S_IMODE(st.st_mode) & ~0o022)
    st = os.stat(env)
    if st.st_mode & 0o022:
        os.chmod(env, stat.S_IMODE(st.st_mode) & ~0o022)


def remove_tree(path: Path) -> None:
    def _writable(func, p, _exc):  # sealed files sit in directories we may have made read-only
        os.chmod(os.path.dirname(p), 0o755)
        func(p)

    if path.is_symlink():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path, onerror=_writable)


HOOK_SOURCE = '''"""Written by bwstack into generation {name} (do not edit; part of its manifest).

Pins this process to the generation it started in (so a switch never changes the code a running server
imports later, nor the interpreter its workers start with), and points CUDA_HOME at this generation's own
toolkit unless the user chose another one: FlashInfer's JIT compiles with $CUDA_HOME/bin/nvcc.
"""

import os
import sys


def _pin() -> None:
    prefix = sys.prefix
    real = os.path.realpath(prefix)
    if real != prefix:
        sys.path[:] = [real + p[len(prefix):] if p == prefix or p.startswith(prefix + os.sep) else p for p in sys.path]
        if sys.executable.startswith(prefix + os.sep):
            sys.executable = real + sys.executable[len(prefix):]
    generation = os.path.dirname(real)
    cuda = os.path.join(generation, "cuda")
    os.environ["BWSTACK_GENERATION"] = os.path.basename(generation)
    if not os.path.isdir(cuda):
        return
    root = os.path.dirname(os.path.dirname(generation))
    chosen = os.environ.get("CUDA_HOME", "")
    managed = not chosen or chosen.startswith(root + os.sep)
    if not managed and os.path.islink(chosen):
        managed = os.readlink(chosen).startswith(root + os.sep)
    if managed:
        os.environ["CUDA_HOME"] = os.path.realpath(cuda)


try:
    _pin()
except Exception:  # never break interpreter start-up
    pass
'''


def write_hook(env: Path, name: str) -> None:
    sp = envinspect.site_packages(env)
    (sp / HOOK_MODULE).write_text(HOOK_SOURCE.format(name=name))
    (sp / HOOK_PTH).write_text("import _bwstack_generation\n")


def post_switch_check(ml_env: Path, gen: Generation) -> dict:
    """Run the env through the ml-env path: the interpreter starts, and torch reports the recorded versions."""
    python = ml_env / "bin" / "python"
    code = (
        "import json, os, sys\n"
        "out = {'generation': os.environ.get('BWSTACK_GENERATION'), 'python': sys.version.split()[0],\n"
        "       'prefix': os.path.realpath(sys.prefix),\n"
        "       'cuda_home': os.environ.get('CUDA_HOME')}\n"
        "try:\n"
        "    import torch\n"
        "    out['torch'] = torch.__version__; out['torch_cuda'] = torch.version.cuda\n"
        "except ImportError as exc:\n"
        "    out['torch_error'] = str(exc)\n"
        "print(json.dumps(out))\n"
    )
    started = time.perf_counter()
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "PYTHONPATH", "PYTHONHOME")}
    try:
        result = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=300, env=env)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BwstackError(f"post-switch check: {python} did not run ({exc}); switched back") from None
    if result.returncode != 0:
        raise BwstackError(f"post-switch check: {python} failed: {result.stderr.strip()[-400:]}; switched back")
    facts = json.loads(result.stdout.strip().splitlines()[-1])
    facts["seconds"] = round(time.perf_counter() - started, 3)
    if facts.get("generation") != gen.name and facts.get("prefix") != str(gen.env.resolve()):
        raise BwstackError(f"post-switch check: {ml_env} runs {facts.get('generation')}, expected {gen.name}")
    want_torch = gen.record.get("torch", {})
    if want_torch.get("version"):
        if "torch_error" in facts:
            raise BwstackError(f"post-switch check: import torch failed in {gen.name}: {facts['torch_error']}")
        if facts.get("torch") != want_torch["version"] or facts.get("torch_cuda") != want_torch.get("cuda"):
            raise BwstackError(
                f"post-switch check: torch {facts.get('torch')} (CUDA {facts.get('torch_cuda')}) in {gen.name}, "
                f"recorded {want_torch['version']} (CUDA {want_torch.get('cuda')})"
            )
    return facts


# ------------------------------------------------------------------------------------------------ exchange

_RENAME_EXCHANGE = 2


def exchange(a: Path, b: Path) -> None:
    """Swap two paths atomically (renameat2 RENAME_EXCHANGE): used to turn a real ml-env directory into
    bwstack's link without a moment where the path does not exist."""
    libc = ctypes.CDLL(None, use_errno=True)
    func = getattr(libc, "renameat2", None)
    if func is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available in this libc")
    at_fdcwd = -100
    if func(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(a))
