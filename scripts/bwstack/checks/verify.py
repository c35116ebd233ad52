"""`bwstack verify`: run the node checks (tests/infra, pytest-testinfra) against hosts; a table or JSON.

Targets are bwstack's (see bwstack.checks.hostspec): local://, ssh://[user@]host[:port], ansible://INVENTORY?limit=...,
docker://CONTAINER, several separated by commas. Each host is checked on its own (one pytest session per
host), so two hosts never merge into one report and a host that cannot be checked says why in one line:
unreachable, no such container, no python3, the probe failing. The checks are the files that
`pytest tests/infra --hosts=SPEC` runs.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import io
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import pytest

from bwstack import paths
from bwstack.checks import hostspec
from bwstack.errors import BwstackError, UsageError
from bwstack.probe import waivers
from bwstack.probe.waivers import WAIVED
from bwstack.terminal import one_line

RESULT_ORDER = {"failed": 0, "error": 1, "passed": 2, "skipped": 3}
# How long a host may keep the checks waiting before it counts as gone (ssh keep-alive: 10 s x 3).
SSH_CONNECT_TIMEOUT = 15
SSH_ALIVE = ("ServerAliveInterval 10", "ServerAliveCountMax 3")

__all__ = ["WAIVED", "CheckResult", "HostReport", "HostUnavailable", "check_hosts", "run_checks"]


def infra_dir() -> Path:
    """tests/infra: installed as the package `bwstack_infra`, or beside the source in a checkout."""
    try:
        import bwstack_infra

        if bwstack_infra.__file__:
            return Path(bwstack_infra.__file__).parent
    except ImportError:
        pass
    here = paths.in_checkout("tests", "infra")
    if here and here.is_dir():
        return here
    raise UsageError("the node checks (tests/infra) are not installed with this bwstack")


@functools.cache
def known_checks() -> tuple[str, ...]:
    """The node checks' names (the tests/infra test functions without `test_`), read from their source."""
    names = []
    for path in sorted(infra_dir().glob("test_*.py")):
        tree = ast.parse(path.read_text())
        # Only what pytest collects: a fixture (`image`, `runtime`) or a hook in the same file is no check, and a
        # waiver matching only its name would waive nothing.
        names += [n.name.removeprefix("test_") for n in tree.body
                  if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]  # fmt: skip
    return tuple(names)


def parse_waivers(items: Sequence[str], option: str = "--skip") -> list[waivers.Waiver]:
    """CHECK=REASON items as given on a command line: each needs its reason, and CHECK must name (part of) a
    check that exists, so a typo never waives nothing silently."""
    try:
        parsed = waivers.parse_all(list(items))
    except ValueError as exc:
        raise UsageError(f"{option} {exc}") from None
    checks = known_checks()
    for waiver in parsed:
        if not any(waiver.check in check for check in checks):
            raise UsageError(
                f"{option} {waiver.check}: no check's name contains {waiver.check!r} "
                f"(`bwstack verify --list-checks` names them)"
            )
    return parsed


class HostUnavailable(Exception):
    """The host could not be checked at all (the probe could not run there); the message is one line."""


@dataclass
class CheckResult:
    host: str
    check: str
    outcome: str  # passed | failed | skipped | error
    message: str
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class HostReport:
    """One host's checks, or (unavailable) the one-line reason it could not be checked."""

    label: str
    checks: list[CheckResult] = field(default_factory=list)
    unavailable: str | None = None

    @property
    def ok(self) -> bool:
        """Nothing failed and something was verified: a run whose every check was skipped or waived (`--skip e=x`
        matches every name) proves nothing about the host."""
        return (
            self.unavailable is None
            and any(r.outcome == "passed" for r in self.checks)
            and not any(r.outcome in ("failed", "error") for r in self.checks)
        )


@dataclass(frozen=True)
class _Host:
    label: str
    spec: str  # testinfra's host spec


# ------------------------------------------------------------------------------------------------ pytest side


