"""The playbooks on this machine (connection=local) with the REAL lock and REAL PyPI: the cu128 profile, CUDA
toolkit by the pip method. provision (cold) -> re-run (converged, timed) -> rollback playbook -> verify playbook.

The store, env and CUDA home live under a tmp dir: the test's copy of stack.lock.yaml differs from the real one
only in the profiles' `cuda.home` (not part of any digest), so nothing is written to /opt or /usr/local.
No GPU here: preflight runs with bwstack_preflight_allow_no_gpu (said loudly in the output). NVIDIA's CUDA 12.x
pip wheels ship no nvcc, so verify's nvcc checks are waived with that reason, visibly.

With only cu128 buildable here (cu130's wheels are not on PyPI), the store holds one generation: the rollback
playbook refuses, saying there is nothing to go back to (a rebuild needs -e bwstack_mlenv_rollback_rebuild=true).
Real generation switches by playbook are covered by test_ansible_flow.py and, over SSH, test_remote_node.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import REAL_PLAYBOOK_RUN, REPO, Run, active, bwstack_cli, local_inventory, needs_ansible, playbook

pytestmark = [pytest.mark.slow, pytest.mark.ansible, pytest.mark.network, needs_ansible]

NEED_FREE_GB = 20  # measured: wheels 4.8 GB + uv cache ~10 GB (the env hard-links into it) + toolkit ~3 GB
NVCC_WAIVER = (
    "nvcc=the cu128 toolkit comes from NVIDIA's PyPI wheels, which ship no nvcc for CUDA 12.x "
    "(FlashInfer JIT needs the apt toolkit)"
)


class RealNode:
    def __init__(self, base: Path) -> None:
        self.base = base
        text = (REPO / "stack.lock.yaml").read_text()
        for version in ("13.0", "12.8"):
            assert f"home: /usr/local/cuda-{version}\n" in text
            text = text.replace(f"home: /usr/local/cuda-{version}\n", f"home: {base / 'cuda'}/cuda-{version}\n")
        self.lock = base / "stack.lock.yaml"
        self.lock.write_text(text)
        self.node = base / "node"
        self.root = self.node / "root"
        self.ml_env = self.node / "ml-env"
        self.inventory = local_inventory(base / "hosts.yml")
        self.runs: dict[str, Run] = {}
        # One bwstack wheel for all runs (a checkout edited during a long run would otherwise be re-shipped).
        facts = bwstack_cli(self.lock, "controller-facts", "--wheel-dir", str(base / "wheel")).ok()
        self.wheel = json.loads(facts.out[facts.out.index("{") :])["wheel"]["path"]

    def variables(self) -> dict:
        return {
            "bwstack_lock": str(self.lock),
            "bwstack_profile": "cu128",
            "bwstack_root": str(self.root),
            "bwstack_ml_env": str(self.ml_env),
            "bwstack_cuda_link": "none",
            "bwstack_cuda_method": "pip",
            "bwstack_preflight_allow_no_gpu": True,
            "bwstack_preflight_min_free_gb": NEED_FREE_GB - 2,
            "bwstack_verify_skip": [NVCC_WAIVER],
            "bwstack_controller_cache": str(self.base / "controller-cache"),
            "bwstack_tool_wheel": self.wheel,
            "bwstack_tool_wrapper": "",  # never this machine's /usr/local/bin
        }

    def play(self, step: str, name: str, **more) -> Run:
        result = playbook(name, self.inventory, {**self.variables(), **more}, log=self.base / "logs" / f"{step}.log")
        self.runs[step] = result
        return result


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest):
    from bwstack.provision.envbuild import find_python

    try:
        find_python("3.12")
    except Exception:
        pytest.skip("no Python 3.12 interpreter (the cu128 profile's Python)")
    if REAL_PLAYBOOK_RUN in request.config.stash:
        pytest.skip(
            f"{request.config.stash[REAL_PLAYBOOK_RUN]} ran the real cu128 provision, its converged re-run, the "
            "one-generation rollback and the waived verify through the playbooks this session; this local run "
            "stands in for it where Docker has no room for the node"
        )
    base = tmp_path_factory.mktemp("ansible-real")
    free = shutil.disk_usage(base).free / 2**30
    if free < NEED_FREE_GB:
        pytest.skip(f"{free:.0f} GiB free at {base}; the real cu128 provision needs {NEED_FREE_GB} GiB")
    node = RealNode(base)
    node.play("cold", "provision.yml")
    if node.runs["cold"].rc == 0:
        node.play("converged", "provision.yml")
        node.play("rollback", "rollback.yml")
        node.play("verify", "verify.yml")
    times = {step: round(r.seconds, 1) for step, r in node.runs.items()}
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    line = f"ansible cu128 on localhost: {json.dumps(times)} (logs in {base / 'logs'})"
    if reporter is not None:
        reporter.write_line(line)
    print(line)
    (base / "times.json").write_text(json.dumps(times))
    yield node
    shutil.rmtree(node.node, ignore_errors=True)  # ~15 GB
    shutil.rmtree(base / "cuda", ignore_errors=True)


def test_cold_provision_builds_the_cu128_env_with_the_pip_toolkit(real: RealNode):
    run = real.runs["cold"].ok()
    assert run.changed() > 0
    gen = active(real.root, real.ml_env)
    assert gen is not None and gen["profile"] == "cu128" and gen["verified"] == "passed"
    assert (real.base / "cuda" / "cuda-12.8" / "bwstack-toolkit.json").is_file()
    assert "CPU-ONLY TARGET" in run.out, "the no-GPU waiver must be said loudly"
    assert "every check passed or was skipped with a reason" in run.out


def test_converged_rerun_reports_no_change(real: RealNode, record_property):
    run = real.runs["converged"].ok()
    record_property("converged_rerun_seconds", round(run.seconds, 1))
    assert run.changed() == 0, run.tail(200)


def test_rollback_with_one_generation_is_refused_saying_so_and_changes_nothing(real: RealNode):
    run = real.runs["rollback"]
    assert run.rc != 0
    assert "nothing to roll back to" in run.out and "is the only generation" in run.out
    assert active(real.root, real.ml_env)["profile"] == "cu128"


def test_verify_passes_with_the_nvcc_checks_waived_visibly(real: RealNode):
    run = real.runs["verify"].ok()
    assert "PASS  module_imports[sglang]" in run.out
    assert "toolkit_nvcc_is_the_profiles_cuda_version: waived by the operator: the cu128 toolkit" in run.out
