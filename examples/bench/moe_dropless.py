#!/usr/bin/env python3
"""Training step of a mixture of experts on the CPU: the dense form, routed dropless and
routed with a capacity factor, timed in one run on one machine. A benchmark, not a test.

For each model (`--preset`, repeatable; default the tiny MoE preset and a wider one) it
writes one set of random weights (the three forms have the same parameters) and a token
file, compiles `SPEC,dense=true`, `SPEC` (dropless: C = T) and `SPEC,capacity_factor=F`
for one CPU rank in fp32, then runs `hzp run PLAN --steps N --log metrics.jsonl`
`--rounds` times per form, the forms interleaved so that drift in the machine's load hits
all three alike. A form's time is the median `step_seconds` over every step but each
run's first. It prints the medians and their ratios to dense, and from one traced run per
form (`--trace`) the milliseconds per step of the experts' products (the MatMul nodes of
the `experts` blocks, forward and backward) and of everything else.

    cargo build --release
    python3 examples/bench/moe_dropless.py [--threads 2] [--steps 20] [--rounds 3]

Needs numpy (for the weights file).
"""

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile

import numpy as np

TRACE_STEPS = 12
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (label, spec): the tiny preset (2 x 16 tokens, hidden 64, 4 experts, top 2) and a wider
# one (2 x 128 tokens, hidden 256, expert MLPs of 512, 8 experts, top 2)
DEFAULT_PRESETS = [
    ("moe-tiny", "preset:moe-tiny"),
    (
        "moe-wide",
        "preset:moe,layers=2,hidden=256,heads=4,kv_heads=4,ffn=512,vocab=512,"
        "seq=128,batch=2,experts=8,top_k=2",
    ),
]


def run(cmd, env=None):
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return r.stdout


def params_of(hzp, spec):
    """[(name, shape)] of the preset's parameters, from its text IR."""
    out = run([hzp, "import", spec])
    params = []
    for line in out.splitlines():
        m = re.match(r"param %(\S+) : f32\[([0-9,]*)\]", line)
        if m:
            params.append((m.group(1), [int(d) for d in m.group(2).split(",") if d]))
    if not params:
        sys.exit(f"no parameters in `hzp import {spec}`")
    return params


def input_shape(hzp, spec):
    out = run([hzp, "import", spec])
    m = re.search(r"input %input_ids : i64\[(\d+),(\d+)\]", out)
    if not m:
        sys.exit(f"no input_ids [B, T] in `hzp import {spec}`")
    return int(m.group(1)), int(m.group(2))


def machine():
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores"


