"""Every relative link in a committed Markdown file reaches a file or folder of the repository."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: [text](target) and [text]: target, the target up to a space, a closing parenthesis or an anchor
LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)|^\s*\[[^\]]+\]:\s*(\S+)", re.MULTILINE)
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.DOTALL)


def markdown_files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.md"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return sorted(ROOT / p for p in listed if (ROOT / p).is_file())


def dead_links(path: Path) -> list[str]:
    """The relative link targets of one Markdown file that name nothing on disk (code spans left out)."""
    text = CODE.sub("", path.read_text())
    dead = []
    for match in LINK.finditer(text):
        target = (match.group(1) or match.group(2)).split("#", 1)[0]
        if not target or re.match(r"[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
            continue  # an anchor in the same file, or a URL (http:, mailto:, javascript:)
        if not (path.parent / target).exists():
            dead.append(target)
    return dead


def test_the_check_finds_a_dead_link_and_passes_live_ones(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("")
    page.write_text("[a](there.md#x) [b](gone.md) [c](https://example.org) `[d](code.md)` [e](#top)\n")
    assert dead_links(page) == ["gone.md"]


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_dead_relative_link(path):
    assert not dead_links(path)
