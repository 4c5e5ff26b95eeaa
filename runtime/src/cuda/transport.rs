//! The transport plan of the local device communicator (`hzp run --backend cuda
//! --ranks-on-one-gpu`): every rank of a plan in one process on one GPU, a collective done
//! by device copies and reduction kernels instead of NCCL.
//!
//! [`transport_plan`] says, for one collective over a group of `n` members, which bytes each
//! member's comm stream copies and which elements it reduces, in what order. The order is
//! the CPU communicator's ([`crate::comm`]): a reduction starts from member 0's input and
//! accumulates members 1, 2, ... one after another (`((x0 + x1) + x2) + ...`, each partial
//! result rounded to the dtype), a mean then multiplies by the dtype's `1/n`; an all-reduce
//! is split by elements, member `i` reducing the `i`-th chunk once and copying it into every
//! member's output. So a run with all ranks on one GPU gives the CPU backend's bits for the
//! collectives (the kernels between them are the GPU's own).
//!
//! The plan is pure data: [`run_on_host`] executes it on host bytes (the CPU tests compare
//! it with [`crate::comm::Communicator`] bit for bit), the CUDA executor issues each step as
//! a `cuMemcpyDtoDAsync` or a `coll_acc_*` / `coll_scale_*` kernel ([`kernel_name`]) on the
//! member's comm stream.

use hzp_ir::{DType, Op, ReduceOp};

/// One member's input or output buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Buf {
    In(usize),
    Out(usize),
}

impl Buf {
    pub fn member(self) -> usize {
        match self {
            Buf::In(m) | Buf::Out(m) => m,
        }
    }
}

/// One step of a member's part of a collective. Offsets are in bytes; counts in elements.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// `bytes` bytes from `src + src_off` to `dst + dst_off`.
    Copy {
        src: Buf,
        src_off: usize,
        dst: Buf,
        dst_off: usize,
        bytes: usize,
    },
    /// `dst[k] = how(dst[k], src[k])` for `count` elements, rounded to the dtype.
    Acc {
        src: Buf,
        src_off: usize,
        dst: Buf,
        dst_off: usize,
        count: usize,
        how: ReduceOp,
    },
    /// `dst[k] = dst[k] * (1/n in the dtype)` for `count` elements (a mean's last step).
    Scale {
        dst: Buf,
        dst_off: usize,
        count: usize,
        n: usize,
    },
}

/// Per member, the steps its comm stream runs, in order. A member's steps read other
/// members' inputs and (all-reduce) write other members' outputs; the caller orders them
/// after every member's arrival and before any member goes on (the two barriers of
/// [`crate::comm::Communicator::run`]; on the GPU, events).
pub type TransportPlan = Vec<Vec<Step>>;

