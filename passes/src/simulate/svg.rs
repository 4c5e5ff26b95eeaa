//! Pictures of a simulated step as SVG, written by hand (no plotting library): a Gantt chart of
//! one rank's streams and a plot of its memory over the step, stacked by buffer kind.
//!
//! Both are deterministic (the same simulation gives the same bytes) and well-formed XML:
//! every text is escaped, numbers are printed with fixed decimals. Long steps have tens of
//! thousands of nodes: neighbouring nodes of one category less than half a pixel apart are
//! drawn as one box (its tooltip says how many), and the memory curve keeps, per pixel
//! column, the point with the most live bytes (so the peak is always drawn).

use crate::simulate::{MemoryTimeline, OpClass, Simulation};
use hzp_ir::{format_bytes, BufferKind, Op, Plan, StreamKind};
use std::fmt::Write as _;

const WIDTH: f64 = 1200.0;
const LEFT: f64 = 120.0;
const RIGHT: f64 = 20.0;
const FONT: &str = "font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\"";

/// Escapes text for XML content and attribute values.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            c if (c as u32) < 0x20 && c != '\n' && c != '\t' => out.push(' '),
            c => out.push(c),
        }
    }
    out
}

/// `12.5 ms`, `3.2 us`, `1.25 s`.
pub fn fmt_time(s: f64) -> String {
    let a = s.abs();
    if a == 0.0 {
        "0".into()
    } else if a >= 1.0 {
        trim(format!("{s:.3}")) + " s"
    } else if a >= 1e-3 {
        trim(format!("{:.3}", s * 1e3)) + " ms"
    } else {
        trim(format!("{:.3}", s * 1e6)) + " us"
    }
}

