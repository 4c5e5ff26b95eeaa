//! Tensor data: the contents of parameters, constants, inputs and outputs.

use crate::dtype::{numel, DType, Shape, TensorType};
use half::{bf16, f16};
use serde::{Deserialize, Serialize};

/// Typed element storage. bf16 and f16 are stored as such and computed in f32 by kernels.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Data {
    F32(Vec<f32>),
    BF16(Vec<bf16>),
    F16(Vec<f16>),
    I64(Vec<i64>),
    I32(Vec<i32>),
    Bool(Vec<bool>),
}

impl Data {
    pub fn dtype(&self) -> DType {
        match self {
            Data::F32(_) => DType::F32,
            Data::BF16(_) => DType::BF16,
            Data::F16(_) => DType::F16,
            Data::I64(_) => DType::I64,
            Data::I32(_) => DType::I32,
            Data::Bool(_) => DType::Bool,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Data::F32(v) => v.len(),
            Data::BF16(v) => v.len(),
            Data::F16(v) => v.len(),
            Data::I64(v) => v.len(),
            Data::I32(v) => v.len(),
            Data::Bool(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Zero-filled storage of `n` elements.
    pub fn zeros(dtype: DType, n: usize) -> Data {
        match dtype {
            DType::F32 => Data::F32(vec![0.0; n]),
            DType::BF16 => Data::BF16(vec![bf16::ZERO; n]),
            DType::F16 => Data::F16(vec![f16::ZERO; n]),
            DType::I64 => Data::I64(vec![0; n]),
            DType::I32 => Data::I32(vec![0; n]),
            DType::Bool => Data::Bool(vec![false; n]),
        }
    }
}

/// A dense, row-major tensor with a static shape.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Tensor {
    pub shape: Shape,
    pub data: Data,
}

impl Tensor {
    /// Builds a tensor; panics if the element count does not match the shape
    /// (a programming error, never user input: frontends check sizes first).
    pub fn new(shape: impl Into<Shape>, data: Data) -> Tensor {
        let shape = shape.into();
        assert_eq!(
            numel(&shape),
            data.len(),
            "tensor data length does not match shape {shape:?}"
        );
        Tensor { shape, data }
    }

    pub fn zeros(ty: &TensorType) -> Tensor {
        Tensor {
            shape: ty.shape.clone(),
            data: Data::zeros(ty.dtype, ty.numel()),
        }
    }

    pub fn f32(shape: impl Into<Shape>, v: Vec<f32>) -> Tensor {
        Tensor::new(shape, Data::F32(v))
    }

    pub fn i64(shape: impl Into<Shape>, v: Vec<i64>) -> Tensor {
        Tensor::new(shape, Data::I64(v))
    }

    pub fn scalar_f32(v: f32) -> Tensor {
        Tensor::new(vec![], Data::F32(vec![v]))
    }

    pub fn scalar_i64(v: i64) -> Tensor {
        Tensor::new(vec![], Data::I64(vec![v]))
    }

    pub fn dtype(&self) -> DType {
        self.data.dtype()
    }

    pub fn ty(&self) -> TensorType {
        TensorType::new(self.dtype(), self.shape.clone())
    }

    pub fn numel(&self) -> usize {
        self.data.len()
    }

    pub fn size_bytes(&self) -> usize {
        self.numel() * self.dtype().size_bytes()
    }

    /// Elements converted to f64 (any dtype), for comparisons, printing and folding.
    pub fn to_f64_vec(&self) -> Vec<f64> {
        match &self.data {
            Data::F32(v) => v.iter().map(|&x| x as f64).collect(),
            Data::BF16(v) => v.iter().map(|&x| x.to_f64()).collect(),
            Data::F16(v) => v.iter().map(|&x| x.to_f64()).collect(),
            Data::I64(v) => v.iter().map(|&x| x as f64).collect(),
            Data::I32(v) => v.iter().map(|&x| x as f64).collect(),
            Data::Bool(v) => v.iter().map(|&x| if x { 1.0 } else { 0.0 }).collect(),
        }
    }

    /// Elements converted to f32 (any dtype).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        match &self.data {
            Data::F32(v) => v.clone(),
            Data::BF16(v) => v.iter().map(|&x| x.to_f32()).collect(),
            Data::F16(v) => v.iter().map(|&x| x.to_f32()).collect(),
            _ => self.to_f64_vec().into_iter().map(|x| x as f32).collect(),
        }
    }

