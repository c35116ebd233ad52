"""`bwstack accept`, static part: recorded machine descriptions (TEST FIXTURES written from the formats'
public documentation, tests/fixtures/machines/) give the expected verdict and fix for every check; hostile
descriptions are refused or read as unknown, never trusted; acceptance only reads, and needs no network.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import MACHINES, REAL_LOCK, bwstack

from bwstack.lock.model import load_lock
from bwstack.probe.hw import driver, pcie
from bwstack.probe.hw.collect import collect
from bwstack.probe.hw.judge import Verdict, Want, judge_static
from bwstack.probe.hw.machine import Machine, Unknown

HEALTHY, MISCONFIGURED, NVLINK = "rtx-pro-6000-x8-healthy", "rtx-pro-6000-x8-misconfigured", "h100-sxm-x8-nvlink"
RTX = Want.of(load_lock(REAL_LOCK).profile("cu130"), load_lock(REAL_LOCK).profile("cu130").target)
# TEST FIXTURE target: what the H100 host is, to show the checks judge by the target, not by habit.
H100 = Want(
    profile="cu130",
    cuda="13.0.1",
    min_driver="580.65.06",
    target="h100-sxm-x8-nvlink",
    gpu_name="NVIDIA H100",
    capability="9.0",
    count=8,
    memory_gb=80,
    interconnect="nvlink",
    datacenter=True,
    pcie_generation=5,
    pcie_width=16,
)
TARGETS = {"rtx": RTX, "h100": H100}
ALL_PASS = {
    "gpu.model": "8 x NVIDIA RTX PRO 6000 Blackwell Server Edition, capability 12.0",
    "driver.flavour": "open kernel module loaded",
    "driver.version": "driver 580.95.05; CUDA 13.0.1 (profile cu130) needs >= 580.65.06",
    "driver.persistence": "nvidia-persistenced is active",
    "driver.fabric_manager": "inactive (not needed on PCIe)",
    "loader.cuda_compat": "/lib/x86_64-linux-gnu/libcuda.so.1 (the driver's)",
    "uvm.hmm": "uvm_disable_hmm=Y",
    "pcie.link": "at Gen1 now, as idle GPUs save power",
    "pcie.bar1": "BAR1 128 GiB on every GPU",
    "gpu.numa": "node 0: GPU0, GPU1, GPU2, GPU3; node 1: GPU4, GPU5, GPU6, GPU7",
    "iommu": "IOMMU off",
    "pcie.acs": "no ACS redirection on the 16 bridges between GPUs",
    "p2p.capability": "all 56 GPU pairs report P2P read OK",
    "interconnect": "PCIe only, as the target: NODE: 8 pairs, PIX: 4 pairs, SYS: 16 pairs",
    "pcie.aspm": "pcie_aspm=off",
    "kernel.xid": "no Xid errors since boot",
    "pcie.aer": "no AER errors since boot on 8 GPUs and 16 bridges",
}

# (machine, target, check, verdict, text in the detail, text in the fix)
EXPECTED = [(HEALTHY, "rtx", check, "pass", detail, "") for check, detail in ALL_PASS.items()] + [
    (MISCONFIGURED, "rtx", "gpu.model", "fail", "8 NVIDIA GPU(s) on the PCIe bus", "did not initialise"),
    (MISCONFIGURED, "rtx", "driver.flavour", "fail", "proprietary nvidia module is loaded", "open kernel modules"),
    (MISCONFIGURED, "rtx", "driver.flavour", "fail", "0000:84:00.0", "nvidia-driver-580-open"),
    (MISCONFIGURED, "rtx", "driver.version", "pass", "580.95.05", ""),
    (MISCONFIGURED, "rtx", "driver.persistence", "warn", "nvidia-persistenced is failed", "systemctl enable --now"),
    (MISCONFIGURED, "rtx", "driver.fabric_manager", "pass", "not needed on PCIe", ""),
    (MISCONFIGURED, "rtx", "loader.cuda_compat", "fail", "/usr/local/cuda-13.0/compat/libcuda.so.1", "ldconfig"),
    (MISCONFIGURED, "rtx", "loader.cuda_compat", "fail", "error 804", "000_cuda-compat.conf"),
    (MISCONFIGURED, "rtx", "uvm.hmm", "warn", "nvidia_uvm is not loaded", "uvm_disable_hmm=1"),
    (MISCONFIGURED, "rtx", "pcie.link", "fail", "0000:84:00.0: x8 of x16; trained at Gen4 of Gen5", "riser"),
    (MISCONFIGURED, "rtx", "pcie.bar1", "pass", "128 GiB", ""),
    (MISCONFIGURED, "rtx", "iommu", "fail", "0000:84:00.0 (DMA-FQ)", "iommu=pt"),
    (MISCONFIGURED, "rtx", "pcie.acs", "fail", "0000:82:01.0 (ReqRedir, CmpltRedir)", "ECAP_ACS+0x6.w=0000"),
    (MISCONFIGURED, "rtx", "pcie.acs", "fail", "12 of the 16 bridges", "BIOS"),
    (MISCONFIGURED, "rtx", "p2p.capability", "unknown", "No devices were found", ""),
    (MISCONFIGURED, "rtx", "interconnect", "unknown", "No devices were found", ""),
    (MISCONFIGURED, "rtx", "pcie.aspm", "warn", "0000:84:00.0 port: L1 Enabled", "pcie_aspm=off"),
    (MISCONFIGURED, "rtx", "kernel.xid", "pass", "no Xid", ""),
    (MISCONFIGURED, "rtx", "pcie.aer", "warn", "0000:84:00.0: 37 correctable", "riser"),
    (NVLINK, "rtx", "gpu.model", "fail", "NVIDIA H100 80GB HBM3 is not NVIDIA RTX PRO 6000 Blackwell", "profile"),
    (NVLINK, "rtx", "driver.flavour", "fail", "proprietary", "open kernel modules"),
    (NVLINK, "rtx", "loader.cuda_compat", "fail", "cuda-12.8/compat", "ldconfig"),
    (NVLINK, "rtx", "driver.fabric_manager", "warn", "runs on a PCIe node", "disable"),
    (NVLINK, "rtx", "interconnect", "warn", "NV18: 28 pairs", "target"),
    (NVLINK, "h100", "gpu.model", "pass", "8 x NVIDIA H100 80GB HBM3, capability 9.0", ""),
    (NVLINK, "h100", "driver.flavour", "pass", "proprietary module, supported for capability 9.0", ""),
    (NVLINK, "h100", "driver.fabric_manager", "pass", "active", ""),
    (NVLINK, "h100", "loader.cuda_compat", "pass", "supported on datacenter GPUs", ""),
    (NVLINK, "h100", "interconnect", "pass", "every GPU pair on NVLink", ""),
    (NVLINK, "h100", "iommu", "pass", "pass-through (identity) for every GPU (kernel: intel_iommu=on iommu=pt)", ""),
    (NVLINK, "h100", "pcie.acs", "pass", "joined by NVLink", ""),
    (NVLINK, "h100", "p2p.capability", "pass", "56 GPU pairs", ""),
    (NVLINK, "h100", "uvm.hmm", "warn", "uvm_disable_hmm=N", "uvm_disable_hmm=1"),
    (NVLINK, "h100", "kernel.xid", "warn", "0000:23:00 Xid 13 x1", "Xid catalogue"),
    (NVLINK, "h100", "pcie.link", "pass", "8 GPUs on Gen5 x16 links", ""),
]


def _findings(machine: str, target: str) -> dict:
    facts = collect(Machine.recorded(MACHINES / machine))
    return {f.check: f for f in judge_static(facts, TARGETS[target])}


@pytest.mark.parametrize(
    ("machine", "target", "check", "verdict", "detail", "fix"),
    EXPECTED,
    ids=[f"{m}-{t}-{c}-{v}-{i}" for i, (m, t, c, v, _, _) in enumerate(EXPECTED)],
)
def test_each_fixture_machine_gives_the_expected_verdict_and_fix(machine, target, check, verdict, detail, fix):
    found = _findings(machine, target)[check]
    assert found.verdict is Verdict(verdict), found
    assert detail in found.detail
    assert fix in found.fix
    assert bool(found.fix) == (found.verdict in (Verdict.FAIL, Verdict.WARN)), "a fix exactly when there is one"


def test_the_healthy_host_passes_every_static_check():
    assert {c: f.verdict for c, f in _findings(HEALTHY, "rtx").items()} == dict.fromkeys(ALL_PASS, Verdict.PASS)


def test_the_nvlink_host_is_accepted_statically_for_its_own_target_with_warnings_only():
    findings = _findings(NVLINK, "h100").values()
    assert not any(f.blocks for f in findings)
    assert {f.check for f in findings if f.verdict is Verdict.WARN} == {"uvm.hmm", "kernel.xid"}


# ------------------------------------------------------------------------------------------------ the CLI


def _accept(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return bwstack("--lock", str(REAL_LOCK), "accept", *args, env=env, timeout=120)


@pytest.mark.parametrize(("machine", "code"), [(HEALTHY, 0), (MISCONFIGURED, 1), (NVLINK, 1)])
def test_exit_code_is_0_when_accepted_and_1_when_not(machine, code):
    result = _accept("--machine", str(MACHINES / machine))
    assert result.returncode == code, result.stderr
    assert result.stdout.strip().splitlines()[-1].startswith("ACCEPTED" if code == 0 else "NOT ACCEPTED")


def test_the_verdict_line_names_the_failed_and_unknown_checks():
    line = _accept("--machine", str(MACHINES / MISCONFIGURED)).stdout.strip().splitlines()[-1]
    assert line.startswith("NOT ACCEPTED:") and "static facts only" in line
    assert "failed: gpu.model, driver.flavour, loader.cuda_compat, pcie.link, iommu, pcie.acs" in line
    assert "unknown: p2p.capability" in line


def test_the_table_shows_every_gpu_with_its_link_bar1_numa_iommu_and_aer():
    out = _accept("--machine", str(MACHINES / MISCONFIGURED)).stdout
    row = next(line for line in out.splitlines() if line.startswith("-    0000:84:00.0"))
    assert row.split()[-6:] == ["Gen5", "128", "GiB", "1", "DMA-FQ", "37/0/0"]
    assert "Gen4 x8 / Gen5 x16" in row and "RTX PRO 6000 Blackwell Server Edition" in row


def test_json_has_every_finding_the_facts_with_unknowns_explained_and_the_table():
    result = _accept("--machine", str(MACHINES / MISCONFIGURED), "--json")
    report = json.loads(result.stdout)
    assert report["accepted"] is False and report["verdict"] == "not accepted"
    assert [f["check"] for f in report["findings"]] == list(ALL_PASS)
    assert {f["verdict"] for f in report["findings"]} <= {v.value for v in Verdict}
    assert report["facts"]["smi"]["unknown"].endswith("exited 6: No devices were found")
    assert report["runtime"]["ran"] is False and "recorded machine" in report["runtime"]["note"]
    assert report["report"][-1] == report["verdict_line"] == result.stderr.strip()


def _test_lock_with_h100_target(tmp_path: Path) -> Path:
    doc = yaml.safe_load(REAL_LOCK.read_text())
    target = {
        "description": "TEST FIXTURE target: eight H100 SXM5 on NVSwitch",
        "gpu_name": "NVIDIA H100",
        "capability": "9.0",
        "count": 8,
        "memory_gb": 80,
        "interconnect": "nvlink",
        "datacenter": True,
        "pcie": {"generation": 5, "width": 16},
        "source": "tests/unit/test_accept_static.py",
    }
    doc["targets"]["h100-sxm-x8-nvlink"] = target
    path = tmp_path / "stack.lock.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def test_hardware_judges_against_another_target_of_the_lock(tmp_path):
    lock = _test_lock_with_h100_target(tmp_path)
    args = ("accept", "--machine", str(MACHINES / NVLINK), "--json")
    own = json.loads(bwstack("--lock", str(lock), *args, "--hardware", "h100-sxm-x8-nvlink").stdout)
    other = json.loads(bwstack("--lock", str(lock), *args).stdout)
    assert own["accepted"] is True and own["target"] == "h100-sxm-x8-nvlink"
    assert other["accepted"] is False and other["target"] == "rtx-pro-6000-x8-pcie"


def _not_a_description(tmp_path: Path) -> str:
    (tmp_path / "empty").mkdir()
    return str(tmp_path / "empty")


def _a_file(tmp_path: Path) -> str:
    (tmp_path / "file").write_text("x")
    return str(tmp_path / "file")


def _a_full_dir(tmp_path: Path) -> str:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    return str(tmp_path / "full")


def _bad_unreadable_json(tmp_path: Path) -> str:
    copy = tmp_path / "m"
    shutil.copytree(MACHINES / HEALTHY, copy, symlinks=True)
    (copy / "unreadable.json").write_text("[1, 2]")
    return str(copy)


def _linked_unreadable_json(tmp_path: Path) -> str:
    copy = tmp_path / "m"
    shutil.copytree(MACHINES / HEALTHY, copy, symlinks=True)
    (copy / "unreadable.json").symlink_to("/etc/hostname")
    return str(copy)


BAD_INPUT = [
    # A bad --timeout is refused before anything runs (--no-runtime would be refused beside it: it reads none).
    ("timeout-zero", lambda t: ["--timeout", "0"], "--timeout 0: must be between 1 and 3600"),
    ("timeout-words", lambda t: ["--timeout", "soon"], "--timeout 'soon': expected a number"),
    ("timeout-nan", lambda t: ["--timeout", "nan"], "must be between"),
    ("timeout-too-long", lambda t: ["--timeout", "3601"], "must be between 1 and 3600"),
    ("timeout-empty", lambda t: ["--no-runtime", "--timeout", ""], "--timeout is empty"),
    ("machine-missing", lambda t: ["--machine", str(t / "nope")], "no such directory"),
    ("machine-a-file", lambda t: ["--machine", _a_file(t)], "no such directory"),
    ("machine-not-a-description", lambda t: ["--machine", _not_a_description(t)], "not a recorded machine"),
    ("machine-empty", lambda t: ["--machine", ""], "--machine is empty"),
    ("machine-bad-unreadable", lambda t: ["--machine", _bad_unreadable_json(t)], "unreadable.json: not a JSON"),
    ("machine-linked-unreadable", lambda t: ["--machine", _linked_unreadable_json(t)], "not a plain file"),
    ("machine-and-record", lambda t: ["--machine", str(MACHINES / HEALTHY), "--record", str(t / "r")], "give one"),
    ("record-into-full-dir", lambda t: ["--no-runtime", "--record", _a_full_dir(t)], "a new or empty directory"),
    ("hardware-unknown", lambda t: ["--no-runtime", "--hardware", "h200-x1"], "not one of the lock's targets"),
    ("env-missing", lambda t: ["--env", str(t / "no-env")], "no Python there"),
    ("env-empty", lambda t: ["--env", ""], "--env is empty"),
    ("profile-unknown", lambda t: ["--no-runtime", "--profile", "cu999"], "unknown profile 'cu999'"),
]


@pytest.mark.parametrize(("case", "args", "message"), BAD_INPUT, ids=[c[0] for c in BAD_INPUT])
def test_bad_input_is_one_line_and_exit_2(tmp_path, case, args, message):
    result = _accept(*args(tmp_path))
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("bwstack: error:"), result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr


# ------------------------------------------------------------------------------------------------ only reads


def _snapshot(root: Path) -> dict[str, tuple]:
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            st = path.lstat()
            if stat.S_ISLNK(st.st_mode):
                found[str(path)] = ("link", os.readlink(path))
            elif stat.S_ISREG(st.st_mode):
                found[str(path)] = ("file", st.st_mode, st.st_mtime_ns, hashlib.sha256(path.read_bytes()).hexdigest())
            else:
                found[str(path)] = ("dir", st.st_mode, st.st_mtime_ns)
    return found


def test_acceptance_only_reads_a_read_only_machine_description(tmp_path):
    copy = tmp_path / "machine"
    shutil.copytree(MACHINES / MISCONFIGURED, copy, symlinks=True)
    for dirpath, dirnames, filenames in os.walk(copy):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            if not path.is_symlink():
                path.chmod(path.stat().st_mode & ~0o222)
    copy.chmod(0o555)
    before = _snapshot(copy)
    result = _accept("--machine", str(copy), "--json")
    assert result.returncode == 1 and json.loads(result.stdout)["findings"]
    assert _snapshot(copy) == before  # root ignores the modes: the snapshot is the proof


def test_acceptance_needs_no_network(tmp_path):
    """Every socket the process would open fails; acceptance does not notice."""
    (tmp_path / "sitecustomize.py").write_text(
        "import socket\n"
        "class _NoNetwork(socket.socket):\n"
        "    def __init__(self, *a, **k):\n"
        "        raise OSError('TEST: this process has no network')\n"
        "socket.socket = _NoNetwork\n"
    )
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    probe = subprocess.run([sys.executable, "-c", "import socket; socket.socket()"], env={**os.environ, **env},
                           capture_output=True, text=True)  # fmt: skip
    assert "no network" in probe.stderr, "the network block itself works"
    result = _accept("--machine", str(MACHINES / HEALTHY), "--json", env=env)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["accepted"] is True


# ------------------------------------------------------------------------------------------------ recording


def test_a_recording_of_this_machine_replays_to_the_same_findings(tmp_path):
    record = tmp_path / "this-machine"
    live = json.loads(_accept("--no-runtime", "--json", "--record", str(record)).stdout)
    replay = json.loads(_accept("--machine", str(record), "--json").stdout)
    assert [(f["check"], f["verdict"], f["detail"]) for f in replay["findings"]] == [
        (f["check"], f["verdict"], f["detail"]) for f in live["findings"]
    ]
    assert (record / "proc" / "cmdline").read_text() == Path("/proc/cmdline").read_text()
    assert (record / "commands" / "kernel-log.argv").is_file()


# ------------------------------------------------------------------------------------------------ hostile


def _hostile_copy(tmp_path: Path) -> Path:
    copy = tmp_path / "machine"
    shutil.copytree(MACHINES / HEALTHY, copy, symlinks=True)
    return copy


def _replace(copy: Path, rel: str, make) -> None:
    path = copy / rel
    if path.is_symlink() or path.is_file():
        path.unlink()
    make(path)


HOSTILE_READS = [
    ("absolute-link-out", "proc/cmdline", lambda p: p.symlink_to("/etc/hostname"), "leads outside"),
    (
        "relative-link-out",
        "proc/cmdline",
        lambda p: p.symlink_to("../../../../../../../../etc/hostname"),
        "leads outside",
    ),
    ("fifo", "proc/cmdline", lambda p: os.mkfifo(p), "not a regular file"),
    ("directory", "proc/cmdline", lambda p: p.mkdir(), "not a regular file"),
    ("huge", "proc/cmdline", lambda p: p.write_bytes(b"x" * (2 << 20)), "larger than 1024 KiB"),
]


@pytest.mark.parametrize(("case", "rel", "make", "why"), HOSTILE_READS, ids=[c[0] for c in HOSTILE_READS])
def test_a_hostile_file_in_a_description_is_unknown_not_followed(tmp_path, case, rel, make, why):
    copy = _hostile_copy(tmp_path)
    _replace(copy, rel, make)
    value = Machine.recorded(copy).read("/" + rel)
    assert isinstance(value, Unknown) and why in value.why


def test_a_folder_of_a_description_linked_out_of_it_is_never_followed(tmp_path):
    """Its owner may swap any name for a link while root replays it (a race, at each lookup): every path is looked
    up one name at a time beneath the recording's folder, so a link leading out of it is refused wherever it is."""
    copy = _hostile_copy(tmp_path)
    secret = tmp_path / "secret"
    (secret / "driver" / "nvidia").mkdir(parents=True)
    (secret / "driver" / "nvidia" / "version").write_text("root's only\n")
    shutil.rmtree(copy / "proc")
    (copy / "proc").symlink_to(secret)
    m = Machine.recorded(copy)
    for value in (m.read("/proc/driver/nvidia/version"), m.listdir("/proc/driver")):
        assert isinstance(value, Unknown) and "leads outside" in value.why
    assert not m.exists("/proc/driver/nvidia/version")


