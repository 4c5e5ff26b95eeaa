//! The text form's errors: the right place, and a message that names the thing.

mod text_common;

use hzp_ir::text::{self, ParseError};
use hzp_ir::*;
use std::collections::HashMap;
use text_common::*;

fn parse_err(src: &str) -> ParseError {
    parse_err_with(src, &|_| None)
}

fn parse_err_with(src: &str, data: &dyn Fn(&str) -> Option<Tensor>) -> ParseError {
    match text::parse(src, "bad.hzp", data) {
        Ok(p) => panic!("expected an error, got a program:\n{}", text::print(&p)),
        Err(e) => e,
    }
}

/// Asserts the error's line, column and that the message contains `needle`.
#[track_caller]
fn check(e: &ParseError, line: usize, column: usize, needle: &str) {
    assert!(
        e.message().contains(needle),
        "message `{}` lacks `{needle}`",
        e.message()
    );
    assert_eq!(
        (e.line(), e.column()),
        (line, column),
        "wrong place for `{}`",
        e.message()
    );
    let shown = e.to_string();
    assert!(
        shown.starts_with(&format!("bad.hzp:{line}:{column}: ")),
        "{shown}"
    );
}

const HEAD: &str = "program \"p\"\ninput %x : f32[2,3]\n";

#[test]
fn unexpected_character() {
    let e = parse_err("input %x : f32[2]\ninput $y : f32[2]\n");
    check(&e, 2, 7, "unexpected character `$`");
}

#[test]
fn unterminated_string() {
    let e = parse_err("program \"abc\ninput %x : f32[2]\n");
    check(&e, 1, 9, "unterminated string");
    let e = parse_err("program \"abc\\");
    check(&e, 1, 9, "unterminated string");
    let e = parse_err("input %\"abc");
    check(&e, 1, 8, "unterminated string");
}

#[test]
fn invalid_escape() {
    let e = parse_err("program \"a\\qb\"\n");
    check(&e, 1, 11, "invalid escape");
    let e = parse_err("program \"a\\u{110000}\"\n");
    check(&e, 1, 11, "invalid escape");
}

#[test]
fn unknown_value() {
    let e = parse_err(&format!("{HEAD}%y = Relu(%x)\n%z = Add(%y, %w)\n"));
    check(&e, 4, 14, "unknown value `%w`");
}

#[test]
fn use_before_definition() {
    let e = parse_err(&format!("{HEAD}%z = Add(%x, %y)\n%y = Relu(%x)\n"));
    check(&e, 3, 14, "unknown value `%y`");
}

#[test]
fn duplicate_names() {
    let e = parse_err(&format!("{HEAD}param %x : f32[2]\n"));
    check(&e, 3, 7, "value `%x` is defined twice (first on line 2)");
    let e = parse_err(&format!(
        "{HEAD}%y = Relu(%x)\n%a, %y = Split{{axis=0, sizes=[1,1]}}(%x)\n"
    ));
    check(&e, 4, 5, "value `%y` is defined twice (first on line 3)");
}

#[test]
fn unknown_op_suggests_close_names() {
    let e = parse_err(&format!("{HEAD}%y = Matmul(%x, %x)\n"));
    check(&e, 3, 6, "unknown op `Matmul`");
    assert!(
        e.help_text().unwrap().contains("`MatMul`"),
        "{:?}",
        e.help_text()
    );
    let e = parse_err(&format!("{HEAD}%y = Frobnicate(%x)\n"));
    check(&e, 3, 6, "unknown op `Frobnicate`");
    let help = e.help_text().unwrap();
    assert!(help.starts_with("known ops: "), "{help}");
    assert!(help.contains("ReduceScatter"), "{help}");
}

#[test]
fn misspelled_keyword() {
    let e = parse_err("inptu %x : f32[2]\n");
    check(&e, 1, 1, "expected a statement");
    assert!(e.help_text().unwrap().contains("`input`"));
}

