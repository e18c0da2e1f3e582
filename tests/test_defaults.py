"""One home for every default: ``config/schema.yaml`` gives a key's value, the validator fills it, and the typed
settings (``replaynoise/settings.py``, each engine's ``settings.py``) say what a key absent from a validated
mapping means. A library function that repeats a schema value as a keyword default, or as the fallback of a
``.get``, would keep answering with the old value after the schema's changed; these tests find any that comes
back."""

from __future__ import annotations

import ast
from pathlib import Path

import yaml
from helpers import REPO

SCHEMA = yaml.safe_load((REPO / "config" / "schema.yaml").read_text())
#: where a key's absent value is stated, once (the settings modules)
HOMES = ("replaynoise/settings.py", "replaynoise/engines/hf/settings.py", "replaynoise/engines/vllm/settings.py")


def schema_values(schema: dict) -> dict[str, list[tuple[str, object]]]:
    """{key name: [(key path, default or absent value)]} over the whole schema; ``figures.conditioning``'s
    value is the one the library's functions once took as ``conditioning``."""
    found: dict[str, list[tuple[str, object]]] = {}

    def walk(node: dict, path: str) -> None:
        for key, spec in (node.get("properties") or {}).items():
            if not isinstance(spec, dict):
                continue
            where = f"{path}.{key}" if path else key
            for field in ("default", "x-absent-value"):
                if field in spec and not isinstance(spec[field], dict):
                    found.setdefault(key, []).append((where, spec[field]))
            walk(spec, where)
            if isinstance(spec.get("additionalProperties"), dict):
                walk(spec["additionalProperties"], f"{where}.*")

    walk(schema, "")
    return found


def repeated_defaults(source: str, values: dict[str, list[tuple[str, object]]]) -> list[tuple[int, str, str]]:
    """(line, what, schema key) for each keyword default and ``.get`` fallback in ``source`` that names a schema
    key and repeats its value."""
    hits = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            positional = args.posonlyargs + args.args
            pairs = list(zip(positional[len(positional) - len(args.defaults) :], args.defaults))
            pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
            for arg, default in pairs:
                if isinstance(default, ast.Constant):
                    hits += [
                        (node.lineno, f"{node.name}({arg.arg}={default.value!r})", where)
                        for where, value in values.get(arg.arg, [])
                        if value == default.value
                    ]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and len(node.args) == 2
            and isinstance(node.args[0], ast.Constant)
        ):
            fallback = node.args[1]
            if isinstance(fallback, ast.Constant):
                given = fallback.value
            elif isinstance(fallback, (ast.List, ast.Tuple)) and not fallback.elts:
                given = []
            else:
                continue
            hits += [
                (node.lineno, f".get({node.args[0].value!r}, {given!r})", where)
                for where, value in values.get(str(node.args[0].value), [])
                if value == given
            ]
    return hits


def test_no_library_function_repeats_a_schema_default():
    values = schema_values(SCHEMA)
    values.setdefault("conditioning", []).append(("figures.conditioning", "main"))
    found = []
    for path in sorted((REPO / "replaynoise").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel not in HOMES:
            found += [
                f"{rel}:{line}: {what} repeats {where}"
                for line, what, where in repeated_defaults(path.read_text(), values)
            ]
    assert not found, "defaults that belong to the schema and settings.py:\n" + "\n".join(found)


def test_the_check_finds_a_repeated_default_in_each_form():
    values = schema_values(SCHEMA)
    planted = (
        'def compare(credit, *, ci: float = 0.95, metric="sign", theta=0.25):\n'
        '    return credit.get("margin_split", 0.3), credit.get("cross_scoring", []), credit.get("ci", 0.9)\n'
    )
    found = {what for _, what, _ in repeated_defaults(planted, values)}
    # theta 0.25 and a ci of 0.9 are not the schema's values: only the three repeats are found
    assert found == {
        "compare(ci=0.95)",
        "compare(metric='sign')",
        ".get('margin_split', 0.3)",
        ".get('cross_scoring', [])",
    }


def test_every_home_exists():
    assert all(Path(REPO / home).is_file() for home in HOMES)
