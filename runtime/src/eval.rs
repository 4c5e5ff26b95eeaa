//! Program evaluation on the CPU: runs a forward program node by node with [`eval_op`],
//! freeing every intermediate after its last use so memory stays bounded by the live set.

use crate::cpu::eval_op;
use hzp_ir::{Op, Program, Tensor, TensorType, ValueDef, ValueId};
use std::borrow::Cow;
use std::collections::HashMap;
use thiserror::Error;

/// Why a program could not be evaluated. Every variant names what it is about.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum EvalError {
    /// The inputs given do not match the program's inputs by name.
    #[error("inputs do not match the program: {}", describe_names(.missing, .unexpected, .duplicate))]
    InputNames {
        missing: Vec<String>,
        unexpected: Vec<String>,
        duplicate: Vec<String>,
    },
    /// An input has the wrong dtype or shape.
    #[error("input `{name}` is {got}, expected {expected}")]
    InputType {
        name: String,
        expected: TensorType,
        got: TensorType,
    },
    /// A parameter without data (shapes-only programs such as presets).
    #[error("parameter `{name}` has no data (a shapes-only program, e.g. a preset, cannot be evaluated)")]
    ParamWithoutData { name: String },
    /// A parameter or constant whose data does not match its declared type.
    #[error("{kind} `{name}` holds {got} data but is declared {expected}")]
    DataType {
        kind: &'static str,
        name: String,
        expected: TensorType,
        got: TensorType,
    },
    /// A node's kernel failed.
    #[error("node \"{node}\" ({op}): {message}")]
    Node {
        node: String,
        op: &'static str,
        message: String,
    },
    /// The program itself is inconsistent (run the verifier).
    #[error("malformed program: {0}")]
    Malformed(String),
}

