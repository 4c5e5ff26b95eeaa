#!/usr/bin/env python3
"""Training-run benchmark of hzp's strategies on the CPU with emulated links.

A benchmark, not a test. It trains the byte-level tiny GPT-2 of tests/models/ on the Python
standard library's sources (README, "Train on a text corpus") over 4 ranks (node=2,gpu=2)
for --steps steps per strategy, with `hzp run --link` slowing every collective down to
emulated links whose slow (inter-node) axis is 10x slower than the fast one, and prints side
by side: the final held-out loss and its difference from the synchronous asynchzp run, the
mean step time, exposed communication and the bytes each rank sends per step across the
slow axis (from `hzp inspect`).

Every strategy trains from the same initial weights on the same batches (same --shuffle
seed). Needs only the hzp binary and python3 (no PyTorch).

Usage:
  cargo build --release
  python3 examples/bench/strategies_cpu.py [--steps 300] [--strategies asynchzp,acco]
      [--link intra=100MB/s,inter=10MB/s] [--workdir /tmp/hzp-strategies]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "tests/models/gpt2_tiny.legacy.op17.onnx"


def sh(args: list[str], quiet: bool = True) -> str:
    started = time.time()
    out = subprocess.run(args, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"failed ({out.returncode}): {' '.join(args)}\n{out.stderr}")
    if not quiet:
        print(f"  ({time.time() - started:.1f} s) {' '.join(args)}", file=sys.stderr)
    return out.stdout


def per_strategy(spec: str) -> dict[str, list[str]]:
    """'name:flag flag;name:flag' -> {name: [flag, flag]}."""
    out: dict[str, list[str]] = {}
    for part in filter(None, spec.split(";")):
        name, flags = part.split(":", 1)
        out[name.strip()] = flags.split()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hzp", default=str(ROOT / "target/release/hzp"))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--strategies", default="asynchzp,acco")
    ap.add_argument("--mesh", default="node=2,gpu=2")
    ap.add_argument("--shape", default="input_ids=16x64")
    ap.add_argument("--link", default="intra=100MB/s,inter=10MB/s")
    ap.add_argument("--workdir", default="/tmp/hzp-strategies")
    ap.add_argument("--lr", default="1e-3", help="the peak learning rate (hzp compile --lr)")
    ap.add_argument("--shuffle", type=int, default=1, help="the sampling seed (hzp run --shuffle)")
    ap.add_argument("--extra", default="", help="extra compile flags per strategy: "
                    "name:flag flag;name:flag (e.g. 'asyncmesh:--slow-axis node')")
    ap.add_argument("--run-extra", default="", help="extra `hzp run` flags per strategy, "
                    "same form (e.g. 'asyncmesh:--lr 4.2e-3')")
    a = ap.parse_args()
    hzp = a.hzp
    wd = Path(a.workdir)
    wd.mkdir(parents=True, exist_ok=True)
    train, val = wd / "stdlib.bin", wd / "stdlib.val.bin"
    if not train.exists():
        stdlib = sysconfig.get_paths()["stdlib"]
        sh([hzp, "data", "prepare", stdlib, "--suffix", ".py", "-o", str(train),
            "--val-output", str(val), "--val-fraction", "0.05"], quiet=False)
    extra = per_strategy(a.extra)
    run_extra = per_strategy(a.run_extra)
    rows = []
    for strategy in a.strategies.split(","):
        plan = wd / f"{strategy}.json"
        sh([hzp, "compile", str(MODEL), "--shape", a.shape, "--retie", "--lr", a.lr,
            "--mesh", a.mesh, "--strategy", strategy, "-o", str(plan)]
           + extra.get(strategy, []), quiet=False)
        inspect = json.loads(sh([hzp, "inspect", str(plan), "--format", "json"]))
        links = inspect["bytes_per_rank_per_link"]
        log = wd / f"{strategy}.jsonl"
        log.unlink(missing_ok=True)
        out = json.loads(sh([hzp, "run", str(plan), "--data", str(train), "--shuffle", str(a.shuffle),
                             "--val-data", str(val), "--eval-every", str(a.steps),
                             "--eval-batches", "16", "--steps", str(a.steps),
                             "--lr-schedule", "cosine", "--warmup", "20",
                             "--link", a.link, "--log", str(log), "--format", "json"]
                            + run_extra.get(strategy, []),
                            quiet=False))
        vals = [json.loads(l) for l in log.read_text().splitlines()]
        val_loss = [v["val_loss"] for v in vals if "val_loss" in v][-1]
        steps = out["step_seconds"][1:]
        exposed = out["exposed_comm_seconds"][1:]
        rows.append({
            "strategy": strategy,
            "final_loss": sum(out["losses"][-20:]) / 20,
            "val_loss": val_loss,
            "step_ms": 1e3 * sum(steps) / len(steps),
            "exposed_ms": 1e3 * sum(exposed) / len(exposed),
            "slow_bytes": links.get("ib", 0),
            "fast_bytes": links.get("nvlink", 0),
        })
    base = next((r for r in rows if r["strategy"] == "asynchzp"), rows[0])
    print(f"\ntiny GPT-2 on {a.mesh}, {a.shape}, {a.steps} steps, --link {a.link}, "
          f"--lr {a.lr}, --shuffle {a.shuffle}")
    print(f"{'strategy':<10} {'val loss':>9} {'vs sync':>8} {'last-20 loss':>12} "
          f"{'step ms':>8} {'exposed ms':>10} {'slow-axis KiB/step':>18} "
          f"{'fast-axis KiB/step':>18}")
    for r in rows:
        d = 100 * (r["val_loss"] - base["val_loss"]) / base["val_loss"]
        print(f"{r['strategy']:<10} {r['val_loss']:>9.4f} {d:>+7.2f}% {r['final_loss']:>12.4f} "
              f"{r['step_ms']:>8.1f} {r['exposed_ms']:>10.1f} "
              f"{r['slow_bytes'] / 1024:>18.1f} {r['fast_bytes'] / 1024:>18.1f}")
    (wd / "results.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