class _Collector:
    def __init__(self, label: str | None = None) -> None:
        self.label = label
        self.results: list[CheckResult] = []
        self.names: dict[str, tuple[str, str]] = {}
        self.unavailable: str | None = None

    @pytest.hookimpl
    def pytest_itemcollected(self, item: pytest.Item) -> None:
        """Host and check name from the parametrization itself (host ids may contain dashes)."""
        host, extra = self.label or "local", []
        callspec = getattr(item, "callspec", None)
        if callspec is not None:
            for key, value in callspec.params.items():
                if key == "_testinfra_host":
                    host = self.label or value.backend.get_pytest_id()
                else:
                    extra.append(str(value))
        name = getattr(item, "originalname", item.name).removeprefix("test_")
        self.names[item.nodeid] = (host, name + (f"[{','.join(extra)}]" if extra else ""))

    @pytest.hookimpl
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo) -> None:
        if call.excinfo is not None and call.excinfo.errisinstance(HostUnavailable):
            self.unavailable = self.unavailable or str(call.excinfo.value)

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            host, check = self.names.get(report.nodeid, (self.label or "local", report.nodeid.split("::")[-1]))
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
    for prefix in ("AssertionError: ", "Failed: ", "bwstack.checks.verify.HostUnavailable: "):
        text = text.removeprefix(prefix)
    return " ".join(text.split())


