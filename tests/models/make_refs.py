#!/usr/bin/env python3
"""PyTorch reference training results for hzp, keyed by ONNX initializer names.

For every ONNX file in this folder (made by make_models.py) and in
../shared/onnx/ (beside the checkout) (skipped, with a message, when that folder is absent) this
rebuilds the PyTorch model the file was exported from, checks that it
reproduces the file's `torch_out` (from `<model>.io.npz`), maps every FLOAT
initializer to the torch parameter it copies (by value: equal, or equal after
swapping the last two axes), and writes

  ref/<file stem>.ref.npz   loss, gradients and parameters after a few
                            optimizer steps, keyed by initializer name
  ref/<file stem>.ref.json  the initializer -> parameter mapping and settings

(for the shared files: ref/shared/<file stem>.ref.{npz,json}; their stems are
the same as the own files').

See ref/README.md for the keys and the exact definitions.

Models:
  * own (tests/models/*.onnx): rebuilt with make_models.py's own code path
    (seed 0, same perturbation), checked against `<model>.grads.npz`.
  * shared (../shared/onnx/ (beside the checkout)*.onnx, no torch model available): an HF model
    is built from a config inferred from the graph (shapes of the
    initializers, LayerNormalization epsilon, Erf/Tanh GELU; 4 heads), and
    every parameter is loaded from the initializer of the same name or, for
    the pre-transposed Linear weights (`onnx::MatMul_NNN`, `val_NNN`), from the
    initializer feeding the MatMul whose output is added to `<prefix>.bias`.

Usage (from anywhere; writes next to this file):
    /work/venv-models/bin/python tests/models/make_refs.py [--only ID ...] [--no-shared]

IDs are file stems (`gpt2_tiny.legacy.op17`) or `shared/<stem>`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import numpy as np
import onnx
import torch
import torch.nn.functional as F
import transformers
from onnx import numpy_helper

HERE = Path(__file__).resolve().parent
REF = HERE / "ref"
SHARED_ONNX = Path(__file__).resolve().parents[3] / "shared" / "onnx"  # ../shared beside the checkout
sys.dont_write_bytecode = True  # no __pycache__ beside make_models.py
sys.path.insert(0, str(HERE))
import make_models as mm  # noqa: E402  (same folder)

FWD_ATOL = 1e-5
ADAMW = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01, "steps": 5}
SGD = {"lr": 0.1, "momentum": 0.9, "steps": 3}
CLIP = {"max_norm": 0.5, "optimizer": "adamw", "steps": 1}


# ---------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------


class Wrapped(torch.nn.Module):
    """The shared files were exported from a wrapper holding the HF model as `m`
    (initializer names start with `m.`); this rebuilds it so the torch names match."""

    def __init__(self, hf, is_decoder: bool):
        super().__init__()
        self.m = hf
        self.is_decoder = is_decoder

    def forward(self, input_ids, attention_mask=None, token_type_ids=None):
        if self.is_decoder:
            return self.m(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                          use_cache=False, return_dict=False)[0]
        return self.m(input_ids=input_ids, attention_mask=attention_mask,
                      token_type_ids=token_type_ids, return_dict=False)[0]

    def hf_lm_loss(self, ids):
        return self.m(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids,
                      use_cache=False, return_dict=True).loss


def hf_lm_loss(model, ids):
    """transformers' own causal LM loss (labels=input_ids) for the same model."""
    if isinstance(model, Wrapped):
        return model.hf_lm_loss(ids)
    return super(type(model), model).forward(
        input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids, use_cache=False, return_dict=True
    ).loss


def build_own(model_name: str):
    """Exactly make_models.make_one's construction (seed, builder, perturbation)."""
    builder, is_decoder = mm.MODELS[model_name]
    torch.manual_seed(mm.SEED)
    model = builder()
    mm.perturb_constant_params(model, mm.SEED + 1)
    model.eval()
    return model, is_decoder


def nice_float(x: float) -> float:
    """The shortest decimal with the same float32 value (9.9999997e-06 -> 1e-05)."""
    return float(str(np.float32(x)))


