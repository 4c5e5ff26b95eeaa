#!/usr/bin/env python3
"""The moe_tiny model (make_models.py) trained with the routers' auxiliary load-balancing
loss, as transformers' Mixtral computes it: `labels=input_ids`, `output_router_logits=True`,
`router_aux_loss_coef=COEF`, no attention mask, so the loss is
`lm_loss + COEF * load_balancing_loss_func(router logits of every layer)`.

The oracle of `routed_moe_tiny_with_router_aux_loss_matches_transformers` in
passes/tests/autodiff_fd.rs. It reads the parameters and input ids the other moe_tiny
references use (moe_tiny.grads.npz `param/<name>`, moe_tiny.io.npz `input_ids`) and writes
moe_tiny.aux.npz beside this file: `coef`, `loss` (the total), `lm_loss`, `aux_loss` and
`grad/<name>` of the total for every parameter (float32).

Usage: python3 tests/models/make_moe_aux_refs.py   (deterministic: no random numbers)
"""

from pathlib import Path

import numpy as np
import torch
from transformers import MixtralForCausalLM

from make_models import build_moe

HERE = Path(__file__).resolve().parent
COEF = 0.05


def main() -> None:
    torch.manual_seed(0)
    model = build_moe()
    with np.load(HERE / "moe_tiny.grads.npz") as z:
        params = {k[len("param/"):]: z[k] for k in z.files if k.startswith("param/")}
    with np.load(HERE / "moe_tiny.io.npz") as z:
        ids = torch.from_numpy(z["input_ids"]).long()
    names = [n for n, _ in model.named_parameters()]
    assert sorted(names) == sorted(params), "parameter names differ from moe_tiny.grads.npz"
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(torch.from_numpy(params[n]))
    model.router_aux_loss_coef = COEF
    model.eval()
    model.zero_grad(set_to_none=True)
    out = MixtralForCausalLM.forward(
        model, input_ids=ids, labels=ids, output_router_logits=True, use_cache=False
    )
    lm = out.loss.item() - COEF * out.aux_loss.item()
    assert out.aux_loss.requires_grad, "the aux loss carries no gradient"
    out.loss.backward()
    arrays = {
        "coef": np.array(COEF, dtype=np.float32),
        "loss": np.array(out.loss.item(), dtype=np.float32),
        "lm_loss": np.array(lm, dtype=np.float32),
        "aux_loss": np.array(out.aux_loss.item(), dtype=np.float32),
    }
    for n, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        arrays[f"grad/{n}"] = g.detach().numpy().astype(np.float32)
    np.savez(HERE / "moe_tiny.aux.npz", **arrays)
    print(f"loss {out.loss.item():.6f} = lm {lm:.6f} + {COEF} * aux {out.aux_loss.item():.6f}")


if __name__ == "__main__":
    main()
