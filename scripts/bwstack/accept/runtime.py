"""The runtime part of acceptance: GPU measurements and the all-reduce, in child processes that run the
env's Python (with torch) under a hard timeout.

All children of one measurement share one process group. On a timeout, a failed rank (the others would
wait for it forever) or any error here, the whole group is killed with SIGKILL and reaped; what is left of
the group afterwards is reported, so "no process left behind" is checked, not assumed. The children talk
over a file store and loopback only. NVLink multicast is never used: every child gets NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1, whatever the caller's environment says.
"""

from __future__ import annotations

import contextlib
import enum
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from bwstack.probe import interp

WORKER = Path(__file__).with_name("gpu_worker.py")
FORCED_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "CUDA_DEVICE_ORDER": "PCI_BUS_ID",  # torch's GPU i is nvidia-smi's GPU i
    "PYTHONUNBUFFERED": "1",
}
DEFAULT_ENV = {
    "NCCL_DEBUG": "INFO",  # the channel lines say which transport (P2P, SHM, NET) NCCL really uses
    "NCCL_SOCKET_IFNAME": "lo",  # one node: NCCL's bootstrap stays on loopback
    "GLOO_SOCKET_IFNAME": "lo",
    "OMP_NUM_THREADS": "1",
}
TRANSPORT_RE = re.compile(r"via ((?:P2P|SHM|NET)(?:/[\w-]+)*)")
LOG_TAIL = 1200
REAP_WAIT_S = 5.0


class Status(enum.Enum):
    DONE = "done"
    TIMEOUT = "timeout"
    FAILED = "failed"


@dataclass(frozen=True)
class GroupResult:
    status: Status
    seconds: float
    returncodes: tuple[int | None, ...]
    left_behind: tuple[int, ...]  # pids of the group still alive after the kill and the wait
    logs: tuple[str, ...]  # each child's combined output

    def tail(self, i: int) -> str:
        return self.logs[i][-LOG_TAIL:] if i < len(self.logs) else ""


def child_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    env = interp.clean_env(base=base)
    for key, value in DEFAULT_ENV.items():
        env.setdefault(key, value)
    env.update(FORCED_ENV)
    return env


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in process group `pgid`, from /proc."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8", errors="replace") as handle:
                stat = handle.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()  # the command name may hold spaces and parentheses
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            members.append(int(entry))
    return members


def run_group(argvs: Sequence[Sequence[str]], env: Mapping[str, str], timeout: float, workdir: Path) -> GroupResult:
    """Start every argv in one new process group; wait until all exit, one fails, or `timeout` passes."""
    procs: list[subprocess.Popen] = []
    logs = [workdir / f"child-{i}.log" for i in range(len(argvs))]
    started = time.monotonic()
    status = Status.DONE
    pgid = 0
    try:
        for i, argv in enumerate(argvs):
            with open(logs[i], "wb") as log:
                # The first child leads a new process group (0: its own pid); the others join it.
                proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                        env=dict(env), **_join(pgid))  # fmt: skip
            pgid = pgid or proc.pid
            procs.append(proc)
        deadline = started + timeout
        while True:
            codes = [p.poll() for p in procs]
            if any(c not in (None, 0) for c in codes):
                status = Status.FAILED
                break
            if all(c == 0 for c in codes):
                break
            if time.monotonic() >= deadline:
                status = Status.TIMEOUT
                break
            time.sleep(0.05)
    finally:
        if pgid:
            _kill_group(pgid, procs)
    left = group_members(pgid) if pgid else []
    wait_until = time.monotonic() + REAP_WAIT_S
    while left and time.monotonic() < wait_until:  # SIGKILLed grandchildren are reaped by their new parent
        time.sleep(0.05)
        left = group_members(pgid)
    return GroupResult(
        status,
        time.monotonic() - started,
        tuple(p.returncode for p in procs),
        tuple(left),
        tuple(path.read_text(encoding="utf-8", errors="replace") if path.exists() else "" for path in logs),
    )


def _join(pgid: int) -> dict:
    """Popen arguments that start a child in process group `pgid` (0: a new group that the child leads)."""
    if sys.version_info >= (3, 11):
        return {"process_group": pgid}
    return {"preexec_fn": lambda: os.setpgid(0, pgid)}  # pragma: no cover - Python 3.10


def _kill_group(pgid: int, procs: list[subprocess.Popen]) -> None:
    with contextlib.suppress(ProcessLookupError):  # every member already gone
        os.killpg(pgid, signal.SIGKILL)
    for proc in procs:
        proc.wait()


