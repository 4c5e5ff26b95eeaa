//! Elementwise fusion for the evaluator: a run of consecutive f32 Unary and Binary nodes
//! with the same result shape (operands of that shape, scalars, biases over the trailing
//! dims or keep-dims reductions over them) runs as one pass, tile by tile. Values used only
//! inside the run live in small per-tile registers instead of full tensors; the others are
//! written once, into a new buffer or into the buffer of an input that dies in the run.
//! Every op computes exactly what its own kernel computes ([`unary_into`],
//! [`binary_into`]), so fusion does not change results.
//!
//! Autodiff's rules, the optimizer update and activations like the tanh GELU are chains of
//! such ops; fused, they read and write memory once instead of once per op.

use crate::cpu::elementwise::{binary_into, is_float_arith, is_float_unary, unary_into, Arg};
use crate::cpu::threads;
use hzp_ir::{BinaryOp, DType, Data, Node, Op, Program, Tensor, UnaryOp, ValueId};

/// Whether the evaluator fuses (on unless `HZP_FUSE=0`, which is for comparisons).
pub fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("HZP_FUSE").map_or(true, |v| v != "0"))
}

/// Elements per tile (per register).
const TILE: usize = 1024;
/// Runs over fewer elements are left to the plain kernels.
const MIN_LEN: usize = 4096;

#[derive(Clone, Copy, Debug)]
enum Src {
    /// The result of instruction `r` of the group.
    Reg(usize),
    /// External input `j` of the group.
    Input(usize),
}

/// How an external input covers the run's elements (its shape broadcast to the run's).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    /// As many elements as the run, same layout.
    Full,
    /// One element.
    Scalar,
    /// The run's trailing dims of `d` elements (a bias): element `i` reads `i % d`.
    Inner(usize),
    /// The run's leading dims, constant over trailing dims of `d` elements (a keep-dims
    /// reduction): element `i` reads `i / d`.
    Outer(usize),
}

impl Mode {
    /// How `input` broadcasts to `out`, if it is one of the modes.
    fn of(input: &[usize], out: &[usize]) -> Option<Mode> {
        let n: usize = out.iter().product();
        let ni: usize = input.iter().product();
        if ni == n {
            return Some(Mode::Full);
        }
        if ni == 1 {
            return Some(Mode::Scalar);
        }
        if input.len() > out.len() {
            return None;
        }
        let mut padded = vec![1; out.len() - input.len()];
        padded.extend_from_slice(input);
        let r = out.len();
        // inner: 1s, then the run's trailing dims
        let k = padded.iter().position(|&d| d != 1).unwrap_or(r);
        if padded[k..] == out[k..] {
            return Some(Mode::Inner(out[k..].iter().product()));
        }
        // outer: the run's leading dims, then 1s
        let k = padded.iter().rposition(|&d| d != 1).map_or(0, |k| k + 1);
        if padded[..k] == out[..k] {
            return Some(Mode::Outer(out[k..].iter().product()));
        }
        None
    }

    /// How many elements an input of this mode holds, for a run of `n`.
    fn len(self, n: usize) -> usize {
        match self {
            Mode::Full => n,
            Mode::Scalar => 1,
            Mode::Inner(d) => d,
            Mode::Outer(d) => n / d,
        }
    }
}

#[derive(Clone, Copy, Debug)]
enum Kind {
    Unary(UnaryOp),
    Binary(BinaryOp),
}

#[derive(Clone, Debug)]
struct Instr {
    kind: Kind,
    a: Src,
    b: Option<Src>,
    /// The register the result goes to.
    dst: usize,
    /// Registers whose value this instruction reads last (free after it).
    frees: Vec<usize>,
}

/// One fused run: nodes `first..=last`; instruction `k` is node `first + k`.
#[derive(Clone, Debug)]
pub struct Group {
    pub first: usize,
    pub last: usize,
    /// Elements of every full operand and result.
    len: usize,
    /// Values read from outside the run, in first-read order, and how each broadcasts.
    pub inputs: Vec<ValueId>,
    modes: Vec<Mode>,
    instrs: Vec<Instr>,
    /// Registers needed (results share registers once their last reader has run).
    nregs: usize,
    /// Results written out (read after the run or returned): (instruction, value, shape).
    outputs: Vec<(usize, ValueId, Vec<usize>)>,
    /// For each written-out result, an input that dies in the run and may hold it instead
    /// of a new buffer (when the evaluator can give it up, see [`Group::donations`]).
    inplace: Vec<Option<usize>>,
}