fn describe_names(missing: &[String], unexpected: &[String], duplicate: &[String]) -> String {
    let list = |v: &[String]| {
        v.iter()
            .map(|n| format!("`{n}`"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut parts = Vec::new();
    if !missing.is_empty() {
        parts.push(format!("missing {}", list(missing)));
    }
    if !unexpected.is_empty() {
        parts.push(format!("unexpected {}", list(unexpected)));
    }
    if !duplicate.is_empty() {
        parts.push(format!("given twice {}", list(duplicate)));
    }
    parts.join("; ")
}

/// Checks that a tensor's element count matches its own shape (fields are public).
fn consistent(t: &Tensor) -> bool {
    crate::cpu::layout::checked_numel(&t.shape) == Some(t.data.len())
}

/// Runs the forward program `p` on named `inputs`; returns the program outputs in
/// `p.outputs` order, keyed by value name.
///
/// Parameters come from [`hzp_ir::Param::data`], constants from the program. Nodes run in
/// order; each intermediate is dropped right after its last reader, so peak memory is the
/// largest live set, not the sum of all activations. Memory and stream ops (`Free`,
/// `RecordEvent`, `WaitEvent`) are no-ops here; collectives are errors.
pub fn evaluate(
    p: &Program,
    inputs: &[(String, Tensor)],
) -> Result<Vec<(String, Tensor)>, EvalError> {
    evaluate_with_stats(p, inputs).map(|(outs, _)| outs)
}

/// Memory statistics of one evaluation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EvalStats {
    /// The most bytes of node results alive at once (inputs, parameters and constants are
    /// borrowed, not counted).
    pub peak_live_bytes: usize,
}

/// [`evaluate`], also reporting how much intermediate memory was alive at the peak.
pub fn evaluate_with_stats(
    p: &Program,
    inputs: &[(String, Tensor)],
) -> Result<(Vec<(String, Tensor)>, EvalStats), EvalError> {
    let nv = p.values.len();
    let in_range = |v: ValueId| {
        if v.index() < nv {
            Ok(v)
        } else {
            Err(EvalError::Malformed(format!(
                "reference to missing value {v}"
            )))
        }
    };
    let mut slots: Vec<Option<Cow<'_, Tensor>>> = vec![None; nv];

    // ---- bind inputs by name
    let by_name: HashMap<&str, ValueId> = p
        .inputs
        .iter()
        .map(|&v| in_range(v).map(|v| (p.value(v).name.as_str(), v)))
        .collect::<Result<_, _>>()?;
    let mut given: HashMap<&str, &Tensor> = HashMap::new();
    let (mut unexpected, mut duplicate) = (Vec::new(), Vec::new());
    for (name, t) in inputs {
        if !by_name.contains_key(name.as_str()) {
            unexpected.push(name.clone());
        } else if given.insert(name.as_str(), t).is_some() {
            duplicate.push(name.clone());
        }
    }
    let missing: Vec<String> = p
        .inputs
        .iter()
        .map(|&v| &p.value(v).name)
        .filter(|n| !given.contains_key(n.as_str()))
        .cloned()
        .collect();
    if !missing.is_empty() || !unexpected.is_empty() || !duplicate.is_empty() {
        return Err(EvalError::InputNames {
            missing,
            unexpected,
            duplicate,
        });
    }
    for &v in &p.inputs {
        let value = p.value(v);
        let t = given[value.name.as_str()];
        if t.ty() != value.ty || !consistent(t) {
            return Err(EvalError::InputType {
                name: value.name.clone(),
                expected: value.ty.clone(),
                got: t.ty(),
            });
        }
        slots[v.index()] = Some(Cow::Borrowed(t));
    }

    // ---- parameters and constants
    for prm in &p.params {
        let v = in_range(prm.value)?;
        let value = p.value(v);
        let t = prm
            .data
            .as_ref()
            .ok_or_else(|| EvalError::ParamWithoutData {
                name: value.name.clone(),
            })?;
        if t.ty() != value.ty || !consistent(t) {
            return Err(EvalError::DataType {
                kind: "parameter",
                name: value.name.clone(),
                expected: value.ty.clone(),
                got: t.ty(),
            });
        }
        slots[v.index()] = Some(Cow::Borrowed(t));
    }
    for c in &p.consts {
        let v = in_range(c.value)?;
        let value = p.value(v);
        if c.data.ty() != value.ty || !consistent(&c.data) {
            return Err(EvalError::DataType {
                kind: "constant",
                name: value.name.clone(),
                expected: value.ty.clone(),
                got: c.data.ty(),
            });
        }
        slots[v.index()] = Some(Cow::Borrowed(&c.data));
    }

    // ---- liveness: the last node reading each value; outputs live to the end
    let mut last_use: Vec<Option<usize>> = vec![None; nv];
    for (i, n) in p.nodes.iter().enumerate() {
        for &v in &n.inputs {
            last_use[in_range(v)?.index()] = Some(i);
        }
    }
    let mut is_output = vec![false; nv];
    for &o in &p.outputs {
        is_output[in_range(o)?.index()] = true;
    }

    // ---- run
    let mut stats = EvalStats::default();
    let mut live_bytes = 0usize;
    for (i, node) in p.nodes.iter().enumerate() {
        if matches!(
            node.op,
            Op::Free | Op::RecordEvent { .. } | Op::WaitEvent { .. }
        ) {
            continue;
        }
        let node_err = |message: String| EvalError::Node {
            node: node.name.clone(),
            op: node.op.name(),
            message,
        };
        let args: Vec<&Tensor> = node
            .inputs
            .iter()
            .map(|&v| {
                slots[v.index()].as_deref().ok_or_else(|| {
                    node_err(format!(
                        "input `{}` has not been computed (nodes out of order?)",
                        p.value(v).name
                    ))
                })
            })
            .collect::<Result<_, _>>()?;
        // a reshape or identity of a dying intermediate reuses its buffer
        let reuse = matches!(node.op, Op::Reshape { .. } | Op::Identity)
            && node.inputs.len() == 1
            && node.outputs.len() == 1
            && last_use[node.inputs[0].index()] == Some(i)
            && !is_output[node.inputs[0].index()]
            && matches!(slots[node.inputs[0].index()], Some(Cow::Owned(_)))
            && args[0].numel() == p.value(in_range(node.outputs[0])?).ty.numel();
        let results = if reuse {
            drop(args);
            let v = node.inputs[0].index();
            let Some(Cow::Owned(mut t)) = slots[v].take() else {
                return Err(node_err("internal: reused input vanished".into()));
            };
            live_bytes -= t.size_bytes();
            t.shape = p.value(node.outputs[0]).ty.shape.clone();
            vec![t]
        } else {
            let r = eval_op(&node.op, &args).map_err(node_err)?;
            drop(args);
            r
        };
        if results.len() != node.outputs.len() {
            return Err(node_err(format!(
                "produced {} outputs, the node declares {}",
                results.len(),
                node.outputs.len()
            )));
        }
        for (&o, t) in node.outputs.iter().zip(results) {
            let value = p.value(in_range(o)?);
            if t.ty() != value.ty {
                return Err(node_err(format!(
                    "computed {} for `{}`, declared {}",
                    t.ty(),
                    value.name,
                    value.ty
                )));
            }
            if !matches!(value.def, ValueDef::Node { .. }) {
                return Err(node_err(format!(
                    "writes `{}`, which is not a node output",
                    value.name
                )));
            }
            // an output nobody reads and the program does not return is dropped at once
            if last_use[o.index()].is_some() || is_output[o.index()] {
                live_bytes += t.size_bytes();
                slots[o.index()] = Some(Cow::Owned(t));
            }
        }
        stats.peak_live_bytes = stats.peak_live_bytes.max(live_bytes);
        // free what this node was the last reader of
        for &v in &node.inputs {
            if last_use[v.index()] == Some(i) && !is_output[v.index()] {
                if let Some(Cow::Owned(t)) = slots[v.index()].take() {
                    live_bytes -= t.size_bytes();
                }
                // borrowed inputs, parameters and constants are only unbound
            }
        }
    }

    // ---- outputs
    let outs = p
        .outputs
        .iter()
        .map(|&o| {
            let value = p.value(o);
            // an output listed twice is cloned for its second occurrence
            let t = slots[o.index()].clone().ok_or_else(|| {
                EvalError::Malformed(format!("output `{}` is never computed", value.name))
            })?;
            Ok((value.name.clone(), t.into_owned()))
        })
        .collect::<Result<Vec<_>, EvalError>>()?;
    Ok((outs, stats))
}

#[cfg(test)]
mod tests {
    use super::*;
    use hzp_ir::{BinaryOp, DType, UnaryOp};

    #[test]
    fn missing_and_extra_inputs_are_listed() {
        let mut p = Program::new("t");
        let x = p.add_input("x", TensorType::new(DType::F32, vec![2]));
        let y = p
            .add_node("neg", Op::Unary(UnaryOp::Neg), vec![x], vec!["y".into()])
            .unwrap();
        p.outputs = y;
        let e = evaluate(&p, &[("z".into(), Tensor::f32(vec![2], vec![1.0, 2.0]))]).unwrap_err();
        let s = e.to_string();
        assert!(
            s.contains("missing `x`") && s.contains("unexpected `z`"),
            "{s}"
        );
        let e = evaluate(
            &p,
            &[("x".into(), Tensor::f32(vec![3], vec![1.0, 2.0, 3.0]))],
        )
        .unwrap_err();
        assert_eq!(e.to_string(), "input `x` is f32[3], expected f32[2]");
        let r = evaluate(&p, &[("x".into(), Tensor::f32(vec![2], vec![1.0, -2.0]))]).unwrap();
        assert_eq!(r[0].0, "y");
        assert_eq!(r[0].1, Tensor::f32(vec![2], vec![-1.0, 2.0]));
    }

    #[test]
    fn kernel_errors_name_the_node() {
        let mut p = Program::new("t");
        let x = p.add_input("x", TensorType::new(DType::I64, vec![2]));
        let z = p.add_const("z", Tensor::i64(vec![2], vec![1, 0]));
        let y = p
            .add_node(
                "/h.0/div",
                Op::Binary(BinaryOp::Div),
                vec![x, z],
                vec!["y".into()],
            )
            .unwrap();
        p.outputs = y;
        let e = evaluate(&p, &[("x".into(), Tensor::i64(vec![2], vec![4, 5]))]).unwrap_err();
        assert!(
            e.to_string().starts_with("node \"/h.0/div\" (Div): "),
            "{e}"
        );
    }
}
