"""CPU training step of a seq-1024 GPT-2, attention fused (default) vs written out
(`--no-fuse-attention`): median step time and peak resident memory of `hzp train`.

A benchmark, not a test. Builds a GPT-2 with `transformers` (fixed seed; hidden 256, 4
layers, 4 heads, vocab 8192, 1024 positions, batch 2 x 1024, dropout 0), exports it with the
legacy exporter at opset 17 (the `train_vs_torch.py` model class), and runs
`hzp train MODEL --inputs batch.npz --loss lm --retie --steps N --format json` twice, with
`/usr/bin/time -v` for the peak resident set. Both runs must give the same losses (1e-4).

    cargo build --release
    /work/venv-torch/bin/python examples/bench/attention_seq1024.py [--steps 4] [--threads 2]
"""

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_vs_torch as base  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def run(hzp, model, batch, steps, threads, fuse):
    cmd = [
        "/usr/bin/time", "-v", str(hzp), "train", str(model), "--inputs", str(batch),
        "--loss", "lm", "--retie", "--steps", str(steps), "--format", "json",
    ]
    if not fuse:
        cmd.append("--no-fuse-attention")
    env = dict(os.environ, HZP_NUM_THREADS=str(threads))
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"hzp failed ({r.returncode}):\n{r.stderr}")
    out = json.loads(r.stdout)
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr).group(1))
    steps_s = sorted(out["step_seconds"][1:]) or out["step_seconds"]
    return out["losses"], steps_s[len(steps_s) // 2], rss / 1024


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workdir", default="/tmp/hzp-attn-bench")
    ap.add_argument("--hzp", default=str(ROOT / "target/release/hzp"))
    a = ap.parse_args()
    base.CONFIG.update(vocab=8192, hidden=256, layers=4, heads=4, seq=1024, batch=2)
    wd = Path(a.workdir)
    wd.mkdir(parents=True, exist_ok=True)
    model, batch = wd / "gpt2_seq1024.onnx", wd / "batch.npz"
    if not model.exists():
        m = base.build_model()
        ids = base.make_batch()
        base.export(m, ids, model)
        np.savez(batch, input_ids=ids.numpy())
    rows = {}
    for fuse in (False, True):
        rows[fuse] = run(a.hzp, model, batch, a.steps, a.threads, fuse)
    (l0, t0, m0), (l1, t1, m1) = rows[False], rows[True]
    for x, y in zip(l0, l1):
        assert abs(x - y) <= 1e-4 * abs(x), f"losses differ: {l0} vs {l1}"
    print(f"GPT-2 seq 1024 (hidden 256, 4 layers, batch 2), {a.threads} threads, {a.steps} steps")
    print(f"  explicit attention: median step {t0 * 1e3:.0f} ms, peak RSS {m0:.0f} MiB")
    print(f"  fused attention:    median step {t1 * 1e3:.0f} ms, peak RSS {m1:.0f} MiB")
    print(f"  speedup {t0 / t1:.2f}x, memory {m1 / m0:.2f}x; losses {l1}")


if __name__ == "__main__":
    main()
