"""Where acceptance reads a node's facts: a root directory for sysfs/procfs files and a command runner.

Node-side: standard library and bwstack.probe only (it ships in the probe zipapp). The live machine is root "/"
and runs the commands below. A recorded machine description is a directory that holds the same files under the
same paths (sys/..., proc/..., etc/...) and the commands' outputs under commands/: `<name>.txt` (stdout),
`<name>.exit` (exit status, 0 when absent), `<name>.stderr` and `<name>.argv` (both optional). Reading changes
nothing: files are opened read-only, commands only query, nothing is written on the node (a recording writes
only into the directory the user names: private, through descriptors, following no link).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from bwstack.probe import dirfd, pathtrust

MAX_FILE_BYTES = 1 << 20  # sysfs/procfs files are small; a bigger one is not what we asked for
MAX_OUTPUT_BYTES = 16 << 20  # a kernel log since boot can be large
COMMAND_TIMEOUT_S = 60  # nvidia-smi can hang on a wedged GPU: that must not hang acceptance
SEARCH_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
UNREADABLE_FILE = "unreadable.json"  # in a recording: files that exist but could not be read, and why

# The commands acceptance runs, by name. Alternatives are tried in order; the first that succeeds answers
# (the kernel log: `dmesg` needs root where kernel.dmesg_restrict=1, the journal may still have it).
COMMANDS: dict[str, tuple[tuple[str, ...], ...]] = {
    "lspci": (("lspci", "-D", "-vvv"),),
    "nvidia-smi-gpus": (
        (
            "nvidia-smi",
            "--query-gpu=index,pci.bus_id,name,compute_cap,driver_version,memory.total,persistence_mode",
            "--format=csv,noheader,nounits",
        ),
    ),
    "nvidia-smi-topo": (("nvidia-smi", "topo", "-m"),),
    "nvidia-smi-p2p": (("nvidia-smi", "topo", "-p2p", "r"),),
    "modinfo-nvidia": (("modinfo", "nvidia"),),
    "kernel-log": (("dmesg",), ("journalctl", "-k", "-b", "0", "--no-pager", "-q")),
    "ldconfig": (("ldconfig", "-p"),),
    "persistenced": (("systemctl", "is-active", "nvidia-persistenced.service"),),
    "fabricmanager": (("systemctl", "is-active", "nvidia-fabricmanager.service"),),
}


@dataclass(frozen=True)
class Unknown:
    """A fact that could not be read, and why (never a guess in its place)."""

    why: str


@dataclass(frozen=True)
class Output:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def failure(self) -> str:
        """One line saying how the command failed."""
        text = (self.stderr.strip() or self.stdout.strip()).splitlines()
        shown = " ".join(a if len(a) <= 40 else a[:24] + "..." for a in self.argv)
        return f"`{shown}` exited {self.returncode}" + (f": {text[0][:200]}" if text else "")


def stdout_of(out: Output | Unknown) -> str | Unknown:
    """A command's output, or why there is none (it could not run, or it failed)."""
    if isinstance(out, Unknown):
        return out
    return out.stdout if out.ok else Unknown(out.failure())


