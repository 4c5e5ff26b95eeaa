"""make_gpt2s.py DIR: GPT-2 small (124M: vocab 50257, hidden 768, 12 layers, 12 heads, seq
1024) and a batch of 8 sequences, as examples/bench/train_vs_torch.py builds and exports
them (DIR/model.onnx, DIR/batch.npz)."""
import sys
from pathlib import Path
import numpy as np
sys.path.insert(0, str(Path(__file__).parent))
import train_vs_torch as tv

out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
tv.CONFIG.update(dict(vocab=50257, hidden=768, layers=12, heads=12, seq=1024, batch=8))
model = tv.build_model(); ids = tv.make_batch()
tv.export(model, ids, out / "model.onnx")
np.savez(out / "batch.npz", input_ids=ids.numpy())
print(f"exported GPT-2 small: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")
