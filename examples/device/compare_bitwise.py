"""compare_bitwise.py NAME A.json B.json A.npz B.npz: two runs that must give the same bits
(a CUDA graph's replays against the same steps issued one by one; the multi-tensor AdamW
against one AdamW launch per parameter): PASS when every step's loss is the same float and
every saved parameter has the same dtype, shape and bytes."""
import json, sys
import numpy as np

name, aj, bj, an, bn = sys.argv[1:6]
try:
    a, b = json.load(open(aj)), json.load(open(bj))
    za, zb = np.load(an), np.load(bn)
except Exception as e:
    print(f"RESULT {name}: FAIL missing output ({e})"); sys.exit(0)
la, lb = a.get("losses", []), b.get("losses", [])
same_losses = len(la) == len(lb) > 0 and all(x == y for x, y in zip(la, lb))
diff = [k for k in za.files
        if k not in zb.files or za[k].dtype != zb[k].dtype or za[k].shape != zb[k].shape
        or za[k].tobytes() != zb[k].tobytes()]
diff += [k for k in zb.files if k not in za.files]
ok = same_losses and not diff and len(za.files) > 0
print(f"RESULT {name}: {'PASS' if ok else 'FAIL'} ({len(la)} losses {'equal' if same_losses else 'DIFFER: %s vs %s' % (la, lb)}, "
      f"{len(za.files) - len(diff)}/{len(za.files)} parameters bit for bit{'; differ: ' + ', '.join(diff[:5]) if diff else ''})")
