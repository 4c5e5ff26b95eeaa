#!/bin/bash
# The GPU verification, in one device call: multi-rank plans run with every rank on
# the one lent GPU (`hzp run --backend cuda --ranks-on-one-gpu`) give the single-rank plan's
# losses and parameters (fp32, 1e-5 relative); async vs --comm sync step times; the NCCL
# path at world size 1. Made from ../shared/device/gpu_check.sh; payload in .device/ (made
# by examples/device/prepare.sh). Run from the repository root:
#   device run, carry [".device"], timeout_s ~590, command `bash .device/multi_rank_check.sh`
# Knobs (env): PART=all, or a space-separated list of tiny gpt2s perf nccl1 acco attn pasa
# moe explicit explicit-fuse explicit-bf16 profile data ckpt e2e bench (e2e: tests/run_e2e.rs, every
# test model x mesh x strategy through the executor hzp run uses, on the CPU and on the GPU,
# E2E_S (its time limit, 300); bench: examples/bench/gpu_vs_torch.py,
# PyTorch eager and torch.compile vs hzp on this card, JSON in $OUT/gpu_vs_torch.json,
# BENCH_CONFIGS (gpt2s), BENCH_STEPS (10), BENCH_S (its time limit, 300); data: a training run from a token file on
# CUDA, per-step losses and the GPU evaluation's val_loss vs the CPU backend; ckpt: a CUDA run stopped with a checkpoint and
# resumed on CUDA (bitwise the uninterrupted run) and on the CPU backend (1e-5); explicit: every tiny model with attention
# written out, CUDA vs CPU; explicit-fuse: the same with HZP_CUDA_FUSE=1; explicit-bf16: the
# same compiled with --precision bf16, within 2e-2; profile: GPT-2 small's GPU time per
# op kind, HZP_CUDA_PROFILE=1, modes PROFILE_MODES, e.g. "explicit explicit-fuse bf16
# bf16-fuse"); graph: every EXPLICIT model on CUDA with a CUDA graph replayed after the
# capture (HZP_CUDA_EXPLAIN=1 says it captured) against --no-cuda-graph, bit for bit, also with
# --comm sync, and gpu=2 with every rank on the GPU (graphs refused: said once, still equal);
# adamw: every EXPLICIT model with the multi-tensor AdamW (the default) against one AdamW launch
# per parameter (HZP_CUDA_ADAMW_PER_NODE=1), bit for bit; lt: every EXPLICIT model with
# cuBLASLt epilogues (HZP_CUDA_LT=1) against the default, within 1e-4, and in bf16 within
# 1e-2 (HZP_CUDA_EXPLAIN=1's
# choice in $W/<model>.lt.y.err))
# (all by default; gpt2s alone takes the longest;
# acco: ACCO plans on CUDA against the CPU backend;
# attn: hzp's CUDA attention kernels, HZP_CUDA_ATTENTION=1, against the CPU backend;
# cudnn: fused attention on cuDNN (bf16 tiny models, CUDA vs CPU within 2e-2, the run's log
# must say cuDNN ran every attention node; cuDNN vs hzp's kernels; GPT-2 small bf16 step
# time, attention on cuDNN vs written out);
# moe: routed mixture of experts on CUDA: the MoE kernels bit for bit against the CPU
# kernels (.device/cuda_moe, the test binary of runtime/tests/cuda_moe.rs), moe_tiny routed
# (MoeDispatch / MoeCombine, the import's default) on CUDA vs the CPU backend (both
# exporters fp32 within 1e-4, bf16 within 2e-2) and vs its written-out form (--no-fuse-moe)
# on CUDA;
# pasa: the PASA fp16 kernel against exact attention (.device/cuda_pasa, the test binary of
# runtime/tests/cuda_pasa.rs) and an fp16 plan trained with --attention pasa vs flash),
# MESHES, STRATS, TINY, STEPS (tiny models, 5), GSTEPS (GPT-2 small, 3), RUN_S (per run, 150).
# Every run has its own timeout and the script goes on after a failure; `RESULT` lines are the
# verdicts; everything (logs, JSON, flight records of failures) lands in $OUT.
set -u
D=$PWD/.device; O=${OUT:-/tmp/out}; mkdir -p "$O"; W=/tmp/mr; mkdir -p $W
exec > >(tee "$O/multi_rank.txt") 2>&1
H=$D/hzp; chmod +x $H
M=${MODELS:-$PWD/tests/models}
PART=${PART:-all}
# want P: P is among the space-separated parts asked for (or all)
want() { [[ " $PART " == *" all "* || " $PART " == *" $1 "* ]]; }
MESHES=${MESHES:-"gpu=2 gpu=4 node=2,gpu=2"}
STRATS=${STRATS:-"asynchzp zero3 hsdp ddp"}
TINY=${TINY:-"gpt2_tiny.legacy.op17:lm:--retie llama_tiny.legacy.op17:lm moe_tiny.legacy.op17:lm bert_tiny.legacy.op17:mean"}
EXPLICIT=${EXPLICIT:-"gpt2_tiny.legacy.op17:lm:--retie llama_tiny.legacy.op17:lm moe_tiny.legacy.op17:lm:--no-fuse-moe bert_tiny.legacy.op17:mean gpt2_tiny.dynamo.op18:lm:--retie llama_tiny.dynamo.op18:lm moe_tiny.dynamo.op18:lm:--no-fuse-moe bert_tiny.dynamo.op18:mean"}
STEPS=${STEPS:-5}; GSTEPS=${GSTEPS:-3}; T=${RUN_S:-150}
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s] $*"; }
el "== gpu"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
$H --version

# tile NPZ OUT K: every array of NPZ repeated K times along axis 0 (a global batch that
# divides by every mesh's world size)
tile() {
  python3 - "$1" "$2" "$3" <<'PY'
import sys, numpy as np
src, dst, k = sys.argv[1], sys.argv[2], int(sys.argv[3])
z = np.load(src)
np.savez(dst, **{n: np.concatenate([z[n]] * k, axis=0) for n in z.files})
PY
}

