"""How big a run must be: from a pilot run with replicated passes, the problems and pairs of draws that resolve a
given excess.

    python -m replaynoise.power results                         # every configuration, excesses of 5, 10, 20 pp
    python -m replaynoise.power reference/gpu-vllm/ladder --config qwen2.5-coder-0.5b-vllm --excess 3 5

A pilot's ``comparison.json`` holds, per conditioning, the crossed model's variance components of the excess
(problems, pass draws, their interaction; ``replicated.components``). Var(excess) at G problems and R pairs is
sigma_u^2/G + sigma_v^2/R + sigma_w^2/(G R) with the pilot's pivots per problem; the power to exclude zero at a true
excess of d is P(|estimate|/SE > t) with the design's Satterthwaite degrees of freedom (``replicated.plan``). A pilot
of one draw per pass has no pass component to plan with, so it is refused: run it with replay.replicates >= 2.

The pass-level SD of a pilot of three pairs is poorly estimated (its F test rarely rejects), so the power at the
pilot's own size is given over its interval: at SD 0, at the estimate and at the upper bound. ``--runs K ...`` with
``--run-sd PP ...`` plans runs too: the power of the interval over problems, pass draws and runs
(``analysis.runs.plan_runs``) for the mean over K runs, at a run-level SD the pilot cannot give (one run has none;
``python -m replaynoise.reference combine`` estimates it from two runs or more, poorly).

``--stop resolved|bounded --max-pairs M`` plans a design that stops when it knows (``analysis.stopping``): per
excess and number of problems, the pairs it is expected to use and its power, beside the fixed design of M pairs.
``python -m replaynoise.power stopping FOLDER ...`` replays the rule over finished runs' pairs (``savings``).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from replaynoise.analysis.replicated import Components, plan
from replaynoise.analysis.runs import plan_runs
from replaynoise.analysis.stopping import StopRule, plan_stop
from replaynoise.io import UnreadableFileError, json_field, read_json
from replaynoise.report.summary import aligned
from replaynoise.savings import main as savings_main
from replaynoise.vouching import require_intact

PROBLEMS = (20, 40, 80, 160, 320)
PAIRS = (2, 3, 5, 8)


def pilot_components(comparison: dict, conditioning: str) -> Components:
    """The crossed components of a pilot configuration's excess (excess units, as ``crossed`` keeps them)."""
    source = str(comparison.get("source", comparison.get("config")))
    conditionings = json_field(comparison, source, "conditionings")
    if not isinstance(conditionings, dict) or conditioning not in conditionings:
        known = sorted(conditionings) if isinstance(conditionings, dict) else []
        raise ValueError(f"{source}: field conditionings has no {conditioning!r} (it has {', '.join(known) or 'none'})")
    json_field(comparison, source, "parameters", "ci")
    block = json_field(conditionings, f"{source}: conditionings", conditioning)
    replicated = block.get("replicated") if isinstance(block, dict) else None
    if not replicated or not replicated.get("available"):
        raise ValueError(
            f"{comparison.get('config')}: {conditioning}: no replicated passes (one draw per pass "
            "cannot estimate the pass-level component); run the pilot with replay.replicates >= 2"
        )
    base = f"{source}: conditionings.{conditioning}.replicated"
    crossed = json_field(replicated, base, "excess_pp", "crossed")
    where = f"{base}.excess_pp.crossed"
    parts = crossed.get("components")
    if not parts:
        raise ValueError(f"{comparison.get('config')}: {conditioning}: {crossed.get('reason', 'no components')}")
    sds = [json_field(parts, f"{where}.components", key) for key in ("problem_sd", "pass_sd", "residual_sd")]
    ms = [json_field(parts, f"{where}.components", "mean_squares", key) for key in ("problems", "pairs", "residual")]
    if not all(isinstance(x, (int, float)) and math.isfinite(x) and x >= 0 for x in [*sds, *ms]):
        raise ValueError(f"{where}.components: an SD or mean square that is not a finite number >= 0: {sds}, {ms}")
    if not any(sds):
        raise ValueError(
            f"{where}.components: every SD is 0 (every pair's excess the same): a pilot that cannot estimate a "
            "variance cannot plan a design; run a larger pilot"
        )
    return Components(
        problem=(sds[0] / 100) ** 2,
        pass_level=(sds[1] / 100) ** 2,
        residual=(sds[2] / 100) ** 2,
        n_problems=json_field(crossed, where, "n_problems"),
        n_pairs=json_field(crossed, where, "n_pairs"),
        mean_squares=(ms[0], ms[1], ms[2]),
    )


