"""The acceptance report: a table for people, JSON for machines, and a one-line verdict."""

from __future__ import annotations

import dataclasses
import enum
import re
from dataclasses import dataclass
from typing import Any, TypedDict

from bwstack.accept.runtime import AllReduceRun, BenchRun
from bwstack.probe.hw.facts import GENERATION_OF_SPEED, MachineFacts, jsonable
from bwstack.probe.hw.judge import Finding, Verdict
from bwstack.probe.hw.machine import Unknown
from bwstack.terminal import one_line


class NodeVerdict(enum.Enum):
    ACCEPTED = "accepted"
    NOT_ACCEPTED = "not accepted"


class FindingJSON(TypedDict):
    check: str
    verdict: str
    detail: str
    fix: str
    blocks: bool


class RuntimeJSON(TypedDict):
    ran: bool
    note: str
    timeout_s: float
    bench: dict[str, Any] | None
    allreduce: dict[str, Any] | None


class ReportJSON(TypedDict):
    machine: str
    profile: str
    target: str
    verdict: str
    accepted: bool
    verdict_line: str
    findings: list[FindingJSON]
    runtime: RuntimeJSON
    facts: dict[str, Any]
    report: list[str]


@dataclass(frozen=True)
class AcceptReport:
    machine: str
    profile: str
    target: str
    static: tuple[Finding, ...]
    runtime: tuple[Finding, ...]
    runtime_note: str  # why the runtime part did not run ("" when it ran)
    timeout_s: float
    facts: MachineFacts
    bench: BenchRun | None = None
    allreduce: AllReduceRun | None = None

    @property
    def findings(self) -> tuple[Finding, ...]:
        return self.static + self.runtime

    @property
    def verdict(self) -> NodeVerdict:
        return NodeVerdict.NOT_ACCEPTED if any(f.blocks for f in self.findings) else NodeVerdict.ACCEPTED

    def verdict_line(self) -> str:
        def names(pick) -> str:
            return ", ".join(f.check for f in self.findings if pick(f))

        failed = names(lambda f: f.verdict is Verdict.FAIL)
        unknown = names(lambda f: f.verdict is Verdict.UNKNOWN and f.blocks)
        warned = names(lambda f: f.verdict is Verdict.WARN)
        scope = "" if not self.runtime_note else " (static facts only: the runtime part did not run)"
        if self.verdict is NodeVerdict.ACCEPTED:
            return f"ACCEPTED: {self.machine} for {self.target}{scope}" + (f"; warnings: {warned}" if warned else "")
        parts = [f"failed: {failed}" if failed else "", f"unknown: {unknown}" if unknown else ""]
        return f"NOT ACCEPTED: {self.machine} for {self.target}{scope}; " + "; ".join(p for p in parts if p)

    # -------------------------------------------------------------------------------------------- table

    def render(self) -> str:
        lines = [f"bwstack accept: {self.machine} against {self.target} (profile {self.profile})", ""]
        width = max(len(f.check) for f in self.findings) if self.findings else 10
        lines.append(f"{'CHECK':<{width}}  {'RESULT':<7}  DETAIL")
        for f in self.findings:
            lines.append(f"{f.check:<{width}}  {f.verdict.value:<7}  {one_line(f.detail)}")
            if f.fix and f.verdict is not Verdict.PASS:
                lines.append(f"{'':<{width}}  {'':<7}  fix: {one_line(f.fix)}")
        lines += ["", *self._gpu_table()]
        lines += ["", *self._runtime_lines()]
        lines += ["", self.verdict_line()]
        return "\n".join(lines)

    def _gpu_table(self) -> list[str]:
        gpus = self.facts.gpus
        if isinstance(gpus, Unknown):
            return [f"GPUs: unknown ({gpus.why})"]
        if not gpus:
            return ["GPUs: none"]
        rows = [("GPU", "BDF", "NAME", "LINK NOW / MAX", "PORT", "BAR1", "NUMA", "IOMMU", "AER c/nf/f")]
        for g in gpus:
            smi = g.smi
            name = smi.name if not isinstance(smi, Unknown) else _marketing(g.lspci_name)
            link = g.link
            if isinstance(link, Unknown):
                link_text = "?"
            else:
                now = GENERATION_OF_SPEED.get(link.speed_gts, "?")
                top = GENERATION_OF_SPEED.get(link.max_speed_gts, "?")
                link_text = f"Gen{now} x{link.width} / Gen{top} x{link.max_width}"
            port = g.port_max_speed_gts
            bar1 = g.bar1_bytes
            iommu = g.iommu
            aer = g.aer
            rows.append(
                (
                    str(smi.index) if not isinstance(smi, Unknown) else "-",
                    g.bdf,
                    name.removeprefix("NVIDIA "),
                    link_text,
                    f"Gen{GENERATION_OF_SPEED.get(port, '?')}" if isinstance(port, float) else "?",
                    f"{bar1 / 2**30:.0f} GiB" if isinstance(bar1, int) else "?",
                    "?" if isinstance(g.numa_node, Unknown) else ("-" if g.numa_node is None else str(g.numa_node)),
                    "?" if isinstance(iommu, Unknown) else ("off" if iommu is None else iommu.domain_type),
                    "?" if isinstance(aer, Unknown) else f"{aer.correctable}/{aer.nonfatal}/{aer.fatal}",
                )
            )
        return _columns(rows)

    def _runtime_lines(self) -> list[str]:
        if self.runtime_note:
            return [f"RUNTIME: {self.runtime_note}"]
        bench = self.bench.result if self.bench else None
        if bench is None:
            return ["RUNTIME: no figures (see gpu.runtime)"]
        lines = [f"RUNTIME (torch {bench.torch}, CUDA {bench.cuda}, timeout {self.timeout_s:g} s per stage)"]
        if not bench.devices:
            lines.append(f"no GPU measured: {bench.reason}")
        if bench.devices:
            rows = [("GPU", "NAME", "BF16 MATMUL TFLOP/s", "DEVICE COPY GB/s", "H2D GB/s", "LINK UNDER LOAD")]
            for d in bench.devices:
                link = d.get("link_under_load")
                link_text = (
                    f"Gen{GENERATION_OF_SPEED.get(link['speed_gts'], '?')} x{link['width']}" if link else "unreadable"
                )
                rows.append(
                    (
                        str(d["index"]),
                        str(d["name"]).removeprefix("NVIDIA "),
                        f"{d['matmul_tflops']:.0f}",
                        f"{d['memcpy_gbs']:.0f}",
                        f"{d['h2d_gbs']:.1f}",
                        link_text,
                    )
                )
            lines += _columns(rows)
        if bench.p2p:
            n = len(bench.devices)
            cell = {(int(p["src"]), int(p["dst"])): float(p["gbs"]) for p in bench.p2p}
            lines.append("P2P one-way GB/s (row -> column)")
            rows = [("", *[str(j) for j in range(n)])]
            rows += [(str(i), *["-" if i == j else f"{cell.get((i, j), 0):.1f}" for j in range(n)]) for i in range(n)]
            lines += _columns(rows)
        run = self.allreduce
        if run is not None:
            if run.result is None:
                lines.append(f"ALL-REDUCE: {run.failure()}")
            else:
                r = run.result
                if r.world < 2:
                    lines.append("ALL-REDUCE: 1 rank: NCCL set up, sum correct; no bus traffic (needs two GPUs)")
                    return lines
                lines.append(
                    f"ALL-REDUCE: {r.world} ranks, {r.bytes / 2**20:.0f} MiB each, {r.seconds * 1e3:.1f} ms: "
                    f"algbw {r.algbw_gbs:.1f} GB/s, busbw {r.busbw_gbs:.1f} GB/s"
                    + (f", via {', '.join(run.transports)}" if run.transports else "")
                )
        return lines

    # -------------------------------------------------------------------------------------------- JSON

    def as_json(self) -> ReportJSON:
        return {
            "machine": self.machine,
            "profile": self.profile,
            "target": self.target,
            "verdict": self.verdict.value,
            "accepted": self.verdict is NodeVerdict.ACCEPTED,
            "verdict_line": self.verdict_line(),
            "findings": [
                {"check": f.check, "verdict": f.verdict.value, "detail": f.detail, "fix": f.fix, "blocks": f.blocks}
                for f in self.findings
            ],
            "runtime": {
                "ran": not self.runtime_note,
                "note": self.runtime_note,
                "timeout_s": self.timeout_s,
                "bench": _plain(self.bench),
                "allreduce": _plain(self.allreduce),
            },
            "facts": jsonable(self.facts),
            "report": self.render().splitlines(),
        }


def _marketing(lspci_name: str | Unknown) -> str:
    """ "NVIDIA Corporation GB202GL [RTX PRO 6000 Blackwell Server Edition] (rev a1)" -> the bracketed name."""
    if isinstance(lspci_name, Unknown):
        return "?"
    found = re.search(r"\[([^\]]+)\]", lspci_name)
    return found.group(1) if found else lspci_name


def _plain(run: Any) -> dict[str, Any] | None:
    if run is None:
        return None
    data = jsonable(dataclasses.asdict(run))
    group = data.get("group") or {}
    group["logs"] = [log[-4000:] for log in group.get("logs", [])]  # the tail is what helps; whole logs are long
    return data


def _columns(rows: list[tuple[str, ...]]) -> list[str]:
    rows = [tuple(one_line(c) for c in r) for r in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