def commit():
    try:
        return subprocess.run(
            ["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return "?"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hzp", default=os.path.join(ROOT, "target", "release", "hzp"))
    ap.add_argument(
        "--preset",
        action="append",
        help="a MoE preset spec (repeatable; default: the tiny preset and a wider one)",
    )
    ap.add_argument("--capacity-factor", type=float, default=1.25)
    ap.add_argument("--steps", type=int, default=20, help="steps per run")
    ap.add_argument("--rounds", type=int, default=3, help="runs per form")
    ap.add_argument("--threads", type=int, help="HZP_NUM_THREADS (default: all cores)")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", help="also write the figures to this file")
    a = ap.parse_args()
    if not os.path.exists(a.hzp):
        sys.exit(f"no hzp binary at {a.hzp} (cargo build --release, or --hzp PATH)")
    presets = (
        [(re.sub(r"[^A-Za-z0-9_.-]+", "_", s.removeprefix("preset:")), s) for s in a.preset]
        if a.preset
        else DEFAULT_PRESETS
    )
    env = dict(os.environ)
    if a.threads:
        env["HZP_NUM_THREADS"] = str(a.threads)
    work = a.workdir or tempfile.mkdtemp(prefix="hzp-moe-bench-")
    os.makedirs(work, exist_ok=True)
    print(f"machine: {machine()}; commit {commit()}; threads {a.threads or 'all'}")
    results = {"machine": machine(), "commit": commit(), "threads": a.threads, "models": {}}
    for label, spec in presets:
        rng = np.random.default_rng(0)
        params = params_of(a.hzp, spec)
        weights = {}
        for name, shape in params:
            if len(shape) == 1:
                weights[name] = np.ones(shape, np.float32)  # norm scales
            else:
                weights[name] = (rng.standard_normal(shape) * 0.02).astype(np.float32)
        pfile = os.path.join(work, f"{label}.params.npz")
        np.savez(pfile, **weights)
        vocab = dict(params)["model.embed_tokens.weight"][0]
        b, t = input_shape(a.hzp, spec)
        tokens = rng.integers(0, vocab, size=b * t * (a.steps + 1) * 4).astype(np.uint16)
        tfile = os.path.join(work, f"{label}.tokens.bin")
        tokens.tofile(tfile)
        forms = [
            ("dense", f"{spec},dense=true"),
            ("dropless", spec),
            (f"capacity {a.capacity_factor}", f"{spec},capacity_factor={a.capacity_factor}"),
        ]
        plans = {}
        for name, fspec in forms:
            plan = os.path.join(work, f"{label}.{name.split()[0]}.plan.json")
            run([a.hzp, "compile", fspec, "--mesh", "gpu=1", "--precision", "fp32", "-o", plan])
            plans[name] = plan
        steps = {name: [] for name, _ in forms}
        for _ in range(a.rounds):
            for name, _ in forms:
                log = os.path.join(work, f"{label}.metrics.jsonl")
                if os.path.exists(log):
                    os.remove(log)
                run(
                    [a.hzp, "run", plans[name], "--params", pfile, "--data", tfile,
                     "--steps", str(a.steps), "--log", log],
                    env,
                )
                with open(log) as f:
                    rows = [json.loads(line) for line in f if line.strip()]
                steps[name].extend(r["step_seconds"] for r in rows[1:])
        # where the time goes: one traced run per form, the experts' products (MatMul
        # nodes of the `experts` blocks, forward and backward) against everything else,
        # medians over the steps after the first
        split = {}
        for name, _ in forms:
            trace = os.path.join(work, f"{label}.trace.json")
            run(
                [a.hzp, "run", plans[name], "--params", pfile, "--data", tfile,
                 "--steps", str(TRACE_STEPS), "--trace", trace],
                env,
            )
            with open(trace) as f:
                events = json.load(f)
            events = events["traceEvents"] if isinstance(events, dict) else events
            per_step = {}
            for e in events:
                args = e.get("args", {})
                if e.get("ph") != "X" or "step" not in args or args["step"] < 2:
                    continue
                experts = args.get("op") == "MatMul" and ".experts." in e.get("name", "")
                key = "experts" if experts else "rest"
                s_ = per_step.setdefault(args["step"], {"experts": 0.0, "rest": 0.0})
                s_[key] += e["dur"] / 1e3
            split[name] = {
                k: statistics.median(v[k] for v in per_step.values()) for k in ("experts", "rest")
            }
        med = {name: statistics.median(v) for name, v in steps.items()}
        print(f"\n{label}: {spec} ({b} x {t} tokens; {a.rounds} runs x {a.steps - 1} timed steps)")
        print(f"  {'':<16} {'ms/step':>9}   {'of dense':>8}   traced: expert products, the rest (ms)")
        for name, _ in forms:
            print(
                f"  {name:<16} {med[name] * 1e3:9.3f}   {med[name] / med['dense']:8.3f}"
                f"   {split[name]['experts']:8.3f} {split[name]['rest']:8.3f}"
            )
        results["models"][label] = {
            "spec": spec,
            "ms_per_step": {n: med[n] * 1e3 for n in med},
            "ratio_to_dense": {n: med[n] / med["dense"] for n in med},
            "traced_ms_per_step": split,
        }
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
