//! The parser: tokens to a [`Program`], checking names, types and data as it goes, then
//! running the verifier.

use super::lexer::{lex, Tok, Token};
use super::ParseError;
use crate::dtype::{DType, TensorType};
use crate::mesh::{Group, Mesh, MeshAxis};
use crate::op::{Attr, Op, StreamKind};
use crate::program::{
    Const, Node, NodeId, Param, Precision, Program, State, Update, Value, ValueDef, ValueId,
};
use crate::role::{Role, RoleKind};
use crate::tensor::{Data, Tensor};
use half::{bf16, f16};
use std::collections::{BTreeMap, HashMap};

/// Largest dimension, element count and mesh size the parser accepts (2^62), so that no
/// shape arithmetic downstream can overflow.
const MAX_SIZE: usize = 1 << 62;

const KEYWORDS: [&str; 10] = [
    "program",
    "mesh",
    "input",
    "param",
    "const",
    "state",
    "output",
    "update",
    "precision",
    "order",
];

/// Parses the text form (see the [module docs](super)).
///
/// `data(name)` supplies the data of parameters (`None`: the parameter has none) and of
/// constants written as `@data` (`None` is an error). `file_name` is used in messages. The
/// result has passed [`verify`](crate::verify::verify). Never panics.
pub fn parse(
    src: &str,
    file_name: &str,
    data: &dyn Fn(&str) -> Option<Tensor>,
) -> Result<Program, ParseError> {
    let toks = lex(src)
        .map_err(|e| ParseError::new(src, file_name, e.start, e.end, e.message, e.label, None))?;
    let mut p = Parser {
        src,
        file: file_name,
        toks,
        pos: 0,
        data,
        prog: Program::default(),
        names: HashMap::new(),
        value_spans: Vec::new(),
        node_spans: Vec::new(),
        program_line: None,
        mesh_line: None,
        outputs: Vec::new(),
        updates: Vec::new(),
        order: None,
    };
    p.prog.name = std::path::Path::new(file_name)
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    p.statements()?;
    p.finish()
}

type Span = (usize, usize);
type PResult<T> = Result<T, ParseError>;

struct Parser<'a, 'd> {
    src: &'a str,
    file: &'a str,
    toks: Vec<Token<'a>>,
    pos: usize,
    data: &'d dyn Fn(&str) -> Option<Tensor>,
    prog: Program,
    /// Name -> id in order of definition.
    names: HashMap<String, ValueId>,
    /// Span of each value's name where it is defined, by id.
    value_spans: Vec<Span>,
    /// Span of each node's op name.
    node_spans: Vec<Span>,
    program_line: Option<Span>,
    mesh_line: Option<Span>,
    outputs: Vec<(String, Span)>,
    /// `update %target = %value` lines, resolved at the end.
    updates: Vec<((String, Span), (String, Span))>,
    order: Option<(Vec<(String, Span)>, Span)>,
}

fn is_int_text(s: &str) -> bool {
    !s.contains(['.', 'e', 'E']) && s != "-inf"
}