def test_links_inside_a_description_are_followed_inside_it(tmp_path):
    """sysfs is links (a device's driver, its iommu_group): a relative link that stays inside is followed."""
    copy = _hostile_copy(tmp_path)
    (copy / "sys" / "real").mkdir()
    (copy / "sys" / "real" / "value").write_text("42\n")
    (copy / "sys" / "via").symlink_to("real")
    (copy / "sys" / "deeper").mkdir()
    (copy / "sys" / "deeper" / "up").symlink_to("../via/value")
    (copy / "sys" / "loop").symlink_to("loop")
    m = Machine.recorded(copy)
    assert m.read("/sys/via/value") == "42\n" and m.read("/sys/deeper/up") == "42\n"
    assert m.listdir("/sys/via") == ["value"] and m.readlink("/sys/via") == "real"
    loop = m.read("/sys/loop")
    assert isinstance(loop, Unknown) and not m.exists("/sys/loop")


def test_a_recording_the_machine_let_go_of_reads_nothing(tmp_path):
    m = Machine.recorded(_hostile_copy(tmp_path))
    m.close()
    assert isinstance(m.read("/proc/cmdline"), Unknown)


def test_text_a_recording_chose_reaches_the_terminal_written_out_not_acted_on(tmp_path):
    """A command's recorded stderr is quoted in the report: an escape sequence there could clear root's screen and
    print a verdict of its own."""
    copy = _hostile_copy(tmp_path)
    (copy / "commands" / "persistenced.txt").write_text("\x1b[2J\x1b[H\x1b[32mACCEPTED everything\x1b[0m\n")
    (copy / "commands" / "persistenced.exit").write_text("3\n")
    result = _accept("--machine", str(copy), "--no-runtime")
    assert "\x1b" not in result.stdout + result.stderr
    assert "\\x1b[2J\\x1b[H\\x1b[32mACCEPTED everything" in result.stdout


