//! Recognition of scaled dot-product attention in imported graphs: each
//! `softmax(scale * Q Kᵀ + mask) V` the exporters wrote out becomes one
//! [`Op::Attention`] node (FlashAttention-style kernels, no T x S matrix kept for the
//! backward).
//!
//! What is recognized, on the imported IR (shape arithmetic already folded):
//! - the product `MatMul(P, V)` with `P = Softmax(x, last axis)`, or the "safe" softmax the
//!   importer rebuilds from PyTorch's `Where(IsNaN(s), 0, s)` (`Where(dead, 0,
//!   Softmax(Where(dead, 0, x)))` with `dead = ReduceMax(x) == -inf`);
//! - `x` = the scores plus any number of additive masks (`Add`, either operand order,
//!   each keeping the scores' shape), or `Where(cond, scores, c)` / `Where(cond, c,
//!   scores)` with a constant `c <= -1e30` (a boolean mask: becomes the additive mask
//!   `Where(cond, 0, c)`);
//! - the scores `MatMul(Q', Kᵀ')` times or divided by constant scalars, before or after the
//!   product, on either operand (torch's SDPA decomposition scales Q and K by
//!   `sqrt(scale)` each): the scale is their product;
//! - `Kᵀ` as a transpose of K (of its last two axes, or composed with a head split such as
//!   `perm = [0,2,3,1]`), through reshapes that regroup the leading axes, or anything else
//!   (then a transpose of it is K);
//! - grouped-query K/V: a value that, through reshapes, is `Expand` of `[B,Hkv,1,S,D]` to
//!   `[B,Hkv,g,S,D]` (Llama/Qwen's `repeat_kv`), or of `[B,1,S,D]` to `[B,H,S,D]`, reads
//!   the Hkv heads directly.
//!
//! It does not fire when the semantics differ or the explicit form is needed: a softmax
//! over another axis, anything between the softmax and the product (dropout, a head mask),
//! a scale that is not a constant scalar, scores or probabilities read by anything else
//! (or program outputs), masks that would broadcast the scores to a larger shape, operands
//! whose leading axes broadcast, and a plain softmax with a constant mask that has a fully
//! -inf row (the explicit softmax gives NaN there, the fused op zeros).
//!
//! A constant mask that is exactly causal (0 on and below the diagonal, -inf or the dtype's
//! lowest above it) becomes the op's `causal` flag.
//!
//! A row whose every score is -inf gives zeros (PyTorch's SDPA semantics; the importer's
//! safe softmax gives the same). With a plain softmax and a run-time mask that fully masks
//! a row, the explicit graph would give NaN for that row; the fused op gives zeros.

use hzp_ir::{
    broadcast_shapes, BinaryOp, DType, NameSet, Op, Program, ReduceOp, Tensor, ValueDef, ValueId,
};

/// A value to read: one that exists, or a new node over one.
#[derive(Clone, Debug)]
enum Src {
    Value(ValueId),
    Op(Op, Box<Src>),
}

/// One part of the additive mask.
#[derive(Clone, Debug)]
enum MaskPart {
    Value(ValueId),
    /// `Where(cond, 0, fill)` (`keep_true`) or `Where(cond, fill, 0)`.
    Where {
        cond: ValueId,
        fill: f64,
        keep_true: bool,
    },
}

/// A recognized attention: the product node `at` whose result it replaces.
struct Hit {
    at: usize,
    q: ValueId,
    k: Src,
    v: Src,
    masks: Vec<MaskPart>,
    scale: f64,
    causal: bool,
}

struct Graph<'a> {
    p: &'a Program,
    users: Vec<usize>,
    pinned: Vec<bool>,
}