impl Group {
    pub fn ops(&self) -> usize {
        self.instrs.len()
    }

    /// Elements of the run.
    pub fn elements(&self) -> usize {
        self.len
    }

    /// The ops of the run, in order (for profiles).
    pub fn op_names(&self) -> Vec<&'static str> {
        self.instrs
            .iter()
            .map(|i| match i.kind {
                Kind::Unary(u) => u.name(),
                Kind::Binary(b) => b.name(),
            })
            .collect()
    }

    /// The inputs whose buffers the run can reuse for its results: the evaluator passes
    /// these as [`Input::Owned`] when it owns them and they die here.
    pub fn donations(&self) -> impl Iterator<Item = ValueId> + '_ {
        self.inplace.iter().flatten().map(|&j| self.inputs[j])
    }

    /// The values the run writes out, in the order [`run`] returns them.
    pub fn output_values(&self) -> impl Iterator<Item = ValueId> + '_ {
        self.outputs.iter().map(|o| o.1)
    }
}

/// The fused runs of a program.
#[derive(Clone, Debug, Default)]
pub struct Plan {
    /// For each node, the run it belongs to.
    pub group_of: Vec<Option<usize>>,
    pub groups: Vec<Group>,
}

/// If node `n` can be fused: the shape it computes.
fn fusable<'p>(p: &'p Program, n: &Node) -> Option<&'p [usize]> {
    let [out] = n.outputs[..] else { return None };
    let ot = p.ty(out);
    if ot.dtype != DType::F32 {
        return None;
    }
    let shape = &ot.shape[..];
    let ok_in = |v: &ValueId| {
        let t = p.ty(*v);
        t.dtype == DType::F32 && Mode::of(&t.shape, shape).is_some()
    };
    let ok = match &n.op {
        Op::Unary(u) => is_float_unary(*u) && n.inputs.len() == 1,
        Op::Binary(b) => is_float_arith(*b) && n.inputs.len() == 2,
        _ => false,
    };
    (ok && n.inputs.iter().all(ok_in)).then_some(shape)
}

/// Finds the fused runs. `skip(i)` marks nodes that are not run (views): they end a run.
/// Value ids are in range.
pub fn plan(p: &Program, is_output: &[bool], skip: impl Fn(usize) -> bool) -> Plan {
    let nv = p.values.len();
    // the last node reading each value
    let mut last_read: Vec<Option<usize>> = vec![None; nv];
    for (i, n) in p.nodes.iter().enumerate() {
        for &v in &n.inputs {
            last_read[v.index()] = Some(i);
        }
    }
    let mut plan = Plan {
        group_of: vec![None; p.nodes.len()],
        groups: Vec::new(),
    };
    let mut run: Option<(usize, &[usize])> = None; // (first node, shape)
    let close = |plan: &mut Plan, first: usize, end: usize| {
        if end - first >= 2 {
            let g = build(p, is_output, &last_read, first, end - 1);
            for i in first..end {
                plan.group_of[i] = Some(plan.groups.len());
            }
            plan.groups.push(g);
        }
    };
    for (i, n) in p.nodes.iter().enumerate() {
        let here = if skip(i) { None } else { fusable(p, n) };
        match (run, here) {
            (Some((_, shape)), Some(s)) if s == shape => {}
            _ => {
                if let Some((first, _)) = run {
                    close(&mut plan, first, i);
                }
                run = here
                    .filter(|s| s.iter().product::<usize>() >= MIN_LEN)
                    .map(|s| (i, s));
            }
        }
    }
    if let Some((first, _)) = run {
        close(&mut plan, first, p.nodes.len());
    }
    plan
}

