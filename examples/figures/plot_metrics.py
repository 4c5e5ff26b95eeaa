#!/usr/bin/env python3
"""Draws the loss curve of a training run from `hzp run --log metrics.jsonl` as an SVG
(training loss per step, validation loss at evaluation steps). Standard library only.

Usage: python3 examples/figures/plot_metrics.py metrics.jsonl -o loss.svg [--title TEXT]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

W, H = 720, 360
LEFT, RIGHT, TOP, BOTTOM = 64, 20, 36, 44


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("metrics")
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("--title", default="training loss")
    a = ap.parse_args()
    rows = [json.loads(l) for l in Path(a.metrics).read_text().splitlines() if l.strip()]
    train = [(r["step"], r["loss"]) for r in rows if r.get("loss") is not None]
    val = [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
    if not train:
        raise SystemExit(f"{a.metrics}: no steps with a loss")
    steps = [s for s, _ in train]
    ys = [y for _, y in train + val]
    x0, x1 = min(steps), max(steps)
    y0, y1 = math.floor(min(ys) * 2) / 2, math.ceil(max(ys) * 2) / 2
    sx = lambda s: LEFT + (s - x0) / max(x1 - x0, 1) * (W - LEFT - RIGHT)
    sy = lambda y: TOP + (y1 - y) / max(y1 - y0, 1e-9) * (H - TOP - BOTTOM)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
        f'font-family="sans-serif" font-size="12">',
        f'<rect width="{W}" height="{H}" fill="white"/>',
        f'<text x="{W / 2}" y="20" text-anchor="middle" font-size="14">{a.title}</text>',
    ]
    # axes and grid
    y = y0
    while y <= y1 + 1e-9:
        out.append(f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{sy(y):.1f}" y2="{sy(y):.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{LEFT - 6}" y="{sy(y) + 4:.1f}" text-anchor="end">{y:.1f}</text>')
        y += 0.5
    n_ticks = 6
    for k in range(n_ticks + 1):
        s = round(x0 + (x1 - x0) * k / n_ticks)
        out.append(f'<text x="{sx(s):.1f}" y="{H - BOTTOM + 16}" text-anchor="middle">{s}</text>')
    out.append(f'<text x="{W / 2}" y="{H - 8}" text-anchor="middle">step</text>')
    out.append(f'<line x1="{LEFT}" x2="{LEFT}" y1="{TOP}" y2="{H - BOTTOM}" stroke="black"/>')
    out.append(f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{H - BOTTOM}" y2="{H - BOTTOM}" stroke="black"/>')
    pts = " ".join(f"{sx(s):.1f},{sy(y):.1f}" for s, y in train)
    out.append(f'<polyline points="{pts}" fill="none" stroke="#1f77b4" stroke-width="1.2"/>')
    if val:
        pts = " ".join(f"{sx(s):.1f},{sy(y):.1f}" for s, y in val)
        out.append(f'<polyline points="{pts}" fill="none" stroke="#d62728" stroke-width="2"/>')
        for s, y in val:
            out.append(f'<circle cx="{sx(s):.1f}" cy="{sy(y):.1f}" r="3" fill="#d62728"/>')
    lx = W - RIGHT - 160
    out.append(f'<line x1="{lx}" x2="{lx + 24}" y1="{TOP + 10}" y2="{TOP + 10}" stroke="#1f77b4" stroke-width="2"/>')
    out.append(f'<text x="{lx + 30}" y="{TOP + 14}">training loss</text>')
    if val:
        out.append(f'<line x1="{lx}" x2="{lx + 24}" y1="{TOP + 28}" y2="{TOP + 28}" stroke="#d62728" stroke-width="2"/>')
        out.append(f'<text x="{lx + 30}" y="{TOP + 32}">validation loss</text>')
    out.append("</svg>")
    Path(a.output).write_text("\n".join(out) + "\n")
    print(f"wrote {a.output}: {len(train)} steps, {len(val)} evaluations")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