impl Graph<'_> {
    fn producer(&self, v: ValueId) -> Option<(&Op, &[ValueId])> {
        match self.p.value(v).def {
            ValueDef::Node { node, .. } => {
                let n = self.p.nodes.get(node.index())?;
                Some((&n.op, n.inputs.as_slice()))
            }
            _ => None,
        }
    }

    /// Read by exactly `n` nodes and not leaving the program.
    fn only_read(&self, v: ValueId, n: usize) -> bool {
        self.users[v.index()] == n && !self.pinned[v.index()]
    }

    fn scalar(&self, v: ValueId) -> Option<f64> {
        let t = self.p.const_data(v)?;
        (t.numel() == 1 && t.dtype().is_float()).then(|| t.to_f64_vec()[0])
    }

    /// Strips constant scalar factors (`Mul` by or `Div` by): the value under them and the
    /// product of the factors. `single` requires each value under a factor to be read once.
    fn unscale(&self, mut v: ValueId, single: bool) -> (ValueId, f64) {
        let mut scale = 1.0;
        while let Some((Op::Binary(b @ (BinaryOp::Mul | BinaryOp::Div)), &[x, y])) =
            self.producer(v)
        {
            let inner = match (*b, self.scalar(x), self.scalar(y)) {
                (BinaryOp::Mul, _, Some(c)) if c != 0.0 => (x, c),
                (BinaryOp::Mul, Some(c), _) if c != 0.0 => (y, c),
                (BinaryOp::Div, _, Some(c)) if c != 0.0 => (x, 1.0 / c),
                _ => break,
            };
            if self.p.ty(inner.0) != self.p.ty(v) || (single && !self.only_read(inner.0, 1)) {
                break; // the scalar broadcast the value, or the value is read elsewhere
            }
            scale *= inner.1;
            v = inner.0;
        }
        (v, scale)
    }

    /// The masked scores `x` (read once by the softmax, or as the safe softmax reads it):
    /// the scores product, its scale and the masks added to it.
    fn masked_scores(&self, x: ValueId, first: bool) -> Option<(ValueId, f64, Vec<MaskPart>)> {
        if !first && !self.only_read(x, 1) {
            return None;
        }
        let ty = self.p.ty(x);
        let (op, ins) = self.producer(x)?;
        match (op, ins) {
            (Op::Binary(BinaryOp::Add), &[a, b]) => {
                for (s, m) in [(a, b), (b, a)] {
                    if self.p.ty(s) != ty {
                        continue;
                    }
                    if let Some((mm, scale, mut masks)) = self.masked_scores(s, false) {
                        masks.push(MaskPart::Value(m));
                        return Some((mm, scale, masks));
                    }
                }
                None
            }
            (Op::Where, &[c, a, b]) => {
                for (s, f, keep_true) in [(a, b, true), (b, a, false)] {
                    let Some(fill) = self.scalar(f) else { continue };
                    if fill > -1e30 || self.p.ty(s) != ty {
                        continue;
                    }
                    if let Some((mm, scale, mut masks)) = self.masked_scores(s, false) {
                        masks.push(MaskPart::Where {
                            cond: c,
                            fill,
                            keep_true,
                        });
                        return Some((mm, scale, masks));
                    }
                }
                None
            }
            _ => {
                // x itself was checked (by the caller when first), each value under it here
                let (mm, scale) = self.unscale(x, true);
                match self.producer(mm)? {
                    (Op::MatMul, _) => Some((mm, scale, Vec::new())),
                    _ => None,
                }
            }
        }
    }

    /// `P = softmax(x)` over the last axis as the product reads it: plain, or the
    /// importer's safe softmax. Returns x and whether the softmax is the safe one.
    fn probs(&self, pv: ValueId) -> Option<(ValueId, bool)> {
        if !self.only_read(pv, 1) {
            return None;
        }
        let last = |axis: usize, x: ValueId| axis + 1 == self.p.ty(x).rank();
        match self.producer(pv)? {
            (Op::Softmax { axis }, &[x]) if last(*axis, x) && self.only_read(x, 1) => {
                Some((x, false))
            }
            (Op::Where, &[dead, zero, y]) => {
                let is_zero = |v| self.scalar(v) == Some(0.0);
                if !is_zero(zero) || !self.only_read(y, 1) || !self.only_read(dead, 2) {
                    return None;
                }
                let (Op::Softmax { axis }, &[fin]) = self.producer(y)? else {
                    return None;
                };
                let (Op::Where, &[d2, z2, x]) = self.producer(fin)? else {
                    return None;
                };
                if d2 != dead || !is_zero(z2) || !self.only_read(fin, 1) || !last(*axis, x) {
                    return None;
                }
                let (Op::Binary(BinaryOp::Equal), &[mx, ninf]) = self.producer(dead)? else {
                    return None;
                };
                if self.scalar(ninf) != Some(f64::NEG_INFINITY) || !self.only_read(mx, 1) {
                    return None;
                }
                let (
                    Op::Reduce {
                        op: ReduceOp::Max,
                        axes,
                        keep_dims: true,
                    },
                    &[x2],
                ) = self.producer(mx)?
                else {
                    return None;
                };
                (x2 == x && axes.len() == 1 && last(axes[0], x) && self.only_read(x, 2))
                    .then_some((x, true))
            }
            _ => None,
        }
    }

    /// `v` through a chain of reshapes: `v`, its reshape's input, and so on.
    fn reshape_chain(&self, v: ValueId) -> Vec<ValueId> {
        let mut chain = vec![v];
        let mut cur = v;
        while let Some((Op::Reshape { .. }, &[x])) = self.producer(cur) {
            chain.push(x);
            cur = x;
        }
        chain
    }

    /// K from `kt` = Kᵀ (shape [.., D, S]): the transpose undone where the graph has one.
    fn untranspose(&self, kt: ValueId) -> Src {
        let ts = &self.p.ty(kt).shape;
        let r = ts.len();
        match self.producer(kt) {
            Some((Op::Transpose { perm }, &[x])) => {
                let mut p2 = perm.clone();
                p2.swap(r - 2, r - 1);
                if p2.iter().enumerate().all(|(i, &a)| i == a) {
                    Src::Value(x)
                } else {
                    Src::Op(Op::Transpose { perm: p2 }, Box::new(Src::Value(x)))
                }
            }
            Some((Op::Reshape { .. }, &[x]))
                if self.p.ty(x).rank() >= 2
                    && self.p.ty(x).shape[self.p.ty(x).rank() - 2..] == ts[r - 2..] =>
            {
                let inner = self.untranspose(x);
                let mut shape = ts[..r - 2].to_vec();
                shape.extend([ts[r - 1], ts[r - 2]]);
                reshaped(self.p, inner, shape)
            }
            _ => Src::Op(
                Op::Transpose {
                    perm: hzp_ir::views::last_two_swapped(r),
                },
                Box::new(Src::Value(kt)),
            ),
        }
    }

    /// A key or value [B,H,S,D] read as fewer heads repeated: the [B,Hkv,S,D] source and
    /// the group size g = H / Hkv (1 and the value itself when it is no such repeat).
    fn unrepeat(&self, x: &Src) -> (Src, usize) {
        let (base, shape) = match x {
            Src::Value(v) => (*v, self.p.ty(*v).shape.clone()),
            Src::Op(Op::Reshape { shape }, inner) => match inner.as_ref() {
                Src::Value(v) => (*v, shape.clone()),
                _ => return (x.clone(), 1),
            },
            _ => return (x.clone(), 1),
        };
        let &[b, h, s, d] = shape.as_slice() else {
            return (x.clone(), 1);
        };
        for u in self.reshape_chain(base) {
            let Some((Op::Expand { shape: es }, &[src])) = self.producer(u) else {
                continue;
            };
            let ss = &self.p.ty(src).shape;
            let hkv = match (es.as_slice(), ss.as_slice()) {
                (&[b2, hkv, g, s2, d2], &[b3, hkv2, 1, s3, d3])
                    if (b2, s2, d2) == (b, s, d)
                        && (b3, hkv2, s3, d3) == (b, hkv, s, d)
                        && hkv * g == h =>
                {
                    hkv
                }
                (&[b2, h2, s2, d2], &[b3, 1, s3, d3])
                    if (b2, h2, s2, d2) == (b, h, s, d) && (b3, s3, d3) == (b, s, d) =>
                {
                    1
                }
                _ => continue,
            };
            if hkv == h {
                break;
            }
            return (
                reshaped(self.p, Src::Value(src), vec![b, hkv, s, d]),
                h / hkv,
            );
        }
        (x.clone(), 1)
    }

    /// The attention whose product `P V` is node `at`, if it is one.
    fn recognize(&self, at: usize) -> Option<Hit> {
        let n = &self.p.nodes[at];
        let (Op::MatMul, &[pv, v], [out]) = (&n.op, n.inputs.as_slice(), n.outputs.as_slice())
        else {
            return None;
        };
        let rank4 = |x: ValueId| self.p.ty(x).rank() == 4;
        if !rank4(pv) || !rank4(v) || !self.p.ty(*out).dtype.is_float() {
            return None;
        }
        let (x, safe) = self.probs(pv)?;
        let (scores, post_scale, masks) = self.masked_scores(x, true)?;
        if !safe && masks.iter().any(|m| self.fully_masked_const(m)) {
            return None;
        }
        let (Op::MatMul, &[qa, kb]) = self.producer(scores)? else {
            return None;
        };
        if !rank4(qa) || !rank4(kb) {
            return None;
        }
        let (q, qscale) = self.unscale(qa, false);
        let (kt, kscale) = self.unscale(kb, false);
        let (qs, ks, vs) = (
            &self.p.ty(q).shape,
            &self.p.ty(kt).shape,
            &self.p.ty(v).shape,
        );
        // no broadcasting of the leading axes: [B,H,T,D] x [B,H,D,S], [B,H,T,S] x [B,H,S,Dv]
        if qs[..2] != ks[..2] || qs[..2] != vs[..2] || ks[3] != vs[2] {
            return None;
        }
        let dt = self.p.ty(q).dtype;
        if [kt, v].iter().any(|&y| self.p.ty(y).dtype != dt) {
            return None;
        }
        let k = self.untranspose(kt);
        let (k, gk) = self.unrepeat(&k);
        let (v, gv) = self.unrepeat(&Src::Value(v));
        let (k, v) = if gk == gv {
            (k, v)
        } else {
            // repeated differently: read both as the full heads
            (self.untranspose(kt), Src::Value(n.inputs[1]))
        };
        let scale = post_scale * qscale * kscale;
        if !scale.is_finite() {
            return None;
        }
        // the mask must broadcast to the scores' shape
        let full = self.p.ty(scores).shape.clone();
        for m in &masks {
            let ms = match m {
                MaskPart::Value(v) => {
                    if self.p.ty(*v).dtype != dt {
                        return None;
                    }
                    &self.p.ty(*v).shape
                }
                MaskPart::Where { cond, .. } => &self.p.ty(*cond).shape,
            };
            if ms.len() > 4 || broadcast_shapes(ms, &full).as_ref() != Some(&full) {
                return None;
            }
        }
        // a constant mask that is exactly the causal one becomes the causal flag (the
        // kernels then skip the keys after each query instead of adding -inf to them)
        let (tq, sk) = (full[2], full[3]);
        let causal = matches!(masks.as_slice(), [m] if self.is_causal_mask(m, tq, sk));
        let masks = if causal { Vec::new() } else { masks };
        Some(Hit {
            at,
            q,
            k,
            v,
            masks,
            scale,
            causal,
        })
    }

    /// A constant additive mask whose last two axes [T, S] are 0 where key j <= query i and
    /// at most -1e30 (-inf, or the dtype's lowest as Hugging Face writes it) elsewhere, the
    /// same in every leading position: what `causal` means. With key 0 always visible no row
    /// is fully masked, so exp of those scores is 0 either way.
    fn is_causal_mask(&self, m: &MaskPart, tq: usize, s: usize) -> bool {
        let MaskPart::Value(v) = m else {
            return false;
        };
        let Some(t) = self.p.const_data(*v) else {
            return false;
        };
        let r = t.shape.len();
        if r < 2 {
            return false;
        }
        if t.shape[r - 2..] != [tq, s] || tq == 0 || s == 0 {
            return false;
        }
        t.to_f64_vec().chunks(tq * s).all(|plane| {
            plane.iter().enumerate().all(|(k, &x)| {
                let (i, j) = (k / s, k % s);
                if j <= i {
                    x == 0.0
                } else {
                    x <= -1e30
                }
            })
        })
    }

    /// A constant mask with a row (along the last axis) of only -inf.
    fn fully_masked_const(&self, m: &MaskPart) -> bool {
        let MaskPart::Value(v) = m else {
            return false;
        };
        let Some(t) = self.p.const_data(*v) else {
            return false;
        };
        let last = t.shape.last().copied().unwrap_or(1);
        last == 0
            || t.to_f64_vec()
                .chunks(last)
                .any(|row| row.iter().all(|&x| x == f64::NEG_INFINITY))
    }
}

