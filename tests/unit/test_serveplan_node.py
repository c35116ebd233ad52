"""serve-plan's node side on files made here: the stand-in nvidia-smi the simulated target answers with, and the
readers of kernel facts (cubin architectures, DeepGEMM's kernel sources, triton_kernels' TMA gather threshold,
FlashInfer's architecture guards). The real files are read in the slow tier (test_serveplan_truth.py)."""

from __future__ import annotations

import importlib.util
import inspect
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from bwstack.probe import interp
from bwstack.probe import main as probe
from bwstack.probe.serveplan import node

DEVICE = node.Device(node.SIMULATED, "12.0", 8, 98304, "NVIDIA RTX PRO 6000 Blackwell", "pcie")


def test_the_stand_in_nvidia_smi_answers_sglangs_memory_query_for_every_simulated_gpu(tmp_path: Path):
    node._stand_in_smi(tmp_path, DEVICE, sys.executable)
    smi = tmp_path / "nvidia-smi"
    out = subprocess.run(
        [str(smi), "--query-gpu=memory.total", "--format=csv,noheader,nounits"], capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stdout.split() == ["98304"] * 8
    named = subprocess.run([str(smi), "--query-gpu=index,name,compute_cap"], capture_output=True, text=True).stdout
    assert named.splitlines()[0] == "0, NVIDIA RTX PRO 6000 Blackwell, 12.0"
    assert "SIMULATED" in smi.read_text()


def _cubin(path: Path, sm: int) -> None:
    """An ELF header whose e_flags carry the SM number where CUDA cubins keep it (bits 8-15)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    header = bytearray(64)
    header[:4] = b"\x7fELF"
    struct.pack_into("<I", header, 48, sm << 8)
    path.write_bytes(bytes(header))


def test_flashinfer_cubins_are_grouped_by_family_with_their_architectures(tmp_path: Path):
    root = tmp_path / "flashinfer_cubin" / "cubins"
    _cubin(root / "75d4" / "fmha" / "trtllm-gen" / "a.cubin", 100)
    _cubin(root / "75d4" / "fmha" / "trtllm-gen" / "b.cubin", 103)
    _cubin(root / "e1e1" / "batched_gemm-2a674db-79e4d37" / "c.cubin", 100)
    families = node._cubin_categories(tmp_path)
    assert families == {
        "fmha": {"cubins": 2, "archs": {"sm_100": 1, "sm_103": 1}},
        "batched_gemm": {"cubins": 1, "archs": {"sm_100": 1}},
    }


def test_deepgemms_architectures_come_from_its_kernel_sources(tmp_path: Path):
    impls = tmp_path / "deep_gemm" / "include" / "deep_gemm" / "impls"
    impls.mkdir(parents=True)
    for name in ("sm90_fp8_gemm_1d1d.cuh", "sm100_bf16_gemm.cuh", "smxx_layout.cuh"):
        (impls / name).write_text("")
    assert node._deep_gemm(tmp_path) == {"impls": "deep_gemm/include/deep_gemm/impls", "archs": ["sm_90", "sm_100"]}
    assert node._deep_gemm(tmp_path / "nothing") is None


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("@triton.constexpr_function\ndef has_tma_gather():\n    return cuda_capability_geq(10, 0)\n", "10.0"),
        ("def has_tma_gather():\n    return False\n", None),
    ],
)
def test_triton_kernels_tma_gather_threshold_is_read_from_its_source(tmp_path: Path, source, expected):
    target = tmp_path / "triton_kernels" / "target_info.py"
    target.parent.mkdir()
    target.write_text("import triton\n\n" + source)
    facts = node._triton_kernels(tmp_path)
    assert facts["tma_gather_from"] == expected
    if expected:
        assert facts["site"] == "triton_kernels/target_info.py:4"


def test_flashinfers_architecture_guard_is_quoted_with_its_line(tmp_path: Path):
    header = tmp_path / "flashinfer" / "data" / "include" / "flashinfer" / "trtllm" / "fmha" / "fmhaRunner.cuh"
    header.parent.mkdir(parents=True)
    header.write_text('// x\n  FLASHINFER_CHECK(mSM == kSM_100 || mSM == kSM_103, "Unsupported architecture");\n')
    guards = node._flashinfer_guards(tmp_path)
    assert guards["fmha"]["site"] == "flashinfer/data/include/flashinfer/trtllm/fmha/fmhaRunner.cuh:2"
    assert "Unsupported architecture" in guards["fmha"]["code"]


def test_a_simulated_job_device_is_the_target_described(tmp_path: Path):
    spec = {"mode": "simulated", "capability": "12.0", "count": 8, "memory_mib": 98304,
            "name": "NVIDIA RTX PRO 6000 Blackwell", "interconnect": "pcie"}  # fmt: skip
    assert node.resolve_device(spec, tmp_path) == DEVICE


def test_a_missing_env_is_an_observation_error_not_a_crash(tmp_path: Path):
    observed = node.observe(tmp_path / "no-env", DEVICE, [{"id": "m", "model": "gpt-oss-20b", "tp": 8}])
    assert observed.error == f"no env at {tmp_path / 'no-env'}: no bin/python"


def _base_nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, os.getpid())  # the process's main thread


def _nice_of_a_child() -> int:
    return int(subprocess.check_output(["sh", "-c", "ps -o ni= -p $$"]))


def test_work_handed_to_yielding_runs_at_a_lower_priority_and_what_it_starts_inherits_it():
    with ThreadPoolExecutor(max_workers=1) as pool:
        child = pool.submit(interp.yielding, _nice_of_a_child).result()
        again = pool.submit(interp.yielding, _nice_of_a_child).result()  # the same thread: not lowered twice
    assert child == again == min(19, _base_nice() + interp.YIELDING_NICE)
    assert os.getpriority(os.PRIO_PROCESS, 0) == _base_nice()  # the caller's own thread is left as it was


def test_yielding_never_raises_a_thread_already_lower():
    def lowest_then_yield() -> int:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        return interp.yielding(_nice_of_a_child)

    with ThreadPoolExecutor(max_workers=1) as pool:
        assert pool.submit(lowest_then_yield).result() == 19


def _env_logging_priorities(tmp_path: Path, other_cases: str) -> Path:
    """A fake env whose python logs the nice value it runs at: "planner N" for SGLang's planner (inenv.py, which
    it answers with no observations); `other_cases` (shell case arms, {log} for the log) for the rest."""
    (tmp_path / "env/lib/python3.12/site-packages").mkdir(parents=True)
    (tmp_path / "env/bin").mkdir()
    log = tmp_path / "priorities.log"
    fake = tmp_path / "env/bin/python"
    fake.write_text(
        "#!/bin/sh\n"
        f'ni=$(ps -o ni= -p $$); case "$*" in *inenv.py*) echo "planner $ni" >> {log}; '
        f"echo '{node.MARKER}{{\"observations\": []}}';; {other_cases.format(log=log)} esac\n"
    )
    fake.chmod(0o755)
    return log


def test_the_planners_interpreter_keeps_the_callers_priority_and_the_file_reads_beside_it_yield(tmp_path: Path):
    """A fake env whose interpreter logs the priority it runs at: the planner (inenv.py) at the caller's, the
    interpreter the kernel facts start beside it (the CUDA facts' `python -c`) at the lowered one."""
    log = _env_logging_priorities(tmp_path, '*) echo "other $ni" >> {log};;')
    observed = node.observe(tmp_path / "env", DEVICE, [{"id": "m", "model": "gpt-oss-20b", "tp": 8}])
    assert observed.error is None, observed.error
    seen = {line.split()[0]: int(line.split()[1]) for line in log.read_text().splitlines()}
    assert seen == {"planner": _base_nice(), "other": min(19, _base_nice() + interp.YIELDING_NICE)}


def test_a_verify_probe_runs_the_planner_at_the_callers_priority_and_the_import_checks_lowered(tmp_path: Path):
    """collect() with a fake env whose interpreter logs its priority: the import checks (which end at once here,
    freeing their pool's thread before the planner starts) yield, the planner's interpreter does not: it never
    gets a thread that yielded."""
    # The CUDA facts' question, asked before the planner starts, is slow: the import checks end first.
    log = _env_logging_priorities(tmp_path, '*"import torch"*) echo "imports $ni" >> {log};; *shutil*) sleep 0.5;;')
    (log.parent / "env/lib/python3.12/site-packages/torch").mkdir()
    job = {"device": {"mode": "simulated", "capability": "12.0", "count": 8, "memory_mib": 98304, "name": "RTX",
                      "interconnect": "pcie"},
           "requests": [{"id": "model-0", "model": "llama-3.1-8b-instruct", "tp": 8}]}  # fmt: skip
    probe.collect(tmp_path / "env", "12.0", runtime=False, serve_plan=job)
    seen = {}
    for line in log.read_text().splitlines():
        seen.setdefault(line.split()[0], set()).add(int(line.split()[1]))
    assert seen == {"planner": {_base_nice()}, "imports": {min(19, _base_nice() + interp.YIELDING_NICE)}}, seen


def _extension_needing_libcuda(sp: Path, libs: Path) -> None:
    """A test-built torch extension (it needs libc10.so) that calls cuInit from libcuda.so.1, as sgl-kernel does."""
    libs.mkdir()
    (libs / "empty.c").write_text("int bwstack_fixture;\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", libs / "libc10.so", libs / "empty.c"], check=True)
    cuda = ["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", libs / "libcuda.so.1", libs / "empty.c"]
    subprocess.run(cuda, check=True)
    (sp / "fixture_ext").mkdir(parents=True)
    (libs / "ext.c").write_text("int cuInit(unsigned);\nint f(void) { return cuInit(0); }\n")
    ext = ["gcc", "-shared", "-fPIC", "-o", sp / "fixture_ext" / "_C.so", libs / "ext.c", f"-L{libs}",
           "-Wl,--no-as-needed", "-lc10", "-l:libcuda.so.1"]  # fmt: skip
    subprocess.run(ext, check=True)


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc to build the fixture extension")
def test_one_stand_in_libcuda_is_built_for_every_caller_of_a_probe_run_and_removed_after(tmp_path: Path):
    sp = tmp_path / "site-packages"
    _extension_needing_libcuda(sp, tmp_path / "libs")
    with probe.StandInLibcuda(sp) as stand_in, ThreadPoolExecutor(max_workers=4) as pool:
        folders = set(pool.map(lambda _: stand_in.folder(), range(8)))
        assert len(folders) == 1
        folder = folders.pop()
        assert folder is not None and (folder / "libcuda.so.1").is_file()
        assert "cuInit" in (folder / "stub.c").read_text()
    assert not folder.exists()


