"""On a GPU host: SGLang's choices with the real GPU equal the choices serve-plan simulates for that GPU.

Run from the repository root on the GPU host (no network there; the wheels in .whl/ travel with the call):

    python3 scripts/gpu/serve_plan_compare.py --wheels .whl --out "$OUT"

The wheels (38 MiB, cp312 manylinux x86_64 for the GPU host's Python 3.12; the versions are the cu128 lock's, the
ones SGLang 0.5.9 pins, where the host has other versions or none) are listed in serve_plan_compare.wheels.txt;
fetch them here with `python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12
--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform
manylinux2014_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux1_x86_64 -d .whl
-r scripts/gpu/serve_plan_compare.wheels.txt`.

What the host cannot run: SGLang 0.5.9 imports sgl_kernel unguarded when CUDA is present
(sglang/srt/layers/quantization/fp8_kernel.py:50, reached from ServerArgs.__post_init__ through
configs/model_config.py), and no sgl-kernel 0.3.21 build loads with the host's torch 2.11 (and the wheel is 510 MiB).
So on that host ServerArgs stops there in both runs alike; what is compared in full is the device as SGLang's own
probes see it (sglang/srt/utils/common.py: is_sm90_supported, is_sm100_supported, is_blackwell_supported,
is_hopper_with_cuda_12_3, get_device_sm, get_device_memory_capacity, ...), which every capability choice in
ServerArgs reads, and FlashInfer's compile targets.

It builds a throwaway env at /tmp/bwstack-plan-env: a venv of this python3 whose site-packages holds the carried
wheels (sglang 0.5.9 and what it needs that the host lacks or has at another version) and a .pth that adds this
interpreter's own import path (torch and the rest of the host's packages) behind them. Then it runs bwstack's
node side twice for every reference model at tensor parallel = the host's GPU count: once with the real device,
once with that device simulated (its capability, count, memory and name), and compares what SGLang decided step by
step. Exit 0 when every step is equal; the observations, the rendered plans and the comparison are written to
--out. sgl-kernel does not travel (hundreds of MB): the steps that need it are "not observed" in both runs alike,
which the comparison shows.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VOLATILE = {"log", "model_path", "speculative_draft_model_path"}  # texts and temporary paths differ, not decisions


def _stdlib(path: str) -> bool:
    """The interpreter's own library (always on its path): everything else is a package directory."""
    roots = [r for r in (sysconfig.get_path("stdlib"), sysconfig.get_path("platstdlib")) if r]
    inside = any(path == r or path.startswith(r + os.sep) for r in roots)
    return inside and "site-packages" not in path and "dist-packages" not in path


def make_env(path: Path, wheels: Path) -> Path:
    """The env both runs use; returns its site-packages."""
    venv.EnvBuilder(clear=True, with_pip=False, symlinks=True).create(path)
    site = Path(sysconfig.get_path("purelib", vars={"base": str(path), "platbase": str(path)}))
    if not site.is_dir():
        site = next(path.glob("lib/python3.*/site-packages"))
    files = sorted(str(p) for p in wheels.glob("*.whl"))
    if files:
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
               "--no-cache-dir", "--target", str(site), *files]  # fmt: skip
        subprocess.run(cmd, check=True)
    ours = {p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    skip = ours | {str(REPO), str(Path(__file__).resolve().parent)}
    host = [p for p in sys.path if p and Path(p).is_dir() and p not in skip and not _stdlib(p)]
    (site / "zz-host-packages.pth").write_text("".join(f"{p}\n" for p in dict.fromkeys(host)))
    return site


def _strip(value):
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


def differences(a, b, where: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b)):
            out += differences(a.get(key), b.get(key), f"{where}.{key}" if where else key)
        return out
    return (
        []
        if a == b
        else [f"{where}: real {json.dumps(a, default=str)[:300]} != simulated {json.dumps(b, default=str)[:300]}"]
    )


