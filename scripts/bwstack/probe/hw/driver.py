"""The NVIDIA driver side of a node: the loaded and installed kernel module, nvidia-smi's GPUs and
matrices, the kernel log's Xid and open-module lines, the driver's services.

Node-side: standard library only. Formats read:
- /proc/driver/nvidia/version: "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release
  Build ..." (open) or "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.95.05  <date>" (proprietary);
- `modinfo nvidia`: "license:        Dual MIT/GPL" (open) or "NVIDIA" (proprietary), "version: ...";
- `nvidia-smi --query-gpu=... --format=csv,noheader,nounits`: one comma-separated row per GPU, the bus id
  as "00000000:03:00.0";
- `nvidia-smi topo -m` / `topo -p2p r`: a GPU-by-GPU matrix, header "GPU0 GPU1 ..." (nvidia-smi underlines
  it with ANSI escapes), rows "GPU0 X NV18 ..." / "GPU0 X OK CNS ...", then a legend;
- kernel log: "NVRM: Xid (PCI:0000:01:00): 79, pid=..., GPU has fallen off the bus." and, for a GPU the
  proprietary module cannot drive, "NVRM: The NVIDIA GPU 0000:02:00.0 (PCI ID: 10de:2c58) ... installed in
  this system requires use of the NVIDIA open kernel modules.";
- `systemctl is-active UNIT`: one word (active, inactive, failed, ...).
"""

from __future__ import annotations

import re

from bwstack.probe.hw.facts import DriverFlavour, Matrix, SmiGpu, Xid
from bwstack.probe.hw.machine import Machine, Unknown, stdout_of

PROC_VERSION = "/proc/driver/nvidia/version"
VERSION_RE = re.compile(r"Kernel Module(?:\s+for\s+\S+)?\s+(\d+(?:\.\d+)+)")
ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")
XID_RE = re.compile(r"NVRM: Xid \((?:PCI:)?([0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2})[^)]*\): (\d+)[,:]?\s*(.*)")
OPEN_REQUIRED = "requires use of the NVIDIA open kernel modules"
OPEN_GPU_RE = re.compile(r"NVIDIA GPU ([0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]) \(PCI ID")
SERVICE_STATES = ("active", "inactive", "failed", "activating", "deactivating", "reloading", "maintenance")


def loaded(m: Machine) -> tuple[str | Unknown, DriverFlavour | Unknown]:
    text = m.read(PROC_VERSION)
    if isinstance(text, Unknown):
        why = Unknown(f"the nvidia kernel module is not loaded ({text.why})")
        return why, why
    first = text.strip().splitlines()[0] if text.strip() else ""
    version = VERSION_RE.search(first)
    if "Open Kernel Module" in first:
        flavour: DriverFlavour | Unknown = DriverFlavour.OPEN
    elif "Kernel Module" in first:
        flavour = DriverFlavour.PROPRIETARY
    else:
        flavour = Unknown(f"{PROC_VERSION} does not name the module: {first[:120]!r}")
    return (version.group(1) if version else Unknown(f"no version in {PROC_VERSION}: {first[:120]!r}")), flavour


def installed(m: Machine) -> tuple[str | Unknown, str | Unknown]:
    """(license, version) of the nvidia.ko that modprobe would load."""
    text = stdout_of(m.run("modinfo-nvidia"))
    if isinstance(text, Unknown):
        return text, text
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("license", "version") and key.strip() not in fields:
            fields[key.strip()] = value.strip()
    return (
        fields.get("license") or Unknown("modinfo nvidia shows no license"),
        fields.get("version") or Unknown("modinfo nvidia shows no version"),
    )


def normalise_bus_id(bus_id: str) -> str:
    """nvidia-smi's "00000000:03:00.0" as sysfs writes it: "0000:03:00.0"."""
    domain, _, rest = bus_id.strip().lower().partition(":")
    return f"{int(domain, 16):04x}:{rest}"


def smi_gpus(m: Machine) -> tuple[SmiGpu, ...] | Unknown:
    text = stdout_of(m.run("nvidia-smi-gpus"))
    if isinstance(text, Unknown):
        return text
    gpus = []
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 7:
            return Unknown(f"nvidia-smi printed a row that is not the 7 fields asked for: {line[:120]!r}")
        try:
            gpus.append(
                SmiGpu(int(parts[0]), normalise_bus_id(parts[1]), parts[2], parts[3], parts[4], int(parts[5]), parts[6])
            )
        except ValueError:
            return Unknown(f"nvidia-smi printed a row that does not parse: {line[:120]!r}")
    if not gpus:
        return Unknown("nvidia-smi lists no GPU")
    return tuple(gpus)


def parse_matrix(text: str) -> Matrix | Unknown:
    rows = [ANSI_RE.sub("", line).split() for line in text.splitlines()]
    header = next((r for r in rows if r and r[0] == "GPU0"), None)
    if header is None:
        return Unknown("no GPU0 header row")
    n = 0
    while n < len(header) and header[n] == f"GPU{n}":
        n += 1
    cells: dict[tuple[int, int], str] = {}
    for row in rows:
        if row is header or not row or not re.fullmatch(r"GPU\d+", row[0]) or len(row) < n + 1:
            continue
        a = int(row[0][3:])
        if a >= n:
            continue
        for b in range(n):
            cells[(a, b)] = row[1 + b]
    if len(cells) != n * n:
        return Unknown(f"the matrix has {len(cells)} of {n * n} cells")
    return Matrix(cells)


def matrix(m: Machine, name: str) -> Matrix | Unknown:
    text = stdout_of(m.run(name))
    if isinstance(text, Unknown):
        return text
    parsed = parse_matrix(text)
    return Unknown(f"`nvidia-smi topo` output not understood: {parsed.why}") if isinstance(parsed, Unknown) else parsed


def kernel_log(m: Machine) -> tuple[tuple[Xid, ...] | Unknown, tuple[str, ...] | Unknown]:
    """(Xid events, GPUs the kernel says need the open modules) since boot."""
    text = stdout_of(m.run("kernel-log"))
    if isinstance(text, Unknown):
        why = Unknown(f"the kernel log cannot be read: {text.why}")
        return why, why
    xids = tuple(Xid(x.group(1).lower(), int(x.group(2)), x.group(3).strip()) for x in XID_RE.finditer(text))
    needs_open: list[str] = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        found = OPEN_GPU_RE.search(line)
        # The driver splits this message over two log lines.
        if found and any(OPEN_REQUIRED in later for later in lines[i : i + 2]):
            bdf = found.group(1).lower()
            if bdf not in needs_open:
                needs_open.append(bdf)
    return xids, tuple(needs_open)


def service(m: Machine, name: str) -> str | Unknown:
    out = m.run(name)
    if isinstance(out, Unknown):
        return out
    state = out.stdout.strip().splitlines()[0].strip() if out.stdout.strip() else ""
    if state in SERVICE_STATES:
        return state
    return Unknown(out.failure() if not out.ok else f"`{' '.join(out.argv)}` printed {state[:80]!r}")
