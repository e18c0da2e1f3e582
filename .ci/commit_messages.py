"""Commit messages of the usual form: a subject of at most 72 characters in the imperative, then a blank line before
any body. Checked over the commits from FIRST (the first to follow the form) to HEAD, merges left out."""

from __future__ import annotations

import subprocess
import sys

#: the first commit held to the form; the commits before it keep their subjects
FIRST = "740b58007b424ee21bfb416c58f46b95b1a6fadc"
SUBJECT_MAX = 72
#: first words that end as a past tense or a gerund would, yet are imperatives
IMPERATIVE_ENDINGS_OK = {"bring", "embed", "feed", "need", "re-feed", "seed", "shed", "speed", "string"}


def problems(message: str) -> list[str]:
    """What is wrong with one commit message: the subject's length, its mood, a body not set off by a blank line."""
    lines = message.rstrip("\n").splitlines() or [""]
    subject, found = lines[0], []
    if not subject.strip():
        found.append("empty subject")
    if len(subject) > SUBJECT_MAX:
        found.append(f"subject of {len(subject)} characters (at most {SUBJECT_MAX})")
    word = subject.split(" ", 1)[0].lower().rstrip(":,")
    if word not in IMPERATIVE_ENDINGS_OK and (word.endswith("ed") or word.endswith("ing")):
        found.append(f"subject opens with {word!r}, not an imperative")
    if len(lines) > 1 and lines[1].strip():
        found.append("no blank line between the subject and the body")
    return found


def main(argv: list[str]) -> int:
    first = argv[0] if argv else FIRST
    revs = subprocess.run(
        ["git", "rev-list", "--no-merges", f"{first}^..HEAD"], capture_output=True, text=True, check=True
    ).stdout.split()
    bad = 0
    for rev in revs:
        message = subprocess.run(["git", "log", "-1", "--format=%B", rev], capture_output=True, text=True, check=True)
        for problem in problems(message.stdout):
            print(f"{rev[:10]}: {problem}: {message.stdout.splitlines()[0]}", file=sys.stderr)
            bad += 1
    print(f"commit messages: {len(revs)} checked from {first[:10]}, {bad} problems")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
