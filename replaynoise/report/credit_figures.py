"""The figures drawn from the per-pivot credit tables rather than the comparisons: the distribution of
Â(re-feed) - Â(exact) and the disagreement by pivot margin, on a conditioning's pivots."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import polars as pl

from replaynoise.analysis.conditionings import eligible_frame
from replaynoise.analysis.disagreement import disagree
from replaynoise.report.drawing import PathLike, finish, message_figure, new_figure, save_figure
from replaynoise.report.figures import COLORS, NO_DATA


def _frames(credits: Mapping[str, Mapping[str, pl.DataFrame]] | None, conditioning: str) -> dict[str, pl.DataFrame]:
    out = {}
    for cfg, credit in (credits or {}).items():
        if not credit:
            continue
        sel = eligible_frame(credit, conditioning)
        if sel is not None and sel.height:
            out[cfg] = sel
    return out


def plot_diff_histogram(
    credits: Mapping[str, Mapping[str, pl.DataFrame]] | None, out_png: PathLike, out_pdf: PathLike, conditioning: str
) -> None:
    """Histogram of d = Â_refeed - Â_exact on its lattice (step 1/K), one panel per configuration.

    A mean-zero perturbation shows as a histogram symmetric about 0; the bar at 0 is the agreement share.
    """
    title = f"Â(re-feed) - Â(exact) on eligible pivots ({conditioning})"
    frames = _frames(credits, conditioning)
    if not frames:
        save_figure(message_figure(NO_DATA, title), out_png, out_pdf)
        return
    ncols = min(3, len(frames))
    nrows = -(-len(frames) // ncols)
    fig = new_figure(3.2 * ncols + 0.5, 2.6 * nrows + 0.6)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    for ax, (cfg, sel) in zip(axes.ravel(), frames.items()):
        k = int(sel["k"].max())
        steps = np.rint((sel["a_hat__refeed"].to_numpy() - sel["a_hat__exact"].to_numpy()) * k).astype(int)
        support = np.arange(-2 * k, 2 * k + 1)
        counts = np.array([(steps == m).sum() for m in support])
        ax.bar(support / k, counts / counts.sum(), width=0.8 / k, color=COLORS["refeed"])
        ax.axvline(0, color="black", linewidth=0.8)
        ax.set_title(f"{cfg} (n={sel.height}, K={k}, mean={steps.mean() / k:+.3f})", fontsize=8)
        ax.set_xlabel("d = Â_refeed - Â_exact")
        ax.set_xlim(-2.05, 2.05)
    for ax in axes.ravel()[len(frames) :]:
        ax.set_axis_off()
    axes[0, 0].set_ylabel("share of pivots")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    save_figure(fig, out_png, out_pdf)


def margin_bins(margins: np.ndarray, n_bins: int) -> np.ndarray:
    """Equal-count bin edges (quantiles), collapsed where ties make edges coincide."""
    edges = np.unique(np.quantile(margins, np.linspace(0, 1, n_bins + 1)))
    return edges if edges.size >= 2 else np.array([margins.min(), margins.max() + 1e-12])


def disagreement_by_margin(sel: pl.DataFrame, edges: Sequence[float], metric: str) -> pl.DataFrame:
    """Per margin bin: pivot count and shares where exact and refeed (and exact and replica) disagree."""
    margins = sel["margin"].to_numpy()
    e, ref, rep = (sel[f"a_hat__{p}"].to_numpy() for p in ("exact", "refeed", "replica"))
    refeed, replica = disagree(e, ref, metric), disagree(e, rep, metric)
    idx = np.clip(np.searchsorted(edges, margins, side="right") - 1, 0, len(edges) - 2)
    rows = []
    for b in range(len(edges) - 1):
        m = idx == b
        n = int(m.sum())
        rows.append(
            {
                "lo": float(edges[b]),
                "hi": float(edges[b + 1]),
                "n": n,
                "refeed": float(refeed[m].mean()) if n else None,
                "replica": float(replica[m].mean()) if n else None,
            }
        )
    return pl.DataFrame(
        rows, schema={"lo": pl.Float64, "hi": pl.Float64, "n": pl.Int64, "refeed": pl.Float64, "replica": pl.Float64}
    )


def plot_disagreement_vs_margin(
    credits: Mapping[str, Mapping[str, pl.DataFrame]] | None,
    out_png: PathLike,
    out_pdf: PathLike,
    conditioning: str,
    n_bins: int,
    metric: str,
) -> None:
    """Disagreement share by pivot margin (equal-count bins, pivots pooled over configurations)."""
    title = f"Disagreement by pivot margin, pooled over configurations ({conditioning}, {metric} metric)"
    frames = _frames(credits, conditioning)
    if not frames:
        save_figure(message_figure(NO_DATA, title), out_png, out_pdf)
        return
    cols = ["margin", "a_hat__exact", "a_hat__refeed", "a_hat__replica"]
    pooled = pl.concat([f.select(cols) for f in frames.values()], how="vertical_relaxed")
    table = disagreement_by_margin(pooled, margin_bins(pooled["margin"].to_numpy(), n_bins), metric)
    table = table.filter(pl.col("n") > 0)
    mid = ((table["lo"] + table["hi"]) / 2).to_numpy()
    fig = new_figure()
    ax = fig.add_subplot()
    ax.plot(mid, 100 * table["refeed"].to_numpy(), marker="o", color=COLORS["refeed"], label="exact vs re-feed")
    ax.plot(mid, 100 * table["replica"].to_numpy(), marker="s", color=COLORS["floor"], label="exact vs replica")
    labels = [f"{lo:.3f}-{hi:.3f}\nn={n}" for lo, hi, n in table.select("lo", "hi", "n").iter_rows()]
    ax.set_xticks(mid, labels, fontsize=7)
    ax.set_xlabel("pivot margin (top-1 vs top-2 gap, in the pivot rule's unit; equal-count bins)")
    ax.set_ylabel("% pivots whose estimate disagrees")
    finish(fig, ax, title, out_png, out_pdf)