/// The plan of `op` over `n` members, each with an input of `dtype` and `in_shape` (the
/// same on every member). Errors as the CPU communicator's argument check.
pub fn transport_plan(
    op: &Op,
    dtype: DType,
    in_shape: &[usize],
    n: usize,
) -> Result<TransportPlan, String> {
    let n = n.max(1);
    let es = dtype.size_bytes();
    let numel: usize = in_shape.iter().product();
    crate::comm::check_args(
        op,
        dtype,
        in_shape,
        n,
        numel * es,
        out_elems(op, numel, n) * es,
    )?;
    let s = in_shape;
    let mut plan: TransportPlan = vec![Vec::new(); n];
    // member order: start from member 0's elements, accumulate the others', then the mean
    let reduce_into = |steps: &mut Vec<Step>,
                       dst: Buf,
                       dst_off: usize,
                       from: usize,
                       count: usize,
                       how: ReduceOp| {
        if count == 0 {
            return;
        }
        steps.push(Step::Copy {
            src: Buf::In(0),
            src_off: from * es,
            dst,
            dst_off,
            bytes: count * es,
        });
        for j in 1..n {
            steps.push(Step::Acc {
                src: Buf::In(j),
                src_off: from * es,
                dst,
                dst_off,
                count,
                how,
            });
        }
        if how == ReduceOp::Mean && dtype != DType::Bool {
            steps.push(Step::Scale {
                dst,
                dst_off,
                count,
                n,
            });
        }
    };
    match op {
        Op::AllGather { axis, .. } => {
            let outer: usize = s[..*axis].iter().product();
            let blk = s[*axis..].iter().product::<usize>() * es;
            for (me, steps) in plan.iter_mut().enumerate() {
                for j in 0..n {
                    for o in 0..outer {
                        push_copy(
                            steps,
                            Buf::In(j),
                            o * blk,
                            Buf::Out(me),
                            (o * n + j) * blk,
                            blk,
                        );
                    }
                }
            }
        }
        Op::ReduceScatter { axis, reduce, .. } => {
            let outer: usize = s[..*axis].iter().product();
            let inner: usize = s[*axis + 1..].iter().product();
            let len = s[*axis] / n;
            let run = len * inner;
            for (me, steps) in plan.iter_mut().enumerate() {
                for o in 0..outer {
                    let from = (o * s[*axis] + me * len) * inner;
                    reduce_into(steps, Buf::Out(me), o * run * es, from, run, *reduce);
                }
            }
        }
        Op::AllReduce { reduce, .. } => {
            for (me, steps) in plan.iter_mut().enumerate() {
                let (lo, hi) = (numel * me / n, numel * (me + 1) / n);
                reduce_into(steps, Buf::Out(me), lo * es, lo, hi - lo, *reduce);
                for j in (0..n).filter(|&j| j != me) {
                    push_copy(
                        steps,
                        Buf::Out(me),
                        lo * es,
                        Buf::Out(j),
                        lo * es,
                        (hi - lo) * es,
                    );
                }
            }
        }
        Op::AllToAll {
            split_axis,
            concat_axis,
            ..
        } => {
            let mut piece = s.to_vec();
            piece[*split_axis] /= n;
            let mut out_shape = piece.clone();
            out_shape[*concat_axis] *= n;
            for (me, steps) in plan.iter_mut().enumerate() {
                for j in 0..n {
                    let mut src_at = vec![0; s.len()];
                    src_at[*split_axis] = me * piece[*split_axis];
                    let mut dst_at = vec![0; s.len()];
                    dst_at[*concat_axis] = j * piece[*concat_axis];
                    block_copies(
                        steps,
                        Buf::In(j),
                        s,
                        &src_at,
                        Buf::Out(me),
                        &out_shape,
                        &dst_at,
                        &piece,
                        es,
                    );
                }
            }
        }
        Op::Broadcast { root, .. } => {
            for (me, steps) in plan.iter_mut().enumerate() {
                push_copy(steps, Buf::In(*root), 0, Buf::Out(me), 0, numel * es);
            }
        }
        other => return Err(format!("{} is not a collective", other.name())),
    }
    Ok(plan)
}

/// Elements of a member's output.
fn out_elems(op: &Op, numel: usize, n: usize) -> usize {
    match op {
        Op::AllGather { .. } => numel * n,
        Op::ReduceScatter { .. } => numel / n,
        _ => numel,
    }
}

/// Appends a copy, merged with the previous one when it continues it (fewer launches).
fn push_copy(
    steps: &mut Vec<Step>,
    src: Buf,
    src_off: usize,
    dst: Buf,
    dst_off: usize,
    bytes: usize,
) {
    if bytes == 0 {
        return;
    }
    if let Some(Step::Copy {
        src: ps,
        src_off: pso,
        dst: pd,
        dst_off: pdo,
        bytes: pb,
    }) = steps.last_mut()
    {
        if *ps == src && *pd == dst && *pso + *pb == src_off && *pdo + *pb == dst_off {
            *pb += bytes;
            return;
        }
    }
    steps.push(Step::Copy {
        src,
        src_off,
        dst,
        dst_off,
        bytes,
    });
}

/// The copies of a `block`-shaped box from `src` (shape `ss`, at `sa`) to `dst` (shape
/// `ds`, at `da`): one per row of the box's last axis, merged where contiguous.
#[allow(clippy::too_many_arguments)]
fn block_copies(
    steps: &mut Vec<Step>,
    src: Buf,
    ss: &[usize],
    sa: &[usize],
    dst: Buf,
    ds: &[usize],
    da: &[usize],
    block: &[usize],
    es: usize,
) {
    crate::comm::block_runs(ss, sa, ds, da, block, es, |so, d_o, n| {
        push_copy(steps, src, so, dst, d_o, n)
    });
}