impl<'a> Parser<'a, '_> {
    // ---------------------------------------------------------------- errors

    fn error_at(&self, span: Span, message: String, label: &str) -> ParseError {
        ParseError::new(
            self.src,
            self.file,
            span.0,
            span.1,
            message,
            label.to_string(),
            None,
        )
    }

    fn error_help(&self, span: Span, message: String, label: &str, help: String) -> ParseError {
        ParseError::new(
            self.src,
            self.file,
            span.0,
            span.1,
            message,
            label.to_string(),
            Some(help),
        )
    }

    // ---------------------------------------------------------------- tokens

    fn peek(&self) -> &Token<'a> {
        &self.toks[self.pos.min(self.toks.len() - 1)]
    }

    fn peek_tok(&self) -> &Tok<'a> {
        &self.peek().tok
    }

    fn span(&self) -> Span {
        let t = self.peek();
        (t.start, t.end)
    }

    fn bump(&mut self) -> Token<'a> {
        let t = self.peek().clone();
        if self.pos < self.toks.len() - 1 {
            self.pos += 1;
        }
        t
    }

    fn at_punct(&self, c: char) -> bool {
        *self.peek_tok() == Tok::Punct(c)
    }

    fn eat_punct(&mut self, c: char) -> bool {
        if self.at_punct(c) {
            self.bump();
            true
        } else {
            false
        }
    }

    fn unexpected(&self, expected: &str) -> ParseError {
        let t = self.peek();
        self.error_at(
            (t.start, t.end),
            format!("expected {expected}, found {}", t.tok.describe()),
            &format!("expected {expected}"),
        )
    }

    fn expect_punct(&mut self, c: char) -> PResult<Span> {
        if self.at_punct(c) {
            let t = self.bump();
            Ok((t.start, t.end))
        } else {
            Err(self.unexpected(&format!("`{c}`")))
        }
    }

    fn expect_end(&mut self) -> PResult<()> {
        match self.peek_tok() {
            Tok::Newline => {
                self.bump();
                Ok(())
            }
            Tok::Eof => Ok(()),
            _ => Err(self.unexpected("the end of the statement")),
        }
    }

    fn expect_value_name(&mut self) -> PResult<(String, Span)> {
        match self.peek_tok() {
            Tok::Value(_) => {
                let t = self.bump();
                let Tok::Value(name) = t.tok else {
                    unreachable!("checked above")
                };
                Ok((name.into_owned(), (t.start, t.end)))
            }
            _ => Err(self.unexpected("a value like `%x`")),
        }
    }

    /// A value reference that must already be defined.
    fn value_use(&mut self) -> PResult<ValueId> {
        let (name, span) = self.expect_value_name()?;
        match self.names.get(&name) {
            Some(&v) => Ok(v),
            None => Err(self.error_at(
                span,
                format!(
                    "unknown value `{}`: it is not defined above this line",
                    super::value_ref(&name)
                ),
                "not defined before this use",
            )),
        }
    }

    /// A comma-separated list of value names (possibly empty), up to the end of the line.
    fn name_list(&mut self) -> PResult<Vec<(String, Span)>> {
        let mut out = Vec::new();
        if matches!(self.peek_tok(), Tok::Newline | Tok::Eof) {
            return Ok(out);
        }
        loop {
            out.push(self.expect_value_name()?);
            if !self.eat_punct(',') {
                return Ok(out);
            }
        }
    }

    // ---------------------------------------------------------------- numbers

    /// A non-negative integer no larger than [`MAX_SIZE`].
    fn size(&mut self, what: &str) -> PResult<usize> {
        let span = self.span();
        let text = match self.peek_tok() {
            Tok::Num(n) => *n,
            _ => return Err(self.unexpected(what)),
        };
        self.bump();
        if !is_int_text(text) || text.starts_with('-') {
            return Err(self.error_at(
                span,
                format!("{what} must be a non-negative integer, got `{text}`"),
                "not a non-negative integer",
            ));
        }
        match text.parse::<u64>() {
            Ok(n) if n <= MAX_SIZE as u64 => Ok(n as usize),
            _ => Err(self.error_at(
                span,
                format!("{what} `{text}` is too large (the limit is 2^62)"),
                "too large",
            )),
        }
    }

    fn int_i64(&self, text: &str, span: Span) -> PResult<i64> {
        if !is_int_text(text) {
            return Err(self.error_at(
                span,
                format!("expected an integer, got `{text}`"),
                "not an integer",
            ));
        }
        text.parse::<i64>().map_err(|_| {
            self.error_at(
                span,
                format!("integer `{text}` does not fit in 64 bits"),
                "out of range",
            )
        })
    }

    // ---------------------------------------------------------------- types

    fn tensor_type(&mut self) -> PResult<(TensorType, Span)> {
        let start = self.span();
        let dtype = match self.peek_tok() {
            Tok::Word(w) => match DType::from_name(w) {
                Some(d) => d,
                None => {
                    let w = w.to_string();
                    return Err(self.error_help(
                        start,
                        format!("unknown dtype `{w}`"),
                        "not a dtype",
                        "dtypes are f32, bf16, f16, i64, i32 and bool".into(),
                    ));
                }
            },
            _ => return Err(self.unexpected("a type like `f32[2,3]`")),
        };
        self.bump();
        self.expect_punct('[')?;
        let mut shape = Vec::new();
        if !self.at_punct(']') {
            loop {
                shape.push(self.size("a dimension")?);
                if !self.eat_punct(',') {
                    break;
                }
            }
        }
        let end = self.expect_punct(']')?;
        let span = (start.0, end.1);
        let ty = TensorType::new(dtype, shape);
        if !type_fits(&ty) {
            return Err(self.error_at(
                span,
                format!("type {ty} has too many elements (the limit is 2^62)"),
                "too large",
            ));
        }
        Ok((ty, span))
    }

    // ---------------------------------------------------------------- statements

    fn statements(&mut self) -> PResult<()> {
        loop {
            let span = self.span();
            match self.peek_tok().clone() {
                Tok::Eof => return Ok(()),
                Tok::Newline => {
                    self.bump();
                    continue;
                }
                Tok::Word("program") => self.program_stmt(span)?,
                Tok::Word("mesh") => self.mesh_stmt(span)?,
                Tok::Word(kw @ ("input" | "param" | "const" | "state")) => self.decl_stmt(kw)?,
                Tok::Word("update") => {
                    self.bump();
                    let target = self.expect_value_name()?;
                    self.expect_punct('=')?;
                    let value = self.expect_value_name()?;
                    self.updates.push((target, value));
                }
                Tok::Word("precision") => self.precision_stmt(span)?,
                Tok::Word("output") => {
                    self.bump();
                    let list = self.name_list()?;
                    if list.is_empty() {
                        return Err(self.unexpected("a value like `%x`"));
                    }
                    self.outputs.extend(list);
                }
                Tok::Word("order") => {
                    self.bump();
                    if let Some((_, first)) = &self.order {
                        let line = self.line_of(first.0);
                        return Err(self.error_at(
                            span,
                            format!("a second `order` line (the first is on line {line})"),
                            "repeated",
                        ));
                    }
                    let list = self.name_list()?;
                    self.order = Some((list, span));
                }
                Tok::Value(_) | Tok::Word(_) => self.node_stmt()?,
                _ => {
                    return Err(self.unexpected(
                        "a statement (program, mesh, precision, input, param, const, state, output, update, or a node)",
                    ))
                }
            }
            self.expect_end()?;
        }
    }

    fn line_of(&self, offset: usize) -> usize {
        self.src
            .as_bytes()
            .iter()
            .take(offset)
            .filter(|&&b| b == b'\n')
            .count()
            + 1
    }

    fn program_stmt(&mut self, span: Span) -> PResult<()> {
        if let Some(first) = self.program_line {
            let line = self.line_of(first.0);
            return Err(self.error_at(
                span,
                format!("a second `program` line (the first is on line {line})"),
                "repeated",
            ));
        }
        self.program_line = Some(span);
        self.bump();
        match self.peek_tok() {
            Tok::Str(s) => {
                self.prog.name = s.to_string();
                self.bump();
                Ok(())
            }
            _ => Err(self.unexpected("the program name as a string, like \"model\"")),
        }
    }

    fn mesh_stmt(&mut self, span: Span) -> PResult<()> {
        if let Some(first) = self.mesh_line {
            let line = self.line_of(first.0);
            return Err(self.error_at(
                span,
                format!("a second `mesh` line (the first is on line {line})"),
                "repeated",
            ));
        }
        if !self.prog.nodes.is_empty() {
            return Err(self.error_at(
                span,
                "the mesh must come before the first node".into(),
                "move this line up",
            ));
        }
        self.mesh_line = Some(span);
        self.bump();
        let mut axes: Vec<MeshAxis> = Vec::new();
        let mut world: usize = 1;
        if !matches!(self.peek_tok(), Tok::Newline | Tok::Eof) {
            loop {
                let aspan = self.span();
                let name = match self.peek_tok() {
                    Tok::Word(w) => w.to_string(),
                    Tok::Str(s) => s.to_string(),
                    _ => return Err(self.unexpected("a mesh axis like `gpu=8`")),
                };
                self.bump();
                if axes.iter().any(|a| a.name == name) {
                    return Err(self.error_at(
                        aspan,
                        format!("mesh axis `{name}` appears twice"),
                        "repeated",
                    ));
                }
                self.expect_punct('=')?;
                let sspan = self.span();
                let size = self.size("a mesh axis size")?;
                if size == 0 {
                    return Err(self.error_at(
                        sspan,
                        format!("mesh axis `{name}` has size 0"),
                        "must be at least 1",
                    ));
                }
                world = match world.checked_mul(size) {
                    Some(w) if w <= MAX_SIZE => w,
                    _ => {
                        return Err(self.error_at(
                            sspan,
                            "the mesh has more than 2^62 ranks".into(),
                            "too large",
                        ))
                    }
                };
                axes.push(MeshAxis { name, size });
                if !self.eat_punct(',') {
                    break;
                }
            }
        }
        self.prog.mesh = Some(Mesh { axes });
        Ok(())
    }

    /// `precision compute=bf16 master=f32 reduce=f32`
    fn precision_stmt(&mut self, span: Span) -> PResult<()> {
        if self.prog.precision.is_some() {
            return Err(self.error_at(span, "a second `precision` line".into(), "repeated"));
        }
        self.bump();
        let mut fields: [Option<DType>; 3] = [None; 3];
        const KEYS: [&str; 3] = ["compute", "master", "reduce"];
        while let Tok::Word(w) = self.peek_tok().clone() {
            let kspan = self.span();
            let Some(k) = KEYS.iter().position(|&x| x == w) else {
                return Err(self.error_at(
                    kspan,
                    format!("unknown precision field `{w}` (expected compute, master, reduce)"),
                    "unknown field",
                ));
            };
            self.bump();
            self.expect_punct('=')?;
            let dspan = self.span();
            let dt = match self.peek_tok() {
                Tok::Word(d) => DType::from_name(d),
                _ => None,
            }
            .ok_or_else(|| {
                self.error_at(dspan, "expected a dtype like bf16".into(), "not a dtype")
            })?;
            self.bump();
            fields[k] = Some(dt);
            if !self.eat_punct(',') {
                break;
            }
        }
        match fields {
            [Some(compute), Some(master), Some(reduce)] => {
                self.prog.precision = Some(Precision {
                    compute,
                    master,
                    reduce,
                });
                Ok(())
            }
            _ => Err(self.error_at(
                span,
                "`precision` needs compute=, master= and reduce=".into(),
                "incomplete",
            )),
        }
    }

    /// Registers a new value; its name must be new.
    fn define(
        &mut self,
        name: String,
        span: Span,
        ty: TensorType,
        def: ValueDef,
    ) -> PResult<ValueId> {
        if let Some(&old) = self.names.get(&name) {
            let line = self.line_of(self.value_spans[old.index()].0);
            return Err(self.error_at(
                span,
                format!(
                    "value `{}` is defined twice (first on line {line})",
                    super::value_ref(&name)
                ),
                "already defined",
            ));
        }
        let id = ValueId(self.prog.values.len() as u32);
        self.names.insert(name.clone(), id);
        self.prog.values.push(Value { name, ty, def });
        self.value_spans.push(span);
        Ok(id)
    }

    fn decl_stmt(&mut self, kw: &str) -> PResult<()> {
        self.bump();
        let (name, nspan) = self.expect_value_name()?;
        self.expect_punct(':')?;
        let (ty, tspan) = self.tensor_type()?;
        match kw {
            "input" => {
                if self.at_punct('=') {
                    self.bump();
                    let t = self.literal(&name, &ty)?;
                    self.prog.specialized.insert(name.clone(), t);
                }
                let id = self.define(name, nspan, ty, ValueDef::Input)?;
                self.prog.inputs.push(id);
            }
            "param" => {
                let data = (self.data)(&name);
                if let Some(t) = &data {
                    self.check_data("parameter", &name, &ty, t, tspan)?;
                }
                let id = self.define(name, nspan, ty, ValueDef::Param)?;
                self.prog.params.push(Param { value: id, data });
            }
            "state" if !self.at_punct('=') => {
                let id = self.define(name, nspan, ty, ValueDef::State)?;
                self.prog.states.push(State {
                    value: id,
                    init: None,
                });
            }
            _ => {
                self.expect_punct('=')?;
                let data = if self.at_punct('@') {
                    let at = self.bump();
                    let wspan = self.span();
                    if *self.peek_tok() != Tok::Word("data") {
                        return Err(self.unexpected("`data` after `@`"));
                    }
                    self.bump();
                    match (self.data)(&name) {
                        Some(t) => {
                            self.check_data("constant", &name, &ty, &t, tspan)?;
                            t
                        }
                        None => {
                            return Err(self.error_at(
                                (at.start, wspan.1),
                                format!(
                                    "constant `{name}` has its data in the weights file, but the weights file has no entry `{name}`"
                                ),
                                "no data for this constant",
                            ))
                        }
                    }
                } else {
                    self.literal(&name, &ty)?
                };
                if kw == "state" {
                    let id = self.define(name, nspan, ty, ValueDef::State)?;
                    self.prog.states.push(State {
                        value: id,
                        init: Some(data),
                    });
                } else {
                    let id = self.define(name, nspan, ty, ValueDef::Const)?;
                    self.prog.consts.push(Const { value: id, data });
                }
            }
        }
        Ok(())
    }

    fn check_data(
        &self,
        what: &str,
        name: &str,
        ty: &TensorType,
        t: &Tensor,
        span: Span,
    ) -> PResult<()> {
        let consistent = t
            .shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .is_some_and(|n| n == t.data.len());
        if !consistent {
            return Err(self.error_at(
                span,
                format!(
                    "the weights file's entry for {what} `{name}` has shape {:?} but {} elements",
                    t.shape,
                    t.data.len()
                ),
                "inconsistent data for this declaration",
            ));
        }
        if t.ty() != *ty {
            return Err(self.error_at(
                span,
                format!(
                    "{what} `{name}` is declared {ty}, but the weights file has {} for it",
                    t.ty()
                ),
                "does not match the weights file",
            ));
        }
        Ok(())
    }

    /// `[v, v, ...]` for a constant of type `ty`.
    fn literal(&mut self, name: &str, ty: &TensorType) -> PResult<Tensor> {
        let open = self.span();
        if !self.at_punct('[') {
            return Err(self.unexpected("a literal list like `[1, 2]` or `@data`"));
        }
        self.bump();
        let want = ty.numel();
        let mut data = match ty.dtype {
            DType::F32 => Data::F32(Vec::new()),
            DType::BF16 => Data::BF16(Vec::new()),
            DType::F16 => Data::F16(Vec::new()),
            DType::I64 => Data::I64(Vec::new()),
            DType::I32 => Data::I32(Vec::new()),
            DType::Bool => Data::Bool(Vec::new()),
        };
        let mut count = 0usize;
        if !self.at_punct(']') {
            loop {
                let span = self.span();
                if count == want {
                    return Err(self.error_at(
                        span,
                        format!(
                            "constant `{name}` is {ty}, which has {want} element{}, but the list is longer",
                            if want == 1 { "" } else { "s" }
                        ),
                        "one element too many",
                    ));
                }
                self.element(&mut data, ty.dtype, span)?;
                count += 1;
                if !self.eat_punct(',') {
                    break;
                }
            }
        }
        let close = self.expect_punct(']')?;
        if count != want {
            return Err(self.error_at(
                (open.0, close.1),
                format!("constant `{name}` is {ty}, which has {want} elements, but the list has {count}"),
                "wrong number of elements",
            ));
        }
        Ok(Tensor {
            shape: ty.shape.clone(),
            data,
        })
    }

    fn element(&mut self, data: &mut Data, dtype: DType, span: Span) -> PResult<()> {
        let tok = self.peek_tok().clone();
        let float_text = match &tok {
            Tok::Num(n) => Some(*n),
            Tok::Word(w @ ("inf" | "nan")) => Some(*w),
            _ => None,
        };
        let is_float = dtype.is_float();
        if is_float && float_text.is_none() {
            return Err(self.unexpected(&format!("a number for this {dtype} constant")));
        }
        let ftext = float_text.unwrap_or_default();
        match data {
            Data::F32(v) => v.push(self.parse_f32(ftext, span)?),
            Data::BF16(v) => v.push(bf16::from_f32(self.parse_f32(ftext, span)?)),
            Data::F16(v) => v.push(f16::from_f32(self.parse_f32(ftext, span)?)),
            Data::I64(v) => match tok {
                Tok::Num(n) => v.push(self.int_i64(n, span)?),
                _ => return Err(self.unexpected("an integer for this i64 constant")),
            },
            Data::I32(v) => match tok {
                Tok::Num(n) => {
                    let x = self.int_i64(n, span)?;
                    let x = i32::try_from(x).map_err(|_| {
                        self.error_at(
                            span,
                            format!("integer `{n}` does not fit in i32"),
                            "out of range",
                        )
                    })?;
                    v.push(x);
                }
                _ => return Err(self.unexpected("an integer for this i32 constant")),
            },
            Data::Bool(v) => match tok {
                Tok::Word("true") => v.push(true),
                Tok::Word("false") => v.push(false),
                _ => return Err(self.unexpected("`true` or `false` for this bool constant")),
            },
        }
        self.bump();
        Ok(())
    }

    fn parse_f32(&self, text: &str, span: Span) -> PResult<f32> {
        match text {
            "inf" => Ok(f32::INFINITY),
            "-inf" => Ok(f32::NEG_INFINITY),
            "nan" => Ok(f32::NAN),
            _ => text.parse::<f32>().map_err(|_| {
                self.error_at(span, format!("`{text}` is not a number"), "not a number")
            }),
        }
    }

    fn parse_f64(&self, text: &str, span: Span) -> PResult<f64> {
        match text {
            "inf" => Ok(f64::INFINITY),
            "-inf" => Ok(f64::NEG_INFINITY),
            "nan" => Ok(f64::NAN),
            _ => text.parse::<f64>().map_err(|_| {
                self.error_at(span, format!("`{text}` is not a number"), "not a number")
            }),
        }
    }

    // ---------------------------------------------------------------- nodes

    fn node_stmt(&mut self) -> PResult<()> {
        let outs = self.node_outputs()?;
        // op name
        let op_span = self.span();
        let op_name = match self.peek_tok() {
            Tok::Word(w) => *w,
            _ => return Err(self.unexpected("an op name like `MatMul`")),
        };
        let all = Op::all_names();
        if !all.contains(&op_name) {
            return Err(self.unknown_op(op_name, op_span, outs.is_empty()));
        }
        self.bump();
        let op = self.node_op(op_name, op_span)?;
        let inputs = self.node_inputs()?;
        let declared = self.declared_types(&outs)?;
        let (node_name, stream) = self.node_name_and_stream()?;
        let role = self.node_role()?;
        if !matches!(self.peek_tok(), Tok::Newline | Tok::Eof) {
            return Err(self.unexpected("the end of the statement"));
        }
        let out_tys = self.node_types(&op, op_name, op_span, &inputs)?;
        self.check_outputs(op_name, op_span, &out_tys, &outs, declared.as_deref())?;
        let node = NodeId(self.prog.nodes.len() as u32);
        let name = node_name.unwrap_or_else(|| {
            outs.first()
                .map_or_else(|| op_name.to_string(), |(n, _)| n.clone())
        });
        let mut outputs = Vec::with_capacity(outs.len());
        for (slot, ((oname, ospan), ty)) in outs.into_iter().zip(out_tys).enumerate() {
            let def = ValueDef::Node {
                node,
                slot: slot as u32,
            };
            outputs.push(self.define(oname, ospan, ty, def)?);
        }
        self.prog.nodes.push(Node {
            name,
            op,
            inputs,
            outputs,
            stream,
            role,
        });
        self.node_spans.push(op_span);
        Ok(())
    }

    /// A node statement's outputs (`%a, %b =`), if it names any.
    fn node_outputs(&mut self) -> PResult<Vec<(String, Span)>> {
        let mut outs: Vec<(String, Span)> = Vec::new();
        if matches!(self.peek_tok(), Tok::Value(_)) {
            loop {
                outs.push(self.expect_value_name()?);
                if !self.eat_punct(',') {
                    break;
                }
            }
            self.expect_punct('=')?;
        }
        Ok(outs)
    }

    /// The op of a node statement from its name and `{attributes}`; an error points at the
    /// attribute it names (or a misspelling of a missing one).
    fn node_op(&mut self, op_name: &str, op_span: Span) -> PResult<Op> {
        // attributes
        let mut attrs: BTreeMap<String, Attr> = BTreeMap::new();
        let mut attr_spans: HashMap<String, Span> = HashMap::new();
        let mut attr_words: HashMap<String, Span> = HashMap::new();
        if self.eat_punct('{') {
            while !self.at_punct('}') {
                let kspan = self.span();
                let key = match self.peek_tok() {
                    Tok::Word(w) => w.to_string(),
                    _ => return Err(self.unexpected("an attribute name or `}`")),
                };
                self.bump();
                self.expect_punct('=')?;
                let value = self.attr_value()?;
                let vend = self.toks[self.pos.saturating_sub(1)].end;
                if let Attr::Word(w) = &value {
                    attr_words.insert(w.clone(), (kspan.0, vend));
                }
                if attrs.insert(key.clone(), value).is_some() {
                    return Err(self.error_at(
                        kspan,
                        format!("attribute `{key}` is given twice"),
                        "repeated",
                    ));
                }
                attr_spans.insert(key, (kspan.0, vend));
                if !self.eat_punct(',') {
                    break;
                }
            }
            self.expect_punct('}')?;
        }
        Op::from_parts(op_name, &attrs).map_err(|e| {
            // A missing attribute next to a misspelt one: point at the misspelling.
            let missing = e
                .split_once("needs attribute `")
                .and_then(|(_, rest)| rest.split_once('`'))
                .map(|(k, _)| k);
            if let Some(missing) = missing {
                let given: Vec<&str> = attr_spans.keys().map(String::as_str).collect();
                if let Some(typo) = close_names(missing, &given).first() {
                    return self.error_help(
                        attr_spans[*typo],
                        e.clone(),
                        "unknown attribute",
                        format!("did you mean `{missing}`?"),
                    );
                }
            }
            // Point at the attribute the message names (by key or by word), if it is there.
            let named = |m: &HashMap<String, Span>| {
                m.iter()
                    .filter(|(k, _)| e.contains(&format!("`{k}`")))
                    .map(|(_, s)| *s)
                    .min()
            };
            let span = named(&attr_spans)
                .or_else(|| named(&attr_words))
                .unwrap_or(op_span);
            self.error_at(span, e, "bad attribute")
        })
    }

    /// A node statement's `(inputs)`.
    fn node_inputs(&mut self) -> PResult<Vec<ValueId>> {
        self.expect_punct('(')?;
        let mut inputs = Vec::new();
        if !self.at_punct(')') {
            loop {
                inputs.push(self.value_use()?);
                if !self.eat_punct(',') {
                    break;
                }
            }
        }
        self.expect_punct(')')?;
        Ok(inputs)
    }

    /// The output types a node statement declares (`: f32[2], i64[]`), one per output.
    fn declared_types(
        &mut self,
        outs: &[(String, Span)],
    ) -> PResult<Option<Vec<(TensorType, Span)>>> {
        let mut declared: Option<Vec<(TensorType, Span)>> = None;
        if self.at_punct(':') {
            let colon = self.bump();
            if outs.is_empty() {
                return Err(self.error_at(
                    (colon.start, colon.end),
                    "output types are given, but the node names no outputs".into(),
                    "no outputs to type",
                ));
            }
            let mut tys = Vec::new();
            loop {
                tys.push(self.tensor_type()?);
                if !self.eat_punct(',') {
                    break;
                }
            }
            if tys.len() != outs.len() {
                let span = (tys[0].1 .0, tys[tys.len() - 1].1 .1);
                return Err(self.error_at(
                    span,
                    format!(
                        "{} output{} named but {} type{} given",
                        outs.len(),
                        if outs.len() == 1 { " is" } else { "s are" },
                        tys.len(),
                        if tys.len() == 1 { " is" } else { "s are" }
                    ),
                    "one type per output",
                ));
            }
            declared = Some(tys);
        }
        Ok(declared)
    }

    /// A node statement's optional `"name"` and `@stream`.
    fn node_name_and_stream(&mut self) -> PResult<(Option<String>, StreamKind)> {
        let mut node_name: Option<String> = None;
        if let Tok::Str(s) = self.peek_tok() {
            node_name = Some(s.to_string());
            self.bump();
        }
        let mut stream = StreamKind::Compute;
        if self.at_punct('@') {
            self.bump();
            let sspan = self.span();
            let w = match self.peek_tok() {
                Tok::Word(w) => *w,
                _ => return Err(self.unexpected("a stream name after `@`")),
            };
            stream = StreamKind::from_name(w).ok_or_else(|| {
                self.error_help(
                    sspan,
                    format!("unknown stream `{w}`"),
                    "not a stream",
                    "streams are compute, allgather and reducescatter".into(),
                )
            })?;
            self.bump();
        }
        Ok((node_name, stream))
    }

    /// The output types of `op` on `inputs` by its type rule; an error lists the inputs.
    fn node_types(
        &self,
        op: &Op,
        op_name: &str,
        op_span: Span,
        inputs: &[ValueId],
    ) -> PResult<Vec<TensorType>> {
        let out_tys = {
            let ins: Vec<&TensorType> = inputs
                .iter()
                .map(|&v| &self.prog.values[v.index()].ty)
                .collect();
            let mesh = self.prog.mesh.as_ref();
            let inferred = guard_infer(op, &ins, mesh)
                .and_then(|()| op.infer(&ins, mesh))
                .and_then(|tys| {
                    if tys.iter().all(type_fits) {
                        Ok(tys)
                    } else {
                        Err(format!(
                            "{op_name} would make a tensor of more than 2^62 elements"
                        ))
                    }
                });
            match inferred {
                Ok(t) => t,
                Err(e) => {
                    let described: Vec<String> = inputs
                        .iter()
                        .map(|&v| {
                            let val = &self.prog.values[v.index()];
                            format!("{} : {}", super::value_ref(&val.name), val.ty)
                        })
                        .collect();
                    let help = if described.is_empty() {
                        "the node has no inputs".to_string()
                    } else {
                        format!("inputs: {}", described.join(", "))
                    };
                    return Err(self.error_help(
                        op_span,
                        e,
                        "the op's type rule rejects this node",
                        help,
                    ));
                }
            }
        };
        Ok(out_tys)
    }

    /// The outputs named match the op's count and the declared types its type rule.
    fn check_outputs(
        &self,
        op_name: &str,
        op_span: Span,
        out_tys: &[TensorType],
        outs: &[(String, Span)],
        declared: Option<&[(TensorType, Span)]>,
    ) -> PResult<()> {
        if out_tys.len() != outs.len() {
            let span = match (outs.first(), outs.last()) {
                (Some(f), Some(l)) => (f.1 .0, l.1 .1),
                _ => op_span,
            };
            return Err(self.error_at(
                span,
                format!(
                    "{op_name} makes {} output{}, but {} {} named",
                    out_tys.len(),
                    if out_tys.len() == 1 { "" } else { "s" },
                    outs.len(),
                    if outs.len() == 1 { "is" } else { "are" }
                ),
                "wrong number of outputs",
            ));
        }
        if let Some(decl) = declared {
            for ((t, (dt, dspan)), (oname, _)) in out_tys.iter().zip(decl).zip(outs) {
                if t != dt {
                    return Err(self.error_at(
                        *dspan,
                        format!(
                            "`{}` is declared {dt}, but {op_name} makes {t}",
                            super::value_ref(oname)
                        ),
                        "does not match the op's type rule",
                    ));
                }
            }
        }
        Ok(())
    }

    /// An optional `role=KIND` or `role=KIND("unit")` after a node's name and stream.
    fn node_role(&mut self) -> PResult<Role> {
        let is_role = matches!(self.peek_tok(), Tok::Word(w) if *w == "role");
        if !is_role {
            return Ok(Role::default());
        }
        self.bump();
        if !self.at_punct('=') {
            return Err(self.unexpected("`=` after `role`"));
        }
        self.bump();
        let span = self.span();
        let kind = match self.peek_tok() {
            Tok::Word(w) => RoleKind::from_name(w).ok_or_else(|| {
                let known: Vec<&str> = RoleKind::ALL.iter().map(|k| k.name()).collect();
                self.error_help(
                    span,
                    format!("unknown role `{w}`"),
                    "not a role",
                    format!("roles are {}", known.join(", ")),
                )
            })?,
            _ => return Err(self.unexpected("a role name after `role=`")),
        };
        self.bump();
        let mut unit = String::new();
        if self.at_punct('(') {
            self.bump();
            match self.peek_tok() {
                Tok::Str(s) => unit = s.to_string(),
                _ => return Err(self.unexpected("the role's unit as a quoted string")),
            }
            self.bump();
            if !self.at_punct(')') {
                return Err(self.unexpected("`)` after the role's unit"));
            }
            self.bump();
        }
        Ok(Role { kind, unit })
    }

    fn attr_value(&mut self) -> PResult<Attr> {
        let span = self.span();
        let tok = self.peek_tok().clone();
        let v = match tok {
            Tok::Num(n) if is_int_text(n) => Attr::Int(self.int_i64(n, span)?),
            Tok::Num(n) => Attr::Float(self.parse_f64(n, span)?),
            Tok::Word("true") => Attr::Bool(true),
            Tok::Word("false") => Attr::Bool(false),
            Tok::Word(w @ ("inf" | "nan")) => Attr::Float(self.parse_f64(w, span)?),
            Tok::Word(w) => Attr::Word(w.to_string()),
            Tok::Str(s) => Attr::Word(s.into_owned()),
            Tok::Punct('[') => {
                self.bump();
                return self.attr_list();
            }
            _ => return Err(self.unexpected("an attribute value")),
        };
        self.bump();
        Ok(v)
    }

    /// After `[`: integers (a list) or names (a group of mesh axes), then `]`.
    fn attr_list(&mut self) -> PResult<Attr> {
        let mut ints = Vec::new();
        let mut words = Vec::new();
        if !self.at_punct(']') {
            loop {
                let span = self.span();
                match self.peek_tok().clone() {
                    Tok::Num(n) if words.is_empty() => ints.push(self.int_i64(n, span)?),
                    Tok::Word(w) if ints.is_empty() => words.push(w.to_string()),
                    Tok::Str(s) if ints.is_empty() => words.push(s.into_owned()),
                    Tok::Num(_) | Tok::Word(_) | Tok::Str(_) => {
                        return Err(self.error_at(
                            span,
                            "a list mixes integers and names".into(),
                            "lists hold integers, groups hold mesh axis names",
                        ))
                    }
                    _ => return Err(self.unexpected("an integer or a mesh axis name")),
                }
                self.bump();
                if !self.eat_punct(',') {
                    break;
                }
            }
        }
        if !self.at_punct(']') {
            return Err(self.unexpected("`,` or `]`"));
        }
        self.bump();
        Ok(if words.is_empty() {
            Attr::Ints(ints)
        } else {
            Attr::Group(Group { axes: words })
        })
    }

    fn unknown_op(&self, name: &str, span: Span, statement_start: bool) -> ParseError {
        let mut pool: Vec<&str> = Op::all_names();
        if statement_start {
            pool.extend(KEYWORDS);
        }
        let close = close_names(name, &pool);
        let looks_like_keyword =
            statement_start && name.starts_with(|c: char| c.is_ascii_lowercase());
        let message = if looks_like_keyword {
            format!(
                "expected a statement (program, mesh, input, param, const, output, or a node), found `{name}`"
            )
        } else {
            format!("unknown op `{name}`")
        };
        let help = if !close.is_empty() {
            format!(
                "did you mean {}?",
                close
                    .iter()
                    .map(|c| format!("`{c}`"))
                    .collect::<Vec<_>>()
                    .join(" or ")
            )
        } else {
            format!("known ops: {}", Op::all_names().join(", "))
        };
        self.error_help(span, message, "unknown name", help)
    }

    // ---------------------------------------------------------------- the end

    fn resolve(&self, name: &str, span: Span) -> PResult<ValueId> {
        self.names.get(name).copied().ok_or_else(|| {
            self.error_at(
                span,
                format!("unknown value `{}`", super::value_ref(name)),
                "not defined in this program",
            )
        })
    }

    fn finish(mut self) -> PResult<Program> {
        let outputs = std::mem::take(&mut self.outputs);
        for (name, span) in &outputs {
            let v = self.resolve(name, *span)?;
            self.prog.outputs.push(v);
        }
        let updates = std::mem::take(&mut self.updates);
        for ((t, tspan), (v, vspan)) in &updates {
            let target = self.resolve(t, *tspan)?;
            let value = self.resolve(v, *vspan)?;
            self.prog.updates.push(Update { target, value });
        }
        if let Some((list, span)) = self.order.take() {
            self.apply_order(&list, span)?;
        }
        if let Err(e) = crate::verify::verify(&self.prog) {
            let span = self.locate(&e.location);
            return Err(self.error_at(span, e.to_string(), "the verifier rejects this"));
        }
        Ok(self.prog)
    }

    /// Renumbers values as the `order` line lists them.
    fn apply_order(&mut self, list: &[(String, Span)], stmt: Span) -> PResult<()> {
        let n = self.prog.values.len();
        let mut new_id = vec![u32::MAX; n];
        for (k, (name, span)) in list.iter().enumerate() {
            let old = self.resolve(name, *span)?;
            if new_id[old.index()] != u32::MAX {
                return Err(self.error_at(
                    *span,
                    format!("`order` lists `{}` twice", super::value_ref(name)),
                    "repeated",
                ));
            }
            new_id[old.index()] = k as u32;
        }
        if let Some(missing) = new_id.iter().position(|&x| x == u32::MAX) {
            return Err(self.error_at(
                stmt,
                format!(
                    "`order` must list every value; it lacks `{}`",
                    super::value_ref(&self.prog.values[missing].name)
                ),
                "incomplete",
            ));
        }
        let map = |v: &mut ValueId| *v = ValueId(new_id[v.index()]);
        let mut values: Vec<Option<Value>> = vec![None; n];
        let mut spans = vec![(0, 0); n];
        for (old, val) in std::mem::take(&mut self.prog.values)
            .into_iter()
            .enumerate()
        {
            spans[new_id[old] as usize] = self.value_spans[old];
            values[new_id[old] as usize] = Some(val);
        }
        self.prog.values = values.into_iter().flatten().collect();
        self.value_spans = spans;
        for node in &mut self.prog.nodes {
            node.inputs.iter_mut().for_each(map);
            node.outputs.iter_mut().for_each(map);
        }
        self.prog.inputs.iter_mut().for_each(map);
        self.prog.outputs.iter_mut().for_each(map);
        self.prog.params.iter_mut().for_each(|p| map(&mut p.value));
        self.prog.consts.iter_mut().for_each(|c| map(&mut c.value));
        self.prog.states.iter_mut().for_each(|c| map(&mut c.value));
        self.prog.updates.iter_mut().for_each(|u| {
            map(&mut u.target);
            map(&mut u.value);
        });
        self.names.values_mut().for_each(map);
        Ok(())
    }

    /// The span a verifier location (`node `n` (Op)`, `value `x``, ...) refers to.
    fn locate(&self, location: &str) -> Span {
        let quoted = location
            .split_once('`')
            .and_then(|(_, rest)| rest.rsplit_once('`'))
            .map(|(inner, _)| inner);
        if let Some(name) = quoted {
            if location.starts_with("node") {
                if let Some(i) = self.prog.nodes.iter().position(|n| n.name == name) {
                    return self.node_spans[i];
                }
            } else if let Some(&v) = self.names.get(name) {
                return self.value_spans[v.index()];
            }
        }
        (0, 0)
    }
}

