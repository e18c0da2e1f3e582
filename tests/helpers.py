"""What the tests share besides fixtures: the tiny workflow configurations and the ways to run, copy and change a
run. The fixtures that make models and runs are in conftest.py."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import yaml
from filelock import FileLock

from replaynoise.config import validate_config
from replaynoise.engines.base import ContinuationRequest
from replaynoise.engines.hf.engine import HFEngine, HFOptions
from replaynoise.generation.replay import PassJob
from replaynoise.generation.rollouts import RolloutJob
from replaynoise.settings import AnalysisSettings, PromptSettings, ReplaySettings, RolloutSettings

REPO = Path(__file__).resolve().parents[1]
PACKAGES = REPO / "resources" / "packages"  # pip-downloaded wheels, shared with the workflow's cache
SNAKEMAKE = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile")]

#: The tiny random model the workflow's mechanics run on (tests/tinymodel.py, ``close``): made once per machine
#: and kept, at a path named by the code that makes it, so every run of a session (and of the next) sees one
#: path, hence one model key.
#: Responses and the answer the grader reads from each (``grading.extract_answer``); the answer span is checked over
#: the same cases, the last five ones where the last number is not the answer.
GRADER_CASES = [
    ("so the total is \\boxed{\\frac{1}{2}}.", "0.5"),
    ("First \\boxed{3}, then corrected: \\boxed{\\dfrac{3}{4}}", "0.75"),
    ("\\boxed{\\sqrt{\\frac{1}{2}}}", "\\sqrt{\\frac{1}{2}}"),
    ("The answer is \\boxed{\\$1,234.50}", "1234.5"),
    ("\\boxed{18 \\text{ dollars}}", "18"),
    ("She makes 9 * 2 = $18 every day.", "18"),
    ("The total is 1,234 apples.", "1234"),
    ("The temperature fell to -3 degrees.", "-3"),
    ("Janet sells 16-3-4=9 eggs.", "9"),
    ("Each costs $2.50.", "2.5"),
    ("So he has 18.", "18"),
    ("He ate 3/4 of the pie.", "0.75"),
    ("The answer is 42. Check: 40 + 2 = 42, and 7 is odd.", "42"),
    ("Final Answer: 17\nI hope it is correct (1 of 2).", "17"),
    ("blah\n#### 1,600", "1600"),
    ("It takes 2/2=<<2/2=1>>1 bolt", "1"),
    ("I do not know.", None),
    ("", None),
    ("The answer is 12. That took 3 steps.", "12"),
    ("\\boxed{12} (2 + 10)", "12"),
    ("#### 7\nThere were 3 of them.", "7"),
    ("The answer: 5 (checked twice)", "5"),
    ("It is 2/2=<<2/2=1>>1 in \\boxed{ 4 } then 9", "4"),
]

TINY_MODEL_DIR = (
    Path(tempfile.gettempdir())
    / f"replaynoise-tests-{os.getuid()}"
    / f"tiny-close-{hashlib.sha256((REPO / 'tests' / 'tinymodel.py').read_bytes()).hexdigest()[:12]}"
)

#: The workflow on a tiny configuration, shared by the workflow, interruption, sharding and bad-input tests.
TINY = {
    "seed": 11,
    "dataset": {"source": "simple_addsub", "n_problems": 3},
    # one compute thread a model job (cpu_threads), so that two jobs run at once on two cores
    "configs": {"tiny": {"model": str(TINY_MODEL_DIR), "dtype": "float32", "max_new_tokens": 24, "cpu_threads": 1}},
    # one problem per batch: the kill tests land between a shard's batches; one trunk a problem, every problem kept
    "rollouts": {"batch_size": 1, "per_problem": 1, "screen": {"rule": "none"}},
    "pivots": {"max_margin": 0.3, "per_rollout": 2},
    "replay": {
        "k": 2,
        "max_new_tokens": 12,
        "batch_size": 4,
        "probe_tokens": 32,
        "passes": ["exact", "replica", "refeed", "selector"],
    },
    "analysis": {"n_boot": 50, "min_eligible": 1},
    # two shards (of about two batches each): every tiny run scatters and gathers; one thread a model job, so that
    # two of them run at once on two cores
    "resources": {"shard_size": 2, "threads": 1},
}

#: One pass's path through the tiny run (rollouts, pivots, the exact pass, its credit): the target the everyday
#: tier's kill and shard tests rerun, and the files they compare with the uninterrupted run's.
EXACT_PATH = "results/credit/tiny/exact.parquet"
EXACT_PATH_FILES = [
    "rollouts/tiny/rollouts.parquet",
    "pivots/tiny.parquet",
    "passes/tiny/exact.parquet",
    "credit/tiny/exact.parquet",
]

#: The same configuration on the packaged SmolLM2 (30 layers, bf16), for the claims about a real model's numbers
#: (its text, its first steps and KV, its prefix mismatch), with no more model work than they read: the paper's
#: three passes, continuations of six tokens, and one shard a step (the tiny run scatters and gathers, and a shard
#: changes no result: tests/test_sharding.py). It is the workflow's test configuration, .test/config/config.yaml.
SMOLLM2 = {"model": "smollm2-135m", "dtype": "bfloat16", "max_new_tokens": 24, "cpu_threads": 1}
DOT_TEST_CONFIG = REPO / ".test" / "config" / "config.yaml"
TINY_ON_SMOLLM2 = yaml.safe_load(DOT_TEST_CONFIG.read_text())
SMOLLM2_KEY = "smollm2-135m-bfloat16"


def snakemake_command(workdir: Path, config: dict, *args: str) -> list[str]:
    """The command line for ``config`` (written beside the results) in ``workdir``, the committed config ignored."""
    cfg = workdir / "test-config.yaml"
    cfg.write_text(yaml.safe_dump(config))
    return [
        *SNAKEMAKE,
        "--directory",
        str(workdir),
        "--cores",
        "2",
        "--configfile",
        str(cfg),
        "--replace-workflow-config",
        *args,
    ]


def snakemake(workdir: Path, config: dict, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(snakemake_command(workdir, config, *args), capture_output=True, text=True, timeout=1500)
    if check and proc.returncode != 0:
        raise AssertionError(f"snakemake failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def planned_rules(workdir: Path, config: dict, *targets: str) -> set[str]:
    """The rules a dry run (of ``targets``, or of the default target) would execute."""
    out = snakemake(workdir, config, *targets, "-n", "--quiet", "rules").stdout  # --quiet takes several values
    rules = set()
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit() and parts[0] not in ("job", "total"):
            rules.add(parts[0])
    return rules


def rerun_readers(workdir: Path, config: dict) -> set[str]:
    """The rules a dry run reruns because what they read changed (their params or code; Snakemake's "Rules with
    provenance triggered jobs"), not because an upstream output did: the steps that read a changed setting."""
    out = snakemake(workdir, config, "-n").stdout
    found = re.search(r"Rules with provenance triggered jobs: (.*)", out)
    return set(found.group(1).split()) if found else set()


def copy_linking(src: Path, dest: Path, link: Callable[[Path], bool], **copytree_args) -> Path:
    """Copy a tree, hard-linking the files for which ``link(path relative to dest)`` holds (a copy where the file
    system refuses a link). Model weights are linked: no step writes into them (a rebuild replaces the directory
    by a rename, which leaves other links alone), and at about 270 MB a copy they filled CI's disk. Whatever a
    test may change in place must be copied, so the tree it came from stays as it was."""

    def link_or_copy(s: str, d: str) -> None:
        if link(Path(d).relative_to(dest)):
            with contextlib.suppress(OSError):
                os.link(s, d)
                return
        shutil.copy2(s, d)

    shutil.copytree(src, dest, copy_function=link_or_copy, **copytree_args)
    return dest


def built_once(tmp_path_factory, name: str, build: Callable[[Path], None]) -> Path:
    """``name`` (a path relative to the session's temporary folder) made by ``build`` once per test session.
    Under pytest -n the workers share one folder and whichever asks first builds while the others wait on its
    lock (pytest-xdist's recipe): a model conversion or a workflow run of a minute or more is not repeated on each
    worker. What one worker's tests may change must reach them as a private copy (``clone_run``)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # a worker's own folder is popen-gwN inside the session's
    out, done = root / name, root / f"{name}.done"
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{out}.lock"):
        if not done.is_file():
            shutil.rmtree(out, ignore_errors=True)  # what a worker that failed to build it left
            build(out)
            done.touch()
    return out


def seed_model(workdir: Path, model_dir: Path) -> None:
    """Reuse a session's prepared model (a directory named by its key; its preparation is tested by the fixture
    that made it), hard-linked, so the run's prepare_model step has nothing to do."""
    copy_linking(model_dir, workdir / "results" / "models" / model_dir.name, lambda path: True)