# check NAME ONNX IO LOSS STEPS EXTRA...: the gpu=1 plan on CUDA is the reference; every
# mesh x strategy runs with all ranks on the GPU and is compared with it
check() {
  local name=$1 onnx=$2 io=$3 loss=$4 steps=$5; shift 5
  local ref=$W/$name.g1
  if ! $H compile --no-fuse-attention $onnx --inputs $io --loss $loss "$@" --mesh gpu=1 -o $ref.json >/dev/null 2>$ref.cerr; then
    el "RESULT $name gpu=1: FAIL compile"; tail -5 $ref.cerr; return
  fi
  timeout $T $H run $ref.json --inputs $io --steps $steps --backend cuda --format json \
    --save-params $ref.npz >$ref.out 2>$ref.err || { el "RESULT $name gpu=1 cuda: FAIL rc=$?"; tail -20 $ref.err; return; }
  for mesh in $MESHES; do
    for strat in $STRATS; do
      local tag=$name.$(echo $mesh | tr ',=' '_-').$strat
      if ! $H compile --no-fuse-attention $onnx --inputs $io --loss $loss "$@" --mesh $mesh --strategy $strat -o $W/$tag.json >/dev/null 2>$W/$tag.cerr; then
        el "RESULT $tag: compile refused: $(grep -v '^note' $W/$tag.cerr | tr -s ' \n' ' ' | cut -c1-200)"; continue
      fi
      local s=$(date +%s)
      timeout $T $H run $W/$tag.json --inputs $io --steps $steps --backend cuda --ranks-on-one-gpu \
        --format json --save-params $W/$tag.npz --collective-timeout 60 --flight-recorder $W/$tag.fr \
        >$W/$tag.out 2>$W/$tag.err
      local rc=$?
      if [ $rc != 0 ]; then el "RESULT $tag: FAIL rc=$rc ($(( $(date +%s) - s ))s)"; tail -30 $W/$tag.err; continue; fi
      python3 $D/compare_ranks.py $tag $ref.out $W/$tag.out $ref.npz $W/$tag.npz
    done
  done
}

if want tiny; then
  el "== tiny models: every mesh x strategy, all ranks on one GPU, vs the gpu=1 plan on CUDA"
  for spec in $TINY; do
    IFS=: read -r stem loss extra <<<"$spec"
    base=${stem%%.*}
    tile $M/$base.io.npz $W/$base.io4.npz 2
    check $stem $M/$stem.onnx $W/$base.io4.npz $loss $STEPS $extra
  done
fi

if want gpt2s; then
  el "== GPT-2 small (124M, seq 1024, batch 8): every mesh x strategy, all ranks on one GPU"
  mkdir -p $W/gpt2s
  if timeout 300 python3 $D/make_gpt2s.py $W/gpt2s; then
    check gpt2s $W/gpt2s/model.onnx $W/gpt2s/batch.npz lm $GSTEPS --retie
  else
    el "RESULT gpt2s: FAIL export"
  fi
fi

if want perf; then
  el "== async vs --comm sync (median step of 6, the first left out)"
  for spec in "gpt2s:$W/gpt2s/model.onnx:$W/gpt2s/batch.npz:gpu=4:asynchzp" "gpt2s:$W/gpt2s/model.onnx:$W/gpt2s/batch.npz:gpu=4:zero3" "llama:$M/llama_tiny.legacy.op17.onnx:$W/llama_tiny.io4.npz:gpu=4:zero3"; do
    IFS=: read -r name onnx io mesh strat <<<"$spec"
    [ -f $onnx ] && [ -f $io ] || { el "perf $name: no model (run PART=gpt2s/tiny first)"; continue; }
    p=$W/perf.$name.$strat.json
    x=""; [[ $name == gpt2s ]] && x=--retie
    $H compile --no-fuse-attention $onnx --inputs $io --loss lm $x --mesh $mesh --strategy $strat -o $p >/dev/null 2>&1 || { el "perf $name $strat: compile failed"; continue; }
    for c in async sync; do
      timeout $T $H run $p --inputs $io --steps 6 --backend cuda --ranks-on-one-gpu --comm $c --format json >$p.$c.out 2>$p.$c.err || { el "perf $name $c: FAIL"; tail -10 $p.$c.err; }
    done
    python3 - $name $mesh $strat $p.async.out $p.sync.out <<'PY'
import json, statistics, sys
name, mesh, strat, a, s = sys.argv[1:6]
def med(f):
    try:
        j = json.load(open(f)); x = j["step_seconds"][1:]
        e = [v for v in j.get("exposed_comm_seconds", [])[1:]]
        return 1e3 * statistics.median(x), 1e3 * statistics.median(e) if e else float("nan")
    except Exception as ex:
        return float("nan"), float("nan")
(am, ae), (sm, se) = med(a), med(s)
print(f"RESULT perf {name} {mesh} {strat}: async {am:.1f} ms (exposed comm {ae:.1f}), sync {sm:.1f} ms (exposed comm {se:.1f}), sync/async {sm/am if am == am and am > 0 else float('nan'):.2f}")
PY
  done
fi