/// Every dim and the element count within [`MAX_SIZE`].
fn type_fits(t: &TensorType) -> bool {
    let mut n: usize = 1;
    for &d in &t.shape {
        if d > MAX_SIZE {
            return false;
        }
        n = n.saturating_mul(d);
    }
    t.shape.contains(&0) || n <= MAX_SIZE
}

fn checked_prod(it: impl IntoIterator<Item = usize>) -> Option<usize> {
    it.into_iter()
        .try_fold(1usize, |a, d| a.checked_mul(d))
        .filter(|&n| n <= MAX_SIZE)
}

/// Rejects attribute and shape combinations whose arithmetic in [`Op::infer`] would overflow,
/// so that the type rule never panics on user input.
fn guard_infer(op: &Op, ins: &[&TensorType], mesh: Option<&Mesh>) -> Result<(), String> {
    let too_big = || format!("{}: sizes overflow (the limit is 2^62)", op.name());
    let group_size = |g: &Group| -> Result<Option<usize>, String> {
        let Some(mesh) = mesh else { return Ok(None) };
        let sizes: Option<Vec<usize>> = g
            .axes
            .iter()
            .map(|a| mesh.axis(a).map(|x| x.size))
            .collect();
        match sizes {
            None => Ok(None),
            Some(s) => checked_prod(s).map(Some).ok_or_else(too_big),
        }
    };
    match op {
        Op::Reshape { shape } | Op::Expand { shape } | Op::Fill { shape, .. }
            if shape.iter().any(|&d| d > MAX_SIZE)
                || (!shape.contains(&0) && checked_prod(shape.iter().copied()).is_none()) =>
        {
            return Err(too_big());
        }
        Op::Tile { repeats } => {
            if let [x] = ins {
                if repeats.len() == x.rank() {
                    let dims: Option<Vec<usize>> = x
                        .shape
                        .iter()
                        .zip(repeats)
                        .map(|(&d, &r)| d.checked_mul(r).filter(|&n| n <= MAX_SIZE))
                        .collect();
                    match dims {
                        Some(d) if d.contains(&0) || checked_prod(d.iter().copied()).is_some() => {}
                        _ => return Err(too_big()),
                    }
                }
            }
        }
        Op::Split { sizes, .. } => {
            sizes
                .iter()
                .try_fold(0usize, |a, &s| a.checked_add(s))
                .ok_or_else(too_big)?;
        }
        Op::Concat { axis } => {
            ins.iter()
                .filter_map(|t| t.shape.get(*axis))
                .try_fold(0usize, |a, &s| a.checked_add(s).filter(|&n| n <= MAX_SIZE))
                .ok_or_else(too_big)?;
        }
        Op::Slice { steps, .. } if steps.iter().any(|s| s.unsigned_abs() > MAX_SIZE as u64) => {
            return Err(format!("Slice: steps must lie within ±2^62, got {steps:?}"));
        }
        Op::AllGather { group, axis }
        | Op::AllToAll {
            group,
            concat_axis: axis,
            ..
        } => {
            if let (Some(n), [x]) = (group_size(group)?, ins) {
                if let Some(&d) = x.shape.get(*axis) {
                    d.checked_mul(n)
                        .filter(|&m| m <= MAX_SIZE)
                        .ok_or_else(too_big)?;
                }
            }
        }
        Op::ReduceScatter { group, .. }
        | Op::AllReduce { group, .. }
        | Op::Broadcast { group, .. } => {
            group_size(group)?;
        }
        Op::MoeDispatch { experts, capacity } => {
            if let Some(&h) = ins.first().and_then(|x| x.shape.get(1)) {
                checked_prod([*experts, *capacity, h]).ok_or_else(too_big)?;
            }
        }
        _ => {}
    }
    Ok(())
}

