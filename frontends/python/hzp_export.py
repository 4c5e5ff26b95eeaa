#!/usr/bin/env python3
"""Export a PyTorch model to ONNX for training with hzp, keeping PyTorch's parameters.

PyTorch's ONNX exporters are made for inference: they merge initializers with equal values
(a fresh model's LayerNorm weights are all ones, so every norm of the model becomes one
initializer), may fold expressions of parameters into new constants, and rename weights
(`onnx::MatMul_737`, `val_244`). A model trained from such a file has ties the user never
wrote, and its parameters do not load back into the PyTorch model.

`export_for_training` avoids all three:

1. every parameter gets a unique random value (fixed seed) for the export, so no two can be
   merged; the model is exported twice with different random values, and an initializer
   whose values change between the two exports depends on the parameters: it must be one
   of them (identified by exact equality, or equality with the transpose), or the export is
   an error naming it (a parameter folded into a new constant);
2. the true values are written back into the identified initializers (the model itself is
   left as it was);
3. beside the model it writes `<stem>.names.json`: for every initializer that is a
   parameter, the `state_dict` keys it stands for (and whether it holds the transpose), the
   real ties (keys that are one tensor in PyTorch, e.g. a tied LM head) and the shape of
   every key; and `<stem>.io.npz`: the example inputs (keys = graph input names) and
   PyTorch's outputs (keys = graph output names), so that
   `hzp eval MODEL --inputs X.io.npz --reference X.io.npz` checks the import.

hzp reads `<stem>.names.json` when it lies beside the model (or `--names FILE`): every
parameter is then named by its state_dict key, PyTorch's ties are kept and no others, and
what hzp writes (`--save-params`, `hzp grad`, checkpoints) loads with
`model.load_state_dict(..., strict=True)`.

Needs torch and onnx (and onnxscript for the dynamo exporter).

Command line:
    python hzp_export.py FILE.py:FUNCTION OUT.onnx [--exporter legacy|dynamo] [--opset N]
where FUNCTION() returns (model, example_inputs), example_inputs a dict name -> tensor.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import numpy_helper

SEED = 20240611
FORMAT = "hzp.names/1"
DEFAULT_OPSET = {"legacy": 17, "dynamo": 18}


class ExportError(RuntimeError):
    """An export that would not give hzp the user's parameters."""


def _parameter_groups(model: torch.nn.Module):
    """[(keys, parameter)] with every state_dict key of each distinct parameter."""
    groups: dict[int, tuple[list[str], torch.nn.Parameter]] = {}
    for key, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), ([], p))[0].append(key)
    return list(groups.values())


def _randomize(groups, seed: int):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in groups:
            r = torch.randn(p.shape, generator=gen, dtype=torch.float32) * 0.02
            # an offset per tensor too: no two tensors of equal shape share a value pattern
            r += torch.rand((), generator=gen) + 0.5
            p.copy_(r.to(p.dtype))


