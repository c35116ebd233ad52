"""One bwstack run at a time per store: an flock the kernel drops when the holder dies, even by SIGKILL."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from bwstack.errors import BusyError


class RunLock:
    """Exclusive lock on <root>/bwstack.lock; the file names the holder so a second run can say who."""

    def __init__(self, root: Path, command: str | None = None) -> None:
        self.path = Path(root) / "bwstack.lock"
        self.command = command or " ".join(["bwstack", *sys.argv[1:]])
        self.fd: int | None = None

    def __enter__(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
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
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        os.fsync(fd)
        self.fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            os.ftruncate(self.fd, 0)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def _describe(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        return "a process that has not written its name yet"
    if not info:
        return "a process that has not written its name yet"
    return f"pid {info.get('pid')} on {info.get('host')}, `{info.get('command')}`, since {info.get('started')}"
