//! The program verifier: SSA, topological order (hence acyclicity), names, and types.
//! Runs after import and between passes; every error names the node or value.

use crate::program::{Node, NodeId, Program, ValueDef, ValueId};
use std::collections::HashSet;
use std::fmt;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VerifyError {
    /// The node (its user-given name) or value the problem is about.
    pub location: String,
    pub message: String,
}

impl fmt::Display for VerifyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.location, self.message)
    }
}

impl std::error::Error for VerifyError {}

fn err(location: impl Into<String>, message: impl Into<String>) -> VerifyError {
    VerifyError {
        location: location.into(),
        message: message.into(),
    }
}

/// Checks the program; returns the first problem found.
pub fn verify(p: &Program) -> Result<(), VerifyError> {
    check_names(p)?;
    check_specialized(p)?;
    let mut defs = Definitions {
        p,
        defined: vec![false; p.values.len()],
    };
    defs.declarations()?;
    defs.nodes()?;
    defs.all_defined()?;
    check_outputs(p)?;
    check_updates(p)
}

fn in_range(p: &Program, v: ValueId) -> bool {
    v.index() < p.values.len()
}

/// Names: non-empty and unique.
fn check_names(p: &Program) -> Result<(), VerifyError> {
    let mut names: foldhash::HashSet<&str> =
        foldhash::HashSet::with_capacity_and_hasher(p.values.len(), Default::default());
    for v in &p.values {
        if v.name.is_empty() {
            return Err(err("value", "has an empty name"));
        }
        if !names.insert(v.name.as_str()) {
            return Err(err(format!("value `{}`", v.name), "name is defined twice"));
        }
    }
    Ok(())
}

/// Specialized values belong to inputs of their type.
fn check_specialized(p: &Program) -> Result<(), VerifyError> {
    for (name, t) in &p.specialized {
        let is_input = p.inputs.iter().any(|&v| {
            in_range(p, v) && p.values[v.index()].name == *name && p.values[v.index()].ty == t.ty()
        });
        if !is_input {
            return Err(err(
                format!("specialized value of `{name}`"),
                format!("is not the value of an input of type {}", t.ty()),
            ));
        }
    }
    Ok(())
}

/// Which values have been defined so far: every value is defined exactly once, by what
/// its `def` says.
struct Definitions<'a> {
    p: &'a Program,
    defined: Vec<bool>,
}

