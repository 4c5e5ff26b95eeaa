//! The text form of programs (`*.hzp`): a deterministic printer ([`print()`]) and a parser
//! ([`parse`]) that reads it back, so that `parse(&print(p), ..) == p` for every valid program
//! (names, value numbering, streams, constant data, mesh, and parameter data supplied by the
//! lookup).
//!
//! # Example
//!
//! ```text
//! program "gpt2_tiny"
//! mesh node=2,gpu=4
//!
//! input %input_ids : i64[2,16]
//! param %"transformer.wte weight" : f32[1000,128]
//! const %c0 : i64[3] = [1, 2, 3]
//! const %mask : bool[1,1,16,16] = @data
//! %x = Gather{axis=0}(%"transformer.wte weight", %input_ids) : f32[2,16,128] "/wte/Gather"
//! %a, %b = Split{axis=2, sizes=[64,64]}(%x) : f32[2,16,64], f32[2,16,64] "split"
//! %g = AllGather{group=[gpu], axis=0}(%a) : f32[8,16,64] "ag" @allgather
//! RecordEvent{event=3}() "rec" @allgather
//! Free(%x) "free_x"
//!
//! output %g, %b
//! ```
//!
//! # Grammar
//!
//! One statement per line; blank lines are ignored and `#` starts a comment that runs to the
//! end of the line.
//!
//! ```text
//! program "NAME"                       optional; defaults to the file stem
//! mesh AXIS=SIZE,AXIS=SIZE,...         optional; before the first node
//! input %NAME : TYPE
//! input %NAME : TYPE = [V, ...]        an input the program was specialized on (its value
//!                                      was folded in at import; any other value is an error)
//! param %NAME : TYPE                   data, if any, from the weights lookup
//! const %NAME : TYPE = [V, V, ...]     row-major literal (the printer inlines <= 16 elements)
//! const %NAME : TYPE = @data           data from the weights lookup
//! state %NAME : TYPE                   persistent state starting at zeros
//! state %NAME : TYPE = [V, ...] | @data  persistent state with an initial value
//! precision compute=DT, master=DT, reduce=DT   mixed-precision policy (training programs)
//! update %TARGET = %VALUE              after a step, a parameter or state takes VALUE
//! %OUT, ... = OP{KEY=ATTR, ...}(%IN, ...) : TYPE, ... "NODE NAME" @STREAM role=ROLE
//! OP{KEY=ATTR, ...}(%IN, ...) "NODE NAME" @STREAM role=ROLE      a node without outputs
//! output %NAME, ...                    may repeat; appends
//! order %NAME, ...                     only for programs whose value numbering is not the
//!                                      order of definition: every value, in id order
//! ```
//!
//! - `%NAME` is bare when the name is made of `A-Z a-z 0-9 _ . - /`, else quoted:
//!   `%"onnx::Gather_5"`. Strings escape `\\`, `\"`, `\n`, `\t`, `\r`, `\0` and other control
//!   characters as `\u{HEX}`.
//! - `TYPE` is `DTYPE[D0,D1,...]` (`f32`, `bf16`, `f16`, `i64`, `i32`, `bool`); a scalar is
//!   `f32[]`.
//! - Attributes come in the order of [`Op::attrs`](crate::Op::attrs); braces are left out for
//!   ops without attributes. `ATTR` is an integer (`-3`), a float (`1e-5`, `0.5`, `inf`, `-inf`,
//!   `nan`; always with `.` or an exponent when printed), `true`/`false`, a word (`bf16`, `sum`),
//!   a list of integers `[1,2,3]`, or a group of mesh axes `[node,gpu]` (`[]` is both the empty
//!   list and the empty group).
//! - Literal values: integers for `i64`/`i32`, numbers (also `inf`, `-inf`, `nan`) for float
//!   types (`bf16`/`f16` print their exact `f32` value), `true`/`false` for `bool`.
//! - Node output types may be left out when writing by hand (`%y = Relu(%x)`): they are
//!   inferred. When given they must equal what the op's type rule makes. The node name may be
//!   left out too: it then defaults to the first output's name (or the op name).
//! - `@STREAM` is `@compute` (the default, never printed), `@allgather` or `@reducescatter`.
//! - `role=ROLE` is the node's [`Role`](crate::Role): `KIND` or `KIND("unit")` with `KIND`
//!   one of `compute` (the default with no unit, never printed), `recompute`, `loss`,
//!   `gather`, `reduce`, `accumulate`, `optimizer`, `regather`.
//!
//! The printer lays out declarations where they sit in the value arena (so a program built
//! layer by layer reads layer by layer), or, if that would use a value before its declaration,
//! all declarations first. When the parser's numbering (order of definition) would differ from
//! the program's, the printer adds an `order` line so that the ids come back exactly.
//!
//! Errors carry the file, line and column, and render with [`miette`].

mod error;
mod lexer;
mod parser;
mod printer;

pub use error::ParseError;
pub use parser::parse;
pub use printer::print;

/// A tensor's values as the text form writes a literal (`[1, 2, 3]`), for messages.
pub fn literal_string(t: &crate::Tensor) -> String {
    crate::tensor::literal_string(t)
}

use crate::program::Program;
use crate::tensor::Tensor;

/// Constants with at most this many elements are printed inline; larger ones as `@data`.
pub const INLINE_CONST_LIMIT: usize = 16;

/// Whether the printer writes this constant's data inline (else it prints `@data`, and the
/// data belongs in the weights file).
pub fn const_is_inline(t: &Tensor) -> bool {
    t.numel() <= INLINE_CONST_LIMIT
}

/// Everything the weights file must hold for [`parse`] to rebuild `p` from `print(p)`:
/// every parameter that has data and every constant printed as `@data`, in program order
/// (parameters first).
pub fn sidecar_entries(p: &Program) -> Vec<(&str, &Tensor)> {
    let name = |v: crate::ValueId| p.values.get(v.index()).map_or("", |v| v.name.as_str());
    let params = p
        .params
        .iter()
        .filter_map(|prm| prm.data.as_ref().map(|d| (name(prm.value), d)));
    let consts = p
        .consts
        .iter()
        .filter(|c| !const_is_inline(&c.data))
        .map(|c| (name(c.value), &c.data));
    let states = p.states.iter().filter_map(|s| {
        s.init
            .as_ref()
            .filter(|t| !const_is_inline(t))
            .map(|t| (name(s.value), t))
    });
    params.chain(consts).chain(states).collect()
}

/// Whether a value name prints bare after `%` (else it is quoted).
pub fn is_bare_name(name: &str) -> bool {
    !name.is_empty() && name.chars().all(lexer::is_bare_name_char)
}

/// A value reference as the text form writes it: `%x` or `%"any name"`.
pub fn value_ref(name: &str) -> String {
    let mut s = String::with_capacity(name.len() + 3);
    printer::write_value_ref(&mut s, name);
    s
}

/// A string literal with `"` and `\` and control characters escaped.
pub fn quote(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    printer::write_quoted(&mut out, s);
    out
}