fn build(
    p: &Program,
    is_output: &[bool],
    last_read: &[Option<usize>],
    first: usize,
    last: usize,
) -> Group {
    let mut inputs: Vec<ValueId> = Vec::new();
    let mut instrs = Vec::new();
    let mut outputs = Vec::new();
    let reg_of = |v: ValueId| {
        (first..=last)
            .find(|&i| p.nodes[i].outputs[0] == v)
            .map(|i| i - first)
    };
    let shape = &p.ty(p.nodes[first].outputs[0]).shape;
    let len = shape.iter().product();
    for (k, n) in p.nodes[first..=last].iter().enumerate() {
        let mut src = |v: ValueId| match reg_of(v) {
            Some(r) => Src::Reg(r),
            None => Src::Input(match inputs.iter().position(|&x| x == v) {
                Some(j) => j,
                None => {
                    inputs.push(v);
                    inputs.len() - 1
                }
            }),
        };
        let kind = match n.op {
            Op::Unary(u) => Kind::Unary(u),
            Op::Binary(b) => Kind::Binary(b),
            _ => unreachable!("only fusable nodes are grouped"),
        };
        let a = src(n.inputs[0]);
        let b = n.inputs.get(1).map(|&v| src(v));
        instrs.push(Instr {
            kind,
            a,
            b,
            dst: 0,
            frees: Vec::new(),
        });
        let o = n.outputs[0];
        if is_output[o.index()] || last_read[o.index()].is_some_and(|r| r > last) {
            outputs.push((k, o, p.ty(o).shape.clone()));
        }
    }
    // registers: instruction k's result lives from k to its last reader in the run
    let mut last_reader: Vec<usize> = (0..instrs.len()).collect();
    for (j, ins) in instrs.iter().enumerate() {
        for s in [Some(ins.a), ins.b].into_iter().flatten() {
            if let Src::Reg(r) = s {
                last_reader[r] = j;
            }
        }
    }
    // results that may go to an input's buffer are stored at the end of each tile (after
    // every read of that input's tile), so their registers are kept to the end
    let modes: Vec<Mode> = inputs
        .iter()
        .map(|&v| Mode::of(&p.ty(v).shape, shape).unwrap_or(Mode::Full))
        .collect();
    let mut donors: Vec<usize> = (0..inputs.len())
        .filter(|&j| {
            let v = inputs[j];
            modes[j] == Mode::Full
                && !is_output[v.index()]
                && matches!(p.value(v).def, hzp_ir::ValueDef::Node { .. })
                && last_read[v.index()].is_some_and(|r| r <= last)
        })
        .collect();
    let inplace: Vec<Option<usize>> = outputs.iter().map(|_| donors.pop()).collect();
    let mut keep = vec![false; instrs.len()];
    for ((k, ..), d) in outputs.iter().zip(&inplace) {
        keep[*k] = d.is_some();
    }
    let (mut free, mut nregs, mut reg_of_instr) = (Vec::new(), 0, vec![0; instrs.len()]);
    for k in 0..instrs.len() {
        let dst = free.pop().unwrap_or_else(|| {
            nregs += 1;
            nregs - 1
        });
        reg_of_instr[k] = dst;
        let ins = &mut instrs[k];
        ins.dst = dst;
        for s in [Some(&mut ins.a), ins.b.as_mut()].into_iter().flatten() {
            if let Src::Reg(r) = *s {
                *s = Src::Reg(reg_of_instr[r]);
                if last_reader[r] == k && !keep[r] && !ins.frees.contains(&reg_of_instr[r]) {
                    ins.frees.push(reg_of_instr[r]);
                }
            }
        }
        // a result nobody in the run reads frees its register at once
        if last_reader[k] == k && !keep[k] {
            ins.frees.push(dst);
        }
        free.extend(ins.frees.iter().copied());
    }
    Group {
        first,
        last,
        len,
        inputs,
        modes,
        instrs,
        nregs,
        outputs,
        inplace,
    }
}

/// A raw pointer that may cross to worker threads (each writes its own part).
#[derive(Clone, Copy, Debug)]
struct SendPtr(*mut f32);
// SAFETY: the buffers outlive the parallel section; workers read them and write disjoint
// ranges.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

/// An input of a fused run: borrowed, or given up by the evaluator (it dies in the run)
/// so that a result can take its buffer.
pub enum Input<'a> {
    Borrowed(&'a Tensor),
    Owned(Tensor),
}