/// Up to three names close to `name` (case-insensitive edit distance).
fn close_names<'n>(name: &str, pool: &[&'n str]) -> Vec<&'n str> {
    if name.len() > 64 {
        return Vec::new();
    }
    let lower = name.to_ascii_lowercase();
    let mut scored: Vec<(usize, &str)> = pool
        .iter()
        .map(|c| (edit_distance(&lower, &c.to_ascii_lowercase()), *c))
        .filter(|(d, c)| *d <= (c.len() / 3).max(1))
        .collect();
    scored.sort();
    scored.dedup_by(|a, b| a.1 == b.1);
    scored.into_iter().take(3).map(|(_, c)| c).collect()
}

/// Optimal-string-alignment distance (edits and adjacent transpositions).
fn edit_distance(a: &str, b: &str) -> usize {
    let a: Vec<char> = a.chars().collect();
    let b: Vec<char> = b.chars().collect();
    let w = b.len() + 1;
    let mut d = vec![0usize; (a.len() + 1) * w];
    for (i, row) in d.chunks_mut(w).enumerate() {
        row[0] = i;
    }
    for (j, x) in d.iter_mut().take(w).enumerate() {
        *x = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            let mut v = (d[(i - 1) * w + j] + 1)
                .min(d[i * w + j - 1] + 1)
                .min(d[(i - 1) * w + j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                v = v.min(d[(i - 2) * w + j - 2] + 1);
            }
            d[i * w + j] = v;
        }
    }
    d[a.len() * w + b.len()]
}
