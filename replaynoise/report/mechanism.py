"""The mechanism figure and table: where a re-fed prefix stops equalling the decode-time state, and what that does
to the re-feed rate, per configuration (a run's ``mechanism.json``) or per reference folder.

The left panel shows bitwise agreement with the decode-time state: of re-fed prefix tokens by the keys their step
attended, and of first steps by prefix length; the right panel the excess by prefix-length bin with its interval. A
kernel switch shows as a step on the left and the excess rising past it on the right.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from replaynoise.io import atomic_path
from replaynoise.report.drawing import PathLike, message_figure, new_figure, save_figure

#: Positions are pooled into windows this many keys wide for the left panel (a token's share is noisy alone).
KEY_WINDOW = 8
#: The table's columns, in order, with their headers.
TABLE_COLUMNS = {
    "bin": "prefix tokens",
    "pivots": "pivots",
    "first_step_all_equal_refeed": "first step = exact (refeed, pivots)",
    "first_step_all_equal_replica": "first step = exact (replica, pivots)",
    "prefix_equal_share": "prefix log-probs = decode (share)",
    "prefix_token_mult_prob_error": "token_mult_prob_error",
    "main_pivots": "main-set pivots (all pairs)",
    "refeed": "re-feed",
    "floor": "floor",
    "excess": "excess pp [CI]",
}


def _windows(by_keys: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    if not by_keys:
        return np.array([]), np.array([])
    frame = pl.DataFrame(by_keys).with_columns(window=pl.col("keys") // KEY_WINDOW * KEY_WINDOW)
    frame = frame.with_columns(equal=pl.col("equal_share") * pl.col("tokens"))
    pooled = frame.group_by("window").agg(pl.col("equal").sum(), pl.col("tokens").sum()).sort("window")
    return pooled["window"].to_numpy() + KEY_WINDOW / 2, (pooled["equal"] / pooled["tokens"]).to_numpy()


def _bin_middles(rows: list[dict], offset: float) -> np.ndarray:
    """Where a prefix-length bin's point goes: its start plus half the usual width (the open last bin too), shifted
    a little per series so that overlapping intervals stay apart."""
    return np.array([r["lo"] for r in rows], dtype=float) + 16 + offset


def plot_mechanism(summaries: Mapping[str, dict], out_png: PathLike, out_pdf: PathLike) -> None:
    """Two panels over ``summaries`` ({label: mechanism summary}). Left, bitwise agreement with the decode-time
    state: re-fed prefix tokens by the keys their step attended (lines, change points dotted) and first steps of
    refeed against exact by prefix-length bin (dashed, squares). Right, the excess by prefix-length bin with its
    interval."""
    usable = {k: v for k, v in summaries.items() if v.get("by_length")}
    if not usable:
        save_figure(message_figure("no configuration to show", "Re-feed mechanism"), out_png, out_pdf)
        return
    fig = new_figure(11.0, 4.6 + 0.22 * len(usable))
    left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for i, (label, summary) in enumerate(sorted(usable.items())):
        color = f"C{i % 10}"
        x, share = _windows(summary.get("by_keys", []))
        if x.size:
            left.plot(x, share, color=color, lw=1.4)
            point = summary.get("change_point") or {}
            if point.get("keys") is not None:
                left.axvline(point["keys"], color=color, ls=":", lw=1)
        steps = [r for r in summary["by_length"] if r.get("first_step_all_equal_refeed") is not None]
        if steps:
            left.plot(
                _bin_middles(steps, 2 * i),
                [r["first_step_all_equal_refeed"] for r in steps],
                color=color,
                ls="--",
                marker="s",
                ms=4,
                lw=1,
            )
        rows = [r for r in summary["by_length"] if r.get("excess_pp") is not None]
        if rows:
            est = np.array([r["excess_pp"] for r in rows], dtype=float)
            lo = np.array([np.nan if r["excess_lo"] is None else r["excess_lo"] for r in rows], dtype=float)
            hi = np.array([np.nan if r["excess_hi"] is None else r["excess_hi"] for r in rows], dtype=float)
            right.errorbar(
                _bin_middles(rows, 3 * i), est, yerr=[est - lo, hi - est], fmt="o-", color=color, ms=3, lw=1, capsize=2
            )
        right.plot([], [], color=color, lw=2, label=label)
    left.set_xlabel("keys attended (lines) / prefix length (squares), tokens")
    left.set_ylabel("bitwise equal to the decode-time state (share)")
    left.set_ylim(-0.03, 1.03)
    left.set_title(
        f"Re-fed prefix tokens ({KEY_WINDOW}-key windows), first steps (pivots)\ndotted: change point", fontsize=9
    )
    right.axhline(0, color="0.5", lw=0.8)
    right.set_xlabel("prefix length (tokens; the last bin open above)")
    right.set_ylabel("excess (re-feed rate - floor), pp")
    right.set_title("Excess by prefix length, main conditioning", fontsize=9)
    handles, labels = right.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.05 * len(usable) ** 0.5 + 0.04, 1, 1))
    save_figure(fig, out_png, out_pdf)


def _cell(value: Any, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and not np.isfinite(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def table_rows(summary: dict) -> list[dict[str, str]]:
    """The prefix-length table of one summary as text cells (``TABLE_COLUMNS``)."""
    out = []
    for row in summary.get("by_length", []):
        cells = {key: _cell(row.get(key)) for key in TABLE_COLUMNS if key != "excess"}
        est = row.get("excess_pp")
        cells["excess"] = (
            "-" if est is None else f"{est:+.1f} [{_cell(row.get('excess_lo'), 1)}, {_cell(row.get('excess_hi'), 1)}]"
        )
        out.append(cells)
    return out


def markdown(summaries: Mapping[str, dict], sources: Mapping[str, str] | None = None) -> str:
    """One section per summary: its change point, first-step and prefix agreement, and the prefix-length table."""
    lines = []
    for label, summary in sorted(summaries.items()):
        lines += [f"### {label}", ""]
        if sources and label in sources:
            lines += [f"Source: `{sources[label]}`.", ""]
        point = summary.get("change_point") or {}
        if point.get("keys") is not None:
            lines.append(
                f"- Prefix tokens (first re-feed draw): log-probs equal the decode-time ones bitwise in "
                f"{point['share_below']:.1%} of {point['tokens_below']:,} tokens attending fewer than {point['keys']} "
                f"keys and {point['share_above']:.1%} of {point['tokens_above']:,} at {point['keys']} or more "
                "(the change point)."
            )
        elif point.get("share_below") is not None:
            lines.append(
                f"- Prefix tokens (first re-feed draw): log-probs equal the decode-time ones bitwise in "
                f"{point['share_below']:.1%} of {point['tokens_below']:,} tokens, with no switch by length."
            )
        prefix = summary.get("prefix") or {}
        if prefix.get("token_mult_prob_error") is not None:
            lines.append(
                f"- token_mult_prob_error {prefix['token_mult_prob_error']:.4f}, k3_kl {prefix['k3_kl']:.2e} over "
                f"{int(prefix['tokens']):,} re-fed prefix tokens."
            )
        for name, first in (summary.get("first_step") or {}).items():
            lines.append(
                f"- First step of `{name}` equal to exact's bitwise: {first['equal']:.1%} of rows, all rows of "
                f"{first['all_equal']:.1%} of {first['pivots']:,} pivots."
            )
        rows = table_rows(summary)
        if rows:
            lines += ["", "| " + " | ".join(TABLE_COLUMNS.values()) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
            lines += ["| " + " | ".join(r[key] for key in TABLE_COLUMNS) + " |" for r in rows]
        lines.append("")
    return "\n".join(lines)


def write_table(
    summaries: Mapping[str, dict],
    csv_path: Path,
    md_path: Path,
    sources: Mapping[str, str] | None = None,
    heading: str = "",
) -> None:
    """The prefix-length tables of every summary, as one CSV (a ``configuration`` column first) and as markdown."""
    frames = [
        pl.DataFrame(s["by_length"], infer_schema_length=None).select(
            pl.lit(label).alias("configuration"), pl.all().exclude("interval")
        )
        for label, s in sorted(summaries.items())
        if s.get("by_length")
    ]
    table = pl.concat(frames, how="diagonal_relaxed") if frames else pl.DataFrame()
    with atomic_path(csv_path) as tmp:
        table.write_csv(tmp, float_precision=6)
    with atomic_path(md_path) as tmp:
        Path(tmp).write_text((heading + "\n\n" if heading else "") + markdown(summaries, sources))


# --------------------------------------------------------------------------------------------- factors
def percent(value: Any) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _share(stat: Mapping[str, Any]) -> str:
    if stat.get("share") is None:
        return "-"
    return f"{percent(stat['share'])} [{percent(stat.get('ci_lo'))}, {percent(stat.get('ci_hi'))}]"


def _effect(stat: Mapping[str, Any]) -> str:
    if stat.get("effect") is None:
        return "-"
    lo, hi = stat.get("effect_ci_lo"), stat.get("effect_ci_hi")
    bounds = "" if lo is None or hi is None else f" [{100 * lo:+.1f}, {100 * hi:+.1f}]"
    return f"{100 * stat['effect']:+.1f}{bounds}"


def point_cell(point: Mapping[str, Any], name: str) -> str:
    """A change point as a cell: where, and the shares either side; none where the shares do not part."""
    if point.get(name) is not None:
        return f"{point[name]}; {percent(point['share_below'])} / {percent(point['share_above'])}"
    return "none" if point.get("share_below") is not None else "-"


def factors_markdown(rows: Sequence[Mapping[str, Any]]) -> str:
    """The factor experiment as one table: each probe's first-step agreement with exact (re-feed, replica) with its
    interval and its effect in points against the base probe, the change point, NeMo-RL's error, and whether it
    replayed the base's rows (problems and pivots shared; exact and re-feed rows bitwise equal)."""
    head = (
        "| probe | re-feed first step = exact [95% CI] | effect pp [CI] | replica = exact | effect pp [CI] | "
        "change point (keys; below / above) | by decode step | token_mult_prob_error | base's problems / pivots "
        "replayed | exact rows = base's | re-feed rows = base's |"
    )
    lines = [head, "|" + "---|" * 11]
    for row in rows:
        point, prefix, same = row.get("change_point") or {}, row.get("prefix") or {}, row.get("against_base") or {}
        change, by_step = point_cell(point, "keys"), point_cell(row.get("change_point_by_step") or {}, "step")
        tmpe = prefix.get("token_mult_prob_error")
        equal = same.get("rows_bitwise_equal") or {}
        lines.append(
            f"| {row['probe']}{' (base)' if row['base'] else ''} | {_share(row['refeed'])} | {_effect(row['refeed'])} "
            f"| {_share(row['replica'])} | {_effect(row['replica'])} | {change} | {by_step} | "
            f"{'-' if tmpe is None else f'{tmpe:.4f}'} | {percent(same.get('problems_shared'))} / "
            f"{percent(same.get('pivots_shared'))} | "
            f"{percent((equal.get('exact') or {}).get('share'))} | "
            f"{percent((equal.get('refeed') or {}).get('share'))} |"
        )
    return "\n".join(lines) + "\n"
