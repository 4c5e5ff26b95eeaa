//! Builders for small ONNX models in tests (encoded with hzp's own prost messages).
#![allow(dead_code)]

use hzp_frontends::onnx::proto::*;
use hzp_frontends::onnx::{encode_tensor, import_bytes, ImportError, ImportOptions};
use hzp_ir::{Program, Tensor};
use prost::Message;

pub const FLOAT: i32 = 1;
pub const INT64: i32 = 7;
pub const BOOL: i32 = 9;

/// A dim: fixed or symbolic.
pub enum D {
    V(i64),
    P(&'static str),
}

pub fn vi(name: &str, elem: i32, dims: &[D]) -> ValueInfoProto {
    let dim = dims
        .iter()
        .map(|d| tensor_shape_proto::Dimension {
            denotation: String::new(),
            value: Some(match d {
                D::V(v) => tensor_shape_proto::dimension::Value::DimValue(*v),
                D::P(p) => tensor_shape_proto::dimension::Value::DimParam(p.to_string()),
            }),
        })
        .collect();
    ValueInfoProto {
        name: name.into(),
        r#type: Some(TypeProto {
            denotation: String::new(),
            value: Some(type_proto::Value::TensorType(type_proto::Tensor {
                elem_type: elem,
                shape: Some(TensorShapeProto { dim }),
            })),
        }),
        doc_string: String::new(),
    }
}

/// A value info without type (outputs: hzp infers them).
pub fn out(name: &str) -> ValueInfoProto {
    ValueInfoProto {
        name: name.into(),
        ..Default::default()
    }
}

pub fn node(
    op: &str,
    name: &str,
    ins: &[&str],
    outs: &[&str],
    attrs: Vec<AttributeProto>,
) -> NodeProto {
    NodeProto {
        input: ins.iter().map(|s| s.to_string()).collect(),
        output: outs.iter().map(|s| s.to_string()).collect(),
        name: name.into(),
        op_type: op.into(),
        attribute: attrs,
        ..Default::default()
    }
}

pub fn a_i(name: &str, v: i64) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        r#type: attribute_type::INT,
        i: Some(v),
        ..Default::default()
    }
}
pub fn a_f(name: &str, v: f32) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        r#type: attribute_type::FLOAT,
        f: Some(v),
        ..Default::default()
    }
}
pub fn a_ints(name: &str, v: &[i64]) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        r#type: attribute_type::INTS,
        ints: v.to_vec(),
        ..Default::default()
    }
}
pub fn a_s(name: &str, v: &str) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        r#type: attribute_type::STRING,
        s: Some(v.as_bytes().to_vec()),
        ..Default::default()
    }
}
pub fn a_t(name: &str, t: TensorProto) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        r#type: attribute_type::TENSOR,
        t: Some(t),
        ..Default::default()
    }
}

pub fn init(name: &str, t: &Tensor) -> TensorProto {
    encode_tensor(name, t)
}

pub struct M {
    pub opset: i64,
    pub nodes: Vec<NodeProto>,
    pub inputs: Vec<ValueInfoProto>,
    pub outputs: Vec<ValueInfoProto>,
    pub inits: Vec<TensorProto>,
}

impl M {
    pub fn new() -> M {
        M {
            opset: 18,
            nodes: vec![],
            inputs: vec![],
            outputs: vec![],
            inits: vec![],
        }
    }
    pub fn proto(&self) -> ModelProto {
        ModelProto {
            ir_version: 8,
            opset_import: vec![OperatorSetIdProto {
                domain: String::new(),
                version: self.opset,
            }],
            producer_name: "hzp-tests".into(),
            graph: Some(GraphProto {
                node: self.nodes.clone(),
                name: "g".into(),
                initializer: self.inits.clone(),
                input: self.inputs.clone(),
                output: self.outputs.clone(),
                ..Default::default()
            }),
            ..Default::default()
        }
    }
    pub fn bytes(&self) -> Vec<u8> {
        self.proto().encode_to_vec()
    }
    pub fn import(&self, shapes: &[(&str, &[usize])]) -> Result<Program, ImportError> {
        import_bytes(&self.bytes(), None, "test.onnx", &opts(shapes))
    }
}

pub fn opts(shapes: &[(&str, &[usize])]) -> ImportOptions {
    let mut o = ImportOptions::default();
    for (n, s) in shapes {
        o.shapes.insert(n.to_string(), s.to_vec());
    }
    o
}

/// Runs a program on named inputs with hzp's CPU evaluator; outputs by name.
pub fn run(p: &Program, inputs: &[(&str, Tensor)]) -> Vec<(String, Tensor)> {
    let ins: Vec<(String, Tensor)> = inputs
        .iter()
        .map(|(n, t)| (n.to_string(), t.clone()))
        .collect();
    hzp_kernels::eval::evaluate(p, &ins).unwrap_or_else(|e| panic!("evaluation failed: {e}"))
}
