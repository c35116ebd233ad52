"""Preflight: is this node fit for the profile? Checked before anything is touched.

Standard library only: it also runs inside the probe zipapp that the Ansible preflight role ships, so the
checks are the same on the CLI and in the playbooks. Requirements come from the lock as a small dict
(`requirements_of(profile)`), so the node needs neither the lock nor bwstack installed.
"""

from __future__ import annotations

import glob
import json
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from bwstack.probe import interp
from bwstack.probe.hw.collect import collect
from bwstack.probe.hw.judge import PREFLIGHT_REFUSES, Verdict, Want, driver_meets, judge_static, version_tuple
from bwstack.probe.hw.machine import Machine

SUPPORTED_OS = ("Ubuntu 22.04", "Ubuntu 24.04", "Debian GNU/Linux 12", "Debian GNU/Linux 13")
PYTHON_SEARCH = ("/usr/bin/python{v}", "/usr/local/bin/python{v}", "~/.pyenv/versions/{v}.*/bin/python{v}")


def requirements_of(profile) -> dict:  # profile: bwstack.lock.model.Profile (kept untyped: stdlib-only module)
    return {
        "profile": profile.name,
        "target_capability": profile.expect.target_capability,
        "min_driver": profile.cuda.min_driver,
        "cuda": profile.cuda.version,
        "python": profile.python,
        "glibc_minor": profile.glibc_minor,
        "accept": Want.of(profile, profile.target).as_json(),
    }


def runs_as(python: str, version: str) -> bool:
    """Whether `python` starts and is `version` (pyenv shims exist for versions that are not selected)."""
    code, out, _err = interp.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], timeout=30)
    return code == 0 and out.strip() == version


def find_python(version: str) -> str | None:
    """An interpreter of `version` (e.g. "3.12"): python3.X on PATH, else the usual install places."""
    candidates = [shutil.which(f"python{version}")]
    for pattern in PYTHON_SEARCH:
        candidates += sorted(glob.glob(os.path.expanduser(pattern.format(v=version))), reverse=True)
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK) and runs_as(candidate, version):
            return candidate
    return None


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    waived: bool = False


@dataclass
class Report:
    profile: str
    checks: list[Check] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok or c.waived for c in self.checks)

    def refusal(self) -> str:
        bad = [c for c in self.checks if not c.ok and not c.waived]
        return "; ".join(f"{c.detail}" + (f" ({c.fix})" if c.fix else "") for c in bad)

    def as_dict(self) -> dict:
        return {
            "profile": self.profile,
            "ok": self.ok,
            "checks": [c.__dict__ for c in self.checks],
            "warnings": self.warnings,
            "refusal": self.refusal() if not self.ok else "",
            "report": self.render().splitlines(),
        }

    def render(self) -> str:
        lines = [f"preflight for profile {self.profile}:"]
        for c in self.checks:
            mark = "ok" if c.ok else ("WAIVED" if c.waived else "REFUSED")
            lines.append(f"  {mark:<7} {c.name}: {c.detail}" + (f" -> {c.fix}" if c.fix and not c.ok else ""))
        lines += [f"  WARNING {w}" for w in self.warnings]
        lines.append("  node is fit" if self.ok else f"  refused: {self.refusal()}")
        return "\n".join(lines)


