"""When two credit estimates disagree: the paper's sign metric and our value metric.

Apart from the statistics (``replaynoise.analysis.paper_stats``), which need statsmodels and scipy: figures and
tables count
disagreements too, and a step that draws a figure should not load them to do it.
"""

from __future__ import annotations

import numpy as np

#: Disagreement metrics: the paper's (pre-registered) sign metric first, then ours.
METRICS = ("sign", "value")
METRIC_DEFINITIONS = {
    "sign": "the paper's: sign(A_a) != sign(A_b); two different nonzero values of one sign agree",
    "value": "ours: A_a != A_b; a same-sign change of magnitude is a disagreement",
}


def check_metric(metric: str) -> str:
    if metric not in METRICS:
        raise ValueError(f"unknown disagreement metric {metric!r}; expected one of {METRICS}")
    return metric


def disagree(a: np.ndarray, b: np.ndarray, metric: str) -> np.ndarray:
    """Per pivot, whether two estimates disagree under ``metric`` (exact comparisons: Â lives on a lattice)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if check_metric(metric) == "sign":
        return np.sign(a) != np.sign(b)
    return a != b