/// `src` reshaped to `shape`, a reshape of a reshape read as one.
fn reshaped(p: &Program, src: Src, shape: Vec<usize>) -> Src {
    let inner = match src {
        Src::Op(Op::Reshape { .. }, inner) => *inner,
        other => other,
    };
    if let Src::Value(v) = inner {
        if p.ty(v).shape == shape {
            return Src::Value(v);
        }
    }
    Src::Op(Op::Reshape { shape }, Box::new(inner))
}

/// Rewrites every recognized attention (see the module docs) into one [`Op::Attention`]
/// node; the explicit nodes are removed when nothing else reads them. Returns how many
/// it rewrote. The result keeps the value names the user sees (graph outputs included).
pub fn fuse_attention(p: &mut Program) -> Result<usize, String> {
    let hits: Vec<Hit> = {
        let users = p.users().iter().map(Vec::len).collect();
        let g = Graph {
            p,
            users,
            pinned: p.escaping_values(),
        };
        (0..p.nodes.len()).filter_map(|i| g.recognize(i)).collect()
    };
    if hits.is_empty() {
        return Ok(0);
    }
    let mut names = NameSet::from_program(p);
    let mut before: Vec<Vec<hzp_ir::Node>> = vec![Vec::new(); p.nodes.len()];
    let mut replace: Vec<(ValueId, ValueId)> = Vec::new();
    let first_new = p.values.len();
    // the values each hit adds, to number them just before the product they replace
    let mut added: Vec<std::ops::Range<usize>> = Vec::new();
    for h in &hits {
        let start = p.values.len();
        let base = p.nodes[h.at].name.clone();
        let mut em = Emit {
            p,
            names: &mut names,
            base: &base,
            out: &mut before[h.at],
        };
        let k = em.src(&h.k)?;
        let v = em.src(&h.v)?;
        let mut mask: Option<ValueId> = None;
        for m in &h.masks {
            let part = match *m {
                MaskPart::Value(v) => v,
                MaskPart::Where {
                    cond,
                    fill,
                    keep_true,
                } => {
                    let dt = em.p.ty(h.q).dtype;
                    let z = em.konst(dt, 0.0, "zero");
                    let f = em.konst(dt, fill, "masked");
                    let (a, b) = if keep_true { (z, f) } else { (f, z) };
                    em.node(Op::Where, vec![cond, a, b], "mask")?
                }
            };
            mask = Some(match mask {
                None => part,
                Some(prev) => em.node(Op::Binary(BinaryOp::Add), vec![prev, part], "mask")?,
            });
        }
        let mut ins = vec![h.q, k, v];
        ins.extend(mask);
        let old = p.nodes[h.at].outputs[0];
        let o_name = names.fresh(&format!("{}.fused", p.value(old).name));
        let lse_name = names.fresh(&format!("{base}/lse"));
        let outs = p.add_node(
            format!("{base}/attention"),
            Op::Attention {
                scale: h.scale,
                causal: h.causal,
            },
            ins,
            vec![o_name, lse_name],
        )?;
        before[h.at].push(p.nodes.pop().expect("just added"));
        replace.push((old, outs[0]));
        added.push(start..p.values.len());
    }
    splice(p, before, &replace, &added, first_new);
    Ok(hits.len())
}