#[test]
fn bad_attributes() {
    let e = parse_err(&format!("{HEAD}%y = Softmax(%x)\n"));
    check(&e, 3, 6, "needs attribute `axis`");
    let e = parse_err(&format!("{HEAD}%y = Softmax{{axs=1}}(%x)\n"));
    check(&e, 3, 14, "needs attribute `axis`");
    assert_eq!(e.help_text(), Some("did you mean `axis`?"));
    let e = parse_err(&format!("{HEAD}%y = Softmax{{axis=1, extra=2}}(%x)\n"));
    check(
        &e,
        3,
        22,
        "op `Softmax` has no attribute `extra` (it has: axis)",
    );
    let e = parse_err(&format!("{HEAD}%y = Softmax{{axis=1.5}}(%x)\n"));
    check(
        &e,
        3,
        14,
        "attribute `axis` of `Softmax` must be an integer",
    );
    let e = parse_err(&format!("{HEAD}%y = Softmax{{axis=-1}}(%x)\n"));
    check(&e, 3, 14, "must be non-negative");
    let e = parse_err(&format!("{HEAD}%y = Softmax{{axis=1, axis=1}}(%x)\n"));
    check(&e, 3, 22, "attribute `axis` is given twice");
    let e = parse_err(&format!("{HEAD}%y = Cast{{to=f64}}(%x)\n"));
    check(&e, 3, 11, "unknown dtype `f64`");
    let e = parse_err(&format!("{HEAD}%y = Reshape{{shape=[1,a]}}(%x)\n"));
    check(&e, 3, 23, "mixes integers and names");
    let e = parse_err(&format!("{HEAD}%y = Reshape{{shape=[1,2.5]}}(%x)\n"));
    check(&e, 3, 23, "expected an integer, got `2.5`");
}

#[test]
fn integers_that_overflow() {
    let e = parse_err(&format!(
        "{HEAD}%y = Trilu{{upper=true, k=9223372036854775808}}(%x)\n"
    ));
    check(
        &e,
        3,
        26,
        "integer `9223372036854775808` does not fit in 64 bits",
    );
    let e = parse_err("const %c : i32[1] = [2147483648]\n");
    check(&e, 1, 22, "integer `2147483648` does not fit in i32");
    let e = parse_err("input %x : f32[99999999999999999999999]\n");
    check(
        &e,
        1,
        16,
        "a dimension `99999999999999999999999` is too large",
    );
    let e = parse_err("input %x : f32[4611686018427387904,2]\n");
    check(&e, 1, 12, "has too many elements");
    let e = parse_err("input %x : f32[-1]\n");
    check(&e, 1, 16, "a dimension must be a non-negative integer");
}

#[test]
fn literal_length_and_element_kinds() {
    let e = parse_err("const %c : i64[2,2] = [1, 2, 3]\n");
    check(
        &e,
        1,
        23,
        "constant `c` is i64[2,2], which has 4 elements, but the list has 3",
    );
    let e = parse_err("const %c : i64[2] = [1, 2, 3]\n");
    check(
        &e,
        1,
        28,
        "constant `c` is i64[2], which has 2 elements, but the list is longer",
    );
    let e = parse_err("const %c : i64[2] = [1, 2.5]\n");
    check(&e, 1, 25, "expected an integer, got `2.5`");
    let e = parse_err("const %c : bool[1] = [1]\n");
    check(&e, 1, 23, "`true` or `false`");
    let e = parse_err("const %c : f32[1] = [true]\n");
    check(&e, 1, 22, "a number for this f32 constant");
    let e = parse_err("const %c : f32[1] = 1.0\n");
    check(&e, 1, 21, "expected a literal list");
}

#[test]
fn declared_type_mismatch_points_at_the_type() {
    let e = parse_err(&format!("{HEAD}%y = Relu(%x) : f32[3,2] \"r\"\n"));
    check(
        &e,
        3,
        17,
        "`%y` is declared f32[3,2], but Relu makes f32[2,3]",
    );
    let e = parse_err(&format!("{HEAD}%y = Cast{{to=bf16}}(%x) : f32[2,3]\n"));
    check(&e, 3, 26, "declared f32[2,3], but Cast makes bf16[2,3]");
}

