"""`bwstack accept`, runtime part: children under a hard timeout, the process group killed and nothing left
behind; figures judged against the lock's envelope; a hung all-reduce fails naming the static causes.

Fast tier: real processes that really block (plain Python), and the judge over measured-figure records.
Slow tier: the real all-reduce code path with torch.distributed on CPU (gloo) in the real cu128 env, a rank
that never joins the collective included. On GPUs the same path runs with NCCL.
"""

from __future__ import annotations

import ast
import json
import os
import sys
import time
from pathlib import Path

import pytest
from helpers import MACHINES, REAL_LOCK, bwstack, needs_py312

from bwstack.accept.report import AcceptReport, NodeVerdict
from bwstack.accept.runtime import (
    FORCED_ENV,
    WORKER,
    AllReduce,
    AllReduceRun,
    Bench,
    BenchRun,
    GroupResult,
    Status,
    child_env,
    group_members,
    run_allreduce,
    run_bench,
    run_group,
)
from bwstack.accept.runtime_judge import judge_runtime
from bwstack.lock.model import load_lock
from bwstack.probe.hw.collect import collect
from bwstack.probe.hw.judge import Verdict, Want, judge_static
from bwstack.probe.hw.machine import Machine

LOCK = load_lock(REAL_LOCK)
PROFILE = LOCK.profile("cu130")
ENVELOPE = PROFILE.target.envelope
RTX = Want.of(PROFILE, PROFILE.target)
HEALTHY = collect(Machine.recorded(MACHINES / "rtx-pro-6000-x8-healthy"))
MISCONFIGURED = collect(Machine.recorded(MACHINES / "rtx-pro-6000-x8-misconfigured"))
GPU_BDFS = [g.bdf for g in HEALTHY.gpus]  # numa 0: GPU0-3, numa 1: GPU4-7
DONE = GroupResult(Status.DONE, 1.0, (0,), (), ("",))
SLEEP = [sys.executable, "-c", "import time; time.sleep(1000)"]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# ------------------------------------------------------------------------------------------------ processes


def test_a_child_that_really_blocks_is_killed_at_the_timeout_with_its_grandchild(tmp_path):
    grandchild_pid = tmp_path / "grandchild.pid"
    blocker = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(1000)'])\n"
        f"open({str(grandchild_pid)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(1000)\n"
    )
    started = time.monotonic()
    result = run_group([[sys.executable, "-c", blocker], SLEEP], child_env(), 3.0, tmp_path)
    assert result.status is Status.TIMEOUT
    assert result.seconds >= 3.0 and time.monotonic() - started < 3.0 + 2.0
    assert result.returncodes == (-9, -9)
    assert result.left_behind == ()
    assert not _alive(int(grandchild_pid.read_text()))


def test_a_failing_child_ends_the_group_at_once_instead_of_waiting_for_the_timeout(tmp_path):
    result = run_group([[sys.executable, "-c", "raise SystemExit(3)"], SLEEP], child_env(), 120, tmp_path)
    assert result.status is Status.FAILED and result.seconds < 20
    assert result.returncodes == (3, -9) and result.left_behind == ()


def test_children_that_finish_are_done_with_their_output_kept(tmp_path):
    result = run_group([[sys.executable, "-c", "print('rank', 0)"]], child_env(), 60, tmp_path)
    assert result.status is Status.DONE and result.returncodes == (0,) and result.logs == ("rank 0\n",)


def test_every_child_gets_nvlink_multicast_off_whatever_the_caller_set(tmp_path):
    caller = {**os.environ, "NCCL_NVLS_ENABLE": "1", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "0", "PYTHONPATH": "/x"}
    keys = sorted([*FORCED_ENV, "PYTHONPATH"])
    show = f"import json, os; print(json.dumps({{k: os.environ.get(k) for k in {keys!r}}}))"
    result = run_group([[sys.executable, "-c", show]] * 2, child_env(caller), 60, tmp_path)
    for log in result.logs:
        seen = json.loads(log)
        assert seen == {**FORCED_ENV, "PYTHONPATH": None}
        assert seen["NCCL_NVLS_ENABLE"] == "0" and seen["NVSHMEM_DISABLE_NVLS"] == "1"


