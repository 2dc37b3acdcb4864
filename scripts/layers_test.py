#!/usr/bin/env python3
"""Tests of scripts/layers.py on small crates written to a temporary folder.

    python3 scripts/layers_test.py        (make lint runs it before the check itself)
"""

import os
import sys
import tempfile
import textwrap
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import layers  # noqa: E402

RULES = """
[[crate]]
name = "demo"
root = "src/lib.rs"
"""


class Crate:
    """A crate in a temporary folder: `files` maps paths under src/ to their text."""

    def __init__(self, files, rules=RULES):
        self.dir = tempfile.TemporaryDirectory()
        for path, text in files.items():
            full = os.path.join(self.dir.name, "src", path)
            os.makedirs(os.path.dirname(full), exist_ok=True)
            with open(full, "w", encoding="utf-8") as f:
                f.write(textwrap.dedent(text))
        self.rules = os.path.join(self.dir.name, "layers.toml")
        with open(self.rules, "w", encoding="utf-8") as f:
            f.write(textwrap.dedent(rules))

    def check(self):
        problems, _, arrows = layers.check(self.dir.name, self.rules)
        return problems, {k: v.names for k, v in arrows["demo"].items()}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.dir.cleanup()


class Arrows(unittest.TestCase):
    def test_a_use_is_an_arrow_to_the_file_that_defines_the_item(self):
        with Crate({
            "lib.rs": "mod a;\nmod b;\n",
            "a.rs": "use crate::b::Thing;\npub fn f(_: Thing) {}\n",
            "b.rs": "pub struct Thing;\n",
        }) as c:
            problems, arrows = c.check()
            self.assertEqual(problems, [])
            self.assertEqual(arrows, {("src/a.rs", "src/b.rs"): {"Thing"}})

    def test_paths_in_the_code_and_module_aliases_are_arrows(self):
        with Crate({
            "lib.rs": "mod a;\nmod b;\nmod c;\n",
            "a.rs": "use crate::b;\npub fn f() { b::g(); super::c::h(); }\n",
            "b.rs": "pub fn g() {}\n",
            "c.rs": "pub fn h() {}\n",
        }) as c:
            _, arrows = c.check()
            self.assertEqual(arrows, {("src/a.rs", "src/b.rs"): {"g"},
                                      ("src/a.rs", "src/c.rs"): {"h"}})

    def test_re_exports_are_followed_to_the_defining_file(self):
        with Crate({
            "lib.rs": "mod m;\nmod user;\n",
            "m/mod.rs": "mod inner;\nmod deep;\npub use inner::Thing;\npub use deep::*;\n",
            "m/inner.rs": "pub struct Thing;\n",
            "m/deep.rs": "pub struct Other;\n",
            "user.rs": "use crate::m::{Other, Thing};\n",
        }) as c:
            _, arrows = c.check()
            self.assertEqual(arrows, {("src/user.rs", "src/m/inner.rs"): {"Thing"},
                                      ("src/user.rs", "src/m/deep.rs"): {"Other"}})

    def test_nested_use_trees_self_and_renames(self):
        with Crate({
            "lib.rs": "mod a;\nmod b;\n",
            "a.rs": "use crate::b::{self as bee, x::{One, Two as Deux}};\n"
                    "pub fn f(_: One, _: Deux) { bee::g() }\n",
            "b.rs": "pub mod x;\npub fn g() {}\n",
            "b/x.rs": "pub struct One;\npub struct Two;\n",
        }) as c:
            _, arrows = c.check()
            self.assertEqual(arrows, {("src/a.rs", "src/b/x.rs"): {"One", "Two"},
                                      ("src/a.rs", "src/b.rs"): {"g"}})

    def test_inline_modules_belong_to_their_file(self):
        with Crate({
            "lib.rs": "mod a;\nmod b;\n",
            "a.rs": "pub fn f() -> u8 { crate::b::consts::A }\n",
            "b.rs": "pub mod consts {\n    pub const A: u8 = 1;\n}\n",
        }) as c:
            _, arrows = c.check()
            self.assertEqual(arrows, {("src/a.rs", "src/b.rs"): {"A"}})

    def test_tests_comments_and_strings_are_no_arrows(self):
        with Crate({
            "lib.rs": "mod a;\nmod b;\n",
            "a.rs": """\
                // use crate::b::Thing;
                /* crate::b::Thing /* nested */ */
                pub const S: &str = "crate::b::Thing";
                pub const R: &str = r#"crate::b::Thing"#;
                pub const C: char = '"';
                pub fn f<'a>(x: &'a str) -> &'a str { x }
                #[cfg(test)]
                mod tests {
                    use crate::b::Thing;
                }
                #[cfg(test)]
                mod more;
                """,
            "a/more.rs": "use crate::b::Thing;\n",
            "b.rs": "pub struct Thing;\nuse crate::a::S;\npub fn g() -> &'static str { S }\n",
        }) as c:
            problems, arrows = c.check()
            self.assertEqual(problems, [])
            self.assertEqual(arrows, {("src/b.rs", "src/a.rs"): {"S"}})

    def test_declaring_a_child_module_is_no_arrow(self):
        with Crate({
            "lib.rs": "mod m;\n",
            "m/mod.rs": "mod child;\npub use child::f;\n",
            "m/child.rs": "pub fn f() { super::helper() }\n",
        }) as c:
            # mod.rs defines no `helper`: the arrow falls back on the module's file.
            problems, arrows = c.check()
            self.assertEqual(problems, [])
            self.assertEqual(arrows, {("src/m/child.rs", "src/m/mod.rs"): {"helper"}})


