"""`bwstack accept`: is this node fit to serve? Static facts (driver, PCIe fabric, IOMMU, loader, kernel
log) judged against the lock's hardware target, then the GPUs measured for real and the first all-reduce
run under a hard timeout. Exit 0: accepted; 1: not accepted; 2: bad input. Nothing on the node changes.
Its options are declared in bwstack.cli.commands.accept, which prints the report.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from bwstack.errors import UsageError

if TYPE_CHECKING:
    from bwstack.accept.report import AcceptReport

TIMEOUT_DEFAULT_S = 180.0
TIMEOUT_MAX_S = 3600.0


def _timeout(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"--timeout {text!r}: expected a number of seconds") from None
    if not math.isfinite(value) or not 1 <= value <= TIMEOUT_MAX_S:
        raise UsageError(f"--timeout {text}: must be between 1 and {TIMEOUT_MAX_S:g} seconds")
    return value


def _python(env: str | None) -> str | None:
    """The interpreter with torch: --env (an env directory or a python), else the active ml-env's."""
    if env is not None:
        if not env.strip():
            raise UsageError("--env is empty: name an env directory or its python")
        path = Path(env)
        python = path / "bin" / "python" if path.is_dir() else path
        if not python.is_file() or not os.access(python, os.X_OK):
            raise UsageError(f"--env {env}: no Python there (expected an env directory or a python executable)")
        return str(python)
    from bwstack.store.layout import Layout

    python = Layout.default().ml_env / "bin" / "python"
    return str(python) if python.is_file() else None


def _machine(args: argparse.Namespace):
    from bwstack.probe.hw.machine import Machine, Recorder

    if args.machine is not None and args.record is not None:
        raise UsageError("--machine reads a recorded description and --record writes one: give one of them")
    if args.machine is not None:
        if not args.machine.strip():
            raise UsageError("--machine is empty: name a recorded machine description directory")
        try:
            return Machine.recorded(args.machine)
        except ValueError as exc:
            raise UsageError(f"--machine: {exc}") from None
    if args.record is not None:
        out = _record_folder(args.record)
        try:  # the Recorder checks again, on the folder it opened: a swap since the check above is refused too
            return Recorder(out)
        except OSError as exc:
            raise UsageError(f"--record {args.record}: {exc.strerror or exc}") from None
        except ValueError as exc:
            raise UsageError(f"--record {args.record}: {exc}") from None
    return Machine()


def _record_folder(text: str) -> Path:
    """--record DIR: root writes the node's facts and kernel log there, so DIR is new (the Recorder makes it 0700)
    or an empty folder that only this user can change, on a path that only root and this user can change: nobody
    else may swap a name in it for a link to a file of root's, or read what is recorded."""
    if not text.strip():
        raise UsageError(f"--record {text!r}: name a new or empty directory")
    try:
        why = _record_folder_unfit(Path(text))
    except OSError as exc:
        why = f"cannot be checked ({exc.strerror or exc})"
    if why:
        raise UsageError(f"--record {text}: {why}")
    return Path(text)


def _record_folder_unfit(out: Path) -> str | None:
    from bwstack.probe import pathtrust

    if os.path.islink(out):
        return "is a link: name a new or empty directory (a link is not followed)"
    if not os.path.lexists(out):
        above = Path(os.path.abspath(out)).parent
        while not os.path.lexists(above):
            above = above.parent
        why = pathtrust.folder_open_to_others(above)  # where the new one goes (/tmp's sticky bit is enough)
        return f"{why} (a new folder is made only where nobody else can change it)" if why else None
    if not out.is_dir():
        return "is not a directory: name a new or empty directory"
    if any(out.iterdir()):
        return "is not empty: name a new or empty directory"
    why = pathtrust.own_folder_open_to_others(out)
    return f"{why} (an existing folder must be this user's alone)" if why else None


def accept(args: argparse.Namespace, log: Callable[[str], None]) -> AcceptReport:
    """Judge this node (or a recorded one) as the accept options say; `log` gets the progress lines."""
    from bwstack.accept.report import AcceptReport
    from bwstack.lock.model import load_lock
    from bwstack.probe.hw.collect import collect
    from bwstack.probe.hw.judge import Finding, Verdict, Want, judge_static

    lock = load_lock(args.lock)
    profile = lock.profile(args.profile)
    if args.hardware is not None:
        if args.hardware not in lock.targets:
            raise UsageError(
                f"--hardware {args.hardware!r} is not one of the lock's targets ({', '.join(lock.targets)})"
            )
        target = lock.targets[args.hardware]
    else:
        target = profile.target
    timeout = _timeout(args.timeout)
    python = None if args.no_runtime or args.machine is not None else _python(args.env)
    want = Want.of(profile, target)
    machine = _machine(args)  # after the other checks: bad input makes no recording folder
    try:
        facts = collect(machine)
    finally:
        machine.close()  # a recording is complete once the facts are read
    static = judge_static(facts, want)
    runtime: tuple[Finding, ...] = ()
    note, bench, allreduce = "", None, None
    if args.no_runtime:
        note = "not run (--no-runtime)"
    elif args.machine is not None:
        note = "not run: a recorded machine has no GPUs to measure (run `bwstack accept` on the node itself)"
    elif python is None:
        runtime = (
            Finding(
                "gpu.runtime",
                Verdict.UNKNOWN,
                "no env to run the GPU measurements with (no active ml-env here): pass --env",
            ),
        )
    else:
        from bwstack.accept.runtime import run_allreduce, run_bench
        from bwstack.accept.runtime_judge import judge_runtime

        log(f"bwstack accept: measuring the GPUs with {python} (timeout {timeout:g} s per stage)")
        bench = run_bench(python, timeout)
        world = len(bench.result.devices) if bench.result else 0
        if world:
            log(f"bwstack accept: all-reduce over {world} GPU(s)")
            allreduce = run_allreduce(python, world, timeout)
        runtime = judge_runtime(bench, allreduce, target.envelope, facts, static, want)
    return AcceptReport(
        machine=machine.label if args.machine is not None else f"{os.uname().nodename} ({machine.label})",
        profile=profile.name,
        target=target.name,
        static=static,
        runtime=runtime,
        runtime_note=note,
        timeout_s=timeout,
        facts=facts,
        bench=bench,
        allreduce=allreduce,
    )
