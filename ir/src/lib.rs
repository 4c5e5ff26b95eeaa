//! hzp's intermediate representation.
//!
//! A [`Program`] is an arena of [`Value`]s and [`Node`]s addressed by typed ids
//! ([`ValueId`], [`NodeId`]), nodes kept in topological order. Values have a dtype and a
//! static shape. Parameters (trainable) are kept apart from constants. The op set covers
//! compute (forward, backward and optimizer ops), collectives on groups of a hierarchical
//! [`Mesh`], memory ops and stream events.
//!
//! The text form ([`text`]) prints deterministically and parses back to the same program.

pub mod dtype;
pub mod layout;
pub mod mesh;
pub mod op;
pub mod plan;
pub mod program;
pub mod role;
pub mod tensor;
pub mod trace;
pub mod verify;
pub mod views;

pub use dtype::{numel, DType, Shape, TensorType};
pub use layout::ParamLayout;
pub use mesh::{Group, Mesh, MeshAxis};
pub use op::{attention_dims, broadcast_shapes, Attr, BinaryOp, Op, ReduceOp, StreamKind, UnaryOp};
pub use plan::{
    content_hash_of, format_bytes, Buffer, BufferKind, ModelEdits, Plan, PlanError, ShardGroups,
    PLAN_VERSION,
};
pub use program::{
    Const, FreshNames, NameSet, Node, NodeId, Param, Precision, Program, State, Update, Value,
    ValueDef, ValueId,
};
pub use role::{Role, RoleKind};
pub use tensor::{Data, Tensor};
pub use verify::{verify, VerifyError};
pub mod text;
