#!/usr/bin/env python3
"""Lists the import circles between the files of hzp's crates.

Usage: python3 examples/tools/import_cycles.py [CRATE_SRC ...]
(default: ir/src frontends/src passes/src runtime/src runtime/kernels/src src)

For each crate, every `.rs` file is a node and its module path follows from the `mod`
tree (`lib.rs`/`main.rs` is the root; `a.rs` or `a/mod.rs` is module `a`). A file depends
on another when it names a path into it: `crate::a::b`, `super::x`, `self::x`, or a child
module of its own (in `use` trees, braces expanded, and in code). Paths are resolved to the
deepest module file they reach, through `pub use` re-exports; `#[cfg(test)]` modules are
left out. A file naming its own ancestors' modules (a child reading
the types its parent declares, through `super::`) is the module tree, not a circle, and is
not counted. The circles are the strongly connected components of more than one file; each
is printed with one edge path through it. Exits 1 when there is a circle.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

DEFAULT = ["ir/src", "frontends/src", "passes/src", "runtime/src", "runtime/kernels/src", "src"]

# comments, strings and char literals, matched left to right (a `//` inside a string is
# not a comment, a quote inside a comment or a char literal starts no string)
TOKEN = re.compile(r"//[^\n]*|/\*.*?\*/|r#*\"[^\"]*\"#*|\"(?:\\.|[^\"\\])*\"|'(?:\\.|[^'\\])'", re.S)


TEST_MOD = re.compile(r"#\[cfg\(test\)\]\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+\w+\s*\{")


def code_only(text: str) -> str:
    """The file without comments, string contents and `#[cfg(test)]` modules (a unit test
    may use what its module's users use)."""
    text = TOKEN.sub(lambda m: '""' if m.group(0).endswith(('"', '#')) else " ", text)
    while m := TEST_MOD.search(text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        text = text[: m.start()] + text[i:]
    return text
MOD_DECL = re.compile(r"^\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;", re.M)
PATH_ATTR = re.compile(r'#\[path\s*=\s*"([^"]+)"\]\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;')
USE = re.compile(r"\buse\s+([^;]+);")
INLINE = re.compile(r"\b(crate|super|self)((?:::\w+)+)")


def expand(tree: str) -> list[str]:
    """`a::{b, c::{d, e}}` -> ['a::b', 'a::c::d', 'a::c::e'] (aliases and globs dropped)."""
    tree = re.sub(r"\s+", "", re.sub(r"\s+as\s+\w+", "", tree))
    i = tree.find("{")
    if i < 0:
        return [tree]
    prefix, depth, parts, cur = tree[:i], 0, [], ""
    for ch in tree[i + 1 : tree.rfind("}")]:
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        depth += ch == "{"
        depth -= ch == "}"
        cur += ch
    parts.append(cur)
    out = []
    for p in parts:
        if p:
            out.extend(prefix + q for q in expand(p))
    return out


def crate_modules(root: Path) -> dict[tuple[str, ...], Path]:
    """Module path -> file, walking `mod x;` declarations from lib.rs / main.rs."""
    mods: dict[tuple[str, ...], Path] = {}
    top = root / "lib.rs" if (root / "lib.rs").exists() else root / "main.rs"
    todo = [((), top)]
    while todo:
        path, f = todo.pop()
        if path in mods or not f.exists():
            continue
        mods[path] = f
        text = code_only(f.read_text())
        here = f.parent if f.name in ("lib.rs", "main.rs", "mod.rs") else f.parent / f.stem
        attrs = {m.group(2): m.group(1) for m in PATH_ATTR.finditer(text)}
        for m in MOD_DECL.finditer(text):
            name = m.group(1)
            if name in attrs:
                cand = [(f.parent / attrs[name]).resolve()]
            else:
                cand = [here / f"{name}.rs", here / name / "mod.rs"]
            for c in cand:
                if c.exists() and root.resolve() in c.resolve().parents:
                    todo.append((path + (name,), c))
                    break
    return mods


PUB_USE = re.compile(r"\bpub(?:\([^)]*\))?\s+use\s+([^;]+);")


def absolute(raw: str, me: tuple[str, ...], children: set[str]):
    """The path's segments from the crate root, or None for a path outside the crate."""
    segs = [s for s in raw.split("::") if s]
    if not segs:
        return None
    if segs[0] == "crate":
        return segs[1:]
    if segs[0] in ("super", "self"):
        base = list(me)
        while segs and segs[0] in ("super", "self"):
            if segs[0] == "super":
                base = base[:-1]
            segs = segs[1:]
        return base + segs
    if segs[0] in children:
        return list(me) + segs
    return None


def deps(root: Path) -> tuple[dict[Path, set[Path]], dict[Path, tuple[str, ...]]]:
    mods = crate_modules(root)
    of_file = {f: p for p, f in mods.items()}
    texts = {f: code_only(f.read_text()) for f in of_file}

    def kids(me):
        return {p[-1] for p in mods if len(p) == len(me) + 1 and p[: len(me)] == me}

    # re-exports: (module, name) -> the absolute path `pub use` gives it
    reexp: dict[tuple[tuple[str, ...], str], list[str]] = {}
    for f, me in of_file.items():
        for m in PUB_USE.finditer(texts[f]):
            for raw in expand(m.group(1)):
                a = absolute(raw, me, kids(me))
                if a:
                    reexp[(me, a[-1])] = a

    def resolve(segs: list[str], depth: int = 0) -> tuple[str, ...]:
        target: tuple[str, ...] = ()
        for i, s in enumerate(segs):
            if target + (s,) in mods:
                target = target + (s,)
            elif (target, s) in reexp and depth < 8 and reexp[(target, s)] != segs:
                return resolve(reexp[(target, s)] + segs[i + 1 :], depth + 1)
            else:
                break
        return target

    graph: dict[Path, set[Path]] = {f: set() for f in of_file}
    for f, me in of_file.items():
        text = texts[f]
        children = kids(me)
        paths: list[str] = []
        for m in USE.finditer(text):
            paths.extend(expand(m.group(1)))
        paths.extend(m.group(1) + m.group(2) for m in INLINE.finditer(text))
        for raw in paths:
            segs = absolute(raw, me, children)
            if segs is None:
                continue
            target = resolve(segs)
            tf = mods.get(target)
            # the module tree: a file and its ancestors' modules
            if tf is None or tf == f or me[: len(target)] == target:
                continue
            graph[f].add(tf)
    return graph, of_file


def sccs(graph: dict[Path, set[Path]]) -> list[list[Path]]:
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def main() -> int:
    roots = sys.argv[1:] or DEFAULT
    found = 0
    for r in roots:
        root = Path(r)
        graph, _ = deps(root)
        for comp in sccs(graph):
            found += 1
            inside = set(comp)
            names = ", ".join(str(p) for p in comp)
            print(f"circle in {r}: {names}")
            for a in comp:
                for b in sorted(graph[a] & inside):
                    print(f"    {a} -> {b}")
    print(f"{found} circle(s)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
