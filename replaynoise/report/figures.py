"""The six result figures, as PNG and PDF with byte-reproducible output.

Figures are built on ``matplotlib.figure.Figure`` with an Agg canvas, never through pyplot, so no global
figure state leaks between calls. Timestamps and tool versions are kept out of the file metadata, so the
same data gives the same bytes and the results manifest stays stable across reruns. A figure without data
says so in the image instead of failing the pipeline.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import matplotlib
import numpy as np
import polars as pl
from matplotlib.ticker import NullFormatter

from replaynoise.generation.passes import pass_spec
from replaynoise.report.drawing import PathLike, finish, message_figure, new_figure, save_figure
from replaynoise.settings import METRIC_BEFORE_THE_KEY, comparison_metric

NO_DATA = "no eligible pivots"
COLORS = {
    "floor": "#7f7f7f",
    "refeed": "#d62728",
    "refeed_text": "#ff7f0e",
    "replica_fresh": "#1f77b4",
    "refeed_replica": "#e377c2",
    "serial": "#2ca02c",
    "zero_crossing": "#d62728",
    "reversal": "#9467bd",
    "magnitude": "#bcbd22",
    "ceiling": "#7f7f7f",
}


def _usable(results: Mapping[str, dict] | None, conditioning: str) -> dict[str, dict]:
    """The configurations whose block for ``conditioning`` holds numbers (available, enough pivots)."""
    out = {}
    for cfg, res in (results or {}).items():
        block = (res or {}).get("conditionings", {}).get(conditioning) or {}
        if (
            block.get("available")
            and block.get("n")
            and (block.get("disagreement") or {}).get("exact_vs_replica", {}).get("estimate") is not None
        ):
            out[cfg] = block
    return out


def _no_data_message(results: Mapping[str, dict] | None, conditioning: str) -> str:
    """Why a figure is empty, in the analysis' own words (e.g. too few eligible pivots, with the counts)."""
    notes = []
    for cfg, res in (results or {}).items():
        block = (res or {}).get("conditionings", {}).get(conditioning) or {}
        reason = block.get("note") or block.get("reason")
        if reason:
            notes.append(f"{cfg}: {reason}")
    return "\n".join(notes) if notes else NO_DATA


def _metric_of(results: Mapping[str, dict] | None) -> str:
    """The disagreement metric the comparisons' headline numbers use (named in every title)."""
    metrics = sorted({comparison_metric(res or {}) for res in (results or {}).values()})
    return "/".join(metrics) if metrics else METRIC_BEFORE_THE_KEY


def _err(stat: dict, scale: float = 1.0) -> tuple[float, float, float]:
    """(value, lower error, upper error) for errorbar; a missing CI draws no bar rather than a fake one."""
    est = stat.get("estimate")
    if est is None:
        return np.nan, 0.0, 0.0
    lo, hi = stat.get("ci_lo"), stat.get("ci_hi")
    lo = est if lo is None else lo
    hi = est if hi is None else hi
    return est * scale, (est - lo) * scale, (hi - est) * scale


# ----------------------------------------------------------------------------------- 1 disagreement bars


