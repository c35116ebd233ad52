"""The facts acceptance reads from a node, as typed records. A fact that could not be read is an Unknown
that says why; nothing here is ever filled in by assumption.

Node-side: standard library only.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from bwstack.probe.hw.machine import Unknown

# PCIe link speeds (GT/s) by generation, as sysfs and lspci print them.
GENERATION_OF_SPEED = {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5, 64.0: 6, 128.0: 7}
# ACS control bits that send peer-to-peer traffic up to the root complex: P2P Request Redirect, P2P
# Completion Redirect, P2P Egress Control (the bits Linux's p2pdma checks in pci_bridge_has_acs_redir).
ACS_REDIRECT_FLAGS = ("ReqRedir", "CmpltRedir", "EgressCtrl")


class DriverFlavour(enum.Enum):
    OPEN = "open"
    PROPRIETARY = "proprietary"


@dataclass(frozen=True)
class Link:
    """A PCIe link from the device's side (sysfs current_/max_link_speed and width)."""

    speed_gts: float
    width: int
    max_speed_gts: float
    max_width: int

    @property
    def generation(self) -> int | None:
        return GENERATION_OF_SPEED.get(self.speed_gts)

    @property
    def max_generation(self) -> int | None:
        return GENERATION_OF_SPEED.get(self.max_speed_gts)


@dataclass(frozen=True)
class Aer:
    """AER error counters since boot (sysfs aer_dev_correctable / _nonfatal / _fatal, TOTAL_* lines)."""

    correctable: int
    nonfatal: int
    fatal: int


@dataclass(frozen=True)
class IommuGroup:
    number: str
    domain_type: str  # /sys/kernel/iommu_groups/N/type: DMA, DMA-FQ, identity, blocked, unmanaged

    @property
    def translating(self) -> bool:
        return self.domain_type in ("DMA", "DMA-FQ")


@dataclass(frozen=True)
class Acs:
    """The ACS control register of a bridge, as lspci -vvv decodes it (ACSCtl flags)."""

    flags: Mapping[str, bool]

    @property
    def redirecting(self) -> tuple[str, ...]:
        return tuple(f for f in ACS_REDIRECT_FLAGS if self.flags.get(f))


@dataclass(frozen=True)
class SmiGpu:
    """One row of `nvidia-smi --query-gpu=...`."""

    index: int
    bdf: str
    name: str
    capability: str
    driver: str
    memory_mib: int
    persistence: str


@dataclass(frozen=True)
class GpuFacts:
    bdf: str
    pci_id: str | Unknown  # vendor:device from sysfs
    lspci_name: str | Unknown
    smi: SmiGpu | Unknown
    link: Link | Unknown
    port_max_speed_gts: float | Unknown  # the port above the GPU: what the slot can do
    numa_node: int | Unknown | None  # None: the firmware reports no affinity (-1)
    bar1_bytes: int | Unknown
    iommu: IommuGroup | Unknown | None  # None: the GPU is in no IOMMU group (IOMMU off)
    aspm: str | Unknown  # LnkCtl "ASPM ..." of the GPU's link
    aer: Aer | Unknown
    bridges: tuple[str, ...]  # the bridges above the GPU, root port first


@dataclass(frozen=True)
class BridgeFacts:
    bdf: str
    description: str | Unknown
    acs: Acs | Unknown | None  # None: the bridge has no ACS capability
    aspm: str | Unknown
    aer: Aer | Unknown


@dataclass(frozen=True)
class Xid:
    bdf: str  # as the driver logs it: domain:bus:device (no function)
    code: int
    text: str


@dataclass(frozen=True)
class DriverFacts:
    loaded_version: str | Unknown  # /proc/driver/nvidia/version
    loaded_flavour: DriverFlavour | Unknown
    installed_license: str | Unknown  # modinfo nvidia: the module file the next boot loads
    installed_version: str | Unknown
    requires_open: tuple[str, ...] | Unknown  # GPUs the kernel log says need the open modules
    xids: tuple[Xid, ...] | Unknown


@dataclass(frozen=True)
class HostFacts:
    cmdline: tuple[str, ...] | Unknown
    iommu_units: tuple[str, ...] | Unknown  # /sys/class/iommu entries (dmar*, ivhd*): an IOMMU is active
    aspm_policy: str | Unknown
    uvm_disable_hmm: str | Unknown  # the loaded nvidia_uvm's parameter (Y/N)
    uvm_hmm_configured: str | Unknown  # where modprobe.d sets uvm_disable_hmm, if it does
    numa_online: str | Unknown
    libcuda: tuple[str, ...] | Unknown  # where the loader finds libcuda.so.1 (ldconfig -p), in order
    compat_conf: tuple[str, ...]  # ld.so.conf(.d) files that put a cuda-compat directory on the loader path
    persistenced: str | Unknown  # systemctl is-active nvidia-persistenced
    fabricmanager: str | Unknown


@dataclass(frozen=True)
class Matrix:
    """A GPU-by-GPU matrix from `nvidia-smi topo` (indices as nvidia-smi numbers the GPUs)."""

    cells: Mapping[tuple[int, int], str]

    def pairs(self) -> list[tuple[int, int, str]]:
        return sorted((a, b, v) for (a, b), v in self.cells.items() if a != b)


@dataclass(frozen=True)
class MachineFacts:
    label: str
    gpus: tuple[GpuFacts, ...] | Unknown
    bridges: Mapping[str, BridgeFacts]
    smi: tuple[SmiGpu, ...] | Unknown
    topology: Matrix | Unknown  # topo -m: X, NV#, PIX, PXB, PHB, NODE, SYS
    p2p: Matrix | Unknown  # topo -p2p r: X, OK, CNS, GNS, TNS, NS, DR, U
    driver: DriverFacts
    host: HostFacts


def jsonable(value: Any) -> Any:
    """Facts as JSON: an Unknown becomes {"unknown": why}, matrices map "a-b" to the cell."""
    if isinstance(value, Unknown):
        return {"unknown": value.why}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Matrix):
        return {f"{a}-{b}": v for (a, b), v in sorted(value.cells.items())}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [jsonable(v) for v in value]
    return value