@pytest.mark.parametrize("where", ["the-folder", "a-folder-above"])
def test_a_link_another_user_made_to_a_recording_is_not_followed(tmp_path, where):
    """Root's own recordings are private (0700: the kernel log is in them). Another user's link to one, as the
    recording or on the way to it, would have root replay (and print) what that user cannot read."""
    private = _hostile_copy(tmp_path)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    link = theirs / ("rec" if where == "the-folder" else "up")
    link.symlink_to(private if where == "the-folder" else tmp_path)
    os.lchown(link, 65534, 65534)
    named = link if where == "the-folder" else link / "machine"
    with pytest.raises(ValueError, match="a link uid 65534 made, not followed"):
        Machine.recorded(named)


def test_a_processs_link_in_proc_is_not_followed_to_a_recording(tmp_path, monkeypatch):
    """/proc/<pid>/cwd, root and fd/N are root's links whoever's process they are (one that made itself
    undumpable), and their text would be read again in root's view, not the process's."""
    monkeypatch.chdir(_hostile_copy(tmp_path))
    with pytest.raises(ValueError, match="a process's link in /proc, not followed"):
        Machine.recorded("/proc/self/cwd")


def test_a_link_root_made_on_the_way_to_a_recording_is_followed(tmp_path):
    (tmp_path / "moved").symlink_to(_hostile_copy(tmp_path))
    assert Machine.recorded(tmp_path / "moved").read("/proc/cmdline") == Machine.recorded(tmp_path / "machine").read(
        "/proc/cmdline"
    )


