//! The import driver: checks the model (opsets, supported ops, inputs and their shapes),
//! binds the graph inputs, walks the nodes through the op rules (`ops`) in the translation
//! context (`ctx`), and checks the outputs.

use super::ctx::{size_ok, Ctx, NodeCx, Slot, MAX_OPSET, MIN_OPSET};
use super::error::{graph_err, node_err, FResult, Fail, ImportErrorKind};
use super::graph::{classify_params, node_label, GraphInfo, Signature};
use super::ops;
use super::proto::{
    data_type as dt, tensor_shape_proto::dimension, type_proto, GraphProto, ModelProto,
    ValueInfoProto,
};
use super::tensor::{decode_tensor, dtype_of};
use super::ImportOptions;
use hzp_ir::{numel, DType, NameSet, Op, Program, Tensor, TensorType, ValueId};
use prost::Message;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

fn check_opsets(m: &ModelProto) -> FResult<()> {
    let mut default = None;
    for o in &m.opset_import {
        if o.domain.is_empty() || o.domain == "ai.onnx" {
            default = Some(o.version);
        }
    }
    match default {
        Some(v) if (MIN_OPSET..=MAX_OPSET).contains(&v) => Ok(()),
        Some(v) => Err(Fail::new(
            ImportErrorKind::Opset,
            format!(
                "unsupported opset {v} (hzp reads opsets {MIN_OPSET}-{MAX_OPSET} of the default \
                 ONNX domain; re-export with e.g. `opset_version=18`, or convert the model with \
                 onnx.version_converter)"
            ),
        )),
        None => Err(Fail::new(
            ImportErrorKind::Opset,
            format!(
                "the model imports no opset of the default ONNX domain (opset_import lists: {}); \
                 hzp reads opsets {MIN_OPSET}-{MAX_OPSET}",
                if m.opset_import.is_empty() {
                    "nothing".to_string()
                } else {
                    m.opset_import
                        .iter()
                        .map(|o| format!("`{}` {}", o.domain, o.version))
                        .collect::<Vec<_>>()
                        .join(", ")
                }
            ),
        )),
    }
}

/// Lists every op type of a live node that hzp cannot translate, in one error.
fn check_supported(info: &GraphInfo, m: &ModelProto) -> FResult<()> {
    let mut bad: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for ni in info.live_order() {
        let n = &info.graph.node[ni];
        if ops::is_supported(&n.domain, &n.op_type) {
            continue;
        }
        let mut key = if n.domain.is_empty() || n.domain == "ai.onnx" {
            n.op_type.clone()
        } else {
            format!("{}.{}", n.domain, n.op_type)
        };
        if m.functions
            .iter()
            .any(|f| f.name == n.op_type && f.domain == n.domain)
        {
            key.push_str(" (a model-local function)");
        }
        let who = if n.name.is_empty() {
            match n.output.iter().find(|o| !o.is_empty()) {
                Some(o) => format!("unnamed, writes `{o}`"),
                None => "unnamed".to_string(),
            }
        } else {
            n.name.clone()
        };
        bad.entry(key).or_default().push(who);
    }
    if bad.is_empty() {
        return Ok(());
    }
    let parts: Vec<String> = bad
        .iter()
        .map(|(op, nodes)| {
            let shown: Vec<&str> = nodes.iter().take(6).map(|s| s.as_str()).collect();
            let more = if nodes.len() > 6 {
                format!(", and {} more", nodes.len() - 6)
            } else {
                String::new()
            };
            format!("{op} (nodes: {}{more})", shown.join(", "))
        })
        .collect();
    let n = bad.len();
    Err(Fail::new(
        ImportErrorKind::Unsupported,
        format!(
            "the model uses {n} op type{} hzp does not support: {}",
            if n == 1 { "" } else { "s" },
            parts.join(", ")
        ),
    ))
}

