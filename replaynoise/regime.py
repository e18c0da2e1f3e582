"""The regime probe's verdict, and its check against committed campaigns.

``snakemake regime`` runs the probe (``replaynoise.generation.regime``) for each configuration and writes
``results/regime/<configuration>/probe.json``; this module turns its rows into that summary and says in words
what it means. ``python -m replaynoise.regime validate`` sets probes beside the committed campaigns they mirror:
the same statistics computed from the campaign's own rows, and the campaign's re-feed rate and excess.

    python -m replaynoise.regime show results/regime/<configuration>/probe.json
    python -m replaynoise.regime validate PROBE.json=REFERENCE_FOLDER ... --out DIR
    python -m replaynoise.regime factors NAME=PROBE_FOLDER ... --base NAME --out DIR
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import polars as pl

from replaynoise.analysis.agreement import first_steps, pivot_agreement, regime_stats, token_gaps
from replaynoise.analysis.factors import factor_rows, probe_stats
from replaynoise.analysis.mechanism import mechanism_summary
from replaynoise.analysis.prefix_mismatch import mismatch_rows
from replaynoise.analysis.rl_metrics import TOKEN_MULT_PROB_ALARM
from replaynoise.generation.passes import replay_draws
from replaynoise.generation.regime import ProbeRun
from replaynoise.io import UnreadableFileError, read_json, read_parquet, write_json, write_text
from replaynoise.report.mechanism import (
    factors_markdown,
    markdown,
    percent,
    plot_mechanism,
    point_cell,
    write_table,
)
from replaynoise.vouching import check_destination, require_intact


def probe_rows(run: ProbeRun) -> tuple[pl.DataFrame, pl.DataFrame]:
    """What a probe keeps of its passes: each row's first step (``first_steps``) and the re-fed prefix's log-probs
    against the decode-time ones (``mismatch_rows``)."""
    return first_steps(run.passes), mismatch_rows(run.rollouts, run.pivots, {"refeed": run.passes["refeed"]})


def probe_summary(run: ProbeRun, steps: pl.DataFrame, mismatch: pl.DataFrame) -> dict[str, Any]:
    """The probe's statistics from its kept rows (``probe_rows``), with its size and seconds per phase."""
    return {
        "problems": run.rollouts["problem_id"].n_unique(),
        "rollouts": run.rollouts.height,
        "pivots": run.pivots.height,
        "prefix_len": {"min": run.pivots["prefix_len"].min(), "max": run.pivots["prefix_len"].max()},
        "seconds": {key: round(value, 2) for key, value in run.seconds.items()},
        **probe_stats(steps, mismatch, run.decode),
    }


#: What a probe's summary records of its run rather than computes from its rows.
RUN_FIELDS = ("config", "settings", "size", "problems", "rollouts", "pivots", "prefix_len", "seconds")


def folder_probe(folder: Path) -> tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame | None]:
    """A probe folder's kept rows: its first steps, its re-fed prefix mismatch and, where kept, its rollouts'
    batches and lengths (``decode.parquet``)."""
    decode = read_parquet(folder / "decode.parquet") if (folder / "decode.parquet").is_file() else None
    return read_parquet(folder / "first_steps.parquet"), read_parquet(folder / "mismatch.parquet"), decode


def recompute(folder: Path) -> dict[str, Any]:
    """A probe folder's summary computed again from its kept rows (``first_steps.parquet``, ``mismatch.parquet``),
    what it records of its run kept as written."""
    recorded = read_json(folder / "probe.json")
    stats = probe_stats(*folder_probe(folder))
    return {**{key: recorded[key] for key in RUN_FIELDS if key in recorded}, **stats}


