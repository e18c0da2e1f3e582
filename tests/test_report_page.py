"""The report opens on the answer: its first page, as headless Chromium renders it, holds every configuration's main
row with its interval, whether it resolved and what it means, and the settings as a table; and every figure of the
report displays as an image. Chromium is Debian's package: where it is absent the test skips, unless
REPLAYNOISE_REQUIRE_CHROMIUM=1 (set by .ci/run, which installs it) makes that a failure."""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess

import polars as pl
import pytest
import yaml
from helpers import REPO, TINY, snakemake

from replaynoise.config import validate_config
from replaynoise.provenance import configuration_differences
from replaynoise.report.summary import summary_value, verdict

#: Appended to a copy of the report: once the page has rendered, it records the first page's text, then shows each
#: figure as the report's own buttons do (``app.setView``) and records the size the browser decoded it at.
PROBE = """<script>
window.addEventListener("load", function () {
  setTimeout(async function () {
    const page = document.querySelector(".prose");
    const out = {landing: page ? page.innerText : null, figures: {}};
    for (const [path, entry] of Object.entries(results)) {
      if (!/\\.(png|svg|jpe?g)$/.test(path)) continue;
      app.setView({content: "img", contentPath: entry.data_uri, resultPath: path});
      await new Promise(function (done) { setTimeout(done, 100); });
      const img = Array.from(document.querySelectorAll("img")).find(function (i) {
        return i.getAttribute("src") === entry.data_uri;
      });
      if (img && !img.complete) await new Promise(function (done) { img.onload = done; img.onerror = done; });
      out.figures[path] = img ? [img.naturalWidth, img.naturalHeight] : null;
    }
    const pre = document.createElement("pre");
    pre.id = "probe";
    pre.textContent = JSON.stringify(out);
    document.body.appendChild(pre);
  }, 500);
});
</script>"""


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        message = "no chromium here (apt-get install chromium)"
        if os.environ.get("REPLAYNOISE_REQUIRE_CHROMIUM") == "1":
            pytest.fail(message + ", and REPLAYNOISE_REQUIRE_CHROMIUM=1 says it must be")
        pytest.skip(message)
    return found


def rendered(browser: str, page) -> dict:
    """What the probe recorded in the page as headless Chromium rendered it."""
    proc = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=30000", "--dump-dom"]
        + [page.as_uri()],
        capture_output=True,
        text=True,
        timeout=300,
    )
    found = re.search(r'<pre id="probe">(.*?)</pre>', proc.stdout, re.DOTALL)
    assert found, proc.stderr[-3000:]
    return json.loads(html.unescape(found.group(1)))


def test_the_report_opens_on_the_answer_and_shows_every_figure(tiny_run, tmp_path):
    browser = chromium()
    snakemake(tiny_run, TINY, "--report", "results/report.html")
    report = (tiny_run / "results" / "report.html").read_text()
    page = tmp_path / "report.html"
    end = report.rindex("</body>")  # the page's own; embedded data may hold the string too
    page.write_text(report[:end] + PROBE + report[end:])
    seen = rendered(browser, page)

    landing = seen["landing"]
    assert landing.index("The answer") < landing.index("What this measures") < landing.index("The settings")
    headline = pl.read_csv(tiny_run / "results" / "tables" / "headline.csv", comment_prefix="#", infer_schema_length=0)
    for row in headline.filter((pl.col("conditioning") == "main") & (pl.col("config") != "pooled")).to_dicts():
        cells = next(line for line in landing.splitlines() if line.startswith(row["config"] + "\t")).split("\t")
        assert cells[4].startswith(summary_value(row, "excess_pp", 1.0, "{:+.1f}")), cells
        assert cells[-1] == verdict(row)[0], cells
        assert verdict(row)[1] in landing, "no sentence of what the row means"
    assert "flip the sign of their credit" in landing
    for key, value in {"model": TINY["configs"]["tiny"]["model"], "engine": "hf"}.items():
        assert re.search(rf"^{key}\t{re.escape(str(value))}", landing, re.MULTILINE), key
    assert "{'" not in landing  # no configuration printed as a raw Python dict

    figures = {
        f"results/{p.relative_to(tiny_run / 'results').as_posix()}" for p in tiny_run.glob("results/figures/*.png")
    }
    assert len(figures) >= 7 and set(seen["figures"]) == figures
    blank = {path: size for path, size in seen["figures"].items() if not size or min(size) < 100}
    assert not blank, blank


def row(**cells) -> dict:
    base = {"config": "c", "refeed_disagreement": "0.2", "floor": "0.05", "excess_pp": "15.0"}
    return {**base, "excess_pp_ci_lo": "5.0", "excess_pp_ci_hi": "25.0", "pairs": "1", "resolved": "n/a", **cells}


def test_each_kind_of_row_gets_its_verdict():
    assert verdict(row(pairs="3", resolved="true"))[0] == "yes"
    assert verdict(row(pairs="3", resolved="false", excess_pp_ci_lo="-1.0"))[0] == "no"
    assert verdict(row())[0] == "no: one draw per pass"  # excludes 0 over problems, pass draws unmeasured
    assert "includes 0" in verdict(row(excess_pp_ci_lo="-5.0"))[1]
    assert verdict(row(refeed_disagreement="0.0", floor="0.0", excess_pp="0.0"))[0] == "exactly zero"
    assert verdict(row(excess_pp="n/a", note="too few eligible pivots"))[0] == "n/a"


def test_the_settings_table_holds_what_a_configuration_is_and_what_it_changed():
    config = validate_config(yaml.safe_load((REPO / "config" / "config.yaml").read_text()))
    config["configs"]["smollm2-bf16"]["top_p"] = 0.95
    found = configuration_differences(config)["smollm2-bf16"]
    assert found == {
        "model": "smollm2-135m",
        "engine": "hf",
        "dtype": "bfloat16",
        "device": "cpu",
        "kernels": "stock",
        "top_p": 0.95,
    }