def test_a_reason_a_recording_gives_is_one_line_of_the_report(tmp_path):
    copy = _hostile_copy(tmp_path)
    (copy / "unreadable.json").write_text(json.dumps({"/proc/cmdline": "x\n\nACCEPTED: forged\n"}))
    value = Machine.recorded(copy).read("/proc/cmdline")
    assert isinstance(value, Unknown) and value.why == "x ACCEPTED: forged"


def test_an_unreadable_json_nested_past_the_parsers_depth_is_refused_and_holds_nothing_open(tmp_path):
    copy = _hostile_copy(tmp_path)
    (copy / "unreadable.json").write_text("[" * 100_000)
    before = sorted(os.listdir("/proc/self/fd"))
    with pytest.raises(ValueError, match=r"unreadable\.json: not a JSON object"):
        Machine.recorded(copy)
    assert sorted(os.listdir("/proc/self/fd")) == before


def test_a_value_a_recording_gives_cannot_start_a_line_of_the_report(tmp_path):
    copy = _hostile_copy(tmp_path)
    (copy / "sys/module/nvidia_uvm/parameters/uvm_disable_hmm").write_text("Y\nFORGED a row of the table\n")
    result = _accept("--machine", str(copy), "--no-runtime")
    assert not any(line.startswith("FORGED") for line in result.stdout.splitlines()), result.stdout


