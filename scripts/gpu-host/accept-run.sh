#!/usr/bin/env bash
# Run `bwstack accept` for real on a GPU host: every static fact read from this machine, the runtime part on
# its GPUs. Writes into $OUT (default: a new directory under /tmp): accept.json (the report), accept.txt (the table),
# accept.stderr, accept.rc (0 accepted, 1 not, 2 bad input) and machine.tar.gz (this machine's facts as a
# recorded machine description: `bwstack accept --machine DIR` replays them offline).
#
# Needs only the standard library, PyYAML and packaging (for the lock) and torch (for the runtime part) in
# the Python it uses: the first of BWSTACK_PYTHON, /opt/torch/.venv/bin/python, python3 that has them. From the
# checkout:
#   bash scripts/gpu-host/accept-run.sh [extra bwstack accept options, e.g. --timeout 300]
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-$(mktemp -d /tmp/bwstack-accept-out.XXXXXX)}"
mkdir -p "$OUT"
PY=""
for candidate in ${BWSTACK_PYTHON:-} /opt/torch/.venv/bin/python "$(command -v python3)"; do
  if [[ -x "$candidate" ]] && "$candidate" -c 'import yaml, packaging, torch' 2>/dev/null; then
    PY="$candidate"
    break
  fi
done
[[ -n "$PY" ]] || { echo "no Python here has PyYAML, packaging and torch: carry wheels (see the device README)"; exit 2; }
export PYTHONPATH="$PWD/scripts${PYTHONPATH:+:$PYTHONPATH}"
# NVLink multicast stays off here too (bwstack sets these in every child it starts, whatever is set here).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

echo "== python: $PY"
"$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())'
echo "== uname: $(uname -a)"
echo "== results in $OUT"

record=$(mktemp -d /tmp/bwstack-accept-record.XXXXXX)
started=$(date +%s)
"$PY" -m bwstack accept --env "$PY" --json --record "$record/machine" "$@" >"$OUT/accept.json" 2>"$OUT/accept.stderr"
rc=$?
echo "$rc" >"$OUT/accept.rc"
echo "== bwstack accept exited $rc after $(( $(date +%s) - started )) s"
tar -czf "$OUT/machine.tar.gz" -C "$record" machine && rm -rf "$record"
"$PY" - "$OUT/accept.json" >"$OUT/accept.txt" <<'PYEOF'
import json, sys
print("\n".join(json.load(open(sys.argv[1]))["report"]))
PYEOF
cat "$OUT/accept.txt" || cat "$OUT/accept.stderr"
echo "== stderr"
cat "$OUT/accept.stderr"

# With two GPUs or more: the hang detection with NCCL on the GPUs (one rank joins the group but never the
# collective), the same code path the CPU test proves with gloo. Writes nccl-hang.json.
echo "== NCCL hang detection"
"$PY" - "$OUT/nccl-hang.json" "$PY" <<'PYEOF'
import json, sys, time
import torch
from bwstack.accept.runtime import run_allreduce
out, python = sys.argv[1], sys.argv[2]
if torch.cuda.device_count() < 2:
    print("skipped: fewer than two GPUs (NCCL needs one GPU per rank)")
    json.dump({"skipped": "fewer than two GPUs"}, open(out, "w"))
    raise SystemExit(0)
started = time.monotonic()
run = run_allreduce(python, 2, 60.0, backend="nccl", mib=64, iters=5, hang_rank=1)
result = {
    "status": run.group.status.value,
    "seconds": round(time.monotonic() - started, 1),
    "left_behind": list(run.group.left_behind),
    "hang_rank_joined": "joined the group" in run.group.logs[1],
    "failure": run.failure(),
}
json.dump(result, open(out, "w"), indent=1)
print(json.dumps(result, indent=1))
PYEOF
exit 0