def graph_facts(g):
    inits = {i.name: i for i in g.initializer}
    eps = {nice_float(a.f) for n in g.node if n.op_type == "LayerNormalization"
           for a in n.attribute if a.name == "epsilon"}
    ops = {n.op_type for n in g.node}
    return inits, eps, ops


def build_shared(path: Path):
    """Rebuild the HF model of a shared file from its initializers."""
    m = onnx.load(str(path))
    g = m.graph
    inits, eps, ops = graph_facts(g)
    arr = {k: numpy_helper.to_array(v) for k, v in inits.items()}
    if len(eps) != 1:
        raise RuntimeError(f"{path.name}: LayerNormalization epsilons {eps}")
    eps = eps.pop()
    layers = 1 + max(int(x) for k in arr for x in re.findall(r"\.(?:h|layer)\.(\d+)\.", k))
    if path.name.startswith("gpt2"):
        is_decoder = True
        emb = arr.get("m.transformer.wte.weight", arr.get("m.lm_head.weight"))
        cfg = transformers.GPT2Config(
            vocab_size=emb.shape[0], n_embd=emb.shape[1], n_positions=arr["m.transformer.wpe.weight"].shape[0],
            n_layer=layers, n_head=4, n_inner=arr["m.transformer.h.0.mlp.c_fc.weight"].shape[1],
            layer_norm_epsilon=eps, activation_function="gelu_new" if "Tanh" in ops else "gelu",
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
            bos_token_id=0, eos_token_id=0,  # not used; the default 50256 is outside the vocabulary
        )
        hf = transformers.GPT2LMHeadModel(cfg)
    elif path.name.startswith("bert"):
        is_decoder = False
        emb = arr["m.embeddings.word_embeddings.weight"]
        cfg = transformers.BertConfig(
            vocab_size=emb.shape[0], hidden_size=emb.shape[1], num_hidden_layers=layers, num_attention_heads=4,
            intermediate_size=arr["m.encoder.layer.0.intermediate.dense.bias"].shape[0],
            max_position_embeddings=arr["m.embeddings.position_embeddings.weight"].shape[0],
            type_vocab_size=arr["m.embeddings.token_type_embeddings.weight"].shape[0],
            layer_norm_eps=eps, hidden_act="gelu" if "Erf" in ops else "gelu_new",
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )
        hf = transformers.BertModel(cfg, add_pooling_layer=False)
    else:
        raise RuntimeError(f"{path.name}: unknown shared model")
    model = Wrapped(hf, is_decoder)

    # Renamed (pre-transposed) Linear weights: MatMul(x, W) -> Add(., <prefix>.bias).
    consumers = {}
    for n in g.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    renamed = {}
    for name in arr:
        for n in consumers.get(name, []):
            if n.op_type != "MatMul" or n.input[1] != name:
                continue
            for nxt in consumers.get(n.output[0], []):
                biases = [i for i in nxt.input if i in inits and i.endswith(".bias")]
                if nxt.op_type == "Add" and len(biases) == 1:
                    renamed[biases[0][: -len("bias")] + "weight"] = name

    loaded = set()
    with torch.no_grad():
        for pname, p in model.named_parameters(remove_duplicate=False):
            if pname in arr:
                src = arr[pname]
            elif pname in renamed:
                src = arr[renamed[pname]].swapaxes(-1, -2)
            else:
                continue
            if tuple(src.shape) != tuple(p.shape):
                raise RuntimeError(f"{path.name}: {pname} shape {tuple(p.shape)} vs initializer {src.shape}")
            p.copy_(torch.from_numpy(np.ascontiguousarray(src)))
            loaded.add(id(p))
    missing = [n for n, p in model.named_parameters() if id(p) not in loaded]
    if missing:
        raise RuntimeError(f"{path.name}: parameters with no initializer to load from: {missing}")
    model.eval()
    return model, is_decoder


# ---------------------------------------------------------------------------
# Loss and mapping
# ---------------------------------------------------------------------------


def compute_loss(model, inputs: dict, is_decoder: bool):
    out = model(**inputs)
    if is_decoder:
        ids = inputs["input_ids"]
        return F.cross_entropy(out[:, :-1].reshape(-1, out.shape[-1]), ids[:, 1:].reshape(-1))
    return out.mean()


