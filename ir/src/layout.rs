//! How a parameter of a sharded (SPMD) program is laid out across ranks: what the runtime
//! needs to cut full parameters into per-rank shards and to put them back together.

use crate::dtype::DType;
use crate::mesh::Group;
use serde::{Deserialize, Serialize};

/// One parameter's layout. The full tensor is flattened, padded with zeros to `padded`
/// elements and cut into equal chunks: a rank's fp32 master shard is chunk
/// `Mesh::group_index(optim_group)` of `size(optim_group)`; its compute shard (the state
/// named `compute_shard`, in `compute_dtype`) is chunk `group_index(params_group)` of
/// `size(params_group)`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParamLayout {
    /// The parameter's name: also the name of the rank's master shard in the program.
    pub name: String,
    pub shape: Vec<usize>,
    pub numel: usize,
    pub padded: usize,
    pub optim_group: Group,
    pub params_group: Group,
    pub compute_shard: String,
    pub compute_dtype: DType,
    /// Set when this parameter's gradient is reduce-scattered per micro-batch over this
    /// group (narrower than the plan's gradient group, inside a node) and accumulated there,
    /// the rest of the gradient group reducing once per step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accumulate_group: Option<Group>,
    /// The optimizer states kept for this parameter (AdamW's moments, SGD's momentum), by
    /// name: each is shaped like the master shard and cut the same way (chunk
    /// `group_index(optim_group)` of the flattened, zero-padded tensor). Checkpoints put
    /// them back together and cut them for another plan with this.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub states: Vec<String>,
    /// Set for an expert weight split by expert parallelism over this group (its axes come
    /// first in both groups above): rank i of the group computes with experts
    /// `i*E/n .. (i+1)*E/n` of the stacked `[E, ...]` weight.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expert_group: Option<Group>,
}
