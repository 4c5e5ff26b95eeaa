//! Recognition of routed mixture-of-experts blocks in imported graphs: each block that
//! gathers every top-k choice's expert weights becomes [`Op::MoeDispatch`] (dropless:
//! capacity = tokens), batched products over the stacked expert weights themselves, and
//! [`Op::MoeCombine`] (docs/moe.md). The per-choice gathers cost `T*K` copies of an
//! expert's weights; the routed form reads each expert's weights once.
//!
//! What is recognized, on the imported IR (shape arithmetic already folded), with `N = T*K`:
//! - the output `ReduceSum(Reshape([T,K,H], y * w), axis 1)`, `w` a reshape to `[N,1]`
//!   of any `[T,K]` value (the combine weights, normalized or not), `y` per-choice;
//! - per-choice values `[N, ...]`: the tokens repeated per choice
//!   (`Reshape(Tile([1,K,1]) or Expand([T,K,H]) of x as [T,1,H])`); a gathered product
//!   `Reshape([N,A], MatMul(G, Reshape([N,B,1], u)))` with `G = Gather(axis 0)` or
//!   `GatherND` of a stacked expert weight `[E,A,B]` by the choices flattened (`[N]` or
//!   `[N,1]`); and row-wise ops of per-choice values: `Sigmoid`, `Silu`, `Relu`, `Gelu`,
//!   `Tanh`, `Neg`, `Erf`, `Abs`, `Mul`/`Add`/`Sub` of two per-choice values of one shape,
//!   `Slice` and `Split` off axis 0;
//! - the choices are one `TopK` over the last axis `E` of a `[T,E]` value (so a token's
//!   choices are distinct experts and capacity `T` drops nothing), the same in every gather.
//!
//! Anything else stays as written: other ops on per-choice values (ones that are not finite
//! at zero, such as `Log`, are left out because the routed buffers' empty rows are zero),
//! per-choice values read outside the block or leaving the program, mismatched shapes.
//! The result equals the graph as written (the combine sums the choices in order).

use hzp_ir::{BinaryOp, NameSet, Node, Op, Program, ReduceOp, UnaryOp, ValueDef, ValueId};
use std::collections::BTreeMap;

/// How one per-choice value `[N, ...]` is computed.
#[derive(Clone, Debug)]
enum Kind {
    /// The block's tokens, one copy per choice.
    Tokens,
    /// `weight[choice] @ input` per row: `weight` is `[E,A,B]`, `input` per-choice `[N,B]`.
    Product { weight: ValueId, input: ValueId },
    /// A row-wise node over per-choice values (this value is its output `slot`).
    Rowwise { node: usize, slot: usize },
}

/// A recognized block: the sum node `at` whose result it replaces.
struct Block {
    at: usize,
    tokens: ValueId,
    choices: ValueId,
    weights: ValueId,
    experts: usize,
    y: ValueId,
    kinds: BTreeMap<ValueId, Kind>,
}

struct Graph<'a> {
    p: &'a Program,
    users: Vec<Vec<hzp_ir::NodeId>>,
    pinned: Vec<bool>,
}

/// What a block's walk has found so far.
struct Walk {
    t: usize,
    k: usize,
    tokens: Option<ValueId>,
    choices: Option<ValueId>,
    experts: Option<usize>,
    kinds: BTreeMap<ValueId, Kind>,
    /// The nodes that may read per-choice values: row-wise nodes, the reshapes feeding
    /// products, the weighting product.
    inside: std::collections::BTreeSet<usize>,
}

