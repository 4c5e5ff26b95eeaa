//! The CUDA kernel sources (compiled at run time by NVRTC) and what they define.

/// Common definitions (types, bf16/f16 conversions, the n-d walk, block reductions).
pub const COMMON: &str = include_str!("kernels/common.cuh");
/// Unary, Binary, Where, Cast, Fill, the fused AdamW step.
pub const ELEMENTWISE: &str = include_str!("kernels/elementwise.cu");
/// Softmax, softmax cross-entropy, LayerNorm/RmsNorm and their gradients, Reduce, ArgMax,
/// CumSum.
pub const REDUCE: &str = include_str!("kernels/reduce.cu");
/// Copies through n-d walks, Trilu, Gather*, Scatter*, OneHot, TopK.
pub const MOVEMENT: &str = include_str!("kernels/movement.cu");
/// Fused attention: the forward (`attn_fwd`) and the gradient's two kernels (`attn_dq`,
/// `attn_dkv`), tiled with an online softmax; PASA's fp16 forward (`attn_fwd_pasa_f16`).
pub const ATTENTION: &str = include_str!("kernels/attention.cu");
/// Mixture of experts: MoeDispatch's slots and copy (`moe_slots`, `moe_zero_*`,
/// `moe_dispatch_*`), MoeCombine and MoeCombineGrad (`moe_combine*`).
pub const MOE: &str = include_str!("kernels/moe.cu");
/// The local device communicator's reductions (`coll_acc_*`, `coll_scale_*`).
pub const COLLECTIVE: &str = include_str!("kernels/collective.cu");

/// The whole program NVRTC compiles, in dependency order.
pub fn source() -> String {
    [
        COMMON,
        ELEMENTWISE,
        REDUCE,
        MOVEMENT,
        ATTENTION,
        MOE,
        COLLECTIVE,
    ]
    .join("\n")
}

/// Threads per block of the attention kernels (`AT_WARPS` warps in the source).
pub const ATTENTION_THREADS: u32 = 128;
/// Query rows per block of `attn_fwd` / `attn_dq` and keys per block of `attn_dkv`
/// (`AT_BR`, `AT_BK`).
pub const ATTENTION_ROWS: usize = 16;
pub const ATTENTION_KEYS: usize = 8;
/// The largest head size the attention kernels take (`AT_DMAX`).
pub const ATTENTION_MAX_HEAD: usize = 256;

/// Threads per block of the one-block-per-lane kernels (softmax, norm, float reduce); the
/// kernels' shared arrays have this size.
pub const REDUCE_THREADS: u32 = 256;

/// The largest rank the n-d walks take (`MAXD` in the sources).
pub const MAXD: usize = 8;

/// Every kernel the sources define (their `extern "C"` names), as the instantiation macros
/// spell them: `<family>_<dtype>` (`f32`, `bf16`, `f16`, `i64`, `i32`, `b8`),
/// `cast_<from>_<to>`, and `<family>_<element size>` (`b1`, `b2`, `b4`, `b8`) for movement.
pub fn kernel_names() -> Vec<String> {
    const FLOATS: [&str; 3] = ["f32", "bf16", "f16"];
    const INTS: [&str; 2] = ["i64", "i32"];
    const ALL: [&str; 6] = ["f32", "bf16", "f16", "i64", "i32", "b8"];
    let mut v = Vec::new();
    let mut add = |fams: &[&str], types: &[&str]| {
        for f in fams {
            for t in types {
                v.push(format!("{f}_{t}"));
            }
        }
    };
    add(
        &[
            "unary",
            "isnan",
            "gelu_tanh_grad",
            "binary",
            "compare",
            "softmax",
            "xent",
            "norm",
            "norm_grad",
            "reduce",
            "argmax",
            "cumsum",
            "attn_fwd",
            "attn_dq",
            "attn_dkv",
        ],
        &FLOATS,
    );
    add(
        &["unary", "binary", "compare", "reduce", "argmax", "cumsum"],
        &INTS,
    );
    add(&["unary", "binary", "compare", "reduce", "argmax"], &["b8"]);
    add(
        &[
            "where",
            "fill",
            "scatter_elements",
            "scatter_nd",
            "one_hot",
            "topk",
        ],
        &ALL,
    );
    add(
        &["copy_nd", "trilu", "gather", "gather_elements", "gather_nd"],
        &["b1", "b2", "b4", "b8"],
    );
    add(
        &[
            "moe_combine",
            "moe_combine_grad_rows",
            "moe_combine_grad_weights",
        ],
        &FLOATS,
    );
    add(&["moe_dispatch", "moe_zero"], &["b2", "b4"]);
    for s in ALL {
        for d in ALL {
            v.push(format!("cast_{s}_{d}"));
        }
    }
    v.push("moe_slots".into());
    v.push("adamw_f32".into());
    v.push("adamw_multi_f32".into());
    // PASA's fp16 forward exists for f16 only
    v.push("attn_fwd_pasa_f16".into());
    // the local device communicator's reductions (see `transport`)
    v.extend(super::local_kernel_names());
    v
}