def verdict(summary: Mapping[str, Any]) -> list[str]:
    """The probe's findings in sentences, each with its numbers."""
    lines = []
    point, prefix = summary.get("change_point") or {}, summary.get("prefix") or {}
    if point.get("keys") is not None:
        lines.append(
            f"Re-fed prefix log-probs equal the decode-time ones bitwise in {point['share_below']:.1%} of "
            f"{point['tokens_below']:,} tokens attending fewer than {point['keys']} keys and in "
            f"{point['share_above']:.1%} of {point['tokens_above']:,} at {point['keys']} keys or more."
        )
    elif point.get("share_below") is not None:
        lines.append(
            f"No switch by length: re-fed prefix log-probs equal the decode-time ones bitwise in "
            f"{point['share_below']:.1%} of {point['tokens_below']:,} tokens, at every number of keys."
        )
    by_step = summary.get("change_point_by_step") or {}
    if by_step.get("step") is not None and point.get("spread") is not None:
        sharper = "decode step" if by_step["spread"] < point["spread"] else "keys"
        lines.append(
            f"By the rollout's decode step: {by_step['share_below']:.1%} equal before step {by_step['step']}, "
            f"{by_step['share_above']:.1%} from it. The switch is sharper by {sharper} (spread "
            f"{by_step['spread']:.4f} by step, {point['spread']:.4f} by keys): by keys points to an attention tile, "
            "by step to the batch a decode step ran, which shrinks as rows finish."
        )
    if prefix.get("token_mult_prob_error") is not None:
        side = "above" if prefix["alarm"] else "below"
        lines.append(
            f"token_mult_prob_error {prefix['token_mult_prob_error']:.4f} ({side} NeMo-RL's alarm of "
            f"{TOKEN_MULT_PROB_ALARM}), k3_kl {prefix['k3_kl']:.2e}, over {int(prefix['tokens']):,} prefix tokens."
        )
    first = summary.get("first_step") or {}
    for name, what in (("refeed", "a re-fed prefix"), ("replica", "the resumed state replayed")):
        if name in first:
            lines.append(
                f"The first step from {what} equals exact's bitwise at {first[name]['all_equal']:.1%} of "
                f"{first[name]['pivots']:,} pivots."
            )
    for row in summary.get("first_step_by_length", []):
        if row.get("pivots"):
            lines.append(
                f"  prefixes of {row['bin']} tokens: {row['first_step_all_equal']:.1%} of {row['pivots']} pivots"
            )
    if "refeed" in first and first["refeed"]["all_equal"] is not None:
        lines.append(
            "Where the first steps agree, re-feeding and resuming replay the same state: the credit they estimate "
            "differs only as a replica's does. Where they do not, expect the campaign's re-feed rate above its floor."
        )
    return lines


# --------------------------------------------------------------------------------------------- validation
def folder_configs(reference: Path) -> list[str]:
    """The configurations whose credit a committed campaign keeps."""
    folder = Path(reference) / "credit"
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no credit tables (the mechanism is computed from them)")
    return sorted(p.name for p in folder.iterdir() if p.is_dir())


#: what the mechanism reads of a committed campaign's folder (``folder_rows``, ``campaign_side``)
CAMPAIGN_READS = (
    "credit/*/*.parquet",
    "analysis/*/comparison.json",
    "analysis/*/first_steps.parquet",
    "analysis/*/mismatch.parquet",
    "rows/*/*.parquet",
)


def folder_rows(
    reference: Path, config: str | None = None
) -> tuple[str, dict[str, pl.DataFrame], pl.DataFrame | None, pl.DataFrame | None]:
    """A committed campaign's configuration (``config``, or its only one) with the tables the mechanism reads: the
    credit of exact and the draws, each row's first step (kept by the run, or the partial folder's rows) and the
    prefix mismatch, each None where the folder does not keep it."""
    reference = Path(reference)
    require_intact(reference, "the mechanism", reads=CAMPAIGN_READS)
    names = folder_configs(reference)
    if config is None and len(names) != 1:
        raise ValueError(f"{reference / 'credit'}: one configuration expected, found {names}; name one")
    config = config or names[0]
    if config not in names:
        raise ValueError(f"{reference / 'credit'}: no configuration {config!r}; it has {names}")
    analysis = reference / "analysis" / config
    used = replay_draws([p.stem for p in (reference / "credit" / config).glob("*.parquet")])
    credit = {name: read_parquet(reference / "credit" / config / f"{name}.parquet") for name in used}
    if (analysis / "first_steps.parquet").is_file():
        steps = read_parquet(analysis / "first_steps.parquet")
    elif (reference / "rows" / config).is_dir():
        steps = first_steps({p.stem: read_parquet(p) for p in (reference / "rows" / config).glob("*.parquet")})
    else:
        steps = None
    if steps is not None:
        steps = steps.filter(pl.col("pass").is_in(used))
    mismatch = read_parquet(analysis / "mismatch.parquet") if (analysis / "mismatch.parquet").is_file() else None
    return config, credit, steps, mismatch


