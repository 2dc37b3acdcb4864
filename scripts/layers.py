#!/usr/bin/env python3
"""The import structure of the workspace's crates, checked: no circle between files, and no
import that breaks a layer rule of scripts/layers.toml (docs/architecture.md states the same
rules in words).

An arrow A -> B means: the production code of file A names an item that file B defines (a
`use`, or a path such as `crate::x::y::Z` or `module::f()` in the code). Paths are resolved the
way rustc resolves them, as far as a reader of `use` lines can: `crate::`, `super::`, `self::`,
child modules, the names a file imports, and re-exports (`pub use`), which are followed to the
file that defines the item. Test code is left out (`#[cfg(test)]` items and the files they
load), and so are comments, strings and declarations of child modules (`mod x;` is no import).

    scripts/layers.py              check; exit 1 with one line per circle or broken rule
    scripts/layers.py --report     also print, per crate, the files, arrows and circles
    scripts/layers.py --arrows F   print the arrows from and to file F, with the names taken

Python 3.11 or later, standard library only.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tomllib
from dataclasses import dataclass, field

# ---------------------------------------------------------------------------------------------
# Reading Rust source


def strip_code(text: str) -> str:
    """The text with comments, string and char literals blanked (newlines kept)."""
    out = []
    i, n = 0, len(text)

    def blank(s: str) -> str:
        return "".join(c if c == "\n" else " " for c in s)

    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(blank(text[i:j]))
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
            out.append(blank(text[i:j]))
            i = j
        elif (m := re.match(r'(?:b|c)?r(#*)"', text[i:i + 260])) and (
            i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")
        ):
            close = '"' + m.group(1)
            j = text.find(close, i + len(m.group(0)))
            j = n if j < 0 else j + len(close)
            out.append('""' + blank(text[i + 2:j]))
            i = j
        elif c == '"' or (c == "b" and text.startswith('b"', i) and not _ident_before(text, i)):
            j = i + (2 if c == "b" else 1)
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            j += 1
            out.append('""' + blank(text[i + 2:j]))
            i = j
        elif c == "'":
            # A char literal ('x', '\n', '\u{..}') or a lifetime ('a).
            if i + 1 < n and text[i + 1] == "\\":
                j = text.find("'", i + 2)
                j = n if j < 0 else j + 1
                out.append(blank(text[i:j]))
                i = j
            elif i + 2 < n and text[i + 2] == "'":
                out.append("   ")
                i += 3
            else:
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _ident_before(text: str, i: int) -> bool:
    return i > 0 and (text[i - 1].isalnum() or text[i - 1] == "_")


def match_brace(text: str, open_at: int) -> int:
    """The index just past the brace that closes the one at `open_at`."""
    depth = 0
    for j in range(open_at, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return j + 1
    return len(text)


TEST_CFG = re.compile(r"#\s*\[\s*cfg\s*\(\s*(?:test|all\s*\(\s*test\b[^\]]*)\s*\)\s*\]")


def item_end(text: str, start: int) -> int:
    """The end of the item (or statement) starting at `start`: its `;` or its closing brace."""
    i = start
    # Further attributes.
    while True:
        m = re.compile(r"\s*#\s*\[").match(text, i)
        if not m:
            break
        depth, j = 0, m.end() - 1
        while j < len(text):
            if text[j] == "[":
                depth += 1
            elif text[j] == "]":
                depth -= 1
                if depth == 0:
                    break
            j += 1
        i = j + 1
    head = re.compile(r"\s*(?:pub(?:\s*\([^)]*\))?\s+)?(\w+)").match(text, i)
    semicolon_items = {"use", "const", "static", "type", "let"}
    depth = 0
    j = i
    while j < len(text):
        ch = text[j]
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        elif ch == ";" and depth <= 0:
            return j + 1
        elif ch == "{" and depth <= 0:
            if head and head.group(1) in semicolon_items:
                j = match_brace(text, j)
                continue
            return match_brace(text, j)
        j += 1
    return len(text)


def drop_test_code(text: str) -> str:
    """Blanks every item marked `#[cfg(test)]` (or `#[cfg(all(test, ..))]`)."""
    while True:
        m = TEST_CFG.search(text)
        if not m:
            return text
        end = item_end(text, m.end())
        text = text[: m.start()] + "".join(c if c == "\n" else " " for c in text[m.start():end]) + text[end:]


# ---------------------------------------------------------------------------------------------
# Modules


@dataclass
class Use:
    path: list[str]  # as written, from the module it is in
    name: str | None  # the name it binds; None for a glob
    public: bool
    line: int


@dataclass
class Module:
    path: tuple[str, ...]
    file: str  # relative to the repository
    parent: Module | None
    crate: Crate
    children: dict[str, Module] = field(default_factory=dict)
    items: set[str] = field(default_factory=set)
    uses: list[Use] = field(default_factory=list)
    code: list[tuple[int, str]] = field(default_factory=list)  # (line, path as written)
    words: set[str] = field(default_factory=set)  # identifiers of the code, `use` lines left out

    def name_uses(self, name: str) -> list[Use]:
        return [u for u in self.uses if u.name == name]


@dataclass
class Crate:
    name: str
    root_file: str
    modules: list[Module] = field(default_factory=list)
    root: Module | None = None


ITEM_DEF = re.compile(
    r"\b(?:fn|struct|enum|trait|type|const|static|union)\s+(?:r#)?([A-Za-z_]\w*)|"
    r"\bmacro_rules!\s*([A-Za-z_]\w*)"
)
MOD_DECL = re.compile(r"\b(?:pub(?:\s*\([^)]*\))?\s+)?mod\s+([A-Za-z_]\w*)\s*([;{])")
USE_DECL = re.compile(r"(?:\b(pub)(?:\s*\([^)]*\))?\s+)?\buse\s+")
CODE_PATH = re.compile(r"(?<![\w:])((?:[A-Za-z_]\w*)(?:\s*::\s*[A-Za-z_]\w*)+)")
PATH_ATTR = re.compile(r'#\s*\[\s*path\s*=\s*"([^"]*)"\s*\]\s*$')


def parse_use_tree(s: str) -> list[tuple[list[str], str | None]]:
    """`a::b::{c, d as e, f::*}` -> [([a,b,c], c), ([a,b,d], e), ([a,b,f], None)]."""
    tokens = re.findall(r"::|\{|\}|,|\*|[A-Za-z_]\w*", s)
    pos = 0

    def tree(prefix: list[str]) -> list[tuple[list[str], str | None]]:
        nonlocal pos
        out: list[tuple[list[str], str | None]] = []
        segs = list(prefix)
        while pos < len(tokens):
            t = tokens[pos]
            if t == "::":
                pos += 1
            elif t == "{":
                pos += 1
                while pos < len(tokens) and tokens[pos] != "}":
                    if tokens[pos] == ",":
                        pos += 1
                        continue
                    out.extend(tree(segs))
                pos += 1
                return out
            elif t == "*":
                pos += 1
                out.append((segs, None))
                return out
            elif t in (",", "}"):
                break
            elif t == "as":
                alias = tokens[pos + 1]
                pos += 2
                if segs and segs[-1] == "self":
                    segs = segs[:-1]
                out.append((segs, None if alias == "_" else alias))
                return out
            else:
                segs = segs + [t]
                pos += 1
        if segs and segs[-1] == "self":
            segs = segs[:-1]
        if segs != list(prefix):
            out.append((segs, segs[-1]))
        return out

    return tree([])


def line_of(text: str, at: int) -> int:
    return text.count("\n", 0, at) + 1


def load_module(crate: Crate, path: tuple[str, ...], file: str, parent: Module | None,
                text: str, repo: str) -> Module:
    """Reads a module whose body is `text` (a whole file, or an inline module's braces)."""
    mod = Module(path, file, parent, crate)
    crate.modules.append(mod)
    # Inline child modules first; their text is blanked out of this one's.
    masked = list(text)
    for m in list(MOD_DECL.finditer(text)):
        if _depth_at(text, m.start()) != 0 or "".join(masked[m.start():m.end()]).strip() == "":
            continue
        name = m.group(1)
        if m.group(2) == "{":
            body_start = m.end() - 1
            body_end = match_brace(text, body_start)
            body = text[body_start + 1: body_end - 1]
            pad = "".join(c if c == "\n" else " " for c in text[:body_start + 1])
            child = load_module(crate, path + (name,), file, mod, pad + body, repo)
            mod.children[name] = child
            for k in range(body_start + 1, body_end - 1):
                if masked[k] != "\n":
                    masked[k] = " "
        else:
            before = text[max(0, m.start() - 200): m.start()]
            attr = PATH_ATTR.search(before.rstrip() + "\n") if "#" in before else None
            child_file = _child_file(repo, file, parent is None or _is_dir_owner(file), name,
                                     path, attr.group(1) if attr else None, mod)
            if child_file is None:
                continue
            with open(os.path.join(repo, child_file), encoding="utf-8") as f:
                child_text = drop_test_code(strip_code(f.read()))
            mod.children[name] = load_module(crate, path + (name,), child_file, mod,
                                             child_text, repo)
    body = "".join(masked)
    for m in ITEM_DEF.finditer(body):
        if _depth_at(body, m.start()) == 0:
            mod.items.add(m.group(1) or m.group(2))
    use_spans = []
    for m in USE_DECL.finditer(body):
        if m.start() > 0 and (body[m.start() - 1].isalnum() or body[m.start() - 1] in "_:"):
            continue
        end = body.find(";", m.end())
        if end < 0:
            continue
        use_spans.append((m.start(), end))
        for segs, name in parse_use_tree(body[m.end():end]):
            mod.uses.append(Use(segs, name, bool(m.group(1)), line_of(body, m.start())))
    code = list(body)
    for a, b in use_spans:
        for k in range(a, b):
            if code[k] != "\n":
                code[k] = " "
    code_text = "".join(code)
    mod.words = set(re.findall(r"[A-Za-z_]\w*", code_text))
    for m in CODE_PATH.finditer(code_text):
        segs = [s.strip() for s in m.group(1).split("::")]
        mod.code.append((line_of(code_text, m.start()), "::".join(segs)))
    return mod


def _depth_at(text: str, at: int) -> int:
    return text.count("{", 0, at) - text.count("}", 0, at)


def _is_dir_owner(file: str) -> bool:
    return os.path.basename(file) in ("mod.rs", "lib.rs", "main.rs")


def _child_file(repo, file, owner, name, path, attr, mod) -> str | None:
    here = os.path.dirname(file)
    if attr is not None:
        return os.path.normpath(os.path.join(here, attr))
    # Inline ancestors (mod a { mod b; }) add folders.
    inline = []
    m = mod
    while m.parent is not None and m.parent.file == m.file:
        inline.insert(0, m.path[-1])
        m = m.parent
    base = here if owner or m.parent is None else os.path.join(
        here, os.path.splitext(os.path.basename(file))[0])
    base = os.path.join(base, *inline)
    for cand in (os.path.join(base, name + ".rs"), os.path.join(base, name, "mod.rs")):
        if os.path.exists(os.path.join(repo, cand)):
            return os.path.normpath(cand)
    return None


# ---------------------------------------------------------------------------------------------
# Resolving names to the files that define them


class Resolver:
    def __init__(self, crate: Crate):
        self.crate = crate
        self.busy: set[tuple] = set()

    def start(self, mod: Module, first: str) -> Module | tuple[str, Module] | None:
        """What the first segment of a path names in `mod`: a module, an item (name, where),
        or None (another crate, std, a local variable)."""
        if first == "crate":
            return self.crate.root
        if first == "self":
            return mod
        if first == "super":
            return mod.parent
        if first in mod.children:
            return mod.children[first]
        for u in mod.name_uses(first):
            r = self.walk(mod, u.path)
            if r is not None:
                return r
        if first in mod.items:
            return (first, mod)
        # Names from glob imports.
        for u in mod.uses:
            if u.name is None:
                target = self.walk(mod, u.path)
                if isinstance(target, Module):
                    if first in target.children:
                        return target.children[first]
                    found = self.item(target, first)
                    if found is not None:
                        return found
        return None

    def walk(self, mod: Module, segs: list[str]):
        key = (id(mod), tuple(segs))
        if key in self.busy:
            return None
        self.busy.add(key)
        try:
            if not segs:
                return mod
            cur = self.start(mod, segs[0])
            for s in segs[1:]:
                if cur is None:
                    return None
                if isinstance(cur, tuple):
                    return cur  # Enum::Variant, Type::method: the type's file
                if s == "super":
                    cur = cur.parent
                elif s == "self":
                    continue
                elif s in cur.children:
                    cur = cur.children[s]
                else:
                    cur = self.item(cur, s) or (s, cur)
            return cur
        finally:
            self.busy.discard(key)

    def item(self, mod: Module, name: str):
        """Where item `name` of module `mod` is defined, following its imports."""
        if name in mod.items:
            return (name, mod)
        for u in mod.name_uses(name):
            r = self.walk(mod, u.path)
            if r is not None:
                return r
        for u in mod.uses:
            if u.name is None:
                target = self.walk(mod, u.path)
                if isinstance(target, Module) and target is not mod:
                    r = self.item(target, name)
                    if r is not None:
                        return r
        return None


@dataclass
class Arrow:
    src: str
    dst: str
    names: set[str]
    lines: set[int]


def arrows_of(crate: Crate) -> dict[tuple[str, str], Arrow]:
    res = Resolver(crate)
    out: dict[tuple[str, str], Arrow] = {}

    def add(mod: Module, target, label: str, line: int):
        if target is None:
            return
        if isinstance(target, tuple):
            name, where = target
            dst = where.file
        else:
            name, dst = label, target.file
        if dst == mod.file:
            return
        a = out.setdefault((mod.file, dst), Arrow(mod.file, dst, set(), set()))
        a.names.add(name)
        a.lines.add(line)

    for mod in crate.modules:
        for u in mod.uses:
            # A re-export (`pub use`, `pub(crate) use`) is the module's face, not a dependency
            # of its code: those who name the item get the arrow to where it is defined. It is
            # an arrow only where the file's own code uses the name too.
            if u.public and (u.name is None or u.name not in mod.words):
                continue
            target = res.walk(mod, u.path)
            # A module imported by name is an arrow only where the code uses it (below); a glob
            # depends on the whole module.
            if isinstance(target, Module) and u.name is not None:
                continue
            add(mod, target, "*" if u.name is None else u.path[-1], u.line)
        for line, path in mod.code:
            segs = path.split("::")
            first = res.start(mod, segs[0])
            if first is None:
                continue
            if isinstance(first, tuple) and len(segs) >= 1 and segs[0] not in ("crate", "self", "super"):
                # An imported item used as `Item::x`: the `use` made the arrow already.
                continue
            target = res.walk(mod, segs)
            if isinstance(target, Module):
                continue
            add(mod, target, segs[-1], line)
    return out


# ---------------------------------------------------------------------------------------------
# Circles and rules


def circles(files: list[str], arrows) -> list[list[str]]:
    """The strongly connected components of more than one file (Tarjan), each sorted."""
    graph: dict[str, list[str]] = {f: [] for f in files}
    for (a, b) in arrows:
        graph.setdefault(a, []).append(b)
        graph.setdefault(b, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str):
        # Iterative Tarjan: (node, iterator over successors).
        work = [(v, iter(sorted(graph[v])))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        while work:
            node, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    advanced = True
                    break
                if w in on:
                    low[node] = min(low[node], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


@dataclass
class Part:
    name: str
    paths: list[str]
    may_import: list[str]


@dataclass
class Area:
    name: str
    root: str
    parts: list[Part]
    why: str = ""

    def part_of(self, file: str) -> Part | None:
        """The part whose path is the longest prefix of `file` (a folder ends in '/')."""
        best, best_len = None, -1
        rel = os.path.relpath(file, self.root)
        if rel.startswith(".."):
            return None
        for p in self.parts:
            for path in p.paths:
                if (path.endswith("/") and rel.startswith(path)) or rel == path:
                    if len(path) > best_len:
                        best, best_len = p, len(path)
        return best

    def contains(self, file: str) -> bool:
        return not os.path.relpath(file, self.root).startswith("..")


def load_rules(path: str) -> tuple[list[dict], list[Area], list[set[str]]]:
    with open(path, "rb") as f:
        cfg = tomllib.load(f)
    allowed = {"": {"known_circles", "crate", "area"}, "crate": {"name", "root"},
               "area": {"name", "root", "why", "part"}, "part": {"name", "paths", "may_import"}}

    def keys(what: str, table: dict):
        for k in table:
            if k not in allowed[what]:
                raise SystemExit(f"{path}: unknown key {k!r}" + (f" in a [[{what}]]" if what else ""))

    keys("", cfg)
    for c in cfg.get("crate", []):
        keys("crate", c)
    for a in cfg.get("area", []):
        keys("area", a)
        for p in a.get("part", []):
            keys("part", p)
    known = [set(c) for c in cfg.get("known_circles", [])]
    areas = []
    for a in cfg.get("area", []):
        parts = [Part(p["name"], p["paths"], p.get("may_import", [])) for p in a["part"]]
        names = {p.name for p in parts}
        for p in parts:
            for other in p.may_import:
                if other not in names:
                    raise SystemExit(f"{path}: area {a['name']}: part {p.name} names an "
                                     f"unknown part {other}")
        areas.append(Area(a["name"], a["root"], parts, a.get("why", "")))
    return cfg.get("crate", []), areas, known


def load_crates(repo: str, crate_cfg: list[dict]) -> list[Crate]:
    crates = []
    for c in crate_cfg:
        crate = Crate(c["name"], c["root"])
        with open(os.path.join(repo, c["root"]), encoding="utf-8") as f:
            text = drop_test_code(strip_code(f.read()))
        crate.root = load_module(crate, (), c["root"], None, text, repo)
        crates.append(crate)
    return crates


def check(repo: str, rules_path: str) -> tuple[list[str], list[Crate], dict]:
    crate_cfg, areas, known = load_rules(rules_path)
    crates = load_crates(repo, crate_cfg)
    problems: list[str] = []
    all_arrows = {}
    seen_known = []
    for crate in crates:
        arrows = arrows_of(crate)
        all_arrows[crate.name] = arrows
        files = sorted({m.file for m in crate.modules})
        for comp in circles(files, arrows):
            if set(comp) in known:
                seen_known.append(set(comp))
                continue
            ties = [f"{a} -> {b} ({', '.join(sorted(arrows[(a, b)].names))})"
                    for (a, b) in sorted(arrows) if a in comp and b in comp]
            problems.append(f"circle of {len(comp)} files in {crate.name}: " + "; ".join(ties))
        for area in areas:
            for f in files:
                if area.contains(f) and area.part_of(f) is None:
                    problems.append(f"{f}: in area {area.name} but on none of its parts "
                                    f"(scripts/layers.toml)")
            for (a, b), arrow in sorted(arrows.items()):
                if not (area.contains(a) and area.contains(b)):
                    continue
                pa, pb = area.part_of(a), area.part_of(b)
                if pa is None or pb is None or pa is pb or pb.name in pa.may_import:
                    continue
                allowed = ", ".join(pa.may_import) or "nothing else"
                problems.append(
                    f"{a}:{min(arrow.lines)}: {area.name} layer rule: {pa.name} imports "
                    f"{pb.name} ({b}: {', '.join(sorted(arrow.names))}); {pa.name} may import "
                    f"{allowed}")
    for k in known:
        if k not in seen_known:
            problems.append("a known circle is gone (or changed): take it off known_circles: "
                            + " ".join(sorted(k)))
    return problems, crates, all_arrows


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", default=os.path.join(os.path.dirname(__file__), ".."))
    ap.add_argument("--rules", default=None)
    ap.add_argument("--report", action="store_true")
    ap.add_argument("--arrows", metavar="FILE")
    args = ap.parse_args(argv)
    repo = os.path.normpath(args.repo)
    rules = args.rules or os.path.join(repo, "scripts", "layers.toml")
    problems, crates, all_arrows = check(repo, rules)
    if args.report:
        for crate in crates:
            arrows = all_arrows[crate.name]
            files = sorted({m.file for m in crate.modules})
            comps = circles(files, arrows)
            print(f"{crate.name}: {len(files)} files, {len(arrows)} arrows, {len(comps)} circles"
                  + "".join(f"\n  circle of {len(c)}: {' '.join(c)}" for c in comps))
    if args.arrows:
        f = os.path.normpath(args.arrows)
        for arrows in all_arrows.values():
            for (a, b), arrow in sorted(arrows.items()):
                if f in (a, b):
                    print(f"{a} -> {b}: {', '.join(sorted(arrow.names))}")
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        print(f"layers: {len(problems)} problem(s); the rules are in {os.path.relpath(rules, repo)}"
              " and docs/architecture.md", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