fn signature(m: &ModelProto) -> Signature {
    const KEY: &str = "pkg.torch.export.ExportedProgram.graph_signature";
    let from_graph = m
        .graph
        .as_ref()
        .into_iter()
        .flat_map(|g| g.metadata_props.iter());
    from_graph
        .chain(m.metadata_props.iter())
        .find(|p| p.key == KEY)
        .map(|p| Signature::parse(&p.value))
        .unwrap_or_default()
}

/// A declared dim.
#[derive(Clone, Debug, PartialEq)]
enum Dim {
    Fixed(usize),
    Sym(String),
    Unknown,
}

fn fmt_dims(d: &[Dim]) -> String {
    let parts: Vec<String> = d
        .iter()
        .map(|d| match d {
            Dim::Fixed(n) => n.to_string(),
            Dim::Sym(s) => s.clone(),
            Dim::Unknown => "?".to_string(),
        })
        .collect();
    format!("[{}]", parts.join(", "))
}

/// Element type and declared dims (`None`: rank unknown) of a value info.
fn declared(v: &ValueInfoProto, what: &str) -> FResult<(i32, Option<Vec<Dim>>)> {
    let shape_err = |m: String| Fail::new(ImportErrorKind::Shapes, m);
    let t = match v.r#type.as_ref().and_then(|t| t.value.as_ref()) {
        Some(type_proto::Value::TensorType(t)) => t,
        Some(_) => {
            return Err(Fail::new(
                ImportErrorKind::Unsupported,
                format!(
                    "{what} `{}` is not a tensor (sequences, maps and optionals are not supported)",
                    v.name
                ),
            ))
        }
        None => return Err(shape_err(format!("{what} `{}` has no type", v.name))),
    };
    let dims = match &t.shape {
        None => None,
        Some(s) => {
            let mut out = Vec::new();
            for d in &s.dim {
                out.push(match &d.value {
                    Some(dimension::Value::DimValue(x)) => {
                        Dim::Fixed(usize::try_from(*x).map_err(|_| {
                            shape_err(format!("{what} `{}` declares a negative dim {x}", v.name))
                        })?)
                    }
                    Some(dimension::Value::DimParam(p)) if !p.is_empty() => Dim::Sym(p.clone()),
                    _ => Dim::Unknown,
                });
            }
            Some(out)
        }
    };
    Ok((t.elem_type, dims))
}

/// Static types for the graph inputs, from the declared shapes and the bindings.
fn bind_inputs(
    info: &GraphInfo,
    opts: &ImportOptions,
) -> FResult<(Vec<TensorType>, BTreeMap<String, usize>)> {
    let shape_err = |m: String| Fail::new(ImportErrorKind::Shapes, m);
    let mut decls = Vec::new();
    for v in &info.inputs {
        let (et, dims) = declared(v, "graph input")?;
        // Same mapping as for tensor data (and as hzp's .npz reader): DOUBLE inputs are fed
        // as f32, narrow integers widened.
        let dtype = dtype_of(et).ok_or_else(|| {
            Fail::new(
                ImportErrorKind::Unsupported,
                format!(
                    "graph input `{}` has element type {}, which hzp does not support",
                    v.name,
                    dt::name(et)
                ),
            )
        })?;
        decls.push((v.name.as_str(), dtype, dims));
    }
    // Symbols from explicit bindings.
    let mut symbols: BTreeMap<String, (usize, String)> = BTreeMap::new();
    let mut shapes: Vec<Option<Vec<usize>>> = vec![None; decls.len()];
    for (i, (name, _, dims)) in decls.iter().enumerate() {
        let Some(b) = opts.shapes.get(*name) else {
            continue;
        };
        check_binding(name, dims.as_deref(), b, &mut symbols)?;
        if !size_ok(b) {
            return Err(shape_err(format!(
                "the shape given for input `{name}` ({}) has too many elements",
                fmt_shape(b)
            )));
        }
        shapes[i] = Some(b.clone());
    }
    // Inputs without a binding: fixed dims and symbols bound elsewhere.
    let mut missing = Vec::new();
    for (i, (name, _, dims)) in decls.iter().enumerate() {
        if shapes[i].is_some() {
            continue;
        }
        let derived: Option<Vec<usize>> = dims.as_ref().and_then(|dims| {
            dims.iter()
                .map(|d| match d {
                    Dim::Fixed(n) => Some(*n),
                    Dim::Sym(s) => symbols.get(s).map(|(x, _)| *x),
                    Dim::Unknown => None,
                })
                .collect()
        });
        match derived {
            Some(s) => shapes[i] = Some(s),
            None => missing.push(match dims {
                Some(d) => format!("`{name}` {}", fmt_dims(d)),
                None => format!("`{name}` (rank not declared)"),
            }),
        }
    }
    if !missing.is_empty() {
        return Err(missing_shapes(&decls, &shapes, &missing, opts));
    }
    let tys = decls
        .iter()
        .zip(shapes)
        .map(|((_, d, _), s)| TensorType::new(*d, s.unwrap_or_default()))
        .collect();
    Ok((tys, symbols.into_iter().map(|(k, (v, _))| (k, v)).collect()))
}