def at_pass_sd(comp: Components, sd_pp: float) -> Components:
    """The pilot with its pass-level SD set to ``sd_pp``: its mean squares those the components expect at its own
    design, so that ``plan`` reads the power at the pilot's size for another pass-level SD."""
    pass_level = (sd_pp / 100) ** 2
    ms_e = comp.residual
    expected = (ms_e + comp.n_pairs * comp.problem, ms_e + comp.n_problems * pass_level, ms_e)
    return Components(comp.problem, pass_level, ms_e, comp.n_problems, comp.n_pairs, expected)


def pass_sd_bounds(comparison: dict, conditioning: str) -> tuple[float, float, float | None]:
    """(0 or the interval's lower end, the estimate, the upper bound) of the pilot's pass-level SD, pp."""
    parts = comparison["conditionings"][conditioning]["replicated"]["excess_pp"]["crossed"]["components"]
    return parts.get("pass_sd_ci_lo") or 0.0, parts["pass_sd"], parts.get("pass_sd_ci_hi")


def power_table(
    comparison: dict,
    conditioning: str,
    excess: list[float],
    problems: Sequence[int] = PROBLEMS,
    pairs: Sequence[int] = PAIRS,
    power: float = 0.8,
) -> str:
    """For each excess, the smallest number of problems that resolves it with ``power`` at each number of pairs,
    and the power at the pilot's own size; "resolves" at the pilot's own interval level (``analysis.ci``)."""
    comp = pilot_components(comparison, conditioning)
    ci = comparison["parameters"]["ci"]
    lines = [
        f"{comparison.get('config')}, {conditioning} conditioning: pilot of {comp.n_problems} problems and "
        f"{comp.n_pairs} pairs; SD of a pair's excess from the pass draw {100 * comp.pass_level**0.5:.1f} pp, "
        f"problem SD {100 * comp.problem**0.5:.1f} pp, residual SD {100 * comp.residual**0.5:.1f} pp"
    ]
    cells = [
        [
            "true excess pp",
            *(f"problems for {power:.0%} power, {r} pairs" for r in pairs),
            f"power at the pilot's {comp.n_problems} x {comp.n_pairs}",
            "over its pass-SD interval (low / estimate / high)",
        ]
    ]
    low, _, high = pass_sd_bounds(comparison, conditioning)
    for d in excess:
        rows = plan(comp, d, problems=problems, pairs=pairs, ci=ci, power=power)
        row = [f"{d:+.1f}"]
        for r in pairs:
            enough = [x["problems"] for x in rows if x["pairs"] == r and x["enough"]]
            row.append(str(min(enough)) if enough else f"> {max(problems)}")
        own = plan(comp, d, problems=[comp.n_problems], pairs=[comp.n_pairs], ci=ci, power=power)[0]
        spread = [
            plan(at_pass_sd(comp, sd), d, problems=[comp.n_problems], pairs=[comp.n_pairs], ci=ci)[0]["power"]
            for sd in (low, high)
            if sd is not None
        ]
        over = " / ".join(f"{x:.2f}" for x in [spread[0], own["power"], *spread[1:]])
        cells.append(
            row
            + [
                f"{own['power']:.2f}",
                f"{over} at SD {low:.1f} / {100 * comp.pass_level**0.5:.1f} / "
                + (f"{high:.1f}" if high is not None else "n/a"),
            ]
        )
    return "\n".join(lines + aligned(cells, indent="  ")) + "\n"


def runs_table(
    comparison: dict,
    conditioning: str,
    excess: list[float],
    runs: Sequence[int],
    run_sds: Sequence[float],
    problems: Sequence[int] = PROBLEMS,
) -> str:
    """The power of the mean over K runs (the pilot's pairs per run) to resolve each excess, per run-level SD."""
    comp = pilot_components(comparison, conditioning)
    ci = comparison["parameters"]["ci"]
    cells = [["true excess pp", "run SD pp", "runs", *(f"power at {g} problems" for g in problems)]]
    for d in excess:
        for sd in run_sds:
            rows = plan_runs(comp, d, problems=problems, runs=runs, run_sd_pp=sd, ci=ci)
            for k in runs:
                cells.append([f"{d:+.1f}", f"{sd:.1f}", str(k), *(f"{x['power']:.2f}" for x in rows if x["runs"] == k)])
    head = f"{comparison.get('config')}, {conditioning} conditioning: runs of {comp.n_pairs} pairs each"
    return "\n".join([head, *aligned(cells, indent="  ")]) + "\n"


