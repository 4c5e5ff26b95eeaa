#!/usr/bin/env python3
"""PyTorch reference for hzp's training runs over a token file.

Writes, next to this file, in tokens/:

  tokens/train.bin          byte-level tokens (vocabulary 256, little-endian uint16,
                            nanoGPT's raw format) of a fixed text: this script's own
                            source followed by make_models.py's, 12288 tokens
  tokens/gpt2_cosine.ref.npz  `losses` (one per step) and `lrs` of PyTorch training the
                            tiny GPT-2 of make_models.py (seed 0, its perturbation) on
                            that file with torch.optim.AdamW (lr 3e-3 maximum, torch's
                            defaults otherwise) and nanoGPT's get_lr (cosine, warmup 2,
                            min lr 3e-4, lr_decay_iters = STEPS)

Sampling is hzp's: the file is cut into windows of SEQ tokens; step s, row r of a batch of
BATCH rows reads window (s * BATCH + r) mod floor(N / SEQ). The loss is transformers' causal
LM loss with labels = input_ids (what `hzp --loss lm` computes).

Usage: /work/venv-models/bin/python tests/models/make_token_refs.py
(needs torch and transformers; see README.md beside this file).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import make_models as mm  # noqa: E402
import make_refs  # noqa: E402

OUT = HERE / "tokens"
TOKENS = 12288
BATCH = 4
SEQ = 32
STEPS = 8
LR = 3e-3
WARMUP = 2
MIN_LR = 3e-4


def get_lr(it: int) -> float:
    """nanoGPT's get_lr with warmup_iters = WARMUP, lr_decay_iters = STEPS."""
    if it < WARMUP:
        return LR * (it + 1) / (WARMUP + 1)
    if it > STEPS:
        return MIN_LR
    ratio = (it - WARMUP) / (STEPS - WARMUP)
    coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))
    return MIN_LR + coeff * (LR - MIN_LR)


def main() -> int:
    OUT.mkdir(exist_ok=True)
    text = Path(__file__).read_bytes() + (HERE / "make_models.py").read_bytes()
    data = np.frombuffer(text[:TOKENS], dtype=np.uint8).astype("<u2")
    assert len(data) == TOKENS, len(data)
    data.tofile(OUT / "train.bin")
    windows = TOKENS // SEQ

    torch.set_num_threads(1)
    model, _ = make_refs.build_own("gpt2_tiny")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, lrs = [], []
    for s in range(STEPS):
        lr = get_lr(s)
        for g in opt.param_groups:
            g["lr"] = lr
        rows = [data[((s * BATCH + r) % windows) * SEQ:][:SEQ] for r in range(BATCH)]
        ids = torch.from_numpy(np.stack(rows).astype(np.int64))
        loss = make_refs.hf_lm_loss(model, ids)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        lrs.append(lr)
        print(f"step {s + 1}  loss {loss.item():.6f}  lr {lr:.3e}")
    np.savez(OUT / "gpt2_cosine.ref.npz", losses=np.array(losses), lrs=np.array(lrs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