HOSTILE_COMMANDS = [
    ("output-is-a-link", "lspci.txt", lambda p: p.symlink_to("/etc/hostname"), "not a plain file"),
    ("exit-not-a-number", "lspci.exit", lambda p: p.write_text("zero\n"), "not an exit status"),
    ("output-is-a-fifo", "lspci.txt", lambda p: os.mkfifo(p), "not a plain file"),
]


@pytest.mark.parametrize(("case", "name", "make", "why"), HOSTILE_COMMANDS, ids=[c[0] for c in HOSTILE_COMMANDS])
def test_a_hostile_command_output_is_unknown(tmp_path, case, name, make, why):
    copy = _hostile_copy(tmp_path)
    _replace(copy, f"commands/{name}", make)
    value = Machine.recorded(copy).run("lspci")
    assert isinstance(value, Unknown) and why in value.why


GARBAGE = [
    ("link-speed-words", "current_link_speed", "fast\n", "pcie.link", "not a link speed"),
    ("link-width-words", "current_link_width", "sixteen\n", "pcie.link", "not a number"),
    ("aer-without-total", "aer_dev_fatal", "Undefined 0\n", "pcie.aer", "no TOTAL_ERR_FATAL line"),
    ("resource-garbage", "resource", "zzz\n", "pcie.bar1", "no BAR1 line"),
]