if want nccl1; then
  el "== NCCL at world size 1 (HZP_NCCL_GROUPS_OF_ONE=1: NCCL communicators for groups of one, through hzp launch)"
  g1=$W/gpt2_tiny.legacy.op17.g1
  [ -f $g1.json ] || $H compile --no-fuse-attention $M/gpt2_tiny.legacy.op17.onnx --inputs $W/gpt2_tiny.io4.npz --loss lm --retie --mesh gpu=1 -o $g1.json >/dev/null 2>&1
  [ -f $W/gpt2_tiny.io4.npz ] || tile $M/gpt2_tiny.io.npz $W/gpt2_tiny.io4.npz 2
  timeout 60 $H run $g1.json --inputs $W/gpt2_tiny.io4.npz --steps $STEPS --backend cuda --format json --save-params $W/n1.copy.npz >$W/n1.copy.out 2>$W/n1.copy.err
  HZP_NCCL_GROUPS_OF_ONE=1 timeout 90 $H launch --nproc-per-node 1 -- run $g1.json --inputs $W/gpt2_tiny.io4.npz --steps $STEPS \
    --backend cuda --format json --save-params $W/n1.nccl.npz --collective-timeout 30 >$W/n1.nccl.out 2>$W/n1.nccl.err
  echo "rc=$?"; tail -15 $W/n1.nccl.err
  # hzp launch prefixes each line with the rank: strip it for the JSON
  sed -E 's/^\[rank [0-9]+\] ?//' $W/n1.nccl.out > $W/n1.nccl.json
  python3 $D/compare_ranks.py nccl-world-1 $W/n1.copy.out $W/n1.nccl.json $W/n1.copy.npz $W/n1.nccl.npz
  el "== two processes on one GPU through hzp launch (NCCL refuses two ranks on one device: expect a clear error naming --ranks-on-one-gpu)"
  $H compile --no-fuse-attention $M/llama_tiny.legacy.op17.onnx --inputs $W/llama_tiny.io4.npz --loss lm --mesh gpu=2 --strategy zero3 -o $W/l2.json >/dev/null 2>&1
  timeout 60 $H launch --nproc-per-node 2 -- run $W/l2.json --inputs $W/llama_tiny.io4.npz --steps 2 --backend cuda --collective-timeout 20 2>&1 | tail -15
fi
if want acco; then
  # ACCO's halves depend on the rank count, so the reference is the same plan on the CPU
  el "== ACCO: one gpu=2 and one node=2,gpu=2 plan, CUDA (all ranks on one GPU) vs the CPU backend"
  # ACCO splits each rank's batch into twice the micro-batches: 8 rows for node=2,gpu=2
  [ -f $W/gpt2_tiny.io8.npz ] || tile $M/gpt2_tiny.io.npz $W/gpt2_tiny.io8.npz 4
  for mesh in gpu=2 node=2,gpu=2; do
    tag=acco.$(echo $mesh | tr ',=' '_-')
    $H compile --no-fuse-attention $M/gpt2_tiny.legacy.op17.onnx --inputs $W/gpt2_tiny.io8.npz --loss lm --retie \
      --mesh $mesh --strategy acco -o $W/$tag.json >/dev/null 2>$W/$tag.cerr || { el "RESULT $tag: FAIL compile"; tail -5 $W/$tag.cerr; continue; }
    timeout $T $H run $W/$tag.json --inputs $W/gpt2_tiny.io8.npz --steps $STEPS --format json --save-params $W/$tag.cpu.npz >$W/$tag.cpu.out 2>$W/$tag.cpu.err \
      || { el "RESULT $tag cpu: FAIL"; tail -10 $W/$tag.cpu.err; continue; }
    timeout $T $H run $W/$tag.json --inputs $W/gpt2_tiny.io8.npz --steps $STEPS --backend cuda --ranks-on-one-gpu --format json \
      --save-params $W/$tag.cuda.npz --collective-timeout 60 >$W/$tag.cuda.out 2>$W/$tag.cuda.err \
      || { el "RESULT $tag cuda: FAIL"; tail -20 $W/$tag.cuda.err; continue; }
    python3 $D/compare_ranks.py $tag $W/$tag.cpu.out $W/$tag.cuda.out $W/$tag.cpu.npz $W/$tag.cuda.npz
  done
fi
if want attn; then
  el "== fused attention on CUDA (HZP_CUDA_ATTENTION=1): 5 steps of the gpu=1 plan with the Attention op vs the CPU backend (1e-4), and step time vs explicit attention"
  for spec in $TINY; do
    IFS=: read -r stem loss extra <<<"$spec"
    base=${stem%%.*}
    [ -f $W/$base.io4.npz ] || tile $M/$base.io.npz $W/$base.io4.npz 2
    f=$W/$stem.fused
    $H compile $M/$stem.onnx --inputs $W/$base.io4.npz --loss $loss $extra --mesh gpu=1 -o $f.json >/dev/null 2>$f.cerr || { el "RESULT attn $stem: FAIL compile"; tail -5 $f.cerr; continue; }
    grep -q '"Attention' $f.json || el "attn $stem: the plan has no fused attention"
    timeout $T $H run $f.json --inputs $W/$base.io4.npz --steps $STEPS --format json --save-params $f.cpu.npz >$f.cpu.out 2>$f.cpu.err || { el "RESULT attn $stem cpu: FAIL"; tail -10 $f.cpu.err; continue; }
    HZP_CUDA_ATTENTION=1 timeout $T $H run $f.json --inputs $W/$base.io4.npz --steps $STEPS --backend cuda --format json --save-params $f.cuda.npz >$f.cuda.out 2>$f.cuda.err || { el "RESULT attn $stem cuda: FAIL rc=$?"; tail -20 $f.cuda.err; continue; }
    TOL=1e-4 python3 $D/compare_ranks.py attn-$stem $f.cpu.out $f.cuda.out $f.cpu.npz $f.cuda.npz
  done
  if [ -f $W/gpt2s/model.onnx ]; then
    for mode in fused explicit; do
      x=""; [ $mode = explicit ] && x=--no-fuse-attention
      p=$W/attnperf.$mode.json
      $H compile $x $W/gpt2s/model.onnx --inputs $W/gpt2s/batch.npz --loss lm --retie --mesh gpu=1 -o $p >/dev/null 2>&1 || { el "attn perf $mode: compile failed"; continue; }
      HZP_CUDA_ATTENTION=1 timeout $T $H run $p --inputs $W/gpt2s/batch.npz --steps 6 --backend cuda --format json >$p.out 2>$p.err || { el "attn perf $mode: FAIL"; tail -10 $p.err; }
    done
    python3 - $W/attnperf.fused.json.out $W/attnperf.explicit.json.out <<'PY'
import json, statistics, sys
def med(f):
    try:
        return 1e3 * statistics.median(json.load(open(f))["step_seconds"][1:])
    except Exception:
        return float("nan")
f, e = med(sys.argv[1]), med(sys.argv[2])
print(f"RESULT attn perf gpt2s gpu=1: fused {f:.1f} ms, explicit {e:.1f} ms, explicit/fused {e / f if f == f and f > 0 else float('nan'):.2f}")
PY
  else
    el "attn perf: no GPT-2 small export (run PART=gpt2s first)"
  fi