/// The reduction kernels' names: `coll_acc_<dtype>` and `coll_scale_<dtype>` for every
/// dtype (`f32`, `bf16`, `f16`, `i64`, `i32`, `b8`); see `kernels/collective.cu`.
pub fn kernel_name(step: &Step, dtype: DType) -> Option<String> {
    let t = dtype_tag(dtype);
    match step {
        Step::Copy { .. } => None,
        Step::Acc { .. } => Some(format!("coll_acc_{t}")),
        Step::Scale { .. } => Some(format!("coll_scale_{t}")),
    }
}

/// The kernels' dtype suffix.
pub fn dtype_tag(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        DType::I64 => "i64",
        DType::I32 => "i32",
        DType::Bool => "b8",
    }
}

/// The reduction code the `coll_acc_*` kernels take (`op` argument).
pub fn reduce_code(how: ReduceOp) -> i32 {
    match how {
        ReduceOp::Sum | ReduceOp::Mean => 0,
        ReduceOp::Prod => 1,
        ReduceOp::Max => 2,
        ReduceOp::Min => 3,
    }
}

/// Runs `plan` on host bytes: `inputs[j]` is member j's input, `outputs[j]` its output
/// (sized by the caller). Members run one after another, each its steps in order: the
/// order the device gives within a member, and members' steps touch disjoint output bytes.
pub fn run_on_host(
    plan: &TransportPlan,
    dtype: DType,
    inputs: &[Vec<u8>],
    outputs: &mut [Vec<u8>],
) -> Result<(), String> {
    let es = dtype.size_bytes();
    for steps in plan {
        for st in steps {
            match *st {
                Step::Copy {
                    src,
                    src_off,
                    dst,
                    dst_off,
                    bytes,
                } => {
                    let from = read(inputs, outputs, src, src_off, bytes)?.to_vec();
                    write(outputs, dst, dst_off, bytes)?.copy_from_slice(&from);
                }
                Step::Acc {
                    src,
                    src_off,
                    dst,
                    dst_off,
                    count,
                    how,
                } => {
                    let x = read(inputs, outputs, src, src_off, count * es)?.to_vec();
                    let d = write(outputs, dst, dst_off, count * es)?;
                    for (a, b) in d.chunks_exact_mut(es).zip(x.chunks_exact(es)) {
                        acc_elem(dtype, how, a, b);
                    }
                }
                Step::Scale {
                    dst,
                    dst_off,
                    count,
                    n,
                } => {
                    let d = write(outputs, dst, dst_off, count * es)?;
                    for a in d.chunks_exact_mut(es) {
                        scale_elem(dtype, n, a);
                    }
                }
            }
        }
    }
    Ok(())
}

fn read<'a>(
    inputs: &'a [Vec<u8>],
    outputs: &'a [Vec<u8>],
    b: Buf,
    off: usize,
    len: usize,
) -> Result<&'a [u8], String> {
    let v = match b {
        Buf::In(m) => inputs.get(m),
        Buf::Out(m) => outputs.get(m),
    }
    .ok_or_else(|| format!("{b:?}: no such member"))?;
    v.get(off..off + len).ok_or_else(|| {
        format!(
            "{b:?}: bytes {off}..{} outside its {} bytes",
            off + len,
            v.len()
        )
    })
}

fn write(outputs: &mut [Vec<u8>], b: Buf, off: usize, len: usize) -> Result<&mut [u8], String> {
    let Buf::Out(m) = b else {
        return Err(format!("{b:?}: a step writes into an input"));
    };
    let v = outputs
        .get_mut(m)
        .ok_or_else(|| format!("{b:?}: no such member"))?;
    let n = v.len();
    v.get_mut(off..off + len)
        .ok_or_else(|| format!("{b:?}: bytes {off}..{} outside its {n} bytes", off + len))
}

/// NaN-propagating max/min, as the CPU communicator and the `coll_acc_*` kernels do.
fn fmax(a: f32, b: f32) -> f32 {
    if a.is_nan() || b.is_nan() {
        f32::NAN
    } else {
        a.max(b)
    }
}

