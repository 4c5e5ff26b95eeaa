#!/usr/bin/env python3
"""One routed mixture-of-experts layer whose experts drop tokens, computed with numpy the way
GShard writes it (one-hot masks, cumulative sums for each choice's position in its expert,
priorities one after another), in float64: the oracle for hzp's MoeDispatch / MoeCombine
with a capacity (`routed_moe_layer_with_drops_matches_numpy_gshard` in
passes/tests/autodiff_fd.rs). PyTorch has no capacity-based MoE of its own to compare with.

Writes moe_drops.npz beside this file: `x [T,H]`, the router `gate.weight [E,H]`, the experts'
`gate_up_proj [E,2F,H]` and `down_proj [E,H,F]` (Mixtral's SwiGLU, transformers 5 layout),
`capacity`, `top_k`, `kept [T,K]` (whether each choice found room) and `y [T,H]`.

Usage: python3 tests/models/make_moe_drops.py   (numpy only; seed 0, same bytes every run)
"""

from pathlib import Path

import numpy as np

T, H, F, E, K, CAPACITY = 12, 8, 6, 4, 2, 3


def main() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((T, H)).astype(np.float32)
    router = (rng.standard_normal((E, H)) * 0.5).astype(np.float32)
    gate_up = (rng.standard_normal((E, 2 * F, H)) * 0.3).astype(np.float32)
    down = (rng.standard_normal((E, H, F)) * 0.3).astype(np.float32)

    x64, r64 = x.astype(np.float64), router.astype(np.float64)
    logits = x64 @ r64.T
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    choice = np.argsort(-p, axis=1, kind="stable")[:, :K]  # [T, K], best first
    top = np.take_along_axis(p, choice, axis=1)
    weight = top / top.sum(axis=1, keepdims=True)  # renormalized, as Mixtral

    # GShard: positions of priority j start after every choice of priorities < j
    kept = np.zeros((T, K), dtype=bool)
    taken = np.zeros(E, dtype=np.int64)
    for j in range(K):
        onehot = np.eye(E, dtype=np.int64)[choice[:, j]]  # [T, E]
        position = ((np.cumsum(onehot, axis=0) - 1 + taken) * onehot).sum(axis=1)
        kept[:, j] = position < CAPACITY
        taken += onehot.sum(axis=0)

    y = np.zeros((T, H))
    for t in range(T):
        for j in range(K):
            if not kept[t, j]:
                continue
            e = choice[t, j]
            gu = gate_up[e].astype(np.float64) @ x64[t]
            a = gu[:F] / (1.0 + np.exp(-gu[:F])) * gu[F:]
            y[t] += weight[t, j] * (down[e].astype(np.float64) @ a)

    out = Path(__file__).resolve().parent / "moe_drops.npz"
    np.savez(
        out,
        x=x,
        **{
            "gate.weight": router,
            "experts.gate_up_proj": gate_up,
            "experts.down_proj": down,
        },
        capacity=np.array(CAPACITY, dtype=np.int64),
        top_k=np.array(K, dtype=np.int64),
        kept=kept,
        y=y.astype(np.float32),
    )
    print(f"wrote {out}: {int((~kept).sum())} of {T * K} choices dropped")


if __name__ == "__main__":
    main()
