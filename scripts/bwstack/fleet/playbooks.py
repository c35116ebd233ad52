"""The playbook runner behind `bwstack provision` and `rollback --target`, for users without inventory, and
the controller facts behind `bwstack controller-facts`. The CLI declares the options
(bwstack.cli.commands.provision, .rollback, .controller_facts) and hands this module typed settings
(bwstack.fleet.settings); nothing here reads a command line.

Controller facts are what the roles need from the lock (a profile's preflight requirements, its CUDA toolkit,
the lock's system packages, the profile a role means), plus, on request, the probe zipapp and a bwstack wheel
to ship to nodes. The roles never parse the lock in Jinja; they read this JSON.

Targets (bwstack.checks.hostspec): `local://` (this machine, connection=local), `ssh://[user@]host[:port]` (several,
comma-separated: a temporary inventory is written), or `ansible://INVENTORY[?limit=PATTERN&group=GROUP]` (yours);
`--ssh-key` and `--known-hosts` become the hosts' SSH settings. Ansible's whole output goes to a log file whose path
is printed first; the run prints one line per phase with its time (bwstack.fleet.phases), the download progress of a
local build, each failing task's message, and ends, on failure, with one line naming each failed host by its label
and its last error (or that it was unreachable). BWSTACK_ANSIBLE_OUTPUT=stream passes Ansible's output through as
it comes instead (what the Ansible tests read).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from bwstack import paths
from bwstack.checks import hostspec
from bwstack.errors import BwstackError, UsageError
from bwstack.fleet.settings import PlaybookSettings
from bwstack.fsutil import atomic_write_bytes
from bwstack.lock import uvtool
from bwstack.probe import pathtrust
from bwstack.probe.treecheck import read_bounded, sha256_file
from bwstack.terminal import visible

GROUP = "bwstack_nodes"
# Fixed zip timestamps (2026-01-01): an unchanged checkout gives the same wheel bytes, so shipping it to a
# node is a no-op on a converged re-run.
SOURCE_DATE_EPOCH = "1767225600"


# ------------------------------------------------------------------------------------------------ locating


def ansible_dir() -> Path:
    """The ansible/ directory: $BWSTACK_ANSIBLE_DIR (refused, not passed over, when it holds no playbooks), the
    checkout's, or the copy installed with the wheel (package `bwstack_ansible`)."""
    found = paths.shipped("ansible", "bwstack_ansible", "provision.yml", env="BWSTACK_ANSIBLE_DIR")
    if found is None:
        raise UsageError(
            "the bwstack playbooks (ansible/provision.yml) are not installed with this bwstack: run it from a "
            "checkout, or set BWSTACK_ANSIBLE_DIR to the repository's ansible/ directory"
        )
    return found


def ansible_playbook() -> str:
    beside = Path(sys.executable).parent / "ansible-playbook"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("ansible-playbook")
    if found:
        return found
    raise BwstackError(
        f"ansible-playbook not found (neither beside {sys.executable} nor on PATH): "
        "install ansible-core into bwstack's environment (`pip install 'ansible-core>=2.16'`)"
    )


def source_tree() -> Path | None:
    """bwstack's own checkout (an editable install), from which the wheel for nodes is built."""
    return paths.checkout()


# ------------------------------------------------------------------------------------------------ controller facts


