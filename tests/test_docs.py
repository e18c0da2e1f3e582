"""docs/ is reference, not a lab notebook: the pages a reader needs (method, configuration, outputs, one page per
engine, reliability, cluster, results, mechanism), at most 80 KiB together; dated logs live beside their
measurements under benchmarks/results/."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = {"method", "configuration", "outputs", "hf", "vllm", "sglang", "reliability", "cluster", "results", "mechanism"}
MAX_BYTES = 80 * 1024


def test_docs_hold_the_reference_pages_and_no_others():
    assert {p.stem for p in DOCS.glob("*.md")} == PAGES


def test_docs_stay_within_80_kib():
    sizes = {p.name: p.stat().st_size for p in DOCS.glob("*.md")}
    assert sum(sizes.values()) <= MAX_BYTES, sorted(sizes.items(), key=lambda kv: -kv[1])


def test_no_page_is_titled_by_an_issue_or_a_lease():
    for page in DOCS.glob("*.md"):
        title = page.read_text().splitlines()[0].lower()
        assert "issue" not in title and "lease" not in title, page.name