    /// Integer elements as i64 (ints and bools); `None` for float tensors.
    pub fn to_i64_vec(&self) -> Option<Vec<i64>> {
        match &self.data {
            Data::I64(v) => Some(v.clone()),
            Data::I32(v) => Some(v.iter().map(|&x| x as i64).collect()),
            Data::Bool(v) => Some(v.iter().map(|&x| x as i64).collect()),
            _ => None,
        }
    }

    /// Builds a tensor of `dtype` from f64 values (rounding/truncating as a cast does).
    pub fn from_f64(dtype: DType, shape: impl Into<Shape>, v: &[f64]) -> Tensor {
        let data = match dtype {
            DType::F32 => Data::F32(v.iter().map(|&x| x as f32).collect()),
            DType::BF16 => Data::BF16(v.iter().map(|&x| bf16::from_f64(x)).collect()),
            DType::F16 => Data::F16(v.iter().map(|&x| f16::from_f64(x)).collect()),
            DType::I64 => Data::I64(v.iter().map(|&x| x as i64).collect()),
            DType::I32 => Data::I32(v.iter().map(|&x| x as i32).collect()),
            DType::Bool => Data::Bool(v.iter().map(|&x| x != 0.0).collect()),
        };
        Tensor::new(shape, data)
    }

    /// The same data with another shape of equal element count.
    pub fn reshaped(mut self, shape: impl Into<Shape>) -> Tensor {
        let shape = shape.into();
        assert_eq!(numel(&shape), self.numel());
        self.shape = shape;
        self
    }
}

/// A float as the text form writes it: `nan`, `inf`, `-inf`, else the shortest form that
/// reads back to the same f32.
fn write_f32(out: &mut String, x: f32) {
    use std::fmt::Write as _;
    if x.is_nan() {
        out.push_str("nan");
    } else if x.is_infinite() {
        out.push_str(if x > 0.0 { "inf" } else { "-inf" });
    } else {
        let _ = write!(out, "{x:?}");
    }
}

/// A tensor's values as the text form writes a literal (`[1, 2, 3]`), for messages.
pub(crate) fn literal_string(t: &Tensor) -> String {
    let mut s = String::new();
    write_literal(&mut s, t);
    s
}

/// Appends `t`'s literal (`[1, 2, 3]`) to `out`.
pub(crate) fn write_literal(out: &mut String, t: &Tensor) {
    use std::fmt::Write as _;
    out.push('[');
    let sep = |out: &mut String, i: usize| {
        if i > 0 {
            out.push_str(", ");
        }
    };
    match &t.data {
        Data::F32(v) => v.iter().enumerate().for_each(|(i, x)| {
            sep(out, i);
            write_f32(out, *x);
        }),
        Data::BF16(v) => v.iter().enumerate().for_each(|(i, x)| {
            sep(out, i);
            write_f32(out, x.to_f32());
        }),
        Data::F16(v) => v.iter().enumerate().for_each(|(i, x)| {
            sep(out, i);
            write_f32(out, x.to_f32());
        }),
        Data::I64(v) => v.iter().enumerate().for_each(|(i, x)| {
            sep(out, i);
            let _ = write!(out, "{x}");
        }),
        Data::I32(v) => v.iter().enumerate().for_each(|(i, x)| {
            sep(out, i);
            let _ = write!(out, "{x}");
        }),
        Data::Bool(v) => v.iter().enumerate().for_each(|(i, x)| {
            sep(out, i);
            out.push_str(if *x { "true" } else { "false" });
        }),
    }
    out.push(']');
}