fi
if want cudnn; then
  el "== attention on cuDNN's fused SDPA: tiny models compiled with --precision bf16 (fused attention kept), 5 steps of the gpu=1 plan on CUDA (default --attention: every attention node on cuDNN, or the run is refused) vs the CPU backend (2e-2), and vs hzp's kernels (HZP_CUDNN=0 --attention flash)"
  for spec in gpt2_tiny.legacy.op17:lm:--retie llama_tiny.legacy.op17:lm; do
    IFS=: read -r stem loss extra <<<"$spec"
    base=${stem%%.*}
    [ -f $W/$base.io4.npz ] || tile $M/$base.io.npz $W/$base.io4.npz 2
    f=$W/$stem.cudnn
    $H compile $M/$stem.onnx --inputs $W/$base.io4.npz --loss $loss $extra --precision bf16 --mesh gpu=1 -o $f.json >/dev/null 2>$f.cerr || { el "RESULT cudnn $stem: FAIL compile"; tail -5 $f.cerr; continue; }
    grep -q 'Attention{' $f.json || { el "RESULT cudnn $stem: FAIL the plan has no fused attention"; continue; }
    timeout $T $H run $f.json --inputs $W/$base.io4.npz --steps $STEPS --format json --save-params $f.cpu.npz >$f.cpu.out 2>$f.cpu.err || { el "RESULT cudnn $stem cpu: FAIL"; tail -10 $f.cpu.err; continue; }
    timeout $T $H run $f.json --inputs $W/$base.io4.npz --steps $STEPS --backend cuda --format json --save-params $f.cuda.npz >$f.cuda.out 2>$f.cuda.err || { el "RESULT cudnn $stem cuda: FAIL rc=$?"; tail -20 $f.cuda.err; continue; }
    grep -h '^hzp: ' $f.cuda.err | head -8
    # cuDNN ran: its note is there, and no node fell back to hzp's kernels or stayed off cuDNN
    if ! grep -q 'attention node(s) with' $f.cuda.err || grep -q "hzp's attention kernels run it\|not on cuDNN" $f.cuda.err; then
      el "RESULT cudnn $stem: FAIL cuDNN did not run every attention node"; continue
    fi
    TOL=2e-2 WORST=5e-2 python3 $D/compare_ranks.py cudnn-vs-cpu-$stem $f.cpu.out $f.cuda.out $f.cpu.npz $f.cuda.npz
    HZP_CUDNN=0 timeout $T $H run $f.json --inputs $W/$base.io4.npz --steps $STEPS --backend cuda --attention flash --format json --save-params $f.flash.npz >$f.flash.out 2>$f.flash.err || { el "RESULT cudnn-vs-flash $stem: FAIL rc=$?"; tail -10 $f.flash.err; continue; }
    TOL=2e-2 WORST=5e-2 python3 $D/compare_ranks.py cudnn-vs-flash-$stem $f.flash.out $f.cuda.out $f.flash.npz $f.cuda.npz
  done
  mkdir -p $W/gpt2s
  [ -f $W/gpt2s/model.onnx ] || timeout 300 python3 $D/make_gpt2s.py $W/gpt2s >/dev/null 2>&1 || el "cudnn perf: GPT-2 small export failed"
  if [ -f $W/gpt2s/model.onnx ]; then
    for mode in cudnn explicit; do
      x=""; [ $mode = explicit ] && x=--no-fuse-attention
      p=$W/cudnnperf.$mode.json
      $H compile $x $W/gpt2s/model.onnx --inputs $W/gpt2s/batch.npz --loss lm --retie --precision bf16 --mesh gpu=1 -o $p >/dev/null 2>&1 || { el "cudnn perf $mode: compile failed"; continue; }
      timeout $T $H run $p --inputs $W/gpt2s/batch.npz --steps 6 --backend cuda --format json >$p.out 2>$p.err || { el "cudnn perf $mode: FAIL"; tail -10 $p.err; }
    done
    grep -h '^hzp: cuDNN' $W/cudnnperf.cudnn.json.err | head -2
    python3 - $W/cudnnperf.cudnn.json.out $W/cudnnperf.explicit.json.out <<'PY'
import json, statistics, sys
def med(f):
    try:
        return 1e3 * statistics.median(json.load(open(f))["step_seconds"][1:])
    except Exception:
        return float("nan")
c, e = med(sys.argv[1]), med(sys.argv[2])
print(f"RESULT cudnn perf gpt2s bf16 gpu=1: cuDNN attention {c:.1f} ms, explicit {e:.1f} ms, explicit/cuDNN {e / c if c == c and c > 0 else float('nan'):.2f}")
PY
  else
    el "cudnn perf: no GPT-2 small export"
  fi
