"""`bwstack verify`: run the node checks (tests/infra, pytest-testinfra) against any host; a table or JSON.

Targets are testinfra host specs: local://, docker://CONTAINER, ssh://[user@]host, ansible://GROUP?ansible_inventory=FILE
(several separated by commas). The checks are the same files `pytest tests/infra --hosts=SPEC` runs.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from bwstack.errors import UsageError

RESULT_ORDER = {"failed": 0, "error": 1, "passed": 2, "skipped": 3}


def infra_dir() -> Path:
    """tests/infra: installed as the package `bwstack_infra`, or beside the source in a checkout."""
    try:
        import bwstack_infra

        if bwstack_infra.__file__:
            return Path(bwstack_infra.__file__).parent
    except ImportError:
        pass
    here = Path(__file__).resolve().parents[2] / "tests" / "infra"
    if here.is_dir():
        return here
    raise UsageError("the node checks (tests/infra) are not installed with this bwstack")


@dataclass
class CheckResult:
    host: str
    check: str
    outcome: str  # passed | failed | skipped | error
    message: str
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0


class _Collector:
    def __init__(self) -> None:
        self.results: list[CheckResult] = []
        self.names: dict[str, tuple[str, str]] = {}

    @pytest.hookimpl
    def pytest_itemcollected(self, item: pytest.Item) -> None:
        """Host and check name from the parametrization itself (host ids may contain dashes)."""
        host, extra = "local", []
        callspec = getattr(item, "callspec", None)
        if callspec is not None:
            for key, value in callspec.params.items():
                if key == "_testinfra_host":
                    host = value.backend.get_pytest_id()
                else:
                    extra.append(str(value))
        name = getattr(item, "originalname", item.name).removeprefix("test_")
        self.names[item.nodeid] = (host, name + (f"[{','.join(extra)}]" if extra else ""))

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            host, check = self.names.get(report.nodeid, ("local", report.nodeid.split("::")[-1]))
            outcome = report.outcome
            if report.when == "setup" and outcome == "failed":
                outcome = "error"
            if outcome == "skipped" and isinstance(report.longrepr, tuple):
                message = str(report.longrepr[2]).removeprefix("Skipped: ")
            elif outcome in ("failed", "error"):
                message = _failure_message(report)
            else:
                message = ""
            notes = [str(v) for k, v in report.user_properties if k == "note"]
            self.results.append(CheckResult(host, check, outcome, message, notes, round(report.duration, 3)))


def _failure_message(report: pytest.TestReport) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    text = text.split("\nassert ")[0].split("\n+  where")[0]
    for prefix in ("AssertionError: ", "Failed: "):
        text = text.removeprefix(prefix)
    return " ".join(text.split())


def run_checks(
    target: str,
    *,
    lock_path: str,
    profile: str | None = None,
    env: str | None = None,
    capability: str | None = None,
    runtime: bool = True,
    facts_dir: str | None = None,
    skip: list[str] | None = None,
    extra_args: list[str] | None = None,
) -> list[CheckResult]:
    args = [
        str(infra_dir()),
        f"--hosts={target}",
        f"--stack-lock={lock_path}",
        "-p", "no:cacheprovider",
        "-q", "--no-header", "-o", "addopts=",
    ]  # fmt: skip
    if profile:
        args.append(f"--stack-profile={profile}")
    if env:
        args.append(f"--stack-env={env}")
    if capability:
        args.append(f"--stack-capability={capability}")
    if not runtime:
        args.append("--stack-no-runtime")
    if facts_dir:
        args.append(f"--stack-facts-dir={facts_dir}")
    args += [f"--stack-skip={item}" for item in skip or []]
    args += extra_args or []
    collector = _Collector()
    sink = io.StringIO()
    # testinfra's ansible backend runs ansible-inventory: the one installed beside this interpreter
    bindir = str(Path(sys.executable).parent)
    old_path = os.environ.get("PATH", "")
    os.environ["PATH"] = f"{bindir}:{old_path}"
    try:
        with contextlib.redirect_stdout(sink):
            code = pytest.main(args, plugins=[collector])
    finally:
        os.environ["PATH"] = old_path
    failed_to_run = (
        pytest.ExitCode.USAGE_ERROR,
        pytest.ExitCode.INTERNAL_ERROR,
        pytest.ExitCode.NO_TESTS_COLLECTED,
        pytest.ExitCode.INTERRUPTED,
    )
    if code in failed_to_run or not collector.results:
        lines = [line for line in sink.getvalue().strip().splitlines() if line.startswith(("E ", "ERROR"))]
        detail = " ".join(line.removeprefix("E").strip() for line in lines[-3:]) or sink.getvalue()[-300:]
        raise UsageError(f"the checks could not run against {target}: {detail}")
    return collector.results


def render(results: list[CheckResult]) -> str:
    if not results:
        return "no checks ran"
    marks = {"passed": "PASS", "failed": "FAIL", "error": "ERROR", "skipped": "SKIP"}
    width = max(len(r.check) for r in results)
    lines = []
    for host in sorted({r.host for r in results}):
        rows = [r for r in results if r.host == host]
        lines.append(f"{host}:")
        for r in sorted(rows, key=lambda r: (RESULT_ORDER.get(r.outcome, 9), r.check)):
            line = f"  {marks.get(r.outcome, r.outcome):<5} {r.check:<{width}}  {r.message}"
            lines.append(line.rstrip())
            for note in r.notes:
                lines.append(f"  {'':<5} {'':<{width}}  note: {note}")
        counts = {k: sum(r.outcome == k for r in rows) for k in ("passed", "failed", "error", "skipped")}
        lines.append(
            f"  {counts['passed']} passed, {counts['failed'] + counts['error']} failed, {counts['skipped']} skipped"
        )
    return "\n".join(lines)


WAIVED = "waived by the operator"


def as_json(results: list[CheckResult]) -> str:
    """Per-host checks for fleets, plus the rendered table and the failure and waiver lines, so that callers
    (the verify role) show them as they are instead of re-rendering them."""
    hosts: dict[str, dict] = {}
    for r in results:
        entry = hosts.setdefault(r.host, {"ok": True, "checks": []})
        entry["checks"].append(r.__dict__)
        if r.outcome in ("failed", "error"):
            entry["ok"] = False
    return json.dumps(
        {
            "ok": all(h["ok"] for h in hosts.values()) if hosts else False,
            "hosts": hosts,
            "report": render(results).splitlines(),
            "failures": [f"{r.check}: {r.message}" for r in results if r.outcome in ("failed", "error")],
            "waived": [f"{r.check}: {r.message}" for r in results if r.message.startswith(WAIVED)],
        },
        indent=2,
    )


def ok(results: list[CheckResult]) -> bool:
    return bool(results) and not any(r.outcome in ("failed", "error") for r in results)
