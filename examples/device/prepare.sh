#!/bin/bash
# Run in the project's root. Fills .device/ (git-ignored through .git/info/exclude) with what
# multi_rank_check.sh needs on the device machine: a stripped release hzp built with
# --features cuda, examples/bench/train_vs_torch.py (GPT-2 small's model and export) and the
# scripts beside this one. Then: device run, carry [".device"], command
# `bash .device/multi_rank_check.sh`.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
grep -qx '/.device/' .git/info/exclude 2>/dev/null || echo '/.device/' >> .git/info/exclude
cargo build --release --features cuda --bin hzp
rm -rf .device; mkdir -p .device
cp "${CARGO_TARGET_DIR:-target}/release/hzp" .device/hzp; strip .device/hzp || true
cp examples/bench/train_vs_torch.py "$here"/multi_rank_check.sh "$here"/compare_ranks.py "$here"/make_gpt2s.py .device/
du -sh .device