def _smi_memory() -> int | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    values = [int(float(v)) for v in out.split() if v.replace(".", "", 1).isdigit()]
    return min(values) if values else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheels", default=str(REPO / ".whl"), help="the carried wheels (default: .whl)")
    parser.add_argument("--out", required=True, help="where the results go")
    parser.add_argument("--env", default="/tmp/bwstack-plan-env")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = Path(args.env)
    site = make_env(env, Path(args.wheels))
    # bwstack's node side from this checkout, SGLang and its dependencies from the env just made
    sys.path[:0] = [str(REPO / "scripts"), str(site)]
    from bwstack.probe.serveplan import node, references
    from bwstack.serveplan import assemble, catalogue, render

    real = node.real_device(env, "nvlink")
    if real is None:
        print("no GPU visible to torch here: nothing to compare", file=sys.stderr)
        return 2
    # SGLang reads the memory from nvidia-smi (the smallest GPU): the simulated device answers the same
    memory = _smi_memory() or real.memory_mib
    simulated = node.Device(node.SIMULATED, real.capability, real.count, memory, real.name, "nvlink")
    requests = [
        {"id": name, "model": name, "tp": real.count}
        for name in references.reference_names()
        if not name.startswith("sglang-eagle3")
    ]
    requests.append(
        {
            "id": "llama-3.1-8b-instruct+eagle3",
            "model": "llama-3.1-8b-instruct",
            "tp": real.count,
            "speculative_algorithm": "EAGLE3",
            "draft": "sglang-eagle3-llama-3.1-8b-instruct",
        }
    )
    runs = {"real": node.run_inenv(env, real, requests), "simulated": node.run_inenv(env, simulated, requests)}
    (out / "observations.json").write_text(json.dumps(runs, indent=1, default=str))
    report = {"device": real.__dict__, "versions": runs["real"].get("versions"), "models": {}}
    views = [runs[k].get("sglang_device_view") for k in ("real", "simulated")]
    view_diff = differences(views[0], views[1])
    report["sglang_device_view"] = {"real": views[0], "simulated": views[1], "differences": view_diff}
    print(f"{'EQUAL' if not view_diff else 'DIFFERENT':9} the device as SGLang's probes see it: {json.dumps(views[0])}")
    for line in view_diff:
        print(f"          {line}")
    equal = not view_diff
    for index, request in enumerate(requests):
        pair = [(runs[k].get("observations") or [None] * len(requests))[index] for k in ("real", "simulated")]
        if runs["real"].get("error") or runs["simulated"].get("error"):
            diff = [f"run error: real {runs['real'].get('error')} / simulated {runs['simulated'].get('error')}"]
        else:
            diff = differences(_strip(pair[0]), _strip(pair[1]))
        steps = sorted((pair[0] or {}).get("steps", {}))
        observed = [s for s in steps if not (pair[0]["steps"][s] or {}).get("not_observed")]
        report["models"][request["id"]] = {"equal": not diff, "differences": diff, "observed_steps": observed}
        equal = equal and not diff
        for label, result in (("real", runs["real"]), ("simulated", runs["simulated"])):
            observation = {"device": {**(real if label == "real" else simulated).__dict__}, "requests": requests,
                           "inenv": result, "kernels": {}, "features": {}}  # fmt: skip
            text = render.render(assemble.plan_for(observation, index, catalogue.load()))
            (out / f"plan-{request['id']}-{label}.txt").write_text(text + "\n")
        mark = "EQUAL" if not diff else "DIFFERENT"
        print(f"{mark:9} {request['id']}: observed steps {', '.join(observed)}")
        for line in diff[:10]:
            print(f"          {line}")
    (out / "comparison.json").write_text(json.dumps(report, indent=1, default=str))
    print(f"{'all equal' if equal else 'DIFFERENCES'}: real {real.name} x{real.count} (capability {real.capability})"
          f" vs simulated; sglang {(runs['real'].get('versions') or {}).get('sglang')}")  # fmt: skip
    return 0 if equal else 1


if __name__ == "__main__":
    raise SystemExit(main())
