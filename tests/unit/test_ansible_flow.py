"""The whole playbook flow on this machine (connection=local) against the FIXTURE stack (small wheels built by
the tests, installed offline from a wheelhouse: the path a cu130 node takes for wheels PyPI does not carry).

One node is driven through: provision fixture-new -> converged re-run -> --check -> provision fixture-old ->
provision fixture-new with verify failing (rescue rolls it back) -> `bwstack rollback --target` (no waivers
given: the node remembers the ones it was provisioned with) -> verify.yml -> the node's own `bwstack` wrapper
-> verify.yml requiring node acceptance (which this machine, without the target's GPUs, cannot pass).
The runs happen once (module fixture); each test checks one behaviour of one step. bwstack itself is
installed into the node's tool venv offline too, from a wheelhouse of its dependencies that the fixture fetches
from PyPI once, hence `network`.

The fixture torch has no extensions and the fixture toolkit no nvcc: those checks are waived, visibly.
"""

from __future__ import annotations

import json
import shutil
import sys
import zipfile
from pathlib import Path

import pytest
from helpers import REPO, Run, active, bwstack_cli, fixture_vars, generations, needs_ansible, playbook, run
from helpers import local_inventory as make_inventory

pytestmark = [pytest.mark.ansible, pytest.mark.network, needs_ansible]

WAIVERS = ["nvcc=the fixture toolkit has no nvcc", "extension=the fixture torch has no compiled extensions"]


def _needs_py312() -> None:
    from bwstack.provision.envbuild import find_python

    try:
        find_python("3.12")
    except Exception:
        pytest.skip("no Python 3.12 interpreter (the fixture profiles' Python)")


