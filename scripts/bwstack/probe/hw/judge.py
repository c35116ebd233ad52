"""Judge a node's static facts against its hardware target: pass, warn or fail, each with a one-line fix.

Node-side: standard library only (preflight runs it inside the probe zipapp). What the lock says about the
target reaches it as `Want`, built on the controller (bwstack.accept.command.want_of) and sent as JSON.
An unknown fact is judged UNKNOWN, never assumed; it blocks acceptance only where the check could fail.
"""

from __future__ import annotations

import enum
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields

from bwstack.probe.hw.facts import GENERATION_OF_SPEED, Acs, DriverFlavour, GpuFacts, IommuGroup, Link, MachineFacts
from bwstack.probe.hw.machine import Unknown

# Xids NVIDIA's catalogue (docs.nvidia.com/deploy/xid-errors) treats as hardware or driver failures that need
# a reset or service: double-bit ECC, micro-controller halt, ECC page retirement failure, NVLink error,
# fallen off the bus, uncontained ECC, GSP timeout/error, unrecovered ECC. Other Xids (application faults) warn.
FATAL_XIDS = {48, 62, 64, 74, 79, 95, 119, 120, 140}
P2P_CODES = {
    "CNS": "chipset not supported",
    "GNS": "GPU not supported",
    "TNS": "topology not supported",
    "NS": "not supported",
    "DR": "disabled by regkey",
    "U": "unknown",
}
OPEN_MODULE_FIX = (
    "install NVIDIA's open kernel modules of the same driver (e.g. nvidia-driver-580-open, or the .run "
    "installer with -m=kernel-open), remove the proprietary ones, reboot"
)


class Verdict(enum.Enum):
    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"
    UNKNOWN = "unknown"
    SKIP = "skip"


@dataclass(frozen=True)
class Finding:
    check: str
    verdict: Verdict
    detail: str
    fix: str = ""
    blocks_when_unknown: bool = True  # false for checks that can at worst warn

    @property
    def blocks(self) -> bool:
        """Whether this finding keeps the node from being accepted."""
        return self.verdict is Verdict.FAIL or (self.verdict is Verdict.UNKNOWN and self.blocks_when_unknown)


@dataclass(frozen=True)
class Want:
    """What the lock says the node must be: the profile's driver minimum and its hardware target."""

    profile: str
    cuda: str
    min_driver: str
    target: str
    gpu_name: str
    capability: str
    count: int
    memory_gb: int
    interconnect: str
    datacenter: bool
    pcie_generation: int
    pcie_width: int

    @classmethod
    def of(cls, profile, target) -> Want:  # (lockfile.Profile, lockfile.Target): untyped, this module is stdlib-only
        return cls(
            profile=profile.name,
            cuda=profile.cuda.version,
            min_driver=profile.cuda.min_driver,
            target=target.name,
            gpu_name=target.gpu_name,
            capability=target.capability,
            count=target.count,
            memory_gb=target.memory_gb,
            interconnect=target.interconnect,
            datacenter=target.datacenter,
            pcie_generation=target.pcie_generation,
            pcie_width=target.pcie_width,
        )

    def as_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: object) -> Want:
        if not isinstance(data, dict):
            raise ValueError("the target must be a JSON object")
        values = {}
        for f in fields(cls):
            if f.name not in data:
                raise ValueError(f"the target has no {f.name!r}")
            value, kind = data[f.name], {"int": int, "bool": bool}.get(str(f.type), str)
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)) or value in ("", None):
                raise ValueError(f"the target's {f.name!r} must be a non-empty {kind.__name__}, got {value!r}")
            values[f.name] = value
        return cls(**values)

    @property
    def blackwell_or_later(self) -> bool:
        """Capability 10.0 and up: NVIDIA drives these GPUs with the open kernel modules only."""
        return int(self.capability.split(".")[0]) >= 10


def version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text or ""))


def driver_meets(version: str, minimum: str) -> bool:
    """The one comparison of a driver version with a profile's minimum (preflight uses it too)."""
    return version_tuple(version) >= version_tuple(minimum)