def map_initializers(g, model):
    """initializer name -> (torch param name, transposed), plus unmapped float initializers."""
    params = dict(model.named_parameters())  # canonical names, tied ones once
    canon = {}  # every alias name -> canonical name
    ids = {id(p): n for n, p in params.items()}
    for n, p in model.named_parameters(remove_duplicate=False):
        canon[n] = ids[id(p)]
    pvals = {n: p.detach().numpy() for n, p in params.items()}
    mapping, unmapped = {}, []
    for init in g.initializer:
        if init.data_type != onnx.TensorProto.FLOAT:
            continue
        a = numpy_helper.to_array(init)
        cands = []
        for n, v in pvals.items():
            if v.shape == a.shape and np.array_equal(v, a):
                cands.append((n, False))
            elif v.ndim >= 2 and v.shape[:-2] + v.shape[:-3:-1] == a.shape and np.array_equal(v.swapaxes(-1, -2), a):
                cands.append((n, True))
        same_name = [c for c in cands if c[0] == canon.get(init.name) and not c[1]]
        if same_name:
            cands = same_name
        if len(cands) > 1:
            raise RuntimeError(f"initializer {init.name} equals several parameters: {cands}")
        if cands:
            mapping[init.name] = cands[0]
        else:
            unmapped.append(init.name)
    not_stored = sorted(set(params) - {t for t, _ in mapping.values()})
    return mapping, unmapped, not_stored


# ---------------------------------------------------------------------------
# Reference computation
# ---------------------------------------------------------------------------


def snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def restore(model, snap):
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(snap[n])
    model.zero_grad(set_to_none=True)


def references(model, inputs: dict, is_decoder: bool):
    """All torch results, keyed by torch parameter name."""
    init = snapshot(model)
    res = {}
    params = lambda: [p for _, p in model.named_parameters()]  # noqa: E731

    # 1-2. loss and gradients.
    model.zero_grad(set_to_none=True)
    loss = compute_loss(model, inputs, is_decoder)
    if is_decoder:
        with torch.no_grad():
            hf = hf_lm_loss(model, inputs["input_ids"]).item()
        if abs(hf - loss.item()) > 1e-6:
            raise RuntimeError(f"loss {loss.item()} != transformers' {hf}")
    loss.backward()
    res["loss"] = loss.item()
    res["no_grad"] = [n for n, p in model.named_parameters() if p.grad is None]
    res["grad"] = {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
                   for n, p in model.named_parameters()}

    # 3. AdamW, 5 steps on the same batch.
    restore(model, init)
    opt = torch.optim.AdamW(params(), lr=ADAMW["lr"], betas=tuple(ADAMW["betas"]), eps=ADAMW["eps"],
                            weight_decay=ADAMW["weight_decay"])
    losses = []
    for _ in range(ADAMW["steps"]):
        opt.zero_grad(set_to_none=True)
        loss = compute_loss(model, inputs, is_decoder)
        losses.append(loss.item())
        loss.backward()
        opt.step()
    res["adamw5"] = snapshot(model)
    res["adamw5_loss"] = losses

    # 4. SGD with momentum, 3 steps.
    restore(model, init)
    opt = torch.optim.SGD(params(), lr=SGD["lr"], momentum=SGD["momentum"])
    losses = []
    for _ in range(SGD["steps"]):
        opt.zero_grad(set_to_none=True)
        loss = compute_loss(model, inputs, is_decoder)
        losses.append(loss.item())
        loss.backward()
        opt.step()
    res["sgd3"] = snapshot(model)
    res["sgd3_loss"] = losses

    # 5. Global-norm clipping then one AdamW step.
    restore(model, init)
    opt = torch.optim.AdamW(params(), lr=ADAMW["lr"], betas=tuple(ADAMW["betas"]), eps=ADAMW["eps"],
                            weight_decay=ADAMW["weight_decay"])
    opt.zero_grad(set_to_none=True)
    compute_loss(model, inputs, is_decoder).backward()
    total = torch.nn.utils.clip_grad_norm_(params(), max_norm=CLIP["max_norm"])
    opt.step()
    res["clip"] = snapshot(model)
    res["clip_total_norm"] = total.item()

    restore(model, init)
    return res


