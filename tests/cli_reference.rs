//! The CLI reference (docs/cli-reference.md) is the parser's own `--help` of every command,
//! kept current: `HZP_BLESS=1 cargo test --test cli_reference` rewrites it. Choice flags
//! list their values, and `hzp completions SHELL` completes them.

mod common;
use common::*;

#[test]
fn the_cli_reference_is_current() {
    let now = ok(&["cli-reference"]);
    let path = repo().join("docs/cli-reference.md");
    if std::env::var_os("HZP_BLESS").is_some() {
        std::fs::write(&path, &now).unwrap();
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == now,
        "docs/cli-reference.md is not the parser's current help: run `HZP_BLESS=1 cargo test --test cli_reference` and commit it"
    );
    for cmd in [
        "`hzp compile`",
        "`hzp run`",
        "`hzp checkpoint export`",
        "`hzp completions`",
    ] {
        assert!(now.contains(cmd), "{cmd} missing from the reference");
    }
}

#[test]
fn choice_flags_list_their_values() {
    let help = ok(&["compile", "--help"]);
    for (flag, values) in [
        (
            "--strategy",
            "asynchzp, zero1, zero2, zero3, hsdp, ddp, acco, asyncmesh",
        ),
        ("--recompute", "on, off, auto"),
        ("--reduce-grads", "per-microbatch, per-step"),
        ("--grad-dtype", "f32, bf16, f16"),
        ("--loss", "lm, ce, mean, mse"),
        ("--optimizer", "adamw, sgd, muon"),
        ("--precision", "fp32, bf16, fp16"),
    ] {
        let at = help
            .find(&format!("{flag} "))
            .unwrap_or_else(|| panic!("{flag} not in help"));
        let rest = &help[at..];
        let end = rest[2..].find("\n      -").map_or(rest.len(), |e| e + 2);
        assert!(
            rest[..end].contains(&format!("[possible values: {values}]")),
            "{flag}: {}",
            &rest[..end]
        );
    }
    // the same concept takes the same values everywhere
    for cmd in [vec!["scale", "--help"], vec!["bench", "compile", "--help"]] {
        let h = ok(&cmd);
        assert!(
            h.contains("[possible values: on, off, auto]"),
            "{cmd:?}: {h}"
        );
    }
    // an unknown value is refused by the parser, naming the values
    let err = fails_with(
        &[
            "compile",
            "x.onnx",
            "--mesh",
            "gpu=2",
            "--strategy",
            "zero4",
        ],
        &["zero4"],
    );
    assert!(err.contains("asynchzp"), "{err}");
    // older spellings still parse
    let (code, _, err) = hzp(&[
        "compile",
        "missing.onnx",
        "--mesh",
        "gpu=2",
        "--strategy",
        "FSDP",
    ]);
    assert_eq!(code, 1);
    assert!(!err.contains("invalid value"), "{err}");
}

#[test]
fn completions_cover_commands_and_choices() {
    let bash = ok(&["completions", "bash"]);
    for word in ["compile", "simulate", "checkpoint", "asynchzp", "zero3"] {
        assert!(bash.contains(word), "bash completion lacks {word}");
    }
    let zsh = ok(&["completions", "zsh"]);
    assert!(
        zsh.contains("#compdef hzp"),
        "{}",
        &zsh[..zsh.len().min(200)]
    );
    fails_with(&["completions", "tcsh"], &["tcsh"]);
}
