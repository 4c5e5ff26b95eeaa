#!/usr/bin/env python3
"""PyTorch mixed-precision references for hzp's bf16 training (`--precision bf16`).

For every own test model (make_models.py's MODELS, rebuilt exactly as make_refs.py does:
same seed and perturbation), this runs 5 AdamW steps on the model's batch
(`<model>.io.npz`) twice:

  fp32      plain fp32 training (the numbers of ref/*.ref.npz's adamw5_loss)
  autocast  the forward and loss under torch.autocast("cpu", dtype=torch.bfloat16),
            backward and optimizer in fp32 on fp32 parameters: PyTorch's usual mixed
            precision recipe

with the settings of make_refs.py (lr 1e-3, betas 0.9/0.999, eps 1e-8, weight decay 0.01)
and the same losses (causal LM cross-entropy for decoders, mean of the output otherwise).
It writes ref/autocast_bf16.json: {model: {"fp32": [5 losses], "autocast": [5 losses]}}.

hzp's bf16 differs by design from autocast (hzp computes every op in bf16 except the loss
and the optimizer, autocast keeps softmax, norms and reductions in fp32), so the test
(tests/training.rs) compares within a stated tolerance, not bit for bit.

Usage: python tests/models/make_autocast_refs.py   (torch, transformers, numpy)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.dont_write_bytecode = True
sys.path.insert(0, str(HERE))
import make_models as mm  # noqa: E402
import make_refs as mr  # noqa: E402

STEPS = 5


def run(model, inputs: dict, is_decoder: bool, autocast: bool) -> list[float]:
    opt = torch.optim.AdamW(
        [p for _, p in model.named_parameters()],
        lr=mr.ADAMW["lr"],
        betas=tuple(mr.ADAMW["betas"]),
        eps=mr.ADAMW["eps"],
        weight_decay=mr.ADAMW["weight_decay"],
    )
    losses = []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = mr.compute_loss(model, inputs, is_decoder)
        loss = loss.float()
        losses.append(loss.item())
        loss.backward()
        opt.step()
    return losses


def main() -> int:
    torch.set_num_threads(1)
    out = {}
    for name in mm.MODELS:
        model, is_decoder = mr.build_own(name)
        with np.load(HERE / f"{name}.io.npz") as z:
            inputs = {k: torch.from_numpy(z[k]) for k in z.files if k != "torch_out"}
        init = mr.snapshot(model)
        fp32 = run(model, inputs, is_decoder, autocast=False)
        mr.restore(model, init)
        amp = run(model, inputs, is_decoder, autocast=True)
        out[name] = {"fp32": fp32, "autocast": amp}
        print(f"{name}: fp32 {fp32[0]:.5f} -> {fp32[-1]:.5f}, autocast {amp[0]:.5f} -> {amp[-1]:.5f}")
    path = HERE / "ref" / "autocast_bf16.json"
    path.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