#[test]
fn type_rule_errors_point_at_the_op() {
    let e = parse_err(&format!("{HEAD}%y = MatMul(%x, %x)\n"));
    check(&e, 3, 6, "MatMul: inner dimensions differ");
    assert!(e.help_text().unwrap().contains("%x : f32[2,3]"));
    let e = parse_err(&format!(
        "{HEAD}%y = AllGather{{group=[gpu], axis=0}}(%x)\n"
    ));
    check(&e, 3, 6, "needs a mesh");
    let e = parse_err(&format!(
        "mesh node=2\n{HEAD}%y = AllGather{{group=[gpu], axis=0}}(%x)\n"
    ));
    check(
        &e,
        4,
        6,
        "group [gpu] names an axis that is not in the mesh",
    );
}

#[test]
fn output_counts() {
    let e = parse_err(&format!("{HEAD}%a, %b = Relu(%x)\n"));
    check(&e, 3, 1, "Relu makes 1 output, but 2 are named");
    let e = parse_err(&format!(
        "{HEAD}%a, %b = Split{{axis=0, sizes=[1,1]}}(%x) : f32[1,3]\n"
    ));
    check(&e, 3, 43, "2 outputs are named but 1 type is given");
    let e = parse_err(&format!("{HEAD}Relu(%x)\n"));
    check(&e, 3, 1, "Relu makes 1 output, but 0 are named");
}

#[test]
fn weights_file_problems() {
    let e = parse_err("const %mask : bool[1,1,16,16] = @data\n");
    check(
        &e,
        1,
        33,
        "constant `mask` has its data in the weights file, but the weights file has no entry `mask`",
    );
    let mut w = HashMap::new();
    w.insert("w".to_string(), Tensor::f32(vec![2], vec![1.0, 2.0]));
    let e = parse_err_with("input %x : f32[2]\nparam %w : f32[3]\n", &|n| {
        w.get(n).cloned()
    });
    check(
        &e,
        2,
        12,
        "parameter `w` is declared f32[3], but the weights file has f32[2] for it",
    );
    let e = parse_err_with("const %w : f32[3] = @data\n", &|n| w.get(n).cloned());
    check(
        &e,
        1,
        12,
        "constant `w` is declared f32[3], but the weights file has f32[2]",
    );
    // an inconsistent tensor from the loader is an error, not a panic
    let broken = Tensor {
        shape: vec![5],
        data: Data::F32(vec![1.0]),
    };
    let e = parse_err_with("param %w : f32[5]\n", &|_| Some(broken.clone()));
    check(&e, 1, 12, "has shape [5] but 1 elements");
}

#[test]
fn unknown_dtype_and_stream() {
    let e = parse_err("input %x : f64[2]\n");
    check(&e, 1, 12, "unknown dtype `f64`");
    let e = parse_err("input %x : f32[2]\n%y = Neg(%x) : f32[2] \"n\" @nccl\n");
    check(&e, 2, 28, "unknown stream `nccl`");
}

#[test]
fn mesh_errors() {
    let e = parse_err("input %x : f32[2]\n%y = Neg(%x)\nmesh gpu=2\n");
    check(&e, 3, 1, "the mesh must come before the first node");
    let e = parse_err("mesh gpu=2,gpu=4\n");
    check(&e, 1, 12, "mesh axis `gpu` appears twice");
    let e = parse_err("mesh gpu=0\n");
    check(&e, 1, 10, "mesh axis `gpu` has size 0");
    let e = parse_err("mesh a=4294967296,b=4294967296\n");
    check(&e, 1, 21, "more than 2^62 ranks");
    let e = parse_err("mesh gpu=2\nmesh gpu=2\n");
    check(&e, 2, 1, "a second `mesh` line (the first is on line 1)");
}