class Circles(unittest.TestCase):
    def test_two_files_that_import_each_other_are_a_circle(self):
        with Crate({
            "lib.rs": "mod a;\nmod b;\n",
            "a.rs": "use crate::b::B;\npub struct A(B);\n",
            "b.rs": "pub struct B;\npub fn g(_: crate::a::A) {}\n",
        }) as c:
            problems, _ = c.check()
            self.assertEqual(len(problems), 1)
            self.assertIn("circle of 2 files", problems[0])
            self.assertIn("src/a.rs -> src/b.rs (B)", problems[0])
            self.assertIn("src/b.rs -> src/a.rs (A)", problems[0])

    def test_a_face_that_only_re_exports_closes_no_circle(self):
        files = {
            "lib.rs": "mod m;\n",
            "m/mod.rs": "mod child;\npub use child::Thing;\npub struct Shared;\n",
            "m/child.rs": "use super::Shared;\npub struct Thing(Shared);\n",
        }
        with Crate(files) as c:
            self.assertEqual(c.check()[0], [])
        # The same face using the child in its own code: a circle.
        files["m/mod.rs"] += "pub fn make() -> Thing { Thing(Shared) }\n"
        with Crate(files) as c:
            problems, _ = c.check()
            self.assertEqual(len(problems), 1, problems)
            self.assertIn("src/m/mod.rs -> src/m/child.rs (Thing)", problems[0])

    def test_three_file_circle(self):
        with Crate({
            "lib.rs": "mod a;\nmod b;\nmod c;\n",
            "a.rs": "pub struct A;\nuse crate::b::B;\n",
            "b.rs": "pub struct B;\nuse crate::c::C;\n",
            "c.rs": "pub struct C;\nuse crate::a::A;\n",
        }) as c:
            problems, _ = c.check()
            self.assertEqual(len(problems), 1)
            self.assertIn("circle of 3 files", problems[0])


    def test_a_known_circle_passes_until_it_is_gone(self):
        known = 'known_circles = [["src/a.rs", "src/b.rs"]]\n' + RULES
        circle = {
            "lib.rs": "mod a;\nmod b;\n",
            "a.rs": "use crate::b::B;\npub struct A(B);\n",
            "b.rs": "pub struct B;\npub fn g(_: crate::a::A) {}\n",
        }
        with Crate(circle, known) as c:
            self.assertEqual(c.check()[0], [])
        circle["b.rs"] = "pub struct B;\n"
        with Crate(circle, known) as c:
            problems, _ = c.check()
            self.assertEqual(len(problems), 1)
            self.assertIn("a known circle is gone", problems[0])


LAYERED = RULES + """
[[area]]
name = "demo"
root = "src"
[[area.part]]
name = "low"
paths = ["low.rs", "lib.rs"]
[[area.part]]
name = "high"
paths = ["high/"]
may_import = ["low"]
"""


class Rules(unittest.TestCase):
    def test_imports_downwards_pass(self):
        with Crate({
            "lib.rs": "mod low;\nmod high;\n",
            "low.rs": "pub struct L;\n",
            "high/mod.rs": "use crate::low::L;\npub fn f(_: L) {}\n",
        }, LAYERED) as c:
            self.assertEqual(c.check()[0], [])

    def test_an_import_upwards_breaks_the_rule(self):
        with Crate({
            "lib.rs": "mod low;\nmod high;\n",
            "low.rs": "pub struct L;\n\npub fn g() { crate::high::f() }\n",
            "high/mod.rs": "pub fn f() {}\n",
        }, LAYERED) as c:
            problems, _ = c.check()
            self.assertEqual(len(problems), 1, problems)
            self.assertIn("src/low.rs:3: demo layer rule: low imports high", problems[0])
            self.assertIn("(src/high/mod.rs: f)", problems[0])
            self.assertIn("low may import nothing else", problems[0])

    def test_a_file_on_no_part_is_reported(self):
        with Crate({
            "lib.rs": "mod low;\nmod stray;\n",
            "low.rs": "pub struct L;\n",
            "stray.rs": "pub struct S;\n",
        }, LAYERED) as c:
            problems, _ = c.check()
            self.assertEqual(problems, ["src/stray.rs: in area demo but on none of its parts "
                                        "(scripts/layers.toml)"])

    def test_the_longest_path_decides_the_part(self):
        rules = LAYERED + """
[[area.part]]
name = "core"
paths = ["high/core.rs"]
"""
        with Crate({
            "lib.rs": "mod low;\nmod high;\n",
            "low.rs": "pub struct L;\n",
            "high/mod.rs": "mod core;\n",
            "high/core.rs": "use crate::low::L;\npub fn f(_: L) {}\n",
        }, rules) as c:
            problems, _ = c.check()
            self.assertEqual(len(problems), 1, problems)
            self.assertIn("core imports low", problems[0])


if __name__ == "__main__":
    unittest.main()