def _unknown(check: str, why: str, *, can_fail: bool = True) -> Finding:
    return Finding(check, Verdict.UNKNOWN, why, blocks_when_unknown=can_fail)


def _label(gpu: GpuFacts) -> str:
    return f"GPU{gpu.smi.index} ({gpu.bdf})" if not isinstance(gpu.smi, Unknown) else gpu.bdf


def _gib(n: int) -> str:
    return f"{n / 2**30:.0f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


# ------------------------------------------------------------------------------------------------ checks


def _gpu_model(f: MachineFacts, want: Want) -> Finding:
    check = "gpu.model"
    if isinstance(f.gpus, Unknown):
        return _unknown(check, f"no GPU list: {f.gpus.why}")
    if not f.gpus:
        return Finding(check, Verdict.FAIL, "no NVIDIA GPU on this node", "seat the GPUs (and check their power)")
    if isinstance(f.smi, Unknown):
        names = sorted({g.lspci_name if isinstance(g.lspci_name, str) else str(g.pci_id) for g in f.gpus})
        return Finding(
            check,
            Verdict.FAIL,
            f"{len(f.gpus)} NVIDIA GPU(s) on the PCIe bus ({'; '.join(names)}) but the driver lists none: {f.smi.why}",
            "the driver did not initialise the GPUs: see driver.flavour and the kernel log (dmesg | grep NVRM)",
        )
    problems = []
    if len(f.smi) != want.count:
        problems.append(f"{len(f.smi)} GPUs, the target has {want.count}")
    wrong_name = sorted({g.name for g in f.smi if not g.name.startswith(want.gpu_name)})
    if wrong_name:
        problems.append(f"{', '.join(wrong_name)} is not {want.gpu_name}")
    wrong_cap = sorted({g.capability for g in f.smi if g.capability != want.capability})
    if wrong_cap:
        problems.append(f"capability {', '.join(wrong_cap)}, the target's is {want.capability}")
    missing = [g.bdf for g in f.gpus if isinstance(g.smi, Unknown)]
    if missing:
        problems.append(f"the driver does not list {', '.join(missing)}")
    names = Counter(g.name for g in f.smi)
    seen = "; ".join(f"{n} x {name}" for name, n in names.items())
    memory = sorted({g.memory_mib for g in f.smi})
    detail = f"{seen}, capability {', '.join(sorted({g.capability for g in f.smi}))}, {'/'.join(map(str, memory))} MiB"
    if problems:
        return Finding(
            check,
            Verdict.FAIL,
            f"{detail}: {'; '.join(problems)}",
            f"this node is not a {want.target} ({want.count} x {want.gpu_name}): use a profile whose target it is",
        )
    return Finding(check, Verdict.PASS, detail)


def _driver_flavour(f: MachineFacts, want: Want) -> Finding:
    check = "driver.flavour"
    d = f.driver
    needs_open = d.requires_open if isinstance(d.requires_open, tuple) else ()
    evidence = f"; the kernel log says {', '.join(needs_open)} requires the open kernel modules" if needs_open else ""
    if isinstance(d.loaded_flavour, Unknown):
        if needs_open:
            return Finding(check, Verdict.FAIL, f"the nvidia module is not running the GPUs{evidence}", OPEN_MODULE_FIX)
        return _unknown(check, d.loaded_flavour.why)
    installed = d.installed_license
    if d.loaded_flavour is DriverFlavour.PROPRIETARY:
        if want.blackwell_or_later:
            return Finding(
                check,
                Verdict.FAIL,
                f"the proprietary nvidia module is loaded; capability {want.capability} (Blackwell) runs only on the "
                f"open kernel modules (RmInitAdapter failed otherwise){evidence}",
                OPEN_MODULE_FIX,
            )
        return Finding(
            check,
            Verdict.PASS,
            f"proprietary module, supported for capability {want.capability} (open modules are required from "
            "Blackwell, capability 10.0, on)",
        )
    if isinstance(installed, str) and installed == "NVIDIA" and want.blackwell_or_later:
        return Finding(
            check,
            Verdict.WARN,
            "the open module is loaded, but the installed nvidia.ko (modinfo) is the proprietary one: the next boot "
            "loads it",
            OPEN_MODULE_FIX,
        )
    license_note = f" (installed module's license: {installed})" if isinstance(installed, str) else ""
    return Finding(check, Verdict.PASS, f"open kernel module loaded{license_note}")


