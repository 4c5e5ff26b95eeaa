#!/bin/sh
# Fuzz hzp's readers: the ONNX importer, the text IR parser, the .npz reader and plan.json
# loading, SECONDS each (default 60), or only TARGET (onnx, text, npz, plan; onnx-fields and
# plan-fields mutate the decoded model / plan JSON and encode it again, the plan's content
# hash recomputed, so inputs get past decoding and the hash check).
#   examples/fuzz/run.sh 600          # ten minutes per target
#   examples/fuzz/run.sh 60 npz
# Inputs that panic or take over 5 s are saved under tests/fuzz/crashes/TARGET/ (commit them:
# `cargo test --test fuzz` replays them on every run) and the run fails naming them. Each
# stage's smallest input, shrunk, goes to tests/fuzz/corpus/TARGET/<stage> when at most 8 KB
# and smaller than the file there (commit them and raise CORPUS_FILES in tests/fuzz.rs).
set -eu
cd "$(dirname "$0")/../.."
SECONDS_PER_TARGET="${1:-60}"
export HZP_FUZZ_SECONDS="$SECONDS_PER_TARGET"
if [ "$#" -ge 2 ]; then export HZP_FUZZ_TARGET="$2"; fi
exec cargo test --release --test fuzz -- --ignored --nocapture fuzz