/// Puts the nodes of each rewrite before the node whose result it replaces (`before[i]`
/// goes before node `i`), makes the readers of each replaced value `old` read `new` (which
/// takes `old`'s name), numbers each rewrite's new values (`added`, all at or after
/// `first_new`) just before the value they replace, and drops what nothing reads any more.
pub(crate) fn splice(
    p: &mut Program,
    mut before: Vec<Vec<hzp_ir::Node>>,
    replace: &[(ValueId, ValueId)],
    added: &[std::ops::Range<usize>],
    first_new: usize,
) {
    let old = std::mem::take(&mut p.nodes);
    for (i, n) in old.into_iter().enumerate() {
        p.nodes.append(&mut before[i]);
        p.nodes.push(n);
    }
    p.renumber_nodes();
    // readers of the explicit product read the fused result, under the product's name
    for &(old, new) in replace {
        let swap = |x: &mut ValueId| {
            if *x == old {
                *x = new;
            }
        };
        for n in &mut p.nodes {
            n.inputs.iter_mut().for_each(swap);
        }
        p.outputs.iter_mut().for_each(swap);
        for u in &mut p.updates {
            swap(&mut u.value);
        }
        let a = std::mem::take(&mut p.values[old.index()].name);
        let b = std::mem::replace(&mut p.values[new.index()].name, a);
        p.values[old.index()].name = b;
    }
    let mut order: Vec<ValueId> = Vec::with_capacity(p.values.len());
    for v in 0..first_new {
        if let Some(k) = replace.iter().position(|&(old, _)| old.index() == v) {
            order.extend(added[k].clone().map(|i| ValueId(i as u32)));
        }
        order.push(ValueId(v as u32));
    }
    p.reorder_values(&order);
    p.eliminate_dead_code();
}

