"""Preflight refuses unfit nodes with an actionable line, before anything is touched.

The GPU is a stand-in `nvidia-smi` on PATH (a shell script printing what the real one prints for the
query bwstack makes): the logic under test is bwstack's, not the driver's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers import bwstack


def _fake_smi(tmp_path: Path, rows: list[str]) -> dict:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    smi = bindir / "nvidia-smi"
    smi.write_text("#!/bin/sh\ncat <<'EOF'\n" + "\n".join(rows) + "\nEOF\n")
    smi.chmod(0o755)
    return {"PATH": f"{bindir}:{os.environ['PATH']}", "BWSTACK_ROOT": str(tmp_path / "root")}


def _preflight(env: dict, *args: str):
    result = bwstack("preflight", "--min-free-gb", "1", "--json", *args, env=env)
    return result.returncode, json.loads(result.stdout), result.stderr


def test_an_rtx_pro_6000_with_an_r580_driver_is_fit_for_cu130(tmp_path):
    env = _fake_smi(tmp_path, ["NVIDIA RTX PRO 6000 Blackwell Server Edition, 12.0, 580.82.07"] * 2)
    code, report, _ = _preflight(env, "--profile", "cu130")
    assert code == 0 and report["ok"]
    assert "2 x NVIDIA RTX PRO 6000" in next(c for c in report["checks"] if c["name"] == "gpu")["detail"]


def test_a_driver_older_than_the_profiles_minimum_is_refused_naming_both(tmp_path):
    env = _fake_smi(tmp_path, ["NVIDIA RTX PRO 6000 Blackwell Server Edition, 12.0, 570.124.06"])
    code, report, err = _preflight(env, "--profile", "cu130")
    assert code == 4 and not report["ok"]
    assert "driver 570.124.06, CUDA 13.0.1 needs >= 580.65.06" in err
    assert err.count("\n") == 1


def test_the_same_driver_is_fine_for_the_cuda_12_8_rollback_profile(tmp_path):
    env = _fake_smi(tmp_path, ["NVIDIA RTX PRO 6000 Blackwell Server Edition, 12.0, 570.124.06"])
    code, _, _ = _preflight(env, "--profile", "cu128")
    assert code == 0


def test_a_gpu_of_another_capability_is_refused_unless_allowed_loudly(tmp_path):
    env = _fake_smi(tmp_path, ["NVIDIA H200, 9.0, 580.159.04"])
    code, _, err = _preflight(env, "--profile", "cu130")
    assert code == 4 and "capability 9.0; profile cu130 targets capability 12.0" in err
    code, report, _ = _preflight(env, "--profile", "cu130", "--allow-other-gpu")
    assert code == 0 and any("OTHER GPU" in w for w in report["warnings"])


def test_no_gpu_is_refused_unless_cpu_only_targets_are_allowed_loudly(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "BWSTACK_ROOT": str(tmp_path / "root")}
    code, _, err = _preflight(env, "--profile", "cu128")
    assert code == 4 and "no NVIDIA GPU" in err
    code, report, _ = _preflight(env, "--profile", "cu128", "--allow-no-gpu")
    assert code == 0 and any(w.startswith("CPU-ONLY TARGET") for w in report["warnings"])


def test_too_little_disk_is_refused_with_the_numbers(tmp_path):
    env = _fake_smi(tmp_path, ["NVIDIA RTX PRO 6000 Blackwell Server Edition, 12.0, 580.82.07"])
    result = bwstack("preflight", "--profile", "cu130", "--min-free-gb", "1000000", env=env)
    assert result.returncode == 4
    assert "GiB free at" in result.stderr and "need 1000000 GiB" in result.stderr


def test_preflight_touches_nothing(tmp_path):
    env = _fake_smi(tmp_path, ["NVIDIA H200, 9.0, 580.159.04"])
    _preflight(env, "--profile", "cu130")
    assert not (tmp_path / "root").exists()


@pytest.mark.parametrize("profile", ["cu130", "cu128"])
def test_the_probe_zipapp_gives_the_same_verdict_without_bwstack_installed(tmp_path, profile):
    """The Ansible role runs the zipapp with the node's python3; it must agree with the CLI."""
    import subprocess
    import sys

    from bwstack.fleet import probe_bundle
    from bwstack.lock.model import load_lock
    from bwstack.probe import preflight

    pyz = probe_bundle.write(tmp_path / "probe.pyz")
    env = {**os.environ, **_fake_smi(tmp_path, ["NVIDIA RTX PRO 6000 Blackwell Server Edition, 12.0, 575.57.08"])}
    req = json.dumps(
        preflight.requirements_of(load_lock(Path(__file__).parents[2] / "stack.lock.yaml").profile(profile))
    )
    out = subprocess.run(
        [sys.executable, "-S", str(pyz), "preflight", "--requirements", req, "--min-free-gb", "1"],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    verdict = json.loads(out.stdout)
    assert verdict["ok"] is (profile == "cu128")  # 575 is below CUDA 13's 580, fine for CUDA 12.8


def test_a_run_that_builds_nothing_needs_no_free_disk_margin(tmp_path):
    """The role passes --reuse GENERATION when bwstack's plan (build --check) says no build is needed."""
    import subprocess
    import sys

    from bwstack.fleet import probe_bundle
    from bwstack.lock.model import load_lock
    from bwstack.probe import preflight

    pyz = probe_bundle.write(tmp_path / "probe.pyz")
    env = {**os.environ, **_fake_smi(tmp_path, ["NVIDIA RTX PRO 6000 Blackwell Server Edition, 12.0, 580.82.07"])}
    req = json.dumps(
        preflight.requirements_of(load_lock(Path(__file__).parents[2] / "stack.lock.yaml").profile("cu130"))
    )
    base = [sys.executable, "-S", str(pyz), "preflight", "--requirements", req, "--min-free-gb", "1000000"]
    building = json.loads(subprocess.run(base, capture_output=True, text=True, env=env).stdout)
    reusing = json.loads(
        subprocess.run([*base, "--reuse", "0003-cu130-abc"], capture_output=True, text=True, env=env).stdout
    )
    assert not building["ok"] and "need 1000000 GiB" in building["refusal"]
    disk = next(c for c in reusing["checks"] if c["name"] == "disk")
    assert reusing["ok"] and disk["detail"].endswith("no build needed (the plan reuses 0003-cu130-abc)")


# ------------------------------------------------------------------------------------------------ node facts


def _node_facts_preflight(machine: str, profile: str = "cu130"):
    """Preflight with the driver and PCIe facts read from a TEST FIXTURE machine description (the rest of the
    checks read this machine, which has no GPU: allowed, as for CPU-only targets)."""
    from helpers import MACHINES, REAL_LOCK

    from bwstack.lock.model import load_lock
    from bwstack.probe import preflight
    from bwstack.probe.hw.machine import Machine

    req = preflight.requirements_of(load_lock(REAL_LOCK).profile(profile))
    return preflight.check(
        req, min_free_gb=0, allow_no_gpu=True, machine=Machine.recorded(MACHINES / machine)
    )  # fmt: skip


def test_the_proprietary_module_on_a_blackwell_target_is_refused_with_the_open_module_fix():
    report = _node_facts_preflight("rtx-pro-6000-x8-misconfigured")
    assert not report.ok
    refusal = report.refusal()
    assert "proprietary nvidia module is loaded" in refusal and "nvidia-driver-580-open" in refusal


def test_the_rest_of_the_acceptance_facts_are_warnings_not_refusals():
    report = _node_facts_preflight("rtx-pro-6000-x8-misconfigured")
    refused = [c.name for c in report.checks if not c.ok and not c.waived]
    assert refused == ["driver.flavour"]
    warned = " | ".join(report.warnings)
    for check in ("loader.cuda_compat", "pcie.link", "iommu", "pcie.acs", "pcie.aer"):
        assert f"{check}: " in warned


def test_a_healthy_node_adds_no_refusal_and_no_warning():
    report = _node_facts_preflight("rtx-pro-6000-x8-healthy")
    assert report.ok
    assert [w for w in report.warnings if not w.startswith("CPU-ONLY TARGET")] == []


@pytest.mark.parametrize("requirements", ["{}", '{"accept": {"profile": "cu130"}}', "[1]", "not json"])
def test_the_probe_refuses_malformed_requirements_with_one_line(capsys, requirements):
    from bwstack.probe import main as probe

    assert probe.main(["preflight", "--requirements", requirements]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bwstack-probe preflight: bad --requirements:") and err.count("\n") == 1