def _driver_version(f: MachineFacts, want: Want) -> Finding:
    check = "driver.version"
    version = f.driver.loaded_version
    if isinstance(version, Unknown) and isinstance(f.smi, tuple):
        version = f.smi[0].driver
    if isinstance(version, Unknown):
        return _unknown(check, version.why)
    need = f"CUDA {want.cuda} (profile {want.profile}) needs >= {want.min_driver}"
    if not driver_meets(version, want.min_driver):
        return Finding(
            check,
            Verdict.FAIL,
            f"driver {version}; {need}",
            f"upgrade the NVIDIA driver to >= {want.min_driver} (R580 serves CUDA 12.8 and 13)",
        )
    installed = f.driver.installed_version
    if isinstance(installed, str) and installed != version:
        return Finding(
            check,
            Verdict.WARN,
            f"driver {version} is loaded but {installed} is installed; {need}",
            "reboot (or reload the nvidia modules) so that the loaded driver is the installed one",
        )
    return Finding(check, Verdict.PASS, f"driver {version}; {need}")


def _persistence(f: MachineFacts, want: Want) -> Finding:
    check = "driver.persistence"
    state = f.host.persistenced
    if state == "active":
        return Finding(check, Verdict.PASS, "nvidia-persistenced is active")
    fix = "systemctl enable --now nvidia-persistenced (nvidia-smi -pm 1 is the deprecated way)"
    modes = {g.persistence for g in f.smi} if isinstance(f.smi, tuple) else set()
    said = state if isinstance(state, str) else f"unknown ({state.why})"
    if modes == {"Enabled"}:
        return Finding(check, Verdict.WARN, f"persistence mode is on, but nvidia-persistenced is {said}", fix, False)
    if isinstance(state, Unknown) and not modes:
        return _unknown(check, f"nvidia-persistenced: {state.why}", can_fail=False)
    return Finding(
        check,
        Verdict.WARN,
        f"nvidia-persistenced is {said}: the driver tears GPU state down between programs",
        fix,
        False,
    )


def _fabric_manager(f: MachineFacts, want: Want) -> Finding:
    check = "driver.fabric_manager"
    state = f.host.fabricmanager
    if want.interconnect == "nvlink":
        if state == "active":
            return Finding(check, Verdict.PASS, "nvidia-fabricmanager is active (NVSwitch systems need it)")
        said = state if isinstance(state, str) else f"unknown ({state.why})"
        return Finding(
            check,
            Verdict.FAIL if isinstance(state, str) else Verdict.UNKNOWN,
            f"nvidia-fabricmanager is {said}; NVSwitch systems need it before CUDA can use the GPUs",
            "install the Fabric Manager of the same driver version and systemctl enable --now nvidia-fabricmanager",
        )
    if state == "active":
        return Finding(
            check,
            Verdict.WARN,
            "nvidia-fabricmanager runs on a PCIe node: it is for NVSwitch systems and is not needed here",
            "systemctl disable --now nvidia-fabricmanager",
            False,
        )
    if isinstance(state, Unknown):
        return _unknown(check, f"nvidia-fabricmanager: {state.why}", can_fail=False)
    return Finding(check, Verdict.PASS, f"nvidia-fabricmanager is {state} (not needed on PCIe)")


