#!/usr/bin/env python3
"""Builds the model of the overlap benchmark (examples/bench/run_overlap.sh).

A GPT-2 from a `transformers` config with a fixed seed: 8 layers, hidden 256, 4 heads, MLP
1024, vocab 2048, 128 positions, dropout 0, and a batch of 8 x 128 token ids. Deep enough
that the first gather and the last reduction of a step (which nothing can hide within one
step) are a small part of its communication. Exported with the legacy exporter at opset 17
with a dynamic batch dimension (the data-parallel ranks each take part of the batch).

    python examples/bench/make_overlap_model.py OUT_DIR

writes OUT_DIR/gpt2_8l.onnx and OUT_DIR/gpt2_8l.npz (key `input_ids`). Needs torch,
transformers and numpy (a benchmark dependency only).
"""

import sys
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_vs_torch as base  # noqa: E402  (its model builder and batch maker)

warnings.filterwarnings("ignore")


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    base.CONFIG.update(vocab=2048, hidden=256, layers=8, heads=4, seq=128, batch=8)
    model = base.build_model()
    ids = base.make_batch()
    base.export(model, ids, out / "gpt2_8l.onnx", dynamic_batch=True)
    np.savez(out / "gpt2_8l.npz", input_ids=ids.numpy())
    print(f"wrote {out / 'gpt2_8l.onnx'} and {out / 'gpt2_8l.npz'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