/// A `--shape` binding `b` of input `name` against its declared `dims`: the same rank,
/// fixed dims kept, each symbolic dim one size across the bindings (recorded in `symbols`
/// with the input that gave it).
fn check_binding(
    name: &str,
    dims: Option<&[Dim]>,
    b: &[usize],
    symbols: &mut BTreeMap<String, (usize, String)>,
) -> FResult<()> {
    let shape_err = |m: String| Fail::new(ImportErrorKind::Shapes, m);
    if let Some(dims) = dims {
        if dims.len() != b.len() {
            return Err(shape_err(format!(
                "the shape given for input `{name}` ({}) has rank {}, but the model declares \
                 `{name}` with rank {} {}",
                fmt_shape(b),
                b.len(),
                dims.len(),
                fmt_dims(dims)
            )));
        }
        for (k, (d, &x)) in dims.iter().zip(b).enumerate() {
            match d {
                Dim::Fixed(n) if *n != x => {
                    return Err(shape_err(format!(
                        "the shape given for input `{name}` ({}) has {x} in dim {k}, but the \
                         model fixes that dim to {n} (declared {})",
                        fmt_shape(b),
                        fmt_dims(dims)
                    )))
                }
                Dim::Sym(s) => match symbols.get(s) {
                    Some((prev, from)) if *prev != x => {
                        return Err(shape_err(format!(
                            "symbolic dim `{s}` is {prev} in the shape given for input \
                             `{from}` but {x} in the one given for `{name}`"
                        )))
                    }
                    Some(_) => {}
                    None => {
                        symbols.insert(s.clone(), (x, name.to_string()));
                    }
                },
                _ => {}
            }
        }
    }
    Ok(())
}

