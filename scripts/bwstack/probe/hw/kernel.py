"""The host side of a node: kernel command line, IOMMU, ASPM policy, NUMA, nvidia_uvm's HMM setting and
where the dynamic loader finds libcuda.

Node-side: standard library only. Formats read:
- /proc/cmdline: the boot parameters, space-separated (iommu=pt, intel_iommu=on, pcie_aspm=off, ...);
- /sys/class/iommu/: one entry per active IOMMU unit (dmar0 on Intel VT-d, ivhd0 on AMD-Vi);
- /sys/module/pcie_aspm/parameters/policy: "[default] performance powersave powersupersave", the active
  policy in brackets (Documentation/admin-guide/kernel-parameters.txt, pcie_aspm);
- /sys/module/nvidia_uvm/parameters/uvm_disable_hmm: "Y" or "N" (a bool module parameter, 0444);
- /etc/modprobe.d/*.conf (and /usr/lib, /lib, /run): "options nvidia_uvm uvm_disable_hmm=1";
- /sys/devices/system/node/online: "0" or "0-1";
- `ldconfig -p`: "\tlibcuda.so.1 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libcuda.so.1";
- /etc/ld.so.conf and /etc/ld.so.conf.d/*.conf: one directory per line (cuda-compat lives in
  /usr/local/cuda-X.Y/compat).
"""

from __future__ import annotations

import re

from bwstack.probe.hw.machine import Machine, Unknown, stdout_of

MODPROBE_DIRS = ("/etc/modprobe.d", "/run/modprobe.d", "/usr/lib/modprobe.d", "/lib/modprobe.d")
COMPAT_RE = re.compile(r"/cuda[^/\s]*/compat/?$")
HMM_OFF_RE = re.compile(r"^\s*options\s+nvidia[_-]uvm\s+.*\buvm_disable_hmm=(1|y|Y)\b", re.M)


def cmdline(m: Machine) -> tuple[str, ...] | Unknown:
    text = m.read("/proc/cmdline")
    return text if isinstance(text, Unknown) else tuple(text.split())


def iommu_units(m: Machine) -> tuple[str, ...] | Unknown:
    names = m.listdir("/sys/class/iommu")
    if isinstance(names, Unknown):
        # No IOMMU driver registered a unit; on a kernel that has the class it is an empty directory.
        return () if "does not exist" in names.why else names
    return tuple(names)


def aspm_policy(m: Machine) -> str | Unknown:
    text = m.read("/sys/module/pcie_aspm/parameters/policy")
    if isinstance(text, Unknown):
        return text
    active = re.search(r"\[(\w+)\]", text)
    return active.group(1) if active else Unknown(f"no [active] policy in {text.strip()!r}")


def numa_online(m: Machine) -> str | Unknown:
    text = m.read("/sys/devices/system/node/online")
    return text.strip() if isinstance(text, str) else text


def uvm_disable_hmm(m: Machine) -> str | Unknown:
    text = m.read("/sys/module/nvidia_uvm/parameters/uvm_disable_hmm")
    if isinstance(text, Unknown):
        if not m.exists("/sys/module/nvidia_uvm"):
            return Unknown("nvidia_uvm is not loaded (it loads with the first CUDA program)")
        return text
    return text.strip()


def uvm_hmm_configured(m: Machine) -> str | Unknown:
    """The modprobe.d file that sets uvm_disable_hmm=1 for the next load of nvidia_uvm."""
    for folder in MODPROBE_DIRS:
        names = m.listdir(folder)
        if isinstance(names, Unknown):
            continue
        for name in names:
            if not name.endswith(".conf"):
                continue
            text = m.read(f"{folder}/{name}")
            if isinstance(text, str) and HMM_OFF_RE.search(text):
                return f"{folder}/{name}"
    return Unknown("no modprobe.d file sets `options nvidia_uvm uvm_disable_hmm=1`")


def libcuda(m: Machine) -> tuple[str, ...] | Unknown:
    text = stdout_of(m.run("ldconfig"))
    if isinstance(text, Unknown):
        return text
    paths = tuple(found.group(1) for found in re.finditer(r"^\s*libcuda\.so\.1 \([^)]*\) => (\S+)\s*$", text, re.M))
    return paths if paths else Unknown("the loader cache has no libcuda.so.1 (no NVIDIA user-space driver)")


def compat_conf(m: Machine) -> tuple[str, ...]:
    """ld.so.conf files that list a cuda-compat directory, as "file: directory"."""
    files = ["/etc/ld.so.conf"]
    names = m.listdir("/etc/ld.so.conf.d")
    if isinstance(names, list):
        files += [f"/etc/ld.so.conf.d/{n}" for n in names if n.endswith(".conf")]
    found = []
    for path in files:
        text = m.read(path)
        if isinstance(text, Unknown):
            continue
        for line in text.splitlines():
            entry = line.split("#", 1)[0].strip()
            if entry and COMPAT_RE.search(entry):
                found.append(f"{path}: {entry}")
    return tuple(found)