def _gpus() -> tuple[list[dict], str | None, str]:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return [], None, "nvidia-smi not found (no NVIDIA driver)"
    try:
        out = subprocess.run(
            [smi, "--query-gpu=name,compute_cap,driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        return [], None, f"nvidia-smi failed: {exc}"
    if out.returncode != 0:
        return [], None, f"nvidia-smi failed: {(out.stderr or out.stdout).strip()[:200]}"
    gpus, driver = [], None
    for line in out.stdout.strip().splitlines():
        name, cap, drv = (p.strip() for p in line.split(","))
        gpus.append({"name": name, "capability": cap})
        driver = drv
    return gpus, driver, ""


def check(
    req: dict,
    *,
    root: str = "/",
    min_free_gb: float = 25.0,
    allow_no_gpu: bool = False,
    allow_other_gpu: bool = False,
    machine: Machine | None = None,
    reuse: str | None = None,
) -> Report:
    """`machine`: where the node's driver and PCIe facts are read (default: this machine). `reuse`: bwstack's
    plan says this run builds nothing (it reuses that generation), so the disk needs no margin for a build."""
    report = Report(req["profile"])
    want = req["target_capability"]
    gpus, driver, why = _gpus()
    if not gpus:
        report.checks.append(
            Check(
                "gpu",
                False,
                f"no NVIDIA GPU: {why}",
                "install the NVIDIA driver, or allow CPU-only targets",
                allow_no_gpu,
            )
        )
        if allow_no_gpu:
            report.warnings.append(
                "CPU-ONLY TARGET: no GPU/driver here; provisioning continues because CPU-only targets are allowed "
                "(containers, CI). Runtime checks will be skipped; nothing proves this node can serve."
            )
    else:
        caps = sorted({g["capability"] for g in gpus})
        names = ", ".join(sorted({g["name"] for g in gpus}))
        ok = caps == [want]
        report.checks.append(
            Check(
                "gpu",
                ok,
                f"{len(gpus)} x {names}, capability {', '.join(caps)}"
                + ("" if ok else f"; profile {req['profile']} targets capability {want}"),
                "" if ok else "use a profile built for this GPU, or allow other GPUs knowingly",
                waived=not ok and allow_other_gpu,
            )
        )
        if not ok and allow_other_gpu:
            report.warnings.append(f"OTHER GPU: capability {', '.join(caps)} is not the profile's {want}")
        drv_ok = driver_meets(driver or "", req["min_driver"])
        report.checks.append(
            Check(
                "driver",
                drv_ok,
                f"driver {driver}, CUDA {req['cuda']} needs >= {req['min_driver']}",
                "" if drv_ok else f"upgrade the NVIDIA driver to >= {req['min_driver']} (R580 serves CUDA 12.8 and 13)",
            )
        )
    path = Path(root)
    while not path.exists():
        path = path.parent
    free = shutil.disk_usage(path).free / 2**30
    if reuse:
        report.checks.append(
            Check("disk", True, f"{free:.1f} GiB free at {path}; no build needed (the plan reuses {reuse})")
        )
    else:
        report.checks.append(
            Check(
                "disk",
                free >= min_free_gb,
                f"{free:.1f} GiB free at {path} (need {min_free_gb:.0f} GiB for an env, its wheels and the uv cache)",
                "" if free >= min_free_gb else "free space, prune generations, or choose another root",
            )
        )
    os_name = _os_name()
    libc = platform.libc_ver()[1]
    glibc_ok = version_tuple(libc) >= (2, req["glibc_minor"])
    report.checks.append(
        Check("glibc", glibc_ok, f"glibc {libc or 'unknown'}; the wheels need >= 2.{req['glibc_minor']}",
              "" if glibc_ok else "use a newer OS (Ubuntu 22.04+)")
    )  # fmt: skip
    if not any(os_name.startswith(s) for s in SUPPORTED_OS):
        report.warnings.append(f"{os_name} is not a tested OS ({', '.join(SUPPORTED_OS)})")
    python = find_python(req["python"])
    report.checks.append(
        Check(
            "python",
            python is not None,
            f"Python {req['python']}: {python or 'not found'}",
            "" if python else f"install python{req['python']} and python{req['python']}-venv",
        )
    )
    _node_facts(report, Want.from_json(req.get("accept")), machine or Machine(), listed=bool(gpus))
    return report


# What the preflight checks above already decide for themselves (from nvidia-smi, as they always did).
_OWN_CHECKS = ("gpu.model", "driver.version")


def _node_facts(report: Report, want: Want, machine: Machine, *, listed: bool) -> None:
    """The static part of `bwstack accept` (the same readers and judge): refuse what makes provisioning
    pointless (PREFLIGHT_REFUSES), warn about the rest."""
    facts = collect(machine)
    if not listed and not (isinstance(facts.gpus, tuple) and facts.gpus):
        return  # no NVIDIA GPU at all: the gpu check above says so
    findings = [f for f in judge_static(facts, want) if f.check not in _OWN_CHECKS]
    for f in findings:
        if f.check in PREFLIGHT_REFUSES and f.verdict is Verdict.FAIL:
            report.checks.append(Check(f.check, False, f.detail, f.fix))
        elif f.verdict in (Verdict.FAIL, Verdict.WARN):
            report.warnings.append(f"{f.check}: {f.detail}" + (f" -> {f.fix}" if f.fix else ""))
    unknown = [f.check for f in findings if f.verdict is Verdict.UNKNOWN]
    if unknown:
        report.warnings.append(f"not read on this node: {', '.join(unknown)} (`bwstack accept` says why)")


def _os_name() -> str:
    from bwstack.probe import osrelease

    return osrelease.read().get("PRETTY_NAME") or platform.platform()


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="bwstack-probe preflight")
    parser.add_argument("--requirements", required=True, help="JSON from bwstack.probe.preflight.requirements_of")
    parser.add_argument("--root", default="/")
    parser.add_argument("--min-free-gb", type=float, default=25.0)
    parser.add_argument("--allow-no-gpu", action="store_true")
    parser.add_argument("--allow-other-gpu", action="store_true")
    parser.add_argument("--reuse", help="the generation bwstack's plan reuses (no build: no disk margin needed)")
    args = parser.parse_args(argv)
    try:
        requirements = json.loads(args.requirements)
        Want.from_json(requirements.get("accept") if isinstance(requirements, dict) else None)
    except ValueError as exc:
        print(f"bwstack-probe preflight: bad --requirements: {exc}", file=sys.stderr)
        return 2
    report = check(
        requirements,
        root=args.root,
        min_free_gb=args.min_free_gb,
        allow_no_gpu=args.allow_no_gpu,
        allow_other_gpu=args.allow_other_gpu,
        reuse=args.reuse or None,
    )
    print(json.dumps(report.as_dict()))
    return 0 if report.ok else 4
