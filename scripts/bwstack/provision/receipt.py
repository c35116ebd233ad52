"""The provision receipt: what a node was last provisioned from, and what that run left on it.

A full provision run that verified ends by writing `<root>/provisioned.json`: the digest of the run's inputs
(the controller's lock and bwstack wheel, and every role setting that shapes the node, digested by the play)
and a fingerprint of each thing the run made: the active generation (its link, and its tree against the
facts sealed with it), the env and CUDA links, and the files and directories the play names (the node's lock
copy, the tool venv's wheel record, the PATH wrapper, the CUDA toolkit, the package database, the
remembered waivers), with the GPUs the driver drives (which the skipped preflight would judge again) and the
standard libraries of the interpreters the tool venv and the env run on.

The next run asks first (`bwstack receipt --check`). Same inputs and every fingerprint unchanged: no role
could change anything, so the play goes straight to verify, which still checks the node for real. Anything
else (another lock, wheel or setting, an apt run, a moved link, a touched file, a drifted generation, a
missing or unreadable receipt) and every role runs as before. The fingerprints over-approximate on purpose:
a false "changed" costs one full run; a false "converged" would hide a change.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from bwstack.errors import BwstackError
from bwstack.fsutil import atomic_write_text
from bwstack.probe import envinspect, sealed
from bwstack.probe.treecheck import sha256_file
from bwstack.store.generations import Store
from bwstack.store.layout import Layout

NAME = "provisioned.json"
FORMAT = 1
MAX_BYTES = 1 << 20
HASHED_FILE_LIMIT = 64 << 20  # larger files are fingerprinted by their stat, not their bytes
# One folder per GPU the driver drives, named by its bus id, each with an `information` file.
GPUS = "/proc/driver/nvidia/gpus"
# The lines of `information` that say which GPU sits where (its IRQ and DMA fields may change at a reboot).
GPU_FIELDS = ("Model", "GPU UUID", "Bus Location", "Device Minor", "GPU Excluded")
MAX_GPUS = 256


@dataclass(frozen=True)
class Verdict:
    converged: bool
    why: str  # what differs, or what matched
    receipt: str
    # Every recorded or watched name whose fingerprint differs (the roles repair what they own from it: a tool
    # venv listed here is made again, not recorded as it now is). Empty when the receipt could not be compared.
    changed: tuple[str, ...] = ()
    compared: bool = False  # a receipt was read and compared: `changed` is the whole list (else nothing is known)

    def as_dict(self) -> dict:
        return {
            "converged": self.converged,
            "why": self.why,
            "receipt": self.receipt,
            "changed": list(self.changed),
            "compared": self.compared,
        }


def _link(path: Path | None) -> str:
    if path is None:
        return "none"
    try:
        return "l:" + os.readlink(path)
    except FileNotFoundError:
        return "absent"
    except OSError as exc:
        return "not a link" if exc.errno == errno.EINVAL else f"unreadable: {exc.strerror}"


def fingerprint(path: str, *, follow: bool = True) -> str:
    """What is at `path`: a link's target (and what it resolves to), a file's bytes (its stat when large), a
    directory's whole tree without following links in it (kind, inode, size, mtime, mode and owner of every
    path, and the newest inode change time among them: sealed.generation_stamp)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "absent"
    except OSError as exc:
        return f"unreadable: {exc.strerror}"
    except ValueError:  # a NUL in a path read from a file
        return "unreadable: not a path"
    owner = f"{stat.S_IMODE(st.st_mode):o} {st.st_uid} {st.st_gid}"
    if stat.S_ISLNK(st.st_mode):
        # read, never written through: what the link names is part of what the run saw (/etc/os-release)
        target = "l:" + os.readlink(path)
        return target + " -> " + fingerprint(os.path.realpath(path), follow=False) if follow else target
    if stat.S_ISDIR(st.st_mode):
        # With the newest inode change time: a file written in place with its mtime put back (a module of the
        # tool's venv edited by hand) keeps every other field.
        tree = sealed.generation_stamp(Path(path))
        return f"d:{owner}:{tree.method}:{tree.digest}:{tree.newest_change}"
    if stat.S_ISREG(st.st_mode) and st.st_size == 0:
        return f"f:{owner}:" + _pseudo_file_digest(path)
    if stat.S_ISREG(st.st_mode) and st.st_size <= HASHED_FILE_LIMIT:
        try:
            return f"f:{owner}:" + sha256_file(Path(path))
        except OSError as exc:
            return f"unreadable: {exc.strerror}"
    return f"s:{owner}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"


