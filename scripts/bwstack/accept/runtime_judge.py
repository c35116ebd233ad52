"""Judge the runtime figures against the target's envelope from the lock; a hung all-reduce is a failure
that names the usual causes the static facts show."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

from bwstack.accept.runtime import AllReduceRun, BenchRun, Status
from bwstack.lock.model import Envelope, Figure
from bwstack.probe.hw.facts import GENERATION_OF_SPEED, MachineFacts
from bwstack.probe.hw.judge import HANG_CAUSES, Finding, Verdict, Want
from bwstack.probe.hw.machine import Unknown


def _against(figure: Figure, value: float) -> Verdict:
    if value < figure.fail_below:
        return Verdict.FAIL
    if value < figure.warn_below:
        return Verdict.WARN
    return Verdict.PASS


def _envelope_says(figure: Figure) -> str:
    low, high = figure.typical
    return f"fail < {figure.fail_below:g}, warn < {figure.warn_below:g}, typical {low:g}-{high:g} {figure.unit}"


def _worst(verdicts: Sequence[Verdict]) -> Verdict:
    for v in (Verdict.FAIL, Verdict.UNKNOWN, Verdict.WARN):
        if v in verdicts:
            return v
    return Verdict.PASS


def _no_envelope(check: str, want: Want, figures: str) -> Finding:
    return Finding(check, Verdict.UNKNOWN, f"{figures}; the lock has no envelope for target {want.target} to judge by")


def _spread(check: str, what: str, key: str, devices: Sequence[Mapping], envelope: Envelope | None, want: Want):
    values = {int(d["index"]): float(d[key]) for d in devices}
    shown = ", ".join(f"GPU{i} {v:.0f}" for i, v in sorted(values.items()))
    if envelope is None:
        return _no_envelope(check, want, f"{what}: {shown}")
    median = statistics.median(values.values())
    figure = envelope.gpu_spread
    verdicts = {i: _against(figure, v / median) for i, v in values.items()}
    worst = _worst(list(verdicts.values()))
    low = [
        f"GPU{i} at {values[i] / median:.0%} of the median"
        for i, v in sorted(verdicts.items())
        if v is not Verdict.PASS
    ]
    detail = f"{what}: {shown}" + (f"; {', '.join(low)} ({_envelope_says(figure)})" if low else "")
    fix = "check that card's power limit, clocks and temperature (nvidia-smi -q -d POWER,CLOCK,TEMPERATURE)"
    return Finding(check, worst, detail, fix if worst is not Verdict.PASS else "")


def judge_runtime(
    bench: BenchRun,
    allreduce: AllReduceRun | None,
    envelope: Envelope | None,
    facts: MachineFacts,
    static: Sequence[Finding],
    want: Want,
) -> tuple[Finding, ...]:
    findings: list[Finding] = []
    if bench.result is None:
        findings.append(
            Finding("gpu.runtime", Verdict.FAIL, bench.failure(), "run the env's torch on this node by hand")
        )
        return tuple(findings)
    devices = bench.result.devices
    if not devices:
        findings.append(
            Finding(
                "gpu.runtime",
                Verdict.UNKNOWN,
                f"{bench.result.reason or 'no GPU'} (torch {bench.result.torch}): nothing measured",
            )
        )
        return tuple(findings)
    broken = [f"GPU{d['index']}" for d in devices if not d.get("matmul_finite")]
    if broken:
        findings.append(
            Finding("gpu.matmul", Verdict.FAIL, f"non-finite matmul results on {', '.join(broken)}", "replace the GPU")
        )
    else:
        findings.append(_spread("gpu.matmul", "bf16 matmul TFLOP/s", "matmul_tflops", devices, envelope, want))
    findings.append(_spread("gpu.memory_bandwidth", "device copy GB/s", "memcpy_gbs", devices, envelope, want))
    findings.append(_link_under_load(devices))
    findings.append(_p2p_bandwidth(bench, envelope, facts, want))
    if allreduce is not None:
        findings += _allreduce(allreduce, envelope, static, want)
    return tuple(findings)


def _link_under_load(devices: Sequence[Mapping]) -> Finding:
    check = "pcie.link_under_load"
    fails, unknown, good = [], [], []
    for d in devices:
        link, label = d.get("link_under_load"), f"GPU{d['index']}"
        if not link:
            unknown.append(label)
            continue
        gen, max_gen = GENERATION_OF_SPEED.get(link["speed_gts"]), GENERATION_OF_SPEED.get(link["max_speed_gts"])
        h2d = f"{d['h2d_gbs']:.0f} GB/s host-to-device"
        if (gen or 0) < (max_gen or 0) or link["width"] < link["max_width"]:
            fails.append(f"{label} at Gen{gen} x{link['width']} of Gen{max_gen} x{link['max_width']} ({h2d})")
        else:
            good.append(f"{label} Gen{gen} x{link['width']} ({h2d})")
    if fails:
        return Finding(
            check,
            Verdict.FAIL,
            f"under load: {', '.join(fails)}",
            "reseat the card, replace the riser/cable, and set the slot to its full generation in the BIOS",
        )
    if unknown:
        return Finding(
            check,
            Verdict.UNKNOWN,
            f"the link of {', '.join(unknown)} could not be read from sysfs while copying"
            + (f"; {', '.join(good)}" if good else ""),
            blocks_when_unknown=False,
        )
    return Finding(check, Verdict.PASS, f"under load: {', '.join(good)}")


def _numa_by_bdf(facts: MachineFacts) -> dict[str, int]:
    if isinstance(facts.gpus, Unknown):
        return {}
    return {g.bdf: g.numa_node for g in facts.gpus if isinstance(g.numa_node, int)}


def _p2p_bandwidth(bench: BenchRun, envelope: Envelope | None, facts: MachineFacts, want: Want) -> Finding:
    check = "p2p.bandwidth"
    assert bench.result is not None
    pairs = bench.result.p2p
    if not pairs:
        return Finding(check, Verdict.SKIP, "one GPU: no peers")
    bdf = {int(d["index"]): d.get("bdf") for d in bench.result.devices}
    numa = _numa_by_bdf(facts)
    rows, verdicts, notes = [], [], set()
    for p in pairs:
        a, b = int(p["src"]), int(p["dst"])
        na, nb = numa.get(bdf.get(a) or ""), numa.get(bdf.get(b) or "")
        same = na is not None and na == nb
        if na is None or nb is None:
            notes.add("NUMA node unknown for some GPUs: judged against the cross-NUMA envelope")
        text = f"{a}->{b} {p['gbs']:.1f}" + ("" if p.get("can_access_peer") else " (no peer access)")
        if envelope is not None:
            verdict = _against(envelope.p2p_same_numa if same else envelope.p2p_cross_numa, float(p["gbs"]))
            if want.interconnect == "pcie" and not p.get("can_access_peer"):
                verdict = Verdict.FAIL
            verdicts.append(verdict)
            if verdict is not Verdict.PASS:
                rows.append(text + f" [{verdict.value}, {'same' if same else 'cross'} NUMA]")
        else:
            rows.append(text)
    summary = f"{len(pairs)} GPU pairs, one-way GB/s {min(float(p['gbs']) for p in pairs):.1f}-"
    summary += f"{max(float(p['gbs']) for p in pairs):.1f}"
    if envelope is None:
        return _no_envelope(check, want, f"{summary}: {', '.join(rows)}")
    worst = _worst(verdicts)
    envelopes = (
        f"same NUMA {_envelope_says(envelope.p2p_same_numa)}; cross NUMA {_envelope_says(envelope.p2p_cross_numa)}"
    )
    detail = summary + (f"; below the envelope: {', '.join(rows[:12])}" if rows else "") + f" ({envelopes})"
    if notes:
        detail += "; " + "; ".join(sorted(notes))
    fix = (
        "slow or missing peer access: turn ACS off on the bridges between the GPUs and set the IOMMU to "
        "pass-through or off (see pcie.acs and iommu); check each slow pair's links"
    )
    return Finding(check, worst, detail, fix if worst is not Verdict.PASS else "")


def _hang_causes(static: Sequence[Finding]) -> str:
    found = [f"{f.check}: {f.detail}" for f in static if f.check in HANG_CAUSES and f.verdict is not Verdict.PASS]
    if found:
        return "usual causes found in the static facts: " + " | ".join(d[:300] for d in found)
    return (
        "the static facts show none of the usual causes (ACS, IOMMU, P2P capability): retry with NCCL_P2P_DISABLE=1 "
        "to see whether peer-to-peer is what hangs"
    )


def _allreduce(run: AllReduceRun, envelope: Envelope | None, static: Sequence[Finding], want: Want) -> list[Finding]:
    findings = []
    if run.result is None:
        detail = run.failure()
        if run.group.status is Status.TIMEOUT:
            detail += "; " + _hang_causes(static)
        findings.append(
            Finding(
                "nccl.allreduce",
                Verdict.FAIL,
                detail,
                "fix what pcie.acs, iommu and p2p.capability report; NCCL_DEBUG=INFO shows where it stops",
            )
        )
        return findings
    r = run.result
    what = f"{r.world} ranks ({r.backend}{' ' + r.nccl if r.nccl else ''}), {r.bytes / 2**20:.0f} MiB each"
    if not r.correct:
        findings.append(
            Finding(
                "nccl.allreduce",
                Verdict.FAIL,
                f"{what}: wrong sums",
                "peer-to-peer corrupts data: see pcie.acs and iommu",
            )
        )
    elif r.world < 2:
        # One rank copies nothing between GPUs: its time and "bandwidth" say nothing about the fabric.
        findings.append(
            Finding("nccl.allreduce", Verdict.PASS, f"{what}: NCCL set up, sum correct (one rank: no peer traffic)")
        )
    else:
        findings.append(
            Finding(
                "nccl.allreduce",
                Verdict.PASS,
                f"{what}: completed, sums correct, {r.seconds * 1e3:.1f} ms per all-reduce",
            )
        )
    figures = f"busbw {r.busbw_gbs:.1f} GB/s (algbw {r.algbw_gbs:.1f} GB/s x 2(n-1)/n, n={r.world})"
    if r.world < 2:
        findings.append(Finding("nccl.busbw", Verdict.SKIP, "one rank: no bus traffic to measure (needs two GPUs)"))
    elif envelope is None:
        findings.append(_no_envelope("nccl.busbw", want, figures))
    else:
        figure = envelope.allreduce_busbw
        verdict = _against(figure, r.busbw_gbs)
        detail = f"{figures} ({_envelope_says(figure)})"
        if r.world != want.count:
            findings.append(
                Finding(
                    "nccl.busbw",
                    Verdict.WARN,
                    f"{detail}; the envelope is for {want.count} GPUs, this ran over {r.world}: not comparable",
                    "run on a node with the target's GPU count",
                    False,
                )
            )
        else:
            fix = "see p2p.bandwidth and nccl.transport; a slow pair slows every ring through it"
            findings.append(Finding("nccl.busbw", verdict, detail, fix if verdict is not Verdict.PASS else ""))
    if r.world >= 2:
        findings.append(_transport(run, want))
    return findings


def _transport(run: AllReduceRun, want: Want) -> Finding:
    check = "nccl.transport"
    if not run.transports:
        return Finding(
            check,
            Verdict.UNKNOWN,
            "NCCL's log names no transport (NCCL_DEBUG=INFO channel lines missing)",
            blocks_when_unknown=False,
        )
    said = ", ".join(run.transports)
    if any(t.startswith("P2P") for t in run.transports):
        return Finding(check, Verdict.PASS, f"NCCL moves data via {said}")
    return Finding(
        check,
        Verdict.WARN,
        f"NCCL moves data via {said}, not peer-to-peer: GPU memory is staged through the host",
        "peer access is blocked: see pcie.acs, iommu and p2p.capability",
        False,
    )
