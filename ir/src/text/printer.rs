//! The printer: one statement per line, deterministic.

use super::const_is_inline;
use super::lexer::{is_word_char, is_word_start};
use crate::dtype::TensorType;
use crate::op::{Attr, Op, StreamKind};
use crate::program::{Program, ValueDef, ValueId};
use crate::tensor::{write_literal, Tensor};
use std::collections::HashMap;
use std::fmt::Write;

/// Prints a program in the text form (see the [module docs](super)). Never panics, even on a
/// program that does not verify (dangling ids print as `%"<missing vN>"`).
pub fn print(p: &Program) -> String {
    let mut out = String::with_capacity(64 + 96 * (p.nodes.len() + p.values.len()));
    out.push_str("program ");
    write_quoted(&mut out, &p.name);
    out.push('\n');
    if let Some(mesh) = &p.mesh {
        out.push_str("mesh");
        for (i, a) in mesh.axes.iter().enumerate() {
            out.push_str(if i == 0 { " " } else { "," });
            write_word(&mut out, &a.name);
            let _ = write!(out, "={}", a.size);
        }
        out.push('\n');
    }
    if let Some(pr) = &p.precision {
        let _ = writeln!(
            out,
            "precision compute={}, master={}, reduce={}",
            pr.compute, pr.master, pr.reduce
        );
    }
    out.push('\n');

    let mut consts: HashMap<ValueId, &Tensor> =
        p.consts.iter().map(|c| (c.value, &c.data)).collect();
    for st in &p.states {
        if let Some(t) = &st.init {
            consts.insert(st.value, t);
        }
    }
    let layout = layout(p);
    let mut defined: Vec<ValueId> = Vec::with_capacity(p.values.len());
    for item in &layout {
        match *item {
            Item::Decl(v) => {
                defined.push(v);
                write_decl(&mut out, p, v, consts.get(&v).copied());
            }
            Item::Node(n) => {
                defined.extend(p.nodes[n].outputs.iter().copied());
                write_node(&mut out, p, n);
            }
        }
    }

    if !p.outputs.is_empty() {
        out.push_str("\noutput ");
        write_ref_list(&mut out, p, &p.outputs);
        out.push('\n');
    }
    for u in &p.updates {
        out.push_str("update ");
        write_ref_list(&mut out, p, &[u.target]);
        out.push_str(" = ");
        write_ref_list(&mut out, p, &[u.value]);
        out.push('\n');
    }
    let canonical =
        defined.len() == p.values.len() && defined.iter().enumerate().all(|(i, v)| v.index() == i);
    if !canonical {
        let all: Vec<ValueId> = (0..p.values.len() as u32).map(ValueId).collect();
        out.push_str("order ");
        write_ref_list(&mut out, p, &all);
        out.push('\n');
    }
    out
}

#[derive(Clone, Copy)]
enum Item {
    Decl(ValueId),
    Node(usize),
}

fn is_decl(def: ValueDef) -> bool {
    matches!(
        def,
        ValueDef::Input | ValueDef::Param | ValueDef::Const | ValueDef::State
    )
}

/// The order of statements: declarations interleaved at their arena positions when that keeps
/// every declaration before its first use and each declaration list in order; otherwise all
/// declarations first (inputs, parameters, constants, each in list order), then the nodes.
fn layout(p: &Program) -> Vec<Item> {
    if let Some(items) = interleaved(p) {
        return items;
    }
    let mut items: Vec<Item> = Vec::with_capacity(p.values.len() + p.nodes.len());
    items.extend(p.inputs.iter().map(|&v| Item::Decl(v)));
    items.extend(p.params.iter().map(|prm| Item::Decl(prm.value)));
    items.extend(p.consts.iter().map(|c| Item::Decl(c.value)));
    items.extend(p.states.iter().map(|s| Item::Decl(s.value)));
    items.extend((0..p.nodes.len()).map(Item::Node));
    items
}

