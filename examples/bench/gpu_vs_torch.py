#!/usr/bin/env python3
"""Same-card benchmark: one GPT-2 training step, PyTorch eager, torch.compile and hzp.

A benchmark, not a test: it runs on the device machine (see examples/device/prepare.sh) and
writes one JSON file; nothing here runs in CI. In one process, on one card, for each config
it

1. builds the GPT-2 of examples/bench/train_vs_torch.py (fixed seed, dropout 0, no two
   parameters equal) at the config's size and a fixed batch, and exports it with the legacy
   exporter (opset 17);
2. times PyTorch's training step (forward, causal-LM cross-entropy, backward,
   torch.optim.AdamW lr 1e-3, betas 0.9/0.999, eps 1e-8, weight decay 0.01) eager and under
   torch.compile, in fp32 and under bf16 autocast, each from the same initial weights:
   median of --steps steps after --warmup steps, peak memory from
   torch.cuda.max_memory_allocated;
3. compiles the export with `hzp compile --mesh gpu=1 --precision fp32|bf16` and times
   `hzp run --backend cuda` (median of the step times after the first), its peak GPU memory
   read from nvidia-smi every 50 ms above the memory in use before the run;
4. writes --out (default bench.json): `card`, `commit`, `torch`, and per config the step
   times (`{hzp,torch_eager,torch_compile}_{fp32,bf16}_ms`), tokens/s, MFU (model FLOPs:
   6 x parameters x tokens plus attention's 12 x layers x hidden x seq x tokens, over the
   card's dense peak when the card is known), peak memory (`*_peak_gib_*`) and the first
   losses of every run with hzp's relative difference to PyTorch eager's.

A ratio is only a result when both sides ran in the same call on the same card: the file
holds one card and one commit.

Usage, from the repository root (on the device machine, with `.device/` from prepare.sh):

    python3 examples/bench/gpu_vs_torch.py --hzp .device/hzp --out $OUT/gpu_vs_torch.json

A dry run on a machine without a GPU (CPU backends, tiny config, no torch.compile):

    python3 examples/bench/gpu_vs_torch.py --device cpu --configs tiny --no-compile \
        --hzp target/release/hzp --out /tmp/gpu_vs_torch.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_vs_torch as tv  # noqa: E402  (the model, batch and export of the CPU benchmark)

CONFIGS = {
    "tiny": dict(vocab=512, hidden=64, layers=2, heads=2, seq=32, batch=2),
    "bench": dict(vocab=8192, hidden=512, layers=4, heads=8, seq=256, batch=4),
    "gpt2s": dict(vocab=50257, hidden=768, layers=12, heads=12, seq=1024, batch=8),
}
# dense peak FLOP/s by card (bf16 tensor cores; fp32 without TF32), from NVIDIA's data sheets
PEAKS = {
    "H100": {"bf16": 989e12, "fp32": 67e12},
    "H200": {"bf16": 989e12, "fp32": 67e12},
}
PRECISIONS = ("fp32", "bf16")


def card_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name(0)
    return "cpu"


def peak_flops(card: str, prec: str) -> float | None:
    for key, peaks in PEAKS.items():
        if key in card:
            return peaks[prec]
    return None


def commit_of(hzp: Path, given: str | None) -> str:
    """The commit hzp was built at: --commit, else the COMMIT file beside the binary (which
    examples/device/prepare.sh writes), else this checkout's HEAD."""
    if given:
        return given
    beside = hzp.parent / "COMMIT"
    if beside.is_file():
        return beside.read_text().strip()
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() or "unknown"


