#!/usr/bin/env python3
"""Benchmark: one GPT-2 training step, hzp on the CPU against PyTorch eager on the CPU.

A benchmark, not a test: nothing here runs in CI, and PyTorch is needed only for this
script. It

1. builds a GPT-2 (hidden 512, 4 layers, 8 heads, MLP 2048, 256 positions, vocab 8192 --
   smaller than GPT-2's 50257 to keep the ONNX file small, ~70 MB) with a fixed seed,
   dropout 0, and every initially-constant parameter (LayerNorm weights and biases)
   slightly perturbed so that no two parameters are equal (hzp's --retie would tie equal
   ones),
2. exports it with the legacy TorchScript exporter at opset 17, through a subclass whose
   forward(input_ids) builds the all-ones attention mask and returns the logits (as
   tests/models/make_models.py does), and writes a fixed batch (4 x 256 token ids) to an
   .npz,
3. times PyTorch's eager training step on the CPU -- forward, causal-LM cross-entropy
   (logits[:, :-1] against input_ids[:, 1:]), backward, torch.optim.AdamW step --
   with torch.set_num_threads(T): median over --steps steps after --warmup steps,
4. runs `hzp train model.onnx --inputs batch.npz --loss lm --retie --steps N
   --format json` with HZP_NUM_THREADS=T and takes the median of its step_seconds after
   the first step,
5. prints both medians, the ratio hzp/torch, and checks that the first three losses of
   the two agree within 1e-4 relative (both start from the same weights and run the same
   AdamW: lr 1e-3, betas 0.9/0.999, eps 1e-8, weight decay 0.01).

Usage (from the repository root, after `cargo build --release`):

    /work/venv-models/bin/python examples/bench/train_vs_torch.py --threads 1
    /work/venv-models/bin/python examples/bench/train_vs_torch.py --threads 2 --steps 8

The model and batch are cached in --workdir (default /tmp/hzp-bench) and reused when the
configuration is unchanged; --fresh re-exports.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

warnings.filterwarnings("ignore")

ROOT = Path(__file__).resolve().parents[2]

SEED = 0
CONFIG = dict(
    vocab=8192,  # GPT-2 has 50257; 8192 keeps the ONNX file small
    hidden=512,
    layers=4,
    heads=8,
    seq=256,
    batch=4,
)


class GPT2Logits(GPT2LMHeadModel):
    """GPT2LMHeadModel whose forward(input_ids) returns only the logits.

    The all-ones attention mask is built inside the graph (transformers 5 decoders need
    an explicit mask for the legacy exporter). A subclass keeps the HF parameter names.
    """

    def forward(self, input_ids):  # noqa: D401 - exported signature
        mask = torch.ones_like(input_ids)
        out = super().forward(
            input_ids=input_ids,
            attention_mask=mask,
            use_cache=False,
            return_dict=False,
        )
        return out[0]


def build_model() -> torch.nn.Module:
    c = CONFIG
    cfg = GPT2Config(
        vocab_size=c["vocab"],
        n_positions=c["seq"],
        n_embd=c["hidden"],
        n_layer=c["layers"],
        n_head=c["heads"],
        n_inner=4 * c["hidden"],
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(SEED)
    model = GPT2Logits(cfg)
    # No two parameters may be equal (LayerNorm weights start all ones): --retie would
    # train equal ones as one parameter.
    gen = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.numel() > 0 and bool((p == p.reshape(-1)[0]).all()):
                p.add_(0.02 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model


def make_batch() -> torch.Tensor:
    gen = torch.Generator().manual_seed(SEED + 2)
    c = CONFIG
    return torch.randint(0, c["vocab"], (c["batch"], c["seq"]), generator=gen, dtype=torch.int64)


def export(model: torch.nn.Module, ids: torch.Tensor, path: Path, dynamic_batch: bool = False):
    """Legacy exporter, opset 17; with `dynamic_batch` the batch dimension is symbolic (so
    data-parallel ranks can each take part of it)."""
    axes = {"input_ids": {0: "batch"}, "logits": {0: "batch"}} if dynamic_batch else None
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        torch.onnx.export(
            model,
            (ids,),
            str(path),
            dynamo=False,
            opset_version=17,
            input_names=["input_ids"],
            output_names=["logits"],
            dynamic_axes=axes,
            do_constant_folding=True,
        )


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    v = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1].reshape(-1, v), ids[:, 1:].reshape(-1))


def torch_steps(model, ids, steps: int, warmup: int):
    """Runs warmup + steps AdamW steps; returns (losses of all steps, seconds of the timed ones)."""
    opt = torch.optim.AdamW(
        model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01
    )
    model.train()
    losses, times = [], []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(model(ids), ids)
        loss.backward()
        opt.step()
        dt = time.perf_counter() - t0
        losses.append(loss.item())
        if i >= warmup:
            times.append(dt)
    return losses, times


def run_hzp(hzp: Path, model: Path, batch: Path, steps: int, threads: int):
    env = dict(os.environ, HZP_NUM_THREADS=str(threads))
    cmd = [
        str(hzp), "train", str(model), "--inputs", str(batch), "--loss", "lm", "--retie",
        "--steps", str(steps), "--format", "json",
    ]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        sys.exit(f"hzp failed ({r.returncode}):\n{r.stderr}")
    out = json.loads(r.stdout)
    return out["losses"], out["step_seconds"], wall


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1, help="threads for both (default 1)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps (default 5)")
    ap.add_argument("--warmup", type=int, default=2, help="PyTorch warm-up steps (default 2)")
    ap.add_argument("--hzp", type=Path, default=ROOT / "target" / "release" / "hzp")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/hzp-bench"))
    ap.add_argument("--fresh", action="store_true", help="re-export even if cached")
    ap.add_argument("--skip-torch", action="store_true", help="only run hzp")
    ap.add_argument("--skip-hzp", action="store_true", help="only run PyTorch")
    args = ap.parse_args()
    if not args.skip_hzp and not args.hzp.exists():
        sys.exit(f"{args.hzp} not found; run `cargo build --release` first")

    torch.set_num_threads(args.threads)
    args.workdir.mkdir(parents=True, exist_ok=True)
    tag = "gpt2_h{hidden}_l{layers}_a{heads}_s{seq}_b{batch}_v{vocab}".format(**CONFIG)
    onnx_path = args.workdir / f"{tag}.legacy.op17.onnx"
    npz_path = args.workdir / f"{tag}.batch.npz"

    model = build_model()
    ids = make_batch()
    n_params = sum(p.numel() for p in model.parameters())
    if args.fresh or not onnx_path.exists() or not npz_path.exists():
        t0 = time.perf_counter()
        export(model, ids, onnx_path)
        np.savez(npz_path, input_ids=ids.numpy())
        print(f"exported {onnx_path} ({onnx_path.stat().st_size / 1e6:.1f} MB) "
              f"in {time.perf_counter() - t0:.1f} s")
        model = build_model()  # the exporter may leave the module changed (training mode)

    attn = getattr(model.config, "_attn_implementation", "?")
    print(f"model: GPT-2, {n_params / 1e6:.2f} M parameters, hidden {CONFIG['hidden']}, "
          f"{CONFIG['layers']} layers, {CONFIG['heads']} heads, vocab {CONFIG['vocab']} "
          f"(reduced from 50257), batch {CONFIG['batch']} x seq {CONFIG['seq']}, "
          f"torch attention: {attn}")
    print(f"threads: {args.threads} (torch.set_num_threads, HZP_NUM_THREADS); "
          f"{os.cpu_count()} cores visible")

    steps = max(args.steps, 3)
    t_losses = t_times = h_losses = h_times = None
    if not args.skip_torch:
        t_losses, t_times = torch_steps(model, ids, steps, args.warmup)
        t_med = statistics.median(t_times)
        print(f"torch {torch.__version__}: median step {t_med * 1e3:8.1f} ms over {len(t_times)} "
              f"steps after {args.warmup} warm-up  (min {min(t_times) * 1e3:.1f})")
    if not args.skip_hzp:
        # hzp's first step includes one-time work (first touch of every buffer); its
        # import and compile time are outside step_seconds.
        h_losses, h_secs, wall = run_hzp(args.hzp, onnx_path, npz_path, steps + 1, args.threads)
        h_times = h_secs[1:]
        h_med = statistics.median(h_times)
        print(f"hzp: median step {h_med * 1e3:8.1f} ms over {len(h_times)} steps after the first "
              f"(first {h_secs[0] * 1e3:.1f} ms, min {min(h_times) * 1e3:.1f}; "
              f"process wall {wall:.1f} s incl. import)")
    if t_times and h_times:
        ratio = statistics.median(h_times) / statistics.median(t_times)
        print(f"ratio hzp/torch: {ratio:.2f}x  ({'hzp faster' if ratio < 1 else 'torch faster'})")
        ok = True
        for i in range(3):
            rel = abs(h_losses[i] - t_losses[i]) / abs(t_losses[i])
            good = rel <= 1e-4
            ok &= good
            print(f"  loss step {i + 1}: hzp {h_losses[i]:.6f}  torch {t_losses[i]:.6f}  "
                  f"rel {rel:.1e}  {'ok' if good else 'MISMATCH'}")
        if not ok:
            sys.exit("loss curves disagree")
        print("loss curves agree (first 3 steps within 1e-4 relative)")


if __name__ == "__main__":
    main()