impl Graph<'_> {
    fn producer(&self, v: ValueId) -> Option<(usize, &Node)> {
        match self.p.value(v).def {
            ValueDef::Node { node, .. } => Some((node.index(), self.p.nodes.get(node.index())?)),
            _ => None,
        }
    }

    fn shape(&self, v: ValueId) -> &[usize] {
        &self.p.ty(v).shape
    }

    /// Read by exactly one node and not leaving the program.
    fn once(&self, v: ValueId) -> bool {
        self.users[v.index()].len() == 1 && !self.pinned[v.index()]
    }

    /// The input of a `Reshape` node producing `v`, if read only there.
    fn unreshape(&self, v: ValueId) -> Option<ValueId> {
        match self.producer(v)? {
            (_, n) if matches!(n.op, Op::Reshape { .. }) && self.once(v) => Some(n.inputs[0]),
            _ => None,
        }
    }

    /// Strips reshapes (whatever reads them) down to a value of shape `[t, k]`.
    fn through_reshapes(&self, mut v: ValueId, t: usize, k: usize) -> Option<ValueId> {
        loop {
            if self.shape(v) == [t, k] {
                return Some(v);
            }
            match self.producer(v)? {
                (_, n) if matches!(n.op, Op::Reshape { .. }) => v = n.inputs[0],
                _ => return None,
            }
        }
    }

    fn recognize(&self, at: usize) -> Option<Block> {
        let n = &self.p.nodes[at];
        let Op::Reduce {
            op: ReduceOp::Sum,
            axes,
            keep_dims: false,
        } = &n.op
        else {
            return None;
        };
        let r = n.inputs[0];
        let &[t, k, h] = self.shape(r) else {
            return None;
        };
        if axes != &[1] || k < 1 || !self.once(r) {
            return None;
        }
        let m = self.unreshape(r)?;
        let (_, mul) = self.producer(m)?;
        if mul.op != Op::Binary(BinaryOp::Mul) || !self.once(m) || self.shape(m) != [t * k, h] {
            return None;
        }
        let (y, wc) = match (mul.inputs[0], mul.inputs[1]) {
            (a, b) if self.shape(b) == [t * k, 1] => (a, b),
            (a, b) if self.shape(a) == [t * k, 1] => (b, a),
            _ => return None,
        };
        let weights = self.through_reshapes(wc, t, k)?;
        if self.shape(y) != [t * k, h] || !self.p.ty(weights).dtype.is_float() {
            return None;
        }
        let mut w = Walk {
            t,
            k,
            tokens: None,
            choices: None,
            experts: None,
            kinds: BTreeMap::new(),
            inside: [self.producer(m)?.0].into(),
        };
        self.per_choice(y, &mut w)?;
        // per-choice values are read only inside the block
        let read_outside = w.kinds.keys().any(|v| {
            self.users[v.index()]
                .iter()
                .any(|u| !w.inside.contains(&u.index()))
        });
        if read_outside {
            return None;
        }
        Some(Block {
            at,
            tokens: w.tokens?,
            choices: w.choices?,
            weights,
            experts: w.experts?,
            y,
            kinds: w.kinds,
        })
    }

    /// Classifies the per-choice value `v` and everything it is computed from.
    fn per_choice(&self, v: ValueId, w: &mut Walk) -> Option<()> {
        if w.kinds.contains_key(&v) {
            return Some(());
        }
        let n_rows = w.t * w.k;
        if self.shape(v).first() != Some(&n_rows) || self.pinned[v.index()] {
            return None;
        }
        let (node, n) = self.producer(v)?;
        let kind = match &n.op {
            Op::Reshape { .. } => self.reshaped(n.inputs[0], w)?,
            Op::Unary(
                UnaryOp::Sigmoid
                | UnaryOp::Silu
                | UnaryOp::Relu
                | UnaryOp::Gelu
                | UnaryOp::GeluTanh
                | UnaryOp::Tanh
                | UnaryOp::Neg
                | UnaryOp::Erf
                | UnaryOp::Abs,
            ) => Kind::Rowwise { node, slot: 0 },
            Op::Binary(BinaryOp::Mul | BinaryOp::Add | BinaryOp::Sub)
                if n.inputs.iter().all(|&x| self.shape(x) == self.shape(v)) =>
            {
                Kind::Rowwise { node, slot: 0 }
            }
            Op::Slice { axes, .. } if !axes.contains(&0) => Kind::Rowwise { node, slot: 0 },
            Op::Split { axis, .. } if *axis != 0 => {
                let slot = n.outputs.iter().position(|&o| o == v)?;
                Kind::Rowwise { node, slot }
            }
            _ => return None,
        };
        match &kind {
            Kind::Rowwise { node, .. } => {
                w.inside.insert(*node);
                for &x in &n.inputs {
                    self.per_choice(x, w)?;
                }
            }
            Kind::Product { input, .. } => self.per_choice(*input, w)?,
            Kind::Tokens => {}
        }
        w.kinds.insert(v, kind);
        Some(())
    }

    /// `v = Reshape(x)` per-choice: the repeated tokens or a gathered product.
    fn reshaped(&self, x: ValueId, w: &mut Walk) -> Option<Kind> {
        let (_, n) = self.producer(x)?;
        match &n.op {
            Op::Tile { repeats } if repeats == &[1, w.k, 1] => self.tokens(n.inputs[0], x, w),
            Op::Expand { .. } => self.tokens(n.inputs[0], x, w),
            Op::MatMul => self.product(x, n, w),
            _ => None,
        }
    }

    /// `rep` `[T,K,H]` repeats `x1` `[T,1,H]`, a reshape of the tokens `[T,H]`.
    fn tokens(&self, x1: ValueId, rep: ValueId, w: &mut Walk) -> Option<Kind> {
        let &[t, k, h] = self.shape(rep) else {
            return None;
        };
        if (t, k) != (w.t, w.k) || self.shape(x1) != [t, 1, h] || !self.once(rep) {
            return None;
        }
        let x = self.unreshape(x1)?;
        if self.shape(x) != [t, h] || !self.p.ty(x).dtype.is_float() {
            return None;
        }
        match w.tokens {
            Some(prev) if prev != x => None,
            _ => {
                w.tokens = Some(x);
                Some(Kind::Tokens)
            }
        }
    }

    /// `mm = MatMul(gathered weight [N,A,B], Reshape([N,B,1], u))` of shape `[N,A,1]`.
    fn product(&self, mm: ValueId, n: &Node, w: &mut Walk) -> Option<Kind> {
        let n_rows = w.t * w.k;
        let &[rows, a, 1] = self.shape(mm) else {
            return None;
        };
        let (g, ur) = (n.inputs[0], n.inputs[1]);
        if rows != n_rows || !self.once(mm) || !self.once(g) {
            return None;
        }
        let u = self.unreshape(ur)?;
        w.inside.insert(self.producer(ur)?.0);
        let &[_, b] = self.shape(u) else {
            return None;
        };
        if self.shape(ur) != [n_rows, b, 1] || self.shape(g) != [n_rows, a, b] {
            return None;
        }
        let (_, gn) = self.producer(g)?;
        let idx = match (&gn.op, self.shape(gn.inputs[1])) {
            (Op::Gather { axis: 0 }, [r]) if *r == n_rows => gn.inputs[1],
            (Op::GatherND { batch_dims: 0 }, [r, 1]) if *r == n_rows => gn.inputs[1],
            _ => return None,
        };
        let weight = gn.inputs[0];
        let &[e, wa, wb] = self.shape(weight) else {
            return None;
        };
        if (wa, wb) != (a, b) {
            return None;
        }
        let choices = self.through_reshapes(idx, w.t, w.k)?;
        self.check_choices(choices, e, w)?;
        Some(Kind::Product { weight, input: u })
    }

    /// The choices are output 1 of a `TopK` of `k` over the last axis `e` of `[T,e]`, the
    /// same for the whole block.
    fn check_choices(&self, choices: ValueId, e: usize, w: &mut Walk) -> Option<()> {
        let (_, n) = self.producer(choices)?;
        let Op::TopK { axis: 1, k, .. } = n.op else {
            return None;
        };
        if n.outputs.get(1) != Some(&choices) || k != w.k || self.shape(n.inputs[0]) != [w.t, e] {
            return None;
        }
        if w.choices.is_some_and(|c| c != choices) || w.experts.is_some_and(|x| x != e) {
            return None;
        }
        w.choices = Some(choices);
        w.experts = Some(e);
        Some(())
    }
}