def dump_json(meta: dict) -> str:
    """JSON with one line per top-level key, and per initializer (diff-friendly)."""
    lines = []
    for k, v in meta.items():
        if k == "initializers":
            inner = [f"  {json.dumps(n)}: {json.dumps(e)}" for n, e in v.items()]
            lines.append(f" {json.dumps(k)}: {{\n" + ",\n".join(inner) + "\n }")
        else:
            lines.append(f" {json.dumps(k)}: {json.dumps(v)}")
    text = "{\n" + ",\n".join(lines) + "\n}\n"
    assert json.loads(text) == json.loads(json.dumps(meta))
    return text


def f32(t) -> np.ndarray:
    return np.array(t, dtype=np.float32, order="C")  # keeps 0-d arrays 0-d


def make_ref(rid: str, path: Path, io_path: Path, model, is_decoder: bool, source: str, check_grads: Path | None):
    stem = path.name[: -len(".onnx")]
    g = onnx.load(str(path)).graph
    init_names = {i.name for i in g.initializer}
    graph_inputs = [i.name for i in g.input if i.name not in init_names]
    with np.load(io_path) as z:
        io = {k: z[k] for k in z.files}
    inputs = {k: torch.from_numpy(io[k]) for k in graph_inputs}

    with torch.no_grad():
        out = model(**inputs).numpy()
    fwd_diff = float(np.abs(out - io["torch_out"]).max())
    if out.shape != io["torch_out"].shape or not fwd_diff < FWD_ATOL:
        raise RuntimeError(f"{stem}: rebuilt model differs from torch_out by {fwd_diff}")

    mapping, unmapped, not_stored = map_initializers(g, model)
    if not_stored:
        raise RuntimeError(f"{stem}: torch parameters with no initializer: {not_stored}")
    res = references(model, inputs, is_decoder)
    if res["no_grad"]:
        raise RuntimeError(f"{stem}: parameters without a gradient: {res['no_grad']}")

    if check_grads is not None:  # own models: same values and gradients as make_models.py wrote
        with np.load(check_grads) as z:
            for n, p in model.named_parameters():
                if not np.array_equal(z[f"param/{n}"], p.detach().numpy()):
                    raise RuntimeError(f"{stem}: param {n} differs from {check_grads.name}")
                gd = float(np.abs(z[f"grad/{n}"] - res["grad"][n].numpy()).max())
                if gd > 1e-6:
                    raise RuntimeError(f"{stem}: grad {n} differs from {check_grads.name} by {gd}")
            if abs(float(z["loss"]) - res["loss"]) > 1e-6:
                raise RuntimeError(f"{stem}: loss differs from {check_grads.name}")

    def keyed(t, transposed):
        a = t.detach().numpy()
        return f32(a.swapaxes(-1, -2) if transposed else a)

    arrays = {
        "loss": f32(res["loss"]),
        "adamw5_loss": f32(res["adamw5_loss"]),
        "sgd3_loss": f32(res["sgd3_loss"]),
        "clip_total_norm": f32(res["clip_total_norm"]),
    }
    for kind in ("grad", "adamw5", "sgd3", "clip"):
        for iname, (pname, tr) in mapping.items():
            arrays[f"{kind}/{iname}"] = keyed(res[kind][pname], tr)

    groups = {}
    for iname, (pname, _) in mapping.items():
        groups.setdefault(pname, []).append(iname)
    tied = [v for v in groups.values() if len(v) > 1]
    # Parameters that torch ties (one Parameter used twice) even when the file stores it once.
    torch_tied = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        torch_tied.setdefault(id(p), []).append(n)
    torch_tied = [v for v in torch_tied.values() if len(v) > 1]

    meta = {
        "onnx": str(path.relative_to(HERE)) if path.is_relative_to(HERE) else str(path),
        "io": str(io_path.relative_to(HERE)) if io_path.is_relative_to(HERE) else str(io_path),
        "source": source,
        "initializers": {k: {"torch": v[0], "transposed": v[1]} for k, v in mapping.items()},
        "unmapped": unmapped,
        "tied_groups": tied,
        "torch_tied_parameters": torch_tied,
        "loss": "lm" if is_decoder else "mean",
        "inputs": graph_inputs,
        "adamw": ADAMW,
        "sgd": SGD,
        "clip": CLIP,
        "forward_max_abs_diff_vs_torch_out": fwd_diff,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "numpy": np.__version__, "onnx": onnx.__version__},
    }
    out = REF / f"{rid}.ref.npz"
    out.parent.mkdir(parents=True, exist_ok=True)
    if rid.startswith("shared/"):
        # The shared models are ~6x larger: keep only the gradient and AdamW references
        # for them so the committed files stay small (SGD and clipping are covered by the
        # project's own models).
        arrays = {k: v for k, v in arrays.items() if not (k.startswith("sgd3") or k.startswith("clip"))}
    np.savez_compressed(out, **arrays)
    (REF / f"{rid}.ref.json").write_text(dump_json(meta))
    return {
        "stem": rid, "loss": res["loss"], "mapped": len(mapping), "params": len(dict(model.named_parameters())),
        "unmapped": unmapped, "tied": tied, "fwd_diff": fwd_diff, "adamw5_loss": res["adamw5_loss"],
        "sgd3_loss": res["sgd3_loss"], "clip_total_norm": res["clip_total_norm"],
        "bytes": out.stat().st_size,
    }


