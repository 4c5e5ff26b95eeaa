#!/usr/bin/env python3
"""ACCO reference for hzp's `--strategy acco`, written from the paper's pseudo-code.

ACCO (Nabli et al., "ACCO: Accumulate While You Communicate for Communication-Overlapped
Sharded LLM Training", arXiv 2406.02613) splits every step's batch into two halves. While
one half's gradients are computed, the other half's are reduced and the (sharded) optimizer
runs; to undo the one-step delay, the first half's gradients are taken at an *estimate* of
the next parameters, made with the optimizer from the previous half-batch gradient, and the
committed update uses the mean of the two half-batch gradients:

    step k (primed after the first step):
      commit     if primed: w, m, v, t = AdamW(w, (g_est_prev + g_prev) / 2)
      phase 1    g_est = grad(loss on half 1) at (est if primed else w)
      phase 2    g     = grad(loss on half 2) at w
      estimate   est   = AdamW(w, g_est) with the committed moments, which it does not keep
      keep       g_est_prev, g_prev = g_est, g

The first step commits nothing (there are no gradients yet), so N steps make N - 1 updates.
Sharding does not change the arithmetic, so this runs on one process; what the rank count
changes is which rows make each half: hzp gives rank r the r-th contiguous block of a
step's rows and cuts each rank's block into its micro-batches, the first half of them
making phase 1. The reported loss is the mean over both halves.

Writes tokens/acco_w{1,2,4}.ref.npz (`losses`) for the tiny GPT-2 of make_models.py on
tokens/train.bin (made by make_token_refs.py): batches of 4 x 32 tokens (8 x 32 for 4
ranks), 8 steps, AdamW
lr 3e-3 (torch's defaults otherwise) with nanoGPT's cosine schedule (warmup 2, min lr
3e-4) as in make_token_refs.py; the rate of step k is used by both its commit and its
estimate.

Usage: /work/venv-torch/bin/python tests/models/make_acco_refs.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import make_refs  # noqa: E402
import make_token_refs as tr  # noqa: E402

BETAS = (0.9, 0.999)
EPS = 1e-8
WD = 0.01


def adamw(w, g, m, v, t, lr):
    """torch.optim.AdamW's update of one tensor (returns new w, m, v; inputs untouched)."""
    w = w * (1 - lr * WD)
    m = BETAS[0] * m + (1 - BETAS[0]) * g
    v = BETAS[1] * v + (1 - BETAS[1]) * g * g
    bc1 = 1 - BETAS[0] ** t
    bc2 = 1 - BETAS[1] ** t
    denom = (v.sqrt() / (bc2**0.5)) + EPS
    return w - (lr / bc1) * m / denom, m, v


def grads_at(model, names, values, ids):
    """Loss and gradients of the mean LM loss on `ids` with the parameters set to `values`."""
    with torch.no_grad():
        for p, val in zip(model.parameters(), values):
            p.copy_(val)
    model.zero_grad(set_to_none=True)
    loss = make_refs.hf_lm_loss(model, ids)
    loss.backward()
    return loss.item(), [p.grad.detach().clone() for p in model.parameters()]


def halves(data, step, ranks, batch, windows):
    """Rows of phase 1 and phase 2 of `step` with `ranks` ranks (one micro-batch per half)."""
    rows = [data[((step * batch + r) % windows) * tr.SEQ:][: tr.SEQ] for r in range(batch)]
    per = batch // ranks
    first, second = [], []
    for r in range(ranks):
        block = rows[r * per:(r + 1) * per]
        first += block[: per // 2]
        second += block[per // 2:]
    as_ids = lambda rs: torch.from_numpy(np.stack(rs).astype(np.int64))  # noqa: E731
    return as_ids(first), as_ids(second)


def run(ranks: int, batch: int) -> list[float]:
    data = np.fromfile(tr.OUT / "train.bin", dtype="<u2")
    windows = len(data) // tr.SEQ
    torch.set_num_threads(1)
    model, _ = make_refs.build_own("gpt2_tiny")
    model.train()
    names = [n for n, _ in model.named_parameters()]
    w = [p.detach().clone() for p in model.parameters()]
    m = [torch.zeros_like(x) for x in w]
    v = [torch.zeros_like(x) for x in w]
    t = 0
    est = None
    g_est_prev = g_prev = None
    losses = []
    for k in range(tr.STEPS):
        lr = tr.get_lr(k)
        if g_prev is not None:
            t += 1
            stepped = [
                adamw(w[i], (g_est_prev[i] + g_prev[i]) / 2, m[i], v[i], t, lr)
                for i in range(len(w))
            ]
            w = [s[0] for s in stepped]
            m = [s[1] for s in stepped]
            v = [s[2] for s in stepped]
        h1, h2 = halves(data, k, ranks, batch, windows)
        l1, g_est = grads_at(model, names, est if est is not None else w, h1)
        l2, g = grads_at(model, names, w, h2)
        est = [adamw(w[i], g_est[i], m[i], v[i], t + 1, lr)[0] for i in range(len(w))]
        g_est_prev, g_prev = g_est, g
        losses.append((l1 + l2) / 2)
        print(f"ranks {ranks} step {k + 1}  loss {losses[-1]:.6f}  lr {lr:.3e}")
    return losses


def main() -> int:
    # (ranks, rows per step): 4 ranks take 8 rows, so that each rank's block halves
    for ranks, batch in ((1, 4), (2, 4), (4, 8)):
        losses = run(ranks, batch)
        np.savez(tr.OUT / f"acco_w{ranks}.ref.npz", losses=np.array(losses))
    return 0


if __name__ == "__main__":
    sys.exit(main())