/// Rewrites every recognized block (see the module docs) into the routed form; the
/// per-choice nodes are removed. Returns how many it rewrote. The combined result keeps
/// the name of the sum it replaces.
pub fn fuse_moe(p: &mut Program) -> Result<usize, String> {
    let blocks: Vec<Block> = {
        let users = p.users();
        let g = Graph {
            p,
            users,
            pinned: p.escaping_values(),
        };
        (0..p.nodes.len()).filter_map(|i| g.recognize(i)).collect()
    };
    if blocks.is_empty() {
        return Ok(0);
    }
    let mut names = NameSet::from_program(p);
    let mut before: Vec<Vec<Node>> = vec![Vec::new(); p.nodes.len()];
    let mut replace: Vec<(ValueId, ValueId)> = Vec::new();
    let first_new = p.values.len();
    let mut added: Vec<std::ops::Range<usize>> = Vec::new();
    for b in &blocks {
        let start = p.values.len();
        // the block's scope: the sum's name without its last part, when it has one
        let name = &p.nodes[b.at].name;
        let base = match name.rsplit_once('/') {
            Some((scope, _)) if !scope.is_empty() => scope.to_string(),
            _ => name.clone(),
        };
        let mut em = Emit {
            p,
            names: &mut names,
            base: &base,
            out: &mut before[b.at],
            routed: BTreeMap::new(),
        };
        let outs = em.nodes(
            Op::MoeDispatch {
                experts: b.experts,
                capacity: em.p.ty(b.tokens).shape[0],
            },
            vec![b.tokens, b.choices],
            &["moe_dispatch", "moe_slots"],
        )?;
        let y = em.routed(b, b.y, outs[0])?;
        let combined = em.nodes(
            Op::MoeCombine,
            vec![y, b.choices, outs[1], b.weights],
            &["moe_combine"],
        )?[0];
        replace.push((p.nodes[b.at].outputs[0], combined));
        added.push(start..p.values.len());
    }
    crate::attention::splice(p, before, &replace, &added, first_new);
    Ok(blocks.len())
}

