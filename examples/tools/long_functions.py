#!/usr/bin/env python3
"""Lists Rust functions longer than a limit (150 lines by default).

Usage: python3 examples/tools/long_functions.py [--limit N] [--max M] [DIR ...]

Without DIRs it reads passes/src runtime/src src frontends/src (the folders the
function-length rule covers). A function's length is counted from its `fn` line to
the line of its closing brace, both included. Prints `LINES path::name (line N)` per
function over the limit, longest first, then the count; exits 0, or with --max M, 1 when
more than M functions are over the limit (CI runs it with --max 3).
"""
import os
import re
import sys

DEFAULT_DIRS = ["passes/src", "runtime/src", "src", "frontends/src"]
FN = re.compile(r"\bfn\s+([A-Za-z_][A-Za-z0-9_]*)")


def blank_out(text):
    """The text with comments, strings and char literals replaced by spaces
    (newlines kept), so braces can be counted."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == "r" and re.match(r'r#*"', text[i:]) and not (i and (text[i - 1].isalnum() or text[i - 1] == "_")):
            hashes = re.match(r"r(#*)\"", text[i:]).group(1)
            end = text.find('"' + hashes, i + 2 + len(hashes))
            j = n if end < 0 else end + 1 + len(hashes)
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            j += 1
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == "'":
            m = re.match(r"'(\\.[^']*|[^\\'])'", text[i:])
            if m:  # a char literal; otherwise a lifetime or label
                out.append(" " * len(m.group(0)))
                i += len(m.group(0))
            else:
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def functions(path):
    """(name, first line, line count) of every function with a body in `path`."""
    with open(path, encoding="utf-8") as f:
        text = blank_out(f.read())
    found = []
    for m in FN.finditer(text):
        # the body starts at the first `{` after the signature, unless a `;` comes first
        # (a trait method without a body)
        j = m.end()
        while j < len(text) and text[j] not in "{;":
            j += 1
        if j >= len(text) or text[j] == ";":
            continue
        depth, k = 0, j
        while k < len(text):
            if text[k] == "{":
                depth += 1
            elif text[k] == "}":
                depth -= 1
                if depth == 0:
                    break
            k += 1
        first = text.count("\n", 0, m.start()) + 1
        last = text.count("\n", 0, k) + 1
        found.append((m.group(1), first, last - first + 1))
    return found


def main(argv):
    limit, most = 150, None
    while len(argv) >= 2 and argv[0] in ("--limit", "--max"):
        if argv[0] == "--limit":
            limit = int(argv[1])
        else:
            most = int(argv[1])
        argv = argv[2:]
    dirs = argv or DEFAULT_DIRS
    long = []
    for d in dirs:
        for root, _, files in os.walk(d):
            for name in sorted(files):
                if name.endswith(".rs"):
                    path = os.path.join(root, name)
                    for fn, line, count in functions(path):
                        if count > limit:
                            long.append((count, path, fn, line))
    long.sort(key=lambda x: (-x[0], x[1], x[3]))
    for count, path, fn, line in long:
        print(f"{count:5} {path[:-3]}::{fn} (line {line})")
    print(f"{len(long)} functions over {limit} lines")
    if most is not None and len(long) > most:
        print(f"more than {most}: split the longest by family or stage")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