def _pseudo_file_digest(path: str) -> str:
    """An empty file, or a /proc or /sys one (size 0, content made on read, in small reads only)."""
    data = _pseudo_file(path)
    return data if isinstance(data, str) else hashlib.sha256(data).hexdigest()


def _pseudo_file(path: str) -> bytes | str:
    """The bytes of a /proc or /sys file (read in small pieces, at most MAX_BYTES), or why not ("unreadable: ...")."""
    chunks: list[bytes] = []
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            for _ in range(MAX_BYTES // 4096):
                chunk = os.read(fd, 4096)
                if not chunk:
                    break
                chunks.append(chunk)
        finally:
            os.close(fd)
    except OSError as exc:
        return f"unreadable: {exc.strerror}"
    return b"".join(chunks)


def gpus(folder: str = GPUS) -> str:
    """Which GPUs the driver drives, and where: what the skipped preflight judged (their model and count). A GPU
    swapped, added, removed or excluded is a change. Read from the driver's own files, not nvidia-smi, so that
    the converged check costs no process start."""
    try:
        names = sorted(os.listdir(folder))
    except FileNotFoundError:
        return "absent"
    except OSError as exc:
        return f"unreadable: {exc.strerror}"
    if len(names) > MAX_GPUS:
        return f"unreadable: {len(names)} entries"
    rows = []
    for name in names:
        data = _pseudo_file(os.path.join(folder, name, "information"))
        text = data if isinstance(data, str) else data.decode("utf-8", "replace")
        fields = {}
        for line in text.splitlines():
            key, sep, value = line.partition(":")
            if sep and key.strip() in GPU_FIELDS:
                fields[key.strip()] = " ".join(value.split())
        rows.append(
            f"{name}=" + ";".join(f"{k}:{fields.get(k, '?')}" for k in GPU_FIELDS) if fields else f"{name}={text}"
        )
    return "g:" + hashlib.sha256("\n".join(rows).encode()).hexdigest()


KERNEL_TREES = ("/proc/", "/sys/", "/dev/")  # content made on read: never read as an interpreter's file


@dataclass(frozen=True)
class Interpreter:
    """What a venv's base interpreter runs from: its standard library, its binary and its shared libpython."""

    stdlib: Path
    binary: str
    libpython: str | None


def _regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except (OSError, ValueError):
        return False


def _stdlib_of(prefix: Path, version: str) -> Path | None:
    """The standard library under an interpreter's prefix, found by its landmark (os.py), as CPython finds it."""
    for lib in ("lib", "lib64"):
        stdlib = prefix / lib / f"python{version}"
        if _regular(stdlib / "os.py"):
            return stdlib
    return None


def _base_of(env: Path) -> Interpreter | None:
    """The interpreter a venv runs on: pyvenv.cfg's `home` (its bin folder) and version."""
    keys = envinspect.pyvenv_cfg(env)
    home = keys.get("home", "")
    parts = (keys.get("version_info") or keys.get("version") or "").split(".")
    if not home.startswith("/") or not home.isprintable() or len(parts) < 2 or not all(p.isdigit() for p in parts[:2]):
        return None
    version = f"{parts[0]}.{parts[1]}"
    prefix = Path(home).parent
    stdlib = _stdlib_of(prefix, version)
    if stdlib is None:
        return None
    shared = stdlib.parent / f"libpython{version}.so.1.0"
    return Interpreter(stdlib, os.path.realpath(env / "bin" / "python"), str(shared) if _regular(shared) else None)


def _this_interpreter() -> Interpreter:
    libdir, soname = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME")
    shared = (
        os.path.join(libdir, soname) if sysconfig.get_config_var("Py_ENABLE_SHARED") and libdir and soname else None
    )
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return Interpreter(stdlib, os.path.realpath(sys.executable), shared if shared and _regular(Path(shared)) else None)


def _file_print(path: str) -> str:
    """A file an interpreter loads, through its links, unless they lead into /proc, /sys or /dev."""
    real = os.path.realpath(path)
    if real.startswith(KERNEL_TREES):
        return f"refused: {path} leads to {real}"
    return fingerprint(path)


def interpreters(env: Path | None) -> dict[str, str]:
    """The interpreters this tool (its venv's base interpreter: this process's) and the active env run on: each
    standard library (a tree stamp), the sitecustomize it imports at start-up (Debian's is a link into /etc), the
    binary and the shared libpython. They lie outside what the store seals, and no package database records an
    interpreter rebuilt in place (pyenv) or edited by hand. `env` None: no trusted active generation to read."""
    items: dict[str, str] = {}
    env_base = _base_of(env) if env is not None else None
    for name, base in (("python:tool", _this_interpreter()), ("python:env", env_base)):
        if base is None:
            items[name] = "none" if env is None else "unknown"
            continue
        items[name] = f"{base.stdlib}: {fingerprint(str(base.stdlib))}"
        items[name + ":sitecustomize"] = _file_print(str(base.stdlib / "sitecustomize.py"))
        items[name + ":binary"] = f"{base.binary}: {_file_print(base.binary)}"
        items[name + ":libpython"] = f"{base.libpython}: {_file_print(base.libpython)}" if base.libpython else "none"
    return items


def observe(layout: Layout, watch: list[str]) -> tuple[dict[str, str], str | None]:
    """The node's fingerprints, and why the active generation cannot be trusted unchanged (None: it can)."""
    items = {
        "current": _link(layout.current),
        "ml-env": _link(layout.ml_env),
        "cuda-link": _link(layout.cuda_link),
        "gpus": gpus(),
    }
    problem = Store(layout, log=lambda _message: None).current_problem()
    target = layout.current.parent / items["current"][2:] if items["current"].startswith("l:") else None
    if problem is None:
        # The generation's tree as sealed; the host is compared with the last provision run's (below), not with
        # the one the generation was built on: after an apt upgrade since the build, no receipt could ever be
        # written again, and every provision run failed at its end (the verify before it reads the facts again).
        problem = "no active generation" if target is None else sealed.unchanged_generation(target / "env", host=False)
    if target is not None and problem is None:
        items["generation"] = ":".join(sealed.tree_stamp(target / "env"))
        items["host"] = sealed.host_fingerprint(target / "env")
    items.update(interpreters(target / "env" if target is not None and problem is None else None))
    for path in sorted(set(watch)):
        items[path] = fingerprint(path)
    return items, problem


def _read(path: Path) -> dict:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise ValueError("no receipt: the node has not finished a provision run with this bwstack") from None
    except OSError as exc:
        raise ValueError(f"receipt unreadable ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as handle:
        st = os.fstat(handle.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_BYTES:
            raise ValueError("the receipt is not a small regular file")
        data = handle.read(MAX_BYTES + 1)
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raise ValueError("the receipt is not JSON") from None
    if (
        not isinstance(doc, dict)
        or doc.get("format") != FORMAT
        or not isinstance(doc.get("inputs"), str)
        or not isinstance(doc.get("items"), dict)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in doc["items"].items())
    ):
        raise ValueError(f"the receipt is not a format-{FORMAT} receipt")
    return doc


def check(layout: Layout, inputs: str, watch: list[str]) -> Verdict:
    path = layout.root / NAME
    try:
        doc = _read(path)
    except ValueError as exc:
        return Verdict(False, str(exc), str(path))
    items, problem = observe(layout, watch)
    recorded = doc["items"]
    # Listed whatever else differs too (new inputs, a drifted generation): what changed is repaired, not recorded.
    changed = tuple(name for name in sorted(set(items) | set(recorded)) if items.get(name) != recorded.get(name))
    if doc["inputs"] != inputs:
        return Verdict(False, "the inputs changed (lock, bwstack wheel or a role setting)", str(path), changed, True)
    if problem is not None:
        return Verdict(False, problem, str(path), changed, True)
    if changed:
        return Verdict(False, f"{changed[0]} changed since the last provision run", str(path), changed, True)
    generation = items["current"].rsplit("/", 1)[-1]
    why = f"provisioned from these inputs; {generation} and every watched path unchanged"
    return Verdict(True, why, str(path), compared=True)


def write(layout: Layout, inputs: str, watch: list[str]) -> bool:
    """Record the node as provisioned from `inputs`; True when that changed the receipt."""
    items, problem = observe(layout, watch)
    if problem is not None:
        raise BwstackError(f"not writing a provision receipt: {problem}")
    doc = {"format": FORMAT, "inputs": inputs, "items": items}
    path = layout.root / NAME
    try:
        if _read(path) == doc:
            return False
    except ValueError:
        pass
    atomic_write_text(path, json.dumps(doc, indent=1, sort_keys=True))
    return True