def jobs(shared: bool):
    """(id, onnx path, io path, builder, source, grads path)"""
    out = []
    for name in mm.MODELS:
        for kind in ("legacy.op17", "dynamo.op18"):
            out.append((f"{name}.{kind}", HERE / f"{name}.{kind}.onnx", HERE / f"{name}.io.npz",
                        (lambda n=name: build_own(n)), "own", HERE / f"{name}.grads.npz"))
    if not shared:
        print("note: --no-shared, skipping the shared models")
    elif SHARED_ONNX.is_dir():
        for p in sorted(SHARED_ONNX.glob("*.onnx")):
            out.append((f"shared/{p.name[: -len('.onnx')]}", p, SHARED_ONNX / (p.name.split(".")[0] + ".io.npz"),
                        (lambda p=p: build_shared(p)), "shared", None))
    else:
        print(f"note: {SHARED_ONNX} is absent, skipping the shared models")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", help="only these ids (gpt2_tiny.legacy.op17, shared/bert_tiny.dynamo.op18)")
    ap.add_argument("--no-shared", action="store_true", help=f"skip the files in {SHARED_ONNX}")
    args = ap.parse_args()

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, numpy {np.__version__}")
    failures = []
    summary = []
    by_model = {}
    for rid, path, io_path, build, source, grads in jobs(not args.no_shared):
        if args.only and rid not in args.only:
            continue
        try:
            model, is_decoder = build()
            s = make_ref(rid, path, io_path, model, is_decoder, source, grads)
        except Exception as e:
            print(f"FAIL {rid}: {type(e).__name__}: {e}")
            failures.append(rid)
            continue
        summary.append(s)
        # legacy and dynamo files of one model must give the same torch results
        key = (source, path.name.split(".")[0])
        prev = by_model.setdefault(key, s)
        if prev is not s and (prev["loss"], prev["adamw5_loss"], prev["sgd3_loss"], prev["clip_total_norm"]) != (
                s["loss"], s["adamw5_loss"], s["sgd3_loss"], s["clip_total_norm"]):
            print(f"FAIL {rid}: results differ from {prev['stem']}")
            failures.append(rid)
        print(
            f"{rid:35} loss {s['loss']:.6f}  mapped {s['mapped']:2} inits -> {s['params']} params  "
            f"tied {s['tied'] or '-'}  unmapped {len(s['unmapped'])}  fwd diff {s['fwd_diff']:.1e}  "
            f"adamw5 {s['adamw5_loss'][-1]:.6f}  sgd3 {s['sgd3_loss'][-1]:.6f}  clip norm {s['clip_total_norm']:.4f}  "
            f"{s['bytes']} bytes",
            flush=True,
        )
    total = sum(s["bytes"] for s in summary)
    print(f"{len(summary)} reference files, {total} bytes of .ref.npz in {REF}")
    if failures:
        print("FAILED: " + ", ".join(failures))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
