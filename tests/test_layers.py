"""The package's layers, read from its imports: each module's floor follows from where it lives (its subpackage,
or the ground or top floor of the package's own modules), a module imports only from its own floor or below, the
imports within a floor never run in a circle, and no import hides inside a function (where a cycle hides). A new
module in an existing subpackage needs no edit here. A step's code version is the import closure of its script."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

from replaynoise.provenance import import_closure, package_imports, source_digest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "replaynoise"
#: The floors, bottom to top: a module may import from its own floor or one below, never from one above. A
#: subpackage is a floor of its own; "ground" holds the package's own modules everything builds on (``GROUND``) and
#: "top" every other module of the package (the configuration, the plan of outputs, provenance and the commands a
#: reviewer runs), so that a new module there sits above every subpackage.
FLOORS = ["ground", "data", "engines", "generation", "analysis", "report", "top"]
GROUND = {"io", "logs", "overlays", "progress", "seeds", "settings"}
#: The subpackages of this floor are plugins: none imports another (the registry, above them, imports each).
PLUGINS = "engines"
#: Function-level imports of replaynoise kept on purpose: the engine a configuration names is loaded only when
#: chosen, so that importing the engine interface (the passes, the analysis) never loads torch or vLLM.
LAZY: set[tuple[str, str]] = set()  # the engine factory imports an engine by name (engines.registry), no statement

Graph = dict[str, tuple[set[str], set[str]]]


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = path.relative_to(package).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules(package: Path = PACKAGE) -> dict[str, Path]:
    """{dotted name below the package: file} of every module, the package's own __init__ left out."""
    return {module_name(p, package): p for p in sorted(package.rglob("*.py")) if module_name(p, package)}


MODULES = package_modules()


def internal_imports(path: Path, modules: dict[str, Path] = MODULES) -> tuple[set[str], set[str]]:
    """(module-level, function-level) replaynoise modules imported by ``path``."""
    top, inner = set(), set()
    for name, at_top in package_imports(path):
        module = name.removeprefix("replaynoise").lstrip(".")
        if module in modules:  # not a name imported from a module
            (top if at_top else inner).add(module)
    return top, inner


def import_graph(package: Path = PACKAGE) -> Graph:
    """{module: (module-level, function-level) imports} of every module of ``package``."""
    modules = package_modules(package)
    return {module: internal_imports(path, modules) for module, path in modules.items()}


def floor(module: str) -> str:
    """The floor a module lives on: its subpackage, the ground floor or the top."""
    head = module.split(".")[0]
    if head in FLOORS:
        return head
    return "ground" if module in GROUND else "top"


def plugins(graph: Graph) -> set[str]:
    """The subpackages of the ``PLUGINS`` floor (``engines.hf``): those with modules of their own."""
    return {
        m
        for m in graph
        if m.count(".") == 1 and m.startswith(f"{PLUGINS}.") and any(k.startswith(f"{m}.") for k in graph)
    }