def _cuda_compat(f: MachineFacts, want: Want) -> Finding:
    check = "loader.cuda_compat"
    libs = f.host.libcuda
    if isinstance(libs, Unknown):
        return _unknown(check, f"where the loader finds libcuda: {libs.why}")
    compat = [p for p in libs if "/compat/" in p]
    conf = list(f.host.compat_conf)
    if not compat and not conf:
        return Finding(check, Verdict.PASS, f"libcuda.so.1 from {libs[0]} (the driver's)")
    where = compat[0] if compat else conf[0]
    via = f" (put there by {', '.join(c.split(':')[0] for c in conf)})" if conf else ""
    if want.datacenter:
        return Finding(
            check, Verdict.PASS, f"cuda-compat on the loader path: {where}{via} (supported on datacenter GPUs)"
        )
    return Finding(
        check,
        Verdict.FAIL,
        f"the loader finds libcuda.so.1 in cuda-compat: {where}{via}; cuda-compat is for datacenter GPUs, "
        f"{want.gpu_name} fails with CUDA error 804",
        f"remove cuda-compat from the loader path ({', '.join(c.split(':')[0] for c in conf) or 'ld.so.conf.d'}), "
        "run ldconfig, and uninstall the cuda-compat package",
    )


def _hmm(f: MachineFacts, want: Want) -> Finding:
    check = "uvm.hmm"
    value, configured = f.host.uvm_disable_hmm, f.host.uvm_hmm_configured
    fix = (
        "echo 'options nvidia_uvm uvm_disable_hmm=1' > /etc/modprobe.d/nvidia-uvm-hmm.conf, "
        "then reload nvidia_uvm or reboot"
    )
    if isinstance(value, str):
        if value in ("Y", "1"):
            return Finding(check, Verdict.PASS, "nvidia_uvm runs with HMM disabled (uvm_disable_hmm=Y)")
        pending = f"; {configured} disables it from the next load of nvidia_uvm" if isinstance(configured, str) else ""
        return Finding(
            check,
            Verdict.WARN,
            f"nvidia_uvm runs with HMM enabled (uvm_disable_hmm={value}){pending}",
            fix if not pending else "reload nvidia_uvm (or reboot)",
            False,
        )
    if isinstance(configured, str):
        return Finding(check, Verdict.PASS, f"{value.why}; {configured} disables HMM when it loads")
    return Finding(check, Verdict.WARN, f"{value.why}, and {configured.why}", fix, False)


def _each_gpu(f: MachineFacts) -> list[GpuFacts]:
    return list(f.gpus) if isinstance(f.gpus, tuple) else []


def _pcie_link(f: MachineFacts, want: Want) -> Finding:
    check = "pcie.link"
    if isinstance(f.gpus, Unknown) or not f.gpus:
        return _unknown(check, "no GPU to read a link of")
    failures, unknown, idle = [], [], []
    for g in f.gpus:
        link = g.link
        if isinstance(link, Unknown):
            unknown.append(f"{_label(g)}: {link.why}")
            continue
        problems, at_idle = _link_problems(g, link, want)
        if problems:
            failures.append(f"{_label(g)}: {'; '.join(problems)}")
        elif at_idle:
            idle.append(_label(g).split(" ")[0])
    if failures:
        return Finding(
            check,
            Verdict.FAIL,
            " | ".join(failures),
            "reseat the card, replace the riser/cable, and set the slot to Gen5 x16 in the BIOS (no bifurcation)",
        )
    if unknown:
        return _unknown(check, " | ".join(unknown))
    detail = f"{len(f.gpus)} GPUs on Gen{want.pcie_generation} x{want.pcie_width} links (card and port)"
    if idle:
        detail += (
            f"; at Gen1 now, as idle GPUs save power (the runtime part reads the link under load): {', '.join(idle)}"
        )
    return Finding(check, Verdict.PASS, detail)


