"""`bwstack provision` (and `rollback --target`): drive the Ansible playbooks for users without inventory.

Also `bwstack controller-facts`, which the roles run on the controller: what they need from the lock (a
profile's preflight requirements, its CUDA toolkit, the lock's system packages) plus, on request, the probe
zipapp and a bwstack wheel to ship to nodes. The roles never parse the lock in Jinja; they read this JSON.

Targets (bwstack.checks.hostspec): `local://` (this machine, connection=local), `ssh://[user@]host[:port]` (several,
comma-separated: a temporary inventory is written), or `ansible://INVENTORY[?limit=PATTERN&group=GROUP]` (yours);
`--ssh-key` and `--known-hosts` become the hosts' SSH settings. The run streams Ansible's output and ends, on
failure, with one line naming each failed host by its label and its last error (or that it was unreachable).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from bwstack import paths
from bwstack.checks import hostspec
from bwstack.errors import BwstackError, UsageError

GROUP = "bwstack_nodes"
# Fixed zip timestamps (2026-01-01): an unchanged checkout gives the same wheel bytes, so shipping it to a
# node is a no-op on a converged re-run.
SOURCE_DATE_EPOCH = "1767225600"


# ------------------------------------------------------------------------------------------------ locating


def _shipped_ansible() -> Path | None:
    """The copy of ansible/ installed with the wheel (package `bwstack_ansible`)."""
    try:
        import bwstack_ansible
    except ImportError:
        return None
    return Path(bwstack_ansible.__path__[0])


def ansible_dir() -> Path:
    """The ansible/ directory: $BWSTACK_ANSIBLE_DIR, the checkout's, or a copy shipped in the package."""
    candidates = [os.environ.get("BWSTACK_ANSIBLE_DIR"), paths.in_checkout("ansible"), _shipped_ansible()]
    for candidate in candidates:
        if candidate and (Path(candidate) / "provision.yml").is_file():
            return Path(candidate)
    raise UsageError(
        "the bwstack playbooks (ansible/provision.yml) are not installed with this bwstack: run it from a "
        "checkout, or set BWSTACK_ANSIBLE_DIR to the repository's ansible/ directory"
    )


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


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _atomic_copy_into(src: Path, dest_dir: Path) -> Path:
    dest_dir.mkdir(parents=True, exist_ok=True)
    dest = dest_dir / src.name
    tmp = dest_dir / f".{src.name}.{os.getpid()}.tmp"
    shutil.copyfile(src, tmp)
    os.replace(tmp, dest)
    return dest


def write_probe(directory: Path) -> Path:
    from bwstack.fleet import probe_bundle

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"bwstack-probe-{probe_bundle.digest()}.pyz"
    if not path.is_file():
        tmp = directory / f".{path.name}.{os.getpid()}.tmp"
        probe_bundle.write(tmp)
        os.replace(tmp, path)
    return path


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
    stamp = directory / ".bwstack-wheel.json"
    try:
        built = json.loads(stamp.read_text())
        path = directory / built["name"]
        if built["source"] == source_digest and path.is_file() and _sha256(path) == built["sha256"]:
            return {"path": str(path), "name": path.name, "sha256": built["sha256"]}
    except (OSError, ValueError, KeyError):
        pass
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
        path = _atomic_copy_into(wheels[0], directory)
    result = {"path": str(path), "name": path.name, "sha256": _sha256(path)}
    stamp.write_text(json.dumps({"source": source_digest, "name": path.name, "sha256": result["sha256"]}))
    return result


def controller_facts(
    lock, probe_dir: str | None, wheel_dir: str | None, wheel: str | None, profile_name: str | None = None
) -> dict:
    from bwstack.probe import preflight

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
        "default_profile": lock.default_profile,
        # the profile a role works on: the one it names, else the lock's default (bwstack resolves it, and
        # refuses an unknown one; the roles never pick)
        "profile": lock.profile(profile_name).name,
        "rollback_profile": lock.rollback_profile,
        "system_packages": {os_id: list(pkgs) for os_id, pkgs in lock.system_packages.items()},
        "profiles": profiles,
    }
    if probe_dir:
        facts["probe"] = str(write_probe(Path(probe_dir)))
    if wheel:
        path = Path(wheel)
        if not path.is_file() or not path.name.startswith("bwstack-") or path.suffix != ".whl":
            raise UsageError(f"--wheel {wheel}: not a bwstack wheel file")
        facts["wheel"] = {"path": str(path.resolve()), "name": path.name, "sha256": _sha256(path)}
    elif wheel_dir:
        facts["wheel"] = build_wheel(Path(wheel_dir))
    return facts


