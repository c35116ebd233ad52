"""One NCCL all-reduce over every visible GPU (spawned workers: this must run from a file)."""

import json
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def work(rank, world, init, q):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world)
    t = torch.full((1024,), float(rank + 1), device=f"cuda:{rank}")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    q.put((rank, float(t[0].item()), float(t.min().item()), float(t.max().item())))
    dist.destroy_process_group()


if __name__ == "__main__":
    world = torch.cuda.device_count()
    # The rendezvous file in a new private folder: a name in the shared /tmp could be taken by another user first.
    folder = tempfile.mkdtemp(prefix="bwstack-nccl-")
    init = "file://" + folder + "/rendezvous"
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    try:
        mp.start_processes(work, args=(world, init, q), nprocs=world, join=True, start_method="spawn")
        got = sorted(q.get() for _ in range(world))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    want = world * (world + 1) / 2
    print(
        json.dumps(
            {
                "world_size": world,
                "expected": want,
                "results": got,
                # Over no GPU nothing was reduced: that is not a pass.
                "ok": world > 0
                and len(got) == world
                and all(v == want and lo == want and hi == want for _, v, lo, hi in got),
                "nccl": ".".join(map(str, torch.cuda.nccl.version())),
            }
        )
    )
