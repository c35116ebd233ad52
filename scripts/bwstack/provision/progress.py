"""Download progress of a wheel fetch: bytes, files and rate, shared by the fetch threads.

Written, at most twice a second, as a small JSON file when $BWSTACK_PROGRESS_FILE names one (`bwstack
provision` on a local target polls it and shows the progress while Ansible waits for the build), and kept as
totals for the build's result (bytes downloaded and the time it took).

The lock holds no wheel sizes: a download's size is known when it starts (Content-Length), so the total is only
the total once every wheel has started downloading or needed none (`total_known`); before that it is a part.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

ENV = "BWSTACK_PROGRESS_FILE"


class DownloadProgress:
    def __init__(self, files: int = 0, path: str | os.PathLike | None = None, interval: float = 0.5) -> None:
        given = path if path is not None else os.environ.get(ENV)
        self.path = Path(given) if given else None
        self.files = files
        self.files_done = 0
        self.downloaded_files = 0
        self.bytes = 0
        self.total_bytes = 0
        self.files_sized = 0  # wheels whose bytes are counted in total_bytes, or that needed no download
        self.unsized_download = False  # a download without a Content-Length: the total is never known
        self.started = time.monotonic()
        self.interval = interval
        self._written = 0.0
        self._lock = threading.Lock()
        self._this_file = threading.local()  # each wheel is fetched, start to file_done, in one thread

    def started_download(self, length: int) -> None:
        first = not getattr(self._this_file, "sized", False)
        self._this_file.sized = True
        with self._lock:
            self.total_bytes += length
            self.downloaded_files += 1
            self.files_sized += first
            self.unsized_download |= length <= 0
        self._write()

    def add(self, n: int) -> None:
        with self._lock:
            self.bytes += n
        self._write()

    def file_done(self) -> None:
        downloaded = getattr(self._this_file, "sized", False)
        self._this_file.sized = False
        with self._lock:
            self.files_done += 1
            self.files_sized += not downloaded
        self._write(force=self.files_done == self.files)

    def seconds(self) -> float:
        return time.monotonic() - self.started

    def state(self, done: bool = False) -> dict:
        return {
            "bytes": self.bytes,
            "total_bytes": self.total_bytes,
            "files": self.files,
            "files_done": self.files_done,
            "total_known": self.files_sized >= self.files and not self.unsized_download,
            "seconds": round(self.seconds(), 3),
            "done": done,
        }

    def summary(self) -> dict:
        return {"bytes_downloaded": self.bytes, "files_downloaded": self.downloaded_files,
                "files": self.files, "seconds": round(self.seconds(), 3)}  # fmt: skip

    def _write(self, force: bool = False, done: bool = False) -> None:
        if self.path is None:
            return
        now = time.monotonic()
        if not force and now - self._written < self.interval:
            return
        self._written = now
        try:
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{threading.get_ident()}")
            tmp.write_text(json.dumps(self.state(done)))
            os.replace(tmp, self.path)
        except OSError:
            pass

    def close(self) -> None:
        self._write(force=True, done=True)
