"""How big a run must be: from a pilot run with replicated passes, the problems and pairs of draws that resolve a
given excess.

    python -m replaynoise.power results                         # every configuration, excesses of 5, 10, 20 pp
    python -m replaynoise.power reference/gpu-vllm/ladder --config qwen2.5-coder-0.5b-vllm --excess 3 5

A pilot's ``comparison.json`` holds, per conditioning, the crossed model's variance components of the excess
(problems, pass draws, their interaction; ``replicated.components``). Var(excess) at G problems and R pairs is
sigma_u^2/G + sigma_v^2/R + sigma_w^2/(G R) with the pilot's pivots per problem; the power to exclude zero at a true
excess of d is P(|estimate|/SE > t) with the design's Satterthwaite degrees of freedom (``replicated.plan``). A pilot
of one draw per pass has no pass component to plan with, so it is refused: run it with replay.replicates >= 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from replaynoise.analysis.replicated import Components, plan
from replaynoise.io import read_json
from replaynoise.report.summary import aligned

PROBLEMS = (20, 40, 80, 160, 320)
PAIRS = (2, 3, 5, 8)


def pilot_components(comparison: dict, conditioning: str) -> Components:
    """The crossed components of a pilot configuration's excess (excess units, as ``crossed`` keeps them)."""
    block = comparison["conditionings"][conditioning]
    replicated = block.get("replicated")
    if not replicated or not replicated.get("available"):
        raise ValueError(
            f"{comparison.get('config')}: {conditioning}: no replicated passes (one draw per pass "
            "cannot estimate the pass-level component); run the pilot with replay.replicates >= 2"
        )
    crossed = replicated["excess_pp"]["crossed"]
    parts = crossed.get("components")
    if not parts:
        raise ValueError(f"{comparison.get('config')}: {conditioning}: {crossed.get('reason', 'no components')}")
    ms = parts["mean_squares"]
    return Components(
        problem=(parts["problem_sd"] / 100) ** 2,
        pass_level=(parts["pass_sd"] / 100) ** 2,
        residual=(parts["residual_sd"] / 100) ** 2,
        n_problems=crossed["n_problems"],
        n_pairs=crossed["n_pairs"],
        mean_squares=(ms["problems"], ms["pairs"], ms["residual"]),
    )


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
        ]
    ]
    for d in excess:
        rows = plan(comp, d, problems=problems, pairs=pairs, ci=ci, power=power)
        row = [f"{d:+.1f}"]
        for r in pairs:
            enough = [x["problems"] for x in rows if x["pairs"] == r and x["enough"]]
            row.append(str(min(enough)) if enough else f"> {max(problems)}")
        own = plan(comp, d, problems=[comp.n_problems], pairs=[comp.n_pairs], ci=ci, power=power)[0]
        cells.append(row + [f"{own['power']:.2f}"])
    return "\n".join(lines + aligned(cells, indent="  ")) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m replaynoise.power", description=__doc__.split("\n")[0])
    ap.add_argument("folder", type=Path, help="a results folder or a reference folder (analysis/<config>/...)")
    ap.add_argument("--config", action="append", help="configuration(s) (default: every one with replicates)")
    ap.add_argument("--conditioning", default="main")
    ap.add_argument("--excess", type=float, nargs="+", default=[5.0, 10.0, 20.0], help="true excesses, pp")
    args = ap.parse_args(argv)
    found = sorted(p for p in (args.folder / "analysis").glob("*/comparison.json") if p.parent.name != "pooled")
    if args.config:
        found = [p for p in found if p.parent.name in args.config]
    if not found:
        print(f"error: no analysis/<config>/comparison.json under {args.folder}", file=sys.stderr)
        return 2
    printed = 0
    for path in found:
        try:
            print(power_table(read_json(path), args.conditioning, args.excess))
            printed += 1
        except ValueError as exc:
            print(f"skipped: {exc}", file=sys.stderr)
    return 0 if printed else 2


if __name__ == "__main__":
    sys.exit(main())