def stop_table(comparison: dict, conditioning: str, excess: list[float], rule: StopRule) -> str:
    """Per excess and number of problems, the pairs the rule is expected to use and its power, beside the fixed
    design of max_pairs pairs (``stopping.plan_stop``, with the pilot's components)."""
    comp = pilot_components(comparison, conditioning)
    ci = comparison["parameters"]["ci"]
    cells = [["true excess pp", "problems", "expected pairs", "power", f"fixed {rule.max_pairs} pairs' power"]]
    for d in excess:
        for row in plan_stop(comp, d, rule, problems=PROBLEMS, ci=ci):
            cells.append(
                [f"{d:+.1f}", str(row["problems"]), f"{row['expected_pairs']:.2f}", f"{row['power']:.2f}"]
                + [f"{row['fixed_power']:.2f}"]
            )
    head = (
        f"{comparison.get('config')}, {conditioning} conditioning: stop when {rule.when}"
        + (f" (half-width {rule.half_width_pp:g} pp)" if rule.when == "bounded" else "")
        + f", pairs {rule.min_pairs} to {rule.max_pairs}"
    )
    return "\n".join([head, *aligned(cells, indent="  ")]) + "\n"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m replaynoise.power", description=__doc__.split("\n")[0])
    ap.add_argument("folder", type=Path, help="a results folder or a reference folder (analysis/<config>/...)")
    ap.add_argument("--config", action="append", help="configuration(s) (default: every one with replicates)")
    ap.add_argument("--conditioning", default="main")
    ap.add_argument("--excess", type=float, nargs="+", default=[5.0, 10.0, 20.0], help="true excesses, pp")
    ap.add_argument("--runs", type=int, nargs="+", help="plan the mean over this many runs (each >= 2)")
    ap.add_argument("--run-sd", type=float, nargs="+", default=[0.0, 2.8, 5.4, 9.7], help="run-level SDs, pp")
    ap.add_argument("--stop", choices=("resolved", "bounded"), help="plan a design that stops when it knows")
    ap.add_argument("--max-pairs", type=int, default=5, help="with --stop: the most pairs")
    ap.add_argument("--min-pairs", type=int, default=2, help="with --stop: the first look's pairs")
    ap.add_argument("--half-width", type=float, default=3.0, help="with --stop bounded: the half-width, pp")
    return ap


def _arguments_refused(args: argparse.Namespace) -> str | None:
    """Why the numbers given cannot be planned with, or None."""
    bad = [x for x in [*args.excess, *args.run_sd] if not math.isfinite(x)]
    if bad or any(k < 2 for k in args.runs or []):
        return f"--excess and --run-sd take finite numbers, --runs numbers >= 2 (given {bad or args.runs})"
    if args.stop:
        try:
            StopRule(args.stop, args.max_pairs, args.min_pairs, args.half_width)
        except ValueError as exc:
            return str(exc)
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["stopping"]:
        return savings_main(argv[1:])
    args = _parser().parse_args(argv)
    refused = _arguments_refused(args)
    if refused:
        print(f"error: {refused}", file=sys.stderr)
        return 2
    rule = StopRule(args.stop, args.max_pairs, args.min_pairs, args.half_width) if args.stop else None
    found = sorted(p for p in (args.folder / "analysis").glob("*/comparison.json") if p.parent.name != "pooled")
    if args.config:
        found = [p for p in found if p.parent.name in args.config]
    if not found:
        print(f"error: no analysis/<config>/comparison.json under {args.folder}", file=sys.stderr)
        return 2
    try:
        require_intact(args.folder, "power", reads=["analysis/*/comparison.json"])
    except (OSError, ValueError, UnreadableFileError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0 if _print_plans(found, args, rule) else 2


def _print_plans(found: list[Path], args: argparse.Namespace, rule: StopRule | None) -> int:
    """Each pilot's tables, a pilot that cannot plan skipped with why; the number printed."""
    printed = 0
    for path in found:
        try:
            comparison = read_json(path)
            if not isinstance(comparison, dict):
                raise ValueError(f"{path}: not a JSON object")
            comparison["source"] = path.as_posix()
            print(power_table(comparison, args.conditioning, args.excess))
            if args.runs:
                print(runs_table(comparison, args.conditioning, args.excess, args.runs, args.run_sd))
            if rule is not None:
                print(stop_table(comparison, args.conditioning, args.excess, rule))
            printed += 1
        except (OSError, ValueError, UnreadableFileError) as exc:
            print(f"skipped: {exc}", file=sys.stderr)
    return printed


if __name__ == "__main__":
    sys.exit(main())