/// Runs group `g` on its inputs (in [`Group::inputs`] order); returns its written-out
/// results in [`Group::output_values`] order.
pub fn run(g: &Group, inputs: Vec<Input<'_>>) -> Result<Vec<Tensor>, String> {
    let n = g.len;
    if inputs.len() != g.inputs.len() {
        return Err("internal: fused run given the wrong number of inputs".into());
    }
    let (mut owned, ptrs) = input_buffers(g, inputs)?;
    let (fresh, dest) = destinations(g, &owned, &ptrs);
    let tiles = Tiles {
        g,
        n,
        ptrs: &ptrs,
        dest: &dest,
    };
    let t = threads::num_threads();
    if t > 1 && n >= 16 * TILE {
        // pieces of whole tiles, a few per thread
        let piece = n.div_ceil(4 * t).div_ceil(TILE) * TILE;
        threads::for_each_index(n.div_ceil(piece), |i| {
            let end = ((i + 1) * piece).min(n);
            tiles.work(i * piece, end, &mut tiles.new_regs(), &mut tiles.new_wide());
        });
    } else {
        tiles.work(0, n, &mut tiles.new_regs(), &mut tiles.new_wide());
    }
    let mut results = Vec::with_capacity(g.outputs.len());
    for (((_, _, shape), &d), f) in g.outputs.iter().zip(&g.inplace).zip(fresh) {
        let v = match f {
            Some(mut v) => {
                // SAFETY: the workers wrote all n elements.
                unsafe { v.set_len(n) };
                v
            }
            None => d
                .and_then(|j| owned[j].take())
                .ok_or("internal: fused result lost its buffer")?,
        };
        results.push(Tensor {
            shape: shape.clone(),
            data: Data::F32(v),
        });
    }
    Ok(results)
}

/// Owned input buffers (kept until they become results) and a pointer per input.
type InputBuffers = (Vec<Option<Vec<f32>>>, Vec<SendPtr>);

/// Every input as a raw pointer, so that a result may overwrite an owned input's tile
/// after the tile's last read; owned buffers stay in the first list until they become
/// results. Each input must be f32 with as many elements as its mode says.
fn input_buffers(g: &Group, inputs: Vec<Input<'_>>) -> Result<InputBuffers, String> {
    let n = g.len;
    let mut owned: Vec<Option<Vec<f32>>> = Vec::with_capacity(inputs.len());
    let mut ptrs: Vec<SendPtr> = Vec::with_capacity(inputs.len());
    for (input, &mode) in inputs.into_iter().zip(&g.modes) {
        let want = mode.len(n);
        let bad = |t: &Tensor| {
            format!(
                "internal: fused input is {} with {} elements, expected f32 with {want}",
                t.dtype(),
                t.data.len()
            )
        };
        match input {
            Input::Borrowed(t) => match &t.data {
                Data::F32(v) if v.len() == want => {
                    ptrs.push(SendPtr(v.as_ptr() as *mut f32));
                    owned.push(None);
                }
                _ => return Err(bad(t)),
            },
            Input::Owned(t) => {
                if !matches!(&t.data, Data::F32(v) if v.len() == want) {
                    return Err(bad(&t));
                }
                let Data::F32(mut v) = t.data else {
                    unreachable!("checked just above")
                };
                ptrs.push(SendPtr(v.as_mut_ptr()));
                owned.push(Some(v));
            }
        }
    }
    Ok((owned, ptrs))
}

/// New result buffers (`None` where a result takes its input's) and, per instruction,
/// where its result is written (and whether it is stored at the end of the tile).
type Destinations = (Vec<Option<Vec<f32>>>, Vec<Option<(SendPtr, bool)>>);

/// Where each written-out result goes: its owned input's buffer, or a new one.
fn destinations(g: &Group, owned: &[Option<Vec<f32>>], ptrs: &[SendPtr]) -> Destinations {
    let n = g.len;
    let mut fresh: Vec<Option<Vec<f32>>> = Vec::with_capacity(g.outputs.len());
    // per instruction: (destination, stored at the end of the tile)
    let mut dest: Vec<Option<(SendPtr, bool)>> = vec![None; g.instrs.len()];
    for (&(k, ..), &d) in g.outputs.iter().zip(&g.inplace) {
        match d.filter(|&j| owned[j].is_some()) {
            Some(j) => {
                dest[k] = Some((ptrs[j], true));
                fresh.push(None);
            }
            None => {
                let mut v = Vec::with_capacity(n);
                dest[k] = Some((SendPtr(v.as_mut_ptr()), false));
                fresh.push(Some(v));
            }
        }
    }
    (fresh, dest)
}

/// A fused run over tiles: the group, its inputs' pointers and its results' destinations.
struct Tiles<'a> {
    g: &'a Group,
    n: usize,
    ptrs: &'a [SendPtr],
    dest: &'a [Option<(SendPtr, bool)>],
}

