"""README's commands against a remote node over SSH, from this machine as the controller (issue 17).

The node is a container of docker/ci-node.sh (a TEST FIXTURE): Debian 12 minbase from debootstrap with sshd,
python3 and ca-certificates carrying the site's CA (this machine's TLS-intercepting proxy), root with a key
and no sudo, pip, venv support, setuptools or packaging; plus the profiles' Python 3.12 where pyenv puts it.
It reaches PyPI and Debian's archive itself, through the site's CA.

Fast (docker, ansible): a node that does not answer and a node that stops answering mid-run (`docker pause`)
fail `bwstack provision` and `bwstack verify` with one line each, within bounded times, and leave no temporary
directory on the controller.

Slow (slow, docker, ansible, network): the cu128 profile from PyPI over SSH, in README's order: provision,
converged re-run (changed=0, no disk margin), `rollback` with one generation (refused, one line), `verify
--target ssh://` (named root@127.0.0.1:PORT, the node's remembered waivers), the node's own `bwstack`, the
fleet playbooks from a copy of inventories/example, then a drift + backup + rollback to the pre-drift generation
(expected to fail until the store keeps drift out of sealed generations: issue 11, the coordinator's part).
The runs happen once (module fixture); each test checks one behaviour of one step. Logs: <tmp>/logs/*.log.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REAL_PLAYBOOK_RUN, Run

from fixtures.remote_node import REPO, Node, build_image, logged, why_no_node_image

ANSIBLE = REPO / "ansible"
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"  # the node's system bundle, which holds the site's CA
NVCC_WAIVER = "nvcc=NVIDIA's PyPI wheels for CUDA 12.x ship no nvcc"
NEED_FREE_GB = 30  # measured: the node's cu128 env, its wheels, uv's cache and the pip toolkit, in Docker's storage
STALL_BOUND_S = 120  # ansible.cfg: 30 s of keep-alive silence, then a 20 s connect timeout for the retry
UNREACHABLE_BOUND_S = 60
NOT_ONE_LINE = ("Traceback", "INTERNALERROR", "CommandResult(")

_WHY = why_no_node_image()
pytestmark = [pytest.mark.docker, pytest.mark.ansible, pytest.mark.skipif(_WHY is not None, reason=_WHY or "")]


def bwstack(*args: str) -> list[str]:
    """The controller's bwstack (README: .venv/bin/bwstack)."""
    return [sys.executable, "-m", "bwstack", *args]