def _pytest_args(
    spec: str,
    lock_path: str,
    profile: str | None,
    env: str | None,
    capability: str | None,
    runtime: bool,
    facts_dir: str | None,
    skip: Sequence[str],
    extra_args: Sequence[str],
) -> list[str]:
    infra = infra_dir()
    # The session is the checks' alone. `-c /dev/null`: no ini file (pytest.ini, tox.ini, setup.cfg, pyproject.toml)
    # of a folder above the checks' sets an option, a plugin or a filter; --confcutdir: no conftest.py above them
    # is loaded. --color=no and -W default: the caller's PY_COLORS/PYTEST_THEME cannot end the session while it
    # renders a failure, nor PYTHONWARNINGS=error turn a warning into a failed check.
    args = [
        str(infra),
        f"--hosts={spec}",
        f"--stack-lock={lock_path}",
        "-c", os.devnull, f"--rootdir={infra}", f"--confcutdir={infra}",
        "-p", "no:cacheprovider", "-p", "testinfra.plugin",
        "-q", "--no-header", "--color=no", "-W", "default",
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
    args += [f"--stack-skip={item}" for item in skip]
    args += list(extra_args)
    return args


@contextlib.contextmanager
def _checks_environment(workdir: Path):
    """The environment while the checks run, put back after. testinfra's ansible backend runs ansible-inventory:
    the one installed beside this interpreter. Only Ansible's commands are put on PATH (links in a directory of
    our own): a local:// host keeps its own PATH (whether it has python3, say). And pytest's own settings of the
    caller's shell are set aside (below)."""
    tools = workdir / "bin"
    tools.mkdir(exist_ok=True)
    for name in ("ansible", "ansible-inventory"):
        beside = Path(sys.executable).parent / name
        if beside.is_file() and not (tools / name).exists():
            (tools / name).symlink_to(beside)
    old = {name: os.environ.get(name) for name in ("PATH", *_PYTEST_SETTINGS)}
    try:
        # An empty entry of PATH is the working folder: none is added (an unset PATH is the system's default).
        kept = [entry for entry in (old["PATH"] or os.defpath).split(os.pathsep) if entry]
        os.environ["PATH"] = os.pathsep.join([str(tools), *kept])
        # The report is the checks' alone: no pytest plugin that happens to be installed beside bwstack
        # (autoloaded from its entry point) and no PYTEST_ADDOPTS or PYTEST_PLUGINS of the caller's shell joins
        # the session; testinfra is named in the arguments. (Not loading the others also starts it sooner.)
        for name in _PYTEST_SETTINGS:
            os.environ.pop(name, None)
        os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
        yield
    finally:
        for name, value in old.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


_PYTEST_SETTINGS = ("PYTEST_ADDOPTS", "PYTEST_PLUGINS", "PYTEST_DISABLE_PLUGIN_AUTOLOAD")


def require_testinfra() -> None:
    """The checks are pytest-testinfra tests: without it pytest would fail deep inside its plugin loading."""
    import importlib.util

    if importlib.util.find_spec("testinfra") is None:
        raise UsageError(
            "the node checks need pytest-testinfra, which is not installed beside this bwstack: install bwstack "
            "with its dependencies (scripts/bootstrap.sh, or pip install bwstack)"
        )


def _run_host(host: _Host, env: str | None, **options) -> HostReport:
    """Reach the host, then run the checks in a pytest session of its own."""
    cause = _reach(host.spec, env)
    if cause is not None:
        return HostReport(host.label, unavailable=cause)
    collector = _Collector(host.label)
    sink = io.StringIO()
    args = _pytest_args(host.spec, env=env, **options)
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        code = pytest.main(args, plugins=[collector])
    if collector.unavailable is not None:
        return HostReport(host.label, unavailable=collector.unavailable)
    failed_to_run = (
        pytest.ExitCode.USAGE_ERROR,
        pytest.ExitCode.INTERNAL_ERROR,
        pytest.ExitCode.NO_TESTS_COLLECTED,
        pytest.ExitCode.INTERRUPTED,
    )
    if code in failed_to_run or not collector.results:
        text = sink.getvalue()
        lines = [line for line in text.strip().splitlines() if line.startswith(("E ", "ERROR"))]
        detail = " ".join(line.removeprefix("E").strip() for line in lines[-3:]) or text.strip()[-300:]
        return HostReport(host.label, unavailable=f"the checks could not run: {' '.join(detail.split())}")
    return HostReport(host.label, collector.results)


# ------------------------------------------------------------------------------------------------ reaching


_REACH_MARK = "bwstack-reached"


def _reach(spec: str, env: str | None) -> str | None:
    """None when the host answers and has a Python for the probe, else the cause in one line."""
    import testinfra

    python = f"{env}/bin/python" if env else ""
    command = (
        f"echo {_REACH_MARK}; p={shlex.quote(python)}; "
        'if [ -n "$p" ] && [ -x "$p" ]; then echo "python=$p"; '
        "elif command -v python3 >/dev/null 2>&1; then echo python=python3; else echo python=none; fi"
    )
    try:
        result = testinfra.get_host(spec).run(command)
    except RuntimeError as exc:  # testinfra's ssh backend raises with the CommandResult on exit 255
        got = exc.args[0] if exc.args else exc
        return "unreachable: " + _last_line(getattr(got, "stderr", "") or str(got))
    except Exception as exc:  # testinfra's backends raise what their transports raise
        return f"unreachable: {_last_line(str(exc)) or type(exc).__name__}"
    if _REACH_MARK not in result.stdout:
        return _last_line(result.stderr) or _last_line(result.stdout) or f"no answer (exit {result.rc})"
    if "python=none" in result.stdout:
        where = f" (and no {python})" if python else ""
        return f"no python3 on the host{where}: the checks run a Python probe there; install python3"
    return None


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    useful = [line for line in lines if not line.startswith(("Warning: Permanently added", "Pseudo-terminal"))]
    line = (useful or lines or [""])[-1]
    return line[:400]


# ------------------------------------------------------------------------------------------------ targets


def _ssh_config(workdir: Path, ssh: hostspec.SshOptions) -> Path:
    """An ssh_config for every SSH host of this run: the options given, no prompt (BatchMode), keep-alive,
    then the user's own ~/.ssh/config (for what they set there and we did not)."""
    path = workdir / "ssh_config"
    if path.exists():
        return path
    lines = ["Host *", "  BatchMode yes", *(f"  {line}" for line in SSH_ALIVE)]
    lines += [f"  {line}" for line in ssh.ssh_config_lines()]
    user_config = Path.home() / ".ssh" / "config"
    if user_config.is_file():
        lines.append(f'  Include "{str(user_config).replace("%", "%%")}"')
    path.write_text("\n".join(lines) + "\n")
    return path


def _hosts_of(target: hostspec.Target, ssh: hostspec.SshOptions, workdir: Path, name: str | None) -> list[_Host]:
    if isinstance(target, hostspec.LocalTarget):
        return [_Host(name or f"{socket.gethostname()} (local)", "local://")]
    if isinstance(target, hostspec.DockerTarget):
        return [_Host(name or target.label, f"docker://{target.container}")]
    config = quote(str(_ssh_config(workdir, ssh)), safe="/")
    if isinstance(target, hostspec.SshTarget):
        user = f"{target.user}@" if target.user else ""
        port = f":{target.port}" if target.port else ""
        spec = f"ssh://{user}{target.address}{port}?ssh_config={config}&timeout={SSH_CONNECT_TIMEOUT}"
        return [_Host(name or target.label, spec)]
    return _ansible_hosts(target, config, ssh)


def _ansible_hosts(target: hostspec.AnsibleTarget, config: str, ssh: hostspec.SshOptions) -> list[_Host]:
    """The inventory's hosts in the group (bwstack_nodes unless ?group=), narrowed by ?limit= as Ansible would."""
    from testinfra.utils.ansible_runner import AnsibleRunner

    binary = Path(sys.executable).parent / "ansible"
    cmd = [str(binary) if binary.is_file() else "ansible", target.pattern, "-i", str(target.inventory)]
    cmd += ["--list-hosts"] + (["--limit", target.limit] if target.limit else [])
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BwstackError(f"--target {target.label}: could not list its hosts ({exc})") from None
    names = [line.strip() for line in out.stdout.splitlines()[1:] if line.strip()]
    if out.returncode != 0 or not names:
        why = _last_line(out.stderr) or "no hosts matched"
        raise UsageError(f"--target {target.label}: no hosts in {target.pattern}" +
                         (f" matching {target.limit}" if target.limit else "") + f": {why}")  # fmt: skip
    inventory = quote(str(target.inventory.absolute()), safe="/")
    runner = AnsibleRunner(str(target.inventory))
    hosts = []
    for name in names:
        try:
            variables = runner.get_variables(name)
        except Exception as exc:  # testinfra asserts on ansible-inventory's exit code
            raise BwstackError(
                f"--target {target.label}: could not read the inventory: {_last_line(str(exc))}"
            ) from None
        if variables.get("ansible_connection") in ("local", "docker"):
            label = name
        else:
            port = variables.get("ansible_port")
            address = hostspec.SshTarget(
                host=str(variables.get("ansible_host") or name),
                user=variables.get("ansible_user"),
                port=int(port) if port else None,
            ).label
            label = address if address == name else f"{name} ({address})"
        spec = f"ansible://{name}?ansible_inventory={inventory}&ssh_config={config}"
        if ssh.key is not None:
            spec += f"&ssh_identity_file={quote(str(ssh.key), safe='/')}"
        hosts.append(_Host(label, spec))
    return hosts


# ------------------------------------------------------------------------------------------------ entry points


def check_hosts(
    targets: Sequence[hostspec.Target],
    *,
    lock_path: str,
    ssh: hostspec.SshOptions | None = None,
    host_name: str | None = None,
    profile: str | None = None,
    env: str | None = None,
    capability: str | None = None,
    runtime: bool = True,
    facts_dir: str | None = None,
    skip: Sequence[str] = (),
    extra_args: Sequence[str] = (),
) -> list[HostReport]:
    """Every host of every target, each in its own session; a host that cannot be checked is a one-line
    report, never an exception."""
    require_testinfra()
    ssh = ssh or hostspec.SshOptions()
    options = dict(
        lock_path=lock_path, profile=profile, capability=capability, runtime=runtime, facts_dir=facts_dir,
        skip=list(skip), extra_args=list(extra_args),
    )  # fmt: skip
    reports: list[HostReport] = []
    with tempfile.TemporaryDirectory(prefix="bwstack-verify-") as tmp, _checks_environment(Path(tmp)):
        hosts = [h for t in targets for h in _hosts_of(t, ssh, Path(tmp), host_name)]
        seen: set[str] = set()
        for host in hosts:
            label = host.label
            while label in seen:  # two inventory hosts at one address stay two reports
                label += "'"
            seen.add(label)
            reports.append(_run_host(_Host(label, host.spec), env, **options))
    return reports


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
    label: str | None = None,
) -> list[CheckResult]:
    """One testinfra host spec (what `bwstack image verify` and the benchmarks use), reported as `label`
    (default: the spec); a host that cannot be checked is one BwstackError line."""
    require_testinfra()
    label = label or (target.removesuffix("://") if target.startswith("local://") else target)
    with tempfile.TemporaryDirectory(prefix="bwstack-verify-") as tmp, _checks_environment(Path(tmp)):
        report = _run_host(
            _Host(label, target), env, lock_path=lock_path, profile=profile, capability=capability, runtime=runtime,
            facts_dir=facts_dir, skip=skip or [], extra_args=extra_args or [],
        )  # fmt: skip
    if report.unavailable is not None:
        raise BwstackError(f"{report.label}: not checked: {report.unavailable}")
    return report.checks