class Machine:
    """Files under `root` and commands from `runner`. Every read returns the text or an Unknown."""

    def __init__(
        self, root: str | Path = "/", commands: Path | None = None, label: str = "", root_fd: int | None = None
    ) -> None:
        self.root = Path(root)
        self.commands = commands  # a recorded description's commands/ directory; None runs them for real
        self.live = commands is None and str(root) == "/"
        self.label = label or ("this machine" if self.live else str(root))
        self._unreadable: dict[str, str] = {}
        # A recorded description is read through a descriptor of its folder, opened once, and every path in it
        # is looked up beneath it (dirfd.open_beneath): its owner may be another user, who could swap a name for
        # a link to a file only root may read while root replays it.
        if root_fd is not None:
            self._root_fd = root_fd
        else:
            self._root_fd = -1 if self.live else dirfd.open_trusted_folder(self.root)
        if not self.live:
            try:
                self._unreadable = self._load_unreadable()
            except BaseException:
                if root_fd is None:
                    self.close()  # opened here; a descriptor handed in is its giver's to close
                else:
                    self._root_fd = -1
                raise

    def _load_unreadable(self) -> dict[str, str]:
        """A recording's unreadable.json: path -> why it could not be read (ValueError when it is not that)."""
        saved = self.root / UNREADABLE_FILE
        data = self._own_file(UNREADABLE_FILE, MAX_FILE_BYTES)
        doc: object = {}
        try:
            doc = json.loads(data) if isinstance(data, str) else {}
        except (ValueError, RecursionError) as exc:  # RecursionError: [[[[... nested past the parser's depth
            data = Unknown(f"not a JSON object of path -> reason ({type(exc).__name__})")
        well_formed = isinstance(doc, dict) and all(isinstance(v, str) for v in doc.values())
        if isinstance(data, Unknown) or not well_formed:
            why = data.why if isinstance(data, Unknown) else "not a JSON object of path -> reason"
            raise ValueError(f"{saved}: {why}")
        assert isinstance(doc, dict)
        return {k: " ".join(v.split()) for k, v in doc.items()}  # a reason is one line of a report

    @classmethod
    def recorded(cls, directory: str | Path) -> Machine:
        """A recorded machine description (raises ValueError when `directory` is not one)."""
        path = Path(directory)
        try:
            fd = dirfd.open_trusted_folder(path)
        except dirfd.OthersLink as exc:
            raise ValueError(f"{path}: {exc.filename} is {exc.strerror}: name the recording's folder itself") from None
        except (FileNotFoundError, NotADirectoryError):
            raise ValueError(f"{path}: no such directory") from None
        except OSError as exc:
            raise ValueError(f"{path}: {exc.strerror or exc}") from None
        try:
            if not any(_is_folder(part, fd) for part in ("sys", "proc", "commands")):
                raise ValueError(f"{path}: not a recorded machine description (no sys/, proc/ or commands/ in it)")
            return cls(path, commands=path / "commands", label=str(path), root_fd=fd)
        except BaseException:
            os.close(fd)
            raise

    def close(self) -> None:
        """Let go of what the machine holds (a recording's folder)."""
        if self._root_fd >= 0:
            os.close(self._root_fd)
            self._root_fd = -1

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    # ---------------------------------------------------------------------------------------------- files

    def _opened(self, path: str) -> int:
        """A descriptor of machine path `path` (a recorded one: beneath the recording, dirfd.open_beneath)."""
        if self.live:
            # O_NONBLOCK: a FIFO must not hang the read.
            return os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        if self._root_fd < 0:
            raise OSError(errno.EBADF, "the recording was let go")
        return dirfd.open_beneath(self._root_fd, path)

    def _recorded_file(self, path: str, limit: int) -> str | Unknown:
        """The text of a regular file at machine path `path`, at most `limit` bytes."""
        fd = self._looked_up(path, "opened")
        if isinstance(fd, Unknown):
            return fd
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return Unknown(f"{path} is not a regular file")
            data = _read_upto(fd, limit + 1)
        except OSError as exc:
            return Unknown(f"{path} cannot be read: {exc.strerror}")
        finally:
            os.close(fd)
        if len(data) > limit:
            return Unknown(f"{path} is larger than {limit // 1024} KiB: not the file expected there")
        return data.decode("utf-8", errors="replace")

    def _own_file(self, rel: str, limit: int) -> str | Unknown | None:
        """A file of the recording itself (its commands' outputs, unreadable.json): a plain file reached through
        plain folders, no link anywhere; None when it is not there."""
        *folders, name = rel.split("/")
        fds: list[int] = []
        try:
            fd = self._root_fd
            for folder in folders:
                fd = dirfd.open_folder(folder, fd)
                fds.append(fd)
            fds.append(os.open(name, dirfd.READ_FLAGS, dir_fd=fd))
            if not stat.S_ISREG(os.fstat(fds[-1]).st_mode):
                return Unknown(f"{rel} in {self.label} is not a plain file")
            data = _read_upto(fds[-1], limit + 1)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                return Unknown(f"{rel} in {self.label} is not a plain file")
            return Unknown(f"{rel} in {self.label} cannot be read: {exc.strerror}")
        finally:
            for fd in fds:
                os.close(fd)
        if len(data) > limit:
            return Unknown(f"{rel} in {self.label} is too large")
        return data.decode("utf-8", errors="replace")

    def read(self, path: str) -> str | Unknown:
        if path in self._unreadable:
            return Unknown(self._unreadable[path])
        return self._recorded_file(path, MAX_FILE_BYTES)

    def _looked_up(self, path: str, failing: str, parent: bool = False) -> int | Unknown:
        """A descriptor of machine path `path` (with `parent`: of the folder it is in), or why there is none;
        `failing` says what could not be done with it ("opened", "listed", "looked up")."""
        if not path.startswith("/") or "\0" in path:
            return Unknown(f"{path!r} is not an absolute path")
        try:
            if parent:
                return self._opened(os.path.dirname(path.rstrip("/")) or "/")
            return self._opened(path)
        except dirfd.Outside:
            return Unknown(f"{path} leads outside the recorded machine {self.label}")
        except FileNotFoundError:
            return Unknown(f"{path} does not exist")
        except PermissionError:
            return Unknown(f"{path} is not readable by this user (run as root)")
        except OSError as exc:
            return Unknown(f"{path} cannot be {failing}: {exc.strerror}")

    def _parent_and_name(self, path: str) -> tuple[int, str] | Unknown:
        fd = self._looked_up(path, "looked up", parent=True)
        return fd if isinstance(fd, Unknown) else (fd, os.path.basename(path.rstrip("/")))

    def readlink(self, path: str) -> str | Unknown:
        if self.live:
            try:
                return os.readlink(path)
            except FileNotFoundError:
                return Unknown(f"{path} does not exist")
            except OSError as exc:
                return Unknown(f"{path} is not a symbolic link ({exc.strerror})")
        found = self._parent_and_name(path)
        if isinstance(found, Unknown):
            return found
        fd, name = found
        try:
            return os.readlink(name, dir_fd=fd)
        except FileNotFoundError:
            return Unknown(f"{path} does not exist")
        except OSError as exc:
            return Unknown(f"{path} is not a symbolic link ({exc.strerror})")
        finally:
            os.close(fd)

    def listdir(self, path: str) -> list[str] | Unknown:
        fd = self._looked_up(path, "listed")
        if isinstance(fd, Unknown):
            return fd
        try:
            return sorted(os.listdir(fd))
        except OSError as exc:
            return Unknown(f"{path} cannot be listed: {exc.strerror}")
        finally:
            os.close(fd)

    def exists(self, path: str) -> bool:
        """Whether `path` is there (a recorded one: and, when a link, what it leads to inside the recording)."""
        if self.live:
            return os.path.lexists(path)
        if not path.startswith("/") or "\0" in path:
            return False
        try:
            os.close(self._opened(path))
        except (dirfd.Outside, FileNotFoundError, NotADirectoryError):
            return False
        except OSError as exc:
            return exc.errno != errno.ELOOP  # there, but not for this user to open
        return True

    # ---------------------------------------------------------------------------------------------- commands

    def run(self, name: str) -> Output | Unknown:
        if name not in COMMANDS:
            raise KeyError(name)  # a programming error, not a fact
        if self.commands is not None:
            return self._recorded(name)
        if not self.live:
            return Unknown(f"commands are not run for {self.label}")
        return _run_live(COMMANDS[name])

    def _recorded(self, name: str) -> Output | Unknown:
        assert self.commands is not None
        parts = {}
        folder = os.path.relpath(self.commands, self.root)
        for suffix in (".txt", ".exit", ".stderr", ".argv"):
            text = self._own_file(f"{folder}/{name}{suffix}", MAX_OUTPUT_BYTES)
            if isinstance(text, Unknown):
                return text
            if text is not None:
                parts[suffix] = text
        if not parts:
            return Unknown(f"`{name}` was not recorded in {self.label}")
        try:
            code = int(parts.get(".exit", "0").strip() or "0")
        except ValueError:
            return Unknown(f"commands/{name}.exit in {self.label} is not an exit status")
        argv = tuple(parts[".argv"].split()) if ".argv" in parts else COMMANDS[name][0]
        return Output(argv, code, parts.get(".txt", ""), parts.get(".stderr", ""))


