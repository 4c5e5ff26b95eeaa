//! The documentation runs: every ```` ```console ```` block in README.md and docs/*.md is a
//! transcript. Lines starting with `$ ` are commands (a trailing `\` continues one); the
//! lines after a command are output it must print, in order (stdout and stderr together).
//! In a quoted line `[..]` matches any text and runs of spaces match any run of spaces; a
//! line `...` stands for any number of lines. Commands run with `sh` in a scratch folder
//! where `tests/` and `examples/` are the repository's and `hzp` is the binary under test,
//! one block per folder, commands in order (a block may use files an earlier command of
//! it wrote). A command that must fail says so with `# exit N` at its end.

mod common;
use common::*;
use std::path::{Path, PathBuf};

/// One command of a transcript and the lines it quotes.
struct Step {
    file: String,
    line: usize,
    command: String,
    exit: i32,
    expect: Vec<String>,
}

/// The transcripts of one Markdown file, one list of steps per block.
fn transcripts(path: &Path) -> Vec<Vec<Step>> {
    let text = std::fs::read_to_string(path).unwrap();
    let file = path
        .strip_prefix(repo())
        .unwrap_or(path)
        .display()
        .to_string();
    let mut blocks = Vec::new();
    let mut lines = text.lines().enumerate().peekable();
    while let Some((_, l)) = lines.next() {
        if l.trim_start() != "```console" {
            continue;
        }
        let mut steps: Vec<Step> = Vec::new();
        let mut continued = false;
        for (n, l) in lines.by_ref() {
            if l.trim_start().starts_with("```") {
                break;
            }
            if continued {
                let step = steps.last_mut().unwrap();
                let part = l.trim();
                continued = part.ends_with('\\');
                step.command.push(' ');
                step.command.push_str(part.trim_end_matches('\\').trim());
                continue;
            }
            if let Some(cmd) = l.strip_prefix("$ ") {
                let mut cmd = cmd.trim().to_string();
                continued = cmd.ends_with('\\');
                if continued {
                    cmd = cmd.trim_end_matches('\\').trim().to_string();
                }
                steps.push(Step {
                    file: file.clone(),
                    line: n + 1,
                    command: cmd,
                    exit: 0,
                    expect: Vec::new(),
                });
            } else if let Some(step) = steps.last_mut() {
                step.expect.push(l.to_string());
            }
        }
        for s in &mut steps {
            if let Some((c, code)) = s.command.rsplit_once("# exit ") {
                s.exit = code.trim().parse().expect("`# exit N` takes a number");
                s.command = c.trim().to_string();
            }
        }
        blocks.push(steps);
    }
    blocks
}

/// Whether `line` matches the quoted `pattern` (`[..]` any text, spaces any spaces).
fn matches(pattern: &str, line: &str) -> bool {
    let norm = |s: &str| s.split_whitespace().collect::<Vec<_>>().join(" ");
    let (pattern, line) = (norm(pattern), norm(line));
    let parts: Vec<&str> = pattern.split("[..]").collect();
    if parts.len() == 1 {
        return pattern == line;
    }
    let mut rest = line.as_str();
    for (i, part) in parts.iter().enumerate() {
        // a wildcard may also stand for the spaces around it
        let part = if i == 0 {
            part.trim_end()
        } else if i == parts.len() - 1 {
            part.trim_start()
        } else {
            part.trim()
        };
        if i == 0 {
            match rest.strip_prefix(part) {
                Some(r) => rest = r,
                None => return false,
            }
        } else if i == parts.len() - 1 {
            return rest.ends_with(part);
        } else {
            match rest.find(part) {
                Some(k) => rest = &rest[k + part.len()..],
                None => return false,
            }
        }
    }
    true
}

/// Checks `out` against the quoted lines: in order, `...` skipping any lines; without a
/// `...` before it, a quoted line must be the next line printed.
fn check(expect: &[String], out: &str) -> Result<(), String> {
    let got: Vec<&str> = out.lines().collect();
    let mut at = 0;
    let mut skip = false;
    for e in expect {
        if e.trim() == "..." {
            skip = true;
            continue;
        }
        let found = if skip {
            (at..got.len()).find(|&k| matches(e, got[k]))
        } else {
            (at < got.len() && matches(e, got[at])).then_some(at)
        };
        match found {
            Some(k) => at = k + 1,
            None => {
                return Err(format!(
                "the documentation quotes\n    {e}\nbut the command printed (from line {}):\n{}",
                at + 1,
                got[at.min(got.len())..]
                    .iter()
                    .take(12)
                    .map(|l| format!("    {l}"))
                    .collect::<Vec<_>>()
                    .join("\n")
            ))
            }
        }
        skip = false;
    }
    Ok(())
}

fn doc_files() -> Vec<PathBuf> {
    let mut v = vec![repo().join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(repo().join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    v.extend(docs);
    v
}

/// A scratch folder with the repository's test models and examples, and `hzp` on PATH.
fn scratch(tag: &str) -> (PathBuf, String) {
    let dir = tempdir(tag);
    #[cfg(unix)]
    for name in ["tests", "examples"] {
        std::os::unix::fs::symlink(repo().join(name), dir.join(name)).unwrap();
    }
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    #[cfg(unix)]
    std::os::unix::fs::symlink(hzp_bin(), bin.join("hzp")).unwrap();
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    (dir, path)
}

#[test]
fn documented_commands_print_what_the_docs_quote() {
    let mut ran = 0;
    let mut failures = Vec::new();
    for f in doc_files() {
        for (b, steps) in transcripts(&f).into_iter().enumerate() {
            let (dir, path) = scratch(&format!("doc{b}"));
            for st in steps {
                let out = std::process::Command::new("sh")
                    .arg("-c")
                    .arg(&st.command)
                    .current_dir(&dir)
                    .env("PATH", &path)
                    .env("NO_COLOR", "1")
                    .env("COLUMNS", "200")
                    .output()
                    .unwrap();
                ran += 1;
                let text = format!(
                    "{}{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                );
                let code = out.status.code().unwrap_or(-1);
                let res = if code != st.exit {
                    Err(format!("exit code {code}, expected {}:\n{text}", st.exit))
                } else {
                    check(&st.expect, &text)
                };
                if let Err(e) = res {
                    failures.push(format!("{}:{}: `{}`: {e}", st.file, st.line, st.command));
                }
            }
        }
    }
    assert!(
        ran >= 6,
        "only {ran} documented commands found: the transcripts were lost"
    );
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
    println!("{ran} documented commands ran as documented");
}

#[test]
fn the_matcher_fails_on_changed_output() {
    let out = "plan for m on gpu=2\n  groups: params [gpu]\n  predicted step 35.8 us\n";
    let ok = |e: &[&str]| check(&e.iter().map(|s| s.to_string()).collect::<Vec<_>>(), out);
    assert!(ok(&["plan for m on gpu=2", "  groups: params [gpu]"]).is_ok());
    assert!(ok(&["...", "  predicted step [..] us"]).is_ok());
    assert!(ok(&["plan for m on [..]", "...", "predicted   step 35.8 us"]).is_ok());
    // a changed figure, a changed word, a missing line, a line out of order
    assert!(ok(&["...", "  predicted step 35.9 us"]).is_err());
    assert!(ok(&["plan for m on gpu=4"]).is_err());
    assert!(ok(&["...", "  exposed communication [..]"]).is_err());
    assert!(ok(&["  groups: params [gpu]"]).is_err());
    assert!(ok(&["...", "  predicted step [..]", "  groups: [..]"]).is_err());
}