fn trim(s: String) -> String {
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

/// Round tick spacing (1, 2 or 5 times a power of ten) for about `target` ticks over `span`.
pub fn tick_step(span: f64, target: usize) -> f64 {
    if span <= 0.0 || !span.is_finite() {
        return 1.0;
    }
    let raw = span / target.max(1) as f64;
    let p = 10f64.powf(raw.log10().floor());
    for m in [1.0, 2.0, 5.0, 10.0] {
        if m * p >= raw {
            return m * p;
        }
    }
    10.0 * p
}

/// Three header lines: the title (bold), the model (cut to fit), a line of numbers.
fn titles(out: &mut String, x0: f64, title: &str, model: &str, stats: &str) {
    let _ = writeln!(
        out,
        "<text x=\"{x0:.2}\" y=\"22\" font-size=\"15\" font-weight=\"bold\">{}</text>",
        escape(title)
    );
    let max = ((WIDTH - RIGHT - x0) / 6.6) as usize;
    let model = if model.chars().count() > max {
        let cut: String = model.chars().take(max.saturating_sub(3)).collect();
        cut + "..."
    } else {
        model.to_string()
    };
    let _ = writeln!(
        out,
        "<text x=\"{x0:.2}\" y=\"42\">model {}</text>",
        escape(&model)
    );
    let _ = writeln!(
        out,
        "<text x=\"{x0:.2}\" y=\"60\" fill=\"#555555\">{}</text>",
        escape(stats)
    );
}

/// Lays legend entries (swatch fill, label) out in rows that fit the width; returns the SVG and
/// the height used.
fn legend(entries: &[(String, &str)], x0: f64, y0: f64) -> (String, f64) {
    let mut out = String::new();
    let (mut x, mut y) = (x0, y0);
    for (label, fill) in entries {
        let w = 30.0 + 6.6 * label.chars().count() as f64;
        if x > x0 && x + w > WIDTH - RIGHT {
            x = x0;
            y += 22.0;
        }
        let _ = writeln!(
            out,
            "<rect x=\"{x:.2}\" y=\"{y:.2}\" width=\"14\" height=\"14\" fill=\"{fill}\" \
             stroke=\"#666666\"/><text x=\"{:.2}\" y=\"{:.2}\">{}</text>",
            x + 20.0,
            y + 12.0,
            escape(label)
        );
        x += w;
    }
    (out, y + 22.0 - y0)
}

/// Byte ticks on a binary unit: the largest power of 1024 not above `max`, and a 1, 2 or 5
/// multiple of it (or of its decimal fractions) giving about `target` ticks.
pub fn byte_tick_step(max: f64, target: usize) -> f64 {
    let mut unit = 1.0;
    while unit * 1024.0 <= max {
        unit *= 1024.0;
    }
    tick_step(max / unit, target) * unit
}

/// A box category of the Gantt chart: (label, fill).
fn category(plan: &Plan, class: OpClass, node: usize) -> (&'static str, &'static str) {
    let op = &plan.program.nodes[node].op;
    match class {
        OpClass::Wait => ("wait (blocked on an event)", "url(#waits)"),
        OpClass::Collective => match op {
            Op::AllGather { .. } => ("all-gather", "#f58518"),
            Op::ReduceScatter { .. } => ("reduce-scatter", "#54a24b"),
            Op::AllReduce { .. } => ("all-reduce", "#e45756"),
            _ => ("other collective", "#b279a2"),
        },
        _ => match op {
            Op::MatMul => ("matmul", "#4c78a8"),
            _ => ("other compute", "#9ecae9"),
        },
    }
}

fn header(out: &mut String, w: f64, h: f64, title: &str) {
    let _ = writeln!(
        out,
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<svg xmlns=\"http://www.w3.org/2000/svg\" \
         width=\"{w:.0}\" height=\"{h:.0}\" viewBox=\"0 0 {w:.0} {h:.0}\" {FONT} font-size=\"12\">"
    );
    let _ = writeln!(out, "<title>{}</title>", escape(title));
    let _ = writeln!(
        out,
        "<rect x=\"0\" y=\"0\" width=\"{w:.0}\" height=\"{h:.0}\" fill=\"#ffffff\"/>"
    );
}

fn time_axis(out: &mut String, step: f64, x0: f64, x1: f64, y_top: f64, y_axis: f64) {
    let span = step.max(1e-12);
    let dx = tick_step(span, 10);
    let _ = writeln!(
        out,
        "<line x1=\"{x0:.2}\" y1=\"{y_axis:.2}\" x2=\"{x1:.2}\" y2=\"{y_axis:.2}\" stroke=\"#333333\"/>"
    );
    let mut k = 0u64;
    loop {
        let t = k as f64 * dx;
        if t > span * (1.0 + 1e-9) {
            break;
        }
        let x = x0 + (x1 - x0) * t / span;
        let _ = writeln!(
            out,
            "<line x1=\"{x:.2}\" y1=\"{y_top:.2}\" x2=\"{x:.2}\" y2=\"{:.2}\" stroke=\"#dddddd\"/>",
            y_axis + 4.0
        );
        let _ = writeln!(
            out,
            "<text x=\"{x:.2}\" y=\"{:.2}\" text-anchor=\"middle\">{}</text>",
            y_axis + 18.0,
            escape(&fmt_time(t))
        );
        k += 1;
        if k > 1000 {
            break;
        }
    }
}

/// The Gantt chart of one rank's streams: a lane per stream (compute, all-gather,
/// reduce-scatter), a box per node that takes time (matmuls, other compute, each collective
/// kind in its colour), waits hatched on the stream that is blocked, and a time axis.
pub fn gantt(plan: &Plan, sim: &Simulation) -> String {
    let lanes = [
        (StreamKind::Compute, "compute"),
        (StreamKind::AllGather, "all-gather"),
        (StreamKind::ReduceScatter, "reduce-scatter"),
    ];
    let lane_h = 34.0;
    let gap = 12.0;
    let top = 80.0;
    let y_axis = top + lanes.len() as f64 * (lane_h + gap);
    let (x0, x1) = (LEFT, WIDTH - RIGHT);
    let step = sim.step_s.max(1e-12);
    let xs = |t: f64| x0 + (x1 - x0) * (t / step).clamp(0.0, 1.0);

    let mut out = String::new();
    let title = format!(
        "{} on {} ({}): step {}",
        sim.strategy,
        sim.mesh,
        sim.cluster,
        fmt_time(sim.step_s)
    );
    out.push_str(
        "<defs><pattern id=\"waits\" width=\"6\" height=\"6\" patternUnits=\"userSpaceOnUse\" \
         patternTransform=\"rotate(45)\"><rect width=\"6\" height=\"6\" fill=\"#eeeeee\"/>\
         <line x1=\"0\" y1=\"0\" x2=\"0\" y2=\"6\" stroke=\"#999999\" stroke-width=\"2\"/>\
         </pattern></defs>\n",
    );
    let busy = |i: usize| sim.stream_busy_s[i];
    let stats = format!(
        "one rank of {}: compute busy {}, exposed communication {} ({:.1}%), MFU {:.1}%",
        sim.world_size,
        fmt_time(busy(0)),
        fmt_time(sim.exposed_comm_s),
        100.0 * sim.exposed_comm_fraction(),
        100.0 * sim.mfu
    );
    titles(&mut out, x0, &title, &sim.model, &stats);
    time_axis(&mut out, step, x0, x1, top - 4.0, y_axis);
    let mut used: Vec<(&'static str, &'static str)> = Vec::new();
    for (li, (stream, label)) in lanes.iter().enumerate() {
        let y = top + li as f64 * (lane_h + gap);
        let _ = writeln!(
            out,
            "<rect x=\"{x0:.2}\" y=\"{y:.2}\" width=\"{:.2}\" height=\"{lane_h:.2}\" \
             fill=\"#f7f7f7\" stroke=\"#cccccc\"/>",
            x1 - x0
        );
        let _ = writeln!(
            out,
            "<text x=\"{:.2}\" y=\"{:.2}\" text-anchor=\"end\">{label}</text>",
            x0 - 8.0,
            y + lane_h / 2.0 + 4.0
        );
        let _ = writeln!(
            out,
            "<text x=\"{:.2}\" y=\"{:.2}\" text-anchor=\"end\" fill=\"#777777\" \
             font-size=\"10\">busy {}</text>",
            x0 - 8.0,
            y + lane_h / 2.0 + 16.0,
            escape(&fmt_time(busy(li)))
        );
        // Boxes, merging neighbours of one category closer than half a pixel.
        let mut cur: Option<(f64, f64, &str, &str, usize, usize)> = None;
        let flush = |out: &mut String, c: (f64, f64, &str, &str, usize, usize)| {
            let (a, b, label, fill, count, first) = c;
            let w = (b - a).max(0.6);
            let tip = if count == 1 {
                let node = &plan.program.nodes[first];
                format!("{} ({}): {}", node.name, node.op.name(), label)
            } else {
                format!("{count} nodes: {label}")
            };
            let _ = writeln!(
                out,
                "<rect x=\"{a:.2}\" y=\"{:.2}\" width=\"{w:.2}\" height=\"{:.2}\" fill=\"{fill}\"{}>\
                 <title>{}</title></rect>",
                y + 3.0,
                lane_h - 6.0,
                if w >= 3.0 {
                    " stroke=\"#ffffff\" stroke-width=\"0.5\""
                } else {
                    ""
                },
                escape(&tip)
            );
        };
        for o in sim.ops.iter().filter(|o| o.stream == *stream) {
            if o.end <= o.start {
                continue;
            }
            let (cat, fill) = category(plan, o.class, o.node);
            if !used.contains(&(cat, fill)) {
                used.push((cat, fill));
            }
            let (a, b) = (xs(o.start), xs(o.end));
            match cur.as_mut() {
                // Boxes of 2 px and more are drawn one by one.
                Some(c) if c.2 == cat && a - c.1 < 0.5 && b - a < 2.0 && c.1 - c.0 < 2.0 => {
                    c.1 = c.1.max(b);
                    c.4 += 1;
                }
                _ => {
                    if let Some(c) = cur.take() {
                        flush(&mut out, c);
                    }
                    cur = Some((a, b, cat, fill, 1, o.node));
                }
            }
        }
        if let Some(c) = cur.take() {
            flush(&mut out, c);
        }
    }
    // Legend, in a fixed order.
    let order = [
        "matmul",
        "other compute",
        "all-gather",
        "reduce-scatter",
        "all-reduce",
        "other collective",
        "wait (blocked on an event)",
    ];
    let entries: Vec<(String, &str)> = order
        .iter()
        .filter_map(|name| used.iter().find(|u| u.0 == *name))
        .map(|(cat, fill)| (cat.to_string(), *fill))
        .collect();
    let (legend_svg, legend_h) = legend(&entries, x0, y_axis + 34.0);
    let mut svg = String::new();
    header(
        &mut svg,
        WIDTH,
        y_axis + 34.0 + legend_h + 8.0,
        &format!("{}: {title}", sim.model),
    );
    svg.push_str(&out);
    svg.push_str(&legend_svg);
    svg.push_str("</svg>\n");
    svg
}

fn kind_color(k: BufferKind) -> &'static str {
    match k {
        BufferKind::Param => "#4c78a8",
        BufferKind::Grad => "#54a24b",
        BufferKind::OptimState => "#b279a2",
        BufferKind::Activation => "#f58518",
        BufferKind::CommBuffer => "#e45756",
        BufferKind::Input => "#72b7b2",
        BufferKind::Other => "#bab0ac",
    }
}

