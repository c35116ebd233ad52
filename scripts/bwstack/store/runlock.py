"""One bwstack run at a time per store: an flock the kernel drops when the holder dies, even by SIGKILL.

The lock file is opened without following links (a link planted at <root>/bwstack.lock is refused, never
followed), and a full disk never stops a run from taking it: naming the holder is best effort.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import stat
import sys
import time
from pathlib import Path

from bwstack.errors import BusyError, UsageError

NAME = "bwstack.lock"


class RunLock:
    """Exclusive lock on <root>/bwstack.lock; the file names the holder so a second run can say who."""

    def __init__(self, root: Path, command: str | None = None) -> None:
        self.root = Path(root)
        self.path = self.root / NAME
        self.command = command or " ".join(["bwstack", *sys.argv[1:]])
        self.fd: int | None = None

    def _open(self) -> int:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        except PermissionError:
            raise UsageError(
                f"{self.root}: permission denied: this store belongs to another user (run as its owner, or pass "
                f"--root for a store of your own)"
            ) from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UsageError(f"{self.path} is a symbolic link; refusing to follow it (remove it)") from None
            if exc.errno in (errno.ENOTDIR, errno.EEXIST):
                raise UsageError(f"{self.root} is not a directory; refusing to use it as the store") from None
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise UsageError(f"{self.root}: the disk is full and the store has no lock file yet") from None
            raise

    def __enter__(self) -> RunLock:
        fd = self._open()
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise UsageError(f"{self.path} is not a regular file; refusing to use it")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(fd)
            os.close(fd)
            raise BusyError(
                f"another bwstack run holds {self.path}: {holder}; wait for it to finish (the lock is released "
                f"automatically when that process exits)"
            ) from None
        holder = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "command": self.command,
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(holder).encode(), 0)
            os.fsync(fd)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            # A full disk: the lock is held all the same; only the holder's name is missing.
        self.fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, 0)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def _describe(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (ValueError, OSError):
        return "a process that has not written its name yet"
    if not isinstance(info, dict) or not info:
        return "a process that has not written its name yet"
    return f"pid {info.get('pid')} on {info.get('host')}, `{info.get('command')}`, since {info.get('started')}"