def _link_problems(g: GpuFacts, link: Link, want: Want) -> tuple[list[str], bool]:
    """What is wrong with a GPU's link, and whether it is at Gen1 only because the GPU is idle."""
    problems = []
    if link.width < link.max_width:
        problems.append(f"x{link.width} of x{link.max_width}")
    elif link.max_width < want.pcie_width:
        problems.append(f"the card's link is x{link.max_width}, the target's x{want.pcie_width}")
    card_gen = link.max_generation or 0
    port = g.port_max_speed_gts
    port_gen = GENERATION_OF_SPEED.get(port, 0) if isinstance(port, float) else None
    capable = min(card_gen, port_gen) if port_gen else card_gen
    if card_gen < want.pcie_generation:
        problems.append(f"the card supports Gen{card_gen} only")
    elif port_gen is not None and port_gen < want.pcie_generation:
        problems.append(f"the port above it supports Gen{port_gen} only")
    now = link.generation or 0
    idle = False
    if now < capable:
        if now == 1:
            idle = True
        else:
            problems.append(f"trained at Gen{now} of Gen{capable}")
    return problems, idle


def _bar1(f: MachineFacts, want: Want) -> Finding:
    check = "pcie.bar1"
    gpus = _each_gpu(f)
    if not gpus:
        return _unknown(check, "no GPU to read BAR1 of", can_fail=False)
    small, unknown, sizes = [], [], set()
    for g in gpus:
        if isinstance(g.bar1_bytes, Unknown):
            unknown.append(f"{_label(g)}: {g.bar1_bytes.why}")
            continue
        vram = g.smi.memory_mib * 2**20 if not isinstance(g.smi, Unknown) else want.memory_gb * 2**30
        sizes.add(_gib(g.bar1_bytes))
        if g.bar1_bytes < vram:
            small.append(f"{_label(g)}: BAR1 {_gib(g.bar1_bytes)} < {_gib(vram)} VRAM")
    if small:
        return Finding(
            check,
            Verdict.WARN,
            " | ".join(small),
            "enable Above 4G Decoding and Resizable BAR in the BIOS so that BAR1 covers the VRAM",
            False,
        )
    if unknown:
        return _unknown(check, " | ".join(unknown), can_fail=False)
    return Finding(check, Verdict.PASS, f"BAR1 {', '.join(sorted(sizes))} on every GPU, at least its VRAM")


def _numa(f: MachineFacts, want: Want) -> Finding:
    check = "gpu.numa"
    gpus = _each_gpu(f)
    if not gpus:
        return _unknown(check, "no GPU to read the NUMA node of", can_fail=False)
    by_node: dict[str, list[str]] = {}
    for g in gpus:
        key = (
            "unknown"
            if isinstance(g.numa_node, Unknown)
            else ("none reported" if g.numa_node is None else f"node {g.numa_node}")
        )
        by_node.setdefault(key, []).append(_label(g).split(" ")[0])
    detail = "; ".join(f"{k}: {', '.join(v)}" for k, v in sorted(by_node.items()))
    online = f.host.numa_online
    multi = isinstance(online, str) and ("-" in online or "," in online)
    if "none reported" in by_node and multi:
        return Finding(
            check,
            Verdict.WARN,
            f"{detail} (this host has NUMA nodes {online})",
            "enable NUMA reporting (ACPI SRAT / NPS) in the BIOS so GPUs show their socket",
            False,
        )
    if "unknown" in by_node:
        return _unknown(check, detail, can_fail=False)
    return Finding(check, Verdict.PASS, detail)


