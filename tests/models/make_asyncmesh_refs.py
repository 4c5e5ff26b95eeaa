"""Reference for hzp's asyncmesh strategy (tests/asyncmesh.rs), written from the pseudo-code
of passes/src/dist/asyncmesh.rs, independently of hzp:

mesh node=2,gpu=2, slow axis `node`: replica r (node r) holds rows [4r, 4r+4) of the global
batch of 8 and trains on them with ordinary (synchronous) AdamW; its parameters' master
copies are sharded over `gpu` (o = 2: each parameter flattened, padded to a multiple of 2,
halved). Every step t, per shard of n elements, k = min(n, ceil(S n / H)):
  idx = (t k + arange(k)) mod n
  send_r = theta_r[idx] + u_r[idx]            (taken before the local step)
  theta_r' = AdamW step of replica r
  d_r = theta_r' - theta_r
  theta_r'[idx] = mean_r(send_r) + d_r[idx] - u_r[idx]   (u_r as sent)
  u_r = B u_r + (1 - B) d_r
The reported loss is the mean of the replicas' losses (MSE, mean over elements).

Writes tests/models/asyncmesh/: mlp.hzp (examples/models/mlp.hzp with 2 rows per rank),
mlp.weights.npz, io.npz (x, y: 8 rows) and ref.npz (losses, every parameter of replica 0
and 1, replica 0's u per parameter, after STEPS steps).

    /work/venv-torch/bin/python tests/models/make_asyncmesh_refs.py
"""
import math
import os
import shutil

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
OUT = os.path.join(HERE, "asyncmesh")
STEPS, S, H, B, LR, WD = 8, 0.3, 2, 0.8, 1e-2, 0.01
REPLICAS, O, ROWS = 2, 2, 4

os.makedirs(OUT, exist_ok=True)
src = open(os.path.join(ROOT, "examples/models/mlp.hzp")).read()
open(os.path.join(OUT, "mlp.hzp"), "w").write(
    src.replace("f32[4,", "f32[2,").replace("examples/models/mlp", "tests/models/asyncmesh/mlp"))
shutil.copy(os.path.join(ROOT, "examples/models/mlp.weights.npz"), os.path.join(OUT, "mlp.weights.npz"))
rng = np.random.default_rng(22)
x = rng.standard_normal((8, 8)).astype(np.float32)
y = rng.standard_normal((8, 2)).astype(np.float32)
np.savez(os.path.join(OUT, "io.npz"), x=x, y=y)

w0 = dict(np.load(os.path.join(OUT, "mlp.weights.npz")))
names = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]


def forward(p, xb):
    h = xb @ p["fc1.weight"] + p["fc1.bias"]
    a = torch.nn.functional.gelu(h)
    return a @ p["fc2.weight"] + p["fc2.bias"]


params = [{k: torch.tensor(w0[k], dtype=torch.float32, requires_grad=True) for k in names}
          for _ in range(REPLICAS)]
opts = [torch.optim.AdamW([p[k] for k in names], lr=LR, weight_decay=WD, foreach=False)
        for p in params]
us = [{k: np.zeros(int(math.ceil(w0[k].size / O)) * O, np.float32) for k in names}
      for _ in range(REPLICAS)]


def flat(t):
    n = t.numel()
    v = np.zeros(int(math.ceil(n / O)) * O, np.float32)
    v[:n] = t.detach().numpy().reshape(-1)
    return v


def chunk_index(t, n_pad):
    """Global positions (over the O shards of a padded parameter) averaged at step t."""
    n = n_pad // O
    k = min(n, max(1, math.ceil(S * n / H)))
    local = (t * k + np.arange(k)) % n
    return np.concatenate([j * n + local for j in range(O)])


losses = []
for t in range(STEPS):
    before = [{k: flat(p[k]) for k in names} for p in params]
    idx = {k: chunk_index(t, before[0][k].size) for k in names}
    step_losses = []
    for r in range(REPLICAS):
        xb = torch.tensor(x[r * ROWS:(r + 1) * ROWS])
        yb = torch.tensor(y[r * ROWS:(r + 1) * ROWS])
        opts[r].zero_grad()
        loss = ((forward(params[r], xb) - yb) ** 2).mean()
        loss.backward()
        opts[r].step()
        step_losses.append(loss.item())
    losses.append(float(np.mean(np.array(step_losses, np.float32))))
    for k in names:
        sent = [before[r][k][idx[k]] + us[r][k][idx[k]] for r in range(REPLICAS)]
        avg = np.mean(sent, axis=0, dtype=np.float32)
        for r in range(REPLICAS):
            after = flat(params[r][k])
            d = after - before[r][k]
            u_sent = us[r][k][idx[k]]
            us[r][k] = np.float32(B) * us[r][k] + np.float32(1 - B) * d
            after[idx[k]] = (avg + d[idx[k]]) - u_sent
            n = params[r][k].numel()
            with torch.no_grad():
                params[r][k].copy_(torch.tensor(after[:n]).reshape(params[r][k].shape))

ref = {"losses": np.array(losses, np.float64)}
for r in range(REPLICAS):
    for k in names:
        ref[f"replica{r}/{k}"] = params[r][k].detach().numpy()
for k in names:
    ref[f"u0/{k}"] = us[0][k]
np.savez(os.path.join(OUT, "ref.npz"), **ref)
print("losses", losses)
