//! The documentation runs: every ```` ```console ```` block in README.md and docs/*.md is a
//! transcript. Lines starting with `$ ` are commands (a trailing `\` continues one); the
//! lines after a command are output it must print, in order (stdout and stderr together).
//! In a quoted line `[..]` matches any text and runs of spaces match any run of spaces; a
//! line `...` stands for any number of lines. Commands run with `sh` in a scratch folder
//! where `tests/` and `examples/` are the repository's and `hzp` is the binary under test,
//! one block per folder, commands in order (a block may use files an earlier command of
//! it wrote). A command that must fail says so with `# exit N` at its end.
//!
//! The prose is checked too: in README.md, ARCHITECTURE.md and docs/*.md, every section that
//! quotes a measured figure names where it comes from (a commit, a test, an examples/ script).

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

/// The files whose figures need provenance: README.md, ARCHITECTURE.md and docs/*.md, less
/// the generated CLI reference (its figures are flag defaults).
fn prose_files() -> Vec<PathBuf> {
    let mut v = doc_files();
    v.insert(1, repo().join("ARCHITECTURE.md"));
    v.retain(|p| !p.ends_with("docs/cli-reference.md"));
    v
}

/// Units that make a number a measured figure: time, size, a percentage, a ratio (`0.41x`).
/// Longest first, so `ms` is read before `s`. A bare `B` is left out: `175B` is a count of
/// parameters more often than of bytes.
const UNITS: &[&str] = &[
    "seconds", "minutes", "second", "minute", "bytes", "hours", "byte", "hour", "mins", "secs",
    "min", "sec", "KiB", "MiB", "GiB", "TiB", "KB", "kB", "MB", "GB", "TB", "ns", "us", "µs", "μs",
    "ms", "s", "h", "%", "x", "×",
];

/// The first measured figure in `line`: a number followed by a unit of [`UNITS`] (ratios
/// with no space, `0.41x`), not part of a name (`fp16`, `H200`), not a flag's value
/// (`--memory 80GiB`, `--timeout=300s`), not a default (`default 300 s`).
fn measured_figure(line: &str) -> Option<String> {
    let c: Vec<char> = line.chars().collect();
    let word = |ch: char| ch.is_alphanumeric() || ch == '_';
    let mut i = 0;
    while i < c.len() {
        let starts = c[i].is_ascii_digit() && (i == 0 || !(word(c[i - 1]) || c[i - 1] == '.'));
        if !starts {
            i += 1;
            continue;
        }
        let mut j = i;
        while j < c.len()
            && (c[j].is_ascii_digit()
                || (matches!(c[j], '.' | ',') && c.get(j + 1).is_some_and(|d| d.is_ascii_digit())))
        {
            j += 1;
        }
        let spaced = c.get(j).is_some_and(|s| *s == ' ' || *s == '\n');
        let at = if spaced { j + 1 } else { j };
        let rest: String = c[at.min(c.len())..].iter().collect();
        let unit = UNITS.iter().find(|u| {
            rest.starts_with(*u)
                && !(spaced && matches!(**u, "x" | "×"))
                && (**u == "%" || !rest[u.len()..].starts_with(word))
        });
        if let Some(u) = unit {
            let before: String = c[..i].iter().collect();
            let mut words = before.split_whitespace().rev();
            // the word the number is in (`--memory=80GiB`, `intra=300GB/s`) and the one
            // before it (`--memory 80GiB`, `--link intra=300GB/s`)
            let near = if before.ends_with(char::is_whitespace) {
                1
            } else {
                2
            };
            let flag = words.clone().take(near).any(|w| {
                w.trim_start_matches(|ch: char| !ch.is_alphanumeric() && ch != '-')
                    .starts_with("--")
            });
            let default = words.by_ref().take(3).any(|w| {
                w.to_lowercase()
                    .trim_matches(|ch: char| !ch.is_alphanumeric())
                    .starts_with("default")
            });
            if !flag && !default {
                let figure: String = c[i..j].iter().collect();
                return Some(format!("{figure}{}{u}", if spaced { " " } else { "" }));
            }
        }
        i = j.max(i + 1);
    }
    None
}