fn fmin(a: f32, b: f32) -> f32 {
    if a.is_nan() || b.is_nan() {
        f32::NAN
    } else {
        a.min(b)
    }
}

fn f32_op(how: ReduceOp, a: f32, b: f32) -> f32 {
    match how {
        ReduceOp::Sum | ReduceOp::Mean => a + b,
        ReduceOp::Prod => a * b,
        ReduceOp::Max => fmax(a, b),
        ReduceOp::Min => fmin(a, b),
    }
}

fn acc_elem(dtype: DType, how: ReduceOp, a: &mut [u8], b: &[u8]) {
    use half::{bf16, f16};
    match dtype {
        DType::F32 => {
            let x = f32::from_le_bytes(a.try_into().unwrap_or_default());
            let y = f32::from_le_bytes(b.try_into().unwrap_or_default());
            a.copy_from_slice(&f32_op(how, x, y).to_le_bytes());
        }
        DType::BF16 => {
            let x = bf16::from_le_bytes(a.try_into().unwrap_or_default()).to_f32();
            let y = bf16::from_le_bytes(b.try_into().unwrap_or_default()).to_f32();
            a.copy_from_slice(&bf16::from_f32(f32_op(how, x, y)).to_le_bytes());
        }
        DType::F16 => {
            let x = f16::from_le_bytes(a.try_into().unwrap_or_default()).to_f32();
            let y = f16::from_le_bytes(b.try_into().unwrap_or_default()).to_f32();
            a.copy_from_slice(&f16::from_f32(f32_op(how, x, y)).to_le_bytes());
        }
        DType::I64 => {
            let x = i64::from_le_bytes(a.try_into().unwrap_or_default());
            let y = i64::from_le_bytes(b.try_into().unwrap_or_default());
            let r = match how {
                ReduceOp::Sum | ReduceOp::Mean => x.wrapping_add(y),
                ReduceOp::Prod => x.wrapping_mul(y),
                ReduceOp::Max => x.max(y),
                ReduceOp::Min => x.min(y),
            };
            a.copy_from_slice(&r.to_le_bytes());
        }
        DType::I32 => {
            let x = i32::from_le_bytes(a.try_into().unwrap_or_default());
            let y = i32::from_le_bytes(b.try_into().unwrap_or_default());
            let r = match how {
                ReduceOp::Sum | ReduceOp::Mean => x.wrapping_add(y),
                ReduceOp::Prod => x.wrapping_mul(y),
                ReduceOp::Max => x.max(y),
                ReduceOp::Min => x.min(y),
            };
            a.copy_from_slice(&r.to_le_bytes());
        }
        DType::Bool => {
            a[0] = match how {
                ReduceOp::Sum | ReduceOp::Max | ReduceOp::Mean => a[0] | b[0],
                ReduceOp::Prod | ReduceOp::Min => a[0] & b[0],
            };
        }
    }
}

fn scale_elem(dtype: DType, n: usize, a: &mut [u8]) {
    use half::{bf16, f16};
    let inv = 1.0 / n as f64;
    match dtype {
        DType::F32 => {
            let x = f32::from_le_bytes(a.try_into().unwrap_or_default());
            a.copy_from_slice(&(x * inv as f32).to_le_bytes());
        }
        DType::BF16 => {
            let x = bf16::from_le_bytes(a.try_into().unwrap_or_default()).to_f32();
            let s = bf16::from_f64(inv).to_f32();
            a.copy_from_slice(&bf16::from_f32(x * s).to_le_bytes());
        }
        DType::F16 => {
            let x = f16::from_le_bytes(a.try_into().unwrap_or_default()).to_f32();
            let s = f16::from_f64(inv).to_f32();
            a.copy_from_slice(&f16::from_f32(x * s).to_le_bytes());
        }
        DType::I64 => {
            let x = i64::from_le_bytes(a.try_into().unwrap_or_default());
            a.copy_from_slice(&x.wrapping_mul(inv as i64).to_le_bytes());
        }
        DType::I32 => {
            let x = i32::from_le_bytes(a.try_into().unwrap_or_default());
            a.copy_from_slice(&x.wrapping_mul(inv as i32).to_le_bytes());
        }
        DType::Bool => {}
    }
}