fi
if want moe; then
  el "== routed mixture of experts on CUDA: the MoE kernels vs the CPU kernels (bitwise); moe_tiny routed, 5 steps of the gpu=1 plan on CUDA vs the CPU backend (fp32 1e-4, bf16 2e-2) and vs the written-out form on CUDA (1e-4)"
  if [ -x $D/cuda_moe ]; then
    HZP_REQUIRE_GPU=1 HZP_SKIPS_DIR=$W/skips timeout $T $D/cuda_moe --nocapture --test-threads 1 \
      moe_kernels_on_the_gpu_equal_the_cpu_kernels >$W/cuda_moe.out 2>&1
    rc=$?
    grep '^RESULT' $W/cuda_moe.out
    if [ $rc = 0 ] && grep -q '1 passed' $W/cuda_moe.out; then el "RESULT moe kernels: PASS"; else el "RESULT moe kernels: FAIL rc=$rc"; tail -30 $W/cuda_moe.out; fi
  else
    el "RESULT moe kernels: FAIL no .device/cuda_moe (run examples/device/prepare.sh)"
  fi
  for spec in "moe_tiny.legacy.op17 fp32 1e-4 1e-3" "moe_tiny.dynamo.op18 fp32 1e-4 1e-3" "moe_tiny.legacy.op17 bf16 2e-2 5e-2"; do
    read -r stem prec tol worst <<<"$spec"
    f=$W/$stem.routed.$prec
    $H compile --no-fuse-attention $M/$stem.onnx --inputs $M/moe_tiny.io.npz --loss lm --precision $prec --mesh gpu=1 -o $f.json >/dev/null 2>$f.cerr || { el "RESULT moe $stem $prec: FAIL compile"; tail -5 $f.cerr; continue; }
    grep -q 'MoeDispatch' $f.json || { el "RESULT moe $stem $prec: FAIL the plan is not routed"; continue; }
    timeout $T $H run $f.json --inputs $M/moe_tiny.io.npz --steps $STEPS --format json --save-params $f.cpu.npz >$f.cpu.out 2>$f.cpu.err || { el "RESULT moe $stem $prec cpu: FAIL"; tail -10 $f.cpu.err; continue; }
    timeout $T $H run $f.json --inputs $M/moe_tiny.io.npz --steps $STEPS --backend cuda --format json --save-params $f.cuda.npz >$f.cuda.out 2>$f.cuda.err || { el "RESULT moe $stem $prec cuda: FAIL rc=$?"; tail -20 $f.cuda.err; continue; }
    TOL=$tol WORST=$worst python3 $D/compare_ranks.py moe-routed-cuda-vs-cpu-$prec-$stem $f.cpu.out $f.cuda.out $f.cpu.npz $f.cuda.npz
  done
  # the written-out form (each choice's expert weights gathered) on CUDA: the routed layer is
  # dropless on import, so both compute the same model
  f=$W/moe_tiny.legacy.op17.routed.fp32; g=$W/moe_tiny.legacy.op17.written
  if [ -f $f.cuda.npz ] && $H compile --no-fuse-attention --no-fuse-moe $M/moe_tiny.legacy.op17.onnx --inputs $M/moe_tiny.io.npz --loss lm --mesh gpu=1 -o $g.json >/dev/null 2>$g.cerr; then
    timeout $T $H run $g.json --inputs $M/moe_tiny.io.npz --steps $STEPS --backend cuda --format json --save-params $g.cuda.npz >$g.cuda.out 2>$g.cuda.err \
      && TOL=1e-4 python3 $D/compare_ranks.py moe-routed-vs-written-cuda $g.cuda.out $f.cuda.out $g.cuda.npz $f.cuda.npz \
      || { el "RESULT moe-routed-vs-written-cuda: FAIL"; tail -10 $g.cuda.err; }
  else
    el "RESULT moe-routed-vs-written-cuda: FAIL (no routed CUDA run, or the written-out compile failed)"
  fi
fi
if want pasa; then
  el "== PASA: attn_fwd_pasa_f16 vs exact f64 attention and its CPU emulation on overflow-prone inputs; beta=0 (plain fp16) must overflow"
  if [ -x $D/cuda_pasa ]; then
    HZP_REQUIRE_GPU=1 timeout $T $D/cuda_pasa --nocapture --test-threads 1 >$W/cuda_pasa.out 2>&1
    rc=$?
    grep '^RESULT' $W/cuda_pasa.out
    if [ $rc = 0 ]; then el "RESULT pasa kernel: PASS"; else el "RESULT pasa kernel: FAIL rc=$rc"; tail -30 $W/cuda_pasa.out; fi
  else
    el "RESULT pasa kernel: FAIL no .device/cuda_pasa (run examples/device/prepare.sh)"
  fi
  el "== PASA end to end: gpt2_tiny compiled with --precision fp16, 5 steps on CUDA with --attention pasa vs --attention flash (losses within 1e-2)"
  [ -f $W/gpt2_tiny.io4.npz ] || tile $M/gpt2_tiny.io.npz $W/gpt2_tiny.io4.npz 2
  f=$W/gpt2_tiny.fp16
  if $H compile $M/gpt2_tiny.legacy.op17.onnx --inputs $W/gpt2_tiny.io4.npz --loss lm --retie --precision fp16 --mesh gpu=1 -o $f.json >/dev/null 2>$f.cerr; then
    for a in flash pasa; do
      timeout $T $H run $f.json --inputs $W/gpt2_tiny.io4.npz --steps $STEPS --backend cuda --attention $a --format json >$f.$a.out 2>$f.$a.err || { el "pasa e2e $a: FAIL rc=$?"; tail -10 $f.$a.err; }
    done
    python3 - $f.flash.out $f.pasa.out <<'PY'
import json, sys
try:
    a, b = (json.load(open(x))["losses"] for x in sys.argv[1:3])
    d = max(abs(x - y) / max(abs(x), 1e-30) for x, y in zip(a, b))
    ok = len(a) == len(b) and len(a) > 0 and all(y == y for y in b) and d <= 1e-2
    print(f"RESULT pasa e2e gpt2_tiny fp16: {'PASS' if ok else 'FAIL'} losses flash {a} pasa {b} (largest relative difference {d:.2e})")
except Exception as e:
    print(f"RESULT pasa e2e gpt2_tiny fp16: FAIL ({e})")
PY
  else
    el "RESULT pasa e2e: FAIL compile"; tail -5 $f.cerr
  fi
fi
# explicit_models TAG [COMPILE-FLAGS]: every EXPLICIT model on CUDA (with the environment as
# it is) vs CPU, within $XTOL (1e-4 unless set)
explicit_models() {
  for spec in $EXPLICIT; do
    IFS=: read -r stem loss extra <<<"$spec"
    base=${stem%%.*}
    f=$W/$stem.$1
    $H compile --no-fuse-attention $M/$stem.onnx --inputs $M/$base.io.npz --loss $loss $extra ${2:-} --mesh gpu=1 -o $f.json >/dev/null 2>$f.cerr || { el "RESULT explicit $stem: FAIL compile"; tail -5 $f.cerr; continue; }
    timeout $T $H run $f.json --inputs $M/$base.io.npz --steps $STEPS --format json --save-params $f.cpu.npz >$f.cpu.out 2>$f.cpu.err || { el "RESULT explicit $stem cpu: FAIL"; tail -10 $f.cpu.err; continue; }
    timeout $T $H run $f.json --inputs $M/$base.io.npz --steps $STEPS --backend cuda --format json --save-params $f.cuda.npz >$f.cuda.out 2>$f.cuda.err || { el "RESULT explicit $stem cuda: FAIL rc=$?"; tail -20 $f.cuda.err; continue; }
    TOL=${XTOL:-1e-4} python3 $D/compare_ranks.py $1-$stem $f.cpu.out $f.cuda.out $f.cpu.npz $f.cuda.npz
  done
}
if want explicit; then
  el "== every tiny model (both exporters), attention written out: 5 steps of the gpu=1 plan on CUDA vs the CPU backend (1e-4)"
  explicit_models explicit