fn interleaved(p: &Program) -> Option<Vec<Item>> {
    let ascending = |ids: &[ValueId]| ids.windows(2).all(|w| w[0] < w[1]);
    let params: Vec<ValueId> = p.params.iter().map(|x| x.value).collect();
    let consts: Vec<ValueId> = p.consts.iter().map(|x| x.value).collect();
    let states: Vec<ValueId> = p.states.iter().map(|x| x.value).collect();
    if !ascending(&p.inputs) || !ascending(&params) || !ascending(&consts) || !ascending(&states) {
        return None;
    }
    // Each declaration list must be exactly the values of its kind, else fall back.
    let count = |want: ValueDef| p.values.iter().filter(|v| v.def == want).count();
    if count(ValueDef::Input) != p.inputs.len()
        || count(ValueDef::Param) != p.params.len()
        || count(ValueDef::Const) != p.consts.len()
        || count(ValueDef::State) != p.states.len()
    {
        return None;
    }
    let in_lists = p
        .inputs
        .iter()
        .chain(p.params.iter().map(|x| &x.value))
        .chain(p.consts.iter().map(|x| &x.value))
        .chain(p.states.iter().map(|x| &x.value))
        .all(|v| p.values.get(v.index()).is_some_and(|val| is_decl(val.def)));
    if !in_lists {
        return None;
    }

    let decls: Vec<ValueId> = p
        .values
        .iter()
        .enumerate()
        .filter(|(_, v)| is_decl(v.def))
        .map(|(i, _)| ValueId(i as u32))
        .collect();
    let mut emitted = vec![false; p.values.len()];
    let mut items = Vec::with_capacity(decls.len() + p.nodes.len());
    let mut next_decl = 0;
    let mut key = 0usize;
    for (n, node) in p.nodes.iter().enumerate() {
        if let Some(min) = node.outputs.iter().map(|v| v.index()).min() {
            key = key.max(min);
        }
        while next_decl < decls.len() && decls[next_decl].index() < key {
            emitted[decls[next_decl].index()] = true;
            items.push(Item::Decl(decls[next_decl]));
            next_decl += 1;
        }
        for v in &node.inputs {
            let is_pending_decl = p
                .values
                .get(v.index())
                .is_some_and(|val| is_decl(val.def) && !emitted[v.index()]);
            if is_pending_decl {
                return None;
            }
        }
        items.push(Item::Node(n));
    }
    items.extend(decls[next_decl..].iter().map(|&v| Item::Decl(v)));
    Some(items)
}

fn write_decl(out: &mut String, p: &Program, v: ValueId, data: Option<&Tensor>) {
    let Some(val) = p.values.get(v.index()) else {
        return;
    };
    let kw = match val.def {
        ValueDef::Input => "input",
        ValueDef::Param => "param",
        ValueDef::State => "state",
        _ => "const",
    };
    out.push_str(kw);
    out.push(' ');
    write_value_ref(out, &val.name);
    let _ = write!(out, " : {}", val.ty);
    if kw == "input" {
        if let Some(t) = p.specialized.get(&val.name) {
            out.push_str(" = ");
            write_literal(out, t);
        }
    }
    if kw == "const" || (kw == "state" && data.is_some()) {
        match data {
            Some(t) if const_is_inline(t) => {
                out.push_str(" = ");
                write_literal(out, t);
            }
            _ => out.push_str(" = @data"),
        }
    }
    out.push('\n');
}

