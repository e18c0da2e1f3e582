"""Do the tests of docs/reliability.md still fail on the defects they guard? Each mutant breaks one guarantee in a
clean copy of the committed tree (``git archive HEAD``); the guarantee's tests run there and must fail. The same
tests run first on the unbroken copy, where they must pass, so a failure is the defect's and not the copy's.

    .venv/bin/python benchmarks/mutants.py [--only NAME ...] [--out benchmarks/results/mutants.json]

CPU, a few minutes a mutant (most tests make a tiny workflow run first). Prints one line per mutant and writes
the JSON record (commit, per mutant: what was broken, the tests, their exit status and time).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: (name, guarantee, file, text, its broken form, tests that must fail on it)
MUTANTS = [
    (
        "resume-never",
        "a killed run resumes from its kept shards",
        "replaynoise/io.py",
        "    path = Path(path)\n    if not path.is_file():\n        return False\n",
        "    return False\n",
        ["tests/test_interruption.py::test_kills_inside_the_long_steps_resume_from_kept_shards_to_identical_files"],
    ),
    (
        "kv-checksum-skipped",
        "a stored KV file that changed is refused by name",
        "replaynoise/engines/hf/kvfiles.py",
        "    if expected_sha256 is not None:\n        actual = hashlib",
        "    if False:\n        actual = hashlib",
        ["tests/test_bad_inputs.py::test_flipped_byte_in_stored_kv_fails_the_pass_naming_the_file"],
    ),
    (
        "weights-unchecked",
        "edited local weights are refused when the prepared model loads",
        "replaynoise/data/loading.py",
        "        if stamps.get(name) != file_stamp(path):",
        "        if False:",
        ["tests/test_models.py::test_edited_local_weights_are_refused_when_the_prepared_model_loads"],
    ),
    (
        "remote-code",
        "no remote code runs",
        "replaynoise/data/loading.py",
        "        local_files_only=True,\n        trust_remote_code=False,\n",
        "        local_files_only=True,\n        trust_remote_code=True,\n",
        ["tests/test_safety.py::test_remote_code_named_by_a_model_is_never_run"],
    ),
    (
        "shard-overlap",
        "sharding changes no result",
        "replaynoise/generation/shards.py",
        "    return range(start, min(start + shard_size, n_problems))",
        "    return range(max(start - 1, 0), min(start + shard_size, n_problems))",
        ["tests/test_sharding.py::test_one_shard_instead_of_two_gives_the_same_pass"],
    ),
    (
        "rollouts-read-replay",
        "a pass setting reruns the passes, not the rollouts",
        "workflow/rules/rollouts.smk",
        "        # read only to name a problem",
        '        replay=config["replay"],\n        # read only to name a problem',
        ["tests/test_workflow.py::test_changing_one_pass_setting_leaves_rollouts_alone"],
    ),
    (
        "long-prompt-unchecked",
        "no prompt runs past the context",
        "replaynoise/generation/rollouts.py",
        "    if not over:\n",
        "    if True:\n",
        [
            "tests/test_hostile_inputs.py::test_a_prompt_past_the_context_is_refused_by_file_and_line_before_any_generation"
        ],
    ),
]


def tree_copy(dest: Path) -> None:
    """The committed tree, with this checkout's wheel cache beside it (the tests fetch nothing then)."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "HEAD"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    if (REPO / "resources").exists():
        (dest / "resources").symlink_to((REPO / "resources").resolve())


def run_tests(tree: Path, tests: list[str]) -> tuple[int, float, str]:
    started = time.monotonic()
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
    )
    lines = proc.stdout.strip().splitlines() or [""]
    why = next((line[1:].strip() for line in lines if line.startswith("E ")), "")  # the first failure's reason
    return proc.returncode, round(time.monotonic() - started, 1), f"{lines[-1]}{': ' + why if why else ''}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="mutant names (default: all)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "mutants.json")
    args = ap.parse_args()
    chosen = [m for m in MUTANTS if not args.only or m[0] in args.only]
    commit = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    record = {"commit": commit, "python": sys.version.split()[0], "mutants": []}
    with tempfile.TemporaryDirectory(prefix="mutants-") as tmp:
        clean = Path(tmp) / "clean"
        clean.mkdir()
        tree_copy(clean)
        tests = [t for m in chosen for t in m[5]]
        rc, seconds, last = run_tests(clean, tests)
        record["unbroken"] = {"tests": tests, "exit": rc, "seconds": seconds, "summary": last}
        print(f"unbroken tree: exit {rc} in {seconds} s ({last})", flush=True)
        if rc != 0:
            sys.exit("the tests fail on the unbroken tree: no mutant can say anything")
        for name, guarantee, rel, text, broken, tests in chosen:
            tree = Path(tmp) / name
            tree.mkdir()
            tree_copy(tree)
            source = (tree / rel).read_text()
            if source.count(text) != 1:
                sys.exit(f"{name}: the text to break is not in {rel} exactly once: update the mutant")
            (tree / rel).write_text(source.replace(text, broken))
            rc, seconds, last = run_tests(tree, tests)
            caught = rc != 0
            record["mutants"].append(
                {
                    "name": name,
                    "guarantee": guarantee,
                    "file": rel,
                    "tests": tests,
                    "exit": rc,
                    "seconds": seconds,
                    "summary": last,
                    "caught": caught,
                }
            )
            print(f"{name}: {'caught' if caught else 'NOT CAUGHT'} (exit {rc}, {seconds} s: {last})", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    if not all(m["caught"] for m in record["mutants"]):
        sys.exit("a mutant was not caught")


if __name__ == "__main__":
    main()
