#!/usr/bin/env python3
"""Benchmark: `hzp run` next to PyTorch FSDP2 and DDP on the CPU, same model, same batch.

A benchmark, not a test (PyTorch is needed only here). In one run it

1. builds a GPT-2 from a `transformers` config with a fixed seed -- 4 layers, hidden 256,
   4 heads, MLP 1024, vocab 8192, 64 positions, dropout 0, every initially-constant
   parameter slightly perturbed (as train_vs_torch.py does, so --retie ties only the tied
   embedding) -- exports it with the legacy exporter at opset 17 with a dynamic batch
   dimension, and writes a global batch of 8 x 64 token ids;
2. for N in --ranks (default 2 and 4) and strategy in asynchzp, zero3: `hzp compile
   --mesh gpu=N --strategy S --loss lm --retie`, then `hzp run --steps K --format json`
   with HZP_NUM_THREADS=1 (each of the N ranks is one compute thread of one process);
3. for N in --ranks: `torchrun --standalone --nproc-per-node N` of this file in worker mode,
   gloo on the CPU, torch.set_num_threads(1) per rank (N single-threaded processes, like
   hzp's N compute threads): FSDP2 (`fully_shard` on each block, then on the model) and DDP.
   Each rank takes its 8/N rows of the global batch; its loss is the mean cross-entropy of
   its rows (logits[:, :-1] against ids[:, 1:]); FSDP2 and DDP average the gradients over the
   ranks, so every step equals one step on the global batch, as hzp's does. AdamW lr 1e-3,
   betas 0.9/0.999, eps 1e-8, weight decay 0.01 on both sides. Step time: from a barrier
   before the step to a barrier after it, on rank 0;
4. repeats the timed runs --rounds times (default 5), every framework once per round, back
   to back, because a shared machine's speed drifts over minutes: a ratio is only taken
   between runs of one round. hzp runs first in odd rounds and PyTorch first in even ones,
   so a load that comes and goes does not always fall on the same side;
5. prints each framework's median step time (after --warmup steps; the median over rounds),
   the ratios hzp / FSDP2 and hzp / DDP (the median over rounds of the ratio within a round,
   and each round's ratio; target: hzp at half of FSDP2's step time or less), and checks that
   hzp's loss curve equals FSDP2's within 1e-4 relative at every step (the script fails
   otherwise).

Usage, from the repository root, after `cargo build --release`:

    /work/venv-models/bin/python examples/bench/fsdp_side_by_side.py [--ranks 2,4] [--steps 20] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_vs_torch as base  # noqa: E402  (the GPT-2 builder and its batch)

warnings.filterwarnings("ignore")

ROOT = Path(__file__).resolve().parents[2]
CONFIG = dict(vocab=8192, hidden=256, layers=4, heads=4, seq=64, batch=8)
ADAMW = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def build():
    base.CONFIG.update(CONFIG)
    return base.build_model(), base.make_batch()


def lm_loss(logits, ids):
    v = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1].reshape(-1, v), ids[:, 1:].reshape(-1))


# ------------------------------------------------------------------------------------------
# torchrun worker


def worker(args) -> int:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, ids = build()
    state = torch.load(args.state, weights_only=True)
    model.load_state_dict(state)
    rows = ids.shape[0] // world
    mine = ids[rank * rows : (rank + 1) * rows]
    if args.mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
        wrapped = model
    else:
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model)
    opt = torch.optim.AdamW(wrapped.parameters(), **ADAMW)
    losses, times = [], []
    for _ in range(args.warmup + args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(wrapped(mine), mine)
        loss.backward()
        opt.step()
        dist.barrier()
        times.append(time.perf_counter() - t0)
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        losses.append(avg.item() / world)
    if rank == 0:
        Path(args.out).write_text(json.dumps({"losses": losses, "step_seconds": times}))
    dist.destroy_process_group()
    return 0


# ------------------------------------------------------------------------------------------
# driver


def run(cmd, env=None, what="", retries=0):
    """Runs `cmd`, returns its stdout; fails the benchmark if it fails `retries + 1` times
    (each failure's output is shown)."""
    for attempt in range(retries + 1):
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if r.returncode == 0:
            return r.stdout
        sys.stderr.write(r.stdout[-4000:] + r.stderr[-4000:])
        if attempt < retries:
            print(f"{what or cmd[0]} failed (exit {r.returncode}); running it again",
                  file=sys.stderr)
    raise SystemExit(f"{what or cmd[0]} failed (exit {r.returncode})")


def prepare(work: Path):
    c = CONFIG
    tag = f"gpt2_l{c['layers']}_h{c['hidden']}_a{c['heads']}_v{c['vocab']}_s{c['seq']}_b{c['batch']}"
    model_path, batch_path, state_path = (
        work / f"{tag}.onnx",
        work / f"{tag}.npz",
        work / f"{tag}.pt",
    )
    if not (model_path.exists() and batch_path.exists() and state_path.exists()):
        model, ids = build()
        base.export(model, ids, model_path, dynamic_batch=True)
        np.savez(batch_path, input_ids=ids.numpy())
        torch.save(model.state_dict(), state_path)
    return model_path, batch_path, state_path


def median_after(v, warmup):
    return statistics.median(v[warmup:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--steps", type=int, default=20, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5,
                    help="times every framework runs, back to back per round")
    ap.add_argument("--workdir", default="/tmp/hzp-bench/side-by-side")
    ap.add_argument("--hzp", default=str(ROOT / "target/release/hzp"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=["fsdp2", "ddp"], help=argparse.SUPPRESS)
    ap.add_argument("--state", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    model_path, batch_path, state_path = prepare(work)
    ranks = [int(x) for x in args.ranks.split(",") if x.strip()]
    total = args.warmup + args.steps
    results = {}  # (framework, N) -> (losses, [median seconds of each round])

    env = dict(os.environ, HZP_NUM_THREADS="1")
    keys = ("hzp asynchzp", "hzp zero3", "torch fsdp2", "torch ddp")
    plans = {}
    for n in ranks:
        for strategy in ("asynchzp", "zero3"):
            plan = work / f"plan_{strategy}_{n}.json"
            run(
                [args.hzp, "compile", str(model_path), "--inputs", str(batch_path), "--loss", "lm",
                 "--retie", "--mesh", f"gpu={n}", "--strategy", strategy, "-o", str(plan),
                 "--lr", str(ADAMW["lr"]), "--betas", ",".join(str(b) for b in ADAMW["betas"]),
                 "--eps", str(ADAMW["eps"]), "--weight-decay", str(ADAMW["weight_decay"])],
                env, f"hzp compile ({strategy}, {n} ranks)",
            )
            plans[(strategy, n)] = plan
    # let the machine settle after the compiles (freeing their memory) before timing
    time.sleep(2)
    # Rounds: every framework once per round, back to back, so that each round's ratios
    # compare runs taken under the same machine load (a shared machine drifts over minutes).
    for rnd in range(args.rounds):
        for n in ranks:
            def run_hzp() -> None:
                for strategy in ("asynchzp", "zero3"):
                    out = run(
                        [args.hzp, "run", str(plans[(strategy, n)]), "--inputs",
                         str(batch_path), "--steps", str(total), "--format", "json"],
                        env, f"hzp run ({strategy}, {n} ranks)",
                    )
                    r = json.loads(out)
                    results.setdefault((f"hzp {strategy}", n), (r["losses"], []))[1].append(
                        median_after(r["step_seconds"], args.warmup))

            def run_torch() -> None:
                for mode in ("fsdp2", "ddp"):
                    out = work / f"torch_{mode}_{n}.json"
                    run(
                        [sys.executable, "-m", "torch.distributed.run", "--standalone",
                         f"--nproc-per-node={n}", __file__, "--worker", "--mode", mode,
                         "--state", str(state_path), "--out", str(out), "--steps",
                         str(args.steps), "--warmup", str(args.warmup)],
                        dict(os.environ, OMP_NUM_THREADS="1"), f"torchrun {mode} ({n} ranks)",
                        # a PyTorch worker now and then aborts ("terminate called
                        # without an active exception"): one more try before giving up
                        retries=1,
                    )
                    r = json.loads(out.read_text())
                    results.setdefault((f"torch {mode}", n), (r["losses"], []))[1].append(
                        median_after(r["step_seconds"], args.warmup))

            # hzp first in odd rounds, PyTorch first in even ones
            for side in ((run_hzp, run_torch) if rnd % 2 == 0 else (run_torch, run_hzp)):
                side()
            print(f"round {rnd + 1}/{args.rounds}, {n} ranks: " + ", ".join(
                f"{k} {results[(k, n)][1][-1] * 1e3:.1f} ms" for k in keys), file=sys.stderr)

    c = CONFIG
    print(
        f"GPT-2 {c['layers']} layers, hidden {c['hidden']}, {c['heads']} heads, vocab {c['vocab']}, "
        f"seq {c['seq']}, global batch {c['batch']}, AdamW; CPU, {os.cpu_count()} cores; "
        f"median of {args.steps} steps after {args.warmup}, {args.rounds} rounds; one thread per "
        "rank on both sides"
    )
    print("step ms: the median over rounds of each run's median step; ratios: the median over "
          "rounds of the ratio within a round (each round's runs back to back)")
    print(f"  {'ranks':>5}  {'framework':<16} {'step ms':>9}  {'vs FSDP2':>8}  {'vs DDP':>7}  "
          "vs FSDP2 per round")
    ok = True
    worst_all = 0.0
    for n in ranks:
        fsdp = results[("torch fsdp2", n)][1]
        ddp = results[("torch ddp", n)][1]
        for key in keys:
            ts = results[(key, n)][1]
            vs_f = [t / f for t, f in zip(ts, fsdp)]
            vs_d = [t / d for t, d in zip(ts, ddp)]
            print(f"  {n:>5}  {key:<16} {statistics.median(ts) * 1e3:9.1f}  "
                  f"{statistics.median(vs_f):7.2f}x  {statistics.median(vs_d):6.2f}x  "
                  + " ".join(f"{r:.2f}" for r in vs_f))
        ref = results[("torch fsdp2", n)][0]
        for key in ("hzp asynchzp", "hzp zero3", "torch ddp"):
            got = results[(key, n)][0]
            worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, ref))
            worst_all = max(worst_all, worst)
            if len(got) != len(ref) or worst > 1e-4:
                ok = False
                print(f"  {n} ranks: {key} loss curve differs from FSDP2's (worst {worst:.2e})")
    print("loss curves (first 5 steps):")
    for (key, n), (losses, _) in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(f"  {n} ranks {key:<16} " + " ".join(f"{x:.6f}" for x in losses[:5]))
    if not ok:
        print("FAILED: loss curves differ by more than 1e-4 relative")
        return 1
    print(f"loss curves equal within 1e-4 relative at every step (worst {worst_all:.1e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
