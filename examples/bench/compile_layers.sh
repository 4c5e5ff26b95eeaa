#!/bin/sh
# Compile time of `hzp compile preset:gpt,layers=L --mesh gpu=8` for L = 96, 192, 384, 768
# (or the layer counts given), with the ratio per doubling (the target: at most 2.3)
# and the compiler's phases (HZP_PROFILE_COMPILE=1).
#   examples/bench/compile_layers.sh            # release build, 96 192 384 768
#   HZP=target/debug/hzp examples/bench/compile_layers.sh 24 48 96
set -eu
cd "$(dirname "$0")/../.."
HZP="${HZP:-target/release/hzp}"
if [ "$HZP" = target/release/hzp ]; then cargo build --release --quiet --bin hzp; fi
[ "$#" -gt 0 ] || set -- 96 192 384 768
prev=""
for L in "$@"; do
    out=$(HZP_PROFILE_COMPILE=1 "$HZP" compile "preset:gpt,layers=$L" --mesh gpu=8 2>&1 >/dev/null)
    t=$(printf '%s\n' "$out" | awk '/ s$/ { s += $(NF-1) } END { printf "%.3f", s }')
    if [ -n "$prev" ]; then
        ratio=$(awk -v a="$t" -v b="$prev" 'BEGIN { printf "%.2f", a / b }')
        echo "layers $L: $t s (x$ratio vs the previous count)"
    else
        echo "layers $L: $t s"
    fi
    printf '%s\n' "$out" | grep ' s$' | sed 's/^/    /'
    prev=$t
done
