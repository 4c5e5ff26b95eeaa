#!/usr/bin/env python3
"""Make the tiny ONNX test models that hzp's importer is tested on.

Builds tiny random-weight models from local `transformers` configs (no hub
downloads), exports each one with both PyTorch ONNX exporters (legacy
TorchScript at opset 17, dynamo at opset 18), and writes, next to this file:

  <model>.legacy.op17.onnx   TorchScript exporter, opset 17
  <model>.dynamo.op18.onnx   dynamo exporter, opset 18
  <model>.io.npz             fixed inputs (keys = ONNX graph input names) and
                             PyTorch's output under `torch_out`
  <model>.grads.npz          `loss`, `param/<name>` and `grad/<name>` for every
                             torch parameter (reference for training)

It checks every export with onnxruntime (fixed inputs and one other shape, to
prove batch and sequence are really symbolic) and prints an op inventory of
every .onnx file here and in ../shared/onnx/ (beside the checkout) (also written to
/tmp/op_inventory.txt).

Usage (see README.md beside this file):
    python tests/models/make_models.py               # make, verify, inventory
    python tests/models/make_models.py --inventory   # only the inventory
"""

from __future__ import annotations

import argparse
import collections
import io
import os
import sys
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
import torch.nn.functional as F
import transformers
from transformers import (
    BertConfig,
    BertModel,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
)

HERE = Path(__file__).resolve().parent
SHARED_ONNX = Path(__file__).resolve().parents[3] / "shared" / "onnx"  # ../shared beside the checkout
INVENTORY_PATH = Path("/tmp/op_inventory.txt")

SEED = 0
VOCAB = 256
HIDDEN = 64
LAYERS = 2
HEADS = 4
KV_HEADS = 2
INTERMEDIATE = 128
MOE_INTERMEDIATE = 64  # per expert; keeps the MoE files well under MAX_FILE_BYTES
MAX_POS = 64
BATCH = 2
SEQ = 16
PAD_TAIL = 5  # BERT: last 5 positions of row 1 are padding
ATOL = 1e-4
MAX_FILE_BYTES = 1_500_000

warnings.filterwarnings("ignore")


# ---------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------


def causal_lm_logits_class(base: type) -> type:
    """Subclass of an HF causal LM whose forward(input_ids) returns logits only.

    A subclass (not a wrapper holding the model) keeps the parameter names
    identical to the HF model's, so ONNX initializer names, `param/<name>` and
    `grad/<name>` all use the same names. The all-ones attention_mask is built
    inside the graph: without an explicit mask, transformers 5 decoders fail
    the legacy exporter (aten::diff).
    """

    class LogitsOnly(base):
        def forward(self, input_ids):  # noqa: D401 - exported signature
            mask = torch.ones_like(input_ids)
            out = super().forward(
                input_ids=input_ids,
                attention_mask=mask,
                use_cache=False,
                return_dict=False,
            )
            return out[0]

    LogitsOnly.__name__ = base.__name__ + "LogitsOnly"
    LogitsOnly.__qualname__ = LogitsOnly.__name__
    return LogitsOnly


class BertHidden(BertModel):
    """BertModel (no pooler) returning only last_hidden_state."""

    def __init__(self, config):
        super().__init__(config, add_pooling_layer=False)

    def forward(self, input_ids, attention_mask, token_type_ids):
        out = super().forward(
            input_ids=input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            return_dict=False,
        )
        return out[0]


def build_gpt2():
    cfg = GPT2Config(
        vocab_size=VOCAB,
        n_positions=MAX_POS,
        n_embd=HIDDEN,
        n_layer=LAYERS,
        n_head=HEADS,
        n_inner=INTERMEDIATE,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return causal_lm_logits_class(GPT2LMHeadModel)(cfg)


def build_llama():
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=MAX_POS,
        attention_dropout=0.0,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=None,
    )
    return causal_lm_logits_class(LlamaForCausalLM)(cfg)


def build_bert():
    cfg = BertConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=INTERMEDIATE,
        max_position_embeddings=MAX_POS,
        type_vocab_size=2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertHidden(cfg)


