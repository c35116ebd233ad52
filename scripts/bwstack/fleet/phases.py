"""What `bwstack provision` prints while Ansible runs: one line per phase with its time, download progress,
and on failure the failing task's message; Ansible's own output goes to a log file whose path is printed.

The events come from the `bwstack_events` callback (ansible/callback_plugins): a JSON line per task start and
per host result. A task's phase is decided by its role and name (PHASES); the env build reports its own
fetch/install/seal/verify times in its JSON, which become phases of their own. "Ansible overhead" is the run's
wall time minus the time the phases' work took (for command tasks: the command's own run time), i.e. Ansible's
start-up, fact gathering, module transfer and per-task cost.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from bwstack.probe import pathtrust
from bwstack.store.layout import setting

# (role, words in the task name) -> phase; the first match wins; "" matches any role / any name.
PHASES: tuple[tuple[str, str, str], ...] = (
    ("bwstack_tool", "packages", "system packages"),
    ("bwstack_mlenv", "system packages", "system packages"),
    ("bwstack_preflight", "", "preflight"),
    ("bwstack_tool", "", "tool"),
    ("bwstack_cuda", "", "CUDA"),
    ("bwstack_mlenv", "Build and switch", "build"),
    ("bwstack_mlenv", "", "env"),
    ("bwstack_verify", "", "verify"),
    ("", "Gathering Facts", "facts"),
)
# Every role depends on this one (the shared settings and the controller facts): Ansible runs its tasks inside
# the role that pulled it in, so they count there. Its tasks before any role are the play's converged check
# (tasks/converged.yml): a phase of its own.
SHARED_ROLE = "bwstack"
CONVERGED_PHASE = "converged check"
SAY_WHICH_WAY = "Converged check - say which way this run goes"  # its message is shown: why roles run or not
# The env build's own timings (bwstack build --json) -> phases.
BUILD_TIMINGS = (
    ("fetch_s", "fetch"),
    ("install_s", "install"),
    ("hash_s", "hash"),
    ("bytecode_s", "bytecode"),
    ("seal_manifest_s", "seal"),
    ("verify_s", "verify (build)"),
)
LOG_KEEP = 20


def phase_of(role: str, task: str) -> str:
    for want_role, words, phase in PHASES:
        if (not want_role or role == want_role) and (not words or words.lower() in task.lower()):
            return phase
    return "other"


def _seconds(delta: str | None) -> float | None:
    """A command result's delta ("0:00:03.123456") in seconds."""
    if not isinstance(delta, str):
        return None
    try:
        h, m, s = delta.split(":")
        return int(h) * 3600 + int(m) * 60 + float(s)
    except ValueError:
        return None