class MemPoll:
    """The most GPU memory nvidia-smi reports in use while the block runs, in bytes above
    what was in use when it began (None without nvidia-smi)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.base = self.peak = None
        self._stop = threading.Event()

    @staticmethod
    def _used_mib() -> int | None:
        r = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
        )
        words = r.stdout.split()
        return int(words[0]) if r.returncode == 0 and words and words[0].isdigit() else None

    def _loop(self):
        while not self._stop.wait(0.05):
            used = self._used_mib()
            if used is not None:
                self.peak = max(self.peak or 0, used)

    def __enter__(self):
        if self.enabled:
            self.base = self._used_mib()
            if self.base is not None:
                self._thread = threading.Thread(target=self._loop, daemon=True)
                self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self.base is not None:
            self._thread.join()

    def bytes_above_base(self) -> int | None:
        if self.base is None or self.peak is None:
            return None
        return max(self.peak - self.base, 0) * 2**20


def torch_run(model, ids, device, prec, compiled, steps, warmup):
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    fwd = torch.compile(model) if compiled else model
    opt = torch.optim.AdamW(
        model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01
    )
    model.train()
    losses, times = [], []
    for i in range(warmup + steps):
        sync()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=prec == "bf16"):
            loss = tv.lm_loss(fwd(ids), ids)
        loss.backward()
        opt.step()
        sync()
        losses.append(loss.item())
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
    return losses, times, peak


def hzp_run(hzp, onnx, batch, work, device, prec, steps, timeout):
    plan = work / f"plan.{prec}.json"
    compile_cmd = [
        str(hzp), "compile", str(onnx), "--inputs", str(batch), "--loss", "lm", "--retie",
        "--no-fuse-attention", "--mesh", "gpu=1", "--precision", prec, "-o", str(plan),
    ]
    r = subprocess.run(compile_cmd, capture_output=True, text=True)
    if r.returncode:
        return None, f"hzp compile failed: {r.stderr[-2000:]}"
    run_cmd = [
        str(hzp), "run", str(plan), "--inputs", str(batch), "--steps", str(steps + 1),
        "--backend", device, "--format", "json",
    ]
    with MemPoll(device == "cuda") as mem:
        try:
            r = subprocess.run(run_cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return None, f"hzp run timed out after {timeout} s"
    if r.returncode:
        return None, f"hzp run failed (rc {r.returncode}): {r.stderr[-3000:]}"
    out = json.loads(r.stdout)
    return (out["losses"], out["step_seconds"][1:], mem.bytes_above_base()), None


def gib(b):
    return None if b is None else round(b / 2**30, 3)


def bench_config(name, a, device, card):
    tv.CONFIG.update(CONFIGS[name])
    c = tv.CONFIG
    work = a.work / name
    work.mkdir(parents=True, exist_ok=True)
    model = tv.build_model()
    ids = tv.make_batch()
    onnx, batch = work / "model.onnx", work / "batch.npz"
    tv.export(model, ids, onnx)
    np.savez(batch, input_ids=ids.numpy())
    params = sum(p.numel() for p in model.parameters())
    tokens = c["batch"] * c["seq"]
    flops = 6 * params * tokens + 12 * c["layers"] * c["hidden"] * c["seq"] * tokens
    row = dict(config=dict(c), params=params, tokens=tokens, flops_per_step=flops, losses={})
    print(f"== {name}: {c}, {params / 1e6:.1f}M parameters", flush=True)

    def record(tag, prec, losses, times, peak):
        ms = 1e3 * statistics.median(times)
        row[f"{tag}_{prec}_ms"] = round(ms, 3)
        row[f"{tag}_{prec}_tokens_per_s"] = round(tokens / (ms / 1e3), 1)
        p = peak_flops(card, prec)
        row[f"{tag}_{prec}_mfu"] = None if p is None else round(flops / (ms / 1e3) / p, 4)
        row[f"{tag}_peak_gib_{prec}"] = gib(peak)
        row["losses"][f"{tag}_{prec}"] = losses[: a.loss_steps]
        print(f"{tag} {prec}: median {ms:.2f} ms, peak {gib(peak)} GiB, losses {losses[:3]}",
              flush=True)

    state = {k: v.clone() for k, v in model.state_dict().items()}
    ids_dev = ids.to(device)
    for tag, compiled in [("torch_eager", False), ("torch_compile", True)]:
        if compiled and a.no_compile:
            continue
        for prec in PRECISIONS:
            model.load_state_dict(state)
            model.to(device)
            losses, times, peak = torch_run(model, ids_dev, device, prec, compiled, a.steps,
                                            a.warmup)
            record(tag, prec, losses, times, peak)
            model.cpu()
    for prec in PRECISIONS:
        got, err = hzp_run(a.hzp, onnx, batch, work, device, prec, a.steps, a.hzp_timeout)
        if err:
            row[f"hzp_{prec}_error"] = err
            print(f"hzp {prec}: {err}", flush=True)
            continue
        losses, times, peak = got
        record("hzp", prec, losses, times, peak)
        ref = row["losses"][f"torch_eager_{prec}"]
        n = min(len(ref), len(losses))
        row[f"hzp_{prec}_loss_rel_diff"] = max(
            abs(x - y) / abs(y) for x, y in zip(losses[:n], ref[:n])
        )
        for tag in ("torch_eager", "torch_compile"):
            if f"{tag}_{prec}_ms" in row:
                row[f"hzp_over_{tag}_{prec}"] = round(
                    row[f"hzp_{prec}_ms"] / row[f"{tag}_{prec}_ms"], 3
                )
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hzp", type=Path, required=True, help="the hzp binary (--features cuda)")
    ap.add_argument("--out", type=Path, default=Path("bench.json"))
    ap.add_argument("--work", type=Path, default=Path("/tmp/hzp-gpu-vs-torch"))
    ap.add_argument("--configs", default="gpt2s", help=f"comma-separated: {', '.join(CONFIGS)}")
    ap.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    ap.add_argument("--warmup", type=int, default=3, help="PyTorch warm-up steps (default 3)")
    ap.add_argument("--loss-steps", type=int, default=10, help="losses kept per run")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    ap.add_argument("--commit", help="the commit hzp was built at (default: COMMIT beside --hzp, else git)")
    ap.add_argument("--hzp-timeout", type=int, default=int(os.environ.get("HZP_RUN_S", "240")))
    a = ap.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device visible to PyTorch: use --device cpu for a dry run")
    unknown = [c for c in a.configs.split(",") if c not in CONFIGS]
    if unknown:
        sys.exit(f"unknown config(s) {unknown}: choose from {', '.join(CONFIGS)}")
    card = card_name(a.device)
    res = dict(card=card, commit=commit_of(a.hzp, a.commit), torch=torch.__version__,
               device=a.device, steps=a.steps, warmup=a.warmup, configs={})
    for name in a.configs.split(","):
        res["configs"][name] = bench_config(name, a, a.device, card)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(res, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