class Node:
    def __init__(self, base: Path) -> None:
        sys.path.insert(0, str(REPO / "tests"))
        from fixtures import fakestack

        self.base = base
        self.stack = base / "stack"
        self.stack.mkdir()
        fakestack.make_stack(self.stack)
        self.lock = self.stack / "stack.lock.yaml"
        self.node = base / "node"
        self.root = self.node / "root"
        self.ml_env = self.node / "ml-env"
        self.inventory = make_inventory(base / "hosts.yml")
        self.logs = base / "logs"
        self.runs: dict[str, Run] = {}
        # One wheel for the whole flow (the checkout may change under a long test run; CI's does not). Building it
        # in the role is covered by test_ansible.py's check-mode test.
        facts = bwstack_cli(self.lock, "controller-facts", "--wheel-dir", str(self.stack / "wheel")).ok()
        self.wheel = json.loads(facts.out[facts.out.index("{") :])["wheel"]["path"]
        # The node is offline: bwstack's own dependencies come from a wheelhouse too (fetched here once).
        self.tool_wheelhouse = self.stack / "tool-wheelhouse"
        run([sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(self.tool_wheelhouse), self.wheel]).ok()
        self.active_after: dict[str, str | None] = {}
        self.wrapper = base / "bin" / "bwstack"  # the node's PATH entry, here in the test's own directory
        self.wrapper.parent.mkdir()

    def provision(self, step: str, profile: str, *flags: str, waivers: bool = True) -> Run:
        """Through the `bwstack provision` CLI, as a user without an inventory would."""
        extra = self.base / f"{step}.extra.json"
        extra.write_text(
            json.dumps(
                {
                    "bwstack_controller_cache": str(self.stack / "controller-cache"),
                    "bwstack_tool_wheel": self.wheel,
                    "bwstack_tool_wheelhouse": str(self.tool_wheelhouse),
                    "bwstack_tool_wrapper": str(self.wrapper),
                }
            )
        )
        args = ["provision", "--target", "local://", "--profile", profile, "--cuda-method", "none", "--allow-no-gpu"]
        args += ["--min-free-gb", "1", "--root", str(self.root), "--ml-env", str(self.ml_env), "--cuda-link", "none"]
        args += ["--wheelhouse", str(self.stack / "wheelhouse"), "--offline", "-e", f"@{extra}", *flags]
        for waiver in WAIVERS if waivers else []:
            args += ["--skip", waiver]
        return self._record(step, bwstack_cli(self.lock, *args, log=self.logs / f"{step}.log"))

    def rollback(self, step: str) -> Run:
        """Through `bwstack rollback --target`, which drives rollback.yml; no waivers given (the node's own)."""
        extra = self.base / f"{step}.extra.json"
        extra.write_text(
            json.dumps({"bwstack_tool_wheel": self.wheel, "bwstack_tool_wheelhouse": str(self.tool_wheelhouse)})
        )
        args = ["rollback", "--target", "local://", "--root", str(self.root), "--ml-env", str(self.ml_env)]
        args += ["--cuda-link", "none", "-e", f"@{extra}"]  # no wheels: it goes back to a generation the store has
        return self._record(step, bwstack_cli(self.lock, *args, log=self.logs / f"{step}.log"))

    def play(self, step: str, name: str, flags: tuple[str, ...] = (), **more) -> Run:
        variables = fixture_vars(
            self.stack, self.node, **{"bwstack_verify_skip": WAIVERS, "bwstack_tool_wheel": self.wheel, **more}
        )
        return self._record(step, playbook(name, self.inventory, variables, *flags, log=self.logs / f"{step}.log"))

    def _record(self, step: str, result: Run) -> Run:
        self.runs[step] = result
        gen = active(self.root, self.ml_env) if self.root.exists() else None
        self.active_after[step] = gen["profile"] if gen else None
        return result


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Node:
    _needs_py312()
    n = Node(tmp_path_factory.mktemp("ansible-flow"))
    n.provision("first", "fixture-new")
    n.provision("rerun", "fixture-new")
    n.provision("check", "fixture-new", "--check", "--diff")
    n.provision("full", "fixture-new", "--full")
    # Only verify runs (--tags), with another setting: it must not vouch for settings no role applied.
    receipt = n.root / "provisioned.json"
    n.receipt_around_tagged = [receipt.read_bytes()]
    n.play("tagged", "provision.yml", bwstack_profile="fixture-new", bwstack_mlenv_services=["bwstack-none.service"],
           flags=("--tags", "verify"))  # fmt: skip
    n.receipt_around_tagged.append(receipt.read_bytes())
    lock_copy = n.root / "stack.lock.yaml"
    lock_copy.write_text(lock_copy.read_text() + "# edited on the node\n")
    n.provision("edited", "fixture-new")
    # Something the wheel did not install, in the tool venv root runs bwstack from: made again, not recorded.
    n.stray = next((n.root / "tool" / "lib").glob("python3.*/site-packages")) / "zz_not_from_the_wheel.pth"
    n.stray.write_text("import sys\n")
    n.provision("tool-edited", "fixture-new")
    # The same under --full, the remedy the play names: the check still runs for its list of what changed.
    n.stray_full = n.stray.with_name("zz_not_from_the_wheel_either.pth")
    n.stray_full.write_text("import sys\n")
    n.provision("tool-edited-full", "fixture-new", "--full")
    # verify's own settings are not inputs (verify runs on the fast path too): this run is converged, and fails
    n.provision("converged-failing", "fixture-new", "-e", json.dumps({"bwstack_verify_profile": "fixture-old"}))
    n.provision("other", "fixture-old", "--diff")
    n.provision("failing", "fixture-new", waivers=False)
    n.rollback("rollback")
    n.play("verify", "verify.yml")
    n.runs["node-verify"] = run([str(n.wrapper), "verify", "--no-runtime"])
    n.runs["node-generations"] = run([str(n.wrapper), "generations", "--json"])
    n.play("accept", "verify.yml", bwstack_verify_require_acceptance=True, bwstack_verify_accept_timeout=60)
    # Another controller (a plain playbook run: pip, no bwstack_tool_uv) ships a new wheel of the same version to
    # the node whose tool venv uv made, and has no pip: the venv gets one before pip installs into it.
    n.newer_wheel = n.base / "newer" / Path(n.wheel).name
    n.newer_wheel.parent.mkdir()
    shutil.copy(n.wheel, n.newer_wheel)
    with zipfile.ZipFile(n.newer_wheel, "a") as wheel:
        wheel.writestr("bwstack/_flow_newer_build.txt", "a later build of the same version\n")
    n.had_pip_before = (n.root / "tool" / "bin" / "pip").exists()
    n.play("pip-after-uv", "provision.yml", bwstack_profile="fixture-new", bwstack_tool_wheel=str(n.newer_wheel),
           bwstack_tool_wheelhouse=str(n.tool_wheelhouse), bwstack_tool_offline=True)  # fmt: skip
    return n