def plot_disagreement(
    results: Mapping[str, dict] | None, out_png: PathLike, out_pdf: PathLike, conditioning: str
) -> None:
    """Per configuration: replica floor D(exact, replica) beside D(exact, refeed) (and other passes), with CIs."""
    title = f"Credit-estimate disagreement with the exact pass ({conditioning}, {_metric_of(results)} metric)"
    blocks = _usable(results, conditioning)
    if not blocks:
        save_figure(message_figure(_no_data_message(results, conditioning), title), out_png, out_pdf)
        return
    series: list[tuple[str, str, Any]] = [
        ("replica floor", "floor", lambda b: b["disagreement"]["exact_vs_replica"]),
        ("re-feed", "refeed", lambda b: b["disagreement"]["exact_vs_refeed"]),
    ]
    extras = sorted({p for b in blocks.values() for p in (b.get("other_passes") or {})})
    for p in extras:  # each against the pass it replicates (the re-feed's replica against the re-feed)
        ref = pass_spec(p).reference
        series.append(
            (
                p if ref == "exact" else f"{p} vs {ref}",
                p,
                lambda b, p=p, ref=ref: (b.get("other_passes") or {}).get(p, {}).get(f"vs_{ref}", {}),
            )
        )
    fig = new_figure(max(6.0, 1.3 * len(blocks) + 3), 4.0)
    ax = fig.add_subplot()
    x = np.arange(len(blocks))
    width = 0.8 / len(series)
    for i, (label, key, get) in enumerate(series):
        vals = np.array([_err(get(b), 100.0) for b in blocks.values()])
        ax.bar(
            x + (i - (len(series) - 1) / 2) * width,
            vals[:, 0],
            width,
            yerr=vals[:, 1:].T,
            capsize=3,
            label=label,
            color=COLORS.get(key, f"C{i + 2}"),
        )
    ax.set_xticks(x, [f"{c}\n(n={b['n']})" for c, b in blocks.items()], fontsize=8)
    ax.set_ylabel("% pivots whose estimate disagrees")
    finish(fig, ax, title, out_png, out_pdf)


# ----------------------------------------------------------------------------- credit flips and mismatch


def plot_mismatch_flips(
    results: Mapping[str, dict] | None, out_png: PathLike, out_pdf: PathLike, conditioning: str
) -> None:
    """Credit flips against prefix mismatch: per configuration, the share of pivots whose estimate the re-feed
    flips and the replica floor's, in bins of the pivot's re-feed k3_kl (``comparison.json → prefix_mismatch``),
    with the AUC of k3_kl for the flip in the legend."""
    title = f"Credit flips against prefix mismatch ({conditioning}, {_metric_of(results)} metric)"
    links = {
        cfg: ((res or {}).get("prefix_mismatch") or {}).get("credit_link", {}).get(conditioning) or {}
        for cfg, res in (results or {}).items()
    }
    usable = {cfg: link for cfg, link in links.items() if link.get("available") and link.get("bins")}
    if not usable:
        notes = [f"{cfg}: {link.get('reason') or 'too few pivots to bin'}" for cfg, link in links.items()]
        save_figure(message_figure("\n".join(notes) or NO_DATA, title), out_png, out_pdf)
        return
    fig = new_figure(7.0, 4.0)
    ax = fig.add_subplot()
    for i, (cfg, link) in enumerate(usable.items()):
        x = np.array([max(b["median"], 1e-12) for b in link["bins"]])
        auc = link["auc"].get("k3_kl")
        label = f"{cfg}: re-feed (n={link['n']}, AUC {'n/a' if auc is None else f'{auc:.2f}'})"
        ax.plot(x, [100 * b["refeed_flip_rate"] for b in link["bins"]], "o-", color=f"C{i}", label=label)
        ax.plot(
            x,
            [100 * b["floor_flip_rate"] for b in link["bins"]],
            "s--",
            color=f"C{i}",
            alpha=0.6,
            label=f"{cfg}: replica floor",
        )
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(NullFormatter())  # a narrow span labels its minor ticks, which overlap
    ax.set_xlabel("prefix k3_kl of the pivot's re-feed (bin median)")
    ax.set_ylabel("% pivots whose estimate flips")
    finish(fig, ax, title, out_png, out_pdf, legend_size=7)


# ----------------------------------------------------------------------------------- 2 kinds of change