/// Downsamples a memory timeline to at most one point per pixel column: the point with the
/// most live bytes in each column.
fn columns(m: &MemoryTimeline, step: f64, px: usize) -> Vec<(f64, [u64; 7])> {
    let mut out: Vec<(f64, [u64; 7])> = Vec::new();
    let mut col_of_last: Option<usize> = None;
    for &(t, live) in &m.points {
        let col = ((t / step.max(1e-12)) * px as f64).floor().max(0.0) as usize;
        let col = col.min(px);
        match (col_of_last, out.last_mut()) {
            (Some(c), Some(last)) if c == col => {
                if MemoryTimeline::total(&live) > MemoryTimeline::total(&last.1) {
                    *last = (t, live);
                }
            }
            _ => {
                out.push((t, live));
                col_of_last = Some(col);
            }
        }
    }
    out
}

/// Live memory over the step, stacked by buffer kind (as a step function), with the arena size
/// and the peak marked.
pub fn memory_plot(sim: &Simulation) -> String {
    let m = &sim.memory;
    let top = 84.0;
    let plot_h = 300.0;
    let y_axis = top + plot_h;
    let (x0, x1) = (LEFT, WIDTH - RIGHT);
    let step = sim.step_s.max(1e-12);
    let ymax_raw = m.arena_bytes.max(m.peak_bytes).max(1) as f64;
    let dy = byte_tick_step(ymax_raw, 5);
    let ymax = (ymax_raw / dy).ceil() * dy;
    let xs = |t: f64| x0 + (x1 - x0) * (t / step).clamp(0.0, 1.0);
    let ys = |b: f64| y_axis - plot_h * (b / ymax).clamp(0.0, 1.0);

    let mut out = String::new();
    let title = format!(
        "{} on {}: memory per rank over one step of {}",
        sim.strategy,
        sim.mesh,
        fmt_time(sim.step_s)
    );
    let stats = format!(
        "peak {} at {} (issue-order peak {}, arena {})",
        format_bytes(m.peak_bytes),
        fmt_time(m.peak_time_s),
        format_bytes(m.planned_peak_bytes),
        format_bytes(m.arena_bytes)
    );
    titles(&mut out, x0, &title, &sim.model, &stats);
    // y grid and labels
    let mut k = 0;
    while k as f64 * dy <= ymax * (1.0 + 1e-9) && k <= 100 {
        let b = k as f64 * dy;
        let y = ys(b);
        let _ = writeln!(
            out,
            "<line x1=\"{x0:.2}\" y1=\"{y:.2}\" x2=\"{x1:.2}\" y2=\"{y:.2}\" stroke=\"#eeeeee\"/>\
             <text x=\"{:.2}\" y=\"{:.2}\" text-anchor=\"end\">{}</text>",
            x0 - 6.0,
            y + 4.0,
            escape(&format_bytes(b.round() as u64))
        );
        k += 1;
    }
    time_axis(&mut out, step, x0, x1, top, y_axis);
    // Stacked step areas, bottom kind first (BufferKind::ALL order).
    let pts = columns(m, step, (x1 - x0) as usize);
    let mut lower = vec![0u64; pts.len()];
    for (ki, kind) in BufferKind::ALL.iter().enumerate() {
        if pts.iter().all(|p| p.1[ki] == 0) {
            continue;
        }
        let upper: Vec<u64> = pts.iter().zip(&lower).map(|(p, l)| l + p.1[ki]).collect();
        // Step function: each point holds until the next one.
        let mut d = String::new();
        let edge = |d: &mut String, vals: &[u64], forward: bool| {
            let n = pts.len();
            let idx: Vec<usize> = if forward {
                (0..n).collect()
            } else {
                (0..n).rev().collect()
            };
            for i in idx {
                let xa = xs(pts[i].0);
                let xb = if i + 1 < n { xs(pts[i + 1].0) } else { x1 };
                let y = ys(vals[i] as f64);
                if forward {
                    let _ = write!(d, "L{xa:.2},{y:.2} L{xb:.2},{y:.2} ");
                } else {
                    let _ = write!(d, "L{xb:.2},{y:.2} L{xa:.2},{y:.2} ");
                }
            }
        };
        edge(&mut d, &upper, true);
        edge(&mut d, &lower, false);
        let d = format!("M{}", d.trim_start_matches('L').trim_end());
        let _ = writeln!(
            out,
            "<path d=\"{d} Z\" fill=\"{}\" fill-opacity=\"0.85\" stroke=\"none\"><title>{}</title></path>",
            kind_color(*kind),
            escape(kind.name())
        );
        lower = upper;
    }
    // Arena and peak.
    let ya = ys(m.arena_bytes as f64);
    let _ = writeln!(
        out,
        "<line x1=\"{x0:.2}\" y1=\"{ya:.2}\" x2=\"{x1:.2}\" y2=\"{ya:.2}\" stroke=\"#000000\" \
         stroke-dasharray=\"6,4\"/><text x=\"{:.2}\" y=\"{:.2}\" text-anchor=\"end\">arena {}</text>",
        x1 - 4.0,
        ya - 4.0,
        escape(&format_bytes(m.arena_bytes))
    );
    let px = xs(m.peak_time_s);
    let py = ys(m.peak_bytes as f64);
    // The label goes left of the dot near the right edge.
    let (lx, anchor) = if px > x1 - 160.0 {
        (px - 6.0, "end")
    } else {
        (px + 6.0, "start")
    };
    let _ = writeln!(
        out,
        "<circle cx=\"{px:.2}\" cy=\"{py:.2}\" r=\"4\" fill=\"#000000\"/><text x=\"{lx:.2}\" \
         y=\"{:.2}\" text-anchor=\"{anchor}\">peak {}</text>",
        py - 6.0,
        escape(&format_bytes(m.peak_bytes))
    );
    // Legend.
    let entries: Vec<(String, &str)> = BufferKind::ALL
        .iter()
        .enumerate()
        .filter(|(ki, _)| m.points.iter().any(|p| p.1[*ki] > 0))
        .map(|(_, kind)| {
            let at_peak = m.peak_by_kind.get(kind.name()).copied().unwrap_or(0);
            (
                format!("{} ({} at peak)", kind.name(), format_bytes(at_peak)),
                kind_color(*kind),
            )
        })
        .collect();
    let (legend_svg, legend_h) = legend(&entries, x0, y_axis + 34.0);
    let mut svg = String::new();
    header(
        &mut svg,
        WIDTH,
        y_axis + 34.0 + legend_h + 8.0,
        &format!("{}: {title}", sim.model),
    );
    svg.push_str(&out);
    svg.push_str(&legend_svg);
    svg.push_str("</svg>\n");
    svg
}
