"""compare_ranks.py NAME REF.json RUN.json REF.npz RUN.npz: a multi-rank run against the
single-rank reference. PASS when every step's loss and every parameter agree within 1e-5
relative (the loss: |a-b|/|a|; a parameter: L2 of the difference over L2 of the reference),
as DESIGN.md's numerics invariant asks of fp32 plans."""
import json, sys
import numpy as np

TOL = 1e-5
name, rj, gj, rn, gn = sys.argv[1:6]
try:
    r, g = json.load(open(rj)), json.load(open(gj))
except Exception as e:
    print(f"RESULT {name}: FAIL no JSON ({e})"); sys.exit(0)
rl, gl = np.array(r["losses"], float), np.array(g["losses"], float)
if rl.shape != gl.shape:
    print(f"RESULT {name}: FAIL {len(gl)} losses, reference {len(rl)}"); sys.exit(0)
dl = float(np.max(np.abs(rl - gl) / np.maximum(np.abs(rl), 1e-30)))
# every rank reports the same (all-reduced) loss?
spread = 0.0
for rank in g.get("rank_losses", []) or []:
    x = np.array(rank, float)
    spread = max(spread, float(np.max(np.abs(x - gl) / np.maximum(np.abs(gl), 1e-30))))
worst, wn, missing = 0.0, "", []
try:
    a, b = np.load(rn), np.load(gn)
    for k in a.files:
        if k not in b.files:
            missing.append(k); continue
        x, y = a[k].astype(np.float64), b[k].astype(np.float64)
        d = float(np.linalg.norm(x - y) / max(np.linalg.norm(x), 1e-30))
        if d > worst:
            worst, wn = d, k
except Exception as e:
    wn = f"params not compared ({e})"; worst = float("inf")
steps = [round(1e3 * s, 1) for s in g.get("step_seconds", [])]
ok = dl <= TOL and worst <= TOL and not missing
print(f"RESULT {name}: {'PASS' if ok else 'FAIL'} losses rel {dl:.1e}, worst param rel L2 {worst:.1e} ({wn})"
      f"{', missing ' + str(missing) if missing else ''}, rank loss spread {spread:.1e}; step ms {steps}")