def test_group_members_sees_a_live_group_and_nothing_after_it_is_killed(tmp_path):
    import subprocess

    proc = subprocess.Popen(SLEEP, start_new_session=True)
    try:
        assert group_members(proc.pid) == [proc.pid]
    finally:
        proc.kill()
        proc.wait()
    assert group_members(proc.pid) == []


def test_the_gpu_worker_imports_only_the_standard_library_and_torch():
    tree = ast.parse(WORKER.read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert names - set(sys.stdlib_module_names) == {"torch"}


def test_accept_with_an_env_that_has_no_torch_fails_the_runtime_saying_why(tmp_path):
    result = bwstack("--lock", str(REAL_LOCK), "accept", "--env", sys.executable, "--json", "--timeout", "60")
    assert result.returncode == 1
    runtime = next(f for f in json.loads(result.stdout)["findings"] if f["check"] == "gpu.runtime")
    assert runtime["verdict"] == "fail" and "No module named 'torch'" in runtime["detail"]
    assert "no process left behind" in runtime["detail"]


# ------------------------------------------------------------------------------------------------ the judge


def _device(i: int, matmul: float = 400.0, memcpy: float = 1500.0, link: dict | None = None) -> dict:
    return {
        "index": i,
        "name": "NVIDIA RTX PRO 6000 Blackwell Server Edition",
        "bdf": GPU_BDFS[i],
        "matmul_tflops": matmul,
        "matmul_finite": True,
        "memcpy_gbs": memcpy,
        "h2d_gbs": 53.0,
        "link_under_load": link or {"speed_gts": 32.0, "width": 16, "max_speed_gts": 32.0, "max_width": 16},
    }


def _bench(devices: list[dict] | None = None, p2p: list[dict] | None = None) -> BenchRun:
    devices = devices if devices is not None else [_device(i) for i in range(8)]
    return BenchRun(Bench("2.9.1+cu130", "13.0", tuple(devices), tuple(p2p or ()), ""), DONE)


def _allreduce(busbw: float, world: int = 8, correct: bool = True, transports=("P2P/CUMEM",)) -> AllReduceRun:
    algbw = busbw * world / (2 * (world - 1)) if world > 1 else 10.0
    result = AllReduce(world, "nccl", 2**30, 2**30 / algbw / 1e9, algbw, busbw, correct, "2.27.7")
    return AllReduceRun(world, "nccl", 180.0, result, DONE, tuple(transports))


def _judge(bench: BenchRun | None = None, allreduce: AllReduceRun | None = None, facts=HEALTHY) -> dict:
    static = judge_static(facts, RTX)
    found = judge_runtime(bench or _bench(), allreduce, ENVELOPE, facts, static, RTX)
    return {f.check: f for f in found}


BUSBW = [(39.5, Verdict.PASS), (37.0, Verdict.PASS), (33.0, Verdict.WARN), (25.0, Verdict.FAIL)]


@pytest.mark.parametrize(("busbw", "verdict"), BUSBW)
def test_all_reduce_bus_bandwidth_is_judged_by_the_lock_envelope(busbw, verdict):
    found = _judge(allreduce=_allreduce(busbw))["nccl.busbw"]
    assert found.verdict is verdict
    assert f"busbw {busbw:.1f} GB/s" in found.detail and "typical 37-41 GB/s" in found.detail


def test_bus_bandwidth_is_algbw_times_2_n_minus_1_over_n():
    found = _judge(allreduce=_allreduce(38.5))["nccl.busbw"]
    assert "algbw 22.0 GB/s x 2(n-1)/n, n=8" in found.detail


def test_an_all_reduce_over_fewer_gpus_than_the_target_is_reported_not_compared():
    found = _judge(allreduce=_allreduce(20.0, world=2))["nccl.busbw"]
    assert found.verdict is Verdict.WARN and "not comparable" in found.detail and not found.blocks


def test_a_single_gpu_all_reduce_has_no_bus_bandwidth_to_judge():
    findings = _judge(allreduce=_allreduce(0.0, world=1))
    assert findings["nccl.busbw"].verdict is Verdict.SKIP and findings["nccl.allreduce"].verdict is Verdict.PASS


def test_a_single_rank_reports_no_time_or_bandwidth_that_would_look_like_a_fabric_figure():
    """One rank moves no data: a 0.0 ms all-reduce at tens of TB/s "algbw" (seen on one H200) is not a figure."""
    findings = _judge(allreduce=_allreduce(0.0, world=1))
    shown = findings["nccl.allreduce"].detail + findings["nccl.busbw"].detail
    assert "GB/s" not in shown and " ms" not in shown and "no peer traffic" in shown


def test_wrong_sums_fail_the_all_reduce():
    found = _judge(allreduce=_allreduce(39.0, correct=False))["nccl.allreduce"]
    assert found.verdict is Verdict.FAIL and "wrong sums" in found.detail


def test_nccl_staging_through_the_host_instead_of_p2p_warns():
    found = _judge(allreduce=_allreduce(39.0, transports=("SHM/direct/direct",)))["nccl.transport"]
    assert found.verdict is Verdict.WARN and "not peer-to-peer" in found.detail


P2P = [
    ((0, 1), 54.0, True, Verdict.PASS, "same"),
    ((0, 1), 45.0, True, Verdict.WARN, "same"),
    ((0, 4), 45.0, True, Verdict.PASS, "cross"),
    ((0, 4), 35.0, True, Verdict.WARN, "cross"),
    ((0, 4), 20.0, True, Verdict.FAIL, "cross"),
    ((0, 1), 54.0, False, Verdict.FAIL, "same"),
]


@pytest.mark.parametrize(("pair", "gbs", "peer", "verdict", "numa"), P2P)
def test_p2p_bandwidth_is_judged_by_the_numa_nodes_of_the_pair(pair, gbs, peer, verdict, numa):
    good = [{"src": a, "dst": b, "can_access_peer": True, "gbs": 55.0} for a in range(8) for b in range(8) if a != b]
    pairs = [p if (p["src"], p["dst"]) != pair else {**p, "gbs": gbs, "can_access_peer": peer} for p in good]
    found = _judge(bench=_bench(p2p=pairs))["p2p.bandwidth"]
    assert found.verdict is verdict
    if verdict is not Verdict.PASS:
        assert f"{pair[0]}->{pair[1]} {gbs:.1f}" in found.detail and f"{numa} NUMA" in found.detail


@pytest.mark.parametrize(("slow", "verdict"), [(395.0, Verdict.PASS), (360.0, Verdict.WARN), (300.0, Verdict.FAIL)])
def test_a_gpu_slower_than_its_peers_is_judged_by_the_spread_envelope(slow, verdict):
    found = _judge(bench=_bench([_device(i, matmul=slow if i == 7 else 400.0) for i in range(8)]))["gpu.matmul"]
    assert found.verdict is verdict
    if verdict is not Verdict.PASS:
        assert "GPU7 at" in found.detail


def test_a_link_below_its_maximum_under_load_fails():
    slow = {"speed_gts": 16.0, "width": 8, "max_speed_gts": 32.0, "max_width": 16}
    found = _judge(bench=_bench([_device(i, link=slow if i == 5 else None) for i in range(8)]))["pcie.link_under_load"]
    assert found.verdict is Verdict.FAIL and "GPU5 at Gen4 x8 of Gen5 x16" in found.detail


def test_no_gpu_seen_by_torch_leaves_the_runtime_unknown_and_blocks_acceptance():
    bench = BenchRun(Bench("2.9.1+cu128", None, (), (), "torch sees no CUDA GPU"), DONE)
    found = _judge(bench=bench)["gpu.runtime"]
    assert found.verdict is Verdict.UNKNOWN and found.blocks and "torch sees no CUDA GPU" in found.detail


def _hung(tmp_path: Path, seconds: float = 2.0) -> AllReduceRun:
    """A real process group that really blocks, as a hung all-reduce would."""
    group = run_group([SLEEP, SLEEP], child_env(), seconds, tmp_path)
    return AllReduceRun(2, "nccl", seconds, None, group, ())


def test_a_hung_all_reduce_fails_naming_the_causes_the_static_facts_show(tmp_path):
    found = _judge(allreduce=_hung(tmp_path), facts=MISCONFIGURED)["nccl.allreduce"]
    assert found.verdict is Verdict.FAIL
    assert "did not finish within 2 s; its process group was killed (no process left behind)" in found.detail
    assert "pcie.acs: ACS sends peer traffic up to the root complex" in found.detail
    assert "iommu: the IOMMU translates the DMA" in found.detail


def test_a_hang_on_a_node_whose_static_facts_are_clean_says_so_and_what_to_try(tmp_path):
    found = _judge(allreduce=_hung(tmp_path), facts=HEALTHY)["nccl.allreduce"]
    assert "none of the usual causes" in found.detail and "NCCL_P2P_DISABLE=1" in found.detail


# ------------------------------------------------------------------------------------------------ slow: gloo


def _env_python(real) -> str:
    return str(real.store.active().env / "bin" / "python")


@pytest.mark.slow
@pytest.mark.network
@needs_py312
def test_the_real_all_reduce_path_with_gloo_gives_correct_sums_and_bus_bandwidth(real):
    run = run_allreduce(_env_python(real), 3, 180, backend="gloo", mib=8, iters=5)
    assert run.group.status is Status.DONE, run.group.logs
    r = run.result
    assert r.correct and r.world == 3 and r.bytes == 8 * 2**20
    assert r.busbw_gbs == pytest.approx(r.algbw_gbs * 4 / 3)
    assert run.group.left_behind == ()


@pytest.mark.slow
@pytest.mark.network
@needs_py312
def test_a_rank_that_never_joins_the_collective_fails_acceptance_within_the_timeout_leaving_nothing(real):
    timeout = 30.0
    started = time.monotonic()
    run = run_allreduce(_env_python(real), 3, timeout, backend="gloo", mib=8, iters=5, hang_rank=2)
    elapsed = time.monotonic() - started
    assert run.group.status is Status.TIMEOUT and run.result is None
    assert "joined the group, never joining the collective" in run.group.logs[2], "it hung in the collective"
    assert elapsed < timeout + 5
    assert run.group.left_behind == ()
    static = judge_static(MISCONFIGURED, RTX)
    bench = _bench()
    report = AcceptReport("TEST", "cu130", RTX.target, static, judge_runtime(bench, run, ENVELOPE, MISCONFIGURED,
                          static, RTX), "", timeout, MISCONFIGURED, bench, run)  # fmt: skip
    assert report.verdict is NodeVerdict.NOT_ACCEPTED
    failed = next(f for f in report.findings if f.check == "nccl.allreduce")
    assert f"did not finish within {timeout:g} s" in failed.detail and "pcie.acs" in failed.detail
    assert "nccl.allreduce" in report.verdict_line()


@pytest.mark.slow
@pytest.mark.network
@needs_py312
def test_the_real_gpu_benchmark_on_a_machine_without_a_gpu_says_torch_sees_none(real):
    run = run_bench(_env_python(real), 180)
    assert run.group.status is Status.DONE and run.result is not None
    assert run.result.devices == () and "torch sees no CUDA GPU" in run.result.reason
    assert run.result.torch.startswith("2.9.1")


def test_a_target_without_an_envelope_leaves_the_figures_unjudged_and_blocks_acceptance():
    static = judge_static(HEALTHY, RTX)
    found = {f.check: f for f in judge_runtime(_bench(), _allreduce(39.0), None, HEALTHY, static, RTX)}
    for check in ("nccl.busbw", "gpu.matmul"):
        assert found[check].verdict is Verdict.UNKNOWN and found[check].blocks
        assert "no envelope for target rtx-pro-6000-x8-pcie" in found[check].detail