#[test]
fn statement_shape_errors() {
    let e = parse_err("input %x f32[2]\n");
    check(&e, 1, 10, "expected `:`, found `f32`");
    let e = parse_err("input %x : f32[2] extra\n");
    check(
        &e,
        1,
        19,
        "expected the end of the statement, found `extra`",
    );
    let e = parse_err("input % : f32[2]\n");
    check(&e, 1, 7, "expected a value name after `%`");
    let e = parse_err("output\n");
    check(&e, 1, 7, "expected a value like `%x`");
    let e = parse_err("input %x : f32[2]\noutput %y\n");
    check(&e, 2, 8, "unknown value `%y`");
    let e = parse_err("program \"a\"\nprogram \"b\"\n");
    check(&e, 2, 1, "a second `program` line");
    let e = parse_err("= 3\n");
    check(&e, 1, 1, "expected a statement");
    let e = parse_err("input %x : f32[2]\n%y = Neg(%x) : \n");
    check(&e, 2, 16, "expected a type like `f32[2,3]`");
    let e = parse_err("input %x : f32[2]\nFree(%x) : f32[2]\n");
    check(
        &e,
        2,
        10,
        "output types are given, but the node names no outputs",
    );
    let e = parse_err("input %x : f32[1.5]\n");
    check(
        &e,
        1,
        16,
        "a dimension must be a non-negative integer, got `1.5`",
    );
    let e = parse_err("const %c : f32[1] = [1.]\n");
    check(&e, 1, 22, "malformed number");
    let e = parse_err("const %c : f32[1] = [12abc]\n");
    check(&e, 1, 22, "malformed number");
}

#[test]
fn order_line_errors() {
    let src = "input %x : f32[2]\ninput %y : f32[2]\n";
    let e = parse_err(&format!("{src}order %y\n"));
    check(&e, 3, 1, "`order` must list every value; it lacks `%x`");
    let e = parse_err(&format!("{src}order %y, %x, %y\n"));
    check(&e, 3, 15, "`order` lists `%y` twice");
    let e = parse_err(&format!("{src}order %y, %q\n"));
    check(&e, 3, 11, "unknown value `%q`");
    let p = text::parse(&format!("{src}order %y, %x\n"), "ok.hzp", &|_| None).unwrap();
    assert_eq!(p.values[0].name, "y");
    assert_eq!(p.inputs, vec![ValueId(1), ValueId(0)]);
}

#[test]
fn columns_count_characters_not_bytes() {
    let e = parse_err("input %\"ünï\" : f32[2]\n%\"ö\" = Nope(%\"ünï\")\n");
    check(&e, 2, 8, "unknown op `Nope`");
}

#[test]
fn shape_arithmetic_that_would_overflow_is_an_error() {
    let big = 1usize << 61;
    let cases = [
        format!("input %x : f32[{big},2]\n%y = Reshape{{shape=[{big},{big}]}}(%x)\n"),
        format!("input %x : f32[{big},1]\n%y = Tile{{repeats=[1,{big}]}}(%x)\n"),
        format!("input %x : f32[{big}]\n%y = Tile{{repeats=[16]}}(%x)\n"),
        "input %x : f32[2]\n%a, %b = Split{axis=0, sizes=[9223372036854775807,9223372036854775807]}(%x)\n".to_string(),
        format!("input %x : f32[{big}]\n%y = Concat{{axis=0}}(%x, %x, %x, %x)\n"),
        "input %x : f32[8]\n%y = Slice{axes=[0], starts=[0], ends=[8], steps=[9223372036854775807]}(%x)\n".to_string(),
        "input %x : f32[8]\n%y = Slice{axes=[0], starts=[7], ends=[-1], steps=[-9223372036854775808]}(%x)\n".to_string(),
        format!("mesh gpu={big}\ninput %x : f32[{big}]\n%y = AllGather{{group=[gpu], axis=0}}(%x)\n"),
        format!("mesh gpu={big}\ninput %x : f32[{big}]\n%y = AllReduce{{group=[gpu,gpu,gpu], reduce=sum}}(%x)\n"),
        format!("mesh gpu={big}\ninput %x : f32[2,4]\n%y = AllToAll{{group=[gpu], split_axis=1, concat_axis=0}}(%x)\n"),
        format!("input %x : i64[{big}]\nconst %v : f32[2] = [0.0, 1.0]\n%y = OneHot{{axis=1, depth={big}}}(%x, %v)\n"),
        format!("%y = Fill{{value=1.0, dtype=f32, shape=[{big},{big}]}}()\n"),
        format!("input %x : f32[1]\n%y = Expand{{shape=[{big},{big},{big}]}}(%x)\n"),
    ];
    for src in &cases {
        let e = parse_err(src);
        // the node on the last line is rejected, with the op named
        assert_eq!(e.line(), src.lines().count(), "{src}: {e}");
        let last = src.lines().last().unwrap();
        assert_eq!(e.column(), last.find("= ").unwrap() + 3, "{src}: {e}");
    }
}