def _iommu(f: MachineFacts, want: Want) -> Finding:
    check = "iommu"
    gpus = _each_gpu(f)
    units = f.host.iommu_units
    cmd = f.host.cmdline
    params = (
        [p for p in cmd if re.match(r"^(iommu|intel_iommu|amd_iommu|iommu\.\w+)=", p)] if isinstance(cmd, tuple) else []
    )
    said = f" (kernel: {' '.join(params)})" if params else ""
    groups: list[tuple[GpuFacts, IommuGroup]] = []
    unknown = []
    for g in gpus:
        if isinstance(g.iommu, Unknown):
            unknown.append(f"{_label(g)}: {g.iommu.why}")
        elif g.iommu is not None:
            groups.append((g, g.iommu))
    translating = [f"{_label(g)} ({grp.domain_type})" for g, grp in groups if grp.translating]
    vfio = [f"{_label(g)} ({grp.domain_type})" for g, grp in groups if grp.domain_type in ("blocked", "unmanaged")]
    if translating:
        return Finding(
            check,
            Verdict.FAIL,
            f"the IOMMU translates the DMA of {', '.join(translating)}{said}: peer traffic goes through it, and "
            "the first NCCL all-reduce can hang",
            "boot with iommu=pt (with amd_iommu=on or intel_iommu=on), or turn the IOMMU off in the BIOS",
        )
    if vfio:
        return Finding(
            check,
            Verdict.FAIL,
            f"{', '.join(vfio)} belong to VFIO (assigned to a virtual machine), not to the NVIDIA driver",
            "unbind the GPUs from vfio-pci and let the nvidia driver take them",
        )
    if unknown:
        return _unknown(check, " | ".join(unknown))
    if isinstance(units, Unknown):
        return _unknown(check, f"/sys/class/iommu: {units.why}")
    if groups:
        return Finding(check, Verdict.PASS, f"IOMMU on in pass-through (identity) for every GPU{said}")
    if isinstance(units, tuple) and units:
        return Finding(check, Verdict.PASS, f"IOMMU units {', '.join(units)} present, no GPU in an IOMMU group{said}")
    return Finding(check, Verdict.PASS, f"IOMMU off: no IOMMU unit, no GPU in an IOMMU group{said}")


def _peer_pairs(f: MachineFacts) -> list[tuple[GpuFacts, GpuFacts]]:
    """GPU pairs whose peer traffic crosses PCIe (pairs joined by NVLink are left out)."""
    gpus = _each_gpu(f)
    index = {g.smi.index: g for g in gpus if not isinstance(g.smi, Unknown)}
    nvlinked = set()
    if not isinstance(f.topology, Unknown):
        for a, b, cell in f.topology.pairs():
            if cell.startswith("NV") and a in index and b in index:
                nvlinked.add(frozenset((index[a].bdf, index[b].bdf)))
    return [(a, b) for i, a in enumerate(gpus) for b in gpus[i + 1 :] if frozenset((a.bdf, b.bdf)) not in nvlinked]


def _acs(f: MachineFacts, want: Want) -> Finding:
    check = "pcie.acs"
    gpus = _each_gpu(f)
    if len(gpus) < 2:
        return Finding(check, Verdict.SKIP, "fewer than two GPUs: no peer traffic")
    pairs = _peer_pairs(f)
    if not pairs:
        return Finding(check, Verdict.PASS, "every GPU pair is joined by NVLink; ACS affects only PCIe peer traffic")
    on_path: set[str] = set()
    for a, b in pairs:
        on_path |= set(a.bridges) ^ set(b.bridges)
    redirect, unknown, clean = [], [], 0
    for bdf in sorted(on_path):
        bridge = f.bridges.get(bdf)
        acs: Acs | Unknown | None = bridge.acs if bridge else Unknown("not read")
        if isinstance(acs, Unknown):
            unknown.append(f"{bdf}: {acs.why}")
        elif acs is not None and acs.redirecting:
            redirect.append(f"{bdf} ({', '.join(acs.redirecting)})")
        else:
            clean += 1
    if redirect:
        return Finding(
            check,
            Verdict.FAIL,
            f"ACS sends peer traffic up to the root complex on {len(redirect)} of the {len(on_path)} bridges between "
            f"GPUs: {', '.join(redirect)}",
            "turn ACS off for these bridges: in the BIOS (ACS / PCIe ACS control), or each boot with "
            "`setpci -s <bridge> ECAP_ACS+0x6.w=0000` (NCCL troubleshooting guide)",
        )
    if unknown:
        return _unknown(check, " | ".join(unknown))
    if not on_path:
        return _unknown(check, "sysfs shows no bridge between the GPUs")
    return Finding(check, Verdict.PASS, f"no ACS redirection on the {clean} bridges between GPUs")