@pytest.mark.parametrize(("case", "name", "text", "check", "why"), GARBAGE, ids=[c[0] for c in GARBAGE])
def test_garbage_in_a_sysfs_file_makes_that_fact_unknown_saying_why(tmp_path, case, name, text, check, why):
    copy = _hostile_copy(tmp_path)
    gpu = copy / "sys/devices/pci0000:00/0000:00:01.1/0000:01:00.0/0000:02:00.0/0000:03:00.0"
    (gpu / name).write_text(text)
    found = {f.check: f for f in judge_static(collect(Machine.recorded(copy)), RTX)}[check]
    assert found.verdict is Verdict.UNKNOWN and why in found.detail


# The resource file of a real H200 in a VM (recorded on a device run, 2026-12-01): BAR0 is 64-bit there, so it
# takes lines 0 and 1, and BAR1 is line 2; nvidia-smi -q -d MEMORY said "BAR1 Memory Usage / Total: 262144 MiB".
H200_VM_RESOURCE = (
    "0x0000104002000000 0x0000104002ffffff 0x000000000014220c\n"
    "0x0000000000000000 0x0000000000000000 0x0000000000000000\n"
    "0x0000100000000000 0x0000103fffffffff 0x000000000014220c\n"
    "0x0000000000000000 0x0000000000000000 0x0000000000000000\n"
    "0x0000104000000000 0x0000104001ffffff 0x000000000014220c\n"
    "0x0000000000000000 0x0000000000000000 0x0000000000000000\n"
    "0x0000000000000000 0x0000000000000000 0x0000000000000000\n"
)