/// Emits the helper nodes of one attention into `out` (placed before its product).
struct Emit<'a> {
    p: &'a mut Program,
    names: &'a mut NameSet,
    base: &'a str,
    out: &'a mut Vec<hzp_ir::Node>,
}

impl Emit<'_> {
    fn node(&mut self, op: Op, ins: Vec<ValueId>, what: &str) -> Result<ValueId, String> {
        let name = self.names.fresh(&format!("{}/{what}", self.base));
        let v = self
            .p
            .add_node(format!("{}/{what}", self.base), op, ins, vec![name])?[0];
        self.out.push(self.p.nodes.pop().expect("just added"));
        Ok(v)
    }
    fn konst(&mut self, dt: DType, x: f64, what: &str) -> ValueId {
        let name = self.names.fresh(&format!("{}/{what}", self.base));
        self.p.add_const(name, Tensor::from_f64(dt, vec![], &[x]))
    }
    fn src(&mut self, s: &Src) -> Result<ValueId, String> {
        match s {
            Src::Value(v) => Ok(*v),
            Src::Op(op, inner) => {
                let x = self.src(inner)?;
                let what = match op {
                    Op::Reshape { .. } => "heads",
                    _ => "untransposed",
                };
                self.node(op.clone(), vec![x], what)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hzp_ir::text::parse;

    const HEAD: &str = "program \"g\"\ninput %q : f32[2,4,5,8]\ninput %k : f32[2,2,5,8]\n\
        input %v : f32[2,2,5,8]\ninput %m : f32[2,1,1,5]\ninput %s : f32[]\n\
        const %c : f32[] = [0.5]\nconst %ninf : f32[] = [-inf]\nconst %big : f32[] = [-1e9]\n\
        %kr = Reshape{shape=[2,2,1,5,8]}(%k) : f32[2,2,1,5,8] \"kr\"\n\
        %ke = Expand{shape=[2,2,2,5,8]}(%kr) : f32[2,2,2,5,8] \"ke\"\n\
        %kk = Reshape{shape=[2,4,5,8]}(%ke) : f32[2,4,5,8] \"kk\"\n\
        %vr = Reshape{shape=[2,2,1,5,8]}(%v) : f32[2,2,1,5,8] \"vr\"\n\
        %ve = Expand{shape=[2,2,2,5,8]}(%vr) : f32[2,2,2,5,8] \"ve\"\n\
        %vv = Reshape{shape=[2,4,5,8]}(%ve) : f32[2,4,5,8] \"vv\"\n\
        %kt = Transpose{perm=[0,1,3,2]}(%kk) : f32[2,4,8,5] \"kt\"\n\
        %qs = Mul(%q, %c) : f32[2,4,5,8] \"qs\"\n\
        %kts = Mul(%kt, %c) : f32[2,4,8,5] \"kts\"\n\
        %sc = MatMul(%qs, %kts) : f32[2,4,5,5] \"sc\"\n";

    fn prog(body: &str, out: &str) -> Program {
        parse(&format!("{HEAD}{body}output %{out}\n"), "g.hzp", &|_| None)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    fn inputs(p: &Program) -> Vec<(String, Tensor)> {
        p.inputs
            .iter()
            .enumerate()
            .map(|(i, &v)| {
                let t = p.ty(v);
                let vals: Vec<f64> = (0..t.numel())
                    .map(|j| {
                        let x = ((j * 37 + i * 11) % 23) as f64 / 7.0 - 1.5;
                        if p.value(v).name == "m" && j % 5 == 4 {
                            f64::NEG_INFINITY
                        } else {
                            x
                        }
                    })
                    .collect();
                (
                    p.value(v).name.clone(),
                    Tensor::from_f64(t.dtype, t.shape.clone(), &vals),
                )
            })
            .collect()
    }

    /// Fuses `p` and checks how many attentions were found and that the outputs agree.
    fn check(body: &str, out: &str, want: usize) -> Program {
        let p = prog(body, out);
        let mut f = p.clone();
        let n = fuse_attention(&mut f).unwrap();
        assert_eq!(n, want, "{body}");
        hzp_ir::verify(&f).unwrap();
        let ins = inputs(&p);
        let a = hzp_kernels::eval::evaluate(&p, &ins).unwrap();
        let b = hzp_kernels::eval::evaluate(&f, &ins).unwrap();
        for ((na, x), (nb, y)) in a.iter().zip(&b) {
            assert_eq!(na, nb);
            for (u, w) in x.to_f64_vec().iter().zip(y.to_f64_vec()) {
                assert!(
                    (u - w).abs() <= 1e-5 * (1.0 + u.abs()),
                    "{body}: {u} vs {w}"
                );
            }
        }
        f
    }

    #[test]
    fn grouped_query_attention_with_a_mask_is_one_op() {
        let f = check(
            "%x = Add(%sc, %m) : f32[2,4,5,5] \"x\"\n%p = Softmax{axis=3}(%x) : f32[2,4,5,5] \"p\"\n\
             %y = MatMul(%p, %vv) : f32[2,4,5,8] \"y\"\n",
            "y",
            1,
        );
        let att = f
            .nodes
            .iter()
            .find(|n| matches!(n.op, Op::Attention { .. }))
            .unwrap();
        assert_eq!(
            att.op,
            Op::Attention {
                scale: 0.25,
                causal: false
            }
        );
        // the key/value heads are read unrepeated, and the output keeps its name
        assert_eq!(f.ty(att.inputs[1]).shape, vec![2, 2, 5, 8]);
        assert_eq!(f.ty(att.inputs[2]).shape, vec![2, 2, 5, 8]);
        assert_eq!(f.value(f.outputs[0]).name, "y");
        assert!(!f.nodes.iter().any(|n| matches!(n.op, Op::Softmax { .. })));
    }

    #[test]
    fn a_constant_causal_mask_becomes_the_causal_flag() {
        let tri = |low: &str| -> String {
            (0..25)
                .map(|k| if k % 5 <= k / 5 { "0.0" } else { low })
                .collect::<Vec<_>>()
                .join(", ")
        };
        for low in ["-inf", "-3.4028235e38"] {
            let f = check(
                &format!(
                    "const %cm : f32[5,5] = [{}]\n%x = Add(%sc, %cm) : f32[2,4,5,5] \"x\"\n\
                     %p = Softmax{{axis=3}}(%x) : f32[2,4,5,5] \"p\"\n\
                     %y = MatMul(%p, %vv) : f32[2,4,5,8] \"y\"\n",
                    tri(low)
                ),
                "y",
                1,
            );
            let att = f
                .nodes
                .iter()
                .find(|n| matches!(n.op, Op::Attention { .. }));
            let att = att.unwrap();
            assert_eq!(
                att.op,
                Op::Attention {
                    scale: 0.25,
                    causal: true
                }
            );
            assert_eq!(att.inputs.len(), 3, "the mask is dropped");
        }
        // a mask that also pads keys stays a mask
        let padded: String = (0..25)
            .map(|k| {
                if k % 5 <= k / 5 && k % 5 != 3 {
                    "0.0"
                } else {
                    "-inf"
                }
            })
            .collect::<Vec<_>>()
            .join(", ");
        let f = check(
            &format!(
                "const %cm : f32[5,5] = [{padded}]\n%x = Add(%sc, %cm) : f32[2,4,5,5] \"x\"\n\
                 %p = Softmax{{axis=3}}(%x) : f32[2,4,5,5] \"p\"\n\
                 %y = MatMul(%p, %vv) : f32[2,4,5,8] \"y\"\n"
            ),
            "y",
            1,
        );
        assert!(f.nodes.iter().any(|n| n.op
            == Op::Attention {
                scale: 0.25,
                causal: false
            }
            && n.inputs.len() == 4));
    }

    #[test]
    fn boolean_masks_and_scores_scaled_after_the_product() {
        check(
            "%d = Div(%sc, %c) : f32[2,4,5,5] \"d\"\n%b = Greater(%m, %c) : bool[2,1,1,5] \"b\"\n\
             %x = Where(%b, %ninf, %d) : f32[2,4,5,5] \"x\"\n%p = Softmax{axis=3}(%x) : f32[2,4,5,5] \"p\"\n\
             %y = MatMul(%p, %vv) : f32[2,4,5,8] \"y\"\n",
            "y",
            1,
        );
    }

    #[test]
    fn differing_semantics_are_left_alone() {
        let tail = "%y = MatMul(%p, %vv) : f32[2,4,5,8] \"y\"\n";
        let cases = [
            // something between the softmax and the product (dropout's scaling)
            "%p0 = Softmax{axis=3}(%sc) : f32[2,4,5,5] \"p0\"\n%p = Mul(%p0, %c) : f32[2,4,5,5] \"p\"\n",
            // a softmax over another axis
            "%p = Softmax{axis=2}(%sc) : f32[2,4,5,5] \"p\"\n",
            // a scale that is not a constant
            "%d = Mul(%sc, %s) : f32[2,4,5,5] \"d\"\n%p = Softmax{axis=3}(%d) : f32[2,4,5,5] \"p\"\n",
            // a fill that is not -inf-like: not an additive mask
            "%b = Greater(%m, %c) : bool[2,1,1,5] \"b\"\n%x = Where(%b, %big, %sc) : f32[2,4,5,5] \"x\"\n\
             %p = Softmax{axis=3}(%x) : f32[2,4,5,5] \"p\"\n",
            // scores transformed otherwise (soft-capping)
            "%t = Tanh(%sc) : f32[2,4,5,5] \"t\"\n%p = Softmax{axis=3}(%t) : f32[2,4,5,5] \"p\"\n",
        ];
        for body in cases {
            check(&format!("{body}{tail}"), "y", 0);
        }
        // the probabilities or the scores read by something else
        check(
            &format!("%p = Softmax{{axis=3}}(%sc) : f32[2,4,5,5] \"p\"\n{tail}%z = Add(%p, %c) : f32[2,4,5,5] \"z\"\n"),
            "z",
            0,
        );
        let p = prog(
            &format!("%p = Softmax{{axis=3}}(%sc) : f32[2,4,5,5] \"p\"\n{tail}"),
            "sc",
        );
        assert_eq!(fuse_attention(&mut p.clone()).unwrap(), 0);
    }
}