def build_moe():
    cfg = MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=MOE_INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=MAX_POS,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=None,
        attention_dropout=0.0,
        router_jitter_noise=0.0,
        output_router_logits=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=None,
        # The default `grouped_mm` exports with neither exporter.
        experts_implementation="batched_mm",
    )
    model = causal_lm_logits_class(MixtralForCausalLM)(cfg)
    impl = model.config._experts_implementation
    assert impl == "batched_mm", f"experts implementation is {impl!r}"
    return model


MODELS = {
    # name: (builder, is_decoder)
    "gpt2_tiny": (build_gpt2, True),
    "llama_tiny": (build_llama, True),
    "bert_tiny": (build_bert, False),
    "moe_tiny": (build_moe, True),
}


def perturb_constant_params(model: torch.nn.Module, seed: int) -> list[str]:
    """Add a small seeded perturbation to every parameter whose elements are all equal."""
    gen = torch.Generator().manual_seed(seed)
    touched = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.numel() > 0 and bool((p == p.reshape(-1)[0]).all()):
                p.add_(0.02 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
                touched.append(name)
    return touched


def make_inputs(name: str, is_decoder: bool, batch: int, seq: int, seed: int):
    """Inputs as an ordered dict name -> int64 tensor (names = ONNX input names)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=gen, dtype=torch.int64)
    if is_decoder:
        return {"input_ids": ids}
    mask = torch.ones(batch, seq, dtype=torch.int64)
    if batch > 1:
        mask[1, seq - min(PAD_TAIL, seq - 1):] = 0
    token_type_ids = torch.zeros(batch, seq, dtype=torch.int64)
    token_type_ids[:, seq // 2:] = 1
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": token_type_ids}


# ---------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------


def export_legacy(model, inputs: dict, output_name: str, path: Path):
    names = list(inputs)
    dyn = {n: {0: "batch", 1: "sequence"} for n in names}
    dyn[output_name] = {0: "batch", 1: "sequence"}
    torch.onnx.export(
        model,
        tuple(inputs.values()),
        str(path),
        dynamo=False,
        opset_version=17,
        input_names=names,
        output_names=[output_name],
        dynamic_axes=dyn,
        do_constant_folding=True,
    )
    model.eval()  # the legacy exporter leaves the module in training mode


def export_dynamo(model, inputs: dict, output_name: str, path: Path):
    batch = torch.export.Dim("batch", min=1, max=1024)
    seq = torch.export.Dim("sequence", min=2, max=MAX_POS)
    dynamic_shapes = {n: {0: batch, 1: seq} for n in inputs}
    prog = torch.onnx.export(
        model,
        tuple(inputs.values()),
        dynamo=True,
        opset_version=18,
        input_names=list(inputs),
        output_names=[output_name],
        dynamic_shapes=dynamic_shapes,
        optimize=True,
        verify=False,
        report=False,
    )
    prog.save(str(path), external_data=False)
    model.eval()
    strip_stack_traces(path)


def strip_stack_traces(path: Path):
    """Drop the dynamo exporter's per-node `pkg.torch.onnx.stack_trace` metadata.

    It holds absolute paths of this machine (so files would differ from machine
    to machine) and is about a third of each file. The other per-node
    metadata_props (namespace, class_hierarchy, fx_node, name_scopes) are kept,
    so importers still meet NodeProto.metadata_props.
    """
    m = onnx.load(str(path), load_external_data=False)
    for node in m.graph.node:
        kept = [p for p in node.metadata_props if p.key != "pkg.torch.onnx.stack_trace"]
        if len(kept) != len(node.metadata_props):
            del node.metadata_props[:]
            node.metadata_props.extend(kept)
    onnx.save(m, str(path))


def check_model_file(path: Path):
    m = onnx.load(str(path), load_external_data=False)
    for init in m.graph.initializer:
        if init.data_location == onnx.TensorProto.EXTERNAL:
            raise RuntimeError(f"{path.name}: initializer {init.name} uses external data")
    onnx.checker.check_model(m)
    for vi in m.graph.input:
        dims = vi.type.tensor_type.shape.dim
        if len(dims) < 2 or not (dims[0].dim_param and dims[1].dim_param):
            raise RuntimeError(f"{path.name}: input {vi.name} batch/sequence not symbolic: {dims}")
    size = path.stat().st_size
    if size >= MAX_FILE_BYTES:
        raise RuntimeError(f"{path.name}: {size} bytes, over {MAX_FILE_BYTES}")
    return m


def ort_run(path: Path, feeds: dict) -> np.ndarray:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    graph_inputs = [i.name for i in sess.get_inputs()]
    if sorted(graph_inputs) != sorted(feeds):
        raise RuntimeError(f"{path.name}: graph inputs {graph_inputs} != provided {sorted(feeds)}")
    outs = sess.run(None, feeds)
    if len(outs) != 1:
        raise RuntimeError(f"{path.name}: {len(outs)} outputs, expected 1")
    return outs[0]


# ---------------------------------------------------------------------------
# Reference gradients
# ---------------------------------------------------------------------------


def reference_grads(model, inputs: dict, is_decoder: bool, path: Path) -> float:
    # One thread: the MoE backward accumulates in a thread-dependent order
    # otherwise (differences ~1e-9), and the committed file should not churn.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference_grads(model, inputs, is_decoder, path)
    finally:
        torch.set_num_threads(threads)


def _reference_grads(model, inputs: dict, is_decoder: bool, path: Path) -> float:
    model.eval()
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    if is_decoder:
        ids = inputs["input_ids"]
        loss = F.cross_entropy(out[:, :-1].reshape(-1, out.shape[-1]), ids[:, 1:].reshape(-1))
        # Cross-check against transformers' own causal LM loss (labels=input_ids).
        with torch.no_grad():
            hf = super(type(model), model).forward(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                labels=ids,
                use_cache=False,
                return_dict=True,
            )
        if abs(hf.loss.item() - loss.item()) > 1e-5:
            raise RuntimeError(f"loss {loss.item()} != transformers' {hf.loss.item()}")
    else:
        loss = out.mean()
    loss.backward()
    arrays = {"loss": np.array(loss.item(), dtype=np.float32)}
    for name, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        arrays[f"param/{name}"] = p.detach().numpy().astype(np.float32)
        arrays[f"grad/{name}"] = g.detach().numpy().astype(np.float32)
    np.savez(path, **arrays)
    model.zero_grad(set_to_none=True)
    return loss.item()


# ---------------------------------------------------------------------------
# Main flow
# ---------------------------------------------------------------------------


def make_one(name: str, builder, is_decoder: bool) -> list[str]:
    print(f"== {name}", flush=True)
    torch.manual_seed(SEED)
    model = builder()
    touched = perturb_constant_params(model, SEED + 1)
    model.eval()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"   {type(model).__name__}: {n_params} parameters, perturbed {len(touched)} constant tensors")

    inputs = make_inputs(name, is_decoder, BATCH, SEQ, SEED + 2)
    output_name = "logits" if is_decoder else "last_hidden_state"

    files = {
        "legacy": HERE / f"{name}.legacy.op17.onnx",
        "dynamo": HERE / f"{name}.dynamo.op18.onnx",
    }
    with contextlib_quiet():
        export_legacy(model, inputs, output_name, files["legacy"])
    with contextlib_quiet():
        export_dynamo(model, inputs, output_name, files["dynamo"])
    model.eval()

    with torch.no_grad():
        torch_out = model(**inputs).float().numpy()
    io_arrays = {k: v.numpy() for k, v in inputs.items()}
    io_arrays["torch_out"] = torch_out
    np.savez(HERE / f"{name}.io.npz", **io_arrays)

    # A second shape, to prove the exports are not specialised to (2, 16).
    other = make_inputs(name, is_decoder, 3, 7, SEED + 3)
    with torch.no_grad():
        other_out = model(**other).float().numpy()

    failures = []
    for kind, path in files.items():
        try:
            m = check_model_file(path)
            got = ort_run(path, {k: v.numpy() for k, v in inputs.items()})
            diff = float(np.abs(got - torch_out).max())
            got2 = ort_run(path, {k: v.numpy() for k, v in other.items()})
            diff2 = float(np.abs(got2 - other_out).max())
            ok = diff < ATOL and diff2 < ATOL and got.shape == torch_out.shape
            status = "OK  " if ok else "FAIL"
            print(
                f"   {status} {path.name}: opset {onnx_opset(m)}, {len(m.graph.node)} nodes, "
                f"{path.stat().st_size} bytes, max|ort-torch| = {diff:.2e} (2x16), {diff2:.2e} (3x7)"
            )
            if not ok:
                failures.append(path.name)
        except Exception as e:  # report and carry on with the other files
            print(f"   FAIL {path.name}: {type(e).__name__}: {e}")
            failures.append(path.name)

    loss = reference_grads(model, inputs, is_decoder, HERE / f"{name}.grads.npz")
    print(f"   grads: loss = {loss:.6f} -> {name}.grads.npz")
    return failures


class contextlib_quiet:
    """Silence the exporters' chatter (stdout and stderr) unless they fail."""

    def __enter__(self):
        self._out, self._err = sys.stdout, sys.stderr
        self._buf = io.StringIO()
        sys.stdout = sys.stderr = self._buf
        return self

    def __exit__(self, exc_type, exc, tb):
        sys.stdout, sys.stderr = self._out, self._err
        if exc_type is not None:
            print(self._buf.getvalue()[-4000:], file=sys.stderr)
        return False


# ---------------------------------------------------------------------------
# Op inventory
# ---------------------------------------------------------------------------


def onnx_opset(m) -> int:
    for op in m.opset_import:
        if op.domain in ("", "ai.onnx"):
            return op.version
    return -1


def fmt_value_info(vi) -> str:
    t = vi.type.tensor_type
    dtype = onnx.TensorProto.DataType.Name(t.elem_type)
    dims = []
    for d in t.shape.dim:
        dims.append(d.dim_param if d.dim_param else (str(d.dim_value) if d.HasField("dim_value") else "?"))
    return f"{vi.name}: {dtype}[{', '.join(dims)}]"


def short_attr_value(a) -> str | None:
    """A short printable value for simple attributes, else None."""
    A = onnx.AttributeProto
    if a.type == A.INT:
        if a.name == "to":
            return onnx.TensorProto.DataType.Name(a.i)
        return str(a.i)
    if a.type == A.FLOAT:
        return f"{a.f:g}"
    if a.type == A.STRING:
        return repr(a.s.decode(errors="replace"))
    if a.type == A.INTS and len(a.ints) <= 8:
        return "[" + ",".join(str(i) for i in a.ints) + "]"
    if a.type == A.TENSOR:
        t = a.t
        return f"tensor {onnx.TensorProto.DataType.Name(t.data_type)}{list(t.dims)}"
    return None


def walk_nodes(graph, prefix=""):
    for node in graph.node:
        yield prefix, node
        for a in node.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield from walk_nodes(a.g, prefix + f"{node.op_type}.{a.name}/")
            elif a.type == onnx.AttributeProto.GRAPHS:
                for g in a.graphs:
                    yield from walk_nodes(g, prefix + f"{node.op_type}.{a.name}/")


def inventory_for(path: Path) -> str:
    m = onnx.load(str(path), load_external_data=False)
    g = m.graph
    lines = []
    size = path.stat().st_size
    opsets = ", ".join(f"{op.domain or 'ai.onnx'}={op.version}" for op in m.opset_import)
    lines.append(f"### {path}  ({size} bytes, ir_version {m.ir_version}, producer {m.producer_name} {m.producer_version})")
    lines.append(f"  opset_import: {opsets}")
    init_names = {i.name for i in g.initializer}
    lines.append("  inputs:  " + "; ".join(fmt_value_info(v) for v in g.input if v.name not in init_names))
    lines.append("  outputs: " + "; ".join(fmt_value_info(v) for v in g.output))
    init_dtypes = collections.Counter(onnx.TensorProto.DataType.Name(i.data_type) for i in g.initializer)
    n_ext = sum(1 for i in g.initializer if i.data_location == onnx.TensorProto.EXTERNAL)
    lines.append(
        f"  initializers: {len(g.initializer)} ({dict(init_dtypes)}), external: {n_ext}; "
        f"value_info entries: {len(g.value_info)}; local functions: {len(m.functions)}"
    )
    lines += initializer_mapping(path, g)
    n_meta = sum(1 for n in g.node if len(n.metadata_props))
    if n_meta:
        keys = sorted({p.key for n in g.node for p in n.metadata_props})
        lines.append(f"  node metadata_props on {n_meta} nodes, keys: {', '.join(keys)}")
    nodes = list(walk_nodes(g))
    for f in m.functions:
        nodes += [(f"function {f.domain}:{f.name}/", n) for n in f.node]
    counts = collections.Counter()
    attrs = collections.defaultdict(lambda: collections.defaultdict(set))
    domains = {}
    where = collections.defaultdict(set)
    for prefix, node in nodes:
        key = (node.domain, node.op_type)
        counts[key] += 1
        domains[key] = node.domain
        if prefix:
            where[key].add(prefix.rstrip("/"))
        for a in node.attribute:
            v = short_attr_value(a)
            attrs[key][a.name].add(v if v is not None else "<" + onnx.AttributeProto.AttributeType.Name(a.type) + ">")
    lines.append(f"  nodes: {len(nodes)} ({len(g.node)} in main graph), op types: {len(counts)}")
    for key in sorted(counts, key=lambda k: (k[0], k[1])):
        dom, op = key
        parts = []
        for an in sorted(attrs[key]):
            vals = sorted(attrs[key][an], key=str)
            shown = vals if len(vals) <= 10 else vals[:10] + [f"...+{len(vals) - 10}"]
            parts.append(f"{an}={{{' | '.join(shown)}}}")
        dom_s = f" [domain {dom}]" if dom else ""
        where_s = f" (in {', '.join(sorted(where[key]))})" if where[key] else ""
        lines.append(f"    {op:<22} x{counts[key]:<4}{dom_s}{where_s}  attrs: {', '.join(parts) if parts else '-'}")
    return "\n".join(lines)


def initializer_mapping(path: Path, g) -> list[str]:
    """How the float initializers relate to the torch parameters in <model>.grads.npz."""
    grads = path.parent / (path.name.split(".")[0] + ".grads.npz")
    if path.parent != HERE or not grads.exists():
        return []
    from onnx import numpy_helper

    with np.load(grads) as z:
        params = {k[len("param/"):]: z[k] for k in z.files if k.startswith("param/")}
    by_name, renamed, unmatched, used = 0, [], [], set()
    for init in g.initializer:
        if init.data_type != onnx.TensorProto.FLOAT:
            continue
        a = numpy_helper.to_array(init)
        if init.name in params and np.array_equal(params[init.name], a):
            by_name += 1
            used.add(init.name)
            continue
        hit = None
        for pname, pv in params.items():
            if pv.shape == a.shape and np.array_equal(pv, a):
                hit = pname
            elif pv.ndim >= 2 and pv.shape[:-2] + pv.shape[:-3:-1] == a.shape and np.array_equal(
                np.swapaxes(pv, -1, -2), a
            ):
                hit = f"T({pname})"
            if hit:
                used.add(pname)
                break
        if hit:
            renamed.append(f"{init.name}={hit}")
        elif a.size > 1:
            unmatched.append(f"{init.name}{list(a.shape)}")
    missing = sorted(set(params) - used)
    out = [
        f"  float initializers vs torch params ({len(params)} in {grads.name}): {by_name} same name and value, "
        f"{len(renamed)} renamed copies (T = transposed last two axes), "
        f"{len(unmatched)} non-scalar others, params not stored: {missing or 'none'}"
    ]
    if renamed:
        out.append("    renamed: " + ", ".join(renamed))
    if unmatched:
        out.append("    others: " + ", ".join(unmatched))
    return out


def write_inventory() -> str:
    files = sorted(HERE.glob("*.onnx")) + (sorted(SHARED_ONNX.glob("*.onnx")) if SHARED_ONNX.is_dir() else [])
    header = (
        f"# ONNX op inventory (torch {torch.__version__}, transformers {transformers.__version__}, "
        f"onnx {onnx.__version__}, onnxruntime {ort.__version__})\n"
        "# per op type: count, then every attribute name seen with its distinct values\n"
    )
    text = header + "\n\n".join(inventory_for(p) for p in files) + "\n"
    INVENTORY_PATH.write_text(text)
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--inventory", action="store_true", help="only print/write the op inventory")
    ap.add_argument("--only", nargs="*", choices=list(MODELS), help="make only these models")
    args = ap.parse_args()

    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, onnx {onnx.__version__}, "
        f"onnxruntime {ort.__version__}, numpy {np.__version__}"
    )
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    failures = []
    if not args.inventory:
        for name in args.only or MODELS:
            builder, is_decoder = MODELS[name]
            failures += make_one(name, builder, is_decoder)
    print()
    print(write_inventory())
    print(f"(inventory written to {INVENTORY_PATH})")
    if failures:
        print("FAILED: " + ", ".join(failures))
        return 1
    print("all exports verified")
    return 0


if __name__ == "__main__":
    sys.exit(main())