fi
if want explicit-fuse; then
  el "== the same with HZP_CUDA_FUSE=1 (elementwise runs fused into generated kernels)"
  (export HZP_CUDA_FUSE=1; explicit_models explicit-fuse)
fi
if want explicit-bf16; then
  el "== the same in bf16 (--precision bf16: bf16 transposes read by products are views, cuBLAS transpose flags), within 2e-2"
  (export XTOL=2e-2 WORST=5e-2; explicit_models explicit-bf16 "--precision bf16")
fi
if want profile; then
  el "== GPT-2 small on one GPU, HZP_CUDA_PROFILE=1: GPU time per op kind (fp32 explicit, fp32 fused, bf16 explicit)"
  mkdir -p $W/gpt2s
  [ -f $W/gpt2s/model.onnx ] || timeout 300 python3 $D/make_gpt2s.py $W/gpt2s >/dev/null 2>&1 || el "profile: GPT-2 small export failed"
  for mode in ${PROFILE_MODES:-explicit fused bf16}; do
    x=""; [ $mode != fused ] && x=--no-fuse-attention; [[ $mode == bf16* ]] && x="$x --precision bf16"
    p=$W/profile.$mode
    # explicit-nc / bf16-nc: the same with HZP_CUDA_NO_COALESCE=1 (elementwise walks as written);
    # explicit-fuse / bf16-fuse: with HZP_CUDA_FUSE=1 (elementwise runs fused)
    [[ $mode == *-nc ]] && export HZP_CUDA_NO_COALESCE=1 || unset HZP_CUDA_NO_COALESCE
    [[ $mode == *-fuse ]] && export HZP_CUDA_FUSE=1 || unset HZP_CUDA_FUSE
    $H compile $x $W/gpt2s/model.onnx --inputs $W/gpt2s/batch.npz --loss lm --retie --mesh gpu=1 --memory 80GiB -o $p.json >/dev/null 2>$p.cerr || { el "profile $mode: compile failed"; tail -3 $p.cerr; continue; }
    HZP_CUDA_PROFILE=1 HZP_CUDA_ATTENTION=1 timeout $T $H run $p.json --inputs $W/gpt2s/batch.npz --steps 4 --backend cuda >$p.out 2>$p.err
    el "RESULT profile gpt2s $mode: rc=$? $(grep -o '([0-9.]* ms)' $p.out | tail -1)"
    grep -v '^note' $p.err | head -45
  done
fi
if want data; then
  el "== a training run from a token file on CUDA (--data, cosine schedule with warmup, --val-data every 4 steps, --log): per-step losses and held-out losses (evaluated by a forward+loss plan on the GPU) vs the CPU backend (1e-5), gpu=1 and gpu=2 with every rank on the GPU"
  for mesh in gpu=1 gpu=2; do
    f=$W/data.$(echo $mesh | tr '=' '-')
    $H compile --no-fuse-attention $M/gpt2_tiny.legacy.op17.onnx --shape input_ids=4x32 --retie --lr 3e-3 --mesh $mesh -o $f.json >/dev/null 2>$f.cerr || { el "RESULT data $mesh: FAIL compile"; tail -3 $f.cerr; continue; }
    x=""; [ $mesh != gpu=1 ] && x=--ranks-on-one-gpu
    for be in cpu cuda; do
      rm -f $f.$be.jsonl
      timeout $T $H run $f.json --backend $be $( [ $be = cuda ] && echo $x ) --data $M/tokens/train.bin --shuffle 1 --lr-schedule cosine --warmup 2 --steps 8 --val-data $M/tokens/train.bin --eval-every 4 --eval-batches 2 --log $f.$be.jsonl >$f.$be.out 2>$f.$be.err || el "data $mesh $be: rc=$?"
    done
    python3 - $mesh $f.cpu.jsonl $f.cuda.jsonl $f.cuda.out <<'PY'
import json, sys
mesh, a, b, out = sys.argv[1:]
try:
    gpu_eval = any(l.startswith("evaluation:") and "(on the GPU" in l for l in open(out))
except OSError:
    gpu_eval = False
try:
    la = [json.loads(l) for l in open(a)]; lb = [json.loads(l) for l in open(b)]
except OSError as e:
    print(f"RESULT data {mesh}: FAIL ({e})"); sys.exit()
d = max((abs(x["loss"] - y["loss"]) / abs(x["loss"]) for x, y in zip(la, lb)), default=float("nan"))
lr = all(abs(x["lr"] - y["lr"]) <= 1e-12 for x, y in zip(la, lb))
va = [(x["step"], x["val_loss"]) for x in la if "val_loss" in x]
vb = [(x["step"], x["val_loss"]) for x in lb if "val_loss" in x]
dv = max((abs(x[1] - y[1]) / abs(x[1]) for x, y in zip(va, vb)), default=float("nan"))
vok = [s for s, _ in va] == [s for s, _ in vb] == [4, 8] and dv <= 1e-5
ok = len(la) == len(lb) == 8 and d <= 1e-5 and lr and vok and gpu_eval
print(f"RESULT data {mesh}: {'PASS' if ok else 'FAIL'} ({len(la)}/{len(lb)} steps, losses within {d:.1e}, lr {'equal' if lr else 'DIFFERS'}, val_loss at steps {[s for s, _ in vb]} within {dv:.1e}, evaluated {'on the GPU' if gpu_eval else 'NOT on the GPU'}; cuda {lb[-1]['loss'] if lb else '-'} vs cpu {la[-1]['loss'] if la else '-'})")
PY
  done