def clone_run(run: Path, dest: Path) -> Path:
    """A private copy of a finished run, to change or break; unlocked, its model files hard-linked."""
    copy_linking(run, dest, lambda path: path.parts[:2] == ("results", "models"), symlinks=True)
    shutil.rmtree(dest / ".snakemake" / "locks", ignore_errors=True)
    return dest


def with_setting(config: dict, path: str, value) -> dict:
    """A copy of ``config`` with the key at dotted ``path`` set to ``value`` (its parents made as needed)."""
    config = json.loads(json.dumps(config))
    *parents, last = path.split(".")
    node = config
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return config


def configuration(**given) -> dict:
    """One configuration's settings as the workflow validates them (every default filled), for an engine built
    outside a run: ``make_engine`` reads validated settings and has no defaults of its own."""
    return validate_config({"configs": {"c": {"model": "smollm2-135m", **given}}})["configs"]["c"]


def analysis_settings(**given) -> AnalysisSettings:
    """The embedded default's analysis settings (the schema's, seed 0), some replaced by ``given``: the library's
    comparison takes them whole, with no defaults of its own."""
    config = validate_config({"configs": {"c": {"model": "smollm2-135m"}}})
    return replace(AnalysisSettings.of(config["analysis"], 0), **given)


def rollout_job(
    config_name: str,
    seed: int,
    sampling,
    rules,
    *,
    style: str = "chat",
    instruction: str = "Answer in one short sentence that ends with the number.",
    shots=(),
    per_problem: int = 1,
    batch_size: int = 1,
    long_prompts: str = "refuse",
) -> RolloutJob:
    """A rollout step's job as a test states it: the prompt and batching it does not name are the tests' usual."""
    return RolloutJob(
        config_name=config_name,
        seed=seed,
        sampling=sampling,
        prompt=PromptSettings(style=style, instruction=instruction, shots=tuple(shots)),
        rollouts=RolloutSettings(per_problem=per_problem, batch_size=batch_size, long_prompts=long_prompts),
        rules=rules,
    )