# ------------------------------------------------------------------------------------------------ measurements


@dataclass(frozen=True)
class Bench:
    """What gpu_worker.py bench measured (the JSON it wrote, kept as the worker wrote it)."""

    torch: str
    cuda: str | None
    devices: tuple[Mapping, ...]
    p2p: tuple[Mapping, ...]
    reason: str  # why there are no devices, when there are none


@dataclass(frozen=True)
class BenchRun:
    result: Bench | None
    group: GroupResult

    def failure(self) -> str:
        return _failure("the GPU benchmark", self.group)


@dataclass(frozen=True)
class AllReduce:
    world: int
    backend: str
    bytes: int
    seconds: float
    algbw_gbs: float
    busbw_gbs: float
    correct: bool
    nccl: str | None


@dataclass(frozen=True)
class AllReduceRun:
    world: int
    backend: str
    timeout: float
    result: AllReduce | None
    group: GroupResult
    transports: tuple[str, ...]

    def failure(self) -> str:
        return _failure(f"the {self.backend} all-reduce over {self.world} ranks", self.group, self.timeout)


def _failure(what: str, group: GroupResult, timeout: float | None = None) -> str:
    left = (
        "no process left behind"
        if not group.left_behind
        else f"{len(group.left_behind)} processes left: {group.left_behind}"
    )
    if group.status is Status.TIMEOUT:
        return f"{what} did not finish within {timeout or group.seconds:g} s; its process group was killed ({left})"
    bad = next((i for i, c in enumerate(group.returncodes) if c not in (0, None)), 0)
    lines = [line for line in group.tail(bad).strip().splitlines() if line.strip()]
    last = lines[-1][:300] if lines else "no output"
    return f"{what}: process {bad} exited {group.returncodes[bad]} ({last}); the group was killed ({left})"


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def run_bench(python: str, timeout: float, *, matmul: int = 8192, copy_mib: int = 1024, p2p_mib: int = 256) -> BenchRun:
    with tempfile.TemporaryDirectory(prefix="bwstack-accept-") as tmp:
        out = Path(tmp) / "bench.json"
        argv = [python, "-I", str(WORKER), "bench", "--out", str(out), "--matmul", str(matmul),
                "--copy-mib", str(copy_mib), "--p2p-mib", str(p2p_mib)]  # fmt: skip
        group = run_group([argv], child_env(), timeout, Path(tmp))
        data = _read_json(out) if group.status is Status.DONE else None
    if data is None:
        return BenchRun(None, group)
    return BenchRun(
        Bench(
            torch=str(data.get("torch")),
            cuda=data.get("cuda"),
            devices=tuple(data.get("devices") or ()),
            p2p=tuple(data.get("p2p") or ()),
            reason=str(data.get("reason") or ""),
        ),
        group,
    )


def run_allreduce(
    python: str,
    world: int,
    timeout: float,
    *,
    backend: str = "nccl",
    mib: int = 1024,
    iters: int = 20,
    hang_rank: int | None = None,
) -> AllReduceRun:
    """All-reduce over `world` ranks, one process each; `hang_rank` joins the group but never the collective
    (fault injection, to prove that a hang is caught)."""
    with tempfile.TemporaryDirectory(prefix="bwstack-accept-") as tmp:
        out = Path(tmp) / "allreduce.json"
        argvs = [
            [python, "-I", str(WORKER), "rank", "--rank", str(r), "--world", str(world), "--backend", backend,
             "--store", tmp, "--out", str(out), "--mib", str(mib), "--iters", str(iters)]
            + (["--hang"] if r == hang_rank else [])
            for r in range(world)
        ]  # fmt: skip
        group = run_group(argvs, child_env(), timeout, Path(tmp))
        data = _read_json(out) if group.status is Status.DONE else None
    transports = tuple(sorted({m.group(1) for log in group.logs for m in TRANSPORT_RE.finditer(log)}))
    result = None
    if data is not None:
        result = AllReduce(
            world=int(data["world"]),
            backend=str(data["backend"]),
            bytes=int(data["bytes"]),
            seconds=float(data["seconds"]),
            algbw_gbs=float(data["algbw_gbs"]),
            busbw_gbs=float(data["busbw_gbs"]),
            correct=bool(data["correct"]),
            nccl=data.get("nccl"),
        )
    return AllReduceRun(world, backend, timeout, result, group, transports)
