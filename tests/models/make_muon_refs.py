#!/usr/bin/env python3
"""PyTorch references for hzp's `--optimizer muon` (tests/training.rs).

For the tiny GPT-2 and Llama (make_models.py's MODELS, rebuilt exactly as make_refs.py
does: same seed and perturbation) this runs 5 steps of torch.optim.Muon + torch.optim.AdamW
on a batch of 8 x 32 seeded token ids (ref/muon_batch.npz), with hzp's parameter split:

  Muon   every 2-D parameter except the token/position embedding tables and the LM head,
         torch's defaults except lr (weight decay 0.1, momentum 0.95, Nesterov, 5
         Newton-Schulz steps, adjust_lr_fn "original" / "match_rms_adamw"), lr 0.02
  AdamW  every other parameter, torch's defaults (lr 1e-3, betas 0.9/0.999, eps 1e-8,
         weight decay 0.01)

torch.optim.Muon reads the matrix's output and input features (A, B of its lr adjustment)
from the parameter's shape, [out, in] as nn.Linear stores it. GPT-2's Conv1D stores its
weight [in, out], so before training the script turns every Conv1D into the nn.Linear it
is (weight transposed, same bias): Muon then sees the linear map as hzp reads it from the
graph. The stored results are transposed back, so they are keyed like the ONNX files'
initializers (see ref/<stem>.ref.json's `initializers` mapping).

CONTROL. Newton-Schulz runs in bf16. Where a gradient matrix has lower rank than its
smaller side (the models' own 2 x 16 batch: 30 predicted tokens against 64-wide matrices)
the orthogonalization lifts the bf16 rounding noise of the null directions to singular
values near 1, so a gradient that differs by round-off (another summation order) moves the
parameters by a few percent (measured: 3e-2 on the worst matrix, torch against itself), in
directions the batch's loss does not see. Hence the larger batch, whose gradients have full
rank. The script still measures what round-off alone does, on torch itself (the same run
with gradients scaled by 1 + 2^-20, which both optimizers' updates ignore in exact
arithmetic), and records it as "control".

Writes
  ref/muon_refs.json       {"<model>/<adjust>": {"losses": [5 losses before each step,
                            then the loss after the 5th], "muon": [torch names],
                            "adamw": [torch names], "control": {"whole", "worst",
                            "worst_param", "losses": relative distances of the control
                            run}}, "settings": {...}}
  ref/muon5.<model>.<adjust>.npz   the parameters after the 5 steps, by torch name
  "<model>/original/ns_f32", ref/muon5.<model>.original.ns_f32.npz: the same with
                            Newton-Schulz in float32 (hzp's --muon-ns-precision fp32)

Usage: /work/venv-torch/bin/python tests/models/make_muon_refs.py   (torch >= 2.9,
transformers, numpy; about 5 s on the CPU)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.optim._muon as muon_mod
from transformers.pytorch_utils import Conv1D

HERE = Path(__file__).resolve().parent
sys.dont_write_bytecode = True
sys.path.insert(0, str(HERE))
import make_models as mm  # noqa: E402
import make_refs as mr  # noqa: E402

STEPS = 5
MUON = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True, "ns_steps": 5}
ADAMW = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}
MODELS = ["gpt2_tiny", "llama_tiny"]
# 8 x 32 token ids (seeded): 248 predicted positions, more than any matrix side (64, 128),
# so every gradient matrix has full rank (see CONTROL)
BATCH = HERE / "ref" / "muon_batch.npz"
BATCH_SHAPE = (8, 32)
ADJUST = ["original", "match_rms_adamw"]
# embedding tables (read by a lookup) and the LM head: AdamW
NOT_MUON = ("wte.weight", "wpe.weight", "embed_tokens.weight", "lm_head.weight")


def conv1d_to_linear(model) -> set[str]:
    """Replaces every Conv1D by an equal nn.Linear; returns the weights' parameter names."""
    names = set()
    for mname, mod in list(model.named_modules()):
        for cname, child in list(mod.named_children()):
            if isinstance(child, Conv1D):
                nx, nf = child.weight.shape
                lin = torch.nn.Linear(nx, nf)
                with torch.no_grad():
                    lin.weight.copy_(child.weight.T)
                    lin.bias.copy_(child.bias)
                setattr(mod, cname, lin)
                names.add(f"{mname}.{cname}.weight" if mname else f"{cname}.weight")
    return names


def newton_schulz_f32(grad, ns_coefficients, ns_steps, eps):
    """torch's Newton-Schulz iteration kept in float32 (no bf16 copy): what hzp computes
    with --muon-ns-precision fp32. Written out here, not copied: the same steps as the
    docstring of torch.optim.Muon."""
    a, b, c = ns_coefficients
    x = grad.to(torch.float32, copy=True)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        g = x @ x.T
        h = b * g + c * (g @ g)
        x = a * x + h @ x
    return x.T if tall else x