/// Every function the repository defines (`fn name` in Rust, `def name` in Python), so that
/// a backticked name in the docs counts as a test reference only when there is such a test.
fn defined_functions() -> std::collections::BTreeSet<String> {
    let mut names = std::collections::BTreeSet::new();
    let mut stack = vec![repo()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            let name = p.file_name().unwrap().to_string_lossy().to_string();
            if p.is_dir() {
                if !name.starts_with('.') && name != "target" && name != "node_modules" {
                    stack.push(p);
                }
                continue;
            }
            let key = match p.extension().and_then(|e| e.to_str()) {
                Some("rs") => "fn ",
                Some("py") => "def ",
                _ => continue,
            };
            let Ok(text) = std::fs::read_to_string(&p) else {
                continue;
            };
            for part in text.split(key).skip(1) {
                let n: String = part
                    .chars()
                    .take_while(|ch| ch.is_alphanumeric() || *ch == '_')
                    .collect();
                if !n.is_empty() {
                    names.insert(n);
                }
            }
        }
    }
    names
}

/// The provenance markers of `text`: commit hashes (7 to 12 lowercase hex digits, at least
/// one digit and one letter), paths under `tests/` or `examples/`, `cargo test`, and
/// backticked snake_case names.
fn provenance(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    for w in text.split(|ch: char| !ch.is_alphanumeric()) {
        let hex = w
            .chars()
            .all(|ch| ch.is_ascii_digit() || ('a'..='f').contains(&ch));
        if (7..=12).contains(&w.len())
            && hex
            && w.chars().any(|ch| ch.is_ascii_digit())
            && w.chars().any(|ch| ch.is_ascii_lowercase())
        {
            found.push(format!("commit {w}"));
        }
    }
    let path_char = |ch: char| ch.is_alphanumeric() || matches!(ch, '_' | '.' | '/' | '-');
    for w in text.split(|ch: char| !path_char(ch)) {
        let w = w.trim_end_matches('.');
        if w.contains("tests/") || w.starts_with("examples/") {
            found.push(format!("path {w}"));
        }
    }
    if text.contains("cargo test") {
        found.push("cargo test".into());
    }
    for (k, s) in text.split('`').enumerate() {
        let snake = s.contains('_')
            && s.starts_with(|ch: char| ch.is_ascii_lowercase())
            && s.chars()
                .all(|ch| ch.is_ascii_lowercase() || ch.is_ascii_digit() || ch == '_');
        if k % 2 == 1 && snake {
            found.push(format!("name {s}"));
        }
    }
    found
}

/// The sections (heading, text outside fenced code) of a Markdown file.
fn sections(text: &str) -> Vec<(String, String)> {
    let mut out = vec![("(before the first heading)".to_string(), String::new())];
    let mut fenced = false;
    for l in text.lines() {
        if l.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        if l.starts_with('#') {
            out.push((l.trim_start_matches('#').trim().to_string(), String::new()));
        } else {
            let body = &mut out.last_mut().unwrap().1;
            body.push_str(l);
            body.push('\n');
        }
    }
    out
}

/// Whether a marker points at something that exists: a commit `git` knows, a path in the
/// repository, a function the repository defines.
fn marker_holds(
    m: &str,
    functions: &std::collections::BTreeSet<String>,
    commits: &dyn Fn(&str) -> bool,
) -> bool {
    if let Some(h) = m.strip_prefix("commit ") {
        commits(h)
    } else if let Some(p) = m.strip_prefix("path ") {
        repo().join(p).exists()
    } else if let Some(n) = m.strip_prefix("name ") {
        functions.contains(n)
    } else {
        true
    }
}

/// Whether `hash` names a commit of this repository. Where there is no history to ask (no
/// `git`, no repository, a shallow clone) every hash is taken as given, and the skip recorded.
fn commit_checker() -> Box<dyn Fn(&str) -> bool> {
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .arg("-C")
            .arg(repo())
            .args(args)
            .output()
            .ok()
    };
    let shallow = git(&["rev-parse", "--is-shallow-repository"]);
    match shallow {
        Some(o) if o.status.success() && String::from_utf8_lossy(&o.stdout).trim() == "false" => {
            Box::new(move |h: &str| {
                git(&["cat-file", "-e", &format!("{h}^{{commit}}")])
                    .is_some_and(|o| o.status.success())
            })
        }
        _ => {
            skip::skip(
                "",
                skip::Missing::Other,
                "no full git history here: the commits the docs cite are not checked to exist",
            );
            Box::new(|_: &str| true)
        }
    }
}