def _export(model, inputs: dict, path: Path, exporter: str, opset: int, constant_folding: bool,
            param_names=()):
    names = list(inputs)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        outs = model(**inputs)
    single = not isinstance(outs, (tuple, list))
    n_out = 1 if single else len(outs)
    out_names = ["output"] if n_out == 1 else [f"output_{i}" for i in range(n_out)]
    if exporter == "legacy":
        dyn = {n: {0: "batch", 1: "sequence"} for n in names}
        torch.onnx.export(
            model,
            tuple(inputs.values()),
            str(path),
            dynamo=False,
            opset_version=opset,
            input_names=names,
            output_names=out_names,
            dynamic_axes=dyn,
            # folding turns Transpose(W) into a new initializer holding W's transpose, which
            # is found and named by its key like any other (with "transpose": true)
            do_constant_folding=constant_folding,
        )
    elif exporter == "dynamo":
        batch = torch.export.Dim("batch", min=1, max=1024)
        seq = torch.export.Dim("sequence", min=2, max=4096)
        dynamic_shapes = {n: {0: batch, 1: seq} for n in names}
        prog = torch.onnx.export(
            model,
            tuple(inputs.values()),
            dynamo=True,
            opset_version=opset,
            input_names=names,
            output_names=out_names,
            dynamic_shapes=dynamic_shapes,
            optimize=False,
            verify=False,
            report=False,
        )
        # The optimizer is needed (it rewrites SplitToSequence / SequenceAt and other
        # patterns into plain ops), but its constant folding would turn expressions of
        # parameters into new constants (Gemma's `1 + w`): without constant_folding it
        # folds no node that reads a parameter.
        import onnxscript.optimizer

        params = set(param_names)
        if constant_folding:
            onnxscript.optimizer.optimize_ir(prog.model)
        else:
            def should_fold(node):
                for v in node.inputs:
                    if v is not None and v.name in params and v.const_value is not None:
                        return False
                return None

            onnxscript.optimizer.optimize_ir(prog.model, should_fold=should_fold)
        prog.save(str(path), external_data=False)
    else:
        raise ExportError(f"exporter must be 'legacy' or 'dynamo', not {exporter!r}")
    model.train(was_training)
    m = onnx.load(str(path))
    for node in m.graph.node:  # absolute paths of this machine; a third of the file
        kept = [p for p in node.metadata_props if p.key != "pkg.torch.onnx.stack_trace"]
        if len(kept) != len(node.metadata_props):
            del node.metadata_props[:]
            node.metadata_props.extend(kept)
    return m


def _float_inits(m: onnx.ModelProto) -> dict[str, np.ndarray]:
    out = {}
    for t in m.graph.initializer:
        if t.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16,
                           onnx.TensorProto.DOUBLE):
            out[t.name] = numpy_helper.to_array(t)
    return out


def _identify(a: np.ndarray, groups, values):
    """(group index, transposed) of the parameter whose random values `a` holds, or None."""
    for gi, (_, p) in enumerate(groups):
        v = values[gi]
        if a.shape == v.shape and np.array_equal(a, v):
            return gi, False
        if v.ndim == 2 and a.shape == v.T.shape and np.array_equal(a, v.T):
            return gi, True
    return None


