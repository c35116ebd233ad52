#!/usr/bin/env bash
# Run `bwstack accept` for real on a GPU host: every static fact read from this machine, the runtime part on
# its GPUs. Writes into $OUT (default: a new directory under /tmp): accept.json (the report), accept.txt (the table),
# accept.stderr, accept.rc (0 accepted, 1 not, 2 bad input) and machine.tar.gz (this machine's facts as a
# recorded machine description: `bwstack accept --machine DIR` replays them offline).
#
# Needs only the standard library, PyYAML and packaging (for the lock) and torch (for the runtime part) in
# the Python it uses: BWSTACK_PYTHON, else /opt/torch/.venv/bin/python, else python3. Run from the checkout:
#   bash scripts/gpu-host/accept-run.sh [extra bwstack accept options, e.g. --timeout 300]
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-$(mktemp -d /tmp/bwstack-accept-out.XXXXXX)}"
mkdir -p "$OUT"
PY="${BWSTACK_PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x /opt/torch/.venv/bin/python ]]; then PY=/opt/torch/.venv/bin/python; else PY=$(command -v python3); fi
fi
export PYTHONPATH="$PWD/scripts${PYTHONPATH:+:$PYTHONPATH}"
# NVLink multicast stays off here too (bwstack sets these in every child it starts, whatever is set here).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

echo "== python: $PY"
"$PY" -c 'import sys, yaml, packaging, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())' \
  || { echo "this Python lacks PyYAML, packaging or torch"; exit 2; }
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
exit 0
