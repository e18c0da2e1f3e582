"""The package's shape, held by caps in ``pyproject.toml`` (``[tool.replaynoise.caps]``): modules small enough to
read whole, functions short enough to see whole and with few enough parameters that a call reads without a
settings type. A function over a cap is exempted there by name, with its reason, or split."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

from helpers import REPO

CAPS = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["replaynoise"]["caps"]


def function_shapes(source: str) -> list[tuple[str, int, int]]:
    """(name, lines, parameters) of every function and method in ``source``; self and cls are not parameters."""
    shapes = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            named = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs if a.arg not in ("self", "cls")]
            starred = [a for a in (args.vararg, args.kwarg) if a is not None]
            shapes.append((node.name, node.end_lineno - node.lineno + 1, len(named) + len(starred)))
    return shapes


def over_caps(path: Path) -> list[str]:
    rel = path.relative_to(REPO).as_posix()
    source = path.read_text()
    found = []
    if len(source.splitlines()) > CAPS["max-module-lines"]:
        found.append(f"{rel}: {len(source.splitlines())} lines (cap {CAPS['max-module-lines']})")
    for name, lines, params in function_shapes(source):
        if f"{rel}:{name}" in CAPS["exempt"]:
            continue
        if lines > CAPS["max-function-lines"]:
            found.append(f"{rel}:{name}: {lines} lines (cap {CAPS['max-function-lines']})")
        if params > CAPS["max-params"]:
            found.append(f"{rel}:{name}: {params} parameters (cap {CAPS['max-params']})")
    return found


def test_every_module_and_function_of_the_package_keeps_within_the_caps():
    found = [line for path in sorted((REPO / "replaynoise").rglob("*.py")) for line in over_caps(path)]
    assert not found, "over the caps of pyproject.toml [tool.replaynoise.caps]:\n" + "\n".join(found)


def test_every_exemption_names_a_function_that_exists_and_needs_it_and_says_why():
    for key, reason in CAPS["exempt"].items():
        rel, name = key.split(":")
        shapes = {n: (lines, params) for n, lines, params in function_shapes((REPO / rel).read_text())}
        assert name in shapes, f"{key}: no such function"
        lines, params = shapes[name]
        assert lines > CAPS["max-function-lines"] or params > CAPS["max-params"], f"{key}: within the caps"
        assert len(reason.split()) >= 5, f"{key}: give the reason"


def test_the_caps_see_a_long_function_and_a_wide_one():
    wide = "def f(a, b, c, d, e, f, g, h, i):\n    return a\n"
    long = "def g(self):\n" + "    x = 1\n" * 60
    assert function_shapes(wide) == [("f", 2, 9)]
    assert function_shapes(long) == [("g", 61, 0)]