def export_for_training(model: torch.nn.Module, example_inputs: dict, path, exporter: str = "dynamo",
                        opset: int | None = None, constant_folding: bool = False) -> dict:
    """Exports `model` to `path` (ONNX) with symbolic batch and sequence dims (dims 0 and 1 of
    every input) for training with hzp; writes `<stem>.names.json` and `<stem>.io.npz` beside
    it. Returns the name map. The model's parameters are left as they were.

    `constant_folding` (default off) lets the exporter fold constant subgraphs; a parameter
    folded into anything but itself or its transpose is then an error naming the
    initializer."""
    path = Path(path)
    if not isinstance(example_inputs, dict) or not example_inputs:
        raise ExportError("example_inputs must be a dict: input name -> tensor")
    opset = opset or DEFAULT_OPSET.get(exporter, 18)
    groups = _parameter_groups(model)
    true = [p.detach().clone() for _, p in groups]
    inits = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for k, seed in enumerate((SEED, SEED + 1)):
                _randomize(groups, seed)
                values = [p.detach().float().numpy().copy() for _, p in groups]
                m = _export(model, example_inputs, Path(tmp) / f"x{k}.onnx", exporter, opset,
                            constant_folding, [key for keys, _ in groups for key in keys])
                inits.append((m, _float_inits(m), values))
    finally:
        with torch.no_grad():
            for (_, p), t in zip(groups, true):
                p.copy_(t)
    (m, first, values), (m2, second, _) = inits
    if sorted(first) != sorted(second):
        raise ExportError("the two exports have different initializers; the exporter is not deterministic here")

    initializers: dict[str, list[dict]] = {}
    found = {}
    derived = []
    for name, a in first.items():
        b = second[name]
        if a.shape == b.shape and np.array_equal(a, b):
            continue  # a constant of the model (a buffer, a mask, a literal): keep it
        hit = _identify(a.astype(np.float32), groups, values)
        if hit is None:
            derived.append(f"`{name}` {list(a.shape)}")
            continue
        gi, transposed = hit
        keys = groups[gi][0]
        initializers[name] = [{"key": k, "transpose": transposed} for k in keys]
        found[name] = (gi, transposed)
    if derived:
        raise ExportError(
            f"{len(derived)} initializer(s) of the {exporter} export are computed from parameters "
            f"but are none of them (the exporter folded an expression of a parameter into a new "
            f"constant): {', '.join(derived)}; hzp would train the folded value, not the "
            f"parameter. Export with constant_folding=False (the default), or with the other "
            f"exporter.")
    used = {gi for gi, _ in found.values()}
    missing = [groups[gi][0][0] for gi in range(len(groups)) if gi not in used and groups[gi][1].requires_grad]
    if missing:
        print(f"hzp_export: note: {len(missing)} parameter(s) are not in the export (the forward does "
              f"not read them): {', '.join(missing)}", file=sys.stderr)

    # the true values go back into the identified initializers
    for t in m.graph.initializer:
        if t.name in found:
            gi, transposed = found[t.name]
            v = true[gi].detach().cpu()
            arr = v.float().numpy() if v.dtype == torch.bfloat16 else v.numpy()
            if transposed:
                arr = arr.T
            new = numpy_helper.from_array(np.ascontiguousarray(arr).astype(numpy_helper.to_array(t).dtype),
                                          t.name)
            t.CopyFrom(new)
    onnx.save(m, str(path))

    parameters = {}
    for keys, p in groups:
        for k in keys:
            parameters[k] = {"shape": list(p.shape), "dtype": str(p.dtype).replace("torch.", "")}
    names = {
        "format": FORMAT,
        "model": path.name,
        "exporter": exporter,
        "opset": opset,
        "initializers": initializers,
        "ties": [keys for keys, _ in groups if len(keys) > 1],
        "parameters": parameters,
    }
    stem = path.with_suffix("")
    Path(f"{stem}.names.json").write_text(json.dumps(names, indent=1) + "\n")

    # inputs and PyTorch's outputs, keyed by the graph's names
    model_was_training = model.training
    model.eval()
    with torch.no_grad():
        outs = model(**example_inputs)
    model.train(model_was_training)
    outs = [outs] if not isinstance(outs, (tuple, list)) else list(outs)
    arrays = {k: v.detach().cpu().numpy() for k, v in example_inputs.items()}
    for o, t in zip(m.graph.output, outs):
        arrays[o.name] = t.detach().float().cpu().numpy()
    np.savez(f"{stem}.io.npz", **arrays)
    return names


def _load_function(spec: str):
    file, _, func = spec.rpartition(":")
    if not file or not func:
        raise ExportError(f"{spec!r}: give FILE.py:FUNCTION")
    mod_spec = importlib.util.spec_from_file_location(Path(file).stem, file)
    if mod_spec is None or mod_spec.loader is None:
        raise ExportError(f"{file}: cannot be loaded as a Python file")
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    if not hasattr(mod, func):
        raise ExportError(f"{file} has no function {func!r}")
    return getattr(mod, func)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("function", metavar="FILE.py:FUNCTION",
                    help="a function returning (model, example_inputs)")
    ap.add_argument("output", metavar="OUT.onnx")
    ap.add_argument("--exporter", choices=["legacy", "dynamo"], default="dynamo")
    ap.add_argument("--opset", type=int, default=None)
    ap.add_argument("--constant-folding", action="store_true",
                    help="let the exporter fold constants (a parameter folded into a new value is an error)")
    a = ap.parse_args(argv)
    try:
        model, inputs = _load_function(a.function)()
        names = export_for_training(model, inputs, a.output, a.exporter, a.opset, a.constant_folding)
    except ExportError as e:
        print(f"hzp_export: error: {e}", file=sys.stderr)
        return 1
    stem = Path(a.output).with_suffix("")
    print(f"wrote {a.output}, {stem}.names.json ({len(names['initializers'])} parameter initializers, "
          f"{len(names['ties'])} ties), {stem}.io.npz")
    return 0


if __name__ == "__main__":
    sys.exit(main())