def plot_kinds_of_change(
    results: Mapping[str, dict] | None, out_png: PathLike, out_pdf: PathLike, conditioning: str
) -> None:
    """Stacked bars: changed estimates as a share of eligible pivots, split into crossing/reversal/magnitude.

    The bar height is the disagreement rate, so re-feed and replica bars can be set side by side.
    """
    title = f"Kinds of change ({conditioning}, {_metric_of(results)} metric)"
    blocks = _usable(results, conditioning)
    if not blocks:
        save_figure(message_figure(_no_data_message(results, conditioning), title), out_png, out_pdf)
        return
    fig = new_figure(max(6.0, 1.4 * len(blocks) + 3), 4.0)
    ax = fig.add_subplot()
    x = np.arange(len(blocks))
    width = 0.38
    kinds = (
        ("zero_crossing", "zero-boundary crossing"),
        ("reversal", "polarity reversal"),
        ("magnitude", "magnitude only"),
    )
    for offset, pair, hatch in ((-width / 2, "exact_vs_refeed", ""), (width / 2, "exact_vs_replica", "//")):
        bottom = np.zeros(len(blocks))
        for key, label in kinds:
            vals = np.array([_kind_share(b, pair, key) for b in blocks.values()])
            ax.bar(
                x + offset,
                vals,
                width,
                bottom=bottom,
                color=COLORS[key],
                hatch=hatch,
                edgecolor="black",
                linewidth=0.5,
                label=label if pair == "exact_vs_refeed" else None,
            )
            bottom += vals
    ax.set_xticks(x, [f"{c}\nleft: re-feed, right: replica" for c in blocks], fontsize=7)
    ax.set_ylabel("% eligible pivots")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    save_figure(fig, out_png, out_pdf)


def _kind_share(block: dict, pair: str, key: str) -> float:
    kinds = block["kinds_of_change"][pair]
    count = (kinds.get(key) or {}).get("count")
    return 0.0 if not kinds.get("n") or count is None else 100.0 * count / kinds["n"]


# ----------------------------------------------------------------------------------- 3 Jaccard sweep