#[test]
fn measured_figures_name_their_provenance() {
    let functions = defined_functions();
    let commits = commit_checker();
    let (mut measured, mut bad) = (0, Vec::new());
    for f in prose_files() {
        let text = std::fs::read_to_string(&f).unwrap();
        let file = f.strip_prefix(repo()).unwrap().display().to_string();
        for (heading, body) in sections(&text) {
            let Some(figure) = measured_figure(&body) else {
                continue;
            };
            measured += 1;
            let markers = provenance(&body);
            if markers
                .iter()
                .any(|m| marker_holds(m, &functions, &*commits))
            {
                continue;
            }
            let stale = if markers.is_empty() {
                String::new()
            } else {
                format!(" (it names {}, none of which exists)", markers.join(", "))
            };
            bad.push(format!("{file}: \"{heading}\": `{figure}`{stale}"));
        }
    }
    assert!(
        measured >= 20,
        "only {measured} sections with measured figures found: the scanner lost them"
    );
    assert!(
        bad.is_empty(),
        "{} sections quote a measured figure (first one shown) without naming the commit, \
         the test (tests/..., `test_name`, cargo test) or the examples/ script behind it:\n{}",
        bad.len(),
        bad.join("\n")
    );
}

#[test]
fn the_figure_scanner_finds_figures_and_markers() {
    // figures: times, sizes, percentages, ratios
    for (line, fig) in [
        ("a step takes 35.8 us here", "35.8 us"),
        ("peak 83.6 GiB on the H200", "83.6 GiB"),
        ("within 2% of the run", "2%"),
        ("0.41x the baseline", "0.41x"),
        ("it took 1,200 ms", "1,200 ms"),
        ("| 12 s | 3 |", "12 s"),
    ] {
        assert_eq!(measured_figure(line).as_deref(), Some(fig), "{line}");
    }
    // not figures: names, flag values, defaults, counts, products of sizes
    for line in [
        "fp16 on an H200 with 8 GPUs",
        "compile with `--memory 80GiB`",
        "compile with --memory=80GiB and --timeout 30s",
        "the timeout (default 300 s) applies",
        "the timeout (default\n300 s) applies",
        "[--link intra=300GB/s,inter=25GB/s]",
        "GPT-3 175B on node=128,gpu=8",
        "a 2x2 mesh of 4 steps",
        "the x86_64 build",
    ] {
        assert_eq!(measured_figure(line), None, "{line}");
    }
    let names = |t: &str| provenance(t);
    assert!(names("measured at 810fb8b on one H200").contains(&"commit 810fb8b".to_string()));
    assert!(names("see tests/fuzz.rs.").contains(&"path tests/fuzz.rs".to_string()));
    assert!(names("see runtime/tests/a.rs").contains(&"path runtime/tests/a.rs".to_string()));
    assert!(names("`cuda_pasa` asserts it").contains(&"name cuda_pasa".to_string()));
    assert!(names("run examples/bench.py").contains(&"path examples/bench.py".to_string()));
    // not markers: a plain word, a number, a flag, a CamelCase name
    assert!(names("deadbeefs 1234567 `--max-steps` `CompileArgs` faced").is_empty());
    // a marker must exist: this function does, a made-up one does not
    let functions = defined_functions();
    let yes = |_: &str| true;
    assert!(marker_holds("name measured_figure", &functions, &yes));
    assert!(!marker_holds(
        "name no_such_test_anywhere",
        &functions,
        &yes
    ));
    assert!(!marker_holds(
        "path tests/no_such_file.rs",
        &functions,
        &yes
    ));
    // sections: a fenced figure is not prose, a heading starts a section
    let s = sections("# A\n```\n9 ms\n```\ntext\n## B\n5 ms\n");
    assert_eq!(s.len(), 3);
    assert_eq!(s[1], ("A".to_string(), "text\n".to_string()));
    assert!(measured_figure(&s[2].1).is_some());
}