def run(name: str, adjust: str, grad_scale: float = 1.0, ns_f32: bool = False):
    model, is_decoder = mr.build_own(name)
    with np.load(BATCH) as z:
        inputs = {k: torch.from_numpy(z[k]) for k in z.files}
    transposed = conv1d_to_linear(model)
    muon, adamw = [], []
    for n, p in model.named_parameters():
        (muon if p.ndim == 2 and not n.endswith(NOT_MUON) else adamw).append((n, p))
    opt_m = torch.optim.Muon(
        [p for _, p in muon],
        lr=MUON["lr"],
        weight_decay=MUON["weight_decay"],
        momentum=MUON["momentum"],
        nesterov=MUON["nesterov"],
        ns_steps=MUON["ns_steps"],
        adjust_lr_fn=adjust,
    )
    opt_a = torch.optim.AdamW(
        [p for _, p in adamw],
        lr=ADAMW["lr"],
        betas=tuple(ADAMW["betas"]),
        eps=ADAMW["eps"],
        weight_decay=ADAMW["weight_decay"],
    )
    losses = []
    saved_ns = muon_mod._zeropower_via_newtonschulz
    if ns_f32:
        muon_mod._zeropower_via_newtonschulz = newton_schulz_f32
    for _ in range(STEPS):
        opt_m.zero_grad(set_to_none=True)
        opt_a.zero_grad(set_to_none=True)
        loss = mr.compute_loss(model, inputs, is_decoder)
        losses.append(loss.item())
        (loss * grad_scale).backward()
        opt_m.step()
        opt_a.step()
    muon_mod._zeropower_via_newtonschulz = saved_ns
    with torch.no_grad():
        losses.append(mr.compute_loss(model, inputs, is_decoder).item())
    params = {}
    for n, p in model.named_parameters():
        v = p.detach().numpy()
        params[n] = np.ascontiguousarray(v.T if n in transposed else v).astype(np.float32)
    return losses, [n for n, _ in muon], [n for n, _ in adamw], params


def control(a: dict, b: dict):
    """Relative L2 distance of parameter sets a and b: whole model, worst parameter."""
    dd = nn = 0.0
    worst, wname = 0.0, ""
    for k in a:
        d = float(np.linalg.norm(a[k].astype(np.float64) - b[k]))
        n = float(np.linalg.norm(a[k].astype(np.float64)))
        dd, nn = dd + d * d, nn + n * n
        if d / max(n, 1e-12) > worst:
            worst, wname = d / max(n, 1e-12), k
    return (dd / nn) ** 0.5, worst, wname


def main() -> int:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    ids = np.random.default_rng(22).integers(0, mm.VOCAB, BATCH_SHAPE, dtype=np.int64)
    np.savez(BATCH, input_ids=ids)
    out = {"settings": {"muon": MUON, "adamw": ADAMW, "steps": STEPS,
                        "versions": {"torch": torch.__version__}}}
    for name in MODELS:
        for adjust in ADJUST:
            losses, muon, adamw, params = run(name, adjust)
            # torch against itself: gradients scaled by 1 + 2^-20 (round-off size; both
            # optimizers' updates are scale-free), to measure how far round-off alone moves
            # the parameters (see CONTROL below)
            c_losses, _, _, c_params = run(name, adjust, 1.0 + 2.0**-20)
            whole, worst, wname = control(params, c_params)
            dl = max(abs(a - b) / abs(b) for a, b in zip(c_losses, losses))
            out[f"{name}/{adjust}"] = {
                "losses": losses, "muon": muon, "adamw": adamw,
                "control": {"whole": whole, "worst": worst, "worst_param": wname, "losses": dl},
            }
            np.savez(HERE / "ref" / f"muon5.{name}.{adjust}.npz", **params)
            if adjust == "original":
                # Newton-Schulz in f32 (hzp --muon-ns-precision fp32): no bf16 rounding to
                # amplify, so round-off stays near f32's (control measured the same way)
                f_losses, _, _, f_params = run(name, adjust, ns_f32=True)
                fc_losses, _, _, fc_params = run(name, adjust, 1.0 + 2.0**-20, ns_f32=True)
                fwhole, fworst, fwname = control(f_params, fc_params)
                fdl = max(abs(a - b) / abs(b) for a, b in zip(fc_losses, f_losses))
                out[f"{name}/{adjust}/ns_f32"] = {
                    "losses": f_losses,
                    "control": {"whole": fwhole, "worst": fworst, "worst_param": fwname,
                                "losses": fdl},
                }
                np.savez(HERE / "ref" / f"muon5.{name}.{adjust}.ns_f32.npz", **f_params)
                print(f"{name} {adjust} ns_f32: loss {f_losses[0]:.6f} -> {f_losses[-1]:.6f}; "
                      f"control: params {fwhole:.2e} (worst {fwname} {fworst:.2e}), "
                      f"losses {fdl:.2e}")
            print(f"{name} {adjust}: {len(muon)} Muon, {len(adamw)} AdamW parameters; "
                  f"loss {losses[0]:.6f} -> {losses[-1]:.6f}; control: params {whole:.2e} "
                  f"(worst {wname} {worst:.2e}), losses {dl:.2e}")
    path = HERE / "ref" / "muon_refs.json"
    path.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