/// The error for inputs whose shapes are not known (`missing`, described), with an example
/// `--shape` and the names given that are not inputs.
fn missing_shapes(
    decls: &[(&str, DType, Option<Vec<Dim>>)],
    shapes: &[Option<Vec<usize>>],
    missing: &[String],
    opts: &ImportOptions,
) -> Fail {
    let shape_err = |m: String| Fail::new(ImportErrorKind::Shapes, m);
    let example = decls
        .iter()
        .zip(shapes)
        .find(|(_, s)| s.is_none())
        .map(|((n, _, d), _)| {
            let ex: Vec<String> = match d {
                Some(d) => d
                    .iter()
                    .enumerate()
                    .map(|(k, d)| match d {
                        Dim::Fixed(x) => x.to_string(),
                        _ if k == 0 => "2".to_string(),
                        _ => "16".to_string(),
                    })
                    .collect(),
                None => vec!["2".into(), "16".into()],
            };
            format!("{n}={}", ex.join("x"))
        })
        .unwrap_or_default();
    let unknown: Vec<&str> = opts
        .shapes
        .keys()
        .filter(|k| !decls.iter().any(|(n, _, _)| n == k))
        .map(|k| k.as_str())
        .collect();
    let hint = if unknown.is_empty() {
        String::new()
    } else {
        format!(
            " (shapes were given for {}, which {} not a graph input; the inputs are {})",
            {
                // name a few; an inputs file for another model can hold hundreds
                let mut shown: Vec<String> =
                    unknown.iter().take(6).map(|u| format!("`{u}`")).collect();
                if unknown.len() > 6 {
                    shown.push(format!("and {} more", unknown.len() - 6));
                }
                shown.join(", ")
            },
            if unknown.len() == 1 { "is" } else { "are" },
            decls
                .iter()
                .map(|(n, _, _)| format!("`{n}`"))
                .collect::<Vec<_>>()
                .join(", ")
        )
    };
    shape_err(format!(
        "hzp needs static shapes, and {} with symbolic dims {} no shape: {}. Pass one \
         `--shape NAME=AxB` per input (e.g. `--shape {example}`), or `--inputs FILE.npz` with \
         example inputs{hint}",
        if missing.len() == 1 {
            "this input"
        } else {
            "these inputs"
        },
        if missing.len() == 1 { "has" } else { "have" },
        missing.join(", ")
    ))
}

fn fmt_shape(s: &[usize]) -> String {
    s.iter()
        .map(|d| d.to_string())
        .collect::<Vec<_>>()
        .join("x")
}

/// Checks a graph output's declared type against what hzp computed.
fn check_output(
    v: &ValueInfoProto,
    got: &TensorType,
    symbols: &BTreeMap<String, usize>,
) -> FResult<()> {
    if v.r#type.is_none() {
        return Ok(());
    }
    let (et, dims) = declared(v, "graph output")?;
    let mismatch = |why: String| {
        Fail::new(
            ImportErrorKind::Node,
            format!(
                "graph output `{}` is declared as {} {} but hzp computes {got} ({why}); the \
                 model or hzp's translation is wrong",
                v.name,
                dt::name(et),
                dims.as_ref()
                    .map(|d| fmt_dims(d))
                    .unwrap_or_else(|| "[?]".into())
            ),
        )
    };
    if et != dt::UNDEFINED && dtype_of(et) != Some(got.dtype) {
        return Err(mismatch("element types differ".into()));
    }
    if let Some(dims) = &dims {
        if dims.len() != got.shape.len() {
            return Err(mismatch("ranks differ".into()));
        }
        for (k, (d, &x)) in dims.iter().zip(&got.shape).enumerate() {
            let want = match d {
                Dim::Fixed(n) => Some(*n),
                Dim::Sym(s) => symbols.get(s).copied(),
                Dim::Unknown => None,
            };
            if let Some(w) = want {
                if w != x {
                    return Err(mismatch(format!("dim {k} is {x}, expected {w}")));
                }
            }
        }
    }
    Ok(())
}

/// The whole import. A value that decides a shape and is computed from graph inputs whose
/// values are given makes the import start again, specialized on those inputs.
pub(crate) fn import(
    bytes: &[u8],
    model_dir: Option<&Path>,
    name: &str,
    opts: &ImportOptions,
) -> FResult<Program> {
    let mut on: BTreeMap<String, Tensor> = BTreeMap::new();
    loop {
        match import_specialized(bytes, model_dir, name, opts, &on) {
            Err(f)
                if !f.specialize.is_empty() && f.specialize.iter().any(|i| !on.contains_key(i)) =>
            {
                for i in f.specialize {
                    let t = given_value(bytes, opts, &i)?;
                    on.insert(i, t);
                }
            }
            Err(mut f) => {
                if !f.specialize.is_empty() {
                    // not expected: the inputs were folded and the value still is not
                    f.message = format!("{} (internal: specializing did not help)", f.message);
                }
                return Err(f);
            }
            Ok(p) => return Ok(p),
        }
    }
}

