"""What the tests share: paths, the CLI run as a user runs it, the Ansible runners and markers.

Tests import from here, never from another test module or from conftest (which holds only fixtures).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from bwstack.fleet import playbooks

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
REAL_LOCK = REPO / "stack.lock.yaml"
MACHINES = TESTS / "fixtures" / "machines"  # TEST FIXTURE recorded machine descriptions (see its README.md)
# Set by the test that ran the real cu128 provision through the playbooks this session (the SSH node flow): the
# local real run (test_ansible_real.py) is its stand-in where Docker has no room for the node, not a second copy.
REAL_PLAYBOOK_RUN = pytest.StashKey[str]()


def bwstack(
    *args: str, env: dict | None = None, check: bool = False, timeout: int = 900
) -> subprocess.CompletedProcess:
    """Run the real CLI in a subprocess (as a user would)."""
    full_env = {**os.environ, **(env or {})}
    result = subprocess.run(
        [sys.executable, "-m", "bwstack", *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"bwstack {' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
        )
    return result


def vouched(archive: Path) -> list[str]:
    """`--sha256 <the archive's>`: what an operator gives `restore` for an archive another store wrote, after
    comparing it with what `bwstack backup --archive` printed there."""
    return ["--sha256", hashlib.sha256(Path(archive).read_bytes()).hexdigest()]


def have_python312() -> bool:
    from bwstack.provision.envbuild import find_python

    try:
        find_python("3.12")
        return True
    except Exception:
        return False


needs_py312 = pytest.mark.skipif(not have_python312(), reason="no Python 3.12 interpreter (the profiles' Python)")


# ------------------------------------------------------------------------------------------------ Ansible

ANSIBLE = REPO / "ansible"
PLAYBOOKS = ["provision.yml", "rollback.yml", "verify.yml"]
ROLES = sorted(p.name for p in (ANSIBLE / "roles").iterdir() if p.is_dir())
RECAP = re.compile(
    r"^(?P<host>\S+)\s+:\s+ok=(?P<ok>\d+)\s+changed=(?P<changed>\d+)\s+unreachable=(?P<unreachable>\d+)\s+"
    r"failed=(?P<failed>\d+)\s+skipped=(?P<skipped>\d+)\s+rescued=(?P<rescued>\d+)\s+ignored=(?P<ignored>\d+)",
    re.M,
)


def tool(name: str) -> str | None:
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.is_file() else shutil.which(name)


def env() -> dict:
    return {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "ANSIBLE_CONFIG": str(ANSIBLE / "ansible.cfg"),
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_FORCE_COLOR": "0",
        # These tests read Ansible's own lines (tasks, debug messages, the recap) from `bwstack provision`.
        "BWSTACK_ANSIBLE_OUTPUT": "stream",
    }


@dataclass
class Run:
    cmd: list[str]
    rc: int
    out: str
    seconds: float

    @property
    def recap(self) -> dict[str, dict[str, int]]:
        return {
            m["host"]: {k: int(v) for k, v in m.groupdict().items() if k != "host"} for m in RECAP.finditer(self.out)
        }

    @property
    def last_line(self) -> str:
        lines = [line for line in self.out.splitlines() if line.strip()]
        return lines[-1] if lines else ""

    def changed(self, host: str = "localhost") -> int:
        return self.recap[host]["changed"]

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.out.splitlines()[-lines:])

    def ok(self) -> Run:
        assert self.rc == 0, f"{' '.join(self.cmd)} failed ({self.rc}):\n{self.tail(120)}"
        return self


def run(cmd: list[str], log: Path | None = None, timeout: int = 1800) -> Run:
    """Run from ansible/ (so ansible-lint finds its .ansible-lint), output merged and, with `log`, written there
    as it comes (a long provision can be followed with tail -f)."""
    started = time.perf_counter()
    lines: list[str] = []
    sink = None
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        sink = log.open("w")
        sink.write(f"$ {' '.join(cmd)}\n")
    with subprocess.Popen(
        cmd, env=env(), cwd=ANSIBLE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if sink is not None:
                sink.write(line)
                sink.flush()
            if time.perf_counter() - started > timeout:
                proc.kill()
                lines.append(f"(killed after {timeout} s)\n")
                break
        rc = proc.wait()
    result = Run(list(cmd), rc, "".join(lines), time.perf_counter() - started)
    if sink is not None:
        sink.write(f"# rc={result.rc} seconds={result.seconds:.1f}\n")
        sink.close()
    return result


def bwstack_cli(lock: Path, *args: str, log: Path | None = None, timeout: int = 1800) -> Run:
    return run([sys.executable, "-m", "bwstack", "--lock", str(lock), *args], log=log, timeout=timeout)


def playbook(
    name: str, inventory: Path, variables: dict, *flags: str, log: Path | None = None, timeout: int = 1800
) -> Run:
    vars_file = (log or inventory).with_suffix(".vars.json")
    vars_file.parent.mkdir(parents=True, exist_ok=True)
    vars_file.write_text(json.dumps(variables, indent=2))
    cmd = [
        tool("ansible-playbook") or "ansible-playbook",
        str(ANSIBLE / name),
        "-i",
        str(inventory),
        "-e",
        f"@{vars_file}",
        *flags,
    ]
    return run(cmd, log=log, timeout=timeout)


def local_inventory(path: Path, hosts: dict[str, dict] | None = None) -> Path:
    """Hosts that are all this machine (connection=local), each with its own variables."""
    python = playbooks.local_python()
    hosts = hosts or {"localhost": {}}
    body = {
        name: {"ansible_connection": "local", "ansible_python_interpreter": python, **hv} for name, hv in hosts.items()
    }
    path.write_text(yaml.safe_dump({"all": {"children": {"bwstack_nodes": {"hosts": body}}}}))
    return path


def generations(root: Path, ml_env: Path) -> list[dict]:
    out = subprocess.run(
        [sys.executable, "-m", "bwstack", "generations", "--root", str(root), "--ml-env", str(ml_env), "--json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(out.stdout)


def active(root: Path, ml_env: Path) -> dict | None:
    return next((g for g in generations(root, ml_env) if g["active"]), None)


needs_ansible = pytest.mark.skipif(tool("ansible-playbook") is None, reason="ansible-playbook is not installed")


def fixture_vars(stack: Path, node: Path, **more) -> dict:
    return {
        "bwstack_lock": str(stack / "stack.lock.yaml"),
        "bwstack_root": str(node / "root"),
        "bwstack_ml_env": str(node / "ml-env"),
        "bwstack_cuda_link": "none",
        "bwstack_cuda_method": "none",
        "bwstack_wheelhouse": [str(stack / "wheelhouse")],
        "bwstack_offline": True,
        "bwstack_preflight_allow_no_gpu": True,
        "bwstack_preflight_min_free_gb": 1,
        "bwstack_controller_cache": str(stack / "controller-cache"),
        "bwstack_tool_offline": False,  # bwstack's own dependencies from PyPI (the flow test installs them offline)
        "bwstack_tool_wrapper": "",  # never this machine's /usr/local/bin
        **more,
    }


OTHER_UID = 65534  # nobody: "another user" in the hostile-path tests


def acl_for_another_user(path: Path) -> None:
    """setfacl -m u:nobody:rwx PATH, written as the kernel's own xattr format (setfacl may not be installed)."""
    import struct

    undefined = 0xFFFFFFFF
    entries = [
        (0x01, 7, undefined),
        (0x02, 7, OTHER_UID),
        (0x04, 5, undefined),
        (0x10, 7, undefined),
        (0x20, 5, undefined),
    ]
    value = struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *entry) for entry in entries)
    try:
        os.setxattr(path, "system.posix_acl_access", value)
    except OSError as exc:
        pytest.skip(f"no POSIX ACLs on this filesystem ({exc.strerror})")