def controller_env(tmpdir: Path | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "ANSIBLE_CONFIG"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    # These tests read Ansible's own lines (tasks, debug messages, the recap) from `bwstack provision`.
    env.update({"ANSIBLE_NOCOLOR": "1", "ANSIBLE_FORCE_COLOR": "0", "BWSTACK_ANSIBLE_OUTPUT": "stream"})
    if tmpdir is not None:
        env["TMPDIR"] = str(tmpdir)
    return env


@pytest.fixture(scope="module")
def node_image() -> str:
    return build_image()


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ------------------------------------------------------------------------------------------------ fast


def test_provision_of_a_node_that_does_not_answer_fails_in_one_line_within_seconds(tmp_path: Path):
    port = closed_port()
    run = logged(bwstack("provision", "--target", f"ssh://root@127.0.0.1:{port}", "--allow-no-gpu"),
                 tmp_path / "unreachable.log", env=controller_env())  # fmt: skip
    assert run.rc == 1
    assert run.last_line == (
        f"bwstack: error: provision.yml failed: root@127.0.0.1:{port}: unreachable: Failed to connect to the host "
        f"via ssh: ssh: connect to host 127.0.0.1 port {port}: Connection refused"
    )
    assert run.seconds < UNREACHABLE_BOUND_S


@pytest.fixture
def stalled(node_image: str, tmp_path: Path):
    node = Node(node_image, tmp_path / "node", "stalled")
    yield node
    node.unpause()
    node.remove()


def test_a_node_that_stops_answering_mid_run_fails_it_within_a_bound_and_leaves_no_temporary_files(
    stalled: Node, tmp_path: Path
):
    """The node is frozen (docker pause) once Ansible holds its shared SSH connection: keep-alive ends it."""
    tmpdir = tmp_path / "controller-tmp"
    tmpdir.mkdir()
    # --min-free-gb 1: the node is frozen before anything is built; the host's free disk is not what this tests
    # (a CI machine with under 25 GiB free refused the node at preflight, before the pause could happen).
    cmd = bwstack("provision", "--target", stalled.target, *stalled.ssh_options, "--profile", "cu128",
                  "--allow-no-gpu", "--min-free-gb", "1", "--ca-bundle", CA_BUNDLE)  # fmt: skip
    proc = subprocess.Popen(
        cmd, env=controller_env(tmpdir), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines, paused_at = [], None
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if paused_at is None and line.startswith("TASK [bwstack_tool : Copy the stack lock]"):
            stalled.pause()
            paused_at = time.perf_counter()
    rc = proc.wait()
    waited = time.perf_counter() - (paused_at or 0)
    (tmp_path / "stalled.log").write_text("".join(lines))
    assert paused_at is not None, "the run never reached the tool role:\n" + "".join(lines[-40:])
    assert rc == 1
    assert waited < STALL_BOUND_S, f"the run took {waited:.0f} s to give up on a frozen node"
    last = [line for line in lines if line.strip()][-1]
    assert last.startswith(f"bwstack: error: provision.yml failed: {stalled.label}: unreachable: ")
    assert not list(tmpdir.iterdir()), f"left behind on the controller: {list(tmpdir.iterdir())}"


def test_verify_of_a_frozen_node_is_one_line_within_a_bound(stalled: Node, tmp_path: Path):
    stalled.pause()
    run = logged(bwstack("verify", "--target", stalled.target, *stalled.ssh_options), tmp_path / "verify.log",
                 env=controller_env())  # fmt: skip
    assert run.rc == 1
    assert run.out.strip().splitlines() == [
        f"{stalled.label}: not checked: unreachable: Connection to 127.0.0.1 port {stalled.port} timed out"
    ]
    assert run.seconds < UNREACHABLE_BOUND_S


# ------------------------------------------------------------------------------------------------ slow: cu128


class Flow:
    """README's commands in order against one node; every run is kept for the tests."""

    def __init__(self, node: Node, base: Path) -> None:
        self.node = node
        self.base = base
        self.logs = base / "logs"
        self.runs: dict[str, Run] = {}
        self.facts: dict[str, object] = {}

    def cli(self, step: str, *args: str, timeout: int = 2400) -> Run:
        run = logged(bwstack(*args), self.logs / f"{step}.log", env=controller_env(), timeout=timeout)
        self.runs[step] = run
        return run

    def provision(self, step: str, *more: str) -> Run:
        """README's SSH command for a CPU-only node that reaches only PyPI (cu128), with this node's key."""
        return self.cli(step, "provision", "--target", self.node.target, *self.node.ssh_options, "--profile", "cu128",
                        "--allow-no-gpu", "--skip", NVCC_WAIVER, "--ca-bundle", CA_BUNDLE, *more)  # fmt: skip

    def on_node(self, step: str, command: str) -> Run:
        started = time.perf_counter()
        done = self.node.ssh(command)
        run = Run(["ssh", command], done.returncode, done.stdout + done.stderr, time.perf_counter() - started)
        (self.logs / f"{step}.log").write_text(f"$ {command}\n{run.out}# rc={run.rc}\n")
        self.runs[step] = run
        return run

    def fleet(self) -> Path:
        """README's fleet section: copy inventories/example/, edit hosts.yml and group_vars/bwstack_nodes.yml."""
        fleet = self.base / "fleet"
        shutil.copytree(ANSIBLE / "inventories" / "example", fleet)
        host = f"node-a01:\n              ansible_host: 127.0.0.1\n              ansible_port: {self.node.port}\n"
        (fleet / "hosts.yml").write_text(
            "---\n# The example fleet, edited down to the CI node (a TEST FIXTURE container).\n"
            "all:\n  children:\n    bwstack_nodes:\n      children:\n        rack_a:\n          hosts:\n"
            f"            {host}"
        )
        group_vars = fleet / "group_vars" / "bwstack_nodes.yml"
        text = group_vars.read_text()
        edits = {
            "ansible_user: ops": "ansible_user: root",
            "ansible_become: true": "ansible_become: false",
            "bwstack_profile: cu130": "bwstack_profile: cu128",
            "bwstack_cuda_method: apt": "bwstack_cuda_method: pip",
            "# bwstack_ca_bundle: /etc/ssl/certs/internal-ca.pem": f"bwstack_ca_bundle: {CA_BUNDLE}",
            "bwstack_verify_skip: []": f"bwstack_verify_skip: [{json.dumps(NVCC_WAIVER)}]",
            "bwstack_preflight_allow_no_gpu: false": "bwstack_preflight_allow_no_gpu: true",
        }
        for old, new in edits.items():
            assert old in text, f"the example group_vars no longer has {old!r}"
            text = text.replace(old, new)
        text += (
            f"\n# This node's SSH key and host key.\nansible_ssh_private_key_file: {self.node.key}\n"
            f"ansible_ssh_common_args: -o UserKnownHostsFile={self.node.known_hosts} -o StrictHostKeyChecking=yes\n"
        )
        group_vars.write_text(text)
        return fleet / "hosts.yml"

    def playbook(self, step: str, inventory: Path, *args: str) -> Run:
        """`cd ansible && ansible-playbook -i INVENTORY ...` (ansible.cfg from the directory, as README says)."""
        cmd = [str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(inventory), *args]
        run = logged(cmd, self.logs / f"{step}.log", cwd=ANSIBLE, env=controller_env(), timeout=2400)
        self.runs[step] = run
        return run

    def generations(self) -> list[dict]:
        return json.loads(self.node.ssh("bwstack generations --json").stdout)


@pytest.fixture(scope="module")
def flow(node_image: str, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest):
    free = shutil.disk_usage("/var/lib/docker" if os.path.isdir("/var/lib/docker") else "/").free / 2**30
    if free < NEED_FREE_GB:
        pytest.skip(f"{free:.0f} GiB free for Docker; the node's cu128 provision needs {NEED_FREE_GB} GiB")
    base = tmp_path_factory.mktemp("remote-node")
    node = Node(node_image, base / "node", "cu128")
    f = Flow(node, base)
    try:
        services = json.dumps({"bwstack_mlenv_services": ["sglang.service"]})
        if f.provision("provision", "-e", services).rc == 0:
            request.config.stash[REAL_PLAYBOOK_RUN] = "test_remote_node.py (the cu128 profile over SSH)"
            f.provision("rerun", "-e", services)
            f.cli("rollback-one", "rollback", "--target", node.target, *node.ssh_options)
            f.cli("verify", "verify", "--target", node.target, *node.ssh_options)
            f.on_node("node-generations", "cd / && bwstack generations --json")
            f.on_node("node-verify", "cd / && bwstack verify --no-runtime")
            inventory = f.fleet()
            f.playbook("fleet-check", inventory, "provision.yml", "--check", "--diff")
            # every role (not the fast path): the full play from the example inventory, on a converged node
            f.playbook("fleet-provision", inventory, "provision.yml", "-e", "bwstack_converged_check=false")
            f.playbook("fleet-verify", inventory, "verify.yml")
            # Drift, as README says backups absorb it: a module added to the active env, then a backup.
            f.facts["pre_drift"] = next(g["name"] for g in f.generations() if g["active"])
            f.on_node("drift", "echo 'DRIFT = 1' > /opt/ml-env/lib/python3.12/site-packages/bwstack_ci_drift.py")
            f.on_node("backup", "bwstack backup --json")
            f.playbook(
                "fleet-rollback", inventory, "rollback.yml", "-e", f"bwstack_mlenv_rollback_to={f.facts['pre_drift']}"
            )
            f.facts["after_rollback"] = f.generations()
            f.on_node("drift-gone", "test ! -e /opt/ml-env/lib/python3.12/site-packages/bwstack_ci_drift.py")
            f.on_node("generations-check", "bwstack generations --check --json")
        times = {step: round(r.seconds, 1) for step, r in f.runs.items()}
        line = f"remote node over SSH (cu128): {json.dumps(times)} (logs in {f.logs})"
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(line)
        yield f
    finally:
        node.remove()


@pytest.mark.slow
@pytest.mark.network
def test_provision_over_ssh_builds_cu128_from_pypi_on_a_bare_node(flow: Flow):
    run = flow.runs["provision"].ok()
    assert run.recap[flow.node.label.replace(":", "_")]["changed"] > 0
    gens = json.loads(flow.runs["node-generations"].ok().out)
    assert [(g["profile"], g["verified"]) for g in gens if g["active"]] == [("cu128", "passed")]
    assert "CPU-ONLY TARGET" in run.out
    assert "python: Python 3.12: /root/.pyenv/versions/3.12" in run.out, "bwstack found the profile's interpreter"
    tool = flow.node.ssh("readlink -f /opt/bwstack/tool/bin/python").stdout.strip()
    assert tool == "/usr/bin/python3.11", "the tool venv uses the interpreter Ansible found (Debian's python3)"


@pytest.mark.slow
@pytest.mark.network
def test_a_service_the_node_does_not_have_is_named_not_failed_on(flow: Flow):
    run = flow.runs["provision"].ok()
    assert "sglang.service: not on " in run.out and "so not restarted" in run.out


@pytest.mark.slow
@pytest.mark.network
def test_converged_rerun_over_ssh_only_verifies_and_changes_nothing(flow: Flow):
    run = flow.runs["rerun"].ok()
    assert run.recap[flow.node.label.replace(":", "_")]["changed"] == 0, run.tail(200)
    assert "converged (provisioned from these inputs; 0000-cu128-" in run.out


@pytest.mark.slow
@pytest.mark.network
def test_rollback_with_one_generation_is_refused_in_one_line(flow: Flow):
    run = flow.runs["rollback-one"]
    assert run.rc == 1
    assert run.last_line.startswith(
        f"bwstack: error: rollback.yml failed: {flow.node.label}: nothing to roll back to: "
    )
    assert "is the only generation" in run.last_line and "--rebuild" in run.last_line


@pytest.mark.slow
@pytest.mark.network
def test_verify_over_ssh_names_the_node_with_user_and_port_and_applies_its_remembered_waivers(flow: Flow):
    run = flow.runs["verify"].ok()
    lines = run.out.splitlines()
    assert lines[0] == f"{flow.node.label}:"
    (nvcc,) = [line for line in lines if "toolkit_nvcc_is_the_profiles_cuda_version" in line]
    assert nvcc.split()[0] == "SKIP" and nvcc.endswith(
        "waived by the operator: NVIDIA's PyPI wheels for CUDA 12.x ship no nvcc"
    )


@pytest.mark.slow
@pytest.mark.network
def test_the_nodes_own_bwstack_runs_anywhere_without_a_lock_option(flow: Flow):
    verify = flow.runs["node-verify"].ok()
    assert "0 failed" in verify.out.splitlines()[-1]


@pytest.mark.slow
@pytest.mark.network
def test_fleet_check_mode_on_the_converged_node_reports_no_change(flow: Flow):
    run = flow.runs["fleet-check"].ok()
    assert run.recap["node-a01"]["changed"] == 0, run.tail(200)


@pytest.mark.slow
@pytest.mark.network
def test_fleet_provision_and_verify_from_the_example_inventory_pass(flow: Flow):
    provision = flow.runs["fleet-provision"].ok()
    # every role ran on the converged node, and its preflight asked for no disk margin: nothing was to be built
    assert "every role runs: bwstack_converged_check is false (--full)" in provision.out
    assert "no build needed (the plan reuses 0000-cu128-" in provision.out
    run = flow.runs["fleet-verify"].ok()
    assert run.recap["node-a01"]["failed"] == 0
    assert f'"{flow.node.label}:",' in run.out, "the table names the node by user@host:port"


@pytest.mark.slow
@pytest.mark.network
def test_after_drift_and_backup_the_pre_drift_generation_is_restored_by_the_rollback_play(flow: Flow):
    flow.runs["backup"].ok()
    run = flow.runs["fleet-rollback"]
    assert run.rc == 0, run.tail(60)
    active = [g["name"] for g in flow.facts["after_rollback"] if g["active"]]
    assert active == [flow.facts["pre_drift"]]
    flow.runs["drift-gone"].ok()
    listed = json.loads(flow.runs["generations-check"].ok().out)
    assert all(g["integrity"] == "ok" for g in listed if g["verified"] == "passed"), listed
