"""The package's layer order, read from its imports: a module imports only modules below it, never inside a
function (where a cycle hides), and a step's code version is the import closure of its script."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from replaynoise.provenance import import_closure, package_imports, source_digest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "replaynoise"
#: The subpackages, bottom to top: a module may import from its own subpackage or one below, never from one above.
#: "" is the package's ground floor (io, settings, ...); the top floor holds what sits above every subpackage (the
#: configuration, the plan of outputs, provenance and the commands a reviewer runs).
SUBPACKAGES = ["", "data", "engines", "generation", "analysis", "report", "top"]
TOP = {
    "config_checks",
    "config",
    "plan",
    "machine",
    "provenance",
    "snapshots",
    "paper_records",
    "partials",
    "reference",
    "reanalyze",
    "power",
    "savings",
    "fingerprint",
    "divergence",
    "reproduction",
    "regime",
    "vouching",
}
#: Bottom to top. A module may import only modules of earlier layers (or of its own package's base).
LAYERS = [
    # the subpackages' own __init__ modules hold their docstrings and import nothing
    [
        "io",
        "logs",
        "overlays",
        "progress",
        "seeds",
        "settings",
        "data",
        "engines.hf",
        "engines.vllm",
        "engines.sglang",
        "generation",
        "analysis",
        "report",
    ],
    ["data.grading", "data.prompts", "data.packages"],
    ["data.benchmarks"],
    ["data.datasets", "data.loading"],
    ["data.models"],
    ["data.preparation"],
    [
        "engines.base",
        "engines.sampling",
        "engines.hf.cpu_matmul",
        "engines.vllm.build",
        "engines.hf.settings",
        "engines.vllm.settings",
        "engines.sglang.settings",
        "engines.sglang.plugin",
    ],
    [
        "engines.hf.kvfiles",
        "engines.hf.kernels",
        "engines.hf.flash",
        "engines.hf.records",
        "engines.recipes",
        "engines.registry",
    ],
    ["engines.sglang.launch"],
    ["engines.hf.static", "engines.vllm.engine", "engines.sglang.engine"],
    ["engines.hf.states"],
    ["engines.hf.refill"],
    ["engines.hf.forwards"],
    ["engines.hf.cached"],
    ["engines.hf.modes"],
    ["engines.hf.invariant_modes"],
    ["engines.hf.engine"],
    ["engines"],
    [
        "generation.passes",
        "generation.shards",
        "generation.pivots",
        "generation.training_log",
        "generation.answer_spans",
    ],
    ["generation.continuations"],
    ["generation.rollouts", "generation.replay", "generation.training"],
    ["generation.regime"],
    [
        "analysis.disagreement",
        "analysis.groups",
        "analysis.credit",
        "analysis.channels",
        "analysis.conditionings",
        "analysis.verification",
        "analysis.rl_metrics",
    ],
    ["analysis.paper_stats"],
    ["analysis.replicated", "analysis.prefix_mismatch", "analysis.probes", "analysis.agreement"],
    ["analysis.comparison", "analysis.controls", "analysis.factors", "analysis.stopping"],
    ["analysis.pooling", "analysis.cross_scoring", "analysis.runs", "analysis.mechanism"],
    [
        "report.summary",
        "report.cost",
        "report.drawing",
        "report.headline",
        "report.contrasts",
        "report.combined",
        "report.alarms",
    ],
    ["report.tables", "report.figures", "report.mechanism", "report.landing"],
    ["report.credit_figures"],
    ["report.plots"],
    ["report.controls", "report.training"],
    ["config_checks"],
    ["config", "plan", "fingerprint", "vouching"],
    ["machine", "provenance", "snapshots", "paper_records"],
    ["partials", "divergence"],
    ["reproduction", "savings"],
    ["reference", "reanalyze", "power", "regime"],
]
#: Function-level imports of replaynoise kept on purpose: the engine a configuration names is loaded only when
#: chosen, so that importing the engine interface (the passes, the analysis) never loads torch or vLLM.
LAZY: set[tuple[str, str]] = set()  # the engine factory imports an engine by name (engines.registry), no statement


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if module_name(p)}


def internal_imports(path: Path) -> tuple[set[str], set[str]]:
    """(module-level, function-level) replaynoise modules imported by ``path``."""
    top, inner = set(), set()
    for name, at_top in package_imports(path):
        module = name.removeprefix("replaynoise").lstrip(".")
        if module in MODULES:  # not a name imported from a module
            (top if at_top else inner).add(module)
    return top, inner


def test_every_module_has_a_layer():
    placed = [m for layer in LAYERS for m in layer]
    assert sorted(placed) == sorted(MODULES), set(placed) ^ set(MODULES)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_a_module_imports_only_lower_layers_and_only_at_the_top(module):
    rank = {m: i for i, layer in enumerate(LAYERS) for m in layer}
    top, inner = internal_imports(MODULES[module])
    for name in top | inner:
        if name == "engines" and module.startswith("engines."):
            continue  # a submodule's import runs its package's __init__, which imports nothing at module level
        assert rank[name] < rank[module], f"{module} (layer {rank[module]}) imports {name} (layer {rank[name]})"
    assert {(module, name) for name in inner} <= LAZY, f"{module} imports {sorted(inner)} inside a function"


def subpackage(module: str) -> str:
    """The floor a module lives on: its subpackage, the ground floor, or the top."""
    if module in TOP:
        return "top"
    head = module.split(".")[0]
    return head if head in SUBPACKAGES else ""


@pytest.mark.parametrize("module", sorted(MODULES))
def test_the_subpackages_are_floors_a_module_imports_from_its_own_or_lower(module):
    """The folders show the layers: data below engines below generation below analysis below report below the
    configuration and the reviewer's commands. (The engines' package imports the engine it is asked for and the
    model loader inside its factory, the one lazy import.)"""
    rank = {name: i for i, name in enumerate(SUBPACKAGES)}
    top, inner = internal_imports(MODULES[module])
    for name in top | (inner - {n for m, n in LAZY if m == module}):
        assert rank[subpackage(name)] <= rank[subpackage(module)], f"{module} imports {name} from a floor above"


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
