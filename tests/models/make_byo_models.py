#!/usr/bin/env python3
"""Bring-your-own-model test files: fresh PyTorch models exported with hzp_export.py.

A PyTorch user's fresh model has many equal-valued parameters (every norm weight all
ones, biases all zeros), which the ONNX exporters merge into one initializer. This makes,
for three model families no other test uses (transformers' Granite with a tied LM head,
GPT-NeoX, and Gemma with its `1 + w` norms), from tiny random configs (fixed seed, no downloads) and WITHOUT perturbing the
constant parameters, in tests/models/byo/:

  <fam>.dynamo.onnx          hzp_export.export_for_training, dynamo exporter, opset 18
                             (onnxscript's optimizer, folding no node that reads a
                             parameter)
  <fam>.legacy.onnx          the same with the legacy exporter, opset 17, constant folding
                             on (weights stored transposed as `onnx::MatMul_N`; off for
                             Gemma, whose `1 + w` it would fold)
  <fam>.{dynamo,legacy}.names.json, .io.npz   what the helper writes beside each
  <fam>.plain.onnx           torch.onnx.export as a user would call it (dynamo, optimized;
                             no name map): the exporter merges the constant parameters
  <fam>.ref.npz              PyTorch's reference: `loss` (the 5 losses of 5 AdamW steps,
                             torch's defaults: lr 1e-3, betas (0.9, 0.999), eps 1e-8,
                             weight decay 0.01; loss = causal LM cross-entropy of
                             logits[:, :-1] against input_ids[:, 1:], hzp's `--loss lm`) and
                             `param/<state_dict key>` after the 5 steps (every key, tied
                             ones included), `grad/<key>` of the first step (to tell
                             elements whose gradient is round-off)

tests/byo_models.rs checks hzp against these.

  python tests/models/make_byo_models.py                       # make everything
  python tests/models/make_byo_models.py --family gemma_byo    # one family
  python tests/models/make_byo_models.py --check-load FILE FAM # strict load_state_dict of
                                                               # a file hzp wrote (.npz or
                                                               # .safetensors) into FAM
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import numpy as np
import onnx
import torch
import torch.nn.functional as F
import transformers

HERE = Path(__file__).resolve().parent
OUT = HERE / "byo"
sys.path.insert(0, str(HERE.parents[1] / "frontends" / "python"))
sys.dont_write_bytecode = True
import hzp_export  # noqa: E402

SEED = 0
VOCAB = 64
HIDDEN = 32
FFN = 64
LAYERS = 2
HEADS = 4
BATCH = 2
SEQ = 8
STEPS = 5
warnings.filterwarnings("ignore")


def logits_only(base):
    class LogitsOnly(base):
        def forward(self, input_ids):
            mask = torch.ones_like(input_ids)
            out = super().forward(input_ids=input_ids, attention_mask=mask, use_cache=False, return_dict=False)
            return out[0]

    LogitsOnly.__name__ = base.__name__ + "LogitsOnly"
    return LogitsOnly


def build_granite():
    # Llama-like with Granite's multipliers; RMSNorms (all ones when fresh), tied LM head.
    cfg = transformers.GraniteConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=True, attention_dropout=0.0, bos_token_id=0, eos_token_id=0,
        pad_token_id=None, embedding_multiplier=2.0, residual_multiplier=0.5,
        attention_multiplier=0.25, logits_scaling=4.0)
    return logits_only(transformers.GraniteForCausalLM)(cfg)


def build_neox():
    # LayerNorms (ones / zeros when fresh), zero-initialized biases, parallel residual,
    # rotary on a quarter of each head, untied output layer.
    cfg = transformers.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, max_position_embeddings=64, rotary_pct=0.25,
        use_parallel_residual=True, hidden_act="gelu", attention_dropout=0.0, hidden_dropout=0.0,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=None)
    return logits_only(transformers.GPTNeoXForCausalLM)(cfg)


def build_gemma():
    # RMSNorm scaling by (1 + w) with w all zeros when fresh (an exporter folds `1 + w` into
    # a new constant, or merges the zeros), GeGLU MLP, tied LM head, embeddings scaled by
    # sqrt(hidden), one K/V head.
    cfg = transformers.GemmaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=1, head_dim=HIDDEN // HEADS,
        max_position_embeddings=64, hidden_activation="gelu_pytorch_tanh", attention_dropout=0.0,
        tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=None)
    return logits_only(transformers.GemmaForCausalLM)(cfg)


FAMILIES = {"granite_byo": build_granite, "neox_byo": build_neox, "gemma_byo": build_gemma}


def fresh(fam: str):
    torch.manual_seed(SEED)
    model = FAMILIES[fam]().eval()
    gen = torch.Generator().manual_seed(SEED + 1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen, dtype=torch.int64)
    return model, {"input_ids": ids}


def strip(path: Path):
    """Drops per-node metadata and doc strings (hzp reads neither): smaller files."""
    m = onnx.load(str(path))
    for n in m.graph.node:
        del n.metadata_props[:]
        n.doc_string = ""
    onnx.save(m, str(path))


def lm_loss(logits, ids):
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def reference(fam: str):
    torch.set_num_threads(1)
    model, inputs = fresh(fam)
    ids = inputs["input_ids"]
    with torch.no_grad():  # cross-check the loss against transformers' own
        hf = super(type(model), model).forward(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids,
                                               use_cache=False, return_dict=True)
        mine = lm_loss(model(ids), ids)
    assert abs(hf.loss.item() - mine.item()) < 1e-5, (hf.loss.item(), mine.item())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                            foreach=False)
    losses = []
    arrays = {}
    named = dict(model.named_parameters(remove_duplicate=False))
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(model(ids), ids)
        loss.backward()
        if step == 0:  # the first gradient tells round-off elements (zero in exact arithmetic)
            for k, p in named.items():
                arrays[f"grad/{k}"] = p.grad.detach().numpy().astype(np.float32).copy()
        opt.step()
        losses.append(loss.item())
    arrays["loss"] = np.array(losses, dtype=np.float32)
    for k, v in model.state_dict(keep_vars=False).items():
        if k in dict(model.named_parameters(remove_duplicate=False)):
            arrays[f"param/{k}"] = v.detach().numpy().astype(np.float32)
    np.savez(OUT / f"{fam}.ref.npz", **arrays)
    print(f"   {fam}.ref.npz: losses {['%.6f' % x for x in losses]}")


def make(fam: str):
    print(f"== {fam}", flush=True)
    # legacy with constant folding, except for Gemma: folding turns its `1 + w` into new
    # constants, which the helper refuses (hzp would train the folded value)
    for exporter, folding in (("dynamo", False), ("legacy", fam != "gemma_byo")):
        model, inputs = fresh(fam)
        path = OUT / f"{fam}.{exporter}.onnx"
        names = hzp_export.export_for_training(model, inputs, path, exporter=exporter,
                                               constant_folding=folding)
        strip(path)
        transposed = sum(u["transpose"] for v in names["initializers"].values() for u in v)
        print(f"   {path.name}: {len(names['initializers'])} parameter initializers "
              f"({transposed} transposed), ties {names['ties']}, {path.stat().st_size} bytes")
    # what a user gets from torch.onnx.export directly
    model, inputs = fresh(fam)
    path = OUT / f"{fam}.plain.onnx"
    batch = torch.export.Dim("batch", min=1, max=1024)
    seq = torch.export.Dim("sequence", min=2, max=64)
    prog = torch.onnx.export(model, (inputs["input_ids"],), dynamo=True, opset_version=18,
                             input_names=["input_ids"], output_names=["output"],
                             dynamic_shapes={"input_ids": {0: batch, 1: seq}}, verify=False, report=False)
    prog.save(str(path), external_data=False)
    strip(path)
    n_params = sum(1 for _ in model.parameters())
    m = onnx.load(str(path))
    print(f"   {path.name}: {len(m.graph.initializer)} initializers for {n_params} parameters, "
          f"{path.stat().st_size} bytes")
    reference(fam)


def check_load(file: str, fam: str):
    model, _ = fresh(fam)
    if file.endswith(".safetensors"):
        from safetensors.torch import load_file
        sd = load_file(file)
    else:
        sd = {k: torch.from_numpy(v) for k, v in np.load(file).items()}
    model.load_state_dict(sd, strict=True)
    ref = np.load(OUT / f"{fam}.ref.npz")
    worst = 0.0
    for k, v in model.state_dict().items():
        r = ref[f"param/{k}"]
        worst = max(worst, float(np.abs(v.numpy() - r).max() / max(np.abs(r).max(), 1e-12)))
    print(f"{file}: load_state_dict(strict=True) into {fam} took all {len(sd)} keys; "
          f"largest difference from PyTorch's 5 AdamW steps, relative to each tensor's max: {worst:.2e}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check-load", nargs=2, metavar=("FILE", "FAMILY"))
    ap.add_argument("--refs-only", action="store_true", help="only the .ref.npz files")
    ap.add_argument("--family", action="append", choices=sorted(FAMILIES),
                    help="make only this family (repeatable; default: all)")
    a = ap.parse_args()
    if a.check_load:
        check_load(*a.check_load)
        return
    OUT.mkdir(exist_ok=True)
    families = a.family or list(FAMILIES)
    if a.refs_only:
        for fam in families:
            reference(fam)
        return
    for fam in families:
        make(fam)
    total = sum(p.stat().st_size for p in OUT.iterdir())
    print(f"byo/: {total} bytes")


if __name__ == "__main__":
    main()