/// Emits the routed nodes of one block into `out` (placed before its sum).
struct Emit<'a> {
    p: &'a mut Program,
    names: &'a mut NameSet,
    base: &'a str,
    out: &'a mut Vec<Node>,
    /// Per-choice value -> its routed `[E, C, ...]` counterpart.
    routed: BTreeMap<ValueId, ValueId>,
}

impl Emit<'_> {
    fn nodes(&mut self, op: Op, ins: Vec<ValueId>, what: &[&str]) -> Result<Vec<ValueId>, String> {
        let outs = what
            .iter()
            .map(|w| self.names.fresh(&format!("{}/{w}", self.base)))
            .collect();
        let name = format!("{}/{}", self.base, what[0]);
        let vs = self.p.add_node(name, op, ins, outs)?;
        self.out.push(self.p.nodes.pop().expect("just added"));
        Ok(vs)
    }

    /// The routed counterpart of the per-choice value `v` (`dispatched` for the tokens).
    fn routed(&mut self, b: &Block, v: ValueId, dispatched: ValueId) -> Result<ValueId, String> {
        if let Some(&r) = self.routed.get(&v) {
            return Ok(r);
        }
        let kind = b
            .kinds
            .get(&v)
            .ok_or("a per-choice value was not classified")?;
        let r = match kind.clone() {
            Kind::Tokens => dispatched,
            Kind::Product { weight, input } => {
                let x = self.routed(b, input, dispatched)?;
                let wt = Op::Transpose {
                    perm: vec![0, 2, 1],
                };
                let wt = self.nodes(wt, vec![weight], &["expert_weight_t"])?[0];
                self.nodes(Op::MatMul, vec![x, wt], &["expert_product"])?[0]
            }
            Kind::Rowwise { node, slot } => {
                let n = self.p.nodes[node].clone();
                let ins = n
                    .inputs
                    .iter()
                    .map(|&x| self.routed(b, x, dispatched))
                    .collect::<Result<Vec<_>, _>>()?;
                let op = shifted(&n.op);
                let last = n.name.rsplit('/').next().unwrap_or(&n.name);
                let what: Vec<String> = (0..n.outputs.len())
                    .map(|i| match i {
                        0 => format!("{last}.routed"),
                        _ => format!("{last}.routed{i}"),
                    })
                    .collect();
                let what: Vec<&str> = what.iter().map(String::as_str).collect();
                let outs = self.nodes(op, ins, &what)?;
                for (&o, &r) in n.outputs.iter().zip(&outs) {
                    self.routed.insert(o, r);
                }
                outs[slot]
            }
        };
        self.routed.insert(v, r);
        Ok(r)
    }
}

