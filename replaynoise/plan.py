"""What a run's outputs are, decided from its settings alone: the figures, the control outputs and what pools.

The Snakefile imports this while it parses, for every dry run and every start, so it holds nothing that loads
the analysis or plotting libraries (statsmodels and matplotlib took most of a parse).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from replaynoise.analysis.groups import POOL_KEYS, pool_settings  # noqa: F401 (the workflow reads them here)
from replaynoise.generation.passes import FLOOR_CONTROLS, LAYER_PASS, pass_spec

#: The workflow's figures by what they are drawn from (each drawn by ``report.plots.PLOTS[name]``), named once for
#: the rules and for a rebuild from a reference folder.
FROM_COMPARISONS = ("disagreement", "kinds_of_change", "jaccard_sweep", "mismatch_flips")
FROM_CREDIT = ("diff_histogram", "disagreement_vs_margin")


def plot_options(name: str, config: Mapping[str, Any]) -> dict[str, Any]:
    """The settings of a configuration that figure ``name`` is drawn with: its rule's params (so a change reruns
    only the figures that use it) and a rebuild's, from one place."""
    if name == "channel_agreement":
        return {}
    options: dict[str, Any] = {"conditioning": config["figures"]["conditioning"]}
    if name == "disagreement_vs_margin":
        options.update(n_bins=config["figures"]["margin_bins"], metric=config["analysis"]["metric"])
    return options


def control_outputs(passes: Sequence[str]) -> dict[str, list[str]]:
    """The control figures and tables this list of passes gives: a transplant figure where a transplant runs, the
    per-layer curve where a per-layer transplant runs, the table where any control runs."""
    specs = [pass_spec(p) for p in passes]
    figures = (["transplant"] if any(s.donor for s in specs) else []) + (
        ["transplant_layers"] if any(LAYER_PASS.fullmatch(p) for p in passes) else []
    )
    tables = (["controls"] if any(not s.source.plain for s in specs) else []) + (
        ["floors"] if any(p in FLOOR_CONTROLS for p in passes) else []
    )
    return {"figures": figures, "tables": tables}
