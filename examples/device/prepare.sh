#!/bin/bash
# Run in the project's root. Fills .device/ (git-ignored through .git/info/exclude) with what
# multi_rank_check.sh needs on the device machine: a stripped release hzp built with
# --features cuda, the PASA kernel check (runtime/tests/cuda_pasa.rs), the MoE kernel check
# (runtime/tests/cuda_moe.rs) and the conformance
# suite (tests/run_e2e.rs) as test binaries,
# examples/bench/train_vs_torch.py (GPT-2 small's model and export) and the
# scripts beside this one. Then: device run, carry [".device"], command
# `bash .device/multi_rank_check.sh`.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
grep -qx '/.device/' .git/info/exclude 2>/dev/null || echo '/.device/' >> .git/info/exclude
cargo build --release --features cuda --bin hzp
rm -rf .device; mkdir -p .device
# the commit the binaries are built at (uncommitted changes marked), for the result files
(git rev-parse --short HEAD; git diff --quiet HEAD || echo "+changes") | paste -sd" " > .device/COMMIT
cp "${CARGO_TARGET_DIR:-target}/release/hzp" .device/hzp; strip .device/hzp || true
# the PASA kernel check (runtime/tests/cuda_pasa.rs) as a test binary
pasa=$(cargo test --release -p hzp-runtime --features cuda --test cuda_pasa --no-run --message-format=json \
  | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "cuda_pasa": print(m["executable"])')
cp "$pasa" .device/cuda_pasa; strip .device/cuda_pasa || true
# the MoE kernels on the GPU against the CPU kernels (runtime/tests/cuda_moe.rs), likewise
moe=$(cargo test --release -p hzp-runtime --features cuda --test cuda_moe --no-run --message-format=json \
  | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "cuda_moe": print(m["executable"])')
cp "$moe" .device/cuda_moe; strip .device/cuda_moe || true
# the conformance suite (tests/run_e2e.rs) with its CUDA leg, run there with HZP_REPO=the
# checkout, HZP_BIN=.device/hzp and HZP_REQUIRE_GPU=1 (PART=e2e of multi_rank_check.sh)
e2e=$(cargo test --release --features cuda --test run_e2e --no-run --message-format=json \
  | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "run_e2e": print(m["executable"])')
cp "$e2e" .device/run_e2e; strip .device/run_e2e || true
cp examples/bench/train_vs_torch.py examples/bench/gpu_vs_torch.py "$here"/multi_rank_check.sh "$here"/compare_ranks.py "$here"/compare_bitwise.py "$here"/make_gpt2s.py .device/
# the PyTorch-vs-hzp speed bench of ../shared/device (GPT-2 configs), when it is beside us:
# python3 .device/gpu_bench.py --hzp .device/hzp --work /tmp/bench --out $OUT --configs gpt2s
shared=$(cd "$here/../.." && pwd)/../shared/device/gpu_bench.py
[ -f "$shared" ] && cp "$shared" .device/ || echo "note: $shared not found: .device/ has no gpu_bench.py"
du -sh .device