def _read_upto(fd: int, limit: int) -> bytes:
    chunks, size = [], 0
    while size < limit:
        chunk = os.read(fd, min(1 << 20, limit - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _run_live(alternatives: tuple[tuple[str, ...], ...]) -> Output | Unknown:
    env = {"PATH": SEARCH_PATH + ":" + os.environ.get("PATH", ""), "LC_ALL": "C", "LANG": "C"}
    last: Output | Unknown = Unknown(f"{alternatives[0][0]} is not installed")
    for argv in alternatives:
        program = shutil.which(argv[0], path=env["PATH"])
        if program is None:
            continue
        try:
            done = subprocess.run(
                [program, *argv[1:]],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=COMMAND_TIMEOUT_S,
                env=env,
                check=False,
            )
        except subprocess.TimeoutExpired:
            last = Unknown(f"`{' '.join(argv)}` did not answer within {COMMAND_TIMEOUT_S} s")
            continue
        except OSError as exc:
            last = Unknown(f"`{' '.join(argv)}` could not start: {exc.strerror}")
            continue
        last = Output(
            argv,
            done.returncode,
            done.stdout[:MAX_OUTPUT_BYTES].decode("utf-8", errors="replace"),
            done.stderr[:MAX_OUTPUT_BYTES].decode("utf-8", errors="replace"),
        )
        if last.ok:
            return last
    return last


def _not_private(fd: int) -> str | None:
    """Why the folder open as `fd` is not fit for a recording: another owner, writable by others (a private
    group aside), an access ACL, or not empty. The checks are the descriptor's, so a swap after them is moot."""
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        return f"belongs to uid {st.st_uid}, not to this user"
    if st.st_mode & 0o002 or (st.st_mode & 0o020 and not pathtrust.private_group(st.st_gid)):
        return "is writable by others"
    if pathtrust.has_acl(fd):
        return "is given to others by an access ACL"
    if os.listdir(fd):
        return "is not empty"
    return None


def _open_recording(directory: Path) -> int:
    """`directory` opened for a recording: made (0700; parents as os.makedirs makes them) when missing, else an
    empty folder of this user's that nobody else can write. Raises ValueError (unfit) or OSError (a link)."""
    os.makedirs(directory.parent, exist_ok=True)
    with contextlib.suppress(FileExistsError):  # there already: judged below by what the open finds
        os.mkdir(directory, 0o700)
    fd = dirfd.open_folder(directory)
    try:
        why = _not_private(fd)
        if why:
            raise ValueError(f"{directory} {why}: a recording goes into a new folder or an empty one of this user's")
        os.fchmod(fd, 0o700)  # the recording holds the kernel log: private, whatever the folder's mode was
    except BaseException:
        os.close(fd)
        raise
    return fd


def _is_folder(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISDIR(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _exists(name: str, dir_fd: int) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


class Recorder(Machine):
    """The live machine, read as usual, with every file, link, listing and command output also written into
    `directory`: a recorded machine description of this node that replays the same facts offline.

    Root records: every write is relative to a descriptor of the folder opened once (and checked) here, with no
    link followed, so a name swapped in the recording cannot turn a write into one elsewhere. Folders are 0700,
    files 0600 (the kernel log is in it). close() (or `with`) lets the folder go."""

    def __init__(self, directory: str | Path) -> None:
        super().__init__("/")
        self.out = Path(directory)
        self.label = "this machine, recorded"
        self._root = _open_recording(self.out)
        try:
            with self._folder(("commands",)):
                pass
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._root >= 0:
            os.close(self._root)
            self._root = -1

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _parts(self, path: str) -> tuple[str, ...]:
        parts = tuple(p for p in path.split("/") if p)
        if any(p in (".", "..") for p in parts):
            raise ValueError(f"refusing to record {path!r}")
        return parts

    def _split(self, path: str) -> tuple[tuple[str, ...], str]:
        parts = self._parts(path)
        if not parts:
            raise ValueError(f"refusing to record {path!r}")
        return parts[:-1], parts[-1]

    def _open_folder(self, parts: tuple[str, ...]) -> int:
        """A new descriptor of the recording's folder `parts`, each made (0700) when missing."""
        fd = os.dup(self._root)
        try:
            for depth, name in enumerate(parts, 1):
                try:
                    sub = dirfd.open_folder(name, fd, make=0o700)
                except OSError as exc:  # a link (ELOOP) or a file (ENOTDIR): refused, never followed
                    where = os.path.join(self.out, *parts[:depth])
                    why = f"{exc.strerror} (the recording needs its own folder there)"
                    raise OSError(exc.errno, why, where) from None
                os.close(fd)
                fd = sub
        except BaseException:
            os.close(fd)
            raise
        return fd

    @contextlib.contextmanager
    def _folder(self, parts: tuple[str, ...]) -> Iterator[int]:
        fd = self._open_folder(parts)
        try:
            yield fd
        finally:
            os.close(fd)

    def _write(self, folder: tuple[str, ...], name: str, text: str) -> None:
        """`text` as the file `name` in `folder`: a new private file renamed over the name (a link or file there
        is replaced, never written through)."""
        with self._folder(folder) as fd:
            dirfd.replace(fd, name, [text.encode("utf-8")], mode=0o600)

    def _save_unreadable(self, path: str, why: str) -> None:
        self._unreadable[path] = why
        self._write((), UNREADABLE_FILE, json.dumps(self._unreadable, indent=1, sort_keys=True) + "\n")

    def read(self, path: str) -> str | Unknown:
        text = super().read(path)
        if isinstance(text, str):
            self._write(*self._split(path), text)
        elif os.path.lexists(path):  # there but unreadable: keep why, so the replay says the same
            self._save_unreadable(path, text.why)
        return text

    def readlink(self, path: str) -> str | Unknown:
        target = super().readlink(path)
        if isinstance(target, str):
            folder, name = self._split(path)
            with self._folder(folder) as fd:
                if not _exists(name, fd):
                    os.symlink(target, name, dir_fd=fd)
        return target

    def listdir(self, path: str) -> list[str] | Unknown:
        names = super().listdir(path)
        if isinstance(names, list):
            with self._folder(self._parts(path)) as fd:
                for name in names:
                    source = os.path.join(path, name)
                    if "/" in name or _exists(name, fd):
                        continue
                    if os.path.islink(source):
                        os.symlink(os.readlink(source), name, dir_fd=fd)
                    elif os.path.isdir(source):
                        os.mkdir(name, 0o700, dir_fd=fd)
        return names

    def run(self, name: str) -> Output | Unknown:
        result = super().run(name)
        if isinstance(result, Unknown):  # replayed as the failure it was, not as "not recorded"
            result = Output(COMMANDS[name][0], 127, "", result.why)
        folder = ("commands",)
        self._write(folder, name + ".txt", result.stdout)
        self._write(folder, name + ".argv", " ".join(result.argv) + "\n")
        if result.returncode:
            self._write(folder, name + ".exit", f"{result.returncode}\n")
        if result.stderr:
            self._write(folder, name + ".stderr", result.stderr)
        return result