@pytest.mark.skipif(shutil.which("gcc") is None, reason="without gcc there is never a stand-in")
def test_no_stand_in_libcuda_where_nothing_links_it(tmp_path: Path, monkeypatch):
    (tmp_path / "site-packages").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    with probe.StandInLibcuda(tmp_path / "site-packages") as stand_in:
        assert stand_in.folder() is None
        assert stand_in.folder() is None  # asked again: the same answer
    assert list((tmp_path / "tmp").iterdir()) == []


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc to build the fixture extension")
def test_a_stand_in_asked_for_after_the_probe_run_ended_is_not_built(tmp_path: Path, monkeypatch):
    sp = tmp_path / "site-packages"
    _extension_needing_libcuda(sp, tmp_path / "libs")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    stand_in = probe.StandInLibcuda(sp)
    stand_in.close()
    assert stand_in.folder() is None
    assert list((tmp_path / "tmp").iterdir()) == []


def _planner_script():
    """probe/scripts/serveplan.py (inenv.py in the env's interpreter) loaded as a module: its helpers only."""
    path = Path(node.__file__).parents[1] / "scripts" / "serveplan.py"
    spec = importlib.util.spec_from_file_location("bwstack_inenv_fixture", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Decided:  # a class whose definition site the planner reports
    field: int = 1


def test_the_planner_reads_a_definitions_source_once_however_often_its_sites_are_asked(monkeypatch):
    inenv = _planner_script()
    read, real = [], inspect.getsourcelines
    monkeypatch.setattr(inenv.inspect, "getsourcelines", lambda obj: read.append(obj) or real(obj))
    sites = {inenv._definition_site(_Decided) for _ in range(5)}
    assert sites == {f"{__file__}:{real(_Decided)[1]}"}
    assert read == [_Decided]
