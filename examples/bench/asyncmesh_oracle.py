#!/usr/bin/env python3
"""PyTorch model of AsyncMesh's averaging rule, beside synchronous training.

An oracle for the question "is asyncmesh's loss gap hzp's or the algorithm's?". It trains
the tiny GPT-2 of tests/models/ (make_refs.build_own: the same weights hzp's benchmark starts
from) with torch.optim.AdamW on the token files that examples/bench/strategies_cpu.py
prepares, nanoGPT's cosine schedule (warmup 20, min lr a tenth), and runs one of:

  sync     one model, the whole batch (what asynchzp computes)
  half     one model, the first half of each batch (one replica's data)
  exact    R replicas, each with its own AdamW on its rows, parameters set to the
           replicas' mean after every step (no staleness, no sparsity: the best any
           scheme with per-replica optimizers can do)
  mesh     hzp's asyncmesh rule (passes/src/dist/asyncmesh.rs), per parameter of n
           elements, k = ceil(S n): idx = (t k + [0, k)) mod n; send theta[idx] + u[idx]
           before the local step; after it theta'[idx] = mean(sent) + d[idx] - u[idx]
           (u as sent), u = B u + (1 - B) d

and prints the held-out loss (the replicas' mean, on the first 16 batches of the validation
file, as `hzp run --eval-batches 16` does). Sampling is this script's own (a seeded
permutation per step), so compare variants with each other, not with hzp's figures.

  python3 examples/bench/strategies_cpu.py --strategies asynchzp   # prepares the tokens
  /path/to/venv/bin/python examples/bench/asyncmesh_oracle.py mesh --sparsity 0.05 \\
      --ema-beta 0.9 --rows 16 --seeds 1,2,3

Needs torch and transformers (tests/models/README.md).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests/models"))
import make_refs  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("variant", choices=["sync", "half", "exact", "mesh"])
    ap.add_argument("--rows", type=int, default=16, help="global batch rows (T = 64)")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--sparsity", type=float, default=0.05)
    ap.add_argument("--ema-beta", type=float, default=0.9)
    ap.add_argument("--constant", action="store_true", help="a constant rate (no schedule)")
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--workdir", default="/tmp/hzp-strategies")
    a = ap.parse_args()
    torch.set_num_threads(1)
    wd = Path(a.workdir)
    train = np.memmap(wd / "stdlib.bin", dtype="<u2", mode="r")
    val = np.memmap(wd / "stdlib.val.bin", dtype="<u2", mode="r")
    seq = 64
    windows = len(train) // seq
    val_rows = [torch.from_numpy(np.stack([val[(b * a.rows + r) * seq:][:seq]
                                           for r in range(a.rows)]).astype(np.int64))
                for b in range(16)]

    def lr_at(it: int) -> float:
        warmup, lo = 20, a.lr / 10
        if a.constant:
            return a.lr
        if it < warmup:
            return a.lr * (it + 1) / (warmup + 1)
        ratio = (it - warmup) / (a.steps - warmup)
        return lo + 0.5 * (1 + math.cos(math.pi * ratio)) * (a.lr - lo)

    def run(seed: int) -> float:
        n_models = 1 if a.variant in ("sync", "half") else a.replicas
        models = [make_refs.build_own("gpt2_tiny")[0] for _ in range(n_models)]
        for m in models:
            m.train()
        opts = [torch.optim.AdamW(m.parameters(), lr=a.lr) for m in models]
        params = [list(m.parameters()) for m in models]
        us = [[torch.zeros_like(p) for p in ps] for ps in params]
        rng = np.random.default_rng(seed)
        per = a.rows // a.replicas
        for t in range(a.steps):
            w = rng.integers(0, windows, a.rows)
            ids = torch.from_numpy(np.stack([train[i * seq:][:seq] for i in w]).astype(np.int64))
            for o in opts:
                for g in o.param_groups:
                    g["lr"] = lr_at(t)
            before = [[p.detach().clone() for p in ps] for ps in params]
            for r, (m, o) in enumerate(zip(models, opts)):
                rows = ids if a.variant == "sync" else ids[r * per:(r + 1) * per]
                o.zero_grad(set_to_none=True)
                make_refs.hf_lm_loss(m, rows).backward()
                o.step()
            if n_models == 1:
                continue
            with torch.no_grad():
                for j in range(len(params[0])):
                    if a.variant == "exact":
                        mean = sum(ps[j] for ps in params) / n_models
                        for ps in params:
                            ps[j].copy_(mean)
                        continue
                    n = params[0][j].numel()
                    k = min(n, math.ceil(a.sparsity * n))
                    idx = (t * k + torch.arange(k)) % n
                    sent = [(before[r][j] + us[r][j]).reshape(-1)[idx] for r in range(n_models)]
                    avg = sum(sent) / n_models
                    for r in range(n_models):
                        d = params[r][j] - before[r][j]
                        flat = params[r][j].view(-1)
                        flat[idx] = avg + d.reshape(-1)[idx] - us[r][j].reshape(-1)[idx]
                        us[r][j].mul_(a.ema_beta).add_((1 - a.ema_beta) * d)
        with torch.no_grad():
            for j, p in enumerate(params[0]):
                p.copy_(sum(ps[j] for ps in params) / n_models)
            models[0].eval()
            return float(np.mean([make_refs.hf_lm_loss(models[0], v).item() for v in val_rows]))

    for seed in (int(s) for s in a.seeds.split(",")):
        loss = run(seed)
        print(f"{a.variant} rows {a.rows} replicas {a.replicas} lr {a.lr:g}"
              f"{' constant' if a.constant else ''} S {a.sparsity:g} "
              f"B {a.ema_beta:g} seed {seed}: val loss {loss:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