# ------------------------------------------------------------------------------------------------ output


def _reports(items: Sequence[CheckResult] | Sequence[HostReport]) -> list[HostReport]:
    """Host reports as given, or grouped from plain check results (image verify mixes image and node checks)."""
    out: dict[str, HostReport] = {}
    for item in items:
        if isinstance(item, HostReport):
            out[item.label] = item
        else:
            out.setdefault(item.host, HostReport(item.host)).checks.append(item)
    return list(out.values())


def render(items: Sequence[CheckResult] | Sequence[HostReport]) -> str:
    reports = _reports(items)
    if not reports:
        return "no checks ran"
    marks = {"passed": "PASS", "failed": "FAIL", "error": "ERROR", "skipped": "SKIP"}
    width = max((len(r.check) for rep in reports for r in rep.checks), default=0)
    lines = []
    for rep in reports:
        if rep.unavailable is not None:
            lines.append(f"{rep.label}: not checked: {rep.unavailable}")
            continue
        lines.append(f"{rep.label}:")
        for r in sorted(rep.checks, key=lambda r: (RESULT_ORDER.get(r.outcome, 9), r.check)):
            line = f"  {marks.get(r.outcome, r.outcome):<5} {r.check:<{width}}  {one_line(r.message)}"
            lines.append(line.rstrip())
            for note in r.notes:
                lines.append(f"  {'':<5} {'':<{width}}  note: {one_line(note)}")
        counts = {k: sum(r.outcome == k for r in rep.checks) for k in ("passed", "failed", "error", "skipped")}
        lines.append(
            f"  {counts['passed']} passed, {counts['failed'] + counts['error']} failed, {counts['skipped']} skipped"
        )
        if rep.checks and not counts["passed"] and not counts["failed"] + counts["error"]:
            lines.append("  nothing was verified: every check was skipped or waived (not a pass)")
    return "\n".join(lines)


def as_json(items: Sequence[CheckResult] | Sequence[HostReport]) -> str:
    """Per-host checks for fleets, plus the rendered table and the failure and waiver lines, so that callers
    (the verify role) show them as they are instead of re-rendering them."""
    reports = _reports(items)
    hosts = {
        rep.label: {"ok": rep.ok, "unavailable": rep.unavailable, "checks": [r.__dict__ for r in rep.checks]}
        for rep in reports
    }
    failures = [f"{rep.label}: not checked: {rep.unavailable}" for rep in reports if rep.unavailable is not None]
    checks = [r for rep in reports for r in rep.checks]
    failures += [f"{r.check}: {r.message}" for r in checks if r.outcome in ("failed", "error")]
    return json.dumps(
        {
            "ok": ok(reports),
            "hosts": hosts,
            "report": render(reports).splitlines(),
            "failures": failures,
            "waived": [
                f"{r.check}: {r.message}" for rep in reports for r in rep.checks if r.message.startswith(WAIVED)
            ],
        },
        indent=2,
    )


def ok(items: Sequence[CheckResult] | Sequence[HostReport]) -> bool:
    reports = _reports(items)
    return bool(reports) and all(rep.ok for rep in reports)