fi
if want ckpt; then
  el "== checkpoints on CUDA: a run stopped at step 2 with a checkpoint and resumed gives the uninterrupted run's losses bit for bit; the CUDA checkpoint resumed on the CPU backend gives them within 1e-5; gpu=1 and gpu=2 with every rank on the GPU"
  for mesh in gpu=1 gpu=2; do
    f=$W/ckpt.$(echo $mesh | tr '=' '-')
    rm -rf $f.ck $f.ck-cpu $f.*.jsonl
    $H compile --no-fuse-attention $M/gpt2_tiny.legacy.op17.onnx --shape input_ids=4x32 --retie --lr 3e-3 --mesh $mesh -o $f.json >/dev/null 2>$f.cerr || { el "RESULT ckpt $mesh: FAIL compile"; tail -3 $f.cerr; continue; }
    x=""; [ $mesh != gpu=1 ] && x=--ranks-on-one-gpu
    common="--data $M/tokens/train.bin --shuffle 1 --lr-schedule cosine --warmup 2 --steps 4"
    timeout $T $H run $f.json --backend cuda $x $common --log $f.whole.jsonl >$f.whole.out 2>$f.whole.err || el "ckpt $mesh whole: rc=$?"
    timeout $T $H run $f.json --backend cuda $x $common --checkpoint-dir $f.ck --checkpoint-every 2 --stop-at 2 --log $f.first.jsonl >$f.first.out 2>$f.first.err || el "ckpt $mesh first half: rc=$?"
    cp -r $f.ck $f.ck-cpu
    timeout $T $H run $f.json --backend cuda $x $common --checkpoint-dir $f.ck --resume --log $f.resumed.jsonl >$f.resumed.out 2>$f.resumed.err || el "ckpt $mesh resumed on cuda: rc=$?"
    timeout $T $H run $f.json --backend cpu $common --checkpoint-dir $f.ck-cpu --resume --log $f.cpu.jsonl >$f.cpu.out 2>$f.cpu.err || el "ckpt $mesh resumed on cpu: rc=$?"
    python3 - $mesh $f.whole.jsonl $f.resumed.jsonl $f.cpu.jsonl <<'PY'
import json, sys
mesh, whole, resumed, cpu = sys.argv[1:]
try:
    w, r, c = ([json.loads(l) for l in open(p)] for p in (whole, resumed, cpu))
except OSError as e:
    print(f"RESULT ckpt {mesh}: FAIL ({e})"); sys.exit()
tail = {x["step"]: x["loss"] for x in w if x["step"] > 2}
rs = {x["step"]: x["loss"] for x in r}; cs = {x["step"]: x["loss"] for x in c}
bitwise = sorted(rs) == sorted(tail) == [3, 4] and all(rs[k] == tail[k] for k in tail)
d = max((abs(cs[k] - tail[k]) / abs(tail[k]) for k in tail if k in cs), default=float("nan"))
on_cpu = sorted(cs) == [3, 4] and d <= 1e-5
print(f"RESULT ckpt {mesh} cuda resume: {'PASS' if bitwise else 'FAIL'} (steps {sorted(rs)}: {[rs.get(k) for k in (3, 4)]} vs uninterrupted {[tail.get(k) for k in (3, 4)]})")
print(f"RESULT ckpt {mesh} cuda checkpoint on cpu: {'PASS' if on_cpu else 'FAIL'} (steps {sorted(cs)}, losses within {d:.1e} of the cuda run)")
PY
  done
fi
# graph_pair TAG PLAN IO RUN-FLAGS...: the plan on CUDA with graphs (HZP_CUDA_EXPLAIN=1) and
# with --no-cuda-graph; the outputs in $W/TAG.{g,n}.*
graph_pair() {
  local tag=$1 plan=$2 io=$3; shift 3
  local f=$W/$tag
  HZP_CUDA_EXPLAIN=1 timeout $T $H run $plan --inputs $io --steps $STEPS --backend cuda "$@" --format json --save-params $f.g.npz >$f.g.out 2>$f.g.err || el "$tag with graphs: rc=$?"
  timeout $T $H run $plan --inputs $io --steps $STEPS --backend cuda --no-cuda-graph "$@" --format json --save-params $f.n.npz >$f.n.out 2>$f.n.err || el "$tag without graphs: rc=$?"
}
if want graph; then
  el "== CUDA graphs: $STEPS steps replayed from the graph captured at step 2 equal the same steps issued one by one, bit for bit (every explicit tiny model; --comm sync; gpu=2 with every rank on the GPU, where graphs are refused)"
  for spec in $EXPLICIT; do
    IFS=: read -r stem loss extra <<<"$spec"
    base=${stem%%.*}
    f=$W/$stem.graph
    $H compile --no-fuse-attention $M/$stem.onnx --inputs $M/$base.io.npz --loss $loss $extra --mesh gpu=1 -o $f.json >/dev/null 2>$f.cerr || { el "RESULT graph $stem: FAIL compile"; tail -5 $f.cerr; continue; }
    graph_pair $stem.graph $f.json $M/$base.io.npz
    grep -q "captured step 2" $f.g.err || el "RESULT graph $stem capture: FAIL ($(grep -i 'graph' $f.g.err | head -2 | tr '\n' ' '))"
    python3 $D/compare_bitwise.py "graph $stem" $f.n.out $f.g.out $f.n.npz $f.g.npz
  done
  f=$W/gpt2_tiny.legacy.op17.graph
  if [ -f $f.json ]; then
    graph_pair graph-sync $f.json $M/gpt2_tiny.io.npz --comm sync
    grep -q "captured step 2" $W/graph-sync.g.err || el "RESULT graph sync capture: FAIL"
    python3 $D/compare_bitwise.py "graph gpt2_tiny --comm sync" $W/graph-sync.n.out $W/graph-sync.g.out $W/graph-sync.n.npz $W/graph-sync.g.npz
  fi
  g2=$W/graph-gpu2
  tile $M/gpt2_tiny.io.npz $g2.io.npz 2
  $H compile --no-fuse-attention $M/gpt2_tiny.legacy.op17.onnx --inputs $g2.io.npz --loss lm --retie --mesh gpu=2 -o $g2.json >/dev/null 2>$g2.cerr || el "RESULT graph gpu=2: FAIL compile"
  graph_pair graph-gpu2 $g2.json $g2.io.npz --ranks-on-one-gpu
  n=$(grep -c "CUDA graphs off: every rank on one GPU" $g2.g.err)
  [ "$n" = 1 ] && el "RESULT graph gpu=2 ranks on one GPU refused: PASS (said once)" || el "RESULT graph gpu=2 ranks on one GPU refused: FAIL (said $n times)"
  python3 $D/compare_bitwise.py "graph gpu=2 refused, uncaptured" $g2.n.out $g2.g.out $g2.n.npz $g2.g.npz