/// The value given for graph input `name`: `--bind` numbers read with the input's declared
/// type and bound shape, else the array given.
fn given_value(bytes: &[u8], opts: &ImportOptions, name: &str) -> FResult<Tensor> {
    if let Some(t) = opts.values.get(name) {
        if !opts.bind.contains_key(name) {
            return Ok(t.clone());
        }
    }
    let nums = opts
        .bind
        .get(name)
        .ok_or_else(|| node_err(format!("internal: no value for input `{name}`")))?;
    let model = ModelProto::decode(bytes).map_err(|e| node_err(e.to_string()))?;
    let v = model
        .graph
        .as_ref()
        .and_then(|g| g.input.iter().find(|v| v.name == name))
        .ok_or_else(|| node_err(format!("`{name}` is not a graph input")))?;
    let (et, dims) = declared(v, "graph input")?;
    let dtype = dtype_of(et).unwrap_or(DType::I64);
    let shape = bind_shape(opts, name, dims.as_deref(), nums.len())?;
    Ok(Tensor::from_f64(dtype, shape, nums))
}

/// The shape of a `--bind` value with `n` numbers.
fn bind_shape(
    opts: &ImportOptions,
    name: &str,
    dims: Option<&[Dim]>,
    n: usize,
) -> FResult<Vec<usize>> {
    let shape = if let Some(s) = opts.shapes.get(name) {
        s.clone()
    } else {
        match dims {
            Some([]) => vec![],
            Some(d) if d.iter().all(|d| matches!(d, Dim::Fixed(_))) => d
                .iter()
                .map(|d| match d {
                    Dim::Fixed(x) => *x,
                    _ => 0,
                })
                .collect(),
            _ => vec![n],
        }
    };
    if numel(&shape) != n {
        return Err(Fail::new(
            ImportErrorKind::Shapes,
            format!(
                "--bind gives {n} number{} for input `{name}`, whose shape is [{}] ({} elements)",
                if n == 1 { "" } else { "s" },
                fmt_shape(&shape),
                numel(&shape)
            ),
        ));
    }
    Ok(shape)
}

fn import_specialized(
    bytes: &[u8],
    model_dir: Option<&Path>,
    name: &str,
    opts: &ImportOptions,
    on: &BTreeMap<String, Tensor>,
) -> FResult<Program> {
    let mut model = decode_model(bytes)?;
    let keys = match &opts.names {
        Some(map) => super::rename::apply(&mut model, map, model_dir)?,
        None => Vec::new(),
    };
    let g = model
        .graph
        .as_ref()
        .ok_or_else(|| Fail::new(ImportErrorKind::Decode, "the model holds no graph"))?;
    check_opsets(&model)?;
    let info = GraphInfo::new(g)?;
    check_supported(&info, &model)?;
    let mut sig = signature(&model);
    sig.params.extend(keys);
    let is_param = classify_params(&info, &sig);
    let bound = bound_shapes(&info, opts)?;
    let (input_tys, symbols) = bind_inputs(&info, &bound)?;
    let given: std::collections::BTreeSet<String> = opts
        .values
        .keys()
        .chain(opts.bind.keys())
        .cloned()
        .collect();

    let names = graph_names(g, &info);
    let mut cx = Ctx {
        prog: Program::new(name),
        names,
        env: HashMap::new(),
        seqs: HashMap::new(),
        info: &info,
        model_dir,
        given: &given,
        folded_bytes: 0,
        shapes_only: opts.shapes_only,
        placeholders: Default::default(),
    };
    for (v, ty) in info.inputs.iter().zip(input_tys) {
        if let Some(t) = on.get(&v.name) {
            if t.ty() != ty {
                return Err(Fail::new(
                    ImportErrorKind::Shapes,
                    format!(
                        "the value given for input `{}` is {}, but the input is {ty}",
                        v.name,
                        t.ty()
                    ),
                ));
            }
            // The input stays (the evaluator checks that it keeps this value); the program
            // reads the value as a constant.
            cx.prog.add_input(v.name.clone(), ty);
            cx.prog.specialized.insert(v.name.clone(), t.clone());
            let cname = cx.fresh(&v.name);
            let s = cx.named_const(t.clone(), cname);
            cx.env.insert(v.name.clone(), s);
            continue;
        }
        let id = cx.prog.add_input(v.name.clone(), ty);
        cx.env.insert(v.name.clone(), Slot::Val(id));
    }
    for (i, t) in g.initializer.iter().enumerate() {
        if !is_param[i] {
            continue;
        }
        let data = decode_tensor(t, &format!("initializer `{}`", t.name), model_dir)?;
        let id = cx.prog.add_param(t.name.clone(), data.ty(), Some(data));
        cx.env.insert(t.name.clone(), Slot::Val(id));
    }

    translate_nodes(&mut cx, g, &info)?;

    let outputs = graph_outputs(&mut cx, g, &symbols)?;
    let mut prog = cx.prog;
    prog.outputs = outputs;
    prog.eliminate_dead_code();
    hzp_ir::verify(&prog).map_err(|e| {
        Fail::new(
            ImportErrorKind::Verify,
            format!(
                "internal error: the imported program does not verify ({e}); please report this \
                 with the model"
            ),
        )
    })?;
    Ok(prog)
}