def plot_jaccard_sweep(
    results: Mapping[str, dict] | None, out_png: PathLike, out_pdf: PathLike, conditioning: str
) -> None:
    """Jaccard(S_exact, S_refeed) against the replica ceiling over θ, one panel per configuration."""
    title = f"Critical-set overlap with the exact selection ({conditioning})"
    blocks = {c: b for c, b in _usable(results, conditioning).items() if b["selection"]["sweep"]}
    if not blocks:
        save_figure(message_figure(_no_data_message(results, conditioning), title), out_png, out_pdf)
        return
    ncols = min(3, len(blocks))
    nrows = -(-len(blocks) // ncols)
    fig = new_figure(3.2 * ncols + 0.5, 2.8 * nrows + 0.6)
    axes = fig.subplots(nrows, ncols, squeeze=False, sharey=True)
    for ax, (cfg, block) in zip(axes.ravel(), blocks.items()):
        sweep = block["selection"]["sweep"]
        theta = np.array([s["theta"] for s in sweep])
        for key, label, color in (
            ("jaccard_refeed", "re-feed", COLORS["refeed"]),
            ("jaccard_replica_ceiling", "replica ceiling", COLORS["ceiling"]),
        ):
            est = np.array([_nan(s[key]["estimate"]) for s in sweep])
            lo = np.array([_nan(s[key]["ci_lo"]) for s in sweep])
            hi = np.array([_nan(s[key]["ci_hi"]) for s in sweep])
            ax.plot(theta, est, marker="o", color=color, label=label)
            ax.fill_between(theta, lo, hi, color=color, alpha=0.2, linewidth=0)
        ax.axvline(block["selection"]["at_theta"]["theta"], color="black", linestyle=":", linewidth=1)
        ax.set_title(f"{cfg} (n={block['n']})", fontsize=9)
        ax.set_xlabel("θ (|Â| ≥ θ)")
        ax.set_ylim(0, 1.02)
    for ax in axes.ravel()[len(blocks) :]:
        ax.set_axis_off()
    axes[0, 0].set_ylabel("Jaccard with exact")
    axes[0, 0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    save_figure(fig, out_png, out_pdf)


def _nan(x: float | None) -> float:
    return np.nan if x is None else float(x)


# ------------------------------------------------------------------------------- 4 channel agreement

#: (label, where the share comes from): channels.csv's row and pivot channels, and the greedy probe's
#: first-step log-probs in comparison.json. Defined on every pivot, eligible or not, so never empty.
AGREEMENT_CHANNELS = (
    ("first-step log-probs\nbit-exact", "probe"),
    ("continuation\ntokens", "token_ids"),
    ("answers", "answer"),
    ("success\ncounts", "success_counts"),
    ("credit Â", "a_hat"),
)


def channel_shares(comparison: dict, channels: pl.DataFrame, other: str) -> list[float]:
    """Share of rows (or pivots) identical between exact and ``other`` per AGREEMENT_CHANNELS; nan where the
    run did not measure it (the probe with replay.probe_tokens 0)."""
    out = []
    for _, key in AGREEMENT_CHANNELS:
        if key == "probe":
            probe = ((comparison or {}).get("probe") or {}).get(other) or {}
            out.append(_nan(probe.get("bit_exact_share")))
            continue
        hit = channels.filter((pl.col("pass_a") == "exact") & (pl.col("pass_b") == other) & (pl.col("channel") == key))
        out.append(_nan(hit["share_identical"][0]) if hit.height else np.nan)  # null: the channel compared none
    return out


def plot_channel_agreement(
    data: Mapping[str, tuple[dict, pl.DataFrame]] | None, out_png: PathLike, out_pdf: PathLike
) -> None:
    """Per configuration, how much of the exact pass each replay reproduces, channel by channel: the replica
    (other batches, same noise) against re-feed. It needs no eligible pivots (every pivot counts), so even a run
    too small for any credit statistic shows where re-feeding departs from the decode-time state."""
    title = "Agreement with the exact pass, by channel (share identical; all pivots)"
    data = {c: d for c, d in (data or {}).items() if d[1].height}
    if not data:
        save_figure(message_figure("no channels measured (channels.csv is empty)", title), out_png, out_pdf)
        return
    # one heat-map row per configuration and replay (replica, then re-feed), one column per channel: compact
    # at any number of configurations, and the two rows of a configuration sit side by side
    labels, shares = [], []
    for cfg, (comparison, channels) in data.items():
        drift = ((comparison or {}).get("verification") or {}).get("refeed_kv_maxdiff") or {}
        note = "" if drift.get("median") is None else f" (KV max |d| median {drift['median']:.2g})"
        pivots = (comparison or {}).get("n_pivots", "?")
        for other in ("replica", "refeed"):
            shares.append(channel_shares(comparison, channels, other))
            labels.append(f"{cfg} ({pivots} pivots)  vs replica" if other == "replica" else f"vs re-feed{note}")
    grid = np.array(shares, dtype=float)
    fig = new_figure(8.0, 0.32 * len(labels) + 1.6)
    ax = fig.add_subplot(1, 1, 1)
    cmap = matplotlib.colormaps["RdYlGn"].with_extremes(bad="lightgrey")  # n/a (not measured): grey, not red
    ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto")
    for (i, j), share in np.ndenumerate(grid):
        ax.text(j, i, "n/a" if np.isnan(share) else f"{share:.2f}", ha="center", va="center", fontsize=7)
    ax.set_xticks(np.arange(len(AGREEMENT_CHANNELS)), [label for label, _ in AGREEMENT_CHANNELS], fontsize=7)
    ax.xaxis.tick_top()
    ax.set_yticks(np.arange(len(labels)), labels, fontsize=7)
    for boundary in np.arange(1.5, len(labels) - 1, 2):
        ax.axhline(boundary, color="white", linewidth=2)
    ax.set_title(title, fontsize=9, pad=24)
    fig.tight_layout()
    save_figure(fig, out_png, out_pdf)