def folder_mechanism(reference: Path, config: str) -> dict[str, Any]:
    """``mechanism_summary`` of one configuration of a committed campaign, under the analysis settings its
    comparison records."""
    _, credit, steps, mismatch = folder_rows(reference, config)
    parameters = read_json(Path(reference) / "analysis" / config / "comparison.json")["parameters"]
    return mechanism_summary(
        credit,
        steps,
        mismatch,
        metric=parameters["metric"],
        ci=parameters["ci"],
        n_boot=parameters["n_boot"],
        seed=parameters["seed"],
    )


def campaign_side(reference: Path) -> dict[str, Any]:
    """The probe's statistics computed from a committed campaign's own rows, with the campaign's headline rates."""
    config, credit, steps, mismatch = folder_rows(reference)
    stats = regime_stats(
        pivot_agreement(steps) if steps is not None else None,
        token_gaps(mismatch, credit["exact"]) if mismatch is not None else None,
    )
    analysis = Path(reference) / "analysis" / config
    comparison = read_json(analysis / "comparison.json")
    main = comparison["conditionings"]["main"]
    block = main.get("replicated") if isinstance(main.get("replicated"), dict) else None
    if block and block.get("available"):  # pooled over the pairs of draws, with the crossed interval
        rates = {key: block[key]["estimate"] for key in ("refeed", "floor", "excess_pp")}
        crossed = block["excess_pp"]["crossed"]
        rates["excess_ci"] = [crossed.get("ci_lo"), crossed.get("ci_hi")]
    else:  # one pair: its own rates and the problem bootstrap's interval
        flips, excess = main["disagreement"], main["excess_pp"]
        rates = {
            "refeed": flips["exact_vs_refeed"]["estimate"],
            "floor": flips["exact_vs_replica"]["estimate"],
            "excess_pp": excess["estimate"],
            "excess_ci": [excess["ci_lo"], excess["ci_hi"]],
        }
    return {"configuration": config, **stats, "rates": rates}


def validation_rows(pairs: Sequence[tuple[Path, Path]]) -> list[dict[str, Any]]:
    """One row per (probe.json, reference folder): the probe's and the campaign's statistics side by side."""
    rows = []
    for probe_file, reference in pairs:
        probe, campaign = read_json(probe_file), campaign_side(reference)
        rows.append({"probe_file": str(probe_file), "reference": str(reference), "probe": probe, "campaign": campaign})
    return rows


def validation_markdown(rows: Sequence[Mapping[str, Any]]) -> str:
    head = (
        "| reference | side | first step = exact (refeed, pivots) | prefix log-probs = decode | change point "
        "(keys; share below / above) | token_mult_prob_error | re-feed | floor | excess pp [CI] |"
    )
    lines = [head, "|" + "---|" * 9]
    for row in rows:
        for side in ("probe", "campaign"):
            s = row[side]
            first = (s.get("first_step") or {}).get("refeed", {})
            prefix, point = s.get("prefix") or {}, s.get("change_point") or {}
            rates = s.get("rates") or {}
            ci = rates.get("excess_ci") or [None, None]
            excess = (
                "-" if rates.get("excess_pp") is None else f"{rates['excess_pp']:+.1f} [{ci[0]:+.1f}, {ci[1]:+.1f}]"
            )
            change = point_cell(point, "keys")
            tmpe = prefix.get("token_mult_prob_error")
            lines.append(
                f"| `{row['reference']}` | {side} | {percent(first.get('all_equal'))} | "
                f"{percent(prefix.get('equal_share'))} "
                f"| {change} | {'-' if tmpe is None else f'{tmpe:.4f}'} | {percent(rates.get('refeed'))} | "
                f"{percent(rates.get('floor'))} | {excess} |"
            )
    return "\n".join(lines) + "\n"


def write_factors(named: Sequence[tuple[str, Path]], base: str, out: Path) -> int:
    """The factor experiment of probe folders (name, folder) against probe ``base`` into ``out``: factors.json and
    factors.md."""
    check_destination(out, [folder for _, folder in named], "factors", tree=False)
    rows = factor_rows({name: folder_probe(folder) for name, folder in named}, base)
    for row, (_, folder) in zip(rows, named):
        row["folder"] = str(folder)
    write_json(rows, out / "factors.json")
    write_text(factors_markdown(rows), out / "factors.md")
    print(factors_markdown(rows))
    return 0