impl Definitions<'_> {
    /// Defines `v`; `what` names the definer, made only for an error (a node's location is
    /// formatted on failure alone).
    fn define(&mut self, v: ValueId, what: impl FnOnce() -> String) -> Result<(), VerifyError> {
        if !in_range(self.p, v) {
            return Err(err(what(), format!("refers to missing value {v}")));
        }
        if std::mem::replace(&mut self.defined[v.index()], true) {
            return Err(err(
                format!("value `{}`", self.p.values[v.index()].name),
                "is defined twice (not SSA)",
            ));
        }
        Ok(())
    }

    /// Inputs, parameters, constants and states, in that order.
    fn declarations(&mut self) -> Result<(), VerifyError> {
        self.inputs()?;
        self.params()?;
        self.consts()?;
        self.states()
    }

    fn inputs(&mut self) -> Result<(), VerifyError> {
        let p = self.p;
        for &v in &p.inputs {
            self.define(v, || "input list".into())?;
            if p.values[v.index()].def != ValueDef::Input {
                return Err(err(
                    format!("input `{}`", p.value(v).name),
                    "is not marked as an input",
                ));
            }
        }
        Ok(())
    }

    fn params(&mut self) -> Result<(), VerifyError> {
        let p = self.p;
        for prm in &p.params {
            self.define(prm.value, || "parameter list".into())?;
            let val = p.value(prm.value);
            if val.def != ValueDef::Param {
                return Err(err(
                    format!("parameter `{}`", val.name),
                    "is not marked as a parameter",
                ));
            }
            if let Some(d) = &prm.data {
                if d.ty() != val.ty {
                    return Err(err(
                        format!("parameter `{}`", val.name),
                        format!("data is {} but the value is {}", d.ty(), val.ty),
                    ));
                }
            }
        }
        Ok(())
    }

    fn consts(&mut self) -> Result<(), VerifyError> {
        let p = self.p;
        for c in &p.consts {
            self.define(c.value, || "constant list".into())?;
            let val = p.value(c.value);
            if val.def != ValueDef::Const {
                return Err(err(
                    format!("constant `{}`", val.name),
                    "is not marked as a constant",
                ));
            }
            if c.data.ty() != val.ty {
                return Err(err(
                    format!("constant `{}`", val.name),
                    format!("data is {} but the value is {}", c.data.ty(), val.ty),
                ));
            }
        }
        Ok(())
    }

    fn states(&mut self) -> Result<(), VerifyError> {
        let p = self.p;
        for st in &p.states {
            self.define(st.value, || "state list".into())?;
            let val = p.value(st.value);
            if val.def != ValueDef::State {
                return Err(err(
                    format!("state `{}`", val.name),
                    "is not marked as a state",
                ));
            }
            if let Some(d) = &st.init {
                if d.ty() != val.ty {
                    return Err(err(
                        format!("state `{}`", val.name),
                        format!("initial data is {} but the value is {}", d.ty(), val.ty),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Nodes in order: inputs defined before use (this also rules out cycles), outputs
    /// defined here, types as the op's rule says.
    fn nodes(&mut self) -> Result<(), VerifyError> {
        let p = self.p;
        for (i, n) in p.nodes.iter().enumerate() {
            let loc = || format!("node `{}` ({})", n.name, n.op.name());
            for &v in &n.inputs {
                if !in_range(p, v) {
                    return Err(err(loc(), format!("reads missing value {v}")));
                }
                if !self.defined[v.index()] {
                    return Err(err(
                        loc(),
                        format!(
                            "reads `{}` before it is defined (nodes out of order or a cycle)",
                            p.value(v).name
                        ),
                    ));
                }
            }
            for (slot, &o) in n.outputs.iter().enumerate() {
                self.define(o, loc)?;
                let want = ValueDef::Node {
                    node: NodeId(i as u32),
                    slot: slot as u32,
                };
                if p.value(o).def != want {
                    return Err(err(
                        loc(),
                        format!(
                            "output `{}` does not point back at this node",
                            p.value(o).name
                        ),
                    ));
                }
            }
            check_node_types(p, n, &loc)?;
        }
        Ok(())
    }

    fn all_defined(&self) -> Result<(), VerifyError> {
        if let Some((i, _)) = self.defined.iter().enumerate().find(|(_, d)| !**d) {
            return Err(err(
                format!("value `{}`", self.p.values[i].name),
                "is never defined",
            ));
        }
        Ok(())
    }
}

/// The node's output types are what its op's rule makes of its input types (`loc` names the
/// node, formatted only for an error).
fn check_node_types(p: &Program, n: &Node, loc: &dyn Fn() -> String) -> Result<(), VerifyError> {
    let tys: Vec<_> = n.inputs.iter().map(|&v| p.ty(v)).collect();
    let out =
        n.op.infer(&tys, p.mesh.as_ref())
            .map_err(|e| err(loc(), e))?;
    if out.len() != n.outputs.len() {
        return Err(err(
            loc(),
            format!(
                "has {} outputs, the op makes {}",
                n.outputs.len(),
                out.len()
            ),
        ));
    }
    for (t, &o) in out.iter().zip(&n.outputs) {
        if *t != p.value(o).ty {
            return Err(err(
                loc(),
                format!(
                    "output `{}` is declared {} but the op makes {}",
                    p.value(o).name,
                    p.value(o).ty,
                    t
                ),
            ));
        }
    }
    Ok(())
}

fn check_outputs(p: &Program) -> Result<(), VerifyError> {
    for &o in &p.outputs {
        if !in_range(p, o) {
            return Err(err("output list", format!("refers to missing value {o}")));
        }
    }
    Ok(())
}

/// Updates: of parameters and states only, each at most once, with a value of the
/// target's type.
fn check_updates(p: &Program) -> Result<(), VerifyError> {
    let mut updated = HashSet::new();
    for u in &p.updates {
        if !in_range(p, u.target) || !in_range(p, u.value) {
            return Err(err("update list", "refers to a missing value"));
        }
        let t = p.value(u.target);
        if !matches!(t.def, ValueDef::Param | ValueDef::State) {
            return Err(err(
                format!("update of `{}`", t.name),
                "only parameters and states can be updated",
            ));
        }
        if !updated.insert(u.target) {
            return Err(err(format!("update of `{}`", t.name), "is updated twice"));
        }
        if p.value(u.value).ty != t.ty {
            return Err(err(
                format!("update of `{}`", t.name),
                format!(
                    "new value `{}` is {} but the target is {}",
                    p.value(u.value).name,
                    p.value(u.value).ty,
                    t.ty
                ),
            ));
        }
    }
    Ok(())
}