def _p2p(f: MachineFacts, want: Want) -> Finding:
    check = "p2p.capability"
    if isinstance(f.p2p, Unknown):
        return _unknown(check, f"nvidia-smi topo -p2p r: {f.p2p.why}")
    pairs = f.p2p.pairs()
    if not pairs:
        return Finding(check, Verdict.SKIP, "one GPU: no peers")
    bad = [f"GPU{a}->GPU{b} {cell} ({P2P_CODES.get(cell, cell)})" for a, b, cell in pairs if cell != "OK"]
    if bad:
        return Finding(
            check,
            Verdict.FAIL,
            f"{len(bad)} of {len(pairs)} GPU pairs cannot read from each other: {', '.join(bad[:8])}"
            + (" ..." if len(bad) > 8 else ""),
            "CNS/TNS: the platform blocks P2P (check ACS, IOMMU and the BIOS's P2P settings); GNS: this GPU has none",
        )
    return Finding(
        check,
        Verdict.PASS,
        f"all {len(pairs)} GPU pairs report P2P read OK (not proof that P2P works: the runtime part measures it)",
    )


def _interconnect(f: MachineFacts, want: Want) -> Finding:
    check = "interconnect"
    nvlink = want.interconnect == "nvlink"
    if isinstance(f.topology, Unknown):
        return _unknown(check, f"nvidia-smi topo -m: {f.topology.why}", can_fail=nvlink)
    pairs = [(a, b, c) for a, b, c in f.topology.pairs() if a < b]
    if not pairs:
        return Finding(check, Verdict.SKIP, "one GPU: no GPU-to-GPU links")
    kinds = Counter("NV#" if c.startswith("NV") else c for _, _, c in pairs)
    # as nvidia-smi names them (NV18: 18 bonded links), counted in GPU pairs
    summary = ", ".join(f"{k}: {n} pair{'s' * (n > 1)}" for k, n in sorted(Counter(c for _, _, c in pairs).items()))
    if nvlink:
        missing = [f"GPU{a}-GPU{b} {c}" for a, b, c in pairs if not c.startswith("NV")]
        if missing:
            return Finding(
                check,
                Verdict.FAIL,
                f"pairs without NVLink: {', '.join(missing[:8])}",
                "check the NVLink/NVSwitch fabric (nvidia-smi nvlink -s) and the Fabric Manager",
            )
        return Finding(check, Verdict.PASS, f"every GPU pair on NVLink ({summary})")
    if kinds.get("NV#"):
        return Finding(
            check,
            Verdict.WARN,
            f"NVLink between GPUs ({summary}): the target {want.target} is PCIe-only, its envelopes do not apply",
            "use a target that describes this node",
            False,
        )
    return Finding(check, Verdict.PASS, f"PCIe only, as the target: {summary}")


def _aspm(f: MachineFacts, want: Want) -> Finding:
    check = "pcie.aspm"
    cmd = f.host.cmdline
    if isinstance(cmd, tuple) and "pcie_aspm=off" in cmd:
        return Finding(check, Verdict.PASS, "ASPM off (pcie_aspm=off on the kernel command line)")
    policy = f.host.aspm_policy
    if policy == "performance":
        return Finding(check, Verdict.PASS, "ASPM policy `performance`: link power states off")
    fix = "boot with pcie_aspm=off (and turn ASPM off in the BIOS): link power states cause PCIe link drops"
    if not _each_gpu(f):
        return _unknown(check, "no GPU link to read", can_fail=False)
    enabled, unknown = [], []
    for g in _each_gpu(f):
        states = [("GPU", g.aspm)]
        if g.bridges and g.bridges[-1] in f.bridges:
            states.append(("port", f.bridges[g.bridges[-1]].aspm))
        for side, state in states:
            if isinstance(state, Unknown):
                unknown.append(f"{_label(g)} {side}: {state.why}")
            elif state != "Disabled":
                enabled.append(f"{_label(g)} {side}: {state}")
    if enabled:
        return Finding(check, Verdict.WARN, f"ASPM on GPU links: {', '.join(enabled[:8])}", fix, False)
    if isinstance(policy, str) and policy in ("powersave", "powersupersave"):
        return Finding(check, Verdict.WARN, f"ASPM policy `{policy}`", fix, False)
    if unknown:
        return _unknown(check, " | ".join(unknown[:4]), can_fail=False)
    said = f"policy `{policy}`" if isinstance(policy, str) else f"policy unknown ({policy.why})"
    return Finding(check, Verdict.PASS, f"ASPM disabled on every GPU link ({said})")