/// A row-wise op of `[N, ...]` values as the same op of `[E, C, ...]` values.
fn shifted(op: &Op) -> Op {
    match op {
        Op::Slice {
            axes,
            starts,
            ends,
            steps,
        } => Op::Slice {
            axes: axes.iter().map(|a| a + 1).collect(),
            starts: starts.clone(),
            ends: ends.clone(),
            steps: steps.clone(),
        },
        Op::Split { axis, sizes } => Op::Split {
            axis: axis + 1,
            sizes: sizes.clone(),
        },
        other => other.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hzp_ir::text::parse;

    /// One block as the legacy exporter writes it (T=4 tokens, K=2 of E=3 experts, H=4,
    /// F=3), with `act` as the activation and `extra` appended before the output.
    fn block(act: &str, extra: &str, out: &str) -> Program {
        let text = format!(
            "program \"m\"\ninput %x : f32[4,4]\ninput %r : f32[4,3]\n\
             param %wu : f32[3,6,4]\nparam %wd : f32[3,4,3]\n\
             %p = Softmax{{axis=1}}(%r) : f32[4,3] \"p\"\n\
             %tv, %ti = TopK{{axis=1, k=2, largest=true, sorted=true}}(%p) : f32[4,2], i64[4,2] \"topk\"\n\
             %x1 = Reshape{{shape=[4,1,4]}}(%x) : f32[4,1,4] \"x1\"\n\
             %xt = Tile{{repeats=[1,2,1]}}(%x1) : f32[4,2,4] \"xt\"\n\
             %xf = Reshape{{shape=[8,4]}}(%xt) : f32[8,4] \"xf\"\n\
             %ix = Reshape{{shape=[8]}}(%ti) : i64[8] \"ix\"\n\
             %gu = Gather{{axis=0}}(%wu, %ix) : f32[8,6,4] \"gu\"\n\
             %xu = Reshape{{shape=[8,4,1]}}(%xf) : f32[8,4,1] \"xu\"\n\
             %mu = MatMul(%gu, %xu) : f32[8,6,1] \"mu\"\n\
             %u = Reshape{{shape=[8,6]}}(%mu) : f32[8,6] \"u\"\n\
             %a, %b = Split{{axis=1, sizes=[3,3]}}(%u) : f32[8,3], f32[8,3] \"split\"\n\
             %s = {act}(%a) : f32[8,3] \"act\"\n\
             %h = Mul(%s, %b) : f32[8,3] \"h\"\n\
             %gd = Gather{{axis=0}}(%wd, %ix) : f32[8,4,3] \"gd\"\n\
             %hu = Reshape{{shape=[8,3,1]}}(%h) : f32[8,3,1] \"hu\"\n\
             %md = MatMul(%gd, %hu) : f32[8,4,1] \"md\"\n\
             %y = Reshape{{shape=[8,4]}}(%md) : f32[8,4] \"y\"\n\
             %wf = Reshape{{shape=[8,1]}}(%tv) : f32[8,1] \"wf\"\n\
             %yw = Mul(%y, %wf) : f32[8,4] \"yw\"\n\
             %y3 = Reshape{{shape=[4,2,4]}}(%yw) : f32[4,2,4] \"y3\"\n\
             %o = Reduce{{op=sum, axes=[1], keep_dims=false}}(%y3) : f32[4,4] \"o\"\n\
             {extra}output %{out}\n"
        );
        let mut p = parse(&text, "m.hzp", &|_| None).unwrap_or_else(|e| panic!("{e}"));
        let shapes: Vec<Vec<usize>> = p
            .params
            .iter()
            .map(|x| p.ty(x.value).shape.clone())
            .collect();
        for (i, (prm, t)) in p.params.iter_mut().zip(shapes).enumerate() {
            let n: usize = t.iter().product();
            let vals: Vec<f64> = (0..n)
                .map(|j| ((j * 29 + i * 7) % 19) as f64 / 9.0 - 1.0)
                .collect();
            prm.data = Some(hzp_ir::Tensor::from_f64(hzp_ir::DType::F32, t, &vals));
        }
        p
    }

    fn inputs() -> Vec<(String, hzp_ir::Tensor)> {
        let v = |n: usize, s: usize| -> Vec<f64> {
            (0..n)
                .map(|j| ((j * 37 + s) % 23) as f64 / 7.0 - 1.5)
                .collect()
        };
        vec![
            (
                "x".into(),
                hzp_ir::Tensor::from_f64(hzp_ir::DType::F32, vec![4, 4], &v(16, 1)),
            ),
            (
                "r".into(),
                hzp_ir::Tensor::from_f64(hzp_ir::DType::F32, vec![4, 3], &v(12, 5)),
            ),
        ]
    }

    fn ops(p: &Program) -> Vec<&'static str> {
        p.nodes.iter().map(|n| n.op.name()).collect()
    }

    #[test]
    fn a_gathered_block_is_routed_and_computes_the_same() {
        let p = block("Silu", "", "o");
        let mut f = p.clone();
        assert_eq!(fuse_moe(&mut f).unwrap(), 1);
        hzp_ir::verify(&f).unwrap();
        let names = ops(&f);
        assert!(
            names.contains(&"MoeDispatch") && names.contains(&"MoeCombine"),
            "{names:?}"
        );
        assert!(!names.contains(&"Gather"), "{names:?}");
        let (a, b) = (eval(&p), eval(&f));
        assert_eq!(a.len(), 16);
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() <= 1e-5, "{a:?} vs {b:?}");
        }
    }

    fn eval(p: &Program) -> Vec<f64> {
        let out = hzp_kernels::eval::evaluate(p, &inputs()).unwrap();
        out[0].1.to_f64_vec()
    }

    /// Near matches stay as written: an activation that is not finite at zero (the routed
    /// buffers' empty rows), a per-choice value read outside the block, choices that are
    /// not a top-k.
    #[test]
    fn near_matches_stay_as_written() {
        let cases = [
            block("Log", "", "o"),
            block("Silu", "", "h").clone(),
            block(
                "Silu",
                "%z = Add(%o, %o) : f32[4,4] \"z\"\noutput %h\n",
                "z",
            ),
        ];
        for (i, p) in cases.into_iter().enumerate() {
            let mut f = p.clone();
            assert_eq!(fuse_moe(&mut f).unwrap(), 0, "case {i}");
            assert!(f == p, "case {i}: the program changed");
        }
        // choices from an ArgMax-like source: a reshape of something that is not a TopK
        let text = hzp_ir::text::print(&block("Silu", "", "o"));
        assert!(text.contains("%ix = Reshape{shape=[8]}(%ti)"), "{text}");
        let text = text.replace(
            "%ix = Reshape{shape=[8]}(%ti)",
            "%tj = Identity(%ti) : i64[4,2] \"tj\"\n%ix = Reshape{shape=[8]}(%tj)",
        );
        let p = parse(&text, "m.hzp", &|_| None).unwrap();
        assert_eq!(fuse_moe(&mut p.clone()).unwrap(), 0);
    }
}