def test_first_provision_installs_bwstack_offline_builds_and_switches(node: Node):
    run = node.runs["first"].ok()
    assert run.changed() > 0
    assert node.active_after["first"] == "fixture-new"
    assert (node.root / "tool" / "bin" / "bwstack").is_file()
    assert (node.ml_env / "bin" / "python").exists()


def test_converged_rerun_reports_no_change(node: Node):
    run = node.runs["rerun"].ok()
    assert run.changed() == 0, run.tail(200)
    print(f"converged fixture re-run: {run.seconds:.1f} s")


def test_converged_rerun_skips_the_roles_that_change_nothing_and_still_verifies(node: Node):
    run = node.runs["rerun"].ok()
    assert "converged (provisioned from these inputs; 0000-fixture-new" in run.out
    assert "is fit for profile" not in run.out  # the preflight's verdict: it did not run
    assert "every check passed or was skipped with a reason" in run.out


def test_full_runs_every_role_on_a_converged_node_and_changes_nothing(node: Node):
    run = node.runs["full"].ok()
    assert "every role runs: bwstack_converged_check is false (--full)" in run.out
    assert "localhost is fit for profile fixture-new" in run.out
    assert run.changed() == 0, run.tail(200)


def test_a_run_limited_by_tags_verifies_but_writes_no_receipt_for_inputs_its_roles_never_applied(node: Node):
    run = node.runs["tagged"].ok()
    assert "every check passed or was skipped with a reason" in run.out
    before, after = node.receipt_around_tagged
    assert after == before, "the receipt now vouches for a setting no role applied"


def test_a_node_whose_files_changed_since_the_last_run_runs_every_role_and_is_put_back(node: Node):
    run = node.runs["edited"].ok()
    assert f"every role runs: {node.root / 'stack.lock.yaml'} changed since the last provision run" in run.out
    assert run.changed() > 0
    assert "# edited on the node" not in (node.root / "stack.lock.yaml").read_text()


def test_a_tool_venv_changed_since_the_last_run_is_made_again_not_recorded_as_it_now_is(node: Node):
    run = node.runs["tool-edited"].ok()
    assert f"every role runs: {node.root / 'tool'} changed since the last provision run" in run.out
    assert not node.stray.exists(), "the changed tool venv was recorded as it was, not made again"
    assert (node.root / "tool" / "bin" / "bwstack").is_file()


def _outcomes(out: str, task: str) -> list[str]:
    """What Ansible's output says of each run of a task: ok, changed, skipping, ..."""
    found = []
    for part in out.split(f"TASK [{task}]")[1:]:
        line = next(x for x in part.splitlines()[1:] if x.strip())
        found.append(line.split(":", 1)[0])
    return found


def _outcome(out: str, task: str) -> str:
    return _outcomes(out, task)[0]


def test_a_run_of_every_role_reads_the_lock_on_the_controller_once(node: Node):
    """Preflight, tool and CUDA each import the lock read; the play's first answer covers what each asks."""
    reads = _outcomes(node.runs["full"].ok().out, "bwstack : Read the lock (controller)")
    assert reads == ["ok", "skipping", "skipping", "skipping"], reads


PLAN_TASK = "bwstack_preflight : Ask bwstack's plan whether this run builds an env"


def test_the_preflight_does_not_run_a_tool_venv_the_converged_check_found_changed(node: Node):
    """It is made again by the tool role; until then root does not run it (the plan is assumed to build)."""
    assert _outcome(node.runs["tool-edited"].ok().out, PLAN_TASK) == "skipping"
    assert _outcome(node.runs["tool-edited-full"].ok().out, PLAN_TASK) == "skipping"
    assert _outcome(node.runs["edited"].ok().out, PLAN_TASK) == "ok"  # a tool venv as it was: asked


def test_a_tool_venv_changed_since_the_last_run_is_made_again_by_a_full_run_too(node: Node):
    run = node.runs["tool-edited-full"].ok()
    assert "every role runs: bwstack_converged_check is false (--full)" in run.out
    assert not node.stray_full.exists(), "--full recorded the changed tool venv as it was"