def write_mechanism(folders: Sequence[Path], out: Path, drawn: Sequence[Path] | None = None) -> int:
    """The mechanism of every configuration of ``folders`` into ``out``: one summary JSON, the table (md, csv) and
    the figure of ``drawn`` (default: all of them; a figure of twenty series is unreadable)."""
    check_destination(out, list(folders), "mechanism", tree=False)
    summaries, sources = {}, {}
    for folder in folders:
        for config in folder_configs(folder):
            label = f"{folder.as_posix()}:{config}"
            summaries[label] = folder_mechanism(folder, config)
            sources[label] = f"{folder.as_posix()}/credit/{config}/"
    write_json(summaries, out / "mechanism.json")
    write_table(summaries, out / "mechanism.csv", out / "mechanism.md", sources, heading="# Re-feed mechanism")
    shown = {Path(f).as_posix() for f in (drawn or folders)}
    plot_mechanism(
        {label: s for label, s in summaries.items() if label.rsplit(":", 1)[0] in shown},
        out / "mechanism.png",
        out / "mechanism.pdf",
    )
    print(markdown(summaries, sources))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m replaynoise.regime", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    show = sub.add_parser("show", help="print a probe's verdict (results/regime/<configuration>/probe.json)")
    show.add_argument("probe", type=Path)
    again = sub.add_parser("recompute", help="write a probe folder's probe.json again from its kept rows")
    again.add_argument("folder", type=Path)
    mech = sub.add_parser("mechanism", help="the mechanism table and figure of committed campaign folders")
    mech.add_argument("folders", nargs="+", type=Path, help="reference folders (every configuration of each)")
    mech.add_argument("--out", type=Path, required=True, help="folder for mechanism.{md,csv,png,pdf,json}")
    mech.add_argument("--figure", type=Path, nargs="+", default=None, help="the folders drawn (default: all)")
    check = sub.add_parser("validate", help="set probes beside the committed campaigns they mirror")
    check.add_argument("pairs", nargs="+", help="PROBE.json=REFERENCE_FOLDER")
    check.add_argument("--out", type=Path, required=True, help="folder for validation.md and validation.json")
    vary = sub.add_parser("factors", help="probes of one campaign that differ in one setting, against a base probe")
    vary.add_argument("probes", nargs="+", help="NAME=PROBE_FOLDER (first_steps.parquet, mismatch.parquet)")
    vary.add_argument("--base", required=True, help="the NAME every other probe is set against")
    vary.add_argument("--out", type=Path, required=True, help="folder for factors.md and factors.json")
    return parser


def _named_folders(items: Sequence[str], base: str) -> list[tuple[str, Path]] | str:
    """NAME=FOLDER arguments as (name, folder), or what is wrong with them."""
    named = []
    for item in items:
        name, sep, folder = item.partition("=")
        if not sep or not name or not (Path(folder) / "first_steps.parquet").is_file():
            return f"{item!r} is not NAME=FOLDER of a probe folder (with first_steps.parquet)"
        named.append((name, Path(folder)))
    names = [name for name, _ in named]
    if len(set(names)) < len(names):
        return f"a probe name is given twice: {', '.join(sorted({n for n in names if names.count(n) > 1}))}"
    if base not in names:
        return f"--base {base!r} names none of the probes ({', '.join(names)})"
    return named


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _command(args)
    except (OSError, ValueError, UnreadableFileError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _command(args: argparse.Namespace) -> int:
    if args.command == "show":
        print("\n".join(verdict(read_json(args.probe))))
        return 0
    if args.command == "recompute":
        write_json(recompute(args.folder), args.folder / "probe.json")
        return 0
    if args.command == "mechanism":
        return write_mechanism(args.folders, args.out, args.figure)
    if args.command == "factors":
        named = _named_folders(args.probes, args.base)
        if isinstance(named, str):
            print(f"factors: {named}", file=sys.stderr)
            return 2
        return write_factors(named, args.base, args.out)
    pairs = []
    for item in args.pairs:
        probe, sep, reference = item.partition("=")
        if not sep or not Path(probe).is_file() or not Path(reference).is_dir():
            print(
                f"validate: {item!r} is not PROBE.json=REFERENCE_FOLDER of an existing file and folder", file=sys.stderr
            )
            return 2
        pairs.append((Path(probe), Path(reference)))
    check_destination(args.out, [r for _, r in pairs], "validate", tree=False)
    rows = validation_rows(pairs)
    write_json(rows, args.out / "validation.json")
    write_text(validation_markdown(rows), args.out / "validation.md")
    print(validation_markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
