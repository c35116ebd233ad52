"""What `bwstack accept` runs in the env's Python to measure the GPUs. Standard library and torch only: it
never imports bwstack (the env does not have it), and it is run as a file.

  gpu_worker.py bench --out FILE            per GPU a bf16 matmul, a device memory copy, a host-to-device
                                            copy (the link is read from sysfs while it runs), then the
                                            device-to-device copy bandwidth of every GPU pair
  gpu_worker.py rank --rank R --world W --backend nccl|gloo --store DIR --out FILE --mib M --iters K
                                            one rank of an all-reduce over W processes (rank 0 writes FILE);
                                            --hang: this rank joins the group but never the collective

Each writes one JSON document to --out and exits 0 when it could measure; a failure is an exception whose
traceback goes to stderr (the parent keeps the tail). The parent sets the environment (NVLink multicast
off, PCI bus order) and the hard timeout.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time


def _write(path: str, payload: dict) -> None:
    tmp = path + ".part"
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(payload, handle)
    os.replace(tmp, path)


def _bdf(props) -> str | None:
    parts = [getattr(props, name, None) for name in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    if any(p is None for p in parts):
        return None
    return f"{parts[0]:04x}:{parts[1]:02x}:{parts[2]:02x}.0"


def _sysfs_link(bdf: str | None) -> dict | None:
    if bdf is None:
        return None
    base = f"/sys/bus/pci/devices/{bdf}"
    try:
        with open(f"{base}/current_link_speed") as s, open(f"{base}/current_link_width") as w:
            speed, width = s.read().split()[0], int(w.read().strip())
        with open(f"{base}/max_link_speed") as s, open(f"{base}/max_link_width") as w:
            max_speed, max_width = s.read().split()[0], int(w.read().strip())
    except (OSError, ValueError, IndexError):
        return None
    return {"speed_gts": float(speed), "width": width, "max_speed_gts": float(max_speed), "max_width": max_width}


def _time_cuda(torch, device, fn, iters: int, during=None) -> tuple[float, object]:
    """Seconds per call of `fn` on `device`, timed with CUDA events; `during` runs while the GPU is busy."""
    with torch.cuda.device(device):
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        seen = during() if during else None
        end.synchronize()
        return start.elapsed_time(end) / 1000 / iters, seen


def bench(args: argparse.Namespace) -> int:
    import torch

    result: dict = {"torch": torch.__version__, "cuda": torch.version.cuda, "devices": [], "p2p": []}
    if not torch.cuda.is_available():
        result["reason"] = "torch sees no CUDA GPU (torch.cuda.is_available() is False)"
        _write(args.out, result)
        return 0
    count = torch.cuda.device_count()
    n = args.matmul
    for i in range(count):
        props = torch.cuda.get_device_properties(i)
        bdf = _bdf(props)
        device = torch.device("cuda", i)
        a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        out = torch.empty(n, n, device=device, dtype=torch.bfloat16)
        seconds, _ = _time_cuda(torch, device, lambda a=a, b=b, out=out: torch.matmul(a, b, out=out), 20)
        finite = bool(torch.isfinite(out).all().item())
        size = args.copy_mib * 2**20
        src = torch.empty(size, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        copy_s, _ = _time_cuda(torch, device, lambda s=src, d=dst: d.copy_(s), 10)
        host = torch.empty(size, dtype=torch.uint8).pin_memory()
        h2d_s, link = _time_cuda(
            torch, device, lambda h=host, d=dst: d.copy_(h, non_blocking=True), 10, lambda b=bdf: _sysfs_link(b)
        )
        result["devices"].append(
            {
                "index": i,
                "name": props.name,
                "bdf": bdf,
                "capability": f"{props.major}.{props.minor}",
                "memory_bytes": props.total_memory,
                "matmul_tflops": 2 * n**3 / seconds / 1e12,
                "matmul_finite": finite,
                "memcpy_gbs": 2 * size / copy_s / 1e9,  # read + write
                "h2d_gbs": size / h2d_s / 1e9,
                "link_under_load": link,
            }
        )
        del a, b, out, src, dst, host
        torch.cuda.empty_cache()
    size = args.p2p_mib * 2**20
    for i in range(count):
        for j in range(count):
            if i == j:
                continue
            src = torch.empty(size, dtype=torch.uint8, device=f"cuda:{i}")
            dst = torch.empty(size, dtype=torch.uint8, device=f"cuda:{j}")
            dst.copy_(src)
            torch.cuda.synchronize(i)
            torch.cuda.synchronize(j)
            times = []
            for _ in range(5):
                started = time.perf_counter()
                dst.copy_(src, non_blocking=True)
                torch.cuda.synchronize(j)
                torch.cuda.synchronize(i)
                times.append(time.perf_counter() - started)
            result["p2p"].append(
                {
                    "src": i,
                    "dst": j,
                    "can_access_peer": bool(torch.cuda.can_device_access_peer(i, j)),
                    "gbs": size / statistics.median(times) / 1e9,
                }
            )
            del src, dst
    _write(args.out, result)
    return 0


def rank(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    if args.backend == "nccl":
        torch.cuda.set_device(args.rank)
        device = torch.device("cuda", args.rank)
    else:
        device = torch.device("cpu")
    # The watchdog's own timeout is far beyond the parent's hard timeout: the parent decides when it hangs.
    dist.init_process_group(
        args.backend,
        init_method=f"file://{os.path.join(args.store, 'rendezvous')}",
        rank=args.rank,
        world_size=args.world,
        timeout=datetime.timedelta(hours=2),
    )
    if args.hang:
        print(f"rank {args.rank}: joined the group, never joining the collective (fault injection)", flush=True)
        while True:
            time.sleep(3600)
    numel = args.mib * 2**20 // 4
    x = torch.full((numel,), float(args.rank + 1), dtype=torch.float32, device=device)
    dist.all_reduce(x)
    expected = args.world * (args.world + 1) / 2
    correct = bool((x == expected).all().item())
    y = torch.zeros(numel, dtype=torch.float32, device=device)
    dist.all_reduce(y)
    if args.backend == "nccl":
        torch.cuda.synchronize()
    dist.barrier()
    started = time.perf_counter()
    for _ in range(args.iters):
        dist.all_reduce(y)
    if args.backend == "nccl":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - started) / args.iters
    dist.barrier()
    dist.destroy_process_group()
    if args.rank == 0:
        size = numel * 4
        algbw = size / seconds / 1e9
        _write(
            args.out,
            {
                "world": args.world,
                "backend": args.backend,
                "bytes": size,
                "seconds": seconds,
                "algbw_gbs": algbw,
                # As nccl-tests computes it for all-reduce: what each link carries.
                "busbw_gbs": algbw * 2 * (args.world - 1) / args.world,
                "correct": correct,
                "torch": torch.__version__,
                "nccl": _nccl_version(torch) if args.backend == "nccl" else None,
            },
        )
    return 0


def _nccl_version(torch) -> str:
    version = torch.cuda.nccl.version()
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="gpu_worker.py")
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("bench")
    p.add_argument("--out", required=True)
    p.add_argument("--matmul", type=int, default=8192)
    p.add_argument("--copy-mib", type=int, default=1024)
    p.add_argument("--p2p-mib", type=int, default=256)
    p = sub.add_parser("rank")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--backend", choices=["nccl", "gloo"], required=True)
    p.add_argument("--store", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--mib", type=int, default=1024)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--hang", action="store_true")
    args = parser.parse_args(argv)
    return bench(args) if args.what == "bench" else rank(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