def _own_folder(directory: Path, option: str) -> tuple[Path, bool]:
    """The controller's cache folder for the probe and the wheel, whose files the playbooks ship to nodes and run
    there as root: a directory of this user's (made 0700 when it does not exist), and whether what it holds can
    be trusted. One that others could write (made under umask 002 by an earlier bwstack) is closed to them, and
    what it holds is made again: a file left under the probe's or the wheel's name would be shipped. Every folder
    above it must be closed to others too (or sticky, as /tmp is): whoever could write one could put another
    folder in its place. Missing folders are made 0700 here, whatever the umask."""
    directory = Path(os.path.abspath(directory))
    try:
        missing, folder = [], directory
        while not os.path.lexists(folder):
            missing.append(folder)
            folder = folder.parent
        for folder in reversed(missing):
            with contextlib.suppress(FileExistsError):  # made by another run meanwhile: checked below like any
                os.mkdir(folder, 0o700)
        st = os.lstat(directory)
        unsafe = pathtrust.open_to_others(directory)
    except OSError as exc:
        raise UsageError(f"{option} {directory}: cannot be made ({exc.strerror})") from None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise UsageError(
            f"{option} {directory}: not a directory of this user's (a file, a link, or another owner): set "
            f"bwstack_controller_cache to a folder of this user's"
        )
    if unsafe:
        raise UsageError(
            f"{option} {directory}: {unsafe}, so others could replace what bwstack writes there, which nodes run as "
            f"root: set bwstack_controller_cache to a folder only this user can write (or close that one)"
        )
    if st.st_mode & 0o022 and not (st.st_mode & 0o002 == 0 and pathtrust.private_group(st.st_gid)):
        os.chmod(directory, stat.S_IMODE(st.st_mode) & ~0o022)
        return directory, False
    return directory, True


def _holds(path: Path, sha256: str) -> bool:
    """`path` is a regular file (not a link) with these bytes."""
    try:
        return sha256_file(path) == sha256
    except OSError:
        return False


def write_probe(directory: Path) -> Path:
    """The probe zipapp in the controller's cache, reused only while it holds the bundle's bytes."""
    from bwstack.fleet import probe_bundle

    directory, trusted = _own_folder(directory, "--probe-dir")
    name = f"bwstack-probe-{probe_bundle.digest()}.pyz"
    if trusted and _holds(directory / name, probe_bundle.sha256()):
        return directory / name
    return probe_bundle.write(directory / name)


_COPY_IGNORE = shutil.ignore_patterns(
    ".git",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    "*.pyc",
    ".venv",
    ".pytest_cache",
    ".ruff_cache",
    ".bench",
    ".artifacts",
    ".whl",
    ".cache",
)


WHEEL_STAMP = ".bwstack-wheel.json"  # which sources the wheel beside it was built from
WHEEL_NAME = re.compile(r"bwstack-[A-Za-z0-9_.+-]+\.whl")
WHEEL_SOURCES = ("pyproject.toml", "README.md", "scripts/bwstack", "tests/infra", "ansible")