def cmd_controller_facts(args: argparse.Namespace) -> int:
    from bwstack.lock.model import load_lock

    facts = controller_facts(load_lock(args.lock), args.probe_dir, args.wheel_dir, args.wheel, args.profile)
    json.dump(facts, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


# ------------------------------------------------------------------------------------------------ targets


def local_python() -> str:
    """The interpreter for modules on this machine: the system's (it has apt's bindings), else bwstack's."""
    return "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable


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
            hosts["localhost"] = {"ansible_connection": "local", "ansible_python_interpreter": local_python()}
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


def _common_vars(args: argparse.Namespace) -> dict:
    """Extra vars for the options the user gave (what they did not give stays with the inventory)."""
    out: dict = {"bwstack_lock": str(Path(args.lock).resolve())}
    pairs = {
        "bwstack_root": getattr(args, "root", None),
        "bwstack_ml_env": getattr(args, "ml_env", None),
        "bwstack_cuda_link": getattr(args, "cuda_link", None),
        "bwstack_ca_bundle": getattr(args, "ca_bundle", None),
    }
    for key, value in pairs.items():
        if value is not None and not value.strip():
            raise UsageError(f"--{key.removeprefix('bwstack_').replace('_', '-')}: empty")
    out.update({k: v for k, v in pairs.items() if v})
    lists = {
        "bwstack_wheelhouse": getattr(args, "wheelhouse", None),
        "bwstack_index": getattr(args, "index", None),
        "bwstack_allow_unhashed": getattr(args, "allow_unhashed", None),
    }
    out.update({k: list(v) for k, v in lists.items() if v})
    skip = getattr(args, "skip", None)
    if skip:
        from bwstack.checks.verify import parse_waivers

        out["bwstack_verify_skip"] = [w.text() for w in parse_waivers(skip)]
    if getattr(args, "offline", False):
        out["bwstack_offline"] = True
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
    temporary directory (removed whatever way the run ends)."""
    local_tmp = tmp / "ansible-local"
    local_tmp.mkdir()
    return {**os.environ, "ANSIBLE_CONFIG": str(directory / "ansible.cfg"), "ANSIBLE_LOCAL_TEMP": str(local_tmp)}


class _Terminated(Exception):
    pass


def _raise_terminated(signum, _frame) -> None:
    raise _Terminated(signum)


def run_playbook(playbook: str, args: argparse.Namespace, extra_vars: dict) -> int:
    directory = ansible_dir()
    binary = ansible_playbook()
    ssh = hostspec.SshOptions.from_args(getattr(args, "ssh_key", None), getattr(args, "known_hosts", None))
    targets = parse_targets(args.target, ssh)
    variables = {**_common_vars(args), **targets.extra, **extra_vars}
    outcome = _Outcome()
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        with tempfile.TemporaryDirectory(prefix="bwstack-ansible-") as tmp:
            cmd = [binary, str(directory / playbook), *targets.args]
            if targets.inventory is not None:
                inv = Path(tmp) / "inventory.json"
                inv.write_text(json.dumps(targets.inventory, indent=2))
                cmd += ["-i", str(inv)]
            vars_file = Path(tmp) / "extra-vars.json"
            vars_file.write_text(json.dumps(variables, indent=2))
            cmd += ["-e", f"@{vars_file}"]
            for item in getattr(args, "extra_vars", None) or []:
                cmd += ["-e", item]
            if getattr(args, "check", False):
                cmd.append("--check")
            if getattr(args, "diff", False):
                cmd.append("--diff")
            print(f"bwstack: running {redact(shlex.join(cmd))}", file=sys.stderr, flush=True)
            code = _stream(cmd, _ansible_env(directory, Path(tmp)), directory, outcome)
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
        print(f"bwstack: error: {playbook} failed{detail}", file=sys.stderr)
        return 1
    return 0


def _stream(cmd: list[str], env: dict, cwd: Path, outcome: _Outcome) -> int:
    """Run ansible-playbook, passing its output through as it comes and reading each host's fatal lines."""
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
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


def cmd_provision(args: argparse.Namespace) -> int:
    extra: dict = {}
    if args.profile:
        extra["bwstack_profile"] = args.profile
    if args.cuda_method:
        extra["bwstack_cuda_method"] = args.cuda_method
    if args.allow_no_gpu:
        extra["bwstack_preflight_allow_no_gpu"] = True
    if args.min_free_gb is not None:
        extra["bwstack_preflight_min_free_gb"] = args.min_free_gb
    return run_playbook("provision.yml", args, extra)


def run_rollback(args: argparse.Namespace) -> int:
    extra: dict = {}
    if args.to:
        extra["bwstack_mlenv_rollback_to"] = args.to
    if args.profile:
        extra["bwstack_mlenv_rollback_profile"] = args.profile
    if args.rebuild:
        extra["bwstack_mlenv_rollback_rebuild"] = True
    return run_playbook("rollback.yml", args, extra)


# ------------------------------------------------------------------------------------------------ parser


def register(sub: argparse._SubParsersAction) -> None:
    """Add `provision` and `controller-facts`; give `rollback` the options its --target mode needs."""
    from bwstack.cli.main import _add_ssh_options, _add_waiver_option

    p = sub.add_parser(
        "provision",
        help="run the provision playbook (preflight, CUDA, env, verify) on local://, ssh:// or ansible:// targets",
    )
    p.add_argument(
        "--target",
        default="local://",
        help="local:// (default), ssh://[user@]host[:port][,ssh://...], or ansible://INVENTORY[?limit=...&group=...]",
    )
    p.add_argument("--profile", help="the lock's profile (default: its default_profile)")
    p.add_argument("--check", action="store_true", help="report what would change; change nothing")
    p.add_argument("--diff", action="store_true", help="show the planned changes as diffs")
    p.add_argument(
        "--cuda-method",
        choices=["pip", "apt", "none"],
        help="how the profile's CUDA toolkit is installed (default pip; none: managed elsewhere)",
    )
    p.add_argument(
        "--allow-no-gpu",
        action="store_true",
        help="accept CPU-only targets (containers, CI); said loudly in the output",
    )
    p.add_argument(
        "--min-free-gb", type=float, help="free disk the preflight requires at the store for a build (default 25)"
    )
    _add_store_and_sources(p)
    _add_waiver_option(p)
    _add_playbook_options(p)
    _add_ssh_options(p)
    p.set_defaults(func=cmd_provision)

    rollback = sub.choices.get("rollback")
    if rollback is not None:
        _add_waiver_option(rollback)
        _add_playbook_options(rollback)
        _add_ssh_options(rollback)

    p = sub.add_parser("controller-facts", help="(for the Ansible roles) what the lock says, as JSON")
    p.add_argument("--probe-dir", help="also write the probe zipapp into this directory")
    p.add_argument("--wheel-dir", help="also build bwstack's wheel (pip wheel --no-deps) into this directory")
    p.add_argument("--wheel", help="use this bwstack wheel instead of building one")
    p.add_argument("--profile", help="the profile to resolve as `profile` (default: the lock's default_profile)")
    p.set_defaults(func=cmd_controller_facts)


def _add_playbook_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-e", "--extra-vars", action="append", metavar="VARS", help="passed to ansible-playbook -e (repeatable)"
    )


def _add_store_and_sources(p: argparse.ArgumentParser) -> None:
    p.add_argument("--root", help=f"bwstack's store on the targets (default {paths.DEFAULT_ROOT})")
    p.add_argument("--ml-env", help="the env path users run on the targets (default /opt/ml-env)")
    p.add_argument("--cuda-link", help="the /usr/local/cuda-style link on the targets ('none' to leave it)")
    p.add_argument("--wheelhouse", action="append", help="directory of wheels on the targets, used first (repeatable)")
    p.add_argument("--index", action="append", metavar="NAME=URL", help="a mirror for one of the lock's indexes")
    p.add_argument("--offline", action="store_true", help="use only --wheelhouse (and the node's wheel store)")
    p.add_argument("--ca-bundle", help="CA bundle on the targets for TLS (always verified)")
    p.add_argument(
        "--allow-unhashed",
        action="append",
        metavar="NAME",
        help="install NAME although the lock has no sha256 for it (recorded as unverified)",
    )