def _xid(f: MachineFacts, want: Want) -> Finding:
    check = "kernel.xid"
    xids = f.driver.xids
    if isinstance(xids, Unknown):
        return _unknown(check, xids.why)
    if not xids:
        return Finding(check, Verdict.PASS, "no Xid errors since boot")
    counts = Counter((x.bdf, x.code) for x in xids)
    text = {(x.bdf, x.code): x.text for x in xids}
    listed = ", ".join(
        f"{bdf} Xid {code} x{n}" + (f" ({text[(bdf, code)][:50]})" if text[(bdf, code)] else "")
        for (bdf, code), n in sorted(counts.items())
    )
    fatal = any(code in FATAL_XIDS for _, code in counts)
    return Finding(
        check,
        Verdict.FAIL if fatal else Verdict.WARN,
        f"Xid errors since boot: {listed}",
        "look each Xid up in NVIDIA's Xid catalogue; 79 (fallen off the bus): reseat the card or riser and check "
        "its power; ECC Xids: reset the GPU, replace it if they recur",
        True,
    )


def _aer(f: MachineFacts, want: Want) -> Finding:
    check = "pcie.aer"
    gpus = _each_gpu(f)
    if not gpus:
        return _unknown(check, "no GPU to read AER counters of")
    devices = [(_label(g), g.aer) for g in gpus]
    devices += [(bdf, f.bridges[bdf].aer) for bdf in sorted(f.bridges)]
    uncorrectable, correctable, unknown = [], [], []
    for name, counters in devices:
        if isinstance(counters, Unknown):
            unknown.append(f"{name}: {counters.why}")
        elif counters.fatal or counters.nonfatal:
            uncorrectable.append(f"{name}: {counters.fatal} fatal, {counters.nonfatal} non-fatal")
        elif counters.correctable:
            correctable.append(f"{name}: {counters.correctable} correctable")
    fix = "reseat or replace the riser/cable and card of those links, check the slot; watch whether counts grow"
    if uncorrectable:
        return Finding(check, Verdict.FAIL, f"uncorrectable PCIe errors since boot: {', '.join(uncorrectable)}", fix)
    if unknown:
        return _unknown(check, " | ".join(unknown[:4]) + (" ..." if len(unknown) > 4 else ""))
    if correctable:
        return Finding(check, Verdict.WARN, f"correctable PCIe errors since boot: {', '.join(correctable)}", fix)
    return Finding(check, Verdict.PASS, f"no AER errors since boot on {len(gpus)} GPUs and {len(f.bridges)} bridges")


STATIC_CHECKS: tuple[Callable[[MachineFacts, Want], Finding], ...] = (
    _gpu_model,
    _driver_flavour,
    _driver_version,
    _persistence,
    _fabric_manager,
    _cuda_compat,
    _hmm,
    _pcie_link,
    _bar1,
    _numa,
    _iommu,
    _acs,
    _p2p,
    _interconnect,
    _aspm,
    _xid,
    _aer,
)
# What preflight refuses a node for (provisioning would be pointless); everything else it only warns about.
PREFLIGHT_REFUSES = ("driver.flavour",)
# What an all-reduce hang is usually caused by, among the static checks.
HANG_CAUSES = ("pcie.acs", "iommu", "p2p.capability")


def judge_static(facts: MachineFacts, want: Want) -> tuple[Finding, ...]:
    return tuple(check(facts, want) for check in STATIC_CHECKS)