def test_bar1_after_a_64_bit_bar0_is_read_from_the_next_free_register(tmp_path):
    copy = _hostile_copy(tmp_path)
    gpu = copy / "sys/devices/pci0000:00/0000:00:01.1/0000:01:00.0/0000:02:00.0/0000:03:00.0"
    (gpu / "resource").write_text(H200_VM_RESOURCE)
    facts = collect(Machine.recorded(copy))
    bar1 = {g.bdf: g.bar1_bytes for g in facts.gpus}["0000:03:00.0"]
    assert bar1 == 262144 * 2**20  # nvidia-smi's figure on that machine


def test_an_nvidia_smi_row_with_other_fields_is_unknown_not_misread(tmp_path):
    copy = _hostile_copy(tmp_path)
    (copy / "commands/nvidia-smi-gpus.txt").write_text(
        "NVIDIA RTX PRO 6000 Blackwell Server Edition, 12.0, 580.95.05\n"
    )
    facts = collect(Machine.recorded(copy))
    assert isinstance(facts.smi, Unknown) and "not the 7 fields asked for" in facts.smi.why


# ------------------------------------------------------------------------------------------------ formats


def test_topology_matrices_parse_through_nvidia_smis_ansi_underline():
    text = (MACHINES / HEALTHY / "commands/nvidia-smi-topo.txt").read_text()
    assert "\x1b[4m" in text
    matrix = driver.parse_matrix(text)
    assert matrix.cells[(0, 1)] == "PIX" and matrix.cells[(0, 2)] == "NODE" and matrix.cells[(0, 7)] == "SYS"
    assert len(matrix.cells) == 64


