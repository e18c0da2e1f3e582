"""The figures and the table of the cache-transplant and precision controls (method.md §7), drawn from the
``controls`` block of each configuration's comparison.json.

Which of them a run makes follows from its passes (``plan.control_outputs``), so a run without controls plans none.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import polars as pl

from replaynoise.generation.passes import FLOOR_PASSES, LAYER_PASS, pass_spec
from replaynoise.io import atomic_path
from replaynoise.report.drawing import message_figure, new_figure, save_figure

PathLike = str | os.PathLike
CHANNEL_LABELS = {"token_ids": "continuation tokens", "next_topk": "first-step top-k log-probs", "a_hat": "credit Â"}
DONOR, RECIPIENT = "#1f77b4", "#ff7f0e"


def _controls(results: Mapping[str, dict] | None, key: str) -> dict[str, Any]:
    return {
        cfg: ((res or {}).get("controls") or {}).get(key)
        for cfg, res in (results or {}).items()
        if ((res or {}).get("controls") or {}).get(key)
    }


def _err(stat: dict) -> tuple[float, float, float]:
    est = stat.get("estimate")
    if est is None:
        return np.nan, 0.0, 0.0
    lo, hi = stat.get("ci_lo"), stat.get("ci_hi")
    return est, est - (est if lo is None else lo), (est if hi is None else hi) - est


def plot_transplant(results: Mapping[str, dict] | None, out_png: PathLike, out_pdf: PathLike) -> None:
    """Per channel, where the donor and recipient passes differ: how often the transplanted pass follows the
    donor's cache and how often it stays with the recipient's path (95% cluster-bootstrap CIs)."""
    title = "Cache transplants: whom the continuation follows where donor and recipient differ"
    data = _controls(results, "transplant")
    rows = [
        (cfg, name, entry)
        for cfg, block in data.items()
        for name, entry in block.items()
        if not LAYER_PASS.fullmatch(name)
    ]
    if not rows:
        save_figure(message_figure("no whole-cache transplant in these passes", title), out_png, out_pdf)
        return
    fig = new_figure(10.0, 0.45 * len(rows) + 1.8)
    axes = fig.subplots(1, len(CHANNEL_LABELS), sharey=True)
    y = np.arange(len(rows))
    for ax, (channel, label) in zip(axes, CHANNEL_LABELS.items()):
        for offset, role, color in ((-0.18, "donor", DONOR), (0.18, "recipient", RECIPIENT)):
            stats = [
                ((entry["channels"].get(channel) or {}).get(f"follows_{role}_where_they_differ") or {})
                for _, _, entry in rows
            ]
            est, lo, hi = np.array([_err(s) for s in stats]).T if stats else ([], [], [])
            ax.barh(y + offset, est, height=0.34, xerr=[lo, hi], color=color, capsize=2, label=f"follows the {role}")
            for yi, s, e, up in zip(y + offset, stats, est, hi):
                text = ("never differ" if s.get("n") == 0 else "n/a") if np.isnan(e) else f"{s['n_same']}/{s['n']}"
                ax.text(0.01 if np.isnan(e) else min(e + up, 1.0) + 0.02, yi, text, va="center", fontsize=6)
        ax.set_xlim(0, 1.15)
        ax.set_title(label, fontsize=8)
        ax.set_xlabel("share of rows (Â: pivots)", fontsize=7)
        ax.tick_params(labelsize=7)
    axes[0].set_yticks(y, [f"{cfg}: {name}\n({e['donor']} → {e['recipient']})" for cfg, name, e in rows], fontsize=7)
    axes[0].invert_yaxis()
    axes[-1].legend(fontsize=7, loc="lower right")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    save_figure(fig, out_png, out_pdf)


def layer_curve(block: Mapping[str, dict], side: str, channel: str = "token_ids") -> list[tuple[int, dict, dict]]:
    """(L, share with the recipient, share with the donor) over the per-layer transplants of one side ("lo":
    re-fed KV in layers [0, L); "hi": in [L, n)), with the whole-cache transplant at its end where it ran."""
    points = []
    for name, entry in block.items():
        match = LAYER_PASS.fullmatch(name)
        whole = name == "transplant_refeed" and entry.get("n_layers")
        if not (match and match.group(1) == side) and not whole:
            continue
        at = int(match.group(2)) if match else (entry["n_layers"] if side == "lo" else 0)
        stats = entry["channels"].get(channel) or {}
        points.append((at, stats.get("with_recipient") or {}, stats.get("with_donor") or {}))
    return sorted(points, key=lambda p: p[0])


def plot_transplant_layers(results: Mapping[str, dict] | None, out_png: PathLike, out_pdf: PathLike) -> None:
    """Where in the network the drift that matters arises: the re-fed KV swapped into the exact pass for the
    lower layers [0, L) or the upper layers [L, n) only, and how often the continuations stay with exact."""
    title = "Per-layer transplant: re-fed KV swapped into the exact pass for some layers only"
    data = _controls(results, "transplant")
    if not any(layer_curve(block, side) for block in data.values() for side in ("lo", "hi")):
        save_figure(message_figure("no per-layer transplant in these passes", title), out_png, out_pdf)
        return
    fig = new_figure(10.0, 3.8)
    axes = fig.subplots(1, 2, sharey=True)
    sides = ((axes[0], "lo", "re-fed KV in layers [0, L)"), (axes[1], "hi", "re-fed KV in layers [L, n)"))
    for ax, side, label in sides:
        for i, (cfg, block) in enumerate(data.items()):
            for channel, style in (("token_ids", "-o"), ("next_topk", ":s")):
                points = layer_curve(block, side, channel)
                if not points:
                    continue
                at = [p[0] for p in points]
                est, lo, hi = np.array([_err(p[1]) for p in points]).T
                ax.errorbar(
                    at,
                    est,
                    yerr=[lo, hi],
                    fmt=style,
                    color=f"C{i}",
                    capsize=2,
                    markersize=4,
                    label=f"{cfg}: {CHANNEL_LABELS[channel]}",
                )
                n = next((e["n_layers"] for e in block.values() if e.get("n_layers")), None)
                if n is not None:  # no layer swapped: the exact pass itself (bitwise, tests/test_controls.py)
                    none = 0 if side == "lo" else n
                    ax.plot(
                        [none, at[0] if side == "lo" else at[-1]],
                        [1.0, est[0] if side == "lo" else est[-1]],
                        style[0],
                        color=f"C{i}",
                        alpha=0.4,
                    )
                    ax.plot([none], [1.0], "o", mfc="white", color=f"C{i}", markersize=5)
        layers = [e.get("n_layers") for block in data.values() for e in block.values() if e.get("n_layers")]
        if layers:
            ax.set_xlim(-0.5, max(layers) + 0.5)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("L (of n layers)", fontsize=8)
        ax.set_ylim(-0.02, 1.05)
        ax.tick_params(labelsize=7)
    axes[0].set_ylabel("share identical with exact (the recipient)\nhollow: no layer swapped, exact itself", fontsize=8)
    axes[1].legend(fontsize=6, loc="lower right")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    save_figure(fig, out_png, out_pdf)


def _pct(stat: dict | None) -> str:
    if not stat or stat.get("estimate") is None:
        return "n/a"
    ci = "" if stat.get("ci_lo") is None else f" [{100 * stat['ci_lo']:.1f}, {100 * stat['ci_hi']:.1f}]"
    return f"{100 * stat['estimate']:.1f}{ci}"


def control_rows(results: Mapping[str, dict] | None) -> tuple[pl.DataFrame, pl.DataFrame]:
    """The transplant rows and the precision rows of every configuration, flat (one column per statistic)."""
    transplant, precision = [], []
    for cfg, block in _controls(results, "transplant").items():
        for name, entry in block.items():
            row = {
                "config": cfg,
                "pass": name,
                "donor": entry["donor"],
                "recipient": entry["recipient"],
                "layers": f"[{entry['layers'][0]}, {'n' if entry['layers'][1] is None else entry['layers'][1]})",
            }
            for channel in CHANNEL_LABELS:
                stats = entry["channels"].get(channel) or {}
                row[f"{channel}_differ"] = stats.get("donor_and_recipient_differ")
                for key in ("with_donor", "with_recipient", "follows_donor_where_they_differ"):
                    row[f"{channel}_{key}"] = (stats.get(key) or {}).get("estimate")
                    row[f"{channel}_{key}_text"] = _pct(stats.get(key))
            transplant.append(row)
    for cfg, arms in _controls(results, "precision").items():
        for arm in arms:
            drift = arm.get("kv_drift") or {}
            precision.append(
                {
                    "config": cfg,
                    "arm": arm["arm"],
                    "pass": arm["pass"],
                    "compared_with": arm["compared_with"],
                    "metric": arm["metric"],
                    "n": arm["n"],
                    "n_problems": arm["n_problems"],
                    **{
                        f"{key}{suffix}": value
                        for key in ("disagreement", "tokens_identical", "first_step_identical")
                        for suffix, value in (
                            ("", arm[key].get("estimate")),
                            ("_ci_lo", arm[key].get("ci_lo")),
                            ("_ci_hi", arm[key].get("ci_hi")),
                            ("_text", _pct(arm[key])),
                        )
                    },
                    "kv_drift_median": drift.get("median"),
                    "kv_drift_max": drift.get("max"),
                    "kv_drift_per_layer_median": ", ".join(f"{v:.3g}" for v in drift.get("per_layer_median") or []),
                }
            )
    return pl.DataFrame(transplant), pl.DataFrame(precision)


def render_controls_markdown(transplant: pl.DataFrame, precision: pl.DataFrame, analysis_hash: str) -> str:
    lines = [
        "# Controls: cache transplants and fixed-prefix precision",
        "",
        f"analysis hash {analysis_hash}; shares in %, 95% problem-cluster bootstrap CIs in brackets.",
        "",
    ]
    if transplant.height:
        lines += [
            "## Cache transplants",
            "",
            "| config | pass | donor → recipient | layers | tokens: with donor / with recipient "
            "| tokens: follows "
            "donor where they differ (n) | first step: follows donor (n) | Â: follows donor (n) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in transplant.iter_rows(named=True):
            lines.append(
                f"| {r['config']} | {r['pass']} | {r['donor']} → {r['recipient']} | {r['layers']} | "
                f"{r['token_ids_with_donor_text']} / {r['token_ids_with_recipient_text']} | "
                f"{r['token_ids_follows_donor_where_they_differ_text']} ({r['token_ids_differ']}) | "
                f"{r['next_topk_follows_donor_where_they_differ_text']} ({r['next_topk_differ']}) | "
                f"{r['a_hat_follows_donor_where_they_differ_text']} ({r['a_hat_differ']}) |"
            )
        lines.append("")
    if precision.height:
        lines += [
            "## Precision arms",
            "",
            "| config | arm | pass vs | n (problems) | disagreement of Â | tokens identical | first step "
            "identical | KV drift max abs dKV: median / max |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in precision.iter_rows(named=True):
            drift = "n/a" if r["kv_drift_median"] is None else f"{r['kv_drift_median']:.3g} / {r['kv_drift_max']:.3g}"
            lines.append(
                f"| {r['config']} | {r['arm']} | {r['pass']} vs {r['compared_with']} | {r['n']} "
                f"({r['n_problems']}) | {r['disagreement_text']} | {r['tokens_identical_text']} | "
                f"{r['first_step_identical_text']} | {drift} |"
            )
        lines.append("")
    if not (transplant.height or precision.height):
        lines.append("No control pass produced numbers (each needs its donor, recipient or reference pass).")
    return "\n".join(lines) + "\n"


def write_controls_table(results: Mapping[str, dict], analysis_hash: str, out_csv: PathLike, out_md: PathLike) -> None:
    """controls.csv (both kinds of row, long: one row per configuration, control and statistic) and controls.md."""
    transplant, precision = control_rows(results)
    long = []
    for kind, frame in (("transplant", transplant), ("precision", precision)):
        for row in frame.iter_rows(named=True):
            ident = {k: row.get(k) for k in ("config", "pass")} | {"control": kind, "arm": row.get("arm")}
            long += [
                ident | {"statistic": k, "value": v}
                for k, v in row.items()
                if k not in ("config", "pass", "arm")
                and not k.endswith("_text")
                and isinstance(v, (int, float))
                and not isinstance(v, bool)
            ]
    csv = pl.DataFrame(
        long,
        schema={
            "config": pl.String,
            "pass": pl.String,
            "control": pl.String,
            "arm": pl.String,
            "statistic": pl.String,
            "value": pl.Float64,
        },
    )
    with atomic_path(out_csv) as tmp, open(tmp, "w", encoding="utf-8") as fh:
        fh.write(f"# analysis_hash={analysis_hash}\n")
        fh.write(csv.write_csv())
    with atomic_path(out_md) as tmp, open(tmp, "w", encoding="utf-8") as fh:
        fh.write(render_controls_markdown(transplant, precision, analysis_hash))


# ---------------------------------------------------------------------------------------------- floors

#: The conditionings the floors table shows: the paper's main set, and every eligible pivot (the serial pass's
#: sample is small, and its floor needs no nonzero estimate to be meaningful).
FLOOR_CONDITIONINGS = ("main", "none")


def floor_rows(results: Mapping[str, dict] | None) -> pl.DataFrame:
    """Per configuration and conditioning, each disagreement beside the replica floor: D(exact, replica),
    D(exact, refeed), and D(reference, p) for every floor pass p that ran (the re-feed's own floor
    D(refeed, refeed_replica); batch-of-one kernels against batched ones, D(exact, serial), on the serial pass's
    pivots)."""
    rows = []
    for cfg, res in (results or {}).items():
        for cond in FLOOR_CONDITIONINGS:
            block = ((res or {}).get("conditionings") or {}).get(cond) or {}
            if not block.get("available"):
                continue
            entries = [
                ("replica", "exact", block.get("disagreement", {}).get("exact_vs_replica"), block),
                ("refeed", "exact", block.get("disagreement", {}).get("exact_vs_refeed"), block),
            ]
            for name in FLOOR_PASSES:
                other = (block.get("other_passes") or {}).get(name)
                if other:
                    ref = pass_spec(name).reference
                    entries.append((name, ref, other.get(f"vs_{ref}"), other))
            for name, ref, stat, scope in entries:
                stat = stat or {}
                rows.append(
                    {
                        "config": cfg,
                        "conditioning": cond,
                        "pass": name,
                        "compared_with": ref,
                        "n": scope.get("n"),
                        "n_problems": scope.get("n_problems"),
                        "disagreement": stat.get("estimate"),
                        "ci_lo": stat.get("ci_lo"),
                        "ci_hi": stat.get("ci_hi"),
                        "n_disagree": stat.get("n_disagree"),
                        "text": _pct(stat),
                        "note": scope.get("note"),
                    }
                )
    schema = {
        "config": pl.String,
        "conditioning": pl.String,
        "pass": pl.String,
        "compared_with": pl.String,
        "n": pl.Int64,
        "n_problems": pl.Int64,
        "disagreement": pl.Float64,
        "ci_lo": pl.Float64,
        "ci_hi": pl.Float64,
        "n_disagree": pl.Int64,
        "text": pl.String,
        "note": pl.String,
    }
    return pl.DataFrame(rows, schema=schema)


def render_floors_markdown(rows: pl.DataFrame, analysis_hash: str) -> str:
    lines = [
        "# Floors: each disagreement beside the floor it is read against",
        "",
        f"analysis hash {analysis_hash}; sign-change rates of Â in %, 95% problem-cluster bootstrap CIs in "
        "brackets. replica: D(exact, replica), the replica floor; refeed: D(exact, refeed); refeed_replica: "
        "D(refeed, refeed_replica), the re-feed's own floor; serial: D(exact, serial), exact resume one "
        "request at a time (batch-of-one kernels) against the batched exact pass, on the serial pass's pivots: "
        "not a floor without batching, since the two passes run other kernels; replica_fresh: D(exact, "
        "replica_fresh), fresh seeds.",
        "",
        "| config | conditioning | pass | vs | n (problems) | disagreement % | pivots that differ |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows.iter_rows(named=True):
        n = "n/a" if r["n"] is None else f"{r['n']} ({r['n_problems']})"
        lines.append(
            f"| {r['config']} | {r['conditioning']} | {r['pass']} | {r['compared_with']} | {n} | "
            f"{r['text']} | {'n/a' if r['n_disagree'] is None else r['n_disagree']} |"
        )
    notes = sorted(
        {
            f"{r['config']} / {r['conditioning']} / {r['pass']}: {r['note']}"
            for r in rows.iter_rows(named=True)
            if r["note"]
        }
    )
    return "\n".join(lines + [""] + [f"- note: {n}" for n in notes]) + "\n"


def write_floors_table(results: Mapping[str, dict], analysis_hash: str, out_csv: PathLike, out_md: PathLike) -> None:
    """floors.csv (one row per configuration, conditioning and pass) and floors.md."""
    rows = floor_rows(results)
    with atomic_path(out_csv) as tmp, open(tmp, "w", encoding="utf-8") as fh:
        fh.write(f"# analysis_hash={analysis_hash}\n")
        fh.write(rows.drop("text").write_csv())
    with atomic_path(out_md) as tmp, open(tmp, "w", encoding="utf-8") as fh:
        fh.write(render_floors_markdown(rows, analysis_hash))
