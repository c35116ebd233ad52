"""Read every static fact acceptance judges, from one machine (live or recorded).

Node-side: standard library only. The GPUs are the NVIDIA display/3D functions sysfs lists (present even
when the driver cannot drive them); nvidia-smi adds what only the driver knows. Where sysfs has no PCI tree
(some sandboxes), the GPUs are those nvidia-smi lists and their PCIe facts are unknown, saying why.
"""

from __future__ import annotations

from bwstack.probe.hw import driver, kernel, pcie
from bwstack.probe.hw.facts import BridgeFacts, DriverFacts, GpuFacts, HostFacts, MachineFacts, SmiGpu
from bwstack.probe.hw.machine import Machine, Unknown


def _smi_for(smi: tuple[SmiGpu, ...] | Unknown, bdf: str) -> SmiGpu | Unknown:
    if isinstance(smi, Unknown):
        return Unknown(f"nvidia-smi: {smi.why}")
    found = next((g for g in smi if g.bdf == bdf), None)
    return found or Unknown("nvidia-smi does not list this GPU")


def _pci_id(node: pcie.PciNode) -> str | Unknown:
    for part in (node.vendor, node.device):
        if isinstance(part, Unknown):
            return part
    return f"{str(node.vendor).removeprefix('0x')}:{str(node.device).removeprefix('0x')}"


def collect(m: Machine) -> MachineFacts:
    nodes = pcie.tree(m)
    entries = pcie.lspci(m)
    smi = driver.smi_gpus(m)
    gpus: list[GpuFacts] = []
    bridges: dict[str, BridgeFacts] = {}
    if isinstance(nodes, dict):
        for node in sorted((n for n in nodes.values() if n.is_nvidia_gpu), key=lambda n: n.bdf):
            above = node.chain[:-1]
            port = nodes.get(above[-1]) if above else None
            gpus.append(
                GpuFacts(
                    bdf=node.bdf,
                    pci_id=_pci_id(node),
                    lspci_name=pcie.name_of(entries, node.bdf),
                    smi=_smi_for(smi, node.bdf),
                    link=pcie.link(m, node.path),
                    port_max_speed_gts=pcie.max_speed(m, port.path)
                    if port
                    else Unknown("no bridge above the GPU in sysfs"),
                    numa_node=pcie.numa_node(m, node.path),
                    bar1_bytes=pcie.bar1_bytes(m, node.path),
                    iommu=pcie.iommu_group(m, node.path),
                    aspm=pcie.aspm_of(entries, node.bdf),
                    aer=pcie.aer(m, node.path),
                    bridges=above,
                )
            )
            for bdf in above:
                if bdf not in bridges and bdf in nodes:
                    bridges[bdf] = pcie.bridge(m, nodes[bdf], entries)
    elif isinstance(smi, tuple):
        why = Unknown(f"sysfs: {nodes.why}")
        for g in smi:
            gpus.append(GpuFacts(g.bdf, why, pcie.name_of(entries, g.bdf), g, why, why, why, why, why, why, why, ()))
    gpu_facts: tuple[GpuFacts, ...] | Unknown = tuple(gpus)
    if isinstance(nodes, Unknown) and isinstance(smi, Unknown):
        gpu_facts = Unknown(f"{nodes.why}; nvidia-smi: {smi.why}")
    loaded_version, loaded_flavour = driver.loaded(m)
    license_, installed_version = driver.installed(m)
    xids, requires_open = driver.kernel_log(m)
    return MachineFacts(
        label=m.label,
        gpus=gpu_facts,
        bridges=bridges,
        smi=smi,
        topology=driver.matrix(m, "nvidia-smi-topo"),
        p2p=driver.matrix(m, "nvidia-smi-p2p"),
        driver=DriverFacts(loaded_version, loaded_flavour, license_, installed_version, requires_open, xids),
        host=HostFacts(
            cmdline=kernel.cmdline(m),
            iommu_units=kernel.iommu_units(m),
            aspm_policy=kernel.aspm_policy(m),
            uvm_disable_hmm=kernel.uvm_disable_hmm(m),
            uvm_hmm_configured=kernel.uvm_hmm_configured(m),
            numa_online=kernel.numa_online(m),
            libcuda=kernel.libcuda(m),
            compat_conf=kernel.compat_conf(m),
            persistenced=driver.service(m, "persistenced"),
            fabricmanager=driver.service(m, "fabricmanager"),
        ),
    )
