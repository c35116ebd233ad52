"""The PCIe side of a node: its GPUs and the bridges above them, from sysfs and `lspci -D -vvv`.

Node-side: standard library only. Formats read (Linux Documentation/ABI/testing/sysfs-bus-pci,
sysfs-bus-pci-devices-aer_stats, sysfs-kernel-iommu_groups; pciutils ls-caps.c / ls-ecaps.c):
- /sys/bus/pci/devices/<bdf> links to /sys/devices/pci<dom>:<bus>/<root port>/.../<bdf>: the bridges above;
- vendor, device, class ("0x10de", "0x2bb5", "0x030200"), numa_node ("-1" when the firmware gives none);
- current_link_speed / max_link_speed ("32.0 GT/s PCIe", older kernels "8 GT/s"), *_link_width ("16");
- resource: one "0x<start> 0x<end> 0x<flags>" line per BAR (all zero when unused);
- aer_dev_correctable / _nonfatal / _fatal: "<name> <count>" lines ending in TOTAL_ERR_COR/NONFATAL/FATAL;
- iommu_group links to /sys/kernel/iommu_groups/<n>, whose `type` is DMA, DMA-FQ, identity, ...;
- lspci -vvv: "LnkCtl:\tASPM Disabled; ..." and "ACSCtl:\tSrcValid+ TransBlk- ReqRedir+ ..."; without root
  the capabilities read "Capabilities: <access denied>".
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from bwstack.probe.hw.facts import Acs, Aer, BridgeFacts, IommuGroup, Link
from bwstack.probe.hw.machine import Machine, Unknown, stdout_of

BDF_RE = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
SPEED_RE = re.compile(r"^\s*([\d.]+)\s*GT/s")
NVIDIA = "0x10de"
GPU_CLASSES = ("0x0300", "0x0302")  # VGA-compatible controller, 3D controller
DEVICES = "/sys/bus/pci/devices"


@dataclass(frozen=True)
class PciNode:
    bdf: str
    path: str  # the device's directory under /sys/devices
    chain: tuple[str, ...]  # bridges above it (root port first), then itself
    vendor: str | Unknown
    device: str | Unknown
    cls: str | Unknown

    @property
    def is_nvidia_gpu(self) -> bool:
        return (
            isinstance(self.vendor, str)
            and isinstance(self.cls, str)
            and self.vendor == NVIDIA
            and self.cls.startswith(GPU_CLASSES)
        )


def _strip(value: str | Unknown) -> str | Unknown:
    return value.strip() if isinstance(value, str) else value


def tree(m: Machine) -> dict[str, PciNode] | Unknown:
    """Every PCI function the kernel lists, with the chain of bridges above it."""
    names = m.listdir(DEVICES)
    if isinstance(names, Unknown):
        return Unknown(f"no PCI devices in sysfs: {names.why}")
    nodes: dict[str, PciNode] = {}
    for bdf in names:
        if not BDF_RE.match(bdf):
            continue
        link = m.readlink(f"{DEVICES}/{bdf}")
        if isinstance(link, Unknown):
            continue
        path = os.path.normpath(os.path.join(DEVICES, link))
        chain = tuple(part for part in path.split("/") if BDF_RE.match(part))
        if not chain or chain[-1] != bdf:
            continue  # not the layout sysfs has: skip rather than guess the device's place
        nodes[bdf] = PciNode(
            bdf,
            path,
            chain,
            _strip(m.read(f"{path}/vendor")),
            _strip(m.read(f"{path}/device")),
            _strip(m.read(f"{path}/class")),
        )
    return nodes


def _speed(text: str | Unknown, what: str) -> float | Unknown:
    if isinstance(text, Unknown):
        return text
    match = SPEED_RE.match(text)
    if not match:
        return Unknown(f"{what} reads {text.strip()!r}, not a link speed")
    return float(match.group(1))


def _int(text: str | Unknown, what: str) -> int | Unknown:
    if isinstance(text, Unknown):
        return text
    try:
        return int(text.strip())
    except ValueError:
        return Unknown(f"{what} reads {text.strip()!r}, not a number")


def link(m: Machine, path: str) -> Link | Unknown:
    values = [
        _speed(m.read(f"{path}/current_link_speed"), "current_link_speed"),
        _int(m.read(f"{path}/current_link_width"), "current_link_width"),
        _speed(m.read(f"{path}/max_link_speed"), "max_link_speed"),
        _int(m.read(f"{path}/max_link_width"), "max_link_width"),
    ]
    for value in values:
        if isinstance(value, Unknown):
            return value
    speed, width, max_speed, max_width = values
    return Link(float(speed), int(width), float(max_speed), int(max_width))


def max_speed(m: Machine, path: str) -> float | Unknown:
    return _speed(m.read(f"{path}/max_link_speed"), "max_link_speed")


def numa_node(m: Machine, path: str) -> int | Unknown | None:
    value = _int(m.read(f"{path}/numa_node"), "numa_node")
    if isinstance(value, int) and value < 0:
        return None
    return value


IORESOURCE_MEM_64 = 0x00100000  # include/linux/ioport.h: a 64-bit memory BAR (it takes two BAR registers)


def bar1_bytes(m: Machine, path: str) -> int | Unknown:
    """BAR1 (NVIDIA's framebuffer aperture) from the device's `resource` file: one line per BAR register. BAR1
    follows BAR0, which is 32-bit on bare-metal cards (BAR1 on line 1) but may be 64-bit, taking lines 0 and 1
    (an H200 in a VM: BAR1 on line 2, as nvidia-smi's "BAR1 Memory Usage" confirms)."""
    text = m.read(f"{path}/resource")
    if isinstance(text, Unknown):
        return text
    try:
        rows = [tuple(int(v, 16) for v in line.split()) for line in text.splitlines()[:6]]
        if len(rows) < 3 or any(len(r) != 3 for r in rows):
            raise ValueError
    except ValueError:
        return Unknown(f"{path}/resource has no BAR1 line in the kernel's format")
    index = 2 if rows[0][2] & IORESOURCE_MEM_64 else 1
    start, end, _flags = rows[index]
    if start == 0 and end == 0:
        return Unknown(f"BAR1 is not assigned (resource line {index} is empty)")
    return end - start + 1


def aer(m: Machine, path: str) -> Aer | Unknown:
    totals = {}
    for name, total in (
        ("correctable", "TOTAL_ERR_COR"),
        ("nonfatal", "TOTAL_ERR_NONFATAL"),
        ("fatal", "TOTAL_ERR_FATAL"),
    ):
        text = m.read(f"{path}/aer_dev_{name}")
        if isinstance(text, Unknown):
            return Unknown(f"no AER counters ({text.why}): the kernel keeps none for this device")
        found = re.search(rf"^{total}\s+(\d+)\s*$", text, re.M)
        if not found:
            return Unknown(f"aer_dev_{name} has no {total} line")
        totals[name] = int(found.group(1))
    return Aer(**totals)


def iommu_group(m: Machine, path: str) -> IommuGroup | Unknown | None:
    target = m.readlink(f"{path}/iommu_group")
    if isinstance(target, Unknown):
        return None if not m.exists(f"{path}/iommu_group") else target
    group = os.path.normpath(os.path.join(path, target))
    kind = m.read(f"{group}/type")
    if isinstance(kind, Unknown):
        return Unknown(f"IOMMU group {os.path.basename(group)}: {kind.why}")
    return IommuGroup(os.path.basename(group), kind.strip())


# ------------------------------------------------------------------------------------------------ lspci


@dataclass(frozen=True)
class LspciEntry:
    description: str
    denied: bool  # "Capabilities: <access denied>": lspci ran without root
    acs: Acs | None  # None: no ACS capability listed
    aspm: str | None  # LnkCtl ASPM state; None: no PCIe capability listed


def parse_lspci(text: str) -> dict[str, LspciEntry]:
    entries: dict[str, LspciEntry] = {}
    for block in re.split(r"\n\s*\n", text):
        lines = block.strip("\n").splitlines()
        if not lines:
            continue
        head = lines[0].split(" ", 1)
        if len(head) != 2 or not BDF_RE.match(head[0].lower()):
            continue
        body = "\n".join(lines[1:])
        acs_line = re.search(r"ACSCtl:\s*(.*)$", body, re.M)
        acs = None
        if acs_line:
            acs = Acs({m.group(1): m.group(2) == "+" for m in re.finditer(r"(\w+)([+-])", acs_line.group(1))})
        aspm = re.search(r"LnkCtl:\s*ASPM ([^;]+);", body)
        entries[head[0].lower()] = LspciEntry(
            description=head[1].split(": ", 1)[-1].strip(),  # after the class ("3D controller: ")
            denied="<access denied>" in body,
            acs=acs,
            aspm=aspm.group(1).strip() if aspm else None,
        )
    return entries


def lspci(m: Machine) -> dict[str, LspciEntry] | Unknown:
    text = stdout_of(m.run("lspci"))
    return text if isinstance(text, Unknown) else parse_lspci(text)


def acs_of(entries: dict[str, LspciEntry] | Unknown, bdf: str) -> Acs | Unknown | None:
    if isinstance(entries, Unknown):
        return Unknown(f"lspci: {entries.why}")
    entry = entries.get(bdf)
    if entry is None:
        return Unknown(f"lspci does not list {bdf}")
    if entry.denied:
        return Unknown("lspci could not read the extended configuration space (run as root)")
    return entry.acs


def aspm_of(entries: dict[str, LspciEntry] | Unknown, bdf: str) -> str | Unknown:
    if isinstance(entries, Unknown):
        return Unknown(f"lspci: {entries.why}")
    entry = entries.get(bdf)
    if entry is None:
        return Unknown(f"lspci does not list {bdf}")
    if entry.denied or entry.aspm is None:
        return Unknown("lspci shows no link control (run as root)" if entry.denied else "no PCIe link control")
    return entry.aspm


def name_of(entries: dict[str, LspciEntry] | Unknown, bdf: str) -> str | Unknown:
    if isinstance(entries, Unknown):
        return Unknown(f"lspci: {entries.why}")
    entry = entries.get(bdf)
    return entry.description if entry else Unknown(f"lspci does not list {bdf}")


def bridge(m: Machine, node: PciNode, entries: dict[str, LspciEntry] | Unknown) -> BridgeFacts:
    return BridgeFacts(
        bdf=node.bdf,
        description=name_of(entries, node.bdf),
        acs=acs_of(entries, node.bdf),
        aspm=aspm_of(entries, node.bdf),
        aer=aer(m, node.path),
    )