def test_lspci_without_root_makes_acs_unknown_saying_so():
    text = (
        "0000:02:00.0 PCI bridge: Broadcom / LSI PEX890xx PCIe Gen 5 Switch (rev b0)\n\tCapabilities: <access denied>\n"
    )
    acs = pcie.acs_of(pcie.parse_lspci(text), "0000:02:00.0")
    assert isinstance(acs, Unknown) and "run as root" in acs.why


def test_the_kernel_log_yields_xids_and_the_gpus_needing_open_modules():
    xids, needs_open = driver.kernel_log(Machine.recorded(MACHINES / MISCONFIGURED))
    assert xids == () and len(needs_open) == 8 and needs_open[0] == "0000:03:00.0"
    xids, _ = driver.kernel_log(Machine.recorded(MACHINES / NVLINK))
    assert [(x.bdf, x.code) for x in xids] == [("0000:23:00", 13)]


# ------------------------------------------------------------------------------------------------ the fixtures


def _tree(root: Path) -> dict[str, tuple]:
    """Every entry under `root` by its relative path: links by target, files by content."""
    return {
        os.path.relpath(k, root): (v[0], v[1]) if v[0] == "link" else (v[0], v[-1] if v[0] == "file" else "")
        for k, v in _snapshot(root).items()
    }


def test_the_fixture_machines_are_what_make_py_writes(tmp_path):
    subprocess.run([sys.executable, str(MACHINES / "make.py"), str(tmp_path)], check=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([HEALTHY, MISCONFIGURED, NVLINK])
    for name in (HEALTHY, MISCONFIGURED, NVLINK):
        assert _tree(tmp_path / name) == _tree(MACHINES / name), f"{name}: run tests/fixtures/machines/make.py"


@pytest.mark.parametrize("name", [HEALTHY, MISCONFIGURED, NVLINK])
def test_every_fixture_machine_says_it_is_a_test_fixture(name):
    assert (MACHINES / name / "FIXTURE").read_text().startswith("TEST FIXTURE")
    assert "TEST FIXTURE" in (MACHINES / "README.md").read_text()


WANT_JSON = Want.of(load_lock(REAL_LOCK).profile("cu130"), load_lock(REAL_LOCK).profile("cu130").target).as_json()
BAD_WANT = [
    ("not-an-object", ["rtx"], "must be a JSON object"),
    ("missing-key", {k: v for k, v in WANT_JSON.items() if k != "min_driver"}, "has no 'min_driver'"),
    ("count-as-text", {**WANT_JSON, "count": "8"}, "'count' must be a non-empty int"),
    ("count-as-bool", {**WANT_JSON, "count": True}, "'count' must be a non-empty int"),
    ("empty-name", {**WANT_JSON, "gpu_name": ""}, "'gpu_name' must be a non-empty str"),
    ("datacenter-as-text", {**WANT_JSON, "datacenter": "no"}, "'datacenter' must be a non-empty bool"),
]


@pytest.mark.parametrize(("case", "data", "message"), BAD_WANT, ids=[c[0] for c in BAD_WANT])
def test_a_malformed_target_sent_to_the_node_is_refused(case, data, message):
    with pytest.raises(ValueError, match=message):
        Want.from_json(data)


def test_the_target_sent_to_the_node_round_trips_through_json():
    assert Want.from_json(json.loads(json.dumps(WANT_JSON))) == RTX
