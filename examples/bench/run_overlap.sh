#!/usr/bin/env bash
# Overlap benchmark of `hzp run` (not a test): on 2 ranks with emulated links slow enough that
# a step's communication takes about as long as its compute, compare the asynchronous schedule
# (collectives on background comm-stream threads) with `--comm sync` (collectives on the
# compute thread), in one run of this script.
#
#   examples/bench/run_overlap.sh [MODEL.onnx IO.npz] [STRATEGY] [STEPS]
#
# Without a model it builds an 8-layer GPT-2 (hidden 256, batch 8 x 128) with
# make_overlap_model.py into $BENCH_DIR (default /tmp/hzp-bench/overlap), which needs
# PyTorch + transformers in $PYTHON (default /work/venv-models/bin/python, else python3).
# A deep model matters: the first gather and the last reductions of a step cannot be hidden
# within the step, and on a 2-layer model they are most of its communication.
#
# 1. compile the model for gpu=2;
# 2. run it without link emulation in sync mode: the compute time per step C (busy time of
#    the compute stream, collectives excluded);
# 3. pick the link bandwidth so the emulated collectives of a step take about C;
# 4. run async and sync with those links; print step times, their ratio (target >= 1.3x) and
#    the exposed communication as a share of communication time (target < 20%).
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ "$#" -ge 2 ]; then
  MODEL=$1
  IO=$2
  shift 2
else
  BENCH_DIR=${BENCH_DIR:-/tmp/hzp-bench/overlap}
  MODEL=$BENCH_DIR/gpt2_8l.onnx
  IO=$BENCH_DIR/gpt2_8l.npz
  if [ ! -f "$MODEL" ] || [ ! -f "$IO" ]; then
    PY=${PYTHON:-/work/venv-models/bin/python}
    [ -x "$PY" ] || PY=python3
    "$PY" examples/bench/make_overlap_model.py "$BENCH_DIR"
  fi
  COMPILE_FLAGS="--loss lm --retie ${COMPILE_FLAGS:-}"
fi
STRATEGY=${1:-zero3}
STEPS=${2:-8}
HZP=${HZP:-target/release/hzp}
[ -x "$HZP" ] || cargo build --release --quiet
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

"$HZP" compile "$MODEL" --inputs "$IO" --mesh gpu=2 --strategy "$STRATEGY" ${COMPILE_FLAGS:-} -o "$TMP/plan.json" >/dev/null
"$HZP" inspect "$TMP/plan.json" --format json >"$TMP/inspect.json"
"$HZP" run "$TMP/plan.json" --inputs "$IO" --steps "$STEPS" --comm sync --format json >"$TMP/base.json"

BW=$(python3 - "$TMP" <<'PY'
import json, sys
d = sys.argv[1]
base = json.load(open(f"{d}/base.json"))
ins = json.load(open(f"{d}/inspect.json"))
# compute only: the compute stream's busy time minus the collectives it ran (sync mode)
busy = base["busy_seconds"]["compute"][1:]
comm = base["comm_seconds"][1:]
compute = sum(b - c for b, c in zip(busy, comm)) / len(busy)
# ring on 2 ranks: each collective sends half its bytes
sent = sum(c["bytes"] for c in ins["collectives"]) / 2
print(f"{sent / compute:.0f} {compute:.6f}")
PY
)
read -r BW COMPUTE <<<"$BW"
# The emulated links take what the cost model says (its algorithms, latency and efficiency),
# not bytes / bandwidth: one sync run with the first guess measures it, and the bandwidth is
# scaled so the step's communication matches its compute.
"$HZP" run "$TMP/plan.json" --inputs "$IO" --steps 4 --comm sync --link "intra=${BW}" --format json >"$TMP/probe.json"
BW=$(python3 - "$TMP" "$BW" "$COMPUTE" <<'PY'
import json, sys
d, bw, compute = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
probe = json.load(open(f"{d}/probe.json"))
comm = probe["comm_seconds"][1:]
print(f"{bw * (sum(comm) / len(comm)) / compute:.0f}")
PY
)
echo "model $MODEL, strategy $STRATEGY, gpu=2, $STEPS steps (first left out)"
echo "compute per step $(python3 -c "print(f'{$COMPUTE*1e3:.1f}')") ms; emulated link: ${BW} B/s, set so one step's collectives take about as long"
for mode in async sync; do
  "$HZP" run "$TMP/plan.json" --inputs "$IO" --steps "$STEPS" --comm $mode --link "intra=${BW}" --format json >"$TMP/$mode.json"
done
python3 - "$TMP" <<'PY'
import json, sys
d = sys.argv[1]
r = {m: json.load(open(f"{d}/{m}.json")) for m in ("async", "sync")}
def med(v):
    v = sorted(v[1:]); return v[len(v) // 2]
for m in ("async", "sync"):
    s = r[m]
    print(f"  {m:<5}  step {med(s['step_seconds'])*1e3:8.2f} ms (median)  "
          f"communication {s['summary']['comm_seconds']*1e3:7.2f} ms  "
          f"exposed {s['summary']['exposed_comm_seconds']*1e3:7.2f} ms")
a, s = r["async"], r["sync"]
assert a["losses"] == s["losses"], "async and sync losses differ"
ratio = med(s["step_seconds"]) / med(a["step_seconds"])
exposed = a["summary"]["exposed_comm_seconds"] / a["summary"]["comm_seconds"]
print(f"async is {ratio:.2f}x faster than sync (target >= 1.3x); "
      f"exposed communication {100*exposed:.1f}% of communication time (target < 20%)")
print("losses identical in both modes")
PY