def hf_engine(model, tokenizer, **given) -> HFEngine:
    """An HF engine as the tests build one around a model of their own: stock kernels, top-5, the decode mode
    the device picks, float32 CPU matmuls, unless ``given`` says otherwise."""
    options = {"kernels": "stock", "topk": 5, "decode": "auto", "cpu_matmul": "fp32"} | given
    if "stop_ids" in options:
        options["stop_ids"] = frozenset(options["stop_ids"])
    return HFEngine(model, tokenizer, HFOptions(**options))


def branch_requests(rollout, positions, k: int) -> list[ContinuationRequest]:
    """Continuation requests from one stored rollout's prefixes: at each position, both branches (the rollout's
    token and its runner-up), ``k`` seeds each, resumed from the rollout's KV file."""
    r = rollout
    return [
        ContinuationRequest(
            f"p@{t}",
            branch,
            j,
            1000 * t + 10 * j + len(branch),
            tuple(r.prompt_ids + r.response_ids[:t]),
            token,
            r.kv_file,
            r.kv_sha256,
            r.logits_digests[t],
        )
        for t in positions
        for branch, token in (("orig", r.response_ids[t]), ("sub", r.topk_ids[t][1]))
        for j in range(k)
    ]


def pass_job(
    pass_name: str,
    config_name: str,
    seed: int,
    sampling,
    *,
    k: int,
    batch_size: int,
    probe_tokens: int = 0,
    sample_sizes: dict | None = None,
) -> PassJob:
    """A pass's job as a test states it: no probes and no sample sizes unless it names them."""
    return PassJob(
        pass_name=pass_name,
        config_name=config_name,
        seed=seed,
        sampling=sampling,
        replay=ReplaySettings(k=k, batch_size=batch_size, probe_tokens=probe_tokens, sample_sizes=sample_sizes or {}),
    )


def keep_all(r) -> int:
    """Keep a rollout's whole decode-time KV (the tests' keep function: every position can be a pivot)."""
    return len(r.prompt_ids) + len(r.response_ids) - 1


def interior_rows(rollouts, ks=(0, 1), seed=lambda t, k: 7 * t + k, name="{r.problem_id}@{t}", **given):
    """Rows that resume every rollout at every interior position t, one per k: a pivot's rows share its prefix
    and read the rollout's decode-time KV. ``given``: further fields, each a function of (rollout, t, k)."""
    return [
        ContinuationRequest(
            pivot_id=name.format(r=r, t=t),
            branch="orig",
            k=k,
            seed=seed(t, k),
            prefix_ids=tuple(r.prompt_ids + r.response_ids[:t]),
            branch_token=r.response_ids[t],
            kv_file=r.kv_file,
            kv_sha256=r.kv_sha256,
            expected_digest=r.logits_digests[t],
            **{field: value(r, t, k) for field, value in given.items()},
        )
        for r in rollouts
        for t in range(1, len(r.response_ids) - 1)
        for k in ks
    ]