def circle(graph: Graph) -> list[str]:
    """One circle of module-level imports (its modules in order, the first repeated at the end), or []."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str]:
        state[module] = 1
        path.append(module)
        for name in sorted(graph[module][0]):
            if state.get(name) == 1:
                return path[path.index(name) :] + [name]
            if name not in state and (found := visit(name)):
                return found
        state[module] = 2
        path.pop()
        return []

    for module in sorted(graph):
        if module not in state and (found := visit(module)):
            return found
    return []


def breaches(graph: Graph) -> list[str]:
    """Every import that breaks the layers: one from a floor above, one between two plugins, one inside a function
    (unless kept in ``LAZY``), and a circle of imports."""
    rank = {name: i for i, name in enumerate(FLOORS)}
    owners = plugins(graph)

    def plugin(module: str) -> str | None:
        return next((p for p in owners if module == p or module.startswith(f"{p}.")), None)

    found = []
    for module, (top, inner) in sorted(graph.items()):
        for name in sorted(top | inner):
            if rank[floor(name)] > rank[floor(module)]:
                found.append(f"{module} ({floor(module)}) imports {name} from a floor above ({floor(name)})")
            if plugin(module) and plugin(name) and plugin(module) != plugin(name):
                found.append(f"{module} imports {name}, another plugin of {PLUGINS}")
        hidden = sorted(name for name in inner if (module, name) not in LAZY)
        if hidden:
            found.append(f"{module} imports {hidden} inside a function")
    if loop := circle(graph):
        found.append("imports run in a circle: " + " -> ".join(loop))
    return found


def test_the_package_keeps_its_layers():
    assert not breaches(import_graph()), "\n".join(breaches(import_graph()))


def test_the_floors_declared_are_the_package_s_own():
    """Every subpackage has its place in ``FLOORS`` (a new one would otherwise sit on the top floor unseen), every
    floor holds modules and every ground module exists."""
    subpackages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert subpackages == set(FLOORS) - {"ground", "top"}
    assert {floor(m) for m in MODULES} == set(FLOORS)
    assert set(MODULES) >= GROUND
    assert plugins(import_graph()) == {"engines.hf", "engines.vllm", "engines.sglang"}


def test_a_new_module_needs_no_edit_and_an_upward_one_breaks_the_layers(tmp_path):
    package = tmp_path / "replaynoise"
    shutil.copytree(PACKAGE, package, ignore=shutil.ignore_patterns("__pycache__"))
    (package / "data" / "fresh.py").write_text("from replaynoise.io import write_json\n")
    (package / "report" / "fresh.py").write_text("from replaynoise.data.fresh import write_json\n")
    assert not breaches(import_graph(package))
    (package / "data" / "upward.py").write_text("from replaynoise.report.summary import verdict\n")
    assert breaches(import_graph(package)) == ["data.upward (data) imports report.summary from a floor above (report)"]


def test_the_contract_sees_each_kind_of_breach():
    graph: Graph = {
        "io": (set(), set()),
        "settings": ({"config"}, set()),  # the ground floor importing a top-level module
        "config": (set(), set()),
        "engines.hf": (set(), set()),
        "engines.hf.engine": ({"engines.vllm.build"}, set()),  # one plugin importing another
        "engines.vllm": (set(), set()),
        "engines.vllm.build": (set(), set()),
        "engines.registry": ({"engines.hf", "engines.vllm.build"}, set()),  # below both, allowed
        "analysis.a": ({"analysis.b", "io"}, set()),
        "analysis.b": ({"analysis.c"}, set()),
        "analysis.c": ({"analysis.a"}, set()),  # a circle within a floor
        "report.r": (set(), {"analysis.a"}),  # downward, but inside a function
    }
    assert breaches(graph) == [
        "engines.hf.engine imports engines.vllm.build, another plugin of engines",
        "report.r imports ['analysis.a'] inside a function",
        "settings (ground) imports config from a floor above (top)",
        "imports run in a circle: analysis.a -> analysis.b -> analysis.c -> analysis.a",
    ]
    del graph["analysis.c"], graph["analysis.b"], graph["engines.hf.engine"], graph["settings"], graph["report.r"]
    graph["analysis.a"] = ({"io"}, set())
    assert breaches(graph) == []


def test_the_bottom_module_imports_nothing_of_the_package():
    assert internal_imports(MODULES["io"]) == (set(), set())


def test_a_step_s_code_version_follows_its_script_s_imports(tmp_path):
    (tmp_path / "replaynoise").mkdir()
    (tmp_path / "replaynoise" / "__init__.py").write_text("")
    (tmp_path / "replaynoise" / "low.py").write_text("X = 1\n")
    (tmp_path / "replaynoise" / "high.py").write_text("from replaynoise.low import X\n")
    (tmp_path / "replaynoise" / "other.py").write_text("Y = 2\n")
    script = tmp_path / "step.py"
    script.write_text("import sys\nfrom replaynoise import high\n")
    assert [p.name for p in import_closure(script, tmp_path)] == ["__init__.py", "high.py", "low.py"]
    before = source_digest(script, tmp_path)
    (tmp_path / "replaynoise" / "other.py").write_text("Y = 3\n")
    assert source_digest(script, tmp_path) == before  # not imported: no rerun
    (tmp_path / "replaynoise" / "low.py").write_text("X = 2\n")
    assert source_digest(script, tmp_path) != before  # imported through high: rerun


@pytest.mark.parametrize("script", ["figure", "headline_tables"])
def test_figure_and_table_steps_do_not_load_the_statistics(script):
    """A figure or table job selects pivots (conditionings) and counts disagreements (disagreement) without
    importing the statistics (paper_stats, comparison, replicated, prefix_mismatch), whose statsmodels and scipy
    imports would double the job's start-up."""
    closure = {
        path.relative_to(REPO).as_posix()
        for path in import_closure(REPO / "workflow" / "scripts" / f"{script}.py", REPO)
    }
    statistics = {
        f"replaynoise/analysis/{name}.py"
        for name in ("paper_stats", "comparison", "replicated", "prefix_mismatch", "probes")
    }
    assert all((REPO / path).is_file() for path in statistics)  # the names are the modules' own
    assert "replaynoise/report/figures.py" in closure or "replaynoise/report/tables.py" in closure
    assert not closure & statistics, sorted(closure)


def _dataclass_fields() -> dict[str, tuple[str, ...]]:
    """{module.Class: its own annotated fields} of every dataclass in the package."""
    found = {}
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            decorated = isinstance(node, ast.ClassDef) and any(
                "dataclass" in ast.unparse(d) for d in node.decorator_list
            )
            if decorated:
                fields = tuple(
                    s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                )
                found[f"{module}.{node.name}"] = fields
    return found


def test_no_record_type_is_defined_twice():
    """A dataclass whose fields open with all of another's (three or more) repeats that type instead of
    deriving from it: a pinned wheel member was once written out in models.py and again in datasets.py."""
    fields = _dataclass_fields()
    repeated = [
        (a, b)
        for a, fa in fields.items()
        for b, fb in fields.items()
        if a != b and len(fa) >= 3 and fb[: len(fa)] == fa
    ]
    assert not repeated
    assert "data.packages.PinnedMember" in fields