impl Tiles<'_> {
    /// Elements [s, e) of input j.
    fn tile_of(&self, j: usize, s: usize, e: usize) -> &[f32] {
        // SAFETY: input j holds mode.len(n) elements at ptrs[j]; a tile of it is only
        // overwritten at the end of that tile, after its last read.
        unsafe { std::slice::from_raw_parts(self.ptrs[j].0.add(s) as *const f32, e - s) }
    }

    /// A worker's registers.
    fn new_regs(&self) -> Vec<Vec<f32>> {
        vec![vec![0f32; TILE]; self.g.nregs]
    }

    /// A worker's tiles of broadcast inputs.
    fn new_wide(&self) -> Vec<Vec<f32>> {
        self.g
            .modes
            .iter()
            .map(|m| match m {
                Mode::Inner(_) | Mode::Outer(_) => vec![0f32; TILE],
                Mode::Full | Mode::Scalar => Vec::new(),
            })
            .collect::<Vec<_>>()
    }

    /// Elements [start, end) with the caller's registers (and tiles of broadcast inputs).
    fn work(&self, start: usize, end: usize, regs: &mut [Vec<f32>], wide: &mut [Vec<f32>]) {
        let mut t0 = start;
        while t0 < end {
            let tl = TILE.min(end - t0);
            self.fill_wide(t0, tl, wide);
            self.run_instrs(t0, tl, regs, wide);
            // results that overwrite an input: now that the tile has been read
            for (ins, out) in self.g.instrs.iter().zip(self.dest) {
                if let Some((ptr, true)) = out {
                    let d = &regs[ins.dst][..tl];
                    // SAFETY: the buffer has room for n elements and [t0, t0 + tl) is this
                    // worker's own range; no slice of this tile of the input is alive.
                    unsafe { std::ptr::copy_nonoverlapping(d.as_ptr(), ptr.0.add(t0), tl) };
                }
            }
            t0 += tl;
        }
    }

    /// Broadcast inputs: the elements of the tile of `tl` elements at `t0`.
    fn fill_wide(&self, t0: usize, tl: usize, wide: &mut [Vec<f32>]) {
        let n = self.n;
        for (j, (w, &mode)) in wide.iter_mut().zip(&self.g.modes).enumerate() {
            let mut i = 0;
            match mode {
                Mode::Inner(d) => {
                    let src = self.tile_of(j, 0, d);
                    while i < tl {
                        let at = (t0 + i) % d;
                        let run = (d - at).min(tl - i);
                        w[i..i + run].copy_from_slice(&src[at..at + run]);
                        i += run;
                    }
                }
                Mode::Outer(d) => {
                    let src = self.tile_of(j, 0, n / d);
                    while i < tl {
                        let at = t0 + i;
                        let run = (d - at % d).min(tl - i);
                        w[i..i + run].fill(src[at / d]);
                        i += run;
                    }
                }
                Mode::Full | Mode::Scalar => {}
            }
        }
    }

    /// Every instruction on the tile of `tl` elements at `t0`; results not stored over an
    /// input are written out as they are made.
    fn run_instrs(&self, t0: usize, tl: usize, regs: &mut [Vec<f32>], wide: &[Vec<f32>]) {
        let g = self.g;
        for (ins, out) in g.instrs.iter().zip(self.dest) {
            let mut dst = std::mem::take(&mut regs[ins.dst]);
            let d = &mut dst[..tl];
            let arg = |s: Src| match s {
                Src::Reg(r) => Arg::Full(&regs[r][..tl]),
                Src::Input(j) => match g.modes[j] {
                    Mode::Full => Arg::Full(self.tile_of(j, t0, t0 + tl)),
                    Mode::Scalar => Arg::Scalar(self.tile_of(j, 0, 1)[0]),
                    Mode::Inner(_) | Mode::Outer(_) => Arg::Full(&wide[j][..tl]),
                },
            };
            match (ins.kind, arg(ins.a)) {
                (Kind::Unary(u), Arg::Full(x)) => unary_into(u, x, d),
                (Kind::Unary(u), Arg::Scalar(x)) => {
                    unary_into(u, &[x], &mut d[..1]);
                    let v = d[0];
                    d.fill(v);
                }
                (Kind::Binary(b), a) => {
                    let bv = ins.b.map_or(Arg::Scalar(f32::NAN), arg);
                    binary_into(b, a, bv, d)
                }
            }
            if let Some((ptr, false)) = out {
                // SAFETY: the buffer has room for n elements and [t0, t0 + tl) is this
                // worker's own range.
                unsafe { std::ptr::copy_nonoverlapping(d.as_ptr(), ptr.0.add(t0), tl) };
            }
            regs[ins.dst] = dst;
        }
    }
}