fi
if want adamw; then
  el "== the multi-tensor AdamW (one launch for every parameter) equals one AdamW launch per parameter (HZP_CUDA_ADAMW_PER_NODE=1), bit for bit, every explicit tiny model"
  for spec in $EXPLICIT; do
    IFS=: read -r stem loss extra <<<"$spec"
    base=${stem%%.*}
    f=$W/$stem.adamw
    $H compile --no-fuse-attention $M/$stem.onnx --inputs $M/$base.io.npz --loss $loss $extra --mesh gpu=1 -o $f.json >/dev/null 2>$f.cerr || { el "RESULT adamw $stem: FAIL compile"; tail -5 $f.cerr; continue; }
    timeout $T $H run $f.json --inputs $M/$base.io.npz --steps $STEPS --backend cuda --format json --save-params $f.m.npz >$f.m.out 2>$f.m.err || el "adamw $stem multi: rc=$?"
    HZP_CUDA_ADAMW_PER_NODE=1 timeout $T $H run $f.json --inputs $M/$base.io.npz --steps $STEPS --backend cuda --format json --save-params $f.p.npz >$f.p.out 2>$f.p.err || el "adamw $stem per node: rc=$?"
    python3 $D/compare_bitwise.py "adamw $stem multi-tensor vs per node" $f.p.out $f.m.out $f.p.npz $f.m.npz
  done
fi
if want lt; then
  el "== cuBLASLt epilogues (HZP_CUDA_LT=1: bias, GELU with its pre-activation, DGELU and bias gradients in the products' calls) against the products and kernels apart, within 1e-4 (bf16: 1e-2), every explicit tiny model"
  for spec in $EXPLICIT; do
    IFS=: read -r stem loss extra <<<"$spec"
    base=${stem%%.*}
    # fp32, and bf16: the same products with bf16 operands, D, bias and aux (f32 accumulation)
    for leg in lt:fp32:1e-4 lt-bf16:bf16:1e-2; do
      IFS=: read -r name prec tol <<<"$leg"
      f=$W/$stem.$name
      $H compile --no-fuse-attention $M/$stem.onnx --inputs $M/$base.io.npz --loss $loss $extra --mesh gpu=1 --precision $prec -o $f.json >/dev/null 2>$f.cerr || { el "RESULT $name $stem: FAIL compile"; tail -5 $f.cerr; continue; }
      timeout $T $H run $f.json --inputs $M/$base.io.npz --steps $STEPS --backend cuda --format json --save-params $f.n.npz >$f.n.out 2>$f.n.err || el "$name $stem without: rc=$?"
      HZP_CUDA_LT=1 HZP_CUDA_EXPLAIN=1 timeout $T $H run $f.json --inputs $M/$base.io.npz --steps $STEPS --backend cuda --format json --save-params $f.y.npz >$f.y.out 2>$f.y.err || { el "RESULT $name $stem: FAIL rc=$?"; tail -20 $f.y.err; continue; }
      el "$name $stem: $(grep -c ': GELU_AUX_BIAS\|: BIAS\|: DGELU\|: BGRADA' $f.y.err) products with an epilogue, $(grep -c 'stays a cuBLAS product' $f.y.err) not wired"
      TOL=$tol python3 $D/compare_ranks.py "$name $stem cuBLASLt epilogues vs apart" $f.n.out $f.y.out $f.n.npz $f.y.npz
    done
  done
fi
if want e2e; then
  el "== the conformance suite (tests/run_e2e.rs) on every backend, the GPU's included (HZP_REQUIRE_GPU=1: a CUDA leg that cannot run fails)"
  HZP_REPO=$PWD HZP_BIN=$H HZP_REQUIRE_GPU=1 HZP_SKIPS_DIR=$O/e2e-skips timeout ${E2E_S:-300} $D/run_e2e --test-threads 2 >$O/run_e2e.txt 2>&1
  rc=$?
  tail -5 $O/run_e2e.txt
  if [ $rc = 0 ]; then el "RESULT e2e: PASS ($(grep -o '[0-9]* passed' $O/run_e2e.txt | tail -1))"; else el "RESULT e2e: FAIL rc=$rc (see run_e2e.txt)"; fi
fi
if want bench; then
  el "== same card, same call: PyTorch eager and torch.compile vs hzp (fp32, bf16), examples/bench/gpu_vs_torch.py"
  timeout ${BENCH_S:-300} python3 $D/gpu_vs_torch.py --hzp $H --configs ${BENCH_CONFIGS:-gpt2s} \
    --steps ${BENCH_STEPS:-10} --work $W/bench --out $O/gpu_vs_torch.json \
    && el "RESULT bench: PASS (wrote gpu_vs_torch.json)" || el "RESULT bench: FAIL rc=$?"
fi
(cd $W && tar czf $O/multi_rank_runs.tgz --exclude='*.npz' --exclude='*.onnx' --exclude='*.json.data' . 2>/dev/null)
grep '^\[.*RESULT\|^RESULT' "$O/multi_rank.txt" | sed -E 's/^\[[0-9]+s\] //' > "$O/results.txt"
el "== done: $(grep -c PASS $O/results.txt) PASS, $(grep -c -E 'FAIL|MISMATCH' $O/results.txt) FAIL/MISMATCH"
