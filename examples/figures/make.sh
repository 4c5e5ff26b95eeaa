#!/usr/bin/env bash
# Regenerates the figures of the README (deterministic: the same hzp gives the same bytes):
#   gantt.svg   - the streams of one rank over one simulated step
#   memory.svg  - memory per rank over the step, stacked by buffer kind
#   compare.md  - asynchzp vs zero3 vs hsdp vs ddp on the same model and mesh
# Usage: examples/figures/make.sh [path/to/hzp]   (default: target/debug/hzp; build it first)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
hzp="${1:-}"
hzp="${hzp:-$root/target/debug/hzp}"
model="preset:gpt,layers=4,hidden=1024,heads=16,vocab=8192,seq=512,batch=4"
mesh="node=2,gpu=8"
tmp="$(mktemp -d)"
"$hzp" compile "$model" --mesh "$mesh" --precision bf16 \
  --shard params=gpu,grads=gpu,optim=node.gpu -o "$tmp/plan.json" >/dev/null
"$hzp" simulate "$tmp/plan.json" --timeline "$here/gantt.svg" --memory-plot "$here/memory.svg"
"$hzp" compare "$model" --mesh "$mesh" --precision bf16 --quiet --format markdown >"$here/compare.md"
rm -rf "$tmp"
echo "wrote $here/gantt.svg $here/memory.svg $here/compare.md"
