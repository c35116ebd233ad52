"""Fetch a closure's wheels and install them at once: what has arrived is installed (by uv, in waves) while the rest
downloads, so the download's waiting and the unpacking's CPU overlap.

Measured on a node of 2 cores with the cu128 closure (4.4 GB of wheels): the fetch alone took 12.6 s (1.3 cores),
uv's install from a cold cache alone 34.3 s (1.7 cores); side by side the two took 37.1 s, against 46.9 s one after
the other. Each wave is one `uv pip install --no-deps` of every wheel fetched since the last one began: a handful of
waves, each with all its wheels' hashes required, as a single install has.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from bwstack.errors import BwstackError
from bwstack.lock.model import LockedPackage, Wheel
from bwstack.provision.wheelhouse import Fetcher, LocalWheel

Install = Callable[[dict[str, LocalWheel]], None]


@dataclass(frozen=True)
class Fetched:
    """Every wheel, in the store and installed, and where the time went."""

    wheels: dict[str, LocalWheel]
    fetch_s: float  # from the start until the last wheel was in the store
    install_after_fetch_s: float  # from then until the last wave was installed
    install_beside_fetch_s: float  # of the waves' time, what ran while wheels were still downloading
    waves: int


class _InstallStopped(BwstackError):
    """The fetch is told to stop: a wave failed (its own error is the one raised)."""


class _Waves(threading.Thread):
    """Installs what the fetch hands over, every wheel since the last wave in one go, until told it is all."""

    def __init__(self, install: Install) -> None:
        super().__init__(name="bwstack-install-waves", daemon=True)
        self._install = install
        self._ready = threading.Condition()
        self._pending: dict[str, LocalWheel] = {}
        self._all_in = False
        self._stopped = False
        self.error: BaseException | None = None
        self.spans: list[tuple[float, float]] = []

    def add(self, wheel: LocalWheel) -> None:
        """From the fetch's threads: one more wheel in the store. Raises once a wave failed, which stops the fetch."""
        with self._ready:
            if self.error is not None or self._stopped:
                raise _InstallStopped("the install failed")
            self._pending[wheel.package] = wheel
            self._ready.notify()

    def all_in(self) -> None:
        with self._ready:
            self._all_in = True
            self._ready.notify()

    def stop(self) -> None:
        """No wave starts after the one running (the fetch failed)."""
        with self._ready:
            self._stopped = True
            self._ready.notify()

    def run(self) -> None:
        while True:
            with self._ready:
                while not self._pending and not self._all_in and not self._stopped:
                    self._ready.wait()
                if self._stopped or not self._pending:
                    return
                wave, self._pending = self._pending, {}
            started = time.perf_counter()
            try:
                self._install(wave)
            except BaseException as exc:  # handed to the caller's thread, which raises it
                with self._ready:
                    self.error = exc
                return
            self.spans.append((started, time.perf_counter()))


def fetch_and_install(
    fetcher: Fetcher, selection: Mapping[str, tuple[LockedPackage, Wheel]], install: Install
) -> Fetched:
    """Fetch `selection` and hand each wave of fetched wheels to `install` (in one thread of its own, one wave at a
    time). A failed wave stops the fetch and is raised; a failed fetch is raised once the running wave is done
    (nothing else is installed after it)."""
    waves = _Waves(install)
    started = time.perf_counter()
    waves.start()
    fetch_error: BaseException | None = None
    wheels: dict[str, LocalWheel] = {}
    try:
        wheels = fetcher.fetch_all(selection, on_fetched=waves.add)
    except BaseException as exc:
        fetch_error = exc
        waves.stop()
    fetched = time.perf_counter()
    waves.all_in()
    waves.join()
    if waves.error is not None:
        raise waves.error
    if fetch_error is not None:
        raise fetch_error
    done = time.perf_counter()
    beside = sum(max(0.0, min(end, fetched) - start) for start, end in waves.spans)
    return Fetched(wheels, fetched - started, done - fetched, beside, len(waves.spans))