def _fmt(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 100 else f"{seconds:.0f} s"


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


@dataclass
class Phase:
    name: str
    seconds: float = 0.0  # wall time of its tasks
    work: float = 0.0  # of which the commands' own run time (the rest is Ansible's per-task cost)
    tasks: int = 0
    changed: int = 0
    skipped: int = 0  # task results that were skips (a converged node skips whole roles)
    note: str = ""


@dataclass
class PhaseReport:
    """Reads events, prints a line when a phase ends. `emit` prints one line."""

    emit: Callable[[str], None]
    started: float = field(default_factory=time.time)
    phases: dict[str, Phase] = field(default_factory=dict)
    current: str | None = None
    task_started: float | None = None
    task_phase: str | None = None
    task_work: float = 0.0
    failures: list[str] = field(default_factory=list)
    recap: dict[str, dict] = field(default_factory=dict)
    printed: set[str] = field(default_factory=set)
    role: str | None = None
    role_phases: dict[str, list[str]] = field(default_factory=dict)
    build: dict | None = None

    def feed(self, event: dict) -> None:
        kind = event.get("event")
        now = float(event.get("t") or time.time())
        if kind == "task":
            self._close_task(now)
            role = event.get("role", "")
            if role == SHARED_ROLE and self.role in (None, "", SHARED_ROLE):
                phase = CONVERGED_PHASE
            elif role == SHARED_ROLE:
                role, phase = self.role or "", self.current or "facts"
            else:
                phase = phase_of(role, event.get("name", ""))
            if self.role is not None and role != self.role:
                self._print_role(self.role)
            self.role, self.current = role, phase
            self.role_phases.setdefault(role, [])
            if phase not in self.role_phases[role]:
                self.role_phases[role].append(phase)
            self.task_started, self.task_phase, self.task_work = now, phase, 0.0
            entry = self.phases.setdefault(phase, Phase(phase))
            entry.tasks += 1
        elif kind in ("ok", "failed", "unreachable", "skipped"):
            result = event.get("result") or {}
            work = _seconds(result.get("delta"))
            if work is not None:
                self.task_work = max(self.task_work, work)
            phase = self.phases.get(self.task_phase or "")
            if phase is not None and result.get("changed"):
                phase.changed += 1
            if phase is not None and kind == "skipped":
                phase.skipped += 1
            if kind == "ok" and phase is not None and phase.name == "build":
                self._read_build(result.get("result"))
            if kind == "ok" and str(event.get("task", "")).endswith(SAY_WHICH_WAY):
                self.emit(f"{event.get('host')}: {' '.join(str(result.get('msg', '')).split())}")
            if kind in ("failed", "unreachable") and not event.get("ignore_errors"):
                self.failures.append(self._failure(event, kind))
        elif kind == "stats":
            self._close_task(now)
            self.recap = event.get("hosts") or {}

    def _close_task(self, now: float) -> None:
        if self.task_started is None or self.task_phase is None:
            return
        phase = self.phases[self.task_phase]
        phase.seconds += max(0.0, now - self.task_started)
        phase.work += self.task_work
        self.task_started = None

    def _read_build(self, result: object) -> None:
        if isinstance(result, dict):
            self.build = result

    @staticmethod
    def _failure(event: dict, kind: str) -> str:
        result = event.get("result") or {}
        message = str(result.get("msg") or "").strip()
        if not message:
            lines = [str(x) for x in result.get("stderr_lines") or [] if str(x).strip()]
            message = lines[-1] if lines else f"exit {result.get('rc')}"
        message = " ".join(message.removeprefix("Task failed: ").split())
        what = "unreachable" if kind == "unreachable" else "failed"
        return f'{event.get("host")}: {what} at "{event.get("task")}": {message[:1200]}'

    def _print_role(self, role: str) -> None:
        """A role ended: print its phases (system packages wait: the env role installs more of them)."""
        if role == "bwstack_mlenv":
            self._print_phase("system packages")
        for name in self.role_phases.get(role, []):
            if name != "system packages":
                self._print_phase(name)

    def _print_phase(self, name: str) -> None:
        phase = self.phases.get(name)
        if phase is None or name in self.printed or name == "facts":
            return
        self.printed.add(name)
        if name == "build" and self.build:
            timings = self.build.get("timings") or {}
            parts = [(label, timings.get(key)) for key, label in BUILD_TIMINGS]
            parts = [(label, value) for label, value in parts if isinstance(value, (int, float))]
            for label, value in parts:
                extra = self._fetch_note() if label == "fetch" else ""
                self.emit(f"  {label:<17} {_fmt(value):>8}{extra}")
            if not parts:
                actions = self.build.get("actions") or []
                self.emit(f"  {'env build':<17} {_fmt(self._work(phase)):>8}  "
                          f"{'; '.join(actions) if actions else 'nothing to build (converged)'}")  # fmt: skip
            return
        changed = f", {phase.changed} changed" if phase.changed else ""
        skipped = (
            ", all skipped" if phase.skipped >= phase.tasks else f", {phase.skipped} skipped" if phase.skipped else ""
        )
        tasks = f"{phase.tasks} task{'' if phase.tasks == 1 else 's'}"
        self.emit(f"  {name:<17} {_fmt(phase.seconds):>8}  ({tasks}{changed}{skipped})")

    def _work(self, phase: Phase) -> float:
        """The time a phase's own work took: the build's own total, a command's run time, else the wall time."""
        if phase.name == "build":
            total = ((self.build or {}).get("timings") or {}).get("total_s")
            return float(total) if isinstance(total, (int, float)) else phase.seconds
        return phase.work if phase.work else phase.seconds

    def _fetch_note(self) -> str:
        fetched = ((self.build or {}).get("timings") or {}).get("fetch") or {}
        done, seconds = fetched.get("bytes_downloaded"), fetched.get("seconds")
        if not done:
            return "  (all from the store's cache)"
        rate = f" at {human_bytes(done / seconds)}/s" if seconds else ""
        return f"  ({human_bytes(done)} downloaded{rate})"

    def finish(self, now: float | None = None) -> None:
        now = now or time.time()
        self._close_task(now)
        if self.role is not None:
            self._print_role(self.role)
        for name in list(self.phases):
            self._print_phase(name)
        total = max(0.0, now - self.started)
        work = sum(self._work(p) for p in self.phases.values() if p.name != "facts")
        overhead = _fmt(max(0.0, total - work))
        self.emit(f"  {'Ansible overhead':<17} {overhead:>8}  (of the total: its start-up, facts, per-task cost)")
        for host, counts in self.recap.items():
            self.emit(
                f"{host:<26} : ok={counts.get('ok', 0)} changed={counts.get('changed', 0)} "
                f"unreachable={counts.get('unreachable', 0)} failed={counts.get('failures', 0)} "
                f"skipped={counts.get('skipped', 0)} rescued={counts.get('rescued', 0)} "
                f"ignored={counts.get('ignored', 0)}"
            )
        self.emit(f"total {_fmt(total)}")


# ------------------------------------------------------------------------------------------------ log files


def log_dir() -> Path:
    """$BWSTACK_LOG_DIR, else /var/log/bwstack as root, else ~/.local/state/bwstack/log."""
    given = setting(None, "BWSTACK_LOG_DIR")  # an empty value is refused, not replaced by the default
    if given:
        return Path(given)
    if os.geteuid() == 0:
        return Path("/var/log/bwstack")
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "bwstack" / "log"


def new_log(what: str) -> Path:
    """A new log file, 0600 (the last LOG_KEEP of each kind are kept); in the temporary directory (a new file of
    a random name) when the log directory cannot be written or others could write it: they could put a link under
    the log's name, or take the file away while Ansible's output goes into it."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    name = f"{what}-{stamp}-{os.getpid()}.log"
    directory = log_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if pathtrust.folder_open_to_others(directory):
            raise PermissionError(f"{directory} is open to others")
        path = directory / name
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
    except OSError:
        import tempfile

        fd, fallback = tempfile.mkstemp(prefix=f"bwstack-{what}-", suffix=".log")
        os.close(fd)
        return Path(fallback)
    for stale in sorted(directory.glob(f"{what}-*.log"))[:-LOG_KEEP]:
        with contextlib.suppress(OSError):
            st = os.lstat(stale)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():  # bwstack's own logs, not a shared folder's
                stale.unlink()
    return path


# ------------------------------------------------------------------------------------------------ progress


class EventTail:
    """New complete lines of a file another process appends to."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.partial = ""

    def read(self) -> list[dict]:
        try:
            with open(self.path, encoding="utf-8") as handle:
                handle.seek(self.offset)
                data = handle.read()
                self.offset = handle.tell()
        except OSError:
            return []
        text = self.partial + data
        lines = text.split("\n")
        self.partial = lines.pop()
        events = []
        for line in lines:
            try:
                events.append(json.loads(line))
            except ValueError:
                continue
        return events


class DownloadWatch:
    """Polls the progress file a local build writes (bwstack.provision.progress) and shows bytes and rate:
    on a terminal one line rewritten in place, else a line every `interval` seconds."""

    def __init__(self, path: Path, stream=None, interval: float = 10.0, poll: float | None = None) -> None:
        self.path = path
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval = interval
        self.poll = poll if poll is not None else (1.0 if self.tty else 2.0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._shown = False

    def __enter__(self) -> DownloadWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if self._shown and self.tty:
            self.stream.write("\n")
            self.stream.flush()

    def _run(self) -> None:
        last_line = 0.0
        while not self._stop.wait(self.poll):
            state = read_progress(self.path)
            if not state or state.get("done"):
                continue
            line = progress_line(state)
            now = time.time()
            if self.tty:
                self.stream.write("\r" + line.ljust(79)[:79])
                self.stream.flush()
                self._shown = True
            elif now - last_line >= self.interval:
                self.stream.write(line + "\n")
                self.stream.flush()
                last_line = now


def read_progress(path: Path) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def progress_line(state: dict) -> str:
    done, total = state.get("bytes", 0), state.get("total_bytes") or 0
    seconds = max(1e-6, float(state.get("seconds") or 0))
    files = f"{state.get('files_done', 0)}/{state.get('files', 0)} wheels"
    # Before every wheel has started downloading, the total is a part of it: not shown as the total.
    of = f" of {human_bytes(total)}" if total and state.get("total_known") else ""
    return f"  fetch: {human_bytes(done)}{of}, {files}, {human_bytes(done / seconds)}/s"
