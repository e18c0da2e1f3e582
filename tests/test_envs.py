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
ENV_FILES = sorted((REPO / "envs").glob("*.yaml"))
RULE_FILES = sorted((REPO / "workflow" / "rules").glob("*.smk"))
#: Pinned in requirements.txt but not needed inside the rule envs: pytest runs the test suite, and snakemake is the
#: driver (it puts itself on a rule script's sys.path through the script preamble; the scripts import nothing from
#: it, which test_driver_only_pins_are_not_imported_in_rule_code checks).
TEST_ONLY = {"pytest"}
DRIVER_ONLY = {"snakemake"}
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s=<>!~;]+)$")
CONDA_DIRECTIVE = re.compile(r"^\s*conda:\s*\n\s*[\"']([^\"']+)[\"']", re.MULTILINE)


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


def requirement_pins() -> dict[str, str]:
    lines = [ln for ln in REQUIREMENTS.read_text().splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    return parse_pins(lines, "requirements.txt")


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
    env_pins = {p.name: env_pip_pins(p) for p in ENV_FILES}
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
    importing = [p.relative_to(REPO).as_posix() for p in code
                 if re.search(r"^\s*(from|import)\s+snakemake\b", p.read_text(), re.MULTILINE)]
    assert not importing, f"these import snakemake, so envs/*.yaml must pin snakemake too: {importing}"


@pytest.mark.parametrize("env_file", ENV_FILES, ids=lambda p: p.name)
def test_every_env_pin_matches_requirements(env_file):
    reqs = requirement_pins()
    pins = env_pip_pins(env_file)
    assert pins, f"{env_file.name}: empty pip section"
    problems = [f"{n}=={v} (requirements.txt: {reqs.get(n)})" for n, v in pins.items() if reqs.get(n) != v]
    assert not problems, f"{env_file.name}: pins not in requirements.txt with the same version: {problems}"


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
    found = []
    for rule_file in [REPO / "Snakefile", *RULE_FILES]:
        found += [(rule_file, m.group(1)) for m in CONDA_DIRECTIVE.finditer(rule_file.read_text())]
    return found


def test_conda_directives_point_to_existing_env_files():
    directives = conda_directives()
    # Every rule with a script runs in a conda env under --use-conda; make sure the regex saw them.
    n_scripts = sum(len(re.findall(r"^\s*script:\s*$", f.read_text(), re.MULTILINE)) for f in RULE_FILES)
    assert len(directives) == n_scripts > 0, f"{len(directives)} conda: directives for {n_scripts} script: rules"
    missing = [f"{f.name}: {env}" for f, env in directives if not (f.parent / env).resolve().is_file()]
    assert not missing, f"conda: directives pointing to no file: {missing}"
    used = {(f.parent / env).resolve() for f, env in directives}
    assert used <= {p.resolve() for p in ENV_FILES}, "a conda: directive points outside envs/"
    assert used == {p.resolve() for p in ENV_FILES}, "an envs/*.yaml file is used by no rule"