def _source_digest(src: Path) -> str:
    """What the wheel is built from; an unchanged checkout reuses the wheel built last time (pip's isolated
    build costs seconds on every playbook run otherwise)."""
    digest = hashlib.sha256()
    for top in WHEEL_SOURCES:
        base = src / top
        paths = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file())
        for path in paths:
            if "__pycache__" in path.parts or path.suffix == ".pyc":
                continue
            digest.update(str(path.relative_to(src)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def build_wheel(directory: Path) -> dict:
    """`pip wheel --no-deps` of a clean copy of the checkout (no stale build/ files), reproducible, placed
    atomically in `directory`; reused while the sources are unchanged."""
    src = source_tree()
    if src is None:
        raise UsageError(
            "this bwstack is not an editable checkout, so there is no source to build a wheel from: "
            "set bwstack_tool_wheel to a bwstack wheel on the controller"
        )
    source_digest = _source_digest(src)
    directory, trusted = _own_folder(directory, "--wheel-dir")
    stamp = directory / WHEEL_STAMP
    try:
        if not trusted:
            raise ValueError("others could write the folder: build again")
        built = json.loads(read_bounded(stamp, 4096, "a wheel stamp"))
        name = built["name"]
        if (
            isinstance(name, str)
            and WHEEL_NAME.fullmatch(name)
            and built["source"] == source_digest
            and _holds(directory / name, built["sha256"])
        ):
            return {"path": str(directory / name), "name": name, "sha256": built["sha256"]}
    except (OSError, ValueError, KeyError, TypeError):
        pass  # none yet, or not one this module wrote: build again
    with tempfile.TemporaryDirectory(prefix="bwstack-wheel-") as tmp:
        copy = Path(tmp) / "src"
        shutil.copytree(src, copy, ignore=_COPY_IGNORE, symlinks=True)
        out = Path(tmp) / "out"
        result = subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--wheel-dir", str(out), str(copy)],
            capture_output=True, text=True, env={**os.environ, "SOURCE_DATE_EPOCH": SOURCE_DATE_EPOCH},
        )  # fmt: skip
        wheels = sorted(out.glob("bwstack-*.whl"))
        if result.returncode != 0 or len(wheels) != 1:
            tail = (result.stderr or result.stdout).strip()[-800:]
            raise BwstackError(f"could not build the bwstack wheel from {src}: {tail}")
        path = directory / wheels[0].name
        atomic_write_bytes(path, wheels[0].read_bytes())
    result = {"path": str(path), "name": path.name, "sha256": sha256_file(path)}
    doc = json.dumps({"source": source_digest, "name": path.name, "sha256": result["sha256"]}).encode()
    atomic_write_bytes(stamp, doc)
    return result


def controller_facts(
    lock, probe_dir: str | None, wheel_dir: str | None, wheel: str | None, *, profile: str | None = None
) -> dict:
    """`profile` is what a role was given ('' or None: nothing); `facts["profile"]` is the profile that means,
    by the lock's one rule (Lock.profile_name), so a role needs no rule of its own."""
    from bwstack.probe import preflight

    chosen = lock.profile_name(profile or None)
    profiles = {}
    for name, profile in lock.profiles.items():
        cuda = profile.cuda
        profiles[name] = {
            "requirements": preflight.requirements_of(profile),
            "cuda": {
                "version": cuda.version,
                "major_minor": cuda.major_minor,
                "home": cuda.home,
                "min_driver": cuda.min_driver,
                "apt_package": cuda.apt_package,
                "apt_version": cuda.apt_version,
                "pip": f"cuda-toolkit[{','.join(cuda.pip_components)}]=={cuda.pip_version}",
            },
            "python": profile.python,
        }
    facts: dict = {
        "lock": str(Path(lock.path).resolve()),
        "lock_sha256": sha256_file(Path(lock.path)),
        "default_profile": lock.profile_name(None),
        "rollback_profile": lock.rollback_profile,
        "system_packages": {os_id: list(pkgs) for os_id, pkgs in lock.system_packages.items()},
        "profiles": profiles,
        "profile": chosen,
    }
    if probe_dir:
        facts["probe"] = str(write_probe(Path(probe_dir)))
    if wheel:
        path = Path(wheel)
        if not path.is_file() or not path.name.startswith("bwstack-") or path.suffix != ".whl":
            raise UsageError(f"--wheel {wheel}: not a bwstack wheel file")
        facts["wheel"] = {"path": str(path.resolve()), "name": path.name, "sha256": sha256_file(path)}
    elif wheel_dir:
        facts["wheel"] = build_wheel(Path(wheel_dir))
    return facts


# ------------------------------------------------------------------------------------------------ targets


def local_python() -> str:
    """The interpreter for modules on this machine: the system's (it has apt's bindings), else bwstack's."""
    return "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable


def local_tool_uv() -> dict[str, str]:
    """The tool role's uv for this machine: the uv bwstack runs here (the same user runs both), which makes the
    node's tool venv in about a second where python -m venv and pip take about eight. None found: pip."""
    try:
        return {"bwstack_tool_uv": uvtool.uv_bin()}
    except BwstackError:
        return {}


@dataclass(frozen=True)
class PlaybookTargets:
    """What `--target` turns into for ansible-playbook: its arguments, extra vars, and an inventory to write
    (local:// and ssh:// targets) with the label of each inventory host (for the one-line summary)."""

    args: list[str]
    extra: dict
    inventory: dict | None
    labels: dict[str, str]


def parse_targets(spec: str, ssh: hostspec.SshOptions | None = None) -> PlaybookTargets:
    ssh = ssh or hostspec.SshOptions()
    targets = hostspec.parse(spec, frozenset({hostspec.Scheme.LOCAL, hostspec.Scheme.SSH, hostspec.Scheme.ANSIBLE}))
    ansible = [t for t in targets if isinstance(t, hostspec.AnsibleTarget)]
    if ansible and len(targets) > 1:
        raise UsageError("--target: combine ansible:// with nothing else (put those hosts in your inventory)")
    if ansible:
        target = ansible[0]
        args = ["-i", str(target.inventory)] + (["--limit", target.limit] if target.limit else [])
        extra = {**ssh.ansible_vars(), **({"bwstack_hosts": target.group} if target.group else {})}
        return PlaybookTargets(args, extra, None, {})
    hosts: dict[str, dict] = {}
    labels: dict[str, str] = {}
    for target in targets:
        if not isinstance(target, hostspec.SshTarget):  # local://
            hosts["localhost"] = {"ansible_connection": "local", "ansible_python_interpreter": local_python(),
                                  **local_tool_uv()}  # fmt: skip
            labels["localhost"] = "localhost"
            continue
        entry: dict = {"ansible_host": target.host, "ansible_connection": "ssh", **ssh.ansible_vars()}
        if target.user:
            entry["ansible_user"] = target.user
        if target.user and target.user != "root":
            entry["ansible_become"] = True  # the roles write /opt, /usr/local and apt state
        if target.port:
            entry["ansible_port"] = target.port
        hosts[target.inventory_name] = entry
        labels[target.inventory_name] = target.label
    inventory = {"all": {"children": {GROUP: {"hosts": hosts}}}}
    return PlaybookTargets([], {}, inventory, labels)


def _common_vars(settings: PlaybookSettings) -> dict:
    """Extra vars for the options the user gave (what they did not give stays with the inventory)."""
    out: dict = {"bwstack_lock": str(Path(settings.lock).resolve())}
    store, sources = settings.store, settings.sources
    pairs = {
        "bwstack_root": store.root,
        "bwstack_ml_env": store.ml_env,
        "bwstack_cuda_link": store.cuda_link,
        "bwstack_ca_bundle": sources.ca_bundle,
    }
    for key, value in pairs.items():
        if value is not None and not value.strip():
            raise UsageError(f"--{key.removeprefix('bwstack_').replace('_', '-')}: empty")
    out.update({k: v for k, v in pairs.items() if v})
    lists = {
        "bwstack_wheelhouse": sources.wheelhouse,
        "bwstack_index": sources.index,
        "bwstack_allow_unhashed": sources.allow_unhashed,
    }
    out.update({k: list(v) for k, v in lists.items() if v})
    if settings.waivers:
        out["bwstack_verify_skip"] = list(settings.waivers)
    if sources.offline:
        out["bwstack_offline"] = True
    if store.take_over_links:
        out["bwstack_take_over_links"] = True
    return out


_FATAL = re.compile(r"^fatal: \[(?P<host>[^\]]+)\]: (?P<kind>UNREACHABLE|FAILED)! => (?P<body>.*)$")
_CREDENTIALS = re.compile(r"(://)[^/@\s]+@")


def redact(text: str) -> str:
    """user:token@ in URLs (index URLs may carry credentials) -> ***@."""
    return _CREDENTIALS.sub(r"\1***@", text)


@dataclass
class _Outcome:
    """What the run said about each host that failed: its last fatal message, and whether it was unreachable."""

    failed: dict[str, tuple[str, str]] = field(default_factory=dict)

    def read(self, line: str) -> None:
        found = _FATAL.match(line.strip())
        if not found:
            return
        body = found["body"]
        try:
            message = str(json.loads(body).get("msg") or body)
        except (ValueError, AttributeError):
            message = body
        message = " ".join(message.removeprefix("Task failed: ").split())
        self.failed[found["host"]] = (found["kind"], message)

    def summary(self, labels: dict[str, str]) -> str:
        parts = []
        for host, (kind, message) in self.failed.items():
            prefix = "unreachable: " if kind == "UNREACHABLE" else ""
            parts.append(f"{labels.get(host, host)}: {prefix}{message[:400]}")
        return "; ".join(parts)


def _ansible_env(directory: Path, tmp: Path) -> dict:
    """ansible-playbook's environment: bwstack's ansible.cfg, and its local temporary files inside our own
    temporary directory (removed whatever way the run ends). No UV_* setting of the caller's: a local node's tasks
    inherit this environment, and its tool role's uv (bwstack_tool_uv) would take the caller's extra indexes,
    find-links or insecure hosts; bwstack's own uv runs set what they need (lock.uvtool.uv_env)."""
    local_tmp = tmp / "ansible-local"
    local_tmp.mkdir()
    own = {k: v for k, v in os.environ.items() if not k.startswith("UV_")}
    return {**own, "ANSIBLE_CONFIG": str(directory / "ansible.cfg"), "ANSIBLE_LOCAL_TEMP": str(local_tmp)}


class _Terminated(Exception):
    pass


def _raise_terminated(signum, _frame) -> None:
    raise _Terminated(signum)


class _LiteralDumper(yaml.SafeDumper):
    """Every string value tagged !unsafe: Ansible takes it as the text it is and never renders it as a template
    (a --root, a waiver reason or an index password holding `{{ lookup('pipe', ...) }}` would otherwise run on
    the controller). Mapping keys stay plain: they are variable names."""

    def represent_dict(self, data):  # type: ignore[override]
        key = "tag:yaml.org,2002:str"
        pairs = [(self.represent_scalar(key, str(k)), self.represent_data(v)) for k, v in data.items()]
        return yaml.MappingNode("tag:yaml.org,2002:map", pairs)


_LiteralDumper.add_representer(dict, _LiteralDumper.represent_dict)
_LiteralDumper.add_representer(str, lambda dumper, text: dumper.represent_scalar("!unsafe", text, style='"'))


def literal_vars(variables: dict) -> str:
    """variables as an Ansible extra-vars file (YAML) whose strings are data, never templates."""
    return yaml.dump(variables, Dumper=_LiteralDumper, sort_keys=False, allow_unicode=True, width=1 << 30)


def run_playbook(playbook: str, settings: PlaybookSettings, extra_vars: dict) -> int:
    directory = ansible_dir()
    binary = ansible_playbook()
    targets = parse_targets(settings.target.spec, settings.target.ssh)
    variables = {**_common_vars(settings), **targets.extra, **extra_vars}
    outcome = _Outcome()
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        with tempfile.TemporaryDirectory(prefix="bwstack-ansible-") as tmp:
            cmd = [binary, str(directory / playbook), *targets.args]
            if targets.inventory is not None:
                inv = Path(tmp) / "inventory.yml"  # its values are text, never templates (literal_vars)
                inv.write_text(literal_vars(targets.inventory))
                cmd += ["-i", str(inv)]
            local = targets.labels == {"localhost": "localhost"}
            if local:  # the build runs on this machine: its download progress can be shown as it goes
                variables["bwstack_progress_file"] = str(Path(tmp) / "progress.json")
            vars_file = Path(tmp) / "extra-vars.yml"
            vars_file.write_text(literal_vars(variables))
            cmd += ["-e", f"@{vars_file}"]
            for item in settings.extra_vars:
                cmd += ["-e", item]
            if settings.check:
                cmd.append("--check")
            if settings.diff:
                cmd.append("--diff")
            print(visible(f"bwstack: running {redact(shlex.join(cmd))}"), file=sys.stderr, flush=True)
            env = _ansible_env(directory, Path(tmp))
            if os.environ.get("BWSTACK_ANSIBLE_OUTPUT") == "stream":
                code = _stream(cmd, env, directory, outcome)
            else:
                code = _run_quiet(cmd, env, directory, outcome, Path(tmp))
    except KeyboardInterrupt:
        print("bwstack: interrupted", file=sys.stderr)
        return 130
    except _Terminated:
        print("bwstack: terminated", file=sys.stderr)
        return 143
    finally:
        signal.signal(signal.SIGTERM, previous)
    if code != 0:
        where = outcome.summary(targets.labels)
        detail = f": {where}" if where else f" (exit {code}); see the output above"
        print(visible(f"bwstack: error: {playbook} failed{detail}"), file=sys.stderr)
        return 1
    return 0


def _stream(cmd: list[str], env: dict, cwd: Path, outcome: _Outcome) -> int:
    """Run ansible-playbook, passing its output through as it comes and reading each host's fatal lines."""
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(visible(line))
            sys.stdout.flush()
            outcome.read(line)
        return proc.wait()
    except BaseException:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise


def _run_quiet(cmd: list[str], env: dict, cwd: Path, outcome: _Outcome, tmp: Path) -> int:
    """Run ansible-playbook with its whole output in a log file (path printed first); print one line per phase
    with its time (bwstack_events callback), download progress of a local build, and on failure the failing
    task's message."""
    from bwstack.fleet import phases

    log = phases.new_log("provision" if "provision" in cmd[1] else Path(cmd[1]).stem)
    print(visible(f"bwstack: Ansible's output: {log}"), flush=True)
    events_path = tmp / "events.jsonl"
    events_path.touch()
    env = {**env, "BWSTACK_EVENTS": str(events_path), "ANSIBLE_CALLBACKS_ENABLED": _callbacks(env),
           "ANSIBLE_CALLBACK_PLUGINS": _callback_dirs(cwd, env)}  # fmt: skip
    report = phases.PhaseReport(lambda line: print(visible(line), flush=True))
    tail = phases.EventTail(events_path)
    watch = phases.DownloadWatch(tmp / "progress.json")
    with open(log, "a", encoding="utf-8") as out, watch:
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                out.write(line)
                outcome.read(line)
                for event in tail.read():
                    report.feed(event)
            code = proc.wait()
        except BaseException:
            _stop(proc)
            raise
    for event in tail.read():
        report.feed(event)
    report.finish()
    for failure in report.failures:
        print(visible(f"bwstack: {failure}"), flush=True)
    if code != 0:
        print(visible(f"bwstack: the whole Ansible output is in {log}"), flush=True)
    return code


def _callbacks(env: dict) -> str:
    enabled = [c for c in env.get("ANSIBLE_CALLBACKS_ENABLED", "").split(",") if c.strip()]
    return ",".join([*enabled, "bwstack_events"])


def _callback_dirs(directory: Path, env: dict) -> str:
    given = env.get("ANSIBLE_CALLBACK_PLUGINS", "")
    return os.pathsep.join(p for p in (str(directory / "callback_plugins"), given) if p)


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_provision(
    settings: PlaybookSettings,
    *,
    profile: str | None = None,
    cuda_method: str | None = None,
    allow_no_gpu: bool = False,
    min_free_gb: float | None = None,
    full: bool = False,
) -> int:
    """provision.yml on the targets. What is not given is left to the inventory (and the roles' defaults:
    no profile means the lock's default_profile, resolved by the roles through controller-facts)."""
    extra: dict = {}
    if profile:
        extra["bwstack_profile"] = profile
    if cuda_method:
        extra["bwstack_cuda_method"] = cuda_method
    if allow_no_gpu:
        extra["bwstack_preflight_allow_no_gpu"] = True
    if min_free_gb is not None:
        extra["bwstack_preflight_min_free_gb"] = min_free_gb
    if full:
        extra["bwstack_converged_check"] = False
    return run_playbook("provision.yml", settings, extra)


def run_rollback(
    settings: PlaybookSettings, *, to: str | None = None, profile: str | None = None, rebuild: bool = False
) -> int:
    extra: dict = {}
    if to:
        extra["bwstack_mlenv_rollback_to"] = to
    if profile:
        extra["bwstack_mlenv_rollback_profile"] = profile
    if rebuild:
        extra["bwstack_mlenv_rollback_rebuild"] = True
    return run_playbook("rollback.yml", settings, extra)