fn write_node(out: &mut String, p: &Program, n: usize) {
    let node = &p.nodes[n];
    if !node.outputs.is_empty() {
        write_ref_list(out, p, &node.outputs);
        out.push_str(" = ");
    }
    out.push_str(node.op.name());
    let attrs = node.op.attrs();
    if !attrs.is_empty() {
        out.push('{');
        let f32_epsilon = matches!(
            node.op,
            Op::LayerNorm { .. }
                | Op::RmsNorm { .. }
                | Op::LayerNormGrad { .. }
                | Op::RmsNormGrad { .. }
        );
        for (i, (k, a)) in attrs.iter().enumerate() {
            if i > 0 {
                out.push_str(", ");
            }
            out.push_str(k);
            out.push('=');
            match a {
                Attr::Float(x) if f32_epsilon && *k == "epsilon" => write_f32_attr(out, *x),
                _ => write_attr(out, a),
            }
        }
        out.push('}');
    }
    out.push('(');
    write_ref_list(out, p, &node.inputs);
    out.push(')');
    if !node.outputs.is_empty() {
        out.push_str(" : ");
        for (i, v) in node.outputs.iter().enumerate() {
            if i > 0 {
                out.push_str(", ");
            }
            match p.values.get(v.index()) {
                Some(val) => write_type(out, &val.ty),
                None => out.push('?'),
            }
        }
    }
    out.push(' ');
    write_quoted(out, &node.name);
    if node.stream != StreamKind::Compute {
        out.push_str(" @");
        out.push_str(node.stream.name());
    }
    if !node.role.is_compute() {
        out.push_str(" role=");
        out.push_str(node.role.kind.name());
        if !node.role.unit.is_empty() {
            out.push('(');
            write_quoted(out, &node.role.unit);
            out.push(')');
        }
    }
    out.push('\n');
}

fn write_type(out: &mut String, t: &TensorType) {
    let _ = write!(out, "{t}");
}

fn write_ref_list(out: &mut String, p: &Program, ids: &[ValueId]) {
    for (i, v) in ids.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        match p.values.get(v.index()) {
            Some(val) => write_value_ref(out, &val.name),
            None => {
                out.push('%');
                write_quoted(out, &format!("<missing {v}>"));
            }
        }
    }
}

pub(crate) fn write_value_ref(out: &mut String, name: &str) {
    out.push('%');
    if super::is_bare_name(name) {
        out.push_str(name);
    } else {
        write_quoted(out, name);
    }
}

/// A word if it lexes as one (and is not a number-like keyword), else a quoted string.
fn write_word(out: &mut String, w: &str) {
    let mut chars = w.chars();
    let wordlike = chars.next().is_some_and(is_word_start) && chars.all(is_word_char);
    if wordlike && !matches!(w, "true" | "false" | "inf" | "nan") {
        out.push_str(w);
    } else {
        write_quoted(out, w);
    }
}

pub(crate) fn write_quoted(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            '\r' => out.push_str("\\r"),
            '\0' => out.push_str("\\0"),
            c if c.is_control() => {
                let _ = write!(out, "\\u{{{:x}}}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

fn write_attr(out: &mut String, a: &Attr) {
    match a {
        Attr::Int(i) => {
            let _ = write!(out, "{i}");
        }
        Attr::Float(x) => write_f64(out, *x),
        Attr::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Attr::Ints(v) => {
            out.push('[');
            for (i, x) in v.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                let _ = write!(out, "{x}");
            }
            out.push(']');
        }
        Attr::Word(w) => write_word(out, w),
        Attr::Group(g) => {
            out.push('[');
            for (i, a) in g.axes.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_word(out, a);
            }
            out.push(']');
        }
    }
}

/// An attribute that the op stores as f32: the shortest f32 form when it reads back to the
/// same f32 (it always should), else the full f64 form.
fn write_f32_attr(out: &mut String, x: f64) {
    let f = x as f32;
    if f as f64 == x && f.is_finite() {
        let s = format!("{f:?}");
        if s.parse::<f64>().is_ok_and(|back| back as f32 == f) {
            out.push_str(&s);
            return;
        }
    }
    write_f64(out, x);
}

fn write_f64(out: &mut String, x: f64) {
    if x.is_nan() {
        out.push_str("nan");
    } else if x.is_infinite() {
        out.push_str(if x > 0.0 { "inf" } else { "-inf" });
    } else {
        // `{:?}` is the shortest form that reads back exactly, and always has `.` or `e`.
        let _ = write!(out, "{x:?}");
    }
}
