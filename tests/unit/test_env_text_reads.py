"""How the root probe reads the text files of an env it inspects (METADATA, pyvenv.cfg, torch/version.py, the
sources the feature and kernel facts parse): as the env's interpreter would, through links, but only when they end
at a regular file of bounded size. A changed generation, or one restored from an archive (which may hold absolute
links), can put a FIFO, a device or a /proc file where a source file was; the probe must pass over it, not hang on
it or read without end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bwstack.probe import treecheck


def _fifo(tmp: Path) -> Path:
    os.mkfifo(tmp / "f.py")
    return tmp / "f.py"


def _link_to_fifo(tmp: Path) -> Path:
    os.mkfifo(tmp / "elsewhere")
    os.symlink(tmp / "elsewhere", tmp / "f.py")
    return tmp / "f.py"


def _link_to_dev_zero(tmp: Path) -> Path:
    os.symlink("/dev/zero", tmp / "f.py")
    return tmp / "f.py"


def _directory(tmp: Path) -> Path:
    (tmp / "f.py").mkdir()
    return tmp / "f.py"


def _over_the_limit(tmp: Path) -> Path:
    (tmp / "f.py").write_bytes(b"x" * 65)
    return tmp / "f.py"


def _proc_file_longer_than_its_size(tmp: Path) -> Path:
    """/proc/self/maps says 0 bytes and holds more than the limit: only a bounded read finds out."""
    os.symlink("/proc/self/maps", tmp / "f.py")
    return tmp / "f.py"


def _missing(tmp: Path) -> Path:
    return tmp / "f.py"


@pytest.mark.parametrize(
    "make",
    [_fifo, _link_to_fifo, _link_to_dev_zero, _directory, _over_the_limit, _proc_file_longer_than_its_size, _missing],
    ids=lambda f: f.__name__.strip("_"),
)
def test_what_is_not_a_small_regular_file_is_refused_and_reads_as_absent(tmp_path, make):
    path = make(tmp_path)
    with pytest.raises((OSError, ValueError)):
        treecheck.read_regular(path, limit=64)
    assert treecheck.read_text(path, limit=64) is None


@pytest.mark.parametrize(
    "kernel_file",
    [
        "/proc/self/status",
        "/sys/kernel/uevent_seqnum",
        "/sys/fs/cgroup/cgroup.controllers",  # cgroup v2, a submount of /sys
        "/sys/fs/cgroup/memory/memory.stat",  # cgroup v1
        "/dev/null",
    ],
)
def test_a_link_to_a_small_file_of_the_kernels_is_refused(tmp_path, kernel_file):
    """/proc and /sys files claim to be regular; reading some has effects (/proc/kmsg consumes the log). Their
    submounts (cgroup, debugfs, tracefs) are other filesystems, refused all the same."""
    if not os.path.exists(kernel_file):
        pytest.skip(f"{kernel_file} is not on this machine")
    os.symlink(kernel_file, tmp_path / "version.py")
    with pytest.raises(ValueError, match=r"kernel's|not a regular file"):
        treecheck.read_regular(tmp_path / "version.py")


def test_a_regular_file_is_read_whole(tmp_path):
    (tmp_path / "f.py").write_bytes(b"x" * 64)
    assert treecheck.read_regular(tmp_path / "f.py", limit=64) == b"x" * 64


def test_a_link_to_a_regular_file_is_followed_as_the_interpreter_follows_it(tmp_path):
    (tmp_path / "real.py").write_text("__version__ = '2.9.1'\n")
    os.symlink("real.py", tmp_path / "version.py")
    assert treecheck.read_text(tmp_path / "version.py") == "__version__ = '2.9.1'\n"


def test_undecodable_bytes_are_replaced_not_fatal(tmp_path):
    (tmp_path / "METADATA").write_bytes(b"Name: x\nVersion: 1\xff\n")
    assert treecheck.read_text(tmp_path / "METADATA") == "Name: x\nVersion: 1\ufffd\n"


# Every text file the static facts read, as a FIFO or a link to /dev/zero, beside the METADATA that make the
# feature reader look at SGLang's and FlashInfer's sources. (Only root can place a FIFO in a sealed generation,
# but a restored archive's absolute links can lead to one that anyone made in /tmp.)
SP = "lib/python3.12/site-packages"
HOSTILE_TEXT_FILES = {
    "pyvenv.cfg": "fifo",
    f"{SP}/torch/version.py": "fifo",
    f"{SP}/torch/__init__.py": "zero",
    f"{SP}/torch-2.9.1.dist-info/METADATA": "fifo",
    f"{SP}/sglang-0.5.9.dist-info/METADATA": "Name: sglang\nVersion: 0.5.9\n",
    f"{SP}/sglang-0.5.9.dist-info/INSTALLER": "zero",
    f"{SP}/flashinfer_python-0.6.4.dist-info/METADATA": "Name: flashinfer-python\nVersion: 0.6.4\n",
    f"{SP}/sglang/srt/layers/communicator.py": "fifo",
    f"{SP}/sglang/srt/layers/moved_elsewhere.py": "fifo",
    f"{SP}/sglang/srt/layers/zero.py": "zero",
    f"{SP}/sglang/srt/utils/common.py": "zero",
    f"{SP}/flashinfer/data/include/flashinfer/comm/trtllm_allreduce_fusion.cuh": "fifo",
    f"{SP}/flashinfer/data/include/flashinfer/trtllm/fmha/fmhaRunner.cuh": "zero",
    f"{SP}/triton_kernels/target_info.py": "fifo",
}

READ_ALL_TEXT = """
import json, sys
from pathlib import Path
from bwstack.probe import envinspect, features, main
from bwstack.probe.serveplan import node
env = Path(sys.argv[1]); sp = envinspect.site_packages(env)
print(json.dumps({
    "python": envinspect.env_python_version(env),
    "installed": main.installed_facts(env),
    "torch_version_py": main._torch_version_py(sp),
    "preloads": main.torch_preloads(sp, "12.8"),
    "features": features.states(features.report(sp, "12.0")),
    "guards": node._flashinfer_guards(sp),
    "triton_kernels": node._triton_kernels(sp),
}))
"""


def test_the_static_facts_pass_over_fifos_and_devices_where_an_envs_text_files_were(tmp_path):
    env = tmp_path / "env"
    for rel, kind in HOSTILE_TEXT_FILES.items():
        path = env / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if kind == "fifo":
            os.mkfifo(path)
        elif kind == "zero":
            os.symlink("/dev/zero", path)
        else:
            path.write_text(kind)
    # In a child with a time limit: a regression fails here instead of hanging the suite.
    done = subprocess.run([sys.executable, "-c", READ_ALL_TEXT, str(env)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    facts = json.loads(done.stdout)
    assert set(facts["installed"]) == {"sglang", "flashinfer-python"}  # torch's METADATA is a FIFO: not installed
    assert facts["installed"]["sglang"]["installer"] == ""
    assert facts["torch_version_py"] == {} and facts["preloads"] == {}
    assert facts["guards"] == {} and facts["triton_kernels"] is None
    assert facts["python"] == "3.12"  # from the folder's name, as pyvenv.cfg cannot be read
    assert facts["features"]["flashinfer_allreduce_fusion"] == "unknown"  # its sources are FIFOs: cannot tell
