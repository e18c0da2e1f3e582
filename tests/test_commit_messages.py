"""The commit-message check that .ci/run runs: a subject of at most 72 characters in the imperative, a blank line
before the body, over the commits from the first one held to the form."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEC = importlib.util.spec_from_file_location("commit_messages", ROOT / ".ci" / "commit_messages.py")
assert SPEC and SPEC.loader
commit_messages = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(commit_messages)


def test_a_message_of_the_usual_form_passes():
    assert commit_messages.problems("Add the check\n\nWhy it is there, in the body.\n") == []
    assert commit_messages.problems("Re-feed the prefix once\n") == []


def test_each_departure_from_the_form_is_named():
    assert "subject of 73 characters" in commit_messages.problems("A" * 73)[0]
    assert "not an imperative" in commit_messages.problems("Added the check")[0]
    assert "not an imperative" in commit_messages.problems("Fixing the check")[0]
    assert "no blank line" in commit_messages.problems("Add the check\nthe body at once")[0]


def test_the_first_commit_held_to_the_form_is_in_the_history():
    done = subprocess.run(["git", "cat-file", "-e", f"{commit_messages.FIRST}^{{commit}}"], cwd=ROOT, check=False)
    assert done.returncode == 0