def test_a_converged_node_that_fails_verify_is_left_as_it_was_and_told_about_full(node: Node):
    run = node.runs["converged-failing"]
    assert run.rc != 0 and "converged (provisioned from these inputs" in run.out
    assert "Nothing was switched on this node" in run.out
    assert "This run only verified" in run.out and "`bwstack provision --full`" in run.out
    assert node.active_after["converged-failing"] == "fixture-new"


def test_check_mode_on_a_converged_node_reports_no_change(node: Node):
    run = node.runs["check"].ok()
    assert run.changed() == 0, run.tail(200)


def test_provisioning_another_profile_switches_and_shows_the_plan_as_a_diff(node: Node):
    run = node.runs["other"].ok()
    assert node.active_after["other"] == "fixture-old"
    assert "-active generation: 0000-fixture-new" in run.out
    assert "+active generation: 0001-fixture-old" in run.out
    assert [g["profile"] for g in generations(node.root, node.ml_env)][:2] == ["fixture-new", "fixture-old"]


def test_a_node_failing_verify_is_rolled_back_and_the_run_fails(node: Node):
    run = node.runs["failing"]
    assert run.rc != 0
    assert run.recap["localhost"]["rescued"] == 1
    assert "verify failed on localhost" in run.out
    assert "The node is back on 0001-fixture-old" in run.out
    assert node.active_after["failing"] == "fixture-old"


def test_rollback_playbook_switches_back_and_verifies_with_the_waivers_the_node_remembers(node: Node):
    run = node.runs["rollback"].ok()
    assert node.active_after["rollback"] == "fixture-new"
    assert run.changed() > 0
    assert "every check passed or was skipped with a reason" in run.out
    assert "waived by the operator: the fixture toolkit has no nvcc" in run.out


def test_the_failed_provision_left_the_remembered_waivers_as_they_were(node: Node):
    remembered = json.loads((node.root / "waivers.json").read_text())["waivers"]
    assert [f"{w['check']}={w['reason']}" for w in remembered] == WAIVERS


def test_the_nodes_bwstack_wrapper_knows_its_lock_and_store(node: Node):
    gens = json.loads(node.runs["node-generations"].ok().out)
    assert [g["profile"] for g in gens if g["active"]] == ["fixture-new"]
    verify = node.runs["node-verify"].ok()
    (line,) = [line for line in verify.out.splitlines() if "toolkit_nvcc_is_the_profiles_cuda_version" in line]
    assert line.split()[0] == "SKIP" and line.endswith("waived by the operator: the fixture toolkit has no nvcc")


def test_verify_playbook_prints_the_table_and_the_waivers(node: Node):
    run = node.runs["verify"].ok()
    assert "PASS  every_closure_package_is_installed_at_its_locked_version" in run.out
    assert (
        "toolkit_nvcc_is_the_profiles_cuda_version: waived by the operator: the fixture toolkit has no nvcc" in run.out
    )
    assert run.changed() == 0


def test_verify_requiring_acceptance_fails_a_node_that_is_not_accepted_and_shows_why(node: Node):
    run = node.runs["accept"]
    assert run.rc != 0
    assert "acceptance failed on localhost: NOT ACCEPTED" in run.out
    assert "gpu.model" in run.out and "no NVIDIA GPU on this node" in run.out


def test_a_local_targets_tool_venv_is_made_by_the_uv_bwstack_runs(node: Node):
    """`bwstack provision` hands a local target its own uv (bwstack_tool_uv): a second where pip takes eight."""
    config = (node.root / "tool" / "pyvenv.cfg").read_text()
    assert any(line.startswith("uv = ") for line in config.splitlines()), config
    assert not node.had_pip_before  # uv made it (a later pip run gives it one: the test below)


def test_a_tool_venv_uv_made_gets_a_pip_when_a_later_run_installs_with_pip(node: Node):
    node.runs["pip-after-uv"].ok()
    assert not node.had_pip_before and (node.root / "tool" / "bin" / "pip").exists()
    site = next((node.root / "tool" / "lib").glob("python3.*/site-packages"))
    assert (site / "bwstack" / "_flow_newer_build.txt").is_file(), "the newer wheel was not installed"