#[test]
fn renders_with_miette() {
    let e = parse_err(&format!("{HEAD}%y = Matmul(%x, %x)\n"));
    let mut out = String::new();
    miette::GraphicalReportHandler::new_themed(miette::GraphicalTheme::unicode_nocolor())
        .render_report(&mut out, &e)
        .unwrap();
    assert!(out.contains("bad.hzp"), "{out}");
    assert!(out.contains("%y = Matmul(%x, %x)"), "{out}");
    assert!(out.contains("unknown name"), "{out}");
    assert!(out.contains("did you mean `MatMul`?"), "{out}");
    let d: &dyn miette::Diagnostic = &e;
    assert_eq!(d.code().unwrap().to_string(), "hzp::text::parse");
    assert_eq!(d.labels().unwrap().next().unwrap().offset(), HEAD.len() + 5);
}

#[test]
fn errors_convert_into_miette_reports() {
    fn send_sync<T: Send + Sync + 'static>() {}
    send_sync::<ParseError>();
    let r: miette::Report = parse_err("input %x : f32[2]\n%y = Nope(%x)\n").into();
    assert!(
        r.to_string().starts_with("bad.hzp:2:6: unknown op `Nope`"),
        "{r}"
    );
}

#[test]
fn empty_and_blank_inputs_are_empty_programs() {
    for src in ["", "\n\n", "# only a comment", "  \t\r\n# c\n"] {
        let p = text::parse(src, "dir/empty.hzp", &|_| None).unwrap();
        assert_eq!(p, Program::new("empty"));
    }
}

#[test]
fn verifier_runs_on_the_result() {
    // A valid program parses; the parser's own checks already cover what the verifier checks,
    // so this just makes sure nothing valid is rejected.
    let p = all_ops();
    let s = text::print(&p);
    let w = weights(&p);
    let q = text::parse(&s, "t.hzp", &|n| w.get(n).cloned()).unwrap();
    verify(&q).unwrap();
}

#[test]
fn unknown_attributes_are_rejected_on_every_op() {
    // Elementwise ops have no attributes; one given is an error, not silently dropped
    // (GELU's tanh approximation would otherwise compute the exact GELU).
    let e = parse_err(&format!("{HEAD}%y = Gelu{{approximate=\"tanh\"}}(%x)\n"));
    assert!(
        e.message()
            .contains("op `Gelu` has no attribute `approximate` (it has: none)")
            && e.message().contains("write GeluTanh"),
        "{}",
        e.message()
    );
    assert_eq!(e.line(), 3);
    let e = parse_err(&format!("{HEAD}%y = Add{{alpha=2}}(%x, %x)\n"));
    assert!(
        e.message().contains("op `Add` has no attribute `alpha`"),
        "{}",
        e.message()
    );
    // Without attributes both still parse.
    text::parse(
        &format!("{HEAD}%y = GeluTanh(%x)\noutput %y\n"),
        "ok.hzp",
        &|_| None,
    )
    .unwrap();
}