/// The model in `bytes`, with a graph; errors say what the bytes are instead.
fn decode_model(bytes: &[u8]) -> FResult<ModelProto> {
    let decode = |m: String| Fail::new(ImportErrorKind::Decode, m);
    if bytes.is_empty() {
        return Err(decode(
            "the file is empty (0 bytes), not an ONNX model".into(),
        ));
    }
    let model = ModelProto::decode(bytes).map_err(|e| {
        decode(format!(
            "the file is not a valid ONNX model: protobuf decoding failed ({e}); is it truncated \
             or another kind of file?"
        ))
    })?;
    if model.graph.is_none() {
        return Err(decode(
            "the file decodes as protobuf but holds no ONNX graph; is it an ONNX model?".into(),
        ));
    }
    Ok(model)
}

/// The shape bindings to import with: `--shape`'s, plus the shapes of `--bind` values of
/// inputs without one (only the shapes: `values` may hold large arrays).
fn bound_shapes(info: &GraphInfo, opts: &ImportOptions) -> FResult<ImportOptions> {
    let mut bound = ImportOptions {
        shapes: opts.shapes.clone(),
        ..Default::default()
    };
    for (name, nums) in &opts.bind {
        if !info.inputs.iter().any(|v| v.name == *name) {
            return Err(Fail::new(
                ImportErrorKind::Shapes,
                format!(
                    "--bind gives a value for `{name}`, which is not a graph input (the inputs \
                     are {})",
                    info.inputs
                        .iter()
                        .map(|v| format!("`{}`", v.name))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            ));
        }
        if let Some(v) = info.inputs.iter().find(|v| v.name == *name) {
            if !bound.shapes.contains_key(name) {
                let (_, dims) = declared(v, "graph input")?;
                let shape = bind_shape(opts, name, dims.as_deref(), nums.len())?;
                bound.shapes.insert(name.clone(), shape);
            }
        }
    }
    Ok(bound)
}

/// Every name the graph already uses (inputs, initializers, node outputs, graph outputs),
/// so that fresh names never collide with them.
fn graph_names(g: &GraphProto, info: &GraphInfo) -> NameSet {
    let mut names = NameSet::default();
    for v in &info.inputs {
        names.insert(&v.name);
    }
    for t in &g.initializer {
        names.insert(&t.name);
    }
    for n in &g.node {
        for o in &n.output {
            if !o.is_empty() {
                names.insert(o);
            }
        }
    }
    for o in &g.output {
        names.insert(&o.name);
    }
    names
}

/// Translates the live nodes in order, binding each ONNX output to its slot; an output
/// something reads but hzp does not compute is an error.
fn translate_nodes(cx: &mut Ctx, g: &GraphProto, info: &GraphInfo) -> FResult<()> {
    for ni in info.live_order() {
        let p = &g.node[ni];
        let label = node_label(p);
        let prefix = |f: Fail| Fail {
            kind: f.kind,
            message: format!("{label}: {}", f.message),
            specialize: f.specialize,
        };
        let mut ins = Vec::with_capacity(p.input.len());
        let mut seqs = Vec::with_capacity(p.input.len());
        for (k, i) in p.input.iter().enumerate() {
            if let Some(s) = cx.seqs.get(i) {
                if !ops::takes_sequences(&p.domain, &p.op_type) {
                    return Err(prefix(node_err(format!(
                        "input {k} (`{i}`) is a sequence of tensors, but {} takes tensors                          (a sequence can only go into SequenceAt, ConcatFromSequence,                          SequenceLength, SequenceInsert or SequenceErase)",
                        p.op_type
                    ))));
                }
                ins.push(None);
                seqs.push(Some(s.clone()));
                continue;
            }
            seqs.push(None);
            ins.push(if i.is_empty() {
                None
            } else {
                Some(cx.lookup(i).map_err(prefix)?)
            });
        }
        let ir_name = if !p.name.is_empty() {
            p.name.clone()
        } else {
            p.output
                .iter()
                .find(|o| !o.is_empty())
                .cloned()
                .unwrap_or_else(|| p.op_type.clone())
        };
        let n = NodeCx {
            p,
            ir_name,
            ins,
            seqs,
        };
        let outs = ops::translate(cx, &n).map_err(prefix)?;
        for (k, o) in p.output.iter().enumerate() {
            if o.is_empty() {
                continue;
            }
            match outs.get(k).cloned().flatten() {
                Some(s) => {
                    cx.env.insert(o.clone(), s);
                }
                None if cx.seqs.contains_key(o) => {}
                None if info.used.contains(o.as_str()) => {
                    return Err(node_err(format!(
                        "{label}: output {k} (`{o}`) is used, but hzp does not compute it for {}",
                        p.op_type
                    )));
                }
                None => {}
            }
        }
    }
    Ok(())
}

/// The graph outputs as IR values under their ONNX names (an alias gets an Identity node),
/// checked against their declared types.
fn graph_outputs(
    cx: &mut Ctx,
    g: &GraphProto,
    symbols: &BTreeMap<String, usize>,
) -> FResult<Vec<ValueId>> {
    let mut outputs = Vec::new();
    for o in &g.output {
        if cx.seqs.contains_key(&o.name) {
            return Err(graph_err(format!(
                "graph output `{}` is a sequence of tensors; hzp's programs output tensors \
                 (ConcatFromSequence or SequenceAt make one)",
                o.name
            )));
        }
        let s = cx.lookup(&o.name)?;
        let id = match &s {
            Slot::Val(v) if cx.prog.value(*v).name == o.name => *v,
            Slot::Const(c) if c.name == o.name => cx.materialize(&s),
            _ => {
                // The output's ONNX name belongs to no IR value (aliases like Identity):
                // give it one.
                let v = cx.materialize(&s);
                if cx.prog.find_value(&o.name).is_some() {
                    return Err(graph_err(format!(
                        "graph output `{}` cannot keep its name",
                        o.name
                    )));
                }
                let r = cx
                    .prog
                    .add_node(o.name.clone(), Op::Identity, vec![v], vec![o.name.clone()])
                    .map_err(node_err)?;
                r[0]
            }
        };
        check_output(o, cx.prog.ty(id), symbols)?;
        outputs.push(id);
    }
    Ok(outputs)
}
